"""Key clip objectives of derive.py: the attention-aware ones against independent references, and a
retrieval probe on which they keep a sharply attended outlier key that the mean logit objective clips."""

import pytest
import torch

from oscar_core.calibrate.derive import (CLIP_GRID, KEY_CLIP_OBJECTIVES, DeriveOptions, clip_objective_label,
                                         derive_keys, key_attention_errors, key_clip_grid, key_errors, quantize_rotated,
                                         search_clip)
from oscar_core.calibrate.statistics import AttentionStatistics
from oscar_core.metrics import causal_attention

D, T, NQ = 64, 256, 32


def retrieval_probe(seed: int = 0):
    """Gaussian keys, one of them (the needle, token 100) with an outlier component along channel 5; most queries
    are diffuse, the last four point along channel 5 and so read the needle. Exact values."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 1, T, D, generator=g, dtype=torch.float64)
    keys[0, 0, 100, 5] += 6.0
    queries = 0.3 * torch.randn(1, 1, NQ, D, generator=g, dtype=torch.float64)
    queries[0, 0, -4:, 5] += 4.0
    values = torch.randn(1, 1, T, D, generator=g, dtype=torch.float64)
    positions = torch.linspace(T // 2, T - 1, NQ).round().long()
    return queries, keys, values, positions


def test_output_objective_matches_causal_attention_reference():
    q, k, v, pos = retrieval_probe()
    r = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64))[0][None]
    mean = k[0].mean(1)
    for clip in (1.0, 0.8, 0.6):
        k_hat = quantize_rotated(k, r, mean, clip, 64, 8)
        s = D ** -0.5
        ref = (causal_attention(q, k_hat, v, s, pos) - causal_attention(q, k, v, s, pos)).pow(2).sum()
        got = key_attention_errors("output", q, k, v, pos, r, mean, clip, 64, 8, s)
        assert got.shape == (1,) and torch.allclose(got[0], ref, rtol=1e-10)
        # KL and weighted logit error from probabilities written out by hand
        scores = (q @ k.mT) * s
        scores_hat = (q @ k_hat.mT) * s
        future = torch.arange(T)[None, :] > pos[:, None]
        p = torch.softmax(scores.masked_fill(future, float("-inf")), -1)
        p_hat = torch.softmax(scores_hat.masked_fill(future, float("-inf")), -1)
        kl = (p * (p.clamp_min(1e-300).log() - p_hat.clamp_min(1e-300).log())).sum()
        wl = (p * (scores_hat - scores).pow(2)).sum()
        assert torch.allclose(key_attention_errors("kl", q, k, v, pos, r, mean, clip, 64, 8, s)[0], kl, rtol=1e-8)
        assert torch.allclose(key_attention_errors("weighted-logit", q, k, v, pos, r, mean, clip, 64, 8, s)[0], wl,
                              rtol=1e-10)


def test_exact_keys_have_zero_error_under_every_objective():
    q, k, v, pos = retrieval_probe()
    r = torch.eye(D, dtype=torch.float64)[None]
    for objective in KEY_CLIP_OBJECTIVES[1:]:
        err = key_attention_errors(objective, q, k, v, pos, r, None, 0.7, 64, T, D ** -0.5)  # all tokens are sinks
        assert float(err.abs().max()) < 1e-12


def test_attention_aware_objectives_keep_the_retrieved_outlier():
    """The mean logit error Σ e C_Q eᵀ is dominated by the diffuse queries and clips hard; the attention-aware
    objectives see the retrieval queries' peak on the needle and clip less."""
    q, k, v, pos = retrieval_probe()
    r = torch.eye(D, dtype=torch.float64)[None]
    c_q = (q[0, 0].mT @ q[0, 0] / NQ)[None]
    logit = float(search_clip(lambda c: key_errors(k, r, None, c_q, c, 64, 0), CLIP_GRID)[0])
    s = D ** -0.5
    for objective in ("output", "kl", "weighted-logit"):
        aware = float(search_clip(lambda c: key_attention_errors(objective, q, k, v, pos, r, None, c, 64, 0, s),
                                  CLIP_GRID)[0])
        assert aware >= logit + 0.15, (objective, aware, logit)
    # and the needle's attention mass for the retrieval queries is kept better at the aware clip
    def needle_mass(clip):
        k_hat = quantize_rotated(k, r, None, clip, 64, 0)
        return float(torch.softmax((q[0, 0, -4:] @ k_hat[0, 0].mT) * s, -1)[:, 100].mean())
    aware = float(search_clip(lambda c: key_attention_errors("output", q, k, v, pos, r, None, c, 64, 0, s),
                              CLIP_GRID)[0])
    assert needle_mass(aware) > needle_mass(logit)


