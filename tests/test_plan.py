"""The launch plan's rules (oscar_core/triton/plan.py): pure functions of a call's shape and the device's facts, so
every test gives them shapes and a count of multiprocessors and checks the plan, with no GPU and no kernel."""

import dataclasses

import pytest

from oscar_core import kvstore
from oscar_core.triton import plan as rules


def programs_a_multiprocessor(consts: dict, options: dict) -> int:
    """One-warp Gluon programs an H100 multiprocessor holds, as the programs compile there (triton 3.6): 16 of the
    4-head programs at head_dim 128 (128 registers), 12 of the 8-head ones, 8 at head_dim 256 or 16 heads a program,
    20 at head_dim 64."""
    if consts["D"] == 64:
        return 20
    if consts["D"] == 256 or consts["R4"] == 16:
        return 8
    return 16 if consts["R4"] == 4 else 12


def ring_costs_programs(consts: dict, options: dict) -> int:
    """As above, but the 8-head programs at head_dim 128 hold two programs fewer through the TMA ring."""
    slots = programs_a_multiprocessor(consts, options)
    return slots - 2 if consts["TMA"] and consts["R4"] == 8 and consts["D"] == 128 else slots


H100 = rules.Device(cuda=True, sms=132, major=9, gluon=True, slots=programs_a_multiprocessor)
A100 = rules.Device(cuda=True, sms=108, major=8, gluon=True, slots=programs_a_multiprocessor)
CPU = rules.Device()


def store_shape(batch, heads, kv_heads, d, group=64, axis="token", layout="tiles", capacity=1024, window=False,
                joint=True) -> rules.DecodeShape:
    """A call's shape over a store of kvstore.empty_cache (64 sink and 256 recent tokens)."""
    block = group if axis == "channel" else 1       # keys per channel: a key block more in the BF16 ring
    return rules.DecodeShape(batch=batch, heads=heads, kv_heads=kv_heads, head_dim=d, key_group=group,
                             value_group=group, key_axis=axis, sink=64, recent=256,
                             ring_slots=256 + (block if block > 1 else 0),
                             rows=kvstore.int2_rows(capacity, token_block=block), value_tiles=layout == "tiles",
                             window=window, joint=joint)


def qwen3_8b(batch: int, context: int, **kw) -> rules.DecodeShape:
    """Qwen3-8B's attention (32 query heads, 8 KV heads, head_dim 128, groups of 64) over a store of `context`."""
    return store_shape(batch, 32, 8, 128, capacity=context, **kw)


def test_store_shape_is_the_shape_of_an_empty_cache():
    """store_shape is what decode.shape_of reads of a call over kvstore.empty_cache's store."""
    import torch

    pytest.importorskip("triton")
    from oscar_core.triton import decode

    for axis in ("token", "channel"):
        cache = kvstore.empty_cache(3, 8, 128, 5000, 64, 64, key_axis=axis)
        assert decode.shape_of(torch.zeros(3, 32, 128), cache) == store_shape(3, 32, 8, 128, 64, axis, capacity=5000,
                                                                               joint=False)


def test_head_blocks_by_the_launches_programs():
    """A reduce program takes the fewest heads (from 2) that keep the launch within 512 programs, a rotation program
    at most 4."""
    assert rules.reduce_heads(16, 2 * 16) == 2          # GQA 16 at batch 1: 256 programs
    assert rules.reduce_heads(16, 16 * 8) == 4          # at batch 8: 512
    assert rules.reduce_heads(8, 64 * 8) == 8           # GQA 8 at batch 8: all 8 heads, 512 programs
    assert rules.reduce_heads(4, 64 * 8) == 4 and rules.reduce_heads(1, 8) == 1 and rules.reduce_heads(3, 3) == 2
    assert [rules.rotate_heads(h) for h in (1, 2, 3, 4, 8, 14, 16)] == [1, 2, 4, 4, 4, 4, 4]


