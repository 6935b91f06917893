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


BUCKETS = 8  # position buckets of the NLL excess


def bucket_figures(excess: dict[str, torch.Tensor], against: str = "kivi") -> dict:
    """Per position bucket (BUCKETS equal spans of the targets): each run's mean NLL excess over BF16 (nats a
    token), given each run's per-target excess [n] (or [windows, n], averaged over windows), and the standard error
    of the mean of OSCAR's per-token excess minus `against`'s (the noise a comparison of the two must clear):
        excess_b = mean_{t∈b} (nll_t − nll_t^BF16),   se_b = std_{t∈b}(Δ_t) / √|b|,
        Δ = excess^OSCAR − excess^against
    The buckets show an error that grows with position: at 32K, eight buckets of 4K tokens."""
    excess = {run: x.reshape(-1, x.shape[-1]) for run, x in excess.items()}
    rows, n = next(iter(excess.values())).shape
    bucket_of = (torch.arange(n) * BUCKETS // n).repeat(rows)
    count = torch.bincount(bucket_of, minlength=BUCKETS).double()
    mean = lambda x: (torch.zeros(BUCKETS, dtype=torch.float64).index_add_(0, bucket_of, x.flatten().double().cpu())
                      / count)  # noqa: E731
    out = {"bounds": bucket_bounds(n + 1), "excess": {run: mean(x).tolist() for run, x in excess.items()}}
    if "oscar" in excess and against in excess:
        diff = excess["oscar"] - excess[against]
        var = (mean(diff.pow(2)) - mean(diff).pow(2)).clamp_min(0) * count / (count - 1).clamp_min(1)
        out["standard_error"] = (var / count).sqrt().tolist()
    return out


def bucket_bounds(t: int) -> list[list[int]]:
    """[first, last] target position (the token predicted) of each of end_to_end's BUCKETS buckets for T tokens."""
    bucket_of = (torch.arange(t - 1) * BUCKETS // (t - 1)).tolist()
    return [[1 + bucket_of.index(i), 1 + len(bucket_of) - 1 - bucket_of[::-1].index(i)] for i in range(BUCKETS)]
