"""One layer's INT2 KV store in pages, as a paged server (vLLM) lays out its cache: pool, block tables, slots.

A sequence's tokens are numbered by position p. Its INT2 tokens are those of kvstore.Int2KVCache (the reference:
which positions are INT2, their codes, scales and zero points, the BF16 sink and recent window are all its rules;
this module only says where the bytes live):

    page     P tokens (page_tokens, 64 by default: one tile of decode rows, and one key block of keys per channel
             in blocks of 64; blocks that divide P fit too). Position p of sequence b lives in page
             block_table[b, p div P], at row p mod P: vLLM's slot mapping, slot = block_table[b, p div P]·P + p mod P
             (slot_mapping). INT2 row n of kvstore (position S + n) is therefore row (S + n) mod P of page
             block_table[b, (S + n) div P]; S is a whole number of pages, so a page holds whole 64-row tiles and
             whole key blocks of one sequence.
    pool     uint8 [num_pages, page_bytes] (what vLLM hands a backend: one tensor a layer, num_blocks pages of
             page_size_bytes). Each page holds, one array after another (page_layout), for its H_kv heads and P rows:
                 key_codes    [H_kv, P, d/4]              (quant.pack_int2 along channels)
                 value_codes  [H_kv, P, d/4]              (value_layout "tiles": each 64 rows one tile, as kvstore)
                 key_scale, key_zero      [H_kv, P, d/G_K]   keys per token
                                          [H_kv, P/G, d]     keys per channel (one row a key block of G tokens)
                 value_scale, value_zero  [H_kv, P, d/G_V]
             so each array is a view [num_pages, H_kv, P, ...] whose page stride is page_bytes, and a (page, head)
             is exactly a kvstore sequence-and-head of P rows: the decode programs read a page as they read a store,
             the page found through the block table (decode_programs, PAGED).
    windows  BF16 [slots, H_kv, S, d] sink and [slots, H_kv, R, d] ring (R = W, or W + G with keys per channel) for
             keys and values, sequence b in window slot window_slot[b].

Why the BF16 tokens live in a side pool of window slots, not in pages: a page has one size, and a BF16 token takes
7-8 times an INT2 token's bytes (4d against d/2 + d/16 a head), so a BF16 page would hold 8-9 tokens and break the
one-page-a-P-tokens rule that vLLM's block tables, slot mapping and allocator rest on. The sink and the ring are a
fixed S + R tokens a sequence, whatever its length: a per-sequence state, not a per-token cache, and stored as one
(in vLLM, a fixed-size state a request holds, like a Mamba layer's: docs/vllm.md). The INT2 rows of the sink's pages
and of the tokens still in the ring are allocated but unused (about S + W of every sequence's tokens: 5 pages a
sequence at S = 64, W = 256).

The INT2 codes of a token are written when it leaves the ring (kvstore.append: quantized from its BF16 copy, or
keys per channel a whole block), W tokens after the token arrived, so the writes follow the block table, not the
step's slot mapping. This module's write and read are the torch reference: a sequence's pages gathered into a
kvstore store of one sequence (sequence_store), written or read by kvstore's own functions, and scattered back. The
device's are the Triton programs: triton/paged_write.py (prefill, append) writes pages through the block tables, and
triton/decode.py reads them.
"""

import math
from dataclasses import dataclass, field

import torch

from oscar_core import kvstore

PAGE_TOKENS = 64
ALIGN = 16          # bytes: each array of a page starts on a 16-byte boundary


