"""oscar eval: perplexity and needle retrieval (the standard suite) or the RULER-style suite (--suite ruler) of BF16
and every INT2 method, side by side."""

import io
import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from oscar_cli.options import POSITIVE, in_range, png_file
from oscar_cli.ui import console, err_console
from oscar_core.calibrate.data import DEFAULT_HELDOUT
from oscar_core.calibrate.models import load_model, resolve_device
from oscar_core.errors import OscarError, UsageError
from oscar_core.evaluate.evaluate_ruler import RulerRequest, default_samples, evaluate_ruler
from oscar_core.evaluate.evaluate_ruler import check_request as check_ruler_request
from oscar_core.evaluate.perplexity import DEPTHS, EvalRequest, Step, check_request, default_batch, evaluate
from oscar_core.evaluate.ruler import TASKS
from oscar_core.evaluate.verify import resolve_model_spec
from oscar_core.formats.bundle import load_bundle
from oscar_core.formats.fileio import atomic_write_bytes
from oscar_core.serve import methods

EXAMPLES = """
Examples:

  oscar eval zoo/HuggingFaceTB/SmolLM2-135M-Instruct/v1 --context 2048 --context 8192 --json eval.json --plot eval.png

  oscar eval BUNDLE --methods bf16,hadamard,oscar --samples 1 --needle-trials 2

  oscar eval BUNDLE --suite ruler --context 4096 --methods bf16,kivi,oscar --json ruler.json --plot ruler.png
"""
SUITES = ("standard", "ruler")


