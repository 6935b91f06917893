"""INT2 KV store, plain-torch reference: write, read, and decode attention over the store.

A token's key k of KV head h is stored rotated and centred, k̃ = (k − μ_K[h])·R_K[h] (float32
arithmetic), and likewise ṽ = (v − μ_V[h])·R_V[h]. The first `sink_tokens` positions and the last
`recent_tokens` positions of a sequence keep k̃, ṽ in BF16; every position between them keeps only
the INT2 codes of quant.quantize (asymmetric, per token per group, clipped by the head's ratio).

Decode attention of one new query q (original space, query head j reading KV head h = j // (H/H_kv)):
    q̃ = q·R_K[h]                              (R_K orthogonal, so q̃·k̃ = q·k − q·μ_K)
    p_t = softmax_t(scaling · q̃·k̃_t)          (the q·μ_K term is the same for every t: softmax ignores it)
    o = (Σ_t p_t ṽ_t)·R_V[h]^T + μ_V[h]
Keys per channel (key_axis "channel", a bundle layer whose Bundle.key_axis says so; methods.Side axis
"channel"): k̃ is quantized per channel over blocks of G = key_group_size tokens after the sink: block j
(positions S + jG .. S + jG + G − 1) of head h and channel c is one INT2 group, the G values k̃[·, c]
(quant.quantize of the [d, G] transposed block with the head's clip, exactly methods.encode). Keys and
values leave the BF16 window together, a whole block at a time, when its last token does (methods.int2_mask
with block G): with L tokens the first n_int2 = ⌊max(L − S − W, 0)/G⌋·G after the sink are INT2 and the
BF16 recent window holds W .. W + G − 1 tokens. Values stay per token (groups of G_V channels).

This module is the ground truth for oscar_core/triton/write.py and decode.py; it does no I/O.
"""

import math
from dataclasses import dataclass, field

import torch

from oscar_core import quant

SINK_TOKENS = 64
RECENT_TOKENS = 256
VALUE_LAYOUTS = ("rows", "tiles")
# Tiles: the Gluon decode programs load a lane's value words 16 bytes at a time, faster on every shape class (H100,
# 100K x 8, graph: 0-12%; docs/kernels.md), the same bytes and outputs.
DEFAULT_VALUE_LAYOUT = "tiles"


@dataclass
class LayerRotation:
    """One layer's bundle tensors (see bundle.py): R [H_kv, d, d], clip [H_kv], μ [H_kv, d] or None."""
    key_rotation: torch.Tensor
    value_rotation: torch.Tensor
    key_clip: torch.Tensor
    value_clip: torch.Tensor
    key_mean: torch.Tensor | None = None
    value_mean: torch.Tensor | None = None


class StoreWindows:
    """What a store's key format and BF16 windows imply, from its fields (key_group_size, key_axis, value_layout,
    key_sink, key_recent): shared by Int2KVCache and paged.PagedKVCache."""

    @property
    def token_block(self) -> int:
        """Tokens that leave the recent window together: 1, or G for keys per channel."""
        return self.key_group_size if self.key_axis == "channel" else 1

    @property
    def value_tiles(self) -> bool:
        """Whether the value codes are in 64-row tiles (value_layout "tiles")."""
        return self.value_layout == "tiles"

    @property
    def sink_tokens(self) -> int:
        return self.key_sink.shape[2]

    @property
    def ring_slots(self) -> int:
        return self.key_recent.shape[2]

    @property
    def recent_tokens(self) -> int:
        return self.ring_slots - (self.token_block if self.key_axis == "channel" else 0)


