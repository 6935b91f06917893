"""oscar upstream export|import: bundles to and from the method authors' rotation files (SGLang, RotationZoo)."""

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from oscar_cli import options
from oscar_cli.ui import console
from oscar_core import upstream as core
from oscar_core.bundle import schema_errors
from oscar_core.errors import OscarError

HELP = "Bundles to and from the method authors' format: <Model>/seq<T>_prompt<N>_group<G>/{k,v}_rotation_*.pt (SGLang)."
EXAMPLES = """
Examples:

  oscar upstream export zoo/HuggingFaceTB/SmolLM2-135M-Instruct/v1 --calibration runs/smollm2 --out rotationzoo

  oscar upstream export zoo/Qwen/Qwen3-8B/v1 --clips upstream --out rotationzoo     # bundle exported with --eigenvalues

  oscar upstream import rotationzoo/Qwen3-8B/seq20000_prompt83_group128 --model Qwen/Qwen3-8B --out imported

  oscar verify zoo/HuggingFaceTB/SmolLM2-135M-Instruct/v1 --compare imported/HuggingFaceTB/SmolLM2-135M-Instruct/upstream-seq4096_prompt8_group64
"""

app = typer.Typer(help=HELP, no_args_is_help=True, epilog=EXAMPLES)


@app.command("export", epilog=EXAMPLES)
def export(
    bundle: Annotated[Path, typer.Argument(help="Bundle directory (U_Q·H·P_br / U_S·H·P_br rotations).")],
    out: Annotated[Path, typer.Option("--out", help="Root; the files go to <out>/<Model>/seq<T>_prompt<N>_group<G>/.")] = ...,
    calibration: Annotated[Optional[Path], typer.Option(help="The calibration directory the bundle was exported from: eigenvalues, clip search, --per-layer.")] = None,
    group_size: Annotated[int, typer.Option(help="INT2 group size the runtime will use (capped at head_dim).", callback=options.POSITIVE)] = core.UPSTREAM_GROUP,
    clips: Annotated[str, typer.Option(help="searched: one ratio per side on the calibration probe, keys uncentred; upstream: 0.96 / 0.92.")] = "searched",
    key_clip: Annotated[Optional[float], typer.Option(help="Key clip ratio to serve with (overrides --clips).", callback=options.FRACTION)] = None,
    value_clip: Annotated[Optional[float], typer.Option(help="Value clip ratio to serve with (overrides --clips).", callback=options.FRACTION)] = None,
    per_layer: Annotated[bool, typer.Option("--per-layer", help="One rotation per layer (C_Q, C_S averaged over KV heads), as their default files.")] = False,
) -> None:
    """Write a bundle as the two upstream rotation files, with serve.sh and what was dropped (oscar_upstream.json)."""
    with console.status("deriving the served variant"):
        plan = core.plan_export(bundle, out, calibration, group_size, clips, key_clip, value_clip, per_layer)
        path = core.write_export(plan)
    r = plan.record
    table = Table(title=f"{r['source']['bundle']} {r['source']['version']} → upstream layout")
    table.add_column("what")
    table.add_column("value")
    for name, data in plan.files.items():
        detail = f"{len(data):,} bytes, sha256 {core.sha256_bytes(data)[:16]}…"
        if name in core.FILES.values():
            side = "key" if name == core.FILES["key"] else "value"
            detail = f"{core.OBJECTIVES[side]}, per {r['grouping']}, {len(r['layers'])} layers; " + detail
        table.add_row(name, detail)
    table.add_row("group size", f"{r['group_size']['served']} (asked {r['group_size']['requested']})")
    table.add_row("clips", f"keys {r['clips']['key']:g}, values {r['clips']['value']:g} ({r['clips']['how']})")
    table.add_row("eigenvalues", f"from the {r['eigenvalues']}")
    for note in plan.notes:
        table.add_row("[yellow]not carried[/]", note)
    console.print(table)
    console.print(f"[green]exported[/] {path}")
    console.print("serve with the authors' SGLang tree (also in serve.sh):")
    console.print(core.shell_lines(plan.env, plan.command), markup=False, highlight=False, soft_wrap=True, end="")
    console.print(f"check what it serves: oscar upstream import {path} --out imported && oscar verify {bundle} "
                  f"--compare imported/{r['source']['bundle']}/upstream-{path.name}", highlight=False, soft_wrap=True)


@app.command("import", epilog=EXAMPLES)
def import_(
    directory: Annotated[Path, typer.Argument(help="A seq<T>_prompt<N>_group<G> directory with the two .pt files.")],
    out: Annotated[Path, typer.Option("--out", help="Zoo root; the bundle goes to <out>/<org>/<model>/<version>/.")] = ...,
    model: Annotated[Optional[str], typer.Option(help="The model the rotations are for (hub id, directory, .gguf); default: the one an oscar export recorded.")] = None,
    key_clip: Annotated[Optional[float], typer.Option(help="Key clip ratio it is served with; default: recorded by oscar export, else 0.96.", callback=options.FRACTION)] = None,
    value_clip: Annotated[Optional[float], typer.Option(help="Value clip ratio; default: recorded, else 0.92.", callback=options.FRACTION)] = None,
    group_size: Annotated[Optional[int], typer.Option(help="INT2 group size; default: from the directory name.", callback=options.POSITIVE)] = None,
    name: Annotated[Optional[str], typer.Option(help="ORG/MODEL; default: from the model id.", callback=options.bundle_name)] = None,
    version: Annotated[Optional[str], typer.Option(help="Bundle version; default: upstream-<directory name>.", callback=options.bundle_version)] = None,
) -> None:
    """Validate upstream rotation files against the model and write them as a bundle that verify and eval read."""
    from oscar_core.layers import layer_specs
    from oscar_core.models import load_model
    from oscar_core.verify import resolve_model_spec

    if not directory.is_dir():
        raise OscarError(f"upstream rotation directory not found: {directory}")
    record = core.read_record(directory)
    if model is None:
        if record is None:
            raise OscarError(f"{directory} does not say which model it is for: pass --model")
        with schema_errors(f"{directory / core.RECORD_FILE}: model"):
            model = resolve_model_spec(None, core.ModelInfo.model_validate(record.get("model")))
    with console.status(f"loading {model} for its attention facts"):
        loaded = load_model(model, "cpu")
    path, manifest, files = core.import_upstream(directory, out, loaded.info, None, key_clip, value_clip, group_size,
                                                 name, version, layer_specs(loaded.model.config))
    m, s = manifest.model, manifest.source
    table = Table(title=f"{directory} → {manifest.name} {manifest.version}")
    table.add_column("check / field")
    table.add_column("value")
    for side, f in files.items():
        worst = max(core.orthogonality_error(r) for r in f.rotations.values())
        eig = sum(e is not None for e in f.eigenvalues.values())
        table.add_row(core.FILES[side], f"{f.objective}, per {f.grouping}, {len(f.rotations)} layers, "
                                        f"max |RᵀR − I| {worst:.1e}, eigenvalues for {eig}, sha256 {f.sha256[:12]}…")
    table.add_row("model", f"{m.id}: {m.num_layers} layers, {m.num_kv_heads} KV heads, head_dim {m.head_dim}")
    table.add_row("group size", f"{manifest.quant.key_group_size}")
    table.add_row("clips", f"keys {manifest.quant.key_clip:g}, values {manifest.quant.value_clip:g} ({s.clips})")
    for note in s.notes:
        table.add_row("[yellow]not carried[/]", note)
    console.print(table)
    console.print(f"[green]imported[/] {path}")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="upstream")
