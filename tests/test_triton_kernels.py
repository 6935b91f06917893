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
from oscar_core.triton import decode, decode_programs, replay, write  # noqa: E402
from oscar_core.triton import plan as rules  # noqa: E402

if not torch.cuda.is_available() and not isinstance(decode_programs._split_kernel,
                                                    triton.runtime.interpreter.InterpretedFunction):
    write = importlib.reload(sys.modules["oscar_core.triton.write"])
    decode_programs = importlib.reload(sys.modules["oscar_core.triton.decode_programs"])
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


def variant(q, cache, max_length=None, pins=None, **settings):
    """The plan decode_attention runs for q over cache (decode.plan_for, with pins), settings replaced."""
    return dataclasses.replace(decode.plan_for(q, cache, max_length, **(pins or {})), **settings)


def launches_of(q, cache, plan, max_length=None, has_mean=True, rotate_values=True):
    """The grids and constexprs of a plan's launches for q over cache (decode.launches)."""
    return decode.launches(decode.shape_of(q, cache), plan, decode.device_of(q, cache), max_length, has_mean,
                           rotate_values)


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
    on_device = to_device(cache)
    plan = variant(q.to(DEVICE), on_device, block_n=32, key_t=key_t)
    out = decode.decode_attention(q.to(DEVICE), on_device, layer.key_rotation.to(DEVICE),
                                  layer.value_rotation.to(DEVICE), layer.value_mean.to(DEVICE), scaling, plan,
                                  out=poisoned)
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
    assert len(cache.graphs) == replay.GRAPHS_PER_STORE
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
    assert len(replays().direct) <= replay.DIRECT_GRAPHS
    strided = torch.randn(q.shape[0], q.shape[2], q.shape[1], generator=gen).to(DEVICE).bfloat16().transpose(1, 2)
    for _ in range(2):
        assert torch.equal(call(strided, out=out), direct(strided))
    assert len(cache.graphs) == 1 and len(replays().direct) <= replay.DIRECT_GRAPHS


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


@pytest.mark.parametrize("key_t", [True, False])
@pytest.mark.parametrize("d,heads,kv_heads,key_group,value_group,lengths", SHAPES)
def test_decode_kernel_every_shape(d, heads, kv_heads, key_group, value_group, lengths, key_t):
    gen = torch.Generator().manual_seed(d * heads + kv_heads)
    cache, layer, q = build(gen, lengths, heads, kv_heads, d, key_group, value_group, sink=16, recent=32)
    ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation, None, d ** -0.5)
    on_device = to_device(cache)
    out = decode.decode_attention(q.to(DEVICE), on_device, layer.key_rotation.to(DEVICE),
                                  layer.value_rotation.to(DEVICE), None, d ** -0.5,
                                  variant(q.to(DEVICE), on_device, block_n=64, key_t=key_t))
    err = relative_errors(out, ref)
    assert err.max() < 1e-2, err


def test_decode_kernel_unsupported_shapes_raise_before_launch():
    gen = torch.Generator().manual_seed(3)
    cache, layer, q = build(gen, [40], 4, 1, 64, 64, 64, sink=16, recent=32)
    args = (layer.key_rotation, layer.value_rotation, None, 0.125)
    assert "head_dim" in rules.shape_problem(4, 1, 192, 64, 64)
    assert "group size" in rules.shape_problem(4, 1, 128, 32, 64)
    with pytest.raises(ValueError, match="head_dim 64, 128 or 256, not 32"):
        decode.decode_attention(q[:, :, :32], cache, *args)
    with pytest.raises(ValueError, match="head_dim 64, 128 or 256, not 32"):
        decode.plan_for(q[:, :, :32], cache)
    assert "not a multiple" in rules.shape_problem(6, 4, 128, 64, 64)
    assert "up to 16" in rules.shape_problem(68, 2, 128, 64, 64)
    assert rules.shape_problem(64, 4, 256, 128, 64) is None
    assert rules.shape_problem(4, 1, 128, 256, 64, "channel") is None


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
    plan = variant(args[0], args[1], block_n=64)
    for max_length, given in ((None, plan), (60, plan), (500, plan), (60, None), (1000, None)):
        out = decode.decode_attention(*args, given, max_length=max_length)
        assert relative_errors(out, ref).max() < 1e-2
    assert torch.equal(decode.decode_attention(*args, max_length=1000), out)
    assert (decode._counters(torch.device(DEVICE), 2) == 0).all()


