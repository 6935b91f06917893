"""Benchmark: INT2 decode attention on every shape class against bf16 SDPA, eager and CUDA graph.

For each shape class (GQA 1-16, head_dim 64/128/256, groups 64/128, keys per token and per channel):
1. error against kvstore.decode_attention_reference on a ragged batch (lengths 7 .. 12,345, real
   prefill), for the default programs and, where the Gluon programs serve, for the Triton ones and for
   Gluon programs of the other number of query heads a program (4 or 8);
2. at 16K x 1, 16K x 8 and 100K x 8 (every sequence at the full context; the store filled with random
   codes, which the time does not depend on): INT2 decode and bf16 SDPA (enable_gqa) as a CUDA-graph
   replay (median of do_bench, L2 cleared before each) and eager (wall clock of 100 back-to-back calls
   from Python, as a plain caller sees it), the byte floor (kvstore.store_nbytes plus q and out, over the
   copy bandwidth) and the share of it the graph reaches.
Imports only torch, triton and oscar_core's torch-only modules, so it runs on a bare GPU image:
    python -m bench.shapes --out bench/results/shapes.md
    python -m bench.shapes --no-errors --sizes 100000x8 --out bench/results/shapes_100k.md   # every class at 100K x 8
--value-layout tiles runs every store with its value codes in 64-row tiles (kvstore's value_layout).
"""

import argparse
import json
import sys

import torch
import triton

from bench.common import copy_bandwidth, eager_ms, graph_bench, layer_of, rel_err, utc_now
from oscar_core import kvstore
from oscar_core.triton import decode, plan

SHAPES = [  # label, query heads, KV heads, head_dim, key group (or block), value group, key axis
    ("Qwen3-8B 32/8 d128", 32, 8, 128, 64, 64, "token"),
    ("Qwen3-8B 32/8 d128, keys per channel", 32, 8, 128, 64, 64, "channel"),
    ("Qwen3-8B 32/8 d128, groups 128", 32, 8, 128, 128, 128, "token"),
    ("Qwen3-8B 32/8 d128, K blocks 128, V groups 128", 32, 8, 128, 128, 128, "channel"),
    ("MHA 32/32 d128 (GQA 1)", 32, 32, 128, 64, 64, "token"),
    ("Qwen2.5-14B 40/8 d128 (GQA 5)", 40, 8, 128, 64, 64, "token"),
    ("Qwen2.5-14B 40/8 d128 (GQA 5), keys per channel", 40, 8, 128, 64, 64, "channel"),
    ("Qwen2.5-7B 28/4 d128 (GQA 7), keys per channel", 28, 4, 128, 64, 64, "channel"),
    ("Qwen3-32B 64/8 d128 (GQA 8)", 64, 8, 128, 64, 64, "token"),
    ("Qwen3-32B 64/8 d128 (GQA 8), keys per channel", 64, 8, 128, 64, 64, "channel"),
    ("GQA 16 32/2 d128", 32, 2, 128, 64, 64, "token"),
    ("Llama-3.2-1B 32/8 d64", 32, 8, 64, 64, 64, "token"),
    ("Qwen2.5-0.5B 14/2 d64, keys per channel", 14, 2, 64, 64, 64, "channel"),
    ("SmolLM2-135M 9/3 d64, keys per channel", 9, 3, 64, 64, 64, "channel"),
    ("Gemma-3-12B 16/8 d256", 16, 8, 256, 64, 64, "token"),
    ("Gemma-3-12B 16/8 d256, keys per channel", 16, 8, 256, 64, 64, "channel"),
    ("Gemma-3-270M 4/1 d256", 4, 1, 256, 64, 64, "token"),
    ("Gemma-3-270M 4/1 d256, keys per channel", 4, 1, 256, 64, 64, "channel"),
]
SIZES = [(16384, 1), (16384, 8), (100_000, 8)]
RAGGED = [7, 700, 4097, 12345]
VALUE_LAYOUT = [kvstore.DEFAULT_VALUE_LAYOUT]     # --value-layout: every store this run builds


def sdpa_call(q, kv_heads, context, gen):
    """The BF16 baseline: torch's SDPA (enable_gqa) of q [B, H, d] over random K/V [B, H_kv, context, d], as a
    call of no arguments (its K/V live as long as it does)."""
    bsz, _, d = q.shape
    k = torch.randn(bsz, kv_heads, context, d, generator=gen, device=q.device).bfloat16()
    v = torch.randn(bsz, kv_heads, context, d, generator=gen, device=q.device).bfloat16()
    q4 = q[:, :, None]
    return lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, scale=d ** -0.5, enable_gqa=True)




