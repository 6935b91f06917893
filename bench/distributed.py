"""Calibration on one and two GPUs, a model sharded over two, and the parallel export: bench/results/distributed.md.

Random-initialised models with real shapes, built on the GPUs (no download): each weight is drawn from its
own generator seeded by its name, on the device it lives on, so every process and every placement holds the
same weights. A byte-level tokenizer (built here) turns generated text into samples.

    python -m bench.distributed --out bench/results/distributed.md            # on a host with 2 GPUs
    python -m bench.distributed --tiny --device cpu --out /tmp/dry.md          # dry run of the whole script

Per model: `calibrate` in one process on one GPU, then in two processes (torchrun, NCCL) on two GPUs, or, for a
model larger than one GPU, in one process sharded over both (accelerate device map); tokens/s over the steady
rounds (the first round, warm-up, and the last, which writes the statistics, left out) and end to end; peak
memory per GPU; the largest deviation of the two-GPU statistics from the one-GPU ones; `export` time.
Results are appended to --out after every model.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_name] = _value  # NVLink multicast off in this process and every process it starts

import torch

ROOT = Path(__file__).resolve().parent.parent

MODELS = {
    # name: (transformers config class, config fields); shapes of the published configs
    "Qwen3-32B": ("Qwen3Config", dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                                      num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                      max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False)),
    "Qwen3-30B-A3B": ("Qwen3MoeConfig", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                             num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                             head_dim=128, num_experts=128, num_experts_per_tok=8, vocab_size=151936,
                                             max_position_embeddings=40960, rope_theta=1000000.0,
                                             tie_word_embeddings=False)),
    "Llama-3-70B-shape-90L": ("LlamaConfig", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=90,
                                                  num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                                  max_position_embeddings=8192, rope_theta=500000.0,
                                                  tie_word_embeddings=False)),
}
TINY = {
    "tiny-qwen3": ("Qwen3Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=512)),
    "tiny-qwen3-moe": ("Qwen3MoeConfig", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=16, num_experts=8, num_experts_per_tok=2, vocab_size=512,
                                              max_position_embeddings=512)),
    "tiny-llama-sharded": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                               max_position_embeddings=512)),
}
SHARDED = ("Llama-3-70B-shape-90L", "tiny-llama-sharded")  # larger than one GPU: one process over both


def byte_tokenizer():
    """256 byte tokens + <eos>, built here (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def config_of(name: str):
    import transformers

    cls, fields = {**MODELS, **TINY}[name]
    config = getattr(transformers, cls)(**fields)
    config._attn_implementation = "sdpa"
    return config


def random_model(name: str, gpus: list[int], dtype: torch.dtype, cpu: bool = False):
    """The model on the meta device, then every weight drawn on its device (one device, or a planned map)."""
    from accelerate import dispatch_model, init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import AutoModelForCausalLM

    from oscar_core.calibrate.models import gpu_memory, plan_device_map

    config = config_of(name)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if cpu:
        plan = {"": "cpu"}
    elif len(gpus) == 1:
        plan = {"": gpus[0]}
        plan_device_map(model, gpu_memory(gpus), dtype)  # refuses a model larger than the GPU, as load_model does
    else:
        plan = plan_device_map(model, gpu_memory(gpus), dtype)

    def device_of(param: str):
        best = max((k for k in plan if k == "" or param == k or param.startswith(k + ".")), key=len)
        value = plan[best]
        return "cpu" if value == "cpu" else torch.device("cuda", value)

    for pname, param in list(model.named_parameters()):
        device = device_of(pname)
        seed = int.from_bytes(hashlib.sha256(pname.encode()).digest()[:7], "little")
        gen = torch.Generator(device=device).manual_seed(seed)
        if param.dim() == 1 and "norm" in pname:
            value = torch.ones(param.shape, dtype=dtype, device=device)
        else:
            value = torch.empty(param.shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
        set_module_tensor_to_device(model, pname, device, value=value)
    if len(set(plan.values())) > 1:
        model = dispatch_model(model, device_map=plan)
    else:
        model.to(device_of(""))
    return model.eval(), config


def worker(args) -> None:
    """One calibration process (world 1, or one rank of torchrun's group)."""
    from oscar_core.calibrate import distributed
    from oscar_core.calibrate.calibration import CalibrationRequest, calibrate
    from oscar_core.calibrate.models import LoadedModel, attention_facts, config_hash
    from oscar_core.formats.bundle import ModelInfo

    group = distributed.from_env()
    cpu = args.device == "cpu"
    visible = 0 if cpu else torch.cuda.device_count()
    gpus = [] if cpu else distributed.process_gpus(group, visible, args.shard)
    dtype = torch.float32 if cpu else torch.bfloat16
    t0 = time.perf_counter()
    model, config = random_model(args.model, gpus, dtype, cpu=cpu)
    build_s = time.perf_counter() - t0
    facts = attention_facts(config)
    info = ModelInfo(id=f"random/{args.model}", config_sha256=config_hash(facts, config), **facts)
    loaded = LoadedModel(model=model, tokenizer=byte_tokenizer(), info=info)
    marks = []
    req = CalibrationRequest(model=f"random/{args.model}", data=args.data, samples=args.samples, seq_len=args.seq_len,
                             seed=0, device="cpu" if cpu else "cuda", checkpoint_s=1e9)
    t0 = time.perf_counter()
    record = calibrate(req, args.calib, loaded=loaded, on_loaded=lambda r: marks.append((0, time.perf_counter())),
                       on_progress=lambda done, total, rate: marks.append((done, time.perf_counter())))
    wall_s = time.perf_counter() - t0
    report = {"rank": group.rank, "world": group.world, "gpus": gpus, "build_s": round(build_s, 2),
              "calibrate_s": round(wall_s, 2),
              "peak_gib": {f"cuda:{i}": round(torch.cuda.max_memory_allocated(i) / 2**30, 2) for i in gpus},
              "devices": sorted({str(p.device) for p in model.parameters()})}
    if group.first:
        (s0, t_first), (s1, t_last) = marks[1], marks[-2]  # after the first round .. before the last round
        report.update(steady_tokens_per_s=round((s1 - s0) * args.seq_len / max(t_last - t_first, 1e-9), 1),
                      end_to_end_tokens_per_s=round(record["tokens"] / wall_s, 1), rounds=len(marks) - 1,
                      steady_samples=s1 - s0)
    Path(args.calib).mkdir(parents=True, exist_ok=True)
    Path(args.calib, f"bench_rank{group.rank}.json").write_text(json.dumps(report))


def write_text(path: Path, n_bytes: int) -> None:
    """Deterministic printable text (the model is random: what the text says does not matter)."""
    gen = torch.Generator().manual_seed(0)
    words = ["".join(chr(97 + c) for c in torch.randint(0, 26, (int(n),), generator=gen).tolist())
             for n in torch.randint(2, 10, (2000,), generator=gen)]
    picks = torch.randint(0, len(words), (n_bytes // 6,), generator=gen).tolist()
    path.write_text(" ".join(words[i] for i in picks))


def run_worker(args, name: str, calib: Path, processes: int, shard: bool) -> dict:
    common = ["worker", "--model", name, "--calib", str(calib), "--data", str(args.data), "--samples",
              str(args.samples), "--seq-len", str(args.seq_len), "--device", args.device]
    if shard:
        common.append("--shard")
    if processes == 1:
        cmd = [sys.executable, "-m", "bench.distributed", *common]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", str(processes), "--module", "bench.distributed", *common]
    t0 = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    log = calib.parent / f"{calib.name}.log"
    log.write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        lines = (result.stdout + result.stderr).strip().splitlines()
        errors = [line for line in lines if "Error" in line or "error:" in line][:3]
        raise RuntimeError(f"{name} with {processes} process(es) failed: {' | '.join(errors + lines[-2:])}")
    reports = [json.loads((calib / f"bench_rank{r}.json").read_text()) for r in range(processes)]
    return {"wall_s": round(time.perf_counter() - t0, 1), "ranks": reports}


def deviation(a_dir: Path, b_dir: Path) -> dict:
    """Largest |a − b| / max|a| per kind of statistic, and of the normalized C_Q and C_S."""
    from safetensors.torch import load_file

    a, b = load_file(a_dir / "statistics.safetensors"), load_file(b_dir / "statistics.safetensors")
    out = {}
    for name in ("query_cov", "output_cov", "key_cov", "value_cov", "key_sum", "value_sum"):
        x, y = a[name].double(), b[name].double()
        out[name] = float((x - y).abs().max() / x.abs().max())
    out["rows_equal"] = bool(torch.equal(a["query_rows"], b["query_rows"]) and torch.equal(a["kv_rows"], b["kv_rows"]))
    probes = [k for k in a if ".probe_" in k and not k.endswith("positions")]
    out["probes"] = max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-30)) for k in probes)
    return out


def export_time(calib: Path, zoo: Path, workers: int) -> dict:
    from oscar_core.calibrate.export import export_bundle

    t0 = time.perf_counter()
    path, manifest = export_bundle(calib, zoo, workers=workers)
    return {"workers": workers, "layers": manifest.model.num_layers, "seconds": round(time.perf_counter() - t0, 1),
            "sha256": manifest.tensors.sha256}


def first_layers(calib: Path, n: int, dst: Path) -> Path:
    """A calibration directory holding only the first n layers of calib's (to time an n-layer export)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    record = json.loads((calib / "calibration.json").read_text())
    n = record["model"]["num_layers"] = min(n, record["model"]["num_layers"])
    with safe_open(calib / "statistics.safetensors", "pt") as f:
        done = f.metadata()["samples_done"]
        state = {k: f.get_slice(k)[:n] if ".probe_" not in k else f.get_tensor(k) for k in f.keys()
                 if ".probe_" not in k or int(k.split(".")[1]) < n}
    save_file(state, dst / "statistics.safetensors", metadata={"samples_done": done})
    (dst / "calibration.json").write_text(json.dumps(record))
    return dst


def smoke(args, work: Path) -> dict:
    """`oscar calibrate --gpus 2` through oscar's own launcher on a tiny model directory, then the same with
    process 1 killed in round 2 (tests/rank_fault.py): the run must fail with one line, leaving round 1 whole."""
    from transformers import AutoModelForCausalLM

    model_dir = work / "tiny-model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config_of("tiny-qwen3")).save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}:{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    out = {}
    killed = ("import sys; from oscar_core.calibrate import distributed; from oscar_core.errors import OscarError\n"
              "try: distributed.launch(sys.argv[1:], 2, module='rank_fault')\n"
              "except OscarError as e: print('error:', e, file=sys.stderr); sys.exit(1)")
    for name, entry in (("cli", ["-m", "oscar_cli"]), ("rank_killed", ["-c", killed])):
        calib = work / f"smoke-{name}"
        cmd = [sys.executable, *entry, "calibrate", str(model_dir), "--data", str(args.data), "--samples", "5",
               "--seq-len", "64", "--device", args.device, "--out", str(calib)]
        if name == "cli":
            cmd += ["--gpus", "2"]
        t0 = time.perf_counter()
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
        record = json.loads((calib / "calibration.json").read_text()) if (calib / "calibration.json").exists() else {}
        out[name] = {"rc": result.returncode, "seconds": round(time.perf_counter() - t0, 1),
                     "stderr_lines": [line for line in result.stderr.splitlines() if line.strip()][-3:],
                     "samples_done": record.get("samples_done"), "processes": record.get("processes"),
                     "temp_files": [p.name for p in calib.glob(".*.tmp")] if calib.exists() else []}
    return out


def bench(args) -> None:
    started = time.perf_counter()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    args.data = work / "text.txt"
    write_text(args.data, args.samples * args.seq_len * 2 + 100_000)
    names = list(TINY if args.tiny else MODELS)
    if args.models:
        names = [n for n in names if n in args.models.split(",")]
    out = Path(args.out)
    cores = len(os.sched_getaffinity(0))
    device = "CPU (dry run)" if args.device == "cpu" else \
        f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    lines = ["# Calibration on several GPUs (`python -m bench.distributed`)", "",
             f"{device}, {cores} CPU cores, torch {torch.__version__}; random-initialised models "
             f"{'(tiny configs)' if args.tiny else 'with real shapes'}; "
             f"{args.samples} samples x {args.seq_len} tokens, batch 1, {'float32' if args.device == 'cpu' else 'BF16'} weights, float64 statistics; "
             f"statistics written once, at the end (`--checkpoint-every` large).", ""]
    results = {}

    def flush():
        out.write_text("\n".join(lines) + "\n")
        Path(str(out) + ".json").write_text(json.dumps(results, indent=1))

    flush()
    if args.smoke:
        try:
            results["smoke"] = smoke(args, work)
        except Exception as e:  # noqa: BLE001
            results["smoke"] = {"error": str(e)}
        lines += ["## `oscar calibrate --gpus 2` through torchrun, and a process killed", "", "```",
                  json.dumps(results["smoke"], indent=1), "```", ""]
        flush()
        print(json.dumps(results["smoke"]), flush=True)
    for name in names:
        entry = results[name] = {}
        shard = name in SHARDED
        try:
            if shard:
                from accelerate import init_empty_weights
                from transformers import AutoModelForCausalLM

                from oscar_core.calibrate.models import gpu_memory, plan_device_map
                from oscar_core.errors import OscarError

                if args.device != "cpu":  # what one GPU says to a model larger than it
                    with init_empty_weights():
                        empty = AutoModelForCausalLM.from_config(config_of(name), dtype=torch.bfloat16)
                    try:
                        plan_device_map(empty, gpu_memory([0]), torch.bfloat16)
                        entry["one_gpu"] = "fits"
                    except OscarError as e:
                        entry["one_gpu"] = f"refused: {e}"
                    del empty
                entry["sharded"] = run_worker(args, name, work / f"{name}-shard", 1, shard=True)
                calib = work / f"{name}-shard"
            else:
                entry["one"] = run_worker(args, name, work / f"{name}-1", 1, shard=False)
                entry["two"] = run_worker(args, name, work / f"{name}-2", 2, shard=False)
                entry["deviation"] = deviation(work / f"{name}-1", work / f"{name}-2")
                calib = work / f"{name}-2"
                if args.export_16 and "export_16" not in results:
                    results["export_16"] = {"model": name, "calib": str(calib)}
            if time.perf_counter() - started < args.budget - 150:
                entry["export"] = export_time(calib, work / "zoo", cores)
            else:
                entry["export_skipped"] = "time budget"
        except Exception as e:  # noqa: BLE001 - a bench keeps what it measured so far
            entry["error"] = str(e)
        lines.extend(render(name, entry))
        flush()
        print(json.dumps({name: entry}), flush=True)
    if results.get("export_16") and time.perf_counter() - started < args.budget - 90:
        e = results["export_16"]
        part = first_layers(Path(e["calib"]), 36, work / "first-36")
        e.update(export_time(part, work / "zoo16", 16))
        lines += [f"Export with 16 worker processes (a 16-core host's worth), the first {e['layers']} layers of "
                  f"{e['model']}'s statistics: **{e['seconds']} s** (target: 36 layers in <= 60 s).", ""]
        flush()


def render(name: str, e: dict) -> list[str]:
    lines = [f"## {name}", ""]
    if "one_gpu" in e:
        lines += [f"One GPU: {e['one_gpu']}", ""]
    if "sharded" in e:
        r = e["sharded"]["ranks"][0]
        lines += ["| run | tokens/s steady | tokens/s end to end | peak memory per GPU | build | wall |",
                  "|---|---|---|---|---|---|",
                  f"| 1 process sharded over {len(r['gpus'])} GPUs ({', '.join(r['devices'])}) | "
                  f"{r['steady_tokens_per_s']:,.0f} | {r['end_to_end_tokens_per_s']:,.0f} | "
                  f"{', '.join(f'{k} {v} GiB' for k, v in r['peak_gib'].items())} | {r['build_s']} s | "
                  f"{e['sharded']['wall_s']} s |", ""]
    if "one" in e and "two" in e:
        one, two = e["one"]["ranks"][0], e["two"]["ranks"][0]
        peaks2 = {k: v for r in e["two"]["ranks"] for k, v in r["peak_gib"].items()}
        lines += ["| run | tokens/s steady | tokens/s end to end | peak memory per GPU | wall |", "|---|---|---|---|---|",
                  f"| 1 process{' (1 GPU)' if one['gpus'] else ''} | {one['steady_tokens_per_s']:,.0f} | {one['end_to_end_tokens_per_s']:,.0f} | "
                  f"{', '.join(f'{k} {v} GiB' for k, v in one['peak_gib'].items())} | {e['one']['wall_s']} s |",
                  f"| 2 processes{' (2 GPUs)' if two['gpus'] else ''}, data parallel | {two['steady_tokens_per_s']:,.0f} | {two['end_to_end_tokens_per_s']:,.0f} | "
                  f"{', '.join(f'{k} {v} GiB' for k, v in sorted(peaks2.items()))} | {e['two']['wall_s']} s |", "",
                  f"Speed-up, steady rounds: **{two['steady_tokens_per_s'] / one['steady_tokens_per_s']:.2f}x**; "
                  f"end to end (model build excluded, final write included): "
                  f"{two['end_to_end_tokens_per_s'] / one['end_to_end_tokens_per_s']:.2f}x.", ""]
    if "deviation" in e:
        d = e["deviation"]
        worst = max(v for k, v in d.items() if isinstance(v, float) and k != "probes")
        lines += [f"Largest deviation of the 2-process statistics from the 1-process ones (|a − b| / max|a|): "
                  f"{worst:.2e} ({', '.join(f'{k} {v:.1e}' for k, v in d.items() if isinstance(v, float))}); "
                  f"row counts equal: {d['rows_equal']}.", ""]
    if "export" in e:
        x = e["export"]
        lines += [f"Export: {x['layers']} layers in {x['seconds']} s with {x['workers']} worker processes.", ""]
    if "export_skipped" in e:
        lines += [f"Export not run: {e['export_skipped']}.", ""]
    if "error" in e:
        lines += [f"Failed: `{e['error'][-600:]}`", ""]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode")
    w = sub.add_parser("worker")
    w.add_argument("--model", required=True)
    w.add_argument("--calib", required=True)
    w.add_argument("--data", required=True)
    w.add_argument("--samples", type=int, required=True)
    w.add_argument("--seq-len", type=int, required=True)
    w.add_argument("--device", default="cuda")
    w.add_argument("--shard", action="store_true")
    p.add_argument("--out", default="bench/results/distributed.md")
    p.add_argument("--work", default="/tmp/oscar-bench-distributed")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--device", default="cuda")
    p.add_argument("--models", default="", help="comma-separated subset")
    p.add_argument("--tiny", action="store_true", help="tiny configs (dry run)")
    p.add_argument("--export-16", action="store_true", help="also time a 36-layer export with 16 workers")
    p.add_argument("--budget", type=float, default=1e9, help="seconds: exports that would run past it are skipped")
    p.add_argument("--smoke", action="store_true", help="first, `oscar calibrate --gpus 2` and a killed process")
    args = p.parse_args()
    if args.mode == "worker":
        worker(args)
    else:
        bench(args)


if __name__ == "__main__":
    main()
