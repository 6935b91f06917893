"""INT2 reference: quantize, pack, unpack, dequantize; bits per element.

Per token and per group of G channels, asymmetric 2-bit quantization on the grid

    x̂ = step · (q + z/4),   q ∈ {0, 1, 2, 3}

The group's range [lo, hi] is first shrunk around its midpoint by the clip ratio c,
step = c·(hi − lo)/3, and the grid is centred on the clipped range. Both group parameters fit
in one byte each, so the metadata costs 16 bits per group (0.25 bit per element at G = 64):
- scale code s (uint8): step = 2^((s − 128)/8), a log-scale grid with 8 codes per octave;
- zero code z (int8): the grid's lowest level in quarter steps, lo = z·step/4.
If the group's offset is too large for z, the step is widened until it fits.
This module is the ground truth that the Triton kernels are tested against.
"""

import functools
import math

import torch

SCALE_CODES_PER_OCTAVE = 8
SCALE_CODE_BIAS = 128
ZERO_CODES_PER_STEP = 4
LEVELS = 4
BF16_BITS = 16
METADATA_BITS_PER_GROUP = 16


@functools.cache
def _steps(device: torch.device) -> torch.Tensor:
    """2^((s − 128)/8) for every code s, correctly rounded to float32."""
    steps = [2.0 ** ((s - SCALE_CODE_BIAS) / SCALE_CODES_PER_OCTAVE) for s in range(256)]
    return torch.tensor(steps, dtype=torch.float32, device=device)


def scale_from_code(scale_code: torch.Tensor) -> torch.Tensor:
    """The step of each scale code, looked up in a table: the same float32 for every shape and instruction set
    (a vectorized exp2 rounds some codes differently from its scalar tail)."""
    return _steps(scale_code.device)[scale_code.long()]


def _scale_code(step: torch.Tensor, round_up: bool = False) -> torch.Tensor:
    exponent = torch.log2(step.clamp_min(2.0**-20)) * SCALE_CODES_PER_OCTAVE
    exponent = torch.ceil(exponent) if round_up else torch.round(exponent)
    return (exponent + SCALE_CODE_BIAS).clamp(0, 255)


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    if x.shape[-1] % group_size:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of group size {group_size}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)


def quantize(x: torch.Tensor, group_size: int = 64, clip: float | torch.Tensor = 1.0):
    """Quantize x [..., d] per group of `group_size` channels.

    clip is a float or a tensor broadcastable to x.shape[:-1] (for example one ratio per head).
    Returns (codes uint8 [..., d] in 0..3, scale_code uint8 [..., d/G], zero_code int8 [..., d/G]).
    """
    g = _groups(x.float(), group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    if isinstance(clip, torch.Tensor):
        clip = clip.to(g.device, torch.float32).unsqueeze(-1)
    mid, half = (hi + lo) / 2, (hi - lo) / 2 * clip
    code = _scale_code(2 * half / (LEVELS - 1))
    step = scale_from_code(code)
    zero = torch.round(ZERO_CODES_PER_STEP * (mid / step - (LEVELS - 1) / 2))
    # A far-off-centre group: widen the step until its lowest level is representable.
    overflow = (zero < -128) | (zero > 127)
    if overflow.any():
        lowest = (mid - (LEVELS - 1) / 2 * step).abs()
        wide = _scale_code(lowest * ZERO_CODES_PER_STEP / 127, round_up=True)
        code = torch.where(overflow, torch.maximum(code, wide), code)
        step = scale_from_code(code)
        zero = torch.round(ZERO_CODES_PER_STEP * (mid / step - (LEVELS - 1) / 2))
    zero = zero.clamp(-128, 127)
    q = torch.round(g / step.unsqueeze(-1) - (zero / ZERO_CODES_PER_STEP).unsqueeze(-1))
    codes = q.clamp(0, LEVELS - 1).to(torch.uint8).reshape(x.shape)
    return codes, code.to(torch.uint8), zero.to(torch.int8)


def dequantize(codes: torch.Tensor, scale_code: torch.Tensor, zero_code: torch.Tensor,
               group_size: int = 64) -> torch.Tensor:
    """x̂ = step · (q + z/4), float32 [..., d]."""
    g = _groups(codes.float(), group_size)
    step = scale_from_code(scale_code).unsqueeze(-1)
    offset = (zero_code.float() / ZERO_CODES_PER_STEP).unsqueeze(-1)
    return (step * (g + offset)).reshape(codes.shape)


def fake_quantize(x: torch.Tensor, group_size: int = 64, clip: float | torch.Tensor = 1.0) -> torch.Tensor:
    """dequantize(quantize(x)): what an INT2 cache gives back, in x's dtype."""
    return dequantize(*quantize(x, group_size, clip), group_size).to(x.dtype)


def pack_int2(codes: torch.Tensor) -> torch.Tensor:
    """Pack 2-bit codes [..., d] into bytes [..., d/4]; channel 4j + i sits in bits 2i..2i+1 of byte j."""
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 4, 4)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def unpack_int2(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int2: bytes [..., d/4] to codes uint8 [..., d]."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 3).reshape(*packed.shape[:-1], packed.shape[-1] * 4)


def bits_per_element(context: int, group_size: int = 64, sink_tokens: int = 64,
                     recent_tokens: int = 256, token_block: int = 1) -> float:
    """Average bits per cached element at `context` tokens: BF16 windows plus INT2 codes and metadata.
    Tokens leave the recent window in whole blocks of `token_block` (G for keys grouped per channel), so
    up to token_block − 1 more of them stay BF16."""
    quantized = max(context - sink_tokens - recent_tokens, 0) // token_block * token_block
    int2_bits = math.log2(LEVELS) + METADATA_BITS_PER_GROUP / group_size
    return ((context - quantized) * BF16_BITS + quantized * int2_bits) / context


def layer_bits_per_element(context: int, key_group_size: int, value_group_size: int, sink_tokens: int,
                           recent_tokens: int, token_block: int = 1, window: int | None = None,
                           int2: bool = True) -> float:
    """Bits per K/V element of one layer's cache at `context` tokens, over a cache of `context` tokens: a sliding
    layer holds min(context, W) of them, all BF16 when it holds no INT2 (a ring); an INT2 layer costs
    bits_per_element of what it holds, keys and values averaged."""
    held = context if window is None else min(context, window)
    if not int2:
        return BF16_BITS * held / context
    bits = sum(bits_per_element(held, g, sink_tokens, recent_tokens, token_block)
               for g in (key_group_size, value_group_size)) / 2
    return bits * held / context


def held_tokens(context: int, window: int | None = None) -> int:
    """Tokens of a `context`-token sequence that a layer's cache (and a BF16 cache of the same layer) holds."""
    return context if window is None else min(context, window)


def cache_bits_per_element(context: int, layers: list[tuple[float, int | None]]) -> float:
    """Bits per element of a whole cache against the BF16 cache of the same model holding the same tokens, over its
    KV layers, each (layer_bits_per_element at `context`, its sliding window or None):
        16 · bytes(cache) / bytes(BF16 cache) = Σ_l b_l·context / Σ_l held_l
    (b_l·context/held_l is the bits per element of what layer l holds): a sliding layer weighs by its window."""
    return sum(bits for bits, _ in layers) * context / sum(held_tokens(context, w) for _, w in layers)
