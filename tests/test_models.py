"""Model loading: the embedded GGUF, a local directory, a hub id served from the local hub cache, bad specs."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import tiny_model

from oscar_core.calibrate.calibration import CalibrationRequest, calibrate
from oscar_core.calibrate.models import DEFAULT_MODEL_ID, resolve
from oscar_core.errors import OscarError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama saved as a model directory, with the default model's real tokenizer."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    src, kwargs, _ = resolve(None)
    tokenizer = AutoTokenizer.from_pretrained(src, **kwargs)
    model = tiny_model("llama")
    model.resize_token_embeddings(len(tokenizer))
    model.config.max_position_embeddings = 256
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_resolve_kinds(tmp_path):
    source, kwargs, weights = resolve(None)
    assert kwargs["gguf_file"].endswith(".gguf") and weights.endswith(".gguf")
    assert resolve("Qwen/Qwen3-8B") == ("Qwen/Qwen3-8B", {}, None)
    with pytest.raises(OscarError, match="model path not found"):
        resolve(str(tmp_path / "x" / "y"))
    (tmp_path / "weights.bin").write_bytes(b"0")
    with pytest.raises(OscarError, match="not a model"):
        resolve(str(tmp_path / "weights.bin"))


def test_hub_id_from_the_local_cache(tiny_dir, tmp_path):
    """A hub id resolves through huggingface_hub's cache (HF_HUB_OFFLINE=1): the path a networked user takes."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--oscar-test--tiny-llama"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in tiny_dir.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 200)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "calib"
    result = subprocess.run([sys.executable, "-c", "from oscar_cli.app import main; main()", "calibrate",
                             "oscar-test/tiny-llama", "--data", str(tmp_path / "text.txt"), "--samples", "2",
                             "--seq-len", "64", "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    import json

    record = json.loads((out / "calibration.json").read_text())
    assert record["model"]["id"] == "oscar-test/tiny-llama" and record["model"]["revision"] == commit
    assert record["complete"] and record["model"]["num_kv_heads"] == 2
    missing = subprocess.run([sys.executable, "-c", "from oscar_cli.app import main; main()", "calibrate",
                              "oscar-test/absent", "--out", str(tmp_path / "x")], env=env, capture_output=True,
                             text=True, timeout=600)
    assert missing.returncode == 1 and "cannot load model oscar-test/absent" in missing.stderr
    assert "Traceback" not in missing.stderr and not (tmp_path / "x").exists()


def test_local_directory_and_limits(tiny_dir, tmp_path):
    from oscar_core.calibrate.models import load_model

    loaded = load_model(str(tiny_dir))
    assert loaded.info.id == tiny_dir.name and loaded.info.file_sha256 and loaded.info.num_heads == 4
    with pytest.raises(OscarError, match="above the model's limit of 256"):
        calibrate(CalibrationRequest(model=str(tiny_dir), seq_len=512, samples=1), tmp_path / "c", loaded=loaded)
    assert not (tmp_path / "c").exists()
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(OscarError, match="holds no text"):
        calibrate(CalibrationRequest(data=str(tmp_path / "empty.txt"), seq_len=64, samples=1), tmp_path / "c",
                  loaded=loaded)
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
def test_default_model_facts(default_model):
    info = default_model.info
    assert info.id == DEFAULT_MODEL_ID and info.architecture == "LlamaForCausalLM"
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (30, 9, 3, 64)
    assert info.max_position_embeddings == 8192 and len(info.file_sha256) == 64
    ids = default_model.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = default_model.model(ids).logits
    assert torch.isfinite(logits).all()
