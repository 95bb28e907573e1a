"""Newton-Schulz on whole matrices when the ranks hold pieces of them: the seam of a matrix-wise optimizer (Muon).

Muon's update is elementwise (momentum, decay, the add) except one step: O = NS(U), which needs each whole matrix U
(its Frobenius norm, its Gram matrix U U^T). A matrix-wise optimizer (`matrix_wise = True`, e.g. `lit_lm.optim.Muon`)
calls an `Orthogonalizer` once per optimizer step with every matrix it updates (the tensors it holds and their
local updates) and gets back, for each, the local part of NS(whole matrix). An MoE layer's stack [E, out, in] is E
matrices. NS runs in the optimizer's `ns_dtype` (`lit_lm.strategies.newton_schulz.NewtonSchulz`: bfloat16, torch's
own function, or float32), and its first op is the cast to that dtype, which is elementwise: the pieces travel in
that dtype, and the matrix an owner reassembles is bit for bit the one a single process casts: the result is
identical, not merely close.

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
    gram         (forced, or in "auto" where it moves fewer bytes) a matrix cut over the `gram_group` (tp) along its
                 *long* dimension (the columns of X, NS's short-and-wide orientation) is orthogonalized on its
                 tp shards, where they are (`NewtonSchulz.iterate`): ||X||^2 = sum_i ||X_i||^2 by one all-reduce,
                 then per NS step X X^T = sum_i X_i X_i^T by one all-reduce (the partial Grams in fp32, the sum
                 cast to the NS dtype), B = b A + c A^2 and X_i <- a X_i + B X_i locally: no piece moves, every tp
                 rank does 4 m^2 n / tp + 2 m^3 of the FLOPs. One all-reduce per NS step (and one for the norms)
                 carries the Grams of every such matrix of the call. Levels inside the tp one (ZeRO's rows of the
                 tp slice) are undone by the owner route first: the dp owner of a matrix is one dp coordinate for
                 its whole tp group (every rank computes the same assignment), so its tp peers hold their slices
                 together. A matrix cut along its short dimension (a column-parallel square or wide matrix, wk/wv)
                 goes to an owner as in "owner" mode: its Gram would be the large n x n one.
    auto         (the default) gram where it applies and moves fewer bytes than the owner route
                 (`gram_moves_less`: for an m x n matrix over p tp ranks, n / m > 20 p / itemsize, i.e. a wide
                 matrix; at tp2 in bfloat16 n > 20 m: rare in a transformer, whose Muon matrices are within ~4x of
                 square, so there the owner route runs), owner elsewhere; "gram" forces Gram wherever it applies,
                 "owner" the owner route everywhere.
    replicated   the baseline: each level's all-to-all hands every piece to every rank of the group (an
                 all-gather), every rank orthogonalizes every matrix and keeps its part.

Bytes per step for an m x n matrix (m <= n) cut over tp: the owner route moves the matrix twice (m n elements of
the NS dtype, gathered then scattered); Gram all-reduces 5 m^2 fp32 Gram elements (one m x m per NS step) plus a
scalar, so it moves fewer bytes when 5 m^2 * 4 < 2 m n * (2 or 4), and it spreads the m^2 n work over the tp ranks
instead of loading one owner. In fp32 NS Gram mode equals owner mode to fp32 summation order (tests at 1e-5); in
bfloat16 the Gram sum is rounded once to bfloat16, as a bfloat16 matmul rounds its fp32 accumulator, but the
summation order differs, and a flipped rounding grows through the 5 steps (docs/optim.md gives the measured size).

Collectives run in one order on every rank (pools of matrices sorted by their levels' group names, levels inner to
outer, then the Gram all-reduces, then back), tensors on the data's device, split sizes from shapes (no host sync).
The optimizer step is after the gradient sync of an accumulation window, so there is one orthogonalization per
optimizer step, whatever `accumulate_grad_batches` is. Not done here (a follow-up): a tp-split matrix replicated
over dp is orthogonalized by each dp replica's tp group (1/tp of the work per rank, not 1/(tp dp)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lit_lm.strategies import comm
from lit_lm.strategies.newton_schulz import NewtonSchulz

NS = NewtonSchulz  # one 2-D matrix -> NS of it in `NS.dtype`; `NS.iterate` for a batch with summed norms and Grams
NS_MODES = ("auto", "gram", "owner", "replicated")


class Orthogonalizer(Protocol):
    """The seam: `__call__` returns, for each of `tensors` (what the optimizer holds), NS of the whole matrix (or
    of each whole matrix of a stack) cut to the part `updates[i]` stands for, in `ns.dtype`, shaped as `updates[i]`;
    `matrix_shape` is the global shape of one matrix of a tensor (Muon's learning-rate adjustment reads it)."""

    def matrix_shape(self, tensor: Tensor) -> tuple[int, int]: ...

    def __call__(self, tensors: list[Tensor], updates: list[Tensor], ns: NS) -> list[Tensor]: ...


def orthogonalize_whole(update: Tensor, ns: NS) -> Tensor:
    """NS of a whole matrix, or of each matrix of a stack [E, out, in], one by one (never the stack as one)."""
    if update.ndim == 2:
        return ns(update)
    return torch.stack([ns(matrix) for matrix in update.unbind(0)])


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


def ns_flops(shape: Sequence[int], parts: int = 1) -> int:
    """NS FLOPs per step of an m x n matrix (m <= n): X X^T and B X (2 m^2 n each), A A (2 m^3); with the n
    columns over `parts` ranks (Gram mode) each does 1/parts of the first two and all of A A."""
    m, n = sorted(shape)
    return 4 * m * m * n // parts + 2 * m ** 3


def long_cut(shape: Sequence[int], dim: Optional[int]) -> bool:
    """Whether a cut along `dim` of a matrix of `shape` cuts the columns of X, NS's short-and-wide orientation
    (the matrix itself, or its transpose when it has more rows than columns): the cut Gram mode undoes."""
    return dim is not None and dim == (0 if NewtonSchulz.transposed(shape) else 1)


def gram_moves_less(shape: Sequence[int], parts: int, itemsize: int) -> bool:
    """Whether Gram mode moves fewer bytes than the owner route for a matrix of `shape` cut along its long side over
    `parts` ranks, its pieces `itemsize` bytes per element. Summed over the ranks, per optimizer step: Gram
    all-reduces one m x m fp32 Gram per NS step (5), a ring all-reduce sending 2 (p - 1) / p of it from each of p
    ranks: 40 (p - 1) m^2 bytes; the owner route gathers the matrix and scatters the result, (p - 1) / p of it each
    way: 2 (p - 1) / p m n itemsize. Gram is cheaper when 20 p m < n itemsize."""
    m, n = sorted(shape)
    return 20 * parts * m < n * itemsize


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
    first) with its owner's coordinate per level (None: every rank, the replicated mode; Gram's level). `gram`:
    its outermost level (tp) is undone by Gram mode, not moved."""

    tensor: int
    expert: Optional[int]
    shape: tuple[int, int]  # the global matrix
    levels: tuple[Level, ...]
    owners: tuple[Optional[int], ...] = ()
    gram: bool = False

    @property
    def flops(self) -> int:
        return ns_flops(self.shape)

    @property
    def rank_flops(self) -> int:
        """The NS FLOPs per step on each rank that works on it: the owner, or each rank of Gram's group."""
        return ns_flops(self.shape, self.levels[-1].size) if self.gram else self.flops

    def moves(self, k: int) -> bool:
        """Whether level k is undone by moving pieces (all but Gram's level)."""
        return not (self.gram and k == len(self.levels) - 1)

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
    if not levels and mode != "replicated" and replica is not None and dist.get_world_size(replica) > 1:
        levels.append(Level(replica, "replica " + comm.group_name(replica), None, 0, dist.get_world_size(replica),
                            dist.get_rank(replica)))
    return tuple(reversed(levels))


