"""Triton decode attention over an Int2KVCache: flash-decoding split over the context, then a merge.

Program (s, b·H_kv + h) of the split kernel attends the HG = H/H_kv query heads of KV head h
(stacked as the rows of the tensor-core products) over one slice of sequence b: splits s < NW take
BLOCK_W tokens each of the BF16 sink and recent windows (one tile per program), splits s ≥ NW share
the INT2 rows of sequence b in chunks of whole tiles sized by b's own length (so the grid never
depends on the data; decode_gluon's programs, where strided_tiles says, take as many tiles strided over
the splits, and where flat_splits says, an equal share of a line of every pair's rows, crossing from one pair into
the next). Each writes the unnormalized output, the running max m and the sum l of its slice; the
merge combines the slices with a running max, o = Σ_s 2^(m_s−M) acc_s / Σ_s 2^(m_s−M) l_s, and returns
to original space, o·R_V^T + μ_V. Scores are kept in base 2: x = scaling·log2(e)·q̃·k̃.
Default: three launches (_rotate_kernel for q̃ = q·R_K in bf16, _split_kernel, _reduce_kernel), four
where decode_gluon's programs take the INT2 rows and _split_kernel only the windows (inside a CUDA graph
the two run side by side). _reduce_kernel merges each block of columns of a block of query heads once
(reduce_heads), each program applies its columns' share of R_V^T, and the last program of a (sequence, KV head,
head block) sums the shares (an atomic counter it resets). fused: one launch, the query rotated inside every
program and the merge done by the last program of each (sequence, KV head) to finish (correct, measured slower:
bench/results/kernel_notes.md v7).

INT2 arithmetic. Byte j of a packed row holds channels 4j+i (i = 0..3). Each byte becomes four bf16
values u_i = m_i·code_i, m = (1, 4, 16, 16) (see _unpack: no integer-to-float conversion). With
x̂ = step·(code + z/4) per token and group g:
  keys:   q̃·k̂ = Σ_g step_g · (Σ_i Σ_{j∈g} (q̃_{4j+i}/m_i)·u_i[j] + z_g/4 · Σ_{c∈g} q̃_c)
  values: Σ_n p_n v̂_n[4j+i] = (Σ_n a_n u_i[n, j])/m_i + Σ_n a_n z_n/4,  a_n = p_n·step_g[n]
so the products run on raw codes and the scale and zero apply to the small score / output tiles.
Both value terms use the same bf16 weights a_n (the product's operand): with a float32 a_n in the
zero term, the two parts of a group's common offset no longer cancel, an error of up to 8e-2 of a
small (diffuse, centred) output.
The unpack leaves 128 in every code (u = 128 + m·code, _unpack_raw) for the keys and subtracts it in
bf16 for the values: the score accumulator starts each tile at −128·Σ_c (row's query operands), which
the products add back exactly (per tile, so no offset builds up over a chunk).
The groups of a head are stacked as extra rows (row = g·HGP + r): key rows carry the query restricted
to group g, value rows carry a = p·step_g; the rows of each group are summed (keys) or the columns
of group g picked (values) afterwards.

Keys per channel (a store with key_axis "channel", blocks of G tokens; here and in decode_gluon): every tile
lies inside one block (BLOCK_N ≤ G), whose step_c and z_c hold for all its tokens, so
  q̃·k̂_t = Σ_c (q̃_c·step_c)·code[t, c] + Σ_c q̃_c·step_c·z_c/4
the products run on the query scaled once a tile and the zero codes add one offset a row
(_channel_scores). The sink and ring programs read the ring of W + G slots from the first BF16 position
S + n_int2 on, n_int2 = ⌊(L − S − W)/G⌋·G.

A window's store (kvstore.window_cache: the sink, a ring of W BF16 slots and a ring of T INT2 rows) holds a
sequence's last N tokens past its sink, so it is read like any store, over its min(n_int2, T) rows in use (in row
order: attention does not depend on it; for a global layer's store n_int2 ≤ T always); the window programs skip the
sink tokens that have left the window (SLIDE) and, with keys per channel, the INT2 programs the rows of the oldest
block that have (HOLE, expired_rows). A window kept whole in BF16 (T = 0) is read by the window programs alone.
"""

import collections
import contextlib
import dataclasses
import functools
import math
import weakref

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from oscar_core.kvstore import Int2KVCache
from oscar_core.triton.launch import cached
from oscar_core.triton.write import code_offsets, dot

LOG2E = 1.4426950408889634

_UNPACK_RAW_LINES = """prmt.b32 lo, $8, 0, 0x4140;
prmt.b32 hi, $8, 0, 0x4342;
lop3.b32 $0, lo, 0x00030003, 0x43004300, 0xEA;
lop3.b32 $1, hi, 0x00030003, 0x43004300, 0xEA;
lop3.b32 $2, lo, 0x000c000c, 0x43004300, 0xEA;
lop3.b32 $3, hi, 0x000c000c, 0x43004300, 0xEA;
lop3.b32 $4, lo, 0x00300030, 0x43004300, 0xEA;
lop3.b32 $5, hi, 0x00300030, 0x43004300, 0xEA;
shr.b32 lo, lo, 2;
shr.b32 hi, hi, 2;
lop3.b32 $6, lo, 0x00300030, 0x43004300, 0xEA;
lop3.b32 $7, hi, 0x00300030, 0x43004300, 0xEA;
""".splitlines()


def _minus_128(line: str) -> str:
    """After each lop3 that writes output $k, subtract 128 in packed bf16: $k = $k·1 − 128 (exact)."""
    if not line.startswith("lop3"):
        return line
    out = line.split()[1].rstrip(",")
    return f"{line}\nfma.rn.bf16x2 {out}, {out}, one, neg;"


_UNPACK_RAW_ASM = tl.constexpr("{\n.reg .b32 lo, hi;\n" + "\n".join(_UNPACK_RAW_LINES) + "\n}")
_UNPACK_ASM = tl.constexpr("{\n.reg .b32 lo, hi, one, neg;\nmov.b32 one, 0x3F803F80;\nmov.b32 neg, 0xC300C300;\n"
                           + "\n".join(_minus_128(line) for line in _UNPACK_RAW_LINES) + "\n}")