@pytest.mark.parametrize("key_t,mean", [(False, True), (False, False), (True, True)])
def test_decode_kernel_without_value_rotation_stays_in_the_stored_space(key_t, mean):
    """value_rotation None (R_V held by the model's weights): the output is õ (+ μ_V) in the values' stored space,
    the reference's with R_V = I; the reduce merges the splits and writes its columns without shares."""
    gen = torch.Generator().manual_seed(12)
    cache, layer, q = build(gen, [500, 90, 7], 8, 2, 64, 64, 64, sink=16, recent=32)
    mu = layer.value_mean if mean else None
    ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, None, mu, 0.125)
    rotated = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation, mu, 0.125)
    on_device = to_device(cache)
    plan = variant(q.to(DEVICE), on_device, block_n=64, key_t=key_t)
    out = decode.decode_attention(q.to(DEVICE), on_device, layer.key_rotation.to(DEVICE), None,
                                  None if mu is None else mu.to(DEVICE), 0.125, plan, graph=False)
    assert relative_errors(out, ref).max() < 1e-2
    assert relative_errors(out, rotated).max() > 0.1
    run = launches_of(q.to(DEVICE), on_device, plan, has_mean=mean, rotate_values=False)
    assert run.work == run.split * (64 + 2) and not run.reduce_consts["ROTATE"]
    assert launches_of(q.to(DEVICE), on_device, plan).work > run.work


def test_reduce_over_many_splits_drops_the_empty_ones():
    """Beyond 64 splits a (sequence, KV head) the reduce loads each split's partials beside its l (not gated on it):
    a short sequence's empty splits, whose partials are never written, still count for nothing."""
    ref, args = reference_and_args(6, [5000, 200], 8, 2)
    plan = variant(args[0], args[1], pins=dict(gluon=False), block_n=64, waves=200)
    run = launches_of(args[0], args[1], plan)
    assert run.ns > 64 and not run.reduce_consts["GATED"]
    assert launches_of(args[0], args[1], dataclasses.replace(plan, waves=4)).reduce_consts["GATED"]
    out = decode.decode_attention(*args, plan, graph=False)
    assert relative_errors(out, ref).max() < 1e-2


@pytest.mark.parametrize("reduce_heads,rotate_heads", [(16, 16), (4, 2), (2, 4), (8, 16)])
def test_head_blocks_give_every_head_its_output(reduce_heads, rotate_heads):
    """However the reduce and the rotation divide a KV head's 14 heads (padded to 16) among programs, every head's
    output is the reference's, and the arms agree with one another."""
    gen = torch.Generator().manual_seed(14)
    cache, layer, q = build(gen, [700, 50, 330], 14, 1, 64, 64, 64)
    ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation,
                                             layer.value_mean, 0.125)
    args = (q.to(DEVICE), to_device(cache), layer.key_rotation.to(DEVICE), layer.value_rotation.to(DEVICE),
            layer.value_mean.to(DEVICE), 0.125)
    triton_programs = decode.plan_for(args[0], args[1], gluon=False)
    whole = decode.decode_attention(*args, triton_programs, graph=False).cpu()
    plan = dataclasses.replace(triton_programs, reduce_heads=reduce_heads, rotate_heads=rotate_heads)
    run = launches_of(args[0], args[1], plan)
    assert run.reduce_grid[2] == 16 // reduce_heads and run.reduce_consts["HB"] == reduce_heads
    out = decode.decode_attention(*args, plan, graph=False).cpu()
    assert torch.isfinite(out).all()
    assert relative_errors(out, ref).max() < 1e-2
    assert relative_errors(out, whole).max() < 2e-3


