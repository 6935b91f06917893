"""transformers' attention reaching an OscarCache (attention.py): model.generate with nothing but the cache reads
decode steps by kernel, the torch path's logits are those of transformers' own sdpa, oscar_attention gives what plain
generate gives, an attention implementation oscar does not route still gets right keys and values, and the layers'
fields are set only by the layers' own methods.

The decode kernel runs on the CPU through Triton's interpreter (conftest sets TRITON_INTERPRET)."""

import copy
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from oscar_core.calibrate.models import cache_argument  # noqa: E402
from oscar_core.calibrate.statistics import route_attention  # noqa: E402
from oscar_core.serve.attention import StandIn, oscar_attention  # noqa: E402
from oscar_core.serve.cache import OscarCache, OscarLayer, Sequences  # noqa: E402

BUNDLE = Path(__file__).resolve().parents[1] / "zoo/HuggingFaceTB/SmolLM2-135M-Instruct/v1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64


def tiny_llama(attention="sdpa"):
    """Two layers at a head_dim the decode kernel takes (conftest's tiny models have 16)."""
    import transformers as tf

    config = tf.LlamaConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=HEADS,
                            num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=256,
                            max_position_embeddings=256)
    config._attn_implementation = attention
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().to(DEVICE)


def padded_batch(n=40, pads=15, seed=2):
    ids = torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :pads] = 0
    return ids, mask


