"""When two builds of one bundle are the same bundle: the tolerances `oscar zoo check` holds a rebuild to.

On one machine and software stack a rebuild is byte-identical. Elsewhere the model's forward pass (oneDNN and
MKL kernels chosen by CPU), LAPACK's eigensolver and vectorized math move the last bits, so a rebuild is held
to measured tolerances per tensor kind (bench/reproducibility.py, bench/results/reproducibility.md):

    clips       c_a == c_b, or a near tie of the search: E_b(c_a) − E_b(c_b) <= τ·E_b(c_b)  per KV head,
                E_b the rebuild's own clip objective (derive.clip_objectives), c_b its argmin over the grid
    means       max |μ_a − μ_b| / max |μ_a|                          per layer
    rotations   ‖R_aᵀ C R_a − R_bᵀ C R_b‖_F / ‖C‖_F                per layer and KV head
    other       max |x_a − x_b| / max |x_a|                          any tensor kind not named above

Why clips may differ: a clip is the argmin of an objective over a grid (0.50, 0.52, ..., 1.00), and where two grid
points score nearly alike the last bits of the statistics decide between them (measured: a value clip of 0.72
against 0.74 under another instruction set, their objectives a few parts in a million apart). The committed clip
is then as good a choice on the rebuild's statistics as the rebuild's own; a tampered clip is not.

Why rotations are not compared element by element: R = U·H·P_br, and the eigenbasis U of a covariance C is
defined only up to each eigenvector's sign and, where eigenvalues (nearly) coincide, up to a rotation within
their eigenspace. The sign rule (largest-magnitude entry positive) flips when two entries are nearly equal, and
a near-degenerate pair of eigenvectors turns by δ/gap for a perturbation δ of C, so element-wise differences
of valid rebuilds are unbounded in principle. What attention sees through R is the covariance in the rotated
space, Rᵀ C R = (H P)ᵀ Uᵀ C U (H P): the query energy (keys, C = C_Q) or attention-output energy (values,
C = C_S) that each rotated channel carries, which sets the error INT2 leaves there. It is invariant to both
ambiguities of U and moves by O(‖δC‖) for a perturbation of the statistics, so it is the quantity compared,
with C the rebuild's own covariance. Equivalently: how far the committed R_a is from diagonalizing C as R_b
does. A tampered rotation (perturbed, permuted, another layer's) changes it at once.
"""

import math
from dataclasses import dataclass

import torch

# Measured on SmolLM2-135M (bench/results/reproducibility.md), rebuilt under ATEN_CPU_CAPABILITY default and avx2
# on an AMD EPYC against the bundle committed from another machine: rotations moved at most 4.8e-7, means 1.0e-7,
# no clip. Another calibration seed moves every layer's rotations by at least 2.5e-2 and means by 9.4e-3. The
# tolerances sit at least 20x above the first and 900x below the second.
TOLERANCES = {"key_rotation": 1e-5, "value_rotation": 1e-5, "key_mean": 1e-5, "value_mean": 1e-5,
              "key_clip": 0.0, "value_clip": 0.0}
CLIP_TIE = 1e-4
OTHER_TOLERANCE = 1e-5
COVARIANCE_OF = {"key_rotation": "query", "value_rotation": "output"}  # C_Q and C_S


@dataclass(frozen=True)
class Deviation:
    """The largest deviation of one tensor kind (or verify figure) and the tolerance it is held to."""
    kind: str
    worst: float
    where: str
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.worst <= self.tolerance

    def reason(self) -> str:
        return f"{self.kind} deviates by {self.worst:.3g} at {self.where} (tolerance {self.tolerance:.3g})"


def kind_of(name: str) -> str:
    """`layers.3.key_rotation` → `key_rotation`."""
    return name.split(".", 2)[-1] if name.startswith("layers.") else name


