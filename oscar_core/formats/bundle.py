"""Rotation bundles: the pydantic manifest, safetensors I/O, checksums, atomic writes.

A bundle is a directory `<zoo>/<org>/<model>/<version>/` with
- rotations.safetensors: per layer i
    layers.{i}.key_rotation    float32 [kv_heads, d, d]   R_K, keys are stored as k·R_K
    layers.{i}.value_rotation  float32 [kv_heads, d, d]   R_V, values are stored as v·R_V
    layers.{i}.key_clip        float32 [kv_heads]         c_K
    layers.{i}.value_clip      float32 [kv_heads]         c_V
  and, when the manifest's rotation.key_centering / value_centering say so,
    layers.{i}.key_mean        float32 [kv_heads, d]      μ_K, subtracted before rotation
    layers.{i}.value_mean      float32 [kv_heads, d]      μ_V, subtracted before rotation, added to the output
  and, optionally (bundles imported from the upstream format, or `oscar export --eigenvalues`),
    layers.{i}.key_eigenvalues, layers.{i}.value_eigenvalues   float32 [kv_heads, d]   of C_Q / C_S, descending
  A hybrid model's bundle has these tensors only for the layers listed in rotation.layers, and so has a model
  with sliding layers whose window is too short for INT2 (rotation.windows, rotation.layers_reason).
- manifest.json: the Manifest below; tensors.sha256 is the checksum of rotations.safetensors.

The schema holds every value to what the format allows (finite numbers, counts and windows >= 0, clips in (0, 1],
group sizes that are powers of two dividing head_dim, layer ids within the model, names that are plain relative
paths, tensors.file a bare file name), so a bad manifest fails at load, whoever loads it.
"""

import contextlib
import json
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from oscar_core import __version__
from oscar_core.errors import OscarError
from oscar_core.formats.fileio import atomic_write_dir, canonical_json, check_name, sha256_bytes

SCHEMA_VERSION = 1
TENSOR_FILE = "rotations.safetensors"
MANIFEST_FILE = "manifest.json"
CONTEXTS_REPORTED = (32768, 131072)
MAX_TOKENS = 1 << 24                    # the largest sink or recent window (tokens) a manifest may give
NAME = r"^[A-Za-z0-9._-]+/[A-Za-z0-9._-]+$"
VERSION = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
TEXT = r"^[^\x00-\x1f\x7f]*$"          # one line: no control characters (they reach cards and tables)


def group_size_problem(size: int, head_dim: int) -> str | None:
    """Why `size` cannot group head_dim channels (or tokens) for INT2, or None: it must be a power of two of at
    least 4 that divides head_dim."""
    if size < 4 or size & (size - 1) or head_dim % size:
        return f"group size {size} must be a power of two of at least 4 that divides head_dim {head_dim}"
    return None


def plain_name(name: str, what: str) -> str:
    """fileio.check_name as a pydantic validator: its OscarError as the ValueError pydantic reports."""
    try:
        return check_name(name, what)
    except OscarError as e:
        raise ValueError(str(e)) from None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)


