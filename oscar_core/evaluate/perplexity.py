"""`oscar eval`: perplexity and needle retrieval of every KV cache method at several context lengths.

Perplexity (teacher-forced, simulate.py): each window of L held-out tokens is run once per method with
every query reading the cache as an INT2 cache would hold it when that query is decoded;
    ppl = exp( Σ_windows Σ_t −log p(x_{t+1} | x_≤t) / #targets ).
Needle (generation through OscarCache): a pass key is hidden at relative depth δ of L tokens of
held-out filler and asked back at the end. The prompt but its last token is prefilled once (exact
attention, as a serving engine's prefill), its K/V are written into each method's OscarCache, and
model.generate decodes the last prompt token and the answer through that cache (on CUDA, read by the
Triton decode kernel: attention.py); exact match of the key.
"""

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from oscar_core.calibrate.data import DEFAULT_HELDOUT, bos_prefix, texts, token_windows
from oscar_core.calibrate.models import cache_argument
from oscar_core.errors import OscarError, UsageError
from oscar_core.metrics import bucket_figures
from oscar_core.serve import methods
from oscar_core.serve.attention import oscar_attention
from oscar_core.serve.cache import OscarCache, exact_cache, fill
from oscar_core.serve.simulate import simulate_int2

NEEDLE_INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
                "Find it and memorize it. I will quiz you about it.\n")
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
NEEDLE_QUESTION = "\nWhat is the pass key? The pass key is"
DEPTHS = (0.1, 0.5, 0.9)
ANSWER_TOKENS = 8
LOGIT_CHUNK = 1024
CUDA_BATCH = 8


@dataclass
class EvalRequest:
    contexts: list[int] = field(default_factory=lambda: [2048])
    methods: list[str] = field(default_factory=lambda: list(methods.METHODS))
    data: str = DEFAULT_HELDOUT
    samples: int = 2
    depths: tuple[float, ...] = DEPTHS
    needle_trials: int = 1
    seed: int = 0
    batch: int = 1


@dataclass
class Step:
    """What an evaluation tells its on_step. text: the work under way, or (done) one plain line of a part just
    finished and its figures; report: the report so far, JSON-ready, once a context is finished (every context in
    report["finished"] complete), else None."""
    text: str
    done: bool = False
    report: dict | None = None


def default_batch(device: str) -> int:
    """Prompts answered together unless asked otherwise: CUDA_BATCH on a GPU, where a decode step costs about the same
    for 8 sequences as for one; 1 on the CPU, where it costs nearly B times as much (docs/ruler.md)."""
    return CUDA_BATCH if str(device).startswith("cuda") else 1


def in_batches(items: list, size: int, key=lambda item: None) -> list[list]:
    """items in order, in runs of at most `size` that share key(item) (answered in one generate call)."""
    out = []
    for item in items:
        if out and len(out[-1]) < size and key(out[-1][0]) == key(item):
            out[-1].append(item)
        else:
            out.append([item])
    return out


def check_lengths(contexts: list[int], method_names: list[str], bundle, max_context: int | None = None) -> None:
    """One-line UsageErrors for no or unknown methods and for contexts under 64 tokens or beyond the model's limit."""
    if not method_names:
        raise UsageError(f"--methods names no method: give some of {', '.join(methods.METHODS)}")
    for m in method_names:
        methods.check_method(m)
    limit = max_context or bundle.manifest.model.max_position_embeddings
    for c in contexts:
        if c < 64:
            raise UsageError(f"--context {c} is too short: use at least 64 tokens")
        if limit and c > limit:
            raise UsageError(f"--context {c} is beyond the model's limit of {limit} tokens")


def check_request(req: EvalRequest, bundle, max_context: int | None = None) -> None:
    """One-line UsageErrors for bad contexts, methods or depths (before any model is loaded)."""
    check_lengths(req.contexts, req.methods, bundle, max_context)
    if req.samples < 1 or req.needle_trials < 0 or any(not 0 <= d <= 1 for d in req.depths):
        raise UsageError("--samples must be positive, --needle-trials non-negative and depths in [0, 1]")
    if req.batch < 1:
        raise UsageError("--batch must be positive")


