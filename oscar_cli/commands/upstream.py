"""oscar upstream export|import: bundles to and from the method authors' rotation files (SGLang, RotationZoo)."""

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from oscar_cli import options
from oscar_cli.ui import console
from oscar_core.errors import OscarError, UsageError
from oscar_core.evaluate.verify import VerifyRequest
from oscar_core.formats.bundle import schema_errors
from oscar_core.publish import upstream as core
from oscar_core.publish.served import SEQ_LEN, measure_served, summary

HELP = "Bundles to and from the method authors' format: <Model>/seq<T>_prompt<N>_group<G>/{k,v}_rotation_*.pt (SGLang)."
EXAMPLES = """
Examples:

  oscar upstream export zoo/HuggingFaceTB/SmolLM2-135M-Instruct/v1 --calibration runs/smollm2 --out rotationzoo

  oscar upstream export zoo/Qwen/Qwen3-8B/v1 --clips upstream --out rotationzoo --device cuda --seq-len 32768   # bundle exported with --eigenvalues

  oscar upstream export zoo/Qwen/Qwen3-8B/v1 --calibration runs/qwen3-8b --per-head --out rotationzoo   # per KV head: format version 2

  oscar upstream import rotationzoo/Qwen3-8B/seq20000_prompt83_group128 --model Qwen/Qwen3-8B --out imported

  oscar verify zoo/HuggingFaceTB/SmolLM2-135M-Instruct/v1 --compare imported/HuggingFaceTB/SmolLM2-135M-Instruct/upstream-seq4096_prompt8_group64
"""

app = typer.Typer(help=HELP, no_args_is_help=True, epilog=EXAMPLES)


@app.command("export", epilog=EXAMPLES)
def export(
    bundle: Annotated[Path, typer.Argument(help="Bundle directory (U_Q·H·P_br / U_S·H·P_br rotations).")],
    out: Annotated[Path, typer.Option("--out", help="Root; the files go to <out>/<Model>/seq<T>_prompt<N>_group<G>/.")] = ...,
    calibration: Annotated[Optional[Path], typer.Option(help="The calibration directory the bundle was exported from: per-layer rotations and eigenvalues (unless the bundle carries its eigenvalues), clip search, per-channel key layers.")] = None,
    group_size: Annotated[int, typer.Option(help="INT2 group size the runtime will use (capped at head_dim).", callback=options.POSITIVE)] = core.UPSTREAM_GROUP,
    clips: Annotated[str, typer.Option(help="searched: one ratio per side on the calibration probe, keys uncentred; upstream: 0.96 / 0.92.")] = "searched",
    key_clip: Annotated[Optional[float], typer.Option(help="Key clip ratio to serve with (overrides --clips).", callback=options.FRACTION)] = None,
    value_clip: Annotated[Optional[float], typer.Option(help="Value clip ratio to serve with (overrides --clips).", callback=options.FRACTION)] = None,
    per_head: Annotated[bool, typer.Option("--per-head", help="The bundle's rotations, one per KV head (format version 2): only an SGLang loader that takes (num_kv_heads, d, d) rotations reads them. Default: one per layer, which every known loader reads.")] = False,
    per_layer: Annotated[bool, typer.Option("--per-layer", hidden=True, help="The default (kept for old scripts).")] = False,
    model: Annotated[Optional[str], typer.Option(help="Model to measure the served variant on; default: the one the manifest names.")] = None,
    seq_len: Annotated[Optional[int], typer.Option(callback=options.SEQUENCE, help=f"Held-out tokens the served variant is measured at; default {SEQ_LEN}, capped by the model's context.")] = None,
    device: Annotated[Optional[str], typer.Option(help="cpu or cuda; default: cuda when available.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Write the files even when the served variant fails verify's gate (loses to KIVI-style INT2).")] = False,
) -> None:
    """Write a bundle as the two upstream rotation files, with serve.sh and what was dropped (oscar_upstream.json),
    after measuring what the runtime would serve (verify's figures, beside the bundle's): refused, unless --force,
    when that loses to KIVI-style INT2."""
    if per_head and per_layer:
        raise UsageError("--per-head and --per-layer exclude each other (per layer is the default)")
    with console.status("deriving the served variant") as status:
        plan = core.plan_export(bundle, out, calibration, group_size, clips, key_clip, value_clip, per_head)
        report = measure_served(plan, VerifyRequest(bundle=bundle, model=model, seq_len=seq_len, device=device),
                                on_step=status.update)
    served = summary(report, forced=force and not report["passed"])
    _print_plan(plan)
    _print_costs(served, report)
    if not report["passed"] and not force:
        raise OscarError(f"the served variant fails verify's gate at {served['seq_len']} tokens ({report['reason']}): "
                         "nothing written; --force writes it anyway")
    path = core.write_export(core.with_served(plan, served))
    forced = " [yellow](forced past verify's gate)[/]" if served["forced"] else ""
    console.print(f"[green]exported[/] {path}{forced}")
    console.print("serve with the authors' SGLang tree (also in serve.sh):")
    console.print(core.shell_lines(plan.env, plan.command), markup=False, highlight=False, soft_wrap=True, end="")
    r = plan.record
    console.print(f"check what it serves: oscar upstream import {path} --out imported && oscar verify {bundle} "
                  f"--compare imported/{r['source']['bundle']}/upstream-{path.name}", highlight=False, soft_wrap=True)


