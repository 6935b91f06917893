"""The method authors' rotation files (their SGLang tree, the OSCAR-RotationZoo hub repo), both ways.

Layout: <root>/<Model>/seq<T>_prompt<N>_group<G>/ (T calibration tokens, N prompts, G the INT2 group size) with
    k_rotation_qqt_r_h_pbr.pt   v_rotation_sst_r_h_pbr.pt
each a torch.save of a plain dict
    {"format_version": 1 | 2, "objective": "qqt" | "sst", "source_grouping": "layer",
     "layers": {layer_id: {"layer_id": int, "rotation": float32 [d, d] | [kv_heads, d, d],
                           "eigenvalues": float32 [d] | [kv_heads, d]}}}
with global layer ids (a hybrid model keys only its attention layers). A row vector is stored as x·R, as in our
bundles, so a rotation moves between the formats unchanged; a [d, d] rotation serves every KV head of its layer.

Format version 1 holds one [d, d] rotation per layer: the only shape the authors' loader (load_oscar_rotations in
their sglang-research tree's mem_cache/memory_pool.py) and the vLLM work-in-progress PR accept, so an export writes
it by default, from C_Q and C_S averaged over the KV heads. Version 2 holds one [kv_heads, d, d] rotation per KV head
(the "V2" a newer SGLang tree also reads): written only when asked (per_head); their runtime cannot fold per-head value
rotations into the weights, so its serve command leaves SGLANG_OSCAR_ABSORB_V_ROTATION off. Import reads both (and the
per-head files older oscar exports labelled version 1).

What the files do not carry, and what this module does about it:
- key (and value) means: their runtime does not centre, so the served variant stores k·R_K, not (k − μ_K)·R_K;
- clip ratios: two global numbers in the environment (SGLANG_OSCAR_K_CLIP_RATIO, default 0.96; ..._V_..., 0.92),
  not one per layer and head: an export picks one per side (searched on the calibration probe, or their defaults);
- the group size: only in the directory name and the serve command (--kv-cache-quant-group-size, default 128),
  capped at head_dim here as everywhere in oscar (a group never spans two heads).
Their value statistics differ from ours (w-weighted VᵀV against our C_S = OᵀO/N); the file name stays "sst"
because that is the name their loader is pointed at.

.pt files are pickles: they are read with torch.load(weights_only=True) only, and anything that needs more is
refused. Export writes the two files, serve.sh (environment and command) and oscar_upstream.json (what was
chosen and dropped) into one directory, atomically.
"""

import io
import json
import pickle
import re
import shlex
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from oscar_core import __version__
from oscar_core.formats.bundle import (CONTEXTS_REPORTED, MAX_TOKENS, Bundle, CalibrationInfo, Manifest, ModelInfo,
                                       QuantInfo, RotationInfo, SourceInfo, TensorFileInfo, bundle_layers,
                                       group_size_problem, schema_errors, write_bundle)
from oscar_core.errors import OscarError, UsageError
from oscar_core.formats.fileio import atomic_write_dir, canonical_json, path_under, sha256_bytes
from oscar_core.rotations import eigenvalues, label, orthogonality_error, oscar_covariance, rotation

FORMAT_VERSIONS = {"layer": 1, "head": 2}   # the format version that carries each grouping
FORMAT_NAME = "upstream RotationZoo (SGLang)"
FILES = {"key": "k_rotation_qqt_r_h_pbr.pt", "value": "v_rotation_sst_r_h_pbr.pt"}
OBJECTIVES = {"key": "qqt", "value": "sst"}
COMPOSITIONS = {"key": label("oscar", "U_Q"), "value": label("oscar", "U_S")}  # U·H·P_br, the "r_h_pbr" of the names
UPSTREAM_CLIPS = {"key": 0.96, "value": 0.92}
UPSTREAM_GROUP = 128
RECORD_FILE = "oscar_upstream.json"
SERVE_FILE = "serve.sh"
ORTHOGONALITY_TOLERANCE = 1e-5  # the same bound oscar verify holds every rotation to
DIRECTORY = re.compile(r"^seq(\d+)_prompt(\d+)_group(\d+)$")
CLIP_ENV = {"key": "SGLANG_OSCAR_K_CLIP_RATIO", "value": "SGLANG_OSCAR_V_CLIP_RATIO"}
ROTATION_ENV = {"key": "SGLANG_OSCAR_K_ROTATION_PATH", "value": "SGLANG_OSCAR_V_ROTATION_PATH"}


def directory_name(tokens: int, prompts: int, group_size: int) -> str:
    return f"seq{tokens}_prompt{prompts}_group{group_size}"


