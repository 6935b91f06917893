"""Where a plain `model.generate` step goes with an OscarCache (eager, as a caller without CUDA graphs runs it): a
model of a real config with random weights (host time does not depend on the weights), its zoo bundle, random
prompts. Arms:
  oscar          OscarCache inside oscar_attention, as a user runs it: each layer's decode step (the token's write
                 and the read) one CUDA graph replay (decode.decode_step), captured on the layer's first steps
  bf16           transformers' DynamicCache
Per arm, after a warm-up call (Triton compiles there): model.generate of 1, 8 and 40 new tokens, each on a fresh
cache; the steady step is (t40 − t8) / 32, the first steps' extra (graph captures) t8 − t1 − 7 steps, the prefill
t1; the arms interleaved, 3 rounds (--rounds), each arm's round with the fastest steady step kept. Then, for each
arm, steps 8-40 of one call (the profilers switched on by a logits processor, so without the
prefill and the captures) under cProfile (the host functions with the most time of their own, a step's share of
each part) and under torch.profiler (the device's busy time a step against the step's, its top kernels); and every
arm's decode step of one layer alone, looped at fixed buffers (layer_steps), once a round.

    python -m bench.eager_generate --model qwen2.5-coder-0.5b --points 32000x1,8192x8 \\
        > bench/results/eager_generate_qwen_h200.txt
    python -m bench.eager_generate --model smollm2-135m --points 8000x1 \\
        > bench/results/eager_generate_smollm2_h200.txt
    python -m bench.eager_generate --model qwen2.5-coder-0.5b --points 32000x1 \\
        > bench/results/eager_generate_profile_qwen32k_h200.txt     (with the torch.profiler part)
"""

import argparse
import contextlib
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from bench.common import wall
from oscar_core.formats.bundle import load_bundle
from oscar_core.serve.cache import OscarCache, oscar_attention

ARMS = ("oscar", "bf16")
PROFILE_AFTER = 8      # the steps the profile leaves out (the graphs are captured on the first two)
PARTS = ("generate", "decode_attention", "decode_step", "replay", "_direct", "commit", "append_kv", "leave_blocks",
         "update", "_grow", "shape_of", "_plan_of", "graph_key", "rotate_query_bf16")


# The packaged models' configs (AutoConfig.from_pretrained of their GGUFs) and their zoo bundles.
MODELS = {
    "qwen2.5-coder-0.5b": ("zoo/Qwen/Qwen2.5-Coder-0.5B-Instruct/v1", dict(
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_parameters=dict(rope_theta=1e6, rope_type="default"))),
    "smollm2-135m": ("zoo/HuggingFaceTB/SmolLM2-135M-Instruct/v1", dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters=dict(rope_theta=1e5, rope_type="default"))),
}


def random_model(config_path: str | None, model: str | None):
    from transformers import AutoConfig, AutoModelForCausalLM

    if config_path:
        config = AutoConfig.from_pretrained(config_path)
    else:
        fields = dict(MODELS[model][1])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def counted_captures():
    """Count CUDA graph captures (decode_attention's and decode_step's); returns the counter (a one-element list)."""
    count = [0]
    begin = torch.cuda.CUDAGraph.capture_begin

    def wrapped(self, *args, **kwargs):
        count[0] += 1
        return begin(self, *args, **kwargs)
    torch.cuda.CUDAGraph.capture_begin = wrapped
    return count


def generate_between(model, cache, ids, tokens: int, after: int, start, stop) -> float:
    """One model.generate call of `tokens` new tokens on a fresh cache (None: DynamicCache), start() called at step
    `after` (by a logits processor, so neither the prefill nor the first steps' graph captures come after it) and
    stop() at the end; returns the seconds between them, the device synchronized at both ends."""
    from transformers import LogitsProcessor, LogitsProcessorList

    began = []

    class Start(LogitsProcessor):
        calls = 0

        def __call__(self, input_ids, scores):
            Start.calls += 1
            if Start.calls == after:
                torch.cuda.synchronize()
                began.append(time.perf_counter())
                start()
            return scores

    mask = torch.ones_like(ids)
    with torch.inference_mode(), oscar_attention(model, cache) if cache is not None else contextlib.nullcontext():
        if cache is not None:
            cache.reset()
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=tokens,
                       min_new_tokens=tokens, do_sample=False, logits_processor=LogitsProcessorList([Start()]))
        torch.cuda.synchronize()
        stop()
    return time.perf_counter() - began[0]


