"""Checks typer runs on flags as it parses them: a value out of range is a usage error (one line, exit 2)."""

import math
import re
from pathlib import Path

import typer

from oscar_core.errors import OscarError
from oscar_core.formats.bundle import NAME, VERSION
from oscar_core.formats.fileio import check_name


def in_range(low: float | None = None, high: float | None = None, above: bool = False):
    """A callback: the flag's value (each value of a repeated flag; None, an unset optional flag, passes) must be a
    finite number, at least `low` (above it when `above`) and at most `high`."""
    bounds = ([] if low is None else [f"{'above' if above else 'at least'} {low:g}"]) + \
        ([] if high is None else [f"at most {high:g}"])
    wanted = " ".join(["a finite number", " and ".join(bounds)]).strip()

    def check(value):
        for v in value if isinstance(value, list) else [value]:
            if v is not None and (not math.isfinite(v) or (low is not None and (v <= low if above else v < low))
                                  or (high is not None and v > high)):
                raise typer.BadParameter(f"{v} is not {wanted}")
        return value

    return check


POSITIVE = in_range(1)            # a count: samples, processes, group size
COUNT = in_range(0)               # a count that may be zero: needle prompts
FRACTION = in_range(0, 1, above=True)   # a clip ratio, in (0, 1]
THRESHOLD = in_range(0, above=True)     # a bound on an error or a KL: finite and above 0
SEQUENCE = in_range(2)            # tokens of a sample: a target needs a token before it


def bundle_name(value: str | None) -> str | None:
    """A callback for --name: ORG/MODEL of letters, digits, '.', '_' or '-', no part '.' or '..'."""
    try:
        if value is not None and not re.fullmatch(NAME, check_name(value, "bundle name")):
            raise typer.BadParameter(f"{value!r} is not ORG/MODEL (letters, digits, '.', '_' or '-')")
    except OscarError as e:
        raise typer.BadParameter(str(e)) from None
    return value


def bundle_version(value: str | None) -> str | None:
    """A callback for --version: letters, digits, '.', '_' or '-', starting with a letter or digit."""
    if value is not None and not re.fullmatch(VERSION, value):
        raise typer.BadParameter(f"{value!r} is not a version (letters, digits, '.', '_' or '-', starting with a "
                                 "letter or digit)")
    return value


def png_file(path: Path | None) -> Path | None:
    """A callback for --plot: a .png file, not a directory (matplotlib would write DIR.png, not what was asked)."""
    if path is not None and (path.suffix.lower() != ".png" or path.is_dir()):
        raise typer.BadParameter(f"{path} is not a .png file to write")
    return path
