"""How many splits the Gluon INT2 programs cut a (sequence, KV head) into at batch 1-8: graph replays, interleaved
arms, every sequence at the full context, on shapes.py's random stores.

    PYTHONPATH=. python3 bench/splits.py min-chunk > bench/results/min_chunk_h200.txt
    PYTHONPATH=. python3 bench/splits.py cap > bench/results/max_gluon_splits.txt

min-chunk: the fewest rows a program reads (default_config's min_chunk) at 128 (the default), 256, 512 and 1024,
best of 2, the splits a pair in brackets, and the largest difference of an arm's output from the 128 arm's.
cap: decode.MAX_GLUON_SPLITS off against 256, best of 3, each arm's error against the float32 reference.
heads: at batch 1-8 with 5-16 heads a KV head, the Gluon programs' heads (8 or 16), MAX_GLUON_SPLITS (256 or 1024)
and the splits a multiprocessor (gluon_waves' or a whole wave of the slots), best of 3, each arm's error.

    PYTHONPATH=. python3 bench/splits.py heads > bench/results/heads_splits_h200.txt
"""
import sys

import torch

sys.path.insert(0, "bench")
import shapes  # noqa: E402
from kernel import graph_bench  # noqa: E402
from tma_ring import call_args  # noqa: E402

from oscar_core import kvstore  # noqa: E402
from oscar_core.triton import decode  # noqa: E402

MIN_CHUNK_CLASSES = ["GQA 16 32/2 d128", "Qwen2.5-0.5B 14/2 d64, keys per channel",
                     "Qwen2.5-7B 28/4 d128 (GQA 7), keys per channel", "Qwen3-32B 64/8 d128 (GQA 8)",
                     "SmolLM2-135M 9/3 d64, keys per channel", "Llama-3.2-1B 32/8 d64", "Qwen3-8B 32/8 d128",
                     "Gemma-3-270M 4/1 d256", "Qwen2.5-14B 40/8 d128 (GQA 5)"]
MIN_CHUNK_POINTS = [(16384, 1), (32768, 1), (100_000, 1), (16384, 8), (100_000, 8)]
MIN_CHUNKS = [128, 256, 512, 1024]
CAP_POINTS = [("Qwen2.5-0.5B 14/2 d64, keys per channel", 100_000, 1),
              ("Qwen2.5-0.5B 14/2 d64, keys per channel", 32768, 1),
              ("Qwen2.5-0.5B 14/2 d64, keys per channel", 200_000, 1),
              ("SmolLM2-135M 9/3 d64, keys per channel", 100_000, 1),
              ("SmolLM2-135M 9/3 d64, keys per channel", 32768, 1), ("GQA 16 32/2 d128", 200_000, 1),
              ("Qwen3-8B 32/8 d128", 100_000, 1), ("Qwen3-8B 32/8 d128", 200_000, 1),
              ("Llama-3.2-1B 32/8 d64", 100_000, 1)]
NO_CAP = 10 ** 9


def problem(label, context, bsz, gen):
    """(a decode call of no arguments writing out, out, decode_attention's leading arguments) for a shape class at
    context x bsz (its groups are 64: tma_ring.call_args)."""
    _, heads, kv, d, _, _, axis = next(s for s in shapes.SHAPES if s[0] == label)
    args = call_args(heads, kv, context, bsz, gen, False, axis, d)
    out = torch.empty_like(args[0])

    def call():
        return decode.decode_attention(*args, max_length=context, out=out, graph=False)
    return call, out, args


def with_min_chunk(min_chunk):
    """default_config with the Gluon programs' min_chunk replaced."""
    def config(*args, **kwargs):
        cfg = BASE_CONFIG(*args, **kwargs)
        return dict(cfg, min_chunk=min_chunk) if cfg.get("min_chunk") == 128 else cfg
    return config


BASE_CONFIG = decode.default_config


def min_chunk(gen):
    for label in MIN_CHUNK_CLASSES:
        for context, bsz in MIN_CHUNK_POINTS:
            call, out, args = problem(label, context, bsz, gen)
            q, cache = args[:2]
            best, outs, splits = {}, {}, {}
            for _ in range(2):
                for chunk in MIN_CHUNKS:
                    decode.default_config = with_min_chunk(chunk)
                    decode._PLANS.clear()
                    call()
                    outs[chunk] = out.float().clone()
                    splits[chunk] = decode.launch_plan(q, cache, max_length=context).ns
                    best[chunk] = min(best.get(chunk, 9), graph_bench(call))
            decode.default_config = BASE_CONFIG
            decode._PLANS.clear()
            diff = max(((outs[c] - outs[128]).norm(dim=-1) / outs[128].norm(dim=-1)).max().item() for c in MIN_CHUNKS)
            print(f"{label} {context} x {bsz}: "
                  + "  ".join(f"{c}: {best[c] * 1e3:.1f} ({splits[c]})" for c in MIN_CHUNKS)
                  + f"  | max diff {diff:.1e}", flush=True)
            del call, args, cache
            torch.cuda.empty_cache()