def page_layout(kv_heads: int, head_dim: int, key_group_size: int = 64, value_group_size: int = 64,
                key_axis: str = "token", page_tokens: int = PAGE_TOKENS) -> dict[str, tuple[int, tuple, torch.dtype]]:
    """name -> (byte offset in a page, shape in a page, dtype) of the six INT2 arrays, in this order."""
    h, d, p = kv_heads, head_dim, page_tokens
    key_meta = (h, p // key_group_size, d) if key_axis == "channel" else (h, p, d // key_group_size)
    shapes = [("key_codes", (h, p, d // 4), torch.uint8), ("value_codes", (h, p, d // 4), torch.uint8),
              ("key_scale", key_meta, torch.uint8), ("key_zero", key_meta, torch.int8),
              ("value_scale", (h, p, d // value_group_size), torch.uint8),
              ("value_zero", (h, p, d // value_group_size), torch.int8)]
    out, offset = {}, 0
    for name, shape, dtype in shapes:
        out[name] = (offset, shape, dtype)
        offset += -(-math.prod(shape) // ALIGN) * ALIGN
    return out


def page_bytes(kv_heads: int, head_dim: int, key_group_size: int = 64, value_group_size: int = 64,
               key_axis: str = "token", page_tokens: int = PAGE_TOKENS) -> int:
    """Bytes of one page (vLLM's page_size_bytes of the layer)."""
    layout = page_layout(kv_heads, head_dim, key_group_size, value_group_size, key_axis, page_tokens)
    offset, shape, _ = layout["value_zero"]
    return offset + -(-math.prod(shape) // ALIGN) * ALIGN


def page_problem(page_tokens: int, sink_tokens: int, key_group_size: int, key_axis: str,
                 window: int | None = None) -> str | None:
    """Why a layer cannot be kept in pages of page_tokens tokens (None: it can)."""
    if page_tokens < kvstore.ROW_BLOCK or page_tokens % kvstore.ROW_BLOCK:
        return f"a page of {page_tokens} tokens is not a whole number of {kvstore.ROW_BLOCK}-row tiles"
    if sink_tokens % page_tokens:
        return f"a sink of {sink_tokens} tokens is not a whole number of {page_tokens}-token pages"
    if key_axis == "channel" and page_tokens % key_group_size:
        return f"key blocks of {key_group_size} tokens do not divide a page of {page_tokens} tokens"
    if window is not None:
        return f"a sliding window of {window} tokens keeps its INT2 rows in a ring, which is not paged yet"
    return None


@dataclass
class PagedKVCache(kvstore.StoreWindows):
    """One layer's paged store (the module docstring): the INT2 arrays are views of `pool` [num_pages, page_bytes],
    [num_pages, H_kv, P, ...] each; the BF16 windows [slots, H_kv, S or R, d]; block_table int32 [B, max_pages],
    window_slot int32 [B] and lengths int32 [B] (tokens of each sequence, as kvstore's) per sequence.
    The field names the decode programs read are kvstore.Int2KVCache's."""
    pool: torch.Tensor
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
    block_table: torch.Tensor
    window_slot: torch.Tensor
    lengths: torch.Tensor
    key_group_size: int = 64
    value_group_size: int = 64
    key_axis: str = "token"
    value_layout: str = kvstore.DEFAULT_VALUE_LAYOUT
    window: None = None
    graphs: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def page_tokens(self) -> int:
        return self.key_codes.shape[2]

    @property
    def page_stride(self) -> int:
        """Bytes from one page to the next in every INT2 array."""
        return self.pool.stride(0)

    @property
    def rows(self) -> int:
        """INT2 rows a sequence can hold: its block table's pages past the sink."""
        return self.block_table.shape[1] * self.page_tokens - self.sink_tokens


def pool_views(pool: torch.Tensor, layout: dict) -> dict[str, torch.Tensor]:
    """The INT2 arrays of a pool [num_pages, page_bytes] as views [num_pages, *shape] (page_layout)."""
    return {name: pool[:, off:off + math.prod(shape)].view(torch.uint8).view(dtype).view(len(pool), *shape)
            for name, (off, shape, dtype) in layout.items()}


def empty_paged(num_pages: int, batch: int, max_pages: int, kv_heads: int, head_dim: int, key_group_size: int = 64,
                value_group_size: int = 64, sink_tokens: int = kvstore.SINK_TOKENS,
                recent_tokens: int = kvstore.RECENT_TOKENS, key_axis: str = "token",
                value_layout: str = kvstore.DEFAULT_VALUE_LAYOUT, page_tokens: int = PAGE_TOKENS,
                window_slots: int | None = None, device: str | torch.device = "cpu") -> PagedKVCache:
    """An empty paged store: a pool of num_pages pages, block tables of max_pages pages for `batch` sequences (all
    page 0 until assigned), window slots (default one a sequence; window_slot[b] = b)."""
    problem = page_problem(page_tokens, sink_tokens, key_group_size, key_axis)
    if problem is not None:
        raise ValueError(problem)
    if value_layout not in kvstore.VALUE_LAYOUTS:
        raise ValueError(f"value_layout must be one of {kvstore.VALUE_LAYOUTS}, not {value_layout!r}")
    layout = page_layout(kv_heads, head_dim, key_group_size, value_group_size, key_axis, page_tokens)
    nbytes = page_bytes(kv_heads, head_dim, key_group_size, value_group_size, key_axis, page_tokens)
    pool = torch.zeros(num_pages, nbytes, dtype=torch.uint8, device=device)
    slots = batch if window_slots is None else window_slots
    ring = recent_tokens + (key_group_size if key_axis == "channel" else 0)

    def bf16(n):
        return torch.zeros(slots, kv_heads, n, head_dim, dtype=torch.bfloat16, device=device)

    return PagedKVCache(
        pool=pool, key_sink=bf16(sink_tokens), value_sink=bf16(sink_tokens), key_recent=bf16(ring),
        value_recent=bf16(ring), **pool_views(pool, layout),
        block_table=torch.zeros(batch, max_pages, dtype=torch.int32, device=device),
        window_slot=torch.arange(batch, dtype=torch.int32, device=device),
        lengths=torch.zeros(batch, dtype=torch.int32, device=device), key_group_size=key_group_size,
        value_group_size=value_group_size, key_axis=key_axis, value_layout=value_layout)


def slot_mapping(block_table: torch.Tensor, b: int, positions: torch.Tensor, page_tokens: int = PAGE_TOKENS):
    """vLLM's slot of each position of sequence b: block_table[b, p div P]·P + p mod P, int64 [n]."""
    positions = positions.long()
    return block_table[b].long()[positions // page_tokens] * page_tokens + positions % page_tokens


def _int2_pages(paged: PagedKVCache, b: int) -> torch.Tensor:
    """The pages of sequence b's INT2 rows, in row order: logical pages S/P .. ⌈L/P⌉ − 1."""
    p, length = paged.page_tokens, int(paged.lengths[b])
    first, last = paged.sink_tokens // p, max(-(-length // p), paged.sink_tokens // p)
    if last > paged.block_table.shape[1]:
        raise ValueError(f"sequence {b} of {length} tokens needs {last} pages, its block table has "
                         f"{paged.block_table.shape[1]}")
    return paged.block_table[b, first:last].long()


def _rows_of(pages_first: torch.Tensor) -> torch.Tensor:
    """[n_pages, H_kv, rows, ...] -> [1, H_kv, n_pages·rows, ...]: pages side by side along the rows."""
    n, h, r = pages_first.shape[:3]
    return pages_first.transpose(0, 1).reshape(1, h, n * r, *pages_first.shape[3:])


def sequence_store(paged: PagedKVCache, b: int) -> kvstore.Int2KVCache:
    """Sequence b as a kvstore store of one sequence (copies): its window slot's BF16 tokens, and as INT2 rows the
    rows of its pages past the sink, page after page (kvstore row n = position S + n)."""
    pages, slot = _int2_pages(paged, b), int(paged.window_slot[b])
    arrays = {name: _rows_of(getattr(paged, name)[pages]) for name in
              ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero")}
    windows = {name: getattr(paged, name)[slot:slot + 1].clone()
               for name in ("key_sink", "value_sink", "key_recent", "value_recent")}
    return kvstore.Int2KVCache(**windows, **arrays, lengths=paged.lengths[b:b + 1].clone(),
                               key_group_size=paged.key_group_size, value_group_size=paged.value_group_size,
                               key_axis=paged.key_axis, value_layout=paged.value_layout)


def put_sequence(paged: PagedKVCache, b: int, store: kvstore.Int2KVCache) -> None:
    """Write a one-sequence store (sequence_store's, changed) back into sequence b's pages and window slot."""
    pages, slot = _int2_pages(paged, b), int(paged.window_slot[b])
    for name in ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero") * bool(len(pages)):
        rows = getattr(store, name)[0]
        getattr(paged, name)[pages] = rows.reshape(rows.shape[0], len(pages), -1, *rows.shape[2:]).transpose(0, 1)
    for name in ("key_sink", "value_sink", "key_recent", "value_recent"):
        getattr(paged, name)[slot] = getattr(store, name)[0]


def append(paged: PagedKVCache, keys: torch.Tensor, values: torch.Tensor, layer: kvstore.LayerRotation,
           starts: torch.Tensor | None = None) -> None:
    """kvstore.append into pages: keys/values [B, H_kv, n, d] (original space) after each sequence's tokens, whose
    lengths already count them (kvstore.advance works on a PagedKVCache too) and whose block tables hold their
    pages."""
    for b in range(len(paged.lengths)):
        store = sequence_store(paged, b)
        kvstore.append(store, keys[b:b + 1], values[b:b + 1], layer, None if starts is None else starts[b:b + 1])
        put_sequence(paged, b, store)


def prefill(paged: PagedKVCache, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
            layer: kvstore.LayerRotation) -> None:
    """kvstore.prefill into empty sequences: keys/values [B, L_max, H_kv, d], lengths [B]."""
    paged.lengths.copy_(lengths.to(paged.lengths))
    for b, n in enumerate(lengths.tolist()):
        store = sequence_store(paged, b)
        store.lengths.zero_()
        kvstore.prefill(store, keys[b:b + 1], values[b:b + 1], lengths[b:b + 1], layer)
        put_sequence(paged, b, store)


def sequence_kv(paged: PagedKVCache, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kvstore.sequence_kv of sequence b read through its block table: float32 [H_kv, L, d] keys and values."""
    return kvstore.sequence_kv(sequence_store(paged, b), 0)
