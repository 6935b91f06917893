"""The TMA ring (decode.tma_stages) against loads at given points: graph replays, best of 3 interleaved, every sequence at
the full context; the outputs compared bit for bit, with the rows a program reads and the rule's choice. Without
arguments, the rule's edge (from 128 pairs, or 2,048 rows a program): Qwen3-8B's shape where the pairs are few or the
programs short, and MHA and GQA 2.

    PYTHONPATH=. python3 bench/tma_ring_classes.py > bench/results/tma_ring_edge.txt
    PYTHONPATH=. python3 bench/tma_ring_classes.py 32,32,100000,8 32,32,32768,8 32,32,100000,4 16,8,100000,16 \\
        > bench/results/tma_ring_classes.txt
    PYTHONPATH=. python3 bench/tma_ring_classes.py 32,8,100000,32,channel 32,8,100000,8,channel \\
        32,8,32768,32,channel 32,8,32768,8,channel 32,8,100000,1,channel 32,8,16384,16,channel 64,8,100000,8,channel \\
        40,8,100000,8,channel 28,4,100000,8,channel 64,8,32768,8,channel 64,8,100000,1,channel \\
        > bench/results/tma_ring_channel.txt
    PYTHONPATH=. python3 bench/tma_ring_classes.py 64,8,100000,8 64,8,100000,32 64,8,32768,8 64,8,16384,8 \\
        64,8,100000,1 40,8,100000,8 32,2,100000,8 32,2,100000,1 32,2,32768,8 > bench/results/tma_ring_gqa.txt
    PYTHONPATH=. python3 bench/tma_ring_classes.py 9,3,100000,8,channel,64 14,2,100000,8,channel,64 \\
        32,8,100000,8,token,64 9,3,16384,8,channel,64 32,8,100000,1,token,64 > bench/results/tma_ring_d64.txt
    PYTHONPATH=. python3 bench/tma_ring_classes.py 4,1,100000,8,token,256 4,1,100000,8,channel,256 \\
        16,8,100000,8,token,256 16,8,100000,8,channel,256 4,1,16384,8,token,256 4,1,16384,8,channel,256 \\
        4,1,100000,1,token,256 4,1,100000,1,channel,256 16,8,100000,1,channel,256 16,8,100000,1,token,256 \\
        4,1,32768,8,channel,256 4,1,32768,8,token,256 4,1,100000,32,token,256 4,1,65536,8,token,256 \\
        16,8,32768,8,token,256 16,8,16384,8,channel,256 16,8,8192,8,token,256 > bench/results/tma_ring_d256.txt
Args: heads,kv_heads,context,batch[,axis[,head_dim]] ... (axis token or channel: keys per channel in blocks of 64;
head_dim 128 unless given)
"""
import sys

import torch

sys.path.insert(0, "bench")
from tma_ring import raced  # noqa: E402

from oscar_core.triton import decode  # noqa: E402

EDGE = [(32, 8, 8192, 32), (32, 8, 16384, 32), (32, 8, 16384, 16), (32, 8, 49152, 8), (32, 8, 65536, 8),
        (32, 8, 65536, 16), (32, 8, 100_000, 4), (32, 8, 100_000, 2), (32, 8, 100_000, 8), (32, 32, 16384, 8),
        (32, 32, 8192, 8), (16, 8, 32768, 16)]


def main():
    gen = torch.Generator("cuda").manual_seed(0)
    specs = [spec.split(",") for spec in sys.argv[1:]]
    points = [(*map(int, f[:4]), False, *f[4:5], *map(int, f[5:])) for f in specs]
    points = points or [p + (False,) for p in EDGE]
    arms = {0: (None, 0), 2: (None, 2)}
    for (heads, kv, context, batch, _, *rest), (args, best, outs) in zip(points, raced(points, arms, gen)):
        plan = decode.launch_plan(args[0], args[1], max_length=context)
        rows = -(-args[1].key_codes.shape[2] // plan.n_int2)
        label = " ".join([f"{heads}/{kv}", *map(str, rest)])
        print(f"{label} {context} x {batch}: loads {best[0] * 1e3:.1f}  ring {best[2] * 1e3:.1f} µs  "
              f"({best[2] / best[0]:.3f}); rows a program ~{rows}; rule TMA {plan.gluon_consts.get('TMA', '-')}, flat "
              f"{plan.gluon_consts.get('FLAT', '-')}; equal {torch.equal(outs[0], outs[2])}", flush=True)
        del args, outs


if __name__ == "__main__":
    main()
