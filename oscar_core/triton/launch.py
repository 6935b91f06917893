"""Triton kernels called through their compiled form, for eager decode.

A JIT launch binds and specializes every argument in Python before it looks up the compiled kernel: with the
40-odd arguments of the decode programs that is tens of microseconds a launch, more than the programs run at
8K-16K tokens. CachedKernel does the JIT launch once per setting and keeps the compiled kernel it returns;
later calls look it up by launch_key and launch it directly. Where the JIT returns no compiled kernel (the CPU
interpreter) every call takes the JIT path. `cached(fn)` is the one CachedKernel of a JIT function: decode's
launches and the write launches of a decode step (append_kv, leave_blocks) go through it.
"""

import functools

import torch


def launch_key(args: tuple, kwargs: dict) -> tuple:
    """What a compiled kernel depends on: the constexprs and options (kwargs), each tensor's dtype and 16-byte
    alignment (what triton specializes a pointer on), each TMA descriptor's type (dtype, block shape, shared
    layout; not its tensor, which the launch encodes), and every other argument's value: finer than triton's own
    specialization of integers (equality to 1, divisibility by 16, width), so never coarser."""
    return tuple(kwargs.items()), tuple(_arg_key(a) for a in args)


def _arg_key(a) -> tuple:
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if hasattr(a, "block_shape") and hasattr(a, "layout"):
        return type(a), a.base.dtype, tuple(a.block_shape), repr(a.layout)
    return type(a), a


class CachedKernel:
    """fn[grid](*args, **constexprs_and_options), the JIT's binding skipped after the first call of a setting.
    args are the kernel's leading parameters in order; every later parameter comes by name."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = {}

    def __call__(self, grid: tuple, *args, **kwargs) -> None:
        key = launch_key(args, kwargs)
        hit = self.compiled.get(key)
        if hit is not None:
            kernel, tail = hit
            kernel[grid + (1,) * (3 - len(grid))](*args, *(kwargs[name] for name in tail))
            return
        kernel = self.fn[grid](*args, **kwargs)
        tail = self.fn.arg_names[len(args):]
        if hasattr(kernel, "function") and all(name in kwargs for name in tail):
            self.compiled[key] = kernel, tail


@functools.lru_cache(maxsize=None)
def cached(fn) -> CachedKernel:
    """The CachedKernel of the JIT function fn (one per function, so every caller shares its compiled kernels)."""
    return CachedKernel(fn)
