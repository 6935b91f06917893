"""The query rotation and the reduce compute their float32 products in float32 when compiled for an H100 (sm_90),
no GPU needed. Triton 3.6 (the GPU image's) rewrote a sum of broadcast products over 16 head rows
(`tl.sum(x[:, :, None] * y[None, :, :], axis=1)`) as a TF32 tensor-core dot: the reduce's õ·R_V^T then kept about
11 mantissa bits, and at 16 query heads a KV head decode_attention's output moved 2-9% from the reference where
the output is a small difference of large terms. Later tritons make that dot IEEE; the test fails on triton 3.6
against the old code.

Each compile runs in a process of its own without TRITON_INTERPRET (test_decode_gluon.py says why)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

BIN = Path(triton.__file__).parent / "backends/nvidia/bin"
pytestmark = pytest.mark.skipif(not (BIN / "ptxas").exists(), reason="this triton has no CUDA backend")

COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from oscar_core.triton import decode_programs

name, const, types, warps = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
fn = getattr(decode_programs, name)
ptrs = dict(dict(q_ptr="*bf16", rk_ptr="*fp32", out_ptr="*bf16", po_ptr="*fp32", pm_ptr="*fp32", pl_ptr="*fp32",
                 py_ptr="*fp32", cnt_ptr="*i32", rv_ptr="*fp32", mean_ptr="*fp32"), **types)
sig = {a: ptrs.get(a, "i32") for a in fn.arg_names if a not in const}
src = ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in const}), constexprs=const)
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1))
print(json.dumps({"dots": [l.strip() for l in kernel.asm["ttir"].splitlines() if "tt.dot" in l],
                  "mma": [l.strip() for l in kernel.asm["ptx"].splitlines() if "mma" in l]}))
"""

REDUCE = dict(HKV=2, D=128, HAS_MEAN=True, PDL=False, GATED=False, ROTATE=True)


def compiled_dots(name: str, const: dict, types: dict | None = None, num_warps: int = 4) -> dict:
    """The tt.dot lines of the kernel's TTIR and the mma lines of its PTX, compiled for sm_90 in a process of its own."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE, name, json.dumps(const), json.dumps(types or {}),
                          str(num_warps)], env=env,
                         capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name,const", [
    ("_rotate_kernel", dict(HKV=1, HG=16, HGP=16, HB=16, D=128, BLOCK_E=16, PDL=False)),
    ("_rotate_kernel", dict(HKV=1, HG=16, HGP=16, HB=4, D=128, BLOCK_E=16, PDL=False)),
    ("_rotate_kernel", dict(HKV=8, HG=8, HGP=8, HB=8, D=128, BLOCK_E=16, PDL=False)),
    ("_rotate_kernel", dict(HKV=8, HG=2, HGP=2, HB=2, D=128, BLOCK_E=16, PDL=False)),
    ("_reduce_kernel", dict(REDUCE, HG=16, HGP=16, HB=16, SB=64, BLOCK_C=8)),
    ("_reduce_kernel", dict(REDUCE, HG=16, HGP=16, HB=16, SB=32, BLOCK_C=16)),
    ("_reduce_kernel", dict(REDUCE, HG=12, HGP=16, HB=16, SB=32, BLOCK_C=16)),
    ("_reduce_kernel", dict(REDUCE, HG=16, HGP=16, HB=2, SB=256, BLOCK_C=8)),
    ("_reduce_kernel", dict(REDUCE, HG=16, HGP=16, HB=4, SB=128, BLOCK_C=16)),
    ("_reduce_kernel", dict(REDUCE, HG=8, HGP=8, HB=8, SB=64, BLOCK_C=16)),
    ("_reduce_kernel", dict(REDUCE, HG=4, HGP=4, HB=4, SB=64, BLOCK_C=16)),
], ids=lambda x: x if isinstance(x, str) else f"heads{x['HGP']}-block{x['HB']}")
def test_float32_products_stay_off_tf32(name, const):
    """No TF32 dot in the rotation's or the reduce's compiled code, at 16 head rows a program as at 2, 4 and 8."""
    found = compiled_dots(name, const)
    assert not [d for d in found["dots"] if "tf32" in d], found["dots"]
    assert not [m for m in found["mma"] if "tf32" in m], found["mma"][:2]


SPLIT_TYPES = dict(ks_ptr="*bf16", vs_ptr="*bf16", kr_ptr="*bf16", vr_ptr="*bf16", kc_ptr="*u8", ksc_ptr="*u8",
                   kz_ptr="*i8", vc_ptr="*u8", vsc_ptr="*u8", vz_ptr="*i8", len_ptr="*i32", scale_log2="fp32",
                   log2_scale="fp32", bt_ptr="*i32", ws_ptr="*i32")


def test_int2_products_are_bf16():
    """The Triton INT2 programs' products (the raw codes against the query operands, the weights against the value
    codes) and the window programs' are bf16 tensor-core products with float32 sums: every dot of the split programs
    compiled for sm_90 takes two bf16 operands, none float32."""
    const = dict(HKV=8, HG=4, D=128, GK=64, GV=64, S=64, W=256, HGP=4, QP=16, NW=5, BLOCK_N=64, BLOCK_W=64,
                 KEY_T=True, USE_ASM=True, F32=False, TB=1, R=1, VT=True, PDL=False, HOLE=False, SLIDE=False,
                 PAGED=False, PAGE=64)
    found = compiled_dots("_split_kernel", const, SPLIT_TYPES, num_warps=1)
    operands = [d.split(" : ")[-1].split("->")[0] for d in found["dots"]]
    assert len(operands) >= 10 and all(o.count("xbf16>") == 2 for o in operands), operands


@pytest.mark.parametrize("d,hg,warps", [(64, 7, 8), (128, 4, 8), (128, 8, 4), (256, 2, 8), (256, 4, 4)])
def test_window_programs_compile_with_more_warps(d, hg, warps):
    """Beside the Gluon programs the window programs run with 4 or 8 warps (plan.window_warps): they compile for
    sm_90 at every head_dim, their bf16 products on the tensor cores."""
    hgp = 1 << (hg - 1).bit_length()
    const = dict(HKV=2, HG=hg, D=d, GK=64, GV=64, S=64, W=256, HGP=hgp, QP=max(16, hgp), NW=5, BLOCK_N=64,
                 BLOCK_W=64, KEY_T=True, USE_ASM=True, F32=False, TB=1, R=1, VT=True, PDL=False, HOLE=False,
                 SLIDE=False, PAGED=False, PAGE=64)
    found = compiled_dots("_split_kernel", const, SPLIT_TYPES, num_warps=warps)
    assert [m for m in found["mma"] if "bf16" in m]


@pytest.mark.parametrize("hg", [4, 16])
def test_reduce_without_value_rotation_has_no_product(hg):
    """With R_V in the model's weights (ROTATE off) the reduce only merges: no dot, no share of õ·R_V^T."""
    found = compiled_dots("_reduce_kernel", dict(REDUCE, HG=hg, HGP=hg, HB=hg, SB=32, BLOCK_C=16, ROTATE=False))
    assert not found["dots"] and not found["mma"]
