"""The oscar command line: calibrate → export → verify → eval → push, and the zoo."""

import os
import sys

import typer

from oscar_cli.ui import err_console
from oscar_core.calibrate.distributed import LAUNCHED, record_error
from oscar_core.errors import OscarError, UsageError

app = typer.Typer(
    name="oscar",
    help="Build, verify and publish OSCAR rotation bundles for 2-bit (INT2) KV caches.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)



@app.callback()
def root() -> None:
    """Build, verify and publish OSCAR rotation bundles for 2-bit (INT2) KV caches.

    Pipeline: calibrate (statistics) → export (bundle) → verify / eval → push; `oscar zoo` rebuilds the zoo.
    """


from oscar_cli.commands import calibrate, export, models, push, verify, zoo  # noqa: E402

calibrate.register(app)
export.register(app)
verify.register(app)
push.register(app)
zoo.register(app)
models.register(app)

from oscar_cli.commands import eval as eval_cmd  # noqa: E402

eval_cmd.register(app)

from oscar_cli.commands import upstream  # noqa: E402

upstream.register(app)


def main() -> None:
    """Entry point: user errors become one line on stderr and exit code 1 (2 for usage errors), never a traceback."""
    try:
        rc = app(standalone_mode=False)
        sys.exit(rc if isinstance(rc, int) else 0)
    except OscarError as e:
        record_error(e)
        if not os.environ.get(LAUNCHED):  # under `oscar calibrate --gpus N` the launcher prints the one line
            err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2 if isinstance(e, UsageError) else 1)
    except KeyboardInterrupt:
        err_console.print("[bold red]interrupted[/]")
        sys.exit(130)
    except SystemExit:
        raise
    except typer.Abort:
        sys.exit(1)
    except typer.TyperException as e:  # a bad or missing flag or argument (click's usage errors): exit 2
        err_console.print(f"[bold red]error:[/] {e.format_message()}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except Exception as e:  # noqa: BLE001 - the last line of defence against tracebacks
        if os.environ.get("OSCAR_DEBUG"):
            raise
        record_error(e)
        if os.environ.get(LAUNCHED):
            sys.exit(1)
        err_console.print(f"[bold red]error:[/] {type(e).__name__}: {e} (set OSCAR_DEBUG=1 for a traceback)",
                          highlight=False, soft_wrap=True)
        sys.exit(1)
