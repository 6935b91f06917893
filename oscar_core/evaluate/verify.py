"""`oscar verify`: check a bundle, then measure what its INT2 cache does to attention and to the model, and gate it.

run_verify(VerifyRequest) is the whole check; the command only parses flags and renders the report.

Checks: manifest schema, checksum, tensor names and shapes (bundle.load_bundle), orthogonality of every
rotation, clip thresholds in (0, 1], finite means, and the model's attention facts against the manifest.

Per layer and KV head, on held-out queries Q, keys K and values V (post-RoPE, fidelity.capture_attention), for
OSCAR (the bundle), KIVI-style, Hadamard (QuaRot-style) and no rotation, K̂ and V̂ as each method stores them
(methods.layer_method: per-token or per-channel keys; the first sink tokens exact), S = causal softmax:
    attention error ‖softmax(s·QK̂ᵀ)V̂ − softmax(s·QKᵀ)V‖ / ‖softmax(s·QKᵀ)V‖      (what the layer outputs)
    key logit error ‖Q(K̂−K)ᵀ‖/‖QKᵀ‖,  value output error ‖S(V̂−V)‖/‖SV‖          (each side alone)
over LAYER_QUERIES query positions spread evenly past the sink, against every key before them. The logit error
is relative to the logits' own size, so a layer with huge logits looks good on it while INT2 noise of a few
logits flattens its attention; the attention error sees that.

End to end (simulate.py: every query reads what the INT2 cache would hold when it is decoded, recent window
in BF16): next-token KL against BF16, top-1 agreement and perplexity of each method, and BF16 perplexity, at
the length a bundle is served (default 32,768 tokens on CUDA, the model's context where shorter; 2,048 on the CPU,
where long contexts are slow: pass --seq-len), with the NLL excess over BF16 per position bucket (metrics.BUCKETS
equal spans of the sample: an error that grows with position shows in the last buckets), and needle retrieval
through each method's cache at the same length (perplexity.needle_prompt, greedy_answers).

The gate: FAIL when
- the length quantizes too little to judge (too_short);
- OSCAR's next-token KL is above KIVI-style's (by more than KL_TIE = 0.001 nats), or its perplexity is above
  KIVI-style's (by more than PPL_TIE = 0.1%), or its KL is above max_kl (--max-kl, else the manifest's max_kl;
  no absolute bound when neither is set: a KL that is fine at 2K grows with the INT2 tokens a longer context holds,
  so the gate compares with KIVI-style at the same length and bits);
- its NLL excess in any position bucket is above KIVI-style's in that bucket by more than BUCKET_TIE nats a token
  plus BUCKET_SIGMAS standard errors of the per-token difference (a 128-token bucket of a short sample is noise;
  a 4K bucket of a 32K sample is not);
- it retrieves fewer needles than KIVI-style at that length, by more than BUCKET_SIGMAS standard errors of the
  difference of the two rates (1 of 10 against 2 of 10 is noise; 1 of 10 against 8 of 10 is not);
- only when given, its mean key logit error is above --max-logit-error.
On CUDA the INT2 write path of OSCAR's per-token sides is the Triton kernel and the decode kernel is checked
against exact attention at the last position; on the CPU the torch reference runs.

Long because `oscar verify` is one report: the checks, the per-layer errors, the end-to-end figures, the needles
and the gate read and write the same report dict; split by measure if another is added.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from oscar_core.calibrate.data import DEFAULT_HELDOUT
from oscar_core.errors import OscarError
from oscar_core.evaluate.fidelity import capture_attention, roundtrip
from oscar_core.formats.bundle import Bundle, Manifest, ModelInfo, bundle_layers
from oscar_core.metrics import bucket_figures, causal_attention, logit_error, relative_error
from oscar_core.rotations import orthogonality_error
from oscar_core.serve import methods

ORTHOGONALITY_TOLERANCE = 1e-5
VERIFY_FILE = "verify.json"  # `oscar verify --record` writes the headline figures beside the bundle
COMPARED = ("oscar", "kivi", "hadamard", "int2")  # per layer and end to end, at the same bits
DEFAULT_SEQ_LEN = {"cuda": 32768, "cpu": 2048}       # held-out tokens per sample, by device type
BUCKET_TIE = 1e-3                                      # nats a token: a bucket's excess this close to KIVI's ties,
BUCKET_SIGMAS = 2.0                                    # ... or within this many standard errors of the difference
DEFAULT_NEEDLES = {"cuda": 10, "cpu": 0}               # needle prompts at the verify length, by device type
NEEDLE_METHODS = ("bf16", "oscar", "kivi")
LAYER_QUERIES = 512                                   # query positions per layer measurement
LOGIT_CHUNK = 512                                     # positions whose logits are made at once
KL_TIE, PPL_TIE = 1e-3, 1e-3  # OSCAR loses to KIVI-style by more than this much KL (nats) / relative perplexity
FACTS = ("architecture", "num_layers", "num_heads", "num_kv_heads", "head_dim")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def check_tensors(bundle: Bundle) -> list[Check]:
    m, checks = bundle.manifest, []
    rotations = {k: v for k, v in bundle.tensors.items() if k.endswith("_rotation")}
    worst_name = max(rotations, key=lambda k: orthogonality_error(rotations[k]))
    worst = orthogonality_error(rotations[worst_name])
    checks.append(Check("rotations orthogonal", worst <= ORTHOGONALITY_TOLERANCE,
                        f"max |RᵀR − I| = {worst:.1e} ({worst_name})"))
    clips = torch.cat([v.flatten() for k, v in bundle.tensors.items() if k.endswith("_clip")])
    checks.append(Check("clip thresholds in (0, 1]", bool(((clips > 0) & (clips <= 1)).all()),
                        f"range {float(clips.min()):.3f}..{float(clips.max()):.3f}"))
    finite = all(torch.isfinite(v).all() for v in bundle.tensors.values())
    checks.append(Check("tensors finite", bool(finite), f"{len(bundle.tensors)} tensors"))
    checks.append(Check("manifest and checksum", True, f"schema {m.schema_version}, sha256 {m.tensors.sha256[:12]}…"))
    return checks


def check_model(manifest_model: ModelInfo, model: ModelInfo) -> Check:
    diffs = [f"{f} {getattr(model, f)} ≠ {getattr(manifest_model, f)}" for f in FACTS
             if getattr(model, f) != getattr(manifest_model, f)]
    if not diffs and model.config_sha256 != manifest_model.config_sha256:
        diffs.append("config hash differs (rope or attention settings)")
    return Check("model matches manifest", not diffs, "; ".join(diffs) or f"{model.id} ({model.architecture})")


def check_layers(manifest: Manifest, config) -> Check:
    """The layers with rotations are the model's layers that hold INT2 tokens (every layer, or a hybrid model's
    attention layers, less sliding layers kept whole in BF16: layers.int2_layer_ids), and the sliding windows the
    manifest records are the model's."""
    from oscar_core.layers import int2_layer_ids, layer_specs, windows

    specs, q = layer_specs(config), manifest.quant
    want, have = int2_layer_ids(specs, q.sink_tokens, q.recent_tokens), manifest.rotation.layers
    ok = (None if have is None else sorted(have)) == want
    where = lambda ids: "every layer" if ids is None else "layers " + ", ".join(map(str, ids))  # noqa: E731
    detail = (where(have) if ok else
              f"the bundle rotates {where(have)}, the model's attention layers are {where(want)}")
    sliding = {str(i): w for i, w in (windows(specs) or {}).items()} or None
    if ok and sliding != manifest.rotation.windows:
        ok, detail = False, f"the bundle's sliding windows are {manifest.rotation.windows}, the model's {sliding}"
    return Check("layers match the model's attention layers", ok, detail)