def check_bundle(bundle, info, config=None) -> None:
    """The bundle must have been calibrated on this model (same attention facts and config) and, given the model's
    config, rotate exactly its attention layers."""
    b = bundle.manifest.model
    facts = ("num_layers", "num_heads", "num_kv_heads", "head_dim")
    if any(getattr(b, f) != getattr(info, f) for f in facts) or b.config_sha256 != info.config_sha256:
        raise OscarError(f"bundle {bundle.manifest.name} is for model {b.id} ({b.num_layers} layers, "
                         f"{b.num_kv_heads} KV heads of dim {b.head_dim}), not {info.id} ({info.num_layers} layers, "
                         f"{info.num_kv_heads} KV heads of dim {info.head_dim})")
    if config is not None:
        from oscar_core.evaluate.verify import check_layers

        layers = check_layers(bundle.manifest, config)
        if not layers.ok:
            raise OscarError(f"bundle {bundle.manifest.name}: {layers.detail}")


def heldout_tokens(source: str, tokenizer, needed: int) -> torch.Tensor:
    """The first `needed` tokens of a source (documents joined with EOS, no BOS); fewer if the source is shorter."""
    out = []
    for window in token_windows(texts(source), tokenizer, 256):
        out.append(window)
        if len(out) * 256 >= needed:
            break
    if not out:
        raise OscarError(f"data source {source} holds no text (fewer than 256 tokens)")
    return torch.cat(out)[:needed]


