"""Benchmark: INT2 decode attention (Triton) against bf16 torch SDPA; write-kernel throughput.

Qwen3-8B attention shape (32 query heads, 8 KV heads, head_dim 128), one query token per sequence,
every sequence at the full context; then a shape-coverage table (head_dim 64/128/256, GQA 1-8, groups
64/128, a ragged batch). Times are medians of triton.testing.do_bench (it clears the L2 cache before
each run). Correctness is checked in the same run against kvstore's reference.
Imports only torch, triton and oscar_core's torch-only modules, so it runs on a bare GPU image:
    python -m bench.kernel --out bench/results/kernel.md           # make bench-kernel
    python -m bench.kernel --quick --out bench/results/kernel_quick.md
"""

import argparse
import dataclasses
import sys

import torch
import triton
from triton.testing import do_bench

from bench.common import copy_bandwidth, graph_bench, kernel_times, layer_of, orthogonal, rel_err, utc_now
from oscar_core import kvstore
from oscar_core.triton import decode, write

HEADS, KV_HEADS, D, GROUP = 32, 8, 128, 64
CONTEXTS = (8192, 32768, 100_000)
BATCHES = (1, 8, 32)


def int2_bytes(batch: int, context: int, sink: int = 64, recent: int = 256) -> int:
    """Fewest bytes the INT2 decode must move: each cache byte once, queries and outputs once."""
    window = min(context, sink + recent)
    per_token_int2 = 2 * (D // 4 + 2 * D // GROUP)
    cache = batch * KV_HEADS * ((context - window) * per_token_int2 + window * 2 * D * 2)
    return cache + 2 * batch * HEADS * D * 2


def stage(name: str) -> str:
    for key, label in (("_rotate", "rotate"), ("_split", "split"), ("_reduce", "reduce")):
        if key in name:
            return label
    return "other"


def bench_config(context, batch, layer, gen, bandwidth, variants):
    """Each variant (name, plan chooser, call, back) at one point: the chooser gives the call's DecodePlan from
    (q, cache, max_length) (None: the default plan); call defaults to decode.decode_attention, back (the output in
    original space, for the error) to the identity."""
    keys = torch.randn(batch, KV_HEADS, context, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    values = torch.randn(batch, KV_HEADS, context, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    keys += layer.key_mean[None, :, None].bfloat16()
    values += layer.value_mean[None, :, None].bfloat16()
    q = torch.randn(batch, HEADS, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    scaling = D ** -0.5
    cache = kvstore.empty_cache(batch, KV_HEADS, D, context, GROUP, GROUP, device="cuda")
    lengths = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    kvstore.prefill(cache, keys.transpose(1, 2), values.transpose(1, 2), lengths, layer, write=write.write_int2)

    q4 = q[:, :, None]
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q4, keys, values, scale=scaling, enable_gqa=True)  # noqa: E731
    t_sdpa = do_bench(sdpa, warmup=25, rep=200, return_mode="median")
    g_sdpa = graph_bench(sdpa)
    del keys, values
    torch.cuda.empty_cache()

    rows = []
    ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation,
                                             layer.value_mean, scaling)
    nbytes = int2_bytes(batch, context)
    for variant in variants:
        name, choose = variant[:2]
        fn = variant[2] if len(variant) > 2 else decode.decode_attention
        back = variant[3] if len(variant) > 3 else (lambda o: o)   # the output in original space, for err
        args = (q, cache, layer.key_rotation, layer.value_rotation, layer.value_mean, scaling)
        try:
            kw = {} if choose is None else dict(plan=choose(q, cache, context))
            out = torch.full((batch, HEADS, D), float("nan"), device="cuda", dtype=torch.bfloat16)
            fn(*args, max_length=context, out=out, **kw)
            torch.cuda.synchronize()
            err = rel_err(back(out.float()), ref)
            run = lambda: fn(*args, max_length=context, **kw)  # noqa: E731
            t = do_bench(run, warmup=25, rep=200, return_mode="median")
            g = graph_bench(run)
            parts = {}
            for kname, ms in kernel_times(run).items():
                parts[stage(kname)] = parts.get(stage(kname), 0.0) + ms
                if stage(kname) == "other":
                    print(f"  other kernel: {kname[:120]} {ms:.4f} ms", flush=True)
        except Exception as e:  # a variant that fails to compile is reported, not fatal
            print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        floor_ms = nbytes / bandwidth * 1e3
        rows.append(dict(context=context, batch=batch, variant=name, sdpa=t_sdpa, int2=t, speedup=t_sdpa / t,
                         gsdpa=g_sdpa, gint2=g, gspeedup=g_sdpa / g,
                         mbytes=nbytes / 1e6, floor=floor_ms, frac=floor_ms / g, err=err, parts=parts))
        print(f"  {context:>6} x{batch:<2} {name:<22} sdpa {t_sdpa:.4f}/{g_sdpa:.4f} ms  int2 {t:.4f}/{g:.4f} ms  "
              f"x{t_sdpa / t:.2f}/x{g_sdpa / g:.2f}  floor {floor_ms:.4f} ms ({floor_ms / g:.0%})  err {err:.2e}",
              flush=True)
    del cache
    torch.cuda.empty_cache()
    return rows


def bench_write(gen, bandwidth):
    """One layer's keys of a 100K-token prefill: 100K tokens x 8 heads x 128."""
    tokens = 100_000
    rot, clip = orthogonal(KV_HEADS, D, gen), torch.full((KV_HEADS,), 0.96, device="cuda")
    mean = torch.randn(KV_HEADS, D, generator=gen, device="cuda")
    x = torch.randn(tokens, KV_HEADS, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    ref = kvstore.write_int2(x[:4096], rot, clip, GROUP, mean)
    got = write.write_int2(x[:4096], rot, clip, GROUP, mean)
    same = min((a == b).float().mean().item() for a, b in zip(got, ref))
    ms = do_bench(lambda: write.write_int2(x, rot, clip, GROUP, mean), warmup=25, rep=200, return_mode="median")
    nbytes = tokens * KV_HEADS * (D * 2 + D // 4 + 2 * D // GROUP)
    return dict(ms=ms, tokens_per_s=tokens * KV_HEADS / (ms * 1e-3), gbps=nbytes / (ms * 1e-3) / 1e9,
                frac=nbytes / bandwidth / (ms * 1e-3), same=same)


# (label, query heads, KV heads, head_dim, key group, value group, lengths): every shape class of a
# supported model. Batch 1 and 4-8 take the two settings of plan.program_config (up to 16 and from 17
# (sequence, KV head) pairs).
SHAPES = [
    ("Llama-3.2-1B 32/8 d64", 32, 8, 64, 64, 64, [16384]),
    ("Llama-3.2-1B 32/8 d64", 32, 8, 64, 64, 64, [16384] * 4),
    ("Qwen3-8B 32/8 d128", 32, 8, 128, 64, 64, [16384] * 4),
    ("Qwen3-8B, groups 128", 32, 8, 128, 128, 128, [16384]),
    ("Qwen3-8B, groups 128", 32, 8, 128, 128, 128, [16384] * 4),
    ("Qwen3-8B, V groups 128", 32, 8, 128, 64, 128, [16384] * 4),
    ("MHA 32/32 d128 (GQA 1)", 32, 32, 128, 64, 64, [16384]),
    ("MHA 32/32 d128 (GQA 1)", 32, 32, 128, 64, 64, [16384] * 4),
    ("Qwen2.5-14B 40/8 (GQA 5)", 40, 8, 128, 64, 64, [16384]),
    ("Qwen2.5-14B 40/8 (GQA 5)", 40, 8, 128, 64, 64, [16384] * 4),
    ("Qwen2.5-7B 28/4 (GQA 7)", 28, 4, 128, 64, 64, [16384]),
    ("Qwen2.5-7B 28/4 (GQA 7)", 28, 4, 128, 64, 64, [16384] * 8),
    ("Qwen3-32B 64/8 (GQA 8)", 64, 8, 128, 64, 64, [16384]),
    ("Qwen3-32B 64/8 (GQA 8)", 64, 8, 128, 64, 64, [16384] * 4),
    ("Gemma-3-12B 16/8 d256", 16, 8, 256, 64, 64, [16384]),
    ("Gemma-3-12B 16/8 d256", 16, 8, 256, 64, 64, [16384] * 4),
    ("d256 GQA 8, groups 128", 32, 4, 256, 128, 128, [16384] * 2),
    ("d256 GQA 8, groups 128", 32, 4, 256, 128, 128, [16384] * 8),
    ("ragged Qwen3-8B", 32, 8, 128, 64, 64, [1, 200, 20000, 7]),
    ("ragged Qwen3-8B", 32, 8, 128, 64, 64, [20000, 7]),
    ("ragged d256", 16, 8, 256, 64, 64, [1, 200, 20000, 7]),
]


def bench_shapes(gen) -> list:
    """Each SHAPES row: error against the reference with and without the value mean (the output then
    is a small average of centred values: the hardest case for a relative error), graph time of the
    INT2 decode, and of bf16 SDPA where all lengths are equal."""
    rows = []
    for label, heads, kv_heads, d, gk, gv, lengths in SHAPES:
        bsz, longest = len(lengths), max(lengths)
        rot = lambda: orthogonal(kv_heads, d, gen)  # noqa: E731
        layer = kvstore.LayerRotation(rot(), rot(), torch.full((kv_heads,), 0.96, device="cuda"),
                                      torch.full((kv_heads,), 0.92, device="cuda"),
                                      torch.randn(kv_heads, d, generator=gen, device="cuda") * 0.5,
                                      torch.randn(kv_heads, d, generator=gen, device="cuda") * 0.5)
        keys = torch.randn(bsz, kv_heads, longest, d, generator=gen, device="cuda", dtype=torch.bfloat16)
        values = torch.randn(bsz, kv_heads, longest, d, generator=gen, device="cuda", dtype=torch.bfloat16)
        keys += layer.key_mean[None, :, None].bfloat16()
        values += layer.value_mean[None, :, None].bfloat16()
        q = torch.randn(bsz, heads, d, generator=gen, device="cuda", dtype=torch.bfloat16)
        scaling = d ** -0.5
        cache = kvstore.empty_cache(bsz, kv_heads, d, longest, gk, gv, device="cuda")
        lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        # The torch write: the Triton write kernel does not fit head_dim 256 (issue 11 rebuilds it).
        kvstore.prefill(cache, keys.transpose(1, 2), values.transpose(1, 2), lens, layer)
        row = dict(label=label, heads=heads, kv_heads=kv_heads, d=d, gk=gk, gv=gv, lengths=lengths)
        try:
            plan = decode.plan_for(q, cache, longest)
            errs = []
            for mean in (layer.value_mean, None):
                ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation, mean,
                                                         scaling)
                out = torch.full((bsz, heads, d), float("nan"), device="cuda", dtype=torch.bfloat16)
                decode.decode_attention(q, cache, layer.key_rotation, layer.value_rotation, mean, scaling, out=out)
                torch.cuda.synchronize()
                errs.append(rel_err(out, ref))
            run = lambda: decode.decode_attention(q, cache, layer.key_rotation, layer.value_rotation,  # noqa: E731
                                                  layer.value_mean, scaling, max_length=longest)
            row.update(err=errs[0], err_nomean=errs[1], gint2=graph_bench(run),
                       launch="Gluon INT2 + Triton windows" if plan.gluon else "Triton", cfg=settings(plan))
            if len(set(lengths)) == 1:
                q4 = q[:, :, None]
                row["gsdpa"] = graph_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                    q4, keys, values, scale=scaling, enable_gqa=True))
        except Exception as e:  # a shape that fails is a row of the table, not the end of the run
            row["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(f"  shape {row}", flush=True)
        rows.append(row)
        del keys, values, cache
        torch.cuda.empty_cache()
    return rows


def render(rows, sweep, wr, bandwidth, shapes=()) -> str:
    props = torch.cuda.get_device_properties(0)
    lines = [
        "# INT2 decode attention kernel vs bf16 SDPA",
        "",
        f"- date: {utc_now()}",
        f"- GPU: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
        f"triton {triton.__version__}, python {sys.version.split()[0]}",
        f"- shape: {HEADS} query heads, {KV_HEADS} KV heads, head_dim {D}, INT2 groups of {GROUP} (K and V), "
        "64 sink + 256 recent tokens in BF16; one query token per sequence, all sequences at the full context",
        f"- measured copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s",
        "- times: median of triton.testing.do_bench (L2 cleared before each run), eager (a Python call per "
        "run, as a plain caller sees it) and CUDA-graph replay (as a serving engine runs decode); INT2 time "
        "includes every launch of a call: the query rotation, the split programs (BF16 windows and INT2 rows; "
        "with the Gluon programs two launches, side by side in a graph) and the reduce, which merges the "
        "splits and applies R_V^T and μ_V",
        "- byte floor: fewest bytes the INT2 decode must move (codes, scale/zero codes, BF16 windows, q, out) "
        "over the copy bandwidth; 'of floor' = floor time / graph time",
        "- err: max over rows of ‖out − ref‖/‖ref‖ against kvstore.decode_attention_reference (float32)",
        "",
        "## Decode attention (the default plan, plan.choose_plan; PTX unpack)",
        "",
        "| context | batch | SDPA ms eager | INT2 ms eager | speedup eager | SDPA ms graph | INT2 ms graph | "
        "speedup graph | INT2 MB | floor ms | of floor | err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['context']} | {r['batch']} | {r['sdpa']:.4f} | {r['int2']:.4f} | {r['speedup']:.2f}x | "
                     f"{r['gsdpa']:.4f} | {r['gint2']:.4f} | {r['gspeedup']:.2f}x | {r['mbytes']:.1f} | "
                     f"{r['floor']:.4f} | {r['frac']:.0%} | {r['err']:.1e} |")
    lines += ["", "## Where the time goes (default settings)", "",
              "Device time per call of each launch (torch.profiler, eager calls), against the graph replay time; "
              "'gaps' = graph time − the kernels' sum (launch latency between the kernels of one decode).", "",
              "| context | batch | rotate ms | split ms | reduce ms | other ms | kernels ms | graph ms | gaps ms |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["parts"]
        total = sum(p.values())
        lines.append(f"| {r['context']} | {r['batch']} | {p.get('rotate', 0):.4f} | {p.get('split', 0):.4f} | "
                     f"{p.get('reduce', 0):.4f} | {p.get('other', 0):.4f} | {total:.4f} | {r['gint2']:.4f} | "
                     f"{r['gint2'] - total:.4f} |")
    lines += ["", "## Targets (default settings)", ""]
    targets = ((100_000, 32, "graph", 6.0), (100_000, 8, "graph", 5.0), (32768, 32, "graph", 5.0),
               (100_000, 1, "graph", 4.0), (100_000, 1, "eager", 2.5))
    for context, batch, mode, target in targets:
        hit = [r for r in rows if r["context"] == context and r["batch"] == batch and r["err"] < 1e-2]
        if hit:
            key, base = ("gspeedup", "gsdpa") if mode == "graph" else ("speedup", "sdpa")
            s = hit[0][key]
            verdict = "met" if s >= target else f"MISSED by {target / s:.2f}x (needs {hit[0][base] / target:.4f} ms)"
            lines.append(f"- {context} tokens, batch {batch}, {mode}: {s:.2f}x vs target {target:g}x: {verdict}")
    if shapes:
        lines += ["", "## Every shape class (16K tokens unless ragged; default settings)", "",
                  "err: ‖out − ref‖/‖ref‖, max over rows, with the value mean μ_V and without it (then the output is "
                  "a small average of centred values, the hardest case for a relative error). Times: CUDA-graph "
                  "replay; SDPA only where all lengths are equal.", "",
                  "| shape | heads / KV heads | d | groups K/V | lengths | settings | launches | err | err, no mean | "
                  "INT2 ms graph | SDPA ms graph | speedup |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in shapes:
            lens = ", ".join(str(n) for n in r["lengths"]) if len(set(r["lengths"])) > 1 else f"{r['lengths'][0]} x {len(r['lengths'])}"
            head = f"| {r['label']} | {r['heads']}/{r['kv_heads']} | {r['d']} | {r['gk']}/{r['gv']} | {lens} |"
            if "failed" in r:
                lines.append(f"{head} | FAILED: {r['failed']} | | | | | | |")
                continue
            sd = f"{r['gsdpa']:.4f} | {r['gsdpa'] / r['gint2']:.2f}x" if "gsdpa" in r else "— | —"
            lines.append(f"{head} {r['cfg']} | {r['launch']} | {r['err']:.1e} | {r['err_nomean']:.1e} | "
                         f"{r['gint2']:.4f} | {sd} |")
    if sweep:
        lines += ["", "## Variant sweep", "",
                  "| context | batch | variant | INT2 ms eager | INT2 ms graph | speedup eager | speedup graph | of floor | err |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in sweep:
            lines.append(f"| {r['context']} | {r['batch']} | {r['variant']} | {r['int2']:.4f} | {r['gint2']:.4f} | "
                         f"{r['speedup']:.2f}x | {r['gspeedup']:.2f}x | {r['frac']:.0%} | {r['err']:.1e} |")
    if wr is None:
        return "\n".join(lines)
    lines += ["", "## Write kernel", "",
              f"100,000 tokens x {KV_HEADS} heads x {D} (one layer's keys): {wr['ms']:.3f} ms, "
              f"{wr['tokens_per_s'] / 1e9:.2f} G token-heads/s, {wr['gbps']:.0f} GB/s moved "
              f"({wr['frac']:.0%} of copy bandwidth); codes equal to the reference on "
              f"{wr['same']:.4%} of elements (worst of codes / scale / zero)", ""]
    return "\n".join(lines)


def settings(plan) -> str:
    """A plan's program settings in a few words: the Triton programs' tile, warps and stages, or the Gluon programs'
    heads a program, waves and ring."""
    if not plan.gluon:
        return f"n{plan.block_n} w{plan.num_warps} s{plan.num_stages}"
    return (f"{plan.gluon_heads} heads, waves {plan.waves}" + (f", TMA {plan.tma}" if plan.tma else "")
            + (", flat" if plan.flat else ""))


def pinned(**pins):
    """A plan chooser: decode.plan_for's plan with these choices pinned (gluon, heads_per_program, flat, pdl)."""
    return lambda q, cache, max_length: decode.plan_for(q, cache, max_length, **pins)


def replaced(pins=None, **fields):
    """A plan chooser: decode.plan_for's plan (with pins), these fields replaced."""
    return lambda q, cache, max_length: dataclasses.replace(decode.plan_for(q, cache, max_length, **(pins or {})),
                                                            **fields)


def absorbed_call(q, cache, key_rotation, value_rotation, value_mean, scaling, **kw):
    """The call of a model whose v_proj / o_proj hold R_V and μ_V (oscar_core.serve.absorb): the output õ stays in the
    values' stored space, no õ·R_V^T in the reduce."""
    return decode.decode_attention(q, cache, key_rotation, None, None, scaling, **kw)


def absorbed_variant(layer):
    """(name, settings, call, back): `back` takes absorbed_call's output to original space (õ·R_V^T + μ_V), for the
    error against the reference."""
    def back(o):
        heads = o.reshape(o.shape[0], KV_HEADS, -1, D)
        return (heads @ layer.value_rotation.transpose(1, 2) + layer.value_mean[None, :, None]).reshape(o.shape)

    return ("R_V in the weights (absorbed)", None, absorbed_call, back)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/kernel.md")
    ap.add_argument("--sweep", action="store_true", help="also time block/warp/split variants at 100K")
    ap.add_argument("--profile", action="store_true", help="one 32K x 32 decode call, for ncu")
    ap.add_argument("--baseline", help="a decode.py of another version, timed beside the default in the sweep")
    ap.add_argument("--no-shapes", action="store_true", help="skip the shape-coverage table")
    ap.add_argument("--quick", action="store_true", help="32K and 100K only, no write kernel")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.profile:
        layer = layer_of(KV_HEADS, D, gen)
        context, batch = 32768, 32
        keys = torch.randn(batch, context, KV_HEADS, D, generator=gen, device="cuda", dtype=torch.bfloat16)
        cache = kvstore.empty_cache(batch, KV_HEADS, D, context, GROUP, GROUP, device="cuda")
        lengths = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        kvstore.prefill(cache, keys, keys, lengths, layer, write=write.write_int2)
        q = torch.randn(batch, HEADS, D, generator=gen, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            decode.decode_attention(q, cache, layer.key_rotation, layer.value_rotation, layer.value_mean,
                                    D ** -0.5, max_length=context)
        torch.cuda.synchronize()
        return
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    layer = layer_of(KV_HEADS, D, gen)
    shapes = [] if args.no_shapes else bench_shapes(gen)
    default = [("default", None)]
    extra = {}
    if args.baseline:   # another version of decode.py, timed on the same caches
        import importlib.util
        spec = importlib.util.spec_from_file_location("decode_baseline", args.baseline)
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
        for key in ((100_000, 1), (100_000, 8), (100_000, 32), (32768, 32), (32768, 8), (32768, 1)):
            extra[key] = [("baseline", None, base.decode_attention)]
    for key in ((100_000, 1), (100_000, 8), (100_000, 32), (32768, 32), (32768, 8)):
        extra.setdefault(key, []).append(("triton INT2", pinned(gluon=False)))
    for key in ((32768, 1), (8192, 1)):   # where the default keeps the Triton programs
        extra.setdefault(key, []).append(("gluon", pinned(gluon=True)))
    for key in ((100_000, 8), (100_000, 32)):
        extra[key].append(("gluon, loads (no TMA ring)", replaced(dict(gluon=True, flat=False), tma=0)))
    for key in ((100_000, 1), (100_000, 8), (100_000, 32), (32768, 32), (32768, 8), (32768, 1)):
        extra.setdefault(key, []).append(absorbed_variant(layer))
    rows, sweep = [], []
    for context in CONTEXTS[1:] if args.quick else CONTEXTS:
        for batch in BATCHES:
            got = bench_config(context, batch, layer, gen, bandwidth, default + extra.get((context, batch), []))
            rows += got[:1]
            if (context, batch) in extra:
                sweep += got
        partial = render(rows, sweep, None, bandwidth, shapes)
        with open(args.out, "w") as f:
            f.write(partial)
    if args.sweep:
        def variant(bn, warps, stages, waves, key_t):     # the Triton programs' settings (plan.program_config)
            return (f"n{bn} w{warps} s{stages} waves{waves}" + (" keyT" if key_t else ""),
                    replaced(dict(gluon=False), block_n=bn, num_warps=warps, num_stages=stages, waves=waves,
                             key_t=key_t))
        one_warp = [variant(64, 1, st, w, kt) for kt in (False, True) for st in (3, 4) for w in (32, 48, 64)]
        plans = {
            1: [variant(bn, 4, 2, w, True) for bn in (128, 256) for w in (2, 4, 8)]
               + [variant(64, 1, 3, w, kt) for kt in (False, True) for w in (16, 32)],
            8: [variant(128, 4, 3, 8, False)] + one_warp,
            32: [variant(128, 4, 3, 4, False)] + one_warp,
        }
        for batch, variants in plans.items():
            sweep += bench_config(100_000, batch, layer, gen, bandwidth, variants)
    if args.quick:
        return
    wr = bench_write(gen, bandwidth)
    print(f"write: {wr}", flush=True)
    text = render(rows, sweep, wr, bandwidth, shapes)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
