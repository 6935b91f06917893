"""Measuring a bundle: perplexity and needle retrieval (perplexity), the RULER-style tasks (ruler) and their run
(evaluate_ruler), attention fidelity layer by layer (fidelity), the check and gate of `oscar verify` (verify)."""
