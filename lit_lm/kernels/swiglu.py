"""Fused SwiGLU activation h = silu(g) * u between the gate/up and down projections.

Eager PyTorch writes silu(g) to memory and reads it back for the product (and again in backward); the fused kernel
reads g and u once and writes h once. Backward recomputes sigmoid(g) instead of saving it:
    du = dh * silu(g),   dg = dh * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_lm.kernels.runtime import cdiv, check_backend, jit, launch, op, use_triton

tl: Any = None  # triton.language, bound by `lit_lm.kernels.runtime.jit` at the first launch

BLOCK = 1024


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


@jit
def _swiglu_fwd(g_ptr, u_ptr, h_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)


@jit
def _swiglu_bwd(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    tl.store(du_ptr + offs, (dh * g * sig).to(du_ptr.dtype.element_ty), mask=mask)
    tl.store(dg_ptr + offs, (dh * u * sig * (1.0 + g * (1.0 - sig))).to(dg_ptr.dtype.element_ty), mask=mask)


@op("swiglu_fwd")
def _forward(gate: Tensor, up: Tensor) -> Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    h = torch.empty_like(gate)
    launch(_swiglu_fwd, (cdiv(h.numel(), BLOCK),), gate, up, h, h.numel(), BLOCK=BLOCK)
    return h


@op("swiglu_bwd")
def _backward(dh: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    dh = dh.contiguous()
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    launch(_swiglu_bwd, (cdiv(dh.numel(), BLOCK),), dh, gate, up, dg, du, dh.numel(), BLOCK=BLOCK)
    return dg, du


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return _forward(gate, up)

    @staticmethod
    def backward(ctx, dh: Tensor) -> tuple[Tensor, Tensor]:
        gate, up = ctx.saved_tensors
        return _backward(dh, gate, up)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """Triton silu(gate) * up (same shapes, any size)."""
    return SwiGLUFunction.apply(gate, up)


class SwiGLU(nn.Module):
    """Drop-in for `lit_lm.model.SwiGLU`: the same `w_gate`, `w_up`, `w_down` linears, fused activation between."""

    def __init__(self, d_model: int, d_ff: int, backend: str = "auto") -> None:
        super().__init__()
        self.backend = check_backend(backend)
        self.w_gate = nn.Linear(d_model, d_ff, bias=False)
        self.w_up = nn.Linear(d_model, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d_model, bias=False)

    @classmethod
    def from_reference(cls, ref: nn.Module, backend: str) -> "SwiGLU":
        with torch.device("meta"):  # placeholders, replaced just below
            module = cls(ref.w_gate.in_features, ref.w_gate.out_features, backend)
        module.w_gate, module.w_up, module.w_down = ref.w_gate, ref.w_up, ref.w_down  # the same Linear modules
        return module

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w_gate(x), self.w_up(x)
        h = swiglu(gate, up) if use_triton(self.backend, gate) else swiglu_reference(gate, up)
        return self.w_down(h)
