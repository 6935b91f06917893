"""Greedy generation whose decode steps replay one captured CUDA graph (the StaticCache pattern).

A decode step through an OscarCache read by kernel (attention.py) has static shapes and
addresses: each layer's store is preallocated for prompt + new tokens (OscarCache.reserve), the decode
kernel's launch grid is planned from that capacity (Sequences.static), the lengths live on the device,
and no mask is built. So the whole forward (embedding, every layer's append and attention, the head)
plus the greedy argmax is captured once with torch.cuda.graph and replayed per token; the host only
counts the replayed steps (OscarCache.count_steps). The same loop runs a transformers StaticCache.

    cache = OscarCache(bundle, "oscar")
    new_tokens = greedy_generate(model, cache, ids, attention_mask, max_new_tokens=256)

It stands in for model.generate(..., do_sample=False) when the decode step should be one graph replay;
graph=False runs the same steps eagerly (any device).
"""

import inspect
from contextlib import ExitStack

import torch

from oscar_core.calibrate.models import cache_argument
from oscar_core.errors import OscarError
from oscar_core.serve.attention import oscar_attention
from oscar_core.serve.cache import OscarCache


class GreedyDecoder:
    """Prefill on entry (after whatever the cache already holds), then decode steps one at a time: step() eagerly, or replay() of the graph that
    capture() records. tokens [B, max_new_tokens] holds the greedy tokens, `produced` how many so far.

        with GreedyDecoder(model, cache, ids, mask, max_new_tokens=64) as dec:
            dec.capture()
            while dec.produced < 64:
                dec.replay()

    attention_mask: [B, n] with left padding (or None), for a prompt on an empty cache. Decode steps pass
    no mask when the cache reads every step by kernel (an OscarCache on CUDA: it knows each sequence's
    length), else the mask grown by one column per step, which only eager steps can do."""

    def __init__(self, model, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int = 32):
        self.model, self.cache, self.max_new_tokens = model, cache, max_new_tokens
        self.oscar = isinstance(cache, OscarCache)
        self.input_ids, self.attention_mask = input_ids, attention_mask
        self.graph = None
        self.stack = ExitStack()

    def __enter__(self):
        model, cache, ids = self.model, self.cache, self.input_ids
        bsz, n = ids.shape
        dev = ids.device
        self.stack.enter_context(torch.inference_mode())
        past = int(cache.get_seq_length())           # tokens already cached (setup: a read-back is fine)
        if self.oscar:
            cache.reserve(past + n + self.max_new_tokens)
            self.stack.enter_context(oscar_attention(model, cache))
        mask = self.attention_mask
        position = (torch.arange(past, past + n, device=dev).expand(bsz, n) if mask is None
                    else (mask.long().cumsum(-1) - 1).clamp_min(0))
        self.extra, prefill = {}, {}
        if "cache_position" in inspect.signature(model.forward).parameters:   # older transformers
            prefill["cache_position"] = torch.arange(past, past + n, device=dev)
            self.extra["cache_position"] = torch.arange(past + n, past + n + 1, device=dev)
        self.cache_kwarg = {cache_argument(model): cache}
        logits = model(ids, attention_mask=mask, position_ids=position, **self.cache_kwarg, use_cache=True,
                       logits_to_keep=1, **prefill).logits[:, -1]
        self.ids = logits.argmax(-1, keepdim=True)
        self.tokens = torch.zeros(bsz, self.max_new_tokens, dtype=torch.long, device=dev)
        self.tokens[:, :1] = self.ids
        self.position = position[:, -1:] + 1
        self.index = torch.ones(1, dtype=torch.long, device=dev)
        self.produced = 1
        by_kernel = self.oscar and cache.reads_by_kernel()
        self.mask = None if mask is None or by_kernel or bool(mask.all()) else mask
        return self

    def __exit__(self, *exc):
        if self.oscar:
            self.cache.sequences.static = False
        self.stack.close()

    def _step(self):
        if self.mask is not None:
            self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        out = self.model(self.ids, attention_mask=self.mask, position_ids=self.position, **self.cache_kwarg,
                         use_cache=True, **self.extra).logits[:, -1]
        self.ids.copy_(out.argmax(-1, keepdim=True))
        self.tokens.index_copy_(1, self.index, self.ids)
        for t in (self.position, self.index, *self.extra.values()):
            t.add_(1)

    def step(self) -> None:
        """One eager decode step."""
        self._step()
        self.produced += 1

    def capture(self, warmup: int = 2) -> None:
        """`warmup` eager steps on a side stream (Triton compiles there), then one step captured, not run."""
        if self.mask is not None:
            raise OscarError("a padded batch decodes in a CUDA graph only through an OscarCache read by kernel "
                             "(on CUDA, inside oscar_attention)")
        if self.oscar and (self.cache.ring_layers or any(layer.key_store is not None for layer in self.cache.kv_layers)):
            raise OscarError("a model with sliding windows in BF16 rings or SideStores (the bf16 and kivi methods, "
                             "INT2 windows too short for a tile of rows) decodes eagerly: those are not captured in a "
                             "CUDA graph")
        if self.oscar:
            self.cache.sequences.static = True
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(min(warmup, self.max_new_tokens - 1 - self.produced)):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()
        if self.oscar:
            self.cache.count_steps(-1)        # the capture ran the Python of one step, not the step

    def replay(self) -> None:
        """One decode step: a replay of the captured graph."""
        self.graph.replay()
        self.produced += 1
        if self.oscar:
            self.cache.count_steps(1)


def greedy_generate(model, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    max_new_tokens: int = 32, graph: bool = True) -> torch.Tensor:
    """Greedy tokens [B, max_new_tokens]: prefill, then every decode step a graph replay (graph=False: eager)."""
    with GreedyDecoder(model, cache, input_ids, attention_mask, max_new_tokens) as dec:
        if graph and max_new_tokens > 3:
            dec.capture()
        while dec.produced < max_new_tokens:
            dec.replay() if dec.graph is not None else dec.step()
        return dec.tokens


def compile_shared_parts(model) -> int:
    """Replace every RMSNorm and MLP module of `model` with its torch.compile'd form (fixed shapes, one graph each),
    as transformers' compiled generation or a serving engine runs them; attention, its projections and the caches
    stay as they are. Returns the number of modules compiled."""
    import torch._dynamo

    # Every layer's modules share one compiled graph a shape; each (batch, module kind) is a shape of its own.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    done = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith(("RMSNorm", "MLP")):
                setattr(parent, name, torch.compile(child, dynamic=False, fullgraph=True))
                done += 1
    return done
