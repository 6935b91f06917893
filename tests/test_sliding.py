"""Sliding-window models end to end on a tiny random Gemma 3 (layers 0 and 2 slide over 8 tokens, layer 1 is global):
calibrate, export, verify and eval; the short windows are kept whole in BF16, so only layer 1 is rotated."""

import json
import math

import pytest
import torch
from conftest import calibrate_and_export, cli, run_cli, tiny_sliding_model, write_tokenizer_and_corpus
from safetensors import safe_open

from oscar_core.formats.bundle import MANIFEST_FILE, TENSOR_FILE


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3")
    vocab = write_tokenizer_and_corpus(out)
    model = tiny_sliding_model("gemma3", 8)
    model.resize_token_embeddings(vocab)
    model.config.max_position_embeddings = 512
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def gemma_bundle(gemma_dir, tmp_path_factory):
    return calibrate_and_export(gemma_dir, tmp_path_factory.mktemp("gemma3-run"))


def test_export_rotates_only_the_layers_holding_int2(gemma_bundle):
    calib, bundle = gemma_bundle
    record = json.loads((calib / "calibration.json").read_text())
    assert record["windows"] == {"0": 8, "2": 8} and "attention_layers" not in record
    rotation = json.loads((bundle / MANIFEST_FILE).read_text())["rotation"]
    assert rotation["layers"] == [1] and rotation["windows"] == {"0": 8, "2": 8}
    assert rotation["layers_reason"].startswith("layers 0, 2 attend to a sliding window of 8 tokens, kept whole")
    with safe_open(bundle / TENSOR_FILE, "pt") as f:
        assert {int(n.split(".")[1]) for n in f.keys()} == {1}


def test_verify_and_eval_on_the_sliding_model(gemma_dir, gemma_bundle, capfd, monkeypatch, tmp_path):
    _, bundle = gemma_bundle
    data = str(gemma_dir / "corpus.txt")
    code, out = run_cli(capfd, monkeypatch, "verify", str(bundle), "--model", str(gemma_dir), "--device", "cpu",
                        "--data", data, "--seq-len", "336", "--json", str(tmp_path / "verify.json"))
    assert code == 0, out
    assert "layers match the model's attention layers: layers 1" in out
    report = json.loads((tmp_path / "verify.json").read_text())
    assert {row["layer"] for row in report["layers"]} == {1}
    assert 0 <= report["end_to_end"]["kl"] < 1
    code, out = run_cli(capfd, monkeypatch, "eval", str(bundle), "--model", str(gemma_dir), "--device", "cpu",
                        "--data", data, "--context", "256", "--samples", "1", "--methods", "bf16,oscar",
                        "--depths", "0.5", "--json", str(tmp_path / "eval.json"))
    assert code == 0, out
    report = json.loads((tmp_path / "eval.json").read_text())
    assert all(math.isfinite(report["perplexity"][m]["256"]) for m in ("bf16", "oscar"))
    # BF16 perplexity is the model's own on the same window.
    from oscar_core.calibrate.models import load_model
    from oscar_core.evaluate.perplexity import heldout_tokens, negative_log_likelihood

    loaded = load_model(str(gemma_dir), "cpu", "float32")
    ids = heldout_tokens(data, loaded.tokenizer, 256)[None]
    nll, n = negative_log_likelihood(loaded.model, ids)
    assert abs(report["perplexity"]["bf16"]["256"] / math.exp(nll / n) - 1) < 1e-3
    # Memory: the two rings hold 8 tokens each (2 sides, 2 KV heads, d 16, BF16) besides layer 1's store.
    assert report["memory"]["bf16"]["bytes"] < report["memory"]["bf16"]["tokens"] * 2 * 2 * 16 * 2 * 3


def test_a_bundle_of_other_windows_is_refused(gemma_dir, gemma_bundle, capfd, monkeypatch, tmp_path):
    from oscar_core.formats.bundle import load_bundle, write_bundle

    b = load_bundle(gemma_bundle[1])
    rotation = b.manifest.rotation.model_copy(update={"windows": {"0": 16, "2": 16}})
    write_bundle(tmp_path / "b", b.manifest.model_copy(update={"rotation": rotation}), b.tensors)
    code, out = run_cli(capfd, monkeypatch, "verify", str(tmp_path / "b"), "--model", str(gemma_dir),
                        "--device", "cpu", "--seq-len", "64", "--data", str(gemma_dir / "corpus.txt"))
    assert code == 1 and "sliding windows are {'0': 16, '2': 16}, the model's {'0': 8, '2': 8}" in out