def generate(model, cache, ids, mask, new_tokens, pad_token_id=0):
    """Greedy tokens and the logits of every step."""
    out = model.generate(ids, attention_mask=mask, **{cache_argument(model): cache}, max_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=pad_token_id, output_logits=True,
                         return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


def tiny_cache(kernel_reads):
    return OscarCache(None, "hadamard", num_layers=2, sink_tokens=4, recent_tokens=16, kernel_reads=kernel_reads)


def count_kernel_reads(monkeypatch) -> list:
    """Every OscarLayer.decode_attention call (the decode kernel's read of a layer's store), by layer."""
    calls, real = [], OscarLayer.decode_attention
    monkeypatch.setattr(OscarLayer, "decode_attention", lambda self, *a: calls.append(self.layer_idx) or real(self, *a))
    return calls


def test_plain_generate_reads_by_kernel_as_oscar_attention_does(monkeypatch):
    """A left-padded batch through model.generate alone: every decode step of every layer read by the kernel (so
    every prefill written with its pads skipped), the tokens and logits of the same cache inside oscar_attention,
    and within the kernel's error of each sequence alone read by torch."""
    model = tiny_llama()
    ids, mask = padded_batch()
    calls = count_kernel_reads(monkeypatch)
    plain = tiny_cache(True)
    got = generate(model, plain, ids, mask, 5)
    assert calls == [0, 1] * 4
    assert plain.layers[1].store.lengths.tolist() == [44, 29] and plain.reads_by_kernel()
    inside = tiny_cache(True)
    with oscar_attention(model, inside):
        again = generate(model, inside, ids, mask, 5)
    assert torch.equal(got[0], again[0]) and torch.equal(got[1], again[1])
    for b, start in ((0, 0), (1, 15)):     # each sequence alone, no pads, read by torch
        alone = ids[b:b + 1, start:]
        logits = generate(model, tiny_cache(False), alone, torch.ones_like(alone), 5)[1][0]
        err = (got[1][b] - logits).norm(dim=-1) / logits.norm(dim=-1)
        assert err.max() < 3e-2, (b, err)


def test_an_attention_it_does_not_route_gets_the_torch_read(monkeypatch):
    """Under eager attention (not transformers' sdpa function, so not oscar's dispatcher) the StandIns a cache
    that reads by kernel returns resolve to the torch read, and a held prefill is written as it came: the logits of
    the same cache reading by torch, exactly, and no kernel read."""
    model = tiny_llama("eager")
    ids, mask = padded_batch()
    calls = count_kernel_reads(monkeypatch)
    got = generate(model, tiny_cache(True), ids, mask, 4)
    want = generate(model, tiny_cache(False), ids, mask, 4)
    assert calls == [] and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_stand_ins_resolve_to_what_the_layer_holds():
    """A decode step's StandIns: the store's torch read (the token written first), read once for keys and values;
    torch operations see that."""
    layer = OscarLayer("int2", 0, None, sink=4, recent=8, kernel_reads=True)
    twin = OscarLayer("int2", 0, None, sink=4, recent=8, kernel_reads=False)
    gen = torch.Generator().manual_seed(4)
    k, v = torch.randn(1, KV_HEADS, 30, HEAD_DIM, generator=gen), torch.randn(1, KV_HEADS, 30, HEAD_DIM, generator=gen)
    held = layer.update(k, v)
    assert isinstance(held[0], StandIn) and layer.get_seq_length() == 30 and torch.equal(held[0] * 1, k)
    twin.update(k, v)
    k1, v1 = k[:, :, :1] + 1, v[:, :, :1] - 1
    keys, values = layer.update(k1, v1)
    want = twin.update(k1, v1)
    assert isinstance(keys, StandIn) and keys.shape == want[0].shape == (1, KV_HEADS, 31, HEAD_DIM)
    assert torch.equal(keys + 0, want[0]) and torch.equal(values.clone(), want[1])
    assert keys.box[0] is values.box[0] and "StandIn(layer 0, keys" in repr(keys)


def test_the_attention_routing_sets_no_field_of_a_layer(monkeypatch):
    """Through plain generate and inside oscar_attention (a left-padded batch, read by kernel), every field of a
    layer and of the sequences the layers share is set by a method of the cache's own classes."""
    owners = {f.__code__ for cls in (OscarLayer, Sequences, OscarCache) for c in cls.__mro__
              for f in vars(c).values() if hasattr(f, "__code__")}
    outside = []

    def spy(self, name, value):
        setter = sys._getframe(1).f_code
        if setter not in owners:
            outside.append((type(self).__name__, name, setter.co_name))
        object.__setattr__(self, name, value)

    model = tiny_llama()
    ids, mask = padded_batch()
    caches = [tiny_cache(True), tiny_cache(True)]
    for cls in (OscarLayer, Sequences):
        monkeypatch.setattr(cls, "__setattr__", spy)
    for cache, routing in zip(caches, (nullcontext, oscar_attention)):
        with routing(model, cache) if routing is oscar_attention else routing():
            generate(model, cache, ids, mask, 3)
    assert outside == []
    setattr(caches[0].layers[0], "held", None)      # what the check catches: a field set from outside the layer
    assert outside == [("OscarLayer", "held", "test_the_attention_routing_sets_no_field_of_a_layer")]


@pytest.mark.slow
def test_generate_gives_the_logits_of_transformers_sdpa(default_model):
    """SmolLM2-135M and its zoo bundle on the CPU (torch reads): model.generate with the cache alone, inside
    oscar_attention, and with transformers' own sdpa function (no oscar dispatcher: the path before it) give the same
    tokens and logits, bit for bit, for a left-padded batch."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model, tok = default_model.model, default_model.tokenizer
    preface = "France is a country in Western Europe with many old cities, rivers and museums. " * 3
    batch = tok([preface + "Its capital is a city called", "Two plus two is"], return_tensors="pt", padding=True,
                padding_side="left")

    def run(routing):
        cache = OscarCache.from_pretrained(BUNDLE, sink_tokens=4, recent_tokens=16)
        with routing(cache):
            return generate(model, cache, batch.input_ids, batch.attention_mask, 6, tok.eos_token_id)

    want = run(lambda cache: route_attention(model, "transformers_sdpa", sdpa_attention_forward, mask="sdpa"))
    for routing in (lambda cache: nullcontext(), lambda cache: oscar_attention(model, cache)):
        got = run(routing)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.slow
def test_generate_reads_a_real_model_by_kernel(default_model, monkeypatch):
    """SmolLM2-135M (30 layers, 9 query heads on 3 KV heads, some layers' keys per channel) with its zoo bundle,
    OscarCache.from_pretrained and model.generate alone: every layer's decode step read by the decode kernel (the
    Triton interpreter on the CPU: one step, about 20 s), the tokens and, within the kernel's error, the logits of
    the torch reads."""
    model, tok = default_model.model, default_model.tokenizer
    if DEVICE != "cpu":     # the shared fixture stays on the CPU
        model = copy.deepcopy(model).to(DEVICE)
    preface = "France is a country in Western Europe with many old cities, rivers and museums. " * 3
    question = preface + "What is the capital of France? Answer in one word."
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt")
    ids = (ids if torch.is_tensor(ids) else ids["input_ids"]).to(DEVICE)
    mask = torch.ones_like(ids)
    calls = count_kernel_reads(monkeypatch)
    cache = OscarCache.from_pretrained(BUNDLE, sink_tokens=4, recent_tokens=16, kernel_reads=True)
    got = generate(model, cache, ids, mask, 2, tok.eos_token_id)
    layers = model.config.num_hidden_layers
    assert sorted(calls) == list(range(layers)) and cache.layers[0].int2_tokens() > 0
    want = generate(model, OscarCache.from_pretrained(BUNDLE, sink_tokens=4, recent_tokens=16, kernel_reads=False),
                    ids, mask, 2, tok.eos_token_id)
    assert torch.equal(got[0], want[0])
    err = (got[1] - want[1]).norm(dim=-1) / want[1].norm(dim=-1)
    assert err.max() < 2e-2, err
