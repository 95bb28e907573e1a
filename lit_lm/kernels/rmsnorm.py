"""Fused RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, one read of x forward, one read of (x, dy) backward
(rows up to 16384 and 4096 columns; wider rows below).

Forward keeps only 1/rms per row (fp32). Backward recomputes x_hat = x * rstd and, per row,
    dx = rstd * (dy*w - x_hat * mean(dy*w * x_hat)),
while the weight gradient dw = sum_rows(dy * x_hat) is reduced without atomics: a fixed number of persistent
programs each sum their slice of rows into a private fp32 partial row, and the partials are added afterwards.

Wide rows: a row of up to FORWARD_MAX_BLOCK (BACKWARD_MAX_BLOCK) columns sits in registers as one block. A wider
one is walked in column chunks, twice, as Triton's layer-norm tutorial does: a first pass sums the squares
(forward) or dy*w * x (backward), the second normalises; the second read of a row comes from L1/L2, not DRAM.
The backward's partial dw row then no longer fits in registers and is accumulated in memory (read-add-write of
the program's own row: still one writer per element).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lit_lm.kernels.runtime import cdiv, check_backend, jit, launch, next_power_of_2, num_programs, op, use_triton

tl: Any = None  # triton.language, bound by `lit_lm.kernels.runtime.jit` at the first launch

# Register budget. An SM has 65,536 32-bit registers, so a block of 32 * num_warps threads may use at most
# 65536 / (32 * num_warps) per thread (and never more than 255). With ELEMENTS_PER_THREAD columns per thread each
# row-wide fp32 tensor costs 16 registers. The forward holds x and w (+ pointers): 45 registers (fp32 input; 42
# bf16), under the 64 of 32 warps (1024 threads), so a 16384 row is one block. The backward also holds dy and the
# dw partial (and x_hat, dy*w): 170 registers (154 bf16) for a 4096 block over 8 warps (255 allowed), while 8192
# over 16 warps (128 allowed) spilled 56 bytes (bf16), hence its smaller block. Figures from ptxas for sm_90
# (`lit_lm/kernels/ttir.py`); tests/test_kernels_build.py checks there are no spills.
FORWARD_MAX_BLOCK = 16384
BACKWARD_MAX_BLOCK = 4096
ELEMENTS_PER_THREAD = 16


def rmsnorm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The PyTorch definition the kernel must match (statistics in fp32 whatever the input dtype)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def _launch_config(n_cols: int, max_block: int) -> dict[str, Any]:
    """BLOCK columns at a time (the whole row when it fits: ONE_BLOCK) and warps for ELEMENTS_PER_THREAD columns
    per thread (4 to 32 warps, the most a GPU block holds)."""
    block = min(next_power_of_2(n_cols), max_block)
    num_warps = min(max(block // (32 * ELEMENTS_PER_THREAD), 4), 32)
    return dict(BLOCK=block, ONE_BLOCK=n_cols <= block, num_warps=num_warps)


@jit
def _rmsnorm_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = x_ptr + row * n_cols, y_ptr + row * n_cols
    cols = tl.arange(0, BLOCK)
    if ONE_BLOCK:  # the row stays in registers: one read
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    else:  # pass 1: sum of squares, chunk by chunk; pass 2: normalise
        sum_sq = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=0.0).to(tl.float32)
            sum_sq += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=0) / n_cols + eps)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + start + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@jit
def _rmsnorm_bwd(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, n_rows, n_cols, rows_per_program,
                 BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    dw_row = dw_partial_ptr + pid * n_cols  # this program's partial sum of dy * x_hat (zeros from the host)
    first = pid * rows_per_program
    if ONE_BLOCK:  # w, the partial dw and each row in registers
        mask = cols < n_cols
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK,), dtype=tl.float32)
        for row in range(first, tl.minimum(first + rows_per_program, n_rows)):
            x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            x_hat = x * rstd
            dyw = dy * w
            dx = rstd * (dyw - x_hat * (tl.sum(dyw * x_hat, axis=0) / n_cols))
            tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * x_hat
        tl.store(dw_row + cols, dw, mask=mask)
    else:
        for row in range(first, tl.minimum(first + rows_per_program, n_rows)):
            rstd = tl.load(rstd_ptr + row)
            # pass 1: c = mean(dy*w * x_hat) over the whole row
            dot = tl.zeros((BLOCK,), dtype=tl.float32)
            for start in range(0, n_cols, BLOCK):
                mask = start + cols < n_cols
                x = tl.load(x_ptr + row * n_cols + start + cols, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row * n_cols + start + cols, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
                dot += dy * w * x
            c = tl.sum(dot, axis=0) * rstd / n_cols
            # pass 2: dx, and dy * x_hat added to this program's dw row
            for start in range(0, n_cols, BLOCK):
                mask = start + cols < n_cols
                x_hat = tl.load(x_ptr + row * n_cols + start + cols, mask=mask, other=0.0).to(tl.float32) * rstd
                dy = tl.load(dy_ptr + row * n_cols + start + cols, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
                dx = rstd * (dy * w - x_hat * c)
                tl.store(dx_ptr + row * n_cols + start + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
                dw = tl.load(dw_row + start + cols, mask=mask, other=0.0)
                tl.store(dw_row + start + cols, dw + dy * x_hat, mask=mask)


@op("rmsnorm_fwd")
def _forward(x2: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(y, rstd) of x2 (rows, cols), contiguous."""
    n_rows, n_cols = x2.shape
    y = torch.empty_like(x2)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2.device)
    launch(_rmsnorm_fwd, (n_rows,), x2, weight, y, rstd, n_cols, eps, **_launch_config(n_cols, FORWARD_MAX_BLOCK))
    return y, rstd


