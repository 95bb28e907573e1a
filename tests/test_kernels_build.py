"""The kernels as a GPU would build them, checked on CPU: Triton's compiler and NVIDIA's ptxas (shipped in the
Triton wheel) need no GPU, so `lit_lm/kernels/ttir.py` builds every kernel for sm_90 (H100/H200) in a subprocess (the
compiler is unavailable where TRITON_INTERPRET=1) and these tests read the result:
  - every integer product in a kernel is 64-bit (an int32 `index * stride` wraps past 2^31 elements, and a
    test that allocates 2^31 elements does not fit here; the interpreter wraps int32 too but cannot be given such
    strides over a small storage);
  - every `tl.dot` on fp32 operands is IEEE fp32, not TF32, and 16-bit ones keep the tensor-core default;
  - RMSNorm's widest blocks fit in registers: ptxas reports no spills.
"""

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton without its NVIDIA back end")

from lit_lm.kernels import rmsnorm  # noqa: E402  (after the skip)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTXAS_CASES = [f"rmsnorm_{name}_{d}" for name, max_block in (("fwd", rmsnorm.FORWARD_MAX_BLOCK),
                                                              ("bwd", rmsnorm.BACKWARD_MAX_BLOCK))
               for d in (max_block, 2 * max_block)]
INT32_PRODUCT = re.compile(r"arith\.muli .*:\s*(tensor<[0-9x]*xi32>|i32)\s*loc")
INT64_PRODUCT = re.compile(r"arith\.muli .*:\s*(tensor<[0-9x]*xi64>|i64)\s*loc")
DOT_PRECISION = re.compile(r"inputPrecision = (\w+)")  # printed only when not the default, IEEE


@pytest.fixture(scope="module")
def built() -> dict:
    """{"ttir": {case: IR text}, "ptxas": {case: registers and spills}} for `lit_lm.kernels.ttir.cases()`; ~10-30 s."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", TRITON_DEFAULT_FP_FUSION="1")  # the latter: Triton 3.9 warns when unset
    run = subprocess.run([sys.executable, "-m", "lit_lm.kernels.ttir", "--ptxas", *PTXAS_CASES], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def test_the_int32_detector_sees_int32_products() -> None:
    """The patterns below on lines as Triton prints them (the pre-fix `b * sq_b` in _attn_fwd was the first)."""
    assert INT32_PRODUCT.search("%0 = arith.muli %b, %sq_b : i32 loc(#loc12)")
    assert INT32_PRODUCT.search("%1 = arith.muli %rows, %2 : tensor<16x1xi32> loc(#loc3)")
    assert not INT32_PRODUCT.search("%1 = arith.muli %rows, %2 : tensor<16x1xi64> loc(#loc3)")
    assert INT64_PRODUCT.search("%0 = arith.muli %row, %n : i64 loc(#loc1)")


def test_every_integer_product_is_64_bit(built: dict) -> None:
    """Program ids (and the row blocks added to loop indices) are widened to int64 before any product, so no
    offset wraps at 2^31 elements: not one int32 multiplication in any kernel, and each kernel has int64 ones."""
    assert len(built["ttir"]) >= 25
    for name, ir in built["ttir"].items():
        narrow = [line.strip() for line in ir.splitlines() if INT32_PRODUCT.search(line)]
        assert not narrow, f"{name}: int32 products {narrow}"
        assert INT64_PRODUCT.search(ir), f"{name}: no int64 product at all (is the pattern still right?)"


def test_fp32_dots_are_ieee_and_16_bit_dots_are_not_forced(built: dict) -> None:
    dots = {name: [DOT_PRECISION.search(line) for line in ir.splitlines() if "tt.dot " in line]
            for name, ir in built["ttir"].items() if name.startswith(("attention", "matmul")) and "delta" not in name}
    # 2 dtypes x (causal, full, varlen) x (fwd, dkdv, dq) and 2 matmuls
    assert len(dots) == 20 and sum(map(len, dots.values())) == 2 * 3 * (2 + 4 + 3) + 2
    for name, found in dots.items():
        precisions = {match.group(1) if match else "ieee" for match in found}
        if "_fp32" in name:
            assert precisions <= {"ieee"}, f"{name}: {precisions}"
        elif "_bf16" in name:  # Triton's default, meaning tensor cores; also shows the pattern sees non-IEEE dots
            assert precisions <= {"tf32"}, f"{name}: {precisions}"


def test_rmsnorm_blocks_fit_in_registers(built: dict) -> None:
    """The widest single block and the chunked loop, each direction, fp32: no spills, and registers within what
    the block's threads may each have (65,536 per SM shared by 32 * num_warps threads, 255 at most)."""
    from lit_lm.kernels.ttir import cases

    all_cases = cases()
    assert sorted(built["ptxas"]) == sorted(PTXAS_CASES)
    for name, usage in built["ptxas"].items():
        warps = all_cases[name].options["num_warps"]
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, f"{name}: {usage}"
        assert warps <= 32 and usage["registers"] <= min(255, 65536 // (32 * warps)), f"{name}: {usage}"