def _print_plan(plan: core.ExportPlan) -> None:
    r = plan.record
    table = Table(title=f"{r['source']['bundle']} {r['source']['version']} → upstream layout")
    table.add_column("what")
    table.add_column("value")
    for name, data in plan.files.items():
        detail = f"{len(data):,} bytes, sha256 {core.sha256_bytes(data)[:16]}…"
        if name in core.FILES.values():
            side = "key" if name == core.FILES["key"] else "value"
            detail = (f"{core.OBJECTIVES[side]}, per {r['grouping']} (format version {r['format_version']}), "
                      f"{len(r['layers'])} layers; " + detail)
        table.add_row(name, detail)
    table.add_row("group size", f"{r['group_size']['served']} (asked {r['group_size']['requested']})")
    table.add_row("clips", f"keys {r['clips']['key']:g}, values {r['clips']['value']:g} ({r['clips']['how']})")
    table.add_row("eigenvalues", f"from the {r['eigenvalues']}")
    for note in plan.notes:
        table.add_row("[yellow]not carried[/]", note)
    console.print(table)


COSTS = (("attention error", "attention_error", "kivi_attention_error"), ("key logit error", "logit_error", None),
         ("value output error", "output_error", None), ("next-token KL", "kl", "kivi_kl"),
         ("top-1 agreement", "top1_agreement", None), ("perplexity", "ppl", "kivi_ppl"))


def _print_costs(served: dict, report: dict) -> None:
    """verify's figures for the served variant beside the bundle's and KIVI-style INT2's."""
    table = Table(title=f"what the served variant costs: verify, {served['seq_len']} held-out tokens, "
                        f"{served['device']}")
    for name in ("", "the bundle", "served by SGLang", "KIVI-style INT2"):
        table.add_column(name, justify="right" if name else "left")
    cell = lambda figures, key: "" if key is None or key not in figures else (  # noqa: E731
        f"{figures[key]:.1%}" if key == "top1_agreement" else f"{figures[key]:.4f}")
    for name, ours, kivi in COSTS:
        table.add_row(name, cell(served["bundle"], ours), cell(served["served"], ours), cell(served["served"], kivi))
    console.print(table)
    verdict = "[green]passes[/]" if served["passed"] else "[red]fails[/]"
    console.print(f"the served variant {verdict} verify's gate (BF16 perplexity "
                  f"{served['served'].get('bf16_ppl', float('nan')):.4f})")
    for note in report["notes"]:
        console.print(f"note: {note}")


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
    from oscar_core.calibrate.models import load_model
    from oscar_core.evaluate.verify import resolve_model_spec
    from oscar_core.layers import layer_specs

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
