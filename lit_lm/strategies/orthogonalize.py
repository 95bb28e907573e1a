"""Newton-Schulz on whole matrices when the ranks hold pieces of them: the seam of a matrix-wise optimizer (Muon).

Muon's update is elementwise (momentum, decay, the add) except one step: O = NS(U), which needs each whole matrix U
(its Frobenius norm, its Gram matrix U U^T). A matrix-wise optimizer (`matrix_wise = True`, e.g. `lit_lm.optim.Muon`)
calls an `Orthogonalizer` once per optimizer step with every matrix it updates (the tensors it holds and their
local updates) and gets back, for each, the local part of NS(whole matrix). An MoE layer's stack [E, out, in] is E
matrices. NS runs in bfloat16 (torch's `_zeropower_via_newtonschulz` casts its input first), and that cast is
elementwise, so the pieces travel as bfloat16 and the matrix an owner reassembles is bit for bit the one a single
process casts: the result is identical, not merely close.

How a rank holds a matrix is what the strategy already says (`WeightShard.splits`, outer to inner: a tp or ep
slice, then ZeRO's rows of it). A cut along dim 0 of an expert stack keeps every expert whole (ep's experts, ZeRO's
rows of a stack); every other cut is a *level* to undo, over its group, in `torch.chunk` parts. Modes:

    whole        no level: NS on the rank's own matrices (one process; ep; ZeRO's rows of an expert stack; pp
                 stages each alone), no communication.
    owner        each matrix gets an owner, one coordinate per level (the owner's rank in that level's group),
                 chosen by greedy longest-first over the cells of its levels' groups, balanced by NS FLOPs
                 (4 m^2 n + 2 m^3 per step for m <= n); gather inner level first: per level ONE all-to-all over its
                 group carries every piece of every matrix to its owner there (ZeRO: rows to the dp owner, which
                 then holds the tp slice; tp: slices to the tp owner, which then holds the matrix), NS once on the
                 owner, and the result's parts go back the same way, outer level first (one all-to-all per level).
                 A matrix every rank of its data-parallel group holds whole (plain DP: replicated gradients) has
                 one "replica" level instead: its owner orthogonalizes it and an all-to-all hands the result to the
                 others, so NS work per rank falls as 1/N.
    replicated   the baseline: each level's all-to-all hands every piece to every rank of the group (an
                 all-gather), every rank orthogonalizes every matrix and keeps its part.

Collectives run in one order on every rank (pools of matrices sorted by their levels' group names, levels inner to
outer, then back), tensors on the data's device, split sizes from shapes (no host sync). The optimizer step is
after the gradient sync of an accumulation window, so there is one orthogonalization per optimizer step, whatever
`accumulate_grad_batches` is. Not done here (a follow-up): tp's Gram-matrix mode (all-reducing the small U U^T of a
matrix split along its long dimension each NS step, instead of moving the pieces); a tp-split matrix replicated over
dp is orthogonalized by each dp replica's tp owner (1/tp of the work per rank, not 1/(tp dp)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lit_lm.strategies import comm

NS = Callable[[Tensor], Tensor]  # one 2-D matrix -> NS of it, bfloat16 (torch's `_zeropower_via_newtonschulz`)
NS_MODES = ("owner", "replicated")


class Orthogonalizer(Protocol):
    """The seam: `__call__` returns, for each of `tensors` (what the optimizer holds), NS of the whole matrix (or
    of each whole matrix of a stack) cut to the part `updates[i]` stands for, bfloat16, shaped as `updates[i]`;
    `matrix_shape` is the global shape of one matrix of a tensor (Muon's learning-rate adjustment reads it)."""

    def matrix_shape(self, tensor: Tensor) -> tuple[int, int]: ...

    def __call__(self, tensors: list[Tensor], updates: list[Tensor], ns: NS) -> list[Tensor]: ...


def orthogonalize_whole(update: Tensor, ns: NS) -> Tensor:
    """NS of a whole matrix, or of each matrix of a stack [E, out, in], one by one (never the stack as one)."""
    if update.ndim == 2:
        return ns(update)
    out = torch.empty(update.shape, dtype=torch.bfloat16, device=update.device)
    for e in range(update.shape[0]):
        out[e] = ns(update[e])
    return out


class LocalOrthogonalizer:
    """One process: every matrix is whole where it is."""

    def matrix_shape(self, tensor: Tensor) -> tuple[int, int]:
        return tuple(tensor.shape[-2:])  # type: ignore[return-value]

    def __call__(self, tensors: list[Tensor], updates: list[Tensor], ns: NS) -> list[Tensor]:
        return [orthogonalize_whole(u, ns) for u in updates]


def chunk(length: int, parts: int, r: int) -> tuple[int, int]:
    """`torch.chunk`'s part r of `length` in `parts` (ceil-sized, the tail short or empty)."""
    size = -(-length // parts)
    return min(r * size, length), min((r + 1) * size, length)


@dataclass(frozen=True, eq=False)
class Level:
    """One cut to undo: the matrix's pieces along `dim` (of the 2-D matrix) are the `torch.chunk` parts of `length`
    over `group`; `dim` None: a replica group, every rank holds the whole matrix."""

    group: dist.ProcessGroup
    name: str
    dim: Optional[int]
    length: int
    size: int
    rank: int

    def shape(self, whole: tuple[int, ...], r: int) -> tuple[int, ...]:
        """Rank r's piece's shape of a matrix of shape `whole` at this level."""
        if self.dim is None:
            return whole
        start, end = chunk(self.length, self.size, r)
        return whole[:self.dim] + (end - start,) + whole[self.dim + 1:]

    def cut(self, whole: Tensor, r: int) -> Tensor:
        if self.dim is None:
            return whole
        start, end = chunk(self.length, self.size, r)
        return whole.narrow(self.dim, start, end - start)


@dataclass(eq=False)
class Unit:
    """One matrix: tensor `tensor` of the call (its expert `expert` for a stack), undone over `levels` (inner
    first) with its owner's coordinate per level (None: every rank, the replicated mode)."""

    tensor: int
    expert: Optional[int]
    shape: tuple[int, int]  # the global matrix
    levels: tuple[Level, ...]
    owners: tuple[Optional[int], ...] = ()

    @property
    def flops(self) -> int:
        m, n = sorted(self.shape)
        return 4 * m * m * n + 2 * m ** 3

    def shape_at(self, k: int) -> tuple[int, ...]:
        """The shape this rank's piece has once levels < k are gathered (k = len(levels): the whole matrix)."""
        shape: tuple[int, ...] = self.shape
        for level in reversed(self.levels[k:]):
            shape = level.shape(shape, level.rank)
        return shape


@dataclass(eq=False)
class Pool:
    """The matrices undone over the same groups: one all-to-all per level and direction for all of them."""

    key: tuple[str, ...]
    units: list[Unit] = field(default_factory=list)


def _levels(shard: Any, replica: Optional[dist.ProcessGroup], mode: str) -> tuple[Level, ...]:
    """The levels of a `WeightShard` (inner first): its cuts but those along an expert stack's dim 0, and groups of
    one; in owner mode a matrix with none that a replica group holds whole gets that group as its one level."""
    shape, levels = list(shard.global_shape), []
    stack = len(shape) == 3
    for split in shard.splits:
        length, size, rank = shape[split.dim], dist.get_world_size(split.group), dist.get_rank(split.group)
        if (split.start, split.end) != chunk(length, size, rank):
            raise ValueError(f"{shard.name}: rows [{split.start}, {split.end}) of {length} along dim {split.dim} are "
                             f"not torch.chunk part {rank} of {size}: the orthogonalizer cannot find its peers' parts")
        if size > 1 and not (stack and split.dim == 0):
            levels.append(Level(split.group, comm.group_name(split.group), split.dim - stack, length, size, rank))
        shape[split.dim] = split.end - split.start
    if not levels and mode == "owner" and replica is not None and dist.get_world_size(replica) > 1:
        levels.append(Level(replica, "replica " + comm.group_name(replica), None, 0, dist.get_world_size(replica),
                            dist.get_rank(replica)))
    return tuple(reversed(levels))


def assign_owners(units: Sequence[Unit]) -> None:
    """Greedy longest-first: each unit, largest NS FLOPs first, to the least loaded cell of its levels' groups
    (ties: the lowest cell), written as one owner coordinate per level. Every rank computes the same."""
    sizes = [level.size for level in units[0].levels]
    load = [0] * math.prod(sizes)
    for unit in sorted(units, key=lambda u: -u.flops):  # stable: equal FLOPs keep their order
        cell = min(range(len(load)), key=lambda c: load[c])
        load[cell] += unit.flops
        coords = []
        for size in sizes:
            coords.append(cell % size)
            cell //= size
        unit.owners = tuple(coords)


class ShardedOrthogonalizer:
    """The orthogonalizer a strategy binds (module docstring): `weights` describe the tensors the optimizer holds
    (`WeightShard`s: `local` is that tensor); `replica_group(shard)` is the group that holds a not-cut matrix whole
    (its data-parallel group), or None."""

    def __init__(self, weights: Sequence[Any], replica_group: Callable[[Any], Optional[dist.ProcessGroup]],
                 mode: str = "owner") -> None:
        if mode not in NS_MODES:
            raise ValueError(f"ns_mode {mode!r}: choose one of {', '.join(NS_MODES)}")
        self.mode = mode
        self._weights = {id(w.local): w for w in weights}
        self._replica = replica_group
        self._plans: dict[tuple[int, ...], tuple[list[int], list[Pool]]] = {}
        self._device = torch.device("cpu")  # the updates' (each call's)

    def matrix_shape(self, tensor: Tensor) -> tuple[int, int]:
        shard = self._weights.get(id(tensor))
        return tuple((shard.global_shape if shard is not None else tensor.shape)[-2:])  # type: ignore[return-value]

    def _plan(self, tensors: list[Tensor]) -> tuple[list[int], list[Pool]]:
        """The call's tensors whole here (by index), and the pools of the others' matrices (sorted by key: one order
        on every rank)."""
        key = tuple(id(t) for t in tensors)
        if key not in self._plans:
            whole, pools = [], {}
            for i, t in enumerate(tensors):
                shard = self._weights.get(id(t))
                if shard is None:
                    raise ValueError("the orthogonalizer was given a tensor the strategy does not hold: bind the "
                                     "optimizer after the strategy sharded it (setup_optimizers)")
                levels = _levels(shard, self._replica(shard), self.mode)
                if not levels:
                    whole.append(i)
                    continue
                names = tuple(level.name for level in levels)
                pool = pools.setdefault(names, Pool(names))
                for e in range(t.shape[0]) if t.ndim == 3 else [None]:  # an expert stack: each expert a matrix
                    pool.units.append(Unit(i, e, tuple(shard.global_shape[-2:]), levels))
            for pool in pools.values():
                first = pool.units[0].levels
                if any(a.group is not b.group for u in pool.units for a, b in zip(u.levels, first)):
                    raise ValueError(f"matrices cut over different groups that share the names {pool.key}: name "
                                     "each group (comm.name_group) so that their all-to-alls stay apart")
                if self.mode == "owner":
                    assign_owners(pool.units)
                else:
                    for unit in pool.units:
                        unit.owners = (None,) * len(unit.levels)
            self._plans[key] = (whole, [pools[k] for k in sorted(pools)])
        return self._plans[key]

    @torch.no_grad()
    def __call__(self, tensors: list[Tensor], updates: list[Tensor], ns: NS) -> list[Tensor]:
        whole, pools = self._plan(tensors)
        self._device = updates[0].device if updates else self._device
        out: list[Tensor] = [None] * len(updates)  # type: ignore[list-item]

        def part(values: list[Tensor], unit: Unit) -> Tensor:
            return values[unit.tensor] if unit.expert is None else values[unit.tensor][unit.expert]

        for i in whole:
            out[i] = orthogonalize_whole(updates[i], ns)
        for pool in pools:
            for i in {unit.tensor for unit in pool.units}:
                out[i] = torch.empty(updates[i].shape, dtype=torch.bfloat16, device=updates[i].device)
            held = {unit: part(updates, unit).bfloat16() for unit in pool.units}
            holds = []
            for k in range(len(pool.key)):
                holds.append(list(held))
                held = self._gather(k, holds[k], held)
            done = {unit: ns(matrix) for unit, matrix in held.items()}
            for k in reversed(range(len(pool.key))):
                done = self._scatter(k, holds[k], done)
            for unit, value in done.items():
                part(out, unit).copy_(value)
        return out

    @staticmethod
    def _mine(unit: Unit, k: int, r: int) -> bool:
        """Whether rank r of level k's group is `unit`'s owner there (every rank, replicated)."""
        return unit.owners[k] is None or unit.owners[k] == r

    def _gather(self, k: int, units: list[Unit], held: dict[Unit, Tensor]) -> dict[Unit, Tensor]:
        """Level k: every rank's piece of each unit to its owner there, in one all-to-all; the owners' units
        reassembled (the pieces in rank order along the level's dim). The same `units` on every rank of the
        group (they agree on the coordinates of the levels before)."""
        if not units:
            return {}
        level = units[0].levels[k]  # the group's (each unit's own level: its dim and length)
        if level.dim is None:  # a replica level: the owner holds it whole already
            return {u: held[u] for u in units if self._mine(u, k, level.rank)}
        sends = [[held[u].reshape(-1) for u in units if self._mine(u, k, r)] for r in range(level.size)]
        owned = [u for u in units if self._mine(u, k, level.rank)]
        shapes = [[u.levels[k].shape(u.shape_at(k + 1), r) for u in owned] for r in range(level.size)]
        received = self._all_to_all(level, sends, shapes)
        return {u: torch.cat([received[r][j] for r in range(level.size)], dim=u.levels[k].dim)
                for j, u in enumerate(owned)}

    def _scatter(self, k: int, units: list[Unit], done: dict[Unit, Tensor]) -> dict[Unit, Tensor]:
        """Level k backwards: each owner's result, cut into the group's parts, back to them in one all-to-all."""
        if not units:
            return {}
        level = units[0].levels[k]  # the group's (each unit's own level: its dim and length)
        if self.mode == "replicated":  # every rank holds every result: its own part
            return {u: u.levels[k].cut(done[u], level.rank) for u in units}
        mine = [u for u in units if self._mine(u, k, level.rank)]
        sends = [[u.levels[k].cut(done[u], r).reshape(-1) for u in mine] for r in range(level.size)]
        shapes = [[u.shape_at(k) for u in units if self._mine(u, k, r)] for r in range(level.size)]
        received = self._all_to_all(level, sends, shapes)
        parts = [iter(received[r]) for r in range(level.size)]
        return {u: next(parts[u.owners[k]]) for u in units}  # type: ignore[index]

    def _all_to_all(self, level: Level, sends: list[list[Tensor]], shapes: list[list[tuple[int, ...]]]
                    ) -> list[list[Tensor]]:
        """One all-to-all over the level's group: `sends[r]` to rank r; from rank r, tensors of `shapes[r]`."""
        device = self._device
        flat = [torch.cat(s) if s else torch.empty(0, dtype=torch.bfloat16, device=device) for s in sends]
        counts = [sum(math.prod(s) for s in shape) for shape in shapes]
        recv = torch.empty(sum(counts), dtype=torch.bfloat16, device=device)
        comm.all_to_all(recv, torch.cat(flat), level.group, output_split_sizes=counts,
                        input_split_sizes=[f.numel() for f in flat], label=f"orthogonalize {level.name}")
        return [[p.view(s) for p, s in zip(got.split([math.prod(s) for s in shape]), shape)]
                for got, shape in zip(recv.split(counts), shapes)]


def bind_orthogonalizer(optimizer: Any, weights: Sequence[Any],
                        replica_group: Callable[[Any], Optional[dist.ProcessGroup]]) -> bool:
    """Give a matrix-wise optimizer (`matrix_wise = True`, an `orthogonalizer` attribute, an `ns_mode`) the
    strategy's orthogonalizer; False for any other optimizer."""
    if not getattr(optimizer, "matrix_wise", False):
        return False
    optimizer.orthogonalizer = ShardedOrthogonalizer(weights, replica_group, getattr(optimizer, "ns_mode", "owner"))
    return True
