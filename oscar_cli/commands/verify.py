"""oscar verify: check a bundle, measure what its INT2 cache does to attention and to the model, and gate it."""

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from oscar_cli.options import COUNT, POSITIVE, SEQUENCE, THRESHOLD
from oscar_cli.ui import console, err_console
from oscar_core.calibrate.data import DEFAULT_HELDOUT
from oscar_core.evaluate.verify import (DEFAULT_NEEDLES, DEFAULT_SEQ_LEN, VERIFY_FILE, VerifyRequest,
                                        layer_ranking, record as record_of, run_verify)
from oscar_core.formats.fileio import atomic_write_json

EXAMPLES = f"""
Examples:

  oscar verify zoo/HuggingFaceTB/SmolLM2-135M-Instruct/v1            # default model, held-out IDLE docs, {DEFAULT_SEQ_LEN['cpu']} tokens on the CPU

  oscar verify zoo/Qwen/Qwen3-8B/v1 --device cuda --json report.json  # {DEFAULT_SEQ_LEN['cuda']} tokens, Triton kernels on the GPU

  oscar verify bundle/rotations.safetensors --model ./my-model --data notes.txt --max-kl 0.05
"""
GATE = (f"FAIL (exit 1) when OSCAR's next-token KL, perplexity, NLL excess in any position bucket or needle retrieval "
        "is worse than KIVI-style INT2's, its KL is above --max-kl (or the manifest's max_kl), or --seq-len leaves "
        "too few tokens past the sink and recent BF16 windows to judge")
SIDES = ("attention", "key", "value")
NAMES = {"oscar": "OSCAR", "compare": "other", "kivi": "KIVI", "hadamard": "Hadamard", "int2": "none"}


