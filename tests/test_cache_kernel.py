"""OscarCache written by the Triton write kernels and read by the decode kernel (through transformers' attention
function, attention.py) against
the torch reference; the write kernels against kvstore's reference.

Run on the CPU through Triton's interpreter (see tests/test_triton_kernels.py for the import dance)."""

import dataclasses
import importlib
import os
import sys
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from oscar_core import kvstore, quant  # noqa: E402
from oscar_core.errors import OscarError  # noqa: E402
from oscar_core.serve.attention import StandIn  # noqa: E402
from oscar_core.serve.cache import OscarCache, oscar_attention  # noqa: E402
from oscar_core.triton import decode, decode_programs, write  # noqa: E402

if not torch.cuda.is_available() and not isinstance(write._append_kernel, triton.runtime.interpreter.InterpretedFunction):
    write = importlib.reload(sys.modules["oscar_core.triton.write"])
if not torch.cuda.is_available() and not isinstance(decode_programs._split_kernel,
                                                    triton.runtime.interpreter.InterpretedFunction):
    decode_programs = importlib.reload(sys.modules["oscar_core.triton.decode_programs"])
    decode = importlib.reload(sys.modules["oscar_core.triton.decode"])

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 64


def tiny_llama():
    import transformers as tf

    config = tf.LlamaConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                            num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=256,
                            max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().to(DEVICE)


def random_bundle(sink, recent, channel_layers=(), key_group=64, layers=LAYERS, windows=None):
    """The fields of a rotation bundle that OscarCache reads: random rotations, means and clips; keys per channel
    in `channel_layers`, per token elsewhere; windows: {layer: N} of the sliding layers."""
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for i in range(layers):
        for side, clip in (("key", 0.9), ("value", 0.95)):
            rot = torch.randn(KV_HEADS, HEAD_DIM, HEAD_DIM, generator=gen, dtype=torch.float64)
            tensors[f"layers.{i}.{side}_rotation"] = torch.linalg.qr(rot)[0].float()
            tensors[f"layers.{i}.{side}_mean"] = 0.1 * torch.randn(KV_HEADS, HEAD_DIM, generator=gen)
            tensors[f"layers.{i}.{side}_clip"] = torch.full((KV_HEADS,), clip)
    manifest = SimpleNamespace(
        name="random", model=SimpleNamespace(num_layers=layers, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM),
        quant=SimpleNamespace(key_group_size=key_group, value_group_size=64, sink_tokens=sink, recent_tokens=recent),
        rotation=SimpleNamespace(layers=None, windows=windows))
    return SimpleNamespace(manifest=manifest, layer=lambda i, name: tensors.get(f"layers.{i}.{name}"),
                           key_axis=lambda i: "channel" if i in channel_layers else "token")


@torch.no_grad()
def decode_logits(model, cache, ids, steps, mask=None):
    """Logits of the prompt's last token and of `steps` forced tokens (3, 4, ...) decoded after it; with a
    left-padding mask, positions count real tokens only and every decode step passes the grown mask."""
    pos = None if mask is None else (mask.long().cumsum(-1) - 1).clamp_min(0)
    out = [model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache).logits[:, -1]]
    for t in range(steps):
        tok = ids[:, -1:] * 0 + t + 3
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            pos = pos[:, -1:] + 1
        out.append(model(tok, attention_mask=mask, position_ids=pos, past_key_values=cache).logits[:, -1])
    return torch.stack(out, 1)


def make_cache(method, bundle, kernel, **kw):
    return OscarCache(bundle, method, num_layers=LAYERS, sink_tokens=4, recent_tokens=16, kernel_reads=kernel,
                      kernel_writes=kernel, **kw)


def test_a_reset_cache_decodes_a_new_batch_as_a_fresh_one():
    """reset() empties the layers and the lengths they share: the next prompt decodes as in a new cache (the
    lengths of the first batch were counted on before)."""
    model = tiny_llama()
    bundle = random_bundle(4, 16)
    gen = torch.Generator().manual_seed(3)
    first, second = (torch.randint(0, 256, (2, n), generator=gen).to(DEVICE) for n in (30, 40))
    cache = make_cache("oscar", bundle, False)
    decode_logits(model, cache, first, steps=2)
    cache.reset()
    got = decode_logits(model, cache, second, steps=2)
    assert torch.equal(got, decode_logits(model, make_cache("oscar", bundle, False), second, steps=2))
    assert cache.sequences.lengths.tolist() == [42, 42]


@pytest.mark.parametrize("method", ["oscar", "hadamard"])
def test_kernel_reads_match_torch_reads(method):
    model = tiny_llama()
    bundle = random_bundle(4, 16) if method == "oscar" else None
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    torch_cache = make_cache(method, bundle, False)
    want = decode_logits(model, torch_cache, ids, steps=4)
    kernel_cache = make_cache(method, bundle, True)
    calls = []
    real = kernel_cache.layers[0].decode_attention
    kernel_cache.layers[0].decode_attention = lambda *a: calls.append(1) or real(*a)
    with oscar_attention(model, kernel_cache):
        got = decode_logits(model, kernel_cache, ids, steps=4)
    assert len(calls) == 4                                         # every decode step of layer 0 read by kernel
    layer = kernel_cache.layers[0]
    assert kernel_cache.get_seq_length() == 44 and layer.int2_tokens() == 44 - 4 - 16
    assert layer.write is not None and layer.store.lengths.tolist() == [44, 44]
    assert model.config._attn_implementation == "sdpa"             # restored
    assert torch.equal(got[:, 0], want[:, 0])                       # prefill: exact sdpa on both
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)
    # 2e-2 with torch writes; the interpreter's float32 -> bf16 conversion truncates (the GPU rounds to
    # nearest), a bias in every BF16 window value that the second layer's inputs carry on.
    assert err.max() < 3e-2, err
    # The Triton write's codes against the reference's: equal but for values at a rounding boundary.
    ref = torch_cache.layers[0].store
    rows = layer.int2_tokens()
    for name in ("key_codes", "value_codes", "key_scale", "value_zero"):
        a, b = getattr(layer.store, name)[:, :, :rows], getattr(ref, name)[:, :, :rows]
        assert (a == b).float().mean() > 0.98, name


