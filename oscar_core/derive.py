"""From attention statistics to a layer's bundle tensors: rotations, key centring, clip thresholds.

Keys. Softmax is invariant to adding the same number to every logit of a query, and
q·(k − μ_K) = q·k − q·μ_K shifts all of a query's logits by the same amount. So the cache may store
(k − μ_K)·R_K instead of k·R_K at no cost in accuracy, and never add μ_K back: INT2 then spends its
four levels on the keys' spread instead of their common offset (the post-RoPE key mean μ_K is large).
Values have no such invariance (μ_V would have to be added back), so they are not centred by default.

Clip thresholds, per KV head, by grid search on the calibration probe (tokens past the BF16 sinks):
    keys:   argmin_c Σ_t e_t C_Q e_t^T,   e_t = k̂_t − k_t   (expected attention-logit error)
    values: argmin_c ‖S (V̂ − V)‖²,       S = causal softmax(scaling·q·k^T)   (attention-output error)
"""

from dataclasses import dataclass

import torch

from oscar_core.metrics import causal_attention
from oscar_core.quant import fake_quantize
from oscar_core.rotations import rotation

CLIP_GRID = tuple(round(1.0 - 0.02 * i, 2) for i in range(26))  # 1.00, 0.98, ..., 0.50


@dataclass(frozen=True)
class DeriveOptions:
    key_rotation: str = "oscar"
    value_rotation: str = "oscar"
    key_centering: bool = True
    value_centering: bool = False
    key_group_size: int = 64      # capped at head_dim by export
    value_group_size: int = 64
    sink_tokens: int = 64
    clip_grid: tuple[float, ...] = CLIP_GRID


def quantize_rotated(x: torch.Tensor, r: torch.Tensor, mean: torch.Tensor | None, clip, group_size: int,
                     sink_tokens: int = 0) -> torch.Tensor:
    """What the cache gives back for x [..., kv_heads, T, d], in original space (mean restored).

    x is centred, rotated by r [kv_heads, d, d], INT2-quantized with per-head clip, rotated back;
    the first sink_tokens stay exact (BF16 in the cache).
    """
    x = x.double()
    centred = x if mean is None else x - mean.double()[..., None, :]
    rotated = centred @ r
    clip = clip if not isinstance(clip, torch.Tensor) else clip[:, None]
    restored = fake_quantize(rotated.float(), group_size, clip).double() @ r.mT
    if mean is not None:
        restored = restored + mean.double()[..., None, :]
    restored[..., :sink_tokens, :] = x[..., :sink_tokens, :]
    return restored


def key_errors(keys, r, mean, query_cov, clip, group_size, sink_tokens) -> torch.Tensor:
    """Per-head expected logit error Σ_t e_t C_Q e_t^T over probe keys [P, kv_heads, T, d]."""
    e = quantize_rotated(keys, r, mean, clip, group_size, sink_tokens) - keys.double()
    return torch.einsum("phti,hij,phtj->h", e, query_cov.double(), e)


def value_errors(queries, keys, values, positions, r, mean, clip, group_size, sink_tokens, scaling) -> torch.Tensor:
    """Per-head ‖S(V̂ − V)‖² on the probe; queries [P, heads, Nq, d], keys/values [P, kv_heads, T, d]."""
    p, h, nq, d = queries.shape
    kv = keys.shape[1]
    q = queries.reshape(p, kv, h // kv, nq, d)
    v_hat = quantize_rotated(values, r, mean, clip, group_size, sink_tokens)
    diff = causal_attention(q, keys[:, :, None], (v_hat - values.double())[:, :, None], scaling, positions)
    return diff.pow(2).sum((0, 2, 3, 4))


def search_clip(errors_at, grid) -> torch.Tensor:
    """Per-head argmin over the grid of errors_at(c) → [kv_heads]; ties go to the larger c."""
    errors = torch.stack([errors_at(c) for c in grid])
    return torch.tensor(grid, dtype=torch.float64)[errors.argmin(0)]


def derive_keys(stats, layer: int, variant: str, centering: bool, group_size: int, sink_tokens: int,
                grid=CLIP_GRID) -> dict[str, torch.Tensor]:
    """R_K, c_K and (if centering) μ_K of one layer."""
    c_q = stats.query_covariance(layer)
    r = rotation(variant, c_q, group_size)
    mean = stats.key_mean(layer) if centering else None
    keys = stats.probe(layer)["key"]
    clip = search_clip(lambda c: key_errors(keys, r, mean, c_q, c, group_size, sink_tokens), grid)
    return {"key_rotation": r, "key_clip": clip, **({"key_mean": mean} if mean is not None else {})}


def derive_values(stats, layer: int, variant: str, centering: bool, group_size: int, sink_tokens: int,
                  grid=CLIP_GRID) -> dict[str, torch.Tensor]:
    """R_V, c_V and (if centering) μ_V of one layer."""
    r = rotation(variant, stats.score_weighted_value_covariance(layer), group_size)
    mean = stats.value_mean(layer) if centering else None
    p = stats.probe(layer)
    scaling = float(stats.acc["scaling"][layer])
    clip = search_clip(lambda c: value_errors(p["query"], p["key"], p["value"], p["positions"], r, mean, c,
                                              group_size, sink_tokens, scaling), grid)
    return {"value_rotation": r, "value_clip": clip, **({"value_mean": mean} if mean is not None else {})}


def derive_layer(stats, layer: int, opts: DeriveOptions) -> dict[str, torch.Tensor]:
    """The bundle tensors of one layer (names without the `layers.{i}.` prefix), float64."""
    return {**derive_keys(stats, layer, opts.key_rotation, opts.key_centering, opts.key_group_size,
                          opts.sink_tokens, opts.clip_grid),
            **derive_values(stats, layer, opts.value_rotation, opts.value_centering, opts.value_group_size,
                            opts.sink_tokens, opts.clip_grid)}
