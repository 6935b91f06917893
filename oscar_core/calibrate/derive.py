"""From attention statistics to a layer's bundle tensors: rotations, key centring, clip thresholds.

Keys. Softmax is invariant to adding the same number to every logit of a query, and
q·(k − μ_K) = q·k − q·μ_K shifts all of a query's logits by the same amount. So the cache may store
(k − μ_K)·R_K instead of k·R_K at no cost in accuracy, and never add μ_K back: INT2 then spends its
four levels on the keys' spread instead of their common offset (the post-RoPE key mean μ_K is large).
Values have no such invariance (μ_V would have to be added back), so they are not centred by default.

Clip thresholds, per KV head, by grid search on the calibration probe (tokens past the BF16 sinks):
    keys:   argmin_{c >= key_clip_floor} of the key clip objective, by default the attention-output error
              "output":  Σ_q ‖softmax(s·q·K̂^T)V − softmax(s·q·K^T)V‖²   (of the keys alone; the default)
            or
              "logit":   Σ_t e_t C_Q e_t^T,   e_t = k̂_t − k_t        (expected attention-logit error)
              "kl":      Σ_q KL(softmax(s·q·K^T) ‖ softmax(s·q·K̂^T))     (attention-distribution error)
              "weighted-logit": Σ_q Σ_t S_qt (s·q·e_t)²                  (logit error weighted by exact attention)
            The logit objective averages over every query and key; the others weigh an error by how much the
            exact attention reads that key, so a few sharply attended keys (retrieval) count as they do at decode.
            A relative logit error cannot see a layer whose logits are large and close (Qwen2.5-Coder-0.5B's layer
            0: the smallest relative error, the largest damage); softmax can. On SmolLM2's 512-token probe,
            "output" and "kl" pick the same clips as "logit" (~0.72) and did not help 8K needle retrieval. The
            floor (default 0.8) is what helped: the probe is too short to contain the 8K retrieval the clip hurts.
    values: argmin_c ‖S (V̂ − V)‖²,       S = causal softmax(scaling·q·k^T)   (attention-output error)

Key format, per layer (derive_layer): keys per token (groups of G channels, U_Q·H·P_br) or per channel (groups of
G tokens, no rotation or U_Q), whichever leaves the smaller relative attention-output error on the probe.

Far positions. The probe holds the first 512 positions, but a bundle serves the whole context, and post-RoPE key
statistics turn with position: a key mean from a k_proj bias in slow RoPE pairs is nearly still over the probe and
has turned by ~1 rad at 32K, so a format centred on the probe's μ_K can win there and lose by a wide margin at 20K+
(a per-channel block absorbs a slowly moving offset in its zero points; a per-token group does not). Given the
layer's RoPE frequencies, the probe's queries and keys are also turned to far offsets (rope.turn, exact: the same
tokens at positions p + Δ, attention unchanged) and every format is scored, and its key clips searched, at all of
them: the error of a format is its worst over the probe's positions and the offsets, the clip objective their sum.
"""

from dataclasses import dataclass

import torch

from oscar_core.errors import OscarError
from oscar_core.metrics import causal_attention
from oscar_core.quant import fake_quantize
from oscar_core.rope import turn
from oscar_core.rotations import label, rotation

CLIP_GRID = tuple(round(1.0 - 0.02 * i, 2) for i in range(26))  # 1.00, 0.98, ..., 0.50
KEY_CLIP_FLOOR = 0.8
KEY_CLIP_OBJECTIVES = ("logit", "output", "kl", "weighted-logit")
KEY_AXES = ("token", "channel")
KEY_CLIP_OBJECTIVE_LABELS = {"logit": "attention-logit error", "output": "attention-output error (exact values)",
                             "kl": "attention KL divergence", "weighted-logit": "attention-weighted logit error"}


def clip_objective_label(key_objective: str = "logit", key_floor: float = 0.0, grid=CLIP_GRID) -> str:
    """The manifest's quant.clip_objective string (objective "logit" with no floor gives the schema's default string)."""
    floor = f" (key clip >= {key_floor:g})" if key_floor > min(grid) else ""
    return f"keys: {KEY_CLIP_OBJECTIVE_LABELS[key_objective]}{floor}; values: attention-output error"