def stats_of_probe(seed: int = 0, outlier: float = 8.0, d: int = 16) -> AttentionStatistics:
    """Statistics of one layer, 4 query heads over 2 KV heads, from real random tensors through observe()."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, T, d, generator=g)
    k = torch.randn(2, 2, T, d, generator=g) + 2.0
    k[:, :, 100, 3] += outlier
    v = torch.randn(2, 2, T, d, generator=g)
    out = torch.randn(2, T, 4, d, generator=g)
    stats = AttentionStatistics(1, 4, 2, d, probe_tokens=T, probe_queries=64)
    stats.observe(0, q, k, v, out, 0.25)
    return stats


def test_derive_keys_objectives_and_floor():
    stats = stats_of_probe()
    base = derive_keys(stats, 0, "oscar", True, 16, 8)
    for objective in KEY_CLIP_OBJECTIVES:
        got = derive_keys(stats, 0, "oscar", True, 16, 8, objective=objective)
        assert torch.equal(got["key_rotation"], base["key_rotation"]) and torch.equal(got["key_mean"], base["key_mean"])
        assert got["key_clip"].shape == (2,) and ((got["key_clip"] >= 0.5) & (got["key_clip"] <= 1)).all()
    floored = derive_keys(stats, 0, "oscar", True, 16, 8, grid=key_clip_grid(DeriveOptions(key_clip_floor=0.9)))
    assert (floored["key_clip"] >= 0.9).all()
    with pytest.raises(ValueError, match="unknown key clip objective"):
        derive_keys(stats, 0, "oscar", True, 16, 8, objective="mse")
    with pytest.raises(ValueError, match="above every clip grid point"):
        key_clip_grid(DeriveOptions(key_clip_floor=1.01))


def test_clip_objective_label_keeps_the_schema_default():
    from oscar_core.formats.bundle import QuantInfo

    assert clip_objective_label() == QuantInfo.model_fields["clip_objective"].default
    assert clip_objective_label("kl") == "keys: attention KL divergence; values: attention-output error"
    assert "(key clip >= 0.9)" in clip_objective_label("logit", 0.9)


def test_default_key_clip_floor_is_recorded():
    """The default keeps key clips at or above 0.8 (the 8K needle fix) and says so in the manifest string."""
    opts = DeriveOptions()
    assert opts.key_clip_objective == "output" and opts.key_clip_floor == 0.8
    assert min(key_clip_grid(opts)) == 0.8 and max(key_clip_grid(opts)) == 1.0
    assert clip_objective_label(opts.key_clip_objective, opts.key_clip_floor) == \
        "keys: attention-output error (exact values) (key clip >= 0.8); values: attention-output error"
    stats = stats_of_probe(1, outlier=0.0, d=64)  # Gaussian keys in groups of 64: the unfloored search clips hard
    from oscar_core.calibrate.derive import derive_layer
    layer, _ = derive_layer(stats, 0, DeriveOptions(sink_tokens=8))
    unfloored = derive_keys(stats, 0, "oscar", True, 64, 8)["key_clip"]
    assert (unfloored < 0.8).any()  # without the floor this probe's search clips harder
    assert (layer["key_clip"] >= 0.8).all()


def stats_of_layer(keys: torch.Tensor, queries: torch.Tensor, seed: int = 0) -> AttentionStatistics:
    """One layer's statistics (2 query heads on 1 KV head, head_dim 64) from given keys [2, 1, T, 64] and queries."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(2, 1, T, 64, generator=g)
    out = torch.randn(2, T, 2, 64, generator=g)
    stats = AttentionStatistics(1, 2, 1, 64, probe_tokens=T, probe_queries=64)
    stats.observe(0, queries, keys, v, out, 0.125)
    return stats


def test_each_layer_keeps_the_key_format_that_attention_sees_least():
    """Keys with two wide, offset channels read by large queries (Qwen2.5-Coder-0.5B's layer 0): per-token groups
    spend their four levels on those channels and the others drown; per-channel groups keep them apart."""
    from oscar_core.calibrate.derive import derive_layer, key_format_name

    g = torch.Generator().manual_seed(0)
    opts = DeriveOptions(sink_tokens=8)
    wide = torch.randn(2, 1, T, 64, generator=g)
    wide[..., 7] = 19 * torch.randn(2, 1, T, generator=g) + 120
    wide[..., 40] = 38 * torch.randn(2, 1, T, generator=g) - 140
    queries = 3 * torch.randn(2, 2, T, 64, generator=g)
    _, info = derive_layer(stats_of_layer(wide, queries), 0, opts)
    assert set(info["errors"]) == {"token U_Q·H·P_br", "channel none", "channel U_Q"}
    assert info["key_axis"] == "channel" and info["key_format"] == min(info["errors"], key=info["errors"].get)
    assert info["errors"]["token U_Q·H·P_br"] > 1.5 * info["errors"][info["key_format"]]

    scaled = torch.randn(2, 1, T, 64, generator=g)
    one, info = derive_layer(stats_of_layer(scaled, torch.randn(2, 2, T, 64, generator=g)), 0,
                             DeriveOptions(sink_tokens=8, key_formats=(("channel", "none"),)))
    assert info["key_axis"] == "channel" and info["errors"] == {}          # one format: nothing to choose
    assert torch.equal(one["key_rotation"], torch.eye(64, dtype=torch.float64)[None])