def first_failure(checks: list[Check]) -> str | None:
    bad = next((c for c in checks if not c.ok), None)
    return None if bad is None else f"{bad.name}: {bad.detail}"


def load_checked(path) -> Bundle:
    """The bundle at `path` if it passes verify's integrity checks (load_bundle: schema, checksum, tensor names and
    shapes; check_tensors: orthogonal, clips in (0, 1], finite), else OscarError naming the first that fails: what
    push and upstream export hold a bundle to before anything leaves the machine."""
    from oscar_core.formats.bundle import load_bundle

    bundle = load_bundle(path)
    failure = first_failure(check_tensors(bundle))
    if failure:
        raise OscarError(f"bundle check failed for {bundle.path}: {failure}")
    return bundle


def too_short(seq_len: int, manifest: Manifest) -> str | None:
    """Why seq_len held-out tokens cannot judge the bundle's INT2 cache, or None. The first sink and the last recent
    tokens stay BF16, so a sample quantizes seq_len − sink − recent tokens: none is too little, and so is less than
    one group of tokens where some layer keeps keys per channel (a key block must leave the BF16 window whole)."""
    q = manifest.quant
    channel = any(e.key_axis == "channel" for e in q.layers or ())
    quantized, need = seq_len - q.sink_tokens - q.recent_tokens, q.key_group_size if channel else 1
    if quantized >= need:
        return None
    what = "nothing is quantized" if quantized <= 0 else f"only {quantized} tokens are quantized"
    return (f"{what} at {seq_len} tokens (the first {q.sink_tokens} and the last {q.recent_tokens} stay BF16), too "
            f"little to judge the INT2 cache: use --seq-len {q.sink_tokens + q.recent_tokens + need} or more")


