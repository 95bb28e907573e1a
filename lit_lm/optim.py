"""Muon for the hidden matrices and AdamW for the rest, in one optimizer that every layout of lit-lm can step.

    matrices (param groups with "matrix": True, `lit_lm.param_groups.param_groups(..., split_matrices=True)`):
        B <- mu B + (1 - mu) G                        momentum (`buf.lerp_(grad, 1 - mu)`), on this rank's shard
        U <- G + mu (B - G)  (nesterov) or B          (`grad.lerp(buf, mu)`), on this rank's shard
        O <- NS_5(U)                                  Newton-Schulz in `ns_dtype` (bfloat16: torch's; or float32), on
                                                      the WHOLE matrix (the seam below)
        W <- (1 - lr wd) W - lr * adjust(A, B) * O    decoupled decay; adjust on the global matrix shape A x B:
                                                      "original" sqrt(max(1, A / B)),
                                                      "match_rms_adamw" 0.2 sqrt(max(A, B))
    the rest (embeddings, head, norms, biases, routers): AdamW with `adamw_lr`, `adamw_betas`, `adamw_eps` and each
        group's weight decay (torch's own functional AdamW: the same ops as `torch.optim.AdamW`).

Everything but NS is elementwise and runs on whatever shard the rank holds; NS needs each whole matrix, and an MoE
layer's expert stack [E, out, in] is E matrices, orthogonalized one by one, never as one. That one non-elementwise
step is a seam, `orthogonalizer` (`lit_lm.strategies.orthogonalize.Orthogonalizer`): by default the whole matrices
of one process (`LocalOrthogonalizer`); a lit-lm strategy binds its distributed one in `setup_optimizers`, because
`matrix_wise = True` says this optimizer has one (owner ranks gather, orthogonalize and scatter each matrix: see
`lit_lm/strategies/orthogonalize.py` and docs/optim.md). On one process the step equals `torch.optim.Muon` on the
matrices (each expert slice a matrix) plus `torch.optim.AdamW` on the rest, bit for bit (tests/test_muon.py).
State: one `momentum_buffer` per matrix tensor, shaped as the tensor the rank holds (a checkpoint reshards it as it
reshards the weights); AdamW's `step`, `exp_avg`, `exp_avg_sq` for the rest.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _adjust_lr
from torch.optim.adam import adam
from torch.optim.optimizer import _get_scalar_dtype, _to_scalar

from lit_lm.strategies.newton_schulz import DTYPES, NewtonSchulz
from lit_lm.strategies.orthogonalize import NS_MODES, LocalOrthogonalizer, Orthogonalizer


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update on the "matrix" param groups, AdamW on the others (module docstring).

    Args (Muon's as torch names them): lr, weight_decay (each group may set its own), momentum, nesterov,
        ns_coefficients, eps (NS's), ns_steps, adjust_lr_fn ("original" (None) or "match_rms_adamw").
        adamw_lr: the other groups' learning rate (None: `lr`, as with "match_rms_adamw"); adamw_betas, adamw_eps.
        ns_mode: how a lit-lm strategy spreads the Newton-Schulz work: "auto" (tp's Gram mode for a matrix cut over
            tp along its long dimension where that moves fewer bytes than the owner route, owner elsewhere), "gram"
            (Gram mode wherever it applies), "owner" (each matrix orthogonalized once, on one rank of
            the ranks that hold it, balanced by FLOPs) or "replicated" (every rank gathers and orthogonalizes every
            matrix it holds a part of: the baseline the benchmark compares with).
        ns_dtype: the dtype Newton-Schulz computes in: "bfloat16" (torch's own function, bit for bit) or "float32"
            (the same iteration, coefficients and eps in fp32: layouts then equal one process to fp32 summation
            order). The pieces an orthogonalizer moves travel in it.
    """

    matrix_wise = True  # its "matrix" groups need whole matrices: a strategy binds `orthogonalizer`

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
                 eps: float = EPS, ns_steps: int = DEFAULT_NS_STEPS, adjust_lr_fn: Optional[str] = None,
                 adamw_lr: Optional[float] = None, adamw_betas: tuple[float, float] = (0.9, 0.95),
                 adamw_eps: float = 1e-8, ns_mode: str = "auto", ns_dtype: str = "bfloat16") -> None:
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r}: choose 'original' (None) or 'match_rms_adamw'")
        if ns_mode not in NS_MODES:
            raise ValueError(f"ns_mode {ns_mode!r}: choose one of {', '.join(NS_MODES)}")
        if ns_dtype not in DTYPES:
            raise ValueError(f"ns_dtype {ns_dtype!r}: choose one of {', '.join(DTYPES)}")
        if not 0.0 <= momentum < 1.0 or lr < 0.0 or weight_decay < 0.0:
            raise ValueError(f"Muon needs lr >= 0, weight_decay >= 0 and 0 <= momentum < 1; got {lr}, "
                             f"{weight_decay}, {momentum}")
        groups = list(params)
        if groups and isinstance(groups[0], dict) and adamw_lr is not None:  # the other groups' own lr
            groups = [g if g.get("matrix") or "lr" in g else {**g, "lr": adamw_lr} for g in groups]
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                        adamw_betas=tuple(adamw_betas), adamw_eps=adamw_eps, matrix=False)
        super().__init__(groups, defaults)
        for group in self.param_groups:
            for p in group["params"] if group["matrix"] else ():
                if p.ndim not in (2, 3):
                    raise ValueError(f"Muon's matrix groups hold matrices (2-D) or stacks of them (3-D, an MoE "
                                     f"layer's experts); got a parameter of shape {tuple(p.shape)}")
        self.ns_mode = ns_mode
        self.ns_dtype = ns_dtype  # an attribute, as ns_mode: how to compute, not a hyperparameter a checkpoint keeps
        self.orthogonalizer: Orthogonalizer = LocalOrthogonalizer()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (self._muon if group["matrix"] else self._adamw)(group)
        return loss

    def _muon(self, group: dict[str, Any]) -> None:
        """torch's `_single_tensor_muon`, with the orthogonalization of every matrix of the group in one call of
        the seam (a distributed one batches its communication over them)."""
        lr, wd, momentum = _to_scalar(group["lr"]), group["weight_decay"], group["momentum"]
        params = [p for p in group["params"] if p.grad is not None]
        updates = []
        for p in params:
            if torch.is_complex(p) or p.grad.is_sparse:
                raise RuntimeError("Muon does not support complex parameters or sparse gradients")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            updates.append(p.grad.lerp(buf, momentum) if group["nesterov"] else buf)
        ns = NewtonSchulz(tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"], DTYPES[self.ns_dtype])
        for p, update in zip(params, self.orthogonalizer(params, updates, ns)):
            adjusted = _adjust_lr(lr, group["adjust_lr_fn"], self.orthogonalizer.matrix_shape(p))
            p.mul_(1 - lr * wd)
            p.add_(update, alpha=-adjusted)

    def _adamw(self, group: dict[str, Any]) -> None:
        """torch.optim.AdamW's step (its defaults: foreach chosen by torch, no amsgrad, not fused or capturable)."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["adamw_betas"]
        adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=None, capturable=False, differentiable=False,
             fused=None, grad_scale=None, found_inf=None, has_complex=any(torch.is_complex(p) for p in params),
             decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["adamw_eps"], maximize=False)


__all__ = ["Muon"]
