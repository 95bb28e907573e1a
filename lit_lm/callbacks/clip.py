"""`GlobalNormClip`: clip gradients to a global L2 norm from a callback, whatever the strategy.

The same thing `Trainer(gradient_clip_val=..., gradient_clip_algorithm="norm")` does under lit-lm's strategies,
as a callback for runs that configure clipping next to other callbacks (or under a strategy that is not ours):
it asks the strategy for the norm over the gradient shards each rank owns, so it is right for sharded gradients,
and falls back to the local gradients under Lightning's own single-device strategy. Logs the pre-clip norm.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.optim import Optimizer

from lit_lm.strategies.base import BaseStrategy
from lit_lm.strategies.clip import clip_grad_norm_, local_grad_shards


class GlobalNormClip(L.Callback):
    def __init__(self, max_norm: float, log: bool = True) -> None:
        if max_norm <= 0:
            raise ValueError(f"GlobalNormClip max_norm must be positive, got {max_norm}")
        self.max_norm = max_norm
        self.log = log

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Optimizer) -> None:
        # Under our strategies the gradient collectives have finished by now (see BaseStrategy.optimizer_step).
        strategy = trainer.strategy
        shards = strategy.grad_norm_shards() if isinstance(strategy, BaseStrategy) else local_grad_shards(pl_module)
        norm = clip_grad_norm_(shards, self.max_norm)
        if self.log:
            pl_module.log("grad_norm", norm)

    def one_process_reference(self) -> "TorchNormClip":
        """What the parity harness (lit_lm.parity) runs in its one-process reference instead of this callback."""
        return TorchNormClip(self.max_norm)


class TorchNormClip(L.Callback):
    """The one-process reference of `GlobalNormClip`: torch's own `clip_grad_norm_`, code the strategies never run."""

    def __init__(self, max_norm: float) -> None:
        self.max_norm = max_norm

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        torch.nn.utils.clip_grad_norm_(module.parameters(), self.max_norm)
