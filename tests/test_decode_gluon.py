"""The Gluon INT2 programs compiled for an H100 (sm_90) on any machine: triton's own compiler and ptxas,
no GPU. Compiling checks what the kernel's design rests on: every conversion from the loaded bytes to
the mma operands is register-only (convert_layout(..., assert_trivial=True) fails the compile
otherwise), and the loop fits the registers without spilling. Their numbers are checked on the GPU by
bench/decode_check.py and bench/kernel.py."""

import re
import subprocess
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from oscar_core.triton import decode_gluon  # noqa: E402

BIN = Path(triton.__file__).parent / "backends/nvidia/bin"
pytestmark = pytest.mark.skipif(not (BIN / "ptxas").exists(), reason="this triton has no CUDA backend")


@pytest.mark.parametrize("heads_per_kv,stages", [(4, 2), (1, 2), (4, 0), (4, 3)])
def test_gluon_int2_programs_compile_for_sm90(tmp_path, heads_per_kv, stages):
    fn = decode_gluon._int2_split_kernel
    const = dict(HKV=8, HG=heads_per_kv, R4=4, S=64, W=256, NW=5, BLOCK_N=64, STAGES=stages)
    types = dict(qt_ptr="*bf16", kw_ptr="*i32", ksc_ptr="*u8", kz_ptr="*u8", vh_ptr="*i16", vsc_ptr="*u8",
                 vz_ptr="*u8", len_ptr="*i32", po_ptr="*fp32", pm_ptr="*fp32", pl_ptr="*fp32", log2_scale="fp32")
    sig = {a: types.get(a, "i32") for a in fn.arg_names if a not in const}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if sig[a].startswith("*") or a == "T"}
    src = GluonASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in const}), constexprs=const,
                         attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1, num_stages=1))
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run([BIN / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True).stdout
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    # Shared memory holds only the ring of copied tiles; the products take their operands from registers.
    assert kernel.metadata.shared == stages * 4608
    sass = subprocess.run([BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
    assert "HMMA.16816.F32.BF16" in sass
    assert ("LDGSTS.E.BYPASS.128" in sass) == (stages > 0)  # 16-byte cp.async copies
