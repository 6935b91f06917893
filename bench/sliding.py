"""Sliding-window layers on real weights: Qwen2.5-Coder-0.5B-Instruct (packaged GGUF) loaded with Qwen2's own
sliding-window settings (use_sliding_window, sliding_window, max_window_layers), so that its upper layers attend to
a window shorter than the text. Measures, on held-out text:
- the BF16 arm of the simulation (what `oscar eval`'s BF16 perplexity and verify's reference run) against the
  model's own forward: largest logit difference, top-1 agreement, perplexity;
- the perplexity of the same weights with global attention (what a simulation blind to windows computed);
- greedy decoding through OscarCache("bf16") (BF16 rings for the sliding layers) against transformers' generate;
- greedy decoding through OscarCache("int2") (the global layers INT2, the sliding ones window stores kept in BF16,
  as Gemma 3's 512-token windows are) from one token, past the window, against the int2 simulation teacher-forced
  on the same tokens (which reads every position as the cache holds it when that position is decoded, so the
  two agree only from a one-token prompt: a prompt's own attention is exact).

    .venv/bin/python bench/sliding.py --window 256 --from-layer 12 --tokens 1024 --out bench/results/sliding.md
"""

import argparse
import contextlib
import io
import math
import time
from pathlib import Path

import torch

from oscar_core.cache import OscarCache
from oscar_core.data import DEFAULT_HELDOUT
from oscar_core.evaluate import heldout_tokens, negative_log_likelihood, perplexity
from oscar_core.layers import layer_specs, windows
from oscar_core.models import resolve
from oscar_core.simulate import simulate_int2

MODEL = "packaged:Qwen2.5-Coder-0.5B-Instruct"


def load(window: int | None, from_layer: int):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source, kwargs, _ = resolve(MODEL)
    config = AutoConfig.from_pretrained(source, **kwargs)
    if window is not None:
        config.use_sliding_window, config.sliding_window, config.max_window_layers = True, window, from_layer
        config.layer_types = ["sliding_attention" if i >= from_layer else "full_attention"
                              for i in range(config.num_hidden_layers)]
    with contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=torch.float32,
                                                     attn_implementation="sdpa", **kwargs).eval()
    return model, AutoTokenizer.from_pretrained(source, **kwargs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--from-layer", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--int2-tokens", type=int, default=400)
    ap.add_argument("--out", type=Path, default=Path("bench/results/sliding.md"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    model, tok = load(args.window, args.from_layer)
    ids = heldout_tokens(DEFAULT_HELDOUT, tok, args.tokens)[None]
    with torch.inference_mode():
        want = model(ids).logits
        with simulate_int2(model, "bf16"):
            got = model(ids).logits
    nll, n = negative_log_likelihood(model, ids)
    own, arm = math.exp(nll / n), perplexity(model, ids, "bf16", None)
    prompt = ids[:, :args.tokens // 2]
    gen = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens, do_sample=False)
    with torch.inference_mode():
        reference = model.generate(prompt, **gen)
        cache = OscarCache(None, "bf16", config=model.config)
        through = model.generate(prompt, past_key_values=cache, **gen)
        int2 = OscarCache(None, "int2", config=model.config)
        first = ids[:, :1]
        out = model.generate(first, past_key_values=int2, output_logits=True, return_dict_in_generate=True,
                             attention_mask=torch.ones_like(first), max_new_tokens=args.int2_tokens,
                             min_new_tokens=args.int2_tokens, do_sample=False)
        decoded = torch.stack(out.logits, 1)[0]
        with simulate_int2(model, "int2"):
            simulated = model(out.sequences[:, :-1]).logits[0]
    ring = cache.ring_layers[0].keys.shape[2]
    sliding = sorted(windows(layer_specs(model.config)))
    store = int2.layers[sliding[0]].store
    del model
    global_model, _ = load(None, 0)
    nll_g, n_g = negative_log_likelihood(global_model, ids)
    rows = [
        ("sliding layers", f"{sliding[0]}-{sliding[-1]}, window {args.window}"),
        ("held-out tokens", f"{ids.shape[1]} ({DEFAULT_HELDOUT})"),
        ("max logit difference, simulated BF16 vs forward",
         f"{float((got - want).abs().max()):.3e} (largest logit {float(want.abs().max()):.1f})"),
        ("top-1 agreement", f"{float((got.argmax(-1) == want.argmax(-1)).float().mean()):.4f}"),
        ("perplexity: model's own forward", f"{own:.4f}"),
        ("perplexity: eval's BF16 arm (simulated)", f"{arm:.4f} (relative difference {abs(arm / own - 1):.1e})"),
        ("perplexity: same weights, every layer global", f"{math.exp(nll_g / n_g):.4f}"),
        (f"greedy {args.new_tokens} tokens after {prompt.shape[1]}: OscarCache('bf16') = generate",
         f"{bool(torch.equal(reference, through))} (each ring holds {ring} tokens)"),
        (f"greedy {args.int2_tokens} tokens after one through OscarCache('int2') against the int2 simulation",
         f"max logit difference {float((decoded - simulated).abs().max()):.3e}, top-1 agreement "
         f"{float((decoded.argmax(-1) == simulated.argmax(-1)).float().mean()):.4f} (each sliding layer a window store "
         f"of {store.sink_tokens} sink and {store.ring_slots} BF16 slots, {store.key_codes.shape[2]} INT2 rows)"),
    ]
    text = (f"# Sliding-window layers on real weights ({MODEL})\n\n`bench/sliding.py --window {args.window} "
            f"--from-layer {args.from_layer} --tokens {args.tokens}`, CPU, float32, "
            f"{time.perf_counter() - t0:.0f} s.\n\n| | |\n|---|---|\n"
            + "".join(f"| {a} | {b} |\n" for a, b in rows))
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
