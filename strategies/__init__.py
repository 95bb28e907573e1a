"""HOW lit-lm parallelises: hand-written strategies, registered by name with Lightning at import time."""

from lightning.pytorch.strategies import StrategyRegistry

from strategies.ddp import DataParallelStrategy
from strategies.ep import ExpertParallelStrategy
from strategies.pp import PipelineStrategy
from strategies.tp import TensorParallelStrategy
from strategies.zero import ZeroStrategy

StrategyRegistry.register("lm_ddp", DataParallelStrategy, description="hand-written bucketed DDP", override=True)
ZeroStrategy.register_strategies(StrategyRegistry)
StrategyRegistry.register("tp", TensorParallelStrategy, description="Megatron tensor (+sequence) parallelism",
                          override=True, tensor_parallel_size=2, sequence_parallel=True)
StrategyRegistry.register("pp", PipelineStrategy, description="pipeline parallel (gpipe, 1f1b, interleaved, zb_h1)",
                          override=True)
StrategyRegistry.register("ep", ExpertParallelStrategy, description="expert parallelism (all-to-all) + DP",
                          override=True)