class ModelInfo(Strict):
    id: str = Field(min_length=1, pattern=TEXT, description="hub id, directory name or .gguf file name")
    revision: str | None = Field(None, description="hub commit, when loaded from a hub")
    file_sha256: str | None = Field(None, description="sha256 of the weights file, when loaded from a file")
    config_sha256: str = Field(description="sha256 of the canonical attention facts of the config")
    architecture: str = Field(pattern=TEXT)
    num_layers: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    max_position_embeddings: int = Field(ge=0)
    rope_position: Literal["post_rope"] = "post_rope"

    @model_validator(mode="after")
    def _heads_group(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        return self


class LayerQuant(Strict):
    """How one layer's keys are quantized, and the figures that decided it (derive.choose_key_axis)."""
    layer: int = Field(ge=0)
    key_axis: Literal["token", "channel"] = Field(
        description="token: groups of G channels of one token; channel: groups of G tokens of one channel")
    key_format: str | None = Field(None, description="the axis and the rotation of the kept keys, e.g. 'channel U_Q'")
    errors: dict[str, float] = Field(default_factory=dict, description="candidate format -> the relative attention-"
                                     "output error its keys (alone) leave on the calibration probe")


class QuantInfo(Strict):
    bits: Literal[2] = 2
    key_group_size: int = Field(64, ge=1)
    value_group_size: int = Field(64, ge=1)
    scale_format: Literal["log2-u8+zero-quarter-i8"] = "log2-u8+zero-quarter-i8"
    key_clip: float = Field(gt=0, le=1, description="mean of the calibrated per-head key clip ratios")
    value_clip: float = Field(gt=0, le=1, description="mean of the calibrated per-head value clip ratios")
    clip_scope: Literal["per_layer_head", "global"] = "per_layer_head"
    clip_objective: str = Field("keys: attention-logit error; values: attention-output error", pattern=TEXT)
    sink_tokens: int = Field(64, ge=0, le=MAX_TOKENS)
    recent_tokens: int = Field(256, ge=0, le=MAX_TOKENS)
    bits_per_element: dict[str, float] = Field(description="context length -> average bits per K/V element")
    layers: list[LayerQuant] | None = Field(None, description="per layer with rotations, the key axis chosen and "
                                            "why; None: every layer's keys per token (bundles before it)")

    @field_validator("bits_per_element")
    @classmethod
    def _bits(cls, bits: dict[str, float]) -> dict[str, float]:
        for context, value in bits.items():
            if not context.isdigit() or not 0 < value <= 16:
                raise ValueError(f"{context!r}: {value} is not a context length (digits) with bits in (0, 16]")
        return bits


class RotationInfo(Strict):
    key: str = Field(pattern=TEXT, description="composition of R_K, e.g. 'U_Q·H·P_br'")
    value: str = Field(pattern=TEXT, description="composition of R_V, e.g. 'U_S·H·P_br'")
    key_centering: bool = False
    value_centering: bool = False
    hadamard: Literal["sylvester"] = "sylvester"
    permutation: Literal["bit_reversal"] = "bit_reversal"
    eigenvector_signs: Literal["largest_magnitude_positive"] = "largest_magnitude_positive"
    layers: list[int] | None = Field(None, description="global ids of the layers with rotations (a hybrid model's "
                                                       "attention layers); None: every layer")
    windows: dict[str, int] | None = Field(None, description="sliding window (tokens) of each sliding layer, those "
                                           "kept whole in BF16 included; None: no sliding layer")
    layers_reason: str | None = Field(None, description="why the KV layers missing from `layers` hold no INT2 tokens")


class CalibrationInfo(Strict):
    data: str = Field(pattern=TEXT)
    data_fingerprint: str = Field(pattern=TEXT)
    samples: int = Field(ge=0)
    seq_len: int = Field(ge=0)
    seed: int | None = Field(description="sampling seed; None when unknown (imported rotations)")
    tokens: int = Field(ge=0)
    model_source: str | None = Field(None, description="where the model was loaded from ('default', a path or a hub "
                                                       "id): verify's hint when --model is not given")
    platform: dict[str, str] | None = Field(None, description="provenance.platform_record() of the build: torch, "
                                            "BLAS/LAPACK, CPU capability, Python, machine; absent in older bundles")
    bos_prefix: list[int] | None = Field(None, description="the tokens every calibration window started with (the "
                                         "tokenizer's BOS, data.bos_prefix); absent: none")


class TensorFileInfo(Strict):
    file: str = Field(TENSOR_FILE, description="a bare file name inside the bundle directory")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0)

    @field_validator("file")
    @classmethod
    def _bare(cls, file: str) -> str:
        if "/" in plain_name(file, "tensors.file"):
            raise ValueError(f"{file!r} is not a bare file name inside the bundle directory")
        return file


class ToolInfo(Strict):
    name: str = "oscar"
    version: str = __version__


class SourceInfo(Strict):
    """Where an imported bundle came from (oscar_core/publish/upstream.py)."""
    format: str = Field(description="e.g. 'upstream RotationZoo (SGLang)'")
    format_version: int
    path: str = Field(description="the directory it was imported from, as given")
    directory: str = Field(description="seq<T>_prompt<N>_group<G>")
    files: dict[str, str] = Field(description="file name -> sha256")
    objectives: dict[str, str] = Field(description="key / value -> the files' objective")
    grouping: Literal["layer", "head"] = Field(description="one rotation per layer (broadcast to every KV head) or per head")
    clips: str = Field(description="where the clip ratios came from")
    notes: list[str] = Field(default_factory=list, description="what the format does not carry")


