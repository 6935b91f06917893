"""Serving benchmark: decode steps of a Qwen3-8B-shaped model through BF16 caches and the INT2 OscarCache.

A random-initialised model with Qwen3-8B's full shapes (36 layers, hidden 4096, 32 query / 8 KV heads,
head_dim 128, bf16) is built on the GPU from a config (no download), and an OSCAR bundle of random
orthogonal rotations, means and clips stands in for a calibrated one (the kernels do the same work).
--model Qwen3-32B: GQA 8; --model Gemma3-12B: head_dim 256, 40 of its 48 layers sliding over 1,024 tokens (the
INT2 arms hold those in window stores, kvstore.window_cache; bf16-flash in FlashRing below; bf16-static, in transformers'
static sliding layers, fails at capture); --model Gemma3-1B: 4 query heads on one KV head, 22 of its 26 layers
sliding over 512 tokens, kept whole in BF16 (window stores with no INT2 rows); --model Gemma3-270M: the same
heads and windows, 18 layers.
Arms, every one in this run, at each (context, batch) point:
  bf16-dynamic   transformers DynamicCache, eager decode steps
  bf16-static    transformers StaticCache, each decode step one CUDA-graph replay (transformers' sdpa path:
                 with the static cache's mask it repeats K/V per query head and runs masked SDPA)
  bf16-flash     a timing stand-in for the best BF16 step torch offers: the same StaticCache and graph, but
                 attention is SDPA with enable_gqa and no mask (flash) over the whole preallocated buffer, the
                 few unwritten slots (at most steps + 24) included: the time of an exact flash-decoding step,
                 not its output; a sliding layer is a ring of its N slots written in place (FlashRing: transformers'
                 static sliding layer rolls its whole buffer every step and cannot be captured)
  int2-eager     OscarCache("oscar") inside oscar_attention, eager decode steps
  int2-graph     the same, each decode step one CUDA-graph replay (oscar_core.serve.decode_graph)
  int2-graph-absorbed  (--absorb-values) int2-graph with R_V and μ_V in v_proj / o_proj (oscar_core.serve.absorb,
                 OscarCache(values_absorbed=True)): run after every other arm, on the model changed in place
                 (exact: the max-batch bf16-flash point, run after it, reads the same model)
--compile: every arm with the model's norms and MLPs compiled (torch.compile, as transformers' compiled generation
or a serving engine runs them): the step's shared part (its weights aside, launches of small elementwise kernels)
shrinks in every arm alike, and what is left between the arms is their attention.
Long contexts are filled synthetically: random post-RoPE keys and values of `context` tokens written
into each cache by its real write path (BF16: the cache's update; INT2: the Triton prefill kernel), then
greedy decode steps run through the whole model (decode_graph.GreedyDecoder). Prefill through the model
is timed separately at a size that fits (the write kernels alone: bench.write).
A torch.profiler trace of one eager decode step counts host-to-device copies, syncs and launches.

    python -m bench.serve --out bench/results/serve.md
    python -m bench.serve --quick --absorb-values --points 32768x8,102400x4,102400x30 \\
        --out bench/results/serve_quick_absorbed.md        (add --compile: serve_quick_compiled.md)
    python -m bench.serve --model Gemma3-12B --quick --points 32768x8,102400x4,102400x8 \\
        --out bench/results/serve_quick_gemma3_12b.md
    python -m bench.serve --quick --arms bf16-dynamic,bf16-flash,int2-eager,int2-graph \\
        --points 32768x8,102400x4,32768x1 --out bench/results/serve_eager_h200.md   (the eager arms beside the graphs)
"""

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.common import GIB, attention_for, utc_now
from oscar_core import kvstore
from oscar_core.layers import layer_specs
from oscar_core.layers import windows as specs_windows
from oscar_core.serve.cache import OscarCache, memory_plan
from oscar_core.serve.decode_graph import GreedyDecoder, compile_shared_parts
ARMS = ("bf16-dynamic", "bf16-static", "bf16-flash", "int2-eager", "int2-graph")
SYNCS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
         "aten::_local_scalar_dense"}


