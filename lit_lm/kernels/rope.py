"""Rotary position embedding (rotate-half convention) for q and k of shape (B, T, H, D), in one pass each.

Position t rotates the pair (x_i, x_{i+D/2}) by angle t * theta^(-2i/D). A rotation is orthogonal, so the
backward is the same kernel rotating the output gradient by the opposite angle (sin -> -sin): nothing but the
cos/sin tables is saved. Token (b, t) takes table row t, or with per-row positions (B, T) (packed documents'
`position_reset`, `lit_lm.data.packing`) row positions[b, t], read by the kernel: no gathered tables in memory.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from lit_lm.kernels.runtime import check_backend, jit, launch, next_power_of_2, op, use_triton

tl: Any = None  # triton.language, bound by `lit_lm.kernels.runtime.jit` at the first launch


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, T, H, D) with cos/sin tables (T, D/2) or per row (B, T, D/2), computing in fp32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


@jit
def _rope(x_ptr, cos_ptr, sin_ptr, pos_ptr, y_ptr, seq_len, n_heads, half,
          INVERSE: tl.constexpr, POSITIONS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one (batch, position) row: all heads at once; int64 before any product
    if POSITIONS:
        t = tl.load(pos_ptr + row).to(tl.int64)  # this token's table row
    else:
        t = row % seq_len
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < n_heads) & (cols < half)
    cos = tl.load(cos_ptr + t * half + cols, mask=cols < half, other=0.0)
    sin = tl.load(sin_ptr + t * half + cols, mask=cols < half, other=0.0)
    if INVERSE:
        sin = -sin
    offs = (row * n_heads + heads) * 2 * half + cols
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (x1 * cos - x2 * sin).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + offs + half, (x1 * sin + x2 * cos).to(y_ptr.dtype.element_ty), mask=mask)


@op("rope")
def _rotate(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool, positions: Optional[Tensor] = None) -> Tensor:
    x = x.contiguous()
    b, t, h, d = x.shape
    y = torch.empty_like(x)
    launch(_rope, (b * t,), x, cos, sin, x if positions is None else positions, y, t, h, d // 2, INVERSE=inverse,
           POSITIONS=positions is not None, BLOCK_H=next_power_of_2(h), BLOCK_D=next_power_of_2(d // 2))
    return y


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Optional[Tensor]
                ) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(cos, sin, positions)
        return _rotate(q, cos, sin, False, positions), _rotate(k, cos, sin, False, positions)

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor) -> tuple[Optional[Tensor], ...]:
        cos, sin, positions = ctx.saved_tensors
        return _rotate(dq, cos, sin, True, positions), _rotate(dk, cos, sin, True, positions), None, None, None


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Optional[Tensor] = None
         ) -> tuple[Tensor, Tensor]:
    """Triton rotation of q (B, T, Hq, D) and k (B, T, Hkv, D) by fp32 tables cos, sin (L, D/2): token t by row t
    (L = T), or with `positions` (B, T) (integers in [0, L)) token (b, t) by row positions[b, t]."""
    if positions is not None:
        positions = positions.long().contiguous()
    return RoPEFunction.apply(q, k, cos.contiguous(), sin.contiguous(), positions)


class RotaryEmbedding(nn.Module):
    """Drop-in for `lit_lm.model.RotaryEmbedding`: no parameters, the same tables, `rope(q, k)` interface."""

    def __init__(self, head_dim: int, theta: float = 10000.0, backend: str = "auto") -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
        self.backend = check_backend(backend)
        self._cache: dict[tuple[int, int, torch.device], tuple[Tensor, Tensor]] = {}
        self._at: Optional[tuple[Tensor, torch.device, tuple[Tensor, Tensor]]] = None  # see cos_sin_at
        self._freq_at: Optional[tuple[torch.device, Tensor, Tensor]] = None  # (device, inv_freq, its copy there)

    @classmethod
    def from_reference(cls, ref: nn.Module, backend: str) -> "RotaryEmbedding":
        if getattr(ref, "attention_factor", 1.0) != 1.0:
            raise ValueError("the rope kernel does not scale cos/sin by YaRN's attention factor: leave `rope` out of "
                             "the kernels (model.init_args.kernels) for a YaRN model")
        rope = cls(ref.head_dim, ref.theta, backend)
        rope.inv_freq = ref.inv_freq  # the reference's frequencies, Llama 3's scaling included
        return rope

    def cos_sin(self, seq_len: int, device: torch.device, offset: int = 0) -> tuple[Tensor, Tensor]:
        """fp32 (T, D/2) tables for positions offset..offset+T-1, built in fp64 and cached per device (in a compiled
        graph: computed there, as `lit_lm.model.RotaryEmbedding` does; a lookup that fills the cache recompiles)."""
        if torch.compiler.is_compiling():
            return self.tables(torch.arange(offset, offset + seq_len), device)
        key = (seq_len, offset, device)
        if key not in self._cache:
            self._cache[key] = self.cos_sin_at(torch.arange(offset, offset + seq_len), device)
        return self._cache[key]

    def cos_sin_at(self, positions: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
        """The tables for arbitrary token positions (T,) (a context-parallel rank's chunks), as `cos_sin`; the
        last ones kept against the positions tensor itself, as `lit_lm.model.RotaryEmbedding.cos_sin_at` does."""
        if torch.compiler.is_compiling():
            return self.tables(positions, device)
        if self._at is not None and self._at[0] is positions and self._at[1] == device:
            return self._at[2]
        tables = self.tables(positions, device)
        self._at = (positions, device, tables)
        return tables

    def tables(self, positions: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
        """Built where the positions are (cp's balanced split hands new ones every step: never read to the host)."""
        angles = torch.outer(positions.to(torch.float64), self._freq(positions.device))
        return angles.cos().float().to(device), angles.sin().float().to(device)

    def _freq(self, at: torch.device) -> Tensor:
        """inv_freq on `at`, copied there once per device (a copy each call would wait on the accelerator); in a
        compiled graph a constant of the graph, not a cache entry (one filled there would recompile at step 2)."""
        if torch.compiler.is_compiling():
            return self.inv_freq.to(at)
        if self._freq_at is None or self._freq_at[0] != at or self._freq_at[1] is not self.inv_freq:
            self._freq_at = (at, self.inv_freq, self.inv_freq.to(at))
        return self._freq_at[2]

    def forward(self, q: Tensor, k: Tensor, positions: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """`positions` as `lit_lm.model.RotaryEmbedding` takes them: None (0..T-1), (T,) any positions, or (B, T)
        per row (packed documents restarting at 0; under cp a rank's share, reaching the whole row's length): a
        table row per token made on the device (`row_tables`), token (b, t) reading row b·T + t in the kernel."""
        rows = positions if positions is not None and positions.ndim == 2 else None
        if rows is not None:
            cos, sin = self.row_tables(rows)
        elif positions is None:
            cos, sin = self.cos_sin(q.shape[1], q.device)
        else:
            cos, sin = self.cos_sin_at(positions, q.device)
        if use_triton(self.backend, q):
            if rows is not None:
                cos, sin = cos.flatten(0, 1), sin.flatten(0, 1)
                rows = torch.arange(cos.shape[0], device=q.device).view(q.shape[:2])
            return rope(q, k, cos, sin, rows)
        return rope_reference(q, cos, sin), rope_reference(k, cos, sin)

    def row_tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """As `lit_lm.model.RotaryEmbedding.row_tables`: fp32 (B, T, D/2), in fp64 on the positions' device."""
        angles = positions.to(torch.float64).unsqueeze(-1) * self._freq(positions.device)
        return angles.cos().float(), angles.sin().float()
