"""Atomic file writes, checksums, and the names that become paths.

A reader never sees a half-written file, and what a killed writer left beside its target (a temporary file or
directory named with the writer's process id, a directory moved aside) is removed by the next write of that
target. A name from a flag or a file (bundle name, version, model id) becomes a path only through path_under:
relative, made of plain parts, and still under its root once resolved.
"""

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from oscar_core.errors import OscarError


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_name(name: str, what: str) -> str:
    """`name` if it is a relative path of plain parts ('/'-separated; none empty, '.' or '..'; no backslash or
    control character); else OscarError naming `what` (e.g. "bundle name")."""
    parts = name.split("/")
    if (not name or name.startswith("/") or "\\" in name or re.search(r"[\x00-\x1f\x7f]", name)
            or any(p in ("", ".", "..") for p in parts)):
        raise OscarError(f"invalid {what} {name!r}: each '/'-separated part must be a plain name (not empty, "
                         "'.' or '..'; no backslash or control character)")
    return name


def path_under(root: str | Path, name: str, what: str) -> Path:
    """root / name, for a name that check_name accepts and that, resolved (symlinks followed), stays under root."""
    path = Path(root) / check_name(name, what)
    if not path.resolve().is_relative_to(Path(root).resolve()):
        raise OscarError(f"{what} {name!r} leads outside {root} (to {path.resolve()}): refused")
    return path


_TEMPORARY = r"\.{name}\.(?:(\d+)\.)?[a-z0-9_]{{8}}\.tmp"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(path: Path) -> None:
    """Remove the temporaries a killed writer of `path` left beside it (those of a process that is gone, or of no
    recorded process), and settle a directory swap it left half done: `.<name>.old` is put back where `path` is
    missing, else removed."""
    if not path.parent.is_dir():
        return
    pattern = re.compile(_TEMPORARY.format(name=re.escape(path.name)))
    for entry in path.parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if not match or (match.group(1) is not None and _alive(int(match.group(1)))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    old = path.with_name(f".{path.name}.old")
    if old.is_dir() and not old.is_symlink():
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, path)


def _temporary_prefix(path: Path) -> str:
    return f".{path.name}.{os.getpid()}."


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, fsync, then rename over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(prefix=_temporary_prefix(path), suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_stream(path: str | Path, chunks, check=None) -> None:
    """atomic_write_bytes for data given as an iterable of byte chunks; check() runs before the rename and may
    raise to leave nothing behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(prefix=_temporary_prefix(path), suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        if check is not None:
            check()
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def canonical_json(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_bytes(path, canonical_json(obj).encode())


def atomic_write_dir(path: str | Path, files: dict[str, bytes]) -> None:
    """Write every file into a temporary sibling directory, then swap it in for `path`.

    An interrupted write leaves `path` as it was (or absent), never half-written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    tmp = Path(tempfile.mkdtemp(prefix=_temporary_prefix(path), suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())
    old = None
    try:
        for name, data in files.items():
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp / name, 0o666 & ~_umask())
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not path.exists():
            os.replace(old, path)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
