"""The Triton programs of decode attention over an Int2KVCache: flash-decoding split over the context, then a merge.

Program (s, b·H_kv + h) of _split_kernel attends the HG = H/H_kv query heads of KV head h (stacked as the rows of
the tensor-core products) over one slice of sequence b: splits s < NW take BLOCK_W tokens each of the BF16 sink and
recent windows (one tile per program), splits s ≥ NW share the INT2 rows of sequence b in chunks of whole tiles sized
by b's own length (so the grid never depends on the data). Where the Gluon programs (decode_gluon.py) take the INT2
rows, _split_kernel runs the window splits alone. Each split writes the unnormalized output, the running max m and the
sum l of its slice; _reduce_kernel merges the slices with a running max,
o = Σ_s 2^(m_s−M) acc_s / Σ_s 2^(m_s−M) l_s, and returns to original space, o·R_V^T + μ_V: each of its programs
merges a block of columns of a block of query heads once and applies its columns' share of R_V^T, and the last
program of a (sequence, KV head, head block) sums the shares (an atomic counter it resets). _rotate_kernel computes
q̃ = q·R_K in bf16 first. Scores are kept in base 2: x = scaling·log2(e)·q̃·k̃. decode.py launches them
(docs/kernels.md: how a call runs).

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

A paged store (paged.PagedKVCache, the compile-time PAGED): INT2 row n of sequence b, head h is row n mod P of head h
of page block_table[b, (S + n) div P], the page's arrays page_stride bytes apart (_page_rows), and its BF16 windows
are those of window slot window_slot[b]. A page of one head is a store's pair of P rows, so everything else is the
same code; without PAGED the programs compile as before (the block table and slot arguments unread).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from oscar_core.triton.launch import cached
from oscar_core.triton.plan import pow2, rotate_heads
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
def _query(q_ptr, rows, cols, mask, D: tl.constexpr):
    """q̃[rows, cols] (_rotate_kernel's output) in bf16, 0 where not mask."""
    return tl.load(q_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.bfloat16)


@triton.jit
def _window_part(q_ptr, ks_ptr, vs_ptr, kr_ptr, vr_ptr, po_ptr, pm_ptr, pl_ptr, bh, length, q_row0,
                 scale_log2, slot, wid, T, HG: tl.constexpr, D: tl.constexpr, S: tl.constexpr, W: tl.constexpr,
                 QP: tl.constexpr, BLOCK_W: tl.constexpr, F32: tl.constexpr,
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
        q = _query(q_ptr, q_row0 + tl.where(r < HG, r, 0), c, (r < HG)[:, None], D)
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
def _page_rows(bt_row, h, n, valid, page_stride, PAGE: tl.constexpr, S: tl.constexpr):
    """Where INT2 rows n (position S + n) of head h of a paged store are: (byte offset of each one's page,
    page_stride a page, int64; its row within the page's [H_kv, PAGE] rows), the page read from the sequence's
    block table row bt_row (paged.PagedKVCache; S a whole number of pages)."""
    page = tl.load(bt_row + (S + n) // PAGE, mask=valid, other=0).to(tl.int64)
    return page * page_stride, h * PAGE + (S + n) % PAGE


@triton.jit
def _int2_part(q_ptr, kc_ptr, ksc_ptr, kz_ptr, vc_ptr, vsc_ptr, vz_ptr, po_ptr, pm_ptr, pl_ptr,
               bh, start, end, q_row0, log2_scale, T, slot, hole_lo, hole_hi, bt_row, h, page_stride,
               HG: tl.constexpr, D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr, HGP: tl.constexpr,
               BLOCK_N: tl.constexpr, KEY_T: tl.constexpr, USE_ASM: tl.constexpr, F32: tl.constexpr,
               TB: tl.constexpr, VT: tl.constexpr, HOLE: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
               S: tl.constexpr):
    """Attention over INT2 rows [start, end) of one sequence and KV head. KEY_T computes the score tile
    transposed (tokens as rows); both orders give the same function. TB > 1: keys per channel over blocks
    of TB tokens (scale / zero codes [T/TB, D]), each tile inside one block (BLOCK_N divides TB), scored by
    _channel_scores; GK then only stacks the query's channels as rows. VT: value codes in 64-row tiles
    (kvstore's value_layout "tiles"). HOLE: rows [hole_lo, hole_hi) are skipped (a window's expired rows).
    PAGED (paged.PagedKVCache): row n is row n mod PAGE of head h in page bt_row[(S + n) div PAGE] (bt_row: the
    sequence's block table row), each array page_stride bytes a page (_page_rows); otherwise row n of pair bh."""
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
    q0 = _query(q_ptr, qrows, 4 * j, qmask, D)
    q1 = (_query(q_ptr, qrows, 4 * j + 1, qmask, D).to(tl.float32) * 0.25).to(tl.bfloat16)
    q2 = (_query(q_ptr, qrows, 4 * j + 2, qmask, D).to(tl.float32) * 0.0625).to(tl.bfloat16)
    q3 = (_query(q_ptr, qrows, 4 * j + 3, qmask, D).to(tl.float32) * 0.0625).to(tl.bfloat16)
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
        if PAGED:
            pb, pr = _page_rows(bt_row, h, n, valid, page_stride, PAGE, S)
            kp = tl.load(kc_ptr + pb[:, None] + pr[:, None] * DB + j[None, :], mask=valid[:, None], other=0)
        else:
            kp = tl.load(kc_ptr + code0 + n[:, None] * DB + j[None, :], mask=valid[:, None], other=0)
        u0, u1, u2, u3 = _unpack_raw(kp, USE_ASM)
        if TB > 1:
            if PAGED:   # the tile's key block: its row of its page
                page = tl.load(bt_row + (S + t0) // PAGE).to(tl.int64)
                meta = page * page_stride + (h * (PAGE // TB) + ((S + t0) % PAGE) // TB) * D
            else:
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
                if PAGED:
                    koff = (pb + pr * NGK)[:, None] + gk[None, :]
                    ksc = tl.load(ksc_ptr + koff, mask=valid[:, None], other=0)
                    kz = tl.load(kz_ptr + koff, mask=valid[:, None], other=0)
                else:
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
                if PAGED:
                    koff = (pb + pr * NGK)[None, :] + gk[:, None]
                    ksc = tl.load(ksc_ptr + koff, mask=valid[None, :], other=0)
                    kz = tl.load(kz_ptr + koff, mask=valid[None, :], other=0)
                else:
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
            if PAGED:
                offsets = (pb // 2)[:, None] + code_offsets(pr, 0, D, D, True)
            else:
                offsets = code_offsets(bh.to(tl.int64) * T + n, 0, D, D, True)
            halves = tl.load(vc_ptr.to(tl.pointer_type(tl.int16)) + offsets, mask=valid[:, None], other=0)
            vp = tl.reshape(tl.join(halves.to(tl.uint8), (halves >> 8).to(tl.uint8)), [BLOCK_N, DB])
        elif PAGED:
            vp = tl.load(vc_ptr + pb[:, None] + pr[:, None] * DB + j[None, :], mask=valid[:, None], other=0)
        else:
            vp = tl.load(vc_ptr + code0 + n[:, None] * DB + j[None, :], mask=valid[:, None], other=0)
        w0, w1, w2, w3 = _unpack(vp, USE_ASM)
        if KEY_T:
            if PAGED:
                voff = (pb + pr * NGV)[:, None] + gv[None, :]
                vsc = tl.load(vsc_ptr + voff, mask=valid[:, None], other=0)
                vz = tl.load(vz_ptr + voff, mask=valid[:, None], other=0)
            else:
                vsc = tl.load(vsc_ptr + vmeta0 + n[:, None] * NGV + gv[None, :], mask=valid[:, None], other=0)
                vz = tl.load(vz_ptr + vmeta0 + n[:, None] * NGV + gv[None, :], mask=valid[:, None], other=0)
            vstep = tl.exp2((vsc.to(tl.float32) - 128.0) * 0.125)
            a3 = (p[:, None, :] * vstep[:, :, None]).to(tl.bfloat16)
            z_sum = z_sum * alpha[None, :] + tl.sum(a3.to(tl.float32) * (vz.to(tl.float32) * 0.25)[:, :, None], axis=0)
            a = tl.trans(tl.reshape(a3, [BLOCK_N, MV]))
        else:
            if PAGED:
                voff = (pb + pr * NGV)[None, :] + gv[:, None]
                vsc = tl.load(vsc_ptr + voff, mask=valid[None, :], other=0)
                vz = tl.load(vz_ptr + voff, mask=valid[None, :], other=0)
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
            CACHE: tl.constexpr, GATED: tl.constexpr):
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
def _split_kernel(q_ptr, ks_ptr, vs_ptr, kr_ptr, vr_ptr, kc_ptr, ksc_ptr, kz_ptr, vc_ptr, vsc_ptr, vz_ptr, len_ptr,
                  po_ptr, pm_ptr, pl_ptr, scale_log2, log2_scale, T, n_int2_splits, min_chunk, NS,
                  bt_ptr, ws_ptr, page_stride, max_pages,
                  HKV: tl.constexpr, HG: tl.constexpr, D: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
                  S: tl.constexpr, W: tl.constexpr, HGP: tl.constexpr, QP: tl.constexpr, NW: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, KEY_T: tl.constexpr, USE_ASM: tl.constexpr,
                  F32: tl.constexpr, TB: tl.constexpr, R: tl.constexpr, VT: tl.constexpr, PDL: tl.constexpr,
                  HOLE: tl.constexpr, SLIDE: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr):
    """Program (sid, bh): split sid of (sequence, KV head) bh, its partial output for _reduce_kernel. TB > 1: keys
    per channel over blocks of TB tokens, a ring of R slots (kvstore.Int2KVCache). PDL: launched as a programmatic
    dependent of the query rotation, whose q̃ it reads only after gdc_wait. PAGED (paged.PagedKVCache): sequence b's
    INT2 rows in pages of PAGE rows through its block table row bt_ptr[b, :max_pages], its BF16 windows in window
    slot ws_ptr[b]; T its most rows."""
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
        wbh = bh
        if PAGED:
            wbh = tl.load(ws_ptr + b) * HKV + h
        _window_part(q_ptr, ks_ptr, vs_ptr, kr_ptr, vr_ptr, po_ptr, pm_ptr, pl_ptr, wbh, length, q_row0, scale_log2,
                     slot, sid, T, HG, D, S, W, QP, BLOCK_W, F32, TB, R, SLIDE)
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
            bt_row = bt_ptr
            if PAGED:
                bt_row = bt_ptr + b.to(tl.int64) * max_pages
            _int2_part(q_ptr, kc_ptr, ksc_ptr, kz_ptr, vc_ptr, vsc_ptr, vz_ptr, po_ptr, pm_ptr, pl_ptr,
                       bh, start, end, q_row0, log2_scale, T, slot, hole_lo, hole_hi,
                       bt_row, h, page_stride, HG, D, GK, GV, HGP,
                       BLOCK_N, KEY_T, USE_ASM, F32, TB, VT, HOLE, PAGED, PAGE, S)
        else:
            r = tl.arange(0, HGP)
            tl.store(pm_ptr + slot * HG + r, tl.full([HGP], -1e30, tl.float32), mask=r < HG)
            tl.store(pl_ptr + slot * HG + r, tl.zeros([HGP], tl.float32), mask=r < HG)


@triton.jit
def _factor_tile(ptr, a_off, b_off, WIDE: tl.constexpr):
    """ptr[a_off[i] + b_off[j]] as [1, A, B]: the right factor of a float32 product x[:, :, None]·tile summed over
    A. WIDE (x has 16 rows or more): loaded in three dimensions, since from an expanded 2-D tile triton 3.6 rewrites
    that product as a TF32 tensor-core dot (tests/test_float32_products.py); narrower, as a 2-D tile (the code
    measured)."""
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


def rotate_query_bf16(q: torch.Tensor, key_rotation: torch.Tensor, pdl: bool = False,
                      heads_per_program: int | None = None) -> torch.Tensor:
    """Triton kvstore.rotate_query, rounded to bf16: q [B, H, d] -> q̃ bf16 [B, H, d]. pdl: the next launch may start
    (programmatic dependent launch) before this one ends. heads_per_program: query heads a program (None: the plan's
    rule, plan.rotate_heads)."""
    bsz, heads, d = q.shape
    kv_heads = key_rotation.shape[0]
    hg = heads // kv_heads
    out = torch.empty(bsz, heads, d, dtype=torch.bfloat16, device=q.device)
    block_e = 16
    hb = heads_per_program or rotate_heads(hg)
    cached(_rotate_kernel)(
        (bsz * kv_heads, d // block_e, pow2(hg) // hb), q.contiguous(), key_rotation.float().contiguous(), out,
        HKV=kv_heads, HG=hg, HGP=pow2(hg), D=d, BLOCK_E=block_e, PDL=pdl, HB=hb, num_warps=4)
    return out
