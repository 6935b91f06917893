"""Generation on real weights, as a user runs it: a real model and its zoo bundle, prompts of real text at long
context, prefill through the model, then greedy decoding; time, tokens per second, memory and tokens per cache.

Each (context, batch) point runs these arms on the same prompts (B windows of the held-out text that ships with
oscar, one token stream cycled from B offsets when the text is shorter than B·context):
  bf16-static   transformers StaticCache, prefill through the model with a DynamicCache (flash SDPA, causal)
                copied in, then every decode step one CUDA-graph replay (oscar_core.serve.decode_graph)
  bf16-flash    the same cache and graph, attention as flash SDPA over the whole buffer (bench.serve's
                stand-in for the best BF16 step: its time, not its tokens, which read the few unwritten slots)
  oscar-graph   OscarCache(bundle, "oscar") inside oscar_attention: the prefill writes the INT2 stores
                (write.prefill_kv), then every decode step one CUDA-graph replay
  oscar-eager   the same cache through model.generate (do_sample=False): eager steps, as a plain caller runs it
  bf16-generate model.generate with its default cache (DynamicCache): the plain caller's BF16 baseline
Decode time: CUDA events around all steps after the warm-up; prefill: wall clock around the model call (each
arm runs once on the first 1,024 tokens before, so Triton compiles there). 'same tokens': the greedy tokens equal
to bf16-static's before the first difference, mean over sequences (INT2 and BF16 caches differ, so greedy
paths part at some point; a quality figure is `oscar eval`'s perplexity, bench/results/real_models.md).

    python -m bench.generate --model packaged:Qwen2.5-Coder-0.5B-Instruct \\
        --bundle zoo/Qwen/Qwen2.5-Coder-0.5B-Instruct/v1 --points 8192x32,32000x1,32000x8,32000x32 \\
        --out bench/results/generate_qwen.md --json bench/results/generate_qwen.json
    python -m bench.generate --bundle zoo/HuggingFaceTB/SmolLM2-135M-Instruct/v1 --points 8000x8,8000x32 \\
        --out bench/results/generate_smollm2.md --json bench/results/generate_smollm2.json
"""

import argparse
import contextlib
import gc
import json
import sys
import time
from pathlib import Path

import torch

from bench.common import GIB, attention_for, utc_now
from oscar_core.calibrate.data import heldout_prompts
from oscar_core.calibrate.models import load_model
from oscar_core.errors import OscarError
from oscar_core.formats.bundle import load_bundle
from oscar_core.metrics import same_prefix
from oscar_core.serve.cache import OscarCache, oscar_attention
from oscar_core.serve.decode_graph import GreedyDecoder
ARMS = ("bf16-static", "bf16-flash", "oscar-graph", "oscar-eager", "bf16-generate")


def bf16_cache(model, ids: torch.Tensor, new_tokens: int):
    """A StaticCache of the prompt but its last token (prefilled with a DynamicCache), and the prefill's seconds."""
    from transformers import DynamicCache, StaticCache

    dynamic = DynamicCache()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model(ids[:, :-1], past_key_values=dynamic, use_cache=True, logits_to_keep=1)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    static = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens + 8)
    pos = torch.arange(ids.shape[1] - 1, device=ids.device)
    for i, layer in enumerate(dynamic.layers):
        static.update(layer.keys, layer.values, i, {"cache_position": pos})
    del dynamic
    return static, seconds


