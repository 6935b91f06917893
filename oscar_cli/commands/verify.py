"""oscar verify: check a bundle and measure the attention error its INT2 cache causes."""

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from oscar_cli.ui import console, err_console
from oscar_core.bundle import load_bundle
from oscar_core.data import DEFAULT_HELDOUT, load_samples
from oscar_core.errors import OscarError
from oscar_core.fileio import atomic_write_json
from oscar_core.models import load_model, resolve_device
from oscar_core.verify import (VERIFY_FILE, Check, check_layers, check_model, check_tensors, first_failure, headline,
                               merge_reports, resolve_model_spec, verify as measure)

EXAMPLES = """
Examples:

  oscar verify zoo/HuggingFaceTB/SmolLM2-135M-Instruct/v1            # default model, held-out Python docs

  oscar verify zoo/Qwen/Qwen3-8B/v1 --device cuda --json report.json  # Triton kernels on the GPU

  oscar verify bundle/rotations.safetensors --model ./my-model --data notes.txt --max-logit-error 0.3
"""


def verify(
    bundle: Annotated[Path, typer.Argument(help="Bundle directory or its rotations.safetensors.")],
    model: Annotated[Optional[str], typer.Option(help="Model to check against; default: the one the manifest names.")] = None,
    data: Annotated[str, typer.Option(help="Held-out text source (hub dataset, file or folder).")] = DEFAULT_HELDOUT,
    samples: Annotated[int, typer.Option(help="Held-out samples.")] = 1,
    seq_len: Annotated[int, typer.Option(help="Tokens per held-out sample.")] = 1024,
    seed: Annotated[int, typer.Option(help="Seed for drawing the samples.")] = 0,
    device: Annotated[Optional[str], typer.Option(help="cpu or cuda; default: cuda when available.")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="Model dtype; default: float32 on CPU, bfloat16 on CUDA.")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the full report here.")] = None,
    max_logit_error: Annotated[Optional[float], typer.Option(help="Fail when OSCAR's mean logit error passes this; default: the manifest's.")] = None,
    checks_only: Annotated[bool, typer.Option(help="Only check the bundle (no model run).")] = False,
    record: Annotated[bool, typer.Option(help="Write the headline figures to verify.json beside the bundle (zoo list and model cards show them).")] = False,
    compare: Annotated[Optional[Path], typer.Option(help="A second bundle for the same model (e.g. from `oscar upstream import`), measured beside this one.")] = None,
) -> None:
    """Check a bundle (schema, checksum, shapes, orthogonality, clips, model match), then measure its INT2 error."""
    b = load_bundle(bundle)
    m = b.manifest
    checks = check_tensors(b)
    other = None
    if compare is not None:
        other = load_bundle(compare)
        checks += [Check(f"compared: {c.name}", c.ok, c.detail) for c in check_tensors(other)]
    failure = first_failure(checks)
    if failure:
        raise OscarError(f"bundle check failed: {failure}")
    if checks_only:
        _print_checks(checks)
        return
    device = resolve_device(device)
    loaded = load_model(resolve_model_spec(model, m.model, m.calibration.model_source), device, dtype)
    checks += [check_model(m.model, loaded.info), check_layers(m, loaded.model.config)]
    if other is not None:
        for c in (check_model(other.manifest.model, loaded.info), check_layers(other.manifest, loaded.model.config)):
            checks.append(Check(f"compared: {c.name}", c.ok, c.detail))
    failure = first_failure(checks)
    if failure:
        raise OscarError(f"bundle check failed: {failure}")
    if loaded.info.max_position_embeddings and seq_len > loaded.info.max_position_embeddings:
        raise OscarError(f"--seq-len {seq_len} is above the model's limit of {loaded.info.max_position_embeddings}")
    _print_checks(checks)
    ids, fingerprint = load_samples(data, loaded.tokenizer, samples, seq_len, seed)
    reports = []
    with console.status(f"measuring INT2 attention error on {samples} × {seq_len} held-out tokens"):
        for i in range(ids.shape[0]):
            reports.append(measure(loaded, b, ids[i:i + 1], use_kernels=device.startswith("cuda"), compare=other))
    report = merge_reports(reports)
    threshold = m.max_logit_error if max_logit_error is None else max_logit_error
    if other is not None:
        report["compare"].update(bundle=str(other.path), name=other.manifest.name, version=other.manifest.version)
    report.update(bundle=str(b.path), name=m.name, version=m.version, data=data, data_fingerprint=fingerprint,
                  seed=seed, samples=samples, seq_len=seq_len, device=device, max_logit_error=threshold,
                  checks=[c.__dict__ for c in checks])
    report["passed"] = report["mean"]["oscar_key"] <= threshold
    _print_report(report)
    if json_out:
        atomic_write_json(json_out, report)
        console.print(f"report → {json_out}")
    if record:
        summary = {k: report[k] for k in ("name", "version", "data", "data_fingerprint", "samples", "seq_len", "seed",
                                          "device", "path", "passed")}
        atomic_write_json(b.path / VERIFY_FILE, {**summary, "figures": headline(report)})
        console.print(f"figures → {b.path / VERIFY_FILE}")
    if not report["passed"]:
        err_console.print(f"[bold red]error:[/] OSCAR mean logit error {report['mean']['oscar_key']:.4f} "
                          f"is above the threshold {threshold}")
        raise typer.Exit(1)


