"""Benchmark: the INT2 write path of a prefill at 100K tokens x 8 KV heads x d 128 (one layer; --head-dim 256 for
Gemma 3's heads), on the GPU.

Every row moves the same bytes a side: the BF16 keys (or values) in, the INT2 codes and each group's scale and
zero codes out; effective bandwidth = those bytes over the median time (do_bench), against the device's copy
bandwidth (bytes read plus written). Rows:
- write_int2: one side, the rotation split on every call (kvstore.write_int2's signature);
- write_int2_prepared: the same kernel with the split made once, over a sweep of tile, waves, stages, the
  register cap and loading a tile ahead;
- prefill K+V: the whole prefill of an empty store as OscarCache writes it (sink, ring and INT2 rows of both
  sides): append_kv (before this bench), prefill_kv with keys per token and keys per channel (blocks of 64 and
  128), and the torch reference (kvstore.append) that wrote keys-per-channel prefills before prefill_kv; prefill_kv
  over a sweep of tile, waves, stages, the register cap and loading a tile ahead.
Codes agree with kvstore's reference on a 4,096-token prefill (share of equal codes, scale and zero codes).
At head_dim 256 a program rotates C = 128 channels (write.columns; the sweep adds C = 64) and the sweep is smaller
(tiles of 64 and 32, waves 2-8, loading ahead or not). For a bare GPU image:
    python -m bench.write --out bench/results/write_h100.md
    python -m bench.write --head-dim 256 --out bench/results/write_d256.md
"""

import argparse
import json
import os

import torch
from triton.testing import do_bench

from bench.common import copy_bandwidth, layer_of, utc_now
from oscar_core import kvstore, quant
from oscar_core.triton import write

TOKENS, HEADS, D = 100_000, 8, 128


