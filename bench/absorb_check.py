"""R_V absorbed into v_proj / o_proj on real models (oscar_core/absorb.py): the same logits, the same INT2 decode.

For each packaged model and its zoo bundle (CPU, float32, the shipped held-out text):
- the largest logit difference over a 512-token prompt between the model and its absorbed copy (no INT2 cache);
- 16 decode steps after a 1,000-token prefill through OscarCache("oscar") on the model against
  OscarCache("oscar", values_absorbed=True) on the absorbed copy (torch reads): KL of the next-token
  distributions and top-1 agreement.

    python3 bench/absorb_check.py --out bench/results/absorb_check.md      (after `make models`)
"""

import argparse
import copy
import datetime
from pathlib import Path

import torch

from oscar_core import absorb
from oscar_core.bundle import load_bundle
from oscar_core.cache import OscarCache
from oscar_core.models import load_model

MODELS = [("default", "zoo/HuggingFaceTB/SmolLM2-135M-Instruct/v1"),
          ("packaged:Qwen2.5-Coder-0.5B-Instruct", "zoo/Qwen/Qwen2.5-Coder-0.5B-Instruct/v1")]
TEXT = Path(__file__).parent.parent / "oscar_core/corpus/heldout.txt"


def decode_log_probs(model, cache, ids: torch.Tensor, prefill: int, steps: int) -> torch.Tensor:
    """Next-token log-probabilities after the prefill and after each of `steps` forced tokens, [steps + 1, vocab]."""
    out = [model(ids[:, :prefill], past_key_values=cache).logits[:, -1]]
    for t in ids[0, prefill:prefill + steps]:
        out.append(model(t.view(1, 1), past_key_values=cache).logits[:, -1])
    return torch.log_softmax(torch.cat(out).float(), -1)


@torch.no_grad()
def check(spec: str, bundle_dir: str, prefill: int = 1000, steps: int = 16) -> dict:
    lm = load_model(spec)
    bundle = load_bundle(bundle_dir)
    ids = lm.tokenizer(TEXT.read_text()[:20000], return_tensors="pt").input_ids[:, :prefill + steps]
    absorbed = copy.deepcopy(lm.model)
    layers = absorb.absorb_value_rotation(absorbed, bundle)
    want = lm.model(ids[:, :512]).logits
    moved = (absorbed(ids[:, :512]).logits - want).abs().max().item()
    ref = decode_log_probs(lm.model, OscarCache(bundle, "oscar", kernel_reads=False), ids, prefill, steps)
    got = decode_log_probs(absorbed, OscarCache(bundle, "oscar", kernel_reads=False, values_absorbed=True), ids,
                           prefill, steps)
    kl = (ref.exp() * (ref - got)).sum(-1)
    return dict(model=bundle.manifest.model.id, layers=len(layers), moved=moved, largest=want.abs().max().item(),
                kl_max=kl.max().item(), kl_mean=kl.mean().item(),
                top1=(ref.argmax(-1) == got.argmax(-1)).float().mean().item())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/absorb_check.md")
    args = p.parse_args()
    rows = [check(spec, bundle) for spec, bundle in MODELS]
    lines = ["# R_V absorbed into v_proj / o_proj on real models (bench/absorb_check.py)", "",
             f"- {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; torch {torch.__version__}; CPU, "
             "float32; the shipped held-out text", "- logits: largest |difference| over a 512-token prompt, model "
             "against its absorbed copy; decode: 16 steps after 1,000 tokens through OscarCache('oscar') against "
             "OscarCache('oscar', values_absorbed=True) on the absorbed copy", "",
             "| model | layers absorbed | largest logit | logits moved | decode KL max | decode KL mean | top-1 agreement |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['layers']} | {r['largest']:.1f} | {r['moved']:.1e} | {r['kl_max']:.1e} | "
              f"{r['kl_mean']:.1e} | {r['top1']:.3f} |" for r in rows]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
