from pathlib import Path

import pytest
import torch

from oscar_core import methods
from oscar_core.bundle import load_bundle
from oscar_core.cache import OscarCache, OscarLayer
from oscar_core.errors import OscarError

BUNDLE = Path(__file__).resolve().parents[1] / "zoo/HuggingFaceTB/SmolLM2-135M-Instruct/v1"


def kv(t, seed=0, heads=3, d=64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, t, d, generator=g), torch.randn(1, heads, t, d, generator=g)


@pytest.mark.parametrize("method", ["int2", "hadamard", "kivi"])
def test_layer_layout_and_measured_bytes(method):
    layer = OscarLayer(method, 0, None, sink=64, recent=256)
    k, v = kv(1000)
    out_k, out_v = layer.update(k, v)
    assert torch.equal(out_k, k) and torch.equal(out_v, v)              # prefill attends in flight
    for _ in range(3):
        out_k, _ = layer.update(*kv(1, seed=7))
    assert layer.get_seq_length() == 1003 and out_k.shape == (1, 3, 1003, 64)
    ks = layer.key_store
    block = 64 if method == "kivi" else 1
    assert ks.sink.shape[2] == 64 and ks.recent.shape[2] >= 256 and ks.recent.shape[2] < 256 + block
    assert ks.n_int2 == 1003 - 64 - ks.recent.shape[2]
    # The sink is exact (BF16) and the INT2 tokens are the method's write path of their BF16 copy.
    assert torch.equal(out_k[:, :, :64], k[:, :, :64].bfloat16().float())
    side = methods.layer_method(method, 0, 3, 64).key
    n = ks.n_int2
    expected = methods.fake(side, k[:, :, 64:64 + n].bfloat16().float())
    assert torch.allclose(out_k[:, :, 64:64 + n], expected, atol=1e-5)
    # Bytes: BF16 windows plus 2.25 bits per INT2 element (codes + one scale and zero byte per 64).
    stores = (layer.key_store, layer.value_store)
    assert layer.nbytes() == sum((64 + s.recent.shape[2]) * 3 * 64 * 2 + s.n_int2 * 3 * (16 + 2) for s in stores)


def test_cache_bytes_against_bf16():
    cache = OscarCache(None, "int2", num_layers=2)
    for i in range(2):
        cache.update(*kv(4096, seed=i), i)
    ratio = cache.bf16_nbytes() / cache.nbytes()
    assert cache.bf16_nbytes() == 2 * 2 * 3 * 4096 * 64 * 2
    assert 4.5 < ratio < 16 / methods.bits_per_element("int2", 4096) + 1e-6
    assert abs(16 / ratio - methods.bits_per_element("int2", 4096)) < 1e-9   # measured = accounted


def test_bad_inputs():
    with pytest.raises(OscarError, match="bundle"):
        OscarCache(None, "oscar", num_layers=2)
    with pytest.raises(OscarError, match="num_layers"):
        OscarCache(None, "int2")
    bundle = load_bundle(BUNDLE)
    layer = OscarCache(bundle, "oscar").layers[0]
    with pytest.raises(OscarError, match="KV heads"):
        layer.update(*kv(10, heads=2, d=64))


def chat_ids(tokenizer, question):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_tensors="pt")
    return ids if torch.is_tensor(ids) else ids["input_ids"]


@pytest.mark.slow
def test_generate_with_oscar_cache_answers_like_bf16(default_model):
    """Greedy chat answers through the INT2 cache (4 sink + 16 recent BF16 tokens, so the prompt's middle is INT2)."""
    model, tok = default_model.model, default_model.tokenizer
    bundle = load_bundle(BUNDLE)
    ids = chat_ids(tok, "What is the capital of France? Answer in one word.")
    assert ids.shape[1] > 24
    answers = {}
    for method in ("bf16", "oscar"):
        cache = OscarCache(bundle, method, sink_tokens=4, recent_tokens=16)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=8,
                             do_sample=False, pad_token_id=tok.eos_token_id)
        answers[method] = out[0, ids.shape[1]:]
        assert cache.get_seq_length() == ids.shape[1] + len(answers[method]) - 1
        if method == "oscar":
            assert cache.bf16_nbytes() / cache.nbytes() > 1.5
    assert "Paris" in tok.decode(answers["bf16"])
    assert "Paris" in tok.decode(answers["oscar"])
    assert torch.equal(answers["oscar"][:3], answers["bf16"][:3])
