"""What each layer of a model attends to and keeps, read once from its transformers config.

Every stage (calibration, simulation, verify, eval, the cache) asks the same questions of a layer: does it keep
a KV cache, and what does its query at position p attend to? Here, per layer (LayerSpec):
    kv_cache   False for a hybrid model's linear-attention or Mamba layers (no keys and values)
    window     None: global causal attention, keys 0..p; W: a sliding window, keys p − W + 1..p (W tokens, its
               own included: transformers' sliding_window_overlay, kv > q − W)
    softcap    attention-logit soft-capping (Gemma 2: s ↦ c·tanh(s/c)); the toolkit does not model it and
               refuses such a model (check_config)
    scaling    the logit scale when the config overrides 1/√d (Gemma's query_pre_attn_scalar^−½)

transformers' conventions: `layer_types` ("full_attention", "sliding_attention"; Qwen2 builds it from
use_sliding_window and max_window_layers, Gemma 2/3 from their pattern) with `sliding_window`; without
layer_types a `sliding_window` applies to every layer (Mistral, Mixtral, Phi-3).

Which layers hold INT2 tokens (holds_int2): every KV layer with global attention, and a sliding layer whose
window is longer than 2·(sink + recent) tokens; a shorter window is kept whole as a BF16 ring of its last W
tokens, as serving engines do (INT2 would cover at most half of it). A longer one keeps a recent window rounded up
so that its INT2 rows are whole tiles (window_recent, the cache's kvstore.window_cache).

The hooks check at run time that the window a layer passes its attention function is the one read here
(check_window); visible() is the mask and windowed_attention() the exact windowed attention every stage uses.
"""

from dataclasses import dataclass

import torch

from oscar_core.errors import OscarError

KV_TYPES = ("full_attention", "sliding_attention", "attention")


@dataclass(frozen=True)
class LayerSpec:
    kv_cache: bool = True
    window: int | None = None
    softcap: float | None = None
    scaling: float | None = None


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _types(text) -> list[str] | None:
    types = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None)
    return [str(t) for t in types] if types else None


def _keeps_kv(kind: str) -> bool:
    return "attention" in kind and not kind.startswith("linear")


def layer_specs(config) -> list[LayerSpec]:
    """One LayerSpec per layer of the model (config: a transformers config, multimodal or text)."""
    text = text_config(config)
    n = text.num_hidden_layers
    types = _types(text) or ["full_attention"] * n
    window = getattr(text, "sliding_window", None) or None
    softcap = getattr(text, "attn_logit_softcapping", None)
    scalar = getattr(text, "query_pre_attn_scalar", None)
    scaling = None if scalar is None else float(scalar) ** -0.5
    everywhere = _types(text) is None  # Mistral: a sliding_window without layer_types windows every layer
    specs = []
    for kind in types[:n]:
        if not _keeps_kv(kind):
            specs.append(LayerSpec(kv_cache=False))
            continue
        w = window if (everywhere or kind == "sliding_attention") else None
        specs.append(LayerSpec(window=w, softcap=softcap, scaling=scaling))
    return specs


def attention_layer_ids(config) -> list[int] | None:
    """Global ids of the layers that keep a KV cache in a hybrid model, from config.layer_types (e.g.
    "full_attention", "sliding_attention", "linear_attention") or layers_block_type ("attention", "mamba");
    None when every layer is an attention layer (or the config does not say)."""
    specs = layer_specs(config)
    ids = [i for i, s in enumerate(specs) if s.kv_cache]
    return None if len(ids) == len(specs) else ids


def holds_int2(spec: LayerSpec, sink: int, recent: int) -> bool:
    """Whether a layer stores INT2 tokens: a KV layer with global attention or a window over 2·(sink + recent)."""
    return spec.kv_cache and (spec.window is None or spec.window > 2 * (sink + recent))


def window_recent(window: int | None, recent: int, token_block: int = 1, stored: bool = True) -> int:
    """The recent BF16 tokens of an INT2 layer: in a sliding layer's window store (stored: methods.stored; a tile of
    INT2 rows, and whole key blocks of token_block, beside `recent`: kvstore.window_cache) the W = N − T of
    kvstore.window_split, at least `recent` (so that its T rows are whole tiles); any other layer its own."""
    from oscar_core.kvstore import window_split

    if window is None or not stored:
        return recent
    rows, ring = window_split(window, recent, token_block)
    return ring if rows else recent


def int2_layer_ids(specs: list[LayerSpec], sink: int, recent: int) -> list[int] | None:
    """Global ids of the layers holding INT2 tokens; None when that is every layer (the bundle's rotation.layers)."""
    ids = [i for i, s in enumerate(specs) if holds_int2(s, sink, recent)]
    return None if len(ids) == len(specs) else ids


def windows(specs: list[LayerSpec]) -> dict[int, int] | None:
    """{layer: W} of the sliding layers; None when the model has none."""
    out = {i: s.window for i, s in enumerate(specs) if s.kv_cache and s.window is not None}
    return out or None