def test_plan_splits_fills_the_machine():
    chunk, splits = rules.plan_splits(batch=1, kv_heads=8, max_int2=100_000, block_n=64, num_sms=132)
    assert chunk % 64 == 0 and splits * chunk >= 100_000 and 8 * splits >= 4 * 132
    chunk, splits = rules.plan_splits(batch=8, kv_heads=8, max_int2=8000, block_n=64, num_sms=132, waves=48,
                                       min_chunk=512)
    assert chunk == 512 and splits == 16
    chunk, splits = rules.plan_splits(batch=32, kv_heads=8, max_int2=0, block_n=64, num_sms=132)
    assert splits == 0
    # 16 programs a multiprocessor: 256 pairs x 8 splits = 2,048 of 2,112 slots, one wave (9 would make 2,304).
    chunk, splits = rules.plan_splits(batch=32, kv_heads=8, max_int2=99_680, block_n=64, num_sms=132, waves=16,
                                       min_chunk=512)
    assert splits == 8 and chunk * splits >= 99_680


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
    plan.choose_plan allots)."""
    rows = {bh: [] for bh in range(len(tiles))}
    work = []
    for p in range(programs):
        segments = list(flat_segments(p, programs, tiles))
        assert 1 <= len(segments) <= 2
        work.append(sum(end - start for _, _, start, end in segments))
        for bh, k, start, end in segments:
            assert 0 <= k < rules.flat_programs_a_pair(programs, len(tiles))
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
    assert rules.flat_splits(pairs, wave) == expect


@pytest.mark.parametrize("pairs,expect", [(240, False), (440, True), (216, False), (256, False)])
def test_flat_splits_leave_the_tma_ring_its_batches(pairs, expect):
    """Where whole splits would read through the TMA ring, flat rows only beyond 12% of the wave idle: not at batch 30
    of 8 KV heads (9.1%, where the ring is faster), still at 55 (16.7%)."""
    assert rules.flat_splits(pairs, 2112, ring=True) == expect


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
    """The TMA ring (plan.tma_stages) with value groups of 64 and the value codes in tiles, on compute capability 9
    and later: with keys per channel in 64-token blocks at 4 and 8 heads a program everywhere (at head_dim 256 from
    256 rows a program); with keys per token in groups of 64 at head_dim 128 for the 4-head programs from 128 pairs or
    2,048 rows a program and for the 8-head ones from 768 rows, at head_dim 64 for the 4-head programs everywhere, at
    256 from 64 pairs or 2,048 rows; nowhere else."""
    shape = store_shape(pairs // kv_heads, heads, kv_heads, d, group, axis, layout)
    assert shape.pairs == pairs
    assert rules.tma_stages(major, shape, rules.gluon_heads(heads // kv_heads, d), rows) == expect


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
    assert rules.gluon_waves(pairs, max_int2, d, slots, ht, 132, 128) == expect


@pytest.mark.parametrize("regs,shared,expect", [(96, 0, 20), (128, 0, 16), (144, 0, 12), (166, 0, 12),
                                                 (225, 0, 8), (64, 0, 32), (128, 20 * 1024, 10)])
def test_resident_warps_count_each_schedulers_registers(regs, shared, expect):
    """The grid's one-warp programs a multiprocessor: each of the 4 schedulers' 16,384 registers hold whole
    warps (96 registers: 5 a scheduler, 20, where 65,536 / (32 · 96) would say 21), and shared memory."""
    assert rules.resident_warps(regs, shared, 228 * 1024) == expect


@pytest.mark.parametrize("heads,kv_heads,d,group,axis,per_program,expect", [
    (32, 8, 128, 64, "token", 4, dict(R4=4, HT=1, NGK=2, NGV=2, TB=1, D=128, MASK_ALL=True, KEYS_AHEAD=False)),
    (32, 8, 128, 128, "token", 4, dict(R4=4, HT=1, NGK=1, NGV=1, TB=1, MASK_ALL=False, KEYS_AHEAD=True)),
    (14, 2, 64, 64, "channel", 8, dict(HG=7, R4=8, HT=1, NGK=1, NGV=1, TB=64, D=64, MASK_ALL=False,
                                       KEYS_AHEAD=False)),
    (14, 2, 64, 64, "channel", 4, dict(R4=4, HT=2, KEYS_AHEAD=True)),
    (32, 2, 128, 64, "token", 8, dict(HG=16, R4=8, HT=2)),
    (9, 3, 64, 64, "token", 4, dict(HG=3, R4=4, HT=1)),
    (64, 8, 128, 64, "channel", None, dict(HG=8, R4=8, HT=1)),     # 8 heads a program from GQA 5
    (40, 8, 128, 64, "channel", None, dict(HG=5, R4=8, HT=1)),
    (32, 8, 128, 64, "channel", None, dict(HG=4, R4=4, HT=1, MASK_ALL=True)),
    (40, 8, 128, 64, "token", None, dict(HG=5, R4=8, HT=1, MASK_ALL=False)),
    # head_dim 256: 4 heads a program
    (16, 8, 256, 64, "token", 8, dict(HG=2, R4=4, HT=1, NGK=4, NGV=4, D=256, MASK_ALL=False, KEYS_AHEAD=True)),
    (32, 2, 256, 128, "channel", None, dict(HG=16, R4=4, HT=4, NGK=1, NGV=2, TB=128, KEYS_AHEAD=False)),
    # Value codes in tiles (the default layout): keys ahead also in the 8-head programs with keys per token or at
    # head_dim 64, and at head_dim 256 with keys per channel; still not in Qwen3-8B's 128-register program.
    (32, 8, 128, 64, "token", None, dict(R4=4, VT=True, MASK_ALL=False, KEYS_AHEAD=False, STRIDED=True,
                                         layout="tiles")),
    (32, 8, 128, 64, "channel", None, dict(R4=4, VT=True, MASK_ALL=False, KEYS_AHEAD=True, layout="tiles")),
    (40, 8, 128, 64, "token", None, dict(R4=8, VT=True, KEYS_AHEAD=True, layout="tiles")),
    (14, 2, 64, 64, "channel", 8, dict(R4=8, VT=True, KEYS_AHEAD=True, PF=1, STRIDED=True, layout="tiles")),
    (64, 8, 128, 64, "channel", None, dict(R4=8, VT=True, KEYS_AHEAD=False, PF=1, STRIDED=False, layout="tiles")),
    (32, 8, 128, 64, "channel", None, dict(R4=4, VT=True, PF=0, STRIDED=False, layout="tiles")),
    (64, 8, 128, 64, "token", None, dict(R4=8, VT=True, PF=0, STRIDED=False, layout="tiles")),
    (32, 2, 256, 128, "channel", None, dict(R4=4, HT=4, VT=True, KEYS_AHEAD=True, PF=0, STRIDED=False,
                                            layout="tiles")),
    (32, 8, 128, 64, "token", None, dict(R4=4, STRIDED=False)),      # value codes in rows
])
def test_gluon_programs_cover_a_kv_heads_query_heads(heads, kv_heads, d, group, axis, per_program, expect):
    """Each KV head's HG query heads go to HT programs of R4 heads (R4·HT ≥ HG > R4·(HT − 1)), the groups
    and key blocks as the store holds them; every tile's scores masked only in the 4-head head_dim 128 programs with
    two value groups a token (elsewhere only a program's last tile, measured faster); key words a tile ahead only in
    4-head programs, but not the 128-register one with two key groups a token nor head_dim 256 with keys per
    channel (value codes in rows; in tiles, the rule of plan.keys_ahead); the next tile hinted into L2 only with keys
    per channel in the 8-head programs at head_dim 128 and at head_dim 64 (plan.prefetch_tiles); tiles strided over
    a sequence's splits at head_dim 64 and in the 4-head programs with keys per token at 128
    (plan.strided_tiles). On an A100 (no TMA ring, which would take the keys ahead and the hints off)."""
    expect = dict(expect)
    layout = expect.pop("layout", "rows")
    shape = store_shape(1, heads, kv_heads, d, group, axis, layout)
    plan = rules.choose_plan(shape, A100, gluon=True, heads_per_program=per_program, flat=False)
    consts = rules.gluon_constexprs(shape, plan)
    assert {k: consts[k] for k in expect} == expect
    assert consts["R4"] * consts["HT"] >= consts["HG"] > consts["R4"] * (consts["HT"] - 1)
    assert consts["NW"] == rules.window_programs(shape) and not consts["FLAT"] and consts["TMA"] == 0
    assert "a CUDA GPU" in rules.gluon_problem(shape, rules.Device())   # not without one



QWEN_PLANS = [
    # 2K x 1: 1,728 INT2 rows, 8 pairs, 4 heads a KV head: the Triton programs, four warps, tiles of 256.
    (2048, 1, dict(gluon=False, pdl=True, block_n=256, num_warps=4, num_stages=2, waves=2, key_t=True, min_chunk=0,
                   window_warps=4, block_c=8, reduce_heads=2, rotate_heads=4)),
    # 8K x 1: the Gluon programs from 4K rows; programs of 128 rows (min_chunk) fill 3/4 of the wave.
    (8192, 1, dict(gluon=True, pdl=True, waves=12, min_chunk=128, tma=0, flat=False, strided=True, keys_ahead=False,
                   mask_all=False, maxnreg=128, window_warps=1, block_c=8, reduce_heads=2)),
    (32768, 1, dict(gluon=True, waves=12, min_chunk=128, tma=0, flat=False)),
    # 100K x 1: a program a multiprocessor left to the window programs; at most 256 splits a pair, so 390 rows.
    (100_000, 1, dict(gluon=True, pdl=True, waves=15, min_chunk=390, tma=0, flat=False, strided=True, window_warps=1)),
    # 100K x 8: programs of 3,072 rows read through the TMA ring (its keys ahead and hints off); 8 warps a window
    # program; the reduce's 16 columns and 4 heads a program keep it to 512 programs.
    (100_000, 8, dict(gluon=True, pdl=True, waves=16, tma=2, flat=False, keys_ahead=False, prefetch=0, strided=True,
                      window_warps=8, block_c=16, reduce_heads=4, rotate_heads=4)),
    # 100K x 32: 8 whole splits a pair fill the wave (2,048 of 2,112); the ring from 128 pairs.
    (100_000, 32, dict(gluon=True, waves=16, tma=2, flat=False, window_warps=4, block_c=16, reduce_heads=4)),
    # 100K x 30: whole splits leave 9.1% of the wave idle, under the ring's 12%: the ring, not flat rows.
    (100_000, 30, dict(gluon=True, tma=2, flat=False)),
    # 100K x 55: 16.7% idle: flat rows, which read no ring and take no strided tiles.
    (100_000, 55, dict(gluon=True, tma=0, flat=True, strided=False, keys_ahead=False)),
]


@pytest.mark.parametrize("context,batch,expect", QWEN_PLANS)
def test_qwen3_8b_plans_on_an_h100(context, batch, expect):
    """The plan of Qwen3-8B's attention on an H100 (132 multiprocessors) at each context and batch, with
    max_length the context: every setting the table of docs/kernels.md gives."""
    plan = rules.choose_plan(qwen3_8b(batch, context), H100, context)
    assert {k: getattr(plan, k) for k in expect} == expect
    assert plan.use_asm and plan.block_w == 64


def test_a_ring_that_costs_programs_is_left_out():
    """The TMA ring only where the programs a multiprocessor holds stay as many: Qwen3-32B's shape (GQA 8, 8 heads a
    program) at 100K x 8 reads 4,160 rows a program, over the 8-head rule's 768, so it takes the ring where the ring
    costs no program, and loads into registers where it costs two."""
    shape = store_shape(8, 64, 8, 128, capacity=100_000)
    assert rules.choose_plan(shape, H100, 100_000).tma == 2
    costly = dataclasses.replace(H100, slots=ring_costs_programs)
    plan = rules.choose_plan(shape, costly, 100_000)
    assert plan.tma == 0 and plan.keys_ahead and plan.gluon_heads == 8 and plan.waves == 12


def test_flat_rows_where_no_ring_is_lost():
    """At 100K x 30 whole splits leave 9.1% of the wave idle: on a GPU without the TMA ring (compute capability 8,
    the same 132 multiprocessors) flat rows take it, past 8%; with the ring (12% there) they do not. A store whose
    arrays lie apart (no descriptors) has no ring either."""
    shape = qwen3_8b(30, 100_000)
    ampere = dataclasses.replace(H100, major=8)
    assert rules.choose_plan(shape, ampere, 100_000).flat
    hopper = rules.choose_plan(shape, H100, 100_000)
    assert not hopper.flat and hopper.tma == 2
    apart = rules.choose_plan(qwen3_8b(30, 100_000, joint=False), H100, 100_000)
    assert apart.flat and apart.tma == 0


def test_the_triton_programs_off_cuda():
    """Without a GPU (the interpreter): the Triton programs, no programmatic launch, no PTX unpack; pinning the Gluon
    programs or programmatic launch there is refused."""
    plan = rules.choose_plan(qwen3_8b(1, 100_000), CPU)
    assert not plan.gluon and not plan.pdl and not plan.use_asm
    assert (plan.block_n, plan.num_warps, plan.waves) == (256, 4, 2)
    with pytest.raises(ValueError, match="Gluon INT2 programs cannot serve this call: they need a CUDA GPU"):
        rules.choose_plan(qwen3_8b(1, 100_000), CPU, gluon=True)
    with pytest.raises(ValueError, match="programmatic dependent launch needs"):
        rules.choose_plan(qwen3_8b(1, 100_000), CPU, pdl=True)
    with pytest.raises(ValueError, match="flat rows"):
        rules.choose_plan(qwen3_8b(1, 100_000), H100, gluon=False, flat=True)


def test_pins_rerun_the_rules_after_them():
    """A pinned choice changes the settings that follow from it: the Triton programs at 100K x 8 take the one-warp
    settings of more than 16 pairs (no programmatic launch beyond 8 pairs without Gluon); 16 heads a program at GQA
    16 make one program a split, and 8 heads two."""
    plan = rules.choose_plan(qwen3_8b(8, 100_000), H100, 100_000, gluon=False)
    assert not plan.gluon and not plan.pdl
    assert (plan.block_n, plan.num_warps, plan.num_stages, plan.waves, plan.key_t, plan.min_chunk) == \
        (64, 1, 3, 48, False, 512)
    gqa16 = store_shape(1, 32, 2, 128, capacity=100_000)
    assert rules.choose_plan(gqa16, H100, heads_per_program=16).gluon_heads == 16
    eight = rules.choose_plan(gqa16, H100, heads_per_program=8)
    assert eight.gluon_heads == 8 and rules.gluon_constexprs(gqa16, eight)["HT"] == 2
    assert rules.choose_plan(store_shape(1, 16, 8, 256, capacity=100_000), H100, gluon=True,
                             heads_per_program=8).gluon_heads == 4    # head_dim 256: always 4


@pytest.mark.parametrize("context,batch,heads,axis,expect,kv_heads,d", [
    (2048, 1, 32, "token", False, 8, 128),    # 1,728 INT2 rows, 8 pairs, 4 heads a KV head: the Triton programs
    (8192, 1, 32, "token", True, 8, 128),     # 7,872 INT2 rows
    (8192, 1, 32, "channel", True, 8, 128),
    (2048, 1, 64, "token", True, 8, 128),     # 8 heads a KV head
    (2048, 4, 32, "token", True, 8, 128),     # 32 pairs
    (2048, 2, 32, "token", False, 8, 128),    # 16 pairs
    (100_000, 1, 4, "token", False, 1, 256),      # head_dim 256 below 8 pairs: Triton with keys per token,
    (100_000, 1, 4, "channel", True, 1, 256),     # Gluon with keys per channel from 64K INT2 rows
    (32768, 1, 4, "channel", False, 1, 256),
    (16384, 8, 4, "token", True, 1, 256),         # 8 pairs
    (320, 8, 32, "token", False, 8, 128),         # no INT2 rows yet
])
def test_gluon_programs_are_the_default_from_4k_int2_rows(context, batch, heads, axis, expect, kv_heads, d):
    """The Gluon programs from 4K INT2 rows, above 16 (sequence, KV head) pairs or above 4 query heads per KV head;
    the Triton programs' one launch fewer only for short contexts at small batch, and at head_dim 256 below 8
    pairs but for keys per channel from 64K rows."""
    shape = store_shape(batch, heads, kv_heads, d, 64, axis, capacity=context)
    assert rules.choose_plan(shape, H100, context).gluon is expect
    assert not rules.choose_plan(shape, CPU, context).gluon


@pytest.mark.parametrize("pairs,d,gluon,num_warps,expect", [
    (8, 128, True, 1, 1), (16, 128, True, 1, 8), (64, 128, True, 1, 8), (65, 128, True, 1, 4), (256, 64, True, 1, 4),
    (8, 256, True, 2, 8), (1, 256, True, 2, 8), (128, 256, True, 2, 4), (64, 128, False, 1, 1), (8, 128, False, 4, 4),
])
def test_window_warps_beside_the_gluon_programs(pairs, d, gluon, num_warps, expect):
    """The window programs take 8 warps beside the Gluon programs up to 64 pairs, 4 beyond; at 8 pairs or fewer below
    head_dim 256 (a slot left to them) and without Gluon, the Triton programs' warps."""
    assert rules.window_warps(pairs, d, gluon, num_warps) == expect


