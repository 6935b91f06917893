"""`oscar calibrate`: stream token samples through a model and accumulate attention statistics.

A calibration directory holds
- statistics.safetensors: the AttentionStatistics accumulators and probes, and in its metadata the
  number of samples already counted (written atomically after every batch, so a rerun resumes);
- calibration.json: provenance (model, data and its fingerprint, N, L, seed, tool version, timings).
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
from oscar_core.data import DEFAULT_CALIBRATION, load_samples
from oscar_core.errors import OscarError
from oscar_core.fileio import atomic_write_bytes, atomic_write_json
from oscar_core.models import load_model, resolve_device
from oscar_core.provenance import model_source, platform_record
from oscar_core.statistics import AttentionStatistics, observe_attention

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


def _save(calib_dir: Path, stats: AttentionStatistics, done: int, record: dict) -> None:
    data = save(stats.state_dict(), metadata={"samples_done": str(done), "tool_version": __version__})
    atomic_write_bytes(calib_dir / STATISTICS_FILE, data)
    atomic_write_json(calib_dir / RECORD_FILE, record)


def calibrate(req: CalibrationRequest, out_dir: str | Path,
              on_progress: Callable[[int, int, float], None] | None = None,
              on_loaded: Callable[[dict], None] | None = None, loaded=None) -> dict:
    """Run (or resume) a calibration into out_dir; returns the provenance record.

    on_loaded(record) is called once the model and samples are ready; on_progress(done, total,
    tokens_per_s) after every batch. `loaded` (models.LoadedModel) skips loading req.model.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise OscarError(f"--out {out_dir} exists and is not a directory")
    if req.samples < 1 or req.seq_len < 2 or req.batch_size < 1:
        raise OscarError("--samples, --seq-len and --batch-size must be positive (seq-len at least 2)")
    device = resolve_device(req.device)
    t0 = time.perf_counter()
    loaded = loaded or load_model(req.model, device, req.dtype)
    info = loaded.info
    if info.max_position_embeddings and req.seq_len > info.max_position_embeddings:
        raise OscarError(f"--seq-len {req.seq_len} is above the model's limit of {info.max_position_embeddings} tokens")
    t1 = time.perf_counter()
    samples, fingerprint = load_samples(req.data, loaded.tokenizer, req.samples, req.seq_len, req.seed,
                                        req.split, req.text_field)
    t2 = time.perf_counter()
    record = {
        "model": info.model_dump(mode="json"),
        "data": {"source": req.data or DEFAULT_CALIBRATION, "split": req.split, "text_field": req.text_field,
                 "fingerprint": fingerprint},
        "samples": req.samples, "seq_len": req.seq_len, "seed": req.seed, "batch_size": req.batch_size,
        "device": device, "dtype": str(next(loaded.model.parameters()).dtype).removeprefix("torch."),
        "tool_version": __version__, "samples_done": 0, "tokens": 0, "complete": False,
        "model_source": model_source(req.model), "platform": platform_record(device),
    }

    stats, done = AttentionStatistics(info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim,
                                      device=device), 0
    if (out_dir / RECORD_FILE).exists():
        previous = read_record(out_dir)
        if _identity(previous) != _identity(record):
            changed = next(k for k in IDENTITY_KEYS if previous.get(k) != record[k])
            raise OscarError(f"{out_dir} holds a calibration of other inputs ({changed} differs): "
                             "use another --out or delete it")
        if previous.get("complete") and (out_dir / STATISTICS_FILE).exists():
            return previous
        if (out_dir / STATISTICS_FILE).exists():
            stats, done = read_statistics(out_dir, info.num_heads)
            stats = AttentionStatistics.from_state_dict(stats.state_dict(), info.num_heads, device=device)
    if on_loaded:
        on_loaded(record)

    forward_s = 0.0
    with torch.inference_mode(), observe_attention(loaded.model, stats.observe):
        for start in range(done, req.samples, req.batch_size):
            batch = samples[start:start + req.batch_size].to(device)
            t = time.perf_counter()
            loaded.model(input_ids=batch, use_cache=False, logits_to_keep=1)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            forward_s += time.perf_counter() - t
            bad = stats.non_finite()
            if bad:
                raise OscarError(f"NaN or Inf in gathered statistics ({bad}) after sample {start}: "
                                 "try --dtype float32, or check the model's weights")
            done = start + batch.shape[0]
            record.update(samples_done=done, tokens=done * req.seq_len, complete=done == req.samples)
            record["timings"] = {"load_s": round(t1 - t0, 3), "data_s": round(t2 - t1, 3),
                                 "forward_s": round(forward_s, 3),
                                 "tokens_per_s": round(batch.numel() / max(time.perf_counter() - t, 1e-9), 1)}
            _save(out_dir, stats, done, record)
            if on_progress:
                on_progress(done, req.samples, record["timings"]["tokens_per_s"])
    return record
