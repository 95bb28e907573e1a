"""`tp`: Megatron tensor (+ sequence) parallelism (`lit_lm/strategies/tp_layers.py`) as a preset of `ComposedStrategy`
(`lit_lm/strategies/presets.py`).

The model says WHAT to split (`tensor_parallel_plan()`); the strategy replaces the planned modules with layers
keeping only their shard, all tp peers of a replica read the same batch, and the rest of the world is data
parallel (`GradSync`, or ZeRO with `zero_stage`). See `docs/tp.md`.
"""

from __future__ import annotations

from typing import Any

from lit_lm.strategies.composed import ComposedStrategy
from lit_lm.strategies.presets import default


class TensorParallelStrategy(ComposedStrategy):
    """Tensor parallelism over `tensor_parallel_size` ranks (default 2, with `sequence_parallel`), data
    parallelism over the rest."""

    def __init__(self, tensor_parallel_size: int = default("tp", "tensor_parallel_size"),
                 sequence_parallel: bool = default("tp", "sequence_parallel"), **kwargs: Any) -> None:
        super().__init__(tensor_parallel_size=tensor_parallel_size,
                         sequence_parallel=sequence_parallel if tensor_parallel_size > 1 else None, **kwargs)