class Manifest(Strict):
    schema_version: Literal[1] = SCHEMA_VERSION
    name: str = Field(pattern=NAME, description="<org>/<model>")
    version: str = Field(pattern=VERSION)
    model: ModelInfo
    quant: QuantInfo
    rotation: RotationInfo
    calibration: CalibrationInfo
    tensors: TensorFileInfo
    tool: ToolInfo = ToolInfo()
    max_logit_error: float = Field(0.5, gt=0, description="oscar verify fails when the OSCAR logit error passes this")
    fidelity: dict[str, float] | None = Field(None, description="verify figures, when recorded")
    max_kl: float | None = Field(None, gt=0, description="oscar verify fails when OSCAR's next-token KL (nats) passes "
                                 "this; unset: verify's default (0.1)")
    source: SourceInfo | None = Field(None, description="provenance of an imported bundle")

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return plain_name(name, "bundle name")

    @model_validator(mode="after")
    def _within_the_model(self):
        m, q, r = self.model, self.quant, self.rotation
        for side, size in (("key", q.key_group_size), ("value", q.value_group_size)):
            if group_size_problem(size, m.head_dim):
                raise ValueError(f"quant.{side}_group_size: {group_size_problem(size, m.head_dim)}")
        ids = range(m.num_layers)
        if r.layers is not None and (not r.layers or sorted(set(r.layers)) != r.layers or not set(r.layers) <= set(ids)):
            raise ValueError(f"rotation.layers {r.layers} must be distinct, ascending ids of some of the model's "
                             f"{m.num_layers} layers")
        for layer, window in (r.windows or {}).items():
            if not layer.isdigit() or int(layer) not in ids or window < 0:
                raise ValueError(f"rotation.windows: layer {layer!r} window {window} must name a layer of the model's "
                                 f"{m.num_layers} with a window >= 0")
        stray = sorted({e.layer for e in q.layers or ()} - set(bundle_layers(self)))
        if stray:
            raise ValueError(f"quant.layers: layer {stray[0]} is not a layer with rotations")
        return self


def schema_message(e: ValidationError) -> str:
    """The first problem pydantic found, as '<field>: <why>'."""
    first = e.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    why = first["msg"].removeprefix("Value error, ")
    return f"{where}: {why}" if where else why


@contextlib.contextmanager
def schema_errors(what: str):
    """Inside, a pydantic ValidationError becomes one OscarError line: '<what>: <field>: <why>'."""
    try:
        yield
    except ValidationError as e:
        raise OscarError(f"{what}: {schema_message(e)}") from None


class Bundle(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    path: Path
    manifest: Manifest
    tensors: dict[str, torch.Tensor]

    def layer(self, i: int, name: str) -> torch.Tensor | None:
        return self.tensors.get(f"layers.{i}.{name}")

    def key_axis(self, i: int) -> str:
        """"token" or "channel": how layer i's keys are grouped for INT2 (manifest quant.layers)."""
        for entry in self.manifest.quant.layers or ():
            if entry.layer == i:
                return entry.key_axis
        return "token"


def bundle_layers(m: Manifest) -> list[int]:
    """The global ids of the layers that carry rotations (hold INT2 tokens): every layer, or a hybrid model's
    attention layers, less sliding layers kept whole in BF16."""
    return list(range(m.model.num_layers)) if m.rotation.layers is None else list(m.rotation.layers)


OPTIONAL_TENSORS = ("key_eigenvalues", "value_eigenvalues")


def expected_shapes(m: Manifest) -> dict[str, tuple[int, ...]]:
    h, d = m.model.num_kv_heads, m.model.head_dim
    shapes = {}
    for i in bundle_layers(m):
        shapes[f"layers.{i}.key_rotation"] = (h, d, d)
        shapes[f"layers.{i}.value_rotation"] = (h, d, d)
        shapes[f"layers.{i}.key_clip"] = (h,)
        shapes[f"layers.{i}.value_clip"] = (h,)
        if m.rotation.key_centering:
            shapes[f"layers.{i}.key_mean"] = (h, d)
        if m.rotation.value_centering:
            shapes[f"layers.{i}.value_mean"] = (h, d)
    return shapes


def tensor_bytes(tensors: dict[str, torch.Tensor], manifest: Manifest) -> bytes:
    metadata = {"format": "pt", "oscar_schema": str(SCHEMA_VERSION), "name": manifest.name,
                "version": manifest.version}
    contiguous = {k: v.detach().to(torch.float32).contiguous().cpu() for k, v in sorted(tensors.items())}
    return canonical_header(save_safetensors(contiguous, metadata=metadata))


def canonical_header(data: bytes) -> bytes:
    """Rewrite a safetensors header with sorted keys: safetensors writes __metadata__ in hash order,
    which changes from call to call, and a bundle must be the same bytes every time it is built."""
    n = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8:8 + n]), separators=(",", ":"), sort_keys=True).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + data[8 + n:]


def manifest_json(manifest: Manifest) -> str:
    """Canonical JSON; the optional fields added after schema 1 shipped (source, rotation.layers, .windows,
    .layers_reason, quant.layers, max_kl, calibration.bos_prefix) are left out when unset (a BOS prefix when empty),
    so manifests written before them keep their bytes."""
    dump = manifest.model_dump(mode="json")
    if dump["source"] is None:
        del dump["source"]
    for name in ("layers", "windows", "layers_reason"):
        if dump["rotation"][name] is None:
            del dump["rotation"][name]
    if dump["quant"]["layers"] is None:
        del dump["quant"]["layers"]
    if dump["max_kl"] is None:
        del dump["max_kl"]
    if not dump["calibration"]["bos_prefix"]:
        del dump["calibration"]["bos_prefix"]
    return canonical_json(dump)


