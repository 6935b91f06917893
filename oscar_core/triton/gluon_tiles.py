"""How a Gluon INT2 program (decode_gluon.py) gets a 64-token tile's bytes into its mma operands: loaded from global
memory into registers, or read from a stage of the TMA ring, and unpacked in place (decode_gluon's docstring has the
layouts). Every conversion from the loaded words to an operand is register-only (convert_layout(...,
assert_trivial=True) fails the compile otherwise)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

# A name that differs between triton 3.6 (the GPU image) and later releases.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

_UNPACK_TEXT = """{
.reg .b32 w, s6, s12;
mov.b32 w, $8;
shr.b32 s6, w, 6;
shr.b32 s12, w, 12;
lop3.b32 $0, w, 0x00030003, 0x43004300, 0xEA;
lop3.b32 $1, w, 0x000c000c, 0x43004300, 0xEA;
lop3.b32 $2, w, 0x00300030, 0x43004300, 0xEA;
lop3.b32 $3, s6, 0x00030003, 0x43004300, 0xEA;
lop3.b32 $4, s6, 0x000c000c, 0x43004300, 0xEA;
lop3.b32 $5, s6, 0x00300030, 0x43004300, 0xEA;
lop3.b32 $6, s12, 0x00030003, 0x43004300, 0xEA;
lop3.b32 $7, s12, 0x000c000c, 0x43004300, 0xEA;
}"""


_UNPACK = gl.constexpr(_UNPACK_TEXT)


@gluon.jit
def unpack_words(words, L3: gl.constexpr):
    """int32 words [..., 1] (layout L3, 16 slots per thread) -> bf16 [..., 16]: slot 2i + e is the code
    at bits 2i of half e, as 128 + 4^ρ(i)·code."""
    w = gl.broadcast(words, gl.zeros([words.shape[0], words.shape[1], 16], gl.int32, L3))[0]
    return gl.inline_asm_elementwise(_UNPACK, "=r,=r,=r,=r,=r,=r,=r,=r" + ",r" * 16, [w], dtype=gl.bfloat16,
                                     is_pure=True, pack=16)


@gluon.jit
def pair(lo, hi):
    """Two int16 halves -> one int32 word, lo in bits 0-15."""
    return (lo.to(gl.int32) & 0xFFFF) | (hi.to(gl.int32) << 16)


@gluon.jit
def load_meta(ptr, t0, NG: gl.constexpr):
    """Scale or zero codes (bytes [T, NG]) of tokens t0 .. t0 + 63 as int32 words [8, 2·NG]: row g holds the
    bytes of tokens 8g .. 8g + 7 (NG = 2: token-major, both groups; NG = 1, groups of 128 channels: one byte a
    token), one 16-byte (8-byte) load a thread."""
    MW: gl.constexpr = gl.BlockedLayout([1, 2 * NG], [8, 4], [1, 1], [1, 0])
    g = gl.arange(0, 8, layout=gl.SliceLayout(1, MW))
    j = gl.arange(0, 2 * NG, layout=gl.SliceLayout(0, MW))
    wp = ptr.to(gl.pointer_type(gl.int32)) + gl.multiple_of(t0, 64) * NG // 4
    return gl.load(wp + (2 * NG * g)[:, None] + j[None, :])


@gluon.jit
def tile_meta(w, RL: gl.constexpr, SIGNED: gl.constexpr):
    """load_meta's words (or the ring's, the same) as float32 2^23 + b per group, b the code
    unsigned (signed codes plus 128), in row order m (row m holds token 8·(m mod 8) + m div 8). One prmt a
    byte (byte_floats) where a conversion would take the special-function unit's quarter-rate pipe, which
    the exp2s already load; callers take the 2^23 off in the arithmetic that follows."""
    x = byte_floats(w, SIGNED)
    if w.shape[1] == 2:
        # One code a token (groups of 128): both halves of the head read it.
        x = gl.reshape(gl.join(x, x), [8, 16])
    x0, x1 = gl.split(gl.reshape(x, [8, 8, 2]))
    return meta_rows(x0, RL), meta_rows(x1, RL)


@gluon.jit
def meta_rows(x, RL: gl.constexpr):
    """[g, j] (token 8g + j) -> [64] in row order m (token 8·(m mod 8) + m div 8), layout RL: register-only."""
    return gl.convert_layout(gl.reshape(gl.permute(x, [1, 0]), [64]), RL, assert_trivial=True)


@gluon.jit
def tile_meta4(w, RL: gl.constexpr, SIGNED: gl.constexpr):
    """Head_dim 256: load_meta's words as tile_meta's floats, one [64] a 64-channel block (4). With groups
    of 128 channels (two codes a token) blocks 0, 1 are the same tensor, and 2, 3."""
    x = byte_floats(w, SIGNED)
    if w.shape[1] == 8:
        # Byte 4j + g of row g' is group g = 2·hi + lo of token 8g' + j: split lo, then hi.
        lo0, lo1 = gl.split(gl.reshape(x, [8, 8, 2, 2]))
        x0, x2 = gl.split(lo0)
        x1, x3 = gl.split(lo1)
        return meta_rows(x0, RL), meta_rows(x1, RL), meta_rows(x2, RL), meta_rows(x3, RL)
    else:
        x0, x1 = gl.split(gl.reshape(x, [8, 8, 2]))
        x0 = meta_rows(x0, RL)
        x1 = meta_rows(x1, RL)
        return x0, x0, x1, x1


@gluon.jit
def load_tile(kw, vh, ksc, kz, vsc, vz, t0, koff, voff, KW: gl.constexpr, NGK: gl.constexpr,
               NGV: gl.constexpr, TB: gl.constexpr, D: gl.constexpr, VT: gl.constexpr, VS: gl.constexpr):
    """Every byte of tile t0: load_keys's words and load_values's halves and metadata."""
    return load_keys(kw, t0, koff, KW, D) + load_values(vh, ksc, kz, vsc, vz, t0, voff, NGK, NGV, TB, D, VT, VS)


@gluon.jit
def load_keys(kw, t0, koff, KW: gl.constexpr, D: gl.constexpr):
    """Tile t0's key words 2t and 2t + 1 of each row (one 8-byte load; at head_dim 64 word t, and the second
    product's registers repeat the first's); at head_dim 256 the upper half's words 8 + 2t and 9 + 2t as the
    lower's (otherwise kw2, kw3 repeat kw0, kw1)."""
    if D >= 128:
        kw0, kw1 = gl.split(gl.load(kw + t0 * (D // 16) + koff))
        kw0 = gl.convert_layout(kw0, KW, assert_trivial=True)
        kw1 = gl.convert_layout(kw1, KW, assert_trivial=True)
    else:
        kw0 = gl.load(kw + t0 * 4 + koff)
        kw1 = kw0
    if D == 256:
        kw2, kw3 = gl.split(gl.load(kw + t0 * 16 + koff + 8))
        kw2 = gl.convert_layout(kw2, KW, assert_trivial=True)
        kw3 = gl.convert_layout(kw3, KW, assert_trivial=True)
    else:
        kw2, kw3 = kw0, kw1
    return kw0, kw1, kw2, kw3


@gluon.jit
def tile_words(x, VS: gl.constexpr):
    """Value words [t, a, j] (lane 4a + t, j in-thread) -> [pairs u = t + 4j, a] in VS: register-only."""
    x = gl.reshape(gl.permute(x, [2, 0, 1]), [32, x.shape[1]])
    return gl.convert_layout(x, VS, assert_trivial=True)


@gluon.jit
def load_values(vh, ksc, kz, vsc, vz, t0, voff, NGK: gl.constexpr, NGV: gl.constexpr, TB: gl.constexpr,
                 D: gl.constexpr, VT: gl.constexpr, VS: gl.constexpr):
    """Tile t0's value halves joined in pairs and its metadata (with keys per channel, TB > 1, the key codes'
    places hold the value codes: the key scales are read per block by _channel_query). At head_dim 256 the
    upper half's halves 16-31 as the lower's (otherwise vw2, vw3 repeat vw0, vw1). VT (value codes in 64-row
    tiles, kvstore's value_layout "tiles"): lane 4a + t's pair words of half 8B + a are the 32 bytes at 16-bit
    slot 64·(8B + a) + 16t of the tile (voff), two 16-byte loads a block, already paired; otherwise two 2-byte
    loads a pair, 8 rows apart, joined by pair."""
    if VT:
        vp = vh.to(gl.pointer_type(gl.int32)) + gl.multiple_of(t0, 64) * (D // 16) + voff
        vw0 = tile_words(gl.load(vp), VS)
        if D >= 128:
            vw1 = tile_words(gl.load(vp + 256), VS)
        else:
            vw1 = vw0
        if D == 256:
            vw2 = tile_words(gl.load(vp + 512), VS)
            vw3 = tile_words(gl.load(vp + 768), VS)
        else:
            vw2, vw3 = vw0, vw1
    else:
        vp = vh + t0 * (D // 8) + voff
        vw0 = pair(gl.load(vp), gl.load(vp + D))
        if D >= 128:
            vw1 = pair(gl.load(vp + 8), gl.load(vp + 8 + D))
        else:
            vw1 = vw0
        if D == 256:
            vw2 = pair(gl.load(vp + 16), gl.load(vp + 16 + D))
            vw3 = pair(gl.load(vp + 24), gl.load(vp + 24 + D))
        else:
            vw2, vw3 = vw0, vw1
    vscb = load_meta(vsc, t0, NGV)
    vzb = load_meta(vz, t0, NGV)
    if TB > 1:
        kscb = vscb
        kzb = vzb
    else:
        kscb = load_meta(ksc, t0, NGK)
        kzb = load_meta(kz, t0, NGK)
    return vw0, vw1, vw2, vw3, kscb, kzb, vscb, vzb


_PREFETCH = gl.constexpr("prefetch.global.L2 [$1];\n mov.b32 $0, 0;")


@gluon.jit
def prefetch_tile(kw, vh, ksc, kz, vsc, vz, t0, D: gl.constexpr, NGK: gl.constexpr, NGV: gl.constexpr,
                   TB: gl.constexpr):
    """Hint tile t0's bytes into L2, holding no register: its key words and value codes (D/4 bytes a row each, 64
    rows contiguous: D/8 lines of 128 bytes each) and the first line of each scale and zero array's."""
    LINES: gl.constexpr = D // 8
    NL: gl.constexpr = D // 2       # at least 2·LINES + 4 lanes' addresses, whole warps
    i = gl.arange(0, NL, layout=gl.BlockedLayout([NL // 32], [32], [1], [0])).to(gl.int64)
    t = t0.to(gl.int64)
    j = (i - 2 * LINES) % 4
    if TB > 1:
        kmeta = (t // TB) * D
    else:
        kmeta = t * NGK
    meta = gl.where(j == 0, vsc.to(gl.int64) + t * NGV,
                    gl.where(j == 1, vz.to(gl.int64) + t * NGV,
                             gl.where(j == 2, ksc.to(gl.int64) + kmeta, kz.to(gl.int64) + kmeta)))
    addr = gl.where(i < LINES, kw.to(gl.int64) + t * (D // 4) + 128 * i,
                    gl.where(i < 2 * LINES, vh.to(gl.int64) + t * (D // 4) + 128 * (i - LINES), meta))
    gl.inline_asm_elementwise(_PREFETCH, "=r,l", [addr], dtype=gl.int32, is_pure=False, pack=1)


_BYTES_TEXT = """{
.reg .b32 w;
xor.b32 w, $4, XOR;
prmt.b32 $0, w, 0x4B000000, 0x7650;
prmt.b32 $1, w, 0x4B000000, 0x7651;
prmt.b32 $2, w, 0x4B000000, 0x7652;
prmt.b32 $3, w, 0x4B000000, 0x7653;
}"""


_U8_FLOATS = gl.constexpr(_BYTES_TEXT.replace("XOR", "0"))


_I8_FLOATS = gl.constexpr(_BYTES_TEXT.replace("XOR", "0x80808080"))


@gluon.jit
def byte_floats(w, SIGNED: gl.constexpr):
    """int32 words [..., n] -> float32 [..., 4n]: byte k of word j at 4j + k, as 2^23 + b, b the byte
    unsigned, or signed plus 128: one prmt a byte moves it into the mantissa of 2^23."""
    f0, f1, f2, f3 = gl.inline_asm_elementwise(_I8_FLOATS if SIGNED else _U8_FLOATS, "=r,=r,=r,=r,r", [w],
                                               dtype=(gl.float32,) * 4, is_pure=True, pack=1)
    x = gl.permute(gl.join(gl.join(f0, f1), gl.join(f2, f3)), [0, 1, 3, 2])
    return gl.reshape(x, [w.shape[0], 4 * w.shape[1]])


@gluon.jit
def load_block(ptr, D: gl.constexpr):
    """A key block's D scale or zero code bytes as int32 words [4, D/16]: lane t (of 4·g + t) loads row t,
    D/4 consecutive bytes, in one vector load (every g alike)."""
    CL: gl.constexpr = gl.BlockedLayout([1, D // 16], [4, 8], [1, 1], [0, 1])
    t = gl.arange(0, 4, layout=gl.SliceLayout(1, CL))
    c = gl.arange(0, D // 16, layout=gl.SliceLayout(0, CL))
    return gl.load(ptr.to(gl.pointer_type(gl.int32)) + (D // 16) * t[:, None] + c[None, :])


@gluon.jit
def block_codes(w, QL: gl.constexpr, D: gl.constexpr, SIGNED: gl.constexpr):
    """load_block's words as floats 2^23 + b (byte_floats) in the query operands' κ order (layout QL, the
    operand's rows): product o reads channel (D/4)·t + 16·o + 8e + i at κ = 16s + 8h + 2t + e (i = 2s + h),
    which lane t holds in its registers. (product 0, product 1); at head_dim 64 one product, returned twice."""
    x = byte_floats(w, SIGNED)
    if D == 128:
        # [t, (o, e, s, h)] -> [(s, h, t, e), o]
        x0, x1 = gl.split(gl.reshape(gl.permute(gl.reshape(x, [4, 2, 2, 4, 2]), [3, 4, 0, 2, 1]), [64, 2]))
        return gl.convert_layout(x0, QL, assert_trivial=True), gl.convert_layout(x1, QL, assert_trivial=True)
    else:
        # [t, (e, s, h)] -> [(s, h, t, e)]
        x0 = gl.reshape(gl.permute(gl.reshape(x, [4, 2, 4, 2]), [2, 3, 0, 1]), [64])
        x0 = gl.convert_layout(x0, QL, assert_trivial=True)
        return x0, x0


@gluon.jit
def key_operand(words, KL: gl.constexpr, a_op: gl.constexpr):
    """A product's key words [tokens, t] (word w(t) of each row) -> the mma A operand [tokens, 64] bf16."""
    k = unpack_words(gl.expand_dims(words, 2), KL)
    # [tokens, t, (i = 2s + h, e)] -> [tokens, (s, h, t, e)]: κ = 16s + 8h + 2t + e.
    k = gl.permute(gl.reshape(k, [k.shape[0], 4, 4, 2, 2]), [0, 2, 3, 1, 4])
    return gl.convert_layout(gl.reshape(k, [k.shape[0], 64]), a_op, assert_trivial=True)


@gluon.jit
def value_operand(words, VL: gl.constexpr, a_op: gl.constexpr):
    """A 64-channel block's value words [token pairs u, a] (halves of rows 2u, 2u + 1 joined) -> the mma A
    operand [64 channels, tokens] bf16."""
    u = unpack_words(gl.expand_dims(words, 2), VL)
    # [pairs u, a, (i, e)] -> [(i, a), (u, e)]: rows κ = 8i + a, columns token 2u + e.
    v = gl.permute(gl.reshape(u, [u.shape[0], 8, 8, 2]), [2, 1, 0, 3])
    return gl.convert_layout(gl.reshape(v, [64, 2 * u.shape[0]]), a_op, assert_trivial=True)


@gluon.jit
def issue_tma(cdesc, mdesc, cring, mring, bars, st, crow, mrow, NBYTES: gl.constexpr):
    """Start the two bulk copies of a tile into stage st of the TMA ring: its key and value codes (codes rows crow ..,
    one box of both arrays) and its four metadata arrays' bytes (metadata rows mrow .., one box), NBYTES in all on
    the stage's mbarrier."""
    bar = bars.index(st)
    mbarrier.expect(bar, NBYTES)
    _tma_load(cdesc, [0, crow, 0], bar, cring.index(st))
    _tma_load(mdesc, [0, mrow, 0], bar, mring.index(st))


@gluon.jit
def read_tma(cring, mring, st, KW: gl.constexpr, VS: gl.constexpr, TB: gl.constexpr, GS: gl.constexpr,
              D: gl.constexpr):
    """load_tile's registers (head_dim 64, 128 or 256, value codes in tiles) from stage st of the TMA ring. Each
    load's layout gives a lane exactly the words load_tile's global loads give it, so the conversions after them are
    register-only. Keys, token 8g + j: at head_dim 128 descriptor row 2g + j div 4, words 8·(j mod 4) + 2t + e (GS:
    t + 4e); at 64 row g, word 4j + t; at 256 (j = 4·j2 + 2·j1 + j0) row 4g + 2·j2 + j1, words 16·j0 + 8h + 2t + e.
    Values: tile row 8B + a, words 8t .. 8t + 7. The 128-byte swizzle spreads
    the key reads' 8 rows of a lane over the banks (two-way conflicts at most; rows in memory order without it:
    eight). The metadata: ring_meta."""
    VW: gl.constexpr = gl.BlockedLayout([1, 1, 8], [4, 8, 1], [1, 1, 1], [2, 0, 1])
    if D == 64:
        codes = cring.index(st).reshape([16, 32])
        K64: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 4], [0, 8], [0, 16]],
                                                       lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
                                                       warp_bases=[], block_bases=[], shape=[8, 32])
        x = gl.reshape(gl.permute(gl.reshape(codes.slice(0, 8).load(K64), [8, 8, 4]), [1, 0, 2]), [64, 4])
        kw0 = gl.convert_layout(x, KW, assert_trivial=True)
        kw1 = kw0
        V64: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4]],
                                                       lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                                       warp_bases=[], block_bases=[], shape=[8, 32])
        y = gl.permute(gl.reshape(codes.slice(8, 8).load(V64), [8, 4, 8]), [1, 0, 2])
        vw0 = tile_words(gl.convert_layout(y, VW, assert_trivial=True), VS)
        vw1 = vw0
    elif D == 256:
        codes = cring.index(st).reshape([64, 32])
        # h: the upper half of a token's words.
        K256: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 8], [0, 16], [1, 0], [2, 0]],
                                                        lane_bases=[[0, 2], [0, 4], [4, 0], [8, 0], [16, 0]],
                                                        warp_bases=[], block_bases=[], shape=[32, 32])
        x = gl.reshape(codes.slice(0, 32).load(K256), [8, 2, 2, 2, 2, 4, 2])
        lo, hi = gl.split(gl.reshape(gl.permute(x, [1, 2, 3, 0, 5, 6, 4]), [64, 4, 2, 2]))
        kw0, kw1 = gl.split(lo)
        kw2, kw3 = gl.split(hi)
        kw0 = gl.convert_layout(kw0, KW, assert_trivial=True)
        kw1 = gl.convert_layout(kw1, KW, assert_trivial=True)
        kw2 = gl.convert_layout(kw2, KW, assert_trivial=True)
        kw3 = gl.convert_layout(kw3, KW, assert_trivial=True)
        V256: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0], [16, 0]],
                                                        lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                                        warp_bases=[], block_bases=[], shape=[32, 32])
        y = gl.permute(gl.reshape(codes.slice(32, 32).load(V256), [2, 2, 8, 4, 8]), [3, 2, 4, 0, 1])
        ye, yo = gl.split(y)        # blocks 0 and 2, blocks 1 and 3
        y0, y2 = gl.split(ye)
        y1, y3 = gl.split(yo)
        vw0 = tile_words(gl.convert_layout(y0, VW, assert_trivial=True), VS)
        vw1 = tile_words(gl.convert_layout(y1, VW, assert_trivial=True), VS)
        vw2 = tile_words(gl.convert_layout(y2, VW, assert_trivial=True), VS)
        vw3 = tile_words(gl.convert_layout(y3, VW, assert_trivial=True), VS)
    else:
        codes = cring.index(st).reshape([32, 32])
        if GS:
            KGS: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 4], [0, 8], [0, 16], [1, 0]],
                                                           lane_bases=[[0, 1], [0, 2], [2, 0], [4, 0], [8, 0]],
                                                           warp_bases=[], block_bases=[], shape=[16, 32])
            x = codes.slice(0, 16).load(KGS)
            x = gl.reshape(gl.permute(gl.reshape(x, [8, 2, 4, 2, 4]), [1, 2, 0, 4, 3]), [64, 4, 2])
        else:
            KLL: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 8], [0, 16], [1, 0]],
                                                           lane_bases=[[0, 2], [0, 4], [2, 0], [4, 0], [8, 0]],
                                                           warp_bases=[], block_bases=[], shape=[16, 32])
            x = codes.slice(0, 16).load(KLL)
            x = gl.reshape(gl.permute(gl.reshape(x, [8, 2, 4, 4, 2]), [1, 2, 0, 3, 4]), [64, 4, 2])
        kw0, kw1 = gl.split(x)
        kw0 = gl.convert_layout(kw0, KW, assert_trivial=True)
        kw1 = gl.convert_layout(kw1, KW, assert_trivial=True)
        VLL: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
                                                       lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                                       warp_bases=[], block_bases=[], shape=[16, 32])
        y0, y1 = gl.split(gl.permute(gl.reshape(codes.slice(16, 16).load(VLL), [2, 8, 4, 8]), [2, 1, 3, 0]))
        vw0 = tile_words(gl.convert_layout(y0, VW, assert_trivial=True), VS)
        vw1 = tile_words(gl.convert_layout(y1, VW, assert_trivial=True), VS)
    if D == 256:
        meta = mring.index(st).reshape([8, 32])
        if TB > 1:
            # The block's lower 128 scale and zero codes (rows 0 and 2; the segment reads rows 1 and 3).
            m0 = ring_meta(meta, 0, 128, True)
            m1 = ring_meta(meta, 2, 128, True)
        else:
            m0 = ring_meta(meta, 0, D, False)
            m1 = ring_meta(meta, 1, D, False)
        m2 = ring_meta(meta, 2, D, False)
        m3 = ring_meta(meta, 3, D, False)
    else:
        kw2, kw3, vw2, vw3 = kw0, kw1, vw0, vw1
        meta = mring.index(st).reshape([4, D // 4])
        m0 = ring_meta(meta, 0, D, TB > 1)
        m1 = ring_meta(meta, 1, D, TB > 1)
        m2 = ring_meta(meta, 2, D, False)
        m3 = ring_meta(meta, 3, D, False)
    return kw0, kw1, kw2, kw3, vw0, vw1, vw2, vw3, m0, m1, m2, m3


@gluon.jit
def ring_meta(meta, i: gl.constexpr, D: gl.constexpr, BLOCK: gl.constexpr):
    """Metadata array i of a stage (D/4 words a tile: one group of 64 channels a token, or a key block's D codes;
    at head_dim 256 rows 2i and 2i + 1 of 32 words) as load_meta gives it (words [8, D/32]: row g the bytes of
    tokens 8g .. 8g + 7), or, BLOCK, as load_block does (words [4, D/16]: lane t of 4·g + t row t; at head_dim
    256 the segment reads a block's codes as two halves of D = 128, a row each)."""
    if D == 256:
        gl.static_assert(not BLOCK)
        L: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4]],
                                                     lane_bases=[[0, 0], [0, 0], [0, 8], [0, 16], [1, 0]],
                                                     warp_bases=[], block_bases=[], shape=[2, 32])
    elif D == 64:
        if BLOCK:
            L: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2]],
                                                         lane_bases=[[0, 4], [0, 8], [0, 0], [0, 0], [0, 0]],
                                                         warp_bases=[], block_bases=[], shape=[1, 16])
        else:
            L: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1]],
                                                         lane_bases=[[0, 0], [0, 0], [0, 2], [0, 4], [0, 8]],
                                                         warp_bases=[], block_bases=[], shape=[1, 16])
    else:
        if BLOCK:
            L: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4]],
                                                         lane_bases=[[0, 8], [0, 16], [0, 0], [0, 0], [0, 0]],
                                                         warp_bases=[], block_bases=[], shape=[1, 32])
        else:
            L: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2]],
                                                         lane_bases=[[0, 0], [0, 0], [0, 4], [0, 8], [0, 16]],
                                                         warp_bases=[], block_bases=[], shape=[1, 32])
    if BLOCK:
        W: gl.constexpr = gl.BlockedLayout([1, D // 16], [4, 8], [1, 1], [0, 1])
        words = gl.reshape(meta.slice(i, 1).load(L), [4, D // 16])
    else:
        W: gl.constexpr = gl.BlockedLayout([1, D // 32], [8, 4], [1, 1], [1, 0])
        R: gl.constexpr = 2 if D == 256 else 1      # the array's rows in the stage
        words = gl.reshape(meta.slice(R * i, R).load(L), [8, D // 32])
    return gl.convert_layout(words, W, assert_trivial=True)
