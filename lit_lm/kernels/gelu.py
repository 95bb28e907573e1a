"""Teaching kernel: fused GeLU, tanh approximation (GPT-2), forward and backward in one pass each.

    gelu(x) = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
    gelu'(x) = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)

The elementwise pattern every fused activation follows: one program per BLOCK elements, masked tail, fp32 math,
result stored in the input dtype; backward recomputes tanh(u) from x instead of saving it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_lm.kernels.runtime import cdiv, jit

tl: Any = None  # triton.language, bound by `lit_lm.kernels.runtime.jit` at the first launch

BLOCK = 1024


def gelu_reference(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


@jit
def _gelu_fwd(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # sqrt(2/pi) = 0.79788...
    tanh_u = 2.0 * tl.sigmoid(2.0 * u) - 1.0  # tanh(u) = 2 sigmoid(2u) - 1
    tl.store(y_ptr + offs, (0.5 * x * (1.0 + tanh_u)).to(y_ptr.dtype.element_ty), mask=mask)


@jit
def _gelu_bwd(dy_ptr, x_ptr, dx_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tanh_u = 2.0 * tl.sigmoid(2.0 * 0.7978845608028654 * (x + 0.044715 * x * x * x)) - 1.0
    du_dx = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    dx = dy * (0.5 * (1.0 + tanh_u) + 0.5 * x * (1.0 - tanh_u * tanh_u) * du_dx)
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


class GeLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        x = x.contiguous()
        y = torch.empty_like(x)
        _gelu_fwd[(cdiv(x.numel(), BLOCK),)](x, y, x.numel(), BLOCK=BLOCK)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        dx = torch.empty_like(x)
        _gelu_bwd[(cdiv(x.numel(), BLOCK),)](dy.contiguous(), x, dx, x.numel(), BLOCK=BLOCK)
        return dx


def gelu(x: Tensor) -> Tensor:
    """Triton tanh-approximate GeLU of a tensor of any shape."""
    return GeLUFunction.apply(x)