# Attention and MLP shapes of the models served here (published configs): GQA 4 and GQA 8 at head_dim 128, and
# Gemma 3 12B (GQA 2, head_dim 256, five sliding layers of 1,024 tokens to one global).
SHAPES = {"Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, layers=36),
          "Qwen3-32B": dict(hidden_size=5120, intermediate_size=25600, num_attention_heads=64, layers=64),
          "Gemma3-12B": dict(hidden_size=3840, intermediate_size=15360, num_attention_heads=16, layers=48,
                             head_dim=256, sliding_window=1024),
          "Gemma3-1B": dict(hidden_size=1152, intermediate_size=6912, num_attention_heads=4, kv_heads=1, layers=26,
                            head_dim=256, sliding_window=512),
          "Gemma3-270M": dict(hidden_size=640, intermediate_size=2048, num_attention_heads=4, kv_heads=1, layers=18,
                              head_dim=256, sliding_window=512)}


def head_dim(name: str) -> int:
    return SHAPES[name].get("head_dim", 128)


def kv_heads(name: str) -> int:
    return SHAPES[name].get("kv_heads", 8)


def qwen3_model(layers: int, name: str = "Qwen3-8B"):
    """A random-initialised model of `name`'s shapes (SHAPES) with `layers` layers, bf16 on the GPU (Qwen3, or
    Gemma 3's text model)."""
    import transformers as tf

    shape = {k: v for k, v in SHAPES[name].items() if k not in ("layers", "head_dim", "sliding_window", "kv_heads")}
    if name.startswith("Gemma3"):
        types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
        config = tf.Gemma3TextConfig(**shape, num_hidden_layers=layers, num_key_value_heads=kv_heads(name),
                                     head_dim=256, sliding_window=SHAPES[name]["sliding_window"], layer_types=types,
                                     query_pre_attn_scalar=256, vocab_size=262208, max_position_embeddings=131072)
    else:
        config = tf.Qwen3Config(**shape, num_hidden_layers=layers, num_key_value_heads=8, head_dim=128,
                                vocab_size=151936, max_position_embeddings=131072, rope_theta=1e6,
                                tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def layer_windows(config) -> dict | None:
    """{layer: N} of a model's sliding layers (None: none), as a bundle's manifest records them."""
    return specs_windows(layer_specs(config))


VALUE_LAYOUT = [kvstore.DEFAULT_VALUE_LAYOUT]     # --value-layout: the INT2 stores' value codes (kvstore.Int2KVCache)


def random_bundle(layers: int, kv_heads: int = 8, d: int = 128, key_axis: str = "token", heads: int = 32,
                  windows: dict | None = None):
    """The bundle fields OscarCache reads: random orthogonal R_K, R_V, means and clips per layer, keys of every
    layer per token or per channel (over blocks of 64 tokens); windows: {layer: N} of the sliding layers."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    tensors = {}
    for i in range(layers):
        for side, clip in (("key", 0.96), ("value", 0.92)):
            a = torch.randn(kv_heads, d, d, generator=gen, device="cuda", dtype=torch.float32)
            tensors[(i, f"{side}_rotation")] = torch.linalg.qr(a)[0].contiguous()
            tensors[(i, f"{side}_mean")] = 0.1 * torch.randn(kv_heads, d, generator=gen, device="cuda")
            tensors[(i, f"{side}_clip")] = torch.full((kv_heads,), clip, device="cuda")
    manifest = SimpleNamespace(
        name="random", model=SimpleNamespace(num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=d),
        quant=SimpleNamespace(key_group_size=64, value_group_size=64, sink_tokens=64, recent_tokens=256),
        rotation=SimpleNamespace(layers=None, windows=windows))
    return SimpleNamespace(manifest=manifest, layer=lambda i, name: tensors.get((i, name)), key_axis=lambda i: key_axis)


def random_kv(batch: int, context: int, seed: int = 0, d: int = 128, kv_heads: int = 8):
    """Post-RoPE-like keys and values [B, H_kv, context, d] bf16: one sequence's data, the batch a broadcast view."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(kv_heads, context, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(kv_heads, context, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    return k[None].expand(batch, -1, -1, -1), v[None].expand(batch, -1, -1, -1)


def make_cache(arm: str, model, bundle, batch: int, context: int, steps: int):
    """A cache of `arm` holding `context` synthetic tokens per sequence, room for `steps` more."""
    from transformers import DynamicCache, StaticCache

    layers = model.config.num_hidden_layers
    k, v = random_kv(batch, context, d=model.config.head_dim, kv_heads=model.config.num_key_value_heads)
    if arm == "bf16-dynamic":
        cache = DynamicCache()
        for i in range(layers):
            cache.update(k.clone(), v.clone(), i)
    elif arm in ("bf16-static", "bf16-flash"):
        cache = StaticCache(config=model.config, max_cache_len=context + steps + 8)
        pos = torch.arange(context, device="cuda")
        for i in range(layers):
            cache.update(k, v, i, {"cache_position": pos})
            if arm == "bf16-flash" and getattr(cache.layers[i], "is_sliding", False):
                cache.layers[i] = FlashRing(cache.layers[i].keys, cache.layers[i].values, context)
    else:
        cache = OscarCache(bundle, "oscar", capacity=context + steps + 8, value_layout=VALUE_LAYOUT[0],
                           values_absorbed=arm.endswith("absorbed"))
        for i in range(layers):
            cache.update(k, v, i)      # write.prefill_kv as the next layer updates (the last: at the first step)
    torch.cuda.synchronize()
    return cache


class FlashRing:
    """bf16-flash's sliding layer of window N: keys and values [B, H_kv, N, d] holding the last N tokens in some
    order; a decoded token overwrites the oldest slot (a device counter, so a graph replays it), and flash attends
    to all N slots, exactly the window its query sees."""
    is_sliding, is_compileable, is_initialized = True, True, True

    @property
    def max_cache_len(self) -> int:
        return self.keys.shape[2]

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, seen: int):
        self.keys, self.values, self.seen = keys.contiguous(), values.contiguous(), seen
        self.slot = torch.zeros(1, dtype=torch.long, device=keys.device)

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys.index_copy_(2, self.slot, key_states)
        self.values.index_copy_(2, self.slot, value_states)
        self.slot.add_(1).remainder_(self.keys.shape[2])
        self.seen += 1
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]


