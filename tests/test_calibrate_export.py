"""calibrate → export on the real default model, resumability, determinism, and the export's refusals."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from oscar_core.calibrate.calibration import STATISTICS_FILE, CalibrationRequest, calibrate
from oscar_core.calibrate.export import export_bundle
from oscar_core.errors import OscarError
from oscar_core.formats.bundle import load_bundle
from oscar_core.rotations import orthogonality_error

REQUEST = CalibrationRequest(samples=3, seq_len=128, batch_size=1, seed=0)


class Interrupt(Exception):
    pass


@pytest.fixture(scope="module")
def calibrated(default_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("calib")
    record = calibrate(REQUEST, out, loaded=default_model)
    return out, record


@pytest.mark.slow
def test_calibration_record(calibrated, default_model):
    out, record = calibrated
    assert record["complete"] and record["samples_done"] == 3 and record["tokens"] == 384
    assert record["model"]["num_layers"] == 30 and record["model"]["num_kv_heads"] == 3
    assert record["model"]["file_sha256"] == default_model.info.file_sha256
    assert len(record["data"]["fingerprint"]) == 64 and record["timings"]["forward_s"] > 0
    on_disk = json.loads((out / "calibration.json").read_text())
    assert on_disk["samples_done"] == 3


@pytest.mark.slow
def test_resume_gives_the_same_statistics(calibrated, default_model, tmp_path):
    out, _ = calibrated

    def stop_after_two(done, total, rate):
        if done == 2:
            raise Interrupt

    with pytest.raises(Interrupt):
        calibrate(REQUEST, tmp_path, on_progress=stop_after_two, loaded=default_model)
    assert not json.loads((tmp_path / "calibration.json").read_text())["complete"]
    with pytest.raises(OscarError, match="incomplete"):
        export_bundle(tmp_path, tmp_path / "zoo")
    seen = []
    calibrate(REQUEST, tmp_path, on_progress=lambda d, t, r: seen.append(d), loaded=default_model)
    assert seen == [3]  # only the missing sample ran
    a, b = load_file(out / STATISTICS_FILE), load_file(tmp_path / STATISTICS_FILE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = CalibrationRequest(samples=3, seq_len=128, seed=1)
    with pytest.raises(OscarError, match="holds a calibration of other inputs"):
        calibrate(other, tmp_path, loaded=default_model)


@pytest.mark.slow
def test_export_is_orthogonal_deterministic_and_loadable(calibrated, tmp_path):
    out, _ = calibrated
    path, manifest = export_bundle(out, tmp_path / "a")
    path2, _ = export_bundle(out, tmp_path / "b")
    for name in ("rotations.safetensors", "manifest.json"):
        assert (path / name).read_bytes() == (path2 / name).read_bytes()
    assert path == tmp_path / "a" / "HuggingFaceTB" / "SmolLM2-135M-Instruct" / "v1"
    bundle = load_bundle(path)
    for i in range(30):
        for side in ("key", "value"):
            r = bundle.layer(i, f"{side}_rotation")
            assert r.shape == (3, 64, 64) and orthogonality_error(r) < 1e-5
            clip = bundle.layer(i, f"{side}_clip")
            assert ((clip > 0.4) & (clip <= 1)).all()
        assert bundle.layer(i, "key_mean").shape == (3, 64)
    assert manifest.quant.bits_per_element["131072"] <= 2.3
    assert manifest.calibration.samples == 3 and manifest.rotation.key == "U_Q·H·P_br"


@pytest.mark.slow
def test_export_copies_manifest_for_the_repo_zoo(calibrated, tmp_path):
    out, _ = calibrated
    (tmp_path / "manifests").mkdir()
    path, _ = export_bundle(out, tmp_path / "zoo", version="v9")
    copy = tmp_path / "manifests" / "HuggingFaceTB" / "SmolLM2-135M-Instruct" / "v9.json"
    assert copy.read_bytes() == (path / "manifest.json").read_bytes()


@pytest.mark.slow
def test_export_refuses_nan_statistics(calibrated, tmp_path):
    out, _ = calibrated
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    stats = load_file(bad / STATISTICS_FILE)
    stats["output_cov"][4, 1, 2, 3] = float("nan")
    save_file(stats, bad / STATISTICS_FILE, metadata={"samples_done": "3"})
    with pytest.raises(OscarError, match="NaN or Inf .*output_cov"):
        export_bundle(bad, tmp_path / "zoo")
    assert not (tmp_path / "zoo").exists()


def test_export_refuses_missing_and_foreign_directories(tmp_path):
    with pytest.raises(OscarError, match="not found"):
        export_bundle(tmp_path / "nothing", tmp_path / "zoo")
    with pytest.raises(OscarError, match="not a calibration directory"):
        export_bundle(tmp_path, tmp_path / "zoo")
