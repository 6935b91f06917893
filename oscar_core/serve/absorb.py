"""R_V in the model's weights: the value rotation absorbed into v_proj and o_proj (SPEC.md section 2; the authors'
runtime does it with SGLANG_OSCAR_ABSORB_V_ROTATION=1).

Query head j of KV head h attends as o_j = Σ_t p_t·v_t with Σ_t p_t = 1, so values produced as v' = (v − μ)·R
(R = R_V[h], μ = μ_V[h], rows as row vectors) give o'_j = (o_j − μ)·R, and o_j = o'_j·R^T + μ. Hence, exactly and
for any attention weights (sinks, sliding windows, any cache):
    v_proj:  W_v'[h] = R^T·W_v[h]          b_v'[h] = (b_v[h] − μ)·R          (W_v[h]: the d rows of KV head h)
    o_proj:  W_o'[:, j] = W_o[:, j]·R      b_o' = b_o + Σ_j W_o[:, j]·μ      (W_o[:, j]: the d columns of head j)
The model with these weights computes what it did (up to the rounding of the new weights to their dtype) with any
cache; an OscarCache made with values_absorbed=True then stores the values as they come (R_V = I, μ_V = 0) and
the decode kernel skips õ·R_V^T (decode.decode_attention with value_rotation None).
"""

import torch

from oscar_core.calibrate.models import attention_facts
from oscar_core.errors import OscarError

MARK = "oscar_values_absorbed"     # set on model.config: the bundle whose R_V the weights hold


def absorbed_value_projection(weight: torch.Tensor, bias: torch.Tensor | None, rotation: torch.Tensor,
                              mean: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """v_proj's (weight [H_kv·d, hidden], bias [H_kv·d] or None) with R [H_kv, d, d] and μ [H_kv, d] or None
    absorbed: W' = R^T·W and b' = (b − μ)·R per KV head, in float64, returned in the weight's dtype; the bias is
    None only where there was none and no mean."""
    kv_heads, d, _ = rotation.shape
    r = rotation.double()
    w = weight.double().reshape(kv_heads, d, -1)
    new_w = torch.einsum("kce,kch->keh", r, w).reshape(weight.shape).to(weight.dtype)
    b = torch.zeros(kv_heads, d, dtype=torch.float64, device=weight.device) if bias is None else bias.double().reshape(kv_heads, d)
    if mean is not None:
        b = b - mean.double()
    if bias is None and mean is None:
        return new_w, None
    new_b = torch.einsum("kc,kce->ke", b, r).reshape(-1)
    return new_w, new_b.to(weight.dtype)


def absorbed_output_projection(weight: torch.Tensor, bias: torch.Tensor | None, rotation: torch.Tensor,
                               mean: torch.Tensor | None, heads: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """o_proj's (weight [hidden, H·d], bias [hidden] or None) for inputs õ in the rotated space: W'[:, j] = W[:, j]·R
    and b' = b + Σ_j W[:, j]·μ, R and μ those of head j's KV head (heads H over R's H_kv), float64 inside."""
    kv_heads, d, _ = rotation.shape
    group = heads // kv_heads
    r = rotation.double().repeat_interleave(group, dim=0)
    w = weight.double().reshape(weight.shape[0], heads, d)
    new_w = torch.einsum("ojc,jce->oje", w, r).reshape(weight.shape).to(weight.dtype)
    if mean is None:
        return new_w, bias
    shift = torch.einsum("ojc,jc->o", w, mean.double().repeat_interleave(group, dim=0))
    b = shift if bias is None else bias.double() + shift
    return new_w, b.to(weight.dtype)


def attention_modules(model) -> dict[int, torch.nn.Module]:
    """{layer index: attention module} of the modules transformers numbers by layer_idx that project values."""
    return {m.layer_idx: m for m in model.modules()
            if hasattr(m, "v_proj") and hasattr(m, "o_proj") and isinstance(getattr(m, "layer_idx", None), int)}


def _check(module, heads: int, kv_heads: int, d: int, i: int) -> None:
    """Refuse an attention whose values or output are not plain linear maps of the heads (a norm on v, an output
    gate, fused projections): the absorption would no longer be exact there."""
    v, o, q = module.v_proj, module.o_proj, getattr(module, "q_proj", None)
    if not (isinstance(v, torch.nn.Linear) and isinstance(o, torch.nn.Linear)):
        raise OscarError(f"layer {i}: v_proj and o_proj must be plain linear layers to absorb R_V")
    if hasattr(module, "v_norm"):
        raise OscarError(f"layer {i}: a norm on the values ({type(module).__name__}.v_norm) cannot absorb R_V")
    if v.out_features != kv_heads * d or o.in_features != heads * d or (
            q is not None and getattr(q, "out_features", heads * d) != heads * d):
        raise OscarError(f"layer {i}: projections of {type(module).__name__} are not {heads}/{kv_heads} heads of "
                         f"{d} (an output gate?), cannot absorb R_V")


@torch.no_grad()
def absorb_value_rotation(model, bundle) -> list[int]:
    """Write the bundle's R_V and μ_V into the model's v_proj and o_proj (in place, see the module docstring) and
    mark model.config; returns the layers changed (those the bundle rotates). Read the model then through an
    OscarCache(bundle, values_absorbed=True). Raises OscarError, before changing anything, for a model already
    absorbed, one the bundle does not describe, or an attention the absorption would not be exact for."""
    if getattr(model.config, MARK, None):
        raise OscarError(f"the model's weights already hold R_V of {getattr(model.config, MARK)}")
    m = bundle.manifest.model
    heads, kv_heads, d = m.num_heads, m.num_kv_heads, m.head_dim
    facts = attention_facts(model.config)
    got = (facts["num_heads"], facts["num_kv_heads"], facts["head_dim"])
    if got != (heads, kv_heads, d):
        raise OscarError(f"bundle {bundle.manifest.name} is for {heads}/{kv_heads} heads of dim {d}; the model has "
                         f"{got[0]}/{got[1]} of dim {got[2]}")
    modules = attention_modules(model)
    layers = [i for i in sorted(modules) if bundle.layer(i, "value_rotation") is not None]
    if not layers:
        raise OscarError(f"no attention layer of {type(model).__name__} has a value rotation in the bundle")
    for i in layers:
        _check(modules[i], heads, kv_heads, d, i)
    for i in layers:
        v, o = modules[i].v_proj, modules[i].o_proj
        r = bundle.layer(i, "value_rotation").to(v.weight.device)
        mean = bundle.layer(i, "value_mean")
        mean = None if mean is None else mean.to(v.weight.device)
        _set(v, *absorbed_value_projection(v.weight, v.bias, r, mean))
        _set(o, *absorbed_output_projection(o.weight, o.bias, r, mean, heads))
    setattr(model.config, MARK, bundle.manifest.name)
    return layers


def _set(linear: torch.nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    linear.weight.copy_(weight)
    if bias is None:
        return
    if linear.bias is None:
        linear.bias = torch.nn.Parameter(bias, requires_grad=False)
    else:
        linear.bias.copy_(bias)