def specs_from(num_layers: int, kv_layers: list[int] | None, windows: dict | None) -> list[LayerSpec]:
    """LayerSpecs from what a calibration record or a manifest keeps: the KV layers (None: every layer) and the
    sliding windows ({layer: W}, keys int or str; None: none)."""
    windows = {int(i): int(w) for i, w in (windows or {}).items()}
    kv = set(range(num_layers) if kv_layers is None else kv_layers) | set(windows)
    return [LayerSpec(window=windows.get(i)) if i in kv else LayerSpec(kv_cache=False) for i in range(num_layers)]


def manifest_specs(manifest) -> list[LayerSpec]:
    """The LayerSpecs a bundle's manifest records: its INT2 layers (rotation.layers) and its sliding layers
    (rotation.windows, which also lists the sliding layers kept whole in BF16)."""
    r = manifest.rotation
    n = manifest.model.num_layers
    return specs_from(n, list(range(n)) if r.layers is None else r.layers, getattr(r, "windows", None))


def ids_text(ids) -> str:
    return ", ".join(map(str, ids))


def int2_reason(specs: list[LayerSpec], sink: int, recent: int) -> str | None:
    """Why some KV layers hold no INT2 tokens (the manifest's rotation.layers_reason); None when all do."""
    ring = [i for i, s in enumerate(specs) if s.kv_cache and not holds_int2(s, sink, recent)]
    if not ring:
        return None
    sizes = sorted({specs[i].window for i in ring})
    return (f"layers {ids_text(ring)} attend to a sliding window of {ids_text(sizes)} tokens, kept whole as a BF16 "
            f"ring: INT2 is used only in windows longer than 2·(sink + recent) = {2 * (sink + recent)} tokens")


def check_config(config, architecture: str) -> None:
    """Refuse, in one line, an attention variant the toolkit does not model (it would be evaluated wrongly):
    logit soft-capping, chunked attention (Llama 4), bidirectional or non-causal attention, learned attention
    sinks (gpt-oss), a layer type other than full or sliding attention, or a model without any KV layer."""
    text = text_config(config)
    what = None
    if getattr(text, "attn_logit_softcapping", None) is not None:
        what = f"attention-logit soft-capping ({text.attn_logit_softcapping})"
    elif getattr(text, "attention_chunk_size", None) is not None:
        what = f"chunked attention (attention_chunk_size {text.attention_chunk_size})"
    elif getattr(text, "use_bidirectional_attention", False) or getattr(text, "is_causal", True) is False:
        what = "bidirectional attention"
    elif getattr(text, "model_type", "") == "gpt_oss":
        what = "learned attention sinks"
    else:
        kinds = {t for t in (_types(text) or []) if _keeps_kv(t) and t not in KV_TYPES}
        if kinds:
            what = f"attention layers of type {', '.join(sorted(kinds))}"
    if what is not None:
        raise OscarError(f"unsupported architecture {architecture}: it uses {what}, which oscar does not model")
    if not any(s.kv_cache for s in layer_specs(config)):
        raise OscarError(f"unsupported architecture {architecture}: none of its layers is an attention layer, "
                         "so it has no KV cache to rotate")
    bad = [s.window for s in layer_specs(config) if s.window is not None and s.window < 1]
    if bad:
        raise OscarError(f"unsupported architecture {architecture}: sliding window {bad[0]} is not a positive length")


def check_window(layer: int, spec: LayerSpec, passed: int | None) -> None:
    """The window the model passes its attention function (`sliding_window`) must be the one its config gives."""
    if (passed or None) != spec.window:
        raise OscarError(f"layer {layer} attends to a sliding window of {passed} tokens, its config says "
                         f"{spec.window}: oscar cannot model this attention")


def visible(positions: torch.Tensor, keys: int, window: int | None) -> torch.Tensor:
    """bool [len(positions), keys]: does the query at position p see key t? t ≤ p, and t > p − W in a window."""
    t = torch.arange(keys, device=positions.device)[None, :]
    p = positions[:, None]
    return (t <= p) if window is None else (t <= p) & (t > p - window)


def windowed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, window: int,
                       chunk: int = 1024) -> torch.Tensor:
    """softmax(scaling·QKᵀ masked by visible(·, T, W))·V, [B, H, T_q, d], for queries [B, H, T_q, d] at the last
    T_q of T positions and keys/values [B, H_kv, T, d]; queries go `chunk` at a time against the keys their window
    can reach (chunk + W of them), so memory stays O(chunk·(chunk + W)) whatever T is."""
    tq, t = query.shape[2], key.shape[2]
    out = []
    for a in range(0, tq, chunk):
        b = min(a + chunk, tq)
        pos = torch.arange(a, b, device=query.device) + (t - tq)
        k0 = max(0, int(pos[0]) - window + 1)
        mask = visible(pos, int(pos[-1]) + 1, window)[:, k0:]
        out.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, k0:int(pos[-1]) + 1], value[:, :, k0:int(pos[-1]) + 1], attn_mask=mask,
            scale=scaling, enable_gqa=query.shape[1] != key.shape[1]))
    return torch.cat(out, dim=2)
