"""The parallel-plan protocol: what a model publishes so that strategies can parallelise it without importing it.

torchtitan-style separation: the model says *what* its repeated unit is and how to initialise any parameter
from its name; each strategy decides *how* to shard, gather, split or wrap it.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

from torch import Tensor, nn


@runtime_checkable
class BlockModel(Protocol):
    """A model with a repeated unit and name-addressed initialisation.

    - `blocks`: an `nn.ModuleDict` keyed by the *global* layer index ("0", "1", ...). It is the unit that ZeRO-3
      gathers, activation checkpointing wraps and pipeline stages own; checkpoint names never depend on a split.
    - `init_parameter(name, tensor)`: fill `tensor` in place with the initial value of parameter `name` (a name of
      the model's own `named_parameters()`), independent of device, order and rank. This lets a strategy build
      the model on the meta device and materialise one piece at a time.
    """

    blocks: nn.ModuleDict

    def init_parameter(self, name: str, tensor: Tensor) -> None: ...


def find_block_model(root: nn.Module) -> tuple[str, Optional[BlockModel]]:
    """The first submodule of `root` (itself included) honouring `BlockModel`, with its qualified name prefix."""
    for prefix, module in root.named_modules():
        if isinstance(module, BlockModel) and isinstance(getattr(module, "blocks", None), nn.ModuleDict):
            return prefix, module
    return "", None
