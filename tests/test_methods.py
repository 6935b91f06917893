import pytest
import torch

from oscar_core import quant
from oscar_core.errors import OscarError
from oscar_core.rotations import hadamard
from oscar_core.serve import methods


def keys_with_outliers(b=1, h=3, t=256, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, t, d, generator=g)
    x[..., 5] *= 20  # one outlier channel, as post-RoPE keys have
    return x + 3 * torch.randn(h, 1, d, generator=g)


def oscar_side(h, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))[0].float()
    return methods.Side(64, rotation=r, mean=torch.randn(h, d, generator=g), clip=torch.tensor([1.0, 0.9, 0.8]))


@pytest.mark.parametrize("side", [methods.Side(64), methods.Side(64, axis="channel"), oscar_side(3, 64),
                                  methods.Side(64, rotation=hadamard(64).float().expand(3, 64, 64))])
def test_encode_decode_equals_fake(side):
    x = keys_with_outliers()
    stored = methods.encode(side, x)
    assert stored["codes"].dtype == torch.uint8 and stored["codes"].numel() == x.numel() // 4
    assert torch.allclose(methods.decode(side, stored), methods.fake(side, x), atol=1e-5)


def test_token_axis_is_the_reference_quantizer_in_the_rotated_space():
    side = oscar_side(3, 64)
    x = keys_with_outliers()
    y = (x - side.mean[:, None]) @ side.rotation
    expected = quant.fake_quantize(y, 64, side.clip[:, None]) @ side.rotation.mT + side.mean[:, None]
    assert torch.allclose(methods.fake(side, x), expected, atol=1e-5)


def test_kivi_keys_quantize_channels_over_token_blocks():
    x = keys_with_outliers(t=150)
    side = methods.Side(64, axis="channel")
    out = methods.fake(side, x)
    block = x[:, :, 64:128].transpose(-1, -2)               # [B, H, d, 64 tokens]
    assert torch.allclose(out[:, :, 64:128], quant.fake_quantize(block, 64).transpose(-1, -2))
    assert torch.equal(out[:, :, 128:], x[:, :, 128:])       # an incomplete block is never quantized
    # Per-channel scales cope with the outlier channel far better than per-token ones.
    per_token = methods.fake(methods.Side(64), x[:, :, :128])
    assert (out[:, :, :128] - x[:, :, :128]).norm() < 0.7 * (per_token - x[:, :, :128]).norm()


def test_int2_mask_windows():
    pos = torch.arange(20)
    m = methods.int2_mask(pos, 20, methods.Side(64), sink=2, recent=4)
    assert m[10].tolist() == [False] * 2 + [True] * 5 + [False] * 13   # t in [2, 6]: t ≤ p − recent
    assert not m[5].any() and m[6, 2] and not m[6, 3]
    blocks = methods.int2_mask(pos, 20, methods.Side(4, axis="channel"), sink=2, recent=4)
    assert not blocks[8].any() and blocks[9, 2:6].all() and not blocks[9, 6:].any()   # block [2, 6) once 5 ≤ p − 4
    assert not methods.int2_mask(pos, 20, None, 2, 4).any()
    # Values of a layer whose keys go by blocks move with them.
    lm = methods.LayerMethod(methods.Side(4, axis="channel"), methods.Side(4))
    assert lm.token_block == 4
    assert torch.equal(methods.int2_mask(pos, 20, lm.value, 2, 4, lm.token_block), blocks)


def test_bits_per_element_same_bits_for_every_int2_method():
    for method in methods.INT2_METHODS:
        if method == "oscar":
            continue
        assert methods.bits_per_element(method, 320) == 16.0
        assert 2.25 < methods.bits_per_element(method, 8192) < 2.9
    assert methods.bits_per_element("int2", 8192) == quant.bits_per_element(8192)
    assert methods.bits_per_element("hadamard", 131072) < 2.3
    assert methods.bits_per_element("bf16", 8192) == 16.0


def test_unknown_method_and_oscar_without_bundle():
    with pytest.raises(OscarError, match="unknown method"):
        methods.check_method("fp8")
    with pytest.raises(OscarError, match="bundle"):
        methods.layer_method("oscar", 0, 3, 64)
