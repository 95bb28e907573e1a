"""What every kernel file shares: a deferred `triton.jit`, the backend choice, and launch-size helpers.

Triton is imported only when a kernel is first launched, for two reasons: `import kernels` must work where Triton
is absent (it is Linux-only), and Triton fixes interpreter-or-compiler when it decorates a function (its own
`triton.language` helpers included, at `import triton`), so importing it before a test sets TRITON_INTERPRET=1
would silently compile instead of interpret. Kernel files therefore declare `tl = None` and let `jit` bind it.
Kernel bodies may use only arguments, literals and `tl` (Triton rejects non-constexpr globals when compiling).
"""

from __future__ import annotations

import functools
import importlib.util
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


def launch(kernel: jit, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`kernel[grid](*args, **kwargs)` inside an `op`'s function: through `torch.library.wrap_triton`, so that
    AOTAutograd records the launch for inductor when the op is a `triton_op`; nothing on fake tensors (the op's
    shapes traced under the interpreter, where `op` registers the function as its own fake)."""
    if any(isinstance(a, torch._subclasses.FakeTensor) for a in args):
        return
    torch.library.wrap_triton(kernel.compiled)[grid](*args, **kwargs)


NAMESPACE = "lit_lm"


class Op:
    """A launcher (tensors and numbers in, new tensors out, its kernels started with `launch`) as the operator
    `lit_lm::<name>`, so that `torch.compile` sees one opaque call with fixed-shape tensors instead of tracing
    Triton's launch code (under the interpreter dynamo followed it into Triton's frames and guarded on each kernel's
    argument count and block sizes: 47 graphs for one block, and more in step 2):
    - Triton compiled (a GPU): `torch.library.triton_op`, as torch documents for user-defined kernels: AOTAutograd
      decomposes it into its `wrap_triton` launches, which inductor runs from its generated code;
    - under the interpreter (TRITON_INTERPRET=1, the kernels on CPU), or without Triton: `torch.library.custom_op`,
      opaque to inductor too (an interpreted launch is numpy), with the launcher as its fake (`launch` skips fake
      tensors, so the fake allocates the outputs and nothing else).
    Registered at the first call, or by `register_ops` (`kernels.apply`: before any compile traces a block), not at
    import: `triton_op` imports Triton, which decides interpreter-or-compiler then (see the module docstring)."""

    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self.name, self.fn = name, fn
        self.registered: Any = None
        functools.update_wrapper(self, fn)
        OPS.append(self)

    def register(self) -> Any:
        if self.registered is None:
            qualname = f"{NAMESPACE}::{self.name}"
            if interpreting() or importlib.util.find_spec("triton") is None:
                self.registered = torch.library.custom_op(qualname, self.fn, mutates_args=())
                self.registered.register_fake(self.fn)
            else:
                self.registered = torch.library.triton_op(qualname, self.fn, mutates_args=())
        return self.registered

    def __call__(self, *args: Any) -> Any:
        return (self.registered or self.register())(*args)


OPS: list[Op] = []


def op(name: str) -> Callable[[Callable[..., Any]], Op]:
    """`@op("rmsnorm_fwd")` over a launcher: `Op(name, launcher)`."""
    return functools.partial(Op, name)


def register_ops() -> None:
    """Registers every kernel file's `Op` (each once)."""
    for each in OPS:
        each.register()


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
# goes on axis 0; every launch in lit_lm/kernels/ uses a 1-D grid.
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
