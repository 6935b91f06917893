"""How many query heads one reduce program merges (decode.reduce_heads): every arm's whole call as a CUDA-graph
replay (bench/kernel.py graph_bench, L2 cleared before each), best of 3 interleaved rounds, the reduce's own device
time (torch.profiler, eager, graph=False), and each arm's error against the float32 reference, on shapes.py's random
stores with every sequence at the full context.

    PYTHONPATH=. python3 bench/reduce_heads.py > bench/results/reduce_heads_h200.txt

Arms: all of a KV head's heads in one program (HB = _pow2(HG), what decode did before reduce_heads), then 8, 4, 2
(those below it); * marks decode.reduce_heads' choice.
"""
import sys

import torch

sys.path.insert(0, "bench")
import shapes  # noqa: E402
from kernel import graph_bench, kernel_times  # noqa: E402

from oscar_core import kvstore  # noqa: E402
from oscar_core.triton import decode  # noqa: E402

POINTS = [("GQA 16 32/2 d128", 8192, 1), ("GQA 16 32/2 d128", 16384, 1), ("GQA 16 32/2 d128", 100_000, 1),
          ("GQA 16 32/2 d128", 100_000, 8), ("Qwen3-32B 64/8 d128 (GQA 8)", 8192, 1),
          ("Qwen3-32B 64/8 d128 (GQA 8)", 100_000, 1), ("Qwen3-32B 64/8 d128 (GQA 8)", 100_000, 8),
          ("Qwen2.5-7B 28/4 d128 (GQA 7), keys per channel", 8192, 1),
          ("Qwen2.5-7B 28/4 d128 (GQA 7), keys per channel", 100_000, 1),
          ("Qwen2.5-0.5B 14/2 d64, keys per channel", 8192, 1), ("Qwen2.5-0.5B 14/2 d64, keys per channel", 100_000, 1),
          ("Qwen2.5-0.5B 14/2 d64, keys per channel", 100_000, 8), ("SmolLM2-135M 9/3 d64, keys per channel", 8192, 1),
          ("SmolLM2-135M 9/3 d64, keys per channel", 100_000, 8), ("Qwen3-8B 32/8 d128", 100_000, 1),
          ("Qwen3-8B 32/8 d128", 100_000, 8), ("Gemma-3-12B 16/8 d256", 100_000, 1)]
RULE = decode.reduce_heads


def reduce_us(call) -> float:
    return sum(v for k, v in kernel_times(call, 20).items() if "_reduce" in k) * 1e3


def main():
    gen = torch.Generator("cuda").manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}; µs: whole call (graph) / reduce alone "
          "(profiler) / error against the reference, per heads a reduce program; (grid) the reduce's")
    for label, context, bsz in POINTS:
        shape = next(s for s in shapes.SHAPES if s[0] == label)
        _, heads, kv_heads, d, gk, gv, axis = shape
        layer, q, out = shapes.timing_inputs(shape, bsz, gen)
        cache = shapes.random_store(bsz, kv_heads, d, context, gk, gv, axis, gen)
        ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation,
                                                 layer.value_mean, d ** -0.5)
        hgp = decode._pow2(heads // kv_heads)
        arms = [hgp] + [hb for hb in (8, 4, 2) if hb < hgp]
        best, red, err, grid = {}, {}, {}, {}
        for _ in range(3):
            for hb in arms:
                decode.reduce_heads = lambda hg, programs, hb=hb: hb
                decode._PLANS.clear()
                call = lambda: decode.decode_attention(q, cache, layer.key_rotation, layer.value_rotation,  # noqa
                                                       layer.value_mean, d ** -0.5, max_length=context, out=out,
                                                       graph=False)
                call()
                err[hb] = shapes.rel_err(out, ref)
                grid[hb] = decode.launch_plan(q, cache, max_length=context).reduce_grid
                best[hb] = min(best.get(hb, 9e9), graph_bench(call) * 1e3)
                red[hb] = min(red.get(hb, 9e9), reduce_us(call))
        decode.reduce_heads = RULE
        decode._PLANS.clear()
        rule = RULE(heads // kv_heads, grid[hgp][0] * grid[hgp][1])
        cells = "  ".join(f"{hb}{'*' if hb == rule else ''}: {best[hb]:.1f} / {red[hb]:.1f} / {err[hb]:.1e} "
                          f"{grid[hb]}" for hb in arms)
        print(f"{label} {context} x {bsz}: {cells}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
