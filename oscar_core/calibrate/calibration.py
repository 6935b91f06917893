"""`oscar calibrate`: stream token samples through a model and accumulate attention statistics.

A calibration directory holds
- statistics.safetensors: the AttentionStatistics accumulators and probes, and in its metadata the
  number of samples already counted (written atomically after every batch, so a rerun resumes);
- calibration.json: provenance (model, data and its fingerprint and BOS prefix, N, L, seed, tool version, timings),
  `rope_inv_freq`: each layer's RoPE frequencies (models.rope_frequencies), and, for a
  hybrid model, `attention_layers`: the global ids of the layers with a KV cache (models.attention_layer_ids);
  the statistics keep every layer, zero for the others (the hooks never see them); for a model with sliding
  layers, `windows`: {layer: W} (layers.windows), whose statistics come from the windowed attention the model
  computes.
"""

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from oscar_core import __version__
from oscar_core.calibrate import distributed
from oscar_core.calibrate.data import DEFAULT_CALIBRATION, bos_prefix, load_samples
from oscar_core.calibrate.models import (attention_layer_ids, gpu_memory, load_model, model_devices, resolve_device,
                                         rope_frequencies)
from oscar_core.calibrate.statistics import AttentionStatistics, observe_attention
from oscar_core.errors import OscarError
from oscar_core.formats.fileio import atomic_write_bytes, atomic_write_json, remove_stale_temporaries
from oscar_core.formats.provenance import model_source, platform_record
from oscar_core.layers import layer_specs, windows

STATISTICS_FILE = "statistics.safetensors"
RECORD_FILE = "calibration.json"
IDENTITY_KEYS = ("model", "data", "samples", "seq_len", "seed")


@dataclass
class CalibrationRequest:
    model: str | None = None
    data: str | None = None
    split: str = "train"
    text_field: str = "text"
    samples: int = 64
    seq_len: int = 2048
    batch_size: int = 1
    seed: int = 0
    device: str | None = None
    dtype: str | None = None
    shard: bool = False        # spread the model over this process's GPUs (accelerate device map)
    checkpoint_s: float = 0.0  # write the statistics at most this often (0: after every round) and at the end


def _identity(record: dict) -> dict:
    return {k: record[k] for k in IDENTITY_KEYS}


