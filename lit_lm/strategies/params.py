"""The parameter index: every parameter this rank holds, under its global name, with where it sits and who owns it.

The engines record what they did by parameter NAME (`ModelSplit`: tp and ep placements, tp partial gradients, the
tied copy on another pipeline stage), so materialising a model built on the meta device or ZeRO-3's new Parameters
need nothing re-pointed. Once every engine is applied, `ParamIndex` is built once from the module's parameters and
the ZeRO engines' rows, and read by everything that names a parameter globally: gradients (`named_grads`), norms
(`grad_shards`), weights for callbacks (`owned_weights`), checkpoints (`lit_lm/strategies/sharded_state.py`) and the
gradient finish after the data-parallel reduce (`finish_split_grads`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
from torch import Tensor, nn

from lit_lm.strategies import comm
from lit_lm.strategies.base import GradPart, Split, WeightShard
from lit_lm.strategies.clip import GradShards
from lit_lm.strategies.dp_engine import param_holder
from lit_lm.strategies.errors import ConfigError
from lit_lm.strategies.experts import ExpertShard
from lit_lm.strategies.layout import ParallelConfig, ParallelLayout
from lit_lm.strategies.placement import Placement, global_index, init_local
from lit_lm.strategies.tp_layers import TPShards, sum_partial_grads
from lit_lm.strategies.zero_engine import ShardedParam, ZeroEngine


@dataclass
class ModelSplit:
    """What the model-splitting engines (tp, ep, the pipeline) did, by name relative to the LightningModule.

    `first_use` maps every name of a parameter (tied aliases too) to the name of its first use, its global name; the
    sets hold global names."""

    first_use: dict[str, str]
    placements: dict[str, Placement] = field(default_factory=dict)  # every name -> this rank's tp / ep slice
    tp_partial: set[str] = field(default_factory=set)  # replicated over tp, a partial gradient on each tp rank
    experts: set[str] = field(default_factory=set)
    tied: set[str] = field(default_factory=set)  # its other use lives on another pipeline stage

    @classmethod
    def of(cls, module: nn.Module) -> "ModelSplit":
        uses: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            uses.setdefault(id(p), []).append(name)
        return cls({name: names[0] for names in uses.values() for name in names})

    def global_name(self, name: str) -> str:
        return self.first_use.get(name, name)

    def add_tp(self, shards: TPShards, dot: str) -> None:
        """`parallelize_model`'s record of the block model under prefix `dot`."""
        for name, (dim, shape) in shards.sharded.items():
            self.placements[dot + name] = Placement(shape, dim, *shards.tp.rows(shape[dim]), "tp")
        self.tp_partial |= {self.global_name(dot + name) for name in shards.partial}

    def tp_splits(self, dot: str) -> dict[str, tuple[int, tuple[int, ...]]]:
        """The tp-split parameters of the block model under prefix `dot`, by name relative to it: (dim, global
        shape) (what FP8 reduces scales for: `lit_lm.strategies.fp8`)."""
        return {name[len(dot):]: (p.dim, tuple(p.global_shape)) for name, p in self.placements.items()
                if p.over == "tp" and name.startswith(dot)}

    def add_experts(self, shards: dict[str, ExpertShard]) -> None:
        for prefix, shard in shards.items():
            for name, shape in shard.global_shapes().items():
                fqn = f"{prefix}.{name}"
                self.placements[fqn] = Placement(shape, 0, shard.start, shard.start + shard.num_local, "ep")
                self.experts.add(self.global_name(fqn))

    def init(self, model: nn.Module, dot: str, name: str, tensor: Tensor,
             rows: Optional[tuple[int, int]] = None) -> bool:
        """Initialise `tensor`, this rank's part of the block model's parameter `name` (ZeRO-3: its `rows` only,
        when the model reads by slice; False when it cannot), as one process would."""
        return init_local(model.init_parameter, self.global_name(dot + name)[len(dot):], tensor,
                          self.placements.get(dot + name), getattr(model, "init_parameter_part", None), rows)


    @staticmethod
    def init_buffer(model: nn.Module) -> Callable[[str, Tensor], None]:
        """The model's `init_buffer(name, tensor)` for a buffer built on the meta device; refused without one."""
        init = getattr(model, "init_buffer", None)
        if init is None:
            def refuse(name: str, tensor: Tensor) -> None:
                raise ConfigError(f"buffer {name} was built on the meta device and {type(model).__name__} has no "
                                  "init_buffer(name, tensor): add one, or create the buffer outside configure_model")
            return refuse
        return init


    def dp_parts(self, module: nn.Module, dense_group: str) -> list[tuple[nn.Module, str]]:
        """What each data-parallel engine holds, with the layout group it reduces over: the dense parameters over
        `dense_group` and, under expert parallelism, the experts over their replicas (edp)."""
        named = [(self.global_name(n), p) for n, p in module.named_parameters()]
        experts = [p for n, p in named if n in self.experts]
        if not experts:
            return [(module, dense_group)]
        return [(param_holder([p for n, p in named if n not in self.experts]), dense_group),
                (param_holder(experts), "edp")]

    @staticmethod
    def check_materialised(module: nn.Module, dot: str, zero3: bool) -> None:
        """Nothing left on the meta device but what ZeRO-3 materialises (the block model's, under prefix `dot`)."""
        leftover = [n for n, t in [*module.named_parameters(), *module.named_buffers()]
                    if t.is_meta and not (zero3 and n.startswith(dot))]
        if leftover:
            raise ConfigError(f"{leftover[:3]} were built on the meta device outside the block model: build them "
                              "in the LightningModule's __init__, not in configure_model")


