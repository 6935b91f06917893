"""`oscar verify`: check a bundle, then measure what its INT2 cache does to attention and to the logits.

Checks: manifest schema, checksum, tensor names and shapes (bundle.load_bundle), orthogonality of every
rotation, clip thresholds in (0, 1], finite means, and the model's attention facts against the manifest.
Measurements on held-out text, per layer and KV head, all at the same bits (INT2, groups of G):
    key logit error ‖Q(K̂−K)^T‖/‖QK^T‖ and value output error ‖S(V̂−V)‖/‖SV‖   (fidelity.py)
for OSCAR (the bundle), Hadamard-only (QuaRot-style) and no rotation; and, end to end, the KL divergence
and top-1 agreement of the model's next-token distribution with the OSCAR INT2 cache against BF16
(simulate.py). On CUDA the INT2 write path is the Triton kernel and the decode kernel is checked
against exact attention at the last position; on CPU the torch reference runs.
"""

from dataclasses import dataclass

import torch

from oscar_core import methods
from oscar_core.bundle import Bundle, Manifest, ModelInfo, bundle_layers
from oscar_core.errors import OscarError
from oscar_core.fidelity import capture_attention, key_error, value_error
from oscar_core.metrics import causal_attention, kl_divergence, relative_error, top1_agreement
from oscar_core.rotations import orthogonality_error

ORTHOGONALITY_TOLERANCE = 1e-5
VERIFY_FILE = "verify.json"  # `oscar verify --record` writes the headline figures beside the bundle
COMPARED = ("oscar", "hadamard", "int2")
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


def _side_tensors(method: str, side: str, layer: int, kv_heads: int, head_dim: int, bundle: Bundle):
    s = getattr(methods.layer_method(method, layer, kv_heads, head_dim, bundle), side)
    rotation = s.rotation if s.rotation is not None else torch.eye(head_dim).expand(kv_heads, head_dim, head_dim)
    return rotation.double(), s.mean, s.clip


def layer_errors(held: dict, bundle: Bundle, write=None, compared=COMPARED) -> list[dict]:
    """Per layer with rotations (bundle_layers: a hybrid model's attention layers) and KV head: key and value
    error of each compared method."""
    m = bundle.manifest
    kv, d, g, sink = m.model.num_kv_heads, m.model.head_dim, m.quant.key_group_size, m.quant.sink_tokens
    rows = []
    for layer in bundle_layers(m):
        q, k, v, scaling = held[layer]
        window = (m.rotation.windows or {}).get(str(layer))   # a sliding layer's values are read in its window
        errors = {}
        for method in compared:
            r, mean, clip = (x.to(k.device) if isinstance(x, torch.Tensor) else x
                             for x in _side_tensors(method, "key", layer, kv, d, bundle))
            errors[f"{method}_key"] = key_error(q, k, r, mean, clip, g, sink, write if method == "oscar" else None)
            r, mean, clip = (x.to(k.device) if isinstance(x, torch.Tensor) else x
                             for x in _side_tensors(method, "value", layer, kv, d, bundle))
            errors[f"{method}_value"] = value_error(q, k, v, scaling, r, mean, clip, m.quant.value_group_size, sink,
                                                    write if method == "oscar" else None, window)
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
                                    m.quant.sink_tokens, m.quant.recent_tokens, device=k.device)
        kvstore.prefill(cache, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                        torch.tensor([t], device=k.device), rot, write=write_int2)
        o = decode_attention(q[None, :, -1].to(torch.bfloat16), cache, rot.key_rotation, rot.value_rotation,
                             rot.value_mean, scaling)
        groups = q.shape[0] // k.shape[0]
        exact = causal_attention(q[:, -1:], k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0), scaling,
                                 torch.tensor([t - 1], device=k.device))[:, 0]
        out.append(float(relative_error(o[0].float()[None], exact[None])))
    return out


def next_token_effect(model, ids: torch.Tensor, bundle: Bundle) -> dict:
    """KL(BF16 ‖ OSCAR INT2) and top-1 agreement of next-token distributions over every position."""
    from oscar_core.simulate import simulate_int2

    with torch.inference_mode():
        with simulate_int2(model, "bf16", bundle):
            reference = model(input_ids=ids).logits
        with simulate_int2(model, "oscar", bundle):
            logits = model(input_ids=ids).logits
    return {"kl": float(kl_divergence(logits, reference)), "top1_agreement": float(top1_agreement(logits, reference))}


