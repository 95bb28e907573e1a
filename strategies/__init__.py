"""HOW lit-lm parallelises: hand-written strategies, registered by name with Lightning at import time."""

from lightning.pytorch.strategies import StrategyRegistry

from strategies.ddp import DataParallelStrategy
from strategies.zero import ZeroStrategy

StrategyRegistry.register("lm_ddp", DataParallelStrategy, description="hand-written bucketed DDP", override=True)
ZeroStrategy.register_strategies(StrategyRegistry)