def test_decode_kernel_default_settings_for_many_sequences():
    """17+ (sequence, KV head) pairs take plan.program_config's one-warp programs."""
    lengths = [700, 450, 321, 330, 600, 64, 500, 360, 420]
    gen = torch.Generator().manual_seed(9)
    cache, layer, q = build(gen, lengths, 8, 2, 64, 64, 64)
    assert rules.program_config(len(lengths) * 2, 64)["num_warps"] == 1
    assert decode.plan_for(q, cache).num_warps == 1
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
    out = decode_programs.rotate_query_bf16(q.to(DEVICE), rot.to(DEVICE)).cpu()
    ref = kvstore.rotate_query(q, rot)
    assert out.dtype == torch.bfloat16
    # float32 sums in another order, then one bf16 rounding: within one bf16 step of the reference.
    assert torch.allclose(out.float(), ref, rtol=2 ** -7, atol=1e-6)


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


@pytest.mark.parametrize("d,heads,kv_heads,key_group,value_group,lengths,block_n,key_t", [
    (64, 2, 2, 64, 64, [300, 1, 112, 113], 64, True),          # one query head per KV head
    (128, 8, 2, 64, 64, [400, 47, 176], 32, False),            # a tile sees half a block
    (128, 8, 1, 64, 128, [260, 130], 256, False),              # tiles capped at the block
    (128, 10, 2, 128, 64, [420, 90], 256, True),               # blocks of 128 tokens, 5 heads a KV head
    (64, 16, 2, 64, 64, [333, 200], 64, False),                # 8 heads a KV head
    (128, 8, 2, 128, 128, [330, 200], 64, True),               # a 64-token tile sees half a 128-block
    (256, 4, 1, 64, 64, [260, 30], 64, True),
])
def test_decode_kernel_channel_keys_match_reference(d, heads, kv_heads, key_group, value_group, lengths, block_n,
                                                    key_t):
    gen = torch.Generator().manual_seed(d + heads + len(lengths))
    cache, layer, q = build_channel(gen, lengths, heads, kv_heads, d, key_group, value_group)
    assert cache.int2_tokens().max() >= 2 * key_group
    ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation, layer.value_mean,
                                             d ** -0.5)
    on_device = to_device(cache)
    plan = variant(q.to(DEVICE), on_device, block_n=block_n, key_t=key_t)
    assert launches_of(q.to(DEVICE), on_device, plan).split_consts["BLOCK_N"] == min(block_n, key_group)
    out = decode.decode_attention(q.to(DEVICE), on_device, layer.key_rotation.to(DEVICE),
                                  layer.value_rotation.to(DEVICE), layer.value_mean.to(DEVICE), d ** -0.5, plan)
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

        def err(**pins):
            out = decode.decode_attention(q.to(DEVICE), on_device, layer.key_rotation.to(DEVICE),
                                          layer.value_rotation.to(DEVICE), None if mean is None else mean.to(DEVICE),
                                          d ** -0.5, decode.plan_for(q.to(DEVICE), on_device, **pins))
            return relative_errors(out, ref).max().item()

        bound = 1e-2 if mean is not None else 1.1 * err(gluon=False) + 1e-4
        for per_program in (4, 8, 16):
            assert err(gluon=True, heads_per_program=per_program) < bound, (mean is None, per_program)
        assert err(gluon=True, flat=True) < bound, (mean is None, "flat")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="the TMA ring needs a Hopper GPU")
@pytest.mark.parametrize("heads,kv_heads,axis,d", [
    (32, 8, "token", 128), (64, 8, "token", 128), (40, 8, "token", 128), (128, 8, "token", 128),
    (32, 8, "channel", 128), (64, 8, "channel", 128), (40, 8, "channel", 128),
    (32, 8, "token", 64), (24, 8, "channel", 64), (56, 8, "channel", 64),
    (4, 1, "token", 256), (16, 8, "token", 256), (4, 1, "channel", 256), (16, 8, "channel", 256)])
