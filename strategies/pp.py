"""`pp`: pipeline parallelism (GPipe, 1F1B, interleaved 1F1B, ZB-H1) as a Lightning strategy, composable with DP.

Each pipeline rank keeps only the model pieces it owns (`PipelineModel.pipeline_split`: its blocks under their
global names, the embedding on the first rank, norm + head on the last). The model is built on the meta device
and only the kept pieces are materialised, each parameter from its name (`init_parameter`), so every stage holds
exactly the values one process would.

One Lightning step runs the whole schedule. The LightningModule's own step is called unchanged; only its
`model.loss(inputs, targets)` call is redirected to the `PipelineRunner`, which runs every microbatch's forward
and backward and returns the detached batch loss broadcast from the last stage, so the module logs the same
`train_loss` / `val_loss` on every rank. Then Lightning would call `optimizer.zero_grad()` (after the step,
before backward): the fresh gradients are stashed away from it in `training_step` and put back in `backward`,
which does no autograd. Gradients are zeroed by the strategy itself when an accumulation window opens.

After the last microbatch: the tied embedding/head gradient (one Parameter in the model, one copy on the first
and one on the last stage) is summed over a two-rank "embedding group" (as Megatron), then gradients are averaged
over dp (`GradSync.finish`, no overlap: the schedule's backwards run with sync off). Clipping sums squares over
the pp group, counting the tied copy once. Checkpoints use the base's DCP hooks: each stage saves and loads only
its own keys, and the tied head's optimizer state goes under the embedding's name, so pp sizes can change.
"""

from __future__ import annotations

import copy
import itertools
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any, Generator, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from typing_extensions import override

from strategies import comm
from strategies.base import BaseStrategy, GradPart
from strategies.clip import GradShards
from strategies.ddp import GradSync, broadcast_parameters
from strategies.layout import ParallelLayout, rank_grid
from strategies.plan import PipelineModel, find_block_model
from strategies.pp_runner import PipelineRunner
from strategies.pp_schedules import SCHEDULES, build_schedule
from strategies.pp_split import split_layers

BALANCE = ("layers", "params")
_EMBEDDING_GROUPS: dict[int, dist.ProcessGroup] = {}  # per layout: new_group is collective, build it once


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_parameter(name)
        return True
    except AttributeError:
        return False


def _outside_blocks(model: nn.Module, first: bool) -> float:
    """Parameters the first (or last) stage holds besides its blocks, from a split of a copy (free on meta)."""
    probe = copy.deepcopy(model)
    probe.pipeline_split([], is_first=first, is_last=not first)
    return float(sum(q.numel() for q in probe.parameters()))


