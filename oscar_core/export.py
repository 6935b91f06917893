"""`oscar export`: derive rotations and clip thresholds from a calibration directory, write a bundle."""

import multiprocessing
import os
import re
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch

from oscar_core.bundle import (CONTEXTS_REPORTED, CalibrationInfo, LayerQuant, Manifest, ModelInfo, QuantInfo,
                               RotationInfo, TensorFileInfo, manifest_json, write_bundle)
from oscar_core.calibration import read_layer_statistics, read_record, read_statistics
from oscar_core.derive import KEY_CLIP_OBJECTIVES, DeriveOptions, clip_objective_label, derive_layer, key_clip_grid
from oscar_core.errors import OscarError
from oscar_core.fileio import atomic_write_bytes
from oscar_core.layers import holds_int2, int2_layer_ids, int2_reason, specs_from, window_recent
from oscar_core.provenance import platform_record
from oscar_core.quant import layer_bits_per_element
from oscar_core.rotations import VARIANTS, eigenvalues, label, orthogonality_error

ORTHOGONALITY_TOLERANCE = 1e-5


def bundle_name(model: ModelInfo) -> str:
    """<org>/<model> for a hub id; local/<name> for a file or directory."""
    parts = model.id.split("/")
    if len(parts) == 2 and all(parts):
        return model.id
    stem = re.sub(r"\.gguf$", "", parts[-1])
    return f"local/{stem}"


def average_bits(context: int, quant: dict, layers=((1, None, True),)) -> float:
    """Bits per K/V element at `context` tokens, averaged over the KV layers, each (token_block, window, int2) as
    quant.layer_bits_per_element takes them; the default is one global layer with keys per token."""
    q = quant
    return round(sum(layer_bits_per_element(context, q["key_group_size"], q["value_group_size"], q["sink_tokens"],
                                            window_recent(window, q["recent_tokens"], block), block, window, int2)
                     for block, window, int2 in layers) / len(layers), 4)


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _single_thread() -> None:
    torch.set_num_threads(1)


def _derive_from_file(calib_dir: str, layer: int, num_heads: int, opts: DeriveOptions) -> tuple[int, tuple]:
    tensors, info = derive_layer(read_layer_statistics(calib_dir, layer, num_heads), 0, opts)
    return layer, (tensors, {**info, "layer": layer})


def derive_layers(stats, calib_dir, num_heads: int, opts: DeriveOptions, workers: int,
                  on_layer: Callable[[int, int], None] | None = None, layers: list[int] | None = None):
    """(layer, (its bundle tensors, its key format)) for every layer of `layers` (None: every layer), in layer order.

    Every derivation runs on one thread (LAPACK's eigh differs in the last bits with the thread count), so
    the bytes do not depend on `workers`: with workers > 1, that many spawned processes each derive whole
    layers, reading only their layer from the statistics file.
    """
    layers = list(range(stats.num_layers)) if layers is None else layers
    total = len(layers)
    if workers <= 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for done, layer in enumerate(layers, 1):
                yield layer, derive_layer(stats, layer, opts)
                if on_layer:
                    on_layer(done, total)
        finally:
            torch.set_num_threads(threads)
        return
    results = {}
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_single_thread) as pool:
        futures = [pool.submit(_derive_from_file, str(calib_dir), layer, num_heads, opts) for layer in layers]
        for future in as_completed(futures):
            layer, derived = future.result()
            results[layer] = derived
            if on_layer:
                on_layer(len(results), total)
    for layer in layers:
        yield layer, results[layer]


def is_repo_zoo(zoo_root: Path) -> bool:
    return zoo_root.name == "zoo" and (zoo_root.parent / "manifests").is_dir()