def parse_directory_name(name: str) -> tuple[int, int, int] | None:
    """(tokens, prompts, group size) from seq<T>_prompt<N>_group<G>, or None."""
    m = DIRECTORY.match(name)
    return None if m is None else tuple(int(x) for x in m.groups())


def model_directory(model_id: str) -> str:
    """<Model> of the layout: the last part of a hub id (their repo uses e.g. Qwen3-8B), without .gguf."""
    return re.sub(r"\.gguf$", "", model_id.rstrip("/").rsplit("/", 1)[-1])


def served_group_size(group_size: int, head_dim: int) -> int:
    """The group actually used: capped at head_dim (a group never spans two heads); a power of two dividing it."""
    g = min(group_size, head_dim)
    if group_size_problem(g, head_dim):
        raise UsageError(f"group size {group_size} must be a power of two of at least 4 that divides head_dim "
                         f"{head_dim} (or exceeds it: it is then capped at {head_dim})")
    return g


# ---------------------------------------------------------------------------------------------------- files

def rotation_file_bytes(side: str, rotations: dict[int, torch.Tensor], eigen: dict[int, torch.Tensor]) -> bytes:
    """torch.save bytes of one side's file; rotations [d, d] (format version 1) or [kv_heads, d, d] (version 2),
    eigenvalues [d] or [kv_heads, d]."""
    grouping = "layer" if next(iter(rotations.values())).dim() == 2 else "head"
    layers = {int(i): {"layer_id": int(i), "rotation": rotations[i].detach().float().cpu().clone().contiguous(),
                       "eigenvalues": eigen[i].detach().float().cpu().clone().contiguous()}
              for i in sorted(rotations)}
    buffer = io.BytesIO()
    torch.save({"format_version": FORMAT_VERSIONS[grouping], "objective": OBJECTIVES[side], "source_grouping": "layer",
                "layers": layers}, buffer)
    return buffer.getvalue()


