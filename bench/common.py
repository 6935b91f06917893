"""What the benchmarks share: timing (CUDA-graph replay, eager wall clock, per-kernel device time), the device's
copy bandwidth, random layers of rotations, and the flash-SDPA stand-in for the best BF16 decode step.

Imports only torch, triton and oscar_core's torch-only modules, so the kernel benchmarks run on a bare GPU image.
"""

import datetime
import time

import torch

from oscar_core import kvstore

GIB = 2 ** 30


def utc_now() -> str:
    """The time a results file is written, as its header shows it."""
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a 2 GiB device-to-device copy."""
    from triton.testing import do_bench

    src = torch.randn(2**29, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def orthogonal(heads: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """[heads, d, d] random orthogonal float32 matrices on the GPU."""
    return torch.linalg.qr(torch.randn(heads, d, d, generator=gen, device="cuda", dtype=torch.float64))[0].float().contiguous()


def layer_of(kv_heads: int, d: int, gen: torch.Generator) -> kvstore.LayerRotation:
    """A random layer: orthogonal R_K and R_V, clips 0.96 / 0.92, key and value means of scale 0.5."""
    return kvstore.LayerRotation(orthogonal(kv_heads, d, gen), orthogonal(kv_heads, d, gen),
                                 torch.full((kv_heads,), 0.96, device="cuda"),
                                 torch.full((kv_heads,), 0.92, device="cuda"),
                                 torch.randn(kv_heads, d, generator=gen, device="cuda") * 0.5,
                                 torch.randn(kv_heads, d, generator=gen, device="cuda") * 0.5)


def graph_bench(fn) -> float:
    """Median time of a CUDA-graph replay of fn (L2 cleared before each replay): the launch cost a
    serving engine pays, without Python's per-call overhead."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=25, rep=200, return_mode="median")


def eager_ms(fn, calls: int = 100) -> float:
    """Wall clock per call of `calls` back-to-back calls from Python (after 5 warm-up calls), in ms."""
    return wall(fn, calls, warmup=5)[1] / 1e3


def wall(fn, calls: int = 300, warmup: int = 10) -> tuple:
    """(µs a call to issue, µs a call to finish) over `calls` back-to-back calls, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter() - t
    torch.cuda.synchronize()
    return issued / calls * 1e6, (time.perf_counter() - t) / calls * 1e6


def kernel_times(fn, calls: int = 20, launches: dict | None = None) -> dict:
    """Device time per call of each kernel fn launches (torch.profiler, eager), in ms; launches, if given,
    gets each kernel's launches per call."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.count:
            times[e.key] = times.get(e.key, 0.0) + e.device_time_total / calls / 1e3
            if launches is not None:
                launches[e.key] = launches.get(e.key, 0.0) + e.count / calls
    return times


def rel_err(out, ref) -> float:
    """max over rows of ‖out − ref‖/‖ref‖ (inf where it is NaN)."""
    err = ((out.float() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    return err if err == err else float("inf")


def flash_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """bf16-flash: SDPA over every slot of the static buffers, GQA in the kernel, no mask."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2), None


def attention_for(arm: str, model):
    """bf16-flash routes attention to flash_attention (the name avoids "flash": transformers reads that
    as a hub kernel); every other arm keeps the model's sdpa (OscarCache's arms route inside GreedyDecoder)."""
    from contextlib import nullcontext

    from oscar_core.calibrate.statistics import route_attention

    return route_attention(model, "bench_gqa_sdpa", flash_attention) if arm == "bf16-flash" else nullcontext()
