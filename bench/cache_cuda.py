"""OscarCache on CUDA: decode steps read by the Triton decode kernel (oscar_attention) vs the torch read.

Greedy generation after a long prompt (so INT2 rows exist beyond the sink + recent BF16 windows), twice
through an "oscar" OscarCache: torch reads (kernel_reads=False: the store dequantized every step) and
kernel reads (the default on CUDA inside oscar_attention). Also the kernel path teacher-forced on the
torch path's tokens, so every step's logits compare, and a BF16 cache for scale.

    PYTHONPATH=. python3 bench/cache_cuda.py --model .gpu/tiny-llama --bundle .gpu/zoo/local/tiny-llama/v1 \\
        --text .gpu/heldout.txt --out bench/results/cache_cuda.md
"""

import argparse
import datetime
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from oscar_core.bundle import load_bundle
from oscar_core.cache import OscarCache, oscar_attention


@torch.inference_mode()
def greedy(model, ids, cache, new_tokens, forced=None):
    """(tokens [n], logits float32 [n, V], decode-step seconds [n − 1]); tokens from `forced` if given."""
    logits = [model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1].float()]
    tokens, times = [], []
    for i in range(new_tokens):
        tokens.append(int(forced[i]) if forced is not None else int(logits[-1].argmax()))
        if i == new_tokens - 1:
            break
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(torch.tensor([[tokens[-1]]], device=ids.device), past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        logits.append(out.logits[0, -1].float())
    return torch.tensor(tokens), torch.stack(logits), times


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".gpu/tiny-llama")
    p.add_argument("--bundle", default=".gpu/zoo/local/tiny-llama/v1")
    p.add_argument("--text", default=".gpu/heldout.txt")
    p.add_argument("--prompt-tokens", type=int, default=600)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", default="bench/results/cache_cuda.md")
    args = p.parse_args()

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = model.cuda().eval()
    bundle = load_bundle(args.bundle)
    ids = tok(Path(args.text).read_text(), return_tensors="pt").input_ids[:, :args.prompt_tokens].cuda()
    n = args.new_tokens

    def cache(method="oscar", kernel_reads=None):
        return OscarCache(bundle, method, kernel_reads=kernel_reads)

    bf16_tokens, _, _ = greedy(model, ids, cache("bf16", False), n)
    torch_cache = cache(kernel_reads=False)
    torch_tokens, torch_logits, torch_times = greedy(model, ids, torch_cache, n)
    kernel_cache = cache()
    with oscar_attention(model, kernel_cache):
        kernel_tokens, kernel_logits, kernel_times = greedy(model, ids, kernel_cache, n)
    forced_cache = cache()
    with oscar_attention(model, forced_cache):
        _, forced_logits, _ = greedy(model, ids, forced_cache, n, forced=torch_tokens)
    _, bf16_logits, _ = greedy(model, ids, cache("bf16", False), n, forced=torch_tokens)
    layer = forced_cache.layers[0]
    assert layer.kernel_problem is None, layer.kernel_problem
    int2_rows = layer.int2_tokens()

    same = int((kernel_tokens == torch_tokens).all())
    first_diff = next((i for i in range(n) if kernel_tokens[i] != torch_tokens[i]), None)
    diff = (forced_logits - torch_logits)[1:]          # decode steps only (row 0 is the shared prefill)
    ref = torch_logits[1:]
    rel = (diff.norm(dim=-1) / ref.norm(dim=-1)).max().item()
    if first_diff is not None:
        top2 = torch_logits[first_diff].topk(2).values
        kernel_top2 = forced_logits[first_diff].topk(2).values
        margin = (f"; at that step the torch-read top-2 logits are {top2[0]:.4f} and {top2[1]:.4f} "
                  f"(gap {top2[0] - top2[1]:.4f}), the kernel-read (teacher-forced) {kernel_top2[0]:.4f} and "
                  f"{kernel_top2[1]:.4f}")
    top1 = (forced_logits[1:].argmax(-1) == ref.argmax(-1)).float().mean().item()
    bf16_same = int((bf16_tokens == torch_tokens).sum())
    bf16_rel = ((bf16_logits - torch_logits)[1:].norm(dim=-1) / ref.norm(dim=-1)).max().item()
    ms = lambda t: 1e3 * statistics.median(t[1:])     # noqa: E731  (the first step compiles the kernel)

    cmd = (f"PYTHONPATH=. python3 bench/cache_cuda.py --model {args.model} --bundle {args.bundle} "
           f"--text {args.text} --prompt-tokens {args.prompt_tokens} --new-tokens {n} --out {args.out}")
    lines = [
        "# OscarCache on CUDA: Triton kernel reads vs torch reads", "",
        f"Measured {datetime.date.today()} on {torch.cuda.get_device_name()}, torch {torch.__version__}; "
        f"model `{args.model}` (bf16, sdpa), bundle `{args.bundle}` ({bundle.manifest.quant.sink_tokens} sink + "
        f"{bundle.manifest.quant.recent_tokens} recent BF16 tokens); greedy, {ids.shape[1]}-token prompt from "
        f"`{args.text}`, {n} new tokens; {int2_rows} INT2 rows per layer and side at the end.", "",
        f"    {cmd}", "",
        "| figure | value |", "|---|---|",
        f"| greedy tokens, kernel reads = torch reads | {'yes' if same else 'no'} "
        f"({int((kernel_tokens == torch_tokens).sum())}/{n} equal"
        f"{'' if first_diff is None else f', first difference at token {first_diff}' + margin}) |",
        f"| teacher-forced decode steps: max abs logit difference | {diff.abs().max().item():.4f} |",
        f"| teacher-forced decode steps: max relative logit error (L2 per step) | {rel:.2e} |",
        f"| teacher-forced decode steps: same top-1 token | {100 * top1:.1f}% |",
        f"| for scale: BF16-cache greedy tokens equal to the OSCAR torch-read tokens | {bf16_same}/{n} |",
        f"| for scale: teacher-forced BF16 cache vs OSCAR torch reads, max relative logit error | {bf16_rel:.2e} |",
        f"| decode step, torch reads (median, ms) | {ms(torch_times):.2f} |",
        f"| decode step, kernel reads (median, ms) | {ms(kernel_times):.2f} |", "",
        f"Torch-read tokens: `{torch_tokens.tolist()}`", "",
        f"Kernel-read tokens: `{kernel_tokens.tolist()}`", "",
        "Step times are for a 2-layer toy model at short context (Python and launch overhead dominate); "
        "they are not a kernel benchmark (bench/kernel.py is).", ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
