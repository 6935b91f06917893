"""Which layers' keys take which INT2 axis, and why: the per-layer picture of a bundle, and what it buys end to end.

For a calibration directory and the bundle exported from it: per layer, the relative attention-output error of
its keys on the calibration probe for each key axis (per token in U_Q·H·P_br, centred; per channel over blocks
of G tokens, KIVI-style) and the axis the export kept (manifest quant.layers); then teacher-forced perplexity on
held-out text for BF16, KIVI-style, the bundle with every layer's keys per token (the published format) and the
bundle as exported. Writes markdown + JSON.

    .venv/bin/python bench/key_axis.py --calib runs/qwen-coder --bundle zoo/Qwen/Qwen2.5-Coder-0.5B-Instruct/v1 \
        --model packaged:Qwen2.5-Coder-0.5B-Instruct --tokens 2048 --out bench/results/key_axis_qwen-coder.md
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from oscar_core.bundle import load_bundle
from oscar_core.data import DEFAULT_HELDOUT
from oscar_core.derive import DeriveOptions
from oscar_core.evaluate import heldout_tokens, perplexity, windows_of
from oscar_core.export import export_bundle
from oscar_core.methods import bits_per_element
from oscar_core.models import load_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calib", required=True)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", default=DEFAULT_HELDOUT)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    t0 = time.time()
    bundle = load_bundle(args.bundle)
    m = bundle.manifest
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = export_bundle(args.calib, tmp, version="token", name=m.name,
                                opts=DeriveOptions(key_group_size=m.quant.key_group_size,
                                                   value_group_size=m.quant.value_group_size, key_formats=(("token", "oscar"),)),
                                sink_tokens=m.quant.sink_tokens, recent_tokens=m.quant.recent_tokens)
        token_only = load_bundle(path)
    loaded = load_model(args.model or m.calibration.model_source)
    ids = windows_of(heldout_tokens(args.data, loaded.tokenizer, args.tokens * args.windows), args.tokens,
                     args.windows, args.data)
    arms = {"BF16": ("bf16", None), "KIVI-style": ("kivi", None),
            "OSCAR, keys per token in every layer": ("oscar", token_only), "OSCAR, as exported": ("oscar", bundle)}
    ppl = {name: perplexity(loaded.model, ids, method, b) for name, (method, b) in arms.items()}
    bits = {name: bits_per_element(method, 131072, b) for name, (method, b) in arms.items()}
    layers = [entry.model_dump() for entry in (m.quant.layers or [])]
    report = {"bundle": args.bundle, "name": m.name, "tokens": args.tokens, "windows": args.windows, "data": args.data,
              "perplexity": ppl, "bits_per_element_128k": bits, "layers": layers, "seconds": round(time.time() - t0)}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# Key axis per layer: {m.name} {m.version}", "",
             f"`python bench/key_axis.py --calib {args.calib} --bundle {args.bundle} --tokens {args.tokens}` on the CPU "
             f"({report['seconds']} s). Held-out: {args.data}, {args.windows} x {args.tokens} tokens, teacher-forced.", "",
             "| arm | perplexity | gap to BF16 | bits/element @128K |", "|---|---|---|---|"]
    for name, p in ppl.items():
        lines.append(f"| {name} | {p:.3f} | {100 * (p / ppl['BF16'] - 1):+.1f}% | {bits[name]:.3f} |")
    lines += ["", "Per layer: relative attention-output error of the keys alone on the calibration probe "
              "(Σ‖(Ŝ−S)V‖²/Σ‖SV‖²), for each axis with its own searched clip; the smaller is kept.", "",
              "| layer | keys per token | keys per channel | kept |", "|---|---|---|---|"]
    for entry in layers:
        e = entry["errors"]
        lines.append(f"| {entry['layer']} | {e.get('token', float('nan')):.4g} | {e.get('channel', float('nan')):.4g} "
                     f"| {entry['key_axis']} |")
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