def eval_command(
    bundle: Annotated[Path, typer.Argument(help="Bundle directory (<zoo>/<org>/<model>/<version>).")],
    model: Annotated[Optional[str], typer.Option(help="Hub id, directory, .gguf or packaged:<name>; default: the one the bundle's manifest names.")] = None,
    suite: Annotated[str, typer.Option(help="standard: perplexity and needle; ruler: the RULER-style tasks.")] = "standard",
    data: Annotated[str, typer.Option(help="Held-out text source (default: IDLE's docs, shipped with oscar).")] = DEFAULT_HELDOUT,
    context: Annotated[Optional[list[int]], typer.Option(callback=in_range(64), help="Context length; repeat for several.")] = None,
    methods_: Annotated[str, typer.Option("--methods", help=f"Comma-separated, of {','.join(methods.METHODS)}.")] = ",".join(methods.METHODS),
    samples: Annotated[Optional[int], typer.Option(help="Perplexity windows per context (default 2); --suite ruler: prompts per task and context (50 on CUDA, 4 on CPU).", callback=POSITIVE)] = None,
    tasks: Annotated[str, typer.Option(help="With --suite ruler: the tasks, comma-separated.")] = ",".join(TASKS),
    needle_trials: Annotated[int, typer.Option(help="Needle prompts per context and depth (0: none).", callback=in_range(0))] = 1,
    depths: Annotated[str, typer.Option(help="Needle depths, comma-separated fractions.")] = ",".join(map(str, DEPTHS)),
    seed: Annotated[int, typer.Option(help="Seed of the pass keys, filler offsets and RULER-style prompts.")] = 0,
    batch: Annotated[Optional[int], typer.Option(help="Needle and RULER-style prompts answered together, left-padded (default: 8 on CUDA, 1 on the CPU).", callback=POSITIVE)] = None,
    device: Annotated[Optional[str], typer.Option(help="cpu, cuda or auto.")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the JSON report here.")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="Write a PNG plot here (a .png file).", callback=png_file)] = None,
) -> None:
    """Perplexity at each context and needle accuracy by depth, or (--suite ruler) RULER-style scores per task, for
    BF16 and the INT2 methods at the same bits."""
    names = [m.strip() for m in methods_.split(",") if m.strip()]
    contexts, device = sorted(set(context or [2048])), resolve_device(device)
    batch = default_batch(device) if batch is None else batch
    if suite == "ruler":
        req = RulerRequest(contexts=contexts, methods=names, tasks=[t.strip() for t in tasks.split(",") if t.strip()],
                           data=data, samples=default_samples(device) if samples is None else samples, seed=seed,
                           batch=batch)
        check, run, render, draw = check_ruler_request, evaluate_ruler, ruler_tables, plot_ruler
    elif suite == "standard":
        req = EvalRequest(contexts=contexts, methods=names, data=data, samples=2 if samples is None else samples,
                          depths=depth_list(depths), needle_trials=needle_trials, seed=seed, batch=batch)
        check, run, render, draw = check_request, evaluate, lambda r: [table(r), *bucket_tables(r)], plot_report
    else:
        raise UsageError(f"unknown suite {suite}: use one of {', '.join(SUITES)}")
    b = load_bundle(bundle)
    check(req, b)
    m = b.manifest
    loaded = load_model(resolve_model_spec(model, m.model, m.calibration.model_source), device)
    logged = not console.is_terminal    # a log file: a plain line a finished part, so a killed run leaves a trace

    def on_step(step: Step) -> None:
        status.update(step.text)
        if step.done and logged:
            console.print(step.text, markup=False, highlight=False, soft_wrap=True)
        if step.report is not None and json_out:     # the contexts finished so far survive a killed run
            atomic_write_bytes(json_out, json.dumps(step.report, indent=1).encode())

    with err_console.status("evaluating") as status:
        report = run(loaded, b, req, on_step=on_step)
    for t in render(report):
        console.print(t)
    png = draw(report) if plot else None  # drawn before the plot is written: a failing plot leaves no PNG
    if json_out:
        atomic_write_bytes(json_out, json.dumps(report, indent=1).encode())
        console.print(f"[green]wrote[/] {json_out}")
    if plot:
        atomic_write_bytes(plot, png)
        console.print(f"[green]wrote[/] {plot}")


def depth_list(depths: str) -> tuple[float, ...]:
    try:
        return tuple(float(d) for d in depths.split(","))
    except ValueError:
        raise OscarError(f"--depths {depths!r}: use comma-separated fractions like 0.1,0.5,0.9") from None


def table(report: dict) -> Table:
    """Bits, perplexity (and its gap to BF16) and needle accuracy with its prompt count, per method and context."""
    t = Table(title=f"{report['model']} · {report['bundle']} · {report['data']}")
    t.add_column("method")
    for c in report["contexts"]:
        t.add_column(f"bits @ {c}", justify="right")
        t.add_column(f"ppl @ {c}", justify="right")
        t.add_column(f"needle @ {c}", justify="right")
    ref = report["perplexity"].get("bf16", {})
    for m in report["methods"]:
        row = [report["labels"][m]]
        for c in map(str, report["contexts"]):
            ppl = report["perplexity"][m][c]
            gap = f" ({ppl / ref[c] - 1:+.1%})" if c in ref and m != "bf16" else ""
            acc, n = report["needle_accuracy"][m].get(c), sum(report["needle_prompts"].get(c, {}).values())
            row += [f"{report['bits_per_element'][m][c]:.2f}", f"{ppl:.3f}{gap}",
                    "–" if acc is None else f"{acc:.0%} ({round(acc * n)}/{n})"]
        t.add_row(*row)
    return t


def bucket_tables(report: dict) -> list[Table]:
    """One table a context: each method's NLL excess over BF16 (nats a token) by position bucket."""
    out = []
    for c, buckets in report.get("buckets", {}).items():
        runs = [m for m in report["methods"] if m in buckets["excess"]]
        t = Table(title=f"NLL excess over BF16 by position @ {c} tokens ({report['windows'][c]} windows)")
        t.add_column("positions", justify="right")
        for m in runs:
            t.add_column(report["labels"][m], justify="right")
        for i, (first, last) in enumerate(buckets["bounds"]):
            t.add_row(f"{first}-{last}", *(f"{buckets['excess'][m][i]:+.4f}" for m in runs))
        out.append(t)
    return out


def ruler_tables(report: dict) -> list[Table]:
    """One table a context: a row a task (its prompt count, each method's score) and the average row."""
    out = []
    for c in map(str, report["contexts"]):
        t = Table(title=f"{report['model']} · {report['bundle']} · RULER-style @ {c} tokens · "
                        f"{report['samples']} prompts per task on {report['device']}",
                  caption="; ".join(f"{task} left out: {why}" for task, why in report["skipped"][c].items()) or None)
        t.add_column("task")
        t.add_column("prompts", justify="right")
        for m in report["methods"]:
            t.add_column(f"{report['labels'][m]} ({report['bits_per_element'][m][c]:.2f} b)", justify="right")
        for task, n in report["prompts"][c].items():
            t.add_row(task, str(n), *(f"{report['scores'][m][c][task]:.1%}" for m in report["methods"]))
        t.add_row("average", str(sum(report["prompts"][c].values())),
                  *(f"{report['average'][m][c]:.1%}" for m in report["methods"]), style="bold")
        out.append(t)
    return out


def short(c) -> str:
    return f"{int(c) // 1024}K" if int(c) >= 1024 else str(c)


def two_panels(report: dict, series, left: tuple[str, str], cells: list, score, labels: list[str],
               right: tuple[str, str], log: bool = False, ylim: tuple[float, float] | None = None) -> bytes:
    """PNG bytes of a two-panel figure. Left: series(method, context) per method over the contexts (log2 axis),
    left = (y label, title). Right: a method x cell grid of score(method, cell) in [0, 1], labels under each cell,
    right = (x label, title)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms, ctx = report["methods"], report["contexts"]
    wide = max(1.3, 0.1 * len(cells))  # the grid's width grows with its cells, so their labels do not overlap
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(5.6 * (1 + wide), 4.8), gridspec_kw={"width_ratios": [1, wide]})
    for m in ms:
        bits = " / ".join(f"{report['bits_per_element'][m][str(c)]:.2f}" for c in ctx)
        ax.plot(ctx, [series(m, str(c)) for c in ctx], marker="o", label=f"{report['labels'][m]} ({bits} b/elt)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log" if log else "linear")
    if ylim:
        ax.set_ylim(ylim)
    ax.set_xticks(ctx, [short(c) for c in ctx])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(left[0])
    ax.set_title(left[1])
    ax.legend(fontsize=8)
    rows = [[score(m, cell) for cell in cells] for m in ms]
    im = bx.imshow(rows, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    bx.set_yticks(range(len(ms)), [report["labels"][m] for m in ms])
    bx.set_xticks(range(len(cells)), labels, fontsize=7)
    for i, row in enumerate(rows):
        for j, v in enumerate(row):
            bx.text(j, i, f"{v:.0%}", ha="center", va="center", fontsize=7)
    bx.set_xlabel(right[0])
    bx.set_title(right[1])
    fig.colorbar(im, ax=bx, fraction=0.03)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=130)
    plt.close(fig)
    return out.getvalue()


def plot_report(report: dict) -> bytes:
    """PNG: left, perplexity vs context per method; right, needle accuracy per method, one cell per (length, depth)
    with its prompt count."""
    prompts = report["needle_prompts"]
    cells = [(c, d) for c in map(str, report["contexts"]) for d in prompts.get(c, {})]
    return two_panels(report, lambda m, c: report["perplexity"][m][c],
                      ("perplexity (held-out, log scale)", "Perplexity vs context"),
                      cells, lambda m, cell: report["needle"][m][cell[0]][cell[1]],
                      [f"{short(c)}\n{float(d):.0%}\nn={prompts[c][d]}" for c, d in cells],
                      ("context / needle depth / prompts", "Needle retrieval (exact match)"), log=True)


TASK_LABELS = {"niah_single": "single", "niah_multikey": "multi\nkey", "niah_multivalue": "multi\nvalue",
               "niah_multiquery": "multi\nquery", "variable_tracking": "var.\ntrack", "common_words": "common\nwords"}


def plot_ruler(report: dict) -> bytes:
    """PNG: left, the RULER-style average vs context per method; right, each method's score per (length, task)
    with its prompt count."""
    prompts = report["prompts"]
    cells = [(c, t) for c in map(str, report["contexts"]) for t in prompts[c]]
    return two_panels(report, lambda m, c: report["average"][m][c],
                      ("average score over tasks", f"RULER-style average (n = {report['samples']} a task)"),
                      cells, lambda m, cell: report["scores"][m][cell[0]][cell[1]],
                      [f"{short(c)}\n{TASK_LABELS.get(t, t)}\nn={prompts[c][t]}" for c, t in cells],
                      ("context / task / prompts", "RULER-style tasks (string match)"), ylim=(-0.02, 1.02))


def register(app: typer.Typer) -> None:
    app.command("eval", epilog=EXAMPLES)(eval_command)
