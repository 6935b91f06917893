"""The Gluon INT2 programs compiled for an H100 (sm_90) on any machine: triton's own compiler and ptxas,
no GPU. Compiling checks what the kernel's design rests on: every conversion from the loaded bytes to
the mma operands is register-only (convert_layout(..., assert_trivial=True) fails the compile
otherwise), and the loop fits the registers without spilling. Their numbers are checked on the GPU by
bench/shapes.py and bench/kernel.py.

Each compile runs in a process of its own without TRITON_INTERPRET: in this suite's process the
interpreter has already run kernels, and triton's interpreter leaves triton.language.core patched after
a kernel calls a library function such as tl.max, which breaks any later real compile."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

BIN = Path(triton.__file__).parent / "backends/nvidia/bin"
pytestmark = pytest.mark.skipif(not (BIN / "ptxas").exists(), reason="this triton has no CUDA backend")

COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from oscar_core.triton import decode, decode_gluon, plan

shape, cubin = json.loads(sys.argv[1]), sys.argv[2]
fn = decode_gluon._int2_split_kernel
const = dict(dict(HKV=8, S=64, W=256, NW=5, BLOCK_N=64, HT=1, D=128, VT=False, PDL=True, SLIDE=False, HOLE=False,
                  FLAT=False, TMA=0), **shape)
const["MASK_ALL"] = plan.mask_every_tile(const["D"], const["R4"], const["NGV"], const.get("VT", False))
const["KEYS_AHEAD"] = plan.keys_ahead(const["D"], const["R4"], const["TB"], const["NGK"], const.get("VT", False))
const.setdefault("PF", plan.prefetch_tiles(const["D"], const["R4"], const["TB"]))
if const["TMA"]:
    const.update(KEYS_AHEAD=False, PF=0)   # as plan.choose_plan sets them with the ring
const.setdefault("STRIDED", plan.strided_tiles(const["D"], const["R4"], const["TB"], const["VT"]))
code_box, meta_box = decode.tma_boxes(const["D"])
types = dict(qt_ptr="*bf16", kw_ptr="*i32", ksc_ptr="*u8", kz_ptr="*u8", vh_ptr="*i16", vsc_ptr="*u8",
             vz_ptr="*u8", len_ptr="*i32", po_ptr="*fp32", pm_ptr="*fp32", pl_ptr="*fp32", log2_scale="fp32",
             cdesc=f"tensordesc<i32{code_box},NVMMASharedLayout(128, 32, 3)>",
             mdesc=f"tensordesc<i32{meta_box},NVMMASharedLayout(0, 32, 3)>")
sig = {a: types.get(a, "i32") for a in fn.arg_names if a not in const}
attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if sig[a].startswith("*") or a == "T"}
src = GluonASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in const}), constexprs=const, attrs=attrs)
maxnreg = plan.gluon_registers(const["D"], const["TB"], const["R4"])
options = dict(num_warps=1, num_stages=1, **({} if maxnreg is None else dict(maxnreg=maxnreg)))
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
open(cubin, "wb").write(kernel.asm["cubin"])
print(json.dumps({"shared": kernel.metadata.shared}))
"""


