"""Offline SASS of the Gluon INT2 programs for sm_90, one row per shape class of bench/shapes.py, no GPU needed.

For each shape class, the constexprs and compile options decode launches with (decode.gluon_constexprs,
decode._gluon_options), compiled for sm_90: registers, stack bytes, shared memory, the programs a multiprocessor
holds (decode.resident_warps), and per 64-token tile and warp the loop's instructions, tensor-core products
(HMMA), quarter-rate special-function ops (MUFU: exp2s and conversions) and global loads. With triton 3.6 (the
GPU image's) installed to a side folder the counts are those of the programs that run on the H100:
    python -m pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36:. python bench/gluon_sass.py --out bench/results/gluon_sass.md
--value-layout rows compiles the programs that read a store whose value codes are in rows rather than 64-row tiles
(kvstore's value_layout; bench/results/gluon_sass_rows.md).
"""

import argparse
import datetime
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, str(Path(__file__).parent))
from kernel_sass import CUOBJDUMP, loop_ops  # noqa: E402
from shapes import SHAPES  # noqa: E402

from oscar_core import kvstore  # noqa: E402
from oscar_core.triton import decode, decode_gluon  # noqa: E402

TYPES = dict(qt_ptr="*bf16", kw_ptr="*i32", ksc_ptr="*u8", kz_ptr="*u8", vh_ptr="*i16", vsc_ptr="*u8", vz_ptr="*u8",
             len_ptr="*i32", po_ptr="*fp32", pm_ptr="*fp32", pl_ptr="*fp32", log2_scale="fp32")
SMEM_PER_SM = 228 * 1024    # H100


def descriptor_types(d: int) -> dict:
    """The signature types of decode.tma_descriptors' two descriptors at head_dim d (read only where TMA > 0)."""
    code_box, meta_box = decode.tma_boxes(d)
    return dict(cdesc=f"tensordesc<i32{code_box},{gl.NVMMASharedLayout(128, 32, 3)!r}>",
                mdesc=f"tensordesc<i32{meta_box},{gl.NVMMASharedLayout(0, 32, 3)!r}>")


def constexprs(heads: int, kv_heads: int, d: int, gk: int, gv: int, axis: str, layout: str = "rows") -> dict:
    """What decode._plan passes the Gluon programs for this shape on an H100 (the window programs' count does not
    reach the loop: 5; programmatic dependent launch on)."""
    cache = kvstore.empty_cache(1, kv_heads, d, 1024, gk, gv, key_axis=axis, value_layout=layout)
    return dict(decode.gluon_constexprs(cache, heads, d, 5), PDL=True)


def compile_row(const: dict) -> dict:
    fn = decode_gluon._int2_split_kernel
    types = dict(TYPES, **descriptor_types(const["D"]))
    sig = {a: types.get(a, "i32") for a in fn.arg_names if a not in const}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if sig[a].startswith("*") or a == "T"}
    src = GluonASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in const}), constexprs=const, attrs=attrs)
    options = dict(decode._gluon_options(const), num_stages=1)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
    regs, stack = (int(x) for x in re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    shared = kernel.metadata.shared
    n, ops = loop_ops(sass)
    return dict(regs=regs, stack=stack, shared=shared, per_sm=decode.resident_warps(regs, shared, SMEM_PER_SM),
                loop=n, hmma=ops.get("HMMA", 0), mufu=ops.get("MUFU", 0), ldg=ops.get("LDG", 0),
                spill=ops.get("LDL", 0) + ops.get("STL", 0), maxnreg=options.get("maxnreg"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/gluon_sass.md")
    ap.add_argument("--value-layout", default=kvstore.DEFAULT_VALUE_LAYOUT, choices=kvstore.VALUE_LAYOUTS)
    args = ap.parse_args()
    lines = ["# The Gluon INT2 programs' loop, offline for sm_90 (bench/gluon_sass.py)", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; triton {triton.__version__}"
             f", torch {torch.__version__}; value codes in {args.value_layout}",
             "- per 64-token tile and warp (one warp a program): loop instructions, tensor-core products (HMMA), "
             "special-function ops (MUFU), global loads (LDG), spill loads and stores (LDL + STL); programs a "
             "multiprocessor from the registers and shared memory (decode.resident_warps, H100)",
             "- the settings decode launches with for each shape class of bench/shapes.py (gluon_constexprs, "
             "_gluon_options: maxnreg where the registers are held); head_dim 256 below 8 (sequence, KV head) pairs "
             "runs the Triton programs by default (decode._plan)", "",
             "| shape | heads a program x programs | key block | groups a token (K, V) | registers | stack | shared B "
             "| programs a SM | keys ahead | loop | HMMA | MUFU | LDG | LDL + STL |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, heads, kv_heads, d, gk, gv, axis in SHAPES:
        c = constexprs(heads, kv_heads, d, gk, gv, axis, args.value_layout)
        r = compile_row(c)
        regs = f"{r['regs']} (held to {r['maxnreg']})" if r["maxnreg"] else str(r["regs"])
        line = (f"| {label} | {c['R4']} x {c['HT']} | {c['TB']} | {c['NGK']}, {c['NGV']} | {regs} | {r['stack']} | "
                f"{r['shared']} | {r['per_sm']} | {'yes' if c['KEYS_AHEAD'] else 'no'} | {r['loop']} | {r['hmma']} | {r['mufu']} | {r['ldg']} | {r['spill']} |")
        print(line, flush=True)
        lines.append(line)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
