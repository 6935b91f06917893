"""At head_dim 256 with few pairs, a spare slot for the window programs (gluon_waves' slots - 1 a multiprocessor, as at
head_dim 64 and 128 from 64K rows at 8 pairs or fewer) against the whole wave decode.gluon_waves gives: graph replays,
best of 3 interleaved, every sequence at the full context, the two outputs compared.

    PYTHONPATH=. python3 bench/waves_d256.py > bench/results/waves_d256.txt
"""
import sys

import torch

sys.path.insert(0, "bench")
from kernel import graph_bench  # noqa: E402
from tma_ring import call_args  # noqa: E402

from oscar_core.triton import decode  # noqa: E402

WHOLE = decode.gluon_waves
POINTS = [(4, 1, 100_000, 8, "token"), (4, 1, 100_000, 8, "channel"), (4, 1, 100_000, 1, "channel"),
          (4, 1, 100_000, 16, "channel"), (16, 8, 100_000, 1, "token"), (16, 8, 100_000, 2, "channel")]


def spare(pairs, max_int2, head_dim, slots, ht, num_sms, min_chunk):
    if pairs <= 16 and max_int2 >= 65536:
        return max(1, (slots - 1) // ht)
    return WHOLE(pairs, max_int2, head_dim, slots, ht, num_sms, min_chunk)


def main():
    gen = torch.Generator("cuda").manual_seed(0)
    for heads, kv, context, batch, axis in POINTS:
        args = call_args(heads, kv, context, batch, gen, False, axis, 256)
        best, outs = {}, {}
        for _ in range(3):
            for name, waves in (("whole", WHOLE), ("spare", spare)):
                decode.gluon_waves = waves
                decode._PLANS.clear()

                def call():
                    return decode.decode_attention(*args, max_length=context, graph=False)
                outs[name] = call()
                best[name] = min(best.get(name, 9), graph_bench(call))
        decode.gluon_waves = WHOLE
        decode._PLANS.clear()
        err = ((outs["whole"].float() - outs["spare"].float()).norm() / outs["whole"].float().norm()).item()
        print(f"{heads}/{kv} {axis} {context} x {batch}: whole {best['whole'] * 1e3:.1f}  spare "
              f"{best['spare'] * 1e3:.1f} µs ({best['spare'] / best['whole']:.3f}); outputs differ by {err:.1e}",
              flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
