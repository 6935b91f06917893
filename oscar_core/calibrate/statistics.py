"""Attention statistics gathered through transformers' attention interface, in float64.

Per layer l and KV head g (whose query heads are G(g)), over all N calibration tokens:
    query_cov[l, g]  = Σ_n Σ_{h∈G(g)} q_{n,h}^T q_{n,h}         (post-RoPE queries; C_Q = query_cov / query_rows)
    output_cov[l, g] = Σ_n Σ_{h∈G(g)} o_{n,h}^T o_{n,h}         (o = S·V, the head's attention output;
                                                                  C_S = V^T S^T S V / N = output_cov / query_rows)
    key_cov, value_cov: Σ k^T k, Σ v^T v;   key_sum, value_sum: Σ k, Σ v   (rows: kv_rows)
Plus a bounded probe per layer: the first `probe_tokens` post-RoPE queries (at `probe_queries` evenly
spaced positions), keys and values of the first `probe_samples` samples, on which clip thresholds are
searched by the real attention error.

The hooks add into per-layer buffers on the device where each layer runs (so a model sharded over
several GPUs accumulates beside its layers); `pending()` hands them over as one [L, ...] tensor per
accumulator and `add()` folds such sums (one process's, or several processes' after an all-reduce) into
the totals on `device`. Reading `acc` or `probes` folds in whatever is pending first.
"""

from contextlib import contextmanager

import torch

PROBE_SAMPLES = 2
PROBE_TOKENS = 512
PROBE_QUERIES = 128
ATTENTION_NAME = "oscar_statistics"


