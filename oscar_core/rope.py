"""Rotary position embedding (RoPE) as the cache sees it: post-RoPE keys and queries turned to other positions.

transformers' RoPE (rotate_half layout) turns the pair (x_i, x_{i+n}) of a head by the angle p·θ_i at position p,
θ_i = inv_freq[i], over the first 2n channels (n = len(inv_freq); partial RoPE leaves the rest alone). Turning
composes: RoPE(p + Δ) = RoPE(Δ)·RoPE(p), so a post-RoPE key of position p turned by Δ is exactly the key the same
token would have at position p + Δ:
    x'_i     = x_i·cos(Δθ_i) − x_{i+n}·sin(Δθ_i)
    x'_{i+n} = x_{i+n}·cos(Δθ_i) + x_i·sin(Δθ_i)
Queries and keys turned by the same Δ keep every logit q·k, so attention is unchanged; what changes is where the
keys sit relative to a bundle's fixed key mean and rotation, which is what INT2 quantization sees at far positions.
"""

import torch


def turn(x: torch.Tensor, inv_freq: torch.Tensor, delta: int) -> torch.Tensor:
    """x [..., d] post-RoPE at positions p, returned as at p + delta (float64)."""
    x = x.double()
    n = inv_freq.numel()
    angle = delta * inv_freq.double().to(x.device)
    cos, sin = angle.cos(), angle.sin()
    a, b = x[..., :n], x[..., n:2 * n]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, x[..., 2 * n:]], dim=-1)


def far_offsets(max_positions: int, probe_tokens: int) -> tuple[int, ...]:
    """The offsets at which derive scores key formats besides the probe's own positions 0..probe_tokens−1: an
    eighth, a quarter, half of the model's context, and its end (the probe's last key at max_positions − 1)."""
    end = max_positions - probe_tokens
    if end <= 0:
        return ()
    return tuple(sorted({max(1, max_positions // 8), max_positions // 4, max_positions // 2, end} - {0}))