def time_decode(model, cache, arm: str, batch: int, steps: int, warmup: int = 2) -> dict:
    """Mean ms per decode step over `steps` steps after warm-up (CUDA events around all of them)."""
    ids = torch.full((batch, 1), 11, dtype=torch.long, device="cuda")
    graph = "graph" in arm or arm in ("bf16-static", "bf16-flash")
    with attention_for(arm, model), GreedyDecoder(model, cache, ids, max_new_tokens=steps + warmup + 4) as dec:
        if graph:
            dec.capture(warmup)
        else:
            for _ in range(warmup):
                dec.step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            dec.replay() if graph else dec.step()
        end.record()
        torch.cuda.synchronize()
        tokens = dec.tokens[:, :dec.produced].cpu()
    ms = start.elapsed_time(end) / steps
    return dict(ms=ms, tokens_per_s=batch * 1e3 / ms, tokens=tokens)


def run_point(model, bundle, arm: str, batch: int, context: int, steps: int) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    row = dict(arm=arm, batch=batch, context=context)
    try:
        t0 = time.perf_counter()
        cache = make_cache(arm, model, bundle, batch, context, steps + 8)
        row["fill_s"] = time.perf_counter() - t0
        row |= time_decode(model, cache, arm, batch, steps)
        row["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        if isinstance(cache, OscarCache):
            row["cache_gib"] = cache.nbytes() / GIB
        del cache
    except Exception as e:  # an arm that does not fit or fails is reported, not fatal
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    gc.collect()
    torch.cuda.empty_cache()
    return row


def time_prefill(model, bundle, arm: str, context: int, batch: int = 1) -> dict:
    from transformers import DynamicCache

    from oscar_core.serve.cache import oscar_attention

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, 1000, (batch, context), device="cuda")
    out = {}
    with torch.inference_mode():
        for rep in range(2):                       # the first run compiles the Triton kernels
            cache = (DynamicCache() if arm == "bf16-dynamic"
                     else OscarCache(bundle, "oscar", capacity=context + 64, value_layout=VALUE_LAYOUT[0]))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if isinstance(cache, OscarCache):
                with oscar_attention(model, cache):
                    model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            else:
                model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            torch.cuda.synchronize()
            out = dict(arm=arm, context=context, batch=batch, s=time.perf_counter() - t0,
                       peak_gib=torch.cuda.max_memory_allocated() / GIB)
            del cache
    print(json.dumps(out), flush=True)
    gc.collect()
    torch.cuda.empty_cache()
    return out


