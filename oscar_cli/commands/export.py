"""oscar export: derive rotations and clip thresholds, write a versioned bundle."""

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from oscar_cli import options
from oscar_cli.ui import console, progress
from oscar_core.calibrate.derive import DeriveOptions, key_formats
from oscar_core.calibrate.export import default_workers, export_bundle

EXAMPLES = """
Examples:

  oscar export runs/smollm2 --out zoo                       # zoo/HuggingFaceTB/SmolLM2-135M-Instruct/v1/

  oscar export runs/qwen3-8b --version v2 --out /data/rotationzoo

  oscar export runs/smollm2 --key-rotation hadamard --no-key-centering --out /tmp/ablation   # a baseline bundle

  oscar export runs/smollm2 --key-axis token --out /tmp/published    # every layer's keys per token (the published format)
"""


def export(
    calib_dir: Annotated[Path, typer.Argument(help="Directory written by oscar calibrate.")],
    out: Annotated[Path, typer.Option("--out", help="Zoo root; the bundle goes to <out>/<org>/<model>/<version>/.")] = ...,
    version: Annotated[str, typer.Option(help="Bundle version.", callback=options.bundle_version)] = "v1",
    name: Annotated[Optional[str], typer.Option(help="ORG/MODEL; default: from the model id.", callback=options.bundle_name)] = None,
    key_rotation: Annotated[str, typer.Option(help="none, hadamard, eigen, eigen-hadamard, oscar (U_Q·H·P_br), eigen-perm-blockhadamard.")] = "oscar",
    value_rotation: Annotated[str, typer.Option(help="Same choices, with U = eigenbasis of C_S.")] = "oscar",
    key_centering: Annotated[bool, typer.Option(help="Subtract the calibrated key mean (attention-invariant).")] = True,
    value_centering: Annotated[bool, typer.Option(help="Subtract the value mean (added back to the output).")] = False,
    group_size: Annotated[int, typer.Option(callback=options.POSITIVE, help="INT2 group size for keys and values (capped at head_dim).")] = 64,
    key_clip_objective: Annotated[str, typer.Option(help="Key clip search objective: logit (Σ e C_Q eᵀ), output, kl or weighted-logit (attention-aware, on the probe).")] = DeriveOptions.key_clip_objective,
    key_clip_floor: Annotated[float, typer.Option(callback=options.FRACTION, help="Smallest key clip ratio the search may pick.")] = DeriveOptions.key_clip_floor,
    key_axis: Annotated[str, typer.Option(help="auto: per layer, keys per token (in the key rotation) or per channel (unrotated or in U_Q), whichever the probe's attention-output error prefers; token or channel: that axis in every layer.")] = "auto",
    eigenvalues: Annotated[bool, typer.Option(help="Also store the eigenvalues of C_Q and C_S (what `oscar upstream export` needs without the calibration directory).")] = False,
    workers: Annotated[Optional[int], typer.Option(callback=options.POSITIVE, help="Processes deriving layers at once (each single-threaded: the bytes do not depend on it); default: one per CPU core.")] = None,
) -> None:
    """Compute R_K = U_Q·H·P_br, R_V = U_S·H·P_br and calibrated clip thresholds; write a rotation bundle."""
    opts = DeriveOptions(key_rotation=key_rotation, value_rotation=value_rotation, key_centering=key_centering,
                         value_centering=value_centering, key_group_size=group_size, value_group_size=group_size,
                         key_clip_objective=key_clip_objective, key_clip_floor=key_clip_floor,
                         key_formats=key_formats(key_axis, key_rotation))
    with progress() as bar:
        task = bar.add_task("deriving rotations", total=None, rate="layers")
        path, manifest = export_bundle(calib_dir, out, version=version, name=name, opts=opts,
                                       workers=workers or default_workers(), with_eigenvalues=eigenvalues,
                                       on_layer=lambda done, total: bar.update(task, completed=done, total=total))
    q = manifest.quant
    table = Table(title=f"{manifest.name} {manifest.version}")
    table.add_column("what")
    table.add_column("value")
    table.add_row("keys", f"{manifest.rotation.key}{' (centred)' if manifest.rotation.key_centering else ''}, "
                          f"group {q.key_group_size}, mean clip {q.key_clip:.3f}")
    table.add_row("values", f"{manifest.rotation.value}{' (centred)' if manifest.rotation.value_centering else ''}, "
                            f"group {q.value_group_size}, mean clip {q.value_clip:.3f}")
    if q.layers:
        formats: dict[str, list[int]] = {}
        for entry in q.layers:
            formats.setdefault(entry.key_format, []).append(entry.layer)
        table.add_row("key format per layer", "; ".join(f"{name}: {len(ids)} layer(s) ({', '.join(map(str, ids))})"
                                                        for name, ids in sorted(formats.items())))
    if manifest.rotation.layers is not None:
        table.add_row("layers", f"{', '.join(map(str, manifest.rotation.layers))} of {manifest.model.num_layers} "
                                "(the attention layers of a hybrid model)")
    for context, bits in q.bits_per_element.items():
        table.add_row(f"bits/element @ {int(context) // 1024}K", f"{bits:.3f}")
    table.add_row("sha256", manifest.tensors.sha256[:16] + "…")
    console.print(table)
    console.print(f"[green]exported[/] {path}")


def register(app: typer.Typer) -> None:
    app.command("export", epilog=EXAMPLES)(export)
