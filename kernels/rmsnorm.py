"""Fused RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, one read of x forward, one read of (x, dy) backward.

Forward keeps only 1/rms per row (fp32). Backward recomputes x_hat = x * rstd and, per row,
    dx = rstd * (dy*w - x_hat * mean(dy*w * x_hat)),
while the weight gradient dw = sum_rows(dy * x_hat) is reduced without atomics: a fixed number of persistent
programs each sum their slice of rows into a private fp32 partial row, and the partials are added afterwards.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from kernels.runtime import cdiv, check_backend, jit, next_power_of_2, num_programs, use_triton

tl: Any = None  # triton.language, bound by `kernels.runtime.jit` at the first launch


def rmsnorm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The PyTorch definition the kernel must match (statistics in fp32 whatever the input dtype)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


@jit
def _rmsnorm_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * n_cols + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@jit
def _rmsnorm_bwd(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, n_rows, n_cols, rows_per_program,
                 BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    first = pid * rows_per_program
    offs = first.to(tl.int64) * n_cols + cols  # int64: rows * cols may exceed 2^31
    for row in range(first, tl.minimum(first + rows_per_program, n_rows)):
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        dyw = dy * w
        dx = rstd * (dyw - x_hat * (tl.sum(dyw * x_hat, axis=0) / n_cols))
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        offs += n_cols
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=mask)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        n_rows, n_cols = x2.shape
        y = torch.empty_like(x2)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block = next_power_of_2(n_cols)
        _rmsnorm_fwd[(n_rows,)](x2, weight, y, rstd, n_cols, eps, BLOCK=block)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor, None]:
        x2, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy2 = dy.reshape(-1, n_cols).contiguous()
        dx = torch.empty_like(x2)
        programs = min(num_programs(x2), n_rows)
        rows_per_program = cdiv(n_rows, programs)
        dw_partial = torch.empty(programs, n_cols, dtype=torch.float32, device=x2.device)
        _rmsnorm_bwd[(programs,)](dy2, x2, weight, rstd, dx, dw_partial, n_rows, n_cols, rows_per_program,
                                  BLOCK=next_power_of_2(n_cols))
        return dx.view(dy.shape), dw_partial.sum(0).to(weight.dtype), None


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
