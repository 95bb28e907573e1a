"""Cross-entropy fused with the z-loss, streaming over the vocabulary in chunks.

Eager `F.cross_entropy(logits.float())` materialises an fp32 copy of the (tokens x vocab) logits and an fp32
gradient of the same size: at vocab 128k that is the largest activation of the step. Here each row is read in
chunks of BLOCK_V with an online logsumexp (running max m and sum s, rescaled when m grows), so only one lse per
row is kept. Backward re-reads the logits chunk by chunk and writes the gradient in the logits' dtype:
    d loss / d x_j = scale * (p_j - [j == target] + 2 * z_loss * lse * p_j),   p_j = exp(x_j - lse),
with scale = grad_output / (number of non-ignored targets), and 0 on ignored rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_lm.kernels.runtime import check_backend, jit, next_power_of_2, use_triton

tl: Any = None  # triton.language, bound by `lit_lm.kernels.runtime.jit` at the first launch

IGNORE_INDEX = -100
MAX_BLOCK_V = 4096


def cross_entropy_reference(logits: Tensor, targets: Tensor, z_loss: float) -> tuple[Tensor, Tensor]:
    """(ce + z_loss * mean(lse^2), ce) in fp32 over non-ignored targets, as `lit_lm.model.LMLoss`."""
    logits = logits.reshape(-1, logits.shape[-1]).float()
    targets = targets.reshape(-1)
    ce = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)
    if z_loss == 0.0:
        return ce, ce.detach()
    valid = targets != IGNORE_INDEX  # masked, not indexed: `logits[valid]` is a host sync on an accelerator
    lse = torch.logsumexp(logits, dim=-1).masked_fill(~valid, 0.0)
    return ce + z_loss * lse.pow(2).sum() / valid.sum(), ce.detach()


@jit
def _ce_fwd(x_ptr, targets_ptr, lse_ptr, ce_ptr, n_cols, stride_row, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_row
    target = tl.load(targets_ptr + row)
    m = -float("inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    tl.store(lse_ptr + row, lse)
    valid = target != ignore_index
    x_target = tl.load(x_row + target, mask=valid, other=0.0).to(tl.float32)
    tl.store(ce_ptr + row, tl.where(valid, lse - x_target, 0.0))


@jit
def _ce_bwd(x_ptr, targets_ptr, lse_ptr, scale_ptr, dx_ptr, n_cols, stride_row, ignore_index, z_loss,
            BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row)
    lse = tl.load(lse_ptr + row)
    scale = tl.where(target != ignore_index, tl.load(scale_ptr), 0.0)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        dx = scale * (p * (1.0 + 2.0 * z_loss * lse) - tl.where(cols == target, 1.0, 0.0))
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, z_loss: float, block_v: int) -> tuple[Tensor, Tensor]:
        shape = logits.shape
        x = logits.reshape(-1, shape[-1])
        if x.stride(-1) != 1:
            x = x.contiguous()
        targets = targets.reshape(-1).contiguous()
        n_rows, n_cols = x.shape
        lse = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        ce_rows = torch.empty_like(lse)
        _ce_fwd[(n_rows,)](x, targets, lse, ce_rows, n_cols, x.stride(0), IGNORE_INDEX, BLOCK_V=block_v)
        valid = targets != IGNORE_INDEX
        n_valid = valid.sum()
        ce = ce_rows.sum() / n_valid
        loss = ce + z_loss * (lse.pow(2) * valid).sum() / n_valid  # a new tensor even at z_loss 0: ce is detached
        ctx.save_for_backward(x, targets, lse, n_valid)
        ctx.z_loss, ctx.block_v, ctx.shape = z_loss, block_v, shape
        ctx.mark_non_differentiable(ce)
        return loss, ce

    @staticmethod
    def backward(ctx, dloss: Tensor, _dce: Tensor) -> tuple[Tensor, None, None, None]:
        x, targets, lse, n_valid = ctx.saved_tensors
        scale = (dloss.float() / n_valid).reshape(1)  # stays on the device: no host sync
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _ce_bwd[(x.shape[0],)](x, targets, lse, scale, dx, x.shape[1], x.stride(0), IGNORE_INDEX, ctx.z_loss,
                               BLOCK_V=ctx.block_v)
        return dx.view(ctx.shape), None, None, None


def cross_entropy(logits: Tensor, targets: Tensor, z_loss: float = 0.0,
                  block_v: int | None = None) -> tuple[Tensor, Tensor]:
    """Triton (loss, detached ce) for logits (..., V) and targets (...); `block_v` is the vocab chunk (pow2)."""
    block_v = block_v or min(next_power_of_2(logits.shape[-1]), MAX_BLOCK_V)
    return CrossEntropyFunction.apply(logits, targets, z_loss, block_v)


class LMLoss(nn.Module):
    """Drop-in for `lit_lm.model.LMLoss`: forward(logits, targets) -> (loss, ce.detach()), same `z_loss`."""

    def __init__(self, z_loss: float = 0.0, backend: str = "auto") -> None:
        super().__init__()
        self.z_loss = z_loss
        self.backend = check_backend(backend)

    @classmethod
    def from_reference(cls, ref: nn.Module, backend: str) -> "LMLoss":
        return cls(ref.z_loss, backend)

    def forward(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        if use_triton(self.backend, logits):
            return cross_entropy(logits, targets, self.z_loss)
        return cross_entropy_reference(logits, targets, self.z_loss)