@dataclass
class Int2KVCache(StoreWindows):
    """Padded per-sequence INT2 KV store of one layer, B sequences, H_kv heads, head_dim d.

    Position p < S (S = sink_tokens) of sequence b:   key_sink[b, :, p]                      bf16 [B, H_kv, S, d]
    position p ≥ S inside the last W (= recent_tokens): key_recent[b, :, (p − S) mod W]    bf16 [B, H_kv, W, d]
    position S ≤ p < L − W (INT2):  key_codes[b, :, p − S]    uint8 [B, H_kv, T, d/4]   (quant.pack_int2 layout)
                                    key_scale[b, :, p − S]    uint8 [B, H_kv, T, d/G_K] (scale codes)
                                    key_zero[b, :, p − S]     int8  [B, H_kv, T, d/G_K] (zero codes)
    and the same for values with G_V. lengths[b] = L is the number of tokens of sequence b.
    So the BF16 tokens of sequence b are the first min(S, L) sink rows and the first
    min(W, max(L − S, 0)) ring rows (in some order: attention does not depend on it), and the
    INT2 tokens are rows [0, max(L − S − W, 0)) of the code tensors. All stored values are rotated
    and centred. T = capacity − S − W rows bound the context at `capacity` tokens.

    key_axis "channel" (keys per channel over blocks of G = key_group_size tokens) changes three things:
      key_scale, key_zero    uint8 / int8 [B, H_kv, T/G, d]: block j's codes of channel c at [b, :, j, c]
                             (key_codes keep the per-token rows above, packed along channels);
      key_recent, value_recent  bf16 [B, H_kv, W + G, d]: ring of R = W + G slots, position p at (p − S) mod R;
      INT2 rows [0, n_int2), n_int2 = ⌊max(L − S − W, 0)/G⌋·G (whole blocks; values move with them),
    and the BF16 ring tokens are positions S + n_int2 .. L − 1 (at most W + G − 1, so a block that
    leaves and the token that pushes it out never share a slot). T is a multiple of G.

    window N (a sliding layer's store, window_cache): the T INT2 rows are a ring, INT2 token i (position S + i) in
    row i mod T, and T + W = N. The W ring slots and the min(n_int2, T) rows in use then hold a sequence's last N
    tokens past the sink, every older one overwritten: the window a query sees once it is written (its own token
    and the N − 1 before it), but for the sink tokens that have left it (p < L − N, which reads skip) and, with
    keys per channel, up to G − 1 tokens of the oldest block held (first_live, which reads skip too). A window kept
    whole in BF16 has T = 0 and W = N: every token it still sees is in the sink or the ring.

    value_layout "tiles" (the default; "rows" is the layout above) changes where value_codes keeps its bytes: each
    tile of 64 rows (rows 64k .. 64k + 63 of one sequence and KV head, the same bytes as in "rows") holds its
    16-bit halves half-major, half h (channels 8h .. 8h + 7) of tile row m at 16-bit slot 64h + tile_slot(m),
    tile_slot(m) = 16·(m div 16) + 2·(m mod 8) + (m mod 16) div 8. So the 16 rows 16i .. 16i + 15 of one half
    are 32 consecutive bytes, rows 16i + j and 16i + 8 + j side by side: the two tokens whose halves make one
    32-bit register of the decode's value operand (decode_gluon), which a lane then loads 16 bytes at a time
    rather than 2 (value_rows / put_value_rows read and write rows in either layout).
    """
    key_sink: torch.Tensor
    value_sink: torch.Tensor
    key_recent: torch.Tensor
    value_recent: torch.Tensor
    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_zero: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_zero: torch.Tensor
    lengths: torch.Tensor
    key_group_size: int = 64
    value_group_size: int = 64
    key_axis: str = "token"
    value_layout: str = DEFAULT_VALUE_LAYOUT
    window: int | None = None       # a sliding layer's store: its INT2 rows a ring (window_cache)
    # CUDA graphs of eager decode calls over this store (triton.decode.decode_attention keeps them here, so
    # they go with the store's tensors they read).
    graphs: dict = field(default_factory=dict, repr=False, compare=False)


    def int2_tokens(self) -> torch.Tensor:
        """Number of INT2 rows in use per sequence, int64 [B]."""
        n = (self.lengths.long() - self.sink_tokens - self.recent_tokens).clamp_min(0)
        n = n // self.token_block * self.token_block
        return n if self.window is None else n.clamp_max(self.key_codes.shape[2])

    def int2_row(self, i: torch.Tensor) -> torch.Tensor:
        """The row that INT2 token i (position S + i) lives in: i, or i mod T in a window's ring."""
        return i if self.window is None else i % self.key_codes.shape[2]

    def first_live(self, length: int, n_int2: int) -> int:
        """The first INT2 token a sequence of `length` tokens still attends to: 0, or in a window's store the first
        of its last N tokens held (keys per channel: up to G − 1 tokens of the oldest block held are older, rows
        the decode kernels mask)."""
        if self.window is None:
            return 0
        return max(n_int2 - self.key_codes.shape[2], length - self.window - self.sink_tokens, 0)


