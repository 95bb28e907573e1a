"""`TensorParallelStrategy` (`tp`): Megatron tensor (+ sequence) parallelism inside each tp group of the
dp x tp layout, hand-written data parallelism (`GradSync`) across the groups.

The model says WHAT to split (`tensor_parallel_plan()`, see `strategies.plan.TensorParallel`); this strategy
decides HOW: after `configure_model` built the whole model, it replaces the planned modules with the layers of
`strategies.tp_layers`, each keeping only its shard (build-then-shard). All tp peers of a replica see the same
batch (the base's sampler is dp-only).

Gradients per step: the sharded ones are complete on their rank; replicated weights used on a part of the data
(norms on sequence shards, QK-norms on local heads) get one all-reduce over tp; then the dp average. Clipping
counts sharded gradients on every rank and replicated ones on tp rank 0 only.

Checkpoints: a sharded parameter (and its optimizer state) is saved as a `DTensor` with `Shard(dim)` of its
global shape under its global name, so `torch.distributed.checkpoint` reshards between tp sizes (and from or to
any other strategy); replicated tensors are saved plainly.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Union

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from strategies.base import WeightShard
from strategies.clip import GradShards
from strategies.ddp import DataParallelStrategy
from strategies.plan import TensorParallelModel
from strategies.tp_layers import TPGroup, TPShards, parallelize_model


class TensorParallelStrategy(DataParallelStrategy):
    """Tensor parallelism over `tensor_parallel_size` ranks (with `sequence_parallel`), data parallelism over the
    rest (`bucket_cap_mb`: the dp gradient buckets)."""

    def __init__(self, tensor_parallel_size: int = 2, sequence_parallel: bool = True, bucket_cap_mb: float = 25.0,
                 **kwargs: Any) -> None:
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        super().__init__(bucket_cap_mb=bucket_cap_mb, tensor_parallel_size=tensor_parallel_size, **kwargs)
        self.sequence_parallel = sequence_parallel
        self._shards: Optional[TPShards] = None
        self._sharded_module: Optional[nn.Module] = None

    def _configure_launcher(self) -> None:
        tp, world = self._tp_size, self.num_processes * self.num_nodes
        if world % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide the number of processes (devices x num_nodes "
                             f"= {world}): set trainer.devices to a multiple of it")
        if self.num_processes % tp:
            warnings.warn(f"tensor_parallel_size={tp} does not divide trainer.devices={self.num_processes} (per "
                          "node): tp groups span nodes and their per-layer collectives cross the slow network; "
                          "use a tp size that divides the devices of a node", stacklevel=2)
        super()._configure_launcher()

    @property
    def shards(self) -> TPShards:
        if self._shards is None:
            raise RuntimeError("the model is split in setup(); it is not ready yet")
        return self._shards

    def parallelize(self, fitting: bool) -> None:
        module = self.lightning_module
        if self._sharded_module is not module:  # fit() then validate() reuses the split module
            model = next((m for m in module.modules() if isinstance(m, TensorParallelModel)), None)
            if model is None:
                raise TypeError(f"{type(module).__name__} holds no model with a tensor_parallel_plan() "
                                "(strategies.plan.TensorParallelModel): the tp strategy cannot split it")
            layout = self.layout
            tp = TPGroup(layout.tp_group, layout.tp_size, layout.tp_rank, self.sequence_parallel)
            self._shards = parallelize_model(model, model.tensor_parallel_plan(), tp)
            self._sharded_module = module
        if self.layout.dp_size > 1:
            super().parallelize(fitting)

    def finish_grad_sync(self) -> None:
        super().finish_grad_sync()  # dp average (sums commute: the order of dp and tp does not matter)
        self.shards.sum_partial_grads()

    def grad_norm_shards(self) -> GradShards:
        params = [p for p in self.lightning_module.parameters() if p.grad is not None]
        owned = [p.grad for p in params if p in self.shards.sharded or self.layout.tp_rank == 0]
        return GradShards([p.grad for p in params], owned, groups=[self.layout.tp_group])

    def owned_weights(self) -> list[WeightShard]:
        """Sharded parameters are this rank's `torch.chunk` part along their split dim over tp; the rest whole."""
        out = []
        for ws in super().owned_weights():
            if ws.param in self.shards.sharded:
                dim, shape = self.shards.sharded[ws.param]
                start, end = self.shards.tp.rows(shape[dim])
                ws = WeightShard(ws.name, ws.local, ws.param, shape, dim, start, end, self.layout.tp_group)
            out.append(ws)
        return out

    # -- checkpoints ------------------------------------------------------------------------------------------
    def _sharded_names(self) -> dict[str, tuple[int, torch.Size]]:
        """FQN (every name of a tied parameter) -> (split dim, global shape) of the sharded parameters."""
        return {name: self.shards.sharded[p]
                for name, p in self.lightning_module.named_parameters(remove_duplicate=False)
                if p in self.shards.sharded}

    def _to_global(self, local: Tensor, dim: int, shape: torch.Size) -> DTensor:
        mesh = self.layout.device_mesh(self.root_device.type)["tp"]
        return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    def _to_local(self, value: Any, sharding: Optional[tuple[int, torch.Size]]) -> Any:
        """A DTensor's local part (DCP filled it), or this rank's slice of a whole tensor (a single-file
        checkpoint); anything else as is."""
        if isinstance(value, DTensor):
            return value.to_local()
        if sharding is not None and isinstance(value, Tensor) and value.shape == sharding[1]:
            return self.shards.tp.shard(value, sharding[0])
        return value

    def lightning_module_state_dict(self) -> dict[str, Any]:
        sharded = self._sharded_names()
        return {name: self._to_global(value, *sharded[name]) if name in sharded else value
                for name, value in self.lightning_module.state_dict().items()}

    def optimizer_state(self, optimizer: Union[Optimizer, LightningOptimizer]) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        sharded = self._sharded_names()
        for fqn, per_param in state["state"].items():
            if fqn in sharded:  # exp_avg and the like have the parameter's local shape; `step` is a scalar
                # new dicts: torch's optimizer state_dict() hands out its live per-parameter dicts
                state["state"][fqn] = {key: self._to_global(value, *sharded[fqn]) if _is_shard(value) else value
                                       for key, value in per_param.items()}
        return state

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        sharded = self._sharded_names()
        state["model"] = {k: self._to_local(v, sharded.get(k)) for k, v in state["model"].items()}
        for key in [k for k in state if k.startswith("optimizer_")]:
            state[key]["state"] = {fqn: {k: self._to_local(v, sharded.get(fqn)) for k, v in s.items()}
                                   for fqn, s in state[key]["state"].items()}
        super().load_sharded_state(state)


def _is_shard(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0
