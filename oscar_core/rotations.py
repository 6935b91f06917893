"""Rotations: eigenbasis, Walsh-Hadamard, bit-reversal permutation, and their compositions.

Convention: a row vector x is stored rotated as x·R, so (q·R)·(k·R)^T = q·k^T for orthogonal R.
    R_K = U_Q · H · P_br      U_Q: eigenvectors of the query covariance C_Q, eigenvalues descending
    R_V = U_S · H · P_br      U_S: eigenvectors of the score-weighted value covariance C_S
H is the normalized Sylvester Walsh-Hadamard matrix (H·H^T = I) and P_br the permutation matrix that
sends channel i to bit_reverse(i), spreading consecutive eigen-directions across quantization groups.
"""

import torch


def eigenbasis(cov: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of symmetric cov [..., d, d] as columns, eigenvalues descending, in float64.

    Each eigenvector's sign is fixed (its largest-magnitude entry positive) so results are deterministic.
    """
    cov = cov.double()
    _, vectors = torch.linalg.eigh((cov + cov.mT) / 2)
    vectors = vectors.flip(-1)
    pivot = vectors.abs().argmax(-2, keepdim=True)
    signs = torch.sign(torch.gather(vectors, -2, pivot))
    return vectors * torch.where(signs == 0, 1.0, signs)


def eigenvalues(cov: torch.Tensor) -> torch.Tensor:
    """Eigenvalues of symmetric cov [..., d, d], descending, float64: the order of eigenbasis's columns."""
    cov = cov.double()
    return torch.linalg.eigvalsh((cov + cov.mT) / 2).flip(-1)


def hadamard(d: int) -> torch.Tensor:
    """Normalized Walsh-Hadamard matrix of size d (a power of two), Sylvester order, float64."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / d**0.5


def block_hadamard(d: int, block: int) -> torch.Tensor:
    """Block-diagonal Hadamard: one normalized Hadamard of size `block` per group of channels."""
    return torch.block_diag(*[hadamard(block)] * (d // block))


def bit_reverse(d: int) -> torch.Tensor:
    """bit_reverse(i) for i < d (a power of two): the index whose log2(d) bits are i's, reversed."""
    bits = d.bit_length() - 1
    i = torch.arange(d)
    return sum(((i >> b) & 1) << (bits - 1 - b) for b in range(bits)) if bits else i


def bit_reversal_permutation(d: int) -> torch.Tensor:
    """P_br as a matrix: (x·P)[bit_reverse(i)] = x[i]."""
    p = torch.zeros(d, d, dtype=torch.float64)
    p[torch.arange(d), bit_reverse(d)] = 1.0
    return p


# Each variant maps (U [..., d, d], group size) to R; U is the eigenbasis of the relevant covariance
# (C_Q for keys, C_S for values). "oscar" is the published composition U·H·P_br.
VARIANTS = {
    "none": lambda u, g: torch.eye(u.shape[-1], dtype=torch.float64).expand_as(u),
    "hadamard": lambda u, g: hadamard(u.shape[-1]).expand_as(u),
    "eigen": lambda u, g: u,
    "eigen-hadamard": lambda u, g: u @ hadamard(u.shape[-1]),
    "oscar": lambda u, g: u @ hadamard(u.shape[-1]) @ bit_reversal_permutation(u.shape[-1]),
    "eigen-perm-blockhadamard": lambda u, g: u @ bit_reversal_permutation(u.shape[-1]) @ block_hadamard(u.shape[-1], g),
}
LABELS = {"none": "none", "hadamard": "H", "eigen": "U", "eigen-hadamard": "U·H", "oscar": "U·H·P_br",
          "eigen-perm-blockhadamard": "U·P_br·H_block"}


def label(variant: str, basis: str = "U") -> str:
    """Display name of a variant, e.g. label("oscar", "U_Q") == "U_Q·H·P_br"."""
    return LABELS[variant].replace("U", basis)


def rotation(variant: str, cov: torch.Tensor, group_size: int) -> torch.Tensor:
    """The rotation of a named variant for covariance cov [..., d, d], float64."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown rotation variant {variant}: one of {', '.join(VARIANTS)}")
    return VARIANTS[variant](eigenbasis(cov), min(group_size, cov.shape[-1])).contiguous()


def oscar_covariance(r: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """The covariance C [..., d, d] whose "oscar" rotation is r [..., d, d] and whose eigenvalues are lam [..., d]
    (descending, the order of the eigenbasis's columns), float64: r = U·H·P_br with H and P_br orthogonal, so
    U = r·P_brᵀ·Hᵀ and C = U·diag(λ)·Uᵀ exactly."""
    d = r.shape[-1]
    u = r.double() @ bit_reversal_permutation(d).T.to(r.device) @ hadamard(d).T.to(r.device)
    return (u * lam.double()[..., None, :]) @ u.mT


def orthogonality_error(r: torch.Tensor) -> float:
    """max |R^T R − I| over every matrix in r [..., d, d]."""
    eye = torch.eye(r.shape[-1], dtype=torch.float64, device=r.device)
    return float((r.double().mT @ r.double() - eye).abs().amax())
