"""OscarCache decode steps read by the Triton decode kernel (oscar_attention) against the torch read.

Run on the CPU through Triton's interpreter (see tests/test_triton_kernels.py for the import dance)."""

import importlib
import os
import sys
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from oscar_core.cache import OscarCache, oscar_attention  # noqa: E402
from oscar_core.triton import decode  # noqa: E402

if not torch.cuda.is_available() and not isinstance(decode._split_kernel, triton.runtime.interpreter.InterpretedFunction):
    importlib.reload(sys.modules["oscar_core.triton.decode"])

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 64


def tiny_llama():
    import transformers as tf

    config = tf.LlamaConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                            num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=256,
                            max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().to(DEVICE)


def random_bundle(sink, recent):
    """The fields of a rotation bundle that OscarCache reads: random rotations, means and clips."""
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for i in range(LAYERS):
        for side, clip in (("key", 0.9), ("value", 0.95)):
            rot = torch.randn(KV_HEADS, HEAD_DIM, HEAD_DIM, generator=gen, dtype=torch.float64)
            tensors[f"layers.{i}.{side}_rotation"] = torch.linalg.qr(rot)[0].float()
            tensors[f"layers.{i}.{side}_mean"] = 0.1 * torch.randn(KV_HEADS, HEAD_DIM, generator=gen)
            tensors[f"layers.{i}.{side}_clip"] = torch.full((KV_HEADS,), clip)
    manifest = SimpleNamespace(
        name="random", model=SimpleNamespace(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM),
        quant=SimpleNamespace(key_group_size=64, value_group_size=64, sink_tokens=sink, recent_tokens=recent))
    return SimpleNamespace(manifest=manifest, layer=lambda i, name: tensors.get(f"layers.{i}.{name}"))


@torch.no_grad()
def decode_logits(model, cache, ids, steps):
    """Logits of the prompt's last token and of `steps` teacher-forced greedy tokens of the torch read."""
    out = [model(ids, past_key_values=cache).logits[:, -1]]
    for t in range(steps):
        out.append(model(ids[:, -1:] * 0 + t + 3, past_key_values=cache).logits[:, -1])
    return torch.stack(out, 1)


@pytest.mark.parametrize("method", ["oscar", "hadamard"])
def test_kernel_reads_match_torch_reads(method):
    model = tiny_llama()
    sink, recent = 4, 16
    bundle = random_bundle(sink, recent) if method == "oscar" else None
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    torch_cache = OscarCache(bundle, method, num_layers=LAYERS, sink_tokens=sink, recent_tokens=recent,
                             kernel_reads=False)
    want = decode_logits(model, torch_cache, ids, steps=4)
    kernel_cache = OscarCache(bundle, method, num_layers=LAYERS, sink_tokens=sink, recent_tokens=recent,
                              kernel_reads=True)
    calls = []
    real = kernel_cache.layers[0].decode_attention
    kernel_cache.layers[0].decode_attention = lambda *a: calls.append(1) or real(*a)
    with oscar_attention(model, kernel_cache):
        got = decode_logits(model, kernel_cache, ids, steps=4)
    assert len(calls) == 4                                         # every decode step of layer 0 read by kernel
    assert kernel_cache.get_seq_length() == 44 and kernel_cache.layers[0].key_store.n_int2 == 44 - sink - recent
    assert model.config._attn_implementation == "sdpa"             # restored
    assert torch.equal(got[:, 0], want[:, 0])                       # prefill: exact sdpa on both
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert err.max() < 2e-2, err


def test_kernel_reads_fall_back():
    model = tiny_llama()
    cache = OscarCache(None, "kivi", num_layers=LAYERS, sink_tokens=4, recent_tokens=16, kernel_reads=True)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with oscar_attention(model, cache):
        decode_logits(model, cache, ids, steps=1)
    assert "per-token" in cache.layers[0].kernel_problem and not cache.layers[0].deferred
    off = OscarCache(None, "int2", num_layers=LAYERS, kernel_reads=False)
    with oscar_attention(model, off):
        assert model.config._attn_implementation == "sdpa"         # nothing routed