def restored(side: methods.Side | None, x: torch.Tensor, sink: int, write=None) -> torch.Tensor:
    """x [KVH, T, d] as the method's INT2 cache gives it back (float64, original space, first `sink` tokens exact).

    Per-token sides go through fidelity.roundtrip (the Triton write kernel when `write` is given); per-channel
    sides through methods.fake, blocks of G tokens from the sink on (a trailing partial block stays exact)."""
    if side is None:
        return x.double()
    if side.axis == "token":
        d = x.shape[-1]
        rotation = side.rotation if side.rotation is not None else torch.eye(d).expand(x.shape[0], d, d)
        mean = None if side.mean is None else side.mean.to(x.device)
        clip = side.clip.to(x.device) if isinstance(side.clip, torch.Tensor) else side.clip
        return roundtrip(x, rotation.to(x.device).double(), mean, clip, side.group_size, sink, write)
    return torch.cat([x[:, :sink].double(), methods.fake(side, x[:, sink:]).double()], dim=1)


def query_positions(t: int, sink: int, n: int = LAYER_QUERIES) -> torch.Tensor | None:
    """n query positions spread evenly over [sink, t) (None: every position, when that is no more)."""
    if t - sink <= n:
        return None
    return torch.linspace(sink, t - 1, n).round().long().unique()


def layer_errors(held: dict, bundle: Bundle, write=None, compared=COMPARED, positions: int | None = None) -> list[dict]:
    """Per layer with rotations (bundle_layers: a hybrid model's attention layers) and KV head: key logit error,
    value output error and attention error of each compared method (module doc). positions: measure LAYER_QUERIES
    (or this many) query positions past the sink; None: every position."""
    m = bundle.manifest
    kv, d, sink = m.model.num_kv_heads, m.model.head_dim, m.quant.sink_tokens
    rows = []
    for layer in bundle_layers(m):
        q, k, v, scaling = held[layer]
        t = k.shape[1]
        window = (m.rotation.windows or {}).get(str(layer))   # a sliding layer reads its window
        pos = None if positions is None else query_positions(t, sink, positions)
        pos = torch.arange(t) if pos is None else pos
        qs = q[:, pos.to(q.device)].reshape(kv, -1, d)  # the group's query heads stacked as rows
        qpos = pos.repeat(qs.shape[1] // len(pos)).to(k.device)
        exact = causal_attention(qs, k, v, scaling, qpos, window)
        errors = {}
        for method in compared:
            lm = methods.layer_method(method, layer, kv, d, bundle)
            w = write if method == "oscar" else None
            k_hat, v_hat = restored(lm.key, k, sink, w), restored(lm.value, v, sink, w)
            errors[f"{method}_key"] = logit_error(qs, k, k_hat)
            errors[f"{method}_value"] = relative_error(causal_attention(qs, k, v_hat, scaling, qpos, window), exact)
            errors[f"{method}_attention"] = relative_error(causal_attention(qs, k_hat, v_hat, scaling, qpos, window), exact)
        for head in range(kv):
            rows.append({"layer": layer, "kv_head": head, **{k: float(e[head]) for k, e in errors.items()}})
    return rows


def decode_kernel_errors(held: dict, bundle: Bundle) -> list[float]:
    """Per layer with rotations (bundle_layers, in that order): relative error of the Triton decode kernel (INT2
    cache of the whole sample) against exact attention for the last position; CUDA only."""
    from oscar_core import kvstore
    from oscar_core.triton.decode import decode_attention
    from oscar_core.triton.write import write_int2

    m = bundle.manifest
    out = []
    for layer in bundle_layers(m):
        q, k, v, scaling = held[layer]
        t = k.shape[1]
        rot = kvstore.LayerRotation(*(bundle.layer(layer, n) for n in
                                      ("key_rotation", "value_rotation", "key_clip", "value_clip")),
                                    key_mean=bundle.layer(layer, "key_mean"), value_mean=bundle.layer(layer, "value_mean"))
        cache = kvstore.empty_cache(1, k.shape[0], k.shape[2], t, m.quant.key_group_size, m.quant.value_group_size,
                                    m.quant.sink_tokens, m.quant.recent_tokens, device=k.device,
                                    key_axis=bundle.key_axis(layer))
        kvstore.prefill(cache, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                        torch.tensor([t], device=k.device), rot, write=write_int2)
        o = decode_attention(q[None, :, -1].to(torch.bfloat16), cache, rot.key_rotation, rot.value_rotation,
                             rot.value_mean, scaling)
        groups = q.shape[0] // k.shape[0]
        exact = causal_attention(q[:, -1:], k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0), scaling,
                                 torch.tensor([t - 1], device=k.device))[:, 0]
        out.append(float(relative_error(o[0].float()[None], exact[None])))
    return out


