"""`oscar export`: derive rotations and clip thresholds from a calibration directory, write a bundle."""

import multiprocessing
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch

from oscar_core.formats.bundle import (CONTEXTS_REPORTED, NAME, VERSION, CalibrationInfo, LayerQuant, Manifest,
                                       ModelInfo, QuantInfo, RotationInfo, TensorFileInfo, group_size_problem,
                                       manifest_json, schema_errors, write_bundle)
from oscar_core.calibrate.calibration import check_record, read_layer_statistics, read_record, read_statistics
from oscar_core.calibrate.derive import (KEY_CLIP_OBJECTIVES, DeriveOptions, clip_objective_label, derive_layer,
                                         key_clip_grid)
from oscar_core.errors import OscarError, UsageError
from oscar_core.formats.fileio import atomic_write_bytes, check_name, path_under
from oscar_core.formats.provenance import platform_record
from oscar_core.layers import holds_int2, int2_layer_ids, int2_reason, specs_from, window_recent
from oscar_core.quant import cache_bits_per_element, layer_bits_per_element
from oscar_core.rope import far_offsets
from oscar_core.rotations import VARIANTS, eigenvalues, label, orthogonality_error

ORTHOGONALITY_TOLERANCE = 1e-5


def bundle_name(model: ModelInfo) -> str:
    """<org>/<model> for a hub id; local/<name> for a file or directory."""
    parts = model.id.split("/")
    if len(parts) == 2 and all(parts):
        return model.id
    stem = re.sub(r"\.gguf$", "", parts[-1])
    return f"local/{stem}"


def check_bundle_name(name: str, version: str) -> str:
    """<name>/<version>, the bundle's path under a zoo root, when both are plain: ORG/MODEL and a version of letters,
    digits, '.', '_' or '-' (no part '.' or '..'); else OscarError (a name from the model id: pass --name)."""
    if not re.fullmatch(VERSION, version):
        raise OscarError(f"invalid bundle version {version!r}: use letters, digits, '.', '_' or '-'")
    if not re.fullmatch(NAME, name):
        raise OscarError(f"invalid bundle name {name!r}: use ORG/MODEL (letters, digits, '.', '_' or '-'; "
                         "pass --name)")
    return f"{check_name(name, 'bundle name')}/{version}"


def average_bits(context: int, quant: dict, layers=((1, None, True),)) -> float:
    """Bits per K/V element at `context` tokens against the BF16 cache of the same model (quant.cache_bits_per_element)
    over the KV layers, each (token_block, window, int2) as quant.layer_bits_per_element takes them; the default is
    one global layer with keys per token."""
    q = quant
    return round(cache_bits_per_element(context, [
        (layer_bits_per_element(context, q["key_group_size"], q["value_group_size"], q["sink_tokens"],
                                window_recent(window, q["recent_tokens"], block), block, window, int2), window)
        for block, window, int2 in layers]), 4)


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _deriver(parent: int) -> None:
    """Set up a spawned deriver: one thread (the bytes do not depend on the process count), and death with the
    export that started it, even a SIGKILLed one (Linux: the kernel's parent-death signal; elsewhere a thread
    that watches the parent)."""
    torch.set_num_threads(1)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # the parent died before the signal was set
        os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """`workers` spawned processes that derive layers, each on one thread, and die with this process."""
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_deriver,
                               initargs=(os.getpid(),))


def _derive_from_file(calib_dir: str, layer: int, num_heads: int, opts: DeriveOptions,
                      inv_freq: torch.Tensor | None) -> tuple[int, tuple]:
    tensors, info = derive_layer(read_layer_statistics(calib_dir, layer, num_heads), 0, opts, inv_freq)
    return layer, (tensors, {**info, "layer": layer})


def layer_frequencies(record: dict) -> dict[int, torch.Tensor]:
    """{layer: its RoPE inv_freq} from a calibration record (empty for calibrations that did not record them)."""
    return {i: torch.tensor(f, dtype=torch.float64) for i, f in enumerate(record.get("rope_inv_freq") or []) if f}


