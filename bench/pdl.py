"""Benchmark: decode attention with programmatic dependent launch (decode_attention's pdl) against without, in one
process.

With pdl each launch after the query rotation is a programmatic dependent of the one before: its programs are
launched while that one's last programs still run (the rotation lets them launch at its start) and wait in
griddepcontrol.wait before they read its output. What it can save is the gap between dependent launches, which
counts most where a call is short: batch 1, 8K-32K tokens (decode_attention's default: on at 8 pairs or fewer).

For each point:
1. outputs: a ragged random store, decode_attention with pdl off and on, as a graph replay and as a direct call:
   bit-identical expected, and within 1e-2 of kvstore.decode_attention_reference;
2. time: CUDA-graph replay (bench/kernel.py graph_bench, L2 cleared before each) and eager (decode_attention's
   default for a plain caller: a replay of its own graph, wall clock per call of 100 calls), best of 3 interleaved
   rounds, SDPA over the same shape beside them.
Imports only torch, triton and oscar_core's torch-only modules, so it runs on a bare GPU image:
    PYTHONPATH=. python3 bench/pdl.py --out bench/results/pdl.md
"""

import argparse
import datetime
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
import shapes  # noqa: E402
from kernel import graph_bench  # noqa: E402

from oscar_core import kvstore  # noqa: E402
from oscar_core.triton import decode  # noqa: E402

# The shape classes timed unless --only says otherwise: one a program family (4 heads with keys per token and per
# channel, 8 heads, head_dim 64, head_dim 256 at one KV head, which runs the Triton programs at batch 1).
DEFAULT = ["Qwen3-8B 32/8 d128", "Qwen3-8B 32/8 d128, keys per channel", "Qwen3-32B 64/8 d128 (GQA 8)",
           "Llama-3.2-1B 32/8 d64", "Gemma-3-270M 4/1 d256"]
QWEN3_8B = [(8192, 1), (16384, 1), (32768, 1), (100_000, 1), (16384, 8), (32768, 8), (100_000, 8), (100_000, 32)]
OTHERS = [(16384, 1), (100_000, 1), (100_000, 8)]


def same_outputs(shape, gen) -> str:
    """'equal' when pdl off and on give the same bits over one ragged store, as a graph and as a direct call."""
    _, heads, kv_heads, d, gk, gv, axis = shape
    layer = shapes.layer_of(kv_heads, d, gen)
    cache = shapes.random_store(len(shapes.RAGGED), kv_heads, d, max(shapes.RAGGED), gk, gv, axis, gen)
    cache.lengths.copy_(torch.tensor(shapes.RAGGED))
    q = torch.randn(len(shapes.RAGGED), heads, d, generator=gen, device="cuda").bfloat16()
    args = (q, cache, layer.key_rotation, layer.value_rotation, layer.value_mean, d ** -0.5)
    outs = {(pdl, graph): decode.decode_attention(*args, pdl=pdl, graph=graph)
            for pdl in (False, True) for graph in (False, True) for _ in range(2)}   # the second call replays
    ref = kvstore.decode_attention_reference(*args)
    err = shapes.rel_err(outs[True, True], ref)
    base = outs[False, False]
    if not all(torch.equal(base, o) for o in outs.values()):
        return f"differ, err {err:.1e}"
    return shapes.equal_verdict(err)


def times(shape, context, bsz, gen, rounds: int = 3) -> dict:
    """Best graph replay and eager call of decode_attention with pdl off and on, and of SDPA, in ms."""
    _, heads, kv_heads, d, gk, gv, axis = shape
    layer, q, out = shapes.timing_inputs(shape, bsz, gen)
    cache = shapes.random_store(bsz, kv_heads, d, context, gk, gv, axis, gen)

    def call(pdl, graph):
        return lambda: decode.decode_attention(q, cache, layer.key_rotation, layer.value_rotation, layer.value_mean,
                                               d ** -0.5, max_length=context, out=out, pdl=pdl, graph=graph)

    fns = {f"{mode} {'pdl' if pdl else 'off'}": (graph_bench, call(pdl, False)) if mode == "graph"
           else (shapes.eager_ms, call(pdl, None)) for mode in ("graph", "eager") for pdl in (False, True)}
    fns["graph sdpa"] = (graph_bench, shapes.sdpa_call(q, kv_heads, context, gen))
    ms = {name: [] for name in fns}
    for _ in range(rounds):
        for name, (bench, fn) in fns.items():
            ms[name].append(bench(fn))
    return {name: min(v) for name, v in ms.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/pdl.md")
    ap.add_argument("--only", help="shape labels containing any of these texts (separated by ;)")
    ap.add_argument("--value-layout", default=kvstore.DEFAULT_VALUE_LAYOUT, choices=kvstore.VALUE_LAYOUTS)
    args = ap.parse_args()
    shapes.VALUE_LAYOUT[0] = args.value_layout
    gen = torch.Generator("cuda").manual_seed(0)
    chosen = [s for s in shapes.SHAPES if (any(p in s[0] for p in args.only.split(";")) if args.only
                                           else s[0] in DEFAULT)]
    points = [(s, c, b) for s in chosen for c, b in (QWEN3_8B if s is shapes.SHAPES[0] else OTHERS)]
    props = torch.cuda.get_device_properties(0)
    lines = ["# Programmatic dependent launch in decode attention, off against on (bench/pdl.py)", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; GPU: {props.name}; torch "
             f"{torch.__version__}, triton {triton.__version__}; value codes in {args.value_layout}",
             "- outputs: a ragged random store, pdl off and on, graph and direct calls (bit-identical expected); err: "
             "against kvstore.decode_attention_reference",
             "- time: best of 3 interleaved rounds; graph: CUDA-graph replay (L2 cleared before each); eager: a plain "
             "caller's decode_attention (a replay of its own graph), wall clock per call of 100; x SDPA: graph SDPA "
             "over the same shape / INT2 graph", ""]

    def row(t):
        return (f"{t['graph off']:.4f} | {t['graph pdl']:.4f} | {(t['graph off'] / t['graph pdl'] - 1) * 100:+.1f}% | "
                f"{t['graph sdpa'] / t['graph off']:.2f}x / {t['graph sdpa'] / t['graph pdl']:.2f}x | "
                f"{t['eager off']:.4f} | {t['eager pdl']:.4f} | {(t['eager off'] / t['eager pdl'] - 1) * 100:+.1f}%")

    shapes.write_ab(args.out, lines, chosen, points, gen, same_outputs, times,
                    "| shape | context x batch | graph off | graph pdl | gain | x SDPA off / pdl | eager off | eager pdl "
                    "| gain |", row)


if __name__ == "__main__":
    main()
