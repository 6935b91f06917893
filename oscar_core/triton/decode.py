"""Decode attention over an Int2KVCache: the public calls, decode_attention and decode_step, and their launches.

    o = decode_attention(q, cache, key_rotation, value_rotation, value_mean, scaling)             # q, o: [B, H, d]
    plan = dataclasses.replace(plan_for(q, cache), block_n=128)                                    # a variant
    o = decode_attention(q, cache, key_rotation, value_rotation, value_mean, scaling, plan)

A call reads its shape (shape_of) and the device (device_of), takes the DecodePlan the rules of plan.py choose for
them (plan_for, worked out once a shape) or the one it is given, and launches the programs of decode_programs.py and
decode_gluon.py with it: the query rotation, the split programs (the window programs and, where the plan says, the
Gluon INT2 programs beside them) and the reduce (docs/kernels.md: how a call runs, and the plan's rules). Nothing is
read back to the host, so a call can be captured in a CUDA graph; an eager call on CUDA replays a graph of itself
kept on the store (replay.py). A shape no program serves is refused by plan.shape_problem (cache.kernel_problem
asks it through this module) before any launch.
"""

import contextlib
import dataclasses
import functools
import math
import weakref

import torch

from oscar_core.kvstore import Int2KVCache
from oscar_core.paged import PagedKVCache
from oscar_core.triton import replay
from oscar_core.triton.decode_programs import LOG2E, _reduce_kernel, _split_kernel, rotate_query_bf16
from oscar_core.triton.launch import cached
from oscar_core.triton.plan import (DecodePlan, DecodeShape, Device, check_plan, choose_plan, flat_programs_a_pair,
                                    gated_loads, gluon_constexprs, gluon_options, plan_splits, pow2, resident_warps,
                                    window_programs)
from oscar_core.triton.plan import shape_problem  # noqa: F401  (cache.kernel_problem asks it here: needs triton)


@functools.lru_cache(maxsize=None)
def _gluon():
    """The decode_gluon module, or None where this triton has no Gluon."""
    try:
        from oscar_core.triton import decode_gluon
    except ImportError:
        return None
    return decode_gluon


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple:
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _one_after_another(arrays) -> bool:
    """Whether contiguous arrays of one size lie back to back in one allocation, in this order."""
    a0 = arrays[0]
    size = a0.numel() * a0.element_size()
    return all(a.is_contiguous() and a.numel() * a.element_size() == size
               and a.untyped_storage().data_ptr() == a0.untyped_storage().data_ptr()
               and a.data_ptr() == a0.data_ptr() + i * size for i, a in enumerate(arrays))


def _arrays(cache: Int2KVCache) -> tuple[tuple, tuple]:
    """The store's INT2 arrays as the TMA ring reads them: the codes, then the scale and zero codes."""
    return ((cache.key_codes, cache.value_codes),
            (cache.key_scale, cache.key_zero, cache.value_scale, cache.value_zero))


def shape_of(q: torch.Tensor, cache: Int2KVCache | PagedKVCache) -> DecodeShape:
    """What the plan's rules read of a call of q [B, H, d] over cache (a paged one: page, and rows its most)."""
    bsz, heads, d = q.shape
    codes, meta = _arrays(cache)
    paged = isinstance(cache, PagedKVCache)
    return DecodeShape(batch=bsz, heads=heads, kv_heads=cache.key_codes.shape[1], head_dim=d,
                       key_group=cache.key_group_size, value_group=cache.value_group_size, key_axis=cache.key_axis,
                       sink=cache.sink_tokens, recent=cache.recent_tokens, ring_slots=cache.ring_slots,
                       rows=cache.rows if paged else cache.key_codes.shape[2], value_tiles=cache.value_tiles,
                       window=cache.window is not None, page=cache.page_tokens if paged else 0,
                       joint=not paged and q.is_cuda and _one_after_another(codes) and _one_after_another(meta))


def page_args(cache: Int2KVCache | PagedKVCache) -> tuple:
    """The split programs' block table, window slots, page stride (bytes) and block table width: a paged store's,
    or for any other store placeholders the programs never read."""
    if isinstance(cache, PagedKVCache):
        return cache.block_table, cache.window_slot, cache.page_stride, cache.block_table.shape[1]
    return cache.lengths, cache.lengths, 0, 0


def device_of(q: torch.Tensor, cache: Int2KVCache) -> Device:
    """What the plan's rules read of q's device (the Gluon programs' slots counted by compiling them for cache)."""
    if not q.is_cuda:
        return Device()
    dev = q.device
    return Device(cuda=True, sms=_num_sms(dev), major=_capability(dev)[0], gluon=_gluon() is not None,
                  slots=functools.partial(_gluon_programs_per_sm, cache, dev))


