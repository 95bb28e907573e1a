"""What every kernel file shares: a deferred `triton.jit`, the backend choice, and launch-size helpers.

Triton is imported only when a kernel is first launched, for two reasons: `import kernels` must work where Triton
is absent (it is Linux-only), and Triton fixes interpreter-or-compiler when it decorates a function (its own
`triton.language` helpers included, at `import triton`), so importing it before a test sets TRITON_INTERPRET=1
would silently compile instead of interpret. Kernel files therefore declare `tl = None` and let `jit` bind it.
Kernel bodies may use only arguments, literals and `tl` (Triton rejects non-constexpr globals when compiling).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable

import torch

BACKENDS = ("auto", "triton", "reference")


class jit:
    """`@jit` = `@triton.jit`, applied on first launch: `kernel[grid](...)` works as with Triton's decorator.

    The first launch also binds the kernel module's global `tl` to `triton.language`. Kernel bodies must not call
    other `@jit` functions (Triton would see this wrapper, not a JITFunction).
    """

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    @functools.cached_property
    def compiled(self) -> Any:
        import triton
        import triton.language

        self.fn.__globals__["tl"] = triton.language
        return triton.jit(self.fn)

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return self.compiled[grid]


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    return backend


def interpreting() -> bool:
    """Whether kernels can run on CPU tensors: TRITON_INTERPRET=1, and set before triton was first imported
    (`import lightning` imports it)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    language = sys.modules.get("triton.language")
    return language is None or type(language.sum).__name__ == "InterpretedFunction"


def use_triton(backend: str, x: torch.Tensor) -> bool:
    """The per-call choice of a drop-in module: "auto" runs Triton on CUDA tensors, and on CPU tensors when the
    interpreter is active (so `TRITON_INTERPRET=1 lit-lm fit ...` exercises the kernels without a GPU);
    "triton" always runs it."""
    if backend == "reference" or (backend == "auto" and not (x.is_cuda or interpreting())):
        return False
    if not x.is_cuda and not interpreting():
        raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is first "
                           "imported (lightning imports it)")
    return True


# CUDA's grid limits: 2^31 - 1 programs on axis 0, 65,535 on axes 1 and 2. A large product (batch x heads) therefore
# goes on axis 0; every launch in kernels/ uses a 1-D grid.
MAX_GRID = (2**31 - 1, 65_535, 65_535)


def check_grid(grid: tuple[int, ...]) -> tuple[int, ...]:
    """`grid`, or a ValueError if an axis is outside CUDA's limits (a GPU would refuse the launch)."""
    if not 1 <= len(grid) <= 3 or any(not 0 < n <= limit for n, limit in zip(grid, MAX_GRID)):
        raise ValueError(f"grid {grid} is outside CUDA's limits {MAX_GRID}")
    return grid


def dot_precision(dtype: torch.dtype) -> str:
    """`input_precision` of `tl.dot` for operands of `dtype`: "ieee" for fp32, since Triton's default ("tf32")
    rounds fp32 operands to 10 mantissa bits on Ampere and later, 1e-3 relative error, and the fp32 path is the one
    that must match PyTorch to 1e-5; 16-bit operands run on tensor cores either way ("tf32" is ignored for them)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def num_programs(x: torch.Tensor) -> int:
    """How many persistent programs a reduction launches: one per SM on a GPU, a few in the interpreter."""
    if x.is_cuda:
        return torch.cuda.get_device_properties(x.device).multi_processor_count
    return 4
