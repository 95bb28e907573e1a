"""`pp`: pipeline parallelism (the schedules of `lit_lm/strategies/pp_schedules.py`) as a preset of `ComposedStrategy`
(`lit_lm/strategies/presets.py`).

Each pipeline rank keeps only the model pieces it owns (`PipelineModel.pipeline_split`: its blocks under their
global names, the embedding on the first rank, norm + head on the last), materialised from the meta device one
parameter at a time. One Lightning step runs the whole schedule (`lit_lm/strategies/pp_runner.py`): the
LightningModule's `model.loss(inputs, targets)` call is redirected to the runner, which returns the batch loss
broadcast from the last stage. The tied embedding/head is summed over the first and last stage. See `docs/pp.md`.
"""

from __future__ import annotations

from typing import Any, Optional

from lit_lm.strategies.composed import ComposedStrategy
from lit_lm.strategies.presets import default


class PipelineStrategy(ComposedStrategy):
    """`pipeline_parallel_size` stages (the `pp` preset: 2); dp = what is left of the world.

    Args (pipeline options: refused with pipeline_parallel_size 1, which runs no pipeline):
        microbatches: the per-replica batch is cut into this many equal microbatches (default 4).
        schedule: a name in `lit_lm/strategies/pp_schedules.py`'s registry (default 1f1b; interleaved_1f1b takes
            `virtual_stages` chunks per rank).
        layers_per_stage: fixed layer counts per (virtual) stage, e.g. [3, 2]; otherwise balanced by `balance`
            ("layers", the default, or "params": parameter counts, the embedding and head included).
    """

    def __init__(self, pipeline_parallel_size: int = default("pp", "pipeline_parallel_size"),
                 microbatches: Optional[int] = None, schedule: Optional[str] = None,
                 virtual_stages: Optional[int] = None, layers_per_stage: Optional[list[int]] = None,
                 balance: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(pipeline_parallel_size=pipeline_parallel_size, microbatches=microbatches,
                         schedule=schedule, virtual_stages=virtual_stages, layers_per_stage=layers_per_stage,
                         balance=balance, **kwargs)

