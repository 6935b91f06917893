"""How fast the INT2 store's tiles read through a TMA ring, against bench/read_ceiling.py's loads into registers.

A probe for the decode's next loop (kernel_notes.md v29, Next): each one-warp Gluon program streams its split's
tiles through a ring of STAGES shared-memory stages filled by TMA bulk copies (one instruction a copy, no load-pipe
work, no registers held while in flight), waits on each stage's mbarrier, reads it into registers as the decode
would (16-byte shared loads) and XORs it into an accumulator, so nothing is optimised away. Tiles are Qwen3-8B's at
100K (4,608 bytes: 4 KiB of key and value codes and 512 bytes of scale and zero codes, one contiguous chunk a tile,
which read_ceiling.md found within 1% of the store's six arrays), on decode's grids: batch 1, 8 and 32 = 8, 64 and
256 (sequence, KV head) pairs, P splits a pair. Graph replays (kernel.graph_bench: L2 cleared, ~4.8 µs of its own).

    PYTHONPATH=. python3 bench/tma_read.py > bench/results/tma_read.md
"""
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, "bench")
from kernel import graph_bench  # noqa: E402
from read_ceiling import TILES  # noqa: E402

ROW_WORDS = 128     # int32 words a descriptor row (512 bytes); a tile is 9 rows: 8 of codes, 1 of metadata
ROW = gl.constexpr(ROW_WORDS)
TILE_BYTES = 9 * ROW_WORDS * 4


@gluon.jit
def _xor(a, b):
    return a ^ b


@gluon.jit
def _read_ring(codes_desc, meta_desc, out_ptr, tiles, STAGES: gl.constexpr):
    """Program (split, pair): the split's chunk of the pair's tiles through a ring of STAGES stages, XORed."""
    split = gl.program_id(0)
    bh = gl.program_id(1)
    chunk = gl.cdiv(tiles, gl.num_programs(0))
    lo = split * chunk
    n = gl.maximum(gl.minimum(lo + chunk, tiles) - lo, 0)
    row0 = (bh * tiles + lo) * 9
    codes = gl.allocate_shared_memory(gl.int32, [STAGES, 8, ROW], codes_desc.layout)
    meta = gl.allocate_shared_memory(gl.int32, [STAGES, 1, ROW], meta_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(bars.index(j), count=1)
    for j in gl.static_range(STAGES):
        if j < n:
            mbarrier.expect(bars.index(j), 9 * ROW * 4)
            tma.async_copy_global_to_shared(codes_desc, [row0 + 9 * j, 0], bars.index(j), codes.index(j))
            tma.async_copy_global_to_shared(meta_desc, [row0 + 9 * j + 8, 0], bars.index(j), meta.index(j))
    CL: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, 1], [1, 0])
    acc = gl.zeros([8, ROW], gl.int32, CL)
    macc = gl.zeros([1, ROW], gl.int32, CL)
    for i in range(n):
        s = i % STAGES
        mbarrier.wait(bars.index(s), (i // STAGES) & 1)
        acc ^= codes.index(s).load(CL)
        macc ^= meta.index(s).load(CL)
        # Every lane's reads of stage s are done before the copy that overwrites it (generic then async proxy).
        gl.thread_barrier()
        fence_async_shared()
        if i + STAGES < n:
            mbarrier.expect(bars.index(s), 9 * ROW * 4)
            tma.async_copy_global_to_shared(codes_desc, [row0 + 9 * (i + STAGES), 0], bars.index(s), codes.index(s))
            tma.async_copy_global_to_shared(meta_desc, [row0 + 9 * (i + STAGES) + 8, 0], bars.index(s), meta.index(s))
    x = gl.reduce(gl.reshape(acc, [8 * ROW]), 0, _xor) ^ gl.reduce(gl.reshape(macc, [ROW]), 0, _xor)
    gl.store(out_ptr + bh * gl.num_programs(0) + split, x)


def main():
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    print("# INT2 store tiles read through a TMA ring (bench/tma_read.py)\n")
    print(f"- {props.name}, torch {torch.__version__}; Qwen3-8B's store at 100K: {TILES} tiles of {TILE_BYTES:,} "
          "bytes a (sequence, KV head) pair; graph replays (~4.8 µs of the bench's own in each); TB/s = tile bytes / "
          "time")
    print("- read_ceiling.md, loads into registers, best grids: batch 1 30.9 µs, batch 8 165.4 µs, "
          "batch 32 615.6 µs\n")
    print("| batch | pairs | programs a SM | splits a pair | stages | µs | TB/s |")
    print("|---|---|---|---|---|---|---|")
    for batch in (1, 8, 32):
        pairs = batch * 8
        store = torch.randint(-2 ** 31, 2 ** 31 - 1, (pairs * TILES * 9, ROW_WORDS), dtype=torch.int32, device="cuda")
        codes_desc = TensorDescriptor.from_tensor(store, [8, ROW_WORDS], gl.NVMMASharedLayout(0, 32, 2))
        meta_desc = TensorDescriptor.from_tensor(store, [1, ROW_WORDS], gl.NVMMASharedLayout(0, 32, 2))
        for per_sm in (4, 8, 12, 16):
            splits = max(1, per_sm * sms // pairs)
            out = torch.empty(pairs * splits, dtype=torch.int32, device="cuda")
            for stages in (2, 3, 4, 6):
                if per_sm * (stages * TILE_BYTES + 1024 + 64) > props.shared_memory_per_multiprocessor:
                    continue
                fn = lambda: _read_ring[(splits, pairs)](codes_desc, meta_desc, out, TILES, STAGES=stages,  # noqa: E731
                                                          num_warps=1)
                t = min(graph_bench(fn) for _ in range(3))
                print(f"| {batch} | {pairs} | {per_sm} | {splits} | {stages} | {t * 1e3:.1f} | "
                      f"{pairs * TILES * TILE_BYTES / t / 1e9:.2f} |", flush=True)
        del store


if __name__ == "__main__":
    main()