def key_clip_grid(opts: "DeriveOptions") -> tuple[float, ...]:
    grid = tuple(c for c in opts.clip_grid if c >= opts.key_clip_floor)
    if not grid:
        raise ValueError(f"key clip floor {opts.key_clip_floor} is above every clip grid point")
    return grid


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
    key_clip_objective: str = "output"   # one of KEY_CLIP_OBJECTIVES: attention-aware by default
    # Key clips are searched on the grid's points >= this floor. 0.8, not the grid's 0.5: on the probe the
    # logit, output and KL objectives pick ~0.70 for keys, which crushes the outlier key components a
    # long-context retrieval query reads; on the H100 (bench/results/key_clip.md) the floor took OSCAR's 8K
    # needle from 0/40 to 9/40 (KIVI-style 3/30, Hadamard 1/30 on shared prompts) for +1.8% perplexity at 8K.
    key_clip_floor: float = KEY_CLIP_FLOOR
    # The key formats derive_layer chooses from per layer: (axis, rotation) pairs, the axis one of KEY_AXES, the
    # rotation a rotations.VARIANTS name for "channel" (for "token" key_rotation is used). One pair: no choice.
    key_formats: tuple[tuple[str, str], ...] = (("token", "oscar"), ("channel", "none"), ("channel", "eigen"))
    # Offsets Δ (positions) the probe is also turned to, scoring key formats and key clips where the bundle is served
    # (rope.far_offsets of the model's context); empty: the probe's own positions only.
    far_offsets: tuple[int, ...] = ()


def quantize_rotated(x: torch.Tensor, r: torch.Tensor, mean: torch.Tensor | None, clip, group_size: int,
                     sink_tokens: int = 0, axis: str = "token") -> torch.Tensor:
    """What the cache gives back for x [..., kv_heads, T, d], in original space (mean restored).

    x is centred, rotated by r [kv_heads, d, d], INT2-quantized with per-head clip, rotated back; the first
    sink_tokens stay exact (BF16 in the cache). axis "token": groups of G channels of one token; "channel":
    groups of G tokens of one channel, in blocks from the sink on (a last incomplete block stays exact).
    """
    x = x.double()
    centred = x if mean is None else x - mean.double()[..., None, :]
    rotated = (centred @ r)[..., sink_tokens:, :]
    if axis == "token":
        clip = clip if not isinstance(clip, torch.Tensor) else clip[:, None]
        quantized = fake_quantize(rotated.float(), group_size, clip).double()
    else:
        full = rotated.shape[-2] // group_size * group_size
        blocks = rotated[..., :full, :].unflatten(-2, (-1, group_size)).transpose(-1, -2)   # [..., n, d, G]
        clip = clip if not isinstance(clip, torch.Tensor) else clip[:, None, None]
        head = fake_quantize(blocks.float(), group_size, clip).double().transpose(-1, -2).flatten(-3, -2)
        quantized = torch.cat([head, rotated[..., full:, :]], dim=-2)
    restored = quantized @ r.mT
    if mean is not None:
        restored = restored + mean.double()[..., None, :]
    return torch.cat([x[..., :sink_tokens, :], restored], dim=-2)


def key_errors(keys, r, mean, query_cov, clip, group_size, sink_tokens, axis: str = "token") -> torch.Tensor:
    """Per-head expected logit error Σ_t e_t C_Q e_t^T over probe keys [P, kv_heads, T, d]."""
    e = quantize_rotated(keys, r, mean, clip, group_size, sink_tokens, axis) - keys.double()
    return torch.einsum("phti,hij,phtj->h", e, query_cov.double(), e)


