"""How transformers' attention reaches an OscarCache: stand-ins for what a layer did not read, and the attention
function that hands them back to the layer.

transformers calls `key, value = cache.update(k, v, layer_idx)` and then the attention function its config names,
`ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value, attention_mask, scaling=...)`.
An OscarLayer that reads by kernel (OscarLayer.update) has nothing to hand over in two cases: a decode step, whose
keys and values the decode kernel reads from the INT2 store, and a multi-token update it writes only once it knows
each sequence's leading pads, which only the attention mask shows. Then update() returns two StandIns and the
layer's attend() does the rest: it writes the held update (skipping the pads), or writes the decode step's token and
reads the store by kernel.

`install()` (every OscarCache calls it) registers `dispatcher(...)` as transformers' "sdpa" attention function,
wrapping the one registered before: a call whose keys are StandIns goes to the layer's attend(); every other call
(another cache, a BF16 ring, a layer read by torch) goes to the wrapped function with its arguments unchanged. So
`model.generate(..., past_key_values=cache)` on an sdpa model (transformers' default) reads decode steps by kernel
with no context manager. Under any other attention implementation a StandIn is still right, only slower: the first
torch operation on it gives the held keys and values as computed, or the layer's torch read of its store.

`oscar_attention(model, cache)` routes a model of any implementation through the same dispatcher (with sdpa behind
it) and lets decode steps that every layer reads by kernel build no mask (what decode_graph captures).
"""

from contextlib import contextmanager

import torch
from torch.utils._pytree import tree_map_only

from oscar_core.errors import OscarError

ATTENTION_NAME = "oscar_cache"      # oscar_attention's attention implementation


class StandIn(torch.Tensor):
    """Keys or values [B, H_kv, L, d] that an OscarLayer update leaves to the layer's attend() (no storage of their
    own). resolve(): the held update's keys and values as computed, or (a decode step) the layer's torch read of its
    store, read once for both; any torch operation on a StandIn works on that."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, layer, side: int, shape, like: torch.Tensor, box: list):
        out = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=like.dtype, device=like.device)
        out.layer, out.side, out.box = layer, side, box
        return out

    def __init__(self, *args):
        super().__init__()

    @classmethod
    def pair(cls, layer, like: torch.Tensor, shape, held: tuple | None = None) -> tuple["StandIn", "StandIn"]:
        """Stand-ins of a layer's keys and values, of `shape`, sharing what they resolve to: `held` (a multi-token
        update's keys and values, as attended) or None (a decode step: the layer's torch read when first asked)."""
        box = [held]
        return cls(layer, 0, shape, like, box), cls(layer, 1, shape, like, box)

    def resolve(self) -> torch.Tensor:
        if self.box[0] is None:
            self.box[0] = self.layer.read(self.dtype)
        return self.box[0][self.side]

    def __repr__(self, **kwargs):
        return f"StandIn(layer {self.layer.layer_idx}, {'keys' if self.side == 0 else 'values'}, {tuple(self.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map_only(cls, cls.resolve, (args, kwargs or {}))
        return func(*args, **kwargs)


def dispatcher(fallback):
    """A transformers attention function: StandIns to their layer's attend(), everything else to `fallback`."""

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if isinstance(key, StandIn):
            scaling = kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
            out = key.layer.attend(query, attention_mask, float(scaling))
            if out is not None:
                return out, None
            key, value = key.resolve(), value.resolve()
        return fallback(module, query, key, value, attention_mask, *args, **kwargs)

    attention.oscar_fallback = fallback
    return attention


def install() -> None:
    """Register dispatcher(previous sdpa) as transformers' "sdpa" attention function, once per process."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if not hasattr(sdpa, "oscar_fallback"):
        AttentionInterface.register("sdpa", dispatcher(sdpa))


@contextmanager
def oscar_attention(model, cache):
    """`model`'s attention through oscar's dispatcher with transformers' sdpa behind it, whatever its own
    implementation, while decode steps that every layer of `cache` reads by kernel build no attention mask.

    Not needed for model.generate on an sdpa model (install(), above); it also refuses a model and a cache that
    disagree on whether the weights hold R_V (absorb.py). Nothing is routed unless the cache reads by kernel
    (kernel_reads, or by default a model on CUDA). It sets nothing on the cache."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from oscar_core.calibrate.statistics import route_attention
    from oscar_core.serve import absorb

    held = getattr(model.config, absorb.MARK, None)
    if bool(held) != cache.values_absorbed:
        raise OscarError(f"the model's weights hold R_V of {held}: make the cache with values_absorbed=True" if held
                         else "the cache has values_absorbed=True but the model's weights do not hold R_V "
                              "(absorb.absorb_value_rotation)")
    use = cache.kernel_reads if cache.kernel_reads is not None else model.device.type == "cuda"
    if not use:
        yield
        return

    def mask(*args, **kwargs):
        if kwargs.get("q_length") == 1 and cache.reads_by_kernel() and not cache.ring_layers:
            return None
        return sdpa_mask(*args, **kwargs)

    AttentionMaskInterface.register(ATTENTION_NAME, mask)
    try:
        with route_attention(model, ATTENTION_NAME, dispatcher(sdpa_attention_forward)):
            yield
    finally:    # the registry is global: leave nothing there that keeps this cache (and its memory) alive
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
