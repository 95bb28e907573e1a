"""`ComposedStrategy`: every parallelism of lit-lm on one N-D layout, applied to the model in one fixed order.

The model says WHAT can be split (its plans, `lit_lm/strategies/plan.py`); this strategy decides HOW, always in this
order (the one description of it; other pages point here):

    1. TP (+SP)      `tp_layers.parallelize_model`: the planned linears, embedding, head and loss keep their tp slice
                     (sequence parallel: norms and the residual stream see 1/tp of the positions)
    2. CP            `cp.parallelize_context`: attention cores become ring (or all-gather) attention over the cp
                     group; the step's loss feeds the rank its zigzag share of every sequence (`cp.context_loss`)
    3. EP            `experts.shard_experts`: each MoE layer keeps its E/ep experts, tokens move by all-to-all
    4. pipeline      `pp_step.split_pipeline`: the stage keeps its blocks (and the embedding / norm + head); the
                     schedule runs as the step's loss (`pp_step.PipelineStep`)
    5. materialise   a model built on the meta device (pp, ZeRO-3) gets its values one parameter at a time, each
                     initialised whole from its global name and sliced to this rank's placement (`placement.py`)
    6. FP8           with the module's `fp8` option, the blocks' linears compute in FP8 (`fp8.py`), the
                     scales of tp-split tensors reduced over tp (the tp placements recorded in step 1)
       activation checkpointing of every block the stage keeps (`lit_lm/strategies/ac.py`)
    7. data parallel `GradSync` (all-reduce over dp, dp x cp under cp) or the ZeRO engine (stage 1-3 over dp_shard
                     (x cp), all-reduced over dp_replicate: HSDP); with experts, a second engine over edp
    8. compile       with the module's `compile` option, each block's forward under `torch.compile`
                     (`lit_lm/strategies/compile.py`): every hook and slice above is in place, the block hooks outside

so TP, CP and EP see the whole model, the pipeline cuts a model whose pieces are already tp/ep-local, and ZeRO
shards what this rank finally holds. Steps 1-4 record what they did by parameter name (`params.ModelSplit`); the
parameter index (`params.ParamIndex`), built once after step 7, answers gradients, norms, owned weights and
checkpoints (`sharded_state.py`) by global name. After each backward window the gradients are finished in the
reverse order: the engines' dp (x cp) mean (`dp_engine.py`), then experts divided by ep, tp partial gradients
summed, the tied embedding/head summed over the first and last stage (`ParamIndex.finish_split_grads`).
The first wave's names (`lm_ddp`, `zero1-3`, `tp`, `pp`, `ep`) are presets of this class
(`lit_lm/strategies/registry.py`); combinations the engines cannot compose are refused at construction
(`layout.REFUSED`).
"""

from __future__ import annotations

import warnings
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any, Generator, Optional, Union

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lit_lm.strategies import ac
from lit_lm.strategies import cp as context
from lit_lm.strategies.cp_balance import DocumentBalancer, HostDocuments
from lit_lm.strategies.base import BaseStrategy, GradPart, WeightShard, _unwrap
from lit_lm.strategies.clip import GradShards
from lit_lm.strategies.compile import CompileReport, check_compile, compile_blocks, wants_compile
from lit_lm.strategies.dp_engine import DataParallelEngine, bind_optimizer, no_sync
from lit_lm.strategies.errors import ConfigError
from lit_lm.strategies.experts import shard_experts
from lit_lm.strategies.flat_step import ELEMENTWISE, elementwise
from lit_lm.strategies.fp8 import apply_fp8
from lit_lm.strategies.grad_sync import GradSync, broadcast_parameters
from lit_lm.strategies.layout import ParallelConfig, ParallelDims
from lit_lm.strategies.params import ModelSplit, ParamIndex
from lit_lm.strategies.orthogonalize import bind_orthogonalizer
from lit_lm.strategies.placement import materialize
from lit_lm.strategies.plan import (ContextParallelModel, ExpertModel, LossFn, StepLoss, TensorParallelModel,
                             find_block_model, require_plan)
from lit_lm.strategies.pp_schedules import build_schedule
from lit_lm.strategies.pp_step import PipelineStep, split_pipeline
from lit_lm.strategies.sharded_state import ShardedState
from lit_lm.strategies.tp_layers import TPGroup, parallelize_model
from lit_lm.strategies.weight_readers import FlushBeforeReaders
from lit_lm.strategies.zero_engine import ZeroEngine


