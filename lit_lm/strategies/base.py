"""`BaseStrategy`: everything lit-lm's parallel strategies share, plugged into Lightning's `ParallelStrategy`.

Not a subclass of `DDPStrategy`: its setup, `block_backward_sync` and teardown all assume torch's DDP wrapper.
The base owns the plumbing; a parallel kind (DDP, ZeRO, TP, PP) overrides a few hooks.

What the base does
    launcher        always `_SubprocessScriptLauncher`: spawns the local ranks under plain `python`, does nothing
                    under torchrun/SLURM but still checks `devices x num_nodes` against the cluster's world size.
    layout          `self.layout`: the cached `ParallelLayout` (layout.py: `.group(name)`, `.rank(name)`,
                    `.size(name)`, `.dp_group`..., `.device_mesh(type)`), built in `setup_environment` after the
                    default group from `parallel_dims(world)` (a hook; the base is data parallel only), which
                    `_configure_launcher` validates first.
    sampler         `distributed_sampler_kwargs` = dp size and rank: tp/pp peers of a replica get the same batch.
    precision       32-true, bf16-mixed, bf16-true; fp16 is refused (its GradScaler's inf check is per rank).
                    The plugin is swapped for one whose `clip_grad_by_norm` calls `self.clip_grad_norm_`.
    optimizer_step  wraps Lightning's closure: closure() (forward + backward) -> `finish_grad_sync()` -> then
                    Lightning's `on_before_optimizer_step` and clipping -> optimizer.step -> `after_optimizer_step`.
    accumulation    `block_backward_sync()` sets `self._sync_enabled = False` for the micro-steps that must not
                    communicate (Lightning enters it on all but the last micro-batch of `accumulate_grad_batches`).
    clipping        `clip_grad_norm_(max_norm)`: the global norm over `grad_norm_shards()`, logged as `grad_norm`
                    (pre-clip).
    checkpoints     a `torch.distributed.checkpoint` directory {"model": ..., "optimizer_<i>": ...} keyed by FQNs
                    relative to the LightningModule, plus a rank-0 `meta.pt` with the rest of Lightning's
                    checkpoint; restored after setup (`restore_checkpoint_after_setup`), so the live (possibly
                    sharded) tensors are the load destination and DCP reshards across world sizes. A single-file
                    Lightning checkpoint is accepted too. Crash-safe (`lit_lm/strategies/checkpoint.py`): written to
                    `<path>.tmp-<id>`, marked `COMPLETE` (step, world size, strategy, dp/tp/pp) after a barrier
                    and published by rename; any directory without the marker is refused on load, naming it.
                    `remove_checkpoint` (save_top_k retention) also clears what crashed saves left in the folder.
                    During fit a save is written in the background (`async_save.py`: the step waits only for a
                    host copy; at most one in flight; removals wait for its publish); `async_checkpoint=False`
                    writes in the step. `wait_for_checkpoints()` returns once the save in flight is published.
    preemption      SIGUSR1/SIGTERM during fit: every rank saves `last.ckpt` at the end of the same step (flags
                    all-reduced asynchronously on a gloo group, one step late) and stops; `preempted` says so
                    (lit_lm/strategies/preemption.py; the CLI then exits with REQUEUE_EXIT_CODE).
    SIGTERM         Lightning's broadcast of rank 0's SIGTERM flag (a host sync on GPUs) runs after logging steps,
                    not at every step (`_sigterm_check_at_logging_steps`).
    failures        `timeout` (seconds, or a timedelta) bounds every collective; when one fails (a dead or hung
                    peer) `on_exception` prints which rank is lost and this rank's last collectives
                    (`lit_lm/strategies/watchdog.py`), then the error propagates and the process exits non-zero.

Hooks for subclasses (all optional)
    parallelize(fitting)            after the module is precision-converted and on its device, before the
                                    optimizers exist: broadcast replicas, shard, register gradient hooks (when
                                    `fitting`; they must be removed again in `teardown()`).
    finish_grad_sync()              after backward, before clipping and the step: wait for gradient collectives
                                    and put the reduced gradients where the optimizer reads them.
    after_optimizer_step(optimizer) after the update: e.g. all-gather updated shards, free gradients.
    grad_norm_shards() -> GradShards the gradients this rank holds, which of them it owns uniquely, and the groups
                                    to sum the squares over (default: all local grads, no collective).
    lightning_module_state_dict()   what is saved as "model" (FQN -> Tensor or DTensor) and, on load, the
                                    destination `dcp.load` writes into (default: the module's full state dict).
    optimizer_state(optimizer)      likewise for "optimizer_<i>": {"state": {fqn: {...}}, "param_groups": [...]}
                                    (default: torch's optimizer state re-keyed by FQN).
    init_optimizer_state(optimizer) make the (lazily created) optimizer state exist before loading into it.
    load_sharded_state(state)       apply a loaded {"model", "optimizer_<i>"} dict (DCP-filled in place, or
                                    whole tensors from a single-file checkpoint) to the module and optimizers.

Service for callbacks (pruning, QAT: they never touch strategy internals)
    owned_weights() -> list[WeightShard]  every parameter as this rank holds it: the part the optimizer updates,
                                    the tensor the forward reads, its global shape, and the levels (`Split`:
                                    dim, range, group; outer to inner) that cut the part from the global tensor
                                    (default: whole).
    named_grads() -> list[GradPart]  every gradient as this rank holds it, under its global name and where it
                                    sits in the global gradient (ZeRO-2/3 leave `param.grad` None: this is how
                                    to read them); the parity harness (lit_lm/parity.py) compares these parts.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Generator, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import _init_optim_state
from torch.optim import Optimizer
from typing_extensions import override

from lit_lm.strategies import checkpoint as ckpt
from lit_lm.strategies.async_save import AsyncSaver
from lit_lm.strategies.preemption import Preemption
from lit_lm.strategies import comm
from lit_lm.strategies.errors import ConfigError
from lit_lm.strategies.clip import GradShards, clip_grad_norm_, local_grad_shards, with_global_norm_clip
from lit_lm.strategies.host_malloc import HostMalloc
from lit_lm.strategies.layout import ParallelDims, ParallelLayout
from lit_lm.strategies.placement import nested_index
from lit_lm.strategies.watchdog import failure_report, is_collective_failure

LOST_RANK_GRACE_S = 5.0  # how long survivors of a failed collective wait for each other to check in


@dataclass(frozen=True)
class Split:
    """One level of how a parameter is cut: this rank keeps [start, end) along `dim` of the tensor the level above
    left it (the global tensor, for the first level), one of the `torch.chunk` parts spread over `group`."""

    dim: int
    start: int
    end: int
    group: dist.ProcessGroup


@dataclass(frozen=True)
class WeightShard:
    """One parameter as this rank holds it, so a callback can compute over the *global* tensor (a pruning
    threshold, an N:M group, a channel's scale) whether the weight is whole, ZeRO-, TP- or TP-then-ZeRO-sharded.

    `local` is what the optimizer updates (its state is keyed by it): the global tensor cut by every level of
    `splits`, outer to inner (a model split, tp or ep, then ZeRO's rows of what that left; none: whole). A list, not
    one range, because tp then ZeRO cuts a weight twice, over two groups, and the rows of a column slice are no
    slice of the global tensor's rows. `param` is what the forward reads: `local` itself, or under ZeRO the tensor
    the innermost split (its rows) is cut from (storage only between steps at stages 1-2).
    """

    name: str  # global FQN, relative to the LightningModule
    local: Tensor
    param: nn.Parameter
    global_shape: torch.Size
    splits: tuple[Split, ...] = ()

    @property
    def param_splits(self) -> tuple[Split, ...]:
        """How `param` is cut from the global tensor: every split but ZeRO's rows, which the forward never sees."""
        return self.splits if self.param is self.local else self.splits[:-1]

    @property
    def groups(self) -> list[dist.ProcessGroup]:
        """The groups `local`'s parts are spread over, outer to inner: reducing over each covers the tensor."""
        return [split.group for split in self.splits]

    @property
    def replica(self) -> Optional[Tensor]:
        """The tensor the forward reads when it is a separate tensor with storage (ZeRO-1/2), else None: a callback
        that edits `local` must edit this too, or the next forward sees the old values."""
        if self.param is self.local:
            return None
        return self.param.data if self.param.untyped_storage().nbytes() else None

    @property
    def index(self) -> tuple[slice, ...]:
        """Where `local` sits in the global tensor (() when it is all of it)."""
        return _index(self.splits)

    @property
    def param_index(self) -> tuple[slice, ...]:
        """Where `param` sits in the global tensor (() when it is all of it)."""
        return _index(self.param_splits)


def _index(splits: tuple[Split, ...]) -> tuple[slice, ...]:
    return nested_index((split.dim, split.start, split.end) for split in splits)


@dataclass(frozen=True)
class GradPart:
    """A parameter's gradient as this rank holds it: `grad` is `global_grad[index]` of the gradient of the
    parameter called `name` (global FQN) with `global_shape`; `index` is () for a whole gradient. `grad` is None
    where the parameter got none (frozen). Replicas (dp, a tied copy on another stage) hold the same part."""

    name: str
    global_shape: torch.Size
    index: tuple[slice, ...]
    grad: Optional[Tensor]


def whole_weights(module: nn.Module) -> list[WeightShard]:
    """Every parameter of `module` as a whole `WeightShard` (no strategy, or a strategy that does not shard)."""
    return [WeightShard(name, p, p, p.shape) for name, p in module.named_parameters()]


class BaseStrategy(ParallelStrategy):
    """Shared plumbing of lit-lm's hand-written parallel strategies (see the module docstring for the hooks)."""

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta, None] = default_pg_timeout,
        async_checkpoint: bool = True,
    ) -> None:
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        self.num_nodes = 1  # the connector only sets num_nodes on strategies that have the attribute
        self._process_group_backend = process_group_backend
        # seconds from yaml (`trainer.strategy.init_args.timeout: 600`), or a timedelta from Python
        self._timeout = timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout
        self._layout: Optional[ParallelLayout] = None
        self._described = False
        self._sync_enabled = True
        # checkpoints saved during fit are written in the background (async_save.py); False: in the step
        self._saver = AsyncSaver(self._timeout) if async_checkpoint else None
        self._preemption: Optional[Preemption] = None
        self._host_malloc: Optional[HostMalloc] = None  # a CPU rank's (setup_environment)

    # -- processes and groups ---------------------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        # Without this Lightning injects no DistributedSampler and ignores `self.log(..., sync_dist=True)`.
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str:
        return self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)

    @property
    def layout(self) -> ParallelLayout:
        if self._layout is None:
            raise RuntimeError(f"{type(self).__name__}.layout is built in setup_environment(); it is not ready yet")
        return self._layout

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.layout.dp_size, "rank": self.layout.dp_rank}

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # Some environments' setters are no-ops: read the rank back through the getter.
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        expected = self.num_processes * self.num_nodes
        declared = os.environ.get("WORLD_SIZE")
        if self.cluster_environment.creates_processes_externally and declared and int(declared) != expected:
            raise ValueError(
                f"the launcher started WORLD_SIZE={declared} processes, but `trainer.devices` "
                f"({self.num_processes}) x `trainer.num_nodes` ({self.num_nodes}) = {expected}: set them so their "
                f"product is {declared} (e.g. devices = processes per node, num_nodes = nodes)"
            )
        self.parallel_dims(expected)  # a bad layout fails here, before any process starts
        # Always a launcher: under torchrun/SLURM it spawns nothing but validates devices x num_nodes.
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.root_device.type == "cpu":  # resident memory = what the rank holds (lit_lm/strategies/host_malloc.py)
            self._host_malloc = HostMalloc()
            self._host_malloc.start()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, self.process_group_backend, timeout=self._timeout,
                              device_id=device_id)
        self._layout = ParallelLayout.get(self.parallel_dims(dist.get_world_size()), timeout=self._timeout)
        if not self._described:  # once per process: Lightning sets the environment up again for validate/test
            self._described = True
            rank_zero_info(f"lit-lm layout: {self.describe_layout()}")

    def parallel_dims(self, world: int) -> ParallelDims:
        """Hook: the sizes of the parallel dimensions on `world` ranks (validated). The base: data parallel only."""
        return ParallelDims.of(world)

    def describe_layout(self) -> str:
        """Hook: the resolved layout in one line, printed once at start (rank 0), so a run says which layout ran."""
        d = self.layout.dims
        return (f"{dist.get_world_size()} ranks = pp {d.pp} × dp_replicate {d.dp_replicate} × dp_shard {d.dp_shard} "
                f"× cp {d.cp} × tp {d.tp}, ep {d.ep}")

    # -- precision --------------------------------------------------------------------------------------------
    @property
    @override
    def precision_plugin(self) -> Precision:
        # Never cache a default here: the connector reads `_precision_plugin` to see whether the user set one.
        plugin = self._precision_plugin if self._precision_plugin is not None else Precision()
        return with_global_norm_clip(plugin, self.clip_grad_norm_)

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = None if plugin is None else with_global_norm_clip(plugin, self.clip_grad_norm_)

    # -- setup and teardown -------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.parallelize(fitting)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            self._watch_preemption(trainer)
        _sigterm_check_at_logging_steps(trainer)
        self._trim_host_memory(setup=True)  # what building and sharding the model freed (ZeRO-3: whole parameters)

    def _watch_preemption(self, trainer: Trainer) -> None:
        """SIGUSR1/SIGTERM -> a checkpoint at a step every rank agrees on, then a requeue (preemption.py)."""
        if self._preemption is None:
            self._preemption = Preemption(dist.new_group(backend="gloo", timeout=self._timeout))
        if self._preemption not in trainer.callbacks:
            trainer.callbacks.append(self._preemption)

    @property
    def preempted(self) -> bool:
        """The last fit stopped for a preemption, its checkpoint saved: exit with `REQUEUE_EXIT_CODE`."""
        return self._preemption is not None and self._preemption.preempted

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        self._reset_optimizers_and_schedulers()  # a second fit() must not keep the first one's optimizers
        super().setup_optimizers(trainer)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def parallelize(self, fitting: bool) -> None:
        """Hook: make the module parallel (see the module docstring). The base keeps it as it is."""

    # -- the training step ----------------------------------------------------------------------------------------
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = True

    @override
    def optimizer_step(self, optimizer: Union[Optimizer, LightningOptimizer], closure: Callable[[], Any],
                       model: Optional[Union[LightningModule, nn.Module]] = None, **kwargs: Any) -> Any:
        def closure_then_sync() -> Any:
            # Lightning runs on_before_optimizer_step and clipping right after this returns: the grads must be
            # final by then.
            result = closure()
            self.finish_grad_sync()
            self._trim_host_memory()
            return result

        output = super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)
        self.after_optimizer_step(optimizer)
        self._trim_host_memory()
        return output

    def _trim_host_memory(self, setup: bool = False) -> None:
        """On a CPU rank, hand what the phase freed back to the system (lit_lm/strategies/host_malloc.py)."""
        if self._host_malloc is not None:
            self._host_malloc.trim(setup)

    def finish_grad_sync(self) -> None:
        """Hook: complete the gradient collectives started during backward."""

    def after_optimizer_step(self, optimizer: Union[Optimizer, LightningOptimizer]) -> None:
        """Hook: work after the parameter update."""

    # -- clipping -----------------------------------------------------------------------------------------------
    def grad_norm_shards(self) -> GradShards:
        """Hook: the gradients this rank holds for the global norm (default: all local, no collective)."""
        return local_grad_shards(self.lightning_module, self.root_device)

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clip to a global L2 norm of `max_norm`; logs and returns the pre-clip norm."""
        norm = clip_grad_norm_(self.grad_norm_shards(), max_norm)
        self.lightning_module.log("grad_norm", norm)
        return norm

    # -- service for callbacks -----------------------------------------------------------------------------------
    def owned_weights(self) -> list[WeightShard]:
        """Every parameter as this rank holds it (same order on all ranks; see `WeightShard`). Default: whole."""
        return whole_weights(self.lightning_module)

    def layer_groups(self) -> list[Optional[dist.ProcessGroup]]:
        """The groups that together reach every rank running this rank's layers, to reduce a layer's statistic over:
        the world (None), except under pipeline parallelism, where a layer lives on one stage: there, the stage's
        own groups (a reduce over the world would pair different stages' layers, and hang)."""
        layout = self.layout
        if layout.pp_size == 1:
            return [None]
        return [layout.group(name) for name in ("dp", "cp", "tp") if layout.size(name) > 1]

    def named_grads(self) -> list[GradPart]:
        """Every parameter's gradient as this rank holds it, under its global name (see `GradPart`): what the
        optimizer steps with, read between the gradient collectives and the update (`on_before_optimizer_step`,
        pre-clip there). Under ZeRO-2/3 `param.grad` is None: the reduced gradient lives only in this shard."""
        return [GradPart(ws.name, ws.global_shape, ws.index, ws.local.grad) for ws in self.owned_weights()]

    # -- collectives for Lightning (logging, callbacks): objects and metrics, not model traffic; still through the
    # accounting layer, so the flight recorder names a hang in them ------------------------------------------------
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if _distributed_is_initialized():
            comm.barrier(label=f"strategy.barrier {name}" if name else "strategy.barrier")

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        return comm.broadcast_object(obj, src, label="strategy.broadcast")

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Union[Tensor, Any]:
        """Lightning's metric sync (`self.log(..., sync_dist=True)`) and other small reductions (the MoE router
        counts): sum, mean, max or min over `group` (default: the world), as a new tensor."""
        if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
            return tensor
        name = (reduce_op or "mean").lower() if isinstance(reduce_op, str) else None
        mean = name in ("mean", "avg") or reduce_op == ReduceOp.AVG
        ops = {"sum": ReduceOp.SUM, "mean": ReduceOp.SUM, "avg": ReduceOp.SUM, "max": ReduceOp.MAX,
               "min": ReduceOp.MIN}
        if name is not None and name not in ops:
            raise ValueError(f"reduce_op {reduce_op!r}: use sum, mean, max or min")
        op = ReduceOp.SUM if mean else ops[name] if name is not None else reduce_op
        out = tensor.detach().clone() if tensor.is_floating_point() or not mean else tensor.detach().float()
        comm.all_reduce(out, group, op, label="strategy.reduce")
        return out / dist.get_world_size(group) if mean else out

    # -- checkpoints ----------------------------------------------------------------------------------------------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the (sharded) parameters and optimizer state must exist to be loaded into

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # done in load_checkpoint, by FQN

    def param_names(self) -> dict[Tensor, str]:
        """Parameter -> FQN relative to the LightningModule (a tied parameter gets its first name)."""
        return {p: name for name, p in self.lightning_module.named_parameters()}

    @override
    def optimizer_state(self, optimizer: Union[Optimizer, LightningOptimizer]) -> dict[str, Any]:
        return ckpt.optimizer_state_by_fqn(_unwrap(optimizer), self.param_names())

    def init_optimizer_state(self, optimizer: Optimizer) -> None:
        _init_optim_state(optimizer)

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        module = self.lightning_module
        module.load_state_dict(state["model"], strict=module.strict_loading)
        for i, optimizer in enumerate(self.optimizers):
            if f"optimizer_{i}" in state:
                ckpt.load_optimizer_state_by_fqn(_unwrap(optimizer), state[f"optimizer_{i}"], self.param_names())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Union[str, Path],
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint writes with torch.distributed.checkpoint and "
                            "takes no storage_options")
        path = Path(self.broadcast(filepath))  # every rank must write to the same directory
        state = {"model": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        topology = {"strategy": type(self).__name__, **asdict(self.layout.dims)}
        background = self._saver if self._saving_in_background() else None
        # what the shards hold: the step's model, and its optimizers unless the save is weights-only
        contents = (checkpoint.get("global_step"), tuple(state))
        if background is not None and background.last is not None and background.last[0] == contents and \
                background.last[1] != path:  # `last.ckpt` right after `step=N.ckpt`: the same shards, linked
            if self.is_global_zero:
                source, meta = background.last[1], ckpt.serialize_meta(checkpoint)
                background.after_publish(lambda: ckpt.save_alias(source, path, meta))
            return
        self.wait_for_checkpoints()  # at most one save in flight
        if background is not None:
            state = background.stage(state)  # the step waits for this copy only
            background.last = (contents, path)
        ckpt.save(path, state, checkpoint, topology, background=background)

    def _saving_in_background(self) -> bool:
        """During fit (ModelCheckpoint's saves); a save called after fit returns (or outside it) is written before
        it returns, as callers of `trainer.save_checkpoint` expect."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return (self._saver is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING
                and trainer.state.status == TrainerStatus.RUNNING)

    def wait_for_checkpoints(self) -> None:
        """Return once the checkpoint being written in the background (if any) is published; raise its error."""
        if self._saver is not None:
            self._saver.wait()

    @override
    def remove_checkpoint(self, filepath: Union[str, Path]) -> None:
        if self.is_global_zero:
            def remove() -> None:
                ckpt.remove(filepath)
                ckpt.remove_stale(Path(filepath).parent)

            if self._saver is not None:
                self._saver.after_publish(remove)  # never before the save in flight is complete
            else:
                remove()

    @override
    def teardown(self) -> None:
        try:
            if self._saver is not None:
                self._saver.close()  # the last checkpoint is published before the process group goes
        finally:
            super().teardown()

    @override
    def load_checkpoint(self, checkpoint_path: Union[str, Path], weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        optimizers = [_unwrap(o) for o in self.optimizers]
        for optimizer in optimizers:  # either format loads into the live (sharded) state
            self.init_optimizer_state(optimizer)
        if not path.is_dir():
            return self._load_single_file(path, weights_only)
        state = {"model": self.lightning_module_state_dict()}
        state.update({f"optimizer_{i}": self.optimizer_state(o) for i, o in enumerate(optimizers)})
        meta = ckpt.load(path, state)  # every file read safely (weights_only), whatever `weights_only` says
        self._refuse_weights_only(path, sum(f"optimizer_{i}" in state for i in range(len(optimizers))))
        self.load_sharded_state(state)
        return meta

    def _refuse_weights_only(self, path: Path, saved_optimizers: int) -> None:
        """A fit resumes the optimizers too: a checkpoint without their state (`save_weights_only=True`) is refused
        in one line, as Lightning's own strategies refuse it, instead of restarting AdamW's moments from zero."""
        trainer = self.lightning_module.trainer
        if trainer.state.fn == TrainerFn.FITTING and saved_optimizers < len(self.optimizers):
            raise ConfigError(
                f"{path} holds no optimizer state (a ModelCheckpoint(save_weights_only=True) save), so a fit cannot "
                "resume from it (ckpt_path): resume from a full checkpoint")

    def _load_single_file(self, path: Path, weights_only: Optional[bool]) -> dict[str, Any]:
        """A plain Lightning checkpoint (e.g. from a single-device run): whole tensors, index-keyed optimizers."""
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=True)  # never code from a checkpoint
        self._refuse_weights_only(path, len(checkpoint.get("optimizer_states", [])))
        state = {"model": checkpoint["state_dict"]}
        names = self.param_names()
        saved_fqns = checkpoint.get(ckpt.OPTIMIZER_FQNS)  # else the saving optimizer held the same parameters
        for i, (optimizer, saved) in enumerate(zip(self.optimizers, checkpoint.get("optimizer_states", []))):
            groups = saved_fqns[i] if saved_fqns else [[names[p] for p in g["params"]]
                                                       for g in _unwrap(optimizer).param_groups]
            state[f"optimizer_{i}"] = ckpt.fqn_keyed(saved, groups)
        self.load_sharded_state(state)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in load_checkpoint, into the live tensors

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded in load_checkpoint, by FQN

    # -- failures -----------------------------------------------------------------------------------------------
    @override
    def on_exception(self, exception: BaseException) -> None:
        if _distributed_is_initialized() and dist.get_world_size() > 1 and is_collective_failure(exception):
            grace = min(LOST_RANK_GRACE_S, self._timeout.total_seconds()) if self._timeout else LOST_RANK_GRACE_S
            print(failure_report(exception, grace), file=sys.stderr, flush=True)


def _sigterm_check_at_logging_steps(trainer: Trainer) -> None:
    """Lightning (2.5+) broadcasts rank 0's SIGTERM flag at the start of every training batch of a distributed run
    (`_TrainingEpochLoop._broadcast_sigterm_tensor`): the flag copied to the device, a world broadcast, `.item()`.
    On a GPU that is a host sync per step: the CPU waits for the last step's kernels instead of queueing the next
    step's (Lightning-AI/pytorch-lightning#21487, which proposes an interval). Here it runs at the batch after each
    step Lightning logs (every `log_every_n_steps`; every batch when that is 0 or 1), where the host has just read
    the logged metrics and the device has nothing queued; the same batches on every rank (loop state, not time).
    A rank that receives SIGTERM itself still stops at the end of its batch (Lightning checks its own flag there,
    with no collective); rank 0's flag reaches ranks that received none after the next logging step."""
    loop = trainer.fit_loop.epoch_loop
    every_step = getattr(loop, "_broadcast_sigterm_tensor", None)
    if every_step is None or getattr(every_step, "at_logging_steps", False):  # another Lightning, or done already
        return

    def at_logging_steps() -> None:
        every = trainer.log_every_n_steps
        if every <= 1 or loop._batches_that_stepped % every == 0:  # the last step logged (`should_update_logs`)
            every_step()

    at_logging_steps.at_logging_steps = True  # type: ignore[attr-defined]
    loop._broadcast_sigterm_tensor = at_logging_steps  # type: ignore[method-assign]


def _unwrap(optimizer: Union[Optimizer, LightningOptimizer]) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
