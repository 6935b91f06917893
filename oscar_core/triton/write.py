"""Triton write kernels: rotate, centre, clip, quantize to INT2 and pack (kvstore.write_int2), the prefill
of an empty kvstore.Int2KVCache and the append of new tokens into one in place (kvstore.append), K and V in one
launch.

Rotation. y = (x − μ)·R is computed as x·R_hi + x·R_lo − μ·R on the tensor cores, where R_hi = bf16(R)
and R_lo = bf16(R − R_hi) (prepare_rotation, once per layer): a bf16 x times a bf16 factor is exact in
the float32 accumulator, and R_hi + R_lo carries 16 of R's 24 bits, so y matches the float32 reference
to about 2^-17 relative (a float32 x is split the same way, x_hi·R_hi + x_hi·R_lo + x_lo·R_hi).
Codes therefore equal the reference's except where a value lies that close to a rounding boundary.
Quantization: per group of G channels the arithmetic of quant.quantize (log2 scale code, quarter-step
zero code, the widening of far-off-centre groups), with products by reciprocals for its divisions (within an
ulp: codes agree on 99.997% of entries, bench/results/write.md); channel 4j + i goes to bits 2i of byte j.

Prefill (prefill_kv), an empty store: program p of (sequence, KV head, side) quantizes INT2 tiles p, p + P, ...
of positions S + kBT .. (keys per channel: one key block of TB tokens a step, quantized down its columns,
in tiles of 64: a block of 128 is two tiles, its channels' ranges taken over both), then writes its sink and
ring tiles in BF16. A key block is rotated transposed, Rᵀ·xᵀ [d, G], its rows (channels) in
_byte_order: a channel's range is then a reduction inside a thread and its quad, and the four channels of a
byte sit in one thread, where rows would spread each channel over the whole program (4,228 instructions a
64-token tile on sm_90 before, 868 now; bench/results/write.md).

Append (append_kv). Row r of the launch is token t = r mod n of sequence b = r div n; with L_b the
length after the append (the caller advanced it, kvstore.advance) and s_b the sequence's leading pads,
the token lands at position p = L_b − n + t (t ≥ s_b): in the sink if p < S, in ring slot (p − S) mod W
if p ≥ L_b − W (BF16, rotated and centred), else in INT2 row p − S. The token that p pushes out of the
ring, p − W, when it was stored there before this append (S ≤ p − W < L_b − n + s_b), is read from that
same slot first and quantized (it is already rotated) into INT2 row p − W − S. A decode step (n = 1)
is one launch for the whole batch; an append longer than W to a non-empty store runs in launches of
W tokens, so that no program reads a ring slot that another program of the same launch rewrites.

Keys per channel (kvstore's key_axis "channel", a ring of R = W + G slots): an append of n ≤ W tokens is
two launches. leave_blocks first quantizes the blocks whose last token the append pushes out of the W
window (at most ⌈n/G⌉ a sequence; a decode step, one every G steps, and its programs exit at once
otherwise): program (k, b·H_kv + h, side) reads the G ring rows of the k-th such block of sequence b,
keys per channel (_quantize_columns: the arithmetic of quant.quantize down each channel of the block,
loaded transposed) and values per token (_quantize), into their INT2 rows. A Triton kernel rather than torch on the
device: which sequence has a block to move depends on its length, which only the device holds, so one
launch with no host read decides it per program and a decode step stays capturable in a CUDA graph.
Then append_kv writes the new tokens to their sink row or ring slot (p − S) mod R, with no eviction (a
block's slots are not reused before it has left). Appends longer than W are the torch reference's.

Value codes in 64-row tiles (a store whose value_layout is "tiles", kvstore.Int2KVCache): every writer stores a
row's value bytes through code_offsets, each 16-bit half into its tile's slot; key codes keep their rows.

A window's store (kvstore.window_cache, RING): INT2 token i goes to row i mod T (keys per channel: key block j to row
block j mod T/G), and only the tokens of its last N = W + T positions are written (a prefill's INT2 tiles or key
blocks start at the first of its last T INT2 tokens; an append skips an evicted or direct token older than that;
leave_blocks writes the last T/G blocks), so no two tokens of a launch share a row. A window kept whole in BF16
(T = 0) has only its sink and ring written.

Channels a program (columns): each program rotates and quantizes C channels of its tokens, y[:, c0:c0 + C] =
(x − μ)·R[:, c0:c0 + C], holding those columns of R; C is the whole head up to head_dim 128 and 128 at 256, where
the whole R (two bf16 [256, 256] tiles) would not fit a multiprocessor's shared memory. A group of channels never
spans two programs, and a key block's channels are independent, so the programs of one head share nothing.

A paged store (paged.PagedKVCache, the compile-time PAGED; the entry points are paged_write.py's): INT2 row r of
sequence b is row (S + r) mod P of head h's [H_kv, P] rows in page block_table[b, (S + r) div P], each array
page_stride bytes a page, and the sink and ring are window slot window_slot[b]'s. The prefill looks the page up once a
tile or key block (both divide the page), append_kv once a row (_page_rows), leave_blocks once a block. Without
PAGED the programs compile as before (the block table and slot arguments unread).

Long because the three write programs (prefill, append, leave) share their quantizer, rotation and placement helpers,
and each places rows in kvstore's three store kinds (rows, a window's ring of rows, pages) behind compile-time flags.
"""

import functools

import torch
import triton
import triton.language as tl

from oscar_core.paged import PagedKVCache
from oscar_core.triton.launch import cached

# 1.5·2^23: (x + M) − M rounds a float32 |x| < 2^22 to nearest, ties to even.
ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _round(x):
    return (x + ROUND_MAGIC) - ROUND_MAGIC


@triton.jit
def _log2(x, F32: tl.constexpr):
    """log2 of a positive normal x; on the GPU the multifunction unit's (lg2.approx, within 2^-22 absolute)
    rather than tl.log2's polynomial of some 20 instructions."""
    if F32:
        y = tl.log2(x)
    else:
        y = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    return y


@triton.jit
def _scale_code(step, ROUND_UP: tl.constexpr, F32: tl.constexpr):
    e = _log2(tl.maximum(step, 2.0 ** -20), F32) * 8.0
    if ROUND_UP:
        e = tl.ceil(e)
    else:
        e = _round(e)
    return tl.minimum(tl.maximum(e + 128.0, 0.0), 255.0)


@triton.jit
def dot(a, b, acc, F32: tl.constexpr):
    """tl.dot; with F32 on float32 copies (exact for bf16 inputs), for the CPU interpreter's numpy matmul."""
    if F32:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        c = tl.dot(a, b, acc)
    return c


@triton.jit
def _product(x, r, acc, T: tl.constexpr, F32: tl.constexpr):
    """acc + x·r, or with T acc + r·xᵀ (r then holds a transposed factor)."""
    if T:
        c = dot(r, tl.trans(x), acc, F32)
    else:
        c = dot(x, r, acc, F32)
    return c


