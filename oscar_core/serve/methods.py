"""KV cache methods compared at the same bits: what each one stores and gives back for keys and values.

Every INT2 method quantizes one side (keys or values) of one layer as
    y = (x − μ)·R                              (μ: [H_kv, d] or 0, R: [H_kv, d, d] orthogonal)
    ŷ = quant.fake_quantize(y, G, c)           (asymmetric INT2, 2 + 16/G bits per element)
    x̂ = ŷ·R^T + μ                              (what attention reads, in original space)
with, per method:
    bf16      no quantization: the cache holds x in BF16 (the reference)
    int2      naive INT2: R = I, μ = 0, c = 1, groups of G channels of one token
    hadamard  QuaRot-style: R = H (normalized Walsh-Hadamard), μ = 0, c = 1
    kivi      KIVI-style: keys per channel in groups of G tokens (so a key's block is quantized only once
              all its G tokens are out of the BF16 window), values per token in groups of G channels; c = 1
    oscar     the bundle's R_K, R_V, μ_K (key centring), μ_V, per-head clips c_K, c_V, and per layer the
              key axis the export chose (bundle.key_axis: per token, or per channel over blocks of G tokens)
The first `sink` tokens and the last `recent` tokens stay in BF16 for every method (bundle or SPEC defaults).
A layer whose keys are quantized per channel moves keys and values to INT2 together, a block of G tokens
at a time (LayerMethod.token_block), so its BF16 recent window holds W to W + G − 1 tokens.
"""

from dataclasses import dataclass

import torch

from oscar_core import quant
from oscar_core.errors import OscarError
from oscar_core.formats.bundle import bundle_layers
from oscar_core.layers import window_recent
from oscar_core.rotations import hadamard

METHODS = ("bf16", "int2", "hadamard", "kivi", "oscar")
INT2_METHODS = METHODS[1:]
LABELS = {"bf16": "BF16", "int2": "INT2 (no rotation)", "hadamard": "Hadamard INT2 (QuaRot)",
          "kivi": "KIVI-style INT2", "oscar": "OSCAR INT2"}
SINK_TOKENS = 64
RECENT_TOKENS = 256
GROUP_SIZE = 64


@dataclass
class Side:
    """How one side (keys or values) of one layer is quantized; rotation None means identity.

    axis "token": groups of `group_size` channels of one token (token_block = 1).
    axis "channel": groups of `group_size` tokens of one channel (token_block = group_size).
    """
    group_size: int = GROUP_SIZE
    axis: str = "token"
    rotation: torch.Tensor | None = None
    mean: torch.Tensor | None = None
    clip: torch.Tensor | float = 1.0

    @property
    def token_block(self) -> int:
        return self.group_size if self.axis == "channel" else 1


@dataclass
class LayerMethod:
    key: Side | None      # None: kept in BF16 (no quantization)
    value: Side | None

    @property
    def token_block(self) -> int:
        """Tokens that leave the recent window for INT2 together (both sides): 1, or G for channel-axis keys."""
        return max([side.token_block for side in (self.key, self.value) if side is not None], default=1)


def stored(lm: LayerMethod, method: str | None = None) -> bool:
    """Whether OscarCache keeps a layer of this method in a kvstore store (kernel-readable; a sliding one in a window
    store): both sides INT2, values per token (keys per token or per channel), and not the kivi baseline, which
    keeps the SideStores it was measured in."""
    return lm.key is not None and lm.value is not None and lm.value.axis == "token" and method != "kivi"


def check_method(method: str) -> None:
    if method not in METHODS:
        raise OscarError(f"unknown method {method}: use one of {', '.join(METHODS)}")


def windows(method: str, bundle=None) -> tuple[int, int]:
    """(sink tokens, recent tokens) kept in BF16: the bundle's, else the SPEC defaults."""
    if bundle is not None:
        return bundle.manifest.quant.sink_tokens, bundle.manifest.quant.recent_tokens
    return SINK_TOKENS, RECENT_TOKENS