def profile_call(model, cache, ids, tokens: int, after: int = 8) -> str:
    """cProfile of the decode steps after the first `after` of one model.generate call (generate_between): the host
    functions with the most time of their own, and a step's share of each of PARTS."""
    prof = cProfile.Profile()
    generate_between(model, cache, ids, tokens, after, prof.enable, prof.disable)
    steps = tokens - after
    stats = pstats.Stats(prof, stream=(buf := io.StringIO()))
    stats.sort_stats("tottime").print_stats(25)
    own = buf.getvalue()
    total = sum(tt for (_, _, _), (_, _, tt, _, _) in stats.stats.items())
    cum = [f"  profiled: {steps} steps, {total / steps * 1e3:.2f} ms a step of host time (under the profiler)"]
    for (file, line, name), (cc, nc, tt, ct, callers) in stats.stats.items():
        if name in PARTS + ("attention",) and "oscar_core" in file or name == "sdpa_attention_forward":
            cum.append(f"  {name} ({Path(file).name}:{line}): {nc / steps:.0f} calls a step, "
                       f"{ct / steps * 1e3:.2f} ms a step cumulative, {ct / max(nc, 1) * 1e6:.1f} µs a call")
    return own[own.rfind("\n", 0, own.find("ncalls")) + 1:] + "\n".join(sorted(cum))


def device_profile(model, cache, ids, tokens: int, after: int = 8, top: int = 10) -> str:
    """torch.profiler of the same steps (profile_summary)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    seconds = generate_between(model, cache, ids, tokens, after, prof.start, prof.stop)
    return profile_summary(prof, tokens - after, seconds, top)


def profile_summary(prof, steps: int, seconds: float, top: int = 10) -> str:
    """A torch.profiler run of `steps` decode steps in `seconds`: the device's busy time a step (the union of its
    kernels' and copies' intervals, every stream) against the step's wall time, so whether a step waits on the host
    or on the device; the kernels with the most device time a step; the host's runtime calls (a synchronize or a
    device-to-host copy stalls the host until the device drains) and its torch operators, a step."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA)
    busy, reach, by_name = 0.0, float("-inf"), {}
    for begin, end, name in spans:
        busy += max(end - max(begin, reach), 0)
        reach = max(reach, end)
        by_name[name] = by_name.get(name, 0.0) + end - begin
    lines = [f"  device: {busy / steps / 1e3:.2f} ms busy a step of {seconds / steps * 1e3:.2f} ms (under the "
             f"profiler), {len(spans) / steps:.0f} device activities a step"]
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {us / steps:9.1f} µs a step  {name[:100]}")
    runtime, ops = {}, {}
    for e in prof.events():
        if e.device_type != DeviceType.CPU:
            continue
        table = runtime if e.name.startswith(("cuda", "cu")) else ops
        calls, us = table.get(e.name, (0, 0.0))
        table[e.name] = (calls + 1, us + e.time_range.end - e.time_range.start)
    for title, table in (("runtime calls", runtime), ("host operators (inclusive)", ops)):
        lines.append(f"  {title}, most time first:")
        for name, (calls, us) in sorted(table.items(), key=lambda kv: -kv[1][1])[:top]:
            lines.append(f"  {calls / steps:7.1f} a step {us / steps:9.1f} µs a step  {name[:90]}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-coder-0.5b")
    p.add_argument("--config", help="a model's config.json instead (random weights); needs --bundle")
    p.add_argument("--bundle", help="default: --model's zoo bundle")
    p.add_argument("--points", default="32000x1")
    p.add_argument("--profile-tokens", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.config and not args.bundle:
        p.error("--config needs --bundle (the model's zoo bundle)")
    model = random_model(args.config, args.model)
    args.bundle = args.bundle or MODELS[args.model][0]
    bundle = load_bundle(args.bundle)
    c = model.config
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}; {c.model_type}, {c.num_hidden_layers} layers, "
          f"{c.num_attention_heads} / {c.num_key_value_heads} heads; bundle {args.bundle}", flush=True)
    captures = counted_captures()
    gen = torch.Generator().manual_seed(0)
    for point in args.points.split(","):
        context, batch = (int(x) for x in point.split("x"))
        ids = torch.randint(0, c.vocab_size, (batch, context), generator=gen).cuda()
        caches = {arm: OscarCache(bundle, "oscar", capacity=context + 48) if arm != "bf16" else None for arm in ARMS}
        for arm in ARMS:
            timed(model, caches[arm], ids, 8)     # compiles
        best = {}
        for _ in range(args.rounds):
            for arm in ARMS:
                captures[0] = 0
                t = {n: timed(model, caches[arm], ids, n) for n in (1, 8, 40)}
                step = (t[40] - t[8]) / 32
                row = (step, t[8] - t[1] - 7 * step, t[1], captures[0])
                best[arm] = min(best.get(arm, row), row)
        for arm in ARMS:
            step, extra, prefill, caps = best[arm]
            print(f"## {context} x {batch} {arm}: steady step {step * 1e3:.2f} ms; first 7 steps' extra "
                  f"{extra * 1e3:.1f} ms; prefill call {prefill:.3f} s; decode graphs captured in the 1-, 8- and "
                  f"40-token calls {caps}", flush=True)
        for arm in ARMS:
            print(f"### {arm}: cProfile of steps {PROFILE_AFTER}-{args.profile_tokens}", flush=True)
            print(profile_call(model, caches[arm], ids, args.profile_tokens, PROFILE_AFTER), flush=True)
            print(f"### {arm}: torch.profiler of steps {PROFILE_AFTER}-{args.profile_tokens}", flush=True)
            print(device_profile(model, caches[arm], ids, args.profile_tokens, PROFILE_AFTER), flush=True)
        for _ in range(args.rounds):
            for arm in ARMS:
                host, finished = layer_steps(model, caches[arm], ids)
                print(f"#### {context} x {batch} {arm}: one layer's decode step alone, {host:.1f} µs of host time, "
                      f"{finished:.1f} µs a step in a loop", flush=True)
        del caches
        torch.cuda.empty_cache()



