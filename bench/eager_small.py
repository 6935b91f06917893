"""Eager decode attention at batch 1, as a plain caller sees it: wall clock per call of back-to-back calls from
Python (host launch cost included), on shape classes of bench/shapes.py at 8K, 16K and 100K tokens.

Arms, each the same decode_attention call but for how the caller holds its tensors:
  fixed     q and out the same tensors every call (a caller with static buffers): after two calls a CUDA graph
            reading and writing them is replayed alone
  out=None  the same q, no out: the output comes from the allocator (a freed output's block handed back)
  moving    q and out cycled over three pairs of tensors: the graph with its own query and output, a copy in
            and a copy out each call (every eager call before the graphs at the caller's addresses)
  launches  graph=False: the three or four launches themselves (CachedKernel)
beside bf16 SDPA eager, and the CUDA-graph replay of SDPA and of the INT2 call (device time alone). err: the
fixed arm's output against kvstore.decode_attention_reference. For a bare GPU image:
    PYTHONPATH=. python3 bench/eager_small.py [--out bench/results/eager_small.md]
"""

import argparse
import datetime
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
from shapes import SHAPES, eager_ms, graph_bench, layer_of, random_store, rel_err, sdpa_call  # noqa: E402

from oscar_core import kvstore  # noqa: E402
from oscar_core.triton import decode  # noqa: E402

CLASSES = ["Qwen3-8B 32/8 d128", "Qwen3-8B 32/8 d128, keys per channel",
           "Qwen2.5-7B 28/4 d128 (GQA 7), keys per channel", "Qwen3-32B 64/8 d128 (GQA 8)", "GQA 16 32/2 d128",
           "Llama-3.2-1B 32/8 d64", "Qwen2.5-0.5B 14/2 d64, keys per channel", "SmolLM2-135M 9/3 d64, keys per channel",
           "Gemma-3-12B 16/8 d256", "Gemma-3-270M 4/1 d256"]
CONTEXTS = [8192, 16384, 100_000]


def row_of(shape, context, gen) -> dict:
    label, heads, kv_heads, d, gk, gv, axis = shape
    layer = layer_of(kv_heads, d, gen)
    cache = random_store(1, kv_heads, d, context, gk, gv, axis, gen)
    pairs = [(torch.randn(1, heads, d, generator=gen, device="cuda").bfloat16(),
              torch.empty(1, heads, d, dtype=torch.bfloat16, device="cuda")) for _ in range(3)]
    q, out = pairs[0]
    turn = [0]

    def call(qq, oo=None, **kw):
        return decode.decode_attention(qq, cache, layer.key_rotation, layer.value_rotation, layer.value_mean,
                                       d ** -0.5, max_length=context, out=oo, **kw)

    def moving():
        turn[0] = (turn[0] + 1) % 3
        return call(*pairs[turn[0]])

    arms = dict(fixed=lambda: call(q, out), none=lambda: call(q), moving=moving,
                launches=lambda: call(q, out, graph=False))
    ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation, layer.value_mean,
                                             d ** -0.5)
    for _ in range(3):
        arms["fixed"]()
    row = dict(shape=label, context=context, err=rel_err(out, ref),
               **{name: eager_ms(fn, 200) for name, fn in arms.items()},
               int2_graph=graph_bench(lambda: call(q, out, graph=False)))
    cache.graphs.clear()
    sdpa = sdpa_call(q, kv_heads, context, gen)
    row.update(sdpa=eager_ms(sdpa, 200), sdpa_graph=graph_bench(sdpa))
    del sdpa
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/eager_small.md")
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    lines = ["# Eager decode attention at batch 1 (bench/eager_small.py)", "",
             f"- {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {props.name}; torch "
             f"{torch.__version__}, triton {triton.__version__}",
             "- ms; eager: wall clock per call of 200 back-to-back calls; graph: median CUDA-graph replay; x SDPA: "
             "SDPA eager / INT2 eager; arms as in the script's docstring", "",
             "| shape | context x 1 | SDPA eager | fixed | out=None | moving | launches | x SDPA fixed | x SDPA moving "
             "| SDPA graph | INT2 graph | err |", "|" + "---|" * 12]
    for label in CLASSES:
        shape = next(s for s in SHAPES if s[0] == label)
        for context in CONTEXTS:
            r = row_of(shape, context, gen)
            lines.append(f"| {label} | {context} | {r['sdpa']:.4f} | {r['fixed']:.4f} | {r['none']:.4f} | "
                         f"{r['moving']:.4f} | {r['launches']:.4f} | {r['sdpa'] / r['fixed']:.2f}x | "
                         f"{r['sdpa'] / r['moving']:.2f}x | {r['sdpa_graph']:.4f} | {r['int2_graph']:.4f} | "
                         f"{r['err']:.1e} |")
            print(lines[-1], flush=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