def assign_owners(units: Sequence[Unit]) -> None:
    """Greedy longest-first: each unit, largest NS FLOPs first, to the least loaded cell of its levels' groups
    (ties: the lowest cell), written as one owner coordinate per level. A Gram unit takes a whole column of cells
    (one coordinate per inner level, every rank of its outermost, tp, level: None there), the one whose most loaded
    cell is least loaded, and adds its per-rank FLOPs to each. Every rank computes the same."""
    sizes = [level.size for level in units[0].levels]
    load = [0] * math.prod(sizes)
    inner = math.prod(sizes[:-1])  # the cells of one coordinate of the outermost level
    for unit in sorted(units, key=lambda u: -u.flops):  # stable: equal FLOPs keep their order
        if unit.gram:
            columns = ([p + inner * t for t in range(sizes[-1])] for p in range(inner))
            cells = min(columns, key=lambda column: max(load[c] for c in column))
        else:
            cells = [min(range(len(load)), key=lambda c: load[c])]
        for c in cells:
            load[c] += unit.rank_flops
        cell, coords = cells[0], []
        for size in sizes:
            coords.append(cell % size)
            cell //= size
        unit.owners = tuple(coords[:-1]) + (None,) if unit.gram else tuple(coords)


class ShardedOrthogonalizer:
    """The orthogonalizer a strategy binds (module docstring): `weights` describe the tensors the optimizer holds
    (`WeightShard`s: `local` is that tensor); `replica_group(shard)` is the group that holds a not-cut matrix whole
    (its data-parallel group), or None; `gram_group` the group whose long-dimension cuts "auto" undoes by Gram mode
    (the strategy's tp group), or None."""

    def __init__(self, weights: Sequence[Any], replica_group: Callable[[Any], Optional[dist.ProcessGroup]],
                 mode: str = "auto", gram_group: Optional[dist.ProcessGroup] = None, itemsize: int = 2) -> None:
        if mode not in NS_MODES:
            raise ValueError(f"ns_mode {mode!r}: choose one of {', '.join(NS_MODES)}")
        self.mode = mode
        self._weights = {id(w.local): w for w in weights}
        self._replica = replica_group
        self._gram_group = gram_group if mode in ("auto", "gram") else None
        self._itemsize = itemsize  # of the NS dtype, in which the owner route moves the pieces
        self._plans: dict[tuple[int, ...], tuple[list[int], list[Pool]]] = {}
        self._device = torch.device("cpu")  # the updates' (each call's)

    def matrix_shape(self, tensor: Tensor) -> tuple[int, int]:
        shard = self._weights.get(id(tensor))
        return tuple((shard.global_shape if shard is not None else tensor.shape)[-2:])  # type: ignore[return-value]

    def _gram(self, shape: tuple[int, int], levels: tuple[Level, ...]) -> bool:
        outer = levels[-1]
        if self._gram_group is None or outer.group is not self._gram_group or not long_cut(shape, outer.dim):
            return False
        return self.mode == "gram" or gram_moves_less(shape, outer.size, self._itemsize)

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
                shape = tuple(shard.global_shape[-2:])
                for e in range(t.shape[0]) if t.ndim == 3 else [None]:  # an expert stack: each expert a matrix
                    pool.units.append(Unit(i, e, shape, levels, gram=self._gram(shape, levels)))
            for pool in pools.values():
                first = pool.units[0].levels
                if any(a.group is not b.group for u in pool.units for a, b in zip(u.levels, first)):
                    raise ValueError(f"matrices cut over different groups that share the names {pool.key}: name "
                                     "each group (comm.name_group) so that their all-to-alls stay apart")
                if self.mode == "replicated":
                    for unit in pool.units:
                        unit.owners = (None,) * len(unit.levels)
                else:
                    assign_owners(pool.units)
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
        gathered = []  # per pool: the units held before each level's gather, and what this rank holds after all
        for pool in pools:
            for i in {unit.tensor for unit in pool.units}:
                out[i] = torch.empty(updates[i].shape, dtype=ns.dtype, device=updates[i].device)
            held = {unit: part(updates, unit).to(ns.dtype) for unit in pool.units}
            holds = []
            for k in range(len(pool.key)):
                holds.append([u for u in held if u.moves(k)])
                held = {**{u: v for u, v in held.items() if not u.moves(k)}, **self._gather(k, holds[k], held, ns)}
            gathered.append((holds, held))
        grams = [(u, piece) for _, held in gathered for u, piece in held.items() if u.gram]
        done = self._gram_ns([u for u, _ in grams], [piece for _, piece in grams], ns) if grams else {}
        for holds, held in gathered:
            mine = {unit: done[unit] if unit.gram else ns(matrix) for unit, matrix in held.items()}
            for k in reversed(range(len(holds))):
                moved = set(holds[k])
                mine = {**{u: v for u, v in mine.items() if u not in moved}, **self._scatter(k, holds[k], mine, ns)}
            for unit, value in mine.items():
                part(out, unit).copy_(value)
        return out

    def _gram_ns(self, units: list[Unit], pieces: list[Tensor], ns: NS) -> dict[Unit, Tensor]:
        """Gram mode (module docstring) for every matrix this rank holds a tp slice of, together: one all-reduce
        of the squared norms, then one of the concatenated fp32 partial Grams per NS step, over the tp group."""
        group, name = units[0].levels[-1].group, units[0].levels[-1].name
        flips = [NewtonSchulz.transposed(u.shape) for u in units]

        def norms(xs: list[Tensor]) -> list[Tensor]:
            squares = torch.stack([x.float().square().sum() for x in xs])
            comm.all_reduce(squares, group, label=f"orthogonalize gram norms {name}")
            return list(squares.sqrt().to(ns.dtype))

        def grams(xs: list[Tensor]) -> list[Tensor]:
            partial = torch.cat([(x.float() @ x.float().T).reshape(-1) for x in xs])
            comm.all_reduce(partial, group, label=f"orthogonalize gram {name}")
            sizes = [x.shape[0] for x in xs]
            return [g.view(m, m).to(ns.dtype) for g, m in zip(partial.split([m * m for m in sizes]), sizes)]

        xs = ns.iterate([p.T if f else p for p, f in zip(pieces, flips)], norms, grams)
        return {u: x.T if f else x for u, x, f in zip(units, xs, flips)}

    @staticmethod
    def _mine(unit: Unit, k: int, r: int) -> bool:
        """Whether rank r of level k's group is `unit`'s owner there (every rank, replicated)."""
        return unit.owners[k] is None or unit.owners[k] == r

    def _gather(self, k: int, units: list[Unit], held: dict[Unit, Tensor], ns: NS) -> dict[Unit, Tensor]:
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
        received = self._all_to_all(level, sends, shapes, ns.dtype)
        return {u: torch.cat([received[r][j] for r in range(level.size)], dim=u.levels[k].dim)
                for j, u in enumerate(owned)}

    def _scatter(self, k: int, units: list[Unit], done: dict[Unit, Tensor], ns: NS) -> dict[Unit, Tensor]:
        """Level k backwards: each owner's result, cut into the group's parts, back to them in one all-to-all."""
        if not units:
            return {}
        level = units[0].levels[k]  # the group's (each unit's own level: its dim and length)
        if self.mode == "replicated":  # every rank holds every result: its own part
            return {u: u.levels[k].cut(done[u], level.rank) for u in units}
        mine = [u for u in units if self._mine(u, k, level.rank)]
        sends = [[u.levels[k].cut(done[u], r).reshape(-1) for u in mine] for r in range(level.size)]
        shapes = [[u.shape_at(k) for u in units if self._mine(u, k, r)] for r in range(level.size)]
        received = self._all_to_all(level, sends, shapes, ns.dtype)
        parts = [iter(received[r]) for r in range(level.size)]
        return {u: next(parts[u.owners[k]]) for u in units}  # type: ignore[index]

    def _all_to_all(self, level: Level, sends: list[list[Tensor]], shapes: list[list[tuple[int, ...]]],
                    dtype: torch.dtype) -> list[list[Tensor]]:
        """One all-to-all over the level's group: `sends[r]` to rank r; from rank r, tensors of `shapes[r]`."""
        device = self._device
        flat = [torch.cat(s) if s else torch.empty(0, dtype=dtype, device=device) for s in sends]
        counts = [sum(math.prod(s) for s in shape) for shape in shapes]
        recv = torch.empty(sum(counts), dtype=dtype, device=device)
        comm.all_to_all(recv, torch.cat(flat), level.group, output_split_sizes=counts,
                        input_split_sizes=[f.numel() for f in flat], label=f"orthogonalize {level.name}")
        return [[p.view(s) for p, s in zip(got.split([math.prod(s) for s in shape]), shape)]
                for got, shape in zip(recv.split(counts), shapes)]


def bind_orthogonalizer(optimizer: Any, weights: Sequence[Any],
                        replica_group: Callable[[Any], Optional[dist.ProcessGroup]],
                        gram_group: Optional[dist.ProcessGroup] = None) -> bool:
    """Give a matrix-wise optimizer (`matrix_wise = True`, an `orthogonalizer` attribute, an `ns_mode`) the
    strategy's orthogonalizer (`gram_group`: its tp group, whose long-dimension cuts "auto" undoes by Gram mode);
    False for any other optimizer."""
    if not getattr(optimizer, "matrix_wise", False):
        return False
    itemsize = getattr(torch, getattr(optimizer, "ns_dtype", "bfloat16")).itemsize
    optimizer.orthogonalizer = ShardedOrthogonalizer(weights, replica_group, getattr(optimizer, "ns_mode", "auto"),
                                                     gram_group, itemsize)
    return True