@triton.jit
def _rotate(x, r_hi, r_lo, acc, F32: tl.constexpr, T: tl.constexpr = False):
    """acc + x·(R_hi + R_lo) in float32 from bf16 products, x [BT, D] as loaded: bf16, or another float type
    split into bf16 x_hi + x_lo; acc float32 [BT, D] (−μ·R broadcast, or zeros). With T the transpose,
    acc + (R_hi + R_lo)ᵀ·xᵀ [D, BT], from r_hi / r_lo holding the factors transposed (rows in any order)."""
    if x.dtype != tl.bfloat16:
        xf = x.to(tl.float32)
        xh = xf.to(tl.bfloat16)
        y = _product(xh, r_hi, acc, T, F32)
        y = _product(xh, r_lo, y, T, F32)
        y = _product((xf - xh.to(tl.float32)).to(tl.bfloat16), r_hi, y, T, F32)
    else:
        y = _product(x, r_hi, acc, T, F32)
        y = _product(x, r_lo, y, T, F32)
    return y


@triton.jit
def _start(mr_ptr, h, c0, BT: tl.constexpr, D: tl.constexpr, C: tl.constexpr, HAS_MEAN: tl.constexpr):
    """The rotation's accumulator before the products: columns [c0, c0 + C) of −μ·R of head h broadcast over BT
    rows (zeros without a mean)."""
    if HAS_MEAN:
        acc = tl.broadcast_to(-tl.load(mr_ptr + h * D + c0 + tl.arange(0, C))[None, :], [BT, C])
    else:
        acc = tl.zeros([BT, C], tl.float32)
    return acc


@triton.jit
def _group_params(lo, hi, clip, F32: tl.constexpr):
    """quant.quantize's parameters of groups with range [lo, hi]: (scale code, 1/step, zero code), float32; the
    step is widened until the zero code fits in int8. Divisions by a constant are products by its reciprocal
    and 1/step is 2^(−e/8), not a division: each can move a value by an ulp, so a range that close to a
    boundary of the scale or zero code may take the neighbouring code (quant.quantize divides)."""
    mid = (hi + lo) * 0.5
    half = (hi - lo) * 0.5 * clip
    code = _scale_code(half * (2.0 / 3.0), False, F32)
    inv = tl.exp2((128.0 - code) * 0.125)
    zero = _round(4.0 * (mid * inv - 1.5))
    overflow = (zero < -128.0) | (zero > 127.0)
    lowest = tl.abs(mid - 1.5 * tl.exp2((code - 128.0) * 0.125))
    wide = _scale_code(lowest * (4.0 / 127.0), True, F32)
    code = tl.where(overflow, tl.maximum(code, wide), code)
    inv = tl.exp2((128.0 - code) * 0.125)
    zero = tl.where(overflow, _round(4.0 * (mid * inv - 1.5)), zero)
    zero = tl.minimum(tl.maximum(zero, -128.0), 127.0)
    return code, inv, zero


@triton.jit
def _codes(y, a, b, F32: tl.constexpr):
    """round(clamp(y·a + b, 0, 3)) (= clamp(round(·), 0, 3), ties to even) in the low two bits of an int32
    whose bits above them are those of ROUND_MAGIC: the clamped value plus ROUND_MAGIC holds the rounded
    integer in its low mantissa bits, read without a float-to-int conversion. ROUND_MAGIC's low 22 bits are
    zero, so the low byte of Σ_i codes_i << 2i is the packed byte with no mask. On the GPU the clamp is the
    saturation of one fma, u = sat(y·a/3 + b/3) in [0, 1], and 3u + ROUND_MAGIC one more (the /3 and ·3 move
    a value by a few ulps, as the reciprocal does)."""
    if F32:
        v = tl.minimum(tl.maximum(y * a + b, 0.0), 3.0) + ROUND_MAGIC
    else:
        u = tl.inline_asm_elementwise("fma.rn.sat.f32 $0, $1, $2, $3;", "=r,r,r,r", [y, a / 3.0, b / 3.0],
                                      dtype=tl.float32, is_pure=True, pack=1)
        v = u * 3.0 + ROUND_MAGIC
    return v.to(tl.int32, bitcast=True)