SHAPES = [  # query heads per KV head, heads a program, groups a token (keys, values), key block
    dict(HG=4, R4=4, NGK=2, NGV=2, TB=1),
    # Flat rows (plan.flat_splits): a loop over the pairs a program meets around the same per-pair code. Triton 3.6
    # (the GPU image's, the code measured) keeps no stack on the 4-head program; 3.9 spills 96 bytes there.
    dict(HG=4, R4=4, NGK=2, NGV=2, TB=1, VT=True, FLAT=True, STRIDED=False, stack=96),
    dict(HG=8, R4=8, NGK=1, NGV=2, TB=64, VT=True, FLAT=True, STRIDED=False),
    # (At head_dim 256 flat rows spill 16 bytes, not 8: the rule keeps them to head_dim 64 and 128.)
    dict(HKV=1, HG=4, R4=4, NGK=4, NGV=4, TB=1, D=256, VT=True, FLAT=True, STRIDED=False, stack=16),
    dict(HG=1, R4=4, NGK=2, NGV=2, TB=1),
    # Two query heads a KV head at head_dim 64 in tiles; a window's store with keys per channel at head_dim 128.
    dict(HG=2, R4=4, NGK=1, NGV=1, TB=1, D=64, VT=True),
    dict(HG=4, R4=4, NGK=1, NGV=2, TB=64, VT=True, SLIDE=True, HOLE=True),
    dict(HG=16, R4=4, HT=4, NGK=2, NGV=2, TB=1),
    dict(HG=4, R4=4, NGK=1, NGV=1, TB=1, stack=80),    # held to 128 registers, keys a tile ahead (16 bytes with triton 3.6): measured faster
    dict(HG=4, R4=4, NGK=2, NGV=2, TB=64),
    dict(HG=7, R4=4, HT=2, NGK=2, NGV=1, TB=128),
    dict(HG=3, R4=4, NGK=1, NGV=1, TB=1, D=64),
    dict(HG=7, R4=4, HT=2, NGK=1, NGV=1, TB=64, D=64),
    dict(HG=8, R4=8, NGK=1, NGV=2, TB=64),
    dict(HG=7, R4=8, NGK=1, NGV=1, TB=64, D=64),
    dict(HG=8, R4=8, NGK=2, NGV=2, TB=1),
    dict(HG=5, R4=8, NGK=1, NGV=2, TB=1),
    dict(HG=7, R4=8, NGK=1, NGV=1, TB=1, D=64),
    dict(HG=12, R4=16, NGK=2, NGV=2, TB=1, stack=160),  # 16 heads a program (the option) spill at d 128
    dict(HG=16, R4=16, NGK=1, NGV=2, TB=64, stack=160),
    dict(HG=16, R4=16, NGK=1, NGV=1, TB=1, D=64),
    dict(HKV=1, HG=4, R4=4, NGK=4, NGV=4, TB=1, D=256),    # Gemma 3's head_dim: 248-253 registers
    dict(HG=2, R4=4, NGK=2, NGV=2, TB=1, D=256),
    dict(HG=4, R4=4, NGK=1, NGV=4, TB=64, D=256),
    dict(HG=3, R4=4, NGK=1, NGV=2, TB=128, D=256),
    # Value codes in 64-row tiles (kvstore's value_layout "tiles"): 16-byte value loads, keys ahead by its rule.
    # The last tile's mask only (mask_every_tile): triton 3.6, the GPU image's, keeps 16 and 0 bytes of stack on these
    # two (the settings measured faster); later tritons 80 and 16.
    dict(HG=4, R4=4, NGK=2, NGV=2, TB=1, VT=True, stack=80),
    dict(HG=4, R4=4, NGK=1, NGV=2, TB=64, VT=True, stack=16),
    dict(HG=8, R4=8, NGK=2, NGV=2, TB=1, VT=True),
    dict(HG=8, R4=8, NGK=1, NGV=2, TB=64, VT=True),
    dict(HG=7, R4=8, NGK=1, NGV=1, TB=64, D=64, VT=True),
    dict(HG=3, R4=4, NGK=1, NGV=1, TB=64, D=64, VT=True),
    dict(HKV=1, HG=4, R4=4, NGK=4, NGV=4, TB=1, D=256, VT=True, stack=8),
    dict(HG=2, R4=4, NGK=1, NGV=4, TB=64, D=256, VT=True, stack=24),
    # Window stores (kvstore.window_cache): Gemma 3 12B's sliding layers, keys per token and per channel (the hole's
    # mask: 8 bytes of stack more than the global layer's program here).
    dict(HG=2, R4=4, NGK=4, NGV=4, TB=1, D=256, VT=True, SLIDE=True, stack=24),
    dict(HG=2, R4=4, NGK=1, NGV=4, TB=64, D=256, VT=True, SLIDE=True, HOLE=True, stack=32),
    # The TMA ring (plan.tma_stages): bulk copies two tiles ahead, no global load in the loop. Triton 3.6 keeps no
    # stack there; 3.9 64 bytes.
    dict(HG=4, R4=4, NGK=2, NGV=2, TB=1, VT=True, TMA=2, stack=64),
    # Keys per channel in blocks of a tile: the block's codes come with the tile's metadata.
    dict(HG=4, R4=4, NGK=1, NGV=2, TB=64, VT=True, TMA=2),
    dict(HG=8, R4=8, NGK=1, NGV=2, TB=64, VT=True, TMA=2),
    dict(HG=8, R4=8, NGK=2, NGV=2, TB=1, VT=True, TMA=2),     # keys per token, a score tile a group
    # Head_dim 64: a tile's codes [2, 8, 32] words, its metadata [4, 1, 16].
    dict(HG=4, R4=4, NGK=1, NGV=1, TB=1, D=64, VT=True, TMA=2),
    dict(HG=3, R4=4, NGK=1, NGV=1, TB=64, D=64, VT=True, TMA=2),
    dict(HG=7, R4=8, NGK=1, NGV=1, TB=64, D=64, VT=True, TMA=2),
    # Head_dim 256: a tile's codes [2, 32, 32] words, its metadata [4, 2, 32]. Triton 3.6 keeps no stack with keys
    # per token and 48 bytes with keys per channel; 3.9 24 and 96.
    dict(HKV=1, HG=4, R4=4, NGK=4, NGV=4, TB=1, D=256, VT=True, TMA=2, stack=24),
    dict(HKV=1, HG=4, R4=4, NGK=1, NGV=4, TB=64, D=256, VT=True, TMA=2, stack=96),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_gluon_int2_programs_compile_for_sm90(tmp_path, shape):
    """Every program compiles for sm_90 with no spills (stack: the bytes a setting measured faster with), its
    products on the tensor cores and shared memory only for the TMA ring (a tile's codes and metadata, 36·D bytes a
    stage, and the stages' mbarriers)."""
    shape = dict(shape)
    stack = shape.pop("stack", 0)
    cubin = tmp_path / "k.cubin"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(shape), str(cubin)], env=env,
                         capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    shared = json.loads(run.stdout.strip().splitlines()[-1])["shared"]
    usage = subprocess.run([BIN / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True).stdout
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) <= stack, usage
    # Shared memory holds only the ring of copied tiles; the products take their operands from registers.
    tma, d = shape.get("TMA", 0), shape.get("D", 128)
    assert shared == tma * (32 * d + 256 * shape["NGV"] + 8)
    sass = subprocess.run([BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
    assert "HMMA.16816.F32.BF16" in sass
    assert "LDGSTS" not in sass     # no cp.async copies
    assert ("UTMALDG.3D" in sass) == (tma > 0)  # bulk tensor copies, two a tile