def load_rotation_file(path: Path) -> dict:
    """torch.load(weights_only=True) of one file: tensors and plain data only, never code."""
    if not path.is_file():
        raise OscarError(f"missing {path.name} in {path.parent}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        why = next((line.strip() for line in str(e).splitlines() if "global" in line.lower()), None)
        if "weights only load failed" in str(e).lower() and why:  # a class or function to import and call
            raise OscarError(f"refused {path}: it needs code execution to load, not only tensors and plain data "
                             f"({why.rstrip('.')}); it was not loaded") from None
        raise OscarError(f"corrupt or truncated rotation file {path}: {str(e).splitlines()[0]}") from None
    except (RuntimeError, EOFError, ValueError, OSError, zipfile.BadZipFile, KeyError, IndexError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise OscarError(f"corrupt or truncated rotation file {path}: {first}") from None
    if not isinstance(obj, dict):
        raise OscarError(f"{path} is not a rotation file: it holds a {type(obj).__name__}, not a dict")
    return obj


@dataclass
class SideFile:
    """One side's validated file: per layer a rotation [kv_heads, d, d] and eigenvalues [kv_heads, d] (or None)."""
    objective: str
    grouping: str                       # "layer" ([d, d] in the file, broadcast) or "head"
    rotations: dict[int, torch.Tensor]
    eigenvalues: dict[int, torch.Tensor | None]
    sha256: str
    format_version: int = 1


def validate_side(obj: dict, side: str, path: Path, model: ModelInfo, layers: list[int]) -> dict:
    """Check one file's dict against the schema and the model: its objective, grouping, rotations, eigenvalues and
    format_version, as SideFile takes them."""
    kv, d = model.num_kv_heads, model.head_dim
    name = path.name
    version = obj.get("format_version")
    if version not in FORMAT_VERSIONS.values() or isinstance(version, bool):
        raise OscarError(f"{name}: format_version {version!r} is not supported (only "
                         f"{' or '.join(map(str, FORMAT_VERSIONS.values()))})")
    objective = obj.get("objective")
    if not isinstance(objective, str) or objective.split("_")[0] != OBJECTIVES[side]:
        raise OscarError(f"{name}: objective {objective!r} is not a {side} objective ({OBJECTIVES[side]!r})")
    if obj.get("source_grouping", "layer") != "layer":
        raise OscarError(f"{name}: source_grouping {obj.get('source_grouping')!r} is not supported (only 'layer')")
    entries = obj.get("layers")
    if not isinstance(entries, dict) or not entries:
        raise OscarError(f"{name}: no 'layers' dict")
    rotations, eigen, shapes = {}, {}, set()
    for key, entry in entries.items():
        if isinstance(key, str) and key.isdigit():
            key = int(key)
        if not isinstance(key, int) or isinstance(key, bool) or not isinstance(entry, dict):
            raise OscarError(f"{name}: layer key {key!r} is not an integer layer id with a dict")
        if entry.get("layer_id", key) != key:
            raise OscarError(f"{name}: layer {key} says layer_id {entry.get('layer_id')!r}")
        r = entry.get("rotation")
        if not isinstance(r, torch.Tensor) or not r.is_floating_point():
            raise OscarError(f"{name}: layer {key} has no floating-point rotation tensor")
        if tuple(r.shape) not in ((d, d), (kv, d, d)):
            raise OscarError(f"{name}: layer {key} rotation has shape {tuple(r.shape)}; the model needs "
                             f"[{d}, {d}] or [{kv}, {d}, {d}] (kv_heads {kv}, head_dim {d})")
        if not torch.isfinite(r).all():
            raise OscarError(f"{name}: layer {key} rotation holds NaN or Inf")
        err = orthogonality_error(r)
        if err > ORTHOGONALITY_TOLERANCE:
            raise OscarError(f"{name}: layer {key} rotation is not orthogonal (max |RᵀR − I| = {err:.1e} > "
                             f"{ORTHOGONALITY_TOLERANCE:g})")
        shapes.add(r.dim())
        rotations[key] = r.float().expand(kv, d, d).contiguous()
        e = entry.get("eigenvalues")
        if e is not None:
            if not isinstance(e, torch.Tensor) or tuple(e.shape) not in ((d,), (kv, d)) or not torch.isfinite(e).all():
                raise OscarError(f"{name}: layer {key} eigenvalues must be finite, [{d}] or [{kv}, {d}]")
            e = e.float().expand(kv, d).contiguous()
        eigen[key] = e
    if len(shapes) > 1:
        raise OscarError(f"{name}: mixes per-layer [d, d] and per-head [kv_heads, d, d] rotations")
    if version == FORMAT_VERSIONS["head"] and shapes != {3}:
        raise OscarError(f"{name}: format_version {version} holds per-head [kv_heads, d, d] rotations, not [d, d]")
    have, want = sorted(rotations), sorted(layers)
    if have != want:
        missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        what = (f"has layer {extra[0]}, which the model has no attention layer for" if extra else
                f"lacks layer {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        raise OscarError(f"{name}: {what}; the model's attention layers are {_ranges(want)}")
    return {"objective": objective, "grouping": "layer" if shapes == {2} else "head", "rotations": rotations,
            "eigenvalues": eigen, "format_version": version}


def _ranges(ids: list[int]) -> str:
    return f"0..{ids[-1]}" if ids == list(range(len(ids))) else ", ".join(map(str, ids))


def read_upstream_dir(directory: str | Path, model: ModelInfo, layers: list[int] | None = None) -> dict[str, SideFile]:
    """Load and validate both files of an upstream directory against the model; layers: the model's attention
    layer ids (a hybrid model's), None for every layer."""
    directory = Path(directory)
    if not directory.is_dir():
        raise OscarError(f"upstream rotation directory not found: {directory}")
    objs = {side: load_rotation_file(directory / file) for side, file in FILES.items()}
    return side_files(objs, {side: sha256_bytes((directory / file).read_bytes()) for side, file in FILES.items()},
                      directory, model, layers)


def side_files(objs: dict[str, dict], shas: dict[str, str], directory: Path, model: ModelInfo,
               layers: list[int] | None = None) -> dict[str, SideFile]:
    """Both sides' loaded dicts (side -> the file's dict, and its sha256) validated against the model."""
    layers = list(range(model.num_layers)) if layers is None else sorted(layers)
    out = {side: SideFile(**validate_side(objs[side], side, directory / FILES[side], model, layers), sha256=shas[side])
           for side in FILES}
    if out["key"].grouping != out["value"].grouping:
        raise OscarError(f"{directory}: the key file is per {out['key'].grouping}, the value file per "
                         f"{out['value'].grouping}: both must be the same")
    return out


# ---------------------------------------------------------------------------------------------------- import

def read_record(directory: Path) -> dict | None:
    """The oscar_upstream.json an oscar export left beside the files, or None."""
    path = directory / RECORD_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise OscarError(f"corrupt {path}: not JSON (delete it to import with the upstream defaults)") from None


def import_upstream(directory: str | Path, zoo_root: str | Path, model: ModelInfo, layers: list[int] | None = None,
                    key_clip: float | None = None, value_clip: float | None = None, group_size: int | None = None,
                    name: str | None = None, version: str | None = None,
                    specs: list | None = None) -> tuple[Path, Manifest, dict[str, SideFile]]:
    """An upstream directory -> a bundle <zoo_root>/<name>/<version>/ that verify and eval read as any other."""
    manifest, tensors, files = upstream_bundle(directory, model, layers, key_clip, value_clip, group_size, name, version,
                                               specs)
    out = path_under(zoo_root, f"{manifest.name}/{manifest.version}", "bundle name")
    return out, write_bundle(out, manifest, tensors), files


def served_windows(record: dict | None) -> tuple[int, int]:
    """(sink, recent) BF16 tokens: as an oscar export recorded them, else the runtime's defaults; a recorded value
    that is no count of tokens (0..MAX_TOKENS) is an error naming the record."""
    try:
        env = record["serve"]["env"] if record is not None else {}
        sink, recent = (int(env.get(f"SGLANG_MIXED_KV_{k}_TOKENS", d)) for k, d in (("PREFIX", 64), ("RECENT", 256)))
    except (KeyError, TypeError, ValueError, AttributeError):
        raise OscarError(f"{RECORD_FILE}: serve.env does not hold the BF16 windows as integers") from None
    if not (0 <= sink <= MAX_TOKENS and 0 <= recent <= MAX_TOKENS):
        raise OscarError(f"{RECORD_FILE}: BF16 windows sink {sink}, recent {recent} must be 0..{MAX_TOKENS} tokens")
    return sink, recent


def upstream_bundle(directory: str | Path, model: ModelInfo, layers: list[int] | None = None,
                    key_clip: float | None = None, value_clip: float | None = None, group_size: int | None = None,
                    name: str | None = None, version: str | None = None, specs: list | None = None):
    """An upstream directory as (manifest, tensors, files) of a bundle, nothing written.

    specs (the model's layers.layer_specs, instead of `layers`): the layers expected are those that hold INT2 tokens
    at the recorded BF16 windows, and the manifest records the model's sliding windows as oscar export does.

    Keys and values are not centred; one clip ratio per side for every layer and head: the given ones, else those
    an oscar export recorded beside the files (oscar_upstream.json, when its checksums match), else the upstream
    defaults 0.96 / 0.92. The group size: given, else from the directory name; capped at head_dim."""
    from oscar_core.layers import int2_layer_ids

    directory = Path(directory)
    record = read_record(directory)
    if specs is not None:
        layers = int2_layer_ids(specs, *served_windows(record))
    files = read_upstream_dir(directory, model, layers)
    return files_bundle(files, directory, record, model, key_clip, value_clip, group_size, name, version, specs)


def files_bundle(files: dict[str, SideFile], directory: Path, record: dict | None, model: ModelInfo,
                 key_clip: float | None = None, value_clip: float | None = None, group_size: int | None = None,
                 name: str | None = None, version: str | None = None, specs: list | None = None):
    """upstream_bundle of validated files (side_files) and the record beside them (read_record, or None)."""
    from oscar_core.calibrate.export import average_bits, bundle_name, check_bundle_name
    from oscar_core.layers import int2_reason, windows

    parsed = parse_directory_name(directory.name)
    if record is not None and record.get("files") != {f: files[s].sha256 for s, f in FILES.items()}:
        record = None  # files changed since the export: its clips no longer describe them
    if group_size is None:
        if parsed is None:
            raise OscarError(f"{directory.name} is not seq<T>_prompt<N>_group<G>: pass --group-size")
        group_size = parsed[2]
    g = served_group_size(group_size, model.head_dim)
    if key_clip is not None or value_clip is not None:
        clips = {"key": UPSTREAM_CLIPS["key"] if key_clip is None else key_clip,
                 "value": UPSTREAM_CLIPS["value"] if value_clip is None else value_clip}
        how = "given on the command line (the other side: upstream default)" if None in (key_clip, value_clip) \
            else "given on the command line"
    elif record is not None:
        clips, how = {s: float(record["clips"][s]) for s in FILES}, f"from {RECORD_FILE}: {record['clips']['how']}"
    else:
        clips, how = dict(UPSTREAM_CLIPS), "upstream defaults (SGLANG_OSCAR_K_CLIP_RATIO 0.96, SGLANG_OSCAR_V_CLIP_RATIO 0.92)"
    for side, c in clips.items():
        if not 0 < c <= 1:
            raise OscarError(f"{side} clip {c} must be in (0, 1]")
    tokens, prompts = (parsed[0], parsed[1]) if parsed else (0, 0)
    version = version or f"upstream-{directory.name}"
    check_bundle_name(name or bundle_name(model), version)

    tensors = {}
    for side, f in files.items():
        for i, r in f.rotations.items():
            tensors[f"layers.{i}.{side}_rotation"] = r
            tensors[f"layers.{i}.{side}_clip"] = torch.full((model.num_kv_heads,), clips[side])
            if f.eigenvalues[i] is not None:
                tensors[f"layers.{i}.{side}_eigenvalues"] = f.eigenvalues[i]
    sink, recent = served_windows(record)
    quant = {"key_group_size": g, "value_group_size": g, "sink_tokens": sink, "recent_tokens": recent}
    sliding = None if specs is None else windows(specs)
    notes = ["keys not centred (the format has no key means)",
             "one clip ratio per side for every layer and head (the runtime takes two numbers)"]
    if record is not None:
        src = record["source"]
        notes.append(f"written by oscar upstream export from {src['bundle']} {src['version']} "
                     f"(sha256 {src['sha256'][:12]}…): value rotation from our C_S = OᵀO/N")
    else:
        notes.append("value rotation from their statistics (sst: w-weighted VᵀV), not our C_S = OᵀO/N")
    if g != group_size:
        notes.append(f"group size {group_size} capped at head_dim {model.head_dim}")
    layer_ids = sorted(files["key"].rotations)
    with schema_errors(f"the files in {directory} give an invalid manifest"):
        manifest = Manifest(
            name=name or bundle_name(model), version=version, model=model,
            quant=QuantInfo(**quant, key_clip=clips["key"], value_clip=clips["value"], clip_scope="global",
                            clip_objective=how, bits_per_element={str(c): average_bits(c, quant) for c in CONTEXTS_REPORTED}),
            rotation=RotationInfo(key=f"{COMPOSITIONS['key']} ({files['key'].objective}, per {files['key'].grouping})",
                                  value=f"{COMPOSITIONS['value']} ({files['value'].objective}, per {files['value'].grouping})",
                                  key_centering=False, value_centering=False,
                                  layers=None if layer_ids == list(range(model.num_layers)) else layer_ids,
                                  windows=None if sliding is None else {str(i): w for i, w in sliding.items()},
                                  layers_reason=None if specs is None else int2_reason(specs, sink, recent)),
            calibration=CalibrationInfo(data=f"upstream rotations {directory.parent.name}/{directory.name}",
                                        data_fingerprint=sha256_bytes("".join(f.sha256 for f in files.values()).encode()),
                                        samples=prompts, seq_len=tokens // prompts if prompts else 0, seed=None,
                                        tokens=tokens),
            tensors=TensorFileInfo(sha256="0" * 64, bytes=0),
            source=SourceInfo(format=FORMAT_NAME, format_version=files["key"].format_version, path=str(directory),
                              directory=directory.name, files={FILES[s]: f.sha256 for s, f in files.items()},
                              objectives={s: f.objective for s, f in files.items()}, grouping=files["key"].grouping,
                              clips=how, notes=notes),
        )
    return manifest, tensors, files


# ---------------------------------------------------------------------------------------------------- export

@dataclass
class ExportPlan:
    """What an export writes and why; files maps file name -> bytes."""
    directory: Path
    files: dict[str, bytes]
    record: dict
    env: dict[str, str]
    command: list[str]
    notes: list[str] = field(default_factory=list)


def serve_env(directory: Path, clips: dict[str, float], sink: int, recent: int, absorb: bool = True) -> dict[str, str]:
    """The environment their SGLang tree reads (SPEC §4b), for rotation files in `directory`; absorb: fold R_V into
    the value projection (their absorb step takes [d, d] rotations only: off for per-head files)."""
    return {"SGLANG_ENABLE_MIXED_KV_WINDOWS": "1",
            ROTATION_ENV["key"]: str(directory / FILES["key"]), ROTATION_ENV["value"]: str(directory / FILES["value"]),
            CLIP_ENV["key"]: f"{clips['key']:g}", CLIP_ENV["value"]: f"{clips['value']:g}",
            "SGLANG_OSCAR_ABSORB_V_ROTATION": "1" if absorb else "0",
            "SGLANG_MIXED_KV_PREFIX_TOKENS": str(sink), "SGLANG_MIXED_KV_RECENT_TOKENS": str(recent),
            "SGLANG_MIXED_KV_SCALE_DTYPE": "float32"}


def serve_command(model_path: str, group_size: int) -> list[str]:
    return ["python", "-m", "sglang.launch_server", "--model-path", model_path, "--kv-cache-dtype", "int2",
            "--kv-cache-quant-group-size", str(group_size), "--decode-attention-backend", "triton",
            "--prefill-attention-backend", "fa3"]


def shell_lines(env: dict[str, str], command: list[str]) -> str:
    """`VAR=value \\` lines then the command: what a user pastes into a shell."""
    lines = [f"{k}={shlex.quote(v)} \\" for k, v in env.items()]
    return "\n".join(lines + [" ".join(shlex.quote(c) for c in command)]) + "\n"


def serve_script(model_id: str, group_size: int, clips: dict[str, float], sink: int, recent: int,
                 absorb: bool = True) -> str:
    """serve.sh: the files' own directory, whatever it is moved to; the model path as $1."""
    env = serve_env(Path("$DIR"), clips, sink, recent, absorb)
    lines = [f'{k}="{v}" \\' if k in ROTATION_ENV.values() else f"{k}={shlex.quote(v)} \\" for k, v in env.items()]
    command = " ".join(shlex.quote(c) for c in serve_command("MODEL", group_size)).replace("MODEL", '"$MODEL"')
    return "\n".join(["#!/bin/sh", "# Serve these OSCAR rotations with the INT2 KV cache of the method authors' SGLang tree.",
                      "# Usage: sh serve.sh [MODEL_PATH_OR_HUB_ID]   (written by oscar upstream export)", "set -e",
                      'DIR="$(cd "$(dirname "$0")" && pwd)"', f'MODEL="${{1:-{model_id}}}"',
                      "exec env \\", *lines, command]) + "\n"


def _check_composition(m: Manifest) -> None:
    for side, want in COMPOSITIONS.items():
        have = getattr(m.rotation, side)
        if have.split(" ")[0] != want:
            raise OscarError(f"the upstream files hold {want} rotations ('r_h_pbr'); this bundle's {side} rotation "
                             f"is {have}: export a bundle built with --{side}-rotation oscar")


def _statistics_for(bundle: Bundle, calib_dir: str | Path):
    from oscar_core.calibrate.calibration import read_record as read_calibration, read_statistics

    record = read_calibration(calib_dir)
    m = bundle.manifest
    if record.get("model", {}).get("config_sha256") != m.model.config_sha256:
        raise OscarError(f"{calib_dir} is a calibration of another model than {m.name}'s")
    if record.get("data", {}).get("fingerprint") != m.calibration.data_fingerprint:
        raise OscarError(f"{calib_dir} is not the calibration {m.name} {m.version} was exported from "
                         "(its data fingerprint differs)")
    stats, done = read_statistics(calib_dir, m.model.num_heads)
    if not record.get("complete") or done != record.get("samples"):
        raise OscarError(f"calibration in {calib_dir} is incomplete")
    return stats


def _axis_cost(m: Manifest, layers: list[int]) -> str:
    """What serving those layers' keys per token costs, from the errors the export recorded (quant.layers)."""
    entries = [e for e in m.quant.layers or () if e.layer in layers and e.errors]
    if not entries:
        return ""
    token = sum(max(v for k, v in e.errors.items() if k.startswith("token")) for e in entries) / len(entries)
    kept = sum(e.errors[e.key_format] for e in entries) / len(entries)
    return (f" (on the calibration probe their keys' relative attention-output error is {token:.3g} per token "
            f"against {kept:.3g} as the bundle keeps them, mean over those layers)")


def plan_export(bundle_path: str | Path, out_root: str | Path, calib_dir: str | Path | None = None,
                group_size: int = UPSTREAM_GROUP, clips: str = "searched", key_clip: float | None = None,
                value_clip: float | None = None, per_head: bool = False) -> ExportPlan:
    """A bundle -> the upstream directory's files (nothing written yet).

    Rotations, by default one per layer (format version 1, what every known loader reads): R = U·H·P_br with U the
    eigenbasis of C̄ = (1/H)·Σ_h C_h, the layer's C_Q (for keys; C_S for values) averaged over its H KV heads, and
    C̄'s eigenvalues. C_h comes from the calibration statistics when calib_dir is given, else from the bundle's own
    rotation R_h and eigenvalues λ_h (rotations.oscar_covariance: C_h = U_h·diag(λ_h)·U_hᵀ with
    U_h = R_h·P_brᵀ·Hᵀ, exact).
    per_head: the bundle's rotations as they are, one per KV head (format version 2), with its eigenvalues, else
    the statistics'. A layer whose keys the bundle keeps per channel is served per token, its key rotation from
    the statistics (needs calib_dir).

    clips: "searched" (one ratio per side, on the calibration probe, minimising the mean over layers and heads of
    the relative key-logit / value-output error of the served variant: keys uncentred, group G; needs calib_dir),
    or "upstream" (0.96 / 0.92); key_clip / value_clip override either."""
    from oscar_core.calibrate.derive import CLIP_GRID, KEY_CLIP_FLOOR, search_global_clip, uncentred_clip_errors

    from oscar_core.evaluate.verify import load_checked

    bundle = load_checked(bundle_path)
    m = bundle.manifest
    _check_composition(m)
    if clips not in ("searched", "upstream"):
        raise OscarError(f"unknown --clips {clips!r}: searched or upstream")
    g = served_group_size(group_size, m.model.head_dim)
    layers = bundle_layers(m)
    kv, d = m.model.num_kv_heads, m.model.head_dim
    grouping = "head" if per_head else "layer"
    # The runtime quantizes keys per token: a layer whose keys the bundle keeps per channel is served per token,
    # with the published U_Q·H·P_br from the statistics in place of its own (per-channel) rotation.
    per_channel = [i for i in layers if bundle.key_axis(i) == "channel"]
    carried = all(bundle.layer(i, f"{s}_eigenvalues") is not None for i in layers for s in FILES)
    searched = clips == "searched" and None in (key_clip, value_clip)
    if (per_channel or searched or not carried) and calib_dir is None:
        why = (f"layers {_ranges(per_channel)} keep keys per channel, which the runtime cannot serve; their "
               "per-token rotation comes from the statistics" if per_channel else
               "--clips searched searches the clips on the calibration probe" if searched else
               "the bundle carries no eigenvalues of C_Q and C_S, which the per-layer rotations are derived from "
               "(or --per-head: the bundle's own rotations, format version 2)" if not per_head else
               "the bundle carries no eigenvalues")
        raise OscarError(f"pass --calibration DIR (the calibration {m.name} {m.version} was exported from): {why}"
                         + ("; or --clips upstream for the upstream defaults" if searched and not per_channel else ""))
    stats = _statistics_for(bundle, calib_dir) if calib_dir is not None else None
    source = "calibration statistics" if stats is not None else "bundle"

    def covariance(side: str, i: int) -> torch.Tensor:   # C_h [kv, d, d] of layer i's side
        if stats is None:
            return oscar_covariance(bundle.layer(i, f"{side}_rotation"), bundle.layer(i, f"{side}_eigenvalues"))
        return stats.query_covariance(i) if side == "key" else stats.score_weighted_value_covariance(i)

    rotations, eigen = {"key": {}, "value": {}}, {"key": {}, "value": {}}
    eigen_source = source if not per_head else "bundle"
    for side in FILES:
        for i in layers:
            if not per_head:
                cov = covariance(side, i).mean(0)
                rotations[side][i], eigen[side][i] = rotation("oscar", cov, g).float(), eigenvalues(cov).float()
            elif side == "key" and i in per_channel:
                rotations[side][i] = rotation("oscar", covariance(side, i), g).float()
                eigen[side][i] = eigenvalues(covariance(side, i)).float()
            else:
                rotations[side][i] = bundle.layer(i, f"{side}_rotation").float()
                kept = bundle.layer(i, f"{side}_eigenvalues")
                if kept is None:
                    kept, eigen_source = eigenvalues(covariance(side, i)), "calibration statistics"
                eigen[side][i] = kept.float()

    chosen, how = {}, {}
    for side, given in (("key", key_clip), ("value", value_clip)):
        if given is not None:
            if not 0 < given <= 1:
                raise OscarError(f"--{side}-clip {given} must be in (0, 1]")
            chosen[side], how[side] = float(given), "given"
        elif clips == "upstream":
            chosen[side], how[side] = UPSTREAM_CLIPS[side], "upstream default"
        else:
            grid = tuple(c for c in CLIP_GRID if c >= KEY_CLIP_FLOOR) if side == "key" else CLIP_GRID
            errors_at = [uncentred_clip_errors(stats, i, side, rotations[side][i].double().expand(kv, d, d), g,
                                               m.quant.sink_tokens) for i in layers]
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # as export: the same bits on every run
            try:
                chosen[side] = search_global_clip(errors_at, grid)
            finally:
                torch.set_num_threads(threads)
            how[side] = (f"searched on the calibration probe, keys uncentred, group {g}: mean relative "
                         + ("logit error, key clip >= 0.8" if side == "key" else "attention-output error"))
    clip_how = "; ".join(f"{s}: {how[s]}" for s in FILES)

    files = {FILES[s]: rotation_file_bytes(s, rotations[s], eigen[s]) for s in FILES}
    directory = path_under(out_root, f"{model_directory(m.model.id)}/"
                           f"{directory_name(m.calibration.tokens, m.calibration.samples, g)}", "model directory")
    sink, recent, absorb = m.quant.sink_tokens, m.quant.recent_tokens, not per_head
    notes = []
    if m.rotation.key_centering:
        notes.append("key centring dropped: the runtime stores k·R_K, not (k − μ_K)·R_K")
    if m.rotation.value_centering:
        notes.append("value centring dropped: the runtime adds no value mean back")
    notes.append(f"per-head clips replaced by one per side: keys {chosen['key']:g}, values {chosen['value']:g}")
    if g != m.quant.key_group_size or g != m.quant.value_group_size:
        notes.append(f"group size {g} (the bundle's: keys {m.quant.key_group_size}, values {m.quant.value_group_size})")
    if g != group_size:
        notes.append(f"group size {group_size} capped at head_dim {d}: one group per head")
    if per_head:
        notes.append(f"one rotation per KV head, format version {FORMAT_VERSIONS['head']}: only an SGLang loader that "
                     "takes [num_kv_heads, d, d] reads it (not the authors' load_oscar_rotations nor the vLLM PR); "
                     "value rotations not folded into the weights (SGLANG_OSCAR_ABSORB_V_ROTATION=0)")
    elif kv > 1:
        notes.append(f"one rotation per layer, the eigenbasis of C_Q (C_S) averaged over the {kv} KV heads (from the "
                     f"{'calibration statistics' if stats is not None else 'bundle: its rotations and eigenvalues'}),"
                     " not the bundle's per-head ones")
    if per_channel:
        notes.append(f"keys per channel not served: the runtime quantizes keys per token, so layers "
                     f"{_ranges(per_channel)} are served per token in U_Q·H·P_br" + _axis_cost(m, per_channel))
    notes.append("value rotation: the eigenbasis of our C_S = OᵀO/N in the file their loader calls 'sst'")
    env = serve_env(directory.resolve(), chosen, sink, recent, absorb)
    command = serve_command(m.model.id, g)
    record = {"format": FORMAT_NAME, "format_version": FORMAT_VERSIONS[grouping],
              "tool": {"name": "oscar", "version": __version__},
              "source": {"bundle": m.name, "version": m.version, "sha256": m.tensors.sha256},
              "model": m.model.model_dump(mode="json"), "layers": layers,
              "directory": directory.name, "grouping": grouping,
              "group_size": {"requested": group_size, "served": g},
              "clips": {**chosen, "how": clip_how},
              "eigenvalues": eigen_source,
              "dropped": notes, "files": {name: sha256_bytes(data) for name, data in files.items()},
              "serve": {"env": serve_env(Path("$DIR"), chosen, sink, recent, absorb),
                        "command": serve_command("$MODEL", g)}}
    files[SERVE_FILE] = serve_script(m.model.id, g, chosen, sink, recent, absorb).encode()
    files[RECORD_FILE] = canonical_json(record).encode()
    return ExportPlan(directory, files, record, env, command, notes)


def with_served(plan: ExportPlan, served: dict) -> ExportPlan:
    """The plan with what its served variant measured (served.summary) in oscar_upstream.json."""
    record = {**plan.record, "served": served}
    return replace(plan, record=record, files={**plan.files, RECORD_FILE: canonical_json(record).encode()})


def served_bundle(plan: ExportPlan, source: Manifest) -> Bundle:
    """What the runtime serves from the plan's files, in memory: the bundle `oscar upstream import` reads back once
    they are written (keys and values uncentred, one clip per side, keys per token, the served group size), for
    verify to measure."""
    from oscar_core.layers import manifest_specs

    objs = {s: torch.load(io.BytesIO(plan.files[f]), map_location="cpu", weights_only=True) for s, f in FILES.items()}
    files = side_files(objs, {s: sha256_bytes(plan.files[f]) for s, f in FILES.items()}, plan.directory,
                       source.model, plan.record["layers"])
    manifest, tensors, _ = files_bundle(files, plan.directory, plan.record, source.model, name=source.name,
                                        specs=manifest_specs(source))
    return Bundle(path=plan.directory, manifest=manifest, tensors=tensors)


def write_export(plan: ExportPlan) -> Path:
    """Write the directory atomically (a reader never sees half of it)."""
    atomic_write_dir(plan.directory, plan.files)
    (plan.directory / SERVE_FILE).chmod(0o755)
    return plan.directory