def summarize(rows: list[dict]) -> dict:
    keys = [k for k in rows[0] if k not in ("layer", "kv_head")]
    return {k: sum(r[k] for r in rows) / len(rows) for k in keys}


def verify(loaded, bundle: Bundle, ids: torch.Tensor, use_kernels: bool, compare: Bundle | None = None) -> dict:
    """The measurement part of a verify report (checks are made by the caller first).

    compare: a second bundle for the same model (e.g. one imported from the upstream format), measured on the
    same held-out tokens; its OSCAR figures go to report["compare"]."""
    model = loaded.model
    device = next(model.parameters()).device
    bundle = bundle.model_copy(update={"tensors": {k: v.to(device) for k, v in bundle.tensors.items()}})
    held = capture_attention(model, ids.to(device))
    write = None
    if use_kernels:
        from oscar_core.triton.write import write_int2 as write
    rows = layer_errors(held, bundle, write)
    report = {"path": "triton" if use_kernels else "torch reference", "layers": rows, "mean": summarize(rows),
              "end_to_end": next_token_effect(model, ids.to(device), bundle)}
    if use_kernels:
        report["decode_kernel_error"] = decode_kernel_errors(held, bundle)
    if compare is not None:
        compare = compare.model_copy(update={"tensors": {k: v.to(device) for k, v in compare.tensors.items()}})
        rows = layer_errors(held, compare, write, ("oscar",))
        report["compare"] = {"layers": rows, "mean": summarize(rows),
                             "end_to_end": next_token_effect(model, ids.to(device), compare)}
    return report


def merge_reports(reports: list[dict]) -> dict:
    """Average per-sample reports (same layers and heads) into one."""
    first = reports[0]
    avg = lambda xs: sum(xs) / len(xs)  # noqa: E731
    layers = [{k: (v if k in ("layer", "kv_head") else avg([r["layers"][i][k] for r in reports]))
               for k, v in row.items()} for i, row in enumerate(first["layers"])]
    merged = {"path": first["path"], "layers": layers,
              "mean": {k: avg([r["mean"][k] for r in reports]) for k in first["mean"]},
              "end_to_end": {k: avg([r["end_to_end"][k] for r in reports]) for k in first["end_to_end"]}}
    if "decode_kernel_error" in first:
        merged["decode_kernel_error"] = [avg(v) for v in zip(*(r["decode_kernel_error"] for r in reports))]
    if "compare" in first:
        merged["compare"] = merge_reports([{"path": r["path"], **r["compare"]} for r in reports])
        del merged["compare"]["path"]
    return merged


def measure_figures(loaded, bundle: Bundle, ids: torch.Tensor, use_kernels: bool = False) -> dict[str, float]:
    """The headline figures of a verify run over the samples ids [n, T] (what `oscar verify --record` keeps)."""
    return headline(merge_reports([verify(loaded, bundle, ids[i:i + 1], use_kernels) for i in range(ids.shape[0])]))


def headline(report: dict) -> dict[str, float]:
    """The figures a zoo table or model card shows, rounded: OSCAR vs Hadamard, and end to end."""
    mean, e2e = report["mean"], report["end_to_end"]
    figures = {"logit_error": mean["oscar_key"], "hadamard_logit_error": mean["hadamard_key"],
               "output_error": mean["oscar_value"], "hadamard_output_error": mean["hadamard_value"],
               "kl": e2e["kl"], "top1_agreement": e2e["top1_agreement"]}
    return {k: round(v, 4) for k, v in figures.items()}


def recorded_figures(bundle_dir) -> dict[str, float] | None:
    """The figures `oscar verify --record` left beside a bundle, if any."""
    import json
    from pathlib import Path

    path = Path(bundle_dir) / VERIFY_FILE
    try:
        return json.loads(path.read_text())["figures"] if path.is_file() else None
    except (ValueError, KeyError):
        return None


def resolve_model_spec(model: str | None, manifest_model: ModelInfo, source: str | None = None) -> str | None:
    """The model to verify against: --model; else the embedded default when the manifest names it; else where
    calibration loaded it from (`source`, the manifest's calibration.model_source) while that path exists; else
    the hub id. A local model (a directory or file, not on the hub) with no path left to it is an error."""
    from pathlib import Path

    from oscar_core.models import DEFAULT_MODEL, DEFAULT_MODEL_ID, default_gguf_path
    from oscar_core.fileio import sha256_file

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
