from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from oscar_core import kvstore
from oscar_core.errors import OscarError
from oscar_core.formats.bundle import load_bundle
from oscar_core.serve import methods
from oscar_core.serve.cache import OscarCache, OscarLayer, Sequences, memory_plan

BUNDLE = Path(__file__).resolve().parents[1] / "zoo/HuggingFaceTB/SmolLM2-135M-Instruct/v1"


def kv(t, seed=0, heads=3, d=64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, t, d, generator=g), torch.randn(1, heads, t, d, generator=g)


def test_kivi_layer_layout_and_measured_bytes():
    layer = OscarLayer("kivi", 0, None, sink=64, recent=256)
    k, v = kv(1000)
    out_k, out_v = layer.update(k, v)
    assert torch.equal(out_k, k) and torch.equal(out_v, v)              # prefill attends in flight
    for _ in range(3):
        out_k, _ = layer.update(*kv(1, seed=7))
    assert layer.get_seq_length() == 1003 and out_k.shape == (1, 3, 1003, 64)
    ks = layer.key_store
    assert ks.sink.shape[2] == 64 and 256 <= ks.recent.shape[2] < 256 + 64
    assert ks.n_int2 == 1003 - 64 - ks.recent.shape[2]
    # The sink is exact (BF16) and the INT2 tokens are the method's write path of their BF16 copy.
    assert torch.equal(out_k[:, :, :64], k[:, :, :64].bfloat16().float())
    side = methods.layer_method("kivi", 0, 3, 64).key
    n = ks.n_int2
    expected = methods.fake(side, k[:, :, 64:64 + n].bfloat16().float())
    assert torch.allclose(out_k[:, :, 64:64 + n], expected, atol=1e-5)
    stores = (layer.key_store, layer.value_store)
    assert layer.nbytes() == sum((64 + s.recent.shape[2]) * 3 * 64 * 2 + s.n_int2 * 3 * (16 + 2) for s in stores)


@pytest.mark.parametrize("method", ["int2", "hadamard"])
def test_store_layer_layout_and_measured_bytes(method):
    layer = OscarLayer(method, 0, None, sink=64, recent=256)
    k, v = kv(1000)
    out_k, out_v = layer.update(k, v)
    assert torch.equal(out_k, k) and torch.equal(out_v, v)              # prefill attends in flight
    for i in range(3):
        out_k, out_v = layer.update(*kv(1, seed=7 + i))
    assert layer.get_seq_length() == 1003 and out_k.shape == (1, 3, 1003, 64)
    store = layer.store
    assert store.lengths.tolist() == [1003] and layer.int2_tokens() == 1003 - 64 - 256
    side = methods.layer_method(method, 0, 3, 64).key
    # Sink and ring: BF16 of the rotated token, read back in original space (exact for the identity).
    assert torch.allclose(out_k[:, :, :64], k[:, :, :64], atol=3e-2)
    if method == "int2":
        assert torch.equal(out_k[:, :, :64], k[:, :, :64].bfloat16().float())
    # Tokens written straight to INT2 by the prefill: the method's quantization of their float32 rotation.
    expected = methods.fake(side, k[:, :, 64:1000 - 256])
    close = torch.isclose(out_k[:, :, 64:1000 - 256], expected, atol=1e-5)
    assert close.float().mean() > 0.999
    # Tokens pushed out of the ring by the 3 decode steps: quantized from their BF16 rotated copy.
    y = methods.rotate(side, k[:, :, 744:747]).bfloat16().float()
    from oscar_core import quant
    back = methods.unrotate(side, quant.fake_quantize(y, 64))
    assert torch.allclose(out_k[:, :, 744:747], back, atol=1e-4)
    # Bytes: exactly the preallocated store (capacity rounded up to 256 tokens), per-sequence lengths aside.
    cap = layer.sequences.capacity
    assert cap == 1024 and layer.nbytes() == kvstore.store_nbytes(1, cap, 3, 64) - 4


def test_store_grows_in_place_and_reads_the_same():
    big = OscarLayer("hadamard", 0, None, sink=4, recent=16, sequences=Sequences(capacity=400))
    small = OscarLayer("hadamard", 0, None, sink=4, recent=16)
    k, v = kv(250, heads=2)
    for layer in (big, small):
        layer.update(k, v)
    assert small.sequences.capacity == 256
    for i in range(10):
        step = kv(1, seed=100 + i, heads=2)
        big.commit(*step, None)
        small.commit(*step, None)
    want, got = big.read(torch.float32), small.read(torch.float32)
    assert small.sequences.capacity == 512 and small.store.key_codes.shape[2] == kvstore.int2_rows(512, 4, 16) == 512
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_cache_bytes_against_bf16():
    cache = OscarCache(None, "int2", num_layers=2)
    for i in range(2):
        cache.update(*kv(4096, seed=i), i)
    ratio = cache.bf16_nbytes() / cache.nbytes()
    assert cache.bf16_nbytes() == 2 * 2 * 3 * 4096 * 64 * 2
    assert 4.5 < ratio < 16 / methods.bits_per_element("int2", 4096) + 1e-6
    assert abs(16 / ratio - methods.bits_per_element("int2", 4096)) < 1e-9   # measured = accounted
    plan = memory_plan(2, 3, 64, 4096, budget_bytes=10 * cache.nbytes() + 5)
    assert plan["bytes_per_sequence"] == cache.nbytes() + 2 * 4
    assert plan["bytes_per_token"] == 2 * 2 * 3 * (16 + 2) and plan["max_batch"] == 9
    assert plan["bf16_bytes_per_sequence"] == cache.bf16_nbytes()


