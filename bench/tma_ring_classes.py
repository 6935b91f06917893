"""The TMA ring (decode.tma_stages) against loads on other 4-head classes at head_dim 128 (MHA, GQA 2): graph
replays, best of 3 interleaved, every sequence at the full context; the outputs compared bit for bit.

    PYTHONPATH=. python3 bench/tma_ring_classes.py 32,32,100000,8 32,32,32768,8 32,32,100000,4 16,8,100000,16 \\
        > bench/results/tma_ring_classes.txt
Args: heads,kv_heads,context,batch ...
"""
import sys

import torch

sys.path.insert(0, "bench")
from tma_ring import call_args, race  # noqa: E402

from oscar_core.triton import decode  # noqa: E402


def main():
    gen = torch.Generator("cuda").manual_seed(0)
    for spec in sys.argv[1:]:
        heads, kv, context, batch = (int(x) for x in spec.split(","))
        args = call_args(heads, kv, context, batch, gen)
        q, cache = args[:2]
        best, outs = race(args, context, {0: (None, 0), 2: (None, 2)})
        rule = decode.launch_plan(q, cache, max_length=context).gluon_consts
        print(f"{spec}: loads {best[0] * 1e3:.1f}  ring {best[2] * 1e3:.1f} µs  ({best[2] / best[0]:.3f}; rule TMA "
              f"{rule['TMA']}, flat {rule['FLAT']}; equal {torch.equal(outs[0], outs[2])})", flush=True)
        del args, cache, outs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