def test_export_refuses_a_model_with_no_int2_layer(tmp_path, capfd, monkeypatch):
    """Mistral sliding over 8 tokens in every layer: nothing would hold INT2, so there is nothing to export."""
    vocab = write_tokenizer_and_corpus(tmp_path)
    model = tiny_sliding_model("mistral", 8)
    model.resize_token_embeddings(vocab)
    model.save_pretrained(tmp_path)
    cli("calibrate", str(tmp_path), "--out", str(tmp_path / "calib"), "--data", str(tmp_path / "corpus.txt"),
        "--samples", "1", "--seq-len", "32", "--device", "cpu", "--dtype", "float32")
    code, out = run_cli(capfd, monkeypatch, "export", str(tmp_path / "calib"), "--out", str(tmp_path / "zoo"))
    assert code == 1 and "Traceback" not in out and not (tmp_path / "zoo").exists()
    assert "holds INT2 tokens: layers 0, 1, 2 attend to a sliding window of 8 tokens" in out


def test_unmodelled_attention_is_refused_at_calibrate(tmp_path, capfd, monkeypatch):
    from transformers import Gemma2Config

    Gemma2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16,
                 architectures=["Gemma2ForCausalLM"]).save_pretrained(tmp_path / "m")
    code, out = run_cli(capfd, monkeypatch, "calibrate", str(tmp_path / "m"), "--out", str(tmp_path / "c"),
                        "--device", "cpu")
    assert code == 1 and "Traceback" not in out and not (tmp_path / "c").exists()
    assert [line for line in out.splitlines() if "error" in line] == [
        "error: unsupported architecture Gemma2ForCausalLM: it uses attention-logit soft-capping (50.0), "
        "which oscar does not model"], out


@pytest.mark.slow
def test_simulated_bf16_equals_the_default_models_forward(default_model):
    """The real default model (global attention): simulate's bf16 arm is its forward up to BF16 rounding of K, V."""
    from oscar_core.serve.simulate import simulate_int2

    model = default_model.model
    ids = torch.randint(0, model.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = model(ids).logits
        with simulate_int2(model, "bf16"):
            got = model(ids).logits
    assert float((got - want).abs().max() / want.abs().max()) < 2e-2
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) > 0.95


def test_long_window_model_end_to_end(tmp_path, capfd, monkeypatch):
    """Mistral sliding over 650 tokens in every layer: longer than 2·(64 + 256), so every layer holds INT2 (the
    manifest lists no layers, only the windows); verify and eval at 700 tokens read each query's window."""
    vocab = write_tokenizer_and_corpus(tmp_path)
    model = tiny_sliding_model("mistral", 650)
    model.resize_token_embeddings(vocab)
    model.config.max_position_embeddings = 1024
    model.save_pretrained(tmp_path)
    data = str(tmp_path / "corpus.txt")
    cli("calibrate", str(tmp_path), "--out", str(tmp_path / "calib"), "--data", data, "--samples", "1",
        "--seq-len", "32", "--device", "cpu", "--dtype", "float32")
    cli("export", str(tmp_path / "calib"), "--out", str(tmp_path / "zoo"), "--workers", "1")
    bundle = tmp_path / "zoo" / "local" / tmp_path.name / "v1"
    rotation = json.loads((bundle / MANIFEST_FILE).read_text())["rotation"]
    assert "layers" not in rotation and "layers_reason" not in rotation
    assert rotation["windows"] == {"0": 650, "1": 650, "2": 650}
    code, out = run_cli(capfd, monkeypatch, "verify", str(bundle), "--model", str(tmp_path), "--device", "cpu",
                        "--data", data, "--seq-len", "700")
    assert code == 0, out
    code, out = run_cli(capfd, monkeypatch, "eval", str(bundle), "--model", str(tmp_path), "--device", "cpu",
                        "--data", data, "--context", "700", "--samples", "1", "--methods", "bf16,oscar",
                        "--depths", "0.5", "--json", str(tmp_path / "eval.json"))
    assert code == 0, out
    report = json.loads((tmp_path / "eval.json").read_text())
    from oscar_core.calibrate.models import load_model
    from oscar_core.evaluate.perplexity import heldout_tokens, negative_log_likelihood

    loaded = load_model(str(tmp_path), "cpu", "float32")
    nll, n = negative_log_likelihood(loaded.model, heldout_tokens(data, loaded.tokenizer, 700)[None])
    assert abs(report["perplexity"]["bf16"]["700"] / math.exp(nll / n) - 1) < 1e-3
    assert report["memory"]["oscar"]["tokens"] > 650   # seen; the stores hold the last 649