def test_kernel_reads_an_absorbed_model():
    """R_V in the weights (absorb.py): decode steps read by kernel without õ·R_V^T match the torch reads of the same
    cache and the logits of the cache that rotates the values itself."""
    from oscar_core.serve.absorb import absorb_value_rotation

    model, bundle = tiny_llama(), random_bundle(4, 16)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    want = decode_logits(model, make_cache("oscar", bundle, False), ids, steps=4)
    absorb_value_rotation(model, bundle)
    torch_reads = decode_logits(model, make_cache("oscar", bundle, False, values_absorbed=True), ids, steps=4)
    cache = make_cache("oscar", bundle, True, values_absorbed=True)
    with oscar_attention(model, cache):
        got = decode_logits(model, cache, ids, steps=4)
    q, store = torch.zeros(2, HEADS, HEAD_DIM, device=DEVICE), cache.layers[0].store
    run = decode.launches(decode.shape_of(q, store), decode.plan_for(q, store), decode.device_of(q, store),
                          rotate_values=False)
    assert cache.layers[0].value_identity and not run.reduce_consts["ROTATE"]
    for a, b, bound in ((got, torch_reads, 3e-2), (torch_reads, want, 1e-3)):
        err = (a - b).norm(dim=-1) / b.norm(dim=-1)
        assert err.max() < bound, err


def test_left_padded_batch_decodes_by_kernel():
    """A left-padded batch: the kernel path (pads skipped at write, per-sequence lengths) against each
    sequence decoded alone without padding through torch reads."""
    model = tiny_llama()
    bundle = random_bundle(4, 16)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (2, 40), generator=gen).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :15] = 0
    cache = make_cache("oscar", bundle, True)
    with oscar_attention(model, cache):
        got = decode_logits(model, cache, ids, steps=3, mask=mask)
    assert cache.layers[1].store.lengths.tolist() == [43, 28] and cache.reads_by_kernel()
    for b, start in ((0, 0), (1, 15)):
        alone = make_cache("oscar", bundle, False)
        want = decode_logits(model, alone, ids[b:b + 1, start:], steps=3)
        err = (got[b] - want[0]).norm(dim=-1) / want[0].norm(dim=-1)
        assert err.max() < 3e-2, (b, err)


def test_mask_with_a_gap_is_refused():
    model = tiny_llama()
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, 10] = 0
    cache = make_cache("hadamard", None, True)
    with oscar_attention(model, cache), pytest.raises(OscarError, match="leading pads"):
        decode_logits(model, cache, ids, steps=0, mask=mask)


