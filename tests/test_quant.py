import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import capability_env, instruction_sets

from oscar_core.quant import (bits_per_element, dequantize, fake_quantize, pack_int2, quantize, scale_from_code,
                              unpack_int2)


def test_pack_unpack_roundtrip_and_layout():
    codes = torch.randint(0, 4, (5, 3, 64), dtype=torch.uint8)
    packed = pack_int2(codes)
    assert packed.shape == (5, 3, 16) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int2(packed), codes)
    one = torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8)
    assert pack_int2(one).item() == 1 | (2 << 2) | (3 << 4)


def test_codes_are_on_the_grid_and_error_is_bounded():
    x = torch.randn(200, 4, 128) * torch.rand(200, 4, 1) * 10
    codes, scale, zero = quantize(x, group_size=64)
    assert codes.max() <= 3 and scale.shape == (200, 4, 2) and zero.dtype == torch.int8
    x_hat = dequantize(codes, scale, zero, 64)
    step = scale_from_code(scale).repeat_interleave(64, -1)
    # Without clipping every value lies within half a step of its level, up to the log-scale rounding of the step.
    assert ((x_hat - x).abs() <= step * 0.5 * 2 ** (1 / 8) + 1e-6).all()


def test_clip_trades_range_for_resolution():
    x = torch.randn(4000, 64)
    e = [((fake_quantize(x, 64, c) - x).norm() / x.norm()).item() for c in (1.0, 0.8)]
    assert e[1] < e[0] < 0.5


def test_per_head_clip_broadcasts():
    """A per-head clip tensor quantizes each head as its own float clip would: the same integer codes, and so
    the same dequantized floats (steps come from a table; the rest is +, −, ×, ÷, each correctly rounded)."""
    x = torch.randn(10, 3, 64, generator=torch.Generator().manual_seed(0))
    clip = torch.tensor([1.0, 0.7, 0.9])
    codes, scale, zero = quantize(x, 64, clip)
    both = fake_quantize(x, 64, clip)
    for h in range(3):
        one = quantize(x[:, h], 64, float(clip[h]))
        for a, b in zip((codes[:, h], scale[:, h], zero[:, h]), one):
            assert torch.equal(a, b)
        assert torch.equal(both[:, h], fake_quantize(x[:, h], 64, float(clip[h])))


def test_steps_are_exact_powers_for_every_shape():
    """2^((s − 128)/8) correctly rounded to float32, whether looked up one code at a time or all at once."""
    codes = torch.arange(256, dtype=torch.uint8)
    exact = torch.tensor([2.0 ** ((s - 128) / 8) for s in range(256)], dtype=torch.float64)
    table = scale_from_code(codes)
    assert torch.equal(table, exact.float())
    assert all(float(scale_from_code(codes[s:s + 1])[0]) == float(table[s]) for s in range(256))
    assert torch.equal(scale_from_code(codes.reshape(16, 16).float()), table.reshape(16, 16))
    assert ((table.double() / exact - 1).abs() <= 2.0 ** -24).all()


def test_far_off_centre_group_stays_bounded():
    x = torch.randn(16, 64) * 0.01 + 100.0
    err = (fake_quantize(x) - x).abs().max().item()
    assert err < 100 / 31  # the step widens to reach the offset; error is at most half a step


def test_bits_per_element():
    assert bits_per_element(320) == 16
    assert math.isclose(bits_per_element(131072), (320 * 16 + (131072 - 320) * 2.25) / 131072)
    assert bits_per_element(131072) <= 2.3


def test_bad_group_size():
    with pytest.raises(ValueError):
        quantize(torch.randn(3, 60), 64)


@pytest.mark.parametrize("capability", instruction_sets())
def test_quantizer_tests_pass_under_each_instruction_set(capability):
    """This file and the INT2 store's tests, with torch dispatching to each CPU instruction set this machine has."""
    root = Path(__file__).resolve().parents[1]
    tests = ["tests/test_quant.py", "tests/test_kvstore.py"]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                             "not instruction_set", *tests], cwd=root, env=capability_env(capability),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_layer_bits_count_what_a_layer_holds():
    from oscar_core.quant import layer_bits_per_element

    # A global layer is bits_per_element; a block of 64 tokens leaves the window whole.
    assert layer_bits_per_element(131072, 64, 64, 64, 256) == bits_per_element(131072)
    # 1000 − 320 = 680 tokens past the windows: 10 whole blocks (640) are INT2, 360 tokens BF16.
    assert layer_bits_per_element(1000, 64, 64, 64, 256, token_block=64) == bits_per_element(1000, token_block=64) \
        == (360 * 16 + 640 * 2.25) / 1000
    # A sliding layer holds its window only: a BF16 ring of 512 tokens is 16 bits over 512 of 32K tokens.
    assert layer_bits_per_element(32768, 64, 64, 64, 256, window=512, int2=False) == 16 * 512 / 32768
    assert layer_bits_per_element(256, 64, 64, 64, 256, window=512, int2=False) == 16
    assert math.isclose(layer_bits_per_element(32768, 64, 64, 64, 256, window=4096),
                        bits_per_element(4096) * 4096 / 32768)