def test_upstream_round_trip_keeps_the_windows(gemma_dir, gemma_bundle, capfd, monkeypatch, tmp_path):
    calib, bundle = gemma_bundle
    code, out = run_cli(capfd, monkeypatch, "upstream", "export", str(bundle), "--calibration", str(calib),
                        "--out", str(tmp_path / "up"))
    assert code == 0, out
    (directory,) = (tmp_path / "up").glob("*/seq*_prompt*_group*")
    code, out = run_cli(capfd, monkeypatch, "upstream", "import", str(directory), "--out", str(tmp_path / "imported"),
                        "--model", str(gemma_dir))
    assert code == 0, out
    (imported,) = (tmp_path / "imported").glob("*/*/upstream-*")
    ours = json.loads((bundle / MANIFEST_FILE).read_text())["rotation"]
    theirs = json.loads((imported / MANIFEST_FILE).read_text())["rotation"]
    assert {k: theirs[k] for k in ("layers", "windows", "layers_reason")} == \
        {k: ours[k] for k in ("layers", "windows", "layers_reason")}
    code, out = run_cli(capfd, monkeypatch, "verify", str(bundle), "--compare", str(imported), "--model",
                        str(gemma_dir), "--device", "cpu", "--data", str(gemma_dir / "corpus.txt"), "--seq-len", "64")
    assert code == 1 and "nothing is quantized at 64 tokens" in out, out   # the comparison is printed all the same


def test_bf16_needle_decoding_equals_generate(gemma_dir, gemma_bundle):
    """eval's needle path for the bf16 method (exact prefill, written into an OscarCache, decoded on) answers as
    transformers' generate does, on a prompt 12 times the window; it hands the model its cache by the keyword this
    transformers takes (no deprecation warning: `past_key_values` is removed from forward in 5.40)."""
    import warnings

    from oscar_core.calibrate.models import load_model
    from oscar_core.evaluate.perplexity import ANSWER_TOKENS, greedy_answers
    from oscar_core.formats.bundle import load_bundle

    loaded = load_model(str(gemma_dir), "cpu", "float32")
    bundle = load_bundle(gemma_bundle[1])
    prompt = torch.randint(3, 200, (96,), generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (text, tokens, nbytes, _), = greedy_answers(loaded.model, loaded.tokenizer, prompt, ["bf16"], bundle,
                                                    3).values()
    assert not [w for w in caught if "past_key_values" in str(w.message)]
    with torch.inference_mode():
        ids = prompt[None]
        want = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=ANSWER_TOKENS,
                                     do_sample=False, pad_token_id=loaded.tokenizer.eos_token_id)
    assert text == loaded.tokenizer.decode(want[0, 96:], skip_special_tokens=True)
    assert tokens == 96 + ANSWER_TOKENS - 1


def test_bits_per_element_are_the_measured_bytes_per_layer_type(gemma_bundle):
    """The bits a sliding model's cache reports are 16 · its bytes / the BF16 cache's bytes of the same tokens: a
    window layer counts the window it holds, in the cache's figure and in BF16's (not the context)."""
    from oscar_core.formats.bundle import load_bundle
    from oscar_core.serve import methods
    from oscar_core.serve.cache import OscarCache

    bundle = load_bundle(gemma_bundle[1])
    m = bundle.manifest.model
    for method in ("oscar", "kivi"):
        cache = OscarCache(bundle, method)
        gen = torch.Generator().manual_seed(0)
        for layer in range(m.num_layers):
            k, v = (torch.randn(1, m.num_kv_heads, 4000, m.head_dim, generator=gen) for _ in range(2))
            cache.update(k, v, layer)
        measured = 16 * cache.nbytes() / cache.bf16_nbytes()
        accounted = methods.bits_per_element(method, 4000, bundle)
        assert abs(measured - accounted) / accounted < 0.03, (method, measured, accounted)  # capacity rounding
        # Windows of 8 kept in BF16 and no sink: kivi's a ring of 8 tokens, oscar's a store of 8 slots.
        sliding = methods.bits_per_element(method, 4000, bundle, "sliding")
        assert sliding == 16.0
        assert 4 < methods.bits_per_element(method, 4000, bundle, "global") < 4.1   # head_dim 16: groups of 16
        assert accounted < 5   # not the sliding layers' 8 tokens counted over the context


def test_a_left_padded_batch_answers_as_each_prompt_alone(gemma_dir, gemma_bundle):
    """Sliding layers in a left-padded batch (bf16's and kivi's BF16 rings, oscar's window stores; windows of 8,
    prompts 50 to 59 times that; the global layer holds INT2 tokens past its sink of 64 and 256 recent):
    batch_answers gives each prompt the answer and cached tokens it gets alone (with the pads written as tokens,
    it did not)."""
    from oscar_core.calibrate.models import load_model
    from oscar_core.evaluate.perplexity import batch_answers, greedy_answers
    from oscar_core.formats.bundle import load_bundle

    loaded = load_model(str(gemma_dir), "cpu", "float32")
    bundle, names = load_bundle(gemma_bundle[1]), ["bf16", "kivi", "oscar"]
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 200, (n,), generator=gen) for n in (470, 400, 433)]
    together = batch_answers(loaded.model, loaded.tokenizer, prompts, names, bundle, 3)
    for p, got in zip(prompts, together):
        alone = greedy_answers(loaded.model, loaded.tokenizer, p, names, bundle, 3)
        assert {m: got[m][:2] for m in names} == {m: alone[m][:2] for m in names}
