"""Where an eager decode_attention call spends its time: host (cProfile over back-to-back calls) and device
(torch.profiler per kernel), at a shape given on the command line. For a bare GPU image:
    PYTHONPATH=. python3 bench/eager_profile.py 32 8 128 16384 1 [token|channel]
"""

import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from shapes import layer_of, random_store  # noqa: E402
from oscar_core.triton import decode  # noqa: E402


def main():
    heads, kv_heads, d, context, bsz = (int(x) for x in sys.argv[1:6])
    axis = sys.argv[6] if len(sys.argv) > 6 else "token"
    gen = torch.Generator("cuda").manual_seed(0)
    layer = layer_of(kv_heads, d, gen)
    cache = random_store(bsz, kv_heads, d, context, 64, 64, axis, gen)
    q = torch.randn(bsz, heads, d, generator=gen, device="cuda").bfloat16()

    def call():
        return decode.decode_attention(q, cache, layer.key_rotation, layer.value_rotation, layer.value_mean,
                                       d ** -0.5, max_length=context)

    for _ in range(10):
        call()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(300):
        call()
    host = (time.perf_counter() - t) / 300 * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / 300 * 1e3
    print(f"{heads}/{kv_heads} d{d} {context}x{bsz} {axis}: host {host:.4f} ms a call (enqueue), wall {wall:.4f} ms")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        call()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(20):
            call()
        torch.cuda.synchronize()
    for e in p.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.count:
            print(f"  device {e.key[:60]:60s} {e.device_time_total / 20 / 1e3:.4f} ms a call")


if __name__ == "__main__":
    main()