def verify(
    bundle: Annotated[Path, typer.Argument(help="Bundle directory or its rotations.safetensors.")],
    model: Annotated[Optional[str], typer.Option(help="Model to check against; default: the one the manifest names.")] = None,
    data: Annotated[str, typer.Option(help="Held-out text source (hub dataset, file or folder); default: IDLE's docs, shipped with oscar.")] = DEFAULT_HELDOUT,
    samples: Annotated[int, typer.Option(help="Held-out samples.", callback=POSITIVE)] = 1,
    seq_len: Annotated[Optional[int], typer.Option(callback=SEQUENCE, help=f"Tokens per held-out sample, the length the gate judges; default: {DEFAULT_SEQ_LEN['cuda']} on CUDA (a served length), {DEFAULT_SEQ_LEN['cpu']} on the CPU, capped by the model's context.")] = None,
    needles: Annotated[Optional[int], typer.Option(callback=COUNT, help=f"Needle prompts at --seq-len (0: none); default: {DEFAULT_NEEDLES['cuda']} on CUDA, {DEFAULT_NEEDLES['cpu']} on the CPU.")] = None,
    seed: Annotated[int, typer.Option(help="Seed for drawing the samples.")] = 0,
    device: Annotated[Optional[str], typer.Option(help="cpu or cuda; default: cuda when available.")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="Model dtype; default: float32 on CPU, bfloat16 on CUDA.")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the full report here.")] = None,
    max_kl: Annotated[Optional[float], typer.Option(callback=THRESHOLD, help="Also fail when OSCAR's next-token KL against BF16 passes this (nats); default: the manifest's max_kl, else no absolute bound (the gate compares with KIVI-style).")] = None,
    max_logit_error: Annotated[Optional[float], typer.Option(callback=THRESHOLD, help="Also fail when OSCAR's mean key logit error passes this (not checked unless given).")] = None,
    checks_only: Annotated[bool, typer.Option(help="Only check the bundle (no model run).")] = False,
    record: Annotated[bool, typer.Option(help="Write the headline figures to verify.json beside the bundle (zoo list and model cards show them).")] = False,
    compare: Annotated[Optional[Path], typer.Option(help="A second bundle for the same model (e.g. from `oscar upstream import`), measured beside this one.")] = None,
) -> None:
    """Check a bundle (schema, checksum, shapes, orthogonality, clips, model match), then measure its INT2 cache
    against KIVI-style, Hadamard and unrotated INT2 at the length it is served: per layer the attention-output error
    (and key logit / value errors), end to end next-token KL, top-1 agreement, perplexity and the NLL excess over
    BF16 by position bucket, and needle retrieval.

    FAIL (exit 1) when OSCAR is worse than KIVI-style INT2 on KL, perplexity, any position bucket's NLL excess or
    needles, its KL is above --max-kl (or the manifest's max_kl), or the length leaves too
    few INT2 tokens to judge."""
    req = VerifyRequest(bundle=bundle, model=model, data=data, samples=samples, seq_len=seq_len, seed=seed,
                        device=device, dtype=dtype, compare=compare, checks_only=checks_only, max_kl=max_kl,
                        max_logit_error=max_logit_error, needles=needles)
    with console.status("verifying") as status:
        report = run_verify(req, on_step=lambda s: status.update(s))
    _print_checks(report["checks"])
    if checks_only:
        return
    for note in report["notes"]:
        console.print(f"note: {note}")
    _print_report(report)
    if json_out:
        atomic_write_json(json_out, report)
        console.print(f"report → {json_out}")
    if record:
        atomic_write_json(Path(report["bundle"]) / VERIFY_FILE, record_of(report))
        console.print(f"figures → {Path(report['bundle']) / VERIFY_FILE}")
    if not report["passed"]:
        err_console.print(f"[bold red]error:[/] {report['reason']}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def _print_checks(checks: list[dict]) -> None:
    for c in checks:
        console.print(f"[{'green' if c['ok'] else 'red'}]{'✓' if c['ok'] else '✗'}[/] {c['name']}: {c['detail']}")


def _print_report(report: dict) -> None:
    _print_layers(report)
    _print_end_to_end(report)
    _print_buckets(report)
    needle = report.get("needle")
    if needle:
        console.print(f"needle retrieval at {report['seq_len']} tokens, {needle['prompts']} prompts: "
                      + ", ".join(f"{NAMES.get(m, m.upper())} {c}/{needle['prompts']}"
                                  for m, c in needle["correct"].items()))
    verdict = "[green]PASS[/]" if report["passed"] else "[red]FAIL[/]"
    e2e = report["end_to_end"]
    figures = f"OSCAR next-token KL {e2e['kl']:.4f} nats"
    if "kivi_kl" in e2e:
        bound = f", bound {report['max_kl']}" if report.get("max_kl") is not None else ""
        figures += (f" (KIVI-style {e2e['kivi_kl']:.4f}{bound}), perplexity {e2e['ppl']:.3f} "
                    f"(KIVI-style {e2e['kivi_ppl']:.3f})")
    extra = report.get("max_logit_error")
    console.print(f"{verdict} {figures}")
    console.print(f"[dim]gate: {GATE}" + (f", or its mean logit error is above {extra}" if extra else "") + "[/]")


def _print_layers(report: dict) -> None:
    other = report.get("compare")
    rows_all, mm = [dict(r) for r in report["layers"]], dict(report["mean"])
    if other:  # the compared bundle's OSCAR figures as columns of this table
        for row, theirs in zip(rows_all, other["layers"]):
            row.update({f"compare_{s}": theirs[f"oscar_{s}"] for s in SIDES if f"oscar_{s}" in theirs})
        mm.update({f"compare_{s}": other["mean"][f"oscar_{s}"] for s in SIDES if f"oscar_{s}" in other["mean"]})
    per_layer: dict[int, list[dict]] = {}
    for row in rows_all:
        per_layer.setdefault(row["layer"], []).append(row)
    order = ("oscar", "compare", "kivi", "hadamard", "int2")
    sides = {s: [m for m in order if f"{m}_{s}" in mm] for s in SIDES}
    sides = {s: ms for s, ms in sides.items() if ms}
    rank = "oscar_attention" if "oscar_attention" in mm else "oscar_key"
    table = Table(title=f"INT2 error by layer, worst {rank.split('_')[1]} error first ({report['path']}, "
                        f"{_size(report)})",
                  caption=None if other is None else f"other: {other['name']} {other['version']} ({other['bundle']})")
    table.add_column("layer", justify="right")
    for side, ms in sides.items():
        for x in ms:
            table.add_column(f"{side}: {NAMES[x]}" if x == "oscar" else NAMES[x], justify="right")
    kernel = dict(zip(per_layer, report.get("decode_kernel_error", [])))  # in the rows' layer order
    if kernel:
        table.add_column("decode kernel", justify="right")
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    for layer in layer_ranking(rows_all, rank):
        rows = per_layer[layer]
        cells = [str(layer)] + [f"{mean(rows, f'{x}_{s}'):.4f}" for s, ms in sides.items() for x in ms]
        table.add_row(*cells, *([f"{kernel[layer]:.4f}"] if kernel else []))
    table.add_section()
    table.add_row("mean", *[f"{mm[f'{x}_{s}']:.4f}" for s, ms in sides.items() for x in ms],
                  *([f"{sum(kernel.values()) / len(kernel):.4f}"] if kernel else []))
    console.print(table)
    worst = per_layer[layer_ranking(rows_all, rank)[0]]
    side = rank.split("_")[1]
    console.print(f"worst layer: {worst[0]['layer']} (OSCAR {side} error {mean(worst, rank):.4f}"
                  + (f", KIVI-style {mean(worst, f'kivi_{side}'):.4f}" if f"kivi_{side}" in worst[0] else "") + ")")


def _size(report: dict) -> str:
    return f"{report['samples']} × {report['seq_len']} tokens" if "seq_len" in report else "held-out tokens"


def _print_end_to_end(report: dict) -> None:
    e2e, other = report["end_to_end"], report.get("compare")
    table = Table(title=f"end to end vs BF16, {_size(report)} "
                        f"(default {DEFAULT_SEQ_LEN['cuda']} on CUDA, {DEFAULT_SEQ_LEN['cpu']} on the CPU)")
    for col in ("cache", "next-token KL (nats)", "top-1 agreement", "perplexity"):
        table.add_column(col, justify="right" if col != "cache" else "left")
    if "bf16_ppl" in e2e:
        table.add_row("BF16", "", "", f"{e2e['bf16_ppl']:.3f}")
    runs = [("OSCAR INT2", e2e, "")]
    if other:
        runs.append((f"other: {other['name']} {other['version']}", other["end_to_end"], ""))
    runs += [(label, e2e, f"{m}_") for m, label in (("kivi", "KIVI-style INT2"), ("hadamard", "Hadamard INT2"),
                                                    ("int2", "INT2, no rotation")) if f"{m}_kl" in e2e]
    for label, figures, p in runs:
        ppl = figures.get(f"{p}ppl")
        table.add_row(label, f"{figures[f'{p}kl']:.4f}", f"{figures[f'{p}top1_agreement']:.1%}",
                      "" if ppl is None else f"{ppl:.3f}")
    console.print(table)


def _print_buckets(report: dict) -> None:
    buckets = report.get("buckets")
    if not buckets:
        return
    runs = [r for r in ("oscar", "compare", "kivi", "hadamard", "int2") if r in buckets["excess"]]
    table = Table(title="NLL excess over BF16 by position (nats a token)")
    table.add_column("positions", justify="right")
    for r in runs:
        table.add_column(NAMES[r], justify="right")
    for i, (first, last) in enumerate(buckets["bounds"]):
        table.add_row(f"{first}-{last}", *[f"{buckets['excess'][r][i]:+.4f}" for r in runs])
    console.print(table)


def register(app: typer.Typer) -> None:
    app.command("verify", epilog=EXAMPLES)(verify)