def export_bundle(calib_dir: str | Path, zoo_root: str | Path, version: str = "v1", name: str | None = None,
                  opts: DeriveOptions = DeriveOptions(), sink_tokens: int = 64, recent_tokens: int = 256,
                  on_layer: Callable[[int, int], None] | None = None,
                  with_eigenvalues: bool = False, workers: int = 1) -> tuple[Path, Manifest]:
    """Write <zoo_root>/<org>/<model>/<version>/ (and manifests/<org>/<model>/<version>.json for the repo zoo).

    with_eigenvalues adds layers.{i}.key_eigenvalues / value_eigenvalues (of C_Q, C_S; what the upstream format
    carries), off by default so that rebuilt zoo bundles keep their bytes.
    workers: processes deriving layers at once (at most one per layer; the bytes do not depend on it). More than
    one spawns processes, so a script calling this needs an `if __name__ == "__main__":` guard; the CLI's
    default is one per CPU core (default_workers()).
    """
    for variant in (opts.key_rotation, opts.value_rotation):
        if variant not in VARIANTS:
            raise OscarError(f"unknown rotation {variant}: one of {', '.join(VARIANTS)}")
    if opts.key_clip_objective not in KEY_CLIP_OBJECTIVES:
        raise OscarError(f"unknown key clip objective {opts.key_clip_objective}: one of {', '.join(KEY_CLIP_OBJECTIVES)}")
    try:
        key_clip_grid(opts)
    except ValueError as e:
        raise OscarError(str(e)) from None
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", version):
        raise OscarError(f"invalid --version {version!r}: use letters, digits, '.', '_' or '-'")
    record = read_record(calib_dir)
    if not record.get("complete"):
        raise OscarError(f"calibration in {calib_dir} is incomplete ({record.get('samples_done', 0)} of "
                         f"{record.get('samples')} samples): rerun oscar calibrate with the same --out to finish it")
    model = ModelInfo.model_validate(record["model"])
    opts = DeriveOptions(**{**opts.__dict__, "key_group_size": min(opts.key_group_size, model.head_dim),
                            "value_group_size": min(opts.value_group_size, model.head_dim)})
    for size in (opts.key_group_size, opts.value_group_size):
        if size < 4 or model.head_dim % size or size & (size - 1):
            raise OscarError(f"group size {size} must be a power of two that divides head_dim {model.head_dim}")
    stats, done = read_statistics(calib_dir, model.num_heads)
    if done != record["samples"]:
        raise OscarError(f"calibration in {calib_dir} is incomplete: statistics count {done} of {record['samples']} samples")
    bad = stats.non_finite()
    if bad:
        raise OscarError(f"NaN or Inf in the statistics of {calib_dir} ({bad}): recalibrate, e.g. with --dtype float32")
    if stats.num_layers != model.num_layers or stats.num_kv_heads != model.num_kv_heads:
        raise OscarError(f"statistics in {calib_dir} do not match the model in its record")

    # Rotations for the layers that hold INT2 tokens only: not a hybrid model's layers without a KV cache, nor
    # sliding layers whose window is kept whole in BF16 (layers.holds_int2). None: every layer.
    specs = specs_from(model.num_layers, record.get("attention_layers"), record.get("windows"))
    held = int2_layer_ids(specs, sink_tokens, recent_tokens)
    layers = list(range(model.num_layers)) if held is None else held
    if not layers:
        raise OscarError(f"no layer of {model.id} holds INT2 tokens: {int2_reason(specs, sink_tokens, recent_tokens)}")
    opts = DeriveOptions(**{**opts.__dict__, "sink_tokens": sink_tokens})
    tensors: dict[str, torch.Tensor] = {}
    formats: list[LayerQuant] = []
    if workers < 1:
        raise OscarError("--workers must be at least 1")
    for layer, (derived, info) in derive_layers(stats, calib_dir, model.num_heads, opts, min(workers, len(layers)),
                                                on_layer, layers):
        for key, value in derived.items():
            tensors[f"layers.{layer}.{key}"] = value.float()
        formats.append(LayerQuant(**info))
    if with_eigenvalues:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # LAPACK's eigensolver differs in the last bits with the thread count: pin it
        try:
            for layer in layers:
                tensors[f"layers.{layer}.key_eigenvalues"] = eigenvalues(stats.query_covariance(layer)).float()
                tensors[f"layers.{layer}.value_eigenvalues"] = eigenvalues(
                    stats.score_weighted_value_covariance(layer)).float()
        finally:
            torch.set_num_threads(threads)
    del stats
    worst = max(orthogonality_error(t) for k, t in tensors.items() if k.endswith("_rotation"))
    if worst > ORTHOGONALITY_TOLERANCE:
        raise OscarError(f"derived rotations are not orthogonal (max |R^T R - I| = {worst:.2e}): statistics are degenerate")

    def mean_clip(kind: str) -> float:
        return round(float(torch.stack([tensors[f"layers.{i}.{kind}_clip"] for i in layers]).mean()), 4)

    quant = {"key_group_size": opts.key_group_size, "value_group_size": opts.value_group_size,
             "sink_tokens": sink_tokens, "recent_tokens": recent_tokens}
    axis = {f.layer: f.key_axis for f in formats}
    kv_layers = [(opts.key_group_size if axis.get(i) == "channel" else 1, spec.window,
                  holds_int2(spec, sink_tokens, recent_tokens)) for i, spec in enumerate(specs) if spec.kv_cache]
    manifest = Manifest(
        name=name or bundle_name(model), version=version, model=model,
        quant=QuantInfo(**quant, key_clip=mean_clip("key"), value_clip=mean_clip("value"),
                        clip_objective=clip_objective_label(opts.key_clip_objective, opts.key_clip_floor, opts.clip_grid),
                        bits_per_element={str(c): average_bits(c, quant, kv_layers) for c in CONTEXTS_REPORTED},
                        layers=formats if len(opts.key_formats) > 1 else None),
        rotation=RotationInfo(key=label(opts.key_rotation, "U_Q"), value=label(opts.value_rotation, "U_S"),
                              key_centering=opts.key_centering, value_centering=opts.value_centering,
                              layers=held, windows=record.get("windows"),
                              layers_reason=int2_reason(specs, sink_tokens, recent_tokens)),
        calibration=CalibrationInfo(data=record["data"]["source"], data_fingerprint=record["data"]["fingerprint"],
                                    samples=record["samples"], seq_len=record["seq_len"], seed=record["seed"],
                                    tokens=record["tokens"], model_source=record.get("model_source"),
                                    platform=platform_record(record.get("device", "cpu")),
                                    bos_prefix=record["data"].get("bos_prefix")),
        tensors=TensorFileInfo(sha256="0" * 64, bytes=0),
    )
    if not re.fullmatch(r"[A-Za-z0-9._-]+/[A-Za-z0-9._-]+", manifest.name):
        raise OscarError(f"invalid bundle name {manifest.name!r}: use ORG/MODEL")
    zoo_root = Path(zoo_root)
    out = zoo_root / manifest.name / version
    manifest = write_bundle(out, manifest, tensors)
    if is_repo_zoo(zoo_root.resolve()):
        atomic_write_bytes(zoo_root.resolve().parent / "manifests" / manifest.name / f"{version}.json",
                           manifest_json(manifest).encode())
    return out, manifest