@dataclass(eq=False)
class ParamRecord:
    """One parameter as this rank holds it: what the forward reads, where it sits in the global tensor, and (ZeRO)
    the engine and rows the optimizer updates."""

    name: str  # global FQN (a tied copy on another stage: the name of the parameter's first use)
    param: nn.Parameter
    placement: Optional[Placement] = None
    expert: bool = False
    tied: bool = False
    tp_partial: bool = False
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

    def splits(self, layout: ParallelLayout) -> tuple[Split, ...]:
        """The cuts from the global tensor to `optimized`, outer to inner: the tp / ep slice, then ZeRO's rows."""
        out = []
        if self.placement is not None:
            p = self.placement
            out.append(Split(p.dim, p.start, p.end, layout.group(p.over)))
        if self.rows is not None:
            out.append(Split(0, self.rows.start, self.rows.end, self.engine.group))
        return tuple(out)


def counted(rec: ParamRecord, layout: ParallelLayout, config: ParallelConfig) -> bool:
    """Whether this rank counts `rec`'s gradient in a global sum over `ParallelConfig.norm_groups`: once per group it
    is replicated on inside them (tp for unsplit parameters, pp for the tied copy, ep for dense ones)."""
    if (rec.placement is None or rec.placement.over != "tp") and config.tp > 1 and layout.tp_rank != 0:
        return False
    if rec.tied and layout.pp_rank != 0:
        return False
    if config.ep > 1 and not config.zero_stage and not rec.expert:
        return layout.rank("ep") == 0
    return True


class ParamIndex:
    """Every parameter of `module` in `named_parameters()` order (`records`), and by any of its names (`aliases`)."""

    def __init__(self, module: nn.Module, split: ModelSplit, engines: Iterable[object]) -> None:
        rows = {sp.param: (engine, sp) for engine in engines if isinstance(engine, ZeroEngine)
                for sp in engine.sharded_params()}
        self.records = []
        for name, p in module.named_parameters():
            engine, sp = rows.get(p, (None, None))
            name = split.global_name(name)
            self.records.append(ParamRecord(name, p, split.placements.get(name), name in split.experts,
                                            name in split.tied, name in split.tp_partial, engine, sp))
        by_param = {rec.param: rec for rec in self.records}
        self.aliases = {name: by_param[p] for name, p in module.named_parameters(remove_duplicate=False)}
        self.by_name = {rec.name: rec for rec in self.records}
        # what `finish_split_grads` touches, found once (a dense dp-only step then walks nothing)
        self._experts = [rec for rec in self.records if rec.expert]
        self._tp_partial = [rec for rec in self.records if rec.tp_partial]
        self._tied = [rec for rec in self.records if rec.tied]

    def named_grads(self) -> list[GradPart]:
        return [GradPart(rec.name, rec.global_shape, rec.index, rec.grad) for rec in self.records]

    def owned_weights(self, layout: ParallelLayout) -> list[WeightShard]:
        """Each parameter cut as the engines cut it: its tp or ep slice, then under ZeRO the rows of that slice."""
        return [WeightShard(rec.name, rec.optimized, rec.param, rec.global_shape, rec.splits(layout))
                for rec in self.records]

    def param_names(self) -> dict[Tensor, str]:
        return {rec.optimized: rec.name for rec in self.records}

    def grad_shards(self, layout: ParallelLayout, config: ParallelConfig, device: torch.device) -> GradShards:
        """Every gradient the optimizer uses, each element counted once over the norm groups (`counted`)."""
        recs = [rec for rec in self.records if rec.grad is not None]
        owned = [rec.grad for rec in recs if counted(rec, layout, config)]
        return GradShards([rec.grad for rec in recs], owned, groups=layout.norm_groups(config), device=device)

    def finish_split_grads(self, layout: ParallelLayout) -> None:
        """After the data-parallel reduce, the rest of the engine order reversed: experts divided by ep (their
        all-to-all summed the ep peers' tokens), tp partial gradients summed (norms under SP), the tied
        embedding/head summed over the first and last stage."""
        ep = layout.size("ep")
        experts = [rec.grad for rec in self._experts if rec.grad is not None] if ep > 1 else []
        if experts:
            torch._foreach_div_(experts, ep)
        if layout.tp_size > 1:
            sum_partial_grads([rec.grad for rec in self._tp_partial], layout.tp_group)
        for rec in self._tied:
            if rec.grad is None:
                rec.optimized.grad = torch.zeros_like(rec.optimized)
            comm.all_reduce(rec.grad, layout.group("pp_embedding"), label="pp tied embedding")