def test_tma_ring_gives_the_loads_outputs(heads, kv_heads, axis, d):
    """The Gluon programs reading through the TMA ring (plan.tma_stages) give the outputs of those loading into
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
    base = decode.plan_for(q.to(DEVICE), on_device, gluon=True, flat=False)
    for stages in (0, 2):
        plan = dataclasses.replace(base, tma=stages, **(dict(keys_ahead=False, prefetch=0) if stages else {}))
        assert launches_of(q.to(DEVICE), on_device, plan).gluon_consts["TMA"] == stages
        # Twice: the first call compiles and launches through the JIT, the second the compiled kernel directly.
        calls = [decode.decode_attention(q.to(DEVICE), on_device, layer.key_rotation.to(DEVICE),
                                         layer.value_rotation.to(DEVICE), layer.value_mean.to(DEVICE), d ** -0.5,
                                         plan, graph=False) for _ in range(2)]
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
    heads per KV head; the Triton programs' one launch fewer only for short contexts at small batch (H100: at 8K x 1
    the Gluon programs win or tie on every shape measured), and at head_dim 256 below 8 pairs (plan.use_gluon)."""
    cache = kvstore.empty_cache(batch, kv_heads, d, context, device="cuda", key_axis=axis)
    q = torch.zeros(batch, heads, d, dtype=torch.bfloat16, device="cuda")
    assert decode.plan_for(q, cache, context).gluon is expect


def test_decode_kernel_channel_keys_refuse_before_launch():
    gen = torch.Generator().manual_seed(5)
    cache, layer, q = build_channel(gen, [100], 4, 1, 64, 64, 64)
    assert "key blocks of 64, 128 or 256" in rules.shape_problem(4, 1, 128, 32, 64, "channel")
    with pytest.raises(ValueError, match="Gluon"):
        decode.plan_for(q, cache, gluon=True)
    gluon = dataclasses.replace(decode.plan_for(q, cache), gluon=True)
    with pytest.raises(ValueError, match="Gluon INT2 programs cannot serve this call: they need a CUDA GPU"):
        decode.decode_attention(q, cache, layer.key_rotation, layer.value_rotation, None, 0.125, gluon)


def test_programmatic_launch_refused_where_the_device_lacks_it():
    gen = torch.Generator().manual_seed(6)
    cache, layer, q = build(gen, [100], 4, 1, 64, 64, 64)
    args = (q, cache, layer.key_rotation, layer.value_rotation, layer.value_mean, 0.125)
    with pytest.raises(ValueError, match="programmatic dependent launch"):
        decode.decode_attention(*args, dataclasses.replace(decode.plan_for(q, cache), pdl=True), graph=False)
    with pytest.raises(ValueError, match="programmatic dependent launch"):
        decode.plan_for(q, cache, pdl=True)
    assert decode.plan_for(q, cache).pdl is False
    assert decode.device_of(q, cache) == rules.Device() and not rules.programmatic_launch(rules.Device())
    assert not rules.programmatic_launch(rules.Device(cuda=True, sms=108, major=8))


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
    plan = decode.plan_for(args[0], on_device)
    assert plan.pdl is (len(lengths) * kv_heads <= 8 or plan.gluon)   # the default: few pairs, or the Gluon programs
    outs = [decode.decode_attention(*args, decode.plan_for(args[0], on_device, gluon=gluon, pdl=pdl), graph=graph)
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
    plan = decode.plan_for(q, cache, context)
    shape = decode.shape_of(q, cache)
    slots = decode._gluon_programs_per_sm(cache, q.device, rules.gluon_constexprs(shape, plan),
                                          rules.gluon_options(plan))
    use = dict(spare=slots - 1, whole=slots)[waves] if waves != "3/4" else slots * 3 // 4
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    max_int2 = context - cache.sink_tokens - cache.recent_tokens
    _, splits = rules.plan_splits(batch, 8, max_int2, 64, sms, use, plan.min_chunk)
    assert plan.waves == use and launches_of(q, cache, plan, context).gluon_grid == (splits, batch * 8)
    assert splits * batch * 8 <= use * sms


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
