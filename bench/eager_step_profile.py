"""Host time of one eager decode step through OscarCache (cProfile over steps), Qwen3-8B shapes with few
layers (the per-layer cost is what grows with depth). For a GPU image with transformers:
    PYTHONPATH=. python3 bench/eager_step_profile.py [layers] [context] [batch] [token|channel]
"""

import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from serve import make_cache, qwen3_model, random_bundle  # noqa: E402

from oscar_core.decode_graph import GreedyDecoder  # noqa: E402


def main():
    layers, context, batch = (int(x) for x in (sys.argv[1:4] if len(sys.argv) > 3 else (4, 32768, 8)))
    axis = sys.argv[4] if len(sys.argv) > 4 else "token"
    model = qwen3_model(layers)
    bundle = random_bundle(layers, key_axis=axis)
    cache = make_cache("int2-eager", model, bundle, batch, context, 64)
    ids = torch.full((batch, 1), 11, dtype=torch.long, device="cuda")
    with GreedyDecoder(model, cache, ids, max_new_tokens=60) as dec:
        for _ in range(4):
            dec.step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            dec.step()
        torch.cuda.synchronize()
        print(f"{layers} layers {context}x{batch} {axis}: {(time.perf_counter() - t) / 20 * 1e3:.2f} ms a step")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            dec.step()
        prof.disable()
        torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
