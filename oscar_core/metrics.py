"""Error metrics: what an INT2 cache does to attention and to the model's predictions."""

import torch

from oscar_core.layers import visible


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """‖approx − exact‖ / ‖exact‖ over the last two dims (one figure per leading index)."""
    num = (approx.double() - exact.double()).flatten(-2).norm(dim=-1)
    return num / exact.double().flatten(-2).norm(dim=-1).clamp_min(1e-30)


def logit_error(q: torch.Tensor, k: torch.Tensor, k_hat: torch.Tensor) -> torch.Tensor:
    """Relative attention-logit error ‖Q(K̂ − K)^T‖ / ‖QK^T‖; q [..., Nq, d], k, k_hat [..., Nk, d]."""
    q, k, k_hat = q.double(), k.double(), k_hat.double()
    return (q @ (k_hat - k).mT).flatten(-2).norm(dim=-1) / (q @ k.mT).flatten(-2).norm(dim=-1).clamp_min(1e-30)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                     q_positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """softmax(scaling·q·k^T, causal) · v in float64, for queries at q_positions; q [..., Nq, d], k, v [..., Nk, d];
    in a sliding window of W (layers.visible) a query at p sees keys p − W + 1..p only."""
    scores = (q.double() @ k.double().mT) * scaling
    hidden = ~visible(q_positions.to(k.device), k.shape[-2], window)
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return probs @ v.double()


def output_error(q, k, v, k_hat, v_hat, scaling: float, q_positions: torch.Tensor,
                 window: int | None = None) -> torch.Tensor:
    """Relative attention-output error of attending over (k̂, v̂) instead of (k, v)."""
    exact = causal_attention(q, k, v, scaling, q_positions, window)
    return relative_error(causal_attention(q, k_hat, v_hat, scaling, q_positions, window), exact)


def kl_divergence(logits: torch.Tensor, reference_logits: torch.Tensor) -> torch.Tensor:
    """Mean KL(reference ‖ approx) over positions, from logits [..., vocab]."""
    ref = torch.log_softmax(reference_logits.double(), -1)
    approx = torch.log_softmax(logits.double(), -1)
    return (ref.exp() * (ref - approx)).sum(-1).mean()


def top1_agreement(logits: torch.Tensor, reference_logits: torch.Tensor) -> torch.Tensor:
    return (logits.argmax(-1) == reference_logits.argmax(-1)).double().mean()


def perplexity(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """exp of the mean next-token cross-entropy; logits [..., T, vocab] predict targets [..., T]."""
    nll = torch.nn.functional.cross_entropy(logits.double().flatten(0, -2), targets.flatten(), reduction="mean")
    return nll.exp()


def same_prefix(tokens: torch.Tensor, reference: torch.Tensor) -> float:
    """Mean over sequences of the generated tokens [B, T] equal to reference's before their first difference."""
    n = min(tokens.shape[1], reference.shape[1])
    diff = (tokens[:, :n] != reference[:, :n]).int()
    first = torch.where(diff.any(1), diff.argmax(1), torch.full((diff.shape[0],), n))
    return first.float().mean().item()
