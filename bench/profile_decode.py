"""Run decode_attention on a random INT2 store, for a profiler to watch (ncu), or time launch settings.

Codes, scales and zeros are random bytes (the work does not depend on them); Qwen3-8B heads.
    PYTHONPATH=. ncu --clock-control none -k regex:_int2_split --launch-skip 3 --launch-count 1 \
        python3 bench/profile_decode.py --context 100000 --batch 32
    PYTHONPATH=. python3 bench/profile_decode.py --context 100000 --batch 32 --waves 16 32 48
(--waves: CUDA-graph time of each setting, against bf16 SDPA on random keys and values of the same shape.)
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from shapes import random_store  # noqa: E402

from oscar_core.triton import decode  # noqa: E402


def random_cache(batch, kv_heads, context, gen):
    return random_store(batch, kv_heads, 128, context, 64, 64, "token", gen)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--gluon", type=int, default=-1, help="1/0 forces the Gluon or Triton INT2 programs")
    ap.add_argument("--waves", type=int, nargs="*", default=[])
    ap.add_argument("--stages", type=int, nargs="*", default=[], help="decode_gluon.STAGES settings to time")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = random_cache(args.batch, 8, args.context, gen)
    rot = torch.linalg.qr(torch.randn(8, 128, 128, device="cuda", dtype=torch.float64))[0].float().contiguous()
    q = torch.randn(args.batch, 32, 128, device="cuda", dtype=torch.bfloat16)
    gluon = None if args.gluon < 0 else bool(args.gluon)
    for _ in range(args.calls):
        decode.decode_attention(q, cache, rot, rot, None, 128 ** -0.5, max_length=args.context, gluon=gluon)
    torch.cuda.synchronize()
    if args.waves or args.stages:
        from kernel import graph_bench
        from oscar_core.triton import decode_gluon
        k, v = (torch.randn(args.batch, 8, args.context, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        sdpa = graph_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], k, v, scale=128 ** -0.5, enable_gqa=True))
        del k, v
        default = decode_gluon.STAGES
        for stages in args.stages or [default]:
            decode_gluon.STAGES = stages
            for waves in args.waves or [None]:
                ms = graph_bench(lambda: decode.decode_attention(q, cache, rot, rot, None, 128 ** -0.5,
                                                                 max_length=args.context, gluon=gluon, waves=waves))
                print(f"{args.context:>6} x{args.batch:<2} gluon {gluon} stages {stages} waves {waves}: "
                      f"{ms:.4f} ms, SDPA {sdpa:.4f} ms, {sdpa / ms:.2f}x", flush=True)
        decode_gluon.STAGES = default


if __name__ == "__main__":
    main()
