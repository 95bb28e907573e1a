"""`ep`: experts sharded over `expert_parallel_size` ranks carved from dp (the engine: `strategies/experts.py`). A
preset of `ComposedStrategy` (`strategies/registry.py`); this module keeps the class path of
configs/strategies/ep*.yaml."""

from strategies.registry import ExpertParallelStrategy

__all__ = ["ExpertParallelStrategy"]
