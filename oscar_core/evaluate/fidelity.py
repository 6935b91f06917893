"""Attention fidelity under INT2, layer by layer, on text the calibration did not see.

For a layer with held-out queries Q, keys K and values V (post-RoPE, one sample):
    key error   = ‖Q(K̂ − K)^T‖ / ‖QK^T‖                       (attention logits, per KV head)
    value error = ‖S(V̂ − V)‖ / ‖SV‖,  S = causal softmax(scaling·QK^T)   (attention output)
K̂ and V̂ are what the cache gives back; the first sink tokens stay exact.
"""

import torch

from oscar_core.calibrate.derive import quantize_rotated
from oscar_core.calibrate.statistics import observe_attention
from oscar_core.metrics import logit_error, output_error


def capture_attention(model, input_ids: torch.Tensor) -> dict[int, tuple]:
    """Run one forward pass; per layer (q [H, T, d], k [KVH, T, d], v [KVH, T, d], scaling) of sample 0."""
    captured = {}

    def keep(layer, q, k, v, out, scaling):
        captured[layer] = (q[0].float(), k[0].float(), v[0].float(), scaling)

    with torch.inference_mode(), observe_attention(model, keep):
        model(input_ids=input_ids.to(next(model.parameters()).device), use_cache=False, logits_to_keep=1)
    return captured


def roundtrip(x, rotation, mean, clip, group_size: int, sink_tokens: int, write=None) -> torch.Tensor:
    """x [KVH, T, d] as an INT2 cache gives it back (float64, original space, sinks exact).

    write=None uses the torch reference (derive.quantize_rotated); otherwise a write kernel with
    kvstore.write_int2's signature (e.g. the Triton one), read back with kvstore.read_int2.
    """
    if write is None:
        return quantize_rotated(x, rotation, mean, clip, group_size, sink_tokens)
    from oscar_core.kvstore import read_int2

    tokens = x.transpose(0, 1).contiguous()
    clip = torch.as_tensor(clip, dtype=torch.float32, device=x.device).expand(x.shape[0]).contiguous()
    mean32 = None if mean is None else mean.float().contiguous()
    rotated = read_int2(*write(tokens, rotation.float().contiguous(), clip, group_size, mean32), group_size)
    restored = rotated.double().transpose(0, 1) @ rotation.double().mT
    if mean is not None:
        restored = restored + mean.double()[:, None, :]
    restored[:, :sink_tokens] = x[:, :sink_tokens].double()
    return restored


def key_error(q, k, rotation, mean, clip, group_size: int, sink_tokens: int, write=None) -> torch.Tensor:
    """Per-KV-head relative logit error; q [H, T, d], k [KVH, T, d]."""
    kv = k.shape[0]
    k_hat = roundtrip(k, rotation, mean, clip, group_size, sink_tokens, write)
    qg = q.reshape(kv, -1, *q.shape[1:]).double()
    return logit_error(qg.flatten(1, 2), k.double(), k_hat)


def value_error(q, k, v, scaling: float, rotation, mean, clip, group_size: int, sink_tokens: int,
                write=None, window: int | None = None) -> torch.Tensor:
    """Per-KV-head relative attention-output error with exact keys; q [H, T, d], k, v [KVH, T, d]; window: the
    layer's sliding window (None: global)."""
    kv, t = k.shape[0], k.shape[1]
    v_hat = roundtrip(v, rotation, mean, clip, group_size, sink_tokens, write)
    rows = q.reshape(kv, -1, q.shape[-1])  # the group's query heads stacked as rows
    positions = torch.arange(t).repeat(rows.shape[1] // t)
    return output_error(rows, k, v, k, v_hat, scaling, positions, window)
