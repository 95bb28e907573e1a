"""`zero1`, `zero2`, `zero3`: ZeRO data parallelism (`lit_lm/strategies/zero_engine.py`) as presets of
`ComposedStrategy` (`lit_lm/strategies/presets.py`).

Lightning builds the user's optimizer as usual; the strategy then points its param groups at the fp32 master
shards in place, so any torch optimizer, its param groups and LR schedulers keep working on shards. ZeRO-3 builds
the model on the meta device and the engine materialises one parameter at a time from its name. Checkpoints hold
each shard as a `DTensor` with `Shard(0)` over dp under its global name and shape (see `ComposedStrategy`).
"""

from __future__ import annotations

from typing import Any

from lit_lm.strategies.composed import ComposedStrategy
from lit_lm.strategies.presets import default
from lit_lm.strategies.zero_engine import check_stage


class ZeroStrategy(ComposedStrategy):
    """ZeRO over the data-parallel ranks: stage 1 shards optimizer state and master weights, 2 also gradients,
    3 also parameters (the presets zero1, zero2, zero3; the default is zero2's); composes with
    `tensor_parallel_size`, `pipeline_parallel_size` (stages 1-2), `expert_parallel_size` (stages 1-2) and
    `data_parallel_replicate_size` (HSDP) like the other presets."""

    def __init__(self, stage: int = default("zero2", "stage"), **kwargs: Any) -> None:
        super().__init__(zero_stage=check_stage(stage), **kwargs)
