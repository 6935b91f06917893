"""R_V absorbed into v_proj and o_proj: the same attention output, the same model, refusals before any change."""

import copy
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_model, tiny_sliding_model
from oscar_core.errors import OscarError
from oscar_core.serve import absorb
from oscar_core.serve.cache import OscarCache, oscar_attention


def orthogonal(n, d, gen):
    return torch.linalg.qr(torch.randn(n, d, d, generator=gen, dtype=torch.float64))[0]


@pytest.mark.parametrize("v_bias,o_bias,mean", [(False, False, False), (True, False, True), (False, True, True)])
def test_absorbed_projections_give_the_same_output(v_bias, o_bias, mean):
    """o_proj(attention(v_proj(x))) with the absorbed weights equals the original, float64, GQA 3, any weights p."""
    gen = torch.Generator().manual_seed(0)
    heads, kv, d, hidden, tokens = 6, 2, 8, 20, 11
    wv, wo = torch.randn(kv * d, hidden, generator=gen, dtype=torch.float64), torch.randn(
        hidden, heads * d, generator=gen, dtype=torch.float64)
    bv = torch.randn(kv * d, generator=gen, dtype=torch.float64) if v_bias else None
    bo = torch.randn(hidden, generator=gen, dtype=torch.float64) if o_bias else None
    r = orthogonal(kv, d, gen)
    mu = torch.randn(kv, d, generator=gen, dtype=torch.float64) if mean else None
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    p = torch.softmax(torch.randn(heads, tokens, generator=gen, dtype=torch.float64), -1)

    def run(wv, bv, wo, bo):
        v = torch.nn.functional.linear(x, wv, bv).reshape(tokens, kv, d).repeat_interleave(heads // kv, 1)
        o = torch.einsum("jt,tjd->jd", p, v).reshape(-1)
        return torch.nn.functional.linear(o, wo, bo)

    new_v = absorb.absorbed_value_projection(wv, bv, r, mu)
    new_o = absorb.absorbed_output_projection(wo, bo, r, mu, heads)
    assert (new_v[1] is None) == (not v_bias and not mean) and (new_o[1] is None) == (not o_bias and not mean)
    torch.testing.assert_close(run(*new_v, *new_o), run(wv, bv, wo, bo), rtol=1e-10, atol=1e-10)
    # The values the new v_proj gives are the stored ones, (v − μ)·R per KV head.
    v = torch.nn.functional.linear(x, wv, bv).reshape(tokens, kv, d)
    want = torch.einsum("tkc,kce->tke", v - (0 if mu is None else mu), r)
    torch.testing.assert_close(torch.nn.functional.linear(x, *new_v).reshape(tokens, kv, d), want)


def bundle_for(model, seed=1, layers=None, mean=True):
    """The fields of a rotation bundle that absorb and OscarCache read, random, for `model`'s shapes."""
    c = model.config
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in (range(c.num_hidden_layers) if layers is None else layers):
        for side in ("key", "value"):
            tensors[f"layers.{i}.{side}_rotation"] = orthogonal(c.num_key_value_heads, d, gen).float()
            tensors[f"layers.{i}.{side}_clip"] = torch.full((c.num_key_value_heads,), 0.95)
            if mean:
                tensors[f"layers.{i}.{side}_mean"] = 0.3 * torch.randn(c.num_key_value_heads, d, generator=gen)
    manifest = SimpleNamespace(
        name="random", model=SimpleNamespace(num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
                                             num_kv_heads=c.num_key_value_heads, head_dim=d),
        quant=SimpleNamespace(key_group_size=8, value_group_size=8, sink_tokens=4, recent_tokens=8),
        rotation=SimpleNamespace(layers=None, windows=None))
    return SimpleNamespace(manifest=manifest, layer=lambda i, name: tensors.get(f"layers.{i}.{name}"),
                           key_axis=lambda i: "token")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma3"])
@torch.no_grad()
def test_absorbed_model_keeps_its_logits(kind):
    """Full-precision logits of a prompt are unchanged (to float32 rounding): Qwen2's v_proj bias, Qwen3's q/k norms,
    Gemma 3's sliding layers; the layers without a value rotation in the bundle are left as they were."""
    model = tiny_sliding_model("gemma3") if kind == "gemma3" else tiny_model(kind)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(4))
    want = model(ids).logits
    absorbed = copy.deepcopy(model)
    changed = absorb.absorb_value_rotation(absorbed, bundle_for(model, layers=[0, 1]))
    assert changed == [0, 1]
    assert getattr(absorbed.config, absorb.MARK) == "random"
    last = model.config.num_hidden_layers - 1
    if last > 1:
        assert torch.equal(absorbed.model.layers[last].self_attn.v_proj.weight,
                           model.model.layers[last].self_attn.v_proj.weight)
    assert not torch.equal(absorbed.model.layers[0].self_attn.o_proj.weight, model.model.layers[0].self_attn.o_proj.weight)
    torch.testing.assert_close(absorbed(ids).logits, want, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_oscar_cache_reads_absorbed_values_as_it_read_rotated_ones():
    """The INT2 cache quantizes the same rotated, centred values either way: decode logits through
    OscarCache(values_absorbed=True) on the absorbed model match those of the cache that rotates them itself."""
    model = tiny_model("qwen2")
    bundle = bundle_for(model)
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(5))

    def decode(m, cache):
        out = [m(ids, past_key_values=cache).logits[:, -1]]
        for t in range(4):
            out.append(m(ids[:, :1] * 0 + t + 3, past_key_values=cache).logits[:, -1])
        return torch.stack(out, 1)

    make = dict(bundle=bundle, method="oscar", num_layers=2, sink_tokens=4, recent_tokens=8, kernel_reads=False)
    want = decode(model, OscarCache(**make))
    absorbed = copy.deepcopy(model)
    absorb.absorb_value_rotation(absorbed, bundle)
    cache = OscarCache(**make, values_absorbed=True)
    got = decode(absorbed, cache)
    assert cache.layers[0].rotation.value_mean is None and cache.layers[0].value_identity
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert err.max() < 1e-3, err
    # The same cache on the unchanged model reads values that were never rotated: not the same logits.
    wrong = decode(model, OscarCache(**make, values_absorbed=True))
    assert ((wrong - want).norm(dim=-1) / want.norm(dim=-1)).max() > 1e-2


