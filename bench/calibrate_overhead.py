"""Cost of gathering statistics: forward passes with the calibration hooks vs plain forward passes.

Same model, same token samples; plain and hooked passes alternate so that machine noise hits both
alike; the median of each is reported. Target: hooks cost at most 25% over plain forward passes.

    .venv/bin/python -m bench.calibrate_overhead --out bench/results/calibrate_overhead.md     (make bench-calibrate)
"""

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path

import torch

from oscar_core.calibrate.data import load_samples
from oscar_core.calibrate.models import load_model, resolve_device
from oscar_core.calibrate.statistics import AttentionStatistics, observe_attention


def timed(fn, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--out", default="bench/results/calibrate_overhead.md")
    args = p.parse_args()
    device = resolve_device(args.device)
    loaded = load_model(args.model, device)
    info = loaded.info
    ids, _ = load_samples(None, loaded.tokenizer, args.batch_size * args.reps, args.seq_len, 0)
    ids = ids.to(device)
    stats = AttentionStatistics(info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim, device=device)
    model = loaded.model

    def plain(batch):
        model(input_ids=batch, use_cache=False, logits_to_keep=1)

    def hooked(batch):
        with observe_attention(model, stats.observe):
            model(input_ids=batch, use_cache=False, logits_to_keep=1)

    plain_s, hooked_s = [], []
    with torch.inference_mode():
        plain(ids[: args.batch_size])  # warm-up
        hooked(ids[: args.batch_size])  # warm-up, and the probes are taken here
        for r in range(args.reps):
            batch = ids[r * args.batch_size:(r + 1) * args.batch_size]
            plain_s.append(timed(lambda: plain(batch), device))
            hooked_s.append(timed(lambda: hooked(batch), device))
    a, b = statistics.median(plain_s), statistics.median(hooked_s)
    tokens = args.batch_size * args.seq_len
    overhead = b / a - 1
    lines = [
        "# Calibration overhead: hooked vs plain forward passes", "",
        f"Measured {datetime.date.today()} on {device} ({platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}), model {info.id}, "
        f"{args.reps} alternating repetitions of batch {args.batch_size} x {args.seq_len} tokens; medians.", "",
        "| pass | median s | tokens/s |", "|---|---|---|",
        f"| plain forward | {a:.3f} | {tokens / a:,.0f} |",
        f"| forward + statistics hooks | {b:.3f} | {tokens / b:,.0f} |", "",
        f"Overhead: **{overhead:+.1%}** (target: at most +25%): "
        f"{'met' if overhead <= 0.25 else 'missed'}.", "",
        "The hooks add, per layer, four batched float64 Gram products (C_Q, C_S, key and value second moments)",
        "and two sums; the probes for the clip search are copied only from the first samples.",
        f"Command: `.venv/bin/python -m bench.calibrate_overhead --seq-len {args.seq_len} --batch-size "
        f"{args.batch_size} --reps {args.reps}`", ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