def read_record(calib_dir: str | Path) -> dict:
    path = Path(calib_dir) / RECORD_FILE
    if not Path(calib_dir).is_dir():
        raise OscarError(f"calibration directory not found: {calib_dir}")
    if not path.is_file():
        raise OscarError(f"not a calibration directory: {calib_dir} has no {RECORD_FILE}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise OscarError(f"corrupt calibration record: {path}") from None


RECORD_KEYS = ("model", "data", "samples", "seq_len", "seed", "tokens")


def check_record(record: dict, calib_dir: str | Path) -> None:
    """What export needs of a calibration record: its keys, attention_layers that are distinct layers of the model,
    and sliding windows of its layers that are >= 0 tokens; else an OscarError naming the file and the field."""
    path = Path(calib_dir) / RECORD_FILE
    missing = [k for k in RECORD_KEYS if k not in record]
    if missing:
        raise OscarError(f"calibration record {path} lacks {missing[0]!r}: recalibrate into a new --out")
    data = record["data"]
    if not isinstance(data, dict) or not isinstance(data.get("source"), str) or not isinstance(data.get("fingerprint"), str):
        raise OscarError(f"calibration record {path}: data must hold a source and a fingerprint")
    layers = record["model"].get("num_layers") if isinstance(record["model"], dict) else None
    if not isinstance(layers, int) or isinstance(layers, bool):
        raise OscarError(f"calibration record {path}: model.num_layers is not an integer")
    kv = record.get("attention_layers")
    if kv is not None and (not isinstance(kv, list) or len(set(kv)) != len(kv)
                           or not all(isinstance(i, int) and 0 <= i < layers for i in kv)):
        raise OscarError(f"calibration record {path}: attention_layers {kv} are not distinct layers 0..{layers - 1}")
    for layer, window in (record.get("windows") or {}).items():
        if not str(layer).isdigit() or int(layer) >= layers or not isinstance(window, int) or window < 0:
            raise OscarError(f"calibration record {path}: windows: layer {layer!r} window {window!r} must be a layer "
                             f"0..{layers - 1} with a window >= 0 tokens")


def read_statistics(calib_dir: str | Path, num_heads: int) -> tuple[AttentionStatistics, int]:
    """The statistics of a calibration directory and the number of samples they count."""
    path = Path(calib_dir) / STATISTICS_FILE
    if not path.is_file():
        raise OscarError(f"calibration directory {calib_dir} has no {STATISTICS_FILE}")
    try:
        with safe_open(path, "pt") as f:
            done = int(f.metadata()["samples_done"])
        state = load_file(path)
    except Exception as e:
        raise OscarError(f"corrupt statistics file {path}: {e}") from None
    return AttentionStatistics.from_state_dict(state, num_heads), done


def read_layer_statistics(calib_dir: str | Path, layer: int, num_heads: int) -> AttentionStatistics:
    """One layer's statistics as a one-layer AttentionStatistics (its layer 0), read without loading the others."""
    with safe_open(Path(calib_dir) / STATISTICS_FILE, "pt") as f:
        state = {name: f.get_slice(name)[layer:layer + 1] for name in f.keys() if ".probe_" not in name}
        prefix = f"layers.{layer}."
        state.update({f"layers.0.{name.removeprefix(prefix)}": f.get_tensor(name)
                      for name in f.keys() if name.startswith(prefix)})
    return AttentionStatistics.from_state_dict(state, num_heads)


def _save(calib_dir: Path, stats: AttentionStatistics, done: int, record: dict) -> None:
    data = save(stats.state_dict(), metadata={"samples_done": str(done), "tool_version": __version__})
    atomic_write_bytes(calib_dir / STATISTICS_FILE, data)
    atomic_write_json(calib_dir / RECORD_FILE, record)


def _rounds(done: int, total: int, group: distributed.Group, batch_size: int):
    """(first sample of the round, this process's slice) for every round of world × batch_size samples."""
    step = group.world * batch_size
    for start in range(done, total, step):
        mine = start + group.rank * batch_size
        yield start, slice(min(mine, total), min(mine + batch_size, total))


def calibrate(req: CalibrationRequest, out_dir: str | Path,
              on_progress: Callable[[int, int, float], None] | None = None,
              on_loaded: Callable[[dict], None] | None = None, loaded=None) -> dict:
    """Run (or resume) a calibration into out_dir; returns the provenance record.

    on_loaded(record) is called once the model and samples are ready; on_progress(done, total,
    tokens_per_s) after every round. `loaded` (models.LoadedModel) skips loading req.model.
    Under torchrun (several processes) every process runs its share of each round; rank 0 writes and
    calls the callbacks, and returns the record (the other ranks return it too, without timings of theirs).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise OscarError(f"--out {out_dir} exists and is not a directory")
    if req.samples < 1 or req.seq_len < 2 or req.batch_size < 1:
        raise OscarError("--samples, --seq-len and --batch-size must be positive (seq-len at least 2)")
    device = resolve_device(req.device)
    group = distributed.from_env()
    if device.startswith("cuda") and loaded is None:
        gpus = distributed.process_gpus(group, torch.cuda.device_count(), req.shard)
        device = f"cuda:{gpus[0]}"
    elif device == "cuda":
        device = f"cuda:{group.local_rank}"
    group = distributed.join(device)
    try:
        record = _calibrate(req, out_dir, device, group, on_progress, on_loaded, loaded)
        distributed.barrier(group)  # every process returns once rank 0 has written
        return record
    finally:
        distributed.leave(group)


def _calibrate(req, out_dir, device, group, on_progress, on_loaded, loaded) -> dict:
    t0 = time.perf_counter()
    if loaded is None:
        memory = gpu_memory(distributed.process_gpus(group, torch.cuda.device_count(), req.shard)) \
            if device.startswith("cuda") else None
        loaded = load_model(req.model, device, req.dtype, max_memory=memory)
    info = loaded.info
    device = str(loaded.model.get_input_embeddings().weight.device)
    if info.max_position_embeddings and req.seq_len > info.max_position_embeddings:
        raise OscarError(f"--seq-len {req.seq_len} is above the model's limit of {info.max_position_embeddings} tokens")
    t1 = time.perf_counter()
    stats, done, record, samples = None, 0, None, None
    if group.first:
        samples, fingerprint = load_samples(req.data, loaded.tokenizer, req.samples, req.seq_len, req.seed,
                                            req.split, req.text_field)
        record = {
            "model": info.model_dump(mode="json"),
            "data": {"source": req.data or DEFAULT_CALIBRATION, "split": req.split, "text_field": req.text_field,
                     "fingerprint": fingerprint, "bos_prefix": bos_prefix(loaded.tokenizer)},
            "samples": req.samples, "seq_len": req.seq_len, "seed": req.seed, "batch_size": req.batch_size,
            "device": device, "dtype": str(next(loaded.model.parameters()).dtype).removeprefix("torch."),
            "tool_version": __version__, "samples_done": 0, "tokens": 0, "complete": False,
            "model_source": model_source(req.model), "platform": platform_record(device),
        }
        layers = attention_layer_ids(loaded.model.config)
        if layers is not None:  # a hybrid model: only these layers are observed (the others keep zero statistics)
            record["attention_layers"] = layers
        sliding = windows(layer_specs(loaded.model.config))
        if sliding is not None:  # observed through their window, as the model attends (statistics.observe_attention)
            record["windows"] = {str(i): w for i, w in sliding.items()}
        rope = rope_frequencies(loaded.model)
        if rope is not None:  # export scores key formats at far positions by turning the probe (rope.turn)
            record["rope_inv_freq"] = rope
        if group.world > 1 or len(model_devices(loaded.model)) > 1:
            record["processes"] = group.world
            record["devices"] = model_devices(loaded.model)
        stats, done = _resume(out_dir, record, info, device)
    record, samples, done = distributed.broadcast(group, (record, samples, done))
    t2 = time.perf_counter()
    if stats is None:
        stats = AttentionStatistics(info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim, device=device)
    if record.get("complete") and done == req.samples:
        return record
    if on_loaded and group.first:
        on_loaded(record)

    forward_s, window_start, saved_at = 0.0, done, time.perf_counter()
    with torch.inference_mode(), observe_attention(loaded.model, stats.observe):
        for start, mine in _rounds(done, req.samples, group, req.batch_size):
            t = time.perf_counter()
            if mine.start < mine.stop:
                stats.first_sample = mine.start
                loaded.model(input_ids=samples[mine].to(device), use_cache=False, logits_to_keep=1)
                if device.startswith("cuda"):
                    torch.cuda.synchronize(device)
            forward_s += time.perf_counter() - t
            end = min(start + group.world * req.batch_size, req.samples)
            due = end == req.samples or time.perf_counter() - saved_at >= req.checkpoint_s
            if distributed.agree(group, due, device):
                sums, rows = distributed.reduce_to_first(group, *stats.pending(), device,
                                                         gather_probes=window_start < stats.probe_samples)
                window_start, saved_at = end, time.perf_counter()
                if group.first:
                    stats.add(sums, rows)
                    bad = stats.non_finite()
                    if bad:
                        raise OscarError(f"NaN or Inf in gathered statistics ({bad}) after sample {end - 1}: "
                                         "try --dtype float32, or check the model's weights")
            if not group.first:
                continue
            record.update(samples_done=end, tokens=end * req.seq_len, complete=end == req.samples)
            record["timings"] = {"load_s": round(t1 - t0, 3), "data_s": round(t2 - t1, 3),
                                 "forward_s": round(forward_s, 3),
                                 "tokens_per_s": round((end - start) * req.seq_len / max(time.perf_counter() - t, 1e-9), 1)}
            if due:
                _save(out_dir, stats, end, record)
            if on_progress:
                on_progress(end, req.samples, record["timings"]["tokens_per_s"])
    return record


def _resume(out_dir: Path, record: dict, info, device: str) -> tuple[AttentionStatistics, int]:
    """The statistics to continue from (zero for a new directory) and the samples they count."""
    stats = AttentionStatistics(info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim, device=device)
    if not (out_dir / RECORD_FILE).exists():
        return stats, 0
    previous = read_record(out_dir)
    if _identity(previous) != _identity(record):
        changed = next(k for k in IDENTITY_KEYS if previous.get(k) != record[k])
        raise OscarError(f"{out_dir} holds a calibration of other inputs ({changed} differs): "
                         "use another --out or delete it")
    for name in (STATISTICS_FILE, RECORD_FILE):  # temporary files left by a process stopped mid-write
        remove_stale_temporaries(out_dir / name)
    if not (out_dir / STATISTICS_FILE).exists():
        return stats, 0
    if previous.get("complete"):
        record.clear()
        record.update(previous)
        return stats, previous["samples_done"]
    stats, done = read_statistics(out_dir, info.num_heads)
    return AttentionStatistics.from_state_dict(stats.state_dict(), info.num_heads, device=device), done
