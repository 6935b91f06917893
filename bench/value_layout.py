"""Benchmark: the value codes in 64-row tiles (kvstore's value_layout "tiles") against rows, decode attention on
every shape class, CUDA-graph replay, in one process.

For each shape class of bench/shapes.py at 100K x 8 (and the Qwen3-8B points of the issue's targets):
1. the two layouts hold the same codes (a ragged batch prefilled into each by the Triton write kernel, write.prefill_kv,
   as OscarCache writes on CUDA): the value codes row by row and decode_attention's outputs over the two stores must be
   bit-identical, and the outputs within 1e-2 of the reference;
2. time: a store of random codes (the time does not depend on them) in each layout, decode_attention as a graph
   replay (bench/kernel.py graph_bench, L2 cleared before each), best of 3 interleaved rounds.
Imports only torch, triton and oscar_core's torch-only modules, so it runs on a bare GPU image:
    PYTHONPATH=. python3 bench/value_layout.py --out bench/results/value_layout.md
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
from oscar_core.triton import decode, write  # noqa: E402

QWEN3_8B_POINTS = [(100_000, 32), (100_000, 1), (32768, 8), (16384, 8), (16384, 1)]


def same_outputs(shape, gen) -> str:
    """'equal' when both layouts of one prefilled store hold the same value codes row by row and decode_attention
    gives the same bits over them, else what differs."""
    _, heads, kv_heads, d, gk, gv, axis = shape
    layer = shapes.layer_of(kv_heads, d, gen)
    bsz, longest = len(shapes.RAGGED), max(shapes.RAGGED)
    # Left-padded [B, H_kv, n, d]: sequence b's tokens are the last RAGGED[b].
    keys = (torch.randn(bsz, kv_heads, longest, d, generator=gen, device="cuda") + layer.key_mean[:, None]).bfloat16()
    values = (torch.randn(bsz, kv_heads, longest, d, generator=gen, device="cuda")
              + layer.value_mean[:, None]).bfloat16()
    q = torch.randn(bsz, heads, d, generator=gen, device="cuda").bfloat16()
    splits = (write.prepare_rotation(layer.key_rotation, layer.key_mean),
              write.prepare_rotation(layer.value_rotation, layer.value_mean))
    stores, outs = [], []
    for layout in kvstore.VALUE_LAYOUTS:
        cache = kvstore.empty_cache(bsz, kv_heads, d, longest, gk, gv, device="cuda", key_axis=axis,
                                    value_layout=layout)
        cache.lengths.copy_(torch.tensor(shapes.RAGGED))
        write.prefill_kv(cache, keys, values, *splits, layer.key_clip, layer.value_clip)
        stores.append(cache)
        outs.append(decode.decode_attention(q, cache, layer.key_rotation, layer.value_rotation, layer.value_mean,
                                            d ** -0.5))
    rows = torch.arange(cache.value_codes.shape[2], device="cuda")
    if not all(torch.equal(kvstore.value_rows(stores[1], b, rows), stores[0].value_codes[b]) for b in range(bsz)):
        return "value codes differ"
    ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation, layer.value_mean,
                                             d ** -0.5)
    err = shapes.rel_err(outs[1], ref)
    if not torch.equal(outs[0], outs[1]):
        return f"differ ({shapes.rel_err(outs[1], outs[0].float()):.1e}), err {err:.1e}"
    return shapes.equal_verdict(err)


def times(shape, context, bsz, gen, rounds: int = 3) -> dict:
    """Best graph replay of decode_attention over a random store of each layout, ms."""
    _, heads, kv_heads, d, gk, gv, axis = shape
    layer, q, out = shapes.timing_inputs(shape, bsz, gen)
    best = {}
    for layout in kvstore.VALUE_LAYOUTS:
        shapes.VALUE_LAYOUT[0] = layout
        cache = shapes.random_store(bsz, kv_heads, d, context, gk, gv, axis, gen)
        fn = (lambda c: lambda: decode.decode_attention(q, c, layer.key_rotation, layer.value_rotation,
                                                        layer.value_mean, d ** -0.5, max_length=context, out=out))(cache)
        best[layout] = (fn, [])
    for _ in range(rounds):
        for layout, (fn, ms) in best.items():
            ms.append(graph_bench(fn))
    shapes.VALUE_LAYOUT[0] = "rows"
    return {layout: min(ms) for layout, (_, ms) in best.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/value_layout.md")
    ap.add_argument("--only", help="shape labels containing any of these texts (separated by ;)")
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    chosen = [s for s in shapes.SHAPES if not args.only or any(p in s[0] for p in args.only.split(";"))]
    points = [(s, 100_000, 8) for s in chosen]
    points += [(shapes.SHAPES[0], c, b) for c, b in QWEN3_8B_POINTS if shapes.SHAPES[0] in chosen]
    props = torch.cuda.get_device_properties(0)
    lines = ["# Value codes in 64-row tiles against rows (bench/value_layout.py)", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; GPU: {props.name}; torch "
             f"{torch.__version__}, triton {triton.__version__}",
             "- outputs: one ragged batch prefilled into each layout by write.prefill_kv, its value codes row by row and "
             "decode_attention over it (bit-identical expected), err: tiles against kvstore.decode_attention_reference; "
             "time: graph replay, best of 3 interleaved rounds, random stores", ""]
    shapes.write_ab(args.out, lines, chosen, points, gen, same_outputs, times,
                    "| shape | context x batch | rows ms | tiles ms | gain |",
                    lambda t: f"{t['rows']:.4f} | {t['tiles']:.4f} | {(t['rows'] / t['tiles'] - 1) * 100:+.1f}%")


if __name__ == "__main__":
    main()
