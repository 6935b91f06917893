"""OscarCache: a transformers Cache whose keys and values are stored INT2 (or BF16) by a method of methods.py.

Per layer and side (keys, values) of B sequences, H_kv heads, head_dim d, L tokens:
    sink    bf16 [B, H_kv, min(L, S), d]           positions [0, S)
    int2    the packed codes of methods.encode     positions [S, S + n), n a multiple of the token block
    recent  bf16 [B, H_kv, L − S − n, d]           positions [S + n, L)
After every write, blocks of the recent tokens move to INT2 (quantized from their BF16 copy) while
the whole block lies outside the last `recent` tokens: INT2 iff t ≥ S and last(t) ≤ L − 1 − W
(methods.int2_mask), so a decoded token at p reads exactly tokens t ∈ [0, S) ∪ (p − W, p] in BF16.

update() follows the serving convention: a single decoded token is written first and then attends to
what the store holds (INT2 dequantized, back in original space); the tokens of a multi-token update
(prefill, or a prefill chunk) attend to the stored past plus themselves as computed (in flight).
INT2 writes use the Triton write kernel (oscar_core/triton/write.py) on CUDA for per-token groups,
and the torch reference (quant.quantize, as oscar_core/kvstore.py) elsewhere.

Reads: in torch (the whole store dequantized into [B, H_kv, L, d]), except single-token decode steps
inside `with oscar_attention(model, cache):` when the cache reads by kernel (on CUDA, or kernel_reads=True):
update() then only writes, and the attention function runs the Triton decode kernel
(oscar_core/triton/decode.py) on the layer's store seen as a kvstore.Int2KVCache: the INT2 codes, scales
and zero codes as they are (no copy), the BF16 sink and recent windows rotated and centred into padded
buffers (at most S + W tokens per step). Prefill keeps exact sdpa attention. A layer the kernel cannot
read (a side in BF16 or per-channel groups, head_dim or group sizes not multiples of 64) reads in torch.
Memory is measured: nbytes() sums the storage of every tensor the cache holds.
"""

from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, DynamicLayer

from oscar_core import methods
from oscar_core.errors import OscarError
from oscar_core.kvstore import Int2KVCache
from oscar_core.statistics import route_attention

ATTENTION_NAME = "oscar_cache"


def _triton_write():
    try:
        from oscar_core.triton.write import write_int2
    except Exception:  # no triton, or no GPU build of it
        return None
    return write_int2