def test_left_padded_batch_reads_right_aligned():
    """Leading pads skipped at write (as oscar_attention does from the mask): each sequence's tokens fill the
    last lengths[b] columns of the torch read, and its INT2 rows start at its first real token."""
    layer = OscarLayer("int2", 0, None, sink=4, recent=8)
    k, v = kv(40, heads=2)
    k, v = k.expand(2, -1, -1, -1).clone(), v.expand(2, -1, -1, -1).clone()
    layer.lazy_initialization(k, v)
    layer.commit(k, v, torch.tensor([0, 10], dtype=torch.int32))
    assert layer.store.lengths.tolist() == [40, 30]
    out_k, _ = layer.read(torch.float32)
    alone = OscarLayer("int2", 0, None, sink=4, recent=8)
    alone.update(k[1:, :, 10:], v[1:, :, 10:])
    assert torch.equal(out_k[1, :, 10:], alone.read(torch.float32)[0][0])
    assert (out_k[1, :, :10] == 0).all()


@pytest.mark.parametrize("method", ["bf16", "kivi", "hadamard"])
def test_fill_skips_each_sequences_pads(method):
    """cache.fill of a left-padded exact prefill (pads 0, 10 and 37 of 120, a store layer and kivi's SideStores per
    sequence): after the prefill and after decode steps, each sequence's keys and values read exactly as filled
    alone, right-aligned, its pads zeros; nothing of a pad is held."""
    from transformers.cache_utils import DynamicLayer

    from oscar_core.serve.cache import exact_cache, fill

    n, pads = 120, [0, 10, 37]
    rows = [kv(n - p, seed=b, heads=2) for b, p in enumerate(pads)]
    keys, values = (torch.stack([torch.cat([torch.full_like(r[i][0, :, :1], 9.0).expand(-1, p, -1), r[i][0]], 1)
                                 for r, p in zip(rows, pads)]) for i in (0, 1))

    def make():
        return OscarCache(None, method, num_layers=1, sink_tokens=4, recent_tokens=16, kernel_reads=False)

    def prefill(k, v):
        done = exact_cache(make())
        done.layers[0] = DynamicLayer()
        done.layers[0].update(k, v)
        return done

    batch = fill(make(), prefill(keys, values), torch.tensor(pads, dtype=torch.int32))
    alone = [fill(make(), prefill(*r)) for r in rows]
    for t in range(6):
        got = batch.layers[0].read(torch.float32)
        for b, (p, one) in enumerate(zip(pads, alone)):
            want = one.layers[0].read(torch.float32)
            for x, y in zip(got, want):
                assert torch.equal(x[b, :, p:], y[0]) and (x[b, :, :p] == 0).all(), (t, b)
        step = kv(1, seed=10 + t, heads=2)
        batch.update(*(x.expand(len(pads), -1, -1, -1) for x in step), 0)
        for one in alone:
            one.update(*step, 0)
    assert batch.get_seq_length() == n + 6 and (method == "bf16" or batch.layers[0].int2_tokens() > 0)


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
    """Greedy chat answers through the INT2 cache (4 sink + 16 recent BF16 tokens, so the prompt's middle is INT2;
    layers whose keys go per channel move it there in blocks of 64 tokens, so the prompt is long enough for two)."""
    model, tok = default_model.model, default_model.tokenizer
    bundle = load_bundle(BUNDLE)
    preface = " ".join(["France is a country in Western Europe with many old cities, rivers and museums."] * 10)
    ids = chat_ids(tok, preface + " What is the capital of France? Answer in one word.")
    assert ids.shape[1] > 4 + 16 + 2 * 64
    answers = {}
    for method in ("bf16", "oscar"):
        cache = OscarCache(bundle, method, sink_tokens=4, recent_tokens=16, capacity=ids.shape[1] + 8)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=8,
                             do_sample=False, pad_token_id=tok.eos_token_id)
        answers[method] = out[0, ids.shape[1]:]
        assert cache.get_seq_length() == ids.shape[1] + len(answers[method]) - 1
        if method == "oscar":
            assert cache.bf16_nbytes() / cache.nbytes() > 1.5
    assert "Paris" in tok.decode(answers["bf16"])
    assert "Paris" in tok.decode(answers["oscar"])
    assert torch.equal(answers["oscar"][:3], answers["bf16"][:3])


