import torch

from oscar_core.rotations import (VARIANTS, bit_reversal_permutation, bit_reverse, block_hadamard, eigenbasis,
                                  eigenvalues, hadamard, orthogonality_error, oscar_covariance, rotation)


def test_hadamard_is_orthogonal_with_equal_magnitudes():
    h = hadamard(64)
    assert orthogonality_error(h) < 1e-12
    assert torch.allclose(h.abs(), torch.full_like(h, 1 / 8))
    assert orthogonality_error(block_hadamard(128, 64)) < 1e-12


def test_bit_reverse():
    assert bit_reverse(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    p = bit_reversal_permutation(8)
    x = torch.arange(8, dtype=torch.float64)
    assert (x @ p)[bit_reverse(8)].tolist() == x.tolist()


def test_eigenbasis_orders_and_fixes_signs():
    a = torch.randn(3, 16, 16, dtype=torch.float64)
    cov = a @ a.mT
    u = eigenbasis(cov)
    lam = torch.diagonal(u.mT @ cov @ u, dim1=-2, dim2=-1)
    assert (lam[:, :-1] >= lam[:, 1:] - 1e-9).all()
    assert torch.allclose(u.mT @ cov @ u, torch.diag_embed(lam), atol=1e-8)
    pivot = u.abs().argmax(-2, keepdim=True)
    assert (torch.gather(u, -2, pivot) > 0).all()
    assert torch.equal(eigenbasis(cov), eigenbasis(cov.clone()))


def test_every_variant_is_orthogonal_and_preserves_dot_products():
    a = torch.randn(2, 64, 64, dtype=torch.float64)
    cov = a @ a.mT
    q, k = torch.randn(2, 5, 64, dtype=torch.float64), torch.randn(2, 7, 64, dtype=torch.float64)
    for variant in VARIANTS:
        r = rotation(variant, cov, 16)
        assert r.shape == (2, 64, 64)
        assert orthogonality_error(r) < 1e-12, variant
        assert torch.allclose((q @ r) @ (k @ r).mT, q @ k.mT, atol=1e-9)


def test_oscar_rotation_is_u_h_pbr():
    a = torch.randn(64, 64, dtype=torch.float64)
    cov = a @ a.T
    expected = eigenbasis(cov) @ hadamard(64) @ bit_reversal_permutation(64)
    assert torch.equal(rotation("oscar", cov, 64), expected)


def test_oscar_covariance_recovers_the_covariance_from_its_rotation_and_eigenvalues():
    a = torch.randn(3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cov = a @ a.mT
    r, lam = rotation("oscar", cov, 8), eigenvalues(cov)
    assert torch.allclose(oscar_covariance(r, lam), cov, atol=1e-10 * cov.abs().max())
    back = oscar_covariance(r.float(), lam.float())   # as a bundle stores them
    assert torch.allclose(rotation("oscar", back, 8), r, atol=1e-5)