def test_greedy_decoder_eager_matches_generate():
    """greedy_generate's eager steps give generate's tokens, and hand the model its cache by the keyword this
    transformers takes (no deprecation warning)."""
    import warnings

    from oscar_core.calibrate.models import cache_argument
    from oscar_core.serve.decode_graph import greedy_generate

    model = tiny_llama()
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0                                   # left padding: torch reads need the grown mask each step
    for m in (None, mask):
        want = model.generate(ids, attention_mask=torch.ones_like(ids) if m is None else m, max_new_tokens=6,
                              **{cache_argument(model): make_cache("int2", None, False)}, do_sample=False,
                              pad_token_id=0)
        cache = make_cache("int2", None, False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = greedy_generate(model, cache, ids, m, max_new_tokens=6, graph=False)
        assert not [w for w in caught if "past_key_values" in str(w.message)]
        assert torch.equal(got, want[:, 30:]) and cache.get_seq_length() == 35


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replay_equals_eager_steps():
    """greedy_generate's CUDA-graph replays give the tokens of the same steps run eagerly (the same
    launch plan: the kernel planned from the capacity in both), for a left-padded batch too."""
    from oscar_core.serve.decode_graph import greedy_generate

    model = tiny_llama().bfloat16()
    bundle = random_bundle(4, 16)
    ids = torch.randint(0, 256, (3, 50), generator=torch.Generator().manual_seed(9)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[2, :20] = 0
    out = []
    for graph in (False, True):
        cache = make_cache("oscar", bundle, None)
        if not graph:
            cache.sequences.static = True
        out.append(greedy_generate(model, cache, ids, mask, max_new_tokens=12, graph=graph))
        assert cache.get_seq_length() == 50 + 11 and cache.layers[0].store.lengths.tolist() == [61, 61, 41]
    assert torch.equal(out[0], out[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replays_window_stores():
    """A model with sliding layers whose windows are window stores (Gemma 3: 100 tokens, 64 INT2 rows; 8 tokens kept
    in BF16, no rows) decodes in CUDA-graph replays, past the window, the tokens of the same steps run eagerly."""
    import transformers as tf

    from oscar_core.serve.decode_graph import greedy_generate

    for window in (100, 8):
        config = tf.Gemma3TextConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=3,
                                     num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                                     vocab_size=256, max_position_embeddings=512, sliding_window=window,
                                     layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval().to(DEVICE)
        ids = torch.randint(0, 256, (2, 90), generator=torch.Generator().manual_seed(9)).to(DEVICE)
        mask = torch.ones_like(ids)
        mask[1, :30] = 0
        out = []
        for graph in (False, True):
            cache = OscarCache(None, "int2", config=config, sink_tokens=4, recent_tokens=16)
            cache.sequences.static = not graph
            out.append(greedy_generate(model, cache, ids, mask, max_new_tokens=24, graph=graph))
        assert cache.layers[0].store.window == window and cache.layers[0].store.lengths.tolist() == [113, 83]
        assert torch.equal(out[0], out[1]), window
    bf16 = OscarCache(None, "bf16", config=config)
    with pytest.raises(OscarError, match="decodes eagerly"):     # BF16 rings (RingLayer)
        greedy_generate(model, bf16, ids, torch.ones_like(mask), max_new_tokens=4, graph=True)


def test_a_decode_step_left_unread_is_written_before_the_store_is_read():
    """Reading by kernel, update() leaves a decode step's token for the kernel's read to write (decode_step); a
    torch read (or the next update) that comes first writes it, so the store holds what a plain update writes (the
    same Triton writes, torch reads)."""
    model = tiny_llama()
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(16)).to(DEVICE)
    caches = [OscarCache(random_bundle(4, 16), "oscar", num_layers=LAYERS, sink_tokens=4, recent_tokens=16,
                         kernel_reads=reads, kernel_writes=True) for reads in (True, False)]
    for cache in caches:
        model(ids, past_key_values=cache)
    layer, twin = (c.layers[0] for c in caches)
    k, v = (torch.randn(2, KV_HEADS, 1, HEAD_DIM, generator=torch.Generator().manual_seed(i)).to(DEVICE)
            for i in range(2))
    assert all(isinstance(t, StandIn) for t in layer.update(k, v))
    assert layer.step is not None and layer.get_seq_length() == 31
    want = twin.update(k, v)
    got = layer.read(torch.float32)
    assert layer.step is None and all(torch.equal(a, b) for a, b in zip(got, want))
    layer.update(k, v)
    layer.update(k, v)          # the step before is written first
    twin.update(k, v)
    twin.update(k, v)
    assert all(torch.equal(a, b) for a, b in zip(layer.read(torch.float32), twin.read(torch.float32)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("axis", ["token", "channel"])
def test_decode_steps_at_fixed_addresses_replay_the_write_with_the_read(axis, monkeypatch):
    """A layer's decode steps whose query, keys, values and output stay put (new values each step) replay one CUDA
    graph of the token's write and the read from the second step at those addresses on (decode.decode_step): the
    output and every byte of the store as the write launched and decode_attention called directly, while key
    blocks leave the window (at lengths 84 and 148); steps whose buffers move replay the graph on buffers of its own,
    the new tokens and the query copied in, and give the same."""
    model = tiny_llama().bfloat16()
    bundle = random_bundle(4, 16, channel_layers=(0,) if axis == "channel" else ())
    ids = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(14)).to(DEVICE)
    caches = [make_cache("oscar", bundle, True) for _ in range(2)]
    for cache in caches:
        with oscar_attention(model, cache):
            model(ids, past_key_values=cache)
    layer, twin = (c.layers[0] for c in caches)
    assert layer.store.key_axis == axis and layer.write is not None
    replayed = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda g: replayed.append(g) or replay(g))
    gen = torch.Generator().manual_seed(15)
    fixed = (torch.empty(2, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE),
             *(torch.empty(2, KV_HEADS, 1, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)))
    steps_replayed, kept = 0, []
    for step in range(80):
        moving = step % 20 >= 16
        q, k, v = (torch.empty_like(t) if moving else t for t in fixed)
        if moving:
            kept.append((q, k, v))      # never at an address of the calls before
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=gen))
        for one in (layer, twin):
            assert isinstance(one.update(k, v)[0], StandIn) and one.step is not None
        replayed.clear()
        got = layer.decode_attention(q, HEAD_DIM ** -0.5)
        entries = [entry for key, entry in layer.store.graphs.items() if key[0] == "step"]
        at_addresses = [g for entry in entries for g in entry.direct.values()]
        steps_replayed += any(g in at_addresses for g in replayed)
        if moving:      # the step's own graph, the new tokens copied in (none on a key's first call)
            assert {id(g) for g in replayed} <= {id(entry.graph) for entry in entries}, step
        (tk, tv), twin.step = twin.step, None
        twin._write_step(tk, tv)
        r = twin.rotation
        want = decode.decode_attention(q, twin.store, r.key_rotation, r.value_rotation, r.value_mean,
                                       HEAD_DIM ** -0.5, max_length=caches[1].sequences.max_length(), graph=False)
        assert torch.equal(got, want), step
        del got, want   # as a model drops them: the next step's output lands where this one was
    assert steps_replayed >= 55         # 64 steps at the fixed addresses, less the first two of each run
    for name in ("key_sink", "key_recent", "key_codes", "key_scale", "key_zero", "value_recent", "value_codes",
                 "value_scale", "value_zero", "lengths"):
        assert torch.equal(getattr(layer.store, name), getattr(twin.store, name)), name
    assert layer.store.lengths.tolist() == [150, 150] and layer.int2_tokens() == (128 if axis == "channel" else 130)


def test_kernel_reads_fall_back():
    model = tiny_llama()
    cache = OscarCache(None, "kivi", num_layers=LAYERS, sink_tokens=4, recent_tokens=16, kernel_reads=True)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with oscar_attention(model, cache):
        decode_logits(model, cache, ids, steps=1)
    assert "per-token" in cache.layers[0].kernel_problem and cache.layers[0].key_store is not None
    off = OscarCache(None, "int2", num_layers=LAYERS, kernel_reads=False)
    with oscar_attention(model, off):
        assert model.config._attn_implementation == "sdpa"         # nothing routed


def orthogonal(heads, d, gen):
    return torch.linalg.qr(torch.randn(heads, d, d, generator=gen, dtype=torch.float64))[0].float()


def two_head_layer(gen, heads, d):
    """A layer of two KV heads with means (the reference's, on the CPU), its tensors on DEVICE, and the Triton
    writes' split key and value rotations."""
    layer = kvstore.LayerRotation(orthogonal(heads, d, gen), orthogonal(heads, d, gen), torch.tensor([0.96, 0.9]),
                                  torch.tensor([0.92, 1.0]), torch.randn(heads, d, generator=gen),
                                  torch.randn(heads, d, generator=gen))
    on = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in vars(layer).items()}
    return (layer, on, write.prepare_rotation(on["key_rotation"], on["key_mean"]),
            write.prepare_rotation(on["value_rotation"], on["value_mean"]))


