"""Benchmark: the rate at which a read-only loop, with no compute, can read the INT2 store's tiles on a given grid.

The Gluon decode programs read 64-token tiles of one (sequence, KV head) pair: key and value codes (2 KiB each at
head_dim 128) and four arrays of scale and zero codes (128 bytes each), 4,608 bytes a tile. This script reads the
same bytes with the same kind of grid (splits x pairs, one warp a program) and only XORs them, so its time is the
ceiling the access pattern and the partition allow (H100, 100K context, 8 KV heads: batch 1, 8, 32 are 8, 64, 256
pairs). Two probes:
- layouts: the store's six arrays against the same bytes of a tile in one contiguous 4,608-byte chunk, at the
  grids decode uses (33 x 64 at batch 8, 198 x 8 at batch 1, 8 x 256 at batch 32), warps 1-2, tiles read 1-2 at a
  time, num_stages 1 or 3;
- grids: programs of W warps (each warp its own stream of tiles), 4-24 streams a multiprocessor, each stream a
  chunk of consecutive tiles (c) or every A-th tile (s, strided), tiles 1 or 2 at a time.
Times are CUDA-graph replays (bench/kernel.py graph_bench: L2 cleared, ~4.8 µs of the bench's own in each).
    PYTHONPATH=. python3 bench/read_ceiling.py [layouts|grids] > bench/results/read_ceiling.md
"""

import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from kernel import copy_bandwidth, graph_bench  # noqa: E402

TILES = 1557            # 64-token tiles of a 100K sequence past its 320 BF16 window tokens