def _logits(model, hidden: torch.Tensor) -> torch.Tensor:
    logits = model.get_output_embeddings()(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


@torch.inference_mode()
def end_to_end(model, ids: torch.Tensor, runs: dict[str, tuple[str, Bundle]]) -> dict[str, dict]:
    """Per run (name → (method, bundle)) on one sample ids [1, T]: KL(BF16 ‖ run) and top-1 agreement of the
    next-token distributions over every position, and perplexity over the T − 1 targets; "bf16": its perplexity.
    Each run is one teacher-forced forward through simulate_int2; logits are made LOGIT_CHUNK positions at a time."""
    from oscar_core.serve.simulate import simulate_int2

    def hidden(method, bundle):
        with simulate_int2(model, method, bundle):
            return model.base_model(input_ids=ids, use_cache=False).last_hidden_state[0]

    reference = hidden("bf16", next(iter(runs.values()))[1])
    states = {name: hidden(method, bundle) for name, (method, bundle) in runs.items()}
    targets, t = ids[0, 1:], ids.shape[1]
    sums = {name: {"kl": 0.0, "top1": 0.0} for name in runs}
    nll = {name: [] for name in ("bf16", *runs)}  # per target, for the position buckets

    def target_nll(log_p, tgt):
        return -log_p[: len(tgt)].gather(-1, tgt[:, None])[:, 0].cpu()

    for a in range(0, t, LOGIT_CHUNK):
        b = min(a + LOGIT_CHUNK, t)
        tgt = targets[a:b]
        ref = torch.log_softmax(_logits(model, reference[a:b]).double(), -1)
        nll["bf16"].append(target_nll(ref, tgt))
        for name, h in states.items():
            out = torch.log_softmax(_logits(model, h[a:b]).double(), -1)
            sums[name]["kl"] += float((ref.exp() * (ref - out)).sum())
            sums[name]["top1"] += float((out.argmax(-1) == ref.argmax(-1)).sum())
            nll[name].append(target_nll(out, tgt))
    nll = {name: torch.cat(x) for name, x in nll.items()}
    figures = {"bf16": {"ppl": math.exp(float(nll["bf16"].mean()))}}
    for name in runs:
        figures[name] = {"kl": sums[name]["kl"] / t, "top1_agreement": sums[name]["top1"] / t,
                         "ppl": math.exp(float(nll[name].mean())), "token_excess": nll[name] - nll["bf16"]}
    return figures


def summarize(rows: list[dict]) -> dict:
    keys = [k for k in rows[0] if k not in ("layer", "kv_head")]
    return {k: sum(r[k] for r in rows) / len(rows) for k in keys}


def layer_ranking(rows: list[dict], key: str = "oscar_attention") -> list[int]:
    """Layers by their mean (over KV heads) of `key`, worst first."""
    per: dict[int, list[float]] = {}
    for r in rows:
        per.setdefault(r["layer"], []).append(r[key])
    return sorted(per, key=lambda layer: -sum(per[layer]) / len(per[layer]))


def verify(loaded, bundle: Bundle, ids: torch.Tensor, use_kernels: bool, compare: Bundle | None = None,
           compared=COMPARED, positions: int | None = LAYER_QUERIES) -> dict:
    """The measurement part of a verify report for one sample ids [1, T] (checks are made first).

    compare: a second bundle for the same model (e.g. one imported from the upstream format), measured on the
    same held-out tokens; its OSCAR figures go to report["compare"]."""
    model = loaded.model
    device = next(model.parameters()).device
    on = lambda b: b.model_copy(update={"tensors": {k: v.to(device) for k, v in b.tensors.items()}})  # noqa: E731
    bundle = on(bundle)
    ids = ids.to(device)
    held = capture_attention(model, ids)
    write = None
    if use_kernels:
        from oscar_core.triton.write import write_int2 as write
    rows = layer_errors(held, bundle, write, compared, positions)
    runs = {m: (m, bundle) for m in compared}
    if compare is not None:
        compare = on(compare)
        runs["compare"] = ("oscar", compare)
    figures = end_to_end(model, ids, runs)
    buckets = bucket_figures({run: f.pop("token_excess") for run, f in figures.items() if "token_excess" in f})
    e2e = {}
    for run, f in figures.items():
        if run != "compare":
            e2e.update({(k if run == "oscar" else f"{run}_{k}"): v for k, v in f.items()})
    report = {"path": "triton" if use_kernels else "torch reference", "layers": rows, "mean": summarize(rows),
              "end_to_end": e2e, "buckets": buckets}
    if use_kernels:
        report["decode_kernel_error"] = decode_kernel_errors(held, bundle)
    if compare is not None:
        rows = layer_errors(held, compare, write, ("oscar",), positions)
        report["compare"] = {"layers": rows, "mean": summarize(rows), "end_to_end": figures["compare"]}
    return report


def _average(key: str, xs: list[float]) -> float:
    """Mean over samples; perplexities (equal-length windows) by their geometric mean, i.e. exp(mean NLL)."""
    if key.endswith("ppl"):
        return math.exp(sum(math.log(x) for x in xs) / len(xs))
    return sum(xs) / len(xs)


def merge_reports(reports: list[dict]) -> dict:
    """Average per-sample reports (same layers and heads) into one."""
    first = reports[0]
    layers = [{k: (v if k in ("layer", "kv_head") else _average(k, [r["layers"][i][k] for r in reports]))
               for k, v in row.items()} for i, row in enumerate(first["layers"])]
    merged = {"path": first["path"], "layers": layers,
              "mean": {k: _average(k, [r["mean"][k] for r in reports]) for k in first["mean"]},
              "end_to_end": {k: _average(k, [r["end_to_end"][k] for r in reports]) for k in first["end_to_end"]}}
    if "buckets" in first:  # samples of one length: means of the means, the standard errors combined
        n = len(reports)
        merged["buckets"] = {"bounds": first["buckets"]["bounds"], "excess": {
            run: [sum(xs) / n for xs in zip(*(r["buckets"]["excess"][run] for r in reports))]
            for run in first["buckets"]["excess"]}}
        if "standard_error" in first["buckets"]:
            merged["buckets"]["standard_error"] = [math.sqrt(sum(x * x for x in xs)) / n for xs in
                                                   zip(*(r["buckets"]["standard_error"] for r in reports))]
    if "decode_kernel_error" in first:
        merged["decode_kernel_error"] = [sum(v) / len(v) for v in zip(*(r["decode_kernel_error"] for r in reports))]
    if "compare" in first:
        merged["compare"] = merge_reports([{"path": r["path"], **r["compare"]} for r in reports])
        del merged["compare"]["path"]
    return merged


def needles_lost(ours: int, theirs: int, prompts: int) -> bool:
    """Whether `ours` of `prompts` needles is below `theirs` by more than BUCKET_SIGMAS standard errors of the
    difference of the two rates, √((p(1 − p) + p'(1 − p')) / n)."""
    p, q = ours / prompts, theirs / prompts
    return q - p > BUCKET_SIGMAS * math.sqrt((p * (1 - p) + q * (1 - q)) / prompts)


def gate(report: dict, max_kl: float | None = None, max_logit_error: float | None = None) -> list[str]:
    """Why the bundle fails (empty: it passes), one phrase per reason (module doc). Differences from KIVI-style
    within KL_TIE nats and PPL_TIE relative perplexity are ties (a context too short for KIVI-style to quantize
    a key block gives two caches that differ only in rounding)."""
    e2e, reasons = report["end_to_end"], []
    buckets = report.get("buckets", {})
    excess = buckets.get("excess", {})
    if "oscar" in excess and "kivi" in excess:
        for (first, last), ours, kivi, se in zip(buckets["bounds"], excess["oscar"], excess["kivi"],
                                                 buckets["standard_error"]):
            if ours > kivi + BUCKET_TIE + BUCKET_SIGMAS * se:
                reasons.append(f"OSCAR loses to KIVI-style at positions {first}-{last}: NLL excess over BF16 "
                               f"{ours:+.4f} > {kivi:+.4f} nats a token")
    needle = report.get("needle")
    if needle and needles_lost(needle["correct"]["oscar"], needle["correct"]["kivi"], needle["prompts"]):
        reasons.append(f"OSCAR retrieves fewer needles than KIVI-style at {report['seq_len']} tokens: "
                       f"{needle['correct']['oscar']} < {needle['correct']['kivi']} of {needle['prompts']}")
    if max_kl is not None and e2e["kl"] > max_kl:
        reasons.append(f"OSCAR's next-token KL {e2e['kl']:.4f} nats is above the bound {max_kl}")
    if e2e["kl"] > e2e["kivi_kl"] + KL_TIE:
        reasons.append(f"OSCAR loses to KIVI-style: next-token KL {e2e['kl']:.4f} > {e2e['kivi_kl']:.4f} nats")
    if e2e["ppl"] > e2e["kivi_ppl"] * (1 + PPL_TIE):
        reasons.append(f"OSCAR loses to KIVI-style: perplexity {e2e['ppl']:.3f} > {e2e['kivi_ppl']:.3f}")
    if max_logit_error is not None and report["mean"]["oscar_key"] > max_logit_error:
        reasons.append(f"OSCAR mean logit error {report['mean']['oscar_key']:.4f} is above the threshold "
                       f"{max_logit_error}")
    return reasons


def measure_figures(loaded, bundle: Bundle, ids: torch.Tensor, use_kernels: bool = False) -> dict[str, float]:
    """The headline figures of a verify run over the samples ids [n, T] (what `oscar verify --record` keeps)."""
    return headline(merge_reports([verify(loaded, bundle, ids[i:i + 1], use_kernels) for i in range(ids.shape[0])]))


HEADLINE = {  # figure name → (report section, key)
    "attention_error": ("mean", "oscar_attention"), "kivi_attention_error": ("mean", "kivi_attention"),
    "hadamard_attention_error": ("mean", "hadamard_attention"),
    "logit_error": ("mean", "oscar_key"), "hadamard_logit_error": ("mean", "hadamard_key"),
    "output_error": ("mean", "oscar_value"), "hadamard_output_error": ("mean", "hadamard_value"),
    "kl": ("end_to_end", "kl"), "kivi_kl": ("end_to_end", "kivi_kl"),
    "top1_agreement": ("end_to_end", "top1_agreement"),
    "ppl": ("end_to_end", "ppl"), "kivi_ppl": ("end_to_end", "kivi_ppl"), "bf16_ppl": ("end_to_end", "bf16_ppl"),
}


def headline(report: dict) -> dict[str, float]:
    """The figures a zoo table or model card shows, rounded: OSCAR against KIVI-style and Hadamard, per layer
    (means) and end to end."""
    return {name: round(report[section][key], 4) for name, (section, key) in HEADLINE.items()
            if key in report[section]}


def recorded_figures(bundle_dir) -> dict[str, float] | None:
    """The figures `oscar verify --record` left beside a bundle, if any, with the length they were measured at
    ("verified at tokens") and, where measured, needles retrieved (OSCAR's and KIVI-style's)."""
    import json
    from pathlib import Path

    path = Path(bundle_dir) / VERIFY_FILE
    try:
        if not path.is_file():
            return None
        recorded = json.loads(path.read_text())
        figures = {**({"verified at tokens": recorded["seq_len"]} if "seq_len" in recorded else {}),
                   **recorded["figures"]}
        if "needle" in recorded:
            n = recorded["needle"]
            figures.update({f"needles {m} of {n['prompts']}": n["correct"][m] for m in ("oscar", "kivi")})
        return figures
    except (ValueError, KeyError, TypeError):
        return None


def resolve_model_spec(model: str | None, manifest_model: ModelInfo, source: str | None = None) -> str | None:
    """The model to verify against: --model; else the embedded default when the manifest names it; else where
    calibration loaded it from (`source`, the manifest's calibration.model_source) while that path exists; else
    the hub id. A local model (a directory or file, not on the hub) with no path left to it is an error."""
    from pathlib import Path

    from oscar_core.calibrate.models import DEFAULT_MODEL, DEFAULT_MODEL_ID, default_gguf_path
    from oscar_core.formats.fileio import sha256_file

    if model:
        return model
    if manifest_model.id == DEFAULT_MODEL_ID:
        try:
            if sha256_file(default_gguf_path()) == manifest_model.file_sha256:
                return DEFAULT_MODEL
        except OscarError:
            pass
    if source and Path(source).is_absolute():
        if Path(source).exists():
            return source
        raise OscarError(f"the model of this bundle was loaded from {source}, which no longer exists: "
                         "pass --model (a directory, .gguf file or hub id)")
    if source and source != DEFAULT_MODEL:
        return source
    if manifest_model.revision is None and manifest_model.file_sha256 and manifest_model.id != DEFAULT_MODEL_ID:
        raise OscarError(f"the bundle was calibrated on a local model ({manifest_model.id}) and records no path to "
                         "it: pass --model (a directory, .gguf file or hub id)")
    return manifest_model.id


@dataclass
class VerifyRequest:
    """What `oscar verify` checks: a bundle (and optionally a second one to compare), on which model and text."""
    bundle: Path
    model: str | None = None            # default: resolve_model_spec
    data: str = DEFAULT_HELDOUT
    samples: int = 1
    seq_len: int | None = None          # default: DEFAULT_SEQ_LEN of the device, capped by the model's context
    seed: int = 0
    device: str | None = None           # default: cuda when available
    dtype: str | None = None
    compare: Path | None = None
    checks_only: bool = False
    max_kl: float | None = None         # default: the manifest's max_kl, else no absolute bound
    max_logit_error: float | None = None  # an extra gate, only when given
    needles: int | None = None          # needle prompts at seq_len; default: DEFAULT_NEEDLES of the device


def _kind(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"


def default_seq_len(device: str, limit: int | None = None) -> int:
    """DEFAULT_SEQ_LEN of the device, capped by the model's context `limit`."""
    length = DEFAULT_SEQ_LEN[_kind(device)]
    return min(length, limit) if limit else length


@torch.inference_mode()
def needle_check(loaded, bundle: Bundle, data: str, seq_len: int, prompts: int, seed: int,
                 methods_=NEEDLE_METHODS) -> dict:
    """Needle retrieval at seq_len through each method's cache (perplexity.needle_prompt / greedy_answers): `prompts`
    pass keys at depths spread evenly over 0.1..0.9 of held-out filler. {"prompts", "correct": {method: count}}."""
    import random

    from oscar_core.evaluate.perplexity import answer_matches, greedy_answers, heldout_tokens, needle_prompt

    rng = random.Random(seed)
    filler = heldout_tokens(data, loaded.tokenizer, seq_len)
    correct = dict.fromkeys(methods_, 0)
    depths = [0.5] if prompts == 1 else [0.1 + 0.8 * i / (prompts - 1) for i in range(prompts)]
    for depth in depths:
        key = str(rng.randrange(10000, 100000))
        prompt = needle_prompt(loaded.tokenizer, filler, seq_len, depth, key)
        answers = greedy_answers(loaded.model, loaded.tokenizer, prompt, list(methods_), bundle,
                                 loaded.info.num_layers)
        for m, (text, *_) in answers.items():
            correct[m] += answer_matches(text, key)
    return {"prompts": len(depths), "depths": [round(d, 3) for d in depths], "correct": correct}


def run_verify(req: VerifyRequest, on_step: Callable[[str], None] | None = None) -> dict:
    """The whole check (module doc): bundle checks, model resolution and loading, model checks, held-out samples,
    measurements, merging and the gate. Returns the JSON-ready report (report["passed"], report["reason"]); a
    failed bundle or model check, or a request that cannot run, raises OscarError in one line."""
    from oscar_core.calibrate.models import load_model, resolve_device
    from oscar_core.formats.bundle import load_bundle

    step = on_step or (lambda s: None)
    if req.samples < 1:
        raise OscarError("--samples must be at least 1")
    b = load_bundle(req.bundle)
    m = b.manifest
    checks = check_tensors(b)
    other = None
    if req.compare is not None:
        other = load_bundle(req.compare)
        checks += [Check(f"compared: {c.name}", c.ok, c.detail) for c in check_tensors(other)]
    failure = first_failure(checks)
    if failure:
        raise OscarError(f"bundle check failed: {failure}")
    report = {"bundle": str(b.path), "name": m.name, "version": m.version}
    if req.checks_only:
        return {**report, "checks": [c.__dict__ for c in checks], "checks_only": True, "passed": True, "reason": None}
    device = resolve_device(req.device)
    step("loading the model")
    loaded = load_model(resolve_model_spec(req.model, m.model, m.calibration.model_source), device, req.dtype)
    return measure_loaded(loaded, device, b, other, req, checks, step)


def measure_loaded(loaded, device: str, b: Bundle, other: Bundle | None, req: VerifyRequest, checks: list[Check],
                   step: Callable[[str], None], compared=COMPARED) -> dict:
    """run_verify from the model checks on, for bundles already checked (checks) and a model loaded on `device`:
    what `oscar upstream export` runs on a served variant held in memory. compared: the methods measured beside
    OSCAR (KIVI-style is what the gate needs)."""
    from oscar_core.calibrate.data import load_samples

    m = b.manifest
    report = {"bundle": str(b.path), "name": m.name, "version": m.version}
    checks = checks + [check_model(m.model, loaded.info), check_layers(m, loaded.model.config)]
    if other is not None:
        for c in (check_model(other.manifest.model, loaded.info), check_layers(other.manifest, loaded.model.config)):
            checks.append(Check(f"compared: {c.name}", c.ok, c.detail))
    failure = first_failure(checks)
    if failure:
        raise OscarError(f"bundle check failed: {failure}")
    limit, notes = loaded.info.max_position_embeddings, []
    seq_len = req.seq_len
    if seq_len is None:
        seq_len = default_seq_len(device, limit)
        if seq_len < DEFAULT_SEQ_LEN[_kind(device)]:
            notes.append(f"the default of {DEFAULT_SEQ_LEN[_kind(device)]} tokens is above the model's context of "
                         f"{limit}: {limit} used")
        if _kind(device) == "cpu":
            notes.append(f"on the CPU verify measures {seq_len} tokens; a bundle is served at 16K-32K: verify there "
                         "on CUDA (the default) or with --seq-len")
    elif limit and seq_len > limit:
        raise OscarError(f"--seq-len {seq_len} is above the model's limit of {limit}")
    step(f"drawing {req.samples} × {seq_len} held-out tokens")
    ids, fingerprint = load_samples(req.data, loaded.tokenizer, req.samples, seq_len, req.seed)
    reports = []
    for i in range(ids.shape[0]):
        step(f"measuring sample {i + 1} of {ids.shape[0]} ({seq_len} tokens): per layer, then end to end")
        reports.append(verify(loaded, b, ids[i:i + 1], use_kernels=device.startswith("cuda"), compare=other,
                              compared=compared))
    report = {**merge_reports(reports), **report}
    needles = DEFAULT_NEEDLES[_kind(device)] if req.needles is None else req.needles
    if needles > 0 and too_short(seq_len, m) is None:
        step(f"needle retrieval at {seq_len} tokens: {needles} prompts")
        report["needle"] = needle_check(loaded, b, req.data, seq_len, needles, req.seed)
    max_kl = req.max_kl if req.max_kl is not None else m.max_kl
    if other is not None:
        report["compare"].update(bundle=str(other.path), name=other.manifest.name, version=other.manifest.version)
    worst = layer_ranking(report["layers"])[0]
    report.update(data=req.data, data_fingerprint=fingerprint, seed=req.seed, samples=req.samples, seq_len=seq_len,
                  device=device, model=loaded.info.id, sink_tokens=m.quant.sink_tokens,
                  recent_tokens=m.quant.recent_tokens, max_kl=max_kl, max_logit_error=req.max_logit_error,
                  worst_layer=worst, notes=notes, checks=[c.__dict__ for c in checks])
    reasons = [r for r in (too_short(seq_len, m),) if r] + gate(report, max_kl, req.max_logit_error)
    report.update(passed=not reasons, reasons=reasons, reason="; ".join(reasons) or None)
    return report


def record(report: dict) -> dict:
    """What `oscar verify --record` writes to VERIFY_FILE beside the bundle: the run's settings and headline figures."""
    summary = {k: report[k] for k in ("name", "version", "data", "data_fingerprint", "samples", "seq_len", "seed",
                                      "device", "path", "passed")}
    extra = {k: report[k] for k in ("buckets", "needle") if k in report}
    return {**summary, "figures": headline(report), **extra}