@triton.jit
def _unpack_raw(packed, USE_ASM: tl.constexpr):
    """uint8 bytes -> four bf16 tensors 128 + m_i·((byte >> 2i) & 3), m = (1, 4, 16, 16): the masked bits
    ored into the mantissa of 128.0, the 128 left in (2 prmt + 8 lop3 + 2 shifts per 16 codes)."""
    if USE_ASM:
        u0, u1, u2, u3 = tl.inline_asm_elementwise(
            _UNPACK_RAW_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [packed],
            dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        u0 = ((packed & 3).to(tl.float32) + 128.0).to(tl.bfloat16)
        u1 = ((packed & 12).to(tl.float32) + 128.0).to(tl.bfloat16)
        u2 = ((packed & 48).to(tl.float32) + 128.0).to(tl.bfloat16)
        u3 = (((packed >> 2) & 48).to(tl.float32) + 128.0).to(tl.bfloat16)
    return u0, u1, u2, u3


@triton.jit
def _unpack(packed, USE_ASM: tl.constexpr):
    """uint8 bytes -> four bf16 tensors u_i = m_i·((byte >> 2i) & 3), m = (1, 4, 16, 16).

    The PTX path ors the masked bits into the mantissa of 128.0 (0x4300, one lop3 for mask and or) and
    subtracts 128 in packed bf16 (exact): 2 prmt + 8 lop3 + 2 shifts + 8 bf16x2 fma per 16 codes, no
    int-to-float conversion."""
    if USE_ASM:
        u0, u1, u2, u3 = tl.inline_asm_elementwise(
            _UNPACK_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [packed],
            dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        # Through float32: the interpreter converts integers to bf16 wrongly (triton 3.9).
        u0 = (packed & 3).to(tl.float32).to(tl.bfloat16)
        u1 = (packed & 12).to(tl.float32).to(tl.bfloat16)
        u2 = (packed & 48).to(tl.float32).to(tl.bfloat16)
        u3 = ((packed >> 2) & 48).to(tl.float32).to(tl.bfloat16)
    return u0, u1, u2, u3


@triton.jit
def _query(q_ptr, rk_ptr, rows, cols, mask, h, D: tl.constexpr, ROTATE: tl.constexpr, F32: tl.constexpr):
    """q̃[rows, cols] in bf16, 0 where not mask: loaded (q_ptr holds q̃, _rotate_kernel's output) or, with
    ROTATE, computed here from q_ptr = q as q[rows]·R_K[h][:, cols] (tf32 products, float32 sums), 16 rows
    of R_K at a time so the shared-memory operand stays small."""
    if ROTATE:
        y = tl.zeros([rows.shape[0], cols.shape[0]], tl.float32)
        for c0 in tl.static_range(0, D, 16):
            c = c0 + tl.arange(0, 16)
            q = tl.load(q_ptr + rows[:, None] * D + c[None, :]).to(tl.float32)
            rot = tl.load(rk_ptr + h * D * D + c[:, None] * D + cols[None, :])
            if F32:
                y = tl.dot(q, rot, y)
            else:
                y = tl.dot(q, rot, y, input_precision="tf32")
        q_rot = tl.where(mask, y, 0.0).to(tl.bfloat16)
    else:
        q_rot = tl.load(q_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.bfloat16)
    return q_rot


@triton.jit
def _window_part(q_ptr, rk_ptr, ks_ptr, vs_ptr, kr_ptr, vr_ptr, po_ptr, pm_ptr, pl_ptr, bh, h, length, q_row0,
                 scale_log2, slot, wid, T, HG: tl.constexpr, D: tl.constexpr, S: tl.constexpr, W: tl.constexpr,
                 QP: tl.constexpr, BLOCK_W: tl.constexpr, ROTATE: tl.constexpr, F32: tl.constexpr,
                 TB: tl.constexpr, R: tl.constexpr, SLIDE: tl.constexpr):
    """Attention over window tokens [wid·BLOCK_W, (wid+1)·BLOCK_W) of the BF16 sink + recent windows.
    TB > 1 (keys per channel, blocks of TB tokens): the ring of R slots holds positions S + n_int2 .. L − 1,
    window token n_sink + i in slot (n_int2 + i) mod R. SLIDE: a window's store (N = W + T), whose sink tokens
    before L − N have left the window."""
    r = tl.arange(0, QP)
    c = tl.arange(0, D)
    n_sink = tl.minimum(length, S)
    if TB > 1:
        n_int2 = tl.maximum(length - S - W, 0) // TB * TB
        n_win = n_sink + tl.maximum(length - S, 0) - n_int2
    else:
        n_win = n_sink + tl.minimum(tl.maximum(length - S, 0), W)
    rows = slot * HG + r
    if wid * BLOCK_W < n_win:
        q = _query(q_ptr, rk_ptr, q_row0 + tl.where(r < HG, r, 0), c, (r < HG)[:, None], h, D, ROTATE, F32)
        sink0 = bh.to(tl.int64) * S * D
        n = wid * BLOCK_W + tl.arange(0, BLOCK_W)
        valid = n < n_win
        if SLIDE:
            valid = valid & ((n >= n_sink) | (n >= length - W - T))
        in_sink = (n < n_sink)[:, None]
        off_s = sink0 + n[:, None] * D + c[None, :]
        if TB > 1:
            ring0 = bh.to(tl.int64) * R * D
            off_r = ring0 + ((tl.maximum(n - n_sink, 0) + n_int2) % R)[:, None] * D + c[None, :]
        else:
            ring0 = bh.to(tl.int64) * W * D
            off_r = ring0 + (n - n_sink)[:, None] * D + c[None, :]
        k = tl.load(tl.where(in_sink, ks_ptr + off_s, kr_ptr + off_r), mask=valid[:, None], other=0.0)
        v = tl.load(tl.where(in_sink, vs_ptr + off_s, vr_ptr + off_r), mask=valid[:, None], other=0.0)
        x = dot(q, tl.trans(k), None, F32) * scale_log2
        x = tl.where(valid[None, :], x, float("-inf"))
        m = tl.max(x, axis=1)
        if SLIDE:       # a slice of sink tokens all out of the window: l = 0, as an empty one
            m = tl.maximum(m, -1e30)
        # Normalize by the bf16 weights that multiply v, so a large common component of v cancels exactly.
        p = tl.exp2(x - m[:, None]).to(tl.bfloat16)
        l = tl.sum(p.to(tl.float32), axis=1)
        acc = dot(p, v, None, F32)
        tl.store(po_ptr + rows[:, None] * D + c[None, :], acc, mask=(r < HG)[:, None])
        tl.store(pm_ptr + rows, m, mask=r < HG)
        tl.store(pl_ptr + rows, l, mask=r < HG)
    else:
        # An empty slice: l = 0 tells the merge to skip its (unwritten) output.
        tl.store(pm_ptr + rows, tl.full([QP], -1e30, tl.float32), mask=r < HG)
        tl.store(pl_ptr + rows, tl.zeros([QP], tl.float32), mask=r < HG)


@triton.jit
def _operand(x, F32: tl.constexpr):
    """x as a bf16 product operand; with F32 (the CPU interpreter, whose float32 -> bf16 conversion truncates:
    a bias the GPU's rounding to nearest has not) left in float32."""
    if F32:
        return x
    return x.to(tl.bfloat16)


@triton.jit
def _channel_scores(q0, q1, q2, q3, u0, u1, u2, u3, ksc_ptr, kz_ptr, meta, j, log2_scale, MK: tl.constexpr,
                    NGK: tl.constexpr, HGP: tl.constexpr, BLOCK_N: tl.constexpr, KEY_T: tl.constexpr,
                    F32: tl.constexpr):
    """Scores of a tile inside one key block of keys per channel (scale / zero codes at meta + c):
        x[r, t] = scaling·log2(e)·Σ_c q̃[r, c]·step_c·(code[t, c] + z_c/4)
    The step and the score scale fold into the query operands, h_i = bf16(q_i·step) (q_i = q̃/m_i as in
    _int2_part), and the zero codes into one offset a row, Σ_c m_i·h_i·z_c/4, over the same bf16 h_i
    (so the two terms of a channel's common offset cancel as they do in k̂); the accumulator starts at
    that offset less 128·Σ h_i, which the unpacked codes (128 + m_i·code) add back. [HGP, BLOCK_N], or
    [BLOCK_N, HGP] with KEY_T."""
    st0 = tl.exp2((tl.load(ksc_ptr + meta + 4 * j).to(tl.float32) - 128.0) * 0.125 + log2_scale)
    st1 = tl.exp2((tl.load(ksc_ptr + meta + 4 * j + 1).to(tl.float32) - 128.0) * 0.125 + log2_scale)
    st2 = tl.exp2((tl.load(ksc_ptr + meta + 4 * j + 2).to(tl.float32) - 128.0) * 0.125 + log2_scale)
    st3 = tl.exp2((tl.load(ksc_ptr + meta + 4 * j + 3).to(tl.float32) - 128.0) * 0.125 + log2_scale)
    h0 = _operand(q0.to(tl.float32) * st0[None, :], F32)
    h1 = _operand(q1.to(tl.float32) * st1[None, :], F32)
    h2 = _operand(q2.to(tl.float32) * st2[None, :], F32)
    h3 = _operand(q3.to(tl.float32) * st3[None, :], F32)
    # m_i·z/4 − 128 a channel: the zero term and the unpack's 128, in one sum a row.
    z0 = tl.load(kz_ptr + meta + 4 * j).to(tl.float32) * 0.25 - 128.0
    z1 = tl.load(kz_ptr + meta + 4 * j + 1).to(tl.float32) - 128.0
    z2 = tl.load(kz_ptr + meta + 4 * j + 2).to(tl.float32) * 4.0 - 128.0
    z3 = tl.load(kz_ptr + meta + 4 * j + 3).to(tl.float32) * 4.0 - 128.0
    off = tl.sum(h0.to(tl.float32) * z0[None, :], axis=1)
    off += tl.sum(h1.to(tl.float32) * z1[None, :], axis=1)
    off += tl.sum(h2.to(tl.float32) * z2[None, :], axis=1)
    off += tl.sum(h3.to(tl.float32) * z3[None, :], axis=1)
    if KEY_T:
        s = tl.zeros([BLOCK_N, MK], tl.float32) + off[None, :]
        s = dot(u0, tl.trans(h0), s, F32)
        s = dot(u1, tl.trans(h1), s, F32)
        s = dot(u2, tl.trans(h2), s, F32)
        s = dot(u3, tl.trans(h3), s, F32)
        x = tl.sum(tl.reshape(s, [BLOCK_N, NGK, HGP]), axis=1)
    else:
        s = tl.zeros([MK, BLOCK_N], tl.float32) + off[:, None]
        s = dot(h0, tl.trans(u0), s, F32)
        s = dot(h1, tl.trans(u1), s, F32)
        s = dot(h2, tl.trans(u2), s, F32)
        s = dot(h3, tl.trans(u3), s, F32)
        x = tl.sum(tl.reshape(s, [NGK, HGP, BLOCK_N]), axis=0)
    return x


@triton.jit
def _int2_part(q_ptr, rk_ptr, kc_ptr, ksc_ptr, kz_ptr, vc_ptr, vsc_ptr, vz_ptr, po_ptr, pm_ptr, pl_ptr,
               bh, h, start, end, q_row0, log2_scale, T, slot, hole_lo, hole_hi,
               HG: tl.constexpr, D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr, HGP: tl.constexpr,
               BLOCK_N: tl.constexpr, KEY_T: tl.constexpr, USE_ASM: tl.constexpr, ROTATE: tl.constexpr,
               F32: tl.constexpr, TB: tl.constexpr, VT: tl.constexpr, HOLE: tl.constexpr):
    """Attention over INT2 rows [start, end) of one sequence and KV head. KEY_T computes the score tile
    transposed (tokens as rows); both orders give the same function. TB > 1: keys per channel over blocks
    of TB tokens (scale / zero codes [T/TB, D]), each tile inside one block (BLOCK_N divides TB), scored by
    _channel_scores; GK then only stacks the query's channels as rows. VT: value codes in 64-row tiles
    (kvstore's value_layout "tiles"). HOLE: rows [hole_lo, hole_hi) are skipped (a window's expired rows)."""
    NGK: tl.constexpr = D // GK
    NGV: tl.constexpr = D // GV
    MK: tl.constexpr = NGK * HGP
    MV: tl.constexpr = NGV * HGP
    DB: tl.constexpr = D // 4
    j = tl.arange(0, DB)

    # Query rows (g, r): q̃[r, 4j+i]/m_i where channel 4j+i lies in key group g, else 0.
    mk = tl.arange(0, MK)
    qmask = ((mk % HGP) < HG)[:, None] & ((j[None, :] // (GK // 4)) == (mk // HGP)[:, None])
    qrows = q_row0 + tl.where(mk % HGP < HG, mk % HGP, 0)
    q0 = _query(q_ptr, rk_ptr, qrows, 4 * j, qmask, h, D, ROTATE, F32)
    q1 = (_query(q_ptr, rk_ptr, qrows, 4 * j + 1, qmask, h, D, ROTATE, F32).to(tl.float32) * 0.25).to(tl.bfloat16)
    q2 = (_query(q_ptr, rk_ptr, qrows, 4 * j + 2, qmask, h, D, ROTATE, F32).to(tl.float32) * 0.0625).to(tl.bfloat16)
    q3 = (_query(q_ptr, rk_ptr, qrows, 4 * j + 3, qmask, h, D, ROTATE, F32).to(tl.float32) * 0.0625).to(tl.bfloat16)
    f0, f1, f2, f3 = q0.to(tl.float32), q1.to(tl.float32), q2.to(tl.float32), q3.to(tl.float32)
    q_sum = tl.reshape(tl.sum(f0 + 4.0 * f1 + 16.0 * (f2 + f3), axis=1), [NGK, HGP, 1])
    # The key unpack leaves 128 in every code (u = 128 + m·code); the score accumulator starts at
    # −128·Σ of the row's (bf16) query operands, so the products add the offset back exactly per tile.
    q_off = 128.0 * tl.sum(f0 + f1 + f2 + f3, axis=1)
    if KEY_T:
        s_init = tl.zeros([BLOCK_N, MK], tl.float32) - q_off[None, :]
        q0t, q1t, q2t, q3t = tl.trans(q0), tl.trans(q1), tl.trans(q2), tl.trans(q3)
        q_sum_t = tl.reshape(q_sum, [1, NGK, HGP])
    else:
        s_init = tl.zeros([MK, BLOCK_N], tl.float32) - q_off[:, None]

    gk = tl.arange(0, NGK)
    gv = tl.arange(0, NGV)
    code0 = bh.to(tl.int64) * T * DB
    kmeta0 = bh.to(tl.int64) * T * NGK
    vmeta0 = bh.to(tl.int64) * T * NGV
    m = tl.full([HGP], -1e30, tl.float32)
    l = tl.zeros([HGP], tl.float32)
    z_sum = tl.zeros([NGV, HGP], tl.float32)
    acc0 = tl.zeros([MV, DB], tl.float32)
    acc1 = tl.zeros([MV, DB], tl.float32)
    acc2 = tl.zeros([MV, DB], tl.float32)
    acc3 = tl.zeros([MV, DB], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        n = t0 + tl.arange(0, BLOCK_N)
        valid = n < end
        if HOLE:
            valid = valid & ((n < hole_lo) | (n >= hole_hi))
        kp = tl.load(kc_ptr + code0 + n[:, None] * DB + j[None, :], mask=valid[:, None], other=0)
        u0, u1, u2, u3 = _unpack_raw(kp, USE_ASM)
        if TB > 1:
            meta = bh.to(tl.int64) * (T // TB) * D + (t0 // TB) * D
        if KEY_T:
            if TB > 1:
                x = _channel_scores(q0, q1, q2, q3, u0, u1, u2, u3, ksc_ptr, kz_ptr, meta, j, log2_scale,
                                    MK, NGK, HGP, BLOCK_N, True, F32)
            else:
                # Scores transposed, [tokens, (g, r)]: the unpacked codes are the register operand
                # (M = BLOCK_N, so Hopper's wgmma), the query the shared one.
                s = dot(u0, q0t, s_init, F32)
                s = dot(u1, q1t, s, F32)
                s = dot(u2, q2t, s, F32)
                s = dot(u3, q3t, s, F32)
                ksc = tl.load(ksc_ptr + kmeta0 + n[:, None] * NGK + gk[None, :], mask=valid[:, None], other=0)
                kz = tl.load(kz_ptr + kmeta0 + n[:, None] * NGK + gk[None, :], mask=valid[:, None], other=0)
                kstep = tl.exp2((ksc.to(tl.float32) - 128.0) * 0.125 + log2_scale)[:, :, None]
                s3 = tl.reshape(s, [BLOCK_N, NGK, HGP])
                x = tl.sum(kstep * (s3 + (kz.to(tl.float32) * 0.25)[:, :, None] * q_sum_t), axis=1)
            x = tl.where(valid[:, None], x, float("-inf"))
            m_new = tl.maximum(m, tl.max(x, axis=0))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(x - m_new[None, :])
            l = l * alpha + tl.sum(p, axis=0)
        else:
            if TB > 1:
                x = _channel_scores(q0, q1, q2, q3, u0, u1, u2, u3, ksc_ptr, kz_ptr, meta, j, log2_scale,
                                    MK, NGK, HGP, BLOCK_N, False, F32)
            else:
                s = dot(q0, tl.trans(u0), s_init, F32)
                s = dot(q1, tl.trans(u1), s, F32)
                s = dot(q2, tl.trans(u2), s, F32)
                s = dot(q3, tl.trans(u3), s, F32)
                ksc = tl.load(ksc_ptr + kmeta0 + n[None, :] * NGK + gk[:, None], mask=valid[None, :], other=0)
                kz = tl.load(kz_ptr + kmeta0 + n[None, :] * NGK + gk[:, None], mask=valid[None, :], other=0)
                kstep = tl.exp2((ksc.to(tl.float32) - 128.0) * 0.125 + log2_scale)[:, None, :]
                s3 = tl.reshape(s, [NGK, HGP, BLOCK_N])
                x = tl.sum(kstep * (s3 + (kz.to(tl.float32) * 0.25)[:, None, :] * q_sum), axis=0)
            x = tl.where(valid[None, :], x, float("-inf"))
            m_new = tl.maximum(m, tl.max(x, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(x - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
        m = m_new

        if VT:
            offsets = code_offsets(bh.to(tl.int64) * T + n, 0, D, D, True)
            halves = tl.load(vc_ptr.to(tl.pointer_type(tl.int16)) + offsets, mask=valid[:, None], other=0)
            vp = tl.reshape(tl.join(halves.to(tl.uint8), (halves >> 8).to(tl.uint8)), [BLOCK_N, DB])
        else:
            vp = tl.load(vc_ptr + code0 + n[:, None] * DB + j[None, :], mask=valid[:, None], other=0)
        w0, w1, w2, w3 = _unpack(vp, USE_ASM)
        if KEY_T:
            vsc = tl.load(vsc_ptr + vmeta0 + n[:, None] * NGV + gv[None, :], mask=valid[:, None], other=0)
            vz = tl.load(vz_ptr + vmeta0 + n[:, None] * NGV + gv[None, :], mask=valid[:, None], other=0)
            vstep = tl.exp2((vsc.to(tl.float32) - 128.0) * 0.125)
            a3 = (p[:, None, :] * vstep[:, :, None]).to(tl.bfloat16)
            z_sum = z_sum * alpha[None, :] + tl.sum(a3.to(tl.float32) * (vz.to(tl.float32) * 0.25)[:, :, None], axis=0)
            a = tl.trans(tl.reshape(a3, [BLOCK_N, MV]))
        else:
            vsc = tl.load(vsc_ptr + vmeta0 + n[None, :] * NGV + gv[:, None], mask=valid[None, :], other=0)
            vz = tl.load(vz_ptr + vmeta0 + n[None, :] * NGV + gv[:, None], mask=valid[None, :], other=0)
            vstep = tl.exp2((vsc.to(tl.float32) - 128.0) * 0.125)
            a3 = (p[None, :, :] * vstep[:, None, :]).to(tl.bfloat16)
            z_sum = z_sum * alpha[None, :] + tl.sum(a3.to(tl.float32) * (vz.to(tl.float32) * 0.25)[:, None, :], axis=2)
            a = tl.reshape(a3, [MV, BLOCK_N])
        alpha_rows = tl.reshape(tl.broadcast_to(alpha[None, :], [NGV, HGP]), [MV])[:, None]
        acc0 = dot(a, w0, acc0 * alpha_rows, F32)
        acc1 = dot(a, w1, acc1 * alpha_rows, F32)
        acc2 = dot(a, w2, acc2 * alpha_rows, F32)
        acc3 = dot(a, w3, acc3 * alpha_rows, F32)

    # Output channel 4j+i of head r: row (g(j), r) of acc_i / m_i, plus the zero term.
    pick = (j // (GV // 4))[None, None, :] == gv[:, None, None]
    zt = z_sum[:, :, None]
    r = tl.arange(0, HGP)
    out = po_ptr + (slot * HG + r)[:, None] * D + 4 * j[None, :]
    omask = (r < HG)[:, None]
    o = tl.sum(tl.where(pick, tl.reshape(acc0, [NGV, HGP, DB]) + zt, 0.0), axis=0)
    tl.store(out, o, mask=omask)
    o = tl.sum(tl.where(pick, tl.reshape(acc1, [NGV, HGP, DB]) * 0.25 + zt, 0.0), axis=0)
    tl.store(out + 1, o, mask=omask)
    o = tl.sum(tl.where(pick, tl.reshape(acc2, [NGV, HGP, DB]) * 0.0625 + zt, 0.0), axis=0)
    tl.store(out + 2, o, mask=omask)
    o = tl.sum(tl.where(pick, tl.reshape(acc3, [NGV, HGP, DB]) * 0.0625 + zt, 0.0), axis=0)
    tl.store(out + 3, o, mask=omask)
    tl.store(pm_ptr + slot * HG + r, m, mask=r < HG)
    tl.store(pl_ptr + slot * HG + r, l, mask=r < HG)


@triton.jit
def _merged(po_ptr, pm_ptr, pl_ptr, base, r, rmask, c, NS, HG: tl.constexpr, D: tl.constexpr, SB: tl.constexpr,
            CACHE: tl.constexpr, GATED: tl.constexpr = True):
    """õ[r, c] = Σ_s 2^(m_s−M) acc_s[r, c] / Σ_s 2^(m_s−M) l_s over the NS splits whose partials start at row
    base: SB splits a step with a running max; splits with l_s = 0 (empty) count for nothing: with GATED their
    partials are left unread (a load that waits on l_s), else loaded beside l_s and dropped. CACHE: the loads'
    cache modifier (".cg" for partials another program of this launch wrote)."""
    m_run = tl.full([r.shape[0]], -1e30, tl.float32)
    l_sum = tl.zeros([r.shape[0]], tl.float32)
    o = tl.zeros([r.shape[0], c.shape[0]], tl.float32)
    for s0 in range(0, NS, SB):
        s = s0 + tl.arange(0, SB)
        mask = (s < NS)[:, None] & rmask[None, :]
        idx = base + s[:, None] * HG + r[None, :]
        ms = tl.load(pm_ptr + idx, mask=mask, other=-1e30, cache_modifier=CACHE)
        ls = tl.load(pl_ptr + idx, mask=mask, other=0.0, cache_modifier=CACHE)
        if GATED:
            part = tl.load(po_ptr + idx[:, :, None] * D + c[None, None, :], mask=(mask & (ls > 0))[:, :, None],
                           other=0.0, cache_modifier=CACHE)
        else:
            part = tl.load(po_ptr + idx[:, :, None] * D + c[None, None, :], mask=mask[:, :, None], other=0.0,
                           cache_modifier=CACHE)
            part = tl.where((ls > 0)[:, :, None], part, 0.0)
        m_new = tl.maximum(m_run, tl.max(ms, axis=0))
        alpha = tl.exp2(m_run - m_new)
        w = tl.exp2(ms - m_new[None, :])
        l_sum = l_sum * alpha + tl.sum(w * ls, axis=0)
        o = o * alpha[:, None] + tl.sum(w[:, :, None] * part, axis=0)
        m_run = m_new
    return o / tl.where(rmask, l_sum, 1.0)[:, None]


@triton.jit
def _merge(po_ptr, pm_ptr, pl_ptr, rv_ptr, mean_ptr, out_ptr, bh, h, NS, HG: tl.constexpr, D: tl.constexpr,
           QP: tl.constexpr, SB: tl.constexpr, BLOCK_E: tl.constexpr, HAS_MEAN: tl.constexpr):
    """o = (Σ_s 2^(m_s−M) acc_s / Σ_s 2^(m_s−M) l_s)·R_V^T + μ_V for the HG heads of (sequence, KV head) bh,
    SB splits per step merged with a running max; splits with l_s = 0 (empty) are skipped unread.
    The partials were written by other programs: loaded past L1 (.cg)."""
    r = tl.arange(0, QP)
    rmask = r < HG
    c = tl.arange(0, D)
    base = bh * NS * HG
    o = _merged(po_ptr, pm_ptr, pl_ptr, base, r, rmask, c, NS, HG, D, SB, ".cg")
    # R_V^T by blocks of BLOCK_E output columns (a small shared-memory operand per product).
    for e0 in tl.static_range(0, D, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        rvt = tl.load(rv_ptr + h * D * D + e[None, :] * D + c[:, None])
        # In float32 (not TF32: the output can be a small difference of large terms; kernel_notes.md v24).
        y = tl.dot(o, rvt, input_precision="ieee")
        if HAS_MEAN:
            y += tl.load(mean_ptr + h * D + e)[None, :]
        tl.store(out_ptr + (bh * HG + r)[:, None] * D + e[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None])


@triton.jit
def expired_rows(length, n_int2, T, S: tl.constexpr, W: tl.constexpr, HOLE: tl.constexpr):
    """[lo, hi): the rows of a window's store (HOLE; keys per channel) holding tokens older than its window, the
    first of the oldest block held (kvstore.Int2KVCache.first_live): with N = S + W + T, INT2 tokens from
    base = max(n_int2 − T, 0) are held and those below L − N are gone. (0, 0) without HOLE."""
    lo = 0
    hi = 0
    if HOLE:
        base = tl.maximum(n_int2 - T, 0)
        lo = base % T
        hi = lo + tl.maximum(length - S - W - T - base, 0)
    return lo, hi


@triton.jit
def _split_kernel(q_ptr, rk_ptr, ks_ptr, vs_ptr, kr_ptr, vr_ptr, kc_ptr, ksc_ptr, kz_ptr, vc_ptr, vsc_ptr, vz_ptr,
                  len_ptr, po_ptr, pm_ptr, pl_ptr, cnt_ptr, rv_ptr, mean_ptr, out_ptr,
                  scale_log2, log2_scale, T, n_int2_splits, min_chunk, NS,
                  HKV: tl.constexpr, HG: tl.constexpr, D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
                  S: tl.constexpr, W: tl.constexpr, HGP: tl.constexpr, QP: tl.constexpr, NW: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, SB: tl.constexpr, BLOCK_E: tl.constexpr, KEY_T: tl.constexpr,
                  USE_ASM: tl.constexpr, ROTATE: tl.constexpr, MERGE: tl.constexpr, HAS_MEAN: tl.constexpr,
                  F32: tl.constexpr, TB: tl.constexpr, R: tl.constexpr, VT: tl.constexpr, PDL: tl.constexpr,
                  HOLE: tl.constexpr, SLIDE: tl.constexpr):
    """Program (sid, bh): split sid of (sequence, KV head) bh; with MERGE the last of its NS programs to
    finish merges (else _reduce_kernel does, in a launch of its own). TB > 1: keys per channel over blocks
    of TB tokens, a ring of R slots (kvstore.Int2KVCache). PDL: launched as a programmatic dependent of the
    query rotation, whose q̃ it reads only after gdc_wait."""
    if PDL:
        gdc_wait()
    sid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    length = tl.load(len_ptr + b)
    q_row0 = b * (HKV * HG) + h * HG
    slot = bh * NS + sid
    if sid < NW:
        _window_part(q_ptr, rk_ptr, ks_ptr, vs_ptr, kr_ptr, vr_ptr, po_ptr, pm_ptr, pl_ptr, bh, h, length, q_row0,
                     scale_log2, slot, sid, T, HG, D, S, W, QP, BLOCK_W, ROTATE, F32, TB, R, SLIDE)
    else:
        # This sequence's INT2 rows over the n_int2_splits programs: chunks of whole tiles, at least min_chunk.
        n_int2 = tl.maximum(length - S - W, 0)
        if TB > 1:
            n_int2 = n_int2 // TB * TB
        hole_lo, hole_hi = expired_rows(length, n_int2, T, S, W, HOLE)
        n_int2 = tl.minimum(n_int2, T)     # a window's ring of T rows holds its last T INT2 tokens
        chunk = tl.maximum(tl.cdiv(n_int2, n_int2_splits), min_chunk)
        chunk = tl.cdiv(chunk, BLOCK_N) * BLOCK_N
        start = (sid - NW) * chunk
        end = tl.minimum(start + chunk, n_int2)
        if start < end:
            _int2_part(q_ptr, rk_ptr, kc_ptr, ksc_ptr, kz_ptr, vc_ptr, vsc_ptr, vz_ptr, po_ptr, pm_ptr, pl_ptr,
                       bh, h, start, end, q_row0, log2_scale, T, slot, hole_lo, hole_hi, HG, D, GK, GV, HGP,
                       BLOCK_N, KEY_T, USE_ASM, ROTATE, F32, TB, VT, HOLE)
        else:
            r = tl.arange(0, HGP)
            tl.store(pm_ptr + slot * HG + r, tl.full([HGP], -1e30, tl.float32), mask=r < HG)
            tl.store(pl_ptr + slot * HG + r, tl.zeros([HGP], tl.float32), mask=r < HG)
    # Every thread's partial is stored before the counter moves (barrier, then a release at GPU scope);
    # the program that brings it to NS merges, then resets it for the next call.
    if MERGE:
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + bh, 1, sem="acq_rel")
        if done == NS - 1:
            _merge(po_ptr, pm_ptr, pl_ptr, rv_ptr, mean_ptr, out_ptr, bh, h, NS, HG, D, QP, SB, BLOCK_E, HAS_MEAN)
            tl.atomic_xchg(cnt_ptr + bh, 0, sem="relaxed")


@triton.jit
def _factor_tile(ptr, a_off, b_off, WIDE: tl.constexpr):
    """ptr[a_off[i] + b_off[j]] as [1, A, B]: the right factor of a float32 product x[:, :, None]·tile summed over
    A. WIDE (x has 16 rows or more): loaded in three dimensions, since from an expanded 2-D tile triton 3.6 rewrites
    that product as a TF32 tensor-core dot (kernel_notes.md v24); narrower, as a 2-D tile (the code measured)."""
    if WIDE:
        return tl.load(ptr + a_off[None, :, None] + b_off[None, None, :])
    else:
        return tl.load(ptr + a_off[:, None] + b_off[None, :])[None, :, :]


@triton.jit
def _reduce_kernel(po_ptr, pm_ptr, pl_ptr, py_ptr, cnt_ptr, rv_ptr, mean_ptr, out_ptr, NS,
                   HKV: tl.constexpr, HG: tl.constexpr, D: tl.constexpr, HGP: tl.constexpr,
                   SB: tl.constexpr, BLOCK_C: tl.constexpr, HAS_MEAN: tl.constexpr, PDL: tl.constexpr,
                   GATED: tl.constexpr, ROTATE: tl.constexpr, HB: tl.constexpr):
    """Program (bh, j, k), for the columns c of block j ([j·BLOCK_C, (j + 1)·BLOCK_C)) and the query heads r of
    block k ([k·HB, (k + 1)·HB), HB dividing HGP):
      õ[r, c] = Σ_s 2^(m_s−M) acc_s[r, c] / Σ_s 2^(m_s−M) l_s   (SB splits a step, running max; splits
                                                                 with l_s = 0 are empty and left unread)
      y_j[r, :] = Σ_{c in block j} õ[r, c]·R_V[:, c]            (its share of õ·R_V^T, float32, to py)
    and the last of the D / BLOCK_C programs of (bh, k) (an atomic counter, which it resets) writes
    o[r] = Σ_j y_j[r] + μ_V, the partials summed in a fixed order. Every partial is read once, and no program
    waits on a serial chain of products. Without ROTATE (R_V in the model's weights) it writes o[r, c] = õ[r, c]
    (+ μ_V[c]) itself: no shares, no counter. PDL: launched as a programmatic dependent of the split programs,
    it loads its R_V columns before gdc_wait and the partials after. GATED: _merged's."""
    bh = tl.program_id(0)
    j = tl.program_id(1)
    k = tl.program_id(2)
    c0 = j * BLOCK_C
    h = bh % HKV
    r = k * HB + tl.arange(0, HB)
    rmask = r < HG
    c = c0 + tl.arange(0, BLOCK_C)
    e = tl.arange(0, D)
    base = bh * NS * HG
    if ROTATE:
        rvt = _factor_tile(rv_ptr + h * D * D, c, e * D, HB >= 16)        # R_V[e, c] as [1, c, e]
        if PDL:
            gdc_wait()
        o = _merged(po_ptr, pm_ptr, pl_ptr, base, r, rmask, c, NS, HG, D, SB, "", GATED)
        y = tl.sum(o[:, :, None] * rvt, axis=1)
        ys = py_ptr + (bh * (D // BLOCK_C) * HGP + r[:, None]) * D + e[None, :]
        tl.store(ys + j * HGP * D, y)
        # Every thread's share is stored before the counter moves (barrier, then a release at GPU scope).
        tl.debug_barrier()
        cnt = cnt_ptr + bh * (HGP // HB) + k
        done = tl.atomic_add(cnt, 1, sem="acq_rel")
        if done == D // BLOCK_C - 1:
            total = tl.zeros([HB, D], tl.float32)
            for i in range(D // BLOCK_C):
                total += tl.load(ys + i * HGP * D, cache_modifier=".cg")
            if HAS_MEAN:
                total += tl.load(mean_ptr + h * D + e)[None, :]
            tl.store(out_ptr + (bh * HG + r)[:, None] * D + e[None, :], total.to(out_ptr.dtype.element_ty),
                     mask=rmask[:, None])
            tl.atomic_xchg(cnt, 0, sem="relaxed")
    else:
        if PDL:
            gdc_wait()
        o = _merged(po_ptr, pm_ptr, pl_ptr, base, r, rmask, c, NS, HG, D, SB, "", GATED)
        if HAS_MEAN:
            o += tl.load(mean_ptr + h * D + c)[None, :]
        tl.store(out_ptr + (bh * HG + r)[:, None] * D + c[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None])


@triton.jit
def _rotate_kernel(q_ptr, rk_ptr, out_ptr, HKV: tl.constexpr, HG: tl.constexpr, HGP: tl.constexpr,
                   D: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr, HB: tl.constexpr):
    """q̃[b, h·HG + r, e] = Σ_c q[b, h·HG + r, c]·R_K[h, c, e] in float32, stored bf16, for columns
    [e0, e0 + BLOCK_E) and the heads r of block k ([k·HB, (k + 1)·HB), HB dividing HGP): kvstore.rotate_query
    in one launch. PDL: lets the next launch (a programmatic dependent) start at once."""
    if PDL:
        gdc_launch_dependents()
    bh = tl.program_id(0)
    e0 = tl.program_id(1) * BLOCK_E
    h = bh % HKV
    r = tl.program_id(2) * HB + tl.arange(0, HB)
    c = tl.arange(0, D)
    e = e0 + tl.arange(0, BLOCK_E)
    rows = (bh * HG + r)[:, None]
    q = tl.load(q_ptr + rows * D + c[None, :], mask=(r < HG)[:, None], other=0.0).to(tl.float32)
    rot = _factor_tile(rk_ptr + h * D * D, c * D, e, HB >= 16)        # R_K[c, e] as [1, c, e]
    y = tl.sum(q[:, :, None] * rot, axis=1)
    tl.store(out_ptr + rows * D + e[None, :], y.to(tl.bfloat16), mask=(r < HG)[:, None])


def rotate_heads(heads_per_kv: int) -> int:
    """Query heads a rotation program takes: at most 4. Its [heads, d, 16] float32 product over all 16 heads of GQA 16
    took 2.8 µs at batch 1, over 4 heads a program 1.7; GQA 8 2.3 -> 1.9 at batch 1, 5.3 -> 4.6 at 8, 16.0 -> 14.2 at
    32; 2 heads a program gain no more and lose at batch 8-32 (H200, bench/head_blocks.py, rotate_heads_h200.txt)."""
    return min(_pow2(heads_per_kv), 4)


def rotate_query_bf16(q: torch.Tensor, key_rotation: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """Triton kvstore.rotate_query, rounded to bf16: q [B, H, d] -> q̃ bf16 [B, H, d]. pdl: the next launch
    may start (programmatic dependent launch) before this one ends."""
    bsz, heads, d = q.shape
    kv_heads = key_rotation.shape[0]
    hg = heads // kv_heads
    out = torch.empty(bsz, heads, d, dtype=torch.bfloat16, device=q.device)
    block_e = 16
    hb = rotate_heads(hg)
    _launch(_rotate_kernel)(
        (bsz * kv_heads, d // block_e, _pow2(hg) // hb), q.contiguous(), key_rotation.float().contiguous(), out,
        HKV=kv_heads, HG=hg, HGP=_pow2(hg), D=d, BLOCK_E=block_e, PDL=pdl, HB=hb, num_warps=4)
    return out


_launch = cached     # a module attribute of its own, which bench/call_parts.py and host_overhead.py replace


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def plan_splits(batch: int, kv_heads: int, max_int2: int, block_n: int, num_sms: int, waves: int = 4,
                min_chunk: int = 0):
    """(chunk, number of INT2 splits): INT2 rows per split (a multiple of block_n, at least min_chunk),
    and as many INT2 splits as keep the programs within `waves` per multiprocessor (rounded down, so a
    `waves` equal to the programs one multiprocessor holds makes one whole wave, not one and a sliver)."""
    want = max(1, waves * num_sms // (batch * kv_heads))
    chunk = max(block_n, min_chunk, -(-max(max_int2, 1) // want))
    chunk = -(-chunk // block_n) * block_n
    return chunk, -(-max_int2 // chunk)


def reduce_heads(heads_per_kv: int, programs: int) -> int:
    """Query heads a reduce program merges: the fewest (from 2) that keep the reduce within 512 programs, where
    `programs` is its grid with all of a KV head's heads in each (pairs x column blocks). One program for all 16
    heads of GQA 16 at batch 1 took 9.5-15 µs, serial steps over the splits' partials of 16 heads at a time; 4 or
    2 heads a program 4.4-5.5 (H200, reduce alone, 8K-100K x 1, bench/head_blocks.py, reduce_heads_h200.txt).
    Past 512 programs more of them lose: Qwen3-8B 100K x 8 7.0 µs at 512 programs, 9.5 at 1,024; GQA 8 100K x 8
    9.0 at 512, 10.8 at 1,024."""
    hgp = _pow2(heads_per_kv)
    hb = min(2, hgp)
    while hb < hgp and programs * (hgp // hb) > 512:
        hb *= 2
    return hb


def default_config(batch: int, kv_heads: int, head_dim: int = 128, gluon: bool = False) -> dict:
    """Launch settings by the number of (sequence, KV head) pairs and head_dim (tuned on an H100 at 100K
    context: v5-v7 in bench/results/kernel_notes.md). From 17 pairs up, one-warp programs (two at head_dim
    256, whose value accumulators would not fit one warp's registers): no cross-warp reductions or barriers
    per tile, enough of them (waves 48) to fill every multiprocessor, at least 512 rows each. Up to 16 pairs
    (batch 1-2), four-warp programs. Each setting was compiled offline for sm_90 (triton 3.6) to fit shared
    memory without spilling in the loop. The Gluon INT2 programs are one warp of 64-token tiles at every
    batch (their products need no shared memory), one whole wave of them (decode_attention counts the
    programs a multiprocessor holds), at least 128 rows each (H100, graph, 128 against 256 rows: Qwen3-8B's
    shape at 8K x 1 0.0214 against 0.0249 ms, 16K x 1 0.0240 against 0.0272, 100K x 1 equal; head_dim 256 at
    1-8 pairs 2-20% faster; 64 rows lost at some lengths; kernel_notes.md v16)."""
    pairs = batch * kv_heads
    if gluon:
        # (num_warps: the window programs' at 8 pairs or fewer below head_dim 256; elsewhere _plan gives them 8 or 4.)
        return dict(block_n=64, num_warps=2 if head_dim > 128 else 1, num_stages=1, waves=16, key_t=True,
                    min_chunk=128)
    if pairs > 16:
        cfg = dict(block_n=64, num_warps=1, num_stages=4 if pairs >= 128 else 3, waves=48, key_t=pairs >= 128,
                   min_chunk=512)
        if head_dim > 128:
            cfg.update(num_warps=2, num_stages=2)
        return cfg
    # block_n 128 outside head_dim 128: at 256 the staged tiles, at 64 the registers (the loop spills at 256).
    return dict(block_n=256 if head_dim == 128 else 128, num_warps=4, num_stages=2, waves=2, key_t=True,
                min_chunk=0)


# At most this many Gluon INT2 splits a (sequence, KV head): past it, at 1-3 pairs, the partials the reduce merges
# cost more than the programs' share of a wave gains (H200, graph, min_chunk 128 / 256 / 512 rows, µs, splits a pair
# in brackets; kernel_notes.md v35): Qwen2.5-0.5B (14/2, d 64) 100K x 1 35.4 (785) / 26.9 (396) / 24.3 (201), 32K x 1
# 22.0 (260) / 20.5 (133) / 20.9; SmolLM2 (9/3) 100K x 1 23.8 (526) / 22.3 (396) / 22.9 (201). Below it the wave's
# splits stay: Qwen3-8B's 228 at 100K x 1 44.4 µs, 200 47.0.
MAX_GLUON_SPLITS = 256

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


def check_shape(heads: int, kv_heads: int, head_dim: int, key_group_size: int, value_group_size: int,
                key_axis: str = "token") -> None:
    """Raise ValueError unless decode_attention supports this attention shape (key_axis "channel": keys per
    channel over blocks of key_group_size tokens)."""
    if head_dim not in (64, 128, 256):
        raise ValueError(f"decode_attention supports head_dim 64, 128 or 256, not {head_dim}")
    if key_axis == "channel" and key_group_size not in (64, 128, 256):
        raise ValueError(f"decode_attention needs key blocks of 64, 128 or 256 tokens for keys per channel, "
                         f"not {key_group_size}")
    groups = (("value", value_group_size),) if key_axis == "channel" else ()
    for name, g in groups or (("key", key_group_size), ("value", value_group_size)):
        if g not in (64, 128, 256) or g > head_dim:
            raise ValueError(f"decode_attention needs a {name} group size of 64, 128 or 256 channels within "
                             f"head_dim {head_dim}, not {g}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if heads // kv_heads > 16:
        raise ValueError(f"decode_attention supports up to 16 query heads per KV head, not {heads // kv_heads}")


def gluon_supported(q: torch.Tensor, cache: Int2KVCache) -> bool:
    """Whether the Gluon INT2 programs (decode_gluon.py) serve this call: a CUDA device of compute
    capability 8.0 or newer, head_dim 64, 128 or 256, value groups (and key groups, keys per token; key blocks,
    keys per channel) of 64 or 128 within the head, up to 16 query heads per KV head, whole 64-row blocks
    of INT2 rows (kvstore.int2_rows allocates them so)."""
    if not q.is_cuda or _gluon() is None or _capability(q.device)[0] < 8:
        return False
    d, gk, gv = q.shape[-1], cache.key_group_size, cache.value_group_size
    keys_fit = gk in (64, 128) and (cache.key_axis == "channel" or gk <= d)
    return (d in (64, 128, 256) and keys_fit and gv in (64, 128) and gv <= d
            and q.shape[1] // cache.key_codes.shape[1] <= 16 and cache.key_codes.shape[2] % 64 == 0)


def gluon_constexprs(cache: Int2KVCache, heads: int, head_dim: int, window_programs: int,
                     heads_per_program: int | None = None) -> dict:
    """decode_gluon._int2_split_kernel's constexprs for a store: HT programs of R4 query heads each cover
    a KV head's HG heads. heads_per_program None: 8 from 5 heads a KV head, else 4. A program of 8 heads has
    a score column a head (keys per token: a score tile a key group), so it costs about what one of 4 does
    (H100, 100K x 8, kernel_notes.md v12: GQA 8 0.29 against 0.43 ms keys per token, 0.34 against 0.50 keys
    per channel; GQA 16 0.15 against 0.22). 16 heads a program (two score columns of the mma, 255 registers
    with spills) is an option, not the rule: from 9 heads a KV head it was 4-14% faster with keys per token at
    100K x 8 and 10-40% slower with keys per channel and at 16K (kernel_notes.md v15). At head_dim 256 always 4
    (its four value accumulators and query operands take 248-253 registers at 4 heads)."""
    kv_heads = cache.key_codes.shape[1]
    hg = heads // kv_heads
    if heads_per_program is None:
        heads_per_program = 8 if hg > 4 else 4
    if head_dim == 256:
        heads_per_program = 4
    r4 = max(4, _pow2(min(hg, heads_per_program)))
    tb = cache.token_block
    ngk = head_dim // cache.key_group_size if tb == 1 else 1
    ngv = head_dim // cache.value_group_size
    tiles = cache.value_tiles
    ring = head_dim == 128 and tb == 1 and ngk == ngv == 2 and r4 == 4 and not tiles
    return dict(HKV=kv_heads, HG=hg, R4=r4, S=cache.sink_tokens, W=cache.recent_tokens, NW=window_programs,
                BLOCK_N=64, STAGES=_gluon().STAGES if ring else 0, NGK=ngk, NGV=ngv, TB=tb, HT=-(-hg // r4),
                D=head_dim, MASK_ALL=mask_every_tile(head_dim, r4, ngv, tiles),
                KEYS_AHEAD=keys_ahead(head_dim, r4, tb, ngk, tiles), VT=tiles, SLIDE=cache.window is not None,
                HOLE=hole(cache), PF=prefetch_tiles(head_dim, r4, tb),
                STRIDED=strided_tiles(head_dim, r4, tb, tiles), FLAT=False, TMA=0)


def hole(cache: Int2KVCache) -> bool:
    """Whether the decode programs skip a store's expired rows (expired_rows): a window's store with keys per
    channel, whose rows hold up to G − 1 tokens of its oldest block that have left the window."""
    return cache.window is not None and cache.token_block > 1


def keys_ahead(head_dim: int, heads_per_program: int, token_block: int, key_groups: int,
               value_tiles: bool = False) -> bool:
    """Whether the Gluon programs load each tile's key words during the tile before. The first key product
    waited on them (ncu, Qwen3-8B 100K x 8: 14% of the warps' stall samples on that one instruction), but
    the words take registers through the tile: only the 4-head programs have them to spare, and not the
    128-register keys-per-token program with two groups a token (it spills) nor head_dim 256 with keys per
    channel. H100, 100K x 8, graph, in the tile / ahead (kernel_notes.md v17): Gemma-3-12B 0.463 / 0.445 ms,
    Gemma-3-270M 0.0943 / 0.0900, SmolLM2 (d 64, keys per channel) 0.0683 / 0.0652, Qwen3-8B with groups of
    128 0.2136 / 0.2052, keys per channel 0.2538 / 0.2516, Llama-3.2-1B 0.1289 / 0.1274; left out: Qwen3-8B
    0.226 / 0.257, 8-head programs 1-3% slower, Gemma-3 keys per channel 2-5% slower.
    With the value codes in tiles (value_tiles: 4 vector loads a tile where there were 32 of 2 bytes) the 8-head
    programs with keys per token and at head_dim 64, and head_dim 256 with keys per channel, run faster ahead
    (H200, 100K x 8, graph, tiles / tiles ahead, kernel_notes.md v18): GQA 5 0.2449 / 0.2373 ms, GQA 8 0.2488 /
    0.2379, GQA 16 0.1339 / 0.1275, Qwen2.5-0.5B (d 64, keys per channel) 0.0567 / 0.0547, Gemma-3-12B keys per
    channel 0.503 / 0.478; the 8-head programs with keys per channel at head_dim 128 still lose ahead (GQA 5-8
    4-9%), and so do the 4-head ones left out above (Qwen3-8B 3%, MHA 5%)."""
    if value_tiles and (heads_per_program == 8 and (token_block == 1 or head_dim == 64)):
        return True
    if value_tiles and head_dim == 256 and token_block > 1:
        return True
    return (heads_per_program == 4 and not (head_dim == 128 and token_block == 1 and key_groups == 2)
            and not (head_dim == 256 and token_block > 1))


def prefetch_tiles(head_dim: int, heads_per_program: int, token_block: int) -> int:
    """Tiles ahead (0: none) that the Gluon programs hint into L2 during each tile (decode_gluon._prefetch_tile).
    With keys per channel the 8-head programs at head_dim 128 and the programs at head_dim 64 wait longest on
    their loads; H100, graph, best of 3 interleaved, shipped / one tile ahead (kernel_notes.md v24): GQA 8 100K x
    8 0.2816 / 0.2694 ms, 32K x 8 0.1242 / 0.1154, 100K x 1 0.0664 / 0.0568; GQA 5 100K x 8 0.2694 / 0.2649, 16K
    x 8 0.0786 / 0.0742; GQA 7 100K x 8 0.1500 / 0.1455; SmolLM2 (9/3, d 64) 100K x 8 0.0600 / 0.0572, 16K x 8
    0.0235 / 0.0237; Qwen2.5-0.5B (14/2, d 64) 100K x 8 0.0557 / 0.0544. A useless hint (the tile in hand) in the
    same loop gains 0-4% at most of these points, so most of the gain is the prefetch. Elsewhere hints lose:
    Qwen3-8B's keys per token 12-19% slower two tiles ahead, its keys per channel 0-6%, Gemma 3 270M's keys per
    channel 2.5% one tile ahead."""
    if token_block > 1 and (head_dim == 64 or (head_dim == 128 and heads_per_program == 8)):
        return 1
    return 0


def strided_tiles(head_dim: int, heads_per_program: int, token_block: int, value_tiles: bool = True) -> bool:
    """Whether Gluon split i of the A that have rows takes tiles i, i + A, i + 2A, ... (decode_gluon's STRIDED)
    rather than a chunk of consecutive ones. A read-only loop over the store with the same grid reads 1-2.5%
    faster strided (neighbouring programs on neighbouring tiles: bench/read_ceiling.py, H100, 100K, batch 1 / 8 /
    32), and ptxas schedules the loop differently. H100, graph, best of 3 interleaved, chunks / strided (ms,
    kernel_notes.md v25): Qwen3-8B keys per token 100K x 8 0.2124 / 0.2081, 100K x 1 0.0492 / 0.0479, 32K x 8
    0.0928 / 0.0911, 100K x 32 0.7664 / 0.7643, with groups of 128 0.1939 / 0.1886, MHA 0.7416 / 0.7359; at
    head_dim 64 Llama-3.2-1B 0.1188 / 0.1163, SmolLM2 (keys per channel) 0.0578 / 0.0564, Qwen2.5-0.5B 0.0546 /
    0.0540. Elsewhere it ties or loses: the 8-head programs at head_dim 128 (GQA 5 with keys per channel 0.2601 /
    0.2767, GQA 7 0.1452 / 0.1512, GQA 8 keys per token 0.2382 / 0.2418), Qwen3-8B with keys per channel, GQA 16
    and head_dim 256 within 0.7%. Measured with the value codes in tiles (the default layout) only: with them in
    rows the 4-head program at head_dim 128 spills 8 bytes strided, so there it stays off (and the cp.async
    ring, which reads rows only, never takes tiles strided)."""
    return value_tiles and (head_dim == 64 or (head_dim == 128 and heads_per_program == 4 and token_block == 1))


def flat_splits(pairs: int, splits_a_wave: int, ring: bool = False) -> bool:
    """Whether the Gluon programs take their rows flat (decode_gluon's FLAT) rather than in whole splits a pair: where
    whole splits, ⌊S / pairs⌋ a pair of the S a wave holds, would leave more than 8% of the wave idle; 12% where
    whole splits would read through the TMA ring (ring: tma_stages), which flat rows do not and which gains 3-5%.
    Flat rows cost about 4% where nothing idles (chunks, not strided tiles, and the loop over pairs), so they pay
    only where more does. H100, Qwen3-8B's shape, graph, best of 3 interleaved, whole splits / flat (µs,
    kernel_notes.md v27): 100K x 30 (1,920 of 2,112 busy) 757.9 / 741.2, ragged 644.1 / 630.8; 100K x 28 (2,016)
    692.6 / 694.3; 100K x 32 (2,048) 774.8 / 789.7; 100K x 24 (all) 574.9 / 597.0. Where no strided tiles are lost more (100K x 30: GQA 8 874.9 /
    824.3, GQA 5 866.7 / 798.2, Qwen3-8B with keys per channel 853.7 / 795.6, head_dim 64 412.8 / 391.4). Against
    whole splits through the ring, flat / ring (µs, bench/results/tma_ring.md): 100K x 30 (9.1% idle) 740.4 / 731.3,
    32K x 30 275.9 / 267.3; 100K x 55 (16.7% idle) 1312.2 / 1413.1."""
    idle = splits_a_wave - pairs * (splits_a_wave // pairs)
    return pairs < splits_a_wave and idle > (0.12 if ring else 0.08) * splits_a_wave


def flat_programs_a_pair(splits_a_wave: int, pairs: int) -> int:
    """The most flat programs (decode_gluon's FLAT) that meet one pair: a pair's P units span ⌈P / Q⌉ programs of Q
    units, and one more where neither of its ends falls on a program's edge."""
    return -(-splits_a_wave // pairs) + 1


def tma_stages(major: int, constexprs: dict, pairs: int, rows: int) -> int:
    """Stages of the TMA ring through which the Gluon programs read their tiles (decode_gluon's TMA; 0: loads into
    registers). A program issues each tile's two bulk copies (TMA: compute capability 9 and later) two tiles ahead
    and reads its operands from shared memory, so its loop waits on no global load. Only with value groups of 64 and
    the value codes in tiles (not a window's store, not flat rows), and the outputs are those of the loads, bit for
    bit. H100, graph, best of 3 interleaved, loads / ring, µs:
    - keys per token, two groups a token, 4 heads a program (Qwen3-8B; kernel_notes.md v32, tma_ring.md): from 128
      (sequence, KV head) pairs, or where a program reads 2,048 rows (32 tiles) or more. 100K x 32 (12,480 rows a
      program) 760.8 / 728.8, ragged 676.9 / 612.5; 100K x 16 390.8 / 367.0; 32K x 32 282.2 / 262.9; 16K x 16
      (1,004 rows) 95.6 / 93.4; 8K x 32 (984) 109.6 / 103.9; with fewer pairs 100K x 8 (64 pairs, 3,022 rows)
      204.7 / 197.5; 64K x 8 (1,977) 143.7 / 143.6; 48K x 8 (1,526) 114.8 / 117.0; 32K x 8 (1,024) 85.0 / 88.4;
      100K x 4 (1,535) 113.3 / 114.6; 100K x 1 (448) 47.4 / 48.6: there the two-tile prologue is not hidden. MHA
      (32/32) 100K x 8 738.9 / 689.6, 8K x 8 99.5 / 94.9; GQA 2 (16/8) 100K x 16 386.3 / 362.0.
    - keys per channel in blocks of a tile (64 tokens), 4 or 8 heads a program: everywhere (kernel_notes.md v33,
      tma_ring_channel.txt). Qwen3-8B 100K x 32 835.5 / 792.8, 100K x 8 228.7 / 216.5, 32K x 32 310.7 / 287.4, 32K x 8
      93.7 / 89.3, 16K x 16 97.5 / 93.6, 100K x 1 52.6 / 52.0; 8 heads a program: GQA 8 (64/8) 100K x 8 263.0 /
      232.6, 32K x 8 107.9 / 95.7, 100K x 1 58.0 / 58.0; GQA 5 (40/8) 258.7 / 230.5; GQA 7 (28/4) 142.2 / 126.0.
    - keys per token, two groups a token, 8 heads a program (GQA 5-16, a score tile a group; tma_ring_gqa.txt): where a
      program reads 768 rows (12 tiles) or more. GQA 8 (64/8) 100K x 8 235.8 / 221.4, 100K x 32 862.2 / 813.8, 32K
      x 8 100.6 / 93.4, 16K x 8 (1,004 rows) 67.8 / 61.9, 100K x 1 (891) 57.1 / 53.7; GQA 5 (40/8) 100K x 8 232.5 /
      218.9; GQA 16 (32/2, two programs a split) 100K x 8 124.1 / 120.3, 32K x 8 (1,014) 58.8 / 57.9, 100K x 1 (512)
      48.6 / 49.7.
    - head_dim 64 (tma_ring_d64.txt), keys per channel at 4 and 8 heads a program and keys per token at 4: everywhere
      measured. SmolLM2 (9/3, keys per channel) 100K x 8 56.5 / 55.4, 16K x 8 (192 rows) 24.5 / 23.5; Qwen2.5-0.5B
      (14/2, 8 heads a program) 100K x 8 50.6 / 48.4; Llama-3.2-1B (32/8, keys per token) 100K x 8 116.3 / 112.3,
      100K x 1 31.5 / 31.1.
    - head_dim 256 (tma_ring_d256.txt; Gemma 3 270M 4/1, Gemma 3 12B 16/8): keys per channel from 256 rows a program,
      keys per token from 64 pairs or 2,048 rows. Keys per channel 4/1 100K x 8 (768 rows) 90.2 / 80.9, 32K x 8
      (256) 51.1 / 49.3, 16K x 8 (128) 38.1 / 40.5, 100K x 1 (128) 36.1 / 40.6; 16/8 100K x 8 484.5 / 431.1, 16K x 8
      117.6 / 106.4, 100K x 1 (768) 86.8 / 85.3. Keys per token 16/8 100K x 8 385.5 / 367.3, 32K x 8 (2,028) 156.6 /
      152.9, 8K x 8 (64 pairs, 492 rows) 71.3 / 70.2; 4/1 100K x 32 (3,022) 206.5 / 204.1; but 4/1 100K x 8 (768)
      75.9 / 76.9, 64K x 8 (510) 61.2 / 61.9, 32K x 8 44.2 / 48.7, 16K x 8 33.9 / 35.6.
    Three and four stages hold more shared memory, so fewer programs fit a multiprocessor, and lose (v31; with keys
    per channel, 12 programs a multiprocessor, 3 stages lose 0.2-4%, and the 4-head programs held to 128 registers
    for 16 a multiprocessor spill and lose 5-13%: v33)."""
    c = constexprs
    if major < 9 or c["D"] not in (64, 128, 256) or c["NGV"] * 64 != c["D"] or not c["VT"] or c["SLIDE"]:
        return 0
    if c["TB"] == c["BLOCK_N"] and c["D"] == 256:
        return 2 if rows >= 256 else 0
    if c["TB"] == c["BLOCK_N"] and c["R4"] in (4, 8):
        return 2
    if c["TB"] > 1 or c["NGK"] * 64 != c["D"]:
        return 0
    if c["D"] == 256:
        return 2 if pairs >= 64 or rows >= 2048 else 0
    if c["D"] == 64:
        return 2 if c["R4"] == 4 else 0
    if c["R4"] == 8:
        return 2 if rows >= 768 else 0
    return 2 if c["R4"] == 4 and (pairs >= 128 or rows >= 2048) else 0


def mask_every_tile(head_dim: int, heads_per_program: int, value_groups: int, value_tiles: bool = False) -> bool:
    """Whether the Gluon programs mask every tile's scores to their rows (else only a program's last tile, behind a
    warp-uniform branch). The branch takes 25-50 instructions a tile off the loop, but ptxas schedules the
    4-head head_dim 128 loop with two value groups a token worse around it: H100, 100K x 8, graph, every tile /
    last tile (kernel_notes.md v17): Qwen3-8B 0.2259 / 0.2280 ms, keys per channel 0.2542 / 0.2586, MHA 0.802 /
    0.815; elsewhere the branch wins or ties: Llama-3.2-1B (d 64) 0.1466 / 0.1290, Gemma-3-12B (d 256) 0.490 /
    0.466, keys per channel 0.567 / 0.547, Qwen3-8B with groups of 128 0.2184 / 0.2136, GQA 5-16 within 0.4% or
    up to 1.7% faster. With the value codes in tiles (value_tiles) the branch wins there too (H100, graph, every
    tile / last tile, kernel_notes.md v19): Qwen3-8B 100K x 8 0.2234 / 0.2164 ms, 100K x 1 0.0508 / 0.0499, keys
    per channel 0.2428 / 0.2356 and 0.0554 / 0.0538, MHA 0.7917 / 0.7568."""
    return not value_tiles and head_dim == 128 and heads_per_program == 4 and value_groups == 2


def gluon_waves(pairs: int, max_int2: int, head_dim: int, slots: int, ht: int, num_sms: int, min_chunk: int) -> int:
    """Gluon INT2 splits a multiprocessor (each split is ht programs; slots: the programs one multiprocessor holds).
    One whole wave, but at head_dim 64/128 for 16 (sequence, KV head) pairs or fewer (H100, graph,
    kernel_notes.md v15, v16):
    - from 64K INT2 rows at 8 pairs or fewer, one program a multiprocessor fewer: the window programs, on a
      stream of their own in a graph, then start beside the INT2 programs rather than after them (100K x 1:
      Qwen3-8B 0.0546 -> 0.0514 ms, GQA 16 0.0722 -> 0.0619, d 64 0.0420 -> 0.0408; at 16 pairs 3-14% slower);
    - where a whole wave's programs would read 256 rows or fewer each, 3/4 of the slots (Qwen3-8B's shape:
      32K x 1 0.0330 -> 0.0293, 48K x 1 0.0401 -> 0.0357, 64K x 1 0.0450 -> 0.0418, 16K x 2 0.0339 -> 0.0303;
      keys per channel 16K x 2 0.0354 -> 0.0322 but 32K x 1 0.0305 -> 0.0319; d 64 within 1%); longer
      programs lose with it (100K x 1 0.0502 -> 0.0524, 100K x 2 0.078 -> 0.084).
    Not at head_dim 256, where 8 programs a multiprocessor take longer tiles: there a whole wave won (100K x 8
    pairs 0.0956 against 0.0983 ms with the spare slot)."""
    if pairs <= 16 and head_dim <= 128:
        if pairs <= 8 and max_int2 >= 65536:
            return max(1, (slots - 1) // ht)
        chunk, _ = plan_splits(pairs, 1, max_int2, 64, num_sms, slots // ht, min_chunk)
        if chunk <= 256:
            return max(1, slots * 3 // 4 // ht)
    return max(1, slots // ht)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple:
    return torch.cuda.get_device_capability(device)


def programmatic_launch(device: torch.device) -> bool:
    """Whether decode's launches can start before the one they depend on ends (programmatic dependent launch,
    griddepcontrol): CUDA devices of compute capability 9.0 or newer (Hopper on)."""
    return device.type == "cuda" and _capability(device)[0] >= 9


_GLUON_SLOTS: dict = {}


def _gluon_options(constexprs: dict) -> dict:
    """The Gluon programs' compile options: one warp; 128 registers a thread at head_dim 64 with keys per
    channel (ptxas picks up to 168 there; held to 128 they run 10-25% faster with no spills: H100, 100K x 8,
    kernel_notes.md v12) and for 4 heads a program with keys per token at head_dim 128 (168 since the block
    codes are floats by prmt, 12 programs a multiprocessor: 5% slower than 16 at 128, which spill nothing;
    kernel_notes.md v15; with groups of 128 it spills 24 bytes and still runs 5% faster). Not with the ring
    (STAGES > 0), which spills more there."""
    c = constexprs
    if (c["D"] == 64 and c["TB"] > 1) or (c["D"] == 128 and c["TB"] == 1 and c["R4"] == 4 and c["STAGES"] == 0):
        return dict(num_warps=1, maxnreg=128)
    return dict(num_warps=1)


def _gluon_programs_per_sm(cache: Int2KVCache, constexprs: dict, device: torch.device) -> int:
    """One-warp Gluon programs a multiprocessor holds (resident_warps), from the compiled kernel (compiled once
    per setting, without launching). Triton 3.6 compiles the loop to 128 registers a thread (16 programs),
    later ones to more; the grid is sized for whichever runs."""
    key = (device, tuple(sorted(constexprs.items())))
    if key not in _GLUON_SLOTS:
        qt = torch.empty(1, dtype=torch.bfloat16, device=device)
        f32 = torch.empty(1, dtype=torch.float32, device=device)
        args = _gluon_args(qt, cache, f32, f32, f32, 1.0, 2, 512, 2, constexprs.get("TMA", 0) > 0)
        compiled = _gluon()._int2_split_kernel.warmup(*args, grid=(1, 1), **_gluon_options(constexprs),
                                                      **constexprs)
        compiled._init_handles()
        smem = torch.cuda.get_device_properties(device).shared_memory_per_multiprocessor
        _GLUON_SLOTS[key] = resident_warps(compiled.n_regs, compiled.metadata.shared, smem)
    return _GLUON_SLOTS[key]


def resident_warps(regs: int, shared: int, smem_per_sm: int) -> int:
    """One-warp programs of `regs` registers a thread and `shared` bytes that a Hopper multiprocessor holds at
    once (at most 32). A warp's registers come from the file of one of its 4 schedulers, 16,384 each, in steps
    of 8 a thread: 4·⌊16384 / (32·regs)⌋, not ⌊65536 / (32·regs)⌋ (at 96 registers 20, not 21: a grid sized
    for 21 ran its last program of each multiprocessor as a second wave, 0.232 against 0.161 ms at 100K x 8,
    d 64; kernel_notes.md v13). Shared memory, less the 1 KiB the driver keeps a program, is shared among them."""
    regs = -(-regs // 8) * 8
    return max(1, min(32, 4 * (16384 // (32 * regs)), smem_per_sm // (shared + 1024)))


@functools.lru_cache(maxsize=None)
def _gluon():
    """The decode_gluon module, or None where this triton has no Gluon."""
    try:
        from oscar_core.triton import decode_gluon
    except ImportError:
        return None
    return decode_gluon


def _gluon_args(qt, cache, po, pm, pl, log2_scale, n_int2, min_chunk, ns, tma: bool = False) -> tuple:
    """decode_gluon._int2_split_kernel's arguments before its constexprs (zeros read as bytes), with the store's TMA
    descriptors where its programs read through a TMA ring (tma_descriptors; None otherwise)."""
    return (qt, cache.key_codes.view(torch.int32), cache.key_scale, cache.key_zero.view(torch.uint8),
            cache.value_codes.view(torch.int16), cache.value_scale, cache.value_zero.view(torch.uint8),
            cache.lengths, po, pm, pl, log2_scale, cache.key_codes.shape[2], n_int2, min_chunk, ns,
            *(tma_descriptors(cache) if tma else (None,) * 2))


_TMA_DESCRIPTORS: dict = {}   # id(key codes) -> (their weak reference, the arrays' addresses, the descriptors or None)


def _one_after_another(arrays) -> bool:
    """Whether contiguous arrays of one size lie back to back in one allocation, in this order."""
    a0 = arrays[0]
    size = a0.numel() * a0.element_size()
    return all(a.is_contiguous() and a.numel() * a.element_size() == size
               and a.untyped_storage().data_ptr() == a0.untyped_storage().data_ptr()
               and a.data_ptr() == a0.data_ptr() + i * size for i, a in enumerate(arrays))


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
    Value groups of 64, value codes in tiles (tma_stages). A descriptor holds only an address, shape and strides, so
    they are built once (about 60 µs of host time) and kept beside the store's key codes for as long as those live (a
    weak key: a store that grows or is freed takes its descriptors with it)."""
    codes = (cache.key_codes, cache.value_codes)
    meta = (cache.key_scale, cache.key_zero, cache.value_scale, cache.value_zero)
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


def decode_attention(q: torch.Tensor, cache: Int2KVCache, key_rotation: torch.Tensor,
                     value_rotation: torch.Tensor | None, value_mean: torch.Tensor | None, scaling: float,
                     max_length: int | None = None, block_n: int | None = None, block_w: int = 64,
                     num_warps: int | None = None, num_stages: int | None = None, waves: int | None = None,
                     use_asm: bool | None = None, out: torch.Tensor | None = None,
                     key_t: bool | None = None, fused: bool = False, gluon: bool | None = None,
                     heads_per_program: int | None = None, graph: bool | None = None,
                     pdl: bool | None = None, flat: bool | None = None) -> torch.Tensor:
    """Triton kvstore.decode_attention_reference: q [B, H, d] original space -> o [B, H, d].

    Three launches (query rotation, split kernel, reduce), or with fused one: the query rotated inside
    the split kernel and the splits merged by the last program of each (sequence, KV head); correct, but
    measured slower (kernel_notes.md v7), so not the default. No device-to-host reads: max_length is only
    a hint for how many programs share the INT2 rows (the largest length expected, e.g. a static bound for
    CUDA-graph capture; None: the store's capacity); each sequence's rows are divided among them by its
    own length, so results never depend on it and the launch grid never depends on the data.
    out, if given, is a contiguous [B, H, d] tensor (float32 or bf16) written in place.
    value_rotation None: the output stays in the values' stored space, õ (+ μ_V), for a model whose weights hold
    R_V (absorb.py); the reduce then only merges the splits.
    Launch settings left as None come from default_config (key_t: the score tile's orientation).
    gluon: the INT2 programs in Gluon (decode_gluon.py, one launch of their own beside the window programs);
    None: where gluon_supported says they run, for more than 16 (sequence, KV head) pairs, from 4K INT2 rows,
    or for more than 4 query heads per KV head (at head_dim 256 below 8 pairs only for keys per channel from
    64K INT2 rows);
    True to require them (ValueError where they cannot).
    Every sequence needs at least one token. The cache tensors must be contiguous.
    A store with keys per channel (cache.key_axis "channel") is read in tiles of at most its key block
    (block_n ≤ G), its scales folded into the query per tile. heads_per_program: query heads a Gluon
    program takes (4, 8 or 16; a KV head's HG heads are split among cdiv(HG, it) programs; None: gluon_constexprs'
    rule).
    Raises ValueError (before any launch) for a shape it does not support (check_shape).
    graph: replay a CUDA graph of this call kept on the store (_replayed); None: on CUDA when no capture is
    under way (an eager caller). Its launches are those of graph=False with max_length rounded up to a power
    of two, so that a growing context recaptures only when it doubles.
    pdl: each launch after the query rotation starts before the one it depends on ends (programmatic dependent
    launch: it waits in gdc_wait, so its launch and prologue overlap the tail of the one before); beyond 8
    (sequence, KV head) pairs the window programs (without the Gluon programs, the split programs) are still
    launched plainly, after the rotation ends. None: at 8 pairs or fewer, and beyond them with the Gluon
    programs, where programmatic_launch says the device has it and fused is off. True to require it (ValueError
    where it cannot).
    flat: the Gluon programs take their rows flat (decode_gluon's FLAT: each program an equal share of a line of
    every pair's rows, crossing from one pair into the next) rather than in whole splits a pair; None: where
    flat_splits says; True to require it (ValueError without the Gluon programs or with their ring)."""
    if graph is None:
        graph = q.is_cuda and not torch.cuda.is_current_stream_capturing()
    if graph:
        options = _graph_options(max_length, block_n=block_n, block_w=block_w, num_warps=num_warps,
                                 num_stages=num_stages, waves=waves, use_asm=use_asm, key_t=key_t, fused=fused,
                                 gluon=gluon, heads_per_program=heads_per_program, pdl=pdl, flat=flat)
        return _replayed(q, cache, key_rotation, value_rotation, value_mean, scaling, out, options)
    bsz, heads, d = q.shape
    has_mean = value_mean is not None
    plan = launch_plan(q, cache, max_length, block_n, block_w, num_warps, num_stages, waves, use_asm, key_t, fused,
                       gluon, heads_per_program, has_mean, pdl, value_rotation is not None, flat)
    kv_heads = cache.key_codes.shape[1]
    q_in = q.contiguous() if fused else rotate_query_bf16(q, key_rotation, plan.pdl)
    work = torch.empty(plan.work, dtype=torch.float32, device=q.device)
    split = plan.split
    po, pm, pl = work[:split * d], work[split * d:split * (d + 1)], work[split * (d + 1):split * (d + 2)]
    py = work[split * (d + 2):]
    if out is None:
        out = torch.empty(bsz, heads, d, dtype=q.dtype, device=q.device)
    rk = key_rotation.float().contiguous()
    if value_rotation is None:
        # Only the fused merge reads it then.
        rv = torch.eye(d, device=q.device).expand(kv_heads, d, d).contiguous() if fused else rk
    else:
        rv = value_rotation.float().contiguous()
    mean = value_mean.float().contiguous() if has_mean else rv
    counters = _counters(q.device, bsz * kv_heads * plan.reduce_grid[2])
    scale_log2 = scaling * LOG2E
    # Captured into a CUDA graph, the window programs run on a stream of their own beside the Gluon INT2
    # programs (two branches of the graph); eager calls keep one stream (their time is the host's).
    side = _side_stream(q.device) if plan.gluon and torch.cuda.is_current_stream_capturing() else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(q.device))
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        # The window programs (with gluon), or every program.
        _launch(_split_kernel)(
            plan.split_grid, q_in, rk, cache.key_sink, cache.value_sink, cache.key_recent, cache.value_recent,
            cache.key_codes, cache.key_scale, cache.key_zero, cache.value_codes, cache.value_scale,
            cache.value_zero, cache.lengths, po, pm, pl, counters, rv, mean, out, scale_log2, math.log2(scale_log2),
            cache.key_codes.shape[2], plan.n_int2, plan.min_chunk, plan.ns, **plan.split_consts)
    if plan.gluon:
        _launch(_gluon()._int2_split_kernel)(
            plan.gluon_grid, *_gluon_args(q_in, cache, po, pm, pl, math.log2(scale_log2), plan.n_int2, plan.min_chunk,
                                          plan.ns, plan.gluon_consts.get("TMA", 0) > 0), **plan.gluon_consts)
    if side is not None:
        torch.cuda.current_stream(q.device).wait_stream(side)
    if not fused:
        _launch(_reduce_kernel)(plan.reduce_grid, po, pm, pl, py, counters, rv, mean, out, plan.ns,
                                **plan.reduce_consts)
    return out


def _graph_options(max_length: int | None, block_n=None, block_w=64, num_warps=None, num_stages=None, waves=None,
                   use_asm=None, key_t=None, fused=False, gluon=None, heads_per_program=None, pdl=None,
                   flat=None) -> dict:
    """The launch settings of a graph of decode_attention (every keyword but q's and the store's), max_length
    rounded up to a power of two."""
    return dict(max_length=None if max_length is None else _pow2(max_length), block_n=block_n, block_w=block_w,
                num_warps=num_warps, num_stages=num_stages, waves=waves, use_asm=use_asm, key_t=key_t, fused=fused,
                gluon=gluon, heads_per_program=heads_per_program, pdl=pdl, flat=flat)


GRAPHS_PER_STORE = 4     # each holds its own work buffers (a private memory pool)
DIRECT_GRAPHS = 2        # graphs at the caller's own addresses, per graph kept on the store; the calls looked back on
_STORE_FIELDS = ("key_sink", "value_sink", "key_recent", "value_recent", "key_codes", "key_scale", "key_zero",
                 "value_codes", "value_scale", "value_zero", "lengths")


@dataclasses.dataclass
class _Replays:
    """The CUDA graphs of one setting of a call over one store (_replay)."""
    graph: torch.cuda.CUDAGraph     # reads inputs, writes o
    inputs: tuple
    o: torch.Tensor
    direct: dict = dataclasses.field(default_factory=dict)  # the call's addresses -> graph reading, writing there
    recent: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=DIRECT_GRAPHS))


def graph_key(q, out, cache, key_rotation, value_rotation, value_mean, scaling, options: dict) -> tuple:
    """What a graph of a decode_attention call over cache depends on: everything it reads by address (the store's
    tensors, the rotations, the mean), q's and out's shape and dtypes, and every launch setting (options)."""
    mean_ptr = None if value_mean is None else value_mean.data_ptr()
    rv_ptr = None if value_rotation is None else value_rotation.data_ptr()
    return (tuple(q.shape), q.dtype, q.device, out.dtype, key_rotation.data_ptr(), rv_ptr, mean_ptr, scaling,
            tuple(options.values()), tuple(getattr(cache, f).data_ptr() for f in _STORE_FIELDS))


def _replay(graphs: dict, key: tuple, launches, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
    """launches(*inputs, out) as one CUDA-graph replay; key: what the launches depend on besides the inputs' and
    out's addresses (graph_key). The graph is captured after the first direct call of a key, on inputs and an
    output of its own, and kept in graphs (a store's, so it never outlives the tensors it reads); the
    GRAPHS_PER_STORE latest keys are kept. A call copies its inputs into the graph's, replays it and copies its
    output out, unless its inputs and out are where one of the DIRECT_GRAPHS calls before had them (a caller with
    fixed buffers, or an allocator handing the same blocks back, every step or every other step): then a graph
    reading those inputs and writing that out is captured, and calls at those addresses replay it alone. A copy
    costs more host time than the replay (H200: 7-11 µs each against 3-6, bench/results/eager_parts_h200.txt), so the
    inputs go in one launch. Calls on one stream at a time."""
    tensors = inputs + (out,)
    where = tuple(t.data_ptr() for t in tensors) if all(t.is_contiguous() for t in tensors) else None
    hit = graphs.get(key)
    if hit is None:
        launches(*inputs, out)
        while len(graphs) >= GRAPHS_PER_STORE:    # the oldest goes (a context that grew past its bucket)
            graphs.pop(next(iter(graphs)))
        own, o = tuple(t.clone(memory_format=torch.contiguous_format) for t in inputs), torch.empty_like(out)
        hit = graphs[key] = _Replays(_graph_of(lambda: launches(*own, o), out.device), own, o)
        hit.recent.append(where)
        return out
    direct = hit.direct.get(where)
    if direct is not None:
        direct.replay()
        return out
    torch._foreach_copy_(hit.inputs, inputs)
    hit.graph.replay()
    out.copy_(hit.o)
    if where is not None and where in hit.recent:
        while len(hit.direct) >= DIRECT_GRAPHS:
            hit.direct.pop(next(iter(hit.direct)))
        hit.direct[where] = _graph_of(lambda: launches(*inputs, out), out.device, hit.graph.pool())
    hit.recent.append(where)
    return out


def _replayed(q, cache, key_rotation, value_rotation, value_mean, scaling, out, options: dict) -> torch.Tensor:
    """decode_attention(q, ..., graph=False, **options) as one CUDA-graph replay (_replay), kept in cache.graphs
    under graph_key."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)

    def launches(q, out):
        decode_attention(q, cache, key_rotation, value_rotation, value_mean, scaling, out=out, graph=False, **options)
    key = graph_key(q, out, cache, key_rotation, value_rotation, value_mean, scaling, options)
    return _replay(cache.graphs, key, launches, (q,), out)


def _graph_of(launches, device, pool=None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of what launches() launches, captured on a side stream (in the memory pool of a graph never
    replayed at the same time, or None: a pool of its own)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        launches()
        graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph


def decode_step(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, write, cache: Int2KVCache,
                key_rotation: torch.Tensor, value_rotation: torch.Tensor | None, value_mean: torch.Tensor | None,
                scaling: float, max_length: int | None = None, out: torch.Tensor | None = None,
                graph: bool | None = None) -> torch.Tensor:
    """A decode step's whole work on one layer's store: write(keys, values) (the new token's launches), then
    decode_attention(q, cache, ...) over the store that now holds it -> [B, H, d].

    graph (None: on CUDA when no capture is under way, an eager caller): both, the write's launches and then the
    decode programs, as one CUDA-graph replay (_replay: the query, keys and values copied into the graph's in one
    launch, or the graph at the call's own addresses): a step's host work is then one replay a layer. The graphs
    are kept in cache.graphs beside decode_attention's, so they never outlive what they read; a call that matches
    one's key (write, the new tokens' shapes and strides, graph_key) reads exactly its own tensors. write: a
    function of (keys, values), or a method of the store's one writer (its function is the key, so that the
    store's graphs hold no reference to their owner), that launches the same every step: what changes between
    steps is read on the device (the store's lengths)."""
    if graph is None:
        graph = q.is_cuda and not torch.cuda.is_current_stream_capturing()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not graph:
        write(keys, values)
        return decode_attention(q, cache, key_rotation, value_rotation, value_mean, scaling, max_length, out=out,
                                graph=False)
    options = _graph_options(max_length)

    def launches(q, keys, values, out):
        write(keys, values)
        decode_attention(q, cache, key_rotation, value_rotation, value_mean, scaling, out=out, graph=False, **options)
    key = (("step", getattr(write, "__func__", write), keys.shape, keys.stride(), values.stride(), keys.dtype,
            values.dtype) + graph_key(q, out, cache, key_rotation, value_rotation, value_mean, scaling, options))
    return _replay(cache.graphs, key, launches, (q, keys, values), out)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """decode_attention's launch settings for one shape of call, worked out once (_PLANS)."""
    gluon: bool
    pdl: bool               # programmatic dependent launch after the query rotation
    ns: int                 # splits a (sequence, KV head): window programs, then INT2 programs
    n_int2: int             # INT2 splits a (sequence, KV head); flat: the number of (sequence, KV head) pairs
    min_chunk: int
    split: int              # partial rows: B·H_kv·ns·HG
    work: int               # float32 elements of the partials and the reduce's shares
    split_grid: tuple
    split_consts: dict
    gluon_grid: tuple
    gluon_consts: dict
    reduce_grid: tuple
    reduce_consts: dict


_PLANS: dict = {}


def launch_plan(q, cache, max_length=None, block_n=None, block_w=64, num_warps=None, num_stages=None, waves=None,
                use_asm=None, key_t=None, fused=False, gluon=None, heads_per_program=None, has_mean=True,
                pdl=None, rotate_values=True, flat=None) -> _Plan:
    """The launch settings decode_attention(q, cache, ...) uses with these arguments (plan.gluon: whether the
    Gluon programs take the INT2 rows), worked out on the first call of a shape and kept in _PLANS."""
    key = (q.device, tuple(q.shape), cache.key_codes.shape[1:3], cache.key_group_size, cache.value_group_size,
           cache.key_axis, cache.value_layout, cache.sink_tokens, cache.ring_slots, hole(cache), max_length, block_n,
           block_w,
           num_warps, num_stages,
           waves, use_asm, key_t, fused, gluon, heads_per_program, has_mean, pdl, rotate_values, flat)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _plan(q, cache, max_length, block_n, block_w, num_warps, num_stages, waves, use_asm,
                                   key_t, fused, gluon, heads_per_program, has_mean, pdl, rotate_values, flat)
    return plan


def _plan(q, cache, max_length, block_n, block_w, num_warps, num_stages, waves, use_asm, key_t, fused, gluon,
          heads_per_program, has_mean, pdl, rotate_values, flat) -> _Plan:
    """Check the shape and derive every launch setting of decode_attention (its docstring)."""
    bsz, heads, d = q.shape
    kv_heads = cache.key_codes.shape[1]
    pairs = bsz * kv_heads     # (sequence, KV head) pairs
    hg = heads // kv_heads
    gk, gv = cache.key_group_size, cache.value_group_size
    tb = cache.token_block
    check_shape(heads, kv_heads, d, gk, gv, cache.key_axis)
    if tb > 1:
        gk = 64         # keys per channel: the query's channels stacked as rows in groups of 64 (_channel_scores)
    if use_asm is None:
        use_asm = q.is_cuda
    if max_length is None:
        max_length = cache.key_codes.shape[2] + cache.sink_tokens + cache.recent_tokens
    max_int2 = min(max(max_length - cache.sink_tokens - cache.recent_tokens, 0), cache.key_codes.shape[2])
    if gluon is None:
        # The Gluon programs wherever they serve, but for short contexts at small batch and few heads, where
        # the Triton programs' one launch fewer may pay: from 8K tokens at batch 1 the Gluon programs win
        # (H100, graph, 8K x 1: Qwen3-8B 0.023 against 0.025 ms, keys per channel 0.024 against 0.032,
        # Llama-3.2-1B's d 64 0.025 both; GQA 16 0.033 against 0.065; kernel_notes.md v14).
        gluon = (not fused and gluon_supported(q, cache) and max_int2 > 0
                 and (pairs > 16 or max_int2 >= 4096 or hg > 4))
        if gluon and d == 256 and pairs < 8:
            # Below 8 pairs at head_dim 256 the Triton programs' four-warp tiles win up to 100K with keys per token
            # (Gemma 3 270M's 4/1 heads at 100K x 1: 0.036 against 0.044 ms) and up to 64K with keys per channel
            # (100K x 1: 0.054 against 0.045; kernel_notes.md v16).
            gluon = cache.key_axis == "channel" and max_int2 >= 65536
    elif gluon and (fused or not gluon_supported(q, cache)):
        raise ValueError("the Gluon INT2 programs need a CUDA GPU (sm_80+), head_dim 64, 128 or 256, groups of 64 "
                         "or 128, at most 16 query heads per KV head, whole 64-row INT2 blocks and fused=False")
    few_pairs = pairs <= 8
    if pdl is None:
        # At batch 1 (8 pairs or fewer) the launch gaps are a share of the call worth saving (H200, graph, off / on,
        # kernel_notes.md v19: Qwen3-8B 8K x 1 0.0204 / 0.0197 ms, 16K x 1 0.0226 / 0.0216, 100K x 1 0.0458 /
        # 0.0445). Beyond, the window programs launched early cost more than the gaps (16K x 8 0.0582 / 0.0616), but
        # with them launched plainly the Gluon programs and the reduce gain a little (H100, 9 of 9 points at batch 8,
        # 0.2-2.9%: Qwen3-8B 32K x 8 0.0938 / 0.0930 ms; kernel_notes.md v22).
        pdl = not fused and (few_pairs or gluon) and programmatic_launch(q.device)
    elif pdl and (fused or not programmatic_launch(q.device)):
        raise ValueError("programmatic dependent launch needs a CUDA GPU of compute capability 9.0 or newer and "
                         "fused=False")
    window_pdl = pdl and few_pairs      # the window programs (or all, without Gluon) dependents of the rotation
    cfg = default_config(bsz, kv_heads, d, gluon)
    block_n = 64 if gluon else block_n or cfg["block_n"]
    if tb > 1:
        block_n = min(block_n, tb)      # every tile inside one key block
    num_warps = num_warps or cfg["num_warps"]
    num_stages = num_stages or cfg["num_stages"]
    nw = -(-(cache.sink_tokens + cache.ring_slots) // block_w)
    # The window programs beside the Gluon programs get their slots only as Gluon programs finish, and ended after
    # them (a model's step, Qwen3-8B 32K x 8: 26 µs, the last 8 past the Gluon programs). With 8 warps rather than
    # the Triton INT2 programs' one they finish sooner (H100, graph, 1 / 4 / 8 warps, µs: 32K x 8 90.9 / 87.5 /
    # 85.4, 16K x 8 61.7 / 58.0 / 56.9, 100K x 8 208.4 / 205.1 / 204.4, 32K x 32 286.6 / 282.7 / 280.5); beyond 64
    # pairs 4 (100K x 32 760.0 / 761.8 / 766.0). At 8 pairs or fewer, where gluon_waves leaves them a slot, they keep
    # default_config's one (100K x 1: 48.0 / 47.7 / - µs, within noise). kernel_notes.md v26. At head_dim 256
    # gluon_waves leaves them no slot, so there they take 8 as well (Gemma 3 270M's 4/1 heads at 8 pairs, 2 / 4 / 8
    # warps: 100K x 8 81.6 / 77.2 / 77.4, keys per channel 98.1 / 95.9 / 94.4, 16K x 8 38.7 / 34.9 / 33.9; v28).
    if gluon and (not few_pairs or d == 256):
        window_warps = 8 if pairs <= 64 else 4
    else:
        window_warps = num_warps
    consts = {}
    if gluon:
        cfg["min_chunk"] = max(cfg["min_chunk"], -(-max_int2 // MAX_GLUON_SPLITS))
        consts = dict(gluon_constexprs(cache, heads, d, nw, heads_per_program), PDL=pdl)
        slots = _gluon_programs_per_sm(cache, consts, q.device)
        cfg["waves"] = gluon_waves(pairs, max_int2, d, slots, consts["HT"], _num_sms(q.device),
                                   cfg["min_chunk"])
    waves = waves or cfg["waves"]
    key_t = cfg["key_t"] if key_t is None else key_t
    # At least one INT2 program per pair, so a sequence longer than max_length is still read whole.
    chunk, n_int2 = plan_splits(bsz, kv_heads, max_int2, block_n, _num_sms(q.device), waves, cfg["min_chunk"])
    n_int2 = max(n_int2, 1)
    ns = nw + n_int2
    splits_a_wave = waves * _num_sms(q.device)
    if flat and not (gluon and consts["STAGES"] == 0):
        raise ValueError("flat needs the Gluon INT2 programs without their ring")
    # The TMA ring, only where it leaves the programs a multiprocessor holds as they were (the grid is sized for them).
    ring = None
    if gluon and (stages := tma_stages(_capability(q.device)[0], consts, pairs, chunk)) and tma_descriptors(cache):
        ring = dict(consts, TMA=stages, KEYS_AHEAD=False, PF=0)    # the ring holds the next tiles already
        if _gluon_programs_per_sm(cache, ring, q.device) != slots:
            ring = None
    if flat is None:
        # Where the wave, not min_chunk, bounds the splits, at head_dim 64 and 128 (at 256 the flat programs spill 16
        # bytes, not 8: not measured), and only where they fit a multiprocessor as many to one (the wave's size).
        flat = (gluon and consts["STAGES"] == 0 and d <= 128 and n_int2 == splits_a_wave // pairs
                and flat_splits(pairs, splits_a_wave, ring is not None)
                and _gluon_programs_per_sm(cache, dict(consts, FLAT=True, STRIDED=False), q.device) >= slots)
    if flat:
        consts.update(FLAT=True, STRIDED=False)
        n_int2 = pairs
        ns = nw + flat_programs_a_pair(splits_a_wave, n_int2)
    elif ring is not None:
        consts = ring
    hgp = max(_pow2(hg), 16 // min(d // gk, d // gv))
    qp = max(16, hgp)
    # Splits merged per step in the fused merge: the [SB, QP, d] partial tile at about 64 registers a thread.
    sb = max(1, min(32, _pow2(ns), 2048 * num_warps // (qp * d)))
    sb = 1 << (sb.bit_length() - 1)
    split = pairs * ns * hg
    # Columns of õ a reduce program merges and rotates: 8 where 16 would give 64 programs or fewer (8 pairs or fewer,
    # or 16 at head_dim 64), twice the programs. H100, graph: 32K x 1 and 100K x 1 1-3% faster (kernel_notes.md
    # v15); Qwen2.5-0.5B's 14/2 heads at 100K x 8 (16 pairs, d 64) 50.0 -> 49.0 µs, 16K x 8 23.9 -> 22.7; at 128
    # programs or more no faster (Qwen3-8B 32K x 2 37.3 -> 37.8, SmolLM2 at 100K x 8 even; v28). Not 4: with 16
    # heads a KV head its programs gave wrong outputs on the H100 (triton 3.6; kernel_notes.md v20), and it was
    # no faster elsewhere (v28).
    block_c = min(d, 8 if few_pairs or pairs * d // 16 <= 64 else 16)
    # Beyond 64 splits the partials are loaded beside their l_s (H100, graph, 100K x 8: Qwen2.5-0.5B's 136 splits
    # 0.0580 -> 0.0566 ms; at 38 splits, Qwen3-8B, 0.1-1.2% slower; kernel_notes.md v20).
    gated = _pow2(ns) <= 64
    hb = reduce_heads(hg, pairs * (d // block_c))
    # The reduce's shares of õ·R_V^T.
    shares = 0 if fused or not rotate_values else pairs * (d // block_c) * _pow2(hg) * d
    launch = dict(launch_pdl=True) if pdl else {}
    window_launch = dict(launch_pdl=True) if window_pdl else {}
    return _Plan(
        gluon=gluon, pdl=pdl, ns=ns, n_int2=n_int2, min_chunk=cfg["min_chunk"], split=split, work=split * (d + 2) + shares,
        split_grid=(nw if gluon else ns, pairs),
        split_consts=dict(HKV=kv_heads, HG=hg, D=d, GK=gk, GV=gv, S=cache.sink_tokens, W=cache.recent_tokens,
                          HGP=hgp, QP=qp, NW=nw, BLOCK_N=block_n, BLOCK_W=block_w, SB=sb, BLOCK_E=min(d, 16),
                          KEY_T=key_t, USE_ASM=use_asm, ROTATE=fused, MERGE=fused, HAS_MEAN=has_mean,
                          F32=not q.is_cuda, TB=tb, R=cache.ring_slots if tb > 1 else 1,
                          VT=cache.value_tiles, PDL=window_pdl, HOLE=hole(cache), SLIDE=cache.window is not None,
                          num_warps=window_warps,
                          num_stages=num_stages, **window_launch),
        gluon_grid=(splits_a_wave * consts["HT"], 1) if flat else (n_int2 * consts.get("HT", 1), pairs),
        gluon_consts=dict(**_gluon_options(consts), **consts, **launch) if gluon else {},
        reduce_grid=(pairs, d // block_c, _pow2(hg) // hb),
        reduce_consts=dict(HKV=kv_heads, HG=hg, D=d, HGP=_pow2(hg), HB=hb,
                           SB=min(8192 // (hb * block_c), max(8, _pow2(ns))), BLOCK_C=block_c, HAS_MEAN=has_mean,
                           PDL=pdl, GATED=gated, ROTATE=rotate_values, num_warps=4, **launch))