def windows_of(tokens: torch.Tensor, length: int, n: int, source: str, prefix: list[int] = ()) -> torch.Tensor:
    """Up to n consecutive windows [n', length] of the token stream, each `prefix` (the tokenizer's bos_prefix)
    then length − len(prefix) stream tokens; an error if there is not one."""
    body = length - len(prefix)
    have = min(n, tokens.numel() // body)
    if have == 0:
        raise OscarError(f"data source {source} holds {tokens.numel()} tokens, fewer than one window of {length}")
    rows = tokens[:have * body].reshape(have, body)
    return torch.cat([torch.tensor(list(prefix), dtype=rows.dtype).expand(have, -1), rows], dim=1)


@torch.inference_mode()
def token_nll(model, ids: torch.Tensor) -> torch.Tensor:
    """−log p(x_{t+1} | x_≤t) of each target of ids [1, L] → [L − 1] float64 (CPU); logits made LOGIT_CHUNK rows
    at a time."""
    hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state[0]
    head = model.get_output_embeddings()
    targets = ids[0, 1:]
    out = []
    for s in range(0, targets.numel(), LOGIT_CHUNK):
        logits = head(hidden[s:s + LOGIT_CHUNK][: targets.numel() - s]).float()
        out.append(torch.nn.functional.cross_entropy(logits, targets[s:s + LOGIT_CHUNK], reduction="none").double())
    return torch.cat(out).cpu()


def negative_log_likelihood(model, ids: torch.Tensor) -> tuple[float, int]:
    """(Σ −log p(x_{t+1} | x_≤t), number of targets) of ids [1, L]."""
    nll = token_nll(model, ids)
    return float(nll.sum()), nll.numel()


def window_nll(model, windows: torch.Tensor, method: str, bundle) -> torch.Tensor:
    """Per-target NLL [n, L − 1] of windows [n, L] with every query reading the method's simulated INT2 cache."""
    with simulate_int2(model, method, bundle):
        return torch.stack([token_nll(model, row[None].to(model.device)) for row in windows])


def perplexity(model, windows: torch.Tensor, method: str, bundle) -> float:
    """exp(mean NLL) over all windows [n, L] with every query reading the method's simulated INT2 cache."""
    return math.exp(float(window_nll(model, windows, method, bundle).mean()))


def encode(tokenizer, text: str) -> torch.Tensor:
    """Token ids [n] of a piece of prompt text, without special tokens (prompts join such pieces id by id)."""
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def needle_prompt(tokenizer, filler: torch.Tensor, length: int, depth: float, key: str) -> torch.Tensor:
    """Token ids [length]: the tokenizer's bos_prefix, intro, filler with the needle at relative depth `depth`,
    the question."""
    bos = torch.tensor(bos_prefix(tokenizer), dtype=torch.long)
    intro = torch.cat([bos, encode(tokenizer, NEEDLE_INTRO)])
    needle, question = encode(tokenizer, NEEDLE.format(key=key)), encode(tokenizer, NEEDLE_QUESTION)
    n = length - len(intro) - len(needle) - len(question)
    if n < 0 or filler.numel() < n:
        raise OscarError(f"not enough filler text for a needle prompt of {length} tokens")
    at = round(depth * n)
    return torch.cat([intro, filler[:at], needle, filler[at:n], question])


def answer_matches(text: str, key: str) -> bool:
    """Exact match: the first run of digits of the answer is the key."""
    digits = "".join(c if c.isdigit() else " " for c in text).split()
    return bool(digits) and digits[0] == key


@torch.inference_mode()
def greedy_answers(model, tokenizer, prompt: torch.Tensor, method_names: list[str], bundle, num_layers: int,
                   max_new_tokens: int = ANSWER_TOKENS) -> dict[str, tuple[str, int, int, int]]:
    """batch_answers of one prompt [L]: {method: (answer text, cached tokens, OscarCache bytes, BF16 bytes)}."""
    return batch_answers(model, tokenizer, [prompt], method_names, bundle, num_layers, max_new_tokens)[0]


def exact_prefill(model, prompts: list[torch.Tensor], like: OscarCache) -> tuple[Cache, torch.Tensor | None]:
    """(An exact cache of every prompt [L_b] but its last token, the prefills left-padded with zeros to the longest,
    each sequence's pads int32 [B] on the device, None if there are none). Each prompt is prefilled alone, exactly as
    a batch of one: the same K/V whatever the batch, and no B x L x L padding mask at long contexts. Every layer of
    `like` keeps keys and values (no state layers: batch_answers answers a hybrid model's prompts one at a time)."""
    cache_arg, longest = cache_argument(model), max(p.numel() for p in prompts) - 1
    alone = []
    for p in prompts:
        alone.append(exact_cache(like))
        model(input_ids=p[None, :-1].to(model.device), **{cache_arg: alone[-1]}, use_cache=True, logits_to_keep=1)
    if len(alone) == 1:
        return alone[0], None
    out = exact_cache(like)
    for i, layer in enumerate(out.layers):
        rows = [c.layers[i] for c in alone]
        k, v = (rows[0].keys.new_zeros(len(rows), *rows[0].keys.shape[1:-2], longest, rows[0].keys.shape[-1])
                for _ in range(2))
        for b, r in enumerate(rows):
            n = r.keys.shape[-2]
            k[b, :, longest - n:], v[b, :, longest - n:] = r.keys[0], r.values[0]
            r.keys = r.values = None        # each prompt's copy freed as it is stacked
        layer.update(k, v)
    pads = torch.tensor([longest + 1 - p.numel() for p in prompts], dtype=torch.int32, device=model.device)
    return out, pads if bool(pads.any()) else None


def answer_length(tokens: torch.Tensor, stop: set[int]) -> int:
    """New tokens of one sequence of a batch as it would have generated them alone: up to and with its first stop
    token (greedy generation stops there; a batch goes on, padding it)."""
    at = [i for i, t in enumerate(tokens.tolist()) if t in stop]
    return at[0] + 1 if at else tokens.numel()


@torch.inference_mode()
def batch_answers(model, tokenizer, prompts: list[torch.Tensor], method_names: list[str], bundle, num_layers: int,
                  max_new_tokens: int = ANSWER_TOKENS) -> list[dict[str, tuple[str, int, int, int]]]:
    """Per prompt, {method: (answer text, cached tokens, OscarCache bytes, BF16 bytes)}: the greedy answer of up to
    max_new_tokens to each prompt [L_b] through each method's cache, the prompts answered together as one left-padded
    batch. Each prompt but its last token is prefilled with exact attention (exact_prefill), its K/V written into
    each method's OscarCache with its pads skipped (cache.fill), and model.generate decodes the last prompt tokens
    and the answers through that cache, the attention mask hiding the pads. A sequence's answer and cached tokens
    (L_b + new tokens − 1) are what it would get alone, up to float reduction order; its bytes are the batch's
    cache bytes divided by the batch size: its share, exact when the prompts have one length (needle prompts),
    else counting the longest prompt's capacity (an INT2 store) or, for SideStore layers, the mean of the prompts.
    A hybrid model's prompts are answered one at a time, its layers without a KV cache starting every method's decode
    from a copy of their prefill state."""
    like = OscarCache(bundle, "bf16", num_layers=num_layers)
    if len(prompts) > 1 and len(like.kv_layers) + len(like.ring_layers) < len(like.layers):
        # A hybrid model's linear-attention or Mamba states would take the pads in: its prompts one at a time.
        return [batch_answers(model, tokenizer, [p], method_names, bundle, num_layers, max_new_tokens)[0]
                for p in prompts]
    prefill, starts = exact_prefill(model, prompts, like)
    lengths = [p.numel() for p in prompts]
    longest, batch = max(lengths), len(prompts)
    pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    ids = torch.full((batch, longest), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, longest - p.numel():], mask[b, longest - p.numel():] = p, 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    stop = model.generation_config.eos_token_id
    stop = set(stop if isinstance(stop, list) else [] if stop is None else [stop])
    cache_arg, out = cache_argument(model), [{} for _ in prompts]
    for m in method_names:
        # Allocated for the prompts and the answers exactly, so the bytes reported are what the cache holds.
        cache = fill(OscarCache(bundle, m, num_layers=num_layers, capacity=longest + max_new_tokens), prefill, starts)
        with oscar_attention(model, cache):
            gen = model.generate(ids, attention_mask=mask, **{cache_arg: cache}, max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad)
        nbytes, bf16_bytes = cache.nbytes() // batch, cache.bf16_nbytes() // batch
        for b, n in enumerate(lengths):
            new = answer_length(gen[b, longest:], stop)
            out[b][m] = (tokenizer.decode(gen[b, longest:longest + new], skip_special_tokens=True), n + new - 1,
                         nbytes, bf16_bytes)
    return out


def evaluate(loaded, bundle, req: EvalRequest, on_step: Callable[[Step], None] | None = None) -> dict:
    """Perplexity and needle accuracy of every method at every context; returns the JSON-ready report. on_step hears
    each part under way, a line of figures for each context's perplexity and needles, and the report so far after
    each (Step)."""
    check_bundle(bundle, loaded.info, loaded.model.config)
    check_request(req, bundle, loaded.info.max_position_embeddings)
    model, tok = loaded.model, loaded.tokenizer
    step = on_step or (lambda s: None)
    longest = max(req.contexts)
    tokens = heldout_tokens(req.data, tok, longest * req.samples)
    report = {"model": loaded.info.id, "bundle": f"{bundle.manifest.name} {bundle.manifest.version}",
              "bundle_sha256": bundle.manifest.tensors.sha256, "data": req.data, "contexts": req.contexts,
              "methods": req.methods, "labels": {m: methods.LABELS[m] for m in req.methods},
              "sink_tokens": bundle.manifest.quant.sink_tokens, "recent_tokens": bundle.manifest.quant.recent_tokens,
              "bits_per_element": {m: {str(c): round(methods.bits_per_element(m, c, bundle), 4) for c in req.contexts}
                                   for m in req.methods},
              "bits_per_element_by_layer_type": {
                  m: {kind: {str(c): round(methods.bits_per_element(m, c, bundle, kind), 4) for c in req.contexts}
                      for kind in methods.layer_kinds(bundle)} for m in req.methods},
              "batch": req.batch, "perplexity": {m: {} for m in req.methods}, "windows": {}, "buckets": {},
              "needle": {m: {} for m in req.methods}, "needle_prompts": {}, "needle_answers": [],
              "needle_accuracy": {m: {} for m in req.methods}, "memory": {}, "timings_s": {},
              "finished": {"perplexity": [], "needle": []}}
    t0 = time.perf_counter()
    for c in req.contexts:
        wins = windows_of(tokens, c, req.samples, req.data, bos_prefix(tok))
        report["windows"][str(c)] = int(wins.shape[0])
        nll = {}
        for m in req.methods:
            step(Step(f"perplexity {m} @ {c}"))
            nll[m] = window_nll(model, wins, m, bundle)
            report["perplexity"][m][str(c)] = math.exp(float(nll[m].mean()))
        if "bf16" in nll:  # the NLL excess over BF16 by position: an error that grows with position shows late
            report["buckets"][str(c)] = bucket_figures({m: x - nll["bf16"] for m, x in nll.items() if m != "bf16"})
        report["finished"]["perplexity"].append(c)
        step(Step(f"perplexity @ {c}: " + ", ".join(f"{m} {report['perplexity'][m][str(c)]:.3f}"
                                                    for m in req.methods), done=True, report=report))
    report["timings_s"]["perplexity"] = round(time.perf_counter() - t0, 1)

    t0 = time.perf_counter()
    rng = random.Random(req.seed)
    for c in req.contexts:
        for m in req.methods:
            report["needle"][m][str(c)] = {str(d): 0.0 for d in req.depths}
        report["needle_prompts"][str(c)] = {str(d): req.needle_trials for d in req.depths}
        trials = []     # (depth, key, prompt), drawn in the order of the seed's stream
        for d in req.depths:
            for _ in range(req.needle_trials):
                key = str(rng.randrange(10000, 100000))
                start = rng.randrange(0, max(tokens.numel() - c, 1))
                filler = torch.cat([tokens[start:], tokens[:start]])
                trials.append((d, key, needle_prompt(tok, filler, c, d, key)))
        done = 0
        for batch in in_batches(trials, req.batch):
            step(Step(f"needle @ {c}, prompts {done + 1}-{done + len(batch)} of {len(trials)}"))
            done += len(batch)
            answers = batch_answers(model, tok, [p for *_, p in batch], req.methods, bundle, loaded.info.num_layers)
            for (d, key, _), per_method in zip(batch, answers):
                for m, (text, length, nbytes, bf16_bytes) in per_method.items():
                    hit = answer_matches(text, key)
                    report["needle"][m][str(c)][str(d)] += hit / req.needle_trials
                    report["needle_answers"].append({"method": m, "context": c, "depth": d, "key": key,
                                                     "answer": text.strip(), "correct": hit})
                    report["memory"][m] = {"tokens": length, "bytes": nbytes, "bf16_bytes": bf16_bytes,
                                           "ratio": round(bf16_bytes / nbytes, 3),
                                           "bits_per_element": round(16 * nbytes / bf16_bytes, 4)}
        for m in req.methods:
            per = report["needle"][m][str(c)]
            if per:
                report["needle_accuracy"][m][str(c)] = sum(per.values()) / len(per)
        report["finished"]["needle"].append(c)
        step(Step(f"needle @ {c}: " + ", ".join(f"{m} {report['needle_accuracy'][m].get(str(c), 0):.0%}"
                                                for m in req.methods) + f" ({len(trials)} prompts)",
                  done=True, report=report))
    report["timings_s"]["needle"] = round(time.perf_counter() - t0, 1)
    return report
