"""Offline SASS of the decode kernel and of two layout prototypes, for sm_90, no GPU needed.

Compiles with triton 3.6 (the GPU image's version) installed to a side folder, so the counts match what
runs on the H100:
    python -m pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36:. python bench/kernel_sass.py
Prints, per 64-token tile and warp, the loop's instruction count and its largest opcodes:
- split: decode._split_kernel at a launch setting (shared memory, registers, stack, spills in the loop);
- keys: the key-score product alone (load, unpack, 4 products), plain Triton vs Gluon with the packed
  bytes loaded straight into the mma A-operand layout;
- values: the value product alone, plain Triton vs Gluon on today's row-major codes vs Gluon on codes
  with token pairs interleaved ([T/2, d/4, 2], the co-design of kernel_notes.md v7).
"""

import re
import subprocess
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from oscar_core.triton import decode

CUOBJDUMP = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
RAW_ASM = decode._UNPACK_RAW_ASM.value
ASM = decode._UNPACK_ASM.value


def compile_sass(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int, is_gluon=False):
    """(metadata, cuobjdump -res-usage text, SASS text) of fn compiled for sm_90; pointers 16-byte aligned."""
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in signature if signature[k].startswith("*")}
    src = (GluonASTSource if is_gluon else ASTSource)(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
    return k.metadata, res, sass


def loop_ops(sass: str) -> tuple[int, dict]:
    """Instruction count of the largest loop body (a backward branch and its target, holding no unpredicated EXIT:
    a wait's retry path placed after the kernel's end branches back into the loop too) and its opcodes."""
    body = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    best, seg = 0, []
    for a, ins in body:
        m = re.search(r"BRA (0x[0-9a-f]+)", ins)
        if m and int(m.group(1), 16) <= a and (a - int(m.group(1), 16)) // 16 + 1 > best:
            t = int(m.group(1), 16)
            inside = [x for x in body if t <= x[0] <= a]
            if not any(x[1].strip() == "EXIT" for x in inside):
                best, seg = (a - t) // 16 + 1, inside
    ops = {}
    for _, ins in seg:
        op = re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ins)
        if op:
            ops[op.group(1)] = ops.get(op.group(1), 0) + 1
    return best, dict(sorted(ops.items(), key=lambda x: -x[1]))