@pytest.mark.parametrize("pairs,d,gluon,expect", [
    (8, 128, False, dict(block_n=256, num_warps=4, num_stages=2, waves=2, key_t=True, min_chunk=0)),
    (16, 64, False, dict(block_n=128, num_warps=4, num_stages=2, waves=2, key_t=True, min_chunk=0)),
    (17, 128, False, dict(block_n=64, num_warps=1, num_stages=3, waves=48, key_t=False, min_chunk=512)),
    (128, 128, False, dict(block_n=64, num_warps=1, num_stages=4, waves=48, key_t=True, min_chunk=512)),
    (64, 256, False, dict(block_n=64, num_warps=2, num_stages=2, waves=48, key_t=False, min_chunk=512)),
    (1, 128, True, dict(block_n=64, num_warps=1, num_stages=1, key_t=True, min_chunk=128)),
    (1, 256, True, dict(num_warps=2)),
])
def test_program_config_by_pairs(pairs, d, gluon, expect):
    """The split programs' settings: four-warp Triton programs up to 16 pairs (tiles of 256 at head_dim 128, else
    128), one-warp ones from 17 (two at head_dim 256; 4 stages from 128 pairs); the Gluon programs' 64-row tiles."""
    cfg = rules.program_config(pairs, d, gluon)
    assert {k: cfg[k] for k in expect} == expect


