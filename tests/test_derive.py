"""Key clip objectives of derive.py: the attention-aware ones against independent references, and a
retrieval probe on which they keep a sharply attended outlier key that the mean logit objective clips."""

import pytest
import torch

from oscar_core.derive import (CLIP_GRID, KEY_CLIP_OBJECTIVES, DeriveOptions, clip_objective_label, derive_keys,
                               key_attention_errors, key_clip_grid, key_errors, quantize_rotated, search_clip)
from oscar_core.metrics import causal_attention
from oscar_core.statistics import AttentionStatistics

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
    from oscar_core.bundle import QuantInfo

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
    from oscar_core.derive import derive_layer
    layer, _ = derive_layer(stats, 0, DeriveOptions(sink_tokens=8))
    unfloored = derive_keys(stats, 0, "oscar", True, 64, 8)["key_clip"]
    assert (unfloored < 0.8).any()  # without the floor this probe's search clips harder
    assert (layer["key_clip"] >= 0.8).all()