def side_bytes(tokens: int, g: int) -> int:
    """BF16 in, INT2 codes and one scale and one zero code a group out, one side."""
    return tokens * HEADS * (2 * D + D // 4 + 2 * D // g)


def agreement(a: kvstore.Int2KVCache, b: kvstore.Int2KVCache) -> float:
    """Worst share of equal entries over both sides' codes, scale and zero codes."""
    shares = []
    for side in ("key", "value"):
        shares.append((quant.unpack_int2(getattr(a, f"{side}_codes")) ==
                       quant.unpack_int2(getattr(b, f"{side}_codes"))).float().mean().item())
        for name in ("scale", "zero"):
            shares.append((getattr(a, f"{side}_{name}") == getattr(b, f"{side}_{name}")).float().mean().item())
    return min(shares)


def prefill_arms(lay, axis: str, g: int):
    """name -> fn(store, k, v) writing a prefill into an empty store."""
    split = (write.prepare_rotation(lay.key_rotation, lay.key_mean),
             write.prepare_rotation(lay.value_rotation, lay.value_mean))
    arms = {"torch reference (kvstore.append)": lambda st, k, v: kvstore.append(st, k, v, lay)}
    if axis == "token":
        arms["append_kv (bt 64)"] = lambda st, k, v: write.append_kv(st, k, v, *split, lay.key_clip, lay.value_clip,
                                                                     evict=False)
    if D > 128:
        settings = [(waves, 1, None, ahead, c) for waves in (2, 4, 8) for ahead in (False, True)
                    for c in ((128, 64) if g <= 64 else (128,))]        # a group within a program's channels
        tiles = (64, 32) if axis == "token" else (64,)
    else:
        settings = [(waves, 1, regs, ahead, None) for waves in (2, 4, 8) for regs in (None, 168)
                    for ahead in (False, True)]
        settings.append((4, 2, None, False, None))
        tiles = (64, 128) if axis == "token" or g == 128 else (g,)      # blocks of 128 in tiles of 64 or one tile
    for bt in tiles:
        for waves, stages, regs, ahead, c in settings:
            cap = f" registers {regs}" if regs else ""
            cols = f" columns {c}" if c else ""
            arms[f"prefill_kv bt {bt} waves {waves} stages {stages}{cap} ahead {int(ahead)}{cols}"] = (
                lambda st, k, v, bt=bt, waves=waves, stages=stages, regs=regs, ahead=ahead, c=c: write.prefill_kv(
                    st, k, v, *split, lay.key_clip, lay.value_clip, block_t=bt, waves=waves, num_stages=stages,
                    registers=regs, ahead=ahead, columns_a_program=c))
    return arms


def bench_prefill(gen, axis: str, g: int, bandwidth: float) -> list[dict]:
    lay = layer_of(HEADS, D, gen)
    rows = []
    small = torch.randn(2, 1, HEADS, 4096, D, generator=gen, device="cuda").bfloat16()
    big = torch.randn(2, 1, HEADS, TOKENS, D, generator=gen, device="cuda").bfloat16()
    nbytes = 2 * side_bytes(TOKENS, g)
    ref = kvstore.empty_cache(1, HEADS, D, 4096, g, g, device="cuda", key_axis=axis)
    kvstore.advance(ref, 4096)
    kvstore.append(ref, small[0], small[1], lay)
    for name, fn in prefill_arms(lay, axis, g).items():
        st = kvstore.empty_cache(1, HEADS, D, 4096, g, g, device="cuda", key_axis=axis)
        kvstore.advance(st, 4096)
        fn(st, small[0], small[1])
        same = agreement(st, ref)
        st = kvstore.empty_cache(1, HEADS, D, TOKENS, g, g, device="cuda", key_axis=axis)
        kvstore.advance(st, TOKENS)
        ms = do_bench(lambda: fn(st, big[0], big[1]), warmup=3 if "torch" in name else 10,
                      rep=20 if "torch" in name else 100, return_mode="median")
        rows.append(dict(path=f"prefill K+V, keys per {axis}" + (f" (blocks of {g})" if axis == "channel" else ""),
                         arm=name, ms=ms, gbps=nbytes / ms / 1e6, share=nbytes / (ms * 1e-3) / bandwidth, same=same))
        print(json.dumps(rows[-1]), flush=True)
        del st
        torch.cuda.empty_cache()
    return rows


def bench_side(gen, bandwidth: float) -> list[dict]:
    lay = layer_of(HEADS, D, gen)
    x = torch.randn(TOKENS, HEADS, D, generator=gen, device="cuda").bfloat16()
    ref = kvstore.write_int2(x[:4096], lay.key_rotation, lay.key_clip, 64, lay.key_mean)
    split = write.prepare_rotation(lay.key_rotation, lay.key_mean)
    arms = {"write_int2 (splits R each call)": lambda xx, **kw: write.write_int2(xx, lay.key_rotation, lay.key_clip,
                                                                                  64, lay.key_mean)}
    if D > 128:
        settings = [(bt, waves, 1, None, ahead, c) for bt in (64, 32) for waves in (2, 4) for ahead in (False, True)
                    for c in (128, 64)]
    else:
        settings = [(bt, waves, 1, regs, ahead, None) for bt in (64, 128) for waves in (2, 4)
                    for regs in (None, 128, 168) for ahead in (False, True)]
        settings += [(128, 2, stages, 128, False, None) for stages in (2, 3)]
    for bt, waves, stages, regs, ahead, c in settings:
        cap = f" registers {regs}" if regs else ""
        cols = f" columns {c}" if c else ""
        arms[f"write_int2_prepared bt {bt} waves {waves} stages {stages}{cap} ahead {int(ahead)}{cols}"] = (
            lambda xx, bt=bt, waves=waves, stages=stages, regs=regs, ahead=ahead, c=c: write.write_int2_prepared(
                xx, split, lay.key_clip, 64, block_t=bt, waves=waves, num_stages=stages, registers=regs,
                ahead=ahead, columns_a_program=c))
    rows = []
    for name, fn in arms.items():
        same = min((a == b).float().mean().item() for a, b in zip(fn(x[:4096]), ref))
        ms = do_bench(lambda: fn(x), warmup=10, rep=100, return_mode="median")
        nbytes = side_bytes(TOKENS, 64)
        rows.append(dict(path="one side, keys per token", arm=name, ms=ms, gbps=nbytes / ms / 1e6,
                         share=nbytes / (ms * 1e-3) / bandwidth, same=same))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def render(rows: list[dict], bandwidth: float) -> str:
    lines = [f"# INT2 write path at 100K tokens x {HEADS} KV heads x d {D} (python -m bench.write)", "",
             f"{torch.cuda.get_device_properties(0).name}; torch {torch.__version__}; "
             f"{utc_now()}; copy bandwidth "
             f"{bandwidth / 1e12:.2f} TB/s (read + write). Effective bandwidth: BF16 in plus INT2 codes, scale and zero "
             "codes out, over the median time. Equal: worst share of codes / scale / zero codes equal to kvstore's "
             "reference on a 4,096-token prefill.", ""]
    for path in dict.fromkeys(r["path"] for r in rows):
        part = [r for r in rows if r["path"] == path]
        best = min(part, key=lambda r: r["ms"])
        lines += [f"## {path}", "", "| arm | ms | GB/s | share of copy bandwidth | equal |", "|---|---|---|---|---|"]
        for r in part:
            mark = " **best**" if r is best else ""
            lines.append(f"| {r['arm']}{mark} | {r['ms']:.4f} | {r['gbps']:.0f} | {r['share']:.0%} | {r['same']:.5f} |")
        lines.append("")
    return "\n".join(lines)


def main():
    global D
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/write.md")
    ap.add_argument("--head-dim", type=int, default=D, choices=(64, 128, 256))
    args = ap.parse_args()
    D = args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth()
    rows = bench_side(gen, bandwidth)
    rows += bench_prefill(gen, "token", 64, bandwidth)
    rows += bench_prefill(gen, "channel", 64, bandwidth)
    rows += bench_prefill(gen, "channel", 128, bandwidth)
    text = render(rows, bandwidth)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(dict(bandwidth=bandwidth, rows=rows), f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
