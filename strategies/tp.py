"""`TensorParallelStrategy` (`tp`): Megatron tensor (+ sequence) parallelism inside each tp group of the
dp x tp layout, hand-written data parallelism across the groups: `GradSync` (all-reduce), or with `zero_stage`
1 or 2 the ZeRO engine (`strategies.zero_engine`) built on the dp group over this rank's tp-local parameters, so
optimizer state (and at stage 2 gradients) of each tp shard is split again over dp.

The model says WHAT to split (`tensor_parallel_plan()`, see `strategies.plan.TensorParallel`); this strategy
decides HOW: after `configure_model` built the whole model, it replaces the planned modules with the layers of
`strategies.tp_layers`, each keeping only its shard (build-then-shard). All tp peers of a replica see the same
batch (the base's sampler is dp-only).

Gradients per step: the sharded ones are complete on their rank; replicated weights used on a part of the data
(norms on sequence shards, QK-norms on local heads) get one all-reduce over tp; and the dp average (under ZeRO a
reduce-scatter, the tp all-reduce then moves only this rank's dp rows). Clipping counts sharded gradients on
every rank and replicated ones on tp rank 0 only (and under ZeRO each dp rank its own rows).

Checkpoints: a sharded parameter (and its optimizer state) is saved as a `DTensor` with `Shard(dim)` of its
global shape under its global name, so `torch.distributed.checkpoint` reshards between tp sizes (and from or to
any other strategy); replicated tensors are saved plainly. Under ZeRO the optimizer state is first all-gathered
over dp into the tp-local tensor (and on load this rank's dp rows are kept): one checkpoint format whatever the
dp, tp and ZeRO settings.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Union

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer
from typing_extensions import override

from strategies.base import GradPart, WeightShard, _unwrap
from strategies.clip import GradShards
from strategies.ddp import DataParallelStrategy
from strategies.plan import TensorParallelModel
from strategies.tp_layers import TPGroup, TPShards, parallelize_model
from strategies.zero_engine import ShardedParam, ZeroEngine


class TensorParallelStrategy(DataParallelStrategy):
    """Tensor parallelism over `tensor_parallel_size` ranks (with `sequence_parallel`), data parallelism over the
    rest: `GradSync` (`bucket_cap_mb`: its gradient buckets) or, with `zero_stage` 1 or 2, ZeRO over dp."""

    def __init__(self, tensor_parallel_size: int = 2, sequence_parallel: bool = True, bucket_cap_mb: float = 25.0,
                 zero_stage: int = 0, **kwargs: Any) -> None:
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage={zero_stage!r} with tensor parallelism: choose 0 (replicated optimizer "
                             "state), 1 (optimizer state sharded over dp) or 2 (and gradients); ZeRO-3 is not "
                             "supported with tp")
        super().__init__(bucket_cap_mb=bucket_cap_mb, tensor_parallel_size=tensor_parallel_size, **kwargs)
        self.sequence_parallel = sequence_parallel
        self.zero_stage = zero_stage
        self._shards: Optional[TPShards] = None
        self._sharded_module: Optional[nn.Module] = None
        self._engine: Optional[ZeroEngine] = None
        self._zero_params: dict[nn.Parameter, ShardedParam] = {}  # tp-local parameter -> its dp rows (ZeRO)

    @override
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
        if self.zero_stage and fitting:  # the engine shards the tp-local tensors along dim 0 over dp
            self._engine = ZeroEngine(module, self.zero_stage, self.layout.dp_group, self.root_device)
            self._zero_params = {sp.param: sp for sp in self._engine.sharded_params()}
        elif self.layout.dp_size > 1:
            super().parallelize(fitting)

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        if self._engine is not None:
            for optimizer in self.optimizers:
                self._engine.shard_optimizer(_unwrap(optimizer))

    @override
    def teardown(self) -> None:
        if self._engine is not None:
            self._engine.detach()
            self._engine, self._zero_params = None, {}
        super().teardown()

    def _grad(self, param: nn.Parameter) -> Optional[Tensor]:
        """What the optimizer steps with: the parameter's gradient, or under ZeRO the master's dp rows of it."""
        return self._zero_params[param].master.grad if self._engine is not None else param.grad

    def finish_grad_sync(self) -> None:
        if self._engine is not None:
            self._engine.finish_grad_sync()  # dp reduce-scatter: this rank's rows of the averaged gradients
        else:
            super().finish_grad_sync()  # dp average (sums commute: the order of dp and tp does not matter)
        self.shards.sum_partial_grads(self._grad)

    def after_optimizer_step(self, optimizer: Union[Optimizer, LightningOptimizer]) -> None:
        if self._engine is not None:
            self._engine.after_step()  # all-gather the updated rows into the tp-local parameters

    def grad_norm_shards(self) -> GradShards:
        params = [p for p in self.lightning_module.parameters() if self._grad(p) is not None]
        owned = [self._grad(p) for p in params if p in self.shards.sharded or self.layout.tp_rank == 0]
        groups = [self.layout.tp_group] if self._engine is None else [self.layout.dp_group, self.layout.tp_group]
        return GradShards([self._grad(p) for p in params], owned, groups=groups)

    def owned_weights(self) -> list[WeightShard]:
        """Sharded parameters are this rank's `torch.chunk` part along their split dim over tp; the rest whole."""
        if self._engine is not None:
            raise NotImplementedError("owned_weights() under tp with ZeRO: the optimizer updates 2-D shards (tp "
                                      "split dim, then dp rows), which a WeightShard cannot describe; use "
                                      "zero_stage=0 with compression callbacks")
        out = []
        for ws in super().owned_weights():
            if ws.param in self.shards.sharded:
                dim, shape = self.shards.sharded[ws.param]
                start, end = self.shards.tp.rows(shape[dim])
                ws = WeightShard(ws.name, ws.local, ws.param, shape, dim, start, end, self.layout.tp_group)
            out.append(ws)
        return out

    def named_grads(self) -> list[GradPart]:
        """Under ZeRO a gradient part is this rank's dp rows (dim 0) of its tp-local part (the tp split dim)."""
        if self._engine is None:
            return super().named_grads()
        out = []
        for sp in self._engine.sharded_params():
            index, shape = [slice(sp.start, sp.end)], sp.param.shape
            if sp.param in self.shards.sharded:
                dim, shape = self.shards.sharded[sp.param]
                start, _ = self.shards.tp.rows(shape[dim])
                if dim == 0:
                    index = [slice(start + sp.start, start + sp.end)]
                else:
                    index += [slice(None)] * (dim - 1) + [slice(start, start + sp.param.shape[dim])]
            out.append(GradPart(sp.fqn, shape, tuple(index), sp.master.grad))
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

    def param_names(self) -> dict[Tensor, str]:
        if self._engine is None:
            return super().param_names()
        return {sp.master: sp.fqn for sp in self._engine.sharded_params()}  # what the optimizer holds

    def _zero_param(self, fqn: str) -> ShardedParam:
        return self._zero_params[self.lightning_module.get_parameter(fqn)]

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        sharded = self._sharded_names()
        return {name: self._to_global(value, *sharded[name]) if name in sharded else value
                for name, value in self.lightning_module.state_dict().items()}

    @override
    def optimizer_state(self, optimizer: Union[Optimizer, LightningOptimizer]) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        sharded = self._sharded_names()
        for fqn, per_param in state["state"].items():
            # new dicts: torch's optimizer state_dict() hands out its live per-parameter dicts
            state["state"][fqn] = {k: self._to_saved(fqn, v, sharded.get(fqn)) for k, v in per_param.items()}
        return state

    def _to_saved(self, fqn: str, value: Any, sharding: Optional[tuple[int, torch.Size]]) -> Any:
        """exp_avg and the like (the parameter's shape; `step` is a scalar): tp-local (gathered over dp under
        ZeRO), then a DTensor of the global shape when the parameter is split over tp."""
        if not _is_shard(value):
            return value
        if self._engine is not None:
            value = self._zero_param(fqn).gather_rows(value, self.layout.dp_group)
        return self._to_global(value, *sharding) if sharding is not None else value

    def _to_live(self, fqn: str, value: Any, sharding: Optional[tuple[int, torch.Size]]) -> Any:
        """The inverse of `_to_saved`: tp-local, then (ZeRO) this rank's dp rows, a copy the optimizer keeps."""
        value = self._to_local(value, sharding)
        if self._engine is None or not _is_shard(value):
            return value
        sp = self._zero_param(fqn)
        return value[sp.start: sp.end].clone()

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        sharded = self._sharded_names()
        state["model"] = {k: self._to_local(v, sharded.get(k)) for k, v in state["model"].items()}
        for key in [k for k in state if k.startswith("optimizer_")]:
            state[key]["state"] = {fqn: {k: self._to_live(fqn, v, sharded.get(fqn)) for k, v in s.items()}
                                   for fqn, s in state[key]["state"].items()}
        super().load_sharded_state(state)
        if self._engine is not None:  # bf16-true keeps separate fp32 masters: take the loaded weights' rows
            with torch.no_grad():
                for sp in self._engine.sharded_params():
                    if sp.master.dtype != sp.param.dtype:
                        sp.master.copy_(sp.param[sp.start: sp.end])


def _is_shard(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0
