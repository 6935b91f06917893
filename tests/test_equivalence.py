"""Equivalence measures: rotations compared through the covariance they rotate, means and clips directly."""

import math

import torch

from oscar_core.equivalence import (CLIP_TIE, Deviation, TOLERANCES, clip_excess, figure_deviations, json_differences,
                                    rotated_covariance_deviation, tensor_deviations)
from oscar_core.rotations import bit_reversal_permutation, eigenbasis, hadamard, rotation

D = 16


def degenerate_covariance(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """C = Q Λ Qᵀ whose two leading eigenvalues are equal (and the rest distinct), and Q."""
    q, _ = torch.linalg.qr(torch.randn(D, D, generator=gen, dtype=torch.float64))
    lam = torch.tensor([10.0, 10.0] + [8.0 - 0.5 * i for i in range(D - 2)], dtype=torch.float64)
    return q @ torch.diag(lam) @ q.T, q


def test_eigenvector_signs_and_turns_within_an_eigenspace_are_not_deviations():
    gen = torch.Generator().manual_seed(0)
    cov, _ = degenerate_covariance(gen)
    u, hp = eigenbasis(cov), hadamard(D) @ bit_reversal_permutation(D)
    r = u @ hp
    assert torch.allclose(r, rotation("oscar", cov, D), atol=1e-12)
    turn = torch.eye(D, dtype=torch.float64)  # a turn within the leading (degenerate) eigenspace ...
    angle = 0.7
    turn[:2, :2] = torch.tensor([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]],
                                dtype=torch.float64)
    signs = torch.diag(torch.tensor([1.0] * (D - 1) + [-1.0], dtype=torch.float64))  # ... and a flipped sign
    other = u @ turn @ signs @ hp  # another valid eigenbasis of cov, same H·P_br
    assert (other - r).abs().max() > 0.1                                   # element-wise: far apart
    assert float(rotated_covariance_deviation(r, other, cov)) < 1e-12      # what attention sees: the same


def test_a_small_turn_of_the_rotation_is_a_deviation():
    gen = torch.Generator().manual_seed(1)
    cov, _ = degenerate_covariance(gen)
    r = rotation("oscar", cov, D)
    a = torch.randn(D, D, generator=gen, dtype=torch.float64)
    turned = r @ torch.linalg.matrix_exp(1e-3 * (a - a.T))
    assert float(rotated_covariance_deviation(r, turned, cov)) > 100 * TOLERANCES["key_rotation"]


def test_tensor_deviations_by_kind_with_structural_reasons():
    gen = torch.Generator().manual_seed(2)
    cov, _ = degenerate_covariance(gen)
    r = rotation("oscar", cov, D)[None]
    mean = torch.randn(1, D, generator=gen)
    committed = {"layers.0.key_rotation": r.float(), "layers.0.key_mean": mean, "layers.0.key_clip": torch.tensor([0.8]),
                 "layers.0.extra": torch.ones(3)}
    rebuilt = {"layers.0.key_rotation": r.float(), "layers.0.key_mean": mean * (1 + 1e-7),
               "layers.0.key_clip": torch.tensor([0.82]), "layers.0.new": torch.ones(1)}
    deviations, reasons = tensor_deviations(committed, rebuilt, {"layers.0.key_rotation": cov[None]})
    by_kind = {d.kind: d for d in deviations}
    assert reasons == ["layers.0.new is only in the rebuild", "layers.0.extra is only in the committed bundle"]
    assert by_kind["key_rotation"].ok and by_kind["key_mean"].ok and 0 < by_kind["key_mean"].worst < 2e-7
    clip = by_kind["key_clip"]
    assert not clip.ok and math.isclose(clip.worst, 0.02, rel_tol=1e-5)
    assert clip.reason().startswith("key_clip deviates by 0.02 at layers.0.key_clip head 0 (0.8 vs 0.82)")


def test_a_clip_is_held_to_the_rebuilds_objective_a_near_tie_passes_a_worse_clip_fails():
    """Clips measured by the rebuild's objective E: the committed 0.72 where the rebuild chose 0.74 passes when
    E(0.72) is within CLIP_TIE of E(0.74); a clip that costs more fails with its excess and both values."""
    def objective(optimum: float, depth: float):
        return lambda c: 1.0 + depth * (torch.as_tensor(c, dtype=torch.float64) - optimum) ** 2

    rebuilt = {"layers.0.value_clip": torch.tensor([0.74, 0.80])}
    near = {"layers.0.value_clip": torch.tensor([0.72, 0.80])}
    far = {"layers.0.value_clip": torch.tensor([0.74, 0.50])}
    tie = objective(0.73, 1.0)                     # 0.72 and 0.74 score the same
    assert clip_excess(tie, rebuilt["layers.0.value_clip"], rebuilt["layers.0.value_clip"]).tolist() == [0.0, 0.0]
    excess = {"layers.0.value_clip": clip_excess(tie, near["layers.0.value_clip"], rebuilt["layers.0.value_clip"])}
    (clip,), _ = tensor_deviations(near, rebuilt, {}, excess)
    assert clip.ok and clip.tolerance == CLIP_TIE and clip.where == "layers.0.value_clip head 0 (0.72 vs 0.74)"
    steep = objective(0.75, 10.0)
    excess = {"layers.0.value_clip": clip_excess(steep, far["layers.0.value_clip"], rebuilt["layers.0.value_clip"])}
    (clip,), _ = tensor_deviations(far, rebuilt, {}, excess)
    worse = (1 + 10 * 0.25 ** 2) / (1 + 10 * 0.05 ** 2) - 1
    assert not clip.ok and math.isclose(clip.worst, worse, rel_tol=1e-6)  # clips are float32
    assert clip.reason().startswith(f"value_clip deviates by {worse:.3g} at layers.0.value_clip head 1 (0.5 vs 0.8)")


def test_figures_and_json_differences():
    d = figure_deviations({"kl": 0.0131, "logit_error": 0.1885}, {"kl": 0.0133, "logit_error": 0.1985},
                          {"kl": 2e-3, "logit_error": 1e-3})
    assert [(x.kind, x.ok) for x in d] == [("verify kl", True), ("verify logit_error", False)]
    assert isinstance(d[0], Deviation)
    ppl = figure_deviations({"ppl": 34.4981, "kivi_ppl": 38.0}, {"ppl": 34.5785, "kivi_ppl": 40.0},
                            {"ppl": 2e-2, "kivi_ppl": 2e-2})
    assert [(x.kind, x.ok) for x in ppl] == [("verify kivi_ppl", False), ("verify ppl", True)]
    assert math.isclose(ppl[1].worst, math.log(34.5785 / 34.4981)) and math.isclose(ppl[0].worst, math.log(40 / 38))
    assert json_differences({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3, "d": 0}}) == ["a.c: 2 ≠ 3",
                                                                                           "a.d: only on one side"]
