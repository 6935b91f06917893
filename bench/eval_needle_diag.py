"""Per-layer diagnostic at 8K needle prompts: for the last query (the answer position), relative attention-output
error of each INT2 method vs BF16 and the attention mass it puts on the needle tokens."""
import json, os, random, sys, torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from oscar_core import methods, evaluate as ev
from oscar_core.models import load_model
from oscar_core.bundle import load_bundle
from oscar_core.simulate import simulated_attention
dev = "cuda" if torch.cuda.is_available() else "cpu"
lm = load_model(None, dev); model, tok = lm.model, lm.tokenizer
bundle = load_bundle("zoo/HuggingFaceTB/SmolLM2-135M-Instruct/v1", dev)
tokens = ev.heldout_tokens(sys.argv[1] if len(sys.argv) > 1 else "default-heldout", tok, 8192 * 3)
M = ["int2", "hadamard", "kivi", "oscar"]
per = {m: [methods.layer_method(m, i, 3, 64, bundle) for i in range(30)] for m in M + ["bf16"]}
res = {m: torch.zeros(30) for m in M}; mass = {m: torch.zeros(30) for m in M + ["bf16"]}
rng = random.Random(1); span = None
def attn(module, q, k, v, mask, scaling=None, **kw):
    out, w = sdpa_attention_forward(module, q, k, v, mask, scaling=scaling, **kw)
    i = module.layer_idx
    ql = q[:, :, -1:]
    ref = simulated_attention(ql, k, v, per["bf16"][i], scaling, 64, 256)
    for m in M + ["bf16"]:
        o = simulated_attention(ql, k, v, per[m][i], scaling, 64, 256)
        if m != "bf16":
            res[m][i] += float((o - ref).norm() / ref.norm())
        # attention mass on the needle span, from the same cache view
        lmx = per[m][i]
        kk = k.float().bfloat16().float()
        kq = kk if lmx.key is None else torch.cat([kk[:, :, :64], methods.fake(lmx.key, kk[:, :, 64:])], 2)
        T = k.shape[2]
        mk = methods.int2_mask(torch.tensor([T - 1], device=k.device), T, lmx.key, 64, 256)[0]
        keys = torch.where(mk[:, None], kq[0], kk[0]).repeat_interleave(3, 0)
        p = torch.softmax(scaling * ql[0, :, 0].float()[:, None] @ keys.mT, -1)[:, 0]
        mass[m][i] += float(p[:, span[0]:span[1]].sum(-1).mean())
    return out, w
AttentionInterface.register("diag", attn); model.set_attn_implementation("diag")
n = 6
for trial in range(n):
    key = str(rng.randrange(10000, 100000)); d = [0.1, 0.3, 0.5, 0.7, 0.9, 0.5][trial]
    start = rng.randrange(0, tokens.numel() - 8192); filler = torch.cat([tokens[start:], tokens[:start]])
    ids = ev.needle_prompt(tok, filler, 8192, d, key)
    needle = torch.tensor(tok(ev.NEEDLE.format(key=key), add_special_tokens=False)["input_ids"])
    for s0 in range(len(ids)):
        if torch.equal(ids[s0:s0 + len(needle)], needle): span = (s0, s0 + len(needle)); break
    with torch.inference_mode(): model(input_ids=ids[None].to(dev), use_cache=False, logits_to_keep=1)
out = {"output_error": {m: (res[m] / n).tolist() for m in M}, "needle_mass": {m: (mass[m] / n).tolist() for m in mass}}
json.dump(out, open(os.environ.get("OUT", "bench/results") + "/eval_needle_diag.json", "w"))
for m in M: print(m, "mean out err %.3f" % float(res[m].mean() / n), "layers", [round(x, 2) for x in (res[m] / n).tolist()])
for m in mass: print(m, "needle mass", [round(x, 3) for x in (mass[m] / n).tolist()])