class PipelineStrategy(BaseStrategy):
    """`pp`: `pipeline_parallel_size` stages; dp = what is left of the world. See the module docstring.

    Args:
        microbatches: the per-replica batch is cut into this many equal microbatches.
        schedule: gpipe, 1f1b, interleaved_1f1b (with `virtual_stages` chunks per rank) or zb_h1.
        layers_per_stage: fixed layer counts per (virtual) stage, e.g. [3, 2]; otherwise balanced by `balance`
            ("layers", or "params": parameter counts, the embedding and head included).
    """

    def __init__(self, pipeline_parallel_size: int = 2, microbatches: int = 4, schedule: str = "1f1b",
                 virtual_stages: int = 1, layers_per_stage: Optional[list[int]] = None, balance: str = "layers",
                 bucket_cap_mb: float = 25.0, **kwargs: Any) -> None:
        super().__init__(pipeline_parallel_size=pipeline_parallel_size, **kwargs)
        if balance not in BALANCE:
            raise ValueError(f"balance: unknown {balance!r}; choose one of {', '.join(BALANCE)}")
        self._schedule = build_schedule(schedule, pipeline_parallel_size, microbatches, virtual_stages)  # checks
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.virtual_stages = virtual_stages
        self.layers_per_stage = layers_per_stage
        self.balance = balance
        self.bucket_cap_mb = bucket_cap_mb
        self._stage_model: Optional[nn.Module] = None
        self._runner: Optional[PipelineRunner] = None
        self._canonical: dict[str, str] = {}  # LightningModule FQN -> the name of the Parameter's first use
        self._tied: list[nn.Parameter] = []  # parameters whose other use lives on another stage
        self._embedding_group: Optional[dist.ProcessGroup] = None
        self._grad_sync: Optional[GradSync] = None
        self._stash: list[tuple[nn.Parameter, Optional[Tensor]]] = []
        self._window_open = False

    # -- building the stage -------------------------------------------------------------------------------------
    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        # configure_model builds on meta: a stage materialises only what it keeps (see parallelize).
        with torch.device("meta"):
            yield

    @override
    def model_to_device(self) -> None:
        pass  # the model may still be on meta here; parallelize() materialises it, then moves the module

    def parallelize(self, fitting: bool) -> None:
        module = self.lightning_module
        prefix, model = find_block_model(module)
        if not isinstance(model, PipelineModel):
            raise TypeError(f"strategy pp needs a model honouring strategies.plan.PipelineModel (blocks, "
                            f"pipeline_split, pipeline_activation, stage_forward, loss); "
                            f"{type(module).__name__} has none")
        if self._stage_model is not model:  # a second setup (validate after fit) finds the model split already
            self._split(model, prefix + "." if prefix else "")
        super().model_to_device()
        if self.layout.dp_size > 1:
            if fitting:
                self._grad_sync = GradSync(module, self.layout.dp_group, self.bucket_cap_mb)
            else:
                broadcast_parameters(module, self.layout.dp_group)

    def _split(self, model: nn.Module, prefix: str) -> None:
        layout = self.layout
        p, rank, v = layout.pp_size, layout.pp_rank, self.virtual_stages
        uses: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            uses.setdefault(id(param), []).append(name)
        aliases = {name: names for names in uses.values() for name in names}  # by name: to_empty makes new Parameters
        costs, extras = None, (0.0, 0.0)
        if self.balance == "params":
            costs = [float(sum(q.numel() for q in block.parameters())) for block in model.blocks.values()]
            extras = (_outside_blocks(model, first=True), _outside_blocks(model, first=False))
        stages = split_layers(len(model.blocks), p, v, self.layers_per_stage, costs, *extras)
        chunk_layers = [stages[c * p + rank] for c in range(v)]
        model.pipeline_split(sorted(itertools.chain(*chunk_layers)), is_first=rank == 0, is_last=rank == p - 1)

        if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
            model.to_empty(device=self.root_device)
            for names in {tuple(a) for a in aliases.values()}:  # to_empty gives each use its own Parameter: re-tie
                present = [n for n in names if _has(model, n)]
                for name in present[1:]:
                    module_name, _, leaf = name.rpartition(".")
                    setattr(model.get_submodule(module_name), leaf, model.get_parameter(present[0]))
            for name, param in model.named_parameters():
                model.init_parameter(aliases[name][0], param)  # a tied head gets the embedding's values
        leftover = [n for n, t in itertools.chain(self.lightning_module.named_parameters(),
                                                   self.lightning_module.named_buffers()) if t.is_meta]
        if leftover:
            raise RuntimeError(f"strategy pp materialises the PipelineModel only; {leftover[:3]} were built on the "
                               "meta device in configure_model: build them in the LightningModule's __init__")

        kept = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        self._tied = [q for name, q in model.named_parameters() if not set(aliases[name]) <= kept]
        self._canonical = {prefix + name: prefix + aliases[name][0]
                           for name, _ in model.named_parameters(remove_duplicate=False)}
        if p > 1 and any(len(names) > 1 for names in uses.values()):
            self._embedding_group = self._first_last_group(layout)
        self._stage_model = model
        self._runner = PipelineRunner(model, self._schedule, rank, chunk_layers, layout.pp_group)

    @staticmethod
    def _first_last_group(layout: ParallelLayout) -> dist.ProcessGroup:
        """The two-rank group of the first and last stage of this rank's pipeline (all ranks build all of them)."""
        if id(layout) not in _EMBEDDING_GROUPS:
            pipelines = rank_grid(layout.world_size, pp=layout.pp_size, tp=layout.tp_size)["pp"]
            group, _ = dist.new_subgroups_by_enumeration([[g[0], g[-1]] for g in pipelines])
            comm.name_group(group, "pp_embedding")
            _EMBEDDING_GROUPS[id(layout)] = group
        return _EMBEDDING_GROUPS[id(layout)]

    # -- steps --------------------------------------------------------------------------------------------------
    @contextmanager
    def _pipelined(self, train: bool) -> Generator[None, None, None]:
        """Inside, the model's `loss(inputs, targets)` runs the whole schedule: the LightningModule's step (its
        batch handling, metrics and logging) stays as it is and only the model call becomes a pipeline."""
        assert self._stage_model is not None and self._runner is not None
        calls = []

        def pipelined_loss(inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
            calls.append(inputs.shape)
            if len(calls) > 1:
                raise RuntimeError("strategy pp runs the whole schedule per model.loss() call: call it once per step")
            if inputs.shape[0] % self.microbatches:
                raise ValueError(f"microbatches={self.microbatches} must divide the per-replica batch size "
                                 f"{inputs.shape[0]}: change microbatches or the batch size")
            with self._grad_sync.no_sync() if self._grad_sync is not None and train else nullcontext():
                return self._runner.run(inputs, targets, train)

        self._stage_model.loss = pipelined_loss  # an instance attribute shadows the method
        try:
            yield
        finally:
            del self._stage_model.loss
        if not calls:
            raise RuntimeError("strategy pp needs the LightningModule's step to compute its loss with "
                               "`model.loss(inputs, targets)`; it never called it")

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        params = [q for q in self.lightning_module.parameters() if q.requires_grad]
        if not self._window_open:  # Lightning zeroes only after this step: clear the last window's gradients
            for q in params:
                q.grad = None
            self._window_open = True
        with self._pipelined(train=True):
            output = super().training_step(*args, **kwargs)
        # Lightning calls optimizer.zero_grad() next, then backward(): keep the gradients out of its way.
        self._stash = [(q, q.grad) for q in params]
        for q in params:
            q.grad = None
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        # Every backward already ran inside the schedule; give back the gradients zero_grad would have taken.
        for q, grad in self._stash:
            q.grad = grad
        self._stash = []
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._pipelined(train=False):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._pipelined(train=False):
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("strategy pp has no predict (generation needs the whole model on one rank): "
                                  "convert the checkpoint (scripts/ckpt.py convert) and predict on one device")

    # -- gradients ----------------------------------------------------------------------------------------------
    def finish_grad_sync(self) -> None:
        if self._embedding_group is not None:
            for q in self._tied:
                if q.grad is None:
                    q.grad = torch.zeros_like(q)
                comm.all_reduce(q.grad, self._embedding_group)
        if self._grad_sync is not None:
            self._grad_sync.finish()

    def after_optimizer_step(self, optimizer: Any) -> None:
        self._window_open = False

    def grad_norm_shards(self) -> GradShards:
        """Stages hold disjoint parameters (dp replicas equal ones): sum over pp, the tied copy counted on the
        first stage only."""
        params = [q for q in self.lightning_module.parameters() if q.grad is not None]
        counted = [q.grad for q in params if self.layout.pp_rank == 0 or all(q is not t for t in self._tied)]
        groups = [self.layout.pp_group] if self.layout.pp_size > 1 else []
        return GradShards([q.grad for q in params], counted, groups)

    def named_grads(self) -> list[GradPart]:
        """A tied copy on another stage is named as its first use (the name a one-process run gives it)."""
        return [replace(g, name=self._canonical.get(g.name, g.name)) for g in super().named_grads()]

    # -- checkpoints --------------------------------------------------------------------------------------------
    def param_names(self) -> dict[Tensor, str]:
        # The tied head's optimizer state is saved under the embedding's name, as a one-process run names it.
        return {q: self._canonical.get(name, name) for q, name in super().param_names().items()}

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        """A single-file checkpoint holds every stage's tensors: this stage takes its own (a missing one fails)."""
        own = self.lightning_module.state_dict().keys()
        state["model"] = {k: v for k, v in state["model"].items() if k in own}
        super().load_sharded_state(state)

    @override
    def teardown(self) -> None:
        if self._grad_sync is not None:
            self._grad_sync.remove_hooks()
            self._grad_sync = None
        module = self.lightning_module
        if module is not None and any(p.is_meta for p in module.parameters()):
            self._lightning_module = None  # the split failed: nothing was materialised to move back to the CPU
        super().teardown()


__all__ = ["PipelineStrategy", "SCHEDULES", "split_layers"]
