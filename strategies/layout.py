"""The process-group layout: which ranks form the data-, pipeline- and tensor-parallel groups.

API (used by every strategy; built once per process and cached, because `new_group` is collective and Lightning
calls `setup_environment` again for every `validate()`/`test()` after `fit()`):

    grid = rank_grid(world_size=8, dp=2, pp=2, tp=2)   # pure arithmetic, no processes
    grid["tp"]  -> [[0, 1], [2, 3], [4, 5], [6, 7]]     # every tp group, as lists of global ranks
    grid["dp"]  -> [[0, 2], [1, 3], [4, 6], [5, 7]]
    grid["pp"]  -> [[0, 4], [1, 5], [2, 6], [3, 7]]

    layout = ParallelLayout.get(pp=2, tp=2)             # on an initialised default group; dp = world // (pp*tp)
    layout.dp_group, layout.dp_rank, layout.dp_size     # likewise pp_*, tp_*
    layout.device_mesh("cpu")                           # a ("pp", "dp", "tp") DeviceMesh over the same groups

Rank order is pp-major, tp-minor (rank = (pp_rank * dp + dp_rank) * tp + tp_rank), as in Megatron: the
tensor-parallel peers, which talk most, are neighbours (same node), the pipeline stages are farthest apart.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from strategies import comm

DIMS = ("pp", "dp", "tp")  # outermost first


def rank_grid(world_size: int, dp: Optional[int] = None, pp: int = 1, tp: int = 1) -> dict[str, list[list[int]]]:
    """Every group of each parallel dimension, as sorted lists of global ranks. `dp=None` = what is left."""
    if pp < 1 or tp < 1 or world_size % (pp * tp):
        raise ValueError(
            f"the world size {world_size} is not divisible by pipeline_parallel_size ({pp}) x "
            f"tensor_parallel_size ({tp}): choose sizes whose product divides the number of processes"
        )
    dp = world_size // (pp * tp) if dp is None else dp
    if dp * pp * tp != world_size:
        raise ValueError(f"dp ({dp}) x pp ({pp}) x tp ({tp}) = {dp * pp * tp} != world size {world_size}")
    sizes = {"pp": pp, "dp": dp, "tp": tp}
    grid: dict[str, list[list[int]]] = {}
    for dim in DIMS:
        others = [d for d in DIMS if d != dim]
        groups = []
        for fixed in itertools.product(*(range(sizes[d]) for d in others)):
            coords = dict(zip(others, fixed))
            groups.append([_rank({**coords, dim: i}, sizes) for i in range(sizes[dim])])
        grid[dim] = sorted(groups)
    return grid


def _rank(coords: dict[str, int], sizes: dict[str, int]) -> int:
    return (coords["pp"] * sizes["dp"] + coords["dp"]) * sizes["tp"] + coords["tp"]


@dataclass
class ParallelLayout:
    """This rank's groups of a dp x pp x tp layout. Build with `ParallelLayout.get(...)` (collective, cached)."""

    world_size: int
    sizes: dict[str, int]
    ranks: dict[str, list[int]]  # the global ranks of this rank's group, per dimension
    groups: dict[str, dist.ProcessGroup]
    _mesh: dict[str, "torch.distributed.device_mesh.DeviceMesh"] = field(default_factory=dict, repr=False)

    @classmethod
    def get(cls, dp: Optional[int] = None, pp: int = 1, tp: int = 1) -> "ParallelLayout":
        """The cached layout for these sizes, creating its groups (all ranks must call) on first use."""
        world = dist.get_world_size()
        key = (id(dist.group.WORLD), world, dp, pp, tp)
        if key not in _CACHE:
            _CACHE[key] = cls._build(world, rank_grid(world, dp, pp, tp))
        return _CACHE[key]

    @classmethod
    def _build(cls, world: int, grid: dict[str, list[list[int]]]) -> "ParallelLayout":
        rank = dist.get_rank()
        groups, ranks = {}, {}
        for dim in DIMS:
            # Every rank creates every group (new_group is collective over the world), keeping its own.
            mine, _ = dist.new_subgroups_by_enumeration(grid[dim])
            comm.name_group(mine, dim)
            groups[dim] = mine
            ranks[dim] = next(g for g in grid[dim] if rank in g)
        return cls(world, {dim: len(ranks[dim]) for dim in DIMS}, ranks, groups)

    def device_mesh(self, device_type: str) -> "torch.distributed.device_mesh.DeviceMesh":
        """A ("pp", "dp", "tp") DeviceMesh over the existing groups (for DTensor checkpoints); no new groups."""
        from torch.distributed.device_mesh import DeviceMesh

        if device_type not in self._mesh:
            mesh = torch.arange(self.world_size).view(self.sizes["pp"], self.sizes["dp"], self.sizes["tp"])
            self._mesh[device_type] = DeviceMesh.from_group(
                [self.groups[d] for d in DIMS], device_type, mesh=mesh, mesh_dim_names=DIMS
            )
        return self._mesh[device_type]

    # The names every strategy uses.
    dp_group = property(lambda self: self.groups["dp"])
    pp_group = property(lambda self: self.groups["pp"])
    tp_group = property(lambda self: self.groups["tp"])
    dp_size = property(lambda self: self.sizes["dp"])
    pp_size = property(lambda self: self.sizes["pp"])
    tp_size = property(lambda self: self.sizes["tp"])
    dp_rank = property(lambda self: self.ranks["dp"].index(dist.get_rank()))
    pp_rank = property(lambda self: self.ranks["pp"].index(dist.get_rank()))
    tp_rank = property(lambda self: self.ranks["tp"].index(dist.get_rank()))


_CACHE: dict[tuple, ParallelLayout] = {}
