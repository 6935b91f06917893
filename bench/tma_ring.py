"""The Gluon programs reading their tiles through the TMA ring (decode.tma_stages) against loads into registers, on
Qwen3-8B's attention shape (32/8 heads, d 128, groups of 64, keys per token, value codes in tiles): CUDA-graph
replays (kernel.graph_bench: L2 cleared, ~4.8 µs of its own), best of 3 interleaved rounds, every sequence at the
full context or a ragged batch (lengths drawn from [context/2, context]); outputs compared bit for bit.

    PYTHONPATH=. python3 bench/tma_ring.py > bench/results/tma_ring.md
"""
import sys

import torch

sys.path.insert(0, "bench")
from kernel import graph_bench  # noqa: E402
import shapes  # noqa: E402

from oscar_core.triton import decode  # noqa: E402

POINTS = [(100_000, 32, False), (100_000, 32, True), (100_000, 24, False), (100_000, 16, False), (100_000, 8, False),
          (32_768, 32, False), (32_768, 16, False), (32_768, 8, False), (100_000, 1, False)]
RULE = decode.tma_stages


def call_args(heads, kv_heads, context, batch, gen, ragged=False, axis="token", d=128):
    """decode_attention's leading arguments over a random store (head_dim 128 unless given) with groups (keys per
    channel: blocks) of 64 (shapes.random_store), every sequence at the full context or, ragged, at lengths drawn from
    [context/2, context]."""
    layer = shapes.layer_of(kv_heads, d, gen)
    cache = shapes.random_store(batch, kv_heads, d, context, 64, 64, axis, gen)
    if ragged:
        cache.lengths.copy_(torch.randint(context // 2, context + 1, (batch,), generator=gen, device="cuda"))
    q = torch.randn(batch, heads, d, generator=gen, device="cuda").bfloat16()
    return q, cache, layer.key_rotation, layer.value_rotation, layer.value_mean, d ** -0.5


def race(args, context, arms):
    """Best graph time (ms) and output of each arm, name -> (decode_attention's flat, the ring's stages), 3 rounds
    interleaved; the rule restored after."""
    best, outs = {}, {}
    for _ in range(3):
        for name, (flat, stages) in arms.items():
            decode.tma_stages = lambda major, consts, pairs, rows, stages=stages: stages
            decode._PLANS.clear()
            fn = lambda: decode.decode_attention(*args, max_length=context, graph=False, flat=flat)  # noqa: E731
            outs[name] = fn()
            best[name] = min(best.get(name, 9), graph_bench(fn))
    decode.tma_stages = RULE
    decode._PLANS.clear()
    return best, outs


def raced(points, arms, gen):
    """For each point (heads, KV heads, context, batch, ragged[, key axis[, head_dim]]): its call's arguments, and
    race's best times and outputs over arms; each point's store freed before the next is built."""
    for heads, kv_heads, context, batch, ragged, *rest in points:
        args = call_args(heads, kv_heads, context, batch, gen, ragged, *rest)
        yield args, *race(args, context, arms)
        del args
        torch.cuda.empty_cache()


def main():
    gen = torch.Generator("cuda").manual_seed(0)
    print("# INT2 decode through the TMA ring against loads into registers (bench/tma_ring.py)\n")
    print(f"- {torch.cuda.get_device_name()}, torch {torch.__version__}; Qwen3-8B's shape, keys per token, groups of "
          "64, value codes in tiles; graph replays, best of 3 interleaved (µs)")
    print("- rule: decode.tma_stages for this call (0: loads into registers)\n")
    print("| context x batch | lengths | loads | TMA 2 stages | TMA / loads | rule | outputs |")
    print("|---|---|---|---|---|---|---|")
    points = [(32, 8, context, batch, ragged) for context, batch, ragged in POINTS]
    for (context, batch, ragged), (args, best, outs) in zip(POINTS, raced(points, {0: (None, 0), 2: (None, 2)}, gen)):
        rule = decode.launch_plan(args[0], args[1], max_length=context).gluon_consts.get("TMA", 0)
        same = "equal" if torch.equal(outs[0], outs[2]) else "differ"
        print(f"| {context} x {batch} | {'ragged' if ragged else 'full'} | {best[0] * 1e3:.1f} | {best[2] * 1e3:.1f} | "
              f"{best[2] / best[0]:.3f} | {rule} | {same} |", flush=True)
        del args, outs
    flat_rows(gen)


def flat_rows(gen):
    """Where whole splits leave the wave idle, flat rows (decode.flat_splits), which the ring does not serve, against
    whole splits with loads and through the ring (before the ring, the rule took flat rows at all three)."""
    print("\n## Flat rows against whole splits through the ring\n")
    print("| context x batch | flat rows, loads | whole splits, loads | whole splits, ring | outputs (ring vs "
          "whole loads) |")
    print("|---|---|---|---|---|")
    sizes = ((100_000, 30), (32_768, 30), (100_000, 55))
    arms = {"flat": (None, 0), "whole": (False, 0), "ring": (False, 2)}
    for (context, batch), (args, best, outs) in zip(sizes, raced([(32, 8, c, b, False) for c, b in sizes], arms, gen)):
        same = "equal" if torch.equal(outs["whole"], outs["ring"]) else "differ"
        print(f"| {context} x {batch} | {best['flat'] * 1e3:.1f} | {best['whole'] * 1e3:.1f} | "
              f"{best['ring'] * 1e3:.1f} | {same} |", flush=True)
        del args, outs


if __name__ == "__main__":
    main()