def check(shape, gen) -> dict:
    """Errors of every program that serves the shape, on a ragged batch written by kvstore.prefill."""
    _, heads, kv_heads, d, gk, gv, axis = shape
    layer = layer_of(kv_heads, d, gen)
    bsz, longest = len(RAGGED), max(RAGGED)
    keys = torch.randn(bsz, longest, kv_heads, d, generator=gen, device="cuda") + layer.key_mean
    values = torch.randn(bsz, longest, kv_heads, d, generator=gen, device="cuda") + layer.value_mean
    cache = kvstore.empty_cache(bsz, kv_heads, d, longest, gk, gv, device="cuda", key_axis=axis,
                                value_layout=VALUE_LAYOUT[0])
    kvstore.prefill(cache, keys.bfloat16(), values.bfloat16(), torch.tensor(RAGGED, device="cuda"), layer)
    q = torch.randn(bsz, heads, d, generator=gen, device="cuda").bfloat16()
    variants = {"default": {}}
    if gluon_serves(q, cache):
        variants.update(gluon=dict(gluon=True), triton=dict(gluon=False))
        if heads // kv_heads > 4:
            other = other_heads_per_program(q, cache)
            variants[f"gluon, {other} heads a program"] = dict(gluon=True, heads_per_program=other)
    errs = {}
    for name, kw in variants.items():
        worst = 0.0
        for mean in (layer.value_mean, None):
            ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation, mean,
                                                     d ** -0.5)
            try:
                out = decode.decode_attention(q, cache, layer.key_rotation, layer.value_rotation, mean, d ** -0.5,
                                              decode.plan_for(q, cache, **kw))
                worst = max(worst, rel_err(out, ref))
            except Exception as e:  # a failing program is a row of the table, not the end of the run
                worst = f"{type(e).__name__}: {str(e)[:160]}"
                break
        errs[name] = worst
    return errs


def gluon_serves(q, cache) -> bool:
    """Whether the Gluon INT2 programs can take this call's INT2 rows (plan.gluon_problem)."""
    return plan.gluon_problem(decode.shape_of(q, cache), decode.device_of(q, cache)) is None


def other_heads_per_program(q, cache) -> int:
    """The query heads a Gluon program the default does not choose (4 or 8)."""
    return 4 if decode.plan_for(q, cache, gluon=True).gluon_heads == 8 else 8


def random_store(bsz, kv_heads, d, context, gk, gv, axis, gen) -> kvstore.Int2KVCache:
    """A full store of random codes: scale codes near 2^0 (128 ± 8), small zeros, unit BF16 windows."""
    cache = kvstore.empty_cache(bsz, kv_heads, d, context, gk, gv, device="cuda", key_axis=axis,
                                value_layout=VALUE_LAYOUT[0])
    for t in (cache.key_codes, cache.value_codes):
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, device="cuda", dtype=torch.uint8))
    for t in (cache.key_scale, cache.value_scale):
        t.copy_(torch.randint(120, 136, t.shape, generator=gen, device="cuda", dtype=torch.uint8))
    for t in (cache.key_zero, cache.value_zero):
        t.copy_(torch.randint(-8, 8, t.shape, generator=gen, device="cuda", dtype=torch.int8))
    for t in (cache.key_sink, cache.value_sink, cache.key_recent, cache.value_recent):
        t.copy_(torch.randn(t.shape, generator=gen, device="cuda").bfloat16())
    cache.lengths.fill_(context)
    return cache


def floor_bytes(shape, context, bsz) -> int:
    """The bytes a decode call must move at least: the full store, plus the bf16 query read and output written."""
    _, heads, kv_heads, d, gk, gv, axis = shape
    return kvstore.store_nbytes(bsz, context, kv_heads, d, gk, gv, key_axis=axis) + 2 * 2 * bsz * heads * d


def time_size(shape, context, bsz, bandwidth, gen) -> dict:
    label, heads, kv_heads, d, gk, gv, axis = shape
    layer = layer_of(kv_heads, d, gen)
    cache = random_store(bsz, kv_heads, d, context, gk, gv, axis, gen)
    q = torch.randn(bsz, heads, d, generator=gen, device="cuda").bfloat16()
    out = torch.empty_like(q)
    gluon = decode.plan_for(q, cache, context).gluon
    row = dict(shape=label, context=context, batch=bsz, program="Gluon INT2 + Triton windows" if gluon else "Triton")

    def int2(**pins):
        chosen = decode.plan_for(q, cache, context, **pins) if pins else None
        return lambda: decode.decode_attention(q, cache, layer.key_rotation, layer.value_rotation, layer.value_mean,
                                               d ** -0.5, chosen, max_length=context, out=out)

    nbytes = floor_bytes(shape, context, bsz)
    row.update(floor=nbytes / bandwidth * 1e3, int2_graph=graph_bench(int2()), int2_eager=eager_ms(int2()))
    if gluon_serves(q, cache) and heads // kv_heads > 4:
        other = other_heads_per_program(q, cache)
        row["other_heads"] = other
        row["int2_graph_other_heads"] = graph_bench(int2(gluon=True, heads_per_program=other))
    del cache
    sdpa = sdpa_call(q, kv_heads, context, gen)
    row.update(sdpa_graph=graph_bench(sdpa), sdpa_eager=eager_ms(sdpa))
    del sdpa
    torch.cuda.empty_cache()
    return row


