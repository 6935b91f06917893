"""oscar zoo list | build | check: the published bundles, rebuilt from their recipes."""

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from oscar_cli.ui import console, err_console, progress
from oscar_core.errors import OscarError, UsageError
from oscar_core.evaluate.verify import recorded_figures
from oscar_core.publish import zoo as zoo_core

app = typer.Typer(name="zoo", no_args_is_help=True,
                  help="The bundle zoo: one recipe per model in zoo/recipes/, bundles in zoo/, manifests in manifests/.")

ZooDir = Annotated[Path, typer.Option("--zoo", help="Zoo directory (recipes/ and the bundles).")]
ManifestsDir = Annotated[Path, typer.Option("--manifests", help="Directory of the manifest copies.")]
Names = Annotated[Optional[list[str]], typer.Argument(help="Bundle names (ORG/MODEL) to act on; default: every recipe.")]


@app.command("list", epilog="Example:\n\n  oscar zoo list")
def list_zoo(zoo: ZooDir = Path("zoo"), manifests: ManifestsDir = Path("manifests")) -> None:
    """Show every bundle of the zoo, and every recipe not built yet."""
    if not zoo.is_dir():
        raise UsageError(f"zoo directory not found: {zoo}")
    built = zoo_core.read_manifests(manifests)
    table = Table()
    for header in ("model", "version", "bits @128K", "calibration", "verify"):
        table.add_column(header, overflow="fold")
    for m in built:
        bits = m.quant.bits_per_element.get("131072")
        c = m.calibration
        figures = m.fidelity or recorded_figures(zoo / m.name / m.version) or {}
        verify = ", ".join(f"{k} {v:.4g}" for k, v in sorted(figures.items())) or "-"
        table.add_row(m.name, m.version, f"{bits:.3f}" if bits is not None else "-",
                      f"{c.data} {c.samples}×{c.seq_len} seed {c.seed}", verify)
    have = {(m.name, m.version) for m in built}
    for r in zoo_core.load_recipes(zoo):
        if (r.name, r.version) not in have:
            table.add_row(r.name, r.version, "-", f"{r.data} {r.samples}×{r.seq_len} seed {r.seed}", "not built")
    console.print(table)


def _run(action, zoo: Path, manifests: Path):
    with progress() as bar:
        task = bar.add_task("", total=None, rate="", visible=False)

        def on_start(recipe: zoo_core.Recipe) -> None:
            bar.update(task, description=f"calibrating {recipe.name} {recipe.version}", total=recipe.samples,
                       completed=0, rate="", visible=True)

        def on_progress(done: int, total: int, tokens_per_s: float) -> None:
            bar.update(task, completed=done, rate=f"{tokens_per_s:,.0f} tok/s")

        return action(zoo, manifests, on_start=on_start, on_progress=on_progress)


@app.command("build", epilog="Examples:\n\n  oscar zoo build\n\n  oscar zoo build Qwen/Qwen2.5-Coder-0.5B-Instruct")
def build(names: Names = None, zoo: ZooDir = Path("zoo"), manifests: ManifestsDir = Path("manifests")) -> None:
    """Rebuild every bundle whose model is available here; skip the others, saying why."""
    outcomes = _run(lambda *a, **k: zoo_core.build(*a, **k, names=names), zoo, manifests)
    for o in outcomes:
        line = f"{o.status} {o.recipe.name} {o.recipe.version}: {o.detail}"
        (console if o.status == "built" else err_console).print(line, highlight=False, soft_wrap=True)
    if not any(o.status == "built" for o in outcomes):
        raise OscarError(f"nothing was built: none of the {len(outcomes)} recipe(s) in {zoo} can be built here")


@app.command("check", epilog="Examples:\n\n  oscar zoo check\n\n  oscar zoo check --no-verify   # tensors and "
                              "manifest only, skip the verify run")
def check(names: Names = None, zoo: ZooDir = Path("zoo"), manifests: ManifestsDir = Path("manifests"),
          verify: Annotated[bool, typer.Option(help="Also verify a rebuild that is not byte-identical and hold its "
                                                    "figures to the recorded verify.json.")] = True) -> None:
    """Rebuild every available bundle into a temporary directory and hold it to the committed one: byte-identical,
    or numerically equivalent (tolerances per tensor kind, printed); fail otherwise."""
    outcomes = _run(lambda *a, **k: zoo_core.check(*a, **k, run_verify=verify, names=names), zoo, manifests)
    for o in outcomes:
        if o.deviations:
            _print_deviations(o)
        detail = f": {o.detail}" if o.detail else ""
        console.print(f"{o.status} {o.recipe.name} {o.recipe.version}{detail}", highlight=False, soft_wrap=True)
    bad = [o for o in outcomes if o.status in ("differs", "missing")]
    if bad:
        raise OscarError(f"{len(bad)} bundle(s) do not match their recipe: "
                         + ", ".join(f"{o.recipe.name} {o.recipe.version}" for o in bad))
    if not any(o.status in ("same", "equivalent") for o in outcomes):
        raise OscarError(f"nothing was checked: none of the {len(outcomes)} recipe(s) in {zoo} can be built here")


def _print_deviations(o: zoo_core.Outcome) -> None:
    table = Table(title=f"{o.recipe.name} {o.recipe.version}: rebuild vs committed (not byte-identical)")
    for header, justify in (("kind", "left"), ("largest deviation", "right"), ("tolerance", "right"),
                            ("", "center"), ("at", "left")):
        table.add_column(header, justify=justify, overflow="fold")
    for d in o.deviations:
        mark = "[green]✓[/]" if d.ok else "[red]✗[/]"
        table.add_row(d.kind, f"{d.worst:.3g}", f"{d.tolerance:.3g}", mark, d.where)
    console.print(table)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="zoo")