@triton.jit
def _quantize(y, clip, BT: tl.constexpr, D: tl.constexpr, G: tl.constexpr, F32: tl.constexpr,
              HALVES: tl.constexpr = False):
    """quant.quantize + pack_int2 of y [BT, D] float32: (bytes uint8 [BT, D/4], scale codes uint8
    [BT, D/G], zero codes int8 [BT, D/G]); HALVES: the bytes two at a time, int16 [BT, D/8] (byte 2h low).
    y/step is taken as y·(1/step), which can differ from the division in the last bit, so a value that
    close to a rounding boundary may take the other code."""
    NG: tl.constexpr = D // G
    PER: tl.constexpr = 8 if HALVES else 4
    yg = tl.reshape(y, [BT, NG, G])
    code, inv, zero = _group_params(tl.min(yg, axis=2), tl.max(yg, axis=2), clip, F32)
    q = tl.reshape(_codes(yg, inv[:, :, None], -(zero * 0.25)[:, :, None], F32), [BT, D // PER, PER])
    packed = tl.sum(q << (tl.arange(0, PER) * 2)[None, None, :], axis=2)
    return packed.to(tl.int16 if HALVES else tl.uint8), code.to(tl.uint8), zero.to(tl.int8)


@triton.jit
def _tile_slot(m):
    """kvstore.tile_slot: the 16-bit slot of tile row m (0-63) within each half's 64 slots of a value tile."""
    return 16 * (m // 16) + 2 * (m % 8) + (m % 16) // 8


@triton.jit
def code_offsets(row, c0, D: tl.constexpr, C: tl.constexpr, TILED: tl.constexpr):
    """Where the codes of channels [c0, c0 + C) of rows `row` [BT] (b·H_kv·T + h·T + r) go in a store's code
    tensor: byte j of row r at byte r·D/4 + j ([BT, C/4], j from c0/4); with TILED (value codes, value_layout
    "tiles") half h of row r at 16-bit slot (r div 64)·8D + 64h + tile_slot(r mod 64) ([BT, C/8], h from c0/8)."""
    if TILED:
        off = ((row // 64) * (8 * D) + _tile_slot(row % 64))[:, None] + 64 * (c0 // 8 + tl.arange(0, C // 8))[None, :]
    else:
        off = (row * (D // 4))[:, None] + (c0 // 4 + tl.arange(0, C // 4))[None, :]
    return off


@triton.jit
def _store_int2(codes_ptr, scale_ptr, zero_ptr, code_off, base_m, y, clip, mask,
                BT: tl.constexpr, D: tl.constexpr, G: tl.constexpr, F32: tl.constexpr, TILED: tl.constexpr = False):
    """Quantize y [BT, D] and store row i's codes at codes_ptr + code_off[i] (code_offsets: bytes, or with
    TILED 16-bit halves), scale/zero + base_m[i] (+ group)."""
    packed, code, zero = _quantize(y, clip, BT, D, G, F32, TILED)
    g = tl.arange(0, D // G)
    tl.store(codes_ptr.to(tl.pointer_type(packed.dtype)) + code_off, packed, mask=mask[:, None])
    tl.store(scale_ptr + base_m[:, None] + g[None, :], code, mask=mask[:, None])
    tl.store(zero_ptr + base_m[:, None] + g[None, :], zero, mask=mask[:, None])


@triton.jit
def _write_kernel(x_ptr, rhi_ptr, rlo_ptr, mr_ptr, clip_ptr, codes_ptr, scale_ptr, zero_ptr, tokens, n_tiles,
                  sx_t, sx_h, sc_t, sc_h, ss_t, ss_h, sz_t, sz_h,
                  D: tl.constexpr, C: tl.constexpr, G: tl.constexpr, BLOCK_T: tl.constexpr, HAS_MEAN: tl.constexpr,
                  AHEAD: tl.constexpr, F32: tl.constexpr):
    """Program (p, h, k) quantizes channels [kC, kC + C) of tiles p, p + P, ... of BLOCK_T tokens of head h, its
    columns of R loaded once; with AHEAD the next tile's load is issued before this tile's work."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    c0 = 0
    if D > C:
        c0 = tl.program_id(2) * C
    c = tl.arange(0, D)
    rot = h * D * D + c[:, None] * D + c0 + tl.arange(0, C)[None, :]
    r_hi = tl.load(rhi_ptr + rot)
    r_lo = tl.load(rlo_ptr + rot)
    clip = tl.load(clip_ptr + h)
    start = _start(mr_ptr, h, c0, BLOCK_T, D, C, HAS_MEAN)
    i = tl.arange(0, BLOCK_T)
    if AHEAD:
        x = _token_tile(x_ptr, pid, tokens, sx_t, sx_h, h, D, BLOCK_T)
    for tile in range(pid, n_tiles, tl.num_programs(0)):
        if AHEAD:
            x_next = _token_tile(x_ptr, tile + tl.num_programs(0), tokens, sx_t, sx_h, h, D, BLOCK_T)
        else:
            x = _token_tile(x_ptr, tile, tokens, sx_t, sx_h, h, D, BLOCK_T)
        # 64-bit offsets once a tile (scalars), 32-bit ones inside it.
        t0 = tile * BLOCK_T
        t64 = t0.to(tl.int64)
        y = _rotate(x, r_hi, r_lo, start, F32)
        _store_int2(codes_ptr + (t64 * sc_t + h * sc_h + c0 // 4), scale_ptr + (t64 * ss_t + h * ss_h + c0 // G),
                    zero_ptr + (t64 * ss_t + h * ss_h + c0 // G), (i * sc_t)[:, None] + tl.arange(0, C // 4)[None, :],
                    i * ss_t, y, clip, t0 + i < tokens, BLOCK_T, C, G, F32)
        if AHEAD:
            x = x_next


@triton.jit
def _token_tile(x_ptr, tile, tokens, sx_t, sx_h, h, D: tl.constexpr, BT: tl.constexpr):
    """x [BT, D] of head h, tokens tile·BT + i; those past `tokens` zeros (and not read)."""
    i = tl.arange(0, BT)
    base = tl.cast(tile, tl.int64) * BT * sx_t + h * sx_h
    return tl.load(x_ptr + base + (i[:, None] * sx_t + tl.arange(0, D)[None, :]),
                   mask=(tile * BT + i < tokens)[:, None], other=0.0)


@triton.jit
def _page_rows(bt_ptr, b, pos, mask, page_stride, max_pages, h, c0, D: tl.constexpr, C: tl.constexpr,
               G: tl.constexpr, TILED: tl.constexpr, PAGE: tl.constexpr):
    """Where positions pos [BT] of sequences b [BT] (INT2 tokens: S ≤ pos) go in a paged store (paged.PagedKVCache):
    row pos mod PAGE of head h in page bt_ptr[b, pos div PAGE], each array page_stride bytes a page. Returns
    code_offsets' offsets of channels [c0, c0 + C) (16-bit halves with TILED) and each row's scale / zero offset."""
    page = tl.load(bt_ptr + b.to(tl.int64) * max_pages + pos // PAGE, mask=mask, other=0).to(tl.int64) * page_stride
    row = h * PAGE + pos % PAGE
    if TILED:
        code_off = (page // 2)[:, None] + code_offsets(row, c0, D, C, True)
    else:
        code_off = page[:, None] + code_offsets(row, c0, D, C, False)
    return code_off, page + row * (D // G)


@triton.jit
def _append_side(x_ptr, sx_b, sx_h, sx_t, rhi_ptr, rlo_ptr, mr_ptr, clip_ptr,
                 sink_ptr, ring_ptr, codes_ptr, scale_ptr, zero_ptr, len_ptr, start_ptr,
                 tile, h, c0, rows, n, t0, piece, T, bt_ptr, ws_ptr, page_stride, max_pages,
                 H: tl.constexpr, D: tl.constexpr, C: tl.constexpr, G: tl.constexpr, S: tl.constexpr, W: tl.constexpr,
                 BT: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_START: tl.constexpr, EVICT: tl.constexpr,
                 DIRECT: tl.constexpr, F32: tl.constexpr, R: tl.constexpr, TILED: tl.constexpr, RING: tl.constexpr,
                 PAGED: tl.constexpr, PAGE: tl.constexpr):
    """One side (keys or values), rows [tile·BT, (tile+1)·BT) of the launch, KV head h, its channels [c0, c0 + C)
    (module docstring); R ring slots (W, or W + G for keys per channel); TILED: codes in 64-row tiles
    (code_offsets); RING: a window's store (INT2 token i in row i mod T; tokens before the last N = W + T skipped);
    PAGED: a paged store (_page_rows; the sequence's BF16 tokens in its window slot ws_ptr[b])."""
    NG: tl.constexpr = D // G
    c = tl.arange(0, D)
    cc = c0 + tl.arange(0, C)
    r = tile * BT + tl.arange(0, BT)
    rmask = r < rows
    b = r // piece
    t = t0 + r % piece
    length = tl.load(len_ptr + b, mask=rmask, other=0)
    if HAS_START:
        first = tl.load(start_ptr + b, mask=rmask, other=0)
    else:
        first = tl.zeros([BT], tl.int32)
    valid = rmask & (t >= first)
    pos = length - n + t
    bh = (b * H + h).to(tl.int64)
    wh = bh
    if PAGED:
        wh = (tl.load(ws_ptr + b, mask=rmask, other=0) * H + h).to(tl.int64)
    x = tl.load(x_ptr + b.to(tl.int64)[:, None] * sx_b + h * sx_h + t.to(tl.int64)[:, None] * sx_t + c[None, :],
                mask=valid[:, None], other=0.0)
    rot = h * D * D + c[:, None] * D + cc[None, :]
    y = _rotate(x, tl.load(rhi_ptr + rot), tl.load(rlo_ptr + rot), _start(mr_ptr, h, c0, BT, D, C, HAS_MEAN), F32)
    clip = tl.load(clip_ptr + h)
    slot = (pos - S) % R
    ring = ring_ptr + (wh * R + slot)[:, None] * D + cc[None, :]
    if EVICT:
        gone = pos - W
        evict = valid & (gone >= S) & (gone < length - n + first)
        if RING:
            evict = evict & (gone >= length - W - T)
            row = bh * T + (gone - S) % T
        else:
            row = bh * T + gone - S
        kept = tl.load(ring, mask=evict[:, None], other=0.0).to(tl.float32)
        if PAGED:
            code_off, meta = _page_rows(bt_ptr, b, gone, evict, page_stride, max_pages, h, c0, D, C, G, TILED, PAGE)
            _store_int2(codes_ptr, scale_ptr + c0 // G, zero_ptr + c0 // G, code_off, meta, kept, clip, evict, BT, C,
                        G, F32, TILED)
        else:
            _store_int2(codes_ptr, scale_ptr + c0 // G, zero_ptr + c0 // G, code_offsets(row, c0, D, C, TILED),
                        row * NG, kept, clip, evict, BT, C, G, F32, TILED)
        tl.debug_barrier()   # every read of a ring slot before any write to it
    in_sink = valid & (pos < S)
    in_ring = valid & (pos >= S) & (pos >= length - W)
    yb = y.to(tl.bfloat16)
    tl.store(sink_ptr + (wh * S + pos)[:, None] * D + cc[None, :], yb, mask=in_sink[:, None])
    tl.store(ring, yb, mask=in_ring[:, None])
    if DIRECT:
        direct = valid & (pos >= S) & (pos < length - W)
        if RING:
            direct = direct & (pos >= length - W - T)
            row = bh * T + (pos - S) % T
        else:
            row = bh * T + pos - S
        if PAGED:
            code_off, meta = _page_rows(bt_ptr, b, pos, direct, page_stride, max_pages, h, c0, D, C, G, TILED, PAGE)
            _store_int2(codes_ptr, scale_ptr + c0 // G, zero_ptr + c0 // G, code_off, meta, y, clip, direct, BT, C, G,
                        F32, TILED)
        else:
            _store_int2(codes_ptr, scale_ptr + c0 // G, zero_ptr + c0 // G, code_offsets(row, c0, D, C, TILED),
                        row * NG, y, clip, direct, BT, C, G, F32, TILED)


@triton.jit
def _append_kernel(kx_ptr, ksx_b, ksx_h, ksx_t, vx_ptr, vsx_b, vsx_h, vsx_t,
                   krhi_ptr, krlo_ptr, kmr_ptr, kclip_ptr, vrhi_ptr, vrlo_ptr, vmr_ptr, vclip_ptr,
                   ksink_ptr, kring_ptr, kcodes_ptr, kscale_ptr, kzero_ptr,
                   vsink_ptr, vring_ptr, vcodes_ptr, vscale_ptr, vzero_ptr,
                   len_ptr, start_ptr, rows, n, t0, piece, T, n_tiles, bt_ptr, ws_ptr, page_stride, max_pages,
                   H: tl.constexpr, D: tl.constexpr, C: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
                   S: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, K_MEAN: tl.constexpr, V_MEAN: tl.constexpr,
                   HAS_START: tl.constexpr, EVICT: tl.constexpr, DIRECT: tl.constexpr,
                   F32: tl.constexpr, R: tl.constexpr, VT: tl.constexpr, RING: tl.constexpr, PAGED: tl.constexpr,
                   PAGE: tl.constexpr):
    """Grid (P, H_kv, 2·D/C): program (p, h, side·D/C + k) appends channels [kC, kC + C) of row tiles p, p + P, ...
    of one side; VT: value codes in 64-row tiles; PAGED: into a paged store (block table rows bt_ptr[b, :max_pages],
    window slots ws_ptr[b])."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    side = tl.program_id(2) // (D // C)
    c0 = tl.program_id(2) % (D // C) * C
    for tile in range(pid, n_tiles, tl.num_programs(0)):
        if side == 0:
            _append_side(kx_ptr, ksx_b, ksx_h, ksx_t, krhi_ptr, krlo_ptr, kmr_ptr, kclip_ptr,
                         ksink_ptr, kring_ptr, kcodes_ptr, kscale_ptr, kzero_ptr, len_ptr, start_ptr,
                         tile, h, c0, rows, n, t0, piece, T, bt_ptr, ws_ptr, page_stride, max_pages,
                         H, D, C, GK, S, W, BT, K_MEAN, HAS_START, EVICT, DIRECT, F32, R, False, RING, PAGED, PAGE)
        else:
            _append_side(vx_ptr, vsx_b, vsx_h, vsx_t, vrhi_ptr, vrlo_ptr, vmr_ptr, vclip_ptr,
                         vsink_ptr, vring_ptr, vcodes_ptr, vscale_ptr, vzero_ptr, len_ptr, start_ptr,
                         tile, h, c0, rows, n, t0, piece, T, bt_ptr, ws_ptr, page_stride, max_pages,
                         H, D, C, GV, S, W, BT, V_MEAN, HAS_START, EVICT, DIRECT, F32, R, VT, RING, PAGED, PAGE)


@triton.jit
def _int2_tile(xb, k, S, first, int2_end, sx_t, D: tl.constexpr, BT: tl.constexpr):
    """x [BT, D] of INT2 tile k: positions S + k·BT + i, rows past int2_end zeros (and not read)."""
    i = tl.arange(0, BT)
    # 64-bit offsets once a tile (scalars), 32-bit ones inside it.
    return tl.load(xb + (S + k * BT + first).to(tl.int64) * sx_t + (i[:, None] * sx_t + tl.arange(0, D)[None, :]),
                   mask=(S + k * BT + i < int2_end)[:, None], other=0.0)


@triton.jit
def _prefill_side(x_ptr, sx_b, sx_h, sx_t, rhi_ptr, rlo_ptr, mr_ptr, clip_ptr, sink_ptr, ring_ptr,
                  codes_ptr, scale_ptr, zero_ptr, len_ptr, b, h, c0, n, T, bt_row, wslot, page_stride,
                  H: tl.constexpr, D: tl.constexpr, C: tl.constexpr, G: tl.constexpr, S: tl.constexpr,
                  W: tl.constexpr, R: tl.constexpr, TB: tl.constexpr, BT: tl.constexpr, COLUMNS: tl.constexpr,
                  HAS_MEAN: tl.constexpr, AHEAD: tl.constexpr, F32: tl.constexpr, TILED: tl.constexpr,
                  RING: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr):
    """One side of sequence b, KV head h, its channels [c0, c0 + C): program p takes INT2 tiles p, p + P, ... of
    BT positions, then BF16 tiles (sink, ring) p, p + P, ...: two loops without branches (prefill_kv). RING: a
    window's store, whose INT2 tiles start at the first of its last T tokens (row i mod T). PAGED: a paged store,
    a tile (a key block) in one page, bt_row[its first position div PAGE] (BT and TB divide PAGE), at its row of
    the page's [H_kv, PAGE] rows; the BF16 tokens in window slot wslot."""
    NG: tl.constexpr = D // G
    J0: tl.constexpr = (S + BT - 1) // BT
    c = tl.arange(0, D)
    cc = c0 + tl.arange(0, C)
    i = tl.arange(0, BT)
    clip = tl.load(clip_ptr + h)
    length = tl.load(len_ptr + b)
    first = n - length                                              # leading pads: the store was empty
    int2_end = S + tl.maximum(length - S - W, 0) // TB * TB        # positions before it are INT2 (or sink)
    bh = (b * H + h).to(tl.int64)
    wh = (wslot * H + h).to(tl.int64)                               # the BF16 windows' (slot, head)
    xb = x_ptr + (b.to(tl.int64) * sx_b + h * sx_h)
    n_int2 = int2_end - S
    if COLUMNS:
        # Key blocks transposed, [C, BT] with rows in _byte_order: the factors as Rᵀ, rows reordered.
        order = c0 + _byte_order(C)
        rot = h * D * D + c[None, :] * D + order[:, None]
        if HAS_MEAN:
            start = tl.broadcast_to(-tl.load(mr_ptr + h * D + order)[:, None], [C, BT])
        else:
            start = tl.zeros([C, BT], tl.float32)
    else:
        rot = h * D * D + c[:, None] * D + cc[None, :]
        start = _start(mr_ptr, h, c0, BT, D, C, HAS_MEAN)
    r_hi = tl.load(rhi_ptr + rot)
    r_lo = tl.load(rlo_ptr + rot)
    # INT2 tiles: positions S + k·BT + i below int2_end (the last tile may end in the ring: masked). With
    # AHEAD the next tile's load is issued before this tile's work (its registers in flight meanwhile).
    if COLUMNS:
        # Key blocks of TB = HALVES·BT tokens, BT at a time: a channel's range over the block's tiles, then each
        # tile quantized with it (HALVES = 2: the tiles' rotations both held).
        HALVES: tl.constexpr = TB // BT
        kb0 = 0
        if RING:
            kb0 = tl.maximum(n_int2 - T, 0) // TB
        if AHEAD:
            x = _int2_tile(xb, HALVES * (kb0 + tl.program_id(0)), S, first, int2_end, sx_t, D, BT)
        for kb in range(kb0 + tl.program_id(0), n_int2 // TB, tl.num_programs(0)):
            if AHEAD:
                x_next = _int2_tile(xb, HALVES * (kb + tl.num_programs(0)), S, first, int2_end, sx_t, D, BT)
            else:
                x = _int2_tile(xb, HALVES * kb, S, first, int2_end, sx_t, D, BT)
            y = _rotate(x, r_hi, r_lo, start, F32, True)
            lo = tl.min(y, axis=1)
            hi = tl.max(y, axis=1)
            if HALVES == 2:
                x1 = _int2_tile(xb, 2 * kb + 1, S, first, int2_end, sx_t, D, BT)
                y1 = _rotate(x1, r_hi, r_lo, start, F32, True)
                lo = tl.minimum(lo, tl.min(y1, axis=1))
                hi = tl.maximum(hi, tl.max(y1, axis=1))
            code, inv, zero = _group_params(lo, hi, clip, F32)
            kr = kb
            if RING:
                kr = kb % (T // TB)
            if PAGED:
                p0 = S + kb * TB
                page = tl.load(bt_row + p0 // PAGE).to(tl.int64) * page_stride
                crow = page + (h * PAGE + p0 % PAGE) * (D // 4)
            else:
                crow = (bh * T + kr * TB) * (D // 4)
            cp = codes_ptr + crow + c0 // 4 + (i[None, :] * (D // 4) + tl.arange(0, C // 4)[:, None])
            tl.store(cp, _pack_columns(y, inv, zero, BT, C, F32))
            if HALVES == 2:
                tl.store(cp + BT * (D // 4), _pack_columns(y1, inv, zero, BT, C, F32))
            if PAGED:
                mrow = page + (h * (PAGE // TB) + (p0 % PAGE) // TB) * D
            else:
                mrow = (bh * (T // TB) + kr) * D
            tl.store(scale_ptr + mrow + order, code.to(tl.uint8))
            tl.store(zero_ptr + mrow + order, zero.to(tl.int8))
            if AHEAD:
                x = x_next
    else:
        k0 = 0
        if RING:
            k0 = tl.maximum(n_int2 - T, 0) // BT
        if AHEAD:
            x = _int2_tile(xb, k0 + tl.program_id(0), S, first, int2_end, sx_t, D, BT)
        for k in range(k0 + tl.program_id(0), (n_int2 + BT - 1) // BT, tl.num_programs(0)):
            in_int2 = S + k * BT + i < int2_end
            if AHEAD:
                x_next = _int2_tile(xb, k + tl.num_programs(0), S, first, int2_end, sx_t, D, BT)
            else:
                x = _int2_tile(xb, k, S, first, int2_end, sx_t, D, BT)
            y = _rotate(x, r_hi, r_lo, start, F32)
            cb, sb, zb = codes_ptr, scale_ptr, zero_ptr
            if RING:
                in_int2 = in_int2 & (k * BT + i >= n_int2 - T)
                row0 = bh * T + (k * BT) % tl.maximum(T, 1)     # T = 0, a window kept in BF16: all masked
            elif PAGED:
                p0 = S + k * BT
                page = tl.load(bt_row + p0 // PAGE).to(tl.int64) * page_stride
                cb, sb, zb = codes_ptr + page, scale_ptr + page, zero_ptr + page
                row0 = h * PAGE + p0 % PAGE
            else:
                row0 = bh * T + k * BT
            # 64-bit offsets to the tile's first row (tiled codes: to the 64-row tile that holds it), 32-bit ones
            # from there.
            if TILED:
                base, local = (row0 // 64) * (16 * D), (row0 % 64).to(tl.int32) + i
            else:
                base, local = row0 * (D // 4), i
            _store_int2(cb + base, sb + row0 * NG + c0 // G, zb + row0 * NG + c0 // G,
                        code_offsets(local, c0, D, C, TILED), i * NG, y, clip, in_int2, BT, C, G, F32, TILED)
            if AHEAD:
                x = x_next
    # The BF16 tiles in channel order.
    rot = h * D * D + c[:, None] * D + cc[None, :]
    r_hi = tl.load(rhi_ptr + rot)
    r_lo = tl.load(rlo_ptr + rot)
    # BF16 tiles: the sink's J0, then the ring's, from the tile that holds position int2_end on.
    ring0 = n_int2 // BT
    n_bf16 = J0 + (tl.maximum(length - S, 0) + BT - 1) // BT - ring0
    for j in range(tl.program_id(0), n_bf16, tl.num_programs(0)):
        p0 = tl.where(j < J0, j * BT, S + (ring0 + j - J0) * BT)      # the tile's first position
        pos = p0 + i
        valid = (pos < length) & ((j >= J0) | (pos < S))
        x = tl.load(xb + (p0 + first).to(tl.int64) * sx_t + (i[:, None] * sx_t + c[None, :]), mask=valid[:, None],
                    other=0.0)
        yb = _rotate(x, r_hi, r_lo, _start(mr_ptr, h, c0, BT, D, C, HAS_MEAN), F32).to(tl.bfloat16)
        tl.store(sink_ptr + wh * S * D + (pos[:, None] * D + cc[None, :]), yb, mask=(valid & (pos < S))[:, None])
        tl.store(ring_ptr + wh * R * D + (((pos - S) % R)[:, None] * D + cc[None, :]), yb,
                 mask=(valid & (pos >= int2_end))[:, None])


@triton.jit
def _prefill_kernel(kx_ptr, ksx_b, ksx_h, ksx_t, vx_ptr, vsx_b, vsx_h, vsx_t,
                    krhi_ptr, krlo_ptr, kmr_ptr, kclip_ptr, vrhi_ptr, vrlo_ptr, vmr_ptr, vclip_ptr,
                    ksink_ptr, kring_ptr, kcodes_ptr, kscale_ptr, kzero_ptr,
                    vsink_ptr, vring_ptr, vcodes_ptr, vscale_ptr, vzero_ptr,
                    len_ptr, n, T, bt_ptr, ws_ptr, page_stride, max_pages,
                    H: tl.constexpr, D: tl.constexpr, C: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
                    S: tl.constexpr, W: tl.constexpr, R: tl.constexpr, TB: tl.constexpr, BT: tl.constexpr,
                    K_MEAN: tl.constexpr, V_MEAN: tl.constexpr, AHEAD: tl.constexpr, F32: tl.constexpr,
                    VT: tl.constexpr, RING: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr):
    """Grid (P, B·H_kv, 2·D/C): program (p, b·H + h, side·D/C + k) writes channels [kC, kC + C) of tiles p, p + P,
    ... of one side of sequence b; VT: value codes in 64-row tiles; PAGED: into a paged store (block table rows
    bt_ptr[b, :max_pages], window slots ws_ptr[b])."""
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    c0 = tl.program_id(2) % (D // C) * C
    bt_row = bt_ptr
    wslot = b
    if PAGED:
        bt_row = bt_ptr + b.to(tl.int64) * max_pages
        wslot = tl.load(ws_ptr + b)
    if tl.program_id(2) < D // C:
        _prefill_side(kx_ptr, ksx_b, ksx_h, ksx_t, krhi_ptr, krlo_ptr, kmr_ptr, kclip_ptr, ksink_ptr, kring_ptr,
                      kcodes_ptr, kscale_ptr, kzero_ptr, len_ptr, b, h, c0, n, T, bt_row, wslot, page_stride,
                      H, D, C, GK, S, W, R, TB, BT, TB > 1, K_MEAN, AHEAD, F32, False, RING, PAGED, PAGE)
    else:
        _prefill_side(vx_ptr, vsx_b, vsx_h, vsx_t, vrhi_ptr, vrlo_ptr, vmr_ptr, vclip_ptr, vsink_ptr, vring_ptr,
                      vcodes_ptr, vscale_ptr, vzero_ptr, len_ptr, b, h, c0, n, T, bt_row, wslot, page_stride,
                      H, D, C, GV, S, W, R, TB, BT, False, V_MEAN, AHEAD, F32, VT, RING, PAGED, PAGE)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def columns(head_dim: int, groups: tuple = (), want: int | None = None) -> int:
    """Channels C a write program rotates and quantizes (want, or by default the whole head up to 128, else 128: two
    programs a head at head_dim 256). A program holds its columns of R as two bf16 [d, C] tiles in shared memory:
    64 KiB at d = C = 128; the whole R at head_dim 256 would take 256 KiB, over the H100's 227. Raises ValueError
    where C does not divide the head or a group of channels (groups: those of the sides quantized per token) would
    span two programs."""
    c = want or min(head_dim, 128)
    if head_dim % c or c < 16 or c & (c - 1):
        raise ValueError(f"a write program takes a power-of-two share of head_dim {head_dim} channels, not {c}")
    if any(g > c for g in groups):
        raise ValueError(f"the write kernels quantize groups of up to {c} channels a program at head_dim {head_dim}, "
                         f"not {max(groups)}")
    return c


def prepare_rotation(rotation: torch.Tensor, mean: torch.Tensor | None = None):
    """(R_hi, R_lo, μ·R): R [H, d, d] split into two bf16 parts, and the rotated mean float32 [H, d] (or None)."""
    rot = rotation.float()
    r_hi = rot.to(torch.bfloat16)
    r_lo = (rot - r_hi.float()).to(torch.bfloat16)
    mr = None if mean is None else torch.einsum("hd,hde->he", mean.float(), rot).contiguous()
    return r_hi.contiguous(), r_lo.contiguous(), mr


def write_int2(x: torch.Tensor, rotation: torch.Tensor, clip: torch.Tensor, group_size: int = 64,
               mean: torch.Tensor | None = None, out=None, block_t: int = 128, waves: int = 2):
    """Triton kvstore.write_int2: x [tokens, H_kv, d] -> (codes uint8 [tokens, H_kv, d/4],
    scale codes uint8 [tokens, H_kv, d/G], zero codes int8 [tokens, H_kv, d/G]).

    `out`, if given, is a triple of such tensors (views with any token/head strides, unit channel
    stride) written in place, e.g. slices of an Int2KVCache transposed to [tokens, H_kv, ...].
    Splits the rotation on every call (prepare_rotation); write_int2_prepared takes the split once."""
    return write_int2_prepared(x, prepare_rotation(rotation, mean), clip, group_size, out, block_t, waves)


def write_int2_prepared(x: torch.Tensor, split, clip: torch.Tensor, group_size: int = 64, out=None,
                        block_t: int = 64, waves: int = 4, num_stages: int = 1, ahead: bool = True,
                        registers: int | None = None, columns_a_program: int | None = None):
    """write_int2 with the rotation already split: split = prepare_rotation(rotation, mean). Tiles of block_t
    tokens of one head a program, `waves` programs a multiprocessor, num_stages tiles of x in flight, `ahead`:
    each tile's load issued a tile early, `registers`: the cap a thread (None: ptxas's choice). The defaults are
    the fastest of bench/write.py's sweep on the H100: 4-warp programs of 64 tokens loading a tile ahead at
    ptxas's registers, four a multiprocessor (1.65 TB/s, against 1.49 for 8-warp ones of 128 tokens held to
    128 registers); at head_dim 256 two programs a head, 128 channels each (`columns_a_program`, columns): 0.88
    TB/s (bench/results/write_d256.md)."""
    tokens, heads, d = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    if out is None:
        out = (torch.empty(tokens, heads, d // 4, dtype=torch.uint8, device=x.device),
               torch.empty(tokens, heads, d // group_size, dtype=torch.uint8, device=x.device),
               torch.empty(tokens, heads, d // group_size, dtype=torch.int8, device=x.device))
    codes, scale, zero = out
    r_hi, r_lo, mr = split
    c = columns(d, (group_size,), columns_a_program)
    n_tiles = triton.cdiv(tokens, block_t)
    programs = max(1, min(n_tiles, -(-waves * _num_sms(x.device) // (heads * (d // c)))))
    _write_kernel[(programs, heads, d // c)](
        x, r_hi, r_lo, r_hi if mr is None else mr, clip.float().contiguous(), codes, scale, zero, tokens, n_tiles,
        x.stride(0), x.stride(1), codes.stride(0), codes.stride(1), scale.stride(0), scale.stride(1),
        zero.stride(0), zero.stride(1), D=d, C=c, G=group_size, BLOCK_T=block_t, HAS_MEAN=mr is not None, AHEAD=ahead,
        F32=not x.is_cuda, num_warps=4 if block_t <= 64 else 8,
        num_stages=num_stages, **({"maxnreg": registers} if x.is_cuda and registers else {}))
    return codes, scale, zero


def page_args(cache) -> tuple:
    """The write programs' block table, window slots, page stride (bytes) and block table width of a paged store
    (paged.PagedKVCache), or for any other store placeholders the programs never read; then their PAGED and PAGE."""
    if isinstance(cache, PagedKVCache):
        args = (cache.block_table, cache.window_slot, cache.page_stride, cache.block_table.shape[1])
        return args, dict(PAGED=True, PAGE=cache.page_tokens)
    return (cache.lengths, cache.lengths, 0, 0), dict(PAGED=False, PAGE=1)


def _channel_groups(cache) -> tuple:
    """The group sizes a store quantizes along channels: values', and keys' where they are per token."""
    return (cache.value_group_size,) + ((cache.key_group_size,) if cache.key_axis == "token" else ())


def append_kv(cache, keys: torch.Tensor, values: torch.Tensor, key_rot, value_rot, key_clip: torch.Tensor,
              value_clip: torch.Tensor, starts: torch.Tensor | None = None, evict: bool = True,
              block_t: int | None = None, waves: int = 4) -> None:
    """Triton kvstore.append: keys/values [B, H_kv, n, d] (any strides with unit channel stride, the
    layout attention layers produce) into the Int2KVCache `cache`, whose lengths already count them; or into a
    paged.PagedKVCache (paged.append's placement: INT2 rows in the pages of the block tables, which hold them).

    key_rot / value_rot: prepare_rotation's triples; clips float32 [H_kv]; starts int32 [B] (leading
    pads) or None; evict=False promises an empty store before this append (a prefill: no ring reads).
    Keys per channel: n ≤ W and evict=False, after leave_blocks (module docstring)."""
    bsz, heads, n, d = keys.shape
    if cache.key_axis == "channel" and (evict or n > cache.recent_tokens):
        raise ValueError("append_kv writes keys per channel only after leave_blocks: evict=False, n ≤ W")
    s, w = cache.sink_tokens, cache.recent_tokens
    c = columns(d, _channel_groups(cache))
    rows_cap = cache.key_codes.shape[2]
    evict = evict and rows_cap > 0      # a window kept in BF16 (no INT2 rows): its old tokens are just overwritten
    piece = w if evict and n > w else n
    pages, page_consts = page_args(cache)
    bt = block_t or (16 if bsz * piece <= 16 else 64)
    for t0 in range(0, n, piece):
        p = min(piece, n - t0)
        rows = bsz * p
        n_tiles = triton.cdiv(rows, bt)
        programs = max(1, min(n_tiles, -(-waves * _num_sms(keys.device) // (2 * heads * (d // c)))))
        (khi, klo, kmr), (vhi, vlo, vmr) = key_rot, value_rot
        cached(_append_kernel)(
            (programs, heads, 2 * (d // c)), keys, keys.stride(0), keys.stride(1), keys.stride(2),
            values, values.stride(0), values.stride(1), values.stride(2),
            khi, klo, khi if kmr is None else kmr, key_clip, vhi, vlo, vhi if vmr is None else vmr, value_clip,
            cache.key_sink, cache.key_recent, cache.key_codes, cache.key_scale, cache.key_zero,
            cache.value_sink, cache.value_recent, cache.value_codes, cache.value_scale, cache.value_zero,
            cache.lengths, cache.lengths if starts is None else starts, rows, n, t0, p, rows_cap, n_tiles, *pages,
            H=heads, D=d, C=c, GK=cache.key_group_size, GV=cache.value_group_size, S=s, W=w, BT=bt,
            K_MEAN=kmr is not None, V_MEAN=vmr is not None, HAS_START=starts is not None, EVICT=evict,
            DIRECT=n > w and rows_cap > 0, F32=not keys.is_cuda, R=cache.ring_slots, VT=cache.value_tiles,
            RING=cache.window is not None, **page_consts, num_warps=4 if bt <= 64 else 8)


def prefill_kv(cache, keys: torch.Tensor, values: torch.Tensor, key_rot, value_rot, key_clip: torch.Tensor,
               value_clip: torch.Tensor, block_t: int = 64, waves: int | None = None, num_stages: int = 1,
               registers: int | None = 0, ahead: bool | None = None, columns_a_program: int | None = None) -> None:
    """Triton kvstore.append into an empty store (a prefill), keys per token or per channel: keys/values
    [B, H_kv, n, d] (any strides with unit channel stride), left-padded: sequence b's tokens are the last
    L_b = cache.lengths[b] of the n (the lengths already count them; leading pads are skipped). One launch
    for K and V, tiles of block_t positions (keys per channel: a key block a step, in tiles of half a block
    when it is longer than block_t), placed as kvstore.append would place them: INT2 tiles quantized (a key
    block's columns together), then the sink's and the ring's tiles in BF16, each in a loop of its own whose
    bounds come from the lengths on the device (branches inside one loop made triton 3.6's pipeliner fail).
    key_rot / value_rot: prepare_rotation's triples; clips float32 [H_kv]. registers: the cap on registers a
    thread (None: ptxas's choice); ahead: each INT2 tile's load issued a tile early, while the tile before it
    is quantized; columns_a_program: the channels a program writes (columns). Defaults (0 and None): the fastest
    of bench/write.py's sweep on the H100, 4-warp programs of 64 tokens loading ahead at ptxas's registers, four a
    multiprocessor; keys per channel in blocks of 128 run as two such tiles a block (1.73 TB/s, against 1.16 for
    8-warp programs of one whole block held to 128 registers); 8-warp tiles (block_t 128) are held to 128. At
    head_dim 256 (two programs a head, 128 channels each) eight a multiprocessor, and no load ahead where a key
    block spans two tiles (0.62-0.69 TB/s, against 0.03-0.04 for the torch reference; bench/results/write_d256.md).
    A paged.PagedKVCache: into the pages of its block tables (which hold them) and its window slots, in tiles that
    divide the page."""
    bsz, heads, n, d = keys.shape
    c = columns(d, _channel_groups(cache), columns_a_program)
    s, tb = cache.sink_tokens, cache.token_block
    if cache.window is not None and cache.key_codes.shape[2] % max(block_t, tb):
        raise ValueError("prefill_kv writes a window's store in tiles that divide its rows")
    bt = max(min(tb, block_t), tb // 2) if tb > 1 else block_t
    pages, page_consts = page_args(cache)
    if page_consts["PAGED"] and (page_consts["PAGE"] % bt or page_consts["PAGE"] % tb):
        raise ValueError(f"prefill_kv writes pages of {page_consts['PAGE']} tokens in tiles that divide them, not {bt}")
    registers = (128 if bt > 64 else None) if registers == 0 else registers
    if ahead is None:
        ahead = bt <= 64 and not (d > 128 and tb > bt)
    waves = waves or (8 if d > 128 else 4)
    held = n if cache.window is None else min(n, cache.window + bt)    # a window's store: its last N tokens
    n_tiles = triton.cdiv(s, bt) + triton.cdiv(max(held - s, 0), bt)
    programs = max(1, min(n_tiles, -(-waves * _num_sms(keys.device) // (2 * bsz * heads * (d // c)))))
    (khi, klo, kmr), (vhi, vlo, vmr) = key_rot, value_rot
    _prefill_kernel[(programs, bsz * heads, 2 * (d // c))](
        keys, keys.stride(0), keys.stride(1), keys.stride(2), values, values.stride(0), values.stride(1),
        values.stride(2), khi, klo, khi if kmr is None else kmr, key_clip, vhi, vlo, vhi if vmr is None else vmr,
        value_clip, cache.key_sink, cache.key_recent, cache.key_codes, cache.key_scale, cache.key_zero,
        cache.value_sink, cache.value_recent, cache.value_codes, cache.value_scale, cache.value_zero, cache.lengths,
        n, cache.key_codes.shape[2], *pages, H=heads, D=d, C=c, GK=cache.key_group_size, GV=cache.value_group_size, S=s,
        W=cache.recent_tokens, R=cache.ring_slots, TB=tb, BT=bt, K_MEAN=kmr is not None, V_MEAN=vmr is not None,
        AHEAD=ahead, F32=not keys.is_cuda, VT=cache.value_tiles, RING=cache.window is not None, **page_consts,
        num_warps=4 if bt <= 64 else 8,
        num_stages=num_stages, **({"maxnreg": registers} if keys.is_cuda and registers else {}))


@triton.jit
def _byte_order(D: tl.constexpr):
    """The channel that row m of a transposed key block [D, G] holds (_quantize_columns): with
    m = (D/2)·a + 16·w + 8·b + g (g < 8), channel 4·(8w + g) + 2a + b. The four channels of packed byte
    8w + g then lie in rows m, m + 8, m + D/2, m + D/2 + 8, which the tensor cores' accumulator gives to
    one thread: codes pack without crossing threads. Needs D ≥ 32 (cache.serving_problem)."""
    m = tl.arange(0, D)
    r = m % (D // 2)
    return 4 * (8 * (r // 16) + r % 8) + 2 * (m // (D // 2)) + (r // 8) % 2


@triton.jit
def _quantize_columns(yt, clip, BT: tl.constexpr, D: tl.constexpr, F32: tl.constexpr):
    """quant.quantize of a key block transposed, yt [D, BT] float32 with its rows in _byte_order (one group of
    BT tokens a channel), codes packed along the channels: (bytes uint8 [D/4, BT], byte j of token t at
    [j, t]; scale codes uint8 [D] and zero codes int8 [D], row m's at m). Rows are channels so that a
    channel's range is a reduction inside a thread and its quarter of threads, not across the block."""
    code, inv, zero = _group_params(tl.min(yt, axis=1), tl.max(yt, axis=1), clip, F32)
    return _pack_columns(yt, inv, zero, BT, D, F32), code.to(tl.uint8), zero.to(tl.int8)


@triton.jit
def _pack_columns(yt, inv, zero, BT: tl.constexpr, D: tl.constexpr, F32: tl.constexpr):
    """The codes of yt [D, BT] (rows in _byte_order) for its rows' 1/step and zero codes, packed along the
    channels: bytes uint8 [D/4, BT], byte j of token t at [j, t]."""
    q = tl.reshape(_codes(yt, inv[:, None], -(zero * 0.25)[:, None], F32), [2, D // 32, 2, 8, BT])
    shift = tl.arange(0, 2)[:, None, None, None, None] * 4 + tl.arange(0, 2)[None, None, :, None, None] * 2
    packed = tl.sum(tl.sum(q << shift, axis=2), axis=0)
    return tl.reshape(packed, [D // 4, BT]).to(tl.uint8)


@triton.jit
def _leave_kernel(kring_ptr, vring_ptr, kcodes_ptr, kscale_ptr, kzero_ptr, vcodes_ptr, vscale_ptr, vzero_ptr,
                  kclip_ptr, vclip_ptr, len_ptr, start_ptr, n, T, bt_ptr, ws_ptr, page_stride, max_pages,
                  H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, GV: tl.constexpr, S: tl.constexpr,
                  W: tl.constexpr, R: tl.constexpr, HAS_START: tl.constexpr, F32: tl.constexpr, VT: tl.constexpr,
                  RING: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr):
    """Program (k, b·H + h, side): the k-th block of sequence b that this append of n tokens pushes out of
    the window (lengths already count them), from its G ring slots into INT2; nothing if there is none. RING: a
    window's store, block j in row block j mod T/G, only the last T/G blocks written. PAGED: a paged store, the
    block in page bt_ptr[b, (S + jG) div PAGE] (G divides PAGE), its ring in window slot ws_ptr[b]."""
    k = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    length = tl.load(len_ptr + b)
    count = n
    if HAS_START:
        count = n - tl.load(start_ptr + b)
    first = tl.maximum(length - count - S - W, 0) // G
    last = tl.maximum(length - S - W, 0) // G
    blk = first + k
    kr = blk
    live = blk < last
    if RING:
        kr = blk % (T // G)
        live = live & (blk >= last - T // G)
    if live:
        t = tl.arange(0, G)
        c = tl.arange(0, D)
        bh64 = bh.to(tl.int64)
        if PAGED:
            p0 = S + blk * G
            page = tl.load(bt_ptr + b.to(tl.int64) * max_pages + p0 // PAGE).to(tl.int64) * page_stride
            slot = ((tl.load(ws_ptr + b) * H + h).to(tl.int64) * R + (blk * G + t) % R) * D
            row = h * PAGE + p0 % PAGE + t
        else:
            slot = (bh64 * R + (blk * G + t) % R) * D
            row = bh64 * T + kr * G + t
        if tl.program_id(2) == 0:
            order = _byte_order(D)
            yt = tl.load(kring_ptr + slot[None, :] + order[:, None]).to(tl.float32)
            packed, code, zero = _quantize_columns(yt, tl.load(kclip_ptr + h), G, D, F32)
            if PAGED:
                tl.store(kcodes_ptr + page + row[None, :] * (D // 4) + tl.arange(0, D // 4)[:, None], packed)
                meta = page + (h * (PAGE // G) + (p0 % PAGE) // G) * D + order
            else:
                tl.store(kcodes_ptr + row[None, :] * (D // 4) + tl.arange(0, D // 4)[:, None], packed)
                meta = (bh64 * (T // G) + kr) * D + order
            tl.store(kscale_ptr + meta, code)
            tl.store(kzero_ptr + meta, zero)
        else:
            y = tl.load(vring_ptr + slot[:, None] + c[None, :]).to(tl.float32)
            if PAGED:
                if VT:
                    code_off = page // 2 + code_offsets(row, 0, D, D, True)
                else:
                    code_off = page + code_offsets(row, 0, D, D, False)
                row_meta = page + row * (D // GV)
            else:
                code_off, row_meta = code_offsets(row, 0, D, D, VT), row * (D // GV)
            _store_int2(vcodes_ptr, vscale_ptr, vzero_ptr, code_off, row_meta, y,
                        tl.load(vclip_ptr + h), t < G, G, D, GV, F32, VT)


def leave_blocks(cache, key_clip: torch.Tensor, value_clip: torch.Tensor, n: int,
                 starts: torch.Tensor | None = None) -> None:
    """Keys per channel: quantize into INT2 the blocks that an append of n ≤ W tokens (starts: leading pads,
    as append_kv) pushes out of the window, from their ring slots; cache.lengths already count the append.
    One launch of ⌈n/G⌉ programs per (sequence, KV head, side); run it before append_kv. A paged.PagedKVCache: the
    blocks into the pages of its block tables, from the rings of its window slots."""
    bsz, (_, heads, _, d) = len(cache.lengths), cache.key_recent.shape
    g = cache.key_group_size
    pages, page_consts = page_args(cache)
    if cache.key_axis != "channel" or n > cache.recent_tokens:
        raise ValueError("leave_blocks moves the key blocks of a store with keys per channel, n ≤ W tokens at a time")
    cached(_leave_kernel)(
        (triton.cdiv(n, g), bsz * heads, 2), cache.key_recent, cache.value_recent, cache.key_codes, cache.key_scale,
        cache.key_zero, cache.value_codes, cache.value_scale, cache.value_zero, key_clip, value_clip, cache.lengths,
        cache.lengths if starts is None else starts, n, cache.key_codes.shape[2], *pages,
        H=heads, D=d, G=g, GV=cache.value_group_size, S=cache.sink_tokens, W=cache.recent_tokens,
        R=cache.ring_slots, HAS_START=starts is not None, F32=not cache.key_codes.is_cuda,
        VT=cache.value_tiles, RING=cache.window is not None, **page_consts,
        num_warps=4 if g * d <= 8192 else 8)