def test_a_key_mean_that_turns_with_position_is_scored_where_the_bundle_is_served():
    """Keys with a large mean in a slow RoPE pair (a k_proj bias) that barely turns over the probe's 256 positions and
    by radians at far ones: per-token groups, centred on the probe's mean, carry the turned residual there, which the
    probe alone never shows; every format is scored at the probe turned to far offsets, and the kept one is the
    format whose worst error over them is the smallest."""
    from oscar_core.calibrate.derive import derive_layer
    from oscar_core.rope import far_offsets, turn

    g = torch.Generator().manual_seed(0)
    inv_freq = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    slow = 24                                             # θ = 3e-4: 0.08 rad over the probe, ~10 rad at 32K
    keys = torch.randn(2, 1, T, 64, generator=g, dtype=torch.float64)
    keys = keys * (0.1 + 3 * torch.rand(2, 1, T, 1, generator=g) ** 3)
    keys[..., slow] += 40.0
    keys[..., slow + 32] += 40.0
    queries = torch.randn(2, 2, T, 64, generator=g, dtype=torch.float64)
    at = torch.arange(T)   # post-RoPE, as the hooks see them: token t turned by t
    keys = torch.stack([torch.stack([turn(keys[s, 0, t], inv_freq, int(t)) for t in at]) for s in range(2)])[:, None]
    queries = torch.stack([torch.stack([turn(queries[s, :, t], inv_freq, int(t)) for t in at], 1) for s in range(2)])
    stats = stats_of_layer(keys.float(), queries.float())
    offsets = far_offsets(32768, T)
    assert offsets == (4096, 8192, 16384, 32512) and far_offsets(256, T) == ()
    _, near = derive_layer(stats, 0, DeriveOptions(sink_tokens=8))
    _, far = derive_layer(stats, 0, DeriveOptions(sink_tokens=8, far_offsets=offsets), inv_freq)
    errors, token = far["errors"], "token U_Q·H·P_br"
    assert set(near["errors"]) == {token, "channel none", "channel U_Q"}
    assert {k for k in errors if "@" in k} == {f"{n} @{o}" for n in near["errors"] for o in offsets}
    assert max(errors[f"{token} @{o}"] for o in offsets) > 5 * errors[token]   # the residual mean grows far out
    worst = {n: max(v for k, v in errors.items() if k.split(" @")[0] == n) for n in near["errors"]}
    assert far["key_format"] == min(worst, key=worst.get) and far["key_axis"] == "channel"
    # Without RoPE frequencies (a calibration that did not record them) the offsets cannot be scored.
    _, none = derive_layer(stats, 0, DeriveOptions(sink_tokens=8, far_offsets=offsets))
    assert none["errors"] == near["errors"]


def test_turning_is_exact_rope():
    """rope.turn(x at p, Δ) is x at p + Δ for transformers' rotate_half RoPE, partial RoPE included."""
    from oscar_core.rope import turn

    g = torch.Generator().manual_seed(0)
    inv_freq = 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 32)   # RoPE on 16 of 32 channels

    def rope(x, p):
        angle = p * inv_freq
        cos, sin = torch.cat([angle.cos()] * 2), torch.cat([angle.sin()] * 2)
        rot, rest = x[..., :16], x[..., 16:]
        half = torch.cat([-rot[..., 8:], rot[..., :8]], -1)
        return torch.cat([rot * cos + half * sin, rest], -1)

    x = torch.randn(5, 32, generator=g, dtype=torch.float64)
    assert torch.allclose(turn(rope(x, 7), inv_freq, 1000), rope(x, 1007), atol=1e-10)
    q, k = torch.randn(2, 32, generator=g, dtype=torch.float64)
    assert torch.allclose(turn(q, inv_freq, 5000) @ turn(k, inv_freq, 5000), q @ k)   # logits unchanged