def layer_method(method: str, layer: int, kv_heads: int, head_dim: int, bundle=None) -> LayerMethod:
    """The key and value Sides of `method` at `layer` (bundle tensors for oscar, float32)."""
    check_method(method)
    g = GROUP_SIZE if bundle is None else bundle.manifest.quant.key_group_size
    gv = GROUP_SIZE if bundle is None else bundle.manifest.quant.value_group_size
    g, gv = min(g, head_dim), min(gv, head_dim)
    if method == "bf16":
        return LayerMethod(None, None)
    if method == "int2":
        return LayerMethod(Side(g), Side(gv))
    if method == "hadamard":
        h = hadamard(head_dim).float().expand(kv_heads, head_dim, head_dim)
        return LayerMethod(Side(g, rotation=h), Side(gv, rotation=h))
    if method == "kivi":
        return LayerMethod(Side(g, axis="channel"), Side(gv))
    if bundle is None:
        raise OscarError("method oscar needs a rotation bundle")

    def t(name):
        x = bundle.layer(layer, name)
        return None if x is None else x.float()

    return LayerMethod(Side(g, bundle.key_axis(layer), rotation=t("key_rotation"), mean=t("key_mean"),
                            clip=t("key_clip")),
                       Side(gv, rotation=t("value_rotation"), mean=t("value_mean"), clip=t("value_clip")))


def layer_methods(method: str, num_layers: int, kv_heads: int, head_dim: int, bundle=None) -> list[LayerMethod]:
    return [layer_method(method, i, kv_heads, head_dim, bundle) for i in range(num_layers)]


def _to(x, ref: torch.Tensor):
    return x.to(ref.device) if isinstance(x, torch.Tensor) else x


def rotate(side: Side, x: torch.Tensor) -> torch.Tensor:
    """y = (x − μ)·R in float32, x [..., H_kv, T, d]."""
    y = x.float()
    if side.mean is not None:
        y = y - _to(side.mean, y)[:, None, :]
    return y if side.rotation is None else y @ _to(side.rotation, y)


def unrotate(side: Side, y: torch.Tensor) -> torch.Tensor:
    """x = y·R^T + μ, y [..., H_kv, T, d] float32."""
    x = y if side.rotation is None else y @ _to(side.rotation, y).mT
    return x if side.mean is None else x + _to(side.mean, x)[:, None, :]


def _clip(side: Side, y: torch.Tensor):
    """The clip as a tensor broadcastable to y.shape[:-1] ([..., H_kv, T] or [..., H_kv, blocks, d])."""
    if isinstance(side.clip, torch.Tensor):
        return _to(side.clip, y)[:, None, None] if side.axis == "channel" else _to(side.clip, y)[:, None]
    return side.clip


