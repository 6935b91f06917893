"""oscar calibrate: gather attention statistics from a causal LM."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from oscar_cli.options import POSITIVE, SEQUENCE, in_range
from oscar_cli.ui import console, progress
from oscar_core.calibrate import distributed
from oscar_core.calibrate.calibration import CalibrationRequest, calibrate as run_calibration

EXAMPLES = """
Examples:

  oscar calibrate --samples 8 --seq-len 512 --out runs/smollm2        # embedded default model and corpus

  oscar calibrate Qwen/Qwen3-8B --data allenai/c4 --split validation --samples 256 --seq-len 4096 --device cuda --out runs/qwen3-8b

  oscar calibrate ./my-model --data corpus/ --out runs/mine            # local directory, folder of .txt/.jsonl/.parquet

  oscar calibrate model.Q8_0.gguf --data notes.jsonl --text-field body --out runs/gguf

  oscar calibrate Qwen/Qwen3-32B --gpus 2 --samples 256 --seq-len 4096 --checkpoint-every 300 --out runs/qwen3-32b   # 2 GPUs, data parallel

  oscar calibrate ./llama-70b --shard --out runs/llama-70b             # one model spread over all GPUs of this host

  torchrun --nproc-per-node 4 -m oscar_cli calibrate Qwen/Qwen3-8B --out runs/qwen3-8b   # the same, started by torchrun
"""


def calibrate(
    model: Annotated[Optional[str], typer.Argument(help="Hub id, local model directory or .gguf file; default: the embedded SmolLM2-135M-Instruct.")] = None,
    out: Annotated[Path, typer.Option("--out", help="Calibration directory (resumed if it exists).")] = ...,
    data: Annotated[Optional[str], typer.Option(help="Hub dataset id, or a .txt/.jsonl/.parquet file or folder; default: Python's own documentation.")] = None,
    split: Annotated[str, typer.Option(help="Dataset split (hub datasets).")] = "train",
    text_field: Annotated[str, typer.Option(help="Text field of .jsonl/.parquet rows and hub datasets.")] = "text",
    samples: Annotated[int, typer.Option(help="Number of token samples N.", callback=POSITIVE)] = 64,
    seq_len: Annotated[int, typer.Option(help="Tokens per sample L.", callback=SEQUENCE)] = 2048,
    batch_size: Annotated[int, typer.Option(help="Samples per forward pass.", callback=POSITIVE)] = 1,
    seed: Annotated[int, typer.Option(help="Seed for drawing the samples.")] = 0,
    device: Annotated[Optional[str], typer.Option(help="cpu or cuda; default: cuda when available.")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="float32, bfloat16 or float16; default: float32 on CPU, bfloat16 on CUDA.")] = None,
    gpus: Annotated[int, typer.Option(callback=POSITIVE, help="Data-parallel processes, one per GPU, started with torchrun (with --device cpu: CPU processes).")] = 1,
    shard: Annotated[bool, typer.Option(help="Spread the model over the GPUs (accelerate device map) for models larger than one GPU; with --gpus N each process takes 1/N of them.")] = False,
    checkpoint_every: Annotated[float, typer.Option(callback=in_range(0), help="Seconds between rewrites of the statistics (0: after every batch); the last batch is always written.")] = 0.0,
) -> None:
    """Stream calibration text through MODEL and gather per-layer, per-KV-head attention statistics."""
    req = CalibrationRequest(model=model, data=data, split=split, text_field=text_field, samples=samples,
                             seq_len=seq_len, batch_size=batch_size, seed=seed, device=device, dtype=dtype,
                             shard=shard, checkpoint_s=checkpoint_every)
    if gpus > 1 and distributed.from_env().world == 1:
        distributed.launch_calibration(req, out, gpus)  # rank 0 of the processes it starts draws the progress
        return
    if not distributed.is_first_process():
        run_calibration(req, out)
        return
    with progress() as bar:
        task = bar.add_task("loading model and data", total=samples, rate="")

        def on_loaded(record: dict) -> None:
            bar.update(task, description=f"calibrating {record['model']['id']}", completed=record["samples_done"])

        def on_progress(done: int, total: int, tokens_per_s: float) -> None:
            bar.update(task, completed=done, rate=f"{tokens_per_s:,.0f} tok/s")

        record = run_calibration(req, out, on_progress=on_progress, on_loaded=on_loaded)
    t = record.get("timings", {})
    console.print(f"[green]calibrated[/] {record['model']['id']}: {record['samples_done']} samples × {record['seq_len']} "
                  f"tokens ({record['tokens']:,} tokens), forward {t.get('forward_s', 0):.1f} s → {out}")


def register(app: typer.Typer) -> None:
    app.command("calibrate", epilog=EXAMPLES)(calibrate)
