"""Triton write kernel: rotate, centre, clip, quantize to INT2 and pack, as kvstore.write_int2.

One program takes BLOCK_T tokens of one KV head: y = (x − μ)·R (float32), then per group of G
channels the arithmetic of quant.quantize (log2 scale code, quarter-step zero code, the widening
of far-off-centre groups), and packs channel 4j + i into bits 2i of byte j.
"""

import torch
import triton
import triton.language as tl

# 1.5·2^23: (x + M) − M rounds a float32 |x| < 2^22 to nearest, ties to even.
ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _round(x):
    return (x + ROUND_MAGIC) - ROUND_MAGIC


@triton.jit
def _scale_code(step, ROUND_UP: tl.constexpr):
    e = tl.log2(tl.maximum(step, 2.0 ** -20)) * 8.0
    if ROUND_UP:
        e = tl.ceil(e)
    else:
        e = _round(e)
    return tl.minimum(tl.maximum(e + 128.0, 0.0), 255.0)


@triton.jit
def _write_kernel(x_ptr, rot_ptr, mean_ptr, clip_ptr, codes_ptr, scale_ptr, zero_ptr, tokens,
                  sx_t, sx_h, sc_t, sc_h, ss_t, ss_h, sz_t, sz_h,
                  D: tl.constexpr, G: tl.constexpr, BLOCK_T: tl.constexpr, HAS_MEAN: tl.constexpr,
                  PRECISION: tl.constexpr):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    NG: tl.constexpr = D // G
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.arange(0, D)
    tmask = t < tokens
    x = tl.load(x_ptr + t[:, None] * sx_t + h * sx_h + c[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
    if HAS_MEAN:
        x = x - tl.load(mean_ptr + h * D + c)[None, :]
    r = tl.load(rot_ptr + h * D * D + c[:, None] * D + c[None, :])
    y = tl.dot(x, r, input_precision=PRECISION)

    yg = tl.reshape(y, [BLOCK_T, NG, G])
    lo = tl.min(yg, axis=2)
    hi = tl.max(yg, axis=2)
    clip = tl.load(clip_ptr + h)
    mid = (hi + lo) / 2.0
    half = (hi - lo) / 2.0 * clip
    code = _scale_code(2.0 * half / 3.0, False)
    step = tl.exp2((code - 128.0) / 8.0)
    zero = _round(4.0 * (mid / step - 1.5))
    overflow = (zero < -128.0) | (zero > 127.0)
    lowest = tl.abs(mid - 1.5 * step)
    wide = _scale_code(lowest * 4.0 / 127.0, True)
    code = tl.where(overflow, tl.maximum(code, wide), code)
    step = tl.exp2((code - 128.0) / 8.0)
    zero = tl.where(overflow, _round(4.0 * (mid / step - 1.5)), zero)
    zero = tl.minimum(tl.maximum(zero, -128.0), 127.0)

    q = _round(yg / step[:, :, None] - (zero / 4.0)[:, :, None])
    q = tl.minimum(tl.maximum(q, 0.0), 3.0).to(tl.int32)
    q = tl.reshape(q, [BLOCK_T, D // 4, 4])
    shifts = tl.arange(0, 4) * 2
    packed = tl.sum(q << shifts[None, None, :], axis=2).to(tl.uint8)

    j = tl.arange(0, D // 4)
    tl.store(codes_ptr + t[:, None] * sc_t + h * sc_h + j[None, :], packed, mask=tmask[:, None])
    g = tl.arange(0, NG)
    tl.store(scale_ptr + t[:, None] * ss_t + h * ss_h + g[None, :], code.to(tl.uint8), mask=tmask[:, None])
    tl.store(zero_ptr + t[:, None] * sz_t + h * sz_h + g[None, :], zero.to(tl.int8), mask=tmask[:, None])


def write_int2(x: torch.Tensor, rotation: torch.Tensor, clip: torch.Tensor, group_size: int = 64,
               mean: torch.Tensor | None = None, out=None, block_t: int = 32, precision: str = "tf32x3"):
    """Triton kvstore.write_int2: x [tokens, H_kv, d] -> (codes uint8 [tokens, H_kv, d/4],
    scale codes uint8 [tokens, H_kv, d/G], zero codes int8 [tokens, H_kv, d/G]).

    `out`, if given, is a triple of such tensors (views with any token/head strides, unit channel
    stride) written in place, e.g. slices of an Int2KVCache transposed to [tokens, H_kv, ...]."""
    tokens, heads, d = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    if out is None:
        out = (torch.empty(tokens, heads, d // 4, dtype=torch.uint8, device=x.device),
               torch.empty(tokens, heads, d // group_size, dtype=torch.uint8, device=x.device),
               torch.empty(tokens, heads, d // group_size, dtype=torch.int8, device=x.device))
    codes, scale, zero = out
    rot = rotation.float().contiguous()
    mean_t = mean.float().contiguous() if mean is not None else rot
    grid = (triton.cdiv(tokens, block_t), heads)
    _write_kernel[grid](x, rot, mean_t, clip.float().contiguous(), codes, scale, zero, tokens,
                        x.stride(0), x.stride(1), codes.stride(0), codes.stride(1),
                        scale.stride(0), scale.stride(1), zero.stride(0), zero.stride(1),
                        D=d, G=group_size, BLOCK_T=block_t, HAS_MEAN=mean is not None, PRECISION=precision)
    return codes, scale, zero
