"""`lm_ddp`: the model replicated on every data-parallel rank, gradients averaged by the hand-written bucketed
all-reduce of `strategies/grad_sync.py`: `ComposedStrategy` with its defaults (a preset, `strategies/presets.py`).
This class keeps the class path of configs/strategies/ddp.yaml."""

from __future__ import annotations

from strategies.composed import ComposedStrategy


class DataParallelStrategy(ComposedStrategy):
    """`lm_ddp`: the model replicated on every dp rank, gradients averaged by `GradSync`."""