def test_append_kernel_matches_reference():
    """triton.write.append_kv against kvstore.append: a left-padded prefill, decode steps that push tokens
    out of the ring, a chunk longer than the ring and a short chunk, on one store."""
    gen = torch.Generator().manual_seed(8)
    bsz, heads, d, s, w = 3, 2, 64, 4, 8
    layer, on, kr, vr = two_head_layer(gen, heads, d)
    ref = kvstore.empty_cache(bsz, heads, d, 80, sink_tokens=s, recent_tokens=w)
    got = kvstore.empty_cache(bsz, heads, d, 80, sink_tokens=s, recent_tokens=w, device=DEVICE)

    def append(n, starts=None):
        k = (torch.randn(bsz, heads, n, d, generator=gen) * 2).bfloat16()
        v = torch.randn(bsz, heads, n, d, generator=gen).bfloat16()
        kvstore.advance(ref, n, starts)
        kvstore.advance(got, n, None if starts is None else starts.to(DEVICE))
        kvstore.append(ref, k, v, layer, starts)
        write.append_kv(got, k.to(DEVICE), v.to(DEVICE), kr, vr, on["key_clip"], on["value_clip"],
                        None if starts is None else starts.to(DEVICE), evict=bool(ref.lengths.sum() > n * bsz))

    append(20, torch.tensor([0, 5, 13], dtype=torch.int32))
    for _ in range(10):
        append(1)
    append(11, torch.tensor([0, 2, 0], dtype=torch.int32))
    append(3)
    assert got.lengths.tolist() == ref.lengths.tolist() == [44, 37, 31]
    for name in ("key_sink", "value_sink", "key_recent", "value_recent"):
        a, b = getattr(got, name).float().cpu(), getattr(ref, name).float()
        # The same float32 rotation computed two ways, rounded to bf16 (the interpreter truncates):
        # within one bf16 step, plus a small absolute slack where the rotated value nearly cancels.
        assert ((a - b).abs() <= 2 ** -7 * b.abs() + 1e-3).all(), name
    for side in ("key", "value") if ref.key_codes.shape[2] else ():
        codes = [quant.unpack_int2(getattr(c, f"{side}_codes")).cpu().int() for c in (got, ref)]
        assert (codes[0] == codes[1]).float().mean() > 0.98
        assert (codes[0] - codes[1]).abs().max() <= 1                   # never more than one code step
        for name in ("scale", "zero"):
            a, b = getattr(got, f"{side}_{name}").cpu().int(), getattr(ref, f"{side}_{name}").int()
            assert (a == b).float().mean() > 0.98 and (a - b).abs().max() <= 1


@pytest.mark.parametrize("d,group", [(64, 64), (128, 64), (128, 128), (256, 128)])
def test_write_kernel_codes_equal_reference(d, group):
    gen = torch.Generator().manual_seed(d + group)
    tokens, heads = 45, 3
    mean = torch.randn(heads, d, generator=gen)
    x = (torch.randn(tokens, heads, d, generator=gen) * 2 + mean).bfloat16()
    rot, clip = orthogonal(heads, d, gen), torch.tensor([1.0, 0.96, 0.9])
    ref = kvstore.write_int2(x, rot, clip, group, mean)
    for inp in (x, x.float() + 1e-3 * torch.randn(x.shape, generator=gen)):     # bf16 input, and float32
        want = ref if inp.dtype == torch.bfloat16 else kvstore.write_int2(inp, rot, clip, group, mean)
        got = write.write_int2(inp.to(DEVICE), rot.to(DEVICE), clip.to(DEVICE), group, mean.to(DEVICE), block_t=16)
        for a, b in zip(got, want):
            assert (a.cpu() == b).float().mean() >= 0.999


@pytest.mark.parametrize("axis,n,starts,dtype", [("token", 70, [0, 5, 40], torch.bfloat16),
                                                 ("channel", 70, [0, 5, 40], torch.float32),
                                                 ("channel", 9, [0, 3, 1], torch.bfloat16),
                                                 ("token", 130, [0, 0, 0], torch.float32)])
def test_prefill_kernel_matches_reference(axis, n, starts, dtype):
    """triton.write.prefill_kv (one launch, K and V) into an empty store against kvstore.append: left pads, keys
    per token and per channel (blocks of 16), prefills shorter than the window and with whole INT2 blocks."""
    gen = torch.Generator().manual_seed(n)
    bsz, heads, d, s, w, g, gv = 3, 2, 64, 4, 8, 16, 32
    layer, on, kr, vr = two_head_layer(gen, heads, d)
    ref = kvstore.empty_cache(bsz, heads, d, 140, g, gv, s, w, key_axis=axis)
    got = kvstore.empty_cache(bsz, heads, d, 140, g, gv, s, w, device=DEVICE, key_axis=axis)
    k = (torch.randn(bsz, heads, n, d, generator=gen) * torch.linspace(0.3, 3, d)).to(dtype)
    v = torch.randn(bsz, heads, n, d, generator=gen).to(dtype)
    pads = torch.tensor(starts, dtype=torch.int32)
    kvstore.advance(ref, n, pads)
    kvstore.advance(got, n, pads.to(DEVICE))
    kvstore.append(ref, k, v, layer, pads)
    write.prefill_kv(got, k.to(DEVICE), v.to(DEVICE), kr, vr, on["key_clip"], on["value_clip"], block_t=16)
    assert ref.int2_tokens().tolist() == got.int2_tokens().cpu().tolist()
    for name in ("key_sink", "value_sink", "key_recent", "value_recent"):
        a, b = getattr(got, name).float().cpu(), getattr(ref, name).float()
        assert ((a - b).abs() <= 2 ** -7 * b.abs() + 1e-3).all(), name     # one bf16 step (the interpreter truncates)
    for side in ("key", "value"):
        codes = [quant.unpack_int2(getattr(c, f"{side}_codes")).cpu().int() for c in (got, ref)]
        assert (codes[0] == codes[1]).float().mean() > 0.99
        for name in ("scale", "zero"):
            a, b = getattr(got, f"{side}_{name}").cpu().int(), getattr(ref, f"{side}_{name}").int()
            assert (a == b).float().mean() > 0.99 and (a - b).abs().max() <= 1, (side, name)


