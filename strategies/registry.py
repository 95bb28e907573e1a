"""The strategy names Lightning resolves (`Trainer(strategy="zero3")`, `trainer.strategy: tp` in yaml): every one a
preset of `ComposedStrategy`. Importing this module registers them (lit_lm's CLI does, before any Trainer)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from strategies.composed import ComposedStrategy
from strategies.pp import PipelineStrategy
from strategies.tp import TensorParallelStrategy
from strategies.zero import ZeroStrategy


class DataParallelStrategy(ComposedStrategy):
    """`lm_ddp`: the model replicated on every dp rank, gradients averaged by `GradSync` (strategies/grad_sync.py)."""


class ExpertParallelStrategy(ComposedStrategy):
    """`ep`: experts sharded over `expert_parallel_size` ranks (default 2) carved from dp, everything else data
    parallel (strategies/experts.py); `zero_stage` 1 or 2 shards dense state over dp and expert state over edp."""

    def __init__(self, expert_parallel_size: int = 2, **kwargs: Any) -> None:
        super().__init__(expert_parallel_size=expert_parallel_size, **kwargs)


StrategyRegistry.register("lm_parallel", ComposedStrategy, description="dp x ZeRO x tp x pp x ep, composed",
                          override=True)
StrategyRegistry.register("lm_ddp", DataParallelStrategy, description="hand-written bucketed DDP", override=True)
ZeroStrategy.register_strategies(StrategyRegistry)
StrategyRegistry.register("tp", TensorParallelStrategy, description="Megatron tensor (+sequence) parallelism",
                          override=True, tensor_parallel_size=2, sequence_parallel=True)
StrategyRegistry.register("pp", PipelineStrategy, description="pipeline parallel (gpipe, 1f1b, interleaved, zb_h1)",
                          override=True)
StrategyRegistry.register("ep", ExpertParallelStrategy, description="expert parallelism (all-to-all) + DP",
                          override=True)
