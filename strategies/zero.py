"""`ZeroStrategy`: the ZeRO engine (`strategies.zero_engine`) plugged into Lightning, registered as zero1/2/3.

Lightning builds the user's optimizer as usual; `setup_optimizers` then points its param groups at the fp32
master shards in place, so any torch optimizer, its param groups and LR schedulers keep working on shards.
Because that optimizer no longer sees the model's parameters, its `zero_grad` does not clear their `.grad`: the
engine frees them after reducing (stages 2, 3) or after the step (stage 1).

ZeRO-3 builds the model on the meta device (`tensor_init_context`, used around `configure_model`) and the engine
materialises it one parameter at a time with the model's `init_parameter`, keeping only the local rows.

Checkpoints: "model" holds the fp32 master weights and "optimizer_<i>" the optimizer state, each shard as a
`DTensor` with `Shard(0)` over the dp mesh under its global FQN and global shape, so DCP reshards to any world
size and any strategy can read them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Generator, Optional, Union

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer
from typing_extensions import override

from strategies.base import BaseStrategy, WeightShard, _unwrap
from strategies.clip import GradShards
from strategies.zero_engine import STAGES, ShardedParam, ZeroEngine, check_stage, model_state_bytes


class ZeroStrategy(BaseStrategy):
    """ZeRO data parallelism: stage 1 shards optimizer state and master weights, 2 also gradients, 3 also
    parameters (see `strategies.zero_engine` for the memory and communication figures)."""

    def __init__(self, stage: int = 2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stage = check_stage(stage)
        self._engine: Optional[ZeroEngine] = None

    @classmethod
    @override
    def register_strategies(cls, registry: Any) -> None:
        for stage, what in STAGES.items():
            registry.register(f"zero{stage}", cls, description=f"ZeRO-{stage}: shards {what}", override=True,
                              stage=stage)

    @property
    def engine(self) -> ZeroEngine:
        if self._engine is None:
            raise RuntimeError("the ZeRO engine is built in setup(); it is not ready yet")
        return self._engine

    # -- model build ------------------------------------------------------------------------------------------
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        if self.stage < 3:
            with super().tensor_init_context(empty_init):
                yield
        else:  # nothing is allocated until the engine materialises the shards
            with torch.device("meta"), self.precision_plugin.tensor_init_context():
                yield

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not any(p.is_meta for p in self.model.parameters()):
            super().model_to_device()

    def parallelize(self, fitting: bool) -> None:
        module = self.lightning_module
        if self._engine is not None and self._engine.module is module:  # fit() then validate(): already sharded
            self._engine.attach()
        else:
            self._engine = ZeroEngine(module, self.stage, self.layout.dp_group, self.root_device)

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            self.engine.shard_optimizer(_unwrap(optimizer))

    @override
    def teardown(self) -> None:
        if self._engine is not None:
            self._engine.detach()
            if self.stage == 3:  # Lightning's teardown moves the module to the CPU: give it whole weights there
                self._engine.consolidate(torch.device("cpu"))
        super().teardown()

    # -- the step -----------------------------------------------------------------------------------------------
    def finish_grad_sync(self) -> None:
        self.engine.finish_grad_sync()

    def after_optimizer_step(self, optimizer: Union[Optimizer, LightningOptimizer]) -> None:
        self.engine.after_step()

    def grad_norm_shards(self) -> GradShards:
        return GradShards(self.engine.owned_grads(), groups=[self.layout.dp_group])

    def owned_weights(self) -> list[WeightShard]:
        """The fp32 master rows (what the optimizer updates) and the parameter the forward reads (whole at
        stages 1-2; storage-less between steps at stage 3), chunked along dim 0 over dp."""
        return [WeightShard(sp.fqn, sp.master, sp.param, sp.param.shape, 0, sp.start, sp.end, self.layout.dp_group)
                for sp in self.engine.sharded_params()]

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of params, grads and optimizer state on this rank (for the memory figures)."""
        optimizer = _unwrap(self.optimizers[0]) if self.optimizers else None
        return model_state_bytes(self.lightning_module, optimizer)

    # -- checkpoints: shards as DTensors under global names ---------------------------------------------------
    def _dtensor(self, sp: ShardedParam, local: Tensor) -> DTensor:
        mesh = self.layout.device_mesh(self.root_device.type)["dp"]
        shape = sp.param.shape
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    def param_names(self) -> dict[Tensor, str]:
        return {sp.master: sp.fqn for sp in self.engine.sharded_params()}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {sp.fqn: self._dtensor(sp, sp.master.detach()) for sp in self.engine.sharded_params()}

    @override
    def optimizer_state(self, optimizer: Union[Optimizer, LightningOptimizer]) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        shards = {sp.fqn: sp for sp in self.engine.sharded_params()}
        state["state"] = {
            fqn: {k: self._dtensor(shards[fqn], v) if _is_shard(v, shards[fqn]) else v for k, v in s.items()}
            for fqn, s in state["state"].items()
        }
        return state

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        """DCP filled the live shards in place; a single-file checkpoint brings whole tensors to slice."""
        shards = {sp.fqn: sp for sp in self.engine.sharded_params()}
        module = self.lightning_module  # a tied parameter's second name (lm_head.weight) is in a single file too
        tied = {n for n, _ in module.named_parameters(remove_duplicate=False)} - {n for n, _ in module.named_parameters()}
        with torch.no_grad():
            for fqn, value in state["model"].items():
                if fqn in tied:
                    continue
                shards[fqn].master.copy_(_local_rows(value, shards[fqn]))
            for i, optimizer in enumerate(self.optimizers):
                saved = state.get(f"optimizer_{i}")
                if saved is None:
                    continue
                optimizer = _unwrap(optimizer)
                for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
                    group.update({k: v for k, v in saved_group.items() if k != "params"})
                for master, fqn in self.param_names().items():
                    for key, value in saved["state"].get(fqn, {}).items():
                        live = optimizer.state[master][key]
                        live.copy_(_local_rows(value, shards[fqn]) if _is_shard(live, shards[fqn]) else value)
        self.engine.refresh_params()


def _is_shard(t: Any, sp: ShardedParam) -> bool:
    return isinstance(t, Tensor) and t.shape == sp.master.shape and t.dim() > 0


def _local_rows(value: Tensor, sp: ShardedParam) -> Tensor:
    return value.to_local() if isinstance(value, DTensor) else value[sp.start: sp.end]