def _print_checks(checks) -> None:
    for c in checks:
        console.print(f"[{'green' if c.ok else 'red'}]{'✓' if c.ok else '✗'}[/] {c.name}: {c.detail}")


def _print_report(report: dict) -> None:
    other = report.get("compare")
    rows_all, mm = [dict(r) for r in report["layers"]], dict(report["mean"])
    if other:  # the compared bundle's OSCAR figures as columns of this table
        for row, theirs in zip(rows_all, other["layers"]):
            row.update(compare_key=theirs["oscar_key"], compare_value=theirs["oscar_value"])
        mm.update(compare_key=other["mean"]["oscar_key"], compare_value=other["mean"]["oscar_value"])
    per_layer: dict[int, list[dict]] = {}
    for row in rows_all:
        per_layer.setdefault(row["layer"], []).append(row)
    table = Table(title=f"INT2 attention error by layer, worst first ({report['path']})",
                  caption=None if other is None else f"other: {other['name']} {other['version']} ({other['bundle']})")
    methods = ("oscar", "compare", "hadamard", "int2") if other else ("oscar", "hadamard", "int2")
    names = {"oscar": "OSCAR", "compare": "other", "hadamard": "Hadamard", "int2": "none"}
    for col in ("layer", *(f"{side}: {names[x]}" if x == "oscar" else names[x] for side in ("key", "value") for x in methods)):
        table.add_column(col, justify="right")
    if "decode_kernel_error" in report:
        table.add_column("decode kernel", justify="right")
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    kernel = dict(zip(per_layer, report.get("decode_kernel_error", [])))  # in the rows' layer order
    order = sorted(per_layer, key=lambda l: -mean(per_layer[l], "oscar_key"))
    for layer in order:
        rows = per_layer[layer]
        cells = [str(layer)] + [f"{mean(rows, f'{m}_{s}'):.4f}" for s in ("key", "value") for m in methods]
        if "decode_kernel_error" in report:
            cells.append(f"{kernel[layer]:.4f}")
        table.add_row(*cells)
    table.add_section()
    table.add_row("mean", *[f"{mm[f'{m}_{s}']:.4f}" for s in ("key", "value") for m in methods],
                  *([f"{sum(report['decode_kernel_error']) / len(report['decode_kernel_error']):.4f}"]
                    if "decode_kernel_error" in report else []))
    console.print(table)
    e2e = report["end_to_end"]
    console.print(f"next-token logits with the OSCAR INT2 cache vs BF16: KL {e2e['kl']:.4f} nats, "
                  f"top-1 agreement {e2e['top1_agreement']:.1%}")
    if other:
        e2e = other["end_to_end"]
        console.print(f"next-token logits with the other bundle's INT2 cache vs BF16: KL {e2e['kl']:.4f} nats, "
                      f"top-1 agreement {e2e['top1_agreement']:.1%}")
    verdict = "[green]PASS[/]" if report["passed"] else "[red]FAIL[/]"
    console.print(f"{verdict} OSCAR mean logit error {mm['oscar_key']:.4f} (threshold {report['max_logit_error']})")


def register(app: typer.Typer) -> None:
    app.command("verify", epilog=EXAMPLES)(verify)