def split_kernel(d=128, hg=4, gk=64, gv=64, block_n=64, warps=1, stages=4, key_t=True, fused=False):
    """decode._split_kernel at one launch setting: shared bytes, registers, stack, loop count, opcodes."""
    hgp = max(decode._pow2(hg), 16 // min(d // gk, d // gv))
    qp = max(16, hgp)
    sb = 1 << (max(1, min(32, 2048 * warps // (qp * d))).bit_length() - 1)
    types = dict(q_ptr="*fp32" if fused else "*bf16", rk_ptr="*fp32", kc_ptr="*u8", ksc_ptr="*u8", kz_ptr="*i8",
                 vc_ptr="*u8", vsc_ptr="*u8", vz_ptr="*i8", len_ptr="*i32", po_ptr="*fp32", pm_ptr="*fp32",
                 pl_ptr="*fp32", cnt_ptr="*i32", rv_ptr="*fp32", mean_ptr="*fp32", scale_log2="fp32",
                 log2_scale="fp32")
    const = dict(HKV=8, HG=hg, D=d, GK=gk, GV=gv, S=64, W=256, HGP=hgp, QP=qp, NW=5, BLOCK_N=block_n, BLOCK_W=64,
                 SB=sb, BLOCK_E=16, KEY_T=key_t, USE_ASM=True, ROTATE=fused, MERGE=fused, HAS_MEAN=True, F32=False,
                 TB=1, R=1, VT=False, PDL=False)
    fn = decode._split_kernel
    sig = {a: types.get(a, "*bf16" if a.endswith("_ptr") else "i32") for a in fn.arg_names if a not in const}
    meta, res, sass = compile_sass(fn, sig, const, warps, stages)
    n, ops = loop_ops(sass)
    regs, stack = re.search(r"REG:(\d+)", res).group(1), re.search(r"STACK:(\d+)", res).group(1)
    return dict(shared=meta.shared, regs=int(regs), stack=int(stack), loop=n,
                spills=ops.get("LDL", 0) + ops.get("STL", 0), ops=dict(list(ops.items())[:8]))


@triton.jit
def keys_triton(kc_ptr, q_ptr, out_ptr, n_tiles, BLOCK_N: tl.constexpr, DB: tl.constexpr, MK: tl.constexpr):
    j, m, n = tl.arange(0, DB), tl.arange(0, MK), tl.arange(0, BLOCK_N)
    qoff = j[:, None] * MK + m[None, :]
    q0, q1 = tl.load(q_ptr + qoff), tl.load(q_ptr + DB * MK + qoff)
    q2, q3 = tl.load(q_ptr + 2 * DB * MK + qoff), tl.load(q_ptr + 3 * DB * MK + qoff)
    acc = tl.zeros([BLOCK_N, MK], tl.float32)
    for t in range(n_tiles):
        kp = tl.load(kc_ptr + t * BLOCK_N * DB + n[:, None] * DB + j[None, :])
        u0, u1, u2, u3 = decode._unpack_raw(kp, True)
        acc = tl.dot(u3, q3, tl.dot(u2, q2, tl.dot(u1, q1, tl.dot(u0, q0, acc))))
    tl.store(out_ptr + n[:, None] * MK + m[None, :], acc)


@gluon.jit
def keys_gluon(kc_ptr, q_ptr, out_ptr, n_tiles, BLOCK_N: gl.constexpr, DB: gl.constexpr, MK: gl.constexpr,
               ASM: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_l))
    j = gl.arange(0, DB, layout=gl.SliceLayout(0, a_l))
    qoff = (gl.arange(0, DB, layout=gl.SliceLayout(1, b_l))[:, None] * MK
            + gl.arange(0, MK, layout=gl.SliceLayout(0, b_l))[None, :])
    q0, q1 = gl.load(q_ptr + qoff), gl.load(q_ptr + DB * MK + qoff)
    q2, q3 = gl.load(q_ptr + 2 * DB * MK + qoff), gl.load(q_ptr + 3 * DB * MK + qoff)
    acc = gl.zeros([BLOCK_N, MK], gl.float32, mma)
    for t in range(n_tiles):
        kp = gl.load(kc_ptr + t * BLOCK_N * DB + n[:, None] * DB + j[None, :])   # bytes in the A layout
        u0, u1, u2, u3 = gl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [kp],
                                                   dtype=(gl.bfloat16,) * 4, is_pure=True, pack=4)
        acc = mma_v2(u3, q3, mma_v2(u2, q2, mma_v2(u1, q1, mma_v2(u0, q0, acc))))
    no = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    mo = gl.arange(0, MK, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + no[:, None] * MK + mo[None, :], acc)


@triton.jit
def values_triton(vc_ptr, a_ptr, out_ptr, n_tiles, BLOCK_N: tl.constexpr, DB: tl.constexpr, MV: tl.constexpr):
    j, r, n = tl.arange(0, DB), tl.arange(0, MV), tl.arange(0, BLOCK_N)
    acc0 = tl.zeros([MV, DB], tl.float32)
    acc1, acc2, acc3 = acc0, acc0, acc0
    for t in range(n_tiles):
        a = tl.load(a_ptr + t * MV * BLOCK_N + r[:, None] * BLOCK_N + n[None, :])
        vp = tl.load(vc_ptr + t * BLOCK_N * DB + n[:, None] * DB + j[None, :])
        w0, w1, w2, w3 = decode._unpack(vp, True)
        acc0, acc1 = tl.dot(a, w0, acc0), tl.dot(a, w1, acc1)
        acc2, acc3 = tl.dot(a, w2, acc2), tl.dot(a, w3, acc3)
    tl.store(out_ptr + r[:, None] * DB + j[None, :], acc0 + acc1 + acc2 + acc3)


@gluon.jit
def values_gluon(vc_ptr, a_ptr, out_ptr, n_tiles, BLOCK_N: gl.constexpr, DB: gl.constexpr, MV: gl.constexpr,
                 ASM: gl.constexpr, PAIRS: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    r = gl.arange(0, MV, layout=gl.SliceLayout(1, a_l))
    na = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, a_l))
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, b_l))
    j = gl.arange(0, DB, layout=gl.SliceLayout(0, b_l))
    if PAIRS:   # token pairs interleaved: byte (t, j) at ((t // 2)·DB + j)·2 + t % 2
        off = ((n // 2)[:, None] * DB + j[None, :]) * 2 + (n % 2)[:, None]
    else:       # today's row-major codes
        off = n[:, None] * DB + j[None, :]
    acc0 = gl.zeros([MV, DB], gl.float32, mma)
    acc1, acc2, acc3 = acc0, acc0, acc0
    for t in range(n_tiles):
        a = gl.load(a_ptr + t * MV * BLOCK_N + r[:, None] * BLOCK_N + na[None, :])
        vp = gl.load(vc_ptr + t * BLOCK_N * DB + off)                           # bytes in the B layout
        w0, w1, w2, w3 = gl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [vp],
                                                   dtype=(gl.bfloat16,) * 4, is_pure=True, pack=4)
        acc0, acc1 = mma_v2(a, w0, acc0), mma_v2(a, w1, acc1)
        acc2, acc3 = mma_v2(a, w2, acc2), mma_v2(a, w3, acc3)
    ro = gl.arange(0, MV, layout=gl.SliceLayout(1, mma))
    jo = gl.arange(0, DB, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + ro[:, None] * DB + jo[None, :], acc0 + acc1 + acc2 + acc3)


def prototype(fn, ptrs, const, is_gluon=False):
    sig = dict(zip(("kc_ptr" if "kc_ptr" in fn.arg_names else "vc_ptr", ptrs[1], "out_ptr", "n_tiles"),
                   ("*u8", "*bf16", "*fp32", "i32")))
    _, _, sass = compile_sass(fn, sig, const, 1, 1, is_gluon)
    n, ops = loop_ops(sass)
    return f"{n} {dict(list(ops.items())[:8])}"


def main():
    assert triton.__version__.startswith("3.6"), f"counts are for triton 3.6 (the GPU image), not {triton.__version__}"
    settings = [dict(), dict(block_n=256, warps=4, stages=2), dict(d=256, warps=2, stages=2),
                dict(d=256, warps=1, stages=2), dict(d=256, block_n=128, warps=4, stages=2),
                dict(d=64, block_n=128, warps=4, stages=2), dict(d=64, block_n=256, warps=4, stages=2),
                dict(block_n=256, warps=4, stages=2, fused=True)]
    for s in settings:
        print("split", s, split_kernel(**s), flush=True)
    shape = dict(BLOCK_N=64, DB=32)
    print("keys   triton", prototype(keys_triton, ("kc_ptr", "q_ptr"), dict(shape, MK=16)))
    print("keys   gluon ", prototype(keys_gluon, ("kc_ptr", "q_ptr"), dict(shape, MK=16, ASM=RAW_ASM), True))
    print("values triton", prototype(values_triton, ("vc_ptr", "a_ptr"), dict(shape, MV=16)))
    for pairs in (False, True):
        print(f"values gluon pairs={pairs}",
              prototype(values_gluon, ("vc_ptr", "a_ptr"), dict(shape, MV=16, ASM=ASM, PAIRS=pairs), True))


if __name__ == "__main__":
    main()