_GLUON_SLOTS: dict = {}


def _gluon_programs_per_sm(cache: Int2KVCache, device: torch.device, constexprs: dict, options: dict) -> int:
    """One-warp Gluon programs a multiprocessor holds (plan.resident_warps), from the compiled kernel (compiled once
    per setting, without launching). Triton 3.6 compiles the loop to 128 registers a thread (16 programs), later ones
    to more; the grid is sized for whichever runs."""
    key = (device, tuple(sorted(constexprs.items())), tuple(sorted(options.items())))
    if key not in _GLUON_SLOTS:
        qt = torch.empty(1, dtype=torch.bfloat16, device=device)
        f32 = torch.empty(1, dtype=torch.float32, device=device)
        args = _gluon_args(qt, cache, f32, f32, f32, 1.0, 2, 512, 2, constexprs["TMA"] > 0)
        compiled = _gluon()._int2_split_kernel.warmup(*args, grid=(1, 1), **options, **constexprs)
        compiled._init_handles()
        smem = torch.cuda.get_device_properties(device).shared_memory_per_multiprocessor
        _GLUON_SLOTS[key] = resident_warps(compiled.n_regs, compiled.metadata.shared, smem)
    return _GLUON_SLOTS[key]


_TMA_DESCRIPTORS: dict = {}   # id(key codes) -> (their weak reference, the arrays' addresses, the descriptors or None)


