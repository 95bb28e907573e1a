"""Global-norm gradient clipping that stays right when gradients are sharded or partitioned across ranks.

    norm = sqrt( sum over ranks of (sum of squares of the gradient elements that rank owns uniquely) )

A strategy describes its gradients with `GradShards` (what to scale, what to count, which groups to sum over);
`clip_grad_norm_` does the rest. For DDP every rank holds every gradient, so `groups` is empty and no collective
is issued; ZeRO counts its shards and sums over dp; TP counts replicated parameters on one tp rank only.

`Trainer(gradient_clip_val=..., gradient_clip_algorithm="norm")` reaches this through `with_global_norm_clip`,
which the base strategy's `precision_plugin` setter applies: Lightning's default `clip_grad_by_norm` would compute
a *local* norm with `torch.nn.utils.clip_grad_norm_`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import Tensor
from torch.optim import Optimizer

from lit_lm.strategies import comm
from lit_lm.strategies.errors import ConfigError


@dataclass
class GradShards:
    """The gradients a rank holds, for a global norm.

    grads: every gradient tensor the optimizer will use on this rank: all of them get scaled.
    owned: the ones counted in the norm (default: `grads`); across the ranks of `groups`, every element of the
        global gradient must be in exactly one rank's `owned`.
    groups: the process groups the partial sums of squares are all-reduced over, one after the other (orthogonal
        groups, e.g. dp then tp, give the sum over their product).
    device: where the norm lives when this rank owns nothing (NCCL all-reduces need a GPU tensor).
    """

    grads: list[Tensor]
    owned: Optional[list[Tensor]] = None
    groups: Sequence[dist.ProcessGroup] = field(default_factory=tuple)
    device: Optional[torch.device] = None


def global_grad_norm(shards: GradShards) -> Tensor:
    """The L2 norm of the full gradient, in fp32, identical on every rank of `shards.groups`."""
    owned = shards.grads if shards.owned is None else shards.owned
    # Per-tensor norms first (as torch.nn.utils.clip_grad_norm_ does): the same rounding as a single-device run.
    if owned:
        sum_sq = torch.stack([torch.linalg.vector_norm(g.detach(), dtype=torch.float32) for g in owned]).square().sum()
    else:
        sum_sq = torch.zeros((), dtype=torch.float32, device=shards.device)
    for group in shards.groups:
        sum_sq = comm.scalar_all_reduce(sum_sq, group, label="global grad norm")
    return sum_sq.sqrt()


def clip_grad_norm_(shards: GradShards, max_norm: float, eps: float = 1e-6) -> Tensor:
    """Scale `shards.grads` in place so the global norm is at most `max_norm`; return the pre-clip norm."""
    norm = global_grad_norm(shards)
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    if shards.grads:
        torch._foreach_mul_(shards.grads, coef.to(shards.grads[0].device))
    return norm


def local_grad_shards(module: torch.nn.Module, device: Optional[torch.device] = None) -> GradShards:
    """Every rank holds every gradient (single device, DDP): count them all, all-reduce nothing."""
    return GradShards([p.grad for p in module.parameters() if p.grad is not None], device=device)


class _GlobalNormClip:
    """Mixin for a precision plugin: `clip_grad_by_norm` calls `clip_fn(max_norm)` instead of a local clip."""

    clip_fn: Callable[[float], Any]

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        self.clip_fn(clip_val)


class GlobalNormPrecision(_GlobalNormClip, Precision):
    """fp32 ("32-true")."""


class GlobalNormMixedPrecision(_GlobalNormClip, MixedPrecision):
    """bf16 autocast ("bf16-mixed")."""


class GlobalNormHalfPrecision(_GlobalNormClip, HalfPrecision):
    """bf16 weights ("bf16-true")."""


FP16_REFUSED = (
    "fp16 precision (16-mixed, 16-true) is not supported by lit-lm's strategies: the 16-mixed GradScaler decides "
    "to skip a step from the inf/nan check of this rank's gradients only, so ranks holding different gradient "
    "shards can disagree and diverge (and 16-true has no scaler at all). "
    "Set `trainer.precision: bf16-mixed` (or 32-true, bf16-true)."
)


def with_global_norm_clip(plugin: Precision, clip_fn: Callable[[float], Any]) -> Precision:
    """The same precision as `plugin`, with norm clipping routed to `clip_fn`. Refuses fp16 and unknown plugins."""
    if isinstance(plugin, _GlobalNormClip):
        converted: Precision = plugin
    elif type(plugin) is Precision:
        converted = GlobalNormPrecision()
    elif type(plugin) is MixedPrecision:
        if plugin.scaler is not None or plugin.precision != "bf16-mixed":
            raise ConfigError(FP16_REFUSED)
        converted = GlobalNormMixedPrecision(plugin.precision, plugin.device)
    elif type(plugin) is HalfPrecision:
        if plugin.precision != "bf16-true":
            raise ConfigError(FP16_REFUSED)
        converted = GlobalNormHalfPrecision(plugin.precision)
    else:
        raise ValueError(
            f"precision plugin {type(plugin).__name__} is not supported by lit-lm's strategies: set "
            "`trainer.precision` to one of 32-true, bf16-mixed, bf16-true and no precision plugin"
        )
    converted.clip_fn = clip_fn
    return converted
