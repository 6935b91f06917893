"""Window stores on real weights: a sliding model's perplexity through the INT2 cache against BF16 and KIVI-style.

A sliding layer whose window holds INT2 lives in a window store (kvstore.window_cache: the sink, a BF16 ring of W'
and a ring of T INT2 rows, layers.window_recent), which the decode kernels read. Qwen2.5-Coder-0.5B-Instruct
(packaged GGUF) is loaded with Qwen2's own sliding-window settings, layers from --from-layer on sliding over
--window tokens, with its zoo bundle's rotations (keys per channel); perplexity on held-out text through the
teacher-forced simulation `oscar eval` runs (each query reads what the cache holds when it is decoded), which
equals OscarCache's decoding (tests/test_layers.py::test_window_store_decodes_as_simulated):
  bf16   every layer BF16 (the model's own attention, windows applied)
  oscar  the zoo bundle; sliding layers in window stores
  kivi   the calibration-free baseline (keys per channel, values per token, no rotation)

    .venv/bin/python bench/window_store.py --window 1024 --tokens 2048
"""

import argparse
import time
from pathlib import Path

import torch

from oscar_core.bundle import load_bundle
from oscar_core.data import DEFAULT_HELDOUT
from oscar_core.evaluate import heldout_tokens, perplexity
from oscar_core.layers import window_recent

BUNDLE = "zoo/Qwen/Qwen2.5-Coder-0.5B-Instruct/v1"


def main():
    import sliding  # bench/sliding.py, beside this script

    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--from-layer", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=Path("bench/results/window_store.md"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    model, tok = sliding.load(args.window, args.from_layer)
    bundle = load_bundle(BUNDLE)
    q = bundle.manifest.quant
    ids = heldout_tokens(DEFAULT_HELDOUT, tok, args.tokens)[None]
    rows = {}
    with torch.inference_mode():
        rows["bf16"] = perplexity(model, ids, "bf16", None)
        rows["oscar"] = perplexity(model, ids, "oscar", bundle)
        rows["kivi"] = perplexity(model, ids, "kivi", None)
        for k, v in rows.items():
            print(k, v, flush=True)
    recent = window_recent(args.window, q.recent_tokens, q.key_group_size if bundle.key_axis(0) == "channel" else 1)
    lines = [f"# Window stores on real weights ({sliding.MODEL})", "",
             f"`bench/window_store.py --window {args.window} --from-layer {args.from_layer} --tokens {args.tokens}`, "
             f"CPU, float32, {time.perf_counter() - t0:.0f} s; bundle `{BUNDLE}`; layers {args.from_layer}-"
             f"{model.config.num_hidden_layers - 1} slide over {args.window} tokens, their window stores keep "
             f"{q.sink_tokens} sink and {recent} recent BF16 tokens (global layers: {q.recent_tokens} recent); "
             f"one window of {args.tokens} held-out tokens, teacher-forced (`oscar eval`'s simulation).", "",
             "| arm | perplexity | vs BF16 |", "|---|---|---|"]
    lines += [f"| {k} | {v:.3f} | {v / rows['bf16'] - 1:+.2%} |" for k, v in rows.items()]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
