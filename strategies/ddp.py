"""`lm_ddp`: the model replicated on every data-parallel rank, gradients averaged by the hand-written bucketed
all-reduce of `strategies/grad_sync.py`. A preset of `ComposedStrategy` (`strategies/registry.py`); this module
keeps the class path of configs/strategies/ddp.yaml."""

from strategies.registry import DataParallelStrategy

__all__ = ["DataParallelStrategy"]
