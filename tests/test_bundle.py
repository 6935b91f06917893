import json
import os

import pytest
import torch
from tiny_bundle import write_tiny_bundle

from oscar_core.errors import OscarError
from oscar_core.formats.bundle import MANIFEST_FILE, TENSOR_FILE, load_bundle, read_manifest
from oscar_core.formats.fileio import atomic_write_dir


def test_roundtrip_and_determinism(tmp_path):
    m1 = write_tiny_bundle(tmp_path / "a")
    m2 = write_tiny_bundle(tmp_path / "b")
    for name in (TENSOR_FILE, MANIFEST_FILE):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    bundle = load_bundle(tmp_path / "a" / TENSOR_FILE)
    assert bundle.manifest == m1 == m2
    r = bundle.layer(1, "key_rotation")
    assert r.shape == (2, 8, 8) and r.dtype == torch.float32
    assert torch.allclose(r.mT @ r, torch.eye(8).expand(2, 8, 8), atol=1e-5)


def test_tampered_tensor_file_is_refused(tmp_path):
    write_tiny_bundle(tmp_path)
    data = bytearray((tmp_path / TENSOR_FILE).read_bytes())
    data[-3] ^= 0x01
    (tmp_path / TENSOR_FILE).write_bytes(bytes(data))
    with pytest.raises(OscarError, match="checksum mismatch"):
        load_bundle(tmp_path)


def edit_manifest(bundle_dir, section: str, key: str, value):
    """Rewrite one field of a written bundle's manifest, as a hand edit would; returns the manifest path."""
    path = bundle_dir / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    manifest[section][key] = value
    path.write_text(json.dumps(manifest))
    return path


def test_bad_manifests(tmp_path):
    write_tiny_bundle(tmp_path)
    path = edit_manifest(tmp_path, "quant", "bits", 4)
    with pytest.raises(OscarError, match="invalid manifest .*quant.bits"):
        read_manifest(tmp_path)
    path.write_text("{not json")
    with pytest.raises(OscarError, match="invalid manifest"):
        load_bundle(tmp_path)
    with pytest.raises(OscarError, match="bundle not found"):
        load_bundle(tmp_path / "nowhere")
    os.remove(path)
    with pytest.raises(OscarError, match="not a bundle"):
        load_bundle(tmp_path)


def test_manifest_that_lies_about_shapes(tmp_path):
    write_tiny_bundle(tmp_path)
    edit_manifest(tmp_path, "model", "num_layers", 3)
    with pytest.raises(OscarError, match="lacks tensor layers.2"):
        load_bundle(tmp_path)


def test_interrupted_write_leaves_the_old_bundle(tmp_path):
    write_tiny_bundle(tmp_path / "b")
    before = {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()}

    with pytest.raises(TypeError):
        atomic_write_dir(tmp_path / "b", {TENSOR_FILE: b"partial", MANIFEST_FILE: None})
    assert {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["b"]  # no temporary left behind
