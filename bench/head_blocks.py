"""How many query heads one program of the reduce (decode.reduce_heads) or of the query rotation (decode.rotate_heads)
takes: every arm's whole call as a CUDA-graph replay (bench/kernel.py graph_bench, L2 cleared before each), best of 3
interleaved rounds, that launch's own device time (torch.profiler, eager, graph=False), and each arm's error against
the float32 reference, on shapes.py's random stores with every sequence at the full context.

    PYTHONPATH=. python3 bench/head_blocks.py reduce > bench/results/reduce_heads_h200.txt
    PYTHONPATH=. python3 bench/head_blocks.py rotate > bench/results/rotate_heads_h200.txt

Arms: all of a KV head's heads in one program (HB = _pow2(HG), what decode did before), then 8, 4, 2 (those below
it); * marks the rule's choice.
"""
import sys

import torch

sys.path.insert(0, "bench")
import shapes  # noqa: E402
from kernel import graph_bench, kernel_times  # noqa: E402

from oscar_core import kvstore  # noqa: E402
from oscar_core.triton import decode  # noqa: E402

GQA16, GQA8, GQA7 = "GQA 16 32/2 d128", "Qwen3-32B 64/8 d128 (GQA 8)", "Qwen2.5-7B 28/4 d128 (GQA 7), keys per channel"
QWEN05, SMOL, QWEN8 = ("Qwen2.5-0.5B 14/2 d64, keys per channel", "SmolLM2-135M 9/3 d64, keys per channel",
                       "Qwen3-8B 32/8 d128")
POINTS = {
    "reduce": [(GQA16, 8192, 1), (GQA16, 16384, 1), (GQA16, 100_000, 1), (GQA16, 100_000, 8), (GQA8, 8192, 1),
               (GQA8, 100_000, 1), (GQA8, 100_000, 8), (GQA7, 8192, 1), (GQA7, 100_000, 1), (QWEN05, 8192, 1),
               (QWEN05, 100_000, 1), (QWEN05, 100_000, 8), (SMOL, 8192, 1), (SMOL, 100_000, 8), (QWEN8, 100_000, 1),
               (QWEN8, 100_000, 8), ("Gemma-3-12B 16/8 d256", 100_000, 1)],
    "rotate": [(GQA16, 8192, 1), (GQA16, 8192, 8), (GQA16, 32768, 32), (GQA8, 8192, 1), (GQA8, 8192, 8),
               (GQA8, 32768, 32), (GQA7, 8192, 1), (QWEN05, 8192, 1), (QWEN05, 8192, 32), (QWEN8, 8192, 1),
               (QWEN8, 32768, 32)],
}


def main():
    part = sys.argv[1] if len(sys.argv) > 1 else "reduce"
    rule_name = f"{part}_heads"
    rule = getattr(decode, rule_name)
    gen = torch.Generator("cuda").manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}; decode.{rule_name}; µs: whole call (graph) / "
          f"the {part} launch alone (profiler) / error against the reference, per heads a program; (grid) the launch's")
    for label, context, bsz in POINTS[part]:
        shape = next(s for s in shapes.SHAPES if s[0] == label)
        _, heads, kv_heads, d, gk, gv, axis = shape
        layer, q, out = shapes.timing_inputs(shape, bsz, gen)
        cache = shapes.random_store(bsz, kv_heads, d, context, gk, gv, axis, gen)
        ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation,
                                                 layer.value_mean, d ** -0.5)
        hg = heads // kv_heads
        hgp = decode._pow2(hg)
        arms = [hgp] + [hb for hb in (8, 4, 2) if hb < hgp]
        best, alone, err = {}, {}, {}
        for _ in range(3):
            for hb in arms:
                setattr(decode, rule_name, lambda *args, hb=hb: hb)
                decode._PLANS.clear()
                call = lambda: decode.decode_attention(q, cache, layer.key_rotation, layer.value_rotation,  # noqa
                                                       layer.value_mean, d ** -0.5, max_length=context, out=out,
                                                       graph=False)
                call()
                err[hb] = shapes.rel_err(out, ref)
                best[hb] = min(best.get(hb, 9e9), graph_bench(call) * 1e3)
                launch = sum(v for k, v in kernel_times(call, 20).items() if f"_{part}" in k) * 1e3
                alone[hb] = min(alone.get(hb, 9e9), launch)
        setattr(decode, rule_name, rule)
        decode._PLANS.clear()
        if part == "reduce":
            programs = decode.launch_plan(q, cache, max_length=context).reduce_grid[:2]
            chosen = rule(hg, programs[0] * programs[1])
        else:
            programs = (bsz * kv_heads, d // 16)
            chosen = rule(hg)
        cells = "  ".join(f"{hb}{'*' if hb == chosen else ''}: {best[hb]:.1f} / {alone[hb]:.1f} / {err[hb]:.1e} "
                          f"{programs + (hgp // hb,)}" for hb in arms)
        print(f"{label} {context} x {bsz}: {cells}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
