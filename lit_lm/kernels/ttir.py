"""Build every kernel for a GPU on a machine without one: what the interpreter cannot show about compiled code.

Triton's interpreter runs kernels through numpy, so it says nothing about the code a GPU would run: how wide each
offset product is, which precision `tl.dot` asks for, how many registers a block needs. Triton's front end and
NVIDIA back end (LLVM, and the `ptxas` its wheel ships) need no GPU, so each kernel is built here at its GPU launch
configuration for an H100/H200 (sm_90) and the results are read:
  - `ttir(case)`: the Triton IR after Triton's own simplification passes (`tt.dot ... inputPrecision`, the
    `arith.muli` of each offset with its integer type);
  - `ptxas_usage(case)`: registers per thread and spilled bytes, from `ptxas -v` on the PTX (a full build).

Run as a script (`python -m lit_lm.kernels.ttir`, TRITON_INTERPRET unset: the interpreter replaces the compiler at
`import triton`) it prints {case name: TTIR} as JSON; `--ptxas NAME...` adds those cases' register usage.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

from lit_lm.kernels import attention, cross_entropy, gelu, matmul, rmsnorm, rope, softmax, swiglu

TARGET = ("cuda", 90, 32)  # H100/H200: compute capability 9.0, warps of 32 threads
FLOAT_ARGS = {"eps", "qk_scale", "scale", "z_loss"}
POINTER_DTYPES = {  # pointer arguments whose dtype does not follow the case's
    "lse_ptr": "fp32", "delta_ptr": "fp32", "rstd_ptr": "fp32", "dw_partial_ptr": "fp32", "scale_ptr": "fp32",
    "cos_ptr": "fp32", "sin_ptr": "fp32", "targets_ptr": "i64", "pos_ptr": "i64",
    "qdoc_ptr": "i64", "qlo_ptr": "i64", "kdoc_ptr": "i64", "khi_ptr": "i64",  # packed documents (varlen)
}
TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class Case:
    """One kernel at one launch configuration: constexprs and launch options as its host code passes them."""

    kernel: Any  # a `lit_lm.kernels.runtime.jit`
    dtype: torch.dtype
    constexprs: dict[str, Any]
    options: dict[str, int] = field(default_factory=dict)

    def signature(self) -> dict[str, str]:
        """Triton types of the arguments: pointers to the case's dtype, fp32 scalars, int32 sizes and strides
        (what Triton infers at a launch with values under 2^31; constexprs by name)."""
        types = {}
        for name in inspect.signature(self.kernel.fn).parameters:
            if name in self.constexprs:
                types[name] = "constexpr"
            elif name.endswith("_ptr"):
                types[name] = "*" + POINTER_DTYPES.get(name, TRITON_DTYPES[self.dtype])
            else:
                types[name] = "fp32" if name in FLOAT_ARGS else "i32"
        return types


def _attention_cases() -> dict[str, Case]:
    cases = {}
    for dtype in (torch.float32, torch.bfloat16):
        cfg = attention._launch_config(128, dtype, gpu=True)
        options = {k: cfg.pop(k) for k in ("num_warps", "num_stages")}
        tag = TRITON_DTYPES[dtype]
        for mask, causal, documents in (("causal", True, False), ("full", False, False), ("varlen", True, True)):
            for name in ("fwd", "bwd_dkdv", "bwd_dq"):
                cases[f"attention_{name}_{tag}_{mask}"] = Case(
                    getattr(attention, f"_attn_{name}"), dtype, dict(cfg, CAUSAL=causal, DOCUMENTS=documents), options)
        cases[f"attention_bwd_delta_{tag}"] = Case(attention._attn_bwd_delta, dtype,
                                                   dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_D=cfg["BLOCK_D"]), options)
    return cases


def _matmul_cases() -> dict[str, Case]:
    cases = {}
    for dtype in (torch.float32, torch.bfloat16):
        cfg = matmul._launch_config(dtype, gpu=True)
        options = {k: cfg.pop(k) for k in ("num_warps", "num_stages")}
        cases[f"matmul_{TRITON_DTYPES[dtype]}"] = Case(matmul._matmul, dtype, cfg, options)
    return cases


def _rmsnorm_cases() -> dict[str, Case]:
    """The widest single block and the chunked loop of each direction, in fp32 (the most registers)."""
    cases = {}
    for name, max_block in (("fwd", rmsnorm.FORWARD_MAX_BLOCK), ("bwd", rmsnorm.BACKWARD_MAX_BLOCK)):
        for d in (max_block, 2 * max_block):
            cfg = rmsnorm._launch_config(d, max_block)
            options = {"num_warps": cfg.pop("num_warps")}
            cases[f"rmsnorm_{name}_{d}"] = Case(getattr(rmsnorm, f"_rmsnorm_{name}"), torch.float32, cfg, options)
    return cases


def cases() -> dict[str, Case]:
    """Every kernel in lit_lm/kernels/ at the configuration its host code launches on a GPU."""
    bf16 = torch.bfloat16
    return {
        **_attention_cases(), **_matmul_cases(), **_rmsnorm_cases(),
        "cross_entropy_fwd": Case(cross_entropy._ce_fwd, bf16, dict(BLOCK_V=cross_entropy.MAX_BLOCK_V)),
        "cross_entropy_bwd": Case(cross_entropy._ce_bwd, bf16, dict(BLOCK_V=cross_entropy.MAX_BLOCK_V)),
        "rope": Case(rope._rope, bf16, dict(INVERSE=False, POSITIONS=False, BLOCK_H=32, BLOCK_D=64)),
        "rope_positions": Case(rope._rope, bf16, dict(INVERSE=False, POSITIONS=True, BLOCK_H=32, BLOCK_D=64)),
        "swiglu_fwd": Case(swiglu._swiglu_fwd, bf16, dict(BLOCK=swiglu.BLOCK)),
        "swiglu_bwd": Case(swiglu._swiglu_bwd, bf16, dict(BLOCK=swiglu.BLOCK)),
        "gelu_fwd": Case(gelu._gelu_fwd, bf16, dict(BLOCK=gelu.BLOCK)),
        "gelu_bwd": Case(gelu._gelu_bwd, bf16, dict(BLOCK=gelu.BLOCK)),
        "softmax_fwd": Case(softmax._softmax_fwd, bf16, dict(BLOCK=4096)),
        "softmax_bwd": Case(softmax._softmax_bwd, bf16, dict(BLOCK=4096)),
    }


def _source(case: Case) -> Any:
    from triton.compiler import ASTSource

    params = list(inspect.signature(case.kernel.fn).parameters)
    constexprs = {(params.index(name),): value for name, value in case.constexprs.items()}
    return ASTSource(case.kernel.compiled, case.signature(), constexprs=constexprs)


def ttir(case: Case) -> str:
    """The kernel's Triton IR for TARGET after Triton's TTIR passes (inlining, canonicalisation), as text.
    Uses the stages `triton.compile` runs, stopping after the first: a full build of the fp32 attention takes
    ~20 s."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    target = GPUTarget(*TARGET)
    backend = make_backend(target)
    options = backend.parse_options(case.options)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = _source(case)
    module = source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                            context)
    stages: dict[str, Any] = {}
    backend.add_stages(stages, options, source.language)
    return str(stages["ttir"](module, {"target": target, **options.__dict__}))


def ptxas_usage(case: Case) -> dict[str, int]:
    """{"registers", "spill_stores", "spill_loads"} per thread of the full build, from `ptxas -v`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    ptx = triton.compile(_source(case), target=GPUTarget(*TARGET), options=case.options).asm["ptx"]
    arch = re.search(r"^\.target (\w+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        command = [get_ptxas(TARGET[1]).path, "-v", f"--gpu-name={arch}", path, "-o", os.path.join(tmp, "k.o")]
        log = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    return {key: int(re.search(pattern, log).group(1)) for key, pattern in [
        ("registers", r"Used (\d+) registers"), ("spill_stores", r"(\d+) bytes spill stores"),
        ("spill_loads", r"(\d+) bytes spill loads")]}


def main(argv: list[str]) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces Triton's compiler")
    all_cases = cases()
    out: dict[str, Any] = {"ttir": {name: ttir(case) for name, case in all_cases.items()}}
    if "--ptxas" in argv:
        out["ptxas"] = {name: ptxas_usage(all_cases[name]) for name in argv[argv.index("--ptxas") + 1:]}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