def decode(model, cache, ids: torch.Tensor, arm: str, new_tokens: int, warmup: int = 2) -> dict:
    """Prefill `ids` (what the cache does not hold yet), capture a step, then time the rest as graph replays."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with attention_for(arm, model), GreedyDecoder(model, cache, ids, max_new_tokens=new_tokens) as dec:
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        dec.capture(warmup)
        steps = new_tokens - dec.produced
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        while dec.produced < new_tokens:
            dec.replay()
        end.record()
        torch.cuda.synchronize()
        tokens = dec.tokens.cpu()
    return dict(prefill_s=prefill_s, ms=start.elapsed_time(end) / steps, tokens=tokens)


def generate_eager(model, cache, ids: torch.Tensor, new_tokens: int) -> dict:
    """model.generate (through `cache`, an OscarCache, or None for transformers' default) with the tokenizer's
    all-ones attention mask: a call with one new token timed alone (the prefill), then the whole call."""
    mask = torch.ones_like(ids)
    with torch.inference_mode(), oscar_attention(model, cache) if cache is not None else contextlib.nullcontext():
        times = []
        for tokens in (1, new_tokens):
            if cache is not None:
                cache.reset()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=tokens,
                                 min_new_tokens=tokens, do_sample=False)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    prefill_s, total = times
    ms = (total - prefill_s) * 1e3 / (new_tokens - 1)
    return dict(prefill_s=prefill_s, ms=ms, tokens=out[:, ids.shape[1]:].cpu())


def run_arm(lm, bundle, arm: str, ids: torch.Tensor, new_tokens: int) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    batch, context = ids.shape
    row = dict(arm=arm, context=context, batch=batch)
    try:
        if arm == "bf16-generate":
            cache = None
            row |= generate_eager(lm.model, None, ids, new_tokens)
            c = lm.model.config
            d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
            row["cache_gib"] = 2 * c.num_hidden_layers * batch * c.num_key_value_heads * (context + new_tokens) * d * 2 / GIB
        elif arm.startswith("bf16"):
            cache, prefill_s = bf16_cache(lm.model, ids, new_tokens)
            row |= decode(lm.model, cache, ids[:, -1:], arm, new_tokens)
            row["prefill_s"] = prefill_s
            row["cache_gib"] = sum(t.numel() * t.element_size() for layer in cache.layers
                                   for t in (layer.keys, layer.values)) / GIB
        else:
            cache = OscarCache(bundle, "oscar", capacity=context + new_tokens + 8)
            if arm == "oscar-graph":
                row |= decode(lm.model, cache, ids, arm, new_tokens)
            else:
                row |= generate_eager(lm.model, cache, ids, new_tokens)
            row["cache_gib"] = cache.nbytes() / GIB
        row["tokens_per_s"] = batch * 1e3 / row["ms"]
        del cache
    except Exception as e:  # an arm that does not fit or fails is reported, not fatal
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    return row


def table(rows: list) -> list:
    """The results table's lines: each arm's tokens/s against bf16-static's and bf16-flash's at its point."""
    lines = ["| context x batch | arm | prefill s | ms a step | tokens/s | vs bf16-static | vs bf16-flash | cache GiB "
             "| same tokens as bf16-static |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        point = f"{row['context']} x {row['batch']}"
        if "error" in row:
            lines.append(f"| {point} | {row['arm']} | {row['error']} | | | | | | |")
            continue
        base = {r["arm"]: r for r in rows if r["context"] == row["context"] and r["batch"] == row["batch"]
                and "error" not in r}
        ratio = [f"{row['tokens_per_s'] / base[a]['tokens_per_s']:.2f}x" if a in base else "-"
                 for a in ("bf16-static", "bf16-flash")]
        same = "-" if "bf16-static" not in base or row["arm"] in ("bf16-static", "bf16-flash") else \
            f"{same_prefix(torch.as_tensor(row['tokens']), torch.as_tensor(base['bf16-static']['tokens'])):.1f} " \
            f"of {len(row['tokens'][0])}"
        lines.append(f"| {point} | {row['arm']} | {row['prefill_s']:.3f} | {row['ms']:.2f} | {row['tokens_per_s']:.0f} "
                     f"| {ratio[0]} | {ratio[1]} | {row['cache_gib']:.3f} | {same} |")
    return lines


def render(rows: list, lm, bundle, args) -> str:
    gpu = torch.cuda.get_device_name()
    import transformers

    lines = [f"# Generation on real weights ({gpu})", "",
             f"- {utc_now()}; torch {torch.__version__}, "
             f"transformers {transformers.__version__}; model `{args.model}` "
             f"({lm.info.architecture}, {lm.model.config.num_hidden_layers} layers, "
             f"{lm.model.config.num_attention_heads} / {lm.model.config.num_key_value_heads} heads, bf16), "
             f"bundle `{args.bundle}` ({bundle.manifest.name})",
             f"- `python -m bench.generate {' '.join(sys.argv[1:])}`",
             f"- {args.new_tokens} greedy tokens a sequence; ms a step and tokens/s over the steps after the "
             "capture; cache: the bytes the cache holds (StaticCache: its buffers; OscarCache.nbytes; DynamicCache: "
             "2 · layers · B · H_kv · (context + new tokens) · d · 2)", ""]
    lines += table(rows)
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="hub id, directory, .gguf or packaged:<name> (default: the embedded one)")
    p.add_argument("--bundle", required=True)
    p.add_argument("--points", default="8192x8", help="context x batch, comma separated")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--out", default="bench/results/generate.md")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench.generate needs a CUDA GPU (its decode steps are CUDA-graph replays)")
    try:
        lm = load_model(args.model, "cuda", "bfloat16")
        bundle = load_bundle(args.bundle, "cuda")
    except OscarError as e:
        sys.exit(f"error: {e}")
    rows = []
    for point in args.points.split(","):
        context, batch = (int(x) for x in point.split("x"))
        ids = heldout_prompts(lm.tokenizer, context, batch).cuda()
        for arm in args.arms.split(","):      # compiles the Triton kernels and captures once at this batch
            run_arm(lm, bundle, arm, ids[:, :1024], 8)
        for arm in args.arms.split(","):
            rows.append(run_arm(lm, bundle, arm, ids, args.new_tokens))
    Path(args.out).write_text(render(rows, lm, bundle, args))
    if args.json:
        Path(args.json).write_text(json.dumps([{k: (v.tolist() if torch.is_tensor(v) else v) for k, v in r.items()}
                                               for r in rows]))
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