def capped_options(opts: DeriveOptions, model: ModelInfo) -> DeriveOptions:
    """opts with the group sizes capped at the model's head_dim."""
    return DeriveOptions(**{**opts.__dict__, "key_group_size": min(opts.key_group_size, model.head_dim),
                            "value_group_size": min(opts.value_group_size, model.head_dim)})


def served_options(opts: DeriveOptions, model: ModelInfo, sink_tokens: int, probe_tokens: int,
                   has_rope: bool) -> DeriveOptions:
    """The options a layer is derived with: group sizes capped, the served sink, and, for a RoPE model, the far
    offsets its key formats and clips are scored at (rope.far_offsets of the model's context)."""
    return DeriveOptions(**{**capped_options(opts, model).__dict__, "sink_tokens": sink_tokens,
                            "far_offsets": far_offsets(model.max_position_embeddings, probe_tokens) if has_rope
                            else ()})


def derive_layers(stats, calib_dir, num_heads: int, opts: DeriveOptions, workers: int,
                  on_layer: Callable[[int, int], None] | None = None, layers: list[int] | None = None,
                  frequencies: dict[int, torch.Tensor] | None = None):
    """(layer, (its bundle tensors, its key format)) for every layer of `layers` (None: every layer), in layer order;
    frequencies: each layer's RoPE inv_freq, for scoring key formats at opts.far_offsets.

    Every derivation runs on one thread (LAPACK's eigh differs in the last bits with the thread count), so
    the bytes do not depend on `workers`: with workers > 1, that many spawned processes each derive whole
    layers, reading only their layer from the statistics file.
    """
    layers = list(range(stats.num_layers)) if layers is None else layers
    frequencies = frequencies or {}
    total = len(layers)
    if workers <= 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for done, layer in enumerate(layers, 1):
                yield layer, derive_layer(stats, layer, opts, frequencies.get(layer))
                if on_layer:
                    on_layer(done, total)
        finally:
            torch.set_num_threads(threads)
        return
    results = {}
    with worker_pool(workers) as pool:
        futures = [pool.submit(_derive_from_file, str(calib_dir), layer, num_heads, opts, frequencies.get(layer))
                   for layer in layers]
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
    if workers < 1:
        raise UsageError("--workers must be at least 1")
    if name is not None:
        check_bundle_name(name, version)
    record = read_record(calib_dir)
    if not record.get("complete"):
        raise OscarError(f"calibration in {calib_dir} is incomplete ({record.get('samples_done', 0)} of "
                         f"{record.get('samples')} samples): rerun oscar calibrate with the same --out to finish it")
    check_record(record, calib_dir)
    with schema_errors(f"calibration record {Path(calib_dir) / 'calibration.json'}: model"):
        model = ModelInfo.model_validate(record["model"])
    opts = capped_options(opts, model)
    for size in (opts.key_group_size, opts.value_group_size):
        if group_size_problem(size, model.head_dim):
            raise UsageError(group_size_problem(size, model.head_dim))
    out = path_under(zoo_root, check_bundle_name(name or bundle_name(model), version), "bundle name")
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
    frequencies = layer_frequencies(record)
    opts = served_options(opts, model, sink_tokens, stats.probe(layers[0])["key"].shape[-2], bool(frequencies))
    tensors: dict[str, torch.Tensor] = {}
    formats: list[LayerQuant] = []
    for layer, (derived, info) in derive_layers(stats, calib_dir, model.num_heads, opts, min(workers, len(layers)),
                                                on_layer, layers, frequencies):
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
    with schema_errors(f"calibration {calib_dir} gives an invalid manifest"):
        manifest = Manifest(
            name=name or bundle_name(model), version=version, model=model,
            quant=QuantInfo(**quant, key_clip=mean_clip("key"), value_clip=mean_clip("value"),
                            clip_objective=clip_objective_label(opts.key_clip_objective, opts.key_clip_floor,
                                                                opts.clip_grid),
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
    manifest = write_bundle(out, manifest, tensors)
    zoo_root = Path(zoo_root)
    if is_repo_zoo(zoo_root.resolve()):
        atomic_write_bytes(zoo_root.resolve().parent / "manifests" / manifest.name / f"{version}.json",
                           manifest_json(manifest).encode())
    return out, manifest
