"""GPU check of the decode kernel on a head_dim-256 shape with few query heads (issue 20: 4 query heads on 1 KV
head, ragged batches, raised OutOfResources: shared memory): the default launch settings and the alternatives,
each against kvstore's reference. Prints one line per setting; exits non-zero if the default fails.
    PYTHONPATH=. python3 bench/decode_d256.py
"""

import sys

import torch

from oscar_core import kvstore
from oscar_core.triton import decode

D = 256


def build(gen, heads, kv_heads, lengths, axis):
    bsz, longest = len(lengths), max(lengths)
    rot = lambda: torch.linalg.qr(torch.randn(kv_heads, D, D, generator=gen, dtype=torch.float64))[0].float()  # noqa: E731
    layer = kvstore.LayerRotation(rot(), rot(), torch.full((kv_heads,), 0.9), torch.full((kv_heads,), 0.9),
                                  torch.randn(kv_heads, D, generator=gen), torch.randn(kv_heads, D, generator=gen))
    on = kvstore.LayerRotation(*(t.cuda() for t in (layer.key_rotation, layer.value_rotation, layer.key_clip,
                                                    layer.value_clip, layer.key_mean, layer.value_mean)))
    cache = kvstore.empty_cache(bsz, kv_heads, D, longest, 64, 64, 64, 256, device="cuda", key_axis=axis)
    keys = torch.randn(bsz, longest, kv_heads, D, generator=gen) + layer.key_mean
    values = torch.randn(bsz, longest, kv_heads, D, generator=gen)
    kvstore.prefill(cache, keys.bfloat16().cuda(), values.bfloat16().cuda(),
                    torch.tensor(lengths, dtype=torch.int32, device="cuda"), on)
    return cache, on, torch.randn(bsz, heads, D, generator=gen).bfloat16().cuda()


def main() -> int:
    gen = torch.Generator().manual_seed(0)
    default_ok = True
    for lengths in ([1, 7, 64, 333, 1000, 4097], [20000, 7, 333, 12345]):
        for axis in ("token", "channel"):
            cache, layer, q = build(gen, 4, 1, lengths, axis)
            ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation,
                                                     layer.value_mean, 0.0625)
            settings = [("default", {})] + [(f"block_n {b} warps {w} stages {s}", dict(block_n=b, num_warps=w,
                                                                                         num_stages=s))
                                            for b, w, s in ((128, 4, 1), (64, 4, 2), (64, 2, 2), (64, 4, 1))]
            for name, kw in settings:
                try:
                    out = decode.decode_attention(q, cache, layer.key_rotation, layer.value_rotation, layer.value_mean,
                                                  0.0625, **kw)
                    err = ((out.float() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
                    line = f"max rel err {err:.2e}"
                    ok = err < 1e-2
                except Exception as e:  # noqa: BLE001 - report what the launch raised
                    line, ok = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}", False
                if name == "default":
                    default_ok &= ok
                print(f"heads 4/1 d 256 {axis} lengths {lengths}: {name}: {line}", flush=True)
    return 0 if default_ok else 1


if __name__ == "__main__":
    sys.exit(main())