def profile_step(model, bundle, arm: str, batch: int = 1, context: int = 4096) -> dict:
    """Counts over one eager decode step (after warm-up): host-to-device copies, syncs, launches."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cache = make_cache(arm, model, bundle, batch, context, 16)
    ids = torch.full((batch, 1), 11, dtype=torch.long, device="cuda")
    with attention_for(arm, model), GreedyDecoder(model, cache, ids, max_new_tokens=8) as dec:
        dec.step()
        dec.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function("decode_step"):
                dec.step()
            torch.cuda.synchronize()
    events = prof.events()
    step = next(e for e in events if e.name == "decode_step").time_range

    def count(*keys, inside=True):
        """Events named like `keys`; host-side ones only inside the step (not the closing synchronize)."""
        return sum(1 for e in events if any(k in e.name for k in keys) and (
            not inside or (step.start <= e.time_range.start and e.time_range.end <= step.end)))

    out = dict(arm=arm, batch=batch, context=context,
               htod_copies=count("Memcpy HtoD", inside=False), dtoh_copies=count("Memcpy DtoH", inside=False),
               syncs=sum(1 for e in events if e.name in SYNCS and step.start <= e.time_range.start
                         and e.time_range.end <= step.end),
               item_calls=count("aten::_local_scalar_dense"),
               launches=count("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    out["top_cpu_ops"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    out["top_cuda_ops"] = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12)
    print(out["top_cuda_ops"], flush=True)
    out["step_cpu_ms"] = (step.end - step.start) / 1e3
    print(json.dumps({k: v for k, v in out.items() if k != "top_cpu_ops"}), flush=True)
    print(out["top_cpu_ops"], flush=True)
    del cache, dec, prof
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Qwen3-8B", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="default: the model's own (Qwen3-32B: 64, 61 GiB of "
                   "weights; --layers 24 leaves room for long caches)")
    p.add_argument("--points", default="32768x8,102400x4,4096x1", help="context x batch, comma separated")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--max-batch-context", type=int, default=102400)
    p.add_argument("--max-batch-cap", type=int, default=None, help="smoke runs: bound the max-batch points")
    p.add_argument("--prefill", default="8192,32768")
    p.add_argument("--out", default="bench/results/serve.md")
    p.add_argument("--json", default=None)
    p.add_argument("--key-axis", default="token", choices=("token", "channel"), help="the bundle's keys, every layer")
    p.add_argument("--quick", action="store_true",
                   help="only the points, arms bf16-flash, int2-eager and int2-graph (no profile, prefill or max batch)")
    p.add_argument("--arms", default=None, help="comma separated: the arms at every point (default: by --quick and "
                   "the context)")
    p.add_argument("--absorb-values", action="store_true",
                   help="also int2-graph-absorbed, after the other arms (the model's v_proj / o_proj changed in place)")
    p.add_argument("--compile", action="store_true",
                   help="the model's norms and MLPs torch.compile'd in every arm (compile_shared_parts)")
    p.add_argument("--value-layout", default=kvstore.DEFAULT_VALUE_LAYOUT, choices=kvstore.VALUE_LAYOUTS,
                   help="how the INT2 stores keep their value codes (kvstore.Int2KVCache)")
    args = p.parse_args()
    args.layers = args.layers or SHAPES[args.model]["layers"]
    if args.arms and not set(args.arms.split(",")) <= set(ARMS):
        p.error(f"--arms: each of {', '.join(ARMS)}")
    VALUE_LAYOUT[0] = args.value_layout

    props = torch.cuda.get_device_properties(0)
    t0 = time.perf_counter()
    model = qwen3_model(args.layers, args.model)
    windows = layer_windows(model.config)
    bundle = random_bundle(args.layers, kv_heads(args.model), head_dim(args.model), key_axis=args.key_axis,
                           heads=SHAPES[args.model]["num_attention_heads"], windows=windows)
    weights = torch.cuda.memory_allocated()
    compiled = compile_shared_parts(model) if args.compile else 0
    res = dict(model=args.model, key_axis=args.key_axis, value_layout=args.value_layout, device=props.name, total_gib=props.total_memory / GIB, weights_gib=weights / GIB,
               torch=torch.__version__, layers=args.layers, steps=args.steps, build_s=time.perf_counter() - t0,
               date=utc_now())
    res["compiled_modules"] = compiled
    import transformers
    import triton
    res["versions"] = f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}"
    print(json.dumps(res), flush=True)
    quick = args.quick
    res["profile"] = [] if quick else [profile_step(model, bundle, a) for a in ("bf16-dynamic", "int2-eager")]
    res["profile"] += [] if quick else [profile_step(model, bundle, a, 4, 102400) for a in ("bf16-flash", "int2-eager")]
    res["prefill"] = []
    for context in [] if quick else map(int, args.prefill.split(",")):
        for arm in ("bf16-dynamic", "int2-eager"):
            res["prefill"].append(time_prefill(model, bundle, arm, context))
    res["points"] = []
    for absorbed in (False, True) if args.absorb_values else (False,):
        if absorbed:
            from oscar_core.serve.absorb import absorb_value_rotation
            absorb_value_rotation(model, bundle)
        for point in args.points.split(","):
            context, batch = map(int, point.split("x"))
            arms = ("bf16-dynamic", "int2-eager") if context <= 8192 else ARMS
            if quick:
                arms = ("bf16-flash", "int2-eager", "int2-graph")
            if args.arms:
                arms = tuple(args.arms.split(","))
            for arm in ("int2-graph-absorbed",) if absorbed else arms:
                res["points"].append(run_point(model, bundle, arm, batch, context, args.steps))
    # The largest batch at this context that fits beside the weights (2 GiB kept for activations and work).
    budget = props.total_memory - weights - 2 * GIB
    plan = memory_plan(args.layers, kv_heads(args.model), head_dim(args.model),
                       args.max_batch_context + args.steps + 16, budget,
                       windows=[(windows or {}).get(i) for i in range(args.layers)])
    res["plan"] = plan | dict(budget_gib=budget / GIB)
    print(json.dumps(res["plan"]), flush=True)
    cap = args.max_batch_cap or 10 ** 9
    int2 = "int2-graph-absorbed" if args.absorb_values else "int2-graph"
    for arm, batch in [] if quick else (("bf16-flash", min(cap, plan["bf16_max_batch"])), (int2, min(cap, plan["max_batch"]))):
        done = [r for r in res["points"] if (r["arm"], r["batch"], r["context"]) == (arm, batch, args.max_batch_context)]
        if done:
            done[0]["max_batch"] = True
            continue
        res["points"].append(run_point(model, bundle, arm, batch, args.max_batch_context, max(4, args.steps // 2)) |
                             dict(max_batch=True))
    for row in res["points"]:
        row.pop("tokens", None)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(render(res))
    print(render(res))


def render(res: dict) -> str:
    lines = [f"# Serving: decode steps through BF16 caches and the INT2 OscarCache ({res['device']})", "",
             f"- {res['date']}; {res['versions']}; model: random-initialised {res.get('model', 'Qwen3-8B')} shapes, {res['layers']} layers, keys per "
             f"{res.get('key_axis', 'token')}, value codes in {res.get('value_layout', 'rows')}, "
             f"weights {res['weights_gib']:.1f} GiB of {res['total_gib']:.1f} GiB"
             + (f"; in every arm the {res['compiled_modules']} norm and MLP modules torch.compile'd (--compile)"
                if res.get("compiled_modules") else ""), "",
             "| context x batch | arm | ms / step | tokens/s | peak GiB | note |", "|---|---|---|---|---|---|"]
    for r in res["points"]:
        note = r.get("error", "") + (" max batch" if r.get("max_batch") else "")
        ms = f"{r['ms']:.2f}" if "ms" in r else "-"
        tps = f"{r['tokens_per_s']:.0f}" if "ms" in r else "-"
        peak = f"{r['peak_gib']:.1f}" if "peak_gib" in r else "-"
        lines.append(f"| {r['context']} x {r['batch']} | {r['arm']} | {ms} | {tps} | {peak} | {note} |")
    lines += ["", "Prefill through the model (batch 1, second run):", "", "| context | arm | s | peak GiB |",
              "|---|---|---|---|"]
    lines += [f"| {r['context']} | {r['arm']} | {r['s']:.3f} | {r['peak_gib']:.1f} |" for r in res["prefill"]]
    lines += ["", "One eager decode step, torch.profiler counts:", "",
              "| arm | host-to-device copies | device-to-host copies | syncs | item() | launches | host ms |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['arm']} ({r['context']} x {r['batch']}) | {r['htod_copies']} | {r['dtoh_copies']} | {r['syncs']} "
              f"| {r['item_calls']} | {r['launches']} | {r['step_cpu_ms']:.2f} |" for r in res["profile"]]
    lines += ["", f"Memory plan: `{json.dumps(res['plan'])}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
