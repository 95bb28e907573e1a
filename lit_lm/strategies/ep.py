"""`ep`: experts sharded over `expert_parallel_size` ranks carved from dp (the engine:
`lit_lm/strategies/experts.py`), as
a preset of `ComposedStrategy` (`lit_lm/strategies/presets.py`); this class keeps the class path of
configs/strategies/ep*.yaml."""

from __future__ import annotations

from typing import Any

from lit_lm.strategies.composed import ComposedStrategy
from lit_lm.strategies.presets import default


class ExpertParallelStrategy(ComposedStrategy):
    """`ep`: experts sharded over `expert_parallel_size` ranks (default 2) carved from dp, everything else data
    parallel; `zero_stage` 1 or 2 shards dense state over dp and expert state over edp."""

    def __init__(self, expert_parallel_size: int = default("ep", "expert_parallel_size"), **kwargs: Any) -> None:
        super().__init__(expert_parallel_size=expert_parallel_size, **kwargs)