@op("rmsnorm_bwd")
def _backward(dy2: Tensor, x2: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """(dx, dw) of the forward's x2 given dy2 (rows, cols), contiguous."""
    n_rows, n_cols = x2.shape
    dx = torch.empty_like(x2)
    programs = min(num_programs(x2), n_rows)
    rows_per_program = cdiv(n_rows, programs)
    dw_partial = torch.zeros(programs, n_cols, dtype=torch.float32, device=x2.device)
    launch(_rmsnorm_bwd, (programs,), dy2, x2, weight, rstd, dx, dw_partial, n_rows, n_cols, rows_per_program,
           **_launch_config(n_cols, BACKWARD_MAX_BLOCK))
    return dx, dw_partial.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y, rstd = _forward(x2, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor, None]:
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(dy.reshape(-1, x2.shape[1]).contiguous(), x2, weight, rstd)
        return dx.view(dy.shape), dw, None


def rmsnorm(x: Tensor, weight: Tensor, eps: float = 1e-5) -> Tensor:
    """Triton RMSNorm over the last dimension of x (any leading shape, any hidden size)."""
    return RMSNormFunction.apply(x, weight, eps)


class RMSNorm(nn.Module):
    """Drop-in for `lit_lm.model.RMSNorm`: same `weight` parameter and `eps`, kernel chosen per call."""

    def __init__(self, dim: int, eps: float = 1e-5, backend: str = "auto") -> None:
        super().__init__()
        self.eps = eps
        self.backend = check_backend(backend)
        self.weight = nn.Parameter(torch.ones(dim))

    @classmethod
    def from_reference(cls, ref: nn.Module, backend: str) -> "RMSNorm":
        with torch.device("meta"):  # a placeholder, replaced just below
            module = cls(ref.weight.shape[0], ref.eps, backend)
        module.weight = ref.weight  # the same Parameter: optimizer state and tying survive the swap
        return module

    def forward(self, x: Tensor) -> Tensor:
        if use_triton(self.backend, x):
            return rmsnorm(x, self.weight, self.eps)
        return rmsnorm_reference(x, self.weight, self.eps)
