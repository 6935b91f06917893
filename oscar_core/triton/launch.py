"""Triton kernels called through their compiled form, for eager decode.

A JIT launch binds and specializes every argument in Python before it looks up the compiled kernel: with the
40-odd arguments of the decode programs that is tens of microseconds a launch, more than the programs run at
8K-16K tokens. CachedKernel does the JIT launch once per setting and keeps the compiled kernel it returns;
later calls look it up by the constexprs and by what triton specializes the other arguments on (a tensor's
dtype and 16-byte alignment; an integer's equality to 1, divisibility by 16 and width), then launch it
directly. Where the JIT returns no compiled kernel (the CPU interpreter) every call takes the JIT path.
"""

import torch


def specialization(arg) -> tuple:
    """What triton compiles a kernel argument's value into."""
    kind = type(arg)
    if kind is int:
        return int, arg == 1, arg % 16 == 0, -2**31 <= arg < 2**31
    if kind is bool:
        return bool, arg
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, int):
        return specialization(int(arg))
    return (kind,)


class CachedKernel:
    """fn[grid](*args, **constexprs_and_options), the JIT's binding skipped after the first call of a setting.
    args are the kernel's leading parameters in order; every later parameter comes by name."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = {}

    def __call__(self, grid: tuple, *args, **kwargs) -> None:
        key = (tuple(kwargs.items()), tuple(map(specialization, args)))
        kernel = self.compiled.get(key)
        if kernel is not None:
            kernel[grid + (1,) * (3 - len(grid))](*args, *(kwargs[name] for name in self.fn.arg_names[len(args):]))
            return
        kernel = self.fn[grid](*args, **kwargs)
        if hasattr(kernel, "function") and all(name in kwargs for name in self.fn.arg_names[len(args):]):
            self.compiled[key] = kernel
