import pytest
import torch

from oscar_core.serve import methods
from oscar_core.serve.cache import OscarLayer
from oscar_core.serve.simulate import simulated_attention
from test_methods import oscar_side

SINK, RECENT = 4, 16


def layer_methods(heads=3, d=64):
    return {"bf16": methods.LayerMethod(None, None),
            "int2": methods.LayerMethod(methods.Side(64), methods.Side(64)),
            "kivi": methods.LayerMethod(methods.Side(8, axis="channel"), methods.Side(64)),
            "oscar": methods.LayerMethod(oscar_side(heads, d, 1), oscar_side(heads, d, 2))}


def qkv(t=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 6, t, 64, generator=g)
    k = torch.randn(1, 3, t, 64, generator=g) * torch.linspace(0.2, 3, 64)
    v = torch.randn(1, 3, t, 64, generator=g)
    return q, k, v


def brute_force(q, k, v, lm, scaling, window=None):
    """Per query p: build each key and value as the cache holds it, then softmax attention over the keys p sees
    (0..p, or p − window + 1..p)."""
    t = k.shape[2]
    k_bf, v_bf = k.bfloat16().float(), v.bfloat16().float()
    def int2(side, x):
        if side is None:
            return x
        return torch.cat([x[:, :, :SINK], methods.fake(side, x[:, :, SINK:])], dim=2)
    k_q, v_q = int2(lm.key, k_bf), int2(lm.value, v_bf)
    out = torch.empty_like(q)
    for p in range(t):
        mk = methods.int2_mask(torch.tensor([p]), p + 1, lm.key, SINK, RECENT, lm.token_block)[0][:, None]
        mv = methods.int2_mask(torch.tensor([p]), p + 1, lm.value, SINK, RECENT, lm.token_block)[0][:, None]
        kp = torch.where(mk, k_q[:, :, :p + 1], k_bf[:, :, :p + 1]).repeat_interleave(2, 1)
        vp = torch.where(mv, v_q[:, :, :p + 1], v_bf[:, :, :p + 1]).repeat_interleave(2, 1)
        a = 0 if window is None else max(0, p - window + 1)
        probs = torch.softmax(scaling * q[:, :, p:p + 1] @ kp[:, :, a:].mT, -1)
        out[:, :, p:p + 1] = probs @ vp[:, :, a:]
    return out


@pytest.mark.parametrize("name", ["bf16", "int2", "kivi", "oscar"])
@pytest.mark.parametrize("chunk", [7, 256])
def test_simulated_attention_matches_per_query_cache_view(name, chunk):
    q, k, v = qkv()
    lm = layer_methods()[name]
    got = simulated_attention(q, k, v, lm, 0.125, SINK, RECENT, chunk)
    assert torch.allclose(got, brute_force(q, k, v, lm, 0.125), atol=1e-4)


@pytest.mark.parametrize("name", ["int2", "kivi", "oscar"])
def test_simulated_attention_matches_decoding_through_the_cache(name):
    """Token-by-token decode through OscarLayer reads what the simulation gives each position."""
    q, k, v = qkv(t=60, seed=1)
    lm = layer_methods()[name]
    layer = OscarLayer("kivi", 0, None, SINK, RECENT)  # a SideStore layer (growing tensors); sides replaced below
    layer.lazy_initialization(k[:, :, :1])
    layer.key_store.side, layer.value_store.side = lm.key, lm.value
    layer.key_store.block = layer.value_store.block = lm.token_block
    outs = []
    for p in range(k.shape[2]):
        kp, vp = layer.update(k[:, :, p:p + 1], v[:, :, p:p + 1])
        probs = torch.softmax(0.125 * q[:, :, p:p + 1] @ kp.repeat_interleave(2, 1).mT, -1)
        outs.append(probs @ vp.repeat_interleave(2, 1))
    got = simulated_attention(q, k, v, lm, 0.125, SINK, RECENT, 16)
    assert torch.allclose(torch.cat(outs, 2), got, atol=1e-4)


def test_int2_differs_from_bf16_only_past_the_window():
    q, k, v = qkv()
    lms = layer_methods()
    exact = simulated_attention(q, k, v, lms["bf16"], 0.125, SINK, RECENT)
    int2 = simulated_attention(q, k, v, lms["int2"], 0.125, SINK, RECENT)
    assert torch.allclose(exact[:, :, :SINK + RECENT], int2[:, :, :SINK + RECENT], atol=1e-5)
    assert not torch.allclose(exact[:, :, SINK + RECENT:], int2[:, :, SINK + RECENT:], atol=1e-3)


@pytest.mark.parametrize("name", ["bf16", "int2", "kivi", "oscar"])
@pytest.mark.parametrize("chunk,window", [(7, 5), (7, 30), (16, 40), (256, 24)])
def test_simulated_attention_in_a_sliding_window(name, chunk, window):
    """A sliding layer: query p reads keys p − window + 1..p, each as the cache holds it (sink, INT2, recent)."""
    q, k, v = qkv()
    lm = layer_methods()[name]
    got = simulated_attention(q, k, v, lm, 0.125, SINK, RECENT, chunk, window)
    assert torch.allclose(got, brute_force(q, k, v, lm, 0.125, window), atol=1e-4)
