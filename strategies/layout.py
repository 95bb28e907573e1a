"""The N-D process-group layout: one validated description of the parallel dimensions, one cache, one mesh.

    dims = ParallelDims.of(world=8, pp=2, tp=2)           # dp_shard = what is left: 2
    grid = rank_grid(dims)                                 # pure arithmetic: every group of every dimension
    grid["tp"] -> [[0, 1], [2, 3], [4, 5], [6, 7]]         # lists of global ranks
    layout = ParallelLayout.get(dims)                      # on an initialised default group (collective, cached)
    layout.group("dp"), layout.rank("tp"), layout.size("pp"), layout.device_mesh("cpu")

Dimensions, innermost (neighbouring ranks, the fastest links) first:

    tp            tensor (+ sequence) parallel: talks every layer, so it stays inside a node
    cp            context parallel: the sequence split over ranks (`strategies/cp.py`); cp peers read the same rows
    dp_shard      data parallel whose ranks shard the model state (ZeRO) or, at stage 0, replicate it
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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from strategies import comm
from strategies.errors import ConfigError

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

