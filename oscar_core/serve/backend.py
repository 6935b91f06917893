"""What a paged serving backend serves of a bundle, layer by layer, or the one line that says why it cannot.

A server (vLLM) hands the backend its model config; the bundle was calibrated for a model (its manifest's model
facts and sliding windows). served_layers checks the two agree and answers, per layer, from the same sources every
stage reads (layers.layer_specs for the config, bundle.bundle_layers and Bundle.key_axis for the manifest):
    kind "int2"   kept in pages (paged.py): keys per token or per channel (key_axis) in groups of key_group channels
                  (tokens), values per token in groups of value_group, the BF16 sink and recent window, and the
                  layer's tensors (kvstore.LayerRotation: R_K, R_V, per-head clips, μ_K and μ_V where centred)
    kind "bf16"   a sliding layer the bundle keeps whole in BF16 (its window too short for INT2): the server's own
                  BF16 attention
    kind "none"   a layer without a KV cache (a hybrid model's linear-attention or Mamba layer)
Refused, as an OscarError of one line: a bundle for another model (layers, heads, KV heads, head_dim, architecture,
sliding windows), and an INT2 layer the paged decode cannot serve, naming the layer and why (a decode shape no program
serves: triton.plan.shape_problem; a page size the key blocks or the sink do not divide, or a paged sliding window:
paged.page_problem).
"""

from dataclasses import dataclass

from oscar_core import kvstore
from oscar_core.formats.bundle import Bundle, bundle_layers
from oscar_core.errors import OscarError
from oscar_core.layers import LayerSpec, layer_specs, manifest_specs
from oscar_core.calibrate.models import attention_facts
from oscar_core.paged import PAGE_TOKENS, page_problem
from oscar_core.triton.plan import shape_problem

FACTS = ("num_layers", "num_heads", "num_kv_heads", "head_dim")


@dataclass
class ServedLayer:
    """One layer as the backend serves it (the module docstring)."""
    layer: int
    kind: str                                   # "int2", "bf16" or "none"
    window: int | None = None                   # a sliding layer's window (tokens)
    key_axis: str = "token"
    key_group: int = 64
    value_group: int = 64
    sink_tokens: int = 0
    recent_tokens: int = 0
    page_tokens: int = PAGE_TOKENS
    rotation: kvstore.LayerRotation | None = None


def model_problem(bundle: Bundle, config) -> str | None:
    """Why the bundle is not for the model of this config (None: it is): its attention facts, architecture and
    sliding windows."""
    m = bundle.manifest.model
    facts = attention_facts(config)
    for name in FACTS:
        if facts[name] != getattr(m, name):
            return (f"bundle {bundle.manifest.name} is for {m.id} ({name} {getattr(m, name)}), the served model has "
                    f"{name} {facts[name]}")
    if facts["architecture"] != m.architecture:
        return f"bundle {bundle.manifest.name} is for a {m.architecture}, the served model is a {facts['architecture']}"
    ours, theirs = layer_specs(config), manifest_specs(bundle.manifest)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a.window != b.window:
            return (f"layer {i}: the served model attends to a window of {a.window}, bundle {bundle.manifest.name} "
                    f"was calibrated with {b.window}")
    return None


def _int2_layer(bundle: Bundle, i: int, spec: LayerSpec, page_tokens: int) -> ServedLayer:
    m = bundle.manifest
    q = m.quant
    axis = bundle.key_axis(i)
    why = shape_problem(m.model.num_heads, m.model.num_kv_heads, m.model.head_dim, q.key_group_size,
                        q.value_group_size, axis)
    why = why or page_problem(page_tokens, q.sink_tokens, q.key_group_size, axis, spec.window)
    if why is not None:
        raise OscarError(f"layer {i} of bundle {m.name} cannot be served in pages: {why}")

    def tensor(name):
        x = bundle.layer(i, name)
        return None if x is None else x.float()

    rotation = kvstore.LayerRotation(*(tensor(f"{side}_{name}") for name in ("rotation", "clip")
                                       for side in ("key", "value")),
                                     tensor("key_mean"), tensor("value_mean"))
    return ServedLayer(i, "int2", spec.window, axis, q.key_group_size, q.value_group_size, q.sink_tokens,
                       q.recent_tokens, page_tokens, rotation)


def served_layers(bundle: Bundle, config, page_tokens: int = PAGE_TOKENS) -> list[ServedLayer]:
    """Every layer of the model as the backend serves it, or OscarError (one line) for bad input."""
    problem = model_problem(bundle, config)
    if problem is not None:
        raise OscarError(problem)
    int2 = set(bundle_layers(bundle.manifest))
    out = []
    for i, spec in enumerate(layer_specs(config)):
        if not spec.kv_cache:
            out.append(ServedLayer(i, "none"))
        elif i not in int2:
            out.append(ServedLayer(i, "bf16", spec.window, page_tokens=page_tokens))
        else:
            out.append(_int2_layer(bundle, i, spec, page_tokens))
    return out
