"""The N-D process-group layout: one validated description of the parallel dimensions, one cache, one mesh.

    dims = ParallelDims.of(world=8, pp=2, tp=2)           # dp_shard = what is left: 2
    grid = rank_grid(dims)                                 # pure arithmetic: every group of every dimension
    grid["tp"] -> [[0, 1], [2, 3], [4, 5], [6, 7]]         # lists of global ranks
    layout = ParallelLayout.get(dims)                      # on an initialised default group (collective, cached)
    layout.group("dp"), layout.rank("tp"), layout.size("pp"), layout.device_mesh("cpu")

Dimensions, innermost (neighbouring ranks, the fastest links) first:

    tp            tensor (+ sequence) parallel: talks every layer, so it stays inside a node
    cp            context parallel: the sequence split over ranks (`lit_lm/strategies/cp.py`); cp peers read the same
    rows dp_shard      data parallel whose ranks shard the model state (ZeRO) or, at stage 0, replicate it
    dp_replicate  data parallel over whole replicas of the shards (HSDP: ZeRO inside, all-reduce across)
    pp            pipeline stages, outermost: one point-to-point activation per microbatch crosses it

    rank = (((pp * R + dp_replicate) * S + dp_shard) * C + cp) * T + tp

Derived groups (also named for the accounting layer):

    dp            dp_replicate x dp_shard: the ranks that split the batch (the sampler; gradient averaging without cp)
    dp_cp         dp x cp: every rank that saw other tokens, so replicated gradients are averaged over it (each cp
                  rank's loss is the mean over its equal share of the tokens: the mean of means is the global mean)
    dp_shard_cp   dp_shard x cp: the ranks ZeRO shards over under cp (parameters are replicated over cp)
    ep            expert parallel, carved from dp_shard x cp (as torchtitan and Megatron): runs of `ep`
                  consecutive ranks of that product hold different experts and exchange tokens (all-to-all)
    edp           the ranks holding the same experts: dp_replicate x (dp_shard x cp / ep); expert gradients are
                  averaged over it, dense ones over dp
    pp_embedding  the first and the last stage of each pipeline (a tied embedding/head is summed over it)

Every group is created once per process (`new_group` is collective over the world, and Lightning calls
`setup_environment` again for every `validate()`/`test()` after `fit()`), in `ParallelLayout.get`, with the
strategy's `timeout`: a subgroup made without one gets the backend's default (30 min for gloo, 10 min for NCCL),
so a collective on `dp` with a dead peer would outwait the world's by that much.

`ParallelConfig` is the one description of a parallel configuration (the sizes and each dimension's options) that
the strategy, the estimator, the planner and the yaml share; `REFUSED` is the one table of the combinations the
engines do not compose (docs/parallelism.md lists it; tests/test_refusals.py checks both ways).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lit_lm.strategies import comm
from lit_lm.strategies.cp import HYBRID as CP_HYBRID
from lit_lm.strategies.cp import METHODS as CP_METHODS
from lit_lm.strategies.cp import ulysses_size_for
from lit_lm.strategies.cp_balance import BALANCES as CP_BALANCES
from lit_lm.strategies.errors import ConfigError
from lit_lm.strategies.zero_engine import check_stage

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first
GROUPS = (*DIMS, "dp", "dp_cp", "dp_shard_cp", "ep", "edp", "pp_embedding")
FIELDS = {"pp": "pipeline_parallel_size", "dp_replicate": "data_parallel_replicate_size",
          "dp_shard": "data_parallel_shard_size", "cp": "context_parallel_size", "tp": "tensor_parallel_size",
          "ep": "expert_parallel_size"}  # the strategy's argument for each size, for messages


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of every parallel dimension; world = pp * dp_replicate * dp_shard * cp * tp, ep divides dp_shard * cp."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @classmethod
    def of(cls, world: int, pp: int = 1, dp_replicate: int = 1, dp_shard: Optional[int] = None, cp: int = 1,
           tp: int = 1, ep: int = 1) -> "ParallelDims":
        """The layout of `world` ranks; `dp_shard=None` takes what the other sizes leave. Validated here, once:
        a bad combination raises one `ConfigError` naming every size and the world size."""
        sizes = dict(pp=pp, dp_replicate=dp_replicate, cp=cp, tp=tp, ep=ep)
        rest = pp * dp_replicate * cp * tp
        if dp_shard is None:
            if min(sizes.values()) < 1:
                cls(**sizes).validate(world)  # names the size that is not positive
            if world % rest:
                named = ", ".join(f"{FIELDS[k]}={v}" for k, v in sizes.items())
                raise ConfigError(f"{named} on a world of {world} ranks: the product of the sizes but ep ({rest}) "
                                  "must divide the world size (trainer.devices x trainer.num_nodes)")
            dp_shard = world // rest
        dims = cls(dp_shard=dp_shard, **sizes)
        dims.validate(world)
        return dims

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def describe(self) -> str:
        return " x ".join(f"{name}={size}" for name, size in asdict(self).items())

    def validate(self, world: int) -> None:
        problem = ""
        bad = [name for name, size in asdict(self).items() if size < 1]
        if bad:
            problem = f"{', '.join(FIELDS[b] for b in bad)} must be >= 1"
        elif self.world != world:
            problem = "their product must equal the world size (trainer.devices x trainer.num_nodes)"
        elif (self.dp_shard * self.cp) % self.ep:
            problem = (f"{FIELDS['ep']} must divide data_parallel_shard_size x context_parallel_size = "
                       f"{self.dp_shard * self.cp} (experts are carved from those ranks)")
        if problem:
            raise ConfigError(f"parallel layout {self.describe()} on a world of {world} ranks: {problem}")


    def size(self, name: str) -> int:
        """Ranks in each group named `name` (a dimension or a derived group, see the module docstring)."""
        derived = {"dp": self.dp, "dp_cp": self.dp * self.cp, "dp_shard_cp": self.dp_shard * self.cp,
                   "edp": self.dp * self.cp // self.ep, "pp_embedding": min(self.pp, 2)}
        return derived[name] if name in derived else getattr(self, name)


# -- the configuration: sizes and each dimension's options, one shape for strategy, estimator, planner and yaml ----
PIPELINE_DEFAULTS = {"microbatches": 4, "schedule": "1f1b", "virtual_stages": 1, "balance": "layers"}
BALANCE = ("layers", "params")  # how a pipeline assigns blocks to stages (`lit_lm.strategies.pp_split`)
ARGS = {name: arg for name, arg in FIELDS.items() if name != "dp_shard"}  # the sizes the strategy takes
OPTIONS = {"sequence_parallel": "tp", "cp_method": "cp", "ulysses_size": "cp", "microbatches": "pp", "schedule": "pp",
           "virtual_stages": "pp", "layers_per_stage": "pp", "balance": "pp",
           "cp_balance": "cp"}  # option -> the dimension reading it


@dataclass(frozen=True)
class ParallelConfig:
    """Every parallel setting of a run, validated on construction; `check()` refuses what the engines do not
    compose (`REFUSED`). `ComposedStrategy`'s yaml arguments map onto it with `from_args` and back with
    `strategy_args` (long names, options only where their dimension is on).

        ParallelConfig(tp=2, pp=2, schedule="zb_h1")            # dp_shard: what the world leaves
        ParallelConfig.from_args(tensor_parallel_size=2, zero_stage=3).check()
        config.dims(world=8)                                  # the validated `ParallelDims`

    `dp_shard` is the data-parallel remainder: None (the strategy's case) takes what the world leaves; the
    estimator and the planner, which have no world, give it."""

    tp: int = 1
    sequence_parallel: bool = True  # under tp: norms and the residual stream on 1/tp of the positions
    pp: int = 1
    microbatches: int = PIPELINE_DEFAULTS["microbatches"]
    schedule: str = PIPELINE_DEFAULTS["schedule"]  # `lit_lm.strategies.pp_schedules` (validated where it is built)
    virtual_stages: int = PIPELINE_DEFAULTS["virtual_stages"]
    layers_per_stage: Optional[tuple[int, ...]] = None  # None: split by `balance`
    balance: str = PIPELINE_DEFAULTS["balance"]
    cp: int = 1
    cp_method: str = "ring"
    cp_balance: str = "zigzag"  # how each sequence is split over the cp ranks (`lit_lm.strategies.cp_balance`)
    ulysses_size: Optional[int] = None  # ulysses+ring: Ulysses ranks inside (None: the most the heads allow, at setup)
    ep: int = 1
    dp_replicate: int = 1
    dp_shard: Optional[int] = None
    zero_stage: int = 0
    zero_collectives: str = "auto"  # ZeRO's gradient reduce and weight gather: `comm.zero_forms` (auto: per backend)

    def __post_init__(self) -> None:
        for name, arg in dict(FIELDS, microbatches="microbatches", virtual_stages="virtual_stages").items():
            size = getattr(self, name)
            if not (size is None and name == "dp_shard") and (not isinstance(size, int) or size < 1):
                raise ConfigError(f"{arg}={size!r}: must be an integer >= 1")
        if self.zero_stage != 0:
            try:
                check_stage(self.zero_stage)
            except ValueError as err:
                raise ConfigError(str(err)) from None
        if self.zero_collectives != "auto" and self.zero_collectives not in comm.ZERO_COLLECTIVES:
            raise ConfigError(f"zero_collectives: unknown {self.zero_collectives!r}; choose auto, "
                              f"{', '.join(comm.ZERO_COLLECTIVES)}")
        if self.cp_method not in CP_METHODS:
            raise ConfigError(f"cp_method: unknown {self.cp_method!r}; choose one of {', '.join(CP_METHODS)}")
        if self.cp_balance not in CP_BALANCES:
            raise ConfigError(f"cp_balance: unknown {self.cp_balance!r}; choose one of {', '.join(CP_BALANCES)}")
        if self.ulysses_size is not None:
            if self.cp_method != CP_HYBRID:
                raise ConfigError(f"ulysses_size is an option of cp_method {CP_HYBRID}: set that or remove it")
            ulysses_size_for(self.cp, set(), self.ulysses_size)  # divides cp (the heads are checked at setup)
        if self.balance not in BALANCE:
            raise ConfigError(f"balance: unknown {self.balance!r}; choose one of {', '.join(BALANCE)}")
        if self.layers_per_stage is not None:  # a yaml list: kept as a tuple, so the config stays hashable
            object.__setattr__(self, "layers_per_stage", tuple(self.layers_per_stage))

    @classmethod
    def from_args(cls, tensor_parallel_size: int = 1, sequence_parallel: Optional[bool] = None,
                  pipeline_parallel_size: int = 1, microbatches: Optional[int] = None, schedule: Optional[str] = None,
                  virtual_stages: Optional[int] = None, layers_per_stage: Optional[list[int]] = None,
                  balance: Optional[str] = None, context_parallel_size: int = 1, cp_method: Optional[str] = None,
                  expert_parallel_size: int = 1, data_parallel_replicate_size: int = 1,
                  zero_stage: int = 0, zero_collectives: str = "auto", ulysses_size: Optional[int] = None,
                  cp_balance: Optional[str] = None) -> "ParallelConfig":
        """From `ComposedStrategy`'s arguments, where None means "not given": an option given without its
        dimension is refused (nobody would read it)."""
        options = dict(sequence_parallel=sequence_parallel, cp_method=cp_method, ulysses_size=ulysses_size,
                       microbatches=microbatches, cp_balance=cp_balance,
                       schedule=schedule, virtual_stages=virtual_stages, layers_per_stage=layers_per_stage,
                       balance=balance)
        sizes = dict(tp=tensor_parallel_size, pp=pipeline_parallel_size, cp=context_parallel_size,
                     ep=expert_parallel_size, dp_replicate=data_parallel_replicate_size)
        if sequence_parallel is not None and tensor_parallel_size == 1:
            raise ConfigError("sequence_parallel is a tensor-parallel option: set tensor_parallel_size > 1 or "
                              "remove it")
        for option in ("cp_method", "cp_balance"):
            if options[option] is not None and context_parallel_size == 1:
                raise ConfigError(f"{option} is a context-parallel option: set context_parallel_size > 1 or remove it")
        given = [k for k, v in options.items() if v is not None and OPTIONS[k] == "pp"]
        if pipeline_parallel_size == 1 and given:
            raise ConfigError(f"{', '.join(given)}: pipeline options, but pipeline_parallel_size is 1: set "
                              "pipeline_parallel_size > 1 or remove them")
        if zero_collectives != "auto" and not zero_stage:
            raise ConfigError("zero_collectives is a ZeRO option: set zero_stage (1-3) or remove it")
        return cls(**sizes, zero_stage=zero_stage, zero_collectives=zero_collectives,
                   **{k: v for k, v in options.items() if v is not None})

    def strategy_args(self) -> dict[str, Any]:
        """`ComposedStrategy`'s arguments for this config (the inverse of `from_args`): every size, and each option
        only where its dimension is on (the strategy refuses options it would not read). `dp_shard` is left to the
        world, as the strategy takes it."""
        args: dict[str, Any] = {arg: getattr(self, name) for name, arg in ARGS.items()}
        args["zero_stage"] = self.zero_stage
        if self.zero_collectives != "auto":
            args["zero_collectives"] = self.zero_collectives
        for option, dim in OPTIONS.items():
            value = getattr(self, option)
            if getattr(self, dim) > 1 and value is not None:
                args[option] = list(value) if isinstance(value, tuple) else value
        return args

    # -- derived ----------------------------------------------------------------------------------------------
    @property
    def sp(self) -> bool:
        """Sequence parallelism is on: tp > 1 and not switched off."""
        return self.tp > 1 and self.sequence_parallel

    def dims(self, world: Optional[int] = None) -> ParallelDims:
        """The sizes as the layout holds them: validated on `world` ranks (dp_shard None: what they leave), or
        without a world the given dp_shard (None: 1), unvalidated (the estimator's case)."""
        sizes = dict(pp=self.pp, dp_replicate=self.dp_replicate, cp=self.cp, tp=self.tp, ep=self.ep)
        if world is None:
            return ParallelDims(dp_shard=self.dp_shard or 1, **sizes)
        return ParallelDims.of(world, dp_shard=self.dp_shard, **sizes)

    @property
    def dp(self) -> int:
        return self.dims().dp

    @property
    def world(self) -> int:
        return self.dims().world

    def describe(self) -> str:
        """Short, as the planner prints it: 'dp2x4 zero3 tp8 1f1b m8'."""
        dp_shard = self.dp_shard or 1
        dp = f"dp{dp_shard}" if self.dp_replicate == 1 else f"dp{self.dp_replicate}x{dp_shard}"
        parts = [dp + (f" zero{self.zero_stage}" if self.zero_stage else "")]
        parts += [f"{k}{getattr(self, k)}" for k in ("pp", "tp", "cp", "ep") if getattr(self, k) > 1]
        if self.tp > 1 and not self.sequence_parallel:
            parts.append("no-sp")
        if self.cp > 1 and self.cp_method != "ring":
            parts.append(self.cp_method + (f" u{self.ulysses_size}" if self.ulysses_size else ""))
        if self.pp > 1:
            v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"{self.schedule} m{self.microbatches}{v}")
        return " ".join(parts)

    # -- group roles: which layout group does what (names; `ParallelLayout.group(name)` gives the group) -------
    @property
    def dense_group(self) -> str:
        """The layout group dense gradients are reduced over: every rank that saw other tokens (dp, and cp: its
        ranks hold the same parameters and each computes the mean over its equal share of the tokens), or under
        ZeRO the part of it the rows are sharded over (HSDP all-reduces over dp_replicate on top)."""
        if self.zero_stage:
            return "dp_shard_cp" if self.cp > 1 else "dp_shard"
        return "dp_cp" if self.cp > 1 else "dp"

    def norm_groups(self, dims: ParallelDims) -> list[str]:
        """The groups a global sum over gradients runs over: those the gradients are partitioned across (tp slices,
        pipeline stages, ZeRO rows, experts), never the pure replicas (each replica computes the same sum); groups
        of one rank left out."""
        names = [name for name in ("tp", "pp") if getattr(self, name) > 1]
        if self.zero_stage:  # rows over dp_shard (x cp); with experts, over dp (ep x edp)
            names.append("dp" if self.ep > 1 else self.dense_group)
        elif self.ep > 1:
            names.append("ep")
        return [name for name in names if dims.size(name) > 1]

    # -- refusals ---------------------------------------------------------------------------------------------
    def refusal(self, moe: Optional[bool] = None) -> Optional["Refusal"]:
        """The first `REFUSED` entry this config matches, or None. `moe`: whether the model has MoE layers (None:
        not known yet, as at the strategy's construction: the entries about MoE models are skipped)."""
        return next((r for r in REFUSED if (not r.moe or moe) and r.when(self)), None)

    def check(self, moe: Optional[bool] = None) -> "ParallelConfig":
        """Raise `ConfigError` with the first matching `REFUSED` entry's message; returns self."""
        refused = self.refusal(moe)
        if refused is not None:
            raise ConfigError(refused.message)
        return self


@dataclass(frozen=True)
class Refusal:
    """A combination the engines do not compose: when it applies, why, and what to use instead. The error reads
    '<combination>: <why>; <instead>'."""

    combination: str  # in the strategy's argument names
    when: Callable[[ParallelConfig], bool]
    why: str
    instead: str
    moe: bool = False  # applies to models with MoE layers only (checked once the model is known)

    @property
    def message(self) -> str:
        return f"{self.combination}: {self.why}; {self.instead}"


REFUSED = (
    Refusal("zero_stage=3 with pipeline_parallel_size > 1", lambda c: c.zero_stage == 3 and c.pp > 1,
            "a stage holds 1/pp of the model already and the schedule's split backward bypasses ZeRO-3's gathers",
            "use zero_stage 1 or 2 with pipeline parallelism"),
    Refusal("zero_stage=3 with expert_parallel_size > 1", lambda c: c.zero_stage == 3 and c.ep > 1,
            "expert shards are not gathered by ZeRO-3's units", "use zero_stage 1 or 2 with expert parallelism"),
    Refusal("expert_parallel_size > 1 with data_parallel_replicate_size > 1", lambda c: c.ep > 1 and c.dp_replicate > 1,
            "ep is carved from dp_shard only", "set data_parallel_replicate_size to 1"),
    Refusal("context_parallel_size > 1 with pipeline_parallel_size > 1", lambda c: c.cp > 1 and c.pp > 1,
            "the pipeline runner does not feed the stages zigzag shares",
            "use cp with dp, tp and ZeRO, or pp without cp"),
    Refusal("context_parallel_size > 1 with expert_parallel_size > 1", lambda c: c.cp > 1 and c.ep > 1,
            "MoE balancing losses would count one rank's tokens only",
            "use ep without cp, or a dense model with cp"),
    Refusal("data_parallel_replicate_size > 1 without ZeRO", lambda c: c.dp_replicate > 1 and c.zero_stage == 0,
            "HSDP replicates ZeRO shards",
            "set zero_stage (1-3), or drop data_parallel_replicate_size (plain data parallel)"),
    Refusal("a model with MoE layers and context_parallel_size > 1", lambda c: c.cp > 1,
            "the balancing losses and router statistics would count one rank's tokens only",
            "use ep without cp, or a dense model with cp", moe=True),
    Refusal("a model with MoE layers under tensor_parallel_size > 1 with sequence_parallel",
            lambda c: c.tp > 1 and c.sequence_parallel,
            "the router's statistics need the whole batch on every tp rank (the experts are replicated over tp), "
            "and sequence parallelism splits the positions", "set sequence_parallel: false", moe=True),
)


def _coords(rank: int, dims: ParallelDims) -> dict[str, int]:
    out = {}
    for name in reversed(DIMS):  # tp innermost
        size = getattr(dims, name)
        out[name] = rank % size
        rank //= size
    return out


def _partition(world: int, key: Callable[[dict[str, int]], tuple]) -> list[list[int]]:
    """The ranks grouped by `key(coords)`, each group in rank order, the groups sorted."""
    groups: dict[tuple, list[int]] = {}
    for r in range(world):
        groups.setdefault(key(r), []).append(r)
    return sorted(groups.values())


def rank_grid(dims: ParallelDims) -> dict[str, list[list[int]]]:
    """Every group of every dimension and derived group (see the module docstring), as lists of global ranks."""
    world = dims.world
    coords = [_coords(r, dims) for r in range(world)]

    def varying(*names: str) -> list[list[int]]:  # the ranks that differ only in `names`
        fixed = [d for d in DIMS if d not in names]
        return _partition(world, lambda r: tuple(coords[r][d] for d in fixed))

    def flat_shard_cp(c: dict[str, int]) -> int:
        return c["dp_shard"] * dims.cp + c["cp"]

    grid = {d: varying(d) for d in DIMS}
    grid["dp"] = varying("dp_replicate", "dp_shard")
    grid["dp_cp"] = varying("dp_replicate", "dp_shard", "cp")
    grid["dp_shard_cp"] = varying("dp_shard", "cp")
    outer = ("pp", "dp_replicate", "tp")
    grid["ep"] = _partition(world, lambda r: (*(coords[r][d] for d in outer), flat_shard_cp(coords[r]) // dims.ep))
    grid["edp"] = _partition(world, lambda r: (coords[r]["pp"], coords[r]["tp"], flat_shard_cp(coords[r]) % dims.ep))
    grid["pp_embedding"] = [sorted({g[0], g[-1]}) for g in grid["pp"]]
    return grid


@dataclass
class ParallelLayout:
    """This rank's groups of every dimension. Build with `ParallelLayout.get(dims)` (collective, cached)."""

    dims: ParallelDims
    grid: dict[str, list[list[int]]]
    groups: dict[str, dist.ProcessGroup]
    _meshes: dict[tuple, "torch.distributed.device_mesh.DeviceMesh"] = field(default_factory=dict, repr=False)

    @classmethod
    def get(cls, dims: ParallelDims, timeout: Optional[timedelta] = None) -> "ParallelLayout":
        """The cached layout for `dims` on the current default group, creating its groups on first use, each with
        `timeout` (None: the backend's default)."""
        dims.validate(dist.get_world_size())
        key = (id(dist.group.WORLD), dims, timeout)
        if key not in _CACHE:
            grid = rank_grid(dims)
            groups = {}
            for name in GROUPS:  # every rank creates every group (new_group is collective), keeping its own
                mine, _ = dist.new_subgroups_by_enumeration(grid[name], timeout=timeout)
                comm.name_group(mine, name)
                groups[name] = mine
            _CACHE[key] = cls(dims, grid, groups)
        return _CACHE[key]

    def group(self, name: str) -> dist.ProcessGroup:
        return self.groups[name]

    def ranks(self, name: str) -> list[int]:
        """The global ranks of this rank's group `name`, in group-rank order."""
        me = dist.get_rank()
        return next(g for g in self.grid[name] if me in g)

    def size(self, name: str) -> int:
        return len(self.ranks(name))

    def rank(self, name: str) -> int:
        return self.ranks(name).index(dist.get_rank())

    def device_mesh(self, device_type: str, *names: str) -> "torch.distributed.device_mesh.DeviceMesh":
        """A DeviceMesh over existing groups (for DTensor checkpoints), no new groups: the full
        (pp, dp_replicate, dp_shard, cp, tp) mesh by default, or this rank's slab of `names` (e.g. "edp", "ep")."""
        from torch.distributed.device_mesh import DeviceMesh

        names = names or DIMS
        key = (device_type, names)
        if key not in self._meshes:
            def slab(rank: int, rest: tuple[str, ...]) -> object:  # [i1][i2]...: this rank's slab, nested
                if not rest:
                    return rank
                return [slab(r, rest[1:]) for r in next(g for g in self.grid[rest[0]] if rank in g)]

            mesh = torch.tensor(slab(dist.get_rank(), names))
            self._meshes[key] = DeviceMesh.from_group([self.groups[n] for n in names], device_type, mesh=mesh,
                                                      mesh_dim_names=names)
        return self._meshes[key]

    def norm_groups(self, config: "ParallelConfig") -> list[dist.ProcessGroup]:
        """This rank's groups a global gradient sum runs over (`ParallelConfig.norm_groups`)."""
        return [self.groups[name] for name in config.norm_groups(self.dims)]

    # The names strategies and callbacks use most.
    dp_group = property(lambda self: self.groups["dp"])
    pp_group = property(lambda self: self.groups["pp"])
    tp_group = property(lambda self: self.groups["tp"])
    dp_size = property(lambda self: self.dims.dp)
    pp_size = property(lambda self: self.dims.pp)
    tp_size = property(lambda self: self.dims.tp)
    dp_rank = property(lambda self: self.rank("dp"))
    pp_rank = property(lambda self: self.rank("pp"))
    tp_rank = property(lambda self: self.rank("tp"))


_CACHE: dict[tuple, ParallelLayout] = {}

