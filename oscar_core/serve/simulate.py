"""Teacher-forced INT2 attention: every query sees exactly what an INT2 cache would give it at decode time.

    with simulate_int2(model, "oscar", bundle):
        logits = model(ids).logits          # one forward, any length the model allows

For query position p of a layer with keys/values K, V (post-RoPE, as the attention interface has them):
    K_bf = bf16(K)                                   what the cache stores
    K̂    = methods.fake(side, K_bf)                  what its INT2 write path gives back
    key t as read by p = K̂_t if INT2(p, t) else K_bf_t,   INT2(p, t) = t ≥ S and last(t) ≤ p − W
(methods.int2_mask; S = 64 sink tokens, W = 256 recent tokens), and the same for values; then causal
softmax attention in float32. The bf16 method reads K_bf, V_bf everywhere. A sliding layer of window N
(layers.LayerSpec) lets p see only keys p − N + 1..p, exactly as the model does; a layer that holds no INT2
tokens (layers.holds_int2: a short window, kept as a BF16 ring) reads K_bf, V_bf whatever the method.

Queries go in chunks [a, b): keys that are INT2 and visible for every query of the chunk (last(t) ≤ a − W,
t > b − 1 − N) are read from K̂ alone; the sink, the keys near the chunk and those near its window's edge
are scored twice, exact and INT2, and a mask picks one score per query (or none, outside its window); the
two softmax parts are merged by their running maxima.
"""

from contextlib import contextmanager

import torch

from oscar_core.calibrate.statistics import route_attention
from oscar_core.layers import check_window, holds_int2, layer_specs, visible, window_recent, windowed_attention
from oscar_core.serve import methods

ATTENTION_NAME = "oscar_simulate"
CHUNK = 512
FAST_PATH_SCORES = 1 << 28   # one SDPA call above this many scores may materialize them all (float32): chunk instead


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _int2(side: methods.Side | None, x: torch.Tensor, sink: int) -> torch.Tensor:
    """x as the INT2 write path gives it back; token blocks start after the sink, as in the cache."""
    if side is None:
        return x
    return torch.cat([x[:, :, :sink], methods.fake(side, x[:, :, sink:])], dim=2)


def simulated_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lm: methods.LayerMethod,
                        scaling: float, sink: int, recent: int, chunk: int = CHUNK,
                        window: int | None = None) -> torch.Tensor:
    """Attention output [B, H, T_q, d] (float32) of queries [B, H, T_q, d] at the last T_q positions of
    keys/values [B, H_kv, T, d], each reading the cache as it would be when that query is decoded;
    window: the layer's sliding window (None: global causal attention)."""
    bsz, heads, tq, d = query.shape
    kv_heads, t = key.shape[1], key.shape[2]
    group = heads // kv_heads
    k_bf, v_bf = _bf16(key), _bf16(value)
    if lm.key is None and lm.value is None and tq == t and bsz * heads * t * t <= FAST_PATH_SCORES:
        if window is not None and window < t:
            return windowed_attention(query.float(), k_bf, v_bf, scaling, window, chunk)
        return torch.nn.functional.scaled_dot_product_attention(
            query.float(), k_bf, v_bf, is_causal=True, scale=scaling, enable_gqa=group > 1)
    k_q, v_q = _int2(lm.key, k_bf, sink), _int2(lm.value, v_bf, sink)
    q = query.float().reshape(bsz, kv_heads, group, tq, d)
    out = torch.empty(bsz, kv_heads, group, tq, d, dtype=torch.float32, device=query.device)
    block = lm.token_block
    for start in range(0, tq, chunk):
        stop = min(start + chunk, tq)
        n = stop - start
        qc = q[:, :, :, start:stop].reshape(bsz, kv_heads, group * n, d) * scaling
        pos = torch.arange(start, stop, device=query.device) + (t - tq)
        first, last = int(pos[0]), int(pos[-1])
        # Keys in [sink, lo) are INT2 for every query of the chunk: last(t) ≤ t + b − 1 ≤ first − recent.
        s = min(sink, last + 1)
        lo = min(max(s, first - recent - block + 2), last + 1)
        # In a window, keys before first − N + 1 are seen by no query of the chunk, from last − N + 1 by all.
        seen_by_one = s if window is None else max(s, first - window + 1)
        far_lo = s if window is None else max(s, last - window + 1)
        far_lo = min(far_lo, lo)
        dev = query.device
        cols = torch.cat([torch.arange(s, device=dev), torch.arange(min(seen_by_one, far_lo), far_lo, device=dev),
                          torch.arange(lo, last + 1, device=dev)])
        mk = methods.int2_mask(pos, last + 1, lm.key, sink, recent, block)[:, cols].repeat(group, 1)
        mv = methods.int2_mask(pos, last + 1, lm.value, sink, recent, block)[:, cols].repeat(group, 1)
        causal = visible(pos, last + 1, window)[:, cols].repeat(group, 1)
        # Band (sink and keys near the chunk): one score per key, against the exact or the INT2 key,
        # whichever the cache holds for this query.
        band = torch.where(mk, qc @ k_q[:, :, cols].mT, qc @ k_bf[:, :, cols].mT)
        band = band.masked_fill(~causal, float("-inf"))
        m_band = band.amax(-1, keepdim=True)
        e_band = (band - m_band).exp_()
        o = (e_band * ~mv) @ v_bf[:, :, cols] + (e_band * mv) @ v_q[:, :, cols]
        l_sum = e_band.sum(-1, keepdim=True)
        if lo > far_lo:
            # Far keys, INT2 and visible for every query: softmax pieces merged by their running max.
            far = qc @ k_q[:, :, far_lo:lo].mT
            m = torch.maximum(far.amax(-1, keepdim=True), m_band)
            e_far = far.sub_(m).exp_()
            shift = (m_band - m).exp_()
            o = o * shift + e_far @ v_q[:, :, far_lo:lo]
            l_sum = l_sum * shift + e_far.sum(-1, keepdim=True)
        out[:, :, :, start:stop] = (o / l_sum).reshape(bsz, kv_heads, group, n, d)
    return out.reshape(bsz, heads, tq, d)


@contextmanager
def simulate_int2(model, method: str, bundle=None, sink_tokens: int | None = None,
                  recent_tokens: int | None = None, chunk: int = CHUNK):
    """Route every attention layer of `model` through simulated_attention for `method` (methods.METHODS).

    The model must be called without padding (one full window per row); with a past cache the queries
    are taken to be the last positions. sink/recent default to the bundle's windows (else 64 and 256).
    Each layer attends as its layers.LayerSpec says (a sliding window), and a layer that holds no INT2 tokens
    (layers.holds_int2) reads BF16 keys and values whatever the method.
    """

    methods.check_method(method)
    sink, recent = methods.windows(method, bundle)
    sink = sink if sink_tokens is None else sink_tokens
    recent = recent if recent_tokens is None else recent_tokens
    per_layer: dict[int, methods.LayerMethod] = {}
    specs = layer_specs(model.config)

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        i = module.layer_idx
        check_window(i, specs[i], kwargs.get("sliding_window"))
        if i not in per_layer:
            per_layer[i] = (methods.layer_method(method, i, key.shape[1], key.shape[-1], bundle)
                            if holds_int2(specs[i], sink, recent) else methods.LayerMethod(None, None))
        scaling = scaling or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        lm = per_layer[i]
        r = window_recent(specs[i].window, recent, lm.token_block, methods.stored(lm, method))
        out = simulated_attention(query, key, value, lm, float(scaling), sink, r, chunk, specs[i].window)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    with route_attention(model, ATTENTION_NAME, attention):
        yield