@pytest.mark.parametrize("pairs,gluon,device,expect", [
    (8, False, H100, True), (9, False, H100, False), (64, True, H100, True), (8, True, A100, False),
    (1, False, CPU, False)])
def test_programmatic_launch_at_few_pairs_or_with_gluon(pairs, gluon, device, expect):
    assert rules.use_pdl(pairs, gluon, device) is expect


@pytest.mark.parametrize("shape,device,reason", [
    (store_shape(1, 32, 8, 128), CPU, "a CUDA GPU of compute capability 8.0"),
    (store_shape(1, 32, 8, 128), dataclasses.replace(H100, major=7), "a CUDA GPU of compute capability 8.0"),
    (store_shape(1, 32, 8, 128), dataclasses.replace(H100, gluon=False), "no Gluon"),
    (store_shape(1, 32, 8, 128, 256), H100, "key groups (or key blocks) of 64 or 128"),
    (store_shape(1, 32, 8, 128, 256, "channel"), H100, "key groups (or key blocks) of 64 or 128"),
    (dataclasses.replace(store_shape(1, 32, 8, 128), value_group=256), H100, "value groups of 64 or 128"),
    (dataclasses.replace(store_shape(1, 32, 8, 128), rows=100), H100, "whole 64-row blocks"),
    (store_shape(1, 32, 8, 128), H100, None),
    (store_shape(1, 32, 2, 64, 64, "channel"), H100, None),
])
def test_gluon_problem_says_why(shape, device, reason):
    why = rules.gluon_problem(shape, device)
    assert why is None if reason is None else reason in why