def rotated_covariance_deviation(a: torch.Tensor, b: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """‖aᵀ C a − bᵀ C b‖_F / ‖C‖_F per matrix of a, b, cov [..., d, d], in float64."""
    a, b, cov = a.double(), b.double(), cov.double()
    diff = a.mT @ cov @ a - b.mT @ cov @ b
    return torch.linalg.matrix_norm(diff) / torch.linalg.matrix_norm(cov).clamp_min(1e-300)


def relative_deviation(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |a|."""
    a, b = a.double(), b.double()
    return float((a - b).abs().amax() / a.abs().amax().clamp_min(1e-300))


def clip_excess(errors_at, committed: torch.Tensor, rebuilt: torch.Tensor) -> torch.Tensor:
    """(E(c_a) − E(c_b)) / E(c_b) per KV head, E = errors_at (clips [kv_heads] -> errors [kv_heads]), for the
    committed clips c_a and the rebuilt c_b; 0 where they are equal, inf where they differ and E(c_b) = 0 (an
    objective that sees no quantized token cannot vouch for another clip)."""
    a, b = committed.double(), rebuilt.double()
    if torch.equal(a, b):
        return torch.zeros_like(a)
    ea, eb = errors_at(a).double(), errors_at(b).double()
    excess = ((ea - eb) / eb).clamp_min(0.0)
    return torch.where(a == b, 0.0, torch.where(eb > 0, excess, float("inf")))


def tensor_deviation(name: str, a: torch.Tensor, b: torch.Tensor, cov: torch.Tensor | None,
                     excess: torch.Tensor | None) -> tuple[float, str]:
    """The deviation of one tensor by its kind's measure (module doc), and where it is largest. excess: a clip's
    clip_excess (None: clips must be equal)."""
    kind = kind_of(name)
    if kind in COVARIANCE_OF and cov is not None:
        per_head = rotated_covariance_deviation(a, b, cov).reshape(-1)
        head = int(per_head.argmax())
        return float(per_head[head]), f"{name} head {head}"
    if kind.endswith("_clip"):
        diff = (a.double() - b.double()).abs().reshape(-1)
        measure = diff if excess is None else excess.double().reshape(-1)
        head = max(range(len(measure)), key=lambda h: (float(measure[h]), float(diff[h])))  # ties: a differing clip
        values = f"{float(a.reshape(-1)[head]):g} vs {float(b.reshape(-1)[head]):g}"
        return float(measure[head]), f"{name} head {head} ({values})"
    return relative_deviation(a, b), name


def tensor_deviations(committed: dict[str, torch.Tensor], rebuilt: dict[str, torch.Tensor],
                      covariances: dict[str, torch.Tensor],
                      excesses: dict[str, torch.Tensor] | None = None) -> tuple[list[Deviation], list[str]]:
    """Per tensor kind, the largest deviation of committed from rebuilt; and the structural differences
    (a tensor on one side only, another shape) as one-line reasons.

    covariances maps a rotation's name to the rebuild's covariance of its side, [kv_heads, d, d]; a rotation
    without one is compared element-wise (relative), which is stricter. excesses maps a clip's name to its
    clip_excess; a clip without one must be equal.
    """
    excesses = excesses or {}
    reasons = [f"{n} is only in the rebuild" for n in sorted(set(rebuilt) - set(committed))]
    reasons += [f"{n} is only in the committed bundle" for n in sorted(set(committed) - set(rebuilt))]
    worst: dict[str, tuple[float, str]] = {}
    for name in sorted(set(committed) & set(rebuilt)):
        a, b = committed[name], rebuilt[name]
        if a.shape != b.shape:
            reasons.append(f"{name} has shape {tuple(a.shape)}, the rebuild {tuple(b.shape)}")
            continue
        value, where = tensor_deviation(name, a, b, covariances.get(name), excesses.get(name))
        kind = kind_of(name)
        if kind not in worst or value > worst[kind][0] or value != value:
            worst[kind] = (value, where)
    deviations = [Deviation(kind, value, where, tolerance(kind, excesses))
                  for kind, (value, where) in sorted(worst.items())]
    return deviations, reasons


def tolerance(kind: str, excesses: dict) -> float:
    """The tolerance of a tensor kind; clips measured by their objective (excesses given) are held to CLIP_TIE."""
    if kind.endswith("_clip") and any(kind_of(n) == kind for n in excesses):
        return CLIP_TIE
    return TOLERANCES.get(kind, OTHER_TOLERANCE)


def figure_deviations(committed: dict[str, float], rebuilt: dict[str, float],
                      margins: dict[str, float]) -> list[Deviation]:
    """|committed − rebuilt| of each verify figure both sides have, held to its margin. Perplexities
    (`*ppl`) compare as |log(committed / rebuilt)|: the difference of their mean NLL in nats."""
    def gap(k: str) -> float:
        a, b = committed[k], rebuilt[k]
        return abs(math.log(a / b)) if k.endswith("ppl") and a > 0 and b > 0 else abs(a - b)

    return [Deviation(f"verify {k}", gap(k), f"{committed[k]:.4f} vs {rebuilt[k]:.4f}", margins[k])
            for k in sorted(set(committed) & set(rebuilt) & set(margins))]


def json_differences(a, b, prefix: str = "") -> list[str]:
    """Dotted paths where two JSON-like values differ, e.g. `calibration.seed: 1 ≠ 0`."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            path = f"{prefix}.{k}" if prefix else k
            if k not in a or k not in b:
                out.append(f"{path}: only on one side")
            else:
                out += json_differences(a[k], b[k], path)
        return out
    return [] if a == b else [f"{prefix}: {a!r} ≠ {b!r}"]