def _blocks(y: torch.Tensor, b: int) -> torch.Tensor:
    """[..., T, d] (T a multiple of b) → [..., T/b, d, b]: each row one channel of one block of tokens."""
    return y.reshape(*y.shape[:-2], y.shape[-2] // b, b, y.shape[-1]).transpose(-1, -2)


def _unblocks(z: torch.Tensor) -> torch.Tensor:
    return z.transpose(-1, -2).flatten(-3, -2)


def encode(side: Side, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """INT2 storage of x [B, H_kv, T, d] (T a multiple of side.token_block): packed codes, scale, zero codes.

    token axis: codes [B, H_kv, T, d/4], scale/zero [B, H_kv, T, d/G];
    channel axis: codes [B, H_kv, T/G, d, G/4], scale/zero [B, H_kv, T/G, d, 1]."""
    y = rotate(side, x)
    if side.axis == "channel":
        y = _blocks(y, side.group_size)
    codes, scale, zero = quant.quantize(y, side.group_size, _clip(side, y))
    return {"codes": quant.pack_int2(codes), "scale": scale, "zero": zero}


def decode(side: Side, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """Inverse of encode up to quantization: x̂ [B, H_kv, T, d] float32 in original space."""
    y = quant.dequantize(quant.unpack_int2(stored["codes"]), stored["scale"], stored["zero"], side.group_size)
    if side.axis == "channel":
        y = _unblocks(y)
    return unrotate(side, y)


def fake(side: Side, x: torch.Tensor) -> torch.Tensor:
    """decode(encode(x)) without packing, x [..., H_kv, T, d]; for the channel axis only the first
    ⌊T/G⌋·G tokens are quantized (the rest are returned as they are: a cache never quantizes them)."""
    y = rotate(side, x)
    if side.axis == "token":
        return unrotate(side, quant.fake_quantize(y, side.group_size, _clip(side, y)))
    b = side.group_size
    full = x.shape[-2] // b * b
    z = _blocks(y[..., :full, :], b)
    head = unrotate(side, _unblocks(quant.fake_quantize(z, b, _clip(side, z))))
    return torch.cat([head, x[..., full:, :].float()], dim=-2)


def int2_mask(positions: torch.Tensor, keys: int, side: Side | None, sink: int, recent: int,
              block: int | None = None) -> torch.Tensor:
    """bool [len(positions), keys]: is key t read from INT2 by the query at position p?

    A token t ≥ sink leaves the BF16 window once p − t ≥ recent; with token blocks of b (the layer's
    LayerMethod.token_block; default the side's own) the block goes to INT2 only when its last token
    last(t) = sink + ⌊(t − sink)/b⌋·b + b − 1 has:
        INT2(p, t) = t ≥ sink  and  last(t) ≤ p − recent.
    So every query sees its own token and the `recent` − 1 before it exactly (t ∈ (p − recent, p])."""
    t = torch.arange(keys, device=positions.device)
    if side is None:
        return torch.zeros(len(positions), keys, dtype=torch.bool, device=positions.device)
    b = block or side.token_block
    last = sink + torch.div(t - sink, b, rounding_mode="floor") * b + b - 1
    return (t >= sink)[None, :] & (last[None, :] <= positions[:, None] - recent)


def bits_per_element(method: str, context: int, bundle=None, kind: str | None = None) -> float:
    """Bits per cached K/V element at `context` tokens against the BF16 cache of the same model (which holds, per
    layer, the same tokens: a sliding layer its window), BF16 windows, codes and metadata counted
    (quant.layer_bits_per_element, quant.cache_bits_per_element): per layer, the tokens past the sink that do not
    fill a whole block of the layer's token_block outside the recent window stay BF16, the rest cost 2 + 16/G bits;
    a sliding layer that holds no INT2 (the bundle's rotation.windows beside rotation.layers) is BF16, its window
    and no sink (a ring for kivi, a store the decode kernel reads for the others: cache.OscarCache).
    kind: "global" or "sliding" for those layers alone; None: the whole cache. Without a bundle: one global layer,
    groups of 64."""
    check_method(method)
    if method == "bf16":
        return float(quant.BF16_BITS)
    sink, recent = windows(method, bundle)
    d = 64 if bundle is None else bundle.manifest.model.head_dim
    slide = {} if bundle is None else {int(i): w for i, w in (bundle.manifest.rotation.windows or {}).items()}
    int2_layers = [0] if bundle is None else bundle_layers(bundle.manifest)
    out = []
    for layer in int2_layers:
        lm = layer_method(method, layer, 1, d, bundle)
        r = window_recent(slide.get(layer), recent, lm.token_block, stored(lm, method))
        out.append((quant.layer_bits_per_element(context, lm.key.group_size, lm.value.group_size, sink, r,
                                                 lm.token_block, slide.get(layer)), slide.get(layer)))
    out += [(quant.layer_bits_per_element(context, 0, 0, 0, recent, window=w, int2=False), w)
            for i, w in slide.items() if i not in int2_layers]
    if kind is not None:
        out = [(b, w) for b, w in out if (w is None) == (kind == "global")]
        if not out:
            raise ValueError(f"no {kind} layer")
    return quant.cache_bits_per_element(context, out)


def layer_kinds(bundle) -> list[str]:
    """The kinds of KV layer a bundle's model has, of "global" and "sliding" (bits_per_element's `kind`)."""
    if bundle is None:
        return ["global"]
    slide = {int(i) for i in bundle.manifest.rotation.windows or {}}
    return (["global"] if any(i not in slide for i in bundle_layers(bundle.manifest)) else []) + \
        (["sliding"] if slide else [])