@pytest.mark.parametrize("change,message", [
    (dict(flat=True, tma=2), "flat rows"),
    (dict(flat=True, gluon=False), "flat rows"),
    (dict(tma=2, gluon=False), "TMA ring"),
    (dict(gluon=True), None),
])
def test_check_plan_refuses_what_cannot_run(change, message):
    """check_plan (decode_attention runs it on a plan it is given): flat rows only in the Gluon programs and without
    the TMA ring, the ring only in the Gluon programs."""
    shape = qwen3_8b(8, 100_000)
    plan = dataclasses.replace(rules.choose_plan(shape, H100, 100_000), **change)
    if message is None:
        rules.check_plan(shape, plan, H100)
    else:
        with pytest.raises(ValueError, match=message):
            rules.check_plan(shape, plan, H100)


def test_check_plan_refuses_what_the_device_or_store_lacks():
    shape = qwen3_8b(8, 100_000)
    ring = rules.choose_plan(shape, H100, 100_000)
    assert ring.tma == 2 and ring.pdl
    with pytest.raises(ValueError, match="TMA ring"):
        rules.check_plan(shape, dataclasses.replace(ring, pdl=False), dataclasses.replace(H100, major=8))
    with pytest.raises(ValueError, match="TMA ring"):
        rules.check_plan(qwen3_8b(8, 100_000, joint=False), ring, H100)
    with pytest.raises(ValueError, match="programmatic dependent launch"):
        rules.check_plan(shape, dataclasses.replace(ring, tma=0), dataclasses.replace(H100, major=8))
    with pytest.raises(ValueError, match="Gluon"):
        rules.check_plan(shape, ring, CPU)
    with pytest.raises(ValueError, match="head_dim 64, 128 or 256, not 96"):
        rules.check_plan(dataclasses.replace(shape, head_dim=96), ring, H100)


def test_a_plan_is_a_value():
    """A plan is frozen and hashable (a graph's key holds it); dataclasses.replace makes a variant."""
    plan = rules.choose_plan(qwen3_8b(8, 100_000), H100, 100_000)
    assert plan == rules.choose_plan(qwen3_8b(8, 100_000), H100, 100_000)
    assert hash(plan) == hash(dataclasses.replace(plan))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.waves = 3
    other = dataclasses.replace(plan, waves=3)
    assert other != plan and other.waves == 3 and plan.waves == 16


@pytest.mark.parametrize("max_length,expect", [(None, 99_712), (100_000, 99_680), (320, 0), (10, 0), (10**6, 99_712)])
def test_int2_rows_a_sequence_of_max_length_holds(max_length, expect):
    assert qwen3_8b(1, 100_000).rows == 99_712
    assert qwen3_8b(1, 100_000).max_int2(max_length) == expect


@pytest.mark.parametrize("max_int2,expect", [(1000, 128), (32_768, 128), (32_769, 129), (99_712, 390)])
def test_gluon_splits_at_most_256_a_pair(max_int2, expect):
    assert rules.gluon_min_chunk(max_int2) == expect
