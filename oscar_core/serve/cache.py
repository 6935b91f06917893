"""OscarCache: a transformers Cache whose keys and values are stored INT2 (or BF16) by a method of methods.py.

Token-group methods (int2, hadamard, oscar) keep each layer in one preallocated kvstore.Int2KVCache
(its docstring gives the byte layout): B sequences, capacity C tokens each, the first S tokens and a
ring of the last W in BF16, rotated and centred ((x − μ)·R), the tokens between them as INT2 rows.
Every write is in place: a new token goes to the sink or its ring slot, and the token it pushes out
of the ring (already rotated) is quantized into its INT2 row; nothing already stored is ever copied,
except once per growth of the capacity (by half, when no `capacity` was given). The per-sequence
lengths are one device int32 tensor shared by every layer; the host keeps its own count (`seen`,
pads included) so a decode step reads nothing back from the device.
On CUDA a write is one Triton launch per layer (K and V, the whole batch): the first (the prefill) by
triton.write.prefill_kv, later ones by triton.write.append_kv; elsewhere the torch reference (kvstore.append).
A bundle layer whose keys are quantized per channel (Bundle.key_axis "channel") lives in the same store with
key_axis "channel": its keys and values leave the ring a block of G tokens at a time (kvstore's docstring); its
prefill is prefill_kv's, its decode steps triton.write.append_kv plus triton.write.leave_blocks, later chunks
longer than the window the torch reference's.
bf16 and the kivi baseline keep the SideStore below: sink, INT2 blocks and recent tokens as growing
tensors, read in torch. A left-padded batch written from an exact prefill (fill, with each sequence's pads) skips the
pads: a store by its per-sequence lengths, SideStores by one a sequence (PaddedSides), so that each sequence's sink,
INT2 tokens and recent window are those it has alone.

A hybrid model's layers without a KV cache (linear attention, Mamba: models.attention_layer_ids, the bundle's
rotation.layers) hold transformers' LinearAttentionLayer (their convolution and recurrent states, exact); the
first OscarLayer advances the shared sequence lengths.

Sliding layers (layers.LayerSpec.window = N: a query sees its own token and the N − 1 before it). Any sliding layer
of the bf16 method, and of kivi one whose window is too short for INT2 to pay (layers.holds_int2), is a RingLayer:
the last N − 1 tokens in BF16, as transformers' DynamicSlidingWindowLayer keeps them (and sizes the mask from).
Every other sliding layer is an OscarLayer whose store is kvstore.window_cache: the sink, a BF16 ring of W' and a
ring of T INT2 rows (W' + T = N, window_split), which hold the last N tokens of each sequence past the sink, so the
decode kernel reads it as it reads a global layer's (skipping the sink tokens once out of the window, and with keys
per channel up to G − 1 tokens of the oldest block held) and the Triton writes write it; fixed in size from its
first update. A short window, kept whole in BF16, is such a store with T = 0, W' = N and no rotation, so that it
too is read by the kernel and captured in CUDA graphs. Its torch reads give the last N − 1 tokens (the mask's
size, as DynamicSlidingWindowLayer). A window that holds INT2 but is too short for one tile of INT2 rows (and key
blocks) keeps SideStores (sink, INT2, recent, as methods.py stores them) trimmed to the last N − 1 tokens after
every update, read by torch.

update() follows the serving convention: a single decoded token is written first and then attends to
what the store holds; the tokens of a multi-token update (prefill, or a prefill chunk) attend to the
stored past plus themselves as computed (in flight).

Reads. Torch: the store dequantized back to original space, [B, H_kv, L, d], each sequence's tokens
right-aligned (so a left-padded batch lines up with its attention mask). Kernel (kernel_reads: by default on CUDA;
True on the CPU under TRITON_INTERPRET=1): a layer the decode kernel can read (serving_problem) answers a decode step
with two attention.StandIns, and its attend(), which the attention function calls (attention.py: transformers' sdpa
function is wrapped to do so, so model.generate needs nothing more than the cache), writes the token and reads the
store by triton.decode.decode_step (with the Triton writes, one CUDA-graph replay a layer on CUDA; else
triton.decode.decode_attention after the write). There, a multi-token update is held until attend() sees the
attention mask: a sequence's leading pads are skipped, so its store starts at its first real token and ragged
batches decode by kernel with per-sequence lengths (an update nothing attends is written as it came when the cache
is next used). A step that reads by kernel does no host synchronisation and no host-to-device copy (bundle tensors
are moved to the device once, on the first update), so it can be captured in a CUDA graph (serve/decode_graph.py).
Every field of a layer is set by the layer's own methods.

Long because the layer kinds (OscarLayer, RingLayer, SideStore) and the Cache around them share one state: the
sequence lengths, the store and the kernel reads that every update and attend() keep consistent (the docstring above
alone is 60 lines). The pure helpers (memory_plan, serving_problem) could move out first if it grows.
"""

import copy
import dataclasses
import math
import warnings
from pathlib import Path

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from oscar_core import kvstore
from oscar_core.errors import OscarError
from oscar_core.formats.bundle import fetch_bundle, load_bundle
from oscar_core.layers import LayerSpec, holds_int2, layer_specs, manifest_specs
from oscar_core.serve import methods
from oscar_core.serve.attention import StandIn, install, oscar_attention  # noqa: F401 (oscar_attention: its old home)


def _triton_write():
    try:
        from oscar_core.triton import write
    except Exception:  # no triton, or no GPU build of it
        return None
    return write


