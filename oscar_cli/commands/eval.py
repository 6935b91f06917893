"""oscar eval: perplexity and needle retrieval of BF16 and every INT2 method, side by side."""

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from oscar_cli.options import POSITIVE, in_range, png_file
from oscar_cli.ui import console, err_console
from oscar_core import methods
from oscar_core.bundle import load_bundle
from oscar_core.data import DEFAULT_HELDOUT
from oscar_core.errors import OscarError
from oscar_core.evaluate import DEPTHS, EvalRequest, check_request, evaluate
from oscar_core.fileio import atomic_write_bytes
from oscar_core.models import load_model, resolve_device
from oscar_core.verify import resolve_model_spec

EXAMPLES = """
Examples:

  oscar eval zoo/HuggingFaceTB/SmolLM2-135M-Instruct/v1 --context 2048 --context 8192 --json eval.json --plot eval.png

  oscar eval BUNDLE --methods bf16,hadamard,oscar --samples 1 --needle-trials 2
"""


def eval_command(
    bundle: Annotated[Path, typer.Argument(help="Bundle directory (<zoo>/<org>/<model>/<version>).")],
    model: Annotated[Optional[str], typer.Option(help="Hub id, directory, .gguf or packaged:<name>; default: the one the bundle's manifest names.")] = None,
    data: Annotated[str, typer.Option(help="Held-out text source (default: IDLE's docs, shipped with oscar).")] = DEFAULT_HELDOUT,
    context: Annotated[Optional[list[int]], typer.Option(callback=in_range(64), help="Context length; repeat for several.")] = None,
    methods_: Annotated[str, typer.Option("--methods", help=f"Comma-separated, of {','.join(methods.METHODS)}.")] = ",".join(methods.METHODS),
    samples: Annotated[int, typer.Option(help="Perplexity windows per context length.", callback=POSITIVE)] = 2,
    needle_trials: Annotated[int, typer.Option(help="Needle prompts per context and depth (0: none).", callback=in_range(0))] = 1,
    depths: Annotated[str, typer.Option(help="Needle depths, comma-separated fractions.")] = ",".join(map(str, DEPTHS)),
    seed: Annotated[int, typer.Option(help="Seed of the pass keys and filler offsets.")] = 0,
    device: Annotated[Optional[str], typer.Option(help="cpu, cuda or auto.")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the JSON report here.")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="Write a PNG plot here (a .png file).", callback=png_file)] = None,
) -> None:
    """Perplexity at each context and needle accuracy by depth, for BF16 and the INT2 methods at the same bits."""
    try:
        depth_list = tuple(float(d) for d in depths.split(","))
    except ValueError:
        raise OscarError(f"--depths {depths!r}: use comma-separated fractions like 0.1,0.5,0.9") from None
    req = EvalRequest(contexts=sorted(set(context or [2048])), methods=[m.strip() for m in methods_.split(",") if m.strip()],
                      data=data, samples=samples, depths=depth_list, needle_trials=needle_trials, seed=seed)
    b = load_bundle(bundle)
    check_request(req, b)
    m = b.manifest
    loaded = load_model(resolve_model_spec(model, m.model, m.calibration.model_source), resolve_device(device))
    with err_console.status("evaluating") as status:
        report = evaluate(loaded, b, req, on_step=lambda s: status.update(s))
    console.print(table(report))
    if json_out:
        atomic_write_bytes(json_out, json.dumps(report, indent=1).encode())
        console.print(f"[green]wrote[/] {json_out}")
    if plot:
        plot_report(report, plot)
        console.print(f"[green]wrote[/] {plot}")


def table(report: dict) -> Table:
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
            acc = report["needle_accuracy"][m].get(c)
            row += [f"{report['bits_per_element'][m][c]:.2f}", f"{ppl:.3f}{gap}", "–" if acc is None else f"{acc:.0%}"]
        t.add_row(*row)
    return t


def plot_report(report: dict, path: Path) -> None:
    """Left: perplexity vs context per method. Right: needle accuracy per method, one cell per (length, depth)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms, ctx = report["methods"], report["contexts"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.3]})
    for m in ms:
        ys = [report["perplexity"][m][str(c)] for c in ctx]
        bits = report["bits_per_element"][m][str(ctx[-1])]
        ax.plot(ctx, ys, marker="o", label=f"{report['labels'][m]} ({bits:.2f} b/elt)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ctx, [f"{c // 1024}K" if c >= 1024 else str(c) for c in ctx])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("perplexity (held-out, log scale)")
    ax.set_title("Perplexity vs context")
    ax.legend(fontsize=8)
    cells = [(c, d) for c in map(str, ctx) for d in next(iter(report["needle"].values())).get(c, {})]
    grid = [[report["needle"][m][c][d] for c, d in cells] for m in ms]
    im = bx.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    bx.set_yticks(range(len(ms)), [report["labels"][m] for m in ms])
    bx.set_xticks(range(len(cells)), [f"{int(c) // 1024 if int(c) >= 1024 else c}{'K' if int(c) >= 1024 else ''}\n"
                                      f"{float(d):.0%}" for c, d in cells], fontsize=8)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            bx.text(j, i, f"{v:.0%}", ha="center", va="center", fontsize=8)
    bx.set_xlabel("context / needle depth")
    bx.set_title("Needle retrieval (exact match)")
    fig.colorbar(im, ax=bx, fraction=0.03)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def register(app: typer.Typer) -> None:
    app.command("eval", epilog=EXAMPLES)(eval_command)
