"""Muon's Newton-Schulz iteration, once, in a chosen dtype, over a batch of matrices whose norm and Gram matrix may
be sums over ranks.

For a matrix G (m x n), X = G / ||G||_F, transposed first when m > n so that X is the short-and-wide one; then
`steps` times, with the quintic coefficients (a, b, c):

    A = X X^T             the Gram matrix (m x m, m <= n)
    B = b A + c A A       torch.addmm(A, A, A, beta=b, alpha=c)
    X = a X + B X         torch.addmm(X, B, X, beta=a)

and the result is X (transposed back). In bfloat16 (`dtype` torch.bfloat16) these are torch's own ops in torch's
order (`torch.optim._muon._zeropower_via_newtonschulz`), so a whole matrix gets torch's result bit for bit
(tests/test_muon.py); in float32 the same iteration, coefficients and eps, computed in fp32.

`iterate` takes the norms and the Gram matrices as functions of the batch: on one rank, ||X|| and X X^T of each
whole matrix. For X cut along its columns over a group, X = [X_1 ... X_p], both are sums over the parts,

    ||X||^2 = sum_i ||X_i||^2,        X X^T = sum_i X_i X_i^T,

and B X_i is the i-th part of B X: with the sums all-reduced, every rank iterates its own X_i and ends with its part
of NS(X), nothing else moved (tp's Gram mode, `lit_lm.strategies.orthogonalize`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

Sums = Callable[[list[Tensor]], list[Tensor]]  # a batch of X (NS orientation, `dtype`) -> one tensor each


def local_norms(xs: list[Tensor]) -> list[Tensor]:
    return [x.norm() for x in xs]


def local_grams(xs: list[Tensor]) -> list[Tensor]:
    return [x @ x.T for x in xs]


@dataclass(frozen=True)
class NewtonSchulz:
    """`steps` Newton-Schulz steps with `coefficients` (a, b, c), the norm clamped at `eps`, computed in `dtype`."""

    coefficients: tuple[float, float, float]
    steps: int
    eps: float
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.steps >= 100 or len(self.coefficients) != 3:
            raise ValueError(f"Newton-Schulz takes 3 coefficients and fewer than 100 steps; got "
                             f"{self.coefficients}, {self.steps}")
        if self.dtype not in DTYPES.values():
            raise ValueError(f"Newton-Schulz in {self.dtype}: choose one of {', '.join(DTYPES)}")

    @staticmethod
    def transposed(shape: tuple[int, ...]) -> bool:
        """Whether NS works on the transpose of a matrix of (global) `shape`: it iterates on the short-and-wide one."""
        return shape[-2] > shape[-1]

    def __call__(self, matrix: Tensor) -> Tensor:
        """NS of one whole 2-D matrix, in `dtype` (torch's `_zeropower_via_newtonschulz` when bfloat16)."""
        if matrix.ndim != 2:
            raise ValueError(f"Newton-Schulz takes a 2-D matrix; got shape {tuple(matrix.shape)}")
        x = matrix.to(self.dtype)
        flip = self.transposed(matrix.shape)
        (x,) = self.iterate([x.T if flip else x])
        return x.T if flip else x

    def iterate(self, xs: list[Tensor], norms: Sums = local_norms, grams: Sums = local_grams) -> list[Tensor]:
        """The iteration on a batch of X (each in `dtype`, already in NS orientation: a part of rows <= cols), every
        matrix's step k before any step k + 1 (so a distributed `grams` can sum the whole batch at once). The
        inputs are not written to."""
        a, b, c = self.coefficients
        xs = [x / n.clamp(min=self.eps) for x, n in zip(xs, norms(xs))]
        for _ in range(self.steps):
            xs = [torch.addmm(x, torch.addmm(g, g, g, beta=b, alpha=c), x, beta=a) for x, g in zip(xs, grams(xs))]
        return xs