def test_loading_a_tile_ahead_changes_no_byte():
    """write_int2_prepared and prefill_kv with each tile's load issued a tile early (`ahead`) write exactly what
    they write without it, on programs that take several tiles (one wave, 16-token tiles)."""
    gen = torch.Generator().manual_seed(3)
    layer, on, kr, vr = two_head_layer(gen, 2, 64)
    x = (torch.randn(150, 2, 64, generator=gen) * 2).bfloat16().to(DEVICE)
    runs = [write.write_int2_prepared(x, kr, on["key_clip"], 32, block_t=16, waves=1, ahead=a) for a in (False, True)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    k, v = (torch.randn(2, 2, 150, 64, generator=gen).bfloat16().to(DEVICE) for _ in range(2))
    for axis in ("token", "channel"):
        stores = []
        for ahead in (False, True):
            st = kvstore.empty_cache(2, 2, 64, 150, 16, 32, 4, 8, device=DEVICE, key_axis=axis)
            kvstore.advance(st, 150, torch.tensor([0, 21], dtype=torch.int32, device=DEVICE))
            write.prefill_kv(st, k, v, kr, vr, on["key_clip"], on["value_clip"], block_t=16, waves=1, ahead=ahead)
            stores.append(st)
        assert min(stores[0].int2_tokens().tolist()) >= 96      # several INT2 tiles a program
        for name in ("codes", "scale", "zero", "sink", "recent"):
            for side in ("key", "value"):
                assert torch.equal(getattr(stores[0], f"{side}_{name}"), getattr(stores[1], f"{side}_{name}")), name


@pytest.mark.parametrize("ahead", [False, True])
def test_key_blocks_in_two_tiles_write_what_one_tile_writes(ahead):
    """Keys per channel in blocks longer than the tile (blocks of 32, tiles of 16: prefill_kv's blocks of 128 in
    64-token tiles) write the same bytes as one tile a block, and kvstore.append's codes; left pads, several
    blocks a program."""
    gen = torch.Generator().manual_seed(32)
    bsz, heads, d, s, w, g, gv, n = 3, 2, 64, 4, 8, 32, 32, 140
    layer, on, kr, vr = two_head_layer(gen, heads, d)
    k = (torch.randn(bsz, heads, n, d, generator=gen) * torch.linspace(0.3, 3, d)).bfloat16()
    v = torch.randn(bsz, heads, n, d, generator=gen).bfloat16()
    pads = torch.tensor([0, 5, 40], dtype=torch.int32)
    ref = kvstore.empty_cache(bsz, heads, d, 160, g, gv, s, w, key_axis="channel")
    kvstore.advance(ref, n, pads)
    kvstore.append(ref, k, v, layer, pads)
    stores = []
    for block_t in (32, 16):
        st = kvstore.empty_cache(bsz, heads, d, 160, g, gv, s, w, device=DEVICE, key_axis="channel")
        kvstore.advance(st, n, pads.to(DEVICE))
        write.prefill_kv(st, k.to(DEVICE), v.to(DEVICE), kr, vr, on["key_clip"], on["value_clip"], block_t=block_t,
                         waves=1, ahead=ahead)
        stores.append(st)
    assert min(stores[0].int2_tokens().tolist()) >= 64      # several key blocks a program
    for name in ("codes", "scale", "zero", "sink", "recent"):
        for side in ("key", "value"):
            assert torch.equal(getattr(stores[0], f"{side}_{name}"), getattr(stores[1], f"{side}_{name}")), (side, name)
    codes = [quant.unpack_int2(c.key_codes).cpu().int() for c in (stores[1], ref)]
    assert (codes[0] == codes[1]).float().mean() > 0.99


def assert_store_matches(got, ref, codes_equal=0.98, meta_equal=0.97):
    """got (the Triton writes) against ref (kvstore's torch writes): BF16 windows within a bf16 step, INT2 codes equal
    but for a small share, and those one code step apart (the kernels' reciprocals, write.py's docstring)."""
    for name in ("key_sink", "value_sink", "key_recent", "value_recent"):
        a, b = getattr(got, name).float().cpu(), getattr(ref, name).float()
        assert ((a - b).abs() <= 2 ** -7 * b.abs() + 1e-3).all(), name
    for side in ("key", "value") if ref.key_codes.shape[2] else ():
        codes = [quant.unpack_int2(getattr(c, f"{side}_codes")).cpu().int() for c in (got, ref)]
        assert (codes[0] == codes[1]).float().mean() > codes_equal, side
        assert (codes[0] - codes[1]).abs().max() <= 1, side
        for name in ("scale", "zero"):
            a, b = getattr(got, f"{side}_{name}").cpu().int(), getattr(ref, f"{side}_{name}").int()
            assert (a == b).float().mean() > meta_equal and (a - b).abs().max() <= 1, (side, name)


@pytest.mark.parametrize("axis", ["token", "channel", "bf16"])
def test_window_store_kernels_match_reference(axis):
    """A window's store (kvstore.window_cache, a sink of 4): prefill_kv of a left-padded batch longer than the window,
    decode steps and chunks through the Triton writes, each wrapping the INT2 rows, against kvstore.append; then
    the decode kernel on that store against the reference, which reads exactly the last N tokens of each sequence
    (test_kvstore). Keys per token: N = 120, 64 rows and 56 BF16 slots, a chunk longer than the ring. Keys per
    channel (blocks of 64, leave_blocks then append_kv): N = 250, 192 rows and a ring of 58 + 64 slots, so the
    oldest block held keeps up to 63 rows the decode programs skip. A window kept whole in BF16 ("bf16": no rows, a
    ring of 120): the writes fill only the sink and the ring, and the decode's window programs read it alone."""
    gen = torch.Generator().manual_seed(120)
    bsz, heads, d = 3, 2, 64
    layer, on, kr, vr = two_head_layer(gen, heads, d)
    window, kw = {"token": (120, {}), "channel": (250, dict(key_axis="channel")), "bf16": (120, dict(int2=False))}[axis]
    ref = kvstore.window_cache(bsz, heads, d, window, 64, 64, 4, 8, **kw)
    got = kvstore.window_cache(bsz, heads, d, window, 64, 64, 4, 8, device=DEVICE, **kw)
    want = {"token": (56, 64), "channel": (58, 192), "bf16": (120, 0)}[axis]
    assert (got.recent_tokens, got.key_codes.shape[2]) == want

    def append(n, starts=None, prefill=False):
        k = (torch.randn(bsz, heads, n, d, generator=gen) * 2).bfloat16()
        v = torch.randn(bsz, heads, n, d, generator=gen).bfloat16()
        kvstore.advance(ref, n, starts)
        kvstore.advance(got, n, None if starts is None else starts.to(DEVICE))
        kvstore.append(ref, k, v, layer, starts)
        st = None if starts is None else starts.to(DEVICE)
        args = (got, k.to(DEVICE), v.to(DEVICE), kr, vr, on["key_clip"], on["value_clip"])
        if prefill:
            write.prefill_kv(*args, block_t=16)
        elif axis == "channel":
            write.leave_blocks(got, on["key_clip"], on["value_clip"], n, st)
            write.append_kv(*args, st, evict=False)
        else:
            write.append_kv(*args, st)

    append(400 if axis == "channel" else 200, torch.tensor([0, 5, 110], dtype=torch.int32), prefill=True)
    assert_store_matches(got, ref)
    for _ in range(9):
        append(1)
    append(40 if axis == "channel" else 70, torch.tensor([0, 2, 0], dtype=torch.int32))
    append(3)
    assert got.lengths.tolist() == ref.lengths.tolist()
    assert_store_matches(got, ref, meta_equal=0.95)    # tokens evicted from rings a bf16 step apart
    q = torch.randn(bsz, 2 * heads, d, generator=gen).to(DEVICE)
    args = (q, got, on["key_rotation"], on["value_rotation"], on["value_mean"], 0.125)
    want = kvstore.decode_attention_reference(*args)
    if axis == "channel":      # the reference skips expired rows of the oldest block held
        assert [got.first_live(n, (n - 62) // 64 * 64) % 64 for n in got.lengths.tolist()] != [0, 0, 0]
    plan = dataclasses.replace(decode.plan_for(q, got), block_n=32)
    err = (decode.decode_attention(*args, plan) - want).norm(dim=-1) / want.norm(dim=-1)
    assert err.max() < 2e-2, err


@pytest.mark.parametrize("axis,layout", [("token", "tiles"), ("channel", "rows")])
def test_write_kernels_at_head_dim_256(axis, layout):
    """head_dim 256 (Gemma 3), where each program rotates half the channels (write.columns): prefill_kv with left
    pads, then decode steps through append_kv (and leave_blocks, keys per channel) against kvstore.append."""
    gen = torch.Generator().manual_seed(256)
    bsz, heads, d, s, w, g, gv = 2, 2, 256, 4, 8, 16 if axis == "channel" else 64, 128
    assert write.columns(d) == 128
    layer, on, kr, vr = two_head_layer(gen, heads, d)
    kw = dict(key_axis=axis, value_layout=layout)
    ref = kvstore.empty_cache(bsz, heads, d, 90, g, gv, s, w, **kw)
    got = kvstore.empty_cache(bsz, heads, d, 90, g, gv, s, w, device=DEVICE, **kw)
    scale = torch.linspace(0.3, 3, d)

    def tokens(n):
        return (torch.randn(bsz, heads, n, d, generator=gen) * scale).bfloat16(), \
            torch.randn(bsz, heads, n, d, generator=gen).bfloat16()

    k, v = tokens(50)
    pads = torch.tensor([0, 9], dtype=torch.int32)
    for c, p in ((ref, pads), (got, pads.to(DEVICE))):
        kvstore.advance(c, 50, p)
    kvstore.append(ref, k, v, layer, pads)
    write.prefill_kv(got, k.to(DEVICE), v.to(DEVICE), kr, vr, on["key_clip"], on["value_clip"], block_t=16)
    for _ in range(20):
        k, v = tokens(1)
        kvstore.advance(ref, 1)
        kvstore.advance(got, 1)
        kvstore.append(ref, k, v, layer)
        if axis == "channel":
            write.leave_blocks(got, on["key_clip"], on["value_clip"], 1)
        write.append_kv(got, k.to(DEVICE), v.to(DEVICE), kr, vr, on["key_clip"], on["value_clip"],
                        evict=axis == "token")
    assert got.lengths.tolist() == ref.lengths.tolist() == [70, 61]
    assert min(ref.int2_tokens().tolist()) >= 48
    assert_store_matches(got, ref)


def test_shapes_the_kernels_cannot_take_fall_back_to_torch():
    from oscar_core.layers import LayerSpec
    from oscar_core.serve import methods
    from oscar_core.serve.cache import serving_problem

    def write_problem(lm, head_dim):
        return serving_problem(lm, 2, head_dim, "write")

    lm = methods.layer_method("int2", 0, 2, 256, None)
    assert serving_problem(lm, 2, 256, query_heads=16) is None
    assert "16 query heads per KV head" in serving_problem(lm, 2, 256, query_heads=40)
    assert write_problem(lm, 256) is None       # two programs a head, 128 channels each (write.columns)
    wide = methods.LayerMethod(methods.Side(256), methods.Side(64))
    assert "groups of up to 128 channels" in write_problem(wide, 256)
    assert write_problem(methods.LayerMethod(methods.Side(64, "channel"), methods.Side(128)), 256) is None
    assert write.columns(64) == 64 and write.columns(256, (64, 128)) == 128 and write.columns(256, (64,), 64) == 64
    with pytest.raises(ValueError, match="groups of up to 128 channels"):
        write.columns(256, (256,))
    with pytest.raises(ValueError, match="power-of-two share"):
        write.columns(256, (), 96)
    lm = methods.layer_method("int2", 0, 2, 256, None)
    channel = methods.LayerMethod(methods.Side(8, "channel"), lm.value)
    assert "blocks of 16 to 256 tokens" in write_problem(channel, 64)
    channel = methods.LayerMethod(methods.Side(16, "channel"), lm.value)
    assert write_problem(channel, 64) is None and "head_dim 32" in write_problem(channel, 16)
    lm = methods.layer_method("int2", 0, 2, 192, None)
    assert "head_dim 64, 128 or 256" in serving_problem(lm, 2, 192)
    kivi = methods.layer_method("kivi", 0, 2, 64, None)
    assert "per-token groups" in serving_problem(kivi, 2, 64, "store", method="kivi")
    lm = methods.layer_method("int2", 0, 2, 64, None)
    for window, problem in ((48, "no tile of INT2 rows"), (100, None), (8, None)):  # INT2 over 2·(4 + 16) tokens
        got = serving_problem(lm, 2, 64, "store", spec=LayerSpec(window=window), sink=4, recent=16)
        assert got == problem if problem is None else problem in got, window


def test_channel_key_write_kernels_match_reference():
    """Keys per channel: leave_blocks + append_kv (Triton) against kvstore.append, through appends of up to W
    tokens with left pads and decode steps across several block boundaries."""
    gen = torch.Generator().manual_seed(10)
    bsz, heads, d, s, w, g, gv = 3, 2, 64, 4, 8, 16, 32
    layer, on, kr, vr = two_head_layer(gen, heads, d)
    ref = kvstore.empty_cache(bsz, heads, d, 90, g, gv, s, w, key_axis="channel")
    got = kvstore.empty_cache(bsz, heads, d, 90, g, gv, s, w, device=DEVICE, key_axis="channel")

    def append(n, starts=None):
        k = (torch.randn(bsz, heads, n, d, generator=gen) * torch.linspace(0.3, 3, d)).bfloat16()
        v = torch.randn(bsz, heads, n, d, generator=gen).bfloat16()
        on_starts = None if starts is None else starts.to(DEVICE)
        kvstore.advance(ref, n, starts)
        kvstore.advance(got, n, on_starts)
        kvstore.append(ref, k, v, layer, starts)
        write.leave_blocks(got, on["key_clip"], on["value_clip"], n, on_starts)
        write.append_kv(got, k.to(DEVICE), v.to(DEVICE), kr, vr, on["key_clip"], on["value_clip"], on_starts,
                        evict=False)

    append(7, torch.tensor([0, 2, 6], dtype=torch.int32))
    for _ in range(40):
        append(1)
    append(8, torch.tensor([0, 3, 0], dtype=torch.int32))
    for _ in range(3):
        append(1)
    assert got.lengths.tolist() == ref.lengths.tolist() == [58, 53, 52]
    assert ref.int2_tokens().tolist() == [32, 32, 32]
    for name in ("key_sink", "value_sink", "key_recent", "value_recent"):
        a, b = getattr(got, name).float().cpu(), getattr(ref, name).float()
        assert ((a - b).abs() <= 2 ** -7 * b.abs() + 1e-3).all(), name
    for side in ("key", "value") if ref.key_codes.shape[2] else ():
        codes = [quant.unpack_int2(getattr(c, f"{side}_codes")).cpu().int() for c in (got, ref)]
        assert (codes[0] == codes[1]).float().mean() > 0.98
        assert (codes[0] - codes[1]).abs().max() <= 1
        for name in ("scale", "zero"):
            a, b = getattr(got, f"{side}_{name}").cpu().int(), getattr(ref, f"{side}_{name}").int()
            assert (a == b).float().mean() > 0.97 and (a - b).abs().max() <= 1, (side, name)
    with pytest.raises(ValueError, match="leave_blocks"):
        write.append_kv(got, *[torch.zeros(bsz, heads, 9, d, device=DEVICE)] * 2, kr, vr, on["key_clip"],
                        on["value_clip"], evict=False)


@pytest.mark.slow      # 42 s on the CPU; keys per channel stay in the fast suite beside a sliding layer (below)
def test_mixed_bundle_kernel_reads_match_torch_reads():
    """Keys per channel in layer 0 (blocks of 64 tokens), per token in layer 1, a left-padded batch: written by
    the Triton kernels (leave_blocks + append_kv on decode steps) and read by the decode kernel, against each
    sequence alone through torch writes and reads, across a block boundary (L = 4 + 16 + 2·64 = 148)."""
    model = tiny_llama()
    bundle = random_bundle(4, 16, channel_layers=(0,))
    ids = torch.randint(0, 256, (2, 140), generator=torch.Generator().manual_seed(12)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    cache = make_cache("oscar", bundle, True)
    with oscar_attention(model, cache):
        got = decode_logits(model, cache, ids, steps=8, mask=mask)
    layer = cache.layers[0]
    assert layer.store.key_axis == "channel" and layer.kernel_problem is None and layer.write is not None
    assert layer.store.lengths.tolist() == [148, 143] and layer.store.int2_tokens().tolist() == [128, 64]
    assert cache.layers[1].store.key_axis == "token"
    for b, start in ((0, 0), (1, 5)):
        alone = make_cache("oscar", bundle, False)
        want = decode_logits(model, alone, ids[b:b + 1, start:], steps=8)
        err = (got[b] - want[0]).norm(dim=-1) / want[0].norm(dim=-1)
        assert err.max() < 3e-2, (b, err)
        ref = alone.layers[0].store
        for name in ("key_codes", "key_scale", "key_zero", "value_codes"):
            a, r = getattr(layer.store, name)[b:b + 1], getattr(ref, name)
            rows = min(a.shape[2], r.shape[2])
            assert (a[:, :, :rows] == r[:, :, :rows]).float().mean() > 0.98, name


def test_channel_blocks_the_kernel_cannot_read_fall_back_to_torch():
    """Key blocks of 32 tokens: the decode kernel refuses them (plan.shape_problem, the one place that decides,
    before any launch), so the layer reads in torch with one warning; its Triton writes still match the torch ones."""
    from oscar_core.serve import methods
    from oscar_core.serve.cache import serving_problem

    model = tiny_llama()
    bundle = random_bundle(4, 16, channel_layers=(0, 1), key_group=32)
    lm = methods.layer_method("oscar", 0, KV_HEADS, HEAD_DIM, bundle)
    assert "key blocks of 64, 128 or 256 tokens" in serving_problem(lm, KV_HEADS, HEAD_DIM, query_heads=HEADS)
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(13)).to(DEVICE)
    want = decode_logits(model, make_cache("oscar", bundle, False), ids, steps=3)
    cache = make_cache("oscar", bundle, True)
    with oscar_attention(model, cache), pytest.warns(UserWarning, match="torch reads"):
        got = decode_logits(model, cache, ids, steps=3)
    assert cache.layers[0].write is not None and not cache.reads_by_kernel()
    assert cache.layers[0].store.int2_tokens().tolist() == [32]
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)
    # The prefill's ring is the kernel's (prefill_kv): its float32 rotation differs from torch's in the last
    # bits, so a few bf16 values round the other way, and the block quantized from them at a decode step takes
    # a few other scale codes (4 of 128 here): 3e-2 of this tiny random model's logits, 4e-4 with torch's ring.
    assert err.max() < 5e-2, err


# The two slowest cases on the CPU (37-66 s each) run with the slow tests, keeping `make test` within 15 minutes.
@pytest.mark.parametrize("head_dim,window,axis", [
    (HEAD_DIM, 8, "token"), pytest.param(256, 8, "token", marks=pytest.mark.slow), (HEAD_DIM, 48, "token"),
    pytest.param(HEAD_DIM, 100, "token", marks=pytest.mark.slow), (HEAD_DIM, 100, "channel")])
def test_kernel_reads_beside_sliding_layers(head_dim, window, axis):
    """Gemma 3 (layers 0 and 2 slide, layer 1 global, INT2; its own head_dim, 256, too): inside oscar_attention the
    global layer is written and decoded by the kernels, in a left-padded batch, against each sequence decoded alone
    through torch writes and reads. Windows of 8 are kept whole in BF16 (window stores with no INT2 rows and no sink:
    a ring of 8, which the kernels write and read); one of 48, over
    2·(sink + recent) = 40 but short of
    a tile of INT2 rows beside the ring, holds INT2 in the sliding layers' SideStores, read by torch, and the global
    layer still counts the sequences' tokens; one of 100 is a window's store (64 INT2 rows, 36 BF16 slots), which
    the kernels write and read too (no mask), with prompts longer than the window (its rows wrap); with a bundle's
    keys per channel (blocks of 64) the same window holds 64 rows beside 36 BF16 tokens, up to 63 of them gone."""
    import transformers as tf

    config = tf.Gemma3TextConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=3, num_attention_heads=HEADS,
                                 num_key_value_heads=KV_HEADS, head_dim=head_dim, vocab_size=256,
                                 max_position_embeddings=256, sliding_window=window,
                                 layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().to(DEVICE)
    n = {8: 70, 48: 70, 100: 250 if axis == "channel" else 150}[window]
    ids = torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :15] = 0

    def cache(kernel):
        if axis == "channel":
            bundle = random_bundle(4, 16, channel_layers=(0, 1, 2), layers=3, windows={0: window, 2: window})
            return OscarCache(bundle, "oscar", kernel_reads=kernel, kernel_writes=kernel)
        return OscarCache(None, "int2", config=config, sink_tokens=4, recent_tokens=16, kernel_reads=kernel,
                          kernel_writes=kernel)

    by_kernel = cache(True)
    calls = []
    for i in (1, 2) if window in (8, 100) else (1,):      # the global layer, and a window's store
        real = by_kernel.layers[i].decode_attention
        by_kernel.layers[i].decode_attention = lambda *a, i=i, real=real: calls.append(i) or real(*a)
    with oscar_attention(model, by_kernel):
        got = decode_logits(model, by_kernel, ids, steps=3, mask=mask)
        every = by_kernel.reads_by_kernel()     # then decode steps build no mask
    if window == 8:
        store = by_kernel.layers[0].store
        assert store.key_codes.shape[2] == 0 and store.ring_slots == 8 and store.sink_tokens == 0 and every
    elif window == 48:
        assert by_kernel.layers[0].key_store is not None and by_kernel.layers[0].window == window
    else:
        assert by_kernel.layers[0].store.window == window and every
        assert by_kernel.layers[0].write is not None and by_kernel.layers[0].store.int2_tokens().tolist() == [64, 64]
        assert by_kernel.layers[0].store.key_axis == axis
    assert calls == ([1, 2] * 3 if window in (8, 100) else [1] * 3)
    assert by_kernel.layers[1].write is not None        # the Triton write kernels, at head_dim 256 too
    for b, start in ((0, 0), (1, 15)):
        want = decode_logits(model, cache(False), ids[b:b + 1, start:], steps=3)
        err = (got[b] - want[0]).norm(dim=-1) / want[0].norm(dim=-1)
        assert err.max() < 3e-2, (b, err)
