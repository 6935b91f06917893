"""Hybrid models (Qwen3-Next: linear-attention layers between full-attention ones), end to end on a tiny random one.

Layers 0 and 2 are linear attention (no KV cache), 1 and 3 full attention: calibrate, export, verify, upstream
export / import / verify --compare and eval must see and rotate layers 1 and 3 only.
"""

import json
import math

import pytest
import torch
from conftest import calibrate_and_export, cli, run_cli, write_tokenizer_and_corpus
from safetensors import safe_open

from oscar_core.calibrate.models import attention_layer_ids, check_supported
from oscar_core.errors import OscarError
from oscar_core.formats.bundle import MANIFEST_FILE, TENSOR_FILE

ATTENTION_LAYERS = [1, 3]


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    """A 4-layer Qwen3-Next (linear, full, linear, full attention) with its own BPE tokenizer, in a directory."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    out = tmp_path_factory.mktemp("qwen3-next")
    vocab = write_tokenizer_and_corpus(out)
    torch.manual_seed(0)
    config = Qwen3NextConfig(vocab_size=vocab, num_hidden_layers=4, hidden_size=128,
                             intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                             shared_expert_intermediate_size=64, linear_num_value_heads=2, linear_num_key_heads=2,
                             linear_key_head_dim=32, linear_value_head_dim=32, full_attention_interval=2,
                             max_position_embeddings=512)
    assert attention_layer_ids(config) == ATTENTION_LAYERS
    Qwen3NextForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hybrid_bundle(hybrid_model, tmp_path_factory):
    """`oscar calibrate` and `oscar export` of the tiny hybrid model: (calibration directory, bundle directory)."""
    return calibrate_and_export(hybrid_model, tmp_path_factory.mktemp("hybrid-run"))


def test_export_rotates_only_the_attention_layers(hybrid_bundle):
    calib, bundle = hybrid_bundle
    assert json.loads((calib / "calibration.json").read_text())["attention_layers"] == ATTENTION_LAYERS
    manifest = json.loads((bundle / MANIFEST_FILE).read_text())
    assert manifest["rotation"]["layers"] == ATTENTION_LAYERS and manifest["model"]["num_layers"] == 4
    with safe_open(bundle / TENSOR_FILE, "pt") as f:
        names = list(f.keys())
        assert sorted({int(n.split(".")[1]) for n in names}) == ATTENTION_LAYERS
        assert {n.split(".", 2)[2] for n in names} == {"key_rotation", "value_rotation", "key_clip", "value_clip",
                                                       "key_mean"}
        r = f.get_tensor("layers.3.key_rotation").double()
    assert r.shape == (2, 64, 64) and torch.allclose(r @ r.mT, torch.eye(64, dtype=torch.float64), atol=1e-5)


def test_verify_measures_the_attention_layers(hybrid_model, hybrid_bundle, capfd, monkeypatch, tmp_path):
    """336 tokens: past the 64 sink and 256 recent BF16 tokens, so the end-to-end figures see INT2 keys and values."""
    _, bundle = hybrid_bundle
    code, out = run_cli(capfd, monkeypatch, "verify", str(bundle), "--model", str(hybrid_model), "--device", "cpu",
                        "--data", str(hybrid_model / "corpus.txt"), "--seq-len", "336", "--json",
                        str(tmp_path / "report.json"))
    assert code == 0, out
    assert "layers match the model's attention layers: layers 1, 3" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert sorted({row["layer"] for row in report["layers"]}) == ATTENTION_LAYERS and len(report["layers"]) == 4
    for name, value in report["mean"].items():
        assert math.isfinite(value) and 0 < value < 1, name
    e2e = report["end_to_end"]
    assert math.isfinite(e2e["kl"]) and e2e["kl"] >= 0 and 0.5 < e2e["top1_agreement"] <= 1


def test_upstream_round_trip_compares_with_ours(hybrid_model, hybrid_bundle, capfd, monkeypatch, tmp_path):
    calib, bundle = hybrid_bundle
    code, out = run_cli(capfd, monkeypatch, "upstream", "export", str(bundle), "--calibration", str(calib),
                        "--out", str(tmp_path / "up"))
    assert code == 0, out
    (directory,) = (tmp_path / "up").glob("*/seq*_prompt*_group*")
    key_file = torch.load(directory / "k_rotation_qqt_r_h_pbr.pt", weights_only=True)
    assert sorted(key_file["layers"]) == ATTENTION_LAYERS
    code, out = run_cli(capfd, monkeypatch, "upstream", "import", str(directory), "--out", str(tmp_path / "imported"),
                        "--model", str(hybrid_model))
    assert code == 0, out
    (imported,) = (tmp_path / "imported").glob("*/*/upstream-*")
    assert json.loads((imported / MANIFEST_FILE).read_text())["rotation"]["layers"] == ATTENTION_LAYERS
    code, out = run_cli(capfd, monkeypatch, "verify", str(bundle), "--compare", str(imported), "--model",
                        str(hybrid_model), "--device", "cpu", "--data", str(hybrid_model / "corpus.txt"),
                        "--seq-len", "128", "--json", str(tmp_path / "report.json"))
    assert code == 1 and "nothing is quantized at 128 tokens" in out, out   # the report is written all the same
    assert "compared: layers match the model's attention layers: layers 1, 3" in out
    theirs = json.loads((tmp_path / "report.json").read_text())["compare"]
    assert sorted({row["layer"] for row in theirs["layers"]}) == ATTENTION_LAYERS
    assert all(math.isfinite(v) and 0 < v < 1 for v in theirs["mean"].values())


def test_verify_refuses_a_bundle_of_other_layers(hybrid_model, hybrid_bundle, capfd, monkeypatch, tmp_path):
    from oscar_core.formats.bundle import load_bundle, write_bundle

    b = load_bundle(hybrid_bundle[1])
    quant = b.manifest.quant.model_copy(update={"layers": [e for e in b.manifest.quant.layers or () if e.layer == 1]})
    m = b.manifest.model_copy(update={"rotation": b.manifest.rotation.model_copy(update={"layers": [1]}),
                                      "quant": quant})
    write_bundle(tmp_path / "b", m, {k: v for k, v in b.tensors.items() if k.startswith("layers.1.")})
    code, out = run_cli(capfd, monkeypatch, "verify", str(tmp_path / "b"), "--model", str(hybrid_model),
                        "--device", "cpu", "--seq-len", "64", "--data", str(hybrid_model / "corpus.txt"))
    assert code == 1 and "the bundle rotates layers 1, the model's attention layers are layers 1, 3" in out


def test_eval_runs_through_the_hybrid_cache(hybrid_model, hybrid_bundle, capfd, monkeypatch, tmp_path):
    _, bundle = hybrid_bundle
    code, out = run_cli(capfd, monkeypatch, "eval", str(bundle), "--model", str(hybrid_model), "--device", "cpu",
                        "--data", str(hybrid_model / "corpus.txt"), "--context", "256", "--samples", "1",
                        "--methods", "bf16,oscar", "--depths", "0.5", "--needle-trials", "2", "--batch", "2",
                        "--json", str(tmp_path / "eval.json"))
    assert code == 0, out
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["batch"] == 2 and report["needle_prompts"] == {"256": {"0.5": 2}}  # answered one at a time
    assert all(math.isfinite(report["perplexity"][m]["256"]) for m in ("bf16", "oscar"))
    assert report["memory"]["oscar"]["tokens"] > 0 and report["memory"]["oscar"]["bytes"] > 0


def test_decode_continues_the_prefill_of_every_layer(hybrid_model):
    """fill() writes an exact prefill into an OscarCache: KV layers through the method (here nothing is INT2 yet, the
    tokens sit in the BF16 sink), the linear-attention layers' states copied. The next token's logits then match an
    uninterrupted forward up to the BF16 rounding of K/V; with the linear states left empty they do not."""
    from transformers import AutoModelForCausalLM

    from oscar_core.serve.cache import OscarCache, OscarLayer, exact_cache, fill, state_layer

    model = AutoModelForCausalLM.from_pretrained(hybrid_model, dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference = model(input_ids=ids, use_cache=False).logits[0, -1]
        like = OscarCache(None, "int2", config=model.config)
        assert [isinstance(layer, OscarLayer) for layer in like.layers] == [False, True, False, True]
        prefill = exact_cache(like)
        model(input_ids=ids[:, :-1], past_key_values=prefill, use_cache=True)

        def next_logits(cache):
            return model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True).logits[0, -1]

        filled = fill(OscarCache(None, "int2", config=model.config), prefill)
        continued = next_logits(filled)
        assert filled.get_seq_length() == 40
        empty = fill(OscarCache(None, "int2", config=model.config), prefill)
        empty.layers[0], empty.layers[2] = state_layer(), state_layer()
        forgetful = next_logits(empty)
        again = next_logits(fill(OscarCache(None, "int2", config=model.config), prefill))  # prefill left unchanged
    scale = reference.abs().max()
    assert (continued - reference).abs().max() < 0.02 * scale
    assert (again - continued).abs().max() == 0
    assert (forgetful - reference).abs().max() > 5 * (continued - reference).abs().max()


def test_model_without_attention_layers_is_refused(capfd, monkeypatch, tmp_path):
    from transformers import MambaConfig

    MambaConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, state_size=8,
                architectures=["MambaForCausalLM"]).save_pretrained(tmp_path / "m")
    code, out = run_cli(capfd, monkeypatch, "calibrate", str(tmp_path / "m"), "--out", str(tmp_path / "c"),
                        "--device", "cpu")
    assert code == 1 and "Traceback" not in out
    assert [line for line in out.splitlines() if "error" in line] == [
        "error: unsupported architecture MambaForCausalLM: none of its layers is an attention layer, "
        "so it has no KV cache to rotate"], out


def test_check_supported_accepts_hybrid_attention(hybrid_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hybrid_model)
    assert not model._supports_attention_backend  # transformers marks the hybrid unsupported as a whole
    check_supported(model)
    model.config.layer_types = ["linear_attention"] * 4
    with pytest.raises(OscarError, match="none of its layers is an attention layer"):
        check_supported(model)