@triton.jit
def _read_tiles(kc, vc, ks, kz, vs, vz, buf, out, T, TPP, CHUNKS: tl.constexpr, AHEAD: tl.constexpr):
    """Program (s, p) XORs tiles [s·TPP, (s + 1)·TPP) of pair p, AHEAD at a time: from the store's six arrays, or
    (CHUNKS) from one buffer holding each tile's bytes as one 4,608-byte chunk."""
    s = tl.program_id(0)
    p = tl.program_id(1)
    w = tl.arange(0, 512)
    m = tl.arange(0, 32)
    acc = tl.zeros([512], tl.int32)
    accm = tl.zeros([32], tl.int32)
    t0 = s * TPP
    for t in range(t0, t0 + TPP, AHEAD):
        for a in tl.static_range(AHEAD):
            if CHUNKS:
                base = (p * (T // 64) + t + a) * 1152
                acc ^= tl.load(buf + base + w)
                acc ^= tl.load(buf + base + 512 + w)
                accm ^= tl.load(buf + base + 1024 + m) ^ tl.load(buf + base + 1056 + m) \
                    ^ tl.load(buf + base + 1088 + m) ^ tl.load(buf + base + 1120 + m)
            else:
                tok = (t + a) * 64
                acc ^= tl.load(kc + (p * T + tok) * 8 + w)
                acc ^= tl.load(vc + (p * T + tok) * 8 + w)
                mo = (p * T + tok) // 2 + m
                accm ^= tl.load(ks + mo) ^ tl.load(kz + mo) ^ tl.load(vs + mo) ^ tl.load(vz + mo)
    tl.store(out + (p * tl.num_programs(0) + s), tl.sum(acc, 0) ^ tl.sum(accm, 0))


@triton.jit
def _read_streams(buf, out, TILES, TPW, NSTREAM, W: tl.constexpr, STRIDED: tl.constexpr, AHEAD: tl.constexpr):
    """Program (s, p): warp w reads stream k = s·W + w of pair p, tiles [k·TPW, (k + 1)·TPW) or (STRIDED) k,
    k + NSTREAM, k + 2·NSTREAM, ..., of a buffer of 4,608-byte tile chunks."""
    s = tl.program_id(0)
    p = tl.program_id(1)
    k = s * W + tl.arange(0, W)
    w = tl.arange(0, 1024)
    wm = 1024 + tl.arange(0, 128)
    acc = tl.zeros([W, 1024], tl.int32)
    accm = tl.zeros([W, 128], tl.int32)
    for i in range(0, TPW, AHEAD):
        for a in tl.static_range(AHEAD):
            if STRIDED:
                t = k + (i + a) * NSTREAM
            else:
                t = k * TPW + i + a
            ok = (t < TILES) & ((k * 0 + i + a) < TPW)
            base = buf + (p * TILES + t)[:, None].to(tl.int64) * 1152
            acc ^= tl.load(base + w[None, :], mask=ok[:, None], other=0)
            accm ^= tl.load(base + wm[None, :], mask=ok[:, None], other=0)
    tl.store(out + (p * tl.num_programs(0) + s) * W + tl.arange(0, W), tl.xor_sum(acc, 1) ^ tl.xor_sum(accm, 1))


def layouts():
    print(f"copy bandwidth {copy_bandwidth() / 1e12:.2f} TB/s", flush=True)
    for pairs, nprog, label in ((64, 33, "batch 8"), (8, 198, "batch 1"), (256, 8, "batch 32")):
        tpp = -(-TILES // nprog)
        T = tpp * nprog * 64
        kc = torch.randint(0, 1 << 30, (pairs * T * 8,), dtype=torch.int32, device="cuda")
        vc = torch.randint(0, 1 << 30, (pairs * T * 8,), dtype=torch.int32, device="cuda")
        meta = [torch.randint(0, 1 << 30, (pairs * T // 2,), dtype=torch.int32, device="cuda") for _ in range(4)]
        buf = torch.randint(0, 1 << 30, (pairs * T // 64 * 1152,), dtype=torch.int32, device="cuda")
        out = torch.empty(pairs * nprog, dtype=torch.int32, device="cuda")
        nbytes = pairs * T // 64 * 4608
        for warps in (1, 2):
            for ahead in (1, 2) if tpp % 2 == 0 else (1,):
                for stages in (1, 3):
                    a, b = (graph_bench(lambda: _read_tiles[(nprog, pairs)](
                        kc, vc, *meta, buf, out, T, tpp, CHUNKS=chunks, AHEAD=ahead, num_warps=warps,
                        num_stages=stages)) for chunks in (False, True))
                    print(f"{label} ({nprog} x {pairs}, {tpp} tiles) warps {warps} ahead {ahead} stages {stages}: "
                          f"store layout {a * 1e3:.1f} us {nbytes / a / 1e9:.2f} TB/s; contiguous {b * 1e3:.1f} us "
                          f"{nbytes / b / 1e9:.2f} TB/s", flush=True)


def grids():
    for pairs, label in ((8, "batch 1"), (64, "batch 8"), (256, "batch 32")):
        buf = torch.randint(0, 1 << 30, (pairs * TILES * 1152,), dtype=torch.int32, device="cuda")
        nbytes = buf.numel() * 4
        out = torch.empty(pairs * 8192, dtype=torch.int32, device="cuda")
        for streams_per_sm in [4, 8, 12, 16, 24] if pairs == 8 else [8, 12, 16]:
            streams = max(1, streams_per_sm * 132 // pairs)
            tpw = -(-TILES // streams)
            row = []
            for W in (1, 2, 4):
                for strided in (False, True):
                    for ahead in (1, 2) if W == 1 else (1,):
                        nprog = -(-streams // W)
                        ms = graph_bench(lambda: _read_streams[(nprog, pairs)](
                            buf, out, TILES, tpw, nprog * W, W=W, STRIDED=strided, AHEAD=ahead, num_warps=W))
                        row.append(f"W{W}{'s' if strided else 'c'}{ahead} {ms * 1e3:.1f}us/{nbytes / ms / 1e9:.2f}")
            print(f"{label}: {streams_per_sm} streams/SM ({streams} a pair, {tpw} tiles): " + ", ".join(row),
                  flush=True)


if __name__ == "__main__":
    which = sys.argv[1:] or ["layouts", "grids"]
    if "layouts" in which:
        layouts()
    if "grids" in which:
        grids()