def test_refusals_change_nothing():
    model = tiny_model("llama")
    bundle = bundle_for(model)
    before = model.model.layers[0].self_attn.v_proj.weight.clone()
    other = bundle_for(model)
    other.manifest.model.num_kv_heads = 1
    with pytest.raises(OscarError, match="bundle random is for 4/1 heads"):
        absorb.absorb_value_rotation(model, other)
    model.model.layers[1].self_attn.v_norm = torch.nn.Identity()
    with pytest.raises(OscarError, match="layer 1: a norm on the values"):
        absorb.absorb_value_rotation(model, bundle)
    assert torch.equal(model.model.layers[0].self_attn.v_proj.weight, before)
    del model.model.layers[1].self_attn.v_norm
    absorb.absorb_value_rotation(model, bundle)
    with pytest.raises(OscarError, match="already hold R_V of random"):
        absorb.absorb_value_rotation(model, bundle)
    with pytest.raises(OscarError, match="make the cache with values_absorbed=True"):
        with oscar_attention(model, OscarCache(bundle, "oscar", num_layers=2, kernel_reads=False)):
            pass
    with pytest.raises(OscarError, match="do not hold R_V"):
        with oscar_attention(tiny_model("llama"), OscarCache(bundle, "oscar", num_layers=2, values_absorbed=True)):
            pass


@torch.no_grad()
def test_real_model_keeps_its_logits_and_int2_decode(default_model):
    """SmolLM2-135M with its zoo bundle: the absorbed model's logits are the original's, and decode steps through
    OscarCache(values_absorbed=True) read what OscarCache read from the original (400 tokens: INT2 rows in use)."""
    from oscar_core.formats.bundle import load_bundle

    model = default_model.model
    bundle = load_bundle("zoo/HuggingFaceTB/SmolLM2-135M-Instruct/v1")
    text = " ".join(f"item {i} is followed by item {i + 1}, and so on." for i in range(60))
    ids = default_model.tokenizer(text, return_tensors="pt").input_ids[:, :400]
    absorbed = copy.deepcopy(model)
    assert absorb.absorb_value_rotation(absorbed, bundle) == list(range(model.config.num_hidden_layers))
    want = model(ids[:, :96]).logits
    scale = want.abs().max()
    assert (absorbed(ids[:, :96]).logits - want).abs().max() < 1e-3 * scale

    def decode(m, cache):
        out = [m(ids, past_key_values=cache).logits[:, -1]]
        for t in ids[0, 1:5]:
            out.append(m(t.view(1, 1), past_key_values=cache).logits[:, -1])
        return torch.log_softmax(torch.cat(out), -1)

    ref = decode(model, OscarCache(bundle, "oscar", kernel_reads=False))
    got = decode(absorbed, OscarCache(bundle, "oscar", kernel_reads=False, values_absorbed=True))
    kl = (ref.exp() * (ref - got)).sum(-1)
    assert kl.max() < 1e-3, kl
