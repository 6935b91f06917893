"""The TMA ring's rule at its edge (decode.tma_stages: from 128 pairs, or 2,048 rows a program): loads against the
ring on Qwen3-8B's shape (and MHA, GQA 2) where the pairs are few or the programs short, graph replays, best of 3
interleaved, every sequence at the full context; outputs compared bit for bit.

    PYTHONPATH=. python3 bench/tma_ring_edge.py > bench/results/tma_ring_edge.txt
"""
import sys
import torch
sys.path.insert(0, "bench")
from tma_ring import call_args, race  # noqa: E402
from oscar_core.triton import decode  # noqa: E402

POINTS = [(32, 8, 8192, 32), (32, 8, 16384, 32), (32, 8, 16384, 16), (32, 8, 49152, 8), (32, 8, 65536, 8),
          (32, 8, 65536, 16), (32, 8, 100_000, 4), (32, 8, 100_000, 2), (32, 8, 100_000, 8), (32, 32, 16384, 8),
          (32, 32, 8192, 8), (16, 8, 32768, 16)]
gen = torch.Generator("cuda").manual_seed(0)
for heads, kv, context, batch in POINTS:
    args = call_args(heads, kv, context, batch, gen)
    best, outs = race(args, context, {0: (None, 0), 2: (None, 2)})
    q, cache = args[:2]
    plan = decode.launch_plan(q, cache, max_length=context)
    rows = -(-max(cache.key_codes.shape[2], 1) // plan.n_int2)
    print(f"{heads}/{kv} {context} x {batch}: loads {best[0]*1e3:.1f} ring {best[2]*1e3:.1f} ({best[2]/best[0]:.3f}); "
          f"rows a program ~{rows}; rule TMA {plan.gluon_consts['TMA']} flat {plan.gluon_consts['FLAT']}; "
          f"equal {torch.equal(outs[0], outs[2])}", flush=True)
    del args, cache, outs
    torch.cuda.empty_cache()