def write_bundle(out_dir: str | Path, manifest: Manifest, tensors: dict[str, torch.Tensor]) -> Manifest:
    """Write rotations.safetensors and manifest.json atomically; returns the manifest with its checksum."""
    data = tensor_bytes(tensors, manifest)
    manifest = manifest.model_copy(update={"tensors": TensorFileInfo(sha256=sha256_bytes(data), bytes=len(data))})
    atomic_write_dir(out_dir, {TENSOR_FILE: data, MANIFEST_FILE: manifest_json(manifest).encode()})
    return manifest


def bundle_dir(path: str | Path) -> Path:
    path = Path(path)
    if path.is_file() and path.name in (TENSOR_FILE, MANIFEST_FILE):
        path = path.parent
    if not path.is_dir():
        raise OscarError(f"bundle not found: {path}")
    return path


def fetch_bundle(source: str | Path, revision: str | None = None) -> Path:
    """The directory of a bundle: `source` itself when it is a local path, else a Hugging Face repo id ("org/name",
    as `oscar push` publishes it) whose manifest.json and tensor file are downloaded as plain files (a bundle's
    files are never links) into OSCAR_BUNDLES/<org>/<name>/<revision> (default ~/.cache/oscar/bundles); with
    HF_HUB_OFFLINE=1 the files already there are used."""
    import os

    path = Path(source)
    if path.exists() or str(source).startswith((".", "/", "~")) or str(source).count("/") != 1:
        return bundle_dir(path)
    from huggingface_hub import hf_hub_download

    root = Path(os.environ.get("OSCAR_BUNDLES") or Path.home() / ".cache" / "oscar" / "bundles")
    local = root / check_name(str(source), "bundle repo id") / check_name(revision or "main", "revision")
    try:
        manifest = Path(hf_hub_download(str(source), MANIFEST_FILE, revision=revision, local_dir=local))
        name = read_manifest(manifest.parent).tensors.file
        hf_hub_download(str(source), name, revision=revision, local_dir=local)
    except OscarError:
        raise
    except Exception as e:  # the hub client's errors: not found, offline and not cached, network
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OscarError(f"cannot fetch bundle {source}: {first}") from None
    return manifest.parent


def read_manifest(path: str | Path) -> Manifest:
    path = bundle_dir(path) / MANIFEST_FILE
    if not path.is_file():
        raise OscarError(f"not a bundle: {path.parent} has no {MANIFEST_FILE}")
    try:
        with schema_errors(f"invalid manifest {path}"):
            return Manifest.model_validate_json(path.read_text())
    except UnicodeDecodeError:
        raise OscarError(f"invalid manifest {path}: not UTF-8 text") from None


def load_bundle(path: str | Path, device: str | torch.device = "cpu") -> Bundle:
    """Load a bundle, validating the manifest, the checksum and every tensor's name and shape."""
    root = bundle_dir(path)
    manifest = read_manifest(root)
    tensor_path = root / manifest.tensors.file
    if not tensor_path.is_file():
        raise OscarError(f"bundle {root} is missing {manifest.tensors.file}")
    if tensor_path.resolve().parent != root.resolve():
        raise OscarError(f"bundle {root}: {manifest.tensors.file} links to {tensor_path.resolve()}, outside the bundle")
    data = tensor_path.read_bytes()
    if len(data) != manifest.tensors.bytes:
        raise OscarError(f"bundle {root}: {manifest.tensors.file} holds {len(data):,} bytes, its manifest says "
                         f"{manifest.tensors.bytes:,} (corrupt or tampered)")
    if sha256_bytes(data) != manifest.tensors.sha256:
        raise OscarError(f"checksum mismatch: {tensor_path} does not match its manifest (corrupt or tampered)")
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, Exception) as e:  # a matching checksum over a broken file
        raise OscarError(f"cannot read {tensor_path}: {e}") from None
    expected = expected_shapes(manifest)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise OscarError(f"bundle {root} lacks tensor {missing[0]} (and {len(missing) - 1} more)")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise OscarError(f"bundle {root}: {name} has shape {tuple(tensors[name].shape)}, manifest implies {shape}")
    shape = (manifest.model.num_kv_heads, manifest.model.head_dim)
    for name in (f"layers.{i}.{t}" for i in bundle_layers(manifest) for t in OPTIONAL_TENSORS):
        if name in tensors and tuple(tensors[name].shape) != shape:
            raise OscarError(f"bundle {root}: {name} has shape {tuple(tensors[name].shape)}, manifest implies {shape}")
    return Bundle(path=root, manifest=manifest, tensors={k: v.to(device) for k, v in tensors.items()})
