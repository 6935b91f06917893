"""Needle and perplexity of OSCAR bundles that differ only in their key clip thresholds (key_clip_objective,
key_clip_floor): one model load, the same held-out data and the same needle prompts for every bundle.

Usage: python bench/eval_key_clip.py BASE_BUNDLE DATA OUT_DIR VARIANT.pt ...
Each VARIANT.pt holds {"name", "manifest" (the manifest.json text of the locally exported variant bundle),
"key_clip" [layers, kv_heads]}. The variant bundle is rebuilt from BASE_BUNDLE's tensors with the key clips
replaced (the key rotation, key mean and value side do not depend on the key clip objective) and must hash
to the manifest's sha256, so it is byte for byte the bundle `oscar export` wrote.
Pass 1: contexts 2K/4K/8K, 3 perplexity windows, 5 depths x 2 trials, seed 0 (the prompts of bench/results/eval.md).
Pass 2: contexts 4K/8K, 1 window, 5 depths x 2 more trials, seed 1.
With SEEDS=2,3 in the environment: needle passes only (contexts 4K/8K, 1 window, 5 depths x 2 trials per seed),
the base bundle also with the methods in BASE_METHODS (e.g. kivi,hadamard,bf16) on the same prompts.
"""
import json, os, sys, time
from pathlib import Path

import torch
from safetensors.torch import load_file

from oscar_core.bundle import Manifest, load_bundle, write_bundle
from oscar_core.evaluate import EvalRequest, evaluate
from oscar_core.models import load_model

DEPTHS = (0.1, 0.25, 0.5, 0.75, 0.9)
base, data, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
base_tensors = load_file(str(Path(base) / "rotations.safetensors"))
bundles = {"logit (current)": base}
for spec in sys.argv[4:]:
    v = torch.load(spec)
    manifest = Manifest.model_validate_json(v["manifest"])
    tensors = dict(base_tensors)
    for i, row in enumerate(v["key_clip"]):
        tensors[f"layers.{i}.key_clip"] = row.float()
    path = Path("/tmp/variants") / v["name"]
    written = write_bundle(path, manifest, tensors)
    assert written.tensors.sha256 == manifest.tensors.sha256, (v["name"], "sha mismatch")
    bundles[v["name"]] = str(path)
loaded = load_model(None, "cuda")
results = {}
if os.environ.get("SEEDS"):
    seeds = [int(x) for x in os.environ["SEEDS"].split(",")]
    extra = [m for m in os.environ.get("BASE_METHODS", "").split(",") if m]
    loaded_bundles = {name: load_bundle(path) for name, path in bundles.items()}
    for seed in seeds:
        for name, b in loaded_bundles.items():
            ms = ["oscar"] + (extra if name == "logit (current)" else [])
            r = evaluate(loaded, b, EvalRequest(contexts=[4096, 8192], methods=ms, data=data, samples=1,
                                                depths=DEPTHS, needle_trials=2, seed=seed))
            for m in ms:
                key = name if m == "oscar" else m
                x = results.setdefault(key, {"needle": {}, "perplexity_1window": {}, "answers": []})
                x["needle"][seed] = r["needle_accuracy"][m]
                x["perplexity_1window"][seed] = r["perplexity"][m]
                x["answers"] += [a for a in r["needle_answers"] if a["method"] == m]
                print(f"{key:28s} seed {seed} needle " + " ".join(f"{c}:{a:.0%}" for c, a in r["needle_accuracy"][m].items()),
                      flush=True)
            (out / "key_clip_eval_seeds.json").write_text(json.dumps(results, indent=1))
    sys.exit(0)
for name, path in bundles.items():
    b = load_bundle(path)
    t0 = time.time()
    r1 = evaluate(loaded, b, EvalRequest(contexts=[2048, 4096, 8192], methods=["oscar"], data=data, samples=3,
                                         depths=DEPTHS, needle_trials=2, seed=0))
    r2 = evaluate(loaded, b, EvalRequest(contexts=[4096, 8192], methods=["oscar"], data=data, samples=1,
                                         depths=DEPTHS, needle_trials=2, seed=1))
    results[name] = {"clip_objective": b.manifest.quant.clip_objective, "key_clip": b.manifest.quant.key_clip,
                     "bundle_sha256": b.manifest.tensors.sha256, "perplexity": r1["perplexity"]["oscar"],
                     "needle_seed0": r1["needle_accuracy"]["oscar"], "needle_seed1": r2["needle_accuracy"]["oscar"],
                     "needle_by_depth_seed0": r1["needle"]["oscar"], "needle_by_depth_seed1": r2["needle"]["oscar"],
                     "answers": r1["needle_answers"] + r2["needle_answers"], "seconds": round(time.time() - t0, 1)}
    (out / "key_clip_eval.json").write_text(json.dumps(results, indent=1))
    x = results[name]
    print(f"{name:28s} clip {x['key_clip']:.3f} ppl " + " ".join(f"{c}:{p:.3f}" for c, p in x["perplexity"].items())
          + " needle s0 " + " ".join(f"{c}:{a:.0%}" for c, a in x["needle_seed0"].items())
          + " s1 " + " ".join(f"{c}:{a:.0%}" for c, a in x["needle_seed1"].items()) + f" ({x['seconds']}s)", flush=True)
