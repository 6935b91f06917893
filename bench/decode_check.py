"""GPU check of decode_attention against kvstore's reference, for the Gluon and the Triton INT2 programs.

For a bare GPU image (no pytest): ragged batches, 1-4 query heads per KV head, small and default windows,
with and without the value mean. Prints one line per case and exits non-zero if any error exceeds 1e-2.
    PYTHONPATH=. python3 bench/decode_check.py
"""

import sys

import torch

from oscar_core import kvstore
from oscar_core.triton import decode, decode_gluon

CASES = [  # (heads, kv_heads, lengths, sink, recent)
    (8, 2, [900, 321, 64, 65], 16, 32),
    (4, 4, [1, 40, 600, 7], 16, 32),
    (6, 2, [333, 45], 16, 32),
    (2, 2, [200, 3], 16, 32),
    (32, 8, [20_000, 7], 64, 256),
    (32, 8, [5000] * 3, 64, 256),
]


def orthogonal(heads, d, gen):
    return torch.linalg.qr(torch.randn(heads, d, d, generator=gen, dtype=torch.float64))[0].float()


def build(gen, heads, kv_heads, lengths, sink, recent, d=128):
    bsz, longest = len(lengths), max(lengths)
    layer = kvstore.LayerRotation(orthogonal(kv_heads, d, gen), orthogonal(kv_heads, d, gen),
                                  torch.full((kv_heads,), 0.96), torch.full((kv_heads,), 0.92),
                                  torch.randn(kv_heads, d, generator=gen), torch.randn(kv_heads, d, generator=gen))
    cache = kvstore.empty_cache(bsz, kv_heads, d, longest, 64, 64, sink, recent, device="cuda")
    keys = torch.randn(bsz, longest, kv_heads, d, generator=gen) + layer.key_mean
    values = torch.randn(bsz, longest, kv_heads, d, generator=gen) + layer.value_mean
    on = kvstore.LayerRotation(*(t.cuda() for t in (layer.key_rotation, layer.value_rotation, layer.key_clip,
                                                    layer.value_clip, layer.key_mean, layer.value_mean)))
    kvstore.prefill(cache, keys.bfloat16().cuda(), values.bfloat16().cuda(),
                    torch.tensor(lengths, dtype=torch.int32, device="cuda"), on)
    q = torch.randn(bsz, heads, d, generator=gen).bfloat16().cuda()
    return cache, on, q


def main() -> int:
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for heads, kv_heads, lengths, sink, recent in CASES:
        cache, layer, q = build(gen, heads, kv_heads, lengths, sink, recent)
        for mean in (layer.value_mean, None):
            ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation, mean,
                                                     0.125)
            for gluon, stages in ((True, 0), (True, 2), (True, 3), (False, 0)):
                default, decode_gluon.STAGES = decode_gluon.STAGES, stages
                out = torch.full_like(q, float("nan"))
                decode.decode_attention(q, cache, layer.key_rotation, layer.value_rotation, mean, 0.125, out=out,
                                        gluon=gluon)
                decode_gluon.STAGES = default
                err = ((out.float() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
                worst = max(worst, err if err == err else float("inf"))
                print(f"heads {heads}/{kv_heads} lengths {lengths[:4]} windows {sink}+{recent} "
                      f"mean {mean is not None} gluon {gluon} stages {stages}: max rel err {err:.2e}", flush=True)
    print(f"worst {worst:.2e}")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