class ComposedStrategy(BaseStrategy):
    """dp x ZeRO x tp x cp x pp x ep on one layout (see the module docstring); `config` is its `ParallelConfig`
    (the sizes and options below; an option only with its dimension > 1).

    Args:
        tensor_parallel_size, sequence_parallel: tp ranks per model replica (neighbouring ranks); under tp, norms
            and the residual stream on 1/tp of the positions (default: on).
        pipeline_parallel_size, microbatches, schedule, virtual_stages, layers_per_stage, balance: pipeline stages
            (outermost ranks) and the schedule's settings (`lit_lm/strategies/pp_schedules.py`).
        context_parallel_size, cp_method, ulysses_size: ranks that split every sequence (zigzag,
            `lit_lm/strategies/cp.py`), attending over the whole sequence by ring (default), allgather, ulysses or
            ulysses+ring (Ulysses over ulysses_size ranks inside, default the most the heads allow; docs/cp.md).
        cp_balance: how each sequence is split over the cp ranks: zigzag (default: causal work equal), or documents
            (packed documents: chunks assigned from each batch's document ids, planned on the host before the
            batch's transfer, so every rank's attention work is even; `lit_lm/strategies/cp_balance.py`).
        expert_parallel_size: ranks that split each MoE layer's experts, carved from the data-parallel ranks.
        data_parallel_replicate_size: HSDP: whole replicas of the ZeRO shards (dp_shard = what is left).
        zero_stage: 0 (replicated, `GradSync` all-reduce), 1, 2 or 3 (see `lit_lm/strategies/zero_engine.py`).
        zero_collectives: how ZeRO reduces gradients and gathers weights: auto (per backend: gloo's all-reduce
            and a broadcast per rank for stages 1-2 on CPU ranks, reduce-scatter and all-gather otherwise),
            reduce_scatter or all_reduce to force one (`lit_lm.strategies.comm.zero_forms`, docs/zero.md).
        bucket_cap_mb: `GradSync`'s gradient buckets (zero_stage 0).
        activation_checkpointing: none, full or selective, per block (`lit_lm/strategies/ac.py`, docs/ac.md).
    """

    def __init__(self, tensor_parallel_size: int = 1, sequence_parallel: Optional[bool] = None,
                 pipeline_parallel_size: int = 1, microbatches: Optional[int] = None, schedule: Optional[str] = None,
                 virtual_stages: Optional[int] = None, layers_per_stage: Optional[list[int]] = None,
                 balance: Optional[str] = None, context_parallel_size: int = 1, cp_method: Optional[str] = None,
                 expert_parallel_size: int = 1, data_parallel_replicate_size: int = 1, zero_stage: int = 0,
                 zero_collectives: str = "auto", bucket_cap_mb: float = 25.0, activation_checkpointing: str = "none",
                 ulysses_size: Optional[int] = None, cp_balance: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = c = ParallelConfig.from_args(
            tensor_parallel_size, sequence_parallel, pipeline_parallel_size, microbatches, schedule, virtual_stages,
            layers_per_stage, balance, context_parallel_size, cp_method, expert_parallel_size,
            data_parallel_replicate_size, zero_stage, zero_collectives, ulysses_size, cp_balance=cp_balance).check()
        self._schedule = build_schedule(c.schedule, c.pp, c.microbatches, c.virtual_stages) if c.pp > 1 else None
        self.bucket_cap_mb, self.activation_checkpointing = bucket_cap_mb, ac.check_mode(activation_checkpointing)
        self._module: Optional[nn.Module] = None  # the LightningModule the engines were applied to
        self._split_record: Optional[ModelSplit] = None
        self._index: Optional[ParamIndex] = None  # built once every engine is applied
        self._engines: list[DataParallelEngine] = []
        self._zero_for: Optional[tuple[nn.Module, list[DataParallelEngine]]] = None  # kept for a validate after fit
        self._pipeline: Optional[PipelineStep] = None
        self._balancer: Optional[DocumentBalancer] = None  # cp_balance documents: plans each batch's split
        self._seam: Optional[StepLoss] = None  # the step's loss under pp (the schedule) or cp (the zigzag share)
        self._compile_report: Optional[CompileReport] = None  # under the module's `compile` option
        self._readers: Optional[FlushBeforeReaders] = None  # ZeRO-1/2: `lit_lm/strategies/weight_readers.py`

    @override
    def _configure_launcher(self) -> None:
        if self.num_nodes > 1 and self.num_processes % self.config.tp:  # one node: the layout's own error says it
            warnings.warn(f"tensor_parallel_size={self.config.tp} does not divide trainer.devices="
                          f"{self.num_processes} (per node): tp groups span nodes and their per-layer collectives "
                          "cross the slow network; use a tp size that divides the devices of a node", stacklevel=2)
        super()._configure_launcher()

    def parallel_dims(self, world: int) -> ParallelDims:
        return self.config.dims(world)

    def describe_layout(self) -> str:
        c = self.config
        parts = [super().describe_layout(), f"ZeRO stage {c.zero_stage}",
                 c.pp > 1 and f"schedule {c.schedule} ({c.microbatches} microbatches, "
                              f"{c.virtual_stages} virtual stages)",
                 c.cp > 1 and f"cp {c.cp_method}", c.tp > 1 and f"sequence parallel {'on' if c.sp else 'off'}"]
        return "; ".join(part for part in parts if part)

    # -- building the model ------------------------------------------------------------------------------------
    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Build on the meta device under pp or ZeRO-3: a stage or a shard materialises only what it keeps."""
        with torch.device("meta") if self.config.pp > 1 or self.config.zero_stage == 3 else ExitStack():
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
        self.model_to_device()
        backend = wants_compile(module)
        if backend:  # engine 8: last, over every hook and slice the others put in place
            c = self.config
            check_compile(self.activation_checkpointing)
            compile_blocks(find_block_model(module)[1], fullgraph=c.tp == c.cp == c.ep == 1, backend=backend,
                           retain_graph=c.pp > 1)
            self._compile_report = CompileReport()
        self._index = ParamIndex(module, self._split_record, self._engines)

    def _split(self, module: nn.Module) -> None:
        """Engines 1-6 of the module docstring, once per module."""
        c, layout = self.config, self.layout
        prefix, model = find_block_model(module)
        dot, split = f"{prefix}." if prefix else "", ModelSplit.of(module)
        c.check(moe=bool(isinstance(model, ExpertModel) and model.expert_plan()))
        if c.tp > 1:
            require_plan(model, TensorParallelModel, f"tensor_parallel_size={c.tp}", "tensor_parallel_plan()", module)
            group = TPGroup(layout.tp_group, layout.tp_size, layout.tp_rank, c.sp)
            split.add_tp(parallelize_model(model, model.tensor_parallel_plan(), group), dot)
        if c.cp > 1:
            require_plan(model, ContextParallelModel, f"context_parallel_size={c.cp}",
                         "context_parallel_plan()", module)
            context.check_data_seq_len(module, c.cp)
            hybrid = None
            if c.cp_method == context.HYBRID:  # its subgroups, made once, with the strategy's timeout
                u = context.model_ulysses_size(model, c.cp, c.tp, c.ulysses_size)
                hybrid = context.hybrid_groups(layout.grid["cp"], u, self._timeout)
            context.parallelize_context(model, layout.group("cp"), c.cp_method, hybrid=hybrid)
            self._balancer = self._document_balancer(module, model)
            loss = context.context_loss(model, layout.group("cp"), self._balancer)
            self._seam = StepLoss(model, lambda x, y, train=None, scale=None, **row: loss(x, y, **row),
                                  "context parallelism")
        if c.ep > 1:
            split.add_experts(shard_experts(module, layout.group("ep")))
        if c.pp > 1:
            runner, split.tied = split_pipeline(model, dot, split.first_use, layout, c, self._schedule)
            self._pipeline = PipelineStep(model, runner, c.microbatches, lambda: no_sync(self._engines))
            self._seam = self._pipeline.loss
        self._split_record, self._init = split, partial(split.init, model, dot)  # fills a tensor by global name
        if any(t.is_meta for t in module.parameters()) and c.zero_stage != 3:
            materialize(model, self.root_device, self._init, ModelSplit.init_buffer(model))
        elif c.zero_stage == 3:  # ZeRO-3 fills the parameters; the few meta buffers (MoE routers' counters) here
            init_buffer = ModelSplit.init_buffer(model)
            for name, buffer in [(n, b) for n, b in model.named_buffers() if b.is_meta]:
                owner, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(owner), leaf, torch.empty_like(buffer, device=self.root_device))
                init_buffer(name, model.get_buffer(name))
        split.check_materialised(module, dot, zero3=c.zero_stage == 3)
        recipe = getattr(module, "fp8", None)  # the module's option (lit_lm's `LanguageModel(fp8=...)`)
        if recipe:  # the block linears in FP8; a tp-split weight's scales reduced over tp (`lit_lm/strategies/fp8.py`)
            apply_fp8(model, recipe, split.tp_splits(dot), layout.tp_group if c.tp > 1 else None)
        if self.activation_checkpointing != "none":
            ac.apply_activation_checkpointing(model, self.activation_checkpointing)

    def _data_parallel(self, fitting: bool) -> None:
        """Engine 7: GradSync or ZeRO over what this rank holds (experts apart, over their own replicas)."""
        c, layout, module = self.config, self.layout, self.lightning_module
        parts = [(held, layout.group(name)) for held, name in self._split_record.dp_parts(module, c.dense_group)]
        self._engines = []
        if c.zero_stage and (fitting or c.zero_stage == 3):  # ZeRO-3 gathers in any forward
            if self._zero_for is not None and self._zero_for[0] is module:  # a validate after fit
                self._engines = self._zero_for[1]
                for engine in self._engines:
                    engine.attach()
                return
            replicate = layout.group("dp_replicate") if c.dp_replicate > 1 else None
            self._engines = [ZeroEngine(holder, c.zero_stage, group, self.root_device, replicate,
                                        reduce_in_backward=c.pp == 1, init=self._init, init_rows=self._init,
                                        collectives=c.zero_collectives, forward_root=module)
                             for holder, group in parts]
            self._zero_for = (module, self._engines)
        elif fitting:
            self._engines = [GradSync(holder, group, self.bucket_cap_mb) for holder, group in parts if group.size() > 1]
        else:
            for holder, group in parts:
                broadcast_parameters(holder, group)

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            self._check_optimizer(_unwrap(optimizer))
            bind_optimizer(_unwrap(optimizer), self._engines)
            if getattr(_unwrap(optimizer), "matrix_wise", False):  # Muon: whole matrices from the pieces this rank
                # holds (after ZeRO pointed it at its master rows), `lit_lm/strategies/orthogonalize.py`; tp's cuts
                # along a matrix's long dimension by Gram mode
                bind_orthogonalizer(_unwrap(optimizer), self.owned_weights(), self._replica_group,
                                    self.layout.group("tp") if self.config.tp > 1 else None)
        if self.config.zero_stage in (1, 2):  # their gathers after the step run into the next forward
            self._readers = self._readers or FlushBeforeReaders(lambda: self._engines)
            if self._readers not in trainer.callbacks:
                trainer.callbacks.insert(0, self._readers)  # before any other reader of the weights

    def _check_optimizer(self, optimizer: Optimizer) -> None:
        """Where the layout splits parameters, only an optimizer that updates each element from that element alone
        (the flat step's ELEMENTWISE) or a matrix-wise one with its orthogonalizer gives the one-process update."""
        c = self.config
        splits = [what for what, on in (("ZeRO", c.zero_stage > 0), ("tp", c.tp > 1), ("ep", c.ep > 1)) if on]
        if splits and not elementwise(optimizer) and not getattr(optimizer, "matrix_wise", False):
            raise ConfigError(f"{type(optimizer).__name__} under {' x '.join(splits)}: a rank holds pieces of the "
                              "parameters, and this optimizer is neither elementwise ("
                              f"{', '.join(t.__name__ for t in ELEMENTWISE)}) nor matrix-wise (lit_lm.optim.Muon); "
                              "use one of those, or plain data/pipeline parallelism")

    def _replica_group(self, weight: WeightShard) -> Optional[torch.distributed.ProcessGroup]:
        """The ranks that hold a not-split parameter whole, with the same gradient: its data-parallel group."""
        if self.config.zero_stage:
            return None  # ZeRO cuts every parameter: its rows are the level
        rec = self._index.by_name[weight.name]
        return self.layout.group("edp" if rec.expert else self.config.dense_group)

    @override
    def teardown(self) -> None:
        for engine in self._engines:
            engine.detach()
            if self.config.zero_stage == 3:  # Lightning's teardown moves the module to the CPU: give it whole weights
                engine.consolidate(torch.device("cpu"))
        self._engines = []
        module = self.lightning_module
        if module is not None and any(p.is_meta for p in module.parameters()):
            self._lightning_module = None  # the split failed: nothing was materialised to move back to the CPU
        super().teardown()

    # -- the step ----------------------------------------------------------------------------------------------
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        with super().block_backward_sync(), no_sync(self._engines):
            yield

    def finish_grad_sync(self) -> None:
        """The reverse of the engine order: the dp mean, then experts / ep, tp partial sums, the tied copy over pp."""
        for engine in self._engines:
            engine.finish_grad_sync()
        self._index.finish_split_grads(self.layout)

    def _document_balancer(self, module: nn.Module, model: nn.Module) -> Optional[DocumentBalancer]:
        """cp_balance documents: a `DocumentBalancer` over the attention cores' windows, or a one-line refusal where
        the rows are not packed documents (there is nothing to balance by)."""
        if self.config.cp_balance != "documents":
            return None
        if not isinstance(module, HostDocuments) or getattr(module, "packing", None) is None:
            raise ConfigError("cp_balance documents balances packed documents: set data.init_args.document_mask true "
                              "(or cp_balance zigzag)")
        windows = tuple(spec.sliding_window for spec in model.context_parallel_plan().values()) or (None,)
        return DocumentBalancer(self.config.cp, windows)

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """cp_balance documents: the batch's split planned from its document ids while it is still on the host (no
        read of a device tensor in the step), then the transfer."""
        if self._balancer is not None:
            self._balancer.plan(self.lightning_module.host_documents(batch))
        return super().batch_to_device(batch, device, dataloader_idx)

    def after_optimizer_step(self, optimizer: Union[Optimizer, LightningOptimizer]) -> None:
        for engine in self._engines:
            engine.after_step()  # ZeRO: all-gather the updated rows into the replicated parameters
        if self._pipeline is not None:
            self._pipeline.window_closed()
        if self._compile_report is not None:
            self._compile_report.after_step()

    def loss_fn(self, model: nn.Module) -> LossFn:
        """The step's loss function (`lit_lm.strategies.plan.LossSeam`): the schedule under pp, the zigzag share under
        cp, else `model.loss`."""
        return self._seam if self._seam is not None else model.loss

    def _step(self, train: bool) -> Any:
        """The step's loss seam, open around a Lightning step (the pipeline's backwards scaled as Lightning would)."""
        scale = 1.0 / self.lightning_module.trainer.accumulate_grad_batches
        return self._seam.step(train=train, scale=scale) if self._seam is not None else ExitStack()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._compile_report is not None:
            self._compile_report.step_starts()
        with self._pipeline.stash(self.lightning_module) if self._pipeline else ExitStack(), self._step(train=True):
            return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        return self._pipeline.backward(closure_loss, self.precision_plugin, self.lightning_module)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step(train=False):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step(train=False):
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._seam is not None:
            raise ConfigError(f"{self._seam.what} has no predict (generation runs the whole model, on the whole "
                              "sequence, on one rank): convert the checkpoint (scripts/ckpt.py convert) and predict "
                              "on one device")
        return super().predict_step(*args, **kwargs)

    # -- services and checkpoints: the parameter index and its sharded state ------------------------------------
    def grad_norm_shards(self) -> GradShards:
        return self._index.grad_shards(self.layout, self.config, self.root_device)

    def named_grads(self) -> list[GradPart]:
        return self._index.named_grads()

    def owned_weights(self) -> list[WeightShard]:
        return self._index.owned_weights(self.layout)

    def param_names(self) -> dict[Tensor, str]:
        return self._index.param_names()

    def _state(self) -> ShardedState:
        return ShardedState(self._index, self.layout, self.root_device.type, self.config.dense_group)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        for engine in self._engines:
            if isinstance(engine, ZeroEngine):
                engine.flush()  # ZeRO-1/2's gathers after the step (`weight_readers.py`)
        return self._state().model_state(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Union[Optimizer, LightningOptimizer]) -> dict[str, Any]:
        pp_group = self.layout.pp_group if self.config.pp > 1 else None
        return self._state().optimizer_state(super().optimizer_state(optimizer), pp_group)

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        self._state().load(self.lightning_module, state, [_unwrap(o) for o in self.optimizers], self._engines)
