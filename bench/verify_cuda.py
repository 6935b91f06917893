"""`oscar verify` on CUDA (Triton write + decode kernels) against the CPU reference, same bundle, same text.

Runs the verify command twice on this machine, --device cpu and --device cuda (float32 model on both, so
the only difference is the INT2 path), and compares the per-layer, per-head errors.

    PYTHONPATH=. python3 bench/verify_cuda.py BUNDLE --model MODEL --out bench/results/verify_cuda.md
"""

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def run_verify(bundle, model, device, seq_len, data, out) -> dict:
    cmd = [sys.executable, "-c", "from oscar_cli.app import main; main()", "verify", bundle, "--model", model,
           "--device", device, "--dtype", "float32", "--seq-len", str(seq_len), "--data", data, "--json", out]
    result = subprocess.run(cmd, capture_output=True, text=True)
    print(result.stdout[-3000:], result.stderr[-2000:])
    if result.returncode != 0:
        raise SystemExit(f"verify on {device} failed ({result.returncode})")
    return json.loads(Path(out).read_text())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle")
    p.add_argument("--model", required=True)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--data", default="default-heldout", help="held-out text (default: the IDLE docs shipped with oscar)")
    p.add_argument("--out", default="bench/results/verify_cuda.md")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cpu = run_verify(args.bundle, args.model, "cpu", args.seq_len, args.data, f"{tmp}/cpu.json")
        gpu = run_verify(args.bundle, args.model, "cuda", args.seq_len, args.data, f"{tmp}/cuda.json")
    keys = [k for k in cpu["layers"][0] if k not in ("layer", "kv_head")]
    worst = max(abs(a[k] - b[k]) / max(abs(a[k]), 1e-12) for a, b in zip(cpu["layers"], gpu["layers"]) for k in keys)
    lines = ["# oscar verify: CUDA (Triton kernels) vs CPU (torch reference)", "",
             f"Measured {datetime.date.today()} on {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, "
             f"torch {torch.__version__}; bundle `{args.bundle}`, model `{args.model}` (float32 on both devices), "
             f"{args.seq_len} held-out tokens of `{args.data}`.", "",
             f"| figure | CPU ({cpu['path']}) | CUDA ({gpu['path']}) |", "|---|---|---|"]
    for k in keys:
        lines.append(f"| mean {k.replace('_', ' ')} error | {cpu['mean'][k]:.5f} | {gpu['mean'][k]:.5f} |")
    for k in cpu["end_to_end"]:
        lines.append(f"| next-token {k} | {cpu['end_to_end'][k]:.5f} | {gpu['end_to_end'][k]:.5f} |")
    if "decode_kernel_error" in gpu:
        lines.append(f"| Triton decode kernel vs exact attention, worst layer | - | "
                     f"{max(gpu['decode_kernel_error']):.5f} |")
    lines += ["", f"Largest relative difference of any per-layer, per-head error figure between the two paths: "
              f"**{worst:.2e}**.", ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
