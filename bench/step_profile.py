"""Where a decode step's GPU time goes: kernel time per step by kernel, INT2 graph step against the best BF16 step.

Builds bench/serve.py's random-initialised model and caches at one (context, batch) point, captures each arm's
decode step as a CUDA graph (int2-graph: OscarCache through decode_graph; bf16-flash: the static cache with
SDPA enable_gqa), and runs torch.profiler over 4 replays; kernels are summed by name, per step.

    PYTHONPATH=. python3 bench/step_profile.py --model Qwen3-8B --key-axis channel --point 32768x8 \\
        --out bench/results/step_profile.md
"""

import argparse
import collections
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import serve  # noqa: E402
from kernel import kernel_times  # noqa: E402

from oscar_core.decode_graph import GreedyDecoder  # noqa: E402

REPLAYS = 4


def step_kernels(model, bundle, arm: str, batch: int, context: int) -> tuple[collections.Counter, collections.Counter]:
    """ms and launches per step of each kernel (by name, first 90 characters) over REPLAYS graph replays."""
    cache = serve.make_cache(arm, model, bundle, batch, context, 24)
    ids = torch.full((batch, 1), 11, dtype=torch.long, device="cuda")
    launches = {}
    with serve.attention_for(arm, model), GreedyDecoder(model, cache, ids, max_new_tokens=20) as dec:
        dec.capture(2)
        for _ in range(2):
            dec.replay()
        times = kernel_times(dec.replay, REPLAYS, launches)
    del cache
    torch.cuda.empty_cache()
    ms, counts = collections.Counter(), collections.Counter()
    for name, t in times.items():
        ms[name[:90]] += t
        counts[name[:90]] += launches[name]
    return ms, counts


def point(text: str) -> tuple[int, int]:
    """'32768x8' -> (32768, 8)."""
    try:
        context, batch = map(int, text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected context x batch such as 32768x8, not {text!r}") from None
    return context, batch


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Qwen3-8B", choices=sorted(serve.SHAPES))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--key-axis", default="channel", choices=("token", "channel"))
    p.add_argument("--point", default=(32768, 8), type=point, help="context x batch, such as 32768x8")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--absorb-values", action="store_true",
                   help="then int2-graph-absorbed: R_V and μ_V in v_proj / o_proj (the model changed in place)")
    p.add_argument("--out", default="bench/results/step_profile.md")
    args = p.parse_args()
    layers = args.layers or serve.SHAPES[args.model]["layers"]
    context, batch = args.point
    model = serve.qwen3_model(layers, args.model)
    bundle = serve.random_bundle(layers, serve.kv_heads(args.model), serve.head_dim(args.model), key_axis=args.key_axis,
                                 heads=serve.SHAPES[args.model]["num_attention_heads"],
                                 windows=serve.layer_windows(model.config))
    props = torch.cuda.get_device_properties(0)
    lines = [f"# Kernel time per decode step by kernel ({props.name})", "",
             f"- {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; torch {torch.__version__}; "
             f"random-initialised {args.model} shapes, {layers} layers, keys per {args.key_axis}, {context} x {batch}",
             f"- `bench/step_profile.py`: torch.profiler over {REPLAYS} CUDA-graph replays of one step; ms per step", ""]
    for arm in ("int2-graph", "bf16-flash") + (("int2-graph-absorbed",) if args.absorb_values else ()):
        if arm.endswith("absorbed"):
            from oscar_core.absorb import absorb_value_rotation
            absorb_value_rotation(model, bundle)
        times, counts = step_kernels(model, bundle, arm, batch, context)
        lines += [f"## {arm}: {sum(times.values()):.2f} ms of kernels a step, {sum(counts.values()):.0f} kernels", "",
                  "| ms / step | launches / step | kernel |", "|---|---|---|"]
        lines += [f"| {v:.3f} | {counts[k]:.0f} | `{k.replace('|', '/')}` |" for k, v in times.most_common(args.top)]
        lines.append("")
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
