"""CachedKernel: the key it caches compiled kernels under, and its JIT path (the CPU interpreter, which
returns no compiled kernel, so every call takes it). The direct launches run on the GPU (bench/shapes.py
checks their outputs against the reference)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from oscar_core.triton.launch import CachedKernel, launch_key  # noqa: E402


@triton.jit
def _scale(x_ptr, out_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n) * FACTOR, mask=i < n)


def test_the_key_tells_apart_what_triton_specializes_on():
    x = torch.zeros(8)

    def key(*args, **kwargs):
        return launch_key(args, kwargs)

    assert key(x, 16) == key(torch.ones(8), 16)
    assert key(x, 16) != key(x[1:], 16)                      # 16-byte alignment
    assert key(x, 16) != key(x.double(), 16)
    assert len({key(x, v) for v in (1, 2, 16, 32, 2**40)}) == 5
    assert key(x, 1) != key(x, True) and key(x, 1) != key(x, 1.0)
    assert key(x, BLOCK=8) != key(x, BLOCK=16) and key(x, BLOCK=8, num_warps=4) != key(x, BLOCK=8)


def test_the_key_takes_a_tma_descriptor_by_its_type():
    """A TMA descriptor (unhashable, rebuilt every call) keys by dtype, block shape and layout, not by its tensor."""
    gluon = pytest.importorskip("triton.experimental.gluon")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    swizzled, plain = gluon.language.NVMMASharedLayout(128, 32, 2), gluon.language.NVMMASharedLayout(0, 32, 2)

    def key(rows, block, layout):
        desc = TensorDescriptor.from_tensor(torch.zeros(rows, 32, dtype=torch.int32), block, layout)
        return launch_key((desc, None), {"TMA": 2})

    hash(key(64, [16, 32], swizzled))
    assert key(64, [16, 32], swizzled) == key(128, [16, 32], swizzled)
    assert key(64, [16, 32], swizzled) != key(64, [1, 32], plain)
    assert key(64, [16, 32], swizzled) != key(64, [16, 32], plain)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path")
def test_interpreted_kernels_run_through_the_jit_every_call():
    launch = CachedKernel(_scale)
    x = torch.arange(10, dtype=torch.float32)
    for factor in (2.0, 3.0, 2.0):
        out = torch.zeros(10)
        launch((2,), x, out, 10, FACTOR=factor, BLOCK=8)
        torch.testing.assert_close(out, x * factor)
    assert launch.compiled == {}


def test_every_caller_shares_one_cached_kernel_a_function():
    from oscar_core.triton import decode, decode_programs, launch, write

    assert launch.cached(_scale) is launch.cached(_scale)
    assert decode.cached is launch.cached and decode_programs.cached is launch.cached and write.cached is launch.cached
    assert launch.cached(write._append_kernel) is not launch.cached(write._leave_kernel)