class SideStore:
    """Sink, INT2 and recent storage of one side of one layer, as growing tensors (bf16, kivi, and a sliding layer
    of any method, which trim() keeps to its window)."""

    def __init__(self, side: methods.Side | None, sink: int, recent: int, block: int = 1):
        self.side, self.sink_tokens, self.recent_tokens, self.block = side, sink, recent, block
        self.sink = self.recent = None
        self.int2: dict[str, torch.Tensor] | None = None
        self.n_int2 = 0
        self.dropped = self.sink_dropped = 0   # tokens trimmed off the front (out of a sliding window), of the sink

    def append(self, x: torch.Tensor) -> None:
        """Append x [B, H_kv, n, d], then move whole blocks leaving the recent window to INT2."""
        x = x.to(torch.bfloat16)
        if self.sink is None:
            self.sink = x[:, :, :0].contiguous()
            self.recent = x[:, :, :0].contiguous()
        room = self.sink_tokens - self.sink.shape[2] - self.sink_dropped
        if room > 0:
            self.sink = torch.cat([self.sink, x[:, :, :room]], dim=2)
            x = x[:, :, room:]
        self.recent = torch.cat([self.recent, x], dim=2)
        if self.side is None:
            return
        b = self.block
        move = max(self.recent.shape[2] - self.recent_tokens, 0) // b * b
        if move:
            stored = methods.encode(self.side, self.recent[:, :, :move])
            self.int2 = stored if self.int2 is None else {
                k: torch.cat([self.int2[k], v], dim=2) for k, v in stored.items()}
            self.recent = self.recent[:, :, move:].clone()
            self.n_int2 += move

    def read(self, dtype: torch.dtype, last: int | None = None) -> torch.Tensor:
        """All L tokens held in position order (or the last `last` of them), original space, [B, H_kv, L, d]."""
        parts = [self.sink.to(dtype)]
        if self.int2 is not None:
            parts.append(methods.decode(self.side, self.int2).to(dtype))
        parts.append(self.recent.to(dtype))
        out = torch.cat(parts, dim=2)
        return out if last is None else out[:, :, max(out.shape[2] - last, 0):]

    def trim(self, keep: int) -> None:
        """Drop the tokens before the last `keep` (a sliding window's past): sink tokens first, then INT2 tokens
        in whole blocks (KIVI keys keep a block until all its tokens are out); storage of the new size."""
        excess = self.held() - keep
        if excess <= 0:
            return
        s = min(excess, self.sink.shape[2])
        if s:
            self.sink = self.sink[:, :, s:].clone()
            self.sink_dropped, self.dropped, excess = self.sink_dropped + s, self.dropped + s, excess - s
        if self.int2 is not None and excess > 0:
            b = self.side.token_block
            k = min(excess, self.n_int2) // b * b
            if k:
                self.int2 = {name: x[:, :, k // b:].clone() for name, x in self.int2.items()}
                self.n_int2, self.dropped = self.n_int2 - k, self.dropped + k

    def held(self) -> int:
        return 0 if self.sink is None else self.sink.shape[2] + self.n_int2 + self.recent.shape[2]

    def length(self) -> int:
        """Tokens written so far (those trimmed off included)."""
        return self.held() + self.dropped

    def tensors(self) -> list[torch.Tensor]:
        out = [t for t in (self.sink, self.recent) if t is not None]
        return out + (list(self.int2.values()) if self.int2 is not None else [])


class PaddedSides:
    """One SideStore a sequence of a left-padded batch: sequence b's first append skips its pads[b] leading pads, so
    its sink, INT2 blocks and recent window hold the tokens they would hold for it alone; its reads are right-aligned
    to the batch's padded length (pads[b] + its own), the pads zeros (the attention mask hides them)."""

    def __init__(self, rows: list[SideStore], pads: list[int]):
        self.rows, self.pads = rows, pads

    def append(self, x: torch.Tensor) -> None:
        for b, row in enumerate(self.rows):
            row.append(x[b:b + 1, :, 0 if row.length() else self.pads[b]:])

    def read(self, dtype: torch.dtype, last: int | None = None) -> torch.Tensor:
        parts = [row.read(dtype, last) for row in self.rows]
        cols = min(self.length(), last or self.length())
        out = parts[0].new_zeros(len(parts), parts[0].shape[1], cols, parts[0].shape[3])
        for b, part in enumerate(parts):
            n = min(part.shape[2], cols)
            if n:
                out[b, :, cols - n:] = part[0, :, part.shape[2] - n:]
        return out

    def trim(self, keep: int) -> None:
        for row in self.rows:
            row.trim(keep)

    def held(self) -> int:
        return max(row.held() for row in self.rows)

    def length(self) -> int:
        """The batch's padded length (the same for every sequence: its pads and its tokens)."""
        return self.pads[0] + self.rows[0].length()

    @property
    def n_int2(self) -> int:
        return max(row.n_int2 for row in self.rows)

    @property
    def sink(self) -> torch.Tensor | None:
        """A [B, …] stand-in of the sink's shape (bf16_nbytes reads its batch, heads and head_dim)."""
        sink = self.rows[0].sink
        return None if sink is None else sink.expand(len(self.rows), -1, -1, -1)

    def tensors(self) -> list[torch.Tensor]:
        return [t for row in self.rows for t in row.tensors()]


class Sequences:
    """What every layer's store shares: per-sequence lengths (device int32 [B]), the last advance's
    counts, and the host's own figures: tokens seen per sequence (pads included, an upper bound of
    every length) and the capacity every store is grown to. counter: the layer that advances them, the first
    to write into a store (a forward pass writes its layers in order; a sliding layer's own SideStores, a BF16
    ring or a layer of another kind before it never do). holder: the layer whose multi-token update waits for
    its attention mask (OscarLayer.attend); the next layer to update writes it first, if no attention came."""

    def __init__(self, capacity: int | None = None):
        self.lengths = self.counts = self.counter = self.holder = None
        self.seen, self.capacity = 0, capacity or 0
        self.static = False     # decode_graph: the kernel's launch grid from the capacity, not from `seen`

    def advance(self, batch: int, tokens: int, starts: torch.Tensor | None, device) -> None:
        if self.lengths is None:
            self.lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        if starts is None:
            self.lengths += tokens
            self.counts = None
        else:
            self.counts = tokens - starts
            self.lengths += self.counts
        self.seen += tokens
        if self.seen > self.capacity:
            grown = self.seen if self.capacity == 0 else max(self.seen, self.capacity * 3 // 2)
            self.capacity = -(-grown // 256) * 256

    def max_length(self) -> int:
        return self.capacity if self.static else self.seen

    def clear(self) -> None:
        """No sequences: lengths, counts, the counting and the holding layer forgotten (capacity and static kept)."""
        self.lengths = self.counts = self.counter = self.holder = None
        self.seen = 0


class OscarLayer(DynamicLayer):
    """One layer of an OscarCache; its stores are made on the first update, from the shapes it sees."""

    def __init__(self, method: str, layer_idx: int, bundle=None, sink: int = 64, recent: int = 256,
                 sequences: Sequences | None = None, kernel_writes: bool | None = None,
                 query_heads: int | None = None, window: int | None = None,
                 value_layout: str = kvstore.DEFAULT_VALUE_LAYOUT, values_absorbed: bool = False,
                 kernel_reads: bool | None = None):
        super().__init__()
        self.method, self.layer_idx, self.bundle = method, layer_idx, bundle
        self.window = window        # a sliding layer's window: a window_cache, or SideStores trimmed to it
        self.spec = LayerSpec(window=window)
        # False: a window kept whole in BF16, a store with no INT2 rows
        self.int2 = holds_int2(self.spec, sink, recent)
        self.is_sliding = window is not None
        self.query_heads = query_heads
        self.windows = (sink, recent)   # the BF16 sink and recent window the method asks for (serving_problem)
        # A window kept whole in BF16 keeps no sink: every token leaves the window in turn.
        self.sink_tokens, self.recent_tokens = sink if self.int2 or window is None else 0, recent
        self.sequences = sequences or Sequences()
        self.kernel_reads = kernel_reads      # decode steps read by the decode kernel; None: on CUDA (first update)
        self.kernel_writes = kernel_writes    # None: on CUDA
        self.value_layout = value_layout      # the INT2 store's value codes (kvstore.Int2KVCache)
        self.values_absorbed = values_absorbed    # the model's weights hold R_V and μ_V (absorb.py)
        self.key_store = self.value_store = None    # SideStore mode (bf16, kivi)
        self.store: kvstore.Int2KVCache | None = None
        self.seen = 0
        self.held = None            # a multi-token update waiting for its attention mask (attend)
        self.step = None            # a decode step's token, written by the decode kernel's call (decode_attention)
        self.warned = False         # a decode step meant for the kernel was read in torch (warned once)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        kv_heads, head_dim = key_states.shape[1], key_states.shape[-1]
        self.shape = (kv_heads, head_dim)
        if self.bundle is not None:
            m = self.bundle.manifest.model
            if (m.num_kv_heads, m.head_dim) != (kv_heads, head_dim):
                raise OscarError(f"bundle {self.bundle.manifest.name} is for {m.num_kv_heads} KV heads of dim "
                                 f"{m.head_dim}; this model has {kv_heads} of dim {head_dim}")
        # A window kept in BF16 has no rotation in the bundle: stored as it comes (identity, no mean).
        lm = methods.layer_method(self.method if self.int2 else "int2", self.layer_idx, kv_heads, head_dim,
                                  self.bundle)
        if self.values_absorbed and lm.value is not None:
            lm.value = dataclasses.replace(lm.value, rotation=None, mean=None)
        if self.kernel_reads is None:
            self.kernel_reads = self.device.type == "cuda"
        problem = self._problem(lm, "store")
        self.kernel_problem = problem or self._problem(lm, "read")
        if problem is None:
            self._init_store(lm, kv_heads, head_dim)
        else:
            self.key_store = SideStore(lm.key, self.sink_tokens, self.recent_tokens, lm.token_block)
            self.value_store = SideStore(lm.value, self.sink_tokens, self.recent_tokens, lm.token_block)
        self.is_initialized = True

    def _problem(self, lm: methods.LayerMethod, job: str) -> str | None:
        return serving_problem(lm, *self.shape, job, spec=self.spec, method=self.method, query_heads=self.query_heads,
                               sink=self.windows[0], recent=self.windows[1])

    def _init_store(self, lm: methods.LayerMethod, kv_heads: int, head_dim: int) -> None:
        """The layer's rotations, means and clips on the device, once; the Triton write's split rotations."""
        dev = self.device
        eye = torch.eye(head_dim, device=dev).expand(kv_heads, head_dim, head_dim).contiguous()

        def tensors(side: methods.Side):
            rot = eye if side.rotation is None else side.rotation.to(dev, torch.float32).contiguous()
            mean = None if side.mean is None else side.mean.to(dev, torch.float32).contiguous()
            clip = (side.clip.to(dev, torch.float32) if isinstance(side.clip, torch.Tensor)
                    else torch.full((kv_heads,), float(side.clip), device=dev))
            return rot, mean, clip.contiguous()

        (rk, mk, ck), (rv, mv, cv) = tensors(lm.key), tensors(lm.value)
        self.rotation = kvstore.LayerRotation(rk, rv, ck, cv, mk, mv)
        self.value_identity = lm.value.rotation is None   # decode then leaves out õ·R_V^T
        self.group_sizes = (lm.key.group_size, lm.value.group_size)
        self.key_axis, self.token_block = lm.key.axis, lm.token_block
        use = self.kernel_writes if self.kernel_writes is not None else dev.type == "cuda"
        problem = self._problem(lm, "write") if use else None
        if use and problem is not None and self.key_axis == "channel":
            warnings.warn(f"OscarCache layer {self.layer_idx}: torch writes ({problem})", stacklevel=2)
        write = _triton_write() if use and problem is None else None
        self.write = write        # the Triton write module, or None: kvstore's torch reference
        if write is not None:
            self.split = (write.prepare_rotation(rk, mk), write.prepare_rotation(rv, mv))

    def _reserve(self, batch: int) -> None:
        """Allocate the store, or grow it to the shared capacity (the INT2 rows copied once); a window's store once,
        at its size."""
        if self.window is not None:
            if self.store is None:
                self.store = kvstore.window_cache(batch, *self.shape, self.window, *self.group_sizes,
                                                  self.sink_tokens, self.recent_tokens, self.device,
                                                  self.value_layout, self.key_axis, self.int2)
                self.store.lengths = self.sequences.lengths
            return
        cap = self.sequences.capacity
        rows = kvstore.int2_rows(cap, self.sink_tokens, self.recent_tokens, self.token_block)
        if self.store is not None and self.store.key_codes.shape[2] >= rows:
            return
        new = kvstore.empty_cache(batch, *self.shape, cap, *self.group_sizes, self.sink_tokens, self.recent_tokens,
                                  device=self.device, key_axis=self.key_axis, value_layout=self.value_layout)
        new.lengths = self.sequences.lengths
        if self.store is not None:
            for f in dataclasses.fields(kvstore.Int2KVCache):
                old = getattr(self.store, f.name)
                if isinstance(old, torch.Tensor) and f.name != "lengths":
                    getattr(new, f.name)[:, :, :old.shape[2]] = old
        self.store = new

    def _grow(self, key_states: torch.Tensor, starts: torch.Tensor | None) -> None:
        """Count an update in the shared lengths (the first layer to write does) and make room for it."""
        seq = self.sequences
        if seq.counter is None:
            seq.counter = self.layer_idx
        if seq.counter == self.layer_idx:
            seq.advance(key_states.shape[0], key_states.shape[-2], starts, key_states.device)
        self._reserve(key_states.shape[0])

    def commit(self, key_states: torch.Tensor, value_states: torch.Tensor, starts: torch.Tensor | None) -> None:
        """Write a whole update into the store; starts[b]: leading pads of sequence b to skip (None: none)."""
        self._flush()
        n = key_states.shape[-2]
        self._grow(key_states, starts)
        if self.write is not None and self.seen == 0:
            self.write.prefill_kv(self.store, key_states, value_states, *self.split, self.rotation.key_clip,
                                  self.rotation.value_clip)
        elif self.write is not None and self.key_axis == "channel" and n <= self.recent_tokens:
            self.write.leave_blocks(self.store, self.rotation.key_clip, self.rotation.value_clip, n, starts)
            self.write.append_kv(self.store, key_states, value_states, *self.split, self.rotation.key_clip,
                                 self.rotation.value_clip, starts, evict=False)
        elif self.write is not None and self.key_axis == "token":
            self.write.append_kv(self.store, key_states, value_states, *self.split, self.rotation.key_clip,
                                 self.rotation.value_clip, starts, evict=self.seen > 0)
        else:
            kvstore.append(self.store, key_states, value_states, self.rotation, starts)
        self.seen += n

    def _write_step(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The Triton write of a decode step's one token per sequence, into a store grown for it (_grow) that holds
        a prefill: the same launches every step (what moves is the lengths on the device), so that
        triton.decode.decode_step can capture them with the read."""
        r = self.rotation
        if self.key_axis == "channel":
            self.write.leave_blocks(self.store, r.key_clip, r.value_clip, 1)
        self.write.append_kv(self.store, keys, values, *self.split, r.key_clip, r.value_clip,
                             evict=self.key_axis == "token")

    def _flush(self) -> None:
        """Write a decode step's token left for the decode kernel's call, if that call did not come."""
        if self.step is not None:
            (keys, values), self.step = self.step, None
            self._write_step(keys, values)

    def _settle(self) -> None:
        """Write what an update left for attend(), if that call did not come: a decode step's token, and a held
        multi-token update as it came (its leading pads kept: the torch reads' attention mask hides them)."""
        self._flush()
        if self.held is not None:
            (keys, values), self.held = self.held, None
            self._release()
            self.commit(keys, values, None)

    def _release(self) -> None:
        if self.sequences.holder is self:
            self.sequences.holder = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the update, or (reading by kernel) leave it to attend(): a decode step's read, and a multi-token
        update until its mask is seen. Returns keys and values to attend to, or StandIns of them for attend()."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if self.key_store is not None:
            return self._update_sides(key_states, value_states)
        holder = self.sequences.holder
        if holder is not None and holder is not self:
            holder._settle()        # nothing attended that layer's update: written first, in order
        self._settle()
        past = self.read(key_states.dtype, self.window and self.window - 1) if n > 1 and self.seen else None
        by_kernel = n == 1 and self.kernel_reads and self.kernel_problem is None
        if (by_kernel and self.write is not None and self.seen
                and (self.key_axis == "token" or self.recent_tokens)):
            self._grow(key_states, None)      # the token is written with the read, in one graph (decode_attention)
            self.seen += 1
            self.step = (key_states, value_states)
        elif n > 1 and self.kernel_reads:
            self.held = (key_states, value_states)      # written by attend(), which sees the mask
            self.sequences.holder = self
        else:
            self.commit(key_states, value_states, None)
        if n == 1 and self.kernel_reads and self.kernel_problem is not None and not self.warned:
            self.warned = True
            warnings.warn(f"OscarCache layer {self.layer_idx}: torch reads ({self.kernel_problem})", stacklevel=2)
        if by_kernel:           # read by attend(); as tall as the torch read
            b, (h, d) = key_states.shape[0], self.shape
            return StandIn.pair(self, key_states, (b, h, min(self.seen, self.window or self.seen), d))
        if n == 1:
            return self.read(key_states.dtype)
        out = (key_states, value_states) if past is None else (
            torch.cat([past[0], key_states], dim=-2), torch.cat([past[1], value_states], dim=-2))
        return out if self.held is None else StandIn.pair(self, key_states, out[0].shape, out)

    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor | None:
        """The attention of the update just returned as StandIns (attention.dispatcher calls it). A held update is
        written now, each sequence's leading pads (the mask's, attention_mask [B, 1, q, kv] or None) skipped, and
        None returned: the caller attends to it. A decode step (query [B, H, 1, d]): its token written and the store
        read by the decode kernel -> [B, 1, H, d]."""
        if self.held is not None:
            (keys, values), self.held = self.held, None
            self._release()
            self.commit(keys, values, _mask_starts(attention_mask, keys.shape[-2]))
            return None
        if query.shape[2] != 1:
            return None
        return self.decode_attention(query[:, :, 0], scaling).to(query.dtype).unsqueeze(1)

    def fill(self, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor | None = None) -> None:
        """Write an exact prefill's keys and values [B, H_kv, n, d] into this empty layer, sequence b's first starts[b]
        tokens (its left pads; None: none) skipped, as attend() would skip them had it seen the mask: the store's
        per-sequence lengths, or a SideStore a sequence (PaddedSides)."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        if self.key_store is None:
            self.commit(keys, values, starts)
            return
        if starts is not None and bool(starts.any()):
            pads = starts.tolist()
            self.key_store, self.value_store = (
                PaddedSides([SideStore(st.side, st.sink_tokens, st.recent_tokens, st.block) for _ in pads], pads)
                for st in (self.key_store, self.value_store))
        self._update_sides(keys, values)

    def _update_sides(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """A sliding layer of window W returns what get_mask_sizes announces (its last W − 1 tokens, and the new ones)
        and then keeps only the last W − 1."""
        n, w, stores = key_states.shape[-2], self.window, (self.key_store, self.value_store)
        if n > 1 and self.key_store.length():
            past_k, past_v = (st.read(key_states.dtype, None if w is None else w - 1) for st in stores)
        self.key_store.append(key_states)
        self.value_store.append(value_states)
        if n == 1:
            out = tuple(st.read(key_states.dtype, w) for st in stores)
        elif self.key_store.length() == n:
            out = key_states, value_states
        else:
            out = torch.cat([past_k, key_states], dim=-2), torch.cat([past_v, value_states], dim=-2)
        if w is not None:
            for st in stores:
                st.trim(w - 1)
        return out

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv length, kv offset) of the mask: a sliding layer's as transformers' DynamicSlidingWindowLayer."""
        if self.window is None:
            return super().get_mask_sizes(query_length)
        seen = self.get_seq_length()
        return min(seen, self.window - 1) + query_length, max(seen - self.window + 1, 0)

    def read(self, dtype: torch.dtype, last: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """All keys and values in original space, [B, H_kv, L, d] each (the torch read; syncs with the device).

        Sequence b's tokens fill the last lengths[b] of the L = seen columns (its leading pads, if
        skipped at write, are zeros); last: only the last `last` columns (a window's store holds its last N)."""
        if self.key_store is not None:
            return self.key_store.read(dtype, last), self.value_store.read(dtype, last)
        self._settle()
        seq, store = self.sequences, self.store
        if self.seen < seq.seen:        # the first KV layer has counted the update this one is about to write
            lengths = seq.lengths - (seq.counts if seq.counts is not None else seq.seen - self.seen)
            store = dataclasses.replace(store, lengths=lengths)
        batch, (heads, d) = store.key_sink.shape[0], self.shape
        cols = min(self.seen, last or self.seen, self.window or self.seen)
        out = [torch.zeros(batch, heads, cols, d, dtype=dtype, device=self.device) for _ in range(2)]
        r = self.rotation
        for b, n in enumerate(store.lengths.tolist()):
            if n:
                for o, y, rot, mean in zip(out, kvstore.sequence_kv(store, b), (r.key_rotation, r.value_rotation),
                                           (r.key_mean, r.value_mean)):
                    x = (y @ rot.transpose(1, 2))[:, -cols:]
                    o[b, :, cols - x.shape[1]:] = (x if mean is None else x + mean[:, None]).to(dtype)
        return out[0], out[1]

    def decode_attention(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Triton decode attention of query [B, H, d] (original space) over the store -> [B, H, d], the step's
        token (left by update) written first: both one CUDA-graph replay on CUDA (decode_step)."""
        from oscar_core.triton.decode import decode_attention, decode_step

        r = self.rotation
        args = (self.store, r.key_rotation, None if self.value_identity else r.value_rotation, r.value_mean, scaling)
        if self.step is None:
            return decode_attention(query.contiguous(), *args, max_length=self.sequences.max_length())
        (keys, values), self.step = self.step, None
        return decode_step(query.contiguous(), keys, values, self._write_step, *args,
                           max_length=self.sequences.max_length())

    def get_seq_length(self) -> int:
        if self.key_store is not None:
            return self.key_store.length()
        return self.seen + (0 if self.held is None else self.held[0].shape[-2])

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._release()
        self.key_store = self.value_store = self.store = self.held = self.step = None
        self.seen = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise OscarError("OscarCache cannot be cropped: INT2 blocks are not reversible")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise OscarError("OscarCache does not support beam search")

    def int2_tokens(self) -> int:
        """INT2 tokens of the longest sequence (host count)."""
        self._settle()
        if self.key_store is not None:
            return self.key_store.n_int2
        if self.window is not None:
            rows, ring = kvstore.window_split(self.window, self.recent_tokens, self.token_block, self.int2)
            return min(max(self.seen - self.sink_tokens - ring, 0) // self.token_block * self.token_block, rows)
        return max(self.seen - self.sink_tokens - self.recent_tokens, 0) // self.token_block * self.token_block

    def nbytes(self) -> int:
        self._settle()
        if self.store is not None:
            return kvstore.allocation_nbytes(t for t in vars(self.store).values()
                                             if isinstance(t, torch.Tensor) and t is not self.store.lengths)
        if self.key_store is None:
            return 0
        return sum(t.untyped_storage().nbytes() for s in (self.key_store, self.value_store) for t in s.tensors())


class OscarCache(Cache):
    """INT2 KV cache for `model.generate(..., past_key_values=OscarCache(bundle, "oscar"))` (`cache=` in recent
    transformers, 5.24 here: models.cache_argument).

    method: one of methods.METHODS; bundle: needed for "oscar", and gives the layer count, the group
    sizes, the BF16 windows and the layers' kinds (layers.manifest_specs); without a bundle pass config=model.config
    (layers.layer_specs: a hybrid model's state layers, sliding windows) or num_layers (every layer global).
    capacity: tokens per sequence each layer's store is allocated for (prompt, pads included, plus
    new tokens); None: the first update's length, grown by half when exceeded.
    kernel_reads: whether decode steps are read by the Triton decode kernel (through transformers' sdpa attention
    function, attention.install, or inside attention.oscar_attention); None: when the model is on CUDA (True forces
    it, e.g. on the CPU under TRITON_INTERPRET=1; False: torch reads always).
    kernel_writes: whether stores are written by the Triton kernel; None: on CUDA.
    value_layout: how the INT2 stores keep their value codes, "tiles" (the default) or "rows" (kvstore.Int2KVCache:
    the same bytes; in tiles the decode kernels read them with 16-byte loads, faster on every shape measured).
    values_absorbed: the model's v_proj and o_proj hold the bundle's R_V and μ_V (absorb.absorb_value_rotation), so
    values are stored as they come and read without õ·R_V^T; oscar_attention refuses a model and cache that
    disagree on it (model.generate alone does not check).
    """

    @classmethod
    def from_pretrained(cls, bundle: str | Path, method: str = "oscar", revision: str | None = None,
                        device: str | torch.device = "cpu", **kwargs) -> "OscarCache":
        """The cache of a bundle directory or a hub repo id (bundle.fetch_bundle: honours HF_HUB_OFFLINE), its
        tensors on `device`; kwargs as __init__ takes them."""
        return cls(load_bundle(fetch_bundle(bundle, revision), device), method, **kwargs)

    def __init__(self, bundle=None, method: str = "oscar", num_layers: int | None = None, config=None,
                 sink_tokens: int | None = None, recent_tokens: int | None = None, kernel_reads: bool | None = None,
                 capacity: int | None = None, kernel_writes: bool | None = None,
                 value_layout: str = kvstore.DEFAULT_VALUE_LAYOUT, values_absorbed: bool = False):
        methods.check_method(method)
        if method == "oscar" and bundle is None:
            raise OscarError("OscarCache(method='oscar') needs a rotation bundle")
        if num_layers is None:
            if bundle is not None:
                num_layers = bundle.manifest.model.num_layers
            elif config is not None:
                num_layers = config.get_text_config().num_hidden_layers
            else:
                raise OscarError("OscarCache needs a bundle, num_layers or config")
        if capacity is not None and capacity < 1:
            raise OscarError(f"OscarCache capacity must be a positive number of tokens, not {capacity}")
        if value_layout not in kvstore.VALUE_LAYOUTS:
            raise OscarError(f"OscarCache value_layout must be one of {', '.join(kvstore.VALUE_LAYOUTS)}, "
                             f"not {value_layout!r}")
        sink, recent = methods.windows(method, bundle)
        sink = sink if sink_tokens is None else sink_tokens
        recent = recent if recent_tokens is None else recent_tokens
        self.method, self.kernel_reads, self.bundle = method, kernel_reads, bundle
        self.values_absorbed = values_absorbed
        self.sequences = Sequences(capacity)
        if bundle is not None:
            query_heads, specs = bundle.manifest.model.num_heads, manifest_specs(bundle.manifest)
        else:
            query_heads = config.get_text_config().num_attention_heads if config is not None else None
            specs = layer_specs(config) if config is not None else [LayerSpec()] * num_layers
        short = [s.window is not None and not holds_int2(s, sink, recent) for s in specs]
        # Sliding layers of the methods without a store (bf16; kivi's short windows) are BF16 rings; a short window of
        # the others is a store the decode kernel reads, with no sink (OscarLayer).
        ring = [(s.window is not None and method == "bf16") or (short[i] and method == "kivi")
                for i, s in enumerate(specs)]
        super().__init__(layers=[
            state_layer() if not s.kv_cache else RingLayer(s.window) if ring[i] else
            OscarLayer(method, i, bundle, sink, recent, self.sequences, kernel_writes, query_heads, window=s.window,
                       value_layout=value_layout, values_absorbed=values_absorbed, kernel_reads=kernel_reads)
            for i, s in enumerate(specs[:num_layers])])
        install()

    def reset(self) -> None:
        """Empty every layer and the sequences they share, for a new batch."""
        self.sequences.clear()
        super().reset()

    @property
    def kv_layers(self) -> list["OscarLayer"]:
        """The layers holding keys and values by the method (all of them but a hybrid model's linear-attention or
        Mamba layers and the RingLayers)."""
        return [layer for layer in self.layers if isinstance(layer, OscarLayer)]

    @property
    def ring_layers(self) -> list["RingLayer"]:
        return [layer for layer in self.layers if isinstance(layer, RingLayer)]

    def reserve(self, tokens: int) -> None:
        """Grow every store to hold `tokens` per sequence now (before a CUDA-graph capture)."""
        seq = self.sequences
        if tokens > seq.capacity:
            seq.capacity = tokens
        for layer in self.kv_layers:
            if layer.store is not None:
                layer._reserve(layer.store.key_sink.shape[0])

    def count_steps(self, steps: int) -> None:
        """Count decode steps the host did not run (CUDA-graph replays; −1 undoes a capture's count)."""
        self.sequences.seen += steps
        for layer in self.kv_layers:
            layer.seen += steps

    def reads_by_kernel(self) -> bool:
        """Every layer is initialized and reads its decode steps by kernel."""
        return all(layer.is_initialized and layer.kernel_reads and layer.kernel_problem is None
                   and layer.store is not None for layer in self.kv_layers)

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds (codes, scales, zero codes, BF16 windows and rings, spare capacity)."""
        return sum(layer.nbytes() for layer in self.kv_layers + self.ring_layers)

    def bf16_nbytes(self) -> int:
        """Bytes of a BF16 cache holding the same tokens: 2 sides · B · H_kv · L · d · 2 bytes per layer (a ring: the
        N − 1 tokens it keeps)."""
        total = sum(layer.nbytes() for layer in self.ring_layers)
        for layer in self.kv_layers:
            layer._settle()
            if layer.store is not None:
                b, h, _, d = layer.store.key_sink.shape
            elif layer.key_store is not None and layer.key_store.sink is not None:
                b, h, _, d = layer.key_store.sink.shape
            else:
                continue
            tokens = layer.get_seq_length() if layer.window is None else (
                layer.key_store.held() if layer.key_store is not None else min(layer.seen, layer.window))
            total += 2 * b * h * tokens * d * 2
        return total


class RingLayer(DynamicSlidingWindowLayer):
    """A sliding layer of window N holding no INT2: its last N − 1 tokens in BF16 (with a decoded token's own, the N
    its query sees), kept and sized for the mask as transformers' DynamicSlidingWindowLayer does. Like the other
    layers, a multi-token update attends to its own tokens as computed, a decoded token to its BF16 copy."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n, dtype = key_states.shape[-2], key_states.dtype
        k, v = super().update(key_states.to(torch.bfloat16), value_states.to(torch.bfloat16))
        if n > 1:  # keep the ring in storage of its own size, not a view of the whole prefill
            self.keys, self.values = self.keys.clone(), self.values.clone()
            return (torch.cat([k[:, :, :-n].to(dtype), key_states], dim=-2),
                    torch.cat([v[:, :, :-n].to(dtype), value_states], dim=-2))
        return k.to(dtype), v.to(dtype)

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(t.untyped_storage().nbytes() for t in (self.keys, self.values))


def state_layer():
    """The cache layer of a layer without keys and values (a hybrid model's linear attention or Mamba): transformers'
    own, holding its convolution and recurrent states exactly."""
    from transformers.cache_utils import LinearAttentionLayer

    return LinearAttentionLayer()


def exact_cache(like: OscarCache) -> Cache:
    """A transformers cache with the layers of `like` that keeps everything exact: a DynamicLayer (every token; a
    sliding layer's mask keeps each query in its window) for each KV layer, state_layer() for the others (what
    `fill` reads)."""
    return Cache(layers=[DynamicLayer() if isinstance(layer, (OscarLayer, RingLayer)) else state_layer()
                         for layer in like.layers])


def fill(cache: OscarCache, prefill: Cache, starts: torch.Tensor | None = None) -> OscarCache:
    """Write an exact prefill (exact_cache) into `cache`: each KV layer's keys and values through the cache's
    method (a ring keeps the last of them, pads included: the mask hides them), and a copy of each state layer (so
    that several caches can decode on from one prefill). starts: each sequence's leading pads in a left-padded
    batch (int32 [B] on the device; None: none), skipped by every OscarLayer (OscarLayer.fill)."""
    for i, done in enumerate(prefill.layers):
        layer = cache.layers[i]
        if isinstance(layer, OscarLayer):
            layer.fill(done.keys, done.values, starts)
        elif isinstance(layer, RingLayer):
            cache.update(done.keys, done.values, i)
        else:
            cache.layers[i] = copy.deepcopy(done)
    return cache


def memory_plan(num_layers: int, kv_heads: int, head_dim: int, context: int, budget_bytes: int | None = None,
                key_group_size: int = 64, value_group_size: int = 64, sink_tokens: int = methods.SINK_TOKENS,
                recent_tokens: int = methods.RECENT_TOKENS, key_axes: list[str] | None = None,
                windows: list[int | None] | None = None) -> dict:
    """Bytes an INT2 OscarCache allocates, and the largest batch a budget holds.

    key_axes: each layer's key axis ("token" or "channel", Bundle.key_axis; None: all "token"); a
    channel layer's store holds a ring of W + G slots and rows in whole blocks of G (kvstore.store_nbytes).
    windows: each layer's sliding window (None: global attention), e.g. [s.window for s in layer_specs(config)];
    a layer whose window holds no INT2 (layers.holds_int2) counts as its window store with no INT2 rows (S + N BF16
    tokens) and, in the BF16 cache, as a RingLayer's min(context, N); a longer window as its kvstore.window_cache (or,
    too short for a tile of rows, a store of min(context, N) tokens: SideStores).
    bytes_per_token: one INT2 token of every INT2 layer (codes, scale and zero codes, K and V);
    bytes_per_sequence: a whole store of `context` tokens (capacity) in every layer, BF16 windows
    included (kvstore.store_nbytes, exactly what OscarCache allocates at that capacity);
    bf16_bytes_per_sequence: the same context in a BF16 cache; max_batch / bf16_max_batch: how many
    sequences of `context` tokens fit in budget_bytes (if given); bits_per_element: bits per K/V element held."""
    axes = key_axes or ["token"] * num_layers
    windows = windows or [None] * num_layers
    ring = [w is not None and not holds_int2(LayerSpec(window=w), sink_tokens, recent_tokens) for w in windows]
    ring_bytes = 2 * kv_heads * sum(min(context, w) for w, r in zip(windows, ring) if r) * head_dim * 2
    held = [(min(context, w or context), axis, w) for w, r, axis in zip(windows, ring, axes) if not r]
    int2_axes = [axis for _, axis, _ in held]

    def store(batch, capacity, layer_axes, sink=sink_tokens, recent=recent_tokens):
        return sum(kvstore.store_nbytes(batch, capacity, kv_heads, head_dim, key_group_size, value_group_size,
                                        sink, recent, axis) for axis in layer_axes)

    def layer_store(tokens, axis, window):
        """A window's store (a tile of rows at least) is allocated whole at its first update."""
        block = key_group_size if axis == "channel" else 1
        rows, ring_slots = kvstore.window_split(window or 0, recent_tokens, block)
        if window is None or rows == 0:
            return store(1, tokens, [axis])
        return store(1, sink_tokens + window, [axis], sink_tokens, ring_slots)

    bf16_windows = sum(kvstore.store_nbytes(1, sink_tokens + w, kv_heads, head_dim, key_group_size, value_group_size,
                                            sink_tokens, w, rows=0)
                       for w, r in zip(windows, ring) if r)
    per_seq = sum(layer_store(*h) for h in held) + bf16_windows
    bf16 = sum(2 * kv_heads * tokens * head_dim * 2 for tokens, _, _ in held) + ring_bytes
    # Rows are allocated in whole blocks: one block's bytes over its rows.
    block = kvstore.ROW_BLOCK if "channel" not in int2_axes else math.lcm(kvstore.ROW_BLOCK, key_group_size)
    window = sink_tokens + recent_tokens
    one_block = store(1, window + 2 * block, int2_axes) - store(1, window + block, int2_axes)
    out = dict(bytes_per_token=one_block // block,
               bytes_per_sequence=per_seq, bf16_bytes_per_sequence=bf16,
               bits_per_element=round(8 * per_seq / (bf16 // 2), 4))
    if budget_bytes is not None:
        out |= dict(max_batch=budget_bytes // per_seq, bf16_max_batch=budget_bytes // bf16)
    return out


def serving_problem(lm: methods.LayerMethod, kv_heads: int, head_dim: int, job: str = "read", *,
                    spec: LayerSpec = LayerSpec(), method: str | None = None, query_heads: int | None = None,
                    sink: int = methods.SINK_TOKENS, recent: int = methods.RECENT_TOKENS) -> str | None:
    """Why oscar's store and kernels cannot serve a layer of this method (lm, of `method`) and kind (spec; sink and
    recent: the BF16 windows), None when they can, for one job:
        "store"  it lives in a kvstore store: a global layer's Int2KVCache, a sliding layer's window_cache (a window
                 too short to hold INT2, layers.holds_int2, one with no INT2 rows); else in SideStores, written and
                 read by torch. Values per token, keys per token or per channel; not the kivi baseline (kept as it
                 was measured); a window holding INT2 must hold a tile of INT2 rows beside `recent`.
        "read"   that, and the Triton decode kernel reads it (else torch reads the store); query_heads None: not known.
        "write"  that, and the Triton write kernels write it (else kvstore's torch reference).
    """
    if not methods.stored(lm, method):
        return "the kernel reads INT2 values in per-token groups, keys per-token or by a bundle's channel blocks"
    if spec.window is not None and holds_int2(spec, sink, recent) and \
            kvstore.window_split(spec.window, recent, lm.token_block)[0] == 0:
        return f"a window of {spec.window} tokens holds no tile of INT2 rows beside {recent} BF16 tokens"
    if job == "read":
        try:
            from oscar_core.triton.plan import shape_problem
        except ImportError:
            return "triton is not installed"
        problem = shape_problem(query_heads or kv_heads, kv_heads, head_dim, lm.key.group_size, lm.value.group_size,
                                lm.key.axis)
        if problem is not None:
            return problem
    elif job == "write":
        def pow2(n):
            return n >= 4 and n & (n - 1) == 0
        if not pow2(head_dim) or head_dim < 16 or not all(pow2(s.group_size) for s in (lm.key, lm.value)):
            return "the write kernel needs power-of-two head_dim and group sizes"
        if lm.key.axis == "channel" and not 16 <= lm.key.group_size <= 256:
            return "the write kernel quantizes key blocks of 16 to 256 tokens"
        if lm.key.axis == "channel" and head_dim < 32:
            return "the write kernel quantizes keys per channel at head_dim 32 or more"
        write = _triton_write()
        if write is not None:
            try:    # the channels a write program takes (R's columns in shared memory) must hold whole groups
                write.columns(head_dim, tuple(s.group_size for s in (lm.key, lm.value) if s.axis == "token"))
            except ValueError as e:
                return str(e)
    elif job != "store":
        raise ValueError(f"serving_problem job must be store, read or write, not {job!r}")
    return None


def _mask_starts(mask: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """Leading pads of each sequence among the n new columns (the last n) of a 4D attention mask (None: no mask):
    the new tokens that do not see themselves (a sliding layer's last query sees only its window, so not the last
    row). Reads the mask on the host once per multi-token update, to refuse a gap the store cannot skip."""
    if mask is None:
        return None
    own = torch.diagonal(mask[:, 0, -n:, -n:], dim1=-2, dim2=-1)
    keep = own if own.dtype == torch.bool else own == 0
    if not bool((keep.int().diff(dim=-1) >= 0).all()):
        raise OscarError("OscarCache skips leading pads only: the attention mask has a gap after a real token")
    return (n - keep.sum(-1)).to(torch.int32)