class SideStore:
    """Sink, INT2 and recent storage of one side of one layer (see the module docstring)."""

    def __init__(self, side: methods.Side | None, sink: int, recent: int):
        self.side, self.sink_tokens, self.recent_tokens = side, sink, recent
        self.sink = self.recent = None
        self.int2: dict[str, torch.Tensor] | None = None
        self.n_int2 = 0

    def append(self, x: torch.Tensor) -> None:
        """Append x [B, H_kv, n, d], then move whole blocks leaving the recent window to INT2."""
        x = x.to(torch.bfloat16)
        if self.sink is None:
            self.sink = x[:, :, :0].contiguous()
            self.recent = x[:, :, :0].contiguous()
        room = self.sink_tokens - self.sink.shape[2]
        if room > 0:
            self.sink = torch.cat([self.sink, x[:, :, :room]], dim=2)
            x = x[:, :, room:]
        self.recent = torch.cat([self.recent, x], dim=2)
        if self.side is None:
            return
        b = self.side.token_block
        move = max(self.recent.shape[2] - self.recent_tokens, 0) // b * b
        if move:
            stored = self._encode(self.recent[:, :, :move])
            self.int2 = stored if self.int2 is None else {
                k: torch.cat([self.int2[k], v], dim=2) for k, v in stored.items()}
            self.recent = self.recent[:, :, move:].clone()
            self.n_int2 += move

    def _encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        side = self.side
        write = _triton_write() if x.is_cuda and side.axis == "token" else None
        if write is None:
            return methods.encode(side, x)
        heads, d = x.shape[1], x.shape[-1]
        rot = side.rotation if side.rotation is not None else torch.eye(d, device=x.device).expand(heads, d, d)
        clip = side.clip if isinstance(side.clip, torch.Tensor) else torch.full((heads,), float(side.clip))
        parts = [write(xb.transpose(0, 1), rot.to(x.device), clip.to(x.device), side.group_size,
                       None if side.mean is None else side.mean.to(x.device)) for xb in x]
        return {name: torch.stack([p[i].transpose(0, 1) for p in parts]).contiguous()
                for i, name in enumerate(("codes", "scale", "zero"))}

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        """All L tokens in position order, original space, [B, H_kv, L, d] in dtype."""
        parts = [self.sink.to(dtype)]
        if self.int2 is not None:
            parts.append(methods.decode(self.side, self.int2).to(dtype))
        parts.append(self.recent.to(dtype))
        return torch.cat(parts, dim=2)

    def kernel_parts(self) -> dict[str, torch.Tensor]:
        """This side as the kvstore.Int2KVCache fields `sink`, `recent`, `codes`, `scale`, `zero`: windows
        rotated and centred, padded to S and W rows; the INT2 tensors themselves (one zero row if none)."""
        b, h, _, d = self.sink.shape
        out = {}
        for name, x, rows in (("sink", self.sink, self.sink_tokens), ("recent", self.recent, self.recent_tokens)):
            out[name] = torch.zeros(b, h, rows, d, dtype=torch.bfloat16, device=x.device)
            out[name][:, :, :x.shape[2]] = methods.rotate(self.side, x)
        if self.int2 is not None:
            return out | self.int2
        g = self.side.group_size
        return out | {"codes": self.sink.new_zeros(b, h, 1, d // 4, dtype=torch.uint8),
                      "scale": self.sink.new_zeros(b, h, 1, d // g, dtype=torch.uint8),
                      "zero": self.sink.new_zeros(b, h, 1, d // g, dtype=torch.int8)}

    def length(self) -> int:
        return 0 if self.sink is None else self.sink.shape[2] + self.n_int2 + self.recent.shape[2]

    def tensors(self) -> list[torch.Tensor]:
        out = [t for t in (self.sink, self.recent) if t is not None]
        return out + (list(self.int2.values()) if self.int2 is not None else [])


class OscarLayer(DynamicLayer):
    """One layer of an OscarCache; the Sides are made on the first update, from the shapes it sees."""

    def __init__(self, method: str, layer_idx: int, bundle=None, sink: int = 64, recent: int = 256):
        super().__init__()
        self.method, self.layer_idx, self.bundle = method, layer_idx, bundle
        self.sink_tokens, self.recent_tokens = sink, recent
        self.key_store = self.value_store = None
        self.kernel_reads = False   # set by oscar_attention: single-token steps read by the decode kernel
        self.deferred = False       # the last update was a decode step whose read is left to the kernel

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        kv_heads, head_dim = key_states.shape[1], key_states.shape[-1]
        if self.bundle is not None:
            m = self.bundle.manifest.model
            if (m.num_kv_heads, m.head_dim) != (kv_heads, head_dim):
                raise OscarError(f"bundle {self.bundle.manifest.name} is for {m.num_kv_heads} KV heads of dim "
                                 f"{m.head_dim}; this model has {kv_heads} of dim {head_dim}")
        lm = methods.layer_method(self.method, self.layer_idx, kv_heads, head_dim, self.bundle)
        self.key_store = SideStore(lm.key, self.sink_tokens, self.recent_tokens)
        self.value_store = SideStore(lm.value, self.sink_tokens, self.recent_tokens)
        self.kernel_problem = kernel_problem(lm, head_dim)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if n > 1 and self.key_store.length():
            past_k, past_v = self.key_store.read(key_states.dtype), self.value_store.read(value_states.dtype)
        self.key_store.append(key_states)
        self.value_store.append(value_states)
        self.deferred = n == 1 and self.kernel_reads and self.kernel_problem is None
        if self.deferred:
            return key_states, value_states   # placeholders: oscar_attention reads the store by kernel
        if n == 1:
            return self.key_store.read(key_states.dtype), self.value_store.read(value_states.dtype)
        if self.key_store.length() == n:
            return key_states, value_states
        return torch.cat([past_k, key_states], dim=-2), torch.cat([past_v, value_states], dim=-2)

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """All keys and values in original space, [B, H_kv, L, d] each (the torch read)."""
        return self.key_store.read(dtype), self.value_store.read(dtype)

    def kernel_view(self) -> Int2KVCache:
        """The store as the decode kernel reads it (see SideStore.kernel_parts)."""
        k, v = self.key_store.kernel_parts(), self.value_store.kernel_parts()
        fields = {f"{side}_{name}": t for side, parts in (("key", k), ("value", v)) for name, t in parts.items()}
        lengths = torch.full((k["sink"].shape[0],), self.get_seq_length(), dtype=torch.int32, device=k["sink"].device)
        return Int2KVCache(**fields, lengths=lengths, key_group_size=self.key_store.side.group_size,
                           value_group_size=self.value_store.side.group_size)

    def decode_attention(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Triton decode attention of query [B, H, d] (original space) over the store -> [B, H, d]."""
        from oscar_core.triton.decode import decode_attention

        ks, vs = self.key_store.side, self.value_store.side
        d, heads = query.shape[-1], self.key_store.sink.shape[1]
        eye = torch.eye(d, device=query.device).expand(heads, d, d)
        rk = eye if ks.rotation is None else ks.rotation.to(query.device)
        rv = eye if vs.rotation is None else vs.rotation.to(query.device)
        mean = None if vs.mean is None else vs.mean.to(query.device)
        return decode_attention(query.contiguous(), self.kernel_view(), rk, rv, mean, scaling,
                                max_length=self.get_seq_length())

    def get_seq_length(self) -> int:
        return 0 if self.key_store is None else self.key_store.length()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.key_store = self.value_store = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise OscarError("OscarCache cannot be cropped: INT2 blocks are not reversible")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise OscarError("OscarCache does not support beam search")

    def nbytes(self) -> int:
        if self.key_store is None:
            return 0
        return sum(t.untyped_storage().nbytes() for s in (self.key_store, self.value_store) for t in s.tensors())


class OscarCache(Cache):
    """INT2 KV cache for `model.generate(..., past_key_values=OscarCache(bundle, "oscar"))`.

    method: one of methods.METHODS; bundle: needed for "oscar", and gives the layer count, the group
    sizes and the BF16 windows; without a bundle pass num_layers (or config=model.config).
    kernel_reads: whether oscar_attention reads decode steps by the Triton kernel; None: when the model
    is on CUDA (True forces it, e.g. on the CPU under TRITON_INTERPRET=1; False: torch reads always).
    """

    def __init__(self, bundle=None, method: str = "oscar", num_layers: int | None = None, config=None,
                 sink_tokens: int | None = None, recent_tokens: int | None = None, kernel_reads: bool | None = None):
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
        sink, recent = methods.windows(method, bundle)
        sink = sink if sink_tokens is None else sink_tokens
        recent = recent if recent_tokens is None else recent_tokens
        self.method, self.kernel_reads = method, kernel_reads
        super().__init__(layers=[OscarLayer(method, i, bundle, sink, recent) for i in range(num_layers)])

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds (codes, scales, zero codes, BF16 windows)."""
        return sum(layer.nbytes() for layer in self.layers)

    def bf16_nbytes(self) -> int:
        """Bytes of a BF16 cache holding the same tokens: 2 sides · B · H_kv · L · d · 2 bytes per layer."""
        total = 0
        for layer in self.layers:
            if layer.key_store is not None and layer.key_store.sink is not None:
                b, h, _, d = layer.key_store.sink.shape
                total += 2 * b * h * layer.get_seq_length() * d * 2
        return total


def kernel_problem(lm: methods.LayerMethod, head_dim: int) -> str | None:
    """Why the decode kernel cannot read a layer of this method (None: it can)."""
    sides = (lm.key, lm.value)
    if any(side is None or side.axis != "token" for side in sides):
        return "the kernel reads INT2 keys and values in per-token groups only"
    if head_dim % 64 or any(side.group_size % 64 for side in sides):
        return "the kernel needs head_dim and group sizes that are multiples of 64"
    return None


@contextmanager
def oscar_attention(model, cache: OscarCache):
    """Attention of `model` reading `cache` by the Triton decode kernel on single-token steps.

    Inside, every attention layer runs exact sdpa, except a decode step (one query token, no padding
    masked out) of a layer the kernel can read (kernel_problem), which runs
    triton.decode.decode_attention on the layer's store instead of dequantizing it. Nothing is
    changed unless the cache reads by kernel (kernel_reads, or by default a model on CUDA).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    use = cache.kernel_reads if cache.kernel_reads is not None else model.device.type == "cuda"
    if not use:
        yield
        return

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer = cache.layers[module.layer_idx]
        scaling = scaling or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        if query.shape[2] == 1 and layer.deferred:
            if attention_mask is None or (attention_mask.dtype == torch.bool and bool(attention_mask.all())):
                out = layer.decode_attention(query[:, :, 0], float(scaling))
                return out.to(query.dtype).unsqueeze(1), None          # [B, 1, H, d]
            key, value = layer.read(query.dtype)                       # padded batch: torch read, masked sdpa
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    for layer in cache.layers:
        layer.kernel_reads = True
    try:
        with route_attention(model, ATTENTION_NAME, attention, mask="sdpa"):
            yield
    finally:
        for layer in cache.layers:
            layer.kernel_reads = layer.deferred = False