ROW_BLOCK = 64


def tile_slot(m: torch.Tensor) -> torch.Tensor:
    """The 16-bit slot of tile row m (0-63) within each half's 64 slots of a value tile (layout "tiles")."""
    return 16 * (m // 16) + 2 * (m % 8) + (m % 16) // 8


def _value_tiles(cache: Int2KVCache, b: int, rows: torch.Tensor):
    """Sequence b's value codes as int16 [H_kv, T/64, 64·d/8] tiles and, for rows [n], the tile [n, 1] and the
    slot [n, d/8] of each of their halves."""
    codes = cache.value_codes[b]
    heads, t, nbytes = codes.shape
    tiles = codes.view(heads, t // ROW_BLOCK, ROW_BLOCK * nbytes).view(torch.int16)
    halves = torch.arange(nbytes // 2, device=codes.device)
    slots = ROW_BLOCK * halves[None, :] + tile_slot(rows % ROW_BLOCK)[:, None]
    return tiles, (rows // ROW_BLOCK)[:, None], slots


def value_rows(cache: Int2KVCache, b: int, rows: torch.Tensor) -> torch.Tensor:
    """The packed value codes of rows `rows` [n] of sequence b, uint8 [H_kv, n, d/4], in either layout."""
    if not cache.value_tiles:
        return cache.value_codes[b, :, rows]
    tiles, tile, slots = _value_tiles(cache, b, rows)
    picked = tiles[:, tile, slots]
    if picked.numel() == 0:     # no rows: its strides may not allow the byte view
        picked = picked.clone(memory_format=torch.contiguous_format)
    return picked.view(torch.uint8)


def put_value_rows(cache: Int2KVCache, b: int, rows: torch.Tensor, packed: torch.Tensor) -> None:
    """Store packed value codes uint8 [H_kv, n, d/4] as rows `rows` [n] of sequence b, in either layout."""
    if not cache.value_tiles:
        cache.value_codes[b, :, rows] = packed
        return
    tiles, tile, slots = _value_tiles(cache, b, rows)
    tiles[:, tile, slots] = packed.contiguous().view(torch.int16)


def _put_codes(cache: Int2KVCache, side: str, b: int, rows: torch.Tensor, packed: torch.Tensor) -> None:
    """Store packed codes [H_kv, n, d/4] of one side as rows `rows` of sequence b."""
    if side == "value":
        put_value_rows(cache, b, rows, packed)
    else:
        cache.key_codes[b, :, rows] = packed


def int2_rows(capacity: int, sink_tokens: int = SINK_TOKENS, recent_tokens: int = RECENT_TOKENS,
              token_block: int = 1) -> int:
    """INT2 rows a store of `capacity` tokens allocates: at least one, rounded up to whole blocks of
    ROW_BLOCK so the decode kernel reads whole 64-token tiles without bounds checks (and to whole
    blocks of token_block, the key blocks of a layer with keys per channel)."""
    rows = max(capacity - sink_tokens - recent_tokens, 1)
    block = math.lcm(ROW_BLOCK, token_block)
    return -(-rows // block) * block


def empty_cache(batch: int, kv_heads: int, head_dim: int, capacity: int, key_group_size: int = 64,
                value_group_size: int = 64, sink_tokens: int = SINK_TOKENS, recent_tokens: int = RECENT_TOKENS,
                device: str | torch.device = "cpu", key_axis: str = "token",
                value_layout: str = DEFAULT_VALUE_LAYOUT, rows: int | None = None) -> Int2KVCache:
    """An empty store for up to `capacity` tokens per sequence (INT2 rows: int2_rows, or `rows`); key_axis
    "channel": keys per channel over blocks of key_group_size tokens; value_layout "tiles": value codes in 64-row
    tiles (the class docstring)."""
    if value_layout not in VALUE_LAYOUTS:
        raise ValueError(f"value_layout must be one of {VALUE_LAYOUTS}, not {value_layout!r}")
    block = key_group_size if key_axis == "channel" else 1
    rows = int2_rows(capacity, sink_tokens, recent_tokens, block) if rows is None else rows
    ring = recent_tokens + (block if key_axis == "channel" else 0)

    def bf16(n):
        return torch.zeros(batch, kv_heads, n, head_dim, dtype=torch.bfloat16, device=device)

    # Arrays of one size share one allocation, one after another: the key codes, then the value codes; and the key
    # scales, key zeros, value scales, value zeros where they are of one size (keys per token in groups as the
    # values'; keys per channel in blocks of 64 tokens with value groups of 64: a block's D bytes, its 64 tokens'
    # D / 64 each). A tile's bytes of each group are then one strided box, which the TMA-fed decode copies at once
    # (triton.decode.tma_descriptors).
    key_codes, value_codes = torch.zeros(2, batch, kv_heads, rows, head_dim // 4, dtype=torch.uint8,
                                         device=device).unbind(0)
    if key_axis == "channel":
        key_shape = (batch, kv_heads, rows // block, head_dim)
    else:
        key_shape = (batch, kv_heads, rows, head_dim // key_group_size)
    value_shape = (batch, kv_heads, rows, head_dim // value_group_size)
    if math.prod(key_shape) == math.prod(value_shape):
        joint = torch.zeros(4, math.prod(key_shape), dtype=torch.uint8, device=device)
        key_scale, key_zero = (a.view(key_shape) for a in joint[:2])
        value_scale, value_zero = (a.view(value_shape) for a in joint[2:])
    else:
        key_scale, key_zero = (torch.zeros(key_shape, dtype=torch.uint8, device=device) for _ in range(2))
        value_scale, value_zero = (torch.zeros(value_shape, dtype=torch.uint8, device=device) for _ in range(2))
    key_zero, value_zero = key_zero.view(torch.int8), value_zero.view(torch.int8)
    return Int2KVCache(
        key_sink=bf16(sink_tokens), value_sink=bf16(sink_tokens),
        key_recent=bf16(ring), value_recent=bf16(ring),
        key_codes=key_codes, key_scale=key_scale, key_zero=key_zero,
        value_codes=value_codes, value_scale=value_scale, value_zero=value_zero,
        lengths=torch.zeros(batch, dtype=torch.int32, device=device),
        key_group_size=key_group_size, value_group_size=value_group_size, key_axis=key_axis,
        value_layout=value_layout)


def allocation_nbytes(tensors) -> int:
    """Bytes of the allocations behind tensors, each counted once (a store's arrays share them: empty_cache)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def to_device(cache: Int2KVCache, device: str | torch.device) -> Int2KVCache:
    """A copy of the store on device, its arrays grouped in allocations as empty_cache groups them (the key and value
    codes; the four scale and zero arrays where they are of one size)."""
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(cache).items()}
    fields["graphs"] = {}
    for names in (("key_codes", "value_codes"), ("key_scale", "key_zero", "value_scale", "value_zero")):
        arrays = [getattr(cache, n) for n in names]
        if len({a.numel() * a.element_size() for a in arrays}) == 1:
            joint = torch.stack([a.contiguous().view(torch.uint8).reshape(-1) for a in arrays]).to(device)
            fields.update({n: j.view(a.dtype).view(a.shape) for n, j, a in zip(names, joint, arrays)})
    return Int2KVCache(**fields)


def window_split(window: int, recent_tokens: int = RECENT_TOKENS, token_block: int = 1,
                 int2: bool = True) -> tuple[int, int]:
    """(T, W) of a sliding window of N tokens: T INT2 rows, the most whole tiles of ROW_BLOCK (and key blocks of
    token_block) that leave at least recent_tokens, and W = N − T BF16 tokens (T = 0: too short for one tile);
    int2=False, a window kept whole in BF16 (layers.holds_int2): (0, N)."""
    unit = math.lcm(ROW_BLOCK, token_block)
    rows = max(window - recent_tokens, 0) // unit * unit if int2 else 0
    return rows, window - rows


def window_cache(batch: int, kv_heads: int, head_dim: int, window: int, key_group_size: int = 64,
                 value_group_size: int = 64, sink_tokens: int = SINK_TOKENS, recent_tokens: int = RECENT_TOKENS,
                 device: str | torch.device = "cpu", value_layout: str = DEFAULT_VALUE_LAYOUT,
                 key_axis: str = "token", int2: bool = True) -> Int2KVCache:
    """An empty store of a sliding layer whose queries see `window` tokens (their own included): the sink, a BF16
    ring of W slots (W + G with keys per channel) and a ring of T INT2 rows, (T, W) = window_split (the class
    docstring). int2=False: a window kept whole in BF16 (layers.holds_int2), T = 0 and W = N: no token is ever
    quantized, and the decode kernel reads it as a store whose INT2 rows are all gone."""
    if not int2 and key_axis != "token":
        raise ValueError("a window kept in BF16 has no key blocks: key_axis must be 'token'")
    rows, ring = window_split(window, recent_tokens, key_group_size if key_axis == "channel" else 1, int2)
    if rows == 0 and int2:
        raise ValueError(f"a window of {window} tokens holds no INT2 tile beside {recent_tokens} BF16 tokens")
    cache = empty_cache(batch, kv_heads, head_dim, sink_tokens + window, key_group_size, value_group_size,
                        sink_tokens, ring, device, key_axis=key_axis, value_layout=value_layout, rows=rows)
    cache.window = window
    return cache


def rotate(x: torch.Tensor, rotation: torch.Tensor, mean: torch.Tensor | None = None) -> torch.Tensor:
    """y[t, h] = (x[t, h] − μ[h])·R[h] in float32, x [tokens, H_kv, d], R [H_kv, d, d]."""
    x = x.float()
    if mean is not None:
        x = x - mean.float()
    return torch.einsum("thd,hde->the", x, rotation.float())


def write_int2(x: torch.Tensor, rotation: torch.Tensor, clip: torch.Tensor, group_size: int = 64,
               mean: torch.Tensor | None = None):
    """Rotate, centre and quantize x [tokens, H_kv, d] (any float dtype) with the per-head clip [H_kv].

    Returns (codes uint8 [tokens, H_kv, d/4] packed by quant.pack_int2,
             scale codes uint8 [tokens, H_kv, d/G], zero codes int8 [tokens, H_kv, d/G]).
    """
    codes, scale, zero = quant.quantize(rotate(x, rotation, mean), group_size, clip.float())
    return quant.pack_int2(codes), scale, zero


def read_int2(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int = 64) -> torch.Tensor:
    """Dequantize the output of write_int2 back to rotated space: float32 [..., d]."""
    return quant.dequantize(quant.unpack_int2(packed), scale, zero, group_size)


def write_key_blocks(y: torch.Tensor, clip: torch.Tensor, group_size: int = 64):
    """Quantize rotated keys y [tokens, H_kv, d] (tokens a multiple of G) per channel over blocks of G tokens,
    clip [H_kv] (methods.encode of a channel-axis Side, without the rotation).

    Returns (codes uint8 [tokens, H_kv, d/4] packed along channels by quant.pack_int2,
             scale codes uint8 [tokens/G, H_kv, d], zero codes int8 [tokens/G, H_kv, d])."""
    t, h, d = y.shape
    blocks = y.float().reshape(t // group_size, group_size, h, d).permute(0, 2, 3, 1)   # [t/G, H, d, G]
    codes, scale, zero = quant.quantize(blocks, group_size, clip.float()[:, None])
    return quant.pack_int2(codes.permute(0, 3, 1, 2).reshape(t, h, d)), scale[..., 0], zero[..., 0]


def read_key_blocks(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    group_size: int = 64) -> torch.Tensor:
    """Dequantize per-channel key blocks, packed [..., T, d/4], scale/zero [..., T/G, d] -> float32 [..., T, d]:
    k̂[t, c] = step[t div G, c]·(q[t, c] + z[t div G, c]/4)."""
    step = quant.scale_from_code(scale).repeat_interleave(group_size, dim=-2)
    offset = (zero.float() / quant.ZERO_CODES_PER_STEP).repeat_interleave(group_size, dim=-2)
    return step * (quant.unpack_int2(packed).float() + offset)


def _store_blocks(cache: Int2KVCache, b: int, old: int, keys: torch.Tensor, values: torch.Tensor,
                  layer: LayerRotation) -> None:
    """Keys per channel: store keys/values [n, H_kv, d] (original space) at positions old .. old + n − 1 of
    sequence b, after `old` stored tokens. The blocks whose last token leaves the window [S + n_int2(old),
    S + n_int2(old + n)) are quantized first (keys per channel, values per token) from their BF16 ring copy
    if they were stored before, else from their float32 rotation; then the new tokens that stay BF16 go to
    the sink or their ring slot."""
    s, w, r, g = cache.sink_tokens, cache.recent_tokens, cache.ring_slots, cache.key_group_size
    final = old + keys.shape[0]

    def n_int2(length):
        return max(length - s - w, 0) // g * g

    lo, hi = s + n_int2(old), s + n_int2(final)
    if cache.window is not None:        # a window's ring of rows keeps the last T INT2 tokens
        lo = min(max(lo, hi - cache.key_codes.shape[2]), hi)
    pos = torch.arange(old, final, device=keys.device)
    in_sink, in_ring = pos < s, pos >= max(hi, s)
    for x, side in ((keys, "key"), (values, "value")):
        rot, mean, clip = (getattr(layer, f"{side}_{name}") for name in ("rotation", "mean", "clip"))
        y = rotate(x, rot, mean)
        ring = getattr(cache, f"{side}_recent")
        if hi > lo:
            split = min(max(old, lo), hi)       # [lo, split) were stored before: read back from the ring
            kept = ring[b, :, (torch.arange(lo, split, device=keys.device) - s) % r].transpose(0, 1)
            leave = torch.cat([kept.float(), y[split - old:hi - old]])
            rows = cache.int2_row(torch.arange(lo - s, hi - s, device=keys.device))
            if side == "key":
                packed, scale, zero = write_key_blocks(leave, clip, g)
                blocks = rows[::g] // g
                cache.key_scale[b, :, blocks] = scale.transpose(0, 1)
                cache.key_zero[b, :, blocks] = zero.transpose(0, 1)
            else:
                codes, scale, zero = quant.quantize(leave, cache.value_group_size, clip.float())
                packed = quant.pack_int2(codes)
                cache.value_scale[b, :, rows] = scale.transpose(0, 1)
                cache.value_zero[b, :, rows] = zero.transpose(0, 1)
            _put_codes(cache, side, b, rows, packed.transpose(0, 1))
        yb = y.to(torch.bfloat16).transpose(0, 1)
        getattr(cache, f"{side}_sink")[b, :, pos[in_sink]] = yb[:, in_sink]
        ring[b, :, (pos[in_ring] - s) % r] = yb[:, in_ring]


def _store(cache: Int2KVCache, b: int, pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           layer: LayerRotation, write) -> None:
    """Store tokens at positions `pos` (ascending, [n]) of sequence b; keys/values [n, H_kv, d] original space."""
    s, w = cache.sink_tokens, cache.recent_tokens
    final = int(pos[-1]) + 1
    in_sink, in_ring = pos < s, (pos >= s) & (pos >= final - w)
    to_int2 = ~in_sink & ~in_ring
    if cache.window is not None:        # a window's ring of rows: its tokens before the last N are gone
        to_int2 &= pos >= final - cache.window
    for x, side in ((keys, "key"), (values, "value")):
        rot, mean = getattr(layer, f"{side}_rotation"), getattr(layer, f"{side}_mean")
        y = rotate(x, rot, mean).to(torch.bfloat16).transpose(0, 1)
        getattr(cache, f"{side}_sink")[b, :, pos[in_sink]] = y[:, in_sink]
        getattr(cache, f"{side}_recent")[b, :, (pos[in_ring] - s) % w] = y[:, in_ring]
        if to_int2.any():
            rows = cache.int2_row(pos[to_int2] - s)
            g = getattr(cache, f"{side}_group_size")
            packed, scale, zero = write(x[to_int2], rot, getattr(layer, f"{side}_clip"), g, mean)
            _put_codes(cache, side, b, rows, packed.transpose(0, 1))
            getattr(cache, f"{side}_scale")[b, :, rows] = scale.transpose(0, 1)
            getattr(cache, f"{side}_zero")[b, :, rows] = zero.transpose(0, 1)


def prefill(cache: Int2KVCache, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
            layer: LayerRotation, write=write_int2) -> None:
    """Fill an empty cache in place with keys/values [B, L_max, H_kv, d] (original space), lengths [B].

    Tokens bound for INT2 are quantized from their float32 rotation by `write` (write_int2 or the
    Triton kernel of the same signature)."""
    for b, n in enumerate(lengths.tolist()):
        if n and cache.key_axis == "channel":
            _store_blocks(cache, b, 0, keys[b, :n], values[b, :n], layer)
        elif n:
            pos = torch.arange(n, device=keys.device)
            _store(cache, b, pos, keys[b, :n], values[b, :n], layer, write)
    cache.lengths.copy_(lengths.to(cache.lengths))


def advance(cache: Int2KVCache, tokens: int, starts: torch.Tensor | None = None) -> torch.Tensor:
    """Count `tokens` new tokens per sequence, less `starts[b]` leading pads: lengths += tokens − starts.

    The append functions (append here, triton.write.append_kv) take lengths that already count the new
    tokens, so one advance serves every layer whose store shares the lengths tensor. Returns the counts."""
    counts = torch.full_like(cache.lengths, tokens) if starts is None else tokens - starts.to(cache.lengths)
    cache.lengths += counts
    return counts


def append(cache: Int2KVCache, keys: torch.Tensor, values: torch.Tensor, layer: LayerRotation,
           starts: torch.Tensor | None = None, write=write_int2) -> None:
    """Store keys/values [B, H_kv, n, d] (original space, attention layout) after each sequence's tokens, in place.

    Sequence b takes tokens t ≥ starts[b] (its leading pads are skipped; starts None: all n), at
    positions L_b − n + starts[b] + (t − starts[b]), L_b = cache.lengths[b], which must already count
    them (see advance). A token still in the recent ring that the new ones push out of the last W is
    quantized into its INT2 row from its BF16 rotated copy before its ring slot is reused; new tokens
    that land in INT2 directly are quantized from their float32 rotation (as prefill). Keys per channel:
    whole blocks leave the ring when their last token does (_store_blocks)."""
    s, w = cache.sink_tokens, cache.recent_tokens
    n = keys.shape[2]
    if cache.key_axis == "channel":
        first = [0] * len(keys) if starts is None else starts.tolist()
        for b, (final, st) in enumerate(zip(cache.lengths.tolist(), first)):
            if st < n:
                _store_blocks(cache, b, final - (n - st), keys[b, :, st:].transpose(0, 1),
                              values[b, :, st:].transpose(0, 1), layer)
        return
    eye = torch.eye(keys.shape[-1], device=keys.device).expand_as(layer.key_rotation)
    first = [0] * len(keys) if starts is None else starts.tolist()
    for b, (final, st) in enumerate(zip(cache.lengths.tolist(), first)):
        old = final - (n - st)
        if st >= n:
            continue
        lo, hi = max(s, old - w, final - (cache.window or final)), min(old, final - w)
        if hi > lo:
            leave = torch.arange(lo, hi, device=keys.device)
            slots, rows = (leave - s) % w, cache.int2_row(leave - s)
            for side in ("key", "value"):
                g = getattr(cache, f"{side}_group_size")
                kept = getattr(cache, f"{side}_recent")[b, :, slots].transpose(0, 1)
                packed, scale, zero = write_int2(kept, eye, getattr(layer, f"{side}_clip"), g)
                _put_codes(cache, side, b, rows, packed.transpose(0, 1))
                getattr(cache, f"{side}_scale")[b, :, rows] = scale.transpose(0, 1)
                getattr(cache, f"{side}_zero")[b, :, rows] = zero.transpose(0, 1)
        pos = torch.arange(old, final, device=keys.device)
        _store(cache, b, pos, keys[b, :, st:].transpose(0, 1), values[b, :, st:].transpose(0, 1), layer, write)


def append_token(cache: Int2KVCache, key: torch.Tensor, value: torch.Tensor, layer: LayerRotation) -> None:
    """Append one token per sequence in place, key/value [B, H_kv, d] original space (advance, then append).

    When the recent ring is full, the token leaving it (position L − W) is quantized from its BF16
    rotated copy into INT2 row L − W − S before its ring slot is reused."""
    advance(cache, 1)
    append(cache, key[:, :, None], value[:, :, None], layer)


def sequence_kv(cache: Int2KVCache, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All stored keys and values of sequence b in rotated space, float32 [H_kv, L, d], in position order (a
    window's store: its last min(L, N))."""
    n = int(cache.lengths[b])
    s, w, tb = cache.sink_tokens, cache.recent_tokens, cache.token_block
    n_sink, n_int2 = min(n, s), max(n - s - w, 0) // tb * tb
    gone = 0 if cache.window is None else min(max(n - cache.window, 0), n_sink)     # sink tokens out of the window
    dev = cache.lengths.device
    ring = (torch.arange(s + n_int2, max(n, s), device=dev) - s) % cache.ring_slots
    rows = cache.int2_row(torch.arange(cache.first_live(n, n_int2), n_int2, device=dev))
    out = []
    for side in ("key", "value"):
        g = getattr(cache, f"{side}_group_size")
        codes = cache.key_codes[b, :, rows] if side == "key" else value_rows(cache, b, rows)
        if side == "key" and cache.key_axis == "channel":    # each row's block's codes
            int2 = read_key_blocks(codes, cache.key_scale[b, :, rows // g], cache.key_zero[b, :, rows // g], 1)
        else:
            int2 = read_int2(codes, getattr(cache, f"{side}_scale")[b, :, rows],
                             getattr(cache, f"{side}_zero")[b, :, rows], g)
        parts = [getattr(cache, f"{side}_sink")[b, :, gone:n_sink].float(), int2,
                 getattr(cache, f"{side}_recent")[b, :, ring].float()]
        out.append(torch.cat(parts, dim=1))
    return out[0], out[1]


def store_nbytes(batch: int, capacity: int, kv_heads: int, head_dim: int, key_group_size: int = 64,
                 value_group_size: int = 64, sink_tokens: int = SINK_TOKENS, recent_tokens: int = RECENT_TOKENS,
                 key_axis: str = "token", rows: int | None = None) -> int:
    """Bytes of empty_cache(batch, kv_heads, head_dim, capacity, ..., rows): BF16 windows, INT2 rows, lengths.
    Keys per channel: scale and zero codes of d channels per block of G rows (as many bytes a row as d/G
    groups a row when G divides d), a ring of W + G slots, rows in whole blocks of G."""
    channel = key_axis == "channel"
    block = key_group_size if channel else 1
    rows = int2_rows(capacity, sink_tokens, recent_tokens, block) if rows is None else rows
    windows = 2 * (sink_tokens + recent_tokens + (block if channel else 0)) * head_dim * 2
    key_meta = 2 * (rows // block) * head_dim if channel else 2 * rows * (head_dim // key_group_size)
    per_row = 2 * (head_dim // 4) + 2 * (head_dim // value_group_size)
    return batch * kv_heads * (windows + rows * per_row + key_meta) + 4 * batch


def rotate_query(q: torch.Tensor, key_rotation: torch.Tensor) -> torch.Tensor:
    """q̃[b, j] = q[b, j]·R_K[j // (H/H_kv)] in float32, q [B, H, d]."""
    kv_heads = key_rotation.shape[0]
    b, h, d = q.shape
    q = q.float().reshape(b, kv_heads, h // kv_heads, d)
    return torch.einsum("bkgd,kde->bkge", q, key_rotation.float()).reshape(b, h, d)


def decode_attention_reference(q: torch.Tensor, cache: Int2KVCache, key_rotation: torch.Tensor,
                               value_rotation: torch.Tensor | None, value_mean: torch.Tensor | None,
                               scaling: float) -> torch.Tensor:
    """Attention of one query token per sequence, q [B, H, d] original space, over the whole cache.

    o[b, j] = softmax(scaling · q̃[b, j]·K̃_b^T)·Ṽ_b·R_V[h]^T + μ_V[h], h = j // (H/H_kv), in float32
    (value_rotation None: R_V = I, the values' stored space, for weights that hold R_V). Returns float32 [B, H, d]."""
    bsz, heads, d = q.shape
    kv_heads = key_rotation.shape[0]
    group = heads // kv_heads
    qr = rotate_query(q, key_rotation).reshape(bsz, kv_heads, group, d)
    out = torch.empty(bsz, kv_heads, group, d, dtype=torch.float32, device=q.device)
    for b in range(bsz):
        k, v = sequence_kv(cache, b)
        p = torch.softmax(scaling * qr[b] @ k.transpose(1, 2), dim=-1)
        o = p @ v
        if value_rotation is not None:
            o = o @ value_rotation.float().transpose(1, 2)
        if value_mean is not None:
            o = o + value_mean.float()[:, None]
        out[b] = o
    return out.reshape(bsz, heads, d)