def _grouped(queries, kv_heads: int) -> torch.Tensor:
    """[P, heads, Nq, d] → [P, kv_heads, heads/kv_heads, Nq, d]: query heads under their KV head."""
    p, h, nq, d = queries.shape
    return queries.reshape(p, kv_heads, h // kv_heads, nq, d)


def _causal_logits(q, k, scaling, positions) -> torch.Tensor:
    """scaling·q·k^T with future keys at -inf; q [P, kv, g, Nq, d], k [P, kv, T, d] → [P, kv, g, Nq, T]."""
    scores = (q.double() @ k.double()[:, :, None].mT) * scaling
    future = torch.arange(k.shape[-2], device=k.device)[None, :] > positions[:, None].to(k.device)
    return scores.masked_fill(future, float("-inf"))


def key_attention_errors(objective, queries, keys, values, positions, r, mean, clip, group_size, sink_tokens,
                         scaling, axis: str = "token") -> torch.Tensor:
    """Per-head attention-aware error of quantizing the keys alone (values exact), summed over probe queries.

    objective: "output" Σ‖(Ŝ − S)V‖², "kl" Σ KL(S ‖ Ŝ), "weighted-logit" Σ_qt S_qt (s·q·e_t)²;
    S, Ŝ causal softmax attention over exact and quantized keys.
    """
    q = _grouped(queries, keys.shape[1])
    k_hat = quantize_rotated(keys, r, mean, clip, group_size, sink_tokens, axis)
    exact = _causal_logits(q, keys, scaling, positions)
    approx = _causal_logits(q, k_hat, scaling, positions)
    if objective == "output":
        v = values.double()[:, :, None]
        return (torch.softmax(approx, -1) @ v - torch.softmax(exact, -1) @ v).pow(2).sum((0, 2, 3, 4))
    log_s = torch.log_softmax(exact, -1)
    if objective == "kl":
        log_s_hat = torch.log_softmax(approx, -1)
        terms = torch.where(torch.isinf(exact), 0.0, log_s.exp() * (log_s - log_s_hat))
        return terms.sum((0, 2, 3, 4))
    if objective == "weighted-logit":
        diff = torch.where(torch.isinf(exact), 0.0, approx - exact)
        return (log_s.exp() * diff.pow(2)).sum((0, 2, 3, 4))
    raise ValueError(f"unknown key clip objective {objective!r}: one of {', '.join(KEY_CLIP_OBJECTIVES)}")


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


def turned_probes(stats, layer: int, inv_freq: torch.Tensor | None, offsets=()) -> dict[int, dict[str, torch.Tensor]]:
    """{Δ: the layer's probe with queries and keys turned by Δ positions} for Δ = 0 and every offset (0 only
    without RoPE frequencies): the same tokens as if they stood Δ positions later (rope.turn)."""
    p = stats.probe(layer)
    probes = {0: p}
    if inv_freq is not None:
        for delta in offsets:
            probes[delta] = {**p, "query": turn(p["query"], inv_freq, delta), "key": turn(p["key"], inv_freq, delta)}
    return probes


def key_clip_errors(stats, layer: int, r: torch.Tensor, mean: torch.Tensor | None, group_size: int,
                    sink_tokens: int, objective: str = "logit", axis: str = "token",
                    probes: dict[int, dict] | None = None):
    """errors_at(c) -> [kv_heads]: the key clip objective (module doc) of one layer's keys rotated by r and centred
    by mean, summed over `probes` (turned_probes; default: the probe alone; "logit", whose C_Q is the probe's, on
    the probe alone). Its argmin over the grid is the layer's c_K."""
    if objective not in KEY_CLIP_OBJECTIVES:
        raise ValueError(f"unknown key clip objective {objective!r}: one of {', '.join(KEY_CLIP_OBJECTIVES)}")
    probes = probes or {0: stats.probe(layer)}
    if objective == "logit":
        keys, c_q = probes[0]["key"], stats.query_covariance(layer)
        return lambda c: key_errors(keys, r, mean, c_q, c, group_size, sink_tokens, axis)
    scaling = float(stats.acc["scaling"][layer])
    return lambda c: sum(key_attention_errors(objective, p["query"], p["key"], p["value"], p["positions"], r, mean,
                                              c, group_size, sink_tokens, scaling, axis) for p in probes.values())


def derive_keys(stats, layer: int, variant: str, centering: bool, group_size: int, sink_tokens: int,
                grid=CLIP_GRID, objective: str = "logit", axis: str = "token",
                probes: dict[int, dict] | None = None) -> dict[str, torch.Tensor]:
    """R_K, c_K and (if centering) μ_K of one layer for keys grouped along `axis`; c_K the argmin over the grid
    of key_clip_errors."""
    if objective not in KEY_CLIP_OBJECTIVES:
        raise ValueError(f"unknown key clip objective {objective!r}: one of {', '.join(KEY_CLIP_OBJECTIVES)}")
    r = rotation(variant, stats.query_covariance(layer), group_size)
    mean = stats.key_mean(layer) if centering else None
    clip = search_clip(key_clip_errors(stats, layer, r, mean, group_size, sink_tokens, objective, axis, probes), grid)
    return {"key_rotation": r, "key_clip": clip, **({"key_mean": mean} if mean is not None else {})}


def key_output_error(stats, layer: int, keys: dict[str, torch.Tensor], group_size: int, sink_tokens: int,
                     axis: str, probe: dict[str, torch.Tensor] | None = None) -> float:
    """Σ‖(Ŝ − S)V‖² / Σ‖SV‖² over the probe's queries and every KV head: the attention-output error that a
    layer's quantized keys (values exact) cause, relative to the attention output itself. It sees softmax: a
    small logit error among keys whose logits are close, or a large one on keys that attention reads, counts;
    a large relative logit error on keys nobody reads does not. probe: a turned probe (default: the layer's)."""
    p = probe or stats.probe(layer)
    scaling = float(stats.acc["scaling"][layer])
    error = key_attention_errors("output", p["query"], p["key"], p["value"], p["positions"], keys["key_rotation"],
                                 keys.get("key_mean"), keys["key_clip"], group_size, sink_tokens, scaling, axis)
    q = _grouped(p["query"], p["key"].shape[1])
    exact = causal_attention(q, p["key"][:, :, None], p["value"][:, :, None], scaling, p["positions"])
    return float(error.sum() / exact.pow(2).sum().clamp_min(torch.finfo(torch.float64).tiny))


def value_clip_errors(stats, layer: int, r: torch.Tensor, mean: torch.Tensor | None, group_size: int,
                      sink_tokens: int):
    """errors_at(c) -> [kv_heads]: the value clip objective ‖S(V̂ − V)‖² of one layer's values rotated by r and
    centred by mean, on the probe. Its argmin over the grid is the layer's c_V."""
    p = stats.probe(layer)
    scaling = float(stats.acc["scaling"][layer])
    return lambda c: value_errors(p["query"], p["key"], p["value"], p["positions"], r, mean, c, group_size,
                                  sink_tokens, scaling)


def derive_values(stats, layer: int, variant: str, centering: bool, group_size: int, sink_tokens: int,
                  grid=CLIP_GRID) -> dict[str, torch.Tensor]:
    """R_V, c_V and (if centering) μ_V of one layer."""
    r = rotation(variant, stats.score_weighted_value_covariance(layer), group_size)
    mean = stats.value_mean(layer) if centering else None
    clip = search_clip(value_clip_errors(stats, layer, r, mean, group_size, sink_tokens), grid)
    return {"value_rotation": r, "value_clip": clip, **({"value_mean": mean} if mean is not None else {})}


def key_formats(key_axis: str, key_rotation: str = "oscar") -> tuple[tuple[str, str], ...]:
    """DeriveOptions.key_formats for a key axis: "auto" (every candidate), "token" or "channel" (that axis only).

    With the default key rotation ("oscar") keys per channel are kept unrotated or in U_Q (derive_layer); any other
    key rotation holds for every candidate, per channel too (an ablation gets the keys it asked for)."""
    token = (("token", key_rotation),)
    channel = (("channel", "none"), ("channel", "eigen")) if key_rotation == "oscar" else (("channel", key_rotation),)
    if key_axis not in ("auto", *KEY_AXES):
        raise OscarError(f"unknown key axis {key_axis!r}: auto, token or channel")
    return {"auto": token + channel, "token": token, "channel": channel}[key_axis]


def key_format_name(axis: str, variant: str) -> str:
    """How a key format reads in a manifest and a table, e.g. "token U_Q·H·P_br", "channel U_Q", "channel none"."""
    return f"{axis} {label(variant, 'U_Q')}"


def derive_layer(stats, layer: int, opts: DeriveOptions, inv_freq: torch.Tensor | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict]:
    """The bundle tensors of one layer (names without the `layers.{i}.` prefix, float64) and its key format
    ({"layer", "key_axis", "key_format", "errors"}: bundle.LayerQuant's fields).

    Keys are derived in every format of opts.key_formats (each with its own rotation and searched clip) and the
    format whose keys leave the smallest relative attention-output error (key_output_error) at its worst over
    the probe and its turns to opts.far_offsets (given the layer's RoPE inv_freq) is kept; a tie keeps the first.
    `errors` holds each format's error on the probe under its name and at offset Δ under "<name> @Δ".
    Per token, the published U_Q·H·P_br spreads every direction over a group's channels; per channel (KIVI-style:
    one scale per channel and block of G tokens) a rotation must not mix a few outlier channels into all the
    others, so the candidates there are none and the eigenbasis U_Q alone."""
    probes = turned_probes(stats, layer, inv_freq, opts.far_offsets)
    candidates, errors, worst = {}, {}, {}
    for axis, variant in opts.key_formats:
        name = key_format_name(axis, variant if axis == "channel" else opts.key_rotation)
        candidates[name] = axis, derive_keys(stats, layer, variant if axis == "channel" else opts.key_rotation,
                                             opts.key_centering, opts.key_group_size, opts.sink_tokens,
                                             key_clip_grid(opts), opts.key_clip_objective, axis, probes)
        if len(opts.key_formats) > 1:
            for delta, probe in probes.items():
                errors[name if delta == 0 else f"{name} @{delta}"] = round(key_output_error(
                    stats, layer, candidates[name][1], opts.key_group_size, opts.sink_tokens, axis, probe), 6)
            worst[name] = max(e for n, e in errors.items() if n == name or n.startswith(f"{name} @"))
    best = min(candidates, key=lambda n: worst.get(n, 0.0))
    axis, keys = candidates[best]
    values = derive_values(stats, layer, opts.value_rotation, opts.value_centering, opts.value_group_size,
                           opts.sink_tokens, opts.clip_grid)
    return {**keys, **values}, {"layer": layer, "key_axis": axis, "key_format": best, "errors": errors}


def clip_objectives(stats, layer: int, tensors: dict[str, torch.Tensor], opts: DeriveOptions, axis: str = "token",
                    inv_freq: torch.Tensor | None = None) -> dict:
    """{"key_clip": errors_at, "value_clip": errors_at}: the objectives whose argmins chose a derived layer's clips
    (derive_layer with opts), given its tensors (names without the `layers.{i}.` prefix) and its key axis."""
    probes = turned_probes(stats, layer, inv_freq, opts.far_offsets)
    return {"key_clip": key_clip_errors(stats, layer, tensors["key_rotation"].double(),
                                        _double(tensors.get("key_mean")), opts.key_group_size, opts.sink_tokens,
                                        opts.key_clip_objective, axis, probes),
            "value_clip": value_clip_errors(stats, layer, tensors["value_rotation"].double(),
                                            _double(tensors.get("value_mean")), opts.value_group_size,
                                            opts.sink_tokens)}


def _double(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.double()


def uncentred_clip_errors(stats, layer: int, side: str, r: torch.Tensor, group_size: int, sink_tokens: int):
    """errors_at(c) -> [kv_heads] of one layer on the calibration probe with nothing centred (as a runtime without
    key or value means stores the cache): the key logit objective Σ e C_Q eᵀ, or the value output error."""
    if side == "key":
        return key_clip_errors(stats, layer, r, None, group_size, sink_tokens, "logit")
    return value_clip_errors(stats, layer, r, None, group_size, sink_tokens)


def search_global_clip(errors_at: list, grid) -> float:
    """One clip ratio for every layer and head: argmin_c mean_{l,h} E_lh(c) / E_lh(c_max), c_max = max(grid).

    errors_at[l](c) -> [kv_heads] errors of layer l at clip c. Each head's error is taken relative to its
    error at c_max (unclipped), so every head counts alike: the raw sums are ruled by the layers with the
    largest activations. Ties go to the larger c."""
    grid = sorted(grid, reverse=True)
    errors = torch.stack([torch.cat([f(c) for f in errors_at]) for c in grid])
    relative = errors / errors[0].clamp_min(torch.finfo(errors.dtype).tiny)
    return float(grid[int(relative.mean(1).argmin())])