class AttentionStatistics:
    def __init__(self, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 probe_samples: int = PROBE_SAMPLES, probe_tokens: int = PROBE_TOKENS,
                 probe_queries: int = PROBE_QUERIES, device: str | torch.device = "cpu"):
        L, H, d = num_layers, num_kv_heads, head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.probe_samples, self.probe_tokens, self.probe_queries = probe_samples, probe_tokens, probe_queries
        f64 = dict(dtype=torch.float64, device=device)
        self._acc = {
            "query_cov": torch.zeros(L, H, d, d, **f64),
            "output_cov": torch.zeros(L, H, d, d, **f64),
            "key_cov": torch.zeros(L, H, d, d, **f64),
            "value_cov": torch.zeros(L, H, d, d, **f64),
            "key_sum": torch.zeros(L, H, d, **f64),
            "value_sum": torch.zeros(L, H, d, **f64),
            "query_rows": torch.zeros(L, dtype=torch.int64, device=device),
            "kv_rows": torch.zeros(L, dtype=torch.int64, device=device),
            "scaling": torch.zeros(L, **f64),
        }
        self._probes: dict[str, torch.Tensor] = {}
        self._pending: dict[int, dict] = {}                    # layer → sums on the layer's device
        self._pending_probes: list[tuple[int, int, dict]] = []  # (layer, first sample, probe tensors)
        self.first_sample: int | None = None  # global index of the batch's first sample (None: count from 0)

    @property
    def num_layers(self) -> int:
        return self._acc["query_rows"].shape[0]

    @property
    def acc(self) -> dict[str, torch.Tensor]:
        """The totals, [L, ...] per accumulator (pending sums folded in)."""
        self.flush()
        return self._acc

    @acc.setter
    def acc(self, value: dict[str, torch.Tensor]) -> None:
        self._acc = value

    @property
    def probes(self) -> dict[str, torch.Tensor]:
        self.flush()
        return self._probes

    @probes.setter
    def probes(self, value: dict[str, torch.Tensor]) -> None:
        self._probes = value

    def pending(self) -> tuple[dict[str, torch.Tensor], list[tuple[int, int, dict]]]:
        """What the hooks gathered since the last call: sums as [L, ...] tensors on `device` (zero where a
        layer saw nothing; scaling zero there) and the new probe rows; the buffers start again empty."""
        sums = {name: torch.zeros_like(x) for name, x in self._acc.items()}
        for layer, buffers in self._pending.items():
            for name, x in buffers.items():
                sums[name][layer] = x
        rows, self._pending, self._pending_probes = self._pending_probes, {}, []
        return sums, rows

    def add(self, sums: dict[str, torch.Tensor], probe_rows=()) -> None:
        """Fold sums (as `pending()` gives them) and probe rows into the totals; probe rows go in sample order."""
        for name, x in sums.items():
            x = x.to(self._acc[name].device)
            if name == "scaling":
                self._acc[name] = torch.where(x != 0, x, self._acc[name])
            else:
                self._acc[name] += x
        for layer, _, new in sorted(probe_rows, key=lambda row: row[:2]):
            for name, x in new.items():
                full = f"layers.{layer}.{name}"
                keep = name == "probe_positions" or full not in self._probes
                self._probes[full] = x if keep else torch.cat([self._probes[full], x])

    def flush(self) -> None:
        if self._pending or self._pending_probes:
            self.add(*self.pending())

    def _by_kv_head(self, x: torch.Tensor) -> torch.Tensor:
        """[B, heads, T, d] → [kv_heads, rows, d] in float64, query heads grouped under their KV head."""
        b, h, t, d = x.shape
        x = x.reshape(b, self.num_kv_heads, h // self.num_kv_heads, t, d).transpose(0, 1)
        return x.reshape(self.num_kv_heads, -1, d).double()

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                output: torch.Tensor, scaling: float) -> None:
        """query [B, H, T, d], key/value [B, KVH, T, d], output [B, T, H, d] (as the attention interface has them)."""
        q, o = self._by_kv_head(query), self._by_kv_head(output.transpose(1, 2))
        k, v = self._by_kv_head(key), self._by_kv_head(value)
        new = {"query_cov": q.mT @ q, "output_cov": o.mT @ o, "key_cov": k.mT @ k, "value_cov": v.mT @ v,
               "key_sum": k.sum(1), "value_sum": v.sum(1), "query_rows": q.shape[1], "kv_rows": k.shape[1]}
        buffers = self._pending.get(layer)
        if buffers is None:
            self._pending[layer] = buffers = new
        else:
            for name, x in new.items():
                buffers[name] += x
        buffers["scaling"] = scaling
        self._probe(layer, query, key, value)

    def _probe_rows(self, layer: int) -> int:
        have = self._probes.get(f"layers.{layer}.probe_key")
        return (0 if have is None else have.shape[0]) + sum(
            new["probe_key"].shape[0] for row_layer, _, new in self._pending_probes if row_layer == layer)

    def _probe(self, layer: int, query, key, value) -> None:
        first = self.first_sample if self.first_sample is not None else self._probe_rows(layer)
        take = min(self.probe_samples - first, query.shape[0])
        if take <= 0:
            return
        t = min(self.probe_tokens, key.shape[2])
        positions = torch.linspace(0, t - 1, min(self.probe_queries, t)).round().long().unique()
        self._pending_probes.append((layer, first, {
            "probe_query": query[:take, :, positions].float().cpu(),
            "probe_key": key[:take, :, :t].float().cpu(),
            "probe_value": value[:take, :, :t].float().cpu(),
            "probe_positions": positions,
        }))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: x.cpu().contiguous() for name, x in {**self.acc, **self.probes}.items()}

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], num_heads: int, device="cpu") -> "AttentionStatistics":
        L, H, d, _ = state["query_cov"].shape
        stats = cls(L, num_heads, H, d, device=device)
        stats._acc = {k: state[k].to(v.device, copy=True) for k, v in stats._acc.items()}
        stats._probes = {k: v.clone() for k, v in state.items() if ".probe_" in k}
        return stats

    def non_finite(self) -> str | None:
        """Name of the first accumulator holding NaN or Inf, or None."""
        for name, x in self.acc.items():
            if x.is_floating_point() and not torch.isfinite(x).all():
                return name
        return None

    # Normalized statistics, per layer: [kv_heads, d, d] and [kv_heads, d].
    def query_covariance(self, layer: int) -> torch.Tensor:
        return self.acc["query_cov"][layer] / self.acc["query_rows"][layer].clamp_min(1)

    def score_weighted_value_covariance(self, layer: int) -> torch.Tensor:
        return self.acc["output_cov"][layer] / self.acc["query_rows"][layer].clamp_min(1)

    def key_covariance(self, layer: int) -> torch.Tensor:
        return self.acc["key_cov"][layer] / self.acc["kv_rows"][layer].clamp_min(1)

    def value_covariance(self, layer: int) -> torch.Tensor:
        return self.acc["value_cov"][layer] / self.acc["kv_rows"][layer].clamp_min(1)

    def key_mean(self, layer: int) -> torch.Tensor:
        return self.acc["key_sum"][layer] / self.acc["kv_rows"][layer].clamp_min(1)

    def value_mean(self, layer: int) -> torch.Tensor:
        return self.acc["value_sum"][layer] / self.acc["kv_rows"][layer].clamp_min(1)

    def probe(self, layer: int) -> dict[str, torch.Tensor]:
        return {name: self.probes[f"layers.{layer}.probe_{name}"] for name in ("query", "key", "value", "positions")}


@contextmanager
def route_attention(model, name: str, attention, mask: str | None = None):
    """Run every attention layer of `model` through `attention` (transformers' attention-function signature),
    registered under `name` with AttentionInterface; the previous implementation is restored on exit.
    mask: the attention-mask builder to register with it (e.g. "sdpa"); None: the layers get no mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(name, attention)
    if mask is not None:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[mask])
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def observe_attention(model, observer):
    """Route every attention layer of `model` through sdpa plus `observer(layer, q, k, v, out, scaling)`.

    The observer sees post-RoPE queries and keys and the real attention output; logits are unchanged. A sliding
    layer (layers.layer_specs) attends to its window only, as the model does (the layers get no mask here, so
    the window is applied by layers.windowed_attention); the window the model passes must be its config's.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from oscar_core.layers import check_window, layer_specs, windowed_attention

    specs = layer_specs(model.config)

    def attention(module, query, key, value, attention_mask, **kwargs):
        spec = specs[module.layer_idx]
        check_window(module.layer_idx, spec, kwargs.get("sliding_window"))
        scaling = kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        if spec.window is not None and attention_mask is None and key.shape[2] > spec.window:
            out = windowed_attention(query, key, value, float(scaling), spec.window).transpose(1, 2).contiguous()
            weights = None
        else:
            out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        observer(module.layer_idx, query, key, value, out, float(scaling))
        return out, weights

    return route_attention(model, ATTENTION_NAME, attention)
