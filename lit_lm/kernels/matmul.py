"""Teaching kernel: tiled matmul C = A @ B with grouped ("super-grouping") program order for L2 reuse.

Each program computes one BLOCK_M x BLOCK_N tile of C, looping over K in BLOCK_K steps with an fp32 accumulator.
Launched in plain row-major order, consecutive programs would sweep a whole row of C tiles and re-read all of B
from DRAM for every row; grouping GROUP_M rows of tiles together makes the programs in flight share a few
A row-panels and B column-panels, which stay in L2. Backward reuses the same kernel on transposed views:
dA = dC @ B^T, dB = A^T @ dC (strides, not copies).

Indices are int64 before they meet a stride (a (tokens x vocab) product passes 2^31 elements), and fp32 operands
run `tl.dot` at "ieee" precision, not TF32 (`runtime.dot_precision`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lit_lm.kernels.runtime import cdiv, check_grid, dot_precision, jit

tl: Any = None  # triton.language, bound by `lit_lm.kernels.runtime.jit` at the first launch


def matmul_reference(a: Tensor, b: Tensor) -> Tensor:
    return a @ b


@jit
def _matmul(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cast(tl.cdiv(N, BLOCK_N), tl.int64)  # cast: N may be a constexpr
    # Walk the tiles GROUP_M rows at a time, column-major inside a group.
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K).to(tl.int64)  # k0 is int32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=(k[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def _launch_config(dtype: torch.dtype, gpu: bool) -> dict[str, Any]:
    """Tiles of 16 in the interpreter (small tests cross tile edges), 128 x 128 on a GPU; `tl.dot` precision."""
    blocks = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=3) if gpu else \
        dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)
    return dict(blocks, GROUP_M=8, DOT_PRECISION=dot_precision(dtype))


def _grid(m: int, n: int, cfg: dict[str, Any]) -> tuple[int]:
    """One program per C tile, on axis 0 (the kernel orders them itself)."""
    return check_grid((cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]),))


def _mm(a: Tensor, b: Tensor) -> Tensor:
    (m, k), n = a.shape, b.shape[1]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    cfg = _launch_config(a.dtype, a.is_cuda)
    _matmul[_grid(m, n, cfg)](a, b, c, m, n, k, *a.stride(), *b.stride(), *c.stride(), **cfg)
    return c


class MatmulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(a, b)
        return _mm(a, b)

    @staticmethod
    def backward(ctx, dc: Tensor) -> tuple[Tensor, Tensor]:
        a, b = ctx.saved_tensors
        return _mm(dc, b.t()), _mm(a.t(), dc)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Triton (M, K) @ (K, N) for 2-D tensors of one dtype."""
    return MatmulFunction.apply(a, b)
