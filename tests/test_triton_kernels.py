"""The Triton kernels against kvstore's reference, on the CPU through Triton's interpreter.

triton.jit reads TRITON_INTERPRET when it decorates a kernel, so the variable is set before the
kernel modules are imported, and they are reloaded if another test module imported them first."""

import dataclasses
import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from oscar_core import kvstore  # noqa: E402
from oscar_core.triton import decode, write  # noqa: E402

if not torch.cuda.is_available() and not isinstance(decode._split_kernel, triton.runtime.interpreter.InterpretedFunction):
    write = importlib.reload(sys.modules["oscar_core.triton.write"])
    decode = importlib.reload(sys.modules["oscar_core.triton.decode"])

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def orthogonal(heads, d, gen):
    return torch.linalg.qr(torch.randn(heads, d, d, generator=gen, dtype=torch.float64))[0].float()


@pytest.mark.parametrize("d,group", [(64, 64), (128, 64), (128, 128)])
def test_write_kernel_matches_reference(d, group):
    gen = torch.Generator().manual_seed(d + group)
    tokens, heads = 45, 3
    mean = torch.randn(heads, d, generator=gen)
    x = (torch.randn(tokens, heads, d, generator=gen) * 2 + mean).bfloat16()
    x[5, 1, 7] = 60.0  # an outlier group
    x[9, 2] = 40.0 + 1e-3 * x[9, 2].float()  # a far-off-centre group: the step widens
    rot = orthogonal(heads, d, gen)
    clip = torch.tensor([1.0, 0.96, 0.9])
    ref = kvstore.write_int2(x, rot, clip, group, mean)
    out = (torch.full((tokens, heads, d // 4), 0xA5, dtype=torch.uint8, device=DEVICE),
           torch.full((tokens, heads, d // group), 0xA5, dtype=torch.uint8, device=DEVICE),
           torch.full((tokens, heads, d // group), -91, dtype=torch.int8, device=DEVICE))
    write.write_int2(x.to(DEVICE), rot.to(DEVICE), clip.to(DEVICE), group, mean.to(DEVICE), out=out)
    out = [t.cpu() for t in out]
    for got, want in zip(out, ref):
        assert (got == want).float().mean() >= 0.999
    got, want = kvstore.read_int2(*out, group), kvstore.read_int2(*ref, group)
    assert (got - want).norm() / want.norm() < 1e-2


def test_write_kernel_into_cache_view():
    gen = torch.Generator().manual_seed(7)
    heads, d = 2, 64
    x = torch.randn(20, heads, d, generator=gen).bfloat16()
    rot, clip = orthogonal(heads, d, gen), torch.full((heads,), 0.9)
    cache = kvstore.empty_cache(1, heads, d, 400, device=DEVICE)
    rows = slice(3, 23)
    view = (cache.key_codes[0, :, rows].transpose(0, 1), cache.key_scale[0, :, rows].transpose(0, 1),
            cache.key_zero[0, :, rows].transpose(0, 1))
    write.write_int2(x.to(DEVICE), rot.to(DEVICE), clip.to(DEVICE), 64, out=view)
    ref = kvstore.write_int2(x, rot, clip, 64)
    assert (cache.key_codes[0, :, rows].transpose(0, 1).cpu() == ref[0]).float().mean() >= 0.999
    assert (cache.key_codes[0, :, :3] == 0).all() and (cache.key_codes[0, :, 23:] == 0).all()


def build(gen, lengths, heads, kv_heads, d, key_group, value_group, sink=64, recent=256):
    """A prefilled cache of data whose per-channel offset the bundle's means capture."""
    bsz, longest = len(lengths), max(lengths)
    mk, mv = torch.randn(kv_heads, d, generator=gen), torch.randn(kv_heads, d, generator=gen)
    layer = kvstore.LayerRotation(orthogonal(kv_heads, d, gen), orthogonal(kv_heads, d, gen),
                                  torch.full((kv_heads,), 0.96), torch.full((kv_heads,), 0.92), mk, mv)
    keys = (torch.randn(bsz, longest, kv_heads, d, generator=gen) + mk).bfloat16()
    values = (torch.randn(bsz, longest, kv_heads, d, generator=gen) + mv).bfloat16()
    cache = kvstore.empty_cache(bsz, kv_heads, d, longest + 8, key_group, value_group, sink, recent)
    kvstore.prefill(cache, keys, values, torch.tensor(lengths), layer)
    q = torch.randn(bsz, heads, d, generator=gen)
    return cache, layer, q


def to_device(cache):
    return kvstore.to_device(cache, DEVICE)


@pytest.mark.parametrize("d,heads,kv_heads,key_group,value_group,lengths,key_t", [
    (64, 16, 2, 64, 64, [700, 50, 330, 1], True),
    (64, 14, 2, 64, 64, [300, 41, 130, 7, 70, 200, 5, 99], True),   # 16 pairs at d 64: the reduce's 8 columns
    (128, 8, 2, 64, 64, [900, 321, 64, 65], True),
    (128, 8, 2, 64, 64, [900, 321, 64, 65], False),
    (128, 8, 2, 64, 128, [419, 7], False),
    (128, 8, 2, 128, 128, [419, 7], True),   # the upstream runtime's group size, for keys and values
])
def test_decode_kernel_matches_reference(monkeypatch, d, heads, kv_heads, key_group, value_group, lengths, key_t):
    gen = torch.Generator().manual_seed(d + len(lengths))
    cache, layer, q = build(gen, lengths, heads, kv_heads, d, key_group, value_group)
    scaling = d ** -0.5
    ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation,
                                             layer.value_mean, scaling)
    poisoned = torch.full((len(lengths), heads, d), float("nan"), device=DEVICE)
    empty = torch.empty
    # Every work buffer starts as NaN too: a partial result the kernel forgets to write shows.
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan"))
                        if k.get("dtype", torch.float32).is_floating_point else empty(*a, **k))
    out = decode.decode_attention(q.to(DEVICE), to_device(cache), layer.key_rotation.to(DEVICE),
                                  layer.value_rotation.to(DEVICE), layer.value_mean.to(DEVICE), scaling,
                                  block_n=32, out=poisoned, key_t=key_t)
    monkeypatch.undo()
    out = out.cpu()
    assert torch.isfinite(out).all()
    err = (out - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert err.max() < 1e-2, err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_eager_calls_replay_a_graph_kept_on_the_store():
    """An eager call on CUDA replays a graph captured after its first call: the bits of a direct call with the
    same (rounded-up) max_length, for new queries and changed lengths; a max_length in the same power-of-two
    bucket reuses the graph, a larger one captures another."""
    gen = torch.Generator().manual_seed(5)
    cache, layer, q = build(gen, [900, 321], 8, 2, 128, 64, 64)
    cache = to_device(cache)
    args = [t.to(DEVICE) for t in (layer.key_rotation, layer.value_rotation, layer.value_mean)] + [128 ** -0.5]

    def call(qq, max_length=1000, **kw):
        return decode.decode_attention(qq, cache, *args, max_length=max_length, **kw)

    call(q.to(DEVICE))
    assert len(cache.graphs) == 1
    for _ in range(3):
        cache.lengths -= 7
        q = torch.randn(q.shape, generator=gen).to(DEVICE)
        assert torch.equal(call(q), call(q, 1024, graph=False))
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=DEVICE)
    assert call(q, out=out) is out and torch.equal(out, call(q, 1024, graph=False).bfloat16())
    call(q, 1020)
    assert len(cache.graphs) == 2               # the bf16 output is a graph of its own
    call(q, 3000)
    assert len(cache.graphs) == 3
    for max_length in (5000, 9000, 17000):
        call(q, max_length)
    assert len(cache.graphs) == decode.GRAPHS_PER_STORE
    assert torch.equal(call(q, 17000), call(q, 32768, graph=False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_eager_calls_at_the_same_addresses_replay_a_graph_of_their_own():
    """A call whose q and out are where one of the two calls before had them captures a graph reading and writing
    there, and later calls at those addresses replay it with no copies: the bits of a direct call, for new query
    values and changed lengths, with out given or not, at one address or two in turn; calls whose buffers move keep
    the copying graph and capture nothing."""
    gen = torch.Generator().manual_seed(6)
    cache, layer, q = build(gen, [900, 321], 8, 2, 128, 64, 64)
    cache = to_device(cache)
    args = [t.to(DEVICE) for t in (layer.key_rotation, layer.value_rotation, layer.value_mean)] + [128 ** -0.5]
    q = q.to(DEVICE).bfloat16()
    out = torch.empty_like(q)

    def call(qq, max_length=1000, **kw):
        return decode.decode_attention(qq, cache, *args, max_length=max_length, **kw)

    def direct(qq):
        return call(qq, 1024, graph=False)

    replays = lambda: next(iter(cache.graphs.values()))  # noqa: E731
    for _ in range(2):
        call(q, out=out)
    assert len(cache.graphs) == 1 and list(replays().direct) == [(q.data_ptr(), out.data_ptr())]
    for _ in range(3):
        cache.lengths -= 5
        q.copy_(torch.randn(q.shape, generator=gen))
        out.zero_()
        assert call(q, out=out) is out and torch.equal(out, direct(q))
    pair = [torch.empty_like(out) for _ in range(2)]   # outputs alternating: a graph at each, from their second call
    for i in range(6):
        assert torch.equal(call(q, out=pair[i % 2]), direct(q))
    pairs = {(q.data_ptr(), o.data_ptr()) for o in pair}
    assert set(replays().direct) == pairs
    moving = [(torch.randn(q.shape, generator=gen).to(DEVICE).bfloat16(), torch.empty_like(out)) for _ in range(3)]
    for qq, oo in moving * 2:
        assert torch.equal(call(qq, out=oo), direct(qq))
    assert set(replays().direct) == pairs
    for _ in range(3):          # out=None: where the allocator hands the freed output back, a graph of its own
        assert torch.equal(call(q), direct(q))
    assert len(replays().direct) <= decode.DIRECT_GRAPHS
    strided = torch.randn(q.shape[0], q.shape[2], q.shape[1], generator=gen).to(DEVICE).bfloat16().transpose(1, 2)
    for _ in range(2):
        assert torch.equal(call(strided, out=out), direct(strided))
    assert len(cache.graphs) == 1 and len(replays().direct) <= decode.DIRECT_GRAPHS


def relative_errors(out, ref):
    return (out.cpu().float() - ref).norm(dim=-1) / ref.norm(dim=-1)


# Every shape class a supported model has, small: head_dim 64/128/256, query heads per KV head 1, 4, 5, 7, 8
# (and 2), groups of 64 and 128, ragged batches (one token, below sink + recent, long beside short).
# Windows of 16 + 32 tokens so that short sequences reach the INT2 rows. No value mean: the output is then
# a small average of centred values, the hardest case for a relative error (bound 1e-2, see kernel.md).
SHAPES = [
    (64, 8, 2, 64, 64, [1, 40, 600, 7]),
    (128, 5, 1, 64, 128, [300, 1]),
    (128, 7, 1, 128, 128, [333, 45]),
    (128, 2, 2, 128, 64, [200, 3]),
    (256, 8, 1, 64, 64, [260, 20]),
    (256, 4, 2, 128, 128, [150, 49]),
]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("d,heads,kv_heads,key_group,value_group,lengths", SHAPES)
def test_decode_kernel_every_shape(d, heads, kv_heads, key_group, value_group, lengths, fused):
    gen = torch.Generator().manual_seed(d * heads + kv_heads)
    cache, layer, q = build(gen, lengths, heads, kv_heads, d, key_group, value_group, sink=16, recent=32)
    ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation, None, d ** -0.5)
    out = decode.decode_attention(q.to(DEVICE), to_device(cache), layer.key_rotation.to(DEVICE),
                                  layer.value_rotation.to(DEVICE), None, d ** -0.5, block_n=64, fused=fused,
                                  key_t=fused)
    err = relative_errors(out, ref)
    assert err.max() < 1e-2, err


def test_decode_kernel_unsupported_shapes_raise_before_launch():
    gen = torch.Generator().manual_seed(3)
    cache, layer, q = build(gen, [40], 4, 1, 64, 64, 64, sink=16, recent=32)
    args = (layer.key_rotation, layer.value_rotation, None, 0.125)
    with pytest.raises(ValueError, match="head_dim"):
        decode.check_shape(4, 1, 192, 64, 64)
    with pytest.raises(ValueError, match="group size"):
        decode.check_shape(4, 1, 128, 32, 64)
    with pytest.raises(ValueError, match="head_dim 64, 128 or 256, not 32"):
        decode.decode_attention(q[:, :, :32], cache, *args)
    with pytest.raises(ValueError, match="not a multiple"):
        decode.check_shape(6, 4, 128, 64, 64)
    with pytest.raises(ValueError, match="up to 16"):
        decode.check_shape(68, 2, 128, 64, 64)


def reference_and_args(seed, lengths, heads, kv_heads):
    """The float32 reference of a small head_dim-64 store (windows of 16 + 32 tokens) and decode_attention's
    positional arguments over it on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    cache, layer, q = build(gen, lengths, heads, kv_heads, 64, 64, 64, sink=16, recent=32)
    ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation,
                                             layer.value_mean, 0.125)
    return ref, (q.to(DEVICE), to_device(cache), layer.key_rotation.to(DEVICE), layer.value_rotation.to(DEVICE),
                 layer.value_mean.to(DEVICE), 0.125)


def test_decode_kernel_result_does_not_depend_on_max_length():
    """max_length only sizes the grid: a wrong hint (shorter than the data, or the capacity) reads every
    token; the merge counters are left at zero for the next call, and a call repeated gives the same bits
    (the reduce sums its programs' shares in a fixed order, whichever finishes last)."""
    ref, args = reference_and_args(4, [500, 90], 4, 1)
    for max_length, fused in ((None, True), (60, True), (500, True), (60, False)):
        out = decode.decode_attention(*args, max_length=max_length, block_n=64, fused=fused)
        assert relative_errors(out, ref).max() < 1e-2
    assert torch.equal(decode.decode_attention(*args, max_length=60, block_n=64), out)
    assert (decode._counters(torch.device(DEVICE), 2) == 0).all()


@pytest.mark.parametrize("fused,mean", [(False, True), (False, False), (True, True)])
def test_decode_kernel_without_value_rotation_stays_in_the_stored_space(fused, mean):
    """value_rotation None (R_V held by the model's weights): the output is õ (+ μ_V) in the values' stored space,
    the reference's with R_V = I; the reduce merges the splits and writes its columns without shares."""
    gen = torch.Generator().manual_seed(12)
    cache, layer, q = build(gen, [500, 90, 7], 8, 2, 64, 64, 64, sink=16, recent=32)
    mu = layer.value_mean if mean else None
    ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, None, mu, 0.125)
    rotated = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation, mu, 0.125)
    out = decode.decode_attention(q.to(DEVICE), to_device(cache), layer.key_rotation.to(DEVICE), None,
                                  None if mu is None else mu.to(DEVICE), 0.125, block_n=64, fused=fused,
                                  graph=False)
    assert relative_errors(out, ref).max() < 1e-2
    assert relative_errors(out, rotated).max() > 0.1
    plan = decode.launch_plan(q.to(DEVICE), to_device(cache), block_n=64, fused=fused, has_mean=mean,
                              rotate_values=False)
    assert plan.work == plan.split * (64 + 2)


def test_reduce_over_many_splits_drops_the_empty_ones():
    """Beyond 64 splits a (sequence, KV head) the reduce loads each split's partials beside its l (not gated on it):
    a short sequence's empty splits, whose partials are never written, still count for nothing."""
    ref, args = reference_and_args(6, [5000, 200], 8, 2)
    plan = decode.launch_plan(args[0], args[1], block_n=64, waves=200, gluon=False)
    assert plan.ns > 64 and not plan.reduce_consts["GATED"]
    out = decode.decode_attention(*args, block_n=64, waves=200, gluon=False, graph=False)
    assert relative_errors(out, ref).max() < 1e-2


def test_head_blocks_by_the_launches_programs():
    """A reduce program takes the fewest heads (from 2) that keep the launch within 512 programs, a rotation program
    at most 4."""
    assert decode.reduce_heads(16, 2 * 16) == 2          # GQA 16 at batch 1: 256 programs
    assert decode.reduce_heads(16, 16 * 8) == 4          # at batch 8: 512
    assert decode.reduce_heads(8, 64 * 8) == 8           # GQA 8 at batch 8: all 8 heads, 512 programs
    assert decode.reduce_heads(4, 64 * 8) == 4 and decode.reduce_heads(1, 8) == 1 and decode.reduce_heads(3, 3) == 2
    assert [decode.rotate_heads(h) for h in (1, 2, 3, 4, 8, 14, 16)] == [1, 2, 4, 4, 4, 4, 4]


@pytest.mark.parametrize("reduce_heads,rotate_heads", [(16, 16), (4, 2), (2, 4), (8, 16)])
def test_head_blocks_give_every_head_its_output(monkeypatch, reduce_heads, rotate_heads):
    """However the reduce and the rotation divide a KV head's 14 heads (padded to 16) among programs, every head's
    output is the reference's, and the arms agree with one another."""
    gen = torch.Generator().manual_seed(14)
    cache, layer, q = build(gen, [700, 50, 330], 14, 1, 64, 64, 64)
    ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation,
                                             layer.value_mean, 0.125)
    args = (q.to(DEVICE), to_device(cache), layer.key_rotation.to(DEVICE), layer.value_rotation.to(DEVICE),
            layer.value_mean.to(DEVICE), 0.125)
    whole = decode.decode_attention(*args, graph=False, gluon=False).cpu()
    monkeypatch.setattr(decode, "reduce_heads", lambda *a: reduce_heads)
    monkeypatch.setattr(decode, "rotate_heads", lambda *a: rotate_heads)
    decode._PLANS.clear()
    plan = decode.launch_plan(args[0], args[1], gluon=False)
    assert plan.reduce_grid[2] == 16 // reduce_heads and plan.reduce_consts["HB"] == reduce_heads
    out = decode.decode_attention(*args, graph=False, gluon=False).cpu()
    monkeypatch.undo()
    decode._PLANS.clear()
    assert torch.isfinite(out).all()
    assert relative_errors(out, ref).max() < 1e-2
    assert relative_errors(out, whole).max() < 2e-3


def test_decode_kernel_default_settings_for_many_sequences():
    """17+ (sequence, KV head) pairs take default_config's one-warp programs."""
    lengths = [700, 450, 321, 330, 600, 64, 500, 360, 420]
    gen = torch.Generator().manual_seed(9)
    cache, layer, q = build(gen, lengths, 8, 2, 64, 64, 64)
    assert decode.default_config(len(lengths), 2, 64)["num_warps"] == 1
    ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation,
                                             layer.value_mean, 0.125)
    out = decode.decode_attention(q.to(DEVICE), to_device(cache), layer.key_rotation.to(DEVICE),
                                  layer.value_rotation.to(DEVICE), layer.value_mean.to(DEVICE), 0.125).cpu()
    err = (out.float() - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert err.max() < 1e-2, err


@pytest.mark.parametrize("heads,kv_heads,d", [(32, 8, 128), (9, 3, 64), (14, 1, 64)])
def test_rotate_query_kernel_matches_reference(heads, kv_heads, d):
    gen = torch.Generator().manual_seed(heads)
    q = torch.randn(3, heads, d, generator=gen).bfloat16()
    rot = orthogonal(kv_heads, d, gen)
    out = decode.rotate_query_bf16(q.to(DEVICE), rot.to(DEVICE)).cpu()
    ref = kvstore.rotate_query(q, rot)
    assert out.dtype == torch.bfloat16
    # float32 sums in another order, then one bf16 rounding: within one bf16 step of the reference.
    assert torch.allclose(out.float(), ref, rtol=2 ** -7, atol=1e-6)


def test_plan_splits_fills_the_machine():
    chunk, splits = decode.plan_splits(batch=1, kv_heads=8, max_int2=100_000, block_n=64, num_sms=132)
    assert chunk % 64 == 0 and splits * chunk >= 100_000 and 8 * splits >= 4 * 132
    chunk, splits = decode.plan_splits(batch=8, kv_heads=8, max_int2=8000, block_n=64, num_sms=132, waves=48,
                                       min_chunk=512)
    assert chunk == 512 and splits == 16
    chunk, splits = decode.plan_splits(batch=32, kv_heads=8, max_int2=0, block_n=64, num_sms=132)
    assert splits == 0
    # 16 programs a multiprocessor: 256 pairs x 8 splits = 2,048 of 2,112 slots, one wave (9 would make 2,304).
    chunk, splits = decode.plan_splits(batch=32, kv_heads=8, max_int2=99_680, block_n=64, num_sms=132, waves=16,
                                       min_chunk=512)
    assert splits == 8 and chunk * splits >= 99_680


def build_channel(gen, lengths, heads, kv_heads, d, key_group, value_group, sink=16, recent=32):
    """A prefilled store whose keys are quantized per channel over blocks of key_group tokens."""
    bsz, longest = len(lengths), max(lengths)
    mk, mv = torch.randn(kv_heads, d, generator=gen), torch.randn(kv_heads, d, generator=gen)
    layer = kvstore.LayerRotation(orthogonal(kv_heads, d, gen), orthogonal(kv_heads, d, gen),
                                  torch.full((kv_heads,), 0.96), torch.full((kv_heads,), 0.92), mk, mv)
    # Keys with a per-channel spread (what makes channel groups pay off), values centred by their mean.
    keys = (torch.randn(bsz, longest, kv_heads, d, generator=gen) * torch.linspace(0.2, 4, d) + mk).bfloat16()
    values = (torch.randn(bsz, longest, kv_heads, d, generator=gen) + mv).bfloat16()
    cache = kvstore.empty_cache(bsz, kv_heads, d, longest + 8, key_group, value_group, sink, recent,
                                key_axis="channel")
    kvstore.prefill(cache, keys, values, torch.tensor(lengths), layer)
    return cache, layer, torch.randn(bsz, heads, d, generator=gen)


@pytest.mark.parametrize("d,heads,kv_heads,key_group,value_group,lengths,block_n,key_t,fused", [
    (64, 2, 2, 64, 64, [300, 1, 112, 113], 64, True, False),          # one query head per KV head
    (128, 8, 2, 64, 64, [400, 47, 176], 32, False, False),            # a tile sees half a block
    (128, 8, 1, 64, 128, [260, 130], 256, False, True),               # fused, tiles capped at the block
    (128, 10, 2, 128, 64, [420, 90], 256, True, False),               # blocks of 128 tokens, 5 heads a KV head
    (64, 16, 2, 64, 64, [333, 200], 64, False, False),                # 8 heads a KV head
    (128, 8, 2, 128, 128, [330, 200], 64, True, False),               # a 64-token tile sees half a 128-block
    (256, 4, 1, 64, 64, [260, 30], 64, True, False),
])
def test_decode_kernel_channel_keys_match_reference(d, heads, kv_heads, key_group, value_group, lengths, block_n,
                                                    key_t, fused):
    gen = torch.Generator().manual_seed(d + heads + len(lengths))
    cache, layer, q = build_channel(gen, lengths, heads, kv_heads, d, key_group, value_group)
    assert cache.int2_tokens().max() >= 2 * key_group
    ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation, layer.value_mean,
                                             d ** -0.5)
    out = decode.decode_attention(q.to(DEVICE), to_device(cache), layer.key_rotation.to(DEVICE),
                                  layer.value_rotation.to(DEVICE), layer.value_mean.to(DEVICE), d ** -0.5,
                                  block_n=block_n, key_t=key_t, fused=fused)
    err = relative_errors(out, ref)
    assert err.max() < 1e-2, err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Gluon programs need a GPU")
@pytest.mark.parametrize("d,heads,kv_heads,group,axis,lengths", [
    (128, 8, 2, 64, "channel", [900, 321, 64, 65]),        # 4 heads a program
    (128, 10, 2, 64, "channel", [700, 130]),               # GQA 5: 8 heads a program, 3 of them padding
    (128, 16, 2, 64, "channel", [1500, 400]),              # GQA 8
    (128, 32, 2, 128, "channel", [800, 300]),              # GQA 16 over 2 programs, blocks and groups of 128
    (64, 14, 2, 64, "channel", [1200, 70, 500]),           # head_dim 64, GQA 7, held to 128 registers
    (64, 6, 2, 64, "channel", [600, 90]),
    (128, 10, 2, 64, "token", [700, 130]),
    (128, 16, 2, 64, "token", [1500, 400]),
    (128, 24, 2, 64, "token", [900, 200]),                # GQA 12: one program of 16 heads (4 padding) or two
    (128, 32, 2, 64, "token", [1500, 400, 65]),           # GQA 16 over 2 programs of 8 or one of 16
    (128, 18, 2, 128, "token", [700, 200]),               # GQA 9, groups of 128: 7 heads of padding at 16
    (64, 14, 2, 64, "token", [1200, 70, 500]),
    (256, 4, 1, 64, "token", [900, 321, 70]),             # head_dim 256: Gemma 3 270M / 1B's attention
    (256, 4, 2, 128, "token", [700, 130]),                # groups of 128, 2 heads a KV head (Gemma 3 12B's GQA)
    (256, 8, 2, 64, "channel", [900, 200]),
    (256, 6, 2, 128, "channel", [800, 300]),              # blocks and groups of 128, 3 heads a KV head
])
def test_gluon_programs_match_reference(d, heads, kv_heads, group, axis, lengths):
    """Within 1e-2 of the reference with the value mean; without it (a small average of centred values, the
    hardest case for a relative error: up to 1.5e-2 here for both families) no worse than the Triton
    programs, with 4, 8 and 16 heads a program."""
    gen = torch.Generator().manual_seed(d + heads + kv_heads)
    make = build_channel if axis == "channel" else build
    cache, layer, q = make(gen, lengths, heads, kv_heads, d, group, group, sink=16, recent=32)
    assert cache.int2_tokens().max() >= 4 * 64
    on_device = to_device(cache)
    for mean in (layer.value_mean, None):
        ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation, mean,
                                                 d ** -0.5)

        def err(**kw):
            out = decode.decode_attention(q.to(DEVICE), on_device, layer.key_rotation.to(DEVICE),
                                          layer.value_rotation.to(DEVICE), None if mean is None else mean.to(DEVICE),
                                          d ** -0.5, **kw)
            return relative_errors(out, ref).max().item()

        bound = 1e-2 if mean is not None else 1.1 * err(gluon=False) + 1e-4
        for per_program in (4, 8, 16):
            assert err(gluon=True, heads_per_program=per_program) < bound, (mean is None, per_program)
        if not decode.launch_plan(q.to(DEVICE), on_device, gluon=True).gluon_consts["STAGES"]:
            assert err(gluon=True, flat=True) < bound, (mean is None, "flat")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="the TMA ring needs a Hopper GPU")
@pytest.mark.parametrize("heads,kv_heads,axis,d", [
    (32, 8, "token", 128), (64, 8, "token", 128), (40, 8, "token", 128), (128, 8, "token", 128),
    (32, 8, "channel", 128), (64, 8, "channel", 128), (40, 8, "channel", 128),
    (32, 8, "token", 64), (24, 8, "channel", 64), (56, 8, "channel", 64),
    (4, 1, "token", 256), (16, 8, "token", 256), (4, 1, "channel", 256), (16, 8, "channel", 256)])
def test_tma_ring_gives_the_loads_outputs(monkeypatch, heads, kv_heads, axis, d):
    """The Gluon programs reading through the TMA ring (decode.tma_stages) give the outputs of those loading into
    registers, bit for bit (the same products in the same order, the same grid), on a ragged batch of 128 pairs,
    keys per token and per channel (4 and 8 heads a program), head_dim 64, 128 and 256; both within 1e-2 of the
    reference."""
    gen = torch.Generator().manual_seed(7)
    lengths = [1500, 400, 65, 2000, 1234, 777, 64, 1999] * 2
    make = build if axis == "token" else build_channel
    cache, layer, q = make(gen, lengths, heads, kv_heads, d, 64, 64, sink=16, recent=32)
    on_device = to_device(cache)
    ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation, layer.value_mean,
                                             d ** -0.5)
    outs = {}
    for stages in (0, 2):
        monkeypatch.setattr(decode, "tma_stages", lambda major, consts, pairs, rows, stages=stages: stages)
        monkeypatch.setattr(decode, "_PLANS", {})
        plan = decode.launch_plan(q.to(DEVICE), on_device, gluon=True)
        assert plan.gluon_consts["TMA"] == stages and not plan.gluon_consts["FLAT"]
        # Twice: the first call compiles and launches through the JIT, the second the compiled kernel directly.
        calls = [decode.decode_attention(q.to(DEVICE), on_device, layer.key_rotation.to(DEVICE),
                                         layer.value_rotation.to(DEVICE), layer.value_mean.to(DEVICE), d ** -0.5,
                                         gluon=True, graph=False) for _ in range(2)]
        assert torch.equal(calls[0], calls[1])
        outs[stages] = calls[0]
        assert relative_errors(outs[stages], ref).max().item() < 1e-2
    assert torch.equal(outs[0], outs[2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Gluon programs need a GPU")
@pytest.mark.parametrize("context,batch,heads,axis,expect,kv_heads,d", [
    (2048, 1, 32, "token", False, 8, 128),    # 1,728 INT2 rows, 8 pairs, 4 heads a KV head: the Triton programs
    (8192, 1, 32, "token", True, 8, 128),     # 7,872 INT2 rows
    (8192, 1, 32, "channel", True, 8, 128),
    (2048, 1, 64, "token", True, 8, 128),     # 8 heads a KV head
    (2048, 4, 32, "token", True, 8, 128),     # 32 pairs
    (100_000, 1, 4, "token", False, 1, 256),      # head_dim 256 below 8 pairs: Triton with keys per token,
    (100_000, 1, 4, "channel", True, 1, 256),     # Gluon with keys per channel from 64K INT2 rows
    (32768, 1, 4, "channel", False, 1, 256),
    (16384, 8, 4, "token", True, 1, 256),         # 8 pairs
])
def test_gluon_programs_are_the_default_from_4k_int2_rows(context, batch, heads, axis, expect, kv_heads, d):
    """The default program choice: Gluon from 4K INT2 rows, above 16 (sequence, KV head) pairs or above 4 query
    heads per KV head; the Triton programs' one launch fewer only for short contexts at small batch (H100,
    kernel_notes.md v14: at 8K x 1 the Gluon programs win or tie on every shape measured), and at head_dim 256
    below 8 pairs (v16)."""
    cache = kvstore.empty_cache(batch, kv_heads, d, context, device="cuda", key_axis=axis)
    q = torch.zeros(batch, heads, d, dtype=torch.bfloat16, device="cuda")
    assert decode.launch_plan(q, cache, max_length=context).gluon is expect


def test_decode_kernel_channel_keys_refuse_before_launch():
    gen = torch.Generator().manual_seed(5)
    cache, layer, q = build_channel(gen, [100], 4, 1, 64, 64, 64)
    with pytest.raises(ValueError, match="key blocks of 64, 128 or 256"):
        decode.check_shape(4, 1, 128, 32, 64, "channel")
    with pytest.raises(ValueError, match="Gluon"):
        decode.decode_attention(q, cache, layer.key_rotation, layer.value_rotation, None, 0.125, gluon=True)


def test_programmatic_launch_refused_where_the_device_lacks_it():
    gen = torch.Generator().manual_seed(6)
    cache, layer, q = build(gen, [100], 4, 1, 64, 64, 64)
    args = (q, cache, layer.key_rotation, layer.value_rotation, layer.value_mean, 0.125)
    with pytest.raises(ValueError, match="programmatic dependent launch"):
        decode.decode_attention(*args, pdl=True, graph=False)
    assert decode.launch_plan(q, cache).pdl is False
    assert not decode.programmatic_launch(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs a Hopper GPU")
@pytest.mark.parametrize("d,heads,kv_heads,lengths,gluon", [
    (128, 32, 8, [5000, 700, 64, 1200], True),     # Gluon INT2 programs beside the window programs
    (128, 32, 8, [900, 321], False),               # the Triton programs take every split
    (256, 4, 1, [3000, 70], None),                 # head_dim 256 below 8 pairs: the Triton programs
])
def test_programmatic_launch_changes_no_bit(d, heads, kv_heads, lengths, gluon):
    """Programmatic dependent launch (the default on Hopper at 8 pairs or fewer, and beyond wherever the Gluon programs
    run) only moves when launches start:
    outputs with and without it are bit-identical, as direct calls and as graph replays, and within 1e-2 of the
    reference."""
    gen = torch.Generator().manual_seed(d + heads)
    cache, layer, q = build(gen, lengths, heads, kv_heads, d, 64, 64, sink=16, recent=32)
    on_device = to_device(cache)
    args = (q.to(DEVICE), on_device, layer.key_rotation.to(DEVICE), layer.value_rotation.to(DEVICE),
            layer.value_mean.to(DEVICE), d ** -0.5)
    plan = decode.launch_plan(args[0], on_device)
    assert plan.pdl is (len(lengths) * kv_heads <= 8 or plan.gluon)   # the default: few pairs, or the Gluon programs
    outs = [decode.decode_attention(*args, gluon=gluon, pdl=pdl, graph=graph)
            for pdl in (False, True) for graph in (False, True, True)]     # the second graph call replays
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation, layer.value_mean,
                                             d ** -0.5)
    assert relative_errors(outs[-1], ref).max() < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Gluon programs need a GPU")
@pytest.mark.parametrize("context,batch,waves,d", [(100_000, 1, "spare", 128), (100_000, 2, "whole", 128),
                                                   (32768, 1, "3/4", 128), (100_000, 1, "whole", 256)])
def test_long_small_batches_leave_the_window_programs_a_slot(context, batch, waves, d):
    """At most 8 (sequence, KV head) pairs from 64K INT2 rows: the Gluon grid is one program a multiprocessor
    short of a whole wave, so the window programs run beside it in a graph; short programs at few pairs: 3/4 of
    a wave; otherwise (and at head_dim 256, 8 programs a multiprocessor) a whole wave."""
    cache = kvstore.empty_cache(batch, 8, d, context, device="cuda")
    q = torch.zeros(batch, 32, d, dtype=torch.bfloat16, device="cuda")
    plan = decode.launch_plan(q, cache, max_length=context)
    consts = {k: v for k, v in plan.gluon_consts.items() if k not in ("num_warps", "maxnreg", "launch_pdl")}
    slots = decode._gluon_programs_per_sm(cache, consts, q.device)
    use = dict(spare=slots - 1, whole=slots)[waves] if waves != "3/4" else slots * 3 // 4
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    max_int2 = context - cache.sink_tokens - cache.recent_tokens
    _, splits = decode.plan_splits(batch, 8, max_int2, 64, sms, use, plan.min_chunk)
    assert plan.gluon_grid == (splits, batch * 8)
    assert splits * batch * 8 <= use * sms


def flat_segments(p, programs, tiles, block=64):
    """(pair, k, start row, end row) of flat program p, as decode_gluon's FLAT computes them: pairs own P units each,
    program p the units [p·Q, (p + 1)·Q), a unit 1/P of the pair's tiles (tiles[bh] of them)."""
    big_p, q = programs, len(tiles)
    u0 = p * q
    for bh in range(u0 // big_p, (u0 + q - 1) // big_p + 1):
        lo, hi = max(u0 - bh * big_p, 0), min(u0 + q - bh * big_p, big_p)
        yield bh, p - bh * big_p // q, lo * tiles[bh] // big_p * block, hi * tiles[bh] // big_p * block


@pytest.mark.parametrize("programs,tiles", [(2112, [1600] * 240), (2112, [1600] * 216), (1056, [1563] * 240),
                                            (2112, [1 + 37 * i % 1600 for i in range(240)]), (2112, [0, 5] * 120),
                                            (1980, [1600] * 7)])
def test_flat_rows_cover_every_tile_once(programs, tiles):
    """The flat programs' shares tile every pair's rows exactly once, in order, each program at most two pairs, its
    share of equal lengths within a tile of the others', and a pair's k below flat_programs_a_pair (the splits
    decode._plan allots)."""
    rows = {bh: [] for bh in range(len(tiles))}
    work = []
    for p in range(programs):
        segments = list(flat_segments(p, programs, tiles))
        assert 1 <= len(segments) <= 2
        work.append(sum(end - start for _, _, start, end in segments))
        for bh, k, start, end in segments:
            assert 0 <= k < decode.flat_programs_a_pair(programs, len(tiles))
            rows[bh].append((k, start, end))
    for bh, parts in rows.items():
        parts.sort()
        assert [k for k, _, _ in parts] == list(range(len(parts)))
        assert parts[0][1] == 0 and parts[-1][2] == tiles[bh] * 64
        assert all(a[2] == b[1] for a, b in zip(parts, parts[1:]))
    if len(set(tiles)) == 1:
        assert max(work) - min(work) <= 2 * 64


@pytest.mark.parametrize("pairs,wave,expect", [(240, 2112, True), (440, 2112, True), (216, 2112, False),
                                               (256, 2112, False), (192, 2112, False), (64, 2112, False),
                                               (2200, 2112, False), (8, 1980, False)])
def test_flat_splits_where_whole_splits_leave_the_wave_idle(pairs, wave, expect):
    """Flat rows where ⌊wave / pairs⌋ splits a pair leave more than 8% of the wave idle (batch 30 of 8 KV heads: 1,920
    of 2,112; 55: 1,760), not at batch 27 (1,944: 7.95%) or 32 (2,048), nor where the pairs divide the wave or
    outnumber it."""
    assert decode.flat_splits(pairs, wave) == expect


@pytest.mark.parametrize("pairs,expect", [(240, False), (440, True), (216, False), (256, False)])
def test_flat_splits_leave_the_tma_ring_its_batches(pairs, expect):
    """Where whole splits would read through the TMA ring, flat rows only beyond 12% of the wave idle: not at batch 30
    of 8 KV heads (9.1%, where the ring is faster), still at 55 (16.7%)."""
    assert decode.flat_splits(pairs, 2112, ring=True) == expect


@pytest.mark.parametrize("heads,kv_heads,d,group,axis,layout,major,pairs,rows,expect", [
    (32, 8, 128, 64, "token", "tiles", 9, 256, 12_480, 2),    # Qwen3-8B at 100K x 32 on a Hopper
    (32, 8, 128, 64, "token", "tiles", 9, 256, 1_024, 2),     # 8K x 32
    (32, 8, 128, 64, "token", "tiles", 9, 64, 3_072, 2),      # 100K x 8
    (32, 8, 128, 64, "token", "tiles", 9, 64, 1_024, 0),      # 32K x 8: no faster
    (32, 8, 128, 64, "token", "tiles", 9, 8, 448, 0),         # 100K x 1
    (32, 8, 128, 64, "token", "tiles", 8, 256, 12_480, 0),    # an A100 has no TMA
    (32, 8, 128, 64, "token", "rows", 9, 256, 12_480, 0),
    (32, 8, 128, 64, "channel", "tiles", 9, 256, 12_480, 2),  # keys per channel in blocks of a tile: everywhere
    (32, 8, 128, 64, "channel", "tiles", 9, 8, 448, 2),
    (64, 8, 128, 64, "channel", "tiles", 9, 64, 1_024, 2),    # and at 8 heads a program
    (32, 8, 128, 128, "channel", "tiles", 9, 256, 12_480, 0),  # blocks of 128: two tiles a block
    (32, 8, 128, 64, "channel", "rows", 9, 256, 12_480, 0),
    (9, 3, 64, 64, "channel", "tiles", 9, 24, 192, 2),        # head_dim 64: SmolLM2 at 16K x 8
    (14, 2, 64, 64, "channel", "tiles", 9, 16, 768, 2),       # Qwen2.5-0.5B, 8 heads a program
    (32, 8, 64, 64, "token", "tiles", 9, 8, 448, 2),          # Llama-3.2-1B at 100K x 1
    (64, 8, 64, 64, "token", "tiles", 9, 64, 3_072, 0),       # 8 heads a program with keys per token: not measured
    (32, 8, 64, 64, "channel", "rows", 9, 64, 3_072, 0),
    (32, 8, 128, 64, "channel", "tiles", 8, 256, 12_480, 0),
    (32, 8, 128, 128, "token", "tiles", 9, 256, 12_480, 0),
    (64, 8, 128, 64, "token", "tiles", 9, 64, 1_024, 2),      # 8 heads a program: from 768 rows a program
    (64, 8, 128, 64, "token", "tiles", 9, 8, 896, 2),
    (32, 2, 128, 64, "token", "tiles", 9, 2, 512, 0),
    (16, 8, 256, 64, "token", "tiles", 9, 64, 6_232, 2),      # head_dim 256, keys per token: Gemma 3 12B 100K x 8
    (16, 8, 256, 64, "token", "tiles", 9, 64, 492, 2),        # 8K x 8: 64 pairs
    (4, 1, 256, 64, "token", "tiles", 9, 32, 3_022, 2),       # Gemma 3 270M 100K x 32
    (4, 1, 256, 64, "token", "tiles", 9, 8, 768, 0),          # 100K x 8: no faster
    (4, 1, 256, 64, "channel", "tiles", 9, 8, 256, 2),        # keys per channel from 256 rows a program
    (4, 1, 256, 64, "channel", "tiles", 9, 8, 128, 0),
    (16, 8, 256, 64, "token", "rows", 9, 64, 6_232, 0),
    (16, 8, 256, 128, "channel", "tiles", 9, 64, 6_232, 0),
])
def test_tma_ring_only_where_measured(heads, kv_heads, d, group, axis, layout, major, pairs, rows, expect):
    """The TMA ring (decode.tma_stages) with value groups of 64 and the value codes in tiles, on compute capability 9
    and later: with keys per channel in 64-token blocks at 4 and 8 heads a program everywhere (at head_dim 256 from
    256 rows a program); with keys per token in groups of 64 at head_dim 128 for the 4-head programs from 128 pairs or
    2,048 rows a program and for the 8-head ones from 768 rows, at head_dim 64 for the 4-head programs everywhere, at
    256 from 64 pairs or 2,048 rows; nowhere else."""
    cache = kvstore.empty_cache(1, kv_heads, d, 1024, group, group, key_axis=axis, value_layout=layout)
    assert decode.tma_stages(major, decode.gluon_constexprs(cache, heads, d, 6), pairs, rows) == expect


def test_tma_descriptors_are_kept_as_long_as_their_store():
    """decode.tma_descriptors builds a store's two descriptors once, over views of its own bytes, and lets them go
    with the store (a store that grows or is freed must not stay alive through them)."""
    pytest.importorskip("triton.experimental.gluon")
    import gc
    cache = kvstore.empty_cache(2, 8, 128, 1024, 64, 64)
    descs = decode.tma_descriptors(cache)
    assert decode.tma_descriptors(cache) is descs
    assert [d.base.data_ptr() for d in descs] == [cache.key_codes.data_ptr(), cache.key_scale.data_ptr()]
    held = id(cache.key_codes)
    del cache, descs
    gc.collect()
    assert held not in decode._TMA_DESCRIPTORS


@pytest.mark.parametrize("move", [False, True])
@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("d", [128, 64, 256])
def test_tma_descriptors_cover_the_store_arrays(move, axis, d):
    """The codes descriptor's boxes are the key codes then the value codes (rows of 32 words), the metadata one's the
    key scales, key zeros, value scales and value zeros (rows of a tile's D/4 words; two rows of 32 at head_dim
    256), for a store of empty_cache and
    its copy by kvstore.to_device, keys per token or per channel (a 64-token block's D bytes where a token's groups
    have D/64); a store whose arrays lie apart gets none (and so no ring)."""
    pytest.importorskip("triton.experimental.gluon")
    gen = torch.Generator().manual_seed(3)
    cache = kvstore.empty_cache(2, 3, d, 1024, 64, 64, key_axis=axis)
    for a in (cache.key_codes, cache.value_codes, cache.key_scale, cache.key_zero.view(torch.uint8),
              cache.value_scale, cache.value_zero.view(torch.uint8)):
        a.copy_(torch.randint(0, 256, a.shape, generator=gen, dtype=torch.uint8))
    if move:
        cache = kvstore.to_device(cache, "cpu")
    codes, meta = decode.tma_descriptors(cache)
    rows = 2 if d == 256 else 1
    assert codes.block_shape == [2, d // 8, 32] and meta.block_shape == [4, rows, d // 4 // rows]
    for desc, arrays in ((codes, (cache.key_codes, cache.value_codes)),
                         (meta, (cache.key_scale, cache.key_zero, cache.value_scale, cache.value_zero))):
        width = desc.block_shape[-1]
        assert list(desc.base.shape) == [len(arrays), arrays[0].numel() // (4 * width), width]
        for box, a in zip(desc.base.unbind(0), arrays):
            assert torch.equal(box.reshape(-1), a.reshape(-1).view(torch.int32))
    apart = dataclasses.replace(cache, value_codes=cache.value_codes.clone())
    assert decode.tma_descriptors(apart) is None


@pytest.mark.parametrize("pairs,max_int2,d,slots,ht,expect", [
    (8, 99_680, 128, 16, 1, 15),      # 100K x 1: a slot for the window programs
    (8, 32_448, 128, 16, 1, 12),      # 32K x 1: a whole wave would read 128 rows a program
    (16, 16_064, 128, 16, 1, 12),     # 16K x 2
    (16, 65_216, 128, 16, 1, 16),     # 64K x 2: 512 rows a program
    (64, 7_872, 128, 16, 1, 16),      # more than 16 pairs
    (8, 99_680, 256, 8, 1, 8),        # head_dim 256
    (2, 32_448, 128, 16, 2, 6),       # GQA 16: two programs a split
])
def test_gluon_waves_by_pairs_and_rows(pairs, max_int2, d, slots, ht, expect):
    """Few pairs: a spare slot from 64K rows (at 8 pairs or fewer), 3/4 of a wave where a whole one would give
    programs of 256 rows or fewer; otherwise a whole wave (132 multiprocessors, programs of at least 128 rows)."""
    assert decode.gluon_waves(pairs, max_int2, d, slots, ht, 132, 128) == expect


@pytest.mark.parametrize("regs,shared,expect", [(96, 0, 20), (128, 0, 16), (144, 0, 12), (166, 0, 12),
                                                 (225, 0, 8), (64, 0, 32), (128, 20 * 1024, 10)])
def test_resident_warps_count_each_schedulers_registers(regs, shared, expect):
    """The grid's one-warp programs a multiprocessor: each of the 4 schedulers' 16,384 registers hold whole
    warps (96 registers: 5 a scheduler, 20, where 65,536 / (32 · 96) would say 21), and shared memory."""
    assert decode.resident_warps(regs, shared, 228 * 1024) == expect


@pytest.mark.parametrize("heads,kv_heads,d,group,axis,per_program,expect", [
    (32, 8, 128, 64, "token", 4, dict(R4=4, HT=1, NGK=2, NGV=2, TB=1, D=128, MASK_ALL=True, KEYS_AHEAD=False)),
    (32, 8, 128, 128, "token", 4, dict(R4=4, HT=1, NGK=1, NGV=1, TB=1, STAGES=0, MASK_ALL=False, KEYS_AHEAD=True)),
    (14, 2, 64, 64, "channel", 8, dict(HG=7, R4=8, HT=1, NGK=1, NGV=1, TB=64, D=64, STAGES=0, MASK_ALL=False, KEYS_AHEAD=False)),
    (14, 2, 64, 64, "channel", 4, dict(R4=4, HT=2, KEYS_AHEAD=True)),
    (32, 2, 128, 64, "token", 8, dict(HG=16, R4=8, HT=2)),
    (9, 3, 64, 64, "token", 4, dict(HG=3, R4=4, HT=1)),
    (64, 8, 128, 64, "channel", None, dict(HG=8, R4=8, HT=1)),     # 8 heads a program from GQA 5
    (40, 8, 128, 64, "channel", None, dict(HG=5, R4=8, HT=1)),
    (32, 8, 128, 64, "channel", None, dict(HG=4, R4=4, HT=1, MASK_ALL=True)),
    (40, 8, 128, 64, "token", None, dict(HG=5, R4=8, HT=1, STAGES=0, MASK_ALL=False)),
    (16, 8, 256, 64, "token", 8, dict(HG=2, R4=4, HT=1, NGK=4, NGV=4, D=256, MASK_ALL=False, KEYS_AHEAD=True)),   # head_dim 256: 4 heads a program
    (32, 2, 256, 128, "channel", None, dict(HG=16, R4=4, HT=4, NGK=1, NGV=2, TB=128, KEYS_AHEAD=False)),
    # Value codes in tiles (the default layout): keys ahead also in the 8-head programs with keys per token or at
    # head_dim 64, and at head_dim 256 with keys per channel; still not in Qwen3-8B's 128-register program.
    (32, 8, 128, 64, "token", None, dict(R4=4, VT=True, STAGES=0, MASK_ALL=False, KEYS_AHEAD=False, STRIDED=True,
                                         layout="tiles")),
    (32, 8, 128, 64, "channel", None, dict(R4=4, VT=True, MASK_ALL=False, KEYS_AHEAD=True, layout="tiles")),
    (40, 8, 128, 64, "token", None, dict(R4=8, VT=True, KEYS_AHEAD=True, layout="tiles")),
    (14, 2, 64, 64, "channel", 8, dict(R4=8, VT=True, KEYS_AHEAD=True, PF=1, STRIDED=True, layout="tiles")),
    (64, 8, 128, 64, "channel", None, dict(R4=8, VT=True, KEYS_AHEAD=False, PF=1, STRIDED=False, layout="tiles")),
    (32, 8, 128, 64, "channel", None, dict(R4=4, VT=True, PF=0, STRIDED=False, layout="tiles")),
    (64, 8, 128, 64, "token", None, dict(R4=8, VT=True, PF=0, STRIDED=False, layout="tiles")),
    (32, 2, 256, 128, "channel", None, dict(R4=4, HT=4, VT=True, KEYS_AHEAD=True, PF=0, STRIDED=False,
                                            layout="tiles")),
    (32, 8, 128, 64, "token", None, dict(R4=4, STAGES=0, STRIDED=False)),      # value codes in rows
])
def test_gluon_programs_cover_a_kv_heads_query_heads(heads, kv_heads, d, group, axis, per_program, expect):
    """Each KV head's HG query heads go to HT programs of R4 heads (R4·HT ≥ HG > R4·(HT − 1)), the groups
    and key blocks as the store holds them; the cp.async ring only where its copies fit (d 128, token keys,
    groups of 64); every tile's scores masked only in the 4-head head_dim 128 programs with two value groups a
    token (elsewhere only a program's last tile, measured faster); key words a tile ahead only in 4-head
    programs, but not the 128-register one with two key groups a token nor head_dim 256 with keys per channel
    (value codes in rows; in tiles, the rule of decode.keys_ahead); the next tile hinted into L2 only with keys
    per channel in the 8-head programs at head_dim 128 and at head_dim 64 (decode.prefetch_tiles); tiles strided
    over a sequence's splits at head_dim 64 and in the 4-head programs with keys per token at 128
    (decode.strided_tiles)."""
    expect = dict(expect)
    layout = expect.pop("layout", "rows")
    cache = kvstore.empty_cache(1, kv_heads, d, 1024, group, group, key_axis=axis, value_layout=layout)
    consts = decode.gluon_constexprs(cache, heads, d, 6, per_program)
    assert {k: consts[k] for k in expect} == expect
    assert consts["R4"] * consts["HT"] >= consts["HG"] > consts["R4"] * (consts["HT"] - 1)
    assert not decode.gluon_supported(torch.zeros(1, heads, d), cache)   # not on a CPU tensor