def cap(gen):
    for label, context, bsz in CAP_POINTS:
        call, out, args = problem(label, context, bsz, gen)
        q, cache = args[:2]
        ref = kvstore.decode_attention_reference(*args)
        best, splits, errs = {}, {}, {}
        for _ in range(3):
            for limit in (NO_CAP, 256):
                decode.MAX_GLUON_SPLITS = limit
                decode._PLANS.clear()
                call()
                errs[limit] = shapes.rel_err(out, ref)
                splits[limit] = decode.launch_plan(q, cache, max_length=context).ns
                best[limit] = min(best.get(limit, 9), graph_bench(call))
        decode.MAX_GLUON_SPLITS = 256
        decode._PLANS.clear()
        print(f"{label} {context} x {bsz}: no cap {best[NO_CAP] * 1e3:.1f} µs ({splits[NO_CAP]} splits, err "
              f"{errs[NO_CAP]:.1e})  256: {best[256] * 1e3:.1f} µs ({splits[256]}, err {errs[256]:.1e})  "
              f"{best[256] / best[NO_CAP]:.3f}", flush=True)
        del call, args, cache
        torch.cuda.empty_cache()


HEADS_POINTS = [("GQA 16 32/2 d128", 8192, 1), ("GQA 16 32/2 d128", 16384, 1), ("GQA 16 32/2 d128", 100_000, 1),
                ("GQA 16 32/2 d128", 100_000, 8), ("Qwen3-32B 64/8 d128 (GQA 8)", 100_000, 1),
                ("Qwen3-32B 64/8 d128 (GQA 8), keys per channel", 100_000, 1),
                ("Qwen2.5-7B 28/4 d128 (GQA 7), keys per channel", 100_000, 1),
                ("Qwen2.5-14B 40/8 d128 (GQA 5)", 100_000, 1), ("Qwen3-8B 32/8 d128", 100_000, 1),
                ("Qwen3-8B 32/8 d128, keys per channel", 100_000, 1)]


def heads(gen):
    for label, context, bsz in HEADS_POINTS:
        call, out, args = problem(label, context, bsz, gen)
        q, cache = args[:2]
        hg = q.shape[1] // cache.key_codes.shape[1]
        ref = kvstore.decode_attention_reference(*args)
        plan = decode.launch_plan(q, cache, max_length=context)
        ht = plan.gluon_consts["HT"]
        slots = decode._gluon_programs_per_sm(cache, {k: plan.gluon_consts[k] for k in plan.gluon_consts
                                                      if k.isupper() and k != "PDL"}, q.device)
        arms = [(hp, limit, w) for hp in ((8, 16) if hg > 4 else (None,)) for limit in (256, 1024)
                for w in (None, "whole")]
        best, splits, errs = {}, {}, {}
        for _ in range(3):
            for arm in arms:
                hp, limit, w = arm
                decode.MAX_GLUON_SPLITS = limit
                decode._PLANS.clear()
                consts = decode.gluon_constexprs(cache, q.shape[1], q.shape[2], 1, hp)
                waves = None if w is None else decode._gluon_programs_per_sm(cache, consts, q.device) // consts["HT"]
                fn = lambda a=args, hp=hp, waves=waves: decode.decode_attention(  # noqa: E731
                    *a, max_length=context, out=out, graph=False, heads_per_program=hp, waves=waves)
                fn()
                errs[arm] = shapes.rel_err(out, ref)
                p = decode.launch_plan(q, cache, max_length=context, heads_per_program=hp, waves=waves)
                splits[arm] = f"{p.n_int2}x{p.gluon_consts['HT']}"
                best[arm] = min(best.get(arm, 9e9), graph_bench(fn) * 1e3)
        decode.MAX_GLUON_SPLITS = 256
        decode._PLANS.clear()
        print(f"{label} {context} x {bsz} (rule: {plan.n_int2}x{ht}, {slots} slots): "
              + "  ".join(f"{a[0] or '-'}/{a[1]}/{a[2] or 'rule'}: {best[a]:.1f} ({splits[a]}, {errs[a]:.1e})"
                          for a in arms), flush=True)
        del call, args, cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    {"min-chunk": min_chunk, "cap": cap, "heads": heads}[sys.argv[1]](torch.Generator("cuda").manual_seed(0))
