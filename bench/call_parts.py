"""Benchmark: what each launch of a decode call adds to its time, for the shape classes of bench/shapes.py.

decode_attention launches the query rotation, the window programs (BF16 sink + recent tokens), the INT2 programs
(Gluon) and the reduce. Each is left out in turn (its launch replaced by nothing; the outputs are then wrong, and
only the times are kept) and the call timed as a CUDA-graph replay (bench/kernel.py graph_bench, L2 cleared
before each, about 4.8 µs of the bench's own in every figure), best of 3 interleaved rounds; then the INT2
programs alone. The byte floor is shapes.py's (the store's bytes plus q and out over the copy bandwidth).
    PYTHONPATH=. python3 bench/call_parts.py --out bench/results/call_parts.md
"""

import argparse
import datetime
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
import shapes  # noqa: E402
from kernel import copy_bandwidth, graph_bench  # noqa: E402

from oscar_core.triton import decode  # noqa: E402

POINTS = {  # label part (shapes.SHAPES) -> context x batch points
    "Qwen3-8B 32/8 d128": [(102400, 1), (32768, 8), (102400, 8), (102400, 32)],
    "(GQA 7), keys per channel": [(102400, 8)],
    "Qwen3-32B 64/8 d128 (GQA 8), keys per channel": [(102400, 8)],
    "GQA 16": [(102400, 8)],
    "Qwen2.5-0.5B": [(16384, 8), (102400, 8)],
    "SmolLM2": [(102400, 8)],
    "Gemma-3-270M": [(102400, 8)],
}
VARIANTS = {  # name -> the launches left out
    "whole": (), "no windows": ("_split_kernel",), "no reduce": ("_reduce_kernel",), "no rotation": ("rotation",),
    "INT2 alone": ("_split_kernel", "_reduce_kernel", "rotation"),
}
LEFT_OUT: set = set()


def _launch(fn, _orig=decode._launch):
    kernel = _orig(fn)
    name = getattr(fn, "__name__", "") or getattr(getattr(fn, "fn", None), "__name__", "")
    return (lambda *a, **k: None) if name in LEFT_OUT else kernel


def _rotation(q, key_rotation, pdl=False, _orig=decode.rotate_query_bf16):
    return q.contiguous() if "rotation" in LEFT_OUT else _orig(q, key_rotation, pdl)


def time_point(shape, context, bsz, bandwidth, gen) -> dict:
    label, _, kv_heads, d, gk, gv, axis = shape
    layer, q, out = shapes.timing_inputs(shape, bsz, gen)
    cache = shapes.random_store(bsz, kv_heads, d, context, gk, gv, axis, gen)
    plan = decode.launch_plan(q, cache, max_length=context)
    call = lambda: decode.decode_attention(q, cache, layer.key_rotation, layer.value_rotation,  # noqa: E731
                                           layer.value_mean, d ** -0.5, max_length=context, out=out, graph=False)
    best = {}
    for _ in range(3):
        for name, left_out in VARIANTS.items():
            LEFT_OUT.clear()
            LEFT_OUT.update(left_out)
            best[name] = min(best.get(name, float("inf")), graph_bench(call))
    LEFT_OUT.clear()
    return dict(shape=label, context=context, batch=bsz, gluon=plan.gluon, int2_grid=list(plan.gluon_grid),
                window_grid=list(plan.split_grid), reduce_grid=list(plan.reduce_grid),
                floor=shapes.floor_bytes(shape, context, bsz) / bandwidth * 1e3, **best)


def render(rows, bandwidth) -> str:
    props = torch.cuda.get_device_properties(0)
    names = list(VARIANTS)
    lines = [
        "# What each launch of a decode call adds (bench/call_parts.py)", "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; GPU: {props.name}; torch "
        f"{torch.__version__}, triton {triton.__version__}; copy bandwidth (read + write) {bandwidth / 1e12:.2f} TB/s",
        "- µs, CUDA-graph replays (L2 cleared before each, about 4.8 µs of the bench's own in each), best of 3 "
        "interleaved; a launch left out is replaced by nothing (the outputs are then wrong); shapes.py's random stores,"
        " every sequence at the full context, R_V and μ_V applied by the reduce (the default)",
        "- of floor: the byte floor over the INT2 programs alone", "",
        "| shape | context x batch | INT2 grid | " + " | ".join(names) + " | floor | of floor, INT2 alone |",
        "|---|---|---|" + "---|" * (len(names) + 2)]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['context']} x {r['batch']} | {tuple(r['int2_grid'])} | "
                     + " | ".join(f"{r[n] * 1e3:.1f}" for n in names)
                     + f" | {r['floor'] * 1e3:.1f} | {r['floor'] / r['INT2 alone']:.0%} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/call_parts.md")
    args = ap.parse_args()
    decode._launch = _launch
    decode.rotate_query_bf16 = _rotation
    gen = torch.Generator("cuda").manual_seed(0)
    bandwidth = copy_bandwidth()
    rows = []
    for part, points in POINTS.items():
        shape = next(s for s in shapes.SHAPES if part in s[0])
        for context, bsz in points:
            rows.append(time_point(shape, context, bsz, bandwidth, gen))
            torch.cuda.empty_cache()
            print(json.dumps(rows[-1]), flush=True)
            with open(args.out, "w") as f:
                f.write(render(rows, bandwidth))
            with open(args.out.replace(".md", ".json"), "w") as f:
                json.dump(rows, f, indent=1)
    print(render(rows, bandwidth))


if __name__ == "__main__":
    main()
