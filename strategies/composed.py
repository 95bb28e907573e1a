"""`ComposedStrategy`: every parallelism of lit-lm on one N-D layout, applied to the model in one fixed order.

The model says WHAT can be split (its plans, `strategies/plan.py`); this strategy decides HOW, always in this order:

    1. TP (+SP)      `tp_layers.parallelize_model`: the planned linears, embedding, head and loss keep their tp
                     slice (sequence parallel: norms and the residual stream see 1/tp of the positions)
    2. CP            `cp.parallelize_context`: each block's attention core becomes ring (or all-gather) attention
                     over the cp group, on the heads TP left this rank; the step feeds the rank its zigzag share
                     of every sequence (`_context_split`)
    3. EP            `ep.shard_experts`: each MoE layer keeps its E/ep experts and moves tokens by all-to-all
                     over the ep group (carved from dp_shard x cp, see `strategies/layout.py`)
    4. pipeline      `pipeline_split`: the stage keeps its blocks (and the embedding / norm + head); the
                     `PipelineRunner` runs the schedule in place of the model's `loss`
    5. materialise   a model built on the meta device (pp, ZeRO-3) gets its values one parameter at a time, each
                     initialised whole from its global name and sliced to this rank's placement (`placement.py`)
    6. activation checkpointing of every block the stage keeps (`strategies/ac.py`)
    7. data parallel `GradSync` (all-reduce over dp, dp x cp under cp) or the ZeRO engine (stage 1-3 over
                     dp_shard (x cp), all-reduced over dp_replicate: HSDP); with experts, a second one over edp

so TP, CP and EP see the whole model, the pipeline cuts a model whose pieces are already tp/ep-local, and ZeRO
shards what this rank finally holds. After every backward window the gradients are finished in the reverse
order: DP/ZeRO reduce (the dp (x cp) mean), experts divided by ep (their all-to-all summed the ep peers' tokens), tp
partial gradients summed (norms under SP), the tied embedding/head summed over the first and last stage.

The names of the first wave (`lm_ddp`, `zero1-3`, `tp`, `pp`, `ep`) are presets of this class
(`strategies/registry.py`). Every combination the engines cannot compose is refused at construction, naming
what works instead.
"""

from __future__ import annotations

import copy
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Generator, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim import Optimizer
from typing_extensions import override

from strategies import ac, comm
from strategies import cp as context
from strategies import checkpoint as ckpt
from strategies.base import BaseStrategy, GradPart, Split, WeightShard, _unwrap
from strategies.clip import GradShards
from strategies.grad_sync import GradSync, broadcast_parameters, flat_step
from strategies.experts import ExpertShard, shard_experts
from strategies.errors import ConfigError
from strategies.layout import ParallelDims
from strategies.placement import Placement, global_index, init_local, materialize
from strategies.plan import ContextParallelModel, ExpertModel, PipelineModel, TensorParallelModel, find_block_model
from strategies.pp_runner import PipelineRunner
from strategies.pp_schedules import build_schedule
from strategies.pp_split import split_layers
from strategies.tp_layers import TPGroup, TPShards, parallelize_model
from strategies.zero_engine import ShardedParam, ZeroEngine, check_stage, shard_optimizer

BALANCE = ("layers", "params")
PIPELINE_DEFAULTS = {"microbatches": 4, "schedule": "1f1b", "virtual_stages": 1, "balance": "layers"}


@dataclass(eq=False)
class _Param:
    """One parameter as this rank holds it: what the forward reads, where it sits in the global tensor, and (ZeRO)
    the engine and rows the optimizer updates."""

    name: str  # global FQN (a tied copy on another stage: the name of the parameter's first use)
    param: nn.Parameter
    placement: Optional[Placement]
    expert: bool
    engine: Optional[ZeroEngine] = None
    rows: Optional[ShardedParam] = None

    @property
    def optimized(self) -> Tensor:
        """The tensor the optimizer holds: the master rows under ZeRO, else the parameter."""
        return self.rows.master if self.rows is not None else self.param

    @property
    def grad(self) -> Optional[Tensor]:
        return self.optimized.grad

    @property
    def global_shape(self) -> torch.Size:
        return self.placement.global_shape if self.placement is not None else self.param.shape

    @property
    def index(self) -> tuple[slice, ...]:
        rows = (self.rows.start, self.rows.end) if self.rows is not None else None
        return global_index(self.placement, rows)


