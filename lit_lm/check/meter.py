"""`Meter`: what a rank of `lit-lm check` measures besides the harness's gradients: per Lightning batch the bytes of
the collectives it issued per (group, op) and the seconds it took, per optimizer step its model-state bytes."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch

from lit_lm.strategies.base import BaseStrategy
from lit_lm.strategies.comm import COMM_LOG
from lit_lm.strategies.zero_engine import model_state_bytes

# collectives of a few bytes that are not model traffic (metric sync, MoE load counts through the strategy's
# reduce; the clipping norm; cp's loss): the planner does not count them
CONTROL = ("strategy.reduce", "global grad norm", "cp loss")


class Meter(L.Callback):
    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []  # {"comm": {(group, op): bytes}, "seconds": float}
        self.state: list[dict[str, int]] = []  # model_state_bytes at each optimizer step
        self.pp_rank = 0

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if isinstance(trainer.strategy, BaseStrategy):
            self.pp_rank = trainer.strategy.layout.pp_rank

    def on_train_batch_start(self, *args: Any) -> None:
        COMM_LOG.reset()
        self._start = time.perf_counter()

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        held = [w.local for w in trainer.strategy.owned_weights()] if isinstance(trainer.strategy, BaseStrategy) \
            else []  # a frozen parameter's master rows are in no optimizer
        self.state.append(model_state_bytes(module, getattr(optimizer, "_optimizer", optimizer), held))

    def on_train_batch_end(self, *args: Any) -> None:
        seconds = time.perf_counter() - self._start
        comm: dict[tuple[str, str], int] = {}
        for r in COMM_LOG.records:
            if r.label not in CONTROL and r.nbytes:
                comm[(r.group, r.op)] = comm.get((r.group, r.op), 0) + r.nbytes
        self.batches.append({"comm": comm, "seconds": seconds})

    def __getstate__(self) -> dict[str, Any]:
        """The measurements only: Lightning binds the module's `log` methods to callbacks during fit, and the
        records travel back from the ranks by pickle."""
        return {k: getattr(self, k) for k in ("batches", "state", "pp_rank")}
