"""Host cost of one decode_attention call with its launches stubbed out (no GPU needed): the Python that runs
before and between the launches, and the launch cache's key, per call, on this machine's CPU.

The stub stands in for launch.CachedKernel after its first call: it builds the same cache key and returns
without launching, so what is timed is what an eager caller pays on top of the launches themselves.
    PYTHONPATH=. python3 bench/host_overhead.py [--calls 2000]
"""

import argparse
import time

import torch

from oscar_core import kvstore
from oscar_core.triton import decode, launch

SHAPES = [(32, 8, 128, 16384, 1), (32, 8, 128, 100_000, 8), (14, 2, 64, 32768, 1)]


class StubKernel(launch.CachedKernel):
    def __call__(self, grid, *args, **kwargs):
        launch.launch_key(args, kwargs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    decode._launch = StubKernel
    for heads, kv_heads, d, context, bsz in SHAPES:
        cache = kvstore.empty_cache(bsz, kv_heads, d, context)
        cache.lengths.fill_(context)
        rot = torch.eye(d).expand(kv_heads, d, d).contiguous()
        q = torch.randn(bsz, heads, d).bfloat16()
        out = torch.empty_like(q)
        call = lambda: decode.decode_attention(q, cache, rot, rot, None, d ** -0.5, max_length=context,  # noqa: E731
                                               out=out)
        for _ in range(20):
            call()
        t = time.perf_counter()
        for _ in range(args.calls):
            call()
        us = (time.perf_counter() - t) / args.calls * 1e6
        print(f"{heads}/{kv_heads} d{d} {context} x {bsz}: {us:.1f} µs a call (launches stubbed)")


if __name__ == "__main__":
    main()