def layer_steps(model, cache, ids, steps: int = 300) -> tuple[float, float]:
    """(µs of host time, µs of wall time) a decode step of one layer takes alone, looped at fixed buffers (bench.common's
    wall: 10 steps' warm-up, then `steps`): the cache's update and its attention (OscarCache: layer 0's update and
    kernel read after a prefill of ids' first tokens; None: a DynamicLayer's update, torch.cat, and sdpa as
    transformers calls it)."""
    from transformers.cache_utils import DynamicLayer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    c = model.config
    batch, context = ids.shape
    context -= steps + 16           # the store's capacity holds the steps and wall's warm-up
    heads, kv, d = c.num_attention_heads, c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    d = getattr(c, "head_dim", None) or d
    q = torch.randn(batch, heads, d, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(batch, kv, 1, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    with torch.inference_mode():
        if cache is not None:
            cache.reset()
            with oscar_attention(model, cache):
                model(ids[:, :context], attention_mask=torch.ones_like(ids[:, :context]), past_key_values=cache)
            layer = cache.layers[0]     # reads its decode steps by kernel (on CUDA): update leaves them to it

            def step():
                layer.update(k, v)
                layer.decode_attention(q, d ** -0.5)
        else:
            layer = DynamicLayer()
            layer.update(*(torch.randn(batch, kv, context, d, dtype=torch.bfloat16, device="cuda")
                           for _ in range(2)))
            module = model.model.layers[0].self_attn
            q4 = q[:, :, None]

            def step():
                keys, values = layer.update(k, v)
                sdpa_attention_forward(module, q4, keys, values, None, scaling=d ** -0.5)
        host, finished = wall(step, steps)
    return host, finished


def timed(model, cache, ids, tokens: int) -> float:
    """Seconds of one model.generate call of `tokens` new tokens on a fresh cache (None: DynamicCache)."""
    mask = torch.ones_like(ids)
    with torch.inference_mode(), oscar_attention(model, cache) if cache is not None else contextlib.nullcontext():
        if cache is not None:
            cache.reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=tokens, min_new_tokens=tokens,
                       do_sample=False)
        torch.cuda.synchronize()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
