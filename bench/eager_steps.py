"""Eager decode steps one by one at serving shapes: each step's wall time and the CUDA graphs it captured, then
torch.profiler over a few steady steps (eager_generate.profile_summary: the device's busy time a step against the
step's, the top kernels, the host's runtime calls). The model and caches are bench/serve.py's (random weights of
Qwen3-8B's shapes, 36 layers; caches filled with random post-RoPE keys and values by their real write paths), the
steps decode_graph.GreedyDecoder's eager steps (OscarCache inside oscar_attention: each layer's write and read one
graph replay, decode.decode_step). It says whether an eager step waits on the host or on the device, and whether
its graphs are captured once or again and again.

    PYTHONPATH=. python3 bench/eager_steps.py --points 32768x8,102400x4,32768x1 > bench/results/eager_steps_h200.txt
"""

import argparse
import sys
import time

import torch

sys.path.insert(0, "bench")
import serve  # noqa: E402
from eager_generate import counted_captures, profile_summary  # noqa: E402

from oscar_core.decode_graph import GreedyDecoder  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="Qwen3-8B", choices=sorted(serve.SHAPES))
    p.add_argument("--points", default="32768x8,102400x4,32768x1")
    p.add_argument("--arms", default="int2-eager,bf16-dynamic")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--profile-steps", type=int, default=8)
    args = p.parse_args()
    from torch.profiler import ProfilerActivity, profile

    layers = serve.SHAPES[args.model]["layers"]
    model = serve.qwen3_model(layers, args.model)
    bundle = serve.random_bundle(layers, serve.kv_heads(args.model), serve.head_dim(args.model),
                                 heads=serve.SHAPES[args.model]["num_attention_heads"])
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}; {args.model} shapes, {layers} layers",
          flush=True)
    captures = counted_captures()
    for point in args.points.split(","):
        context, batch = map(int, point.split("x"))
        for arm in args.arms.split(","):
            cache = serve.make_cache(arm, model, bundle, batch, context, args.steps + args.profile_steps + 8)
            ids = torch.full((batch, 1), 11, dtype=torch.long, device="cuda")
            with GreedyDecoder(model, cache, ids, max_new_tokens=args.steps + args.profile_steps + 4) as dec:
                rows = []
                for _ in range(args.steps):
                    captures[0] = 0
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    dec.step()
                    torch.cuda.synchronize()
                    rows.append(((time.perf_counter() - t) * 1e3, captures[0]))
                steady = sorted(ms for ms, _ in rows[2:])
                on = ", ".join(str(i + 1) for i, (_, c) in enumerate(rows) if c) or "none"
                print(f"## {context} x {batch} {arm}: steps after the second, ms: median "
                      f"{steady[len(steady) // 2]:.1f}, min {steady[0]:.1f}, max {steady[-1]:.1f}; graphs captured "
                      f"{sum(c for _, c in rows)} (on steps {on})", flush=True)
                print("  each step, ms (graphs captured): " + " ".join(f"{ms:.1f}({c})" for ms, c in rows))
                prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                torch.cuda.synchronize()
                t = time.perf_counter()
                prof.start()
                for _ in range(args.profile_steps):
                    dec.step()
                torch.cuda.synchronize()
                prof.stop()
                seconds = time.perf_counter() - t
            print(f"### {context} x {batch} {arm}: torch.profiler of {args.profile_steps} steps", flush=True)
            print(profile_summary(prof, args.profile_steps, seconds, top=8), flush=True)
            del cache, dec, prof
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
