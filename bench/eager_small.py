"""Eager decode attention at batch 1, as a plain caller sees it: wall clock per call of back-to-back calls
from Python (host launch cost included). The default call (a CUDA graph of the call kept on the store: copy
q in, replay, copy out), the direct call (graph=False: three or four launches), the one fused launch (query
rotation inside every program, merge by the last program of each KV head), and bf16 SDPA; plus each one's
CUDA-graph replay time (device time alone). Qwen3-8B attention shape. For a bare GPU image:
    PYTHONPATH=. python3 bench/eager_small.py [--out bench/results/eager_small.md]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from shapes import eager_ms, graph_bench, layer_of, random_store, rel_err  # noqa: E402

from oscar_core import kvstore  # noqa: E402
from oscar_core.triton import decode  # noqa: E402

HEADS, KV_HEADS, D = 32, 8, 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/eager_small.md")
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    lines = ["# Eager decode attention at small batch (bench/eager_small.py)", "",
             f"{torch.cuda.get_device_properties(0).name}; Qwen3-8B shape (32/8 heads, d 128, groups 64, keys per "
             "token); eager: wall clock per call of 100 calls; graph: median CUDA-graph replay; ms", "",
             "| context x batch | SDPA eager | default eager | direct eager | fused eager | SDPA graph | direct graph "
             "| fused graph | default err | fused err |", "|---|---|---|---|---|---|---|---|---|---|"]
    for context, bsz in ((8192, 1), (16384, 1), (32768, 1), (100_000, 1), (8192, 4), (32768, 4)):
        layer = layer_of(KV_HEADS, D, gen)
        cache = random_store(bsz, KV_HEADS, D, context, 64, 64, "token", gen)
        q = torch.randn(bsz, HEADS, D, generator=gen, device="cuda").bfloat16()
        out = torch.empty_like(q)

        def int2(fused, graph=False):
            return lambda: decode.decode_attention(q, cache, layer.key_rotation, layer.value_rotation,
                                                   layer.value_mean, D ** -0.5, max_length=context, out=out,
                                                   fused=fused, graph=graph)

        ref = kvstore.decode_attention_reference(q, cache, layer.key_rotation, layer.value_rotation,
                                                 layer.value_mean, D ** -0.5)
        int2(False, None)()
        int2(False, None)()
        errs = [rel_err(out, ref)]
        int2(True)()
        errs.append(rel_err(out, ref))
        k = torch.randn(bsz, KV_HEADS, context, D, generator=gen, device="cuda").bfloat16()
        v = torch.randn_like(k)

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, scale=D ** -0.5,
                                                                    enable_gqa=True)

        row = [eager_ms(sdpa), eager_ms(int2(False, None)), eager_ms(int2(False)), eager_ms(int2(True)),
               graph_bench(sdpa), graph_bench(int2(False)), graph_bench(int2(True))]
        lines.append(f"| {context} x {bsz} | " + " | ".join(f"{x:.4f}" for x in row) + " | " +
                     " | ".join(f"{e:.2e}" for e in errs) + " |")
        print(lines[-1], flush=True)
        del cache, k, v
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