def test_int2_store_decodes_as_the_simulation():
    """Token-by-token decode through the int2 store (identity rotation: its BF16 ring holds the tokens' BF16
    copies, from which leaving tokens are quantized) reads what simulate.simulated_attention gives each position."""
    from oscar_core.serve.simulate import simulated_attention

    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 6, 60, 64, generator=g), torch.randn(1, 3, 60, 64, generator=g), torch.randn(1, 3, 60, 64,
                                                                                                          generator=g)
    layer = OscarLayer("int2", 0, None, sink=4, recent=16)
    outs = []
    for p in range(60):
        kp, vp = layer.update(k[:, :, p:p + 1], v[:, :, p:p + 1])
        probs = torch.softmax(0.125 * q[:, :, p:p + 1] @ kp.repeat_interleave(2, 1).mT, -1)
        outs.append(probs @ vp.repeat_interleave(2, 1))
    assert layer.store is not None
    lm = methods.layer_method("int2", 0, 3, 64)
    assert torch.allclose(torch.cat(outs, 2), simulated_attention(q, k, v, lm, 0.125, 4, 16, 16), atol=1e-4)


def test_mixed_bundle_decodes_as_the_simulation(tmp_path):
    """A bundle with keys per channel in layer 0 and per token in layer 1: greedy decoding through OscarCache
    (torch reads) gives the logits, tokens and perplexity that simulate_int2 gives the same text teacher-forced.
    Identity rotations and no means, so that the BF16 ring copy a leaving block is quantized from is the
    simulation's BF16 token (with a rotation the store quantizes bf16((k − μ)·R), the simulation (k − μ)·R:
    a code flips now and then, in per-token layers as in channel ones); the prefill attends in flight to float32
    keys, the simulation to BF16 ones (4e-4)."""
    import transformers as tf

    from oscar_core.formats.bundle import LayerQuant
    from oscar_core.serve.simulate import simulate_int2
    from tiny_bundle import HEAD_DIM, KV_HEADS, LAYERS, write_tiny_bundle

    write_tiny_bundle(tmp_path)
    bundle = load_bundle(tmp_path)
    bundle.manifest.quant.layers = [LayerQuant(layer=0, key_axis="channel"), LayerQuant(layer=1, key_axis="token")]
    for i in range(LAYERS):
        for side in ("key", "value"):
            bundle.tensors[f"layers.{i}.{side}_rotation"] = torch.eye(HEAD_DIM).expand(KV_HEADS, -1, -1).contiguous()
        bundle.tensors.pop(f"layers.{i}.value_mean")
    config = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                            num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=128,
                            max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(3))
    cache = OscarCache(bundle, "oscar", sink_tokens=4, recent_tokens=16)
    with torch.no_grad():
        logits = [model(ids, past_key_values=cache).logits[:, -1]]
        tokens = [logits[-1].argmax(-1, keepdim=True)]
        for _ in range(70):
            logits.append(model(tokens[-1], past_key_values=cache).logits[:, -1])
            tokens.append(logits[-1].argmax(-1, keepdim=True))
        text = torch.cat([ids, *tokens], dim=1)
        with simulate_int2(model, "oscar", bundle, sink_tokens=4, recent_tokens=16):
            want = model(text[:, :-1]).logits[:, 9:]
    got = torch.stack(logits, 1)
    stores = [layer.store for layer in cache.layers]
    assert [s.key_axis for s in stores] == ["channel", "token"] and cache.layers[0].key_store is None
    assert stores[0].int2_tokens().tolist() == [56] and stores[1].int2_tokens().tolist() == [60]
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 2e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    nll = [torch.nn.functional.cross_entropy(x[0, :-1], text[0, 11:]) for x in (got, want)]
    assert abs(float(nll[0] - nll[1])) < 1e-3


def test_memory_plan_counts_channel_layers():
    axes = ["channel", "token"]
    plan = memory_plan(2, 3, 64, 4096, key_axes=axes)
    assert plan["bytes_per_sequence"] == sum(kvstore.store_nbytes(1, 4096, 3, 64, key_axis=a) for a in axes)
    assert plan["bytes_per_token"] == memory_plan(2, 3, 64, 4096)["bytes_per_token"]
    layer = OscarLayer("oscar", 0, SimpleNamespace(
        manifest=SimpleNamespace(quant=SimpleNamespace(key_group_size=64, value_group_size=64),
                                 model=SimpleNamespace(num_kv_heads=3, head_dim=64)),
        layer=lambda i, name: torch.ones(3) if name.endswith("clip") else None, key_axis=lambda i: "channel"),
        sink=64, recent=256)
    layer.update(*kv(1000))
    cap = layer.sequences.capacity
    assert layer.store.key_axis == "channel"
    assert layer.nbytes() == kvstore.store_nbytes(1, cap, 3, 64, key_axis="channel") - 4
