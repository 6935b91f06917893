"""The Triton writes of a paged store (paged.PagedKVCache): a prefill of a batch of sequences, and an append (a decode
step, or a chunk) after their tokens, placed as paged.prefill / paged.append place them (INT2 row r of sequence b at
row (S + r) mod P of page block_table[b, (S + r) div P], the BF16 sink and ring in window slot window_slot[b]).

The programs are write.py's (prefill_kv, append_kv, leave_blocks) compiled with PAGED: each INT2 tile, key block or
evicted token finds its page through the block table on the device, so a decode step is the same launches whatever
the lengths (capturable in a CUDA graph, as OscarCache's steps are). Without PAGED they compile to the code they had
before (the same PTX for sm_90, but for four unread parameters). The arithmetic is the unpaged kernels', so a paged
store holds, page by page, the bytes the unpaged kernels write into a kvstore store.
"""

import torch

from oscar_core.paged import PagedKVCache
from oscar_core.triton import write


def _paged(store) -> PagedKVCache:
    if not isinstance(store, PagedKVCache):
        raise TypeError(f"paged_write writes a paged.PagedKVCache, not {type(store).__name__} (write.py: kvstore's)")
    return store


def prefill(store: PagedKVCache, keys: torch.Tensor, values: torch.Tensor, key_rot, value_rot,
            key_clip: torch.Tensor, value_clip: torch.Tensor, block_t: int = 64) -> None:
    """paged.append into empty sequences (a prefill), one launch for K and V: keys/values [B, H_kv, n, d] (original
    space, any strides with unit channel stride), left-padded: sequence b's tokens are the last store.lengths[b] of
    the n (the lengths already count them: kvstore.advance with the pads as starts) and its block table row holds
    pages for them. key_rot / value_rot: write.prepare_rotation's triples; clips float32 [H_kv]; block_t: the tile,
    which must divide the page (write.prefill_kv)."""
    write.prefill_kv(_paged(store), keys, values, key_rot, value_rot, key_clip, value_clip, block_t=block_t)


def append(store: PagedKVCache, keys: torch.Tensor, values: torch.Tensor, key_rot, value_rot,
           key_clip: torch.Tensor, value_clip: torch.Tensor, starts: torch.Tensor | None = None) -> None:
    """paged.append after each sequence's tokens: keys/values [B, H_kv, n, d], lengths already counting them (starts:
    leading pads, int32 [B], or None), block tables holding their pages. A decode step is n = 1: the new token into
    its sink row or ring slot, and what it pushes out of the recent window quantized into its page: the token W
    back (keys per token), or with keys per channel the key block whose last token that is (write.leave_blocks, one
    launch before the append's). Keys per channel: n ≤ W (a longer chunk is paged.append's)."""
    store = _paged(store)
    if store.key_axis == "channel":
        write.leave_blocks(store, key_clip, value_clip, keys.shape[2], starts)
        write.append_kv(store, keys, values, key_rot, value_rot, key_clip, value_clip, starts, evict=False)
    else:
        write.append_kv(store, keys, values, key_rot, value_rot, key_clip, value_clip, starts, evict=True)