def tma_boxes(head_dim: int) -> tuple[list, list]:
    """The boxes (one tile) of tma_descriptors' two descriptors: codes [2, D/8, 32] words, metadata [4, 1, D/4]
    words (at head_dim 256 [4, 2, 32]: rows of at most 32 words)."""
    rows = 2 if head_dim == 256 else 1
    return [2, head_dim // 8, 32], [4, rows, head_dim // 4 // rows]


def tma_descriptors(cache: Int2KVCache) -> tuple | None:
    """The TMA descriptors of a store's INT2 arrays for decode_gluon's TMA ring, or None where the store does not lay
    them out as kvstore.empty_cache does (the value codes right after the key codes; the key scales, key zeros, value
    scales and value zeros one after another). Two descriptors, one bulk copy each a tile, both views of the store's
    own bytes (never a copy):
      codes [2, B·H_kv·T·D/512, 32] int32 words, the key codes then the value codes as rows of 512/D tokens, a tile
        [2, D/8, 32] with the 128-byte swizzle;
      metadata [4, B·H_kv·T/64, D/4] words, the four arrays as rows of a tile's D/4 words (one group of 64 channels
        a token, or a 64-token key block's D codes), a tile [4, 1, D/4]; at head_dim 256 rows of 32 words, a tile
        [4, 2, 32].
    Value groups of 64, value codes in tiles (plan.tma_stages). A descriptor holds only an address, shape and strides,
    so they are built once (about 60 µs of host time) and kept beside the store's key codes for as long as those live
    (a weak key: a store that grows or is freed takes its descriptors with it)."""
    codes, meta = _arrays(cache)
    key = tuple((a.data_ptr(), a.numel()) for a in codes + meta)
    hit = _TMA_DESCRIPTORS.get(id(cache.key_codes))
    if hit is None or hit[0]() is not cache.key_codes or hit[1] != key:
        descriptors = None
        if _one_after_another(codes) and _one_after_another(meta):
            from triton.experimental.gluon import language as gl
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

            def boxes(arrays, block, swizzle):
                words = arrays[0].view(-1).view(torch.int32)
                width = block[-1]
                joint = words.as_strided((len(arrays), words.numel() // width, width), (words.numel(), width, 1))
                return TensorDescriptor.from_tensor(joint, block, gl.NVMMASharedLayout(swizzle, 32, 3))

            code_box, meta_box = tma_boxes(cache.key_codes.shape[-1] * 4)
            descriptors = (boxes(codes, code_box, 128), boxes(meta, meta_box, 0))
        hit = (weakref.ref(cache.key_codes), key, descriptors)
        _TMA_DESCRIPTORS[id(cache.key_codes)] = hit
        weakref.finalize(cache.key_codes, _TMA_DESCRIPTORS.pop, id(cache.key_codes), None)
    return hit[2]


def _gluon_args(qt, cache, po, pm, pl, log2_scale, n_int2, min_chunk, ns, tma: bool = False) -> tuple:
    """decode_gluon._int2_split_kernel's arguments before its constexprs (zeros read as bytes), with the store's TMA
    descriptors where its programs read through a TMA ring (tma_descriptors; None otherwise)."""
    return (qt, cache.key_codes.view(torch.int32), cache.key_scale, cache.key_zero.view(torch.uint8),
            cache.value_codes.view(torch.int16), cache.value_scale, cache.value_zero.view(torch.uint8),
            cache.lengths, po, pm, pl, log2_scale, cache.key_codes.shape[2], n_int2, min_chunk, ns,
            *(tma_descriptors(cache) if tma else (None,) * 2))


_COUNTERS: dict = {}
_OLD_COUNTERS: list = []


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (sequence, KV head) and reduce head block, reused by every call on the device:
    each call's merging programs leave them at 0. A larger set replaces the old one, which is kept alive (a captured
    CUDA graph may still point at it). Calls on one device must not run concurrently on several streams."""
    have = _COUNTERS.get(device)
    if have is None or have.numel() < n:
        if have is not None:
            _OLD_COUNTERS.append(have)
        have = _COUNTERS[device] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return have


@dataclasses.dataclass(frozen=True)
class Launches:
    """The grids and constexprs of a plan's launches for one shape of call (launches)."""
    ns: int                 # splits a pair: window programs, then INT2 programs
    n_int2: int             # INT2 splits a pair; flat: the number of pairs
    min_chunk: int
    split: int              # partial rows: pairs · ns · HG
    work: int               # float32 elements of the partials and the reduce's shares
    split_grid: tuple
    split_consts: dict
    gluon_grid: tuple
    gluon_consts: dict
    reduce_grid: tuple
    reduce_consts: dict


def launches(shape: DecodeShape, plan: DecodePlan, device: Device, max_length: int | None = None,
             has_mean: bool = True, rotate_values: bool = True) -> Launches:
    """The grids and constexprs of plan's launches (arithmetic, no rule): the INT2 splits a pair for max_length
    (plan_splits, at least one, so a sequence longer than max_length is still read whole), the partials' layout, and
    each program's constexprs. has_mean: a value mean to add; rotate_values: õ·R_V^T in the reduce."""
    d, hg, pairs, tb = shape.head_dim, shape.heads_per_kv, shape.pairs, shape.token_block
    gk = 64 if tb > 1 else shape.key_group     # keys per channel: the query's channels as rows in groups of 64
    gv = shape.value_group
    block_n = plan.block_n if tb == 1 else min(plan.block_n, tb)
    nw = window_programs(shape, plan.block_w)
    _, n_int2 = plan_splits(shape.batch, shape.kv_heads, shape.max_int2(max_length), block_n, device.sms, plan.waves,
                            plan.min_chunk)
    n_int2 = max(n_int2, 1)
    wave = plan.waves * device.sms
    flat = plan.gluon and plan.flat
    if flat:
        n_int2 = pairs
        ns = nw + flat_programs_a_pair(wave, pairs)
    else:
        ns = nw + n_int2
    hgp = max(pow2(hg), 16 // min(d // gk, d // gv))
    split = pairs * ns * hg
    block_c, hb = plan.block_c, plan.reduce_heads
    shares = pairs * (d // block_c) * pow2(hg) * d if rotate_values else 0
    launch = dict(launch_pdl=True) if plan.pdl else {}
    window_pdl = plan.pdl and pairs <= 8      # the window programs (or all, without Gluon) dependents of the rotation
    split_consts = dict(HKV=shape.kv_heads, HG=hg, D=d, GK=gk, GV=gv, S=shape.sink, W=shape.recent, HGP=hgp,
                        QP=max(16, hgp), NW=nw, BLOCK_N=block_n, BLOCK_W=plan.block_w, KEY_T=plan.key_t,
                        USE_ASM=plan.use_asm, F32=not device.cuda, TB=tb, R=shape.ring_slots if tb > 1 else 1,
                        VT=shape.value_tiles, PDL=window_pdl, HOLE=shape.hole, SLIDE=shape.window,
                        PAGED=shape.page > 0, PAGE=max(shape.page, 1),
                        num_warps=plan.window_warps if plan.gluon else plan.num_warps, num_stages=plan.num_stages,
                        **(dict(launch_pdl=True) if window_pdl else {}))
    gluon_consts = dict(**gluon_options(plan), **gluon_constexprs(shape, plan), **launch) if plan.gluon else {}
    ht = gluon_consts.get("HT", 1)
    return Launches(
        ns=ns, n_int2=n_int2, min_chunk=plan.min_chunk, split=split, work=split * (d + 2) + shares,
        split_grid=(nw if plan.gluon else ns, pairs), split_consts=split_consts,
        gluon_grid=(wave * ht, 1) if flat else (n_int2 * ht, pairs), gluon_consts=gluon_consts,
        reduce_grid=(pairs, d // block_c, pow2(hg) // hb),
        reduce_consts=dict(HKV=shape.kv_heads, HG=hg, D=d, HGP=pow2(hg), HB=hb,
                           SB=min(8192 // (hb * block_c), max(8, pow2(ns))), BLOCK_C=block_c, HAS_MEAN=has_mean,
                           PDL=plan.pdl, GATED=gated_loads(ns), ROTATE=rotate_values, num_warps=4, **launch))


_PLANS: dict = {}
_LAUNCHES: dict = {}


def _plan_of(q, cache, shape: DecodeShape, max_length, pins: tuple = (None,) * 4) -> DecodePlan:
    key = (q.device, shape, max_length, pins)
    plan = _PLANS.get(key)
    if plan is None:
        gluon, heads_per_program, flat, pdl = pins
        plan = _PLANS[key] = choose_plan(shape, device_of(q, cache), max_length, gluon=gluon,
                                         heads_per_program=heads_per_program, flat=flat, pdl=pdl)
    return plan


def plan_for(q: torch.Tensor, cache: Int2KVCache, max_length: int | None = None, *, gluon: bool | None = None,
             heads_per_program: int | None = None, flat: bool | None = None, pdl: bool | None = None) -> DecodePlan:
    """The plan decode_attention(q, cache, ..., max_length=max_length) runs (plan.choose_plan, worked out once a shape
    and kept), with any of gluon, heads_per_program, flat and pdl pinned (None: the rule's choice)."""
    return _plan_of(q, cache, shape_of(q, cache), max_length, (gluon, heads_per_program, flat, pdl))


def _launches_of(q, cache, shape: DecodeShape, plan: DecodePlan, max_length, has_mean, rotate_values) -> Launches:
    key = (q.device, shape, plan, max_length, has_mean, rotate_values)
    run = _LAUNCHES.get(key)
    if run is None:
        device = device_of(q, cache)
        check_plan(shape, plan, device)
        run = _LAUNCHES[key] = launches(shape, plan, device, max_length, has_mean, rotate_values)
    return run


def _direct(q, cache, key_rotation, value_rotation, value_mean, scaling, plan, max_length, out) -> torch.Tensor:
    """decode_attention's launches, direct."""
    shape = shape_of(q, cache)
    if plan is None:
        plan = _plan_of(q, cache, shape, max_length)
    has_mean = value_mean is not None
    run = _launches_of(q, cache, shape, plan, max_length, has_mean, value_rotation is not None)
    d = shape.head_dim
    q_in = rotate_query_bf16(q, key_rotation, plan.pdl, plan.rotate_heads)
    work = torch.empty(run.work, dtype=torch.float32, device=q.device)
    split = run.split
    po, pm, pl = work[:split * d], work[split * d:split * (d + 1)], work[split * (d + 1):split * (d + 2)]
    py = work[split * (d + 2):]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    # Without R_V (held by the model's weights) the reduce reads no rotation: any float32 tensor stands in.
    rv = (key_rotation if value_rotation is None else value_rotation).float().contiguous()
    mean = value_mean.float().contiguous() if has_mean else rv
    counters = _counters(q.device, shape.pairs * run.reduce_grid[2])
    scale_log2 = scaling * LOG2E
    # Captured into a CUDA graph, the window programs run on a stream of their own beside the Gluon INT2
    # programs (two branches of the graph); eager calls keep one stream (their time is the host's).
    side = _side_stream(q.device) if plan.gluon and torch.cuda.is_current_stream_capturing() else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(q.device))
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        # The window programs (with gluon), or every split.
        cached(_split_kernel)(
            run.split_grid, q_in, cache.key_sink, cache.value_sink, cache.key_recent, cache.value_recent,
            cache.key_codes, cache.key_scale, cache.key_zero, cache.value_codes, cache.value_scale, cache.value_zero,
            cache.lengths, po, pm, pl, scale_log2, math.log2(scale_log2), shape.rows, run.n_int2,
            run.min_chunk, run.ns, *page_args(cache), **run.split_consts)
    if plan.gluon:
        cached(_gluon()._int2_split_kernel)(
            run.gluon_grid, *_gluon_args(q_in, cache, po, pm, pl, math.log2(scale_log2), run.n_int2, run.min_chunk,
                                         run.ns, plan.tma > 0), **run.gluon_consts)
    if side is not None:
        torch.cuda.current_stream(q.device).wait_stream(side)
    cached(_reduce_kernel)(run.reduce_grid, po, pm, pl, py, counters, rv, mean, out, run.ns, **run.reduce_consts)
    return out


def decode_attention(q: torch.Tensor, cache: Int2KVCache, key_rotation: torch.Tensor,
                     value_rotation: torch.Tensor | None, value_mean: torch.Tensor | None, scaling: float,
                     plan: DecodePlan | None = None, *, max_length: int | None = None, out: torch.Tensor | None = None,
                     graph: bool | None = None) -> torch.Tensor:
    """Triton kvstore.decode_attention_reference: q [B, H, d] original space -> o [B, H, d]. cache: an Int2KVCache,
    or a paged.PagedKVCache (sequence b's rows through its block table row, its windows in its window slot).

    plan: the launch settings (None: plan_for's, the rules' for this shape). max_length: the longest sequence
    expected (e.g. a static bound for CUDA-graph capture; None: the store's capacity), only a hint for how many
    programs share the INT2 rows: each sequence's rows are divided among them by its own length, so results never
    depend on it and the grid never depends on the data. out, if given, is a contiguous [B, H, d] tensor (float32 or
    bf16) written in place. value_rotation None: the output stays in the values' stored space, õ (+ μ_V), for a
    model whose weights hold R_V (absorb.py); the reduce then only merges the splits.
    Every sequence needs at least one token. The cache tensors must be contiguous. Raises ValueError (before any
    launch) for a shape no program serves (plan.shape_problem) or a plan the device or the store cannot run.
    graph: replay a CUDA graph of this call kept on the store (replay.py); None: on CUDA when no capture is under way
    (an eager caller). Its launches are those of graph=False with max_length rounded up to a power of two, so that a
    growing context recaptures only when it doubles."""
    if graph is None:
        graph = q.is_cuda and not torch.cuda.is_current_stream_capturing()
    if not graph:
        return _direct(q, cache, key_rotation, value_rotation, value_mean, scaling, plan, max_length, out)
    rounded = None if max_length is None else pow2(max_length)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)

    def launches(q, out):
        _direct(q, cache, key_rotation, value_rotation, value_mean, scaling, plan, rounded, out)
    key = replay.graph_key(q, out, cache, key_rotation, value_rotation, value_mean, scaling, (rounded, plan))
    return replay.replay(cache.graphs, key, launches, (q,), out)


def decode_step(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, write, cache: Int2KVCache,
                key_rotation: torch.Tensor, value_rotation: torch.Tensor | None, value_mean: torch.Tensor | None,
                scaling: float, plan: DecodePlan | None = None, *, max_length: int | None = None,
                out: torch.Tensor | None = None, graph: bool | None = None) -> torch.Tensor:
    """A decode step's whole work on one layer's store: write(keys, values) (the new token's launches), then
    decode_attention(q, cache, ...) over the store that now holds it -> [B, H, d].

    graph (None: on CUDA when no capture is under way, an eager caller): both, the write's launches and then the
    decode programs, as one CUDA-graph replay (replay.replay: the query, keys and values copied into the graph's in
    one launch, or the graph at the call's own addresses): a step's host work is then one replay a layer. The graphs
    are kept in cache.graphs beside decode_attention's, so they never outlive what they read; a call that matches
    one's key (write, the new tokens' shapes and strides, replay.graph_key) reads exactly its own tensors. write: a
    function of (keys, values), or a method of the store's one writer (its function is the key, so that the store's
    graphs hold no reference to their owner), that launches the same every step: what changes between steps is read
    on the device (the store's lengths)."""
    if graph is None:
        graph = q.is_cuda and not torch.cuda.is_current_stream_capturing()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not graph:
        write(keys, values)
        return _direct(q, cache, key_rotation, value_rotation, value_mean, scaling, plan, max_length, out)
    rounded = None if max_length is None else pow2(max_length)

    def launches(q, keys, values, out):
        write(keys, values)
        _direct(q, cache, key_rotation, value_rotation, value_mean, scaling, plan, rounded, out)
    key = (("step", getattr(write, "__func__", write), keys.shape, keys.stride(), values.stride(), keys.dtype,
            values.dtype) + replay.graph_key(q, out, cache, key_rotation, value_rotation, value_mean, scaling,
                                             (rounded, plan)))
    return replay.replay(cache.graphs, key, launches, (q, keys, values), out)