def render(checks, rows, bandwidth) -> str:
    props = torch.cuda.get_device_properties(0)
    lines = [
        "# INT2 decode attention on every shape class vs bf16 SDPA (python -m bench.shapes)", "",
        f"- date: {utc_now()}; GPU: {props.name}; torch "
        f"{torch.__version__}, triton {triton.__version__}; copy bandwidth (read + write) {bandwidth / 1e12:.2f} TB/s",
        "- 64 sink + 256 recent tokens in BF16 (plus the key block's ring for keys per channel); one query token "
        f"per sequence, every sequence at the full context; value codes in {VALUE_LAYOUT[0]} (kvstore's value_layout)",
        "- graph: median CUDA-graph replay (bench.common.graph_bench, L2 cleared before each); eager: wall clock per call of 100 calls "
        "from Python; x SDPA: SDPA time / INT2 time, same mode; of floor: floor time / INT2 graph time",
        "- err: max over rows of ‖out − ref‖/‖ref‖ against kvstore.decode_attention_reference, ragged lengths "
        f"{RAGGED}, with and without the value mean", "",
        "## Errors", "", "| shape | program | err |", "|---|---|---|"]
    for label, errs in checks.items():
        for name, e in errs.items():
            lines.append(f"| {label} | {name} | {e if isinstance(e, str) else f'{e:.2e}'} |")
    lines += ["", "## Time (ms)", "",
              "| shape | context x batch | program | INT2 graph | SDPA graph | x SDPA | floor | of floor | "
              "INT2 eager | SDPA eager | x SDPA eager | graph, the other heads a program (4 or 8) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['shape']} | {r['context']} x {r['batch']} | failed: {r['failed']} |")
            continue
        other = f"{r['int2_graph_other_heads']:.4f} ({r['other_heads']})" if "other_heads" in r else ""
        lines.append(
            f"| {r['shape']} | {r['context']} x {r['batch']} | {r['program']} | {r['int2_graph']:.4f} | "
            f"{r['sdpa_graph']:.4f} | {r['sdpa_graph'] / r['int2_graph']:.2f}x | {r['floor']:.4f} | "
            f"{r['floor'] / r['int2_graph']:.0%} | {r['int2_eager']:.4f} | {r['sdpa_eager']:.4f} | "
            f"{r['sdpa_eager'] / r['int2_eager']:.2f}x | {other} |")
    return "\n".join(lines) + "\n"


def save(out: str, checks, rows, bandwidth) -> str:
    """The results so far, as markdown and JSON (rewritten after every row: a run cut short keeps them)."""
    text = render(checks, rows, bandwidth)
    with open(out, "w") as f:
        f.write(text)
    with open(out.replace(".md", ".json"), "w") as f:
        json.dump(dict(checks=checks, rows=rows), f, indent=1)
    return text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/shapes.md")
    ap.add_argument("--only", help="shape labels containing any of these texts (separated by ;)")
    ap.add_argument("--sizes", default=",".join(f"{c}x{b}" for c, b in SIZES),
                    help="context x batch points, comma separated")
    ap.add_argument("--no-time", action="store_true", help="errors only")
    ap.add_argument("--no-errors", action="store_true", help="times only")
    ap.add_argument("--value-layout", default=kvstore.DEFAULT_VALUE_LAYOUT, choices=kvstore.VALUE_LAYOUTS)
    args = ap.parse_args()
    VALUE_LAYOUT[0] = args.value_layout
    gen = torch.Generator("cuda").manual_seed(0)
    bandwidth = copy_bandwidth()
    shapes = [s for s in SHAPES if not args.only or any(part in s[0] for part in args.only.split(";"))]
    sizes = [tuple(int(v) for v in point.split("x")) for point in args.sizes.split(",")]
    checks, rows = {}, []
    for shape in [] if args.no_errors else shapes:
        checks[shape[0]] = check(shape, gen)
        print(f"check {shape[0]}: {checks[shape[0]]}", flush=True)
        save(args.out, checks, rows, bandwidth)
    for shape in [] if args.no_time else shapes:
        for context, bsz in sizes:
            try:
                row = time_size(shape, context, bsz, bandwidth, gen)
            except Exception as e:
                row = dict(shape=shape[0], context=context, batch=bsz, failed=f"{type(e).__name__}: {str(e)[:160]}")
                torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
            rows.append(row)
            save(args.out, checks, rows, bandwidth)
    print(save(args.out, checks, rows, bandwidth))
    bad = [v for errs in checks.values() for v in errs.values() if isinstance(v, str) or v > 1e-2]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