class ComposedStrategy(BaseStrategy):
    """dp x ZeRO x tp x cp x pp x ep on one layout (see the module docstring).

    Args:
        tensor_parallel_size: tp ranks per model replica (neighbouring ranks).
        sequence_parallel: under tp, norms and the residual stream on 1/tp of the positions (default: on).
        pipeline_parallel_size: pipeline stages (outermost ranks).
        microbatches, schedule, virtual_stages, layers_per_stage, balance: the pipeline's (pp > 1 only; see
            `strategies/pp_schedules.py`): gpipe, 1f1b, interleaved_1f1b (virtual_stages chunks per rank), zb_h1.
        context_parallel_size: ranks that split every sequence (zigzag, `strategies/cp.py`; between tp and dp).
        cp_method: ring (default) or allgather, how the cp ranks attend over the whole sequence (cp > 1 only).
        expert_parallel_size: ranks that split each MoE layer's experts, carved from the data-parallel ranks.
        data_parallel_replicate_size: HSDP: whole replicas of the ZeRO shards (dp_shard = what is left).
        zero_stage: 0 (replicated, `GradSync` all-reduce), 1, 2 or 3 (see `strategies/zero_engine.py`).
        bucket_cap_mb: `GradSync`'s gradient buckets (zero_stage 0).
        activation_checkpointing: none, full or selective, per block (`strategies/ac.py`, docs/ac.md).
    """

    def __init__(self, tensor_parallel_size: int = 1, sequence_parallel: Optional[bool] = None,
                 pipeline_parallel_size: int = 1, microbatches: Optional[int] = None, schedule: Optional[str] = None,
                 virtual_stages: Optional[int] = None, layers_per_stage: Optional[list[int]] = None,
                 balance: Optional[str] = None, context_parallel_size: int = 1, cp_method: Optional[str] = None,
                 expert_parallel_size: int = 1, data_parallel_replicate_size: int = 1, zero_stage: int = 0,
                 bucket_cap_mb: float = 25.0,
                 activation_checkpointing: str = "none", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tp_size, self.pp_size, self.ep_size = tensor_parallel_size, pipeline_parallel_size, expert_parallel_size
        self.cp_size, self.replicate_size = context_parallel_size, data_parallel_replicate_size
        for name, size in (("tensor_parallel_size", self.tp_size), ("pipeline_parallel_size", self.pp_size),
                           ("context_parallel_size", self.cp_size),
                           ("expert_parallel_size", self.ep_size), ("data_parallel_replicate_size",
                                                                    self.replicate_size)):
            if not isinstance(size, int) or size < 1:
                raise ConfigError(f"{name}={size!r}: must be an integer >= 1")
        if zero_stage != 0:
            check_stage(zero_stage)
        self.zero_stage = zero_stage
        if sequence_parallel is not None and self.tp_size == 1:
            raise ConfigError("sequence_parallel is a tensor-parallel option: set tensor_parallel_size > 1 or "
                              "remove it")
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel is not False
        if cp_method is not None and self.cp_size == 1:
            raise ConfigError("cp_method is a context-parallel option: set context_parallel_size > 1 or remove it")
        self.cp_method = cp_method or "ring"
        if self.cp_method not in context.METHODS:
            raise ConfigError(f"cp_method: unknown {self.cp_method!r}; choose one of {', '.join(context.METHODS)}")
        pipeline = dict(microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages,
                        balance=balance, layers_per_stage=layers_per_stage)
        given = [k for k, v in pipeline.items() if v is not None]
        if self.pp_size == 1 and given:
            raise ConfigError(f"{', '.join(given)}: pipeline options, but pipeline_parallel_size is 1: set "
                              "pipeline_parallel_size > 1 or remove them")
        opts = {**PIPELINE_DEFAULTS, **{k: v for k, v in pipeline.items() if v is not None}}
        self.microbatches, self.schedule_name = opts["microbatches"], opts["schedule"]
        self.virtual_stages, self.balance = opts["virtual_stages"], opts["balance"]
        self.layers_per_stage = layers_per_stage
        if self.balance not in BALANCE:
            raise ConfigError(f"balance: unknown {self.balance!r}; choose one of {', '.join(BALANCE)}")
        self._schedule = build_schedule(self.schedule_name, self.pp_size, self.microbatches, self.virtual_stages) \
            if self.pp_size > 1 else None
        self.bucket_cap_mb = bucket_cap_mb
        self.activation_checkpointing = ac.check_mode(activation_checkpointing)
        self._refuse_unsupported()

        self._module: Optional[nn.Module] = None  # the LightningModule the engines were applied to
        self._tp: Optional[TPShards] = None
        self._experts: dict[str, ExpertShard] = {}
        self._placements: dict[str, Placement] = {}  # global FQN (every alias) -> this rank's slice
        self._canonical: dict[str, str] = {}  # global FQN -> the name of the parameter's first use
        self._tied: list[nn.Parameter] = []  # parameters whose other use lives on another pipeline stage
        self._init_fn: Optional[Callable[[str, Tensor], None]] = None  # fills a materialised tensor by global name
        self._stage_model: Optional[nn.Module] = None
        self._cp_model: Optional[nn.Module] = None  # the block model whose `loss` gets zigzag shares under cp
        self._runner: Optional[PipelineRunner] = None
        self._syncs: list[GradSync] = []
        self._engines: list[ZeroEngine] = []
        self._engines_for: Optional[tuple[nn.Module, list[ZeroEngine]]] = None  # kept for a validate after fit
        self._params: list[_Param] = []  # every parameter, in `named_parameters()` order
        self._by_param: dict[nn.Parameter, _Param] = {}
        self._stash: list[tuple[Tensor, Optional[Tensor]]] = []
        self._window_open = False

    def _refuse_unsupported(self) -> None:
        """Combinations the engines do not compose, each with the one that works."""
        if self.zero_stage == 3 and self.pp_size > 1:
            raise ConfigError("zero_stage=3 with pipeline_parallel_size > 1: a stage holds 1/pp of the model "
                              "already and the schedule's split backward bypasses ZeRO-3's gathers; use "
                              "zero_stage 1 or 2 with pipeline parallelism")
        if self.zero_stage == 3 and self.ep_size > 1:
            raise ConfigError("zero_stage=3 with expert_parallel_size > 1: expert shards are not gathered by "
                              "ZeRO-3's units; use zero_stage 1 or 2 with expert parallelism")
        if self.ep_size > 1 and self.replicate_size > 1:
            raise ConfigError("expert_parallel_size > 1 with data_parallel_replicate_size > 1: ep is carved from "
                              "dp_shard only; set data_parallel_replicate_size to 1")
        if self.cp_size > 1 and self.pp_size > 1:
            raise ConfigError("context_parallel_size > 1 with pipeline_parallel_size > 1: the pipeline runner does "
                              "not feed the stages zigzag shares; use cp with dp, tp and ZeRO, or pp without cp")
        if self.cp_size > 1 and self.ep_size > 1:
            raise ConfigError("context_parallel_size > 1 with expert_parallel_size > 1: MoE balancing losses would "
                              "count one rank's tokens only; use ep without cp, or a dense model with cp")
        if self.replicate_size > 1 and self.zero_stage == 0:
            raise ConfigError("data_parallel_replicate_size > 1 without ZeRO: HSDP replicates ZeRO shards; set "
                              "zero_stage (1-3), or drop data_parallel_replicate_size (plain data parallel)")

    @override
    def _configure_launcher(self) -> None:
        if self.num_nodes > 1 and self.num_processes % self.tp_size:  # one node: the layout's own error says it
            warnings.warn(f"tensor_parallel_size={self.tp_size} does not divide trainer.devices={self.num_processes} "
                          "(per node): tp groups span nodes and their per-layer collectives cross the slow network; "
                          "use a tp size that divides the devices of a node", stacklevel=2)
        super()._configure_launcher()

    def parallel_dims(self, world: int) -> ParallelDims:
        return ParallelDims.of(world, pp=self.pp_size, dp_replicate=self.replicate_size, cp=self.cp_size,
                               tp=self.tp_size, ep=self.ep_size)

    def describe_layout(self) -> str:
        parts = [super().describe_layout(), f"ZeRO stage {self.zero_stage}"]
        if self.pp_size > 1:
            parts.append(f"schedule {self.schedule_name} ({self.microbatches} microbatches, {self.virtual_stages} "
                         "virtual stages)")
        if self.cp_size > 1:
            parts.append(f"cp {self.cp_method}")
        if self.tp_size > 1:
            parts.append(f"sequence parallel {'on' if self.sequence_parallel else 'off'}")
        return "; ".join(parts)

    @property
    def _dense_group(self) -> str:
        """The layout group dense gradients are reduced over: every rank that saw other tokens (dp, and cp: its
        ranks hold the same parameters and each computes the mean over its equal share of the tokens), or under
        ZeRO the part of it the rows are sharded over (HSDP all-reduces over dp_replicate on top)."""
        if self.zero_stage:
            return "dp_shard_cp" if self.cp_size > 1 else "dp_shard"
        return "dp_cp" if self.cp_size > 1 else "dp"

    # -- building the model ------------------------------------------------------------------------------------
    @property
    def _on_meta(self) -> bool:
        """Build on the meta device: a stage or a ZeRO-3 shard materialises only what it keeps."""
        return self.pp_size > 1 or self.zero_stage == 3

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        if self._on_meta:  # configure_model builds on meta; `parallelize` materialises this rank's part
            with torch.device("meta"):
                yield
        else:
            yield

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not any(p.is_meta for p in self.model.parameters()):
            super().model_to_device()

    def parallelize(self, fitting: bool) -> None:
        module = self.lightning_module
        if self._module is not module:  # a validate/test after fit finds the model split already
            self._split(module)
            self._module = module
        for model in (m for m in module.modules() if isinstance(m, ExpertModel)):
            model.set_batch_group(self.layout.dp_group)  # MoE balancing statistics over the global batch
        self._data_parallel(fitting)

    def _split(self, module: nn.Module) -> None:
        """Engines 1-5 of the module docstring, once per module."""
        layout = self.layout
        prefix, model = find_block_model(module)
        dot = f"{prefix}." if prefix else ""
        if self.tp_size > 1:
            if not isinstance(model, TensorParallelModel):
                raise ConfigError(f"tensor_parallel_size={self.tp_size}: {type(module).__name__} holds no model with "
                                  "a tensor_parallel_plan() (strategies.plan.TensorParallelModel)")
            group = TPGroup(layout.tp_group, layout.tp_size, layout.tp_rank, self.sequence_parallel)
            self._tp = parallelize_model(model, model.tensor_parallel_plan(), group)
        if self.cp_size > 1:
            if not isinstance(model, ContextParallelModel):
                raise ConfigError(f"context_parallel_size={self.cp_size}: {type(module).__name__} holds no model "
                                  "with a context_parallel_plan() (strategies.plan.ContextParallelModel)")
            data = getattr(getattr(module, "_trainer", None), "datamodule", None)  # refused here, not at step 1
            seq_len = getattr(data, "seq_len", None)
            if isinstance(seq_len, int) and seq_len % (2 * self.cp_size):
                raise ConfigError(f"context_parallel_size={self.cp_size} splits each sequence into 2·cp="
                                  f"{2 * self.cp_size} zigzag chunks, but seq_len is {seq_len} "
                                  f"(data.init_args.seq_len); use a multiple of {2 * self.cp_size}, or another cp")
            context.parallelize_context(model, layout.group("cp"), self.cp_method)
            self._cp_model = model
        if self.ep_size > 1:
            self._experts = shard_experts(module, layout.group("ep"))
        self._placements = self._placements_of(module)
        uses: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            uses.setdefault(id(p), []).append(name)
        first_use = {name: names[0] for names in uses.values() for name in names}
        if self.pp_size > 1:
            self._split_pipeline(model, dot, first_use)
        self._init_fn = lambda name, t: self._init(model, dot, first_use, name, t)
        self._init_rows = lambda name, t, rows: self._init(model, dot, first_use, name, t, rows)
        if any(t.is_meta for t in module.parameters()) and self.zero_stage != 3:
            with self._rebinding(module):
                materialize(model, self.root_device, self._init_fn, lambda name, t: self._init_buffer(model, name, t))
        leftover = [n for n, t in [*module.named_parameters(), *module.named_buffers()]
                    if t.is_meta and not (self.zero_stage == 3 and n.startswith(dot))]
        if leftover:
            raise ConfigError(f"{leftover[:3]} were built on the meta device outside the block model: build them "
                              "in the LightningModule's __init__, not in configure_model")
        self._canonical = {name: first_use[name] for name, _ in module.named_parameters(remove_duplicate=False)}
        if self.activation_checkpointing != "none":
            ac.apply_activation_checkpointing(model, self.activation_checkpointing)

    @contextmanager
    def _rebinding(self, module: nn.Module) -> Generator[None, None, None]:
        """Materialising (and ZeRO-3) gives the model new Parameter objects: point what the engines recorded about
        the old ones (tp shards, expert shards, tied copies) at the new ones, by name."""
        old = dict(module.named_parameters(remove_duplicate=False))
        yield
        new = {old[name]: p for name, p in module.named_parameters(remove_duplicate=False) if name in old}
        if self._tp is not None:
            self._tp.sharded = {new.get(p, p): v for p, v in self._tp.sharded.items()}
            self._tp.partial = [new.get(p, p) for p in self._tp.partial]
        self._tied = [new.get(p, p) for p in self._tied]
        for shard in self._experts.values():
            shard.rebind()

    def _placements_of(self, module: nn.Module) -> dict[str, Placement]:
        out = {}
        sharded = self._tp.sharded if self._tp is not None else {}
        experts = {p: shard for shard in self._experts.values() for p in shard.parameters()}
        for name, p in module.named_parameters(remove_duplicate=False):
            if p in sharded:
                dim, shape = sharded[p]
                start, end = self._tp.tp.rows(shape[dim])
                out[name] = Placement(shape, dim, start, end, "tp")
            elif p in experts:
                shard = experts[p]
                out[name] = Placement(torch.Size((shard.num_experts, *p.shape[1:])), 0, shard.start,
                                      shard.start + shard.num_local, "ep")
        return out

    def _init(self, model: nn.Module, dot: str, first_use: dict[str, str], name: str, tensor: Tensor,
              rows: Optional[tuple[int, int]] = None) -> bool:
        global_name = first_use.get(dot + name, dot + name)
        return init_local(model.init_parameter, global_name[len(dot):], tensor, self._placements.get(dot + name),
                          getattr(model, "init_parameter_part", None), rows)

    @staticmethod
    def _init_buffer(model: nn.Module, name: str, tensor: Tensor) -> None:
        init = getattr(model, "init_buffer", None)
        if init is None:
            raise ConfigError(f"buffer {name} was built on the meta device and {type(model).__name__} has no "
                              "init_buffer(name, tensor): add one, or create the buffer outside configure_model")
        init(name, tensor)

    def _split_pipeline(self, model: Optional[nn.Module], dot: str, first_use: dict[str, str]) -> None:
        if not isinstance(model, PipelineModel):
            raise ConfigError(f"pipeline_parallel_size={self.pp_size}: the model must honour "
                              "strategies.plan.PipelineModel (blocks, pipeline_split, pipeline_activation, "
                              "stage_forward, loss)")
        layout = self.layout
        p, rank, v = layout.pp_size, layout.pp_rank, self.virtual_stages
        costs, extras = None, (0.0, 0.0)
        if self.balance == "params":
            costs = [float(sum(q.numel() for q in block.parameters())) for block in model.blocks.values()]
            extras = (_outside_blocks(model, first=True), _outside_blocks(model, first=False))
        stages = split_layers(len(model.blocks), p, v, self.layers_per_stage, costs, *extras)
        chunk_layers = [stages[c * p + rank] for c in range(v)]
        model.pipeline_split(sorted(layer for chunk in chunk_layers for layer in chunk), is_first=rank == 0,
                             is_last=rank == p - 1)
        kept = {dot + n for n, _ in model.named_parameters(remove_duplicate=False)}
        aliases: dict[str, set[str]] = {}
        for name, first in first_use.items():
            aliases.setdefault(first, set()).add(name)
        self._tied = [q for n, q in model.named_parameters() if not aliases[first_use[dot + n]] <= kept]
        self._stage_model = model
        self._runner = PipelineRunner(model, self._schedule, rank, chunk_layers, layout.pp_group,
                                      seq_shards=self.tp_size if self.sequence_parallel else 1)

    # -- data parallelism --------------------------------------------------------------------------------------
    def _data_parallel(self, fitting: bool) -> None:
        """Engine 6: GradSync or ZeRO over what this rank holds (experts apart, over their own replicas)."""
        layout = self.layout
        module = self.lightning_module
        expert_ids = {id(p) for shard in self._experts.values() for p in shard.parameters()}
        named = list(module.named_parameters())
        experts = [p for _, p in named if id(p) in expert_ids]
        dense = module if not experts else _param_holder([p for _, p in named if id(p) not in expert_ids])
        parts = [(dense, layout.group(self._dense_group))]
        if experts:
            parts.append((_param_holder(experts), layout.group("edp")))
        self._engines, self._syncs = [], []
        if self.zero_stage and (fitting or self.zero_stage == 3):  # ZeRO-3 gathers in any forward
            if self._engines_for is not None and self._engines_for[0] is module:  # a validate after fit
                self._engines = self._engines_for[1]
                for engine in self._engines:
                    engine.attach()
            else:
                replicate = layout.group("dp_replicate") if self.replicate_size > 1 else None
                with self._rebinding(module):
                    self._engines = [ZeroEngine(holder, self.zero_stage, group, self.root_device, replicate,
                                                reduce_in_backward=self.pp_size == 1, init=self._init_fn,
                                                init_rows=self._init_rows)
                                     for holder, group in parts]
                self._engines_for = (module, self._engines)
        elif fitting:
            self._syncs = [GradSync(holder, group, self.bucket_cap_mb)
                           for holder, group in parts
                           if dist.get_world_size(group) > 1]
        else:
            for holder, group in parts:
                broadcast_parameters(holder, group)
        self.model_to_device()
        self._index_params()

    def _index_params(self) -> None:
        rows = {sp.param: (engine, sp) for engine in self._engines for sp in engine.sharded_params()}
        expert_ids = {id(p) for shard in self._experts.values() for p in shard.parameters()}
        self._params = []
        for name, p in self.lightning_module.named_parameters():
            engine, sp = rows.get(p, (None, None))
            self._params.append(_Param(self._canonical.get(name, name), p, self._placements.get(name),
                                       id(p) in expert_ids, engine, sp))
        self._by_param = {rec.param: rec for rec in self._params}
        if self._tp is not None:  # forget what the pipeline split removed
            self._tp.partial = [p for p in self._tp.partial if p in self._by_param]
            self._tp.sharded = {p: v for p, v in self._tp.sharded.items() if p in self._by_param}

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            if self._engines:
                shard_optimizer(_unwrap(optimizer), self._engines)
            elif self._syncs:
                flat_step(_unwrap(optimizer), self._syncs)

    @override
    def teardown(self) -> None:
        for sync in self._syncs:
            sync.remove_hooks()
        for engine in self._engines:
            engine.detach()
            if self.zero_stage == 3:  # Lightning's teardown moves the module to the CPU: give it whole weights
                engine.consolidate(torch.device("cpu"))
        self._syncs, self._engines = [], []
        module = self.lightning_module
        if module is not None and any(p.is_meta for p in module.parameters()):
            self._lightning_module = None  # the split failed: nothing was materialised to move back to the CPU
        super().teardown()

    # -- the step ----------------------------------------------------------------------------------------------
    @contextmanager
    def _no_sync(self) -> Generator[None, None, None]:
        with ExitStack() as stack:
            for sync in [*self._syncs, *self._engines]:
                stack.enter_context(sync.no_sync())
            yield

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        with super().block_backward_sync(), self._no_sync():
            yield

    def finish_grad_sync(self) -> None:
        """The reverse of the engine order: the dp mean, experts / ep, tp partial sums, the tied copy over pp."""
        for sync in self._syncs:
            sync.finish()
        for engine in self._engines:
            engine.finish_grad_sync()
        if self.ep_size > 1:  # each holds the sum over its ep peers' tokens: make it the mean
            grads = [rec.grad for rec in self._params if rec.expert and rec.grad is not None]
            if grads:
                torch._foreach_div_(grads, self.ep_size)
        if self._tp is not None:
            self._tp.sum_partial_grads(lambda p: self._by_param[p].grad)
        if self._tied:
            group = self.layout.group("pp_embedding")
            for p in self._tied:
                rec = self._by_param[p]
                if rec.grad is None:
                    rec.optimized.grad = torch.zeros_like(rec.optimized)
                comm.all_reduce(rec.grad, group, label="pp tied embedding")

    def after_optimizer_step(self, optimizer: Union[Optimizer, LightningOptimizer]) -> None:
        for engine in self._engines:
            engine.after_step()  # all-gather the updated rows into the replicated parameters
        self._window_open = False

    # -- the pipeline: the LightningModule's step runs the whole schedule ---------------------------------------
    @contextmanager
    def _pipelined(self, train: bool) -> Generator[None, None, None]:
        """Inside, the model's `loss(inputs, targets)` runs the whole schedule: the LightningModule's step (its
        batch handling, metrics and logging) stays as it is and only the model call becomes a pipeline."""
        if self._runner is None:
            yield
            return
        runner, calls = self._runner, []

        def pipelined_loss(inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
            calls.append(inputs.shape)
            if len(calls) > 1:
                raise RuntimeError("pipeline parallelism runs the whole schedule per model.loss() call: call it "
                                   "once per step")
            if inputs.shape[0] % self.microbatches:
                raise ConfigError(f"microbatches={self.microbatches} must divide the per-replica batch size "
                                  f"{inputs.shape[0]}: change microbatches or the batch size")
            # Lightning scales the returned loss by 1 / accumulate_grad_batches before a backward that is a no-op
            # here (the schedule ran it): the runner scales its backwards instead
            scale = 1.0 / self.lightning_module.trainer.accumulate_grad_batches
            with self._no_sync() if train else ExitStack():
                return runner.run(inputs, targets, train, loss_scale=scale)

        with _loss_redirected(self._stage_model, pipelined_loss, "pipeline parallelism"):
            yield

    # -- context parallelism: the LightningModule's step sees whole sequences, the model this rank's share -----------
    @contextmanager
    def _context_split(self) -> Generator[None, None, None]:
        """Inside, the model's `loss(inputs, targets)` runs on this cp rank's zigzag share of the whole sequences
        (with their positions, for RoPE). Autograd sees this rank's loss (times the share of valid targets it
        holds, `cp.zigzag_batch`), whose gradients the dp x cp mean makes the whole batch's; the VALUE returned,
        and the cross-entropy, are the cp group's mean, so what the step logs is the whole sequences' loss."""
        if self._cp_model is None:
            yield
            return
        model, group = self._cp_model, self.layout.group("cp")
        local_loss = model.loss

        def context_loss(inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
            share, share_targets, positions, weight = context.zigzag_batch(inputs, targets, group)
            loss, ce = local_loss(share, share_targets, positions)
            loss, ce = loss * weight, ce * weight
            mean = torch.stack((loss.detach(), ce.detach()))
            comm.all_reduce(mean, group, label="cp loss")
            mean /= self.cp_size
            return loss + (mean[0] - loss.detach()), mean[1]

        with _loss_redirected(model, context_loss, "context parallelism"):
            yield

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._runner is None:
            with self._context_split():
                return super().training_step(*args, **kwargs)
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
        if self._runner is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)  # callbacks' on_before_backward
        for q, grad in self._stash:  # every backward already ran inside the schedule
            q.grad = grad
        self._stash = []
        return self.precision_plugin.post_backward(closure_loss, module)  # on_after_backward

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._pipelined(train=False), self._context_split():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._pipelined(train=False), self._context_split():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._cp_model is not None:
            raise ConfigError("context parallelism has no predict (generation decodes one token at a time, on "
                              "the whole sequence): convert the checkpoint (scripts/ckpt.py convert) and predict "
                              "on one device")
        if self._runner is not None:
            raise ConfigError("pipeline parallelism has no predict (generation needs the whole model on one rank): "
                              "convert the checkpoint (scripts/ckpt.py convert) and predict on one device")
        return super().predict_step(*args, **kwargs)

    # -- services: norms, gradients and weights under global names ------------------------------------------------
    def _norm_groups(self) -> list[dist.ProcessGroup]:
        """The groups a global sum over gradients runs over: those the gradients are partitioned across (tp slices,
        pipeline stages, ZeRO rows, experts), never the pure replicas (each replica computes the same sum)."""
        layout = self.layout
        groups = [name for name, size in (("tp", self.tp_size), ("pp", self.pp_size)) if size > 1]
        if self.zero_stage:  # rows over dp_shard (x cp); with experts, over dp (ep x edp)
            groups.append("dp" if self.ep_size > 1 else self._dense_group)
        elif self.ep_size > 1:
            groups.append("ep")
        return [layout.group(name) for name in groups if layout.size(name) > 1]

    def _counted(self, rec: _Param) -> bool:
        """Whether this rank counts `rec`'s gradient in the sums over `_norm_groups`: once per group it is
        replicated on inside them (tp for unsplit parameters, pp for the tied copy, ep for dense ones)."""
        layout = self.layout
        if (rec.placement is None or rec.placement.over != "tp") and self.tp_size > 1 and layout.tp_rank != 0:
            return False
        if layout.pp_rank != 0 and any(rec.param is t for t in self._tied):
            return False
        if self.ep_size > 1 and not self.zero_stage and not rec.expert:
            return layout.rank("ep") == 0
        return True

    def grad_norm_shards(self) -> GradShards:
        """Every gradient the optimizer uses, each element counted once (`_counted`, `_norm_groups`)."""
        recs = [rec for rec in self._params if rec.grad is not None]
        owned = [rec.grad for rec in recs if self._counted(rec)]
        return GradShards([rec.grad for rec in recs], owned, groups=self._norm_groups(), device=self.root_device)

    def named_grads(self) -> list[GradPart]:
        return [GradPart(rec.name, rec.global_shape, rec.index, rec.grad) for rec in self._params]

    def owned_weights(self) -> list[WeightShard]:
        """Each parameter cut as the engines cut it: its tp or ep slice (`placement`), then under ZeRO the rows of
        that slice the optimizer updates, over the engine's group."""
        out = []
        for rec in self._params:
            splits = []
            if rec.placement is not None:
                split = rec.placement
                splits.append(Split(split.dim, split.start, split.end, self.layout.group(split.over)))
            if rec.rows is not None:
                splits.append(Split(0, rec.rows.start, rec.rows.end, rec.engine.group))
            out.append(WeightShard(rec.name, rec.optimized, rec.param, rec.global_shape, tuple(splits)))
        return out

    # -- checkpoints: one format, global names and shapes ---------------------------------------------------------
    def _dtensor(self, rec: _Param, local: Tensor, rows: bool) -> DTensor:
        """`local` (the rank's placement slice, or under ZeRO its rows of a not-split parameter) as a DTensor."""
        shape = rec.global_shape
        if rows:
            mesh = self.layout.device_mesh(self.root_device.type, "dp_replicate", self._dense_group)
            placements = [Replicate(), Shard(0)]
        elif rec.placement.over == "tp":
            mesh, placements = self.layout.device_mesh(self.root_device.type, "tp"), [Shard(rec.placement.dim)]
        else:
            mesh, placements = self.layout.device_mesh(self.root_device.type, "edp", "ep"), [Replicate(), Shard(0)]
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    def _saved(self, rec: _Param, value: Any) -> Any:
        """A tensor shaped like the optimizer's (a parameter, or ZeRO rows) in the checkpoint's format: under ZeRO
        rows of a split parameter are first gathered into the slice (one format whatever the stage)."""
        if not (isinstance(value, Tensor) and value.dim() > 0):
            return value
        if rec.rows is not None and rec.placement is None:
            return self._dtensor(rec, value, rows=True)
        if rec.rows is not None:
            value = rec.rows.gather_rows(value, rec.engine.group)
        return self._dtensor(rec, value, rows=False) if rec.placement is not None else value

    def _live(self, rec: _Param, value: Any) -> Any:
        """The inverse of `_saved`, from what DCP filled in (a DTensor) or a single-file checkpoint's whole tensor."""
        if not (isinstance(value, Tensor) and value.dim() > 0):
            return value
        if isinstance(value, DTensor):
            local = value.to_local()
            if rec.rows is not None and rec.placement is None:
                return local
        else:
            local = value[rec.placement.index] if rec.placement is not None else value
        return local[rec.rows.start: rec.rows.end].clone() if rec.rows is not None else local

    def _records(self) -> dict[str, _Param]:
        """Every name of every parameter (tied aliases too) -> its record."""
        return {name: self._by_param[p] for name, p in self.lightning_module.named_parameters(remove_duplicate=False)}

    def param_names(self) -> dict[Tensor, str]:
        return {rec.optimized: rec.name for rec in self._params}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        records = self._records()
        state = {}
        for name, value in self.lightning_module.state_dict().items():
            rec = records.get(name)
            state[name] = self._saved(rec, rec.optimized.detach()) if rec is not None else value
        return state

    @override
    def optimizer_state(self, optimizer: Union[Optimizer, LightningOptimizer]) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        by_name = {rec.name: rec for rec in self._params}
        # new dicts: torch's optimizer state_dict() hands out its live per-parameter dicts
        state["state"] = {fqn: {k: self._saved(by_name[fqn], v) for k, v in s.items()}
                          for fqn, s in state["state"].items()}
        if self.pp_size > 1:  # a stage names only its parameters, and one rank's groups are written: name them all
            stages = comm.all_gather_object([g["params"] for g in state["param_groups"]], self.layout.pp_group,
                                            label="optimizer groups of every stage")
            for i, group in enumerate(state["param_groups"]):  # in stage order: the one-process order
                group["params"] = list(dict.fromkeys(fqn for names in stages for fqn in names[i]))
        return state

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        records = self._records()
        module = self.lightning_module
        own = module.state_dict().keys()
        missing = [k for k in own if k not in state["model"]]
        if missing and module.strict_loading:
            raise ConfigError(f"the checkpoint lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}: it holds "
                              "another model; load it with strict_loading = False to skip them")
        buffers = dict(module.named_buffers())
        with torch.no_grad():
            for name, value in state["model"].items():
                if name in records:
                    rec = records[name]
                    rec.optimized.copy_(self._live(rec, value))
                elif name in buffers:
                    buffers[name].copy_(value.to_local() if isinstance(value, DTensor) else value)
        by_name = {rec.name: rec for rec in self._params}
        for i, optimizer in enumerate(self.optimizers):
            saved = state.get(f"optimizer_{i}")
            if saved is None:
                continue
            saved["state"] = {fqn: {k: self._live(by_name[fqn], v) for k, v in s.items()}
                              for fqn, s in saved["state"].items() if fqn in by_name}
            ckpt.load_optimizer_state_by_fqn(_unwrap(optimizer), saved, self.param_names())
        for engine in self._engines:
            engine.refresh_params()  # stages 1-2: the loaded master rows into the replicated parameters


@contextmanager
def _loss_redirected(model: nn.Module, loss: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]], what: str
                     ) -> Generator[None, None, None]:
    """Inside, `model.loss` is `loss` (an instance attribute shadows the method), so the LightningModule's step stays
    as it is; a step that never calls it would bypass `what`: refused."""
    calls = []

    def redirected(inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        calls.append(inputs.shape)
        return loss(inputs, targets)

    model.loss = redirected
    try:
        yield
    finally:
        del model.loss
    if not calls:
        raise RuntimeError(f"{what} needs the LightningModule's step to compute its loss with "
                           "`model.loss(inputs, targets)`; it never called it")


def _param_holder(params: list[nn.Parameter]) -> nn.Module:
    """A module over exactly these Parameters (not copies), for an engine that must see only them."""
    holder = nn.Module()
    holder.params = nn.ParameterList(params)
    return holder


def _outside_blocks(model: nn.Module, first: bool) -> float:
    """Parameters the first (or last) stage holds besides its blocks, from a split of a copy (free on meta)."""
    probe = copy.deepcopy(model)
    probe.pipeline_split([], is_first=first, is_last=not first)
    return float(sum(q.numel() for q in probe.parameters()))


