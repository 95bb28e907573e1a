"""Teaching kernel: row softmax, one row per program, forward and backward.

The row-reduction pattern RMSNorm and cross-entropy build on: the whole row sits in one block (masked past the
end with -inf so padding gets probability 0), the max is subtracted for stability, statistics are fp32.
Backward needs only the output: dx = y * (dy - sum(dy * y)).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lit_lm.kernels.runtime import jit, next_power_of_2

tl: Any = None  # triton.language, bound by `lit_lm.kernels.runtime.jit` at the first launch


def softmax_reference(x: Tensor) -> Tensor:
    return torch.softmax(x.float(), dim=-1).to(x.dtype)


@jit
def _softmax_fwd(x_ptr, y_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(y_ptr + row * n_cols + cols, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=mask)


@jit
def _softmax_bwd(dy_ptr, y_ptr, dx_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dx = y * (dy - tl.sum(dy * y, axis=0))
    tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch.empty_like(x2)
        _softmax_fwd[(x2.shape[0],)](x2, y, x2.shape[1], BLOCK=next_power_of_2(x2.shape[1]))
        ctx.save_for_backward(y)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        dx = torch.empty_like(y)
        _softmax_bwd[(y.shape[0],)](dy.reshape(y.shape).contiguous(), y, dx, y.shape[1],
                                    BLOCK=next_power_of_2(y.shape[1]))
        return dx.view(dy.shape)


def softmax(x: Tensor) -> Tensor:
    """Triton softmax over the last dimension (rows up to a few thousand wide: one block per row)."""
    return SoftmaxFunction.apply(x)
