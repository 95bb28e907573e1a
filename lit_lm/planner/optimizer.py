"""The optimizer's part of an estimate: its state bytes, and Muon's Newton-Schulz work and traffic per step.

    state       AdamW (every parameter, the default): m and v at the size of the tensor it steps, plus a 4-byte
                `step` per tensor (`lit_lm.planner.estimate._model_state` places them); Muon (`lit_lm.optim.Muon`):
                one `momentum_buffer` per hidden matrix (`lit_lm.param_groups.is_matrix`: the blocks' >= 2-D weights
                but routers, an expert stack counted as its tensor), AdamW's three for the rest.
    NS FLOPs    per optimizer step `ns_steps` x `ns_flops` of each matrix (an expert of a stack one by one), as
                `lit_lm.strategies.orthogonalize` assigns them: a matrix no level cuts is done where it is; one cut
                over groups (ZeRO's rows over the dense group, tp's slice) or held whole by a plain data-parallel
                group (a "replica" level) goes to one owner of those groups' cells, balanced greedily by FLOPs
                (`assign_owners`, run here on stand-in levels); a tp cut along the long dimension is Gram mode
                in "gram" mode, and in "auto" where it moves fewer bytes (`gram_moves_less`): every tp rank does
                1/tp of the m^2 n terms, all of the m^3; "replicated" does every matrix on every rank of its
                groups.
    traffic     the owner route, per level (inner first): one all-to-all carrying each piece to its owner (a rank's
                input: the pieces it holds), and one back (an owner's input: its gathered matrices, cut for every
                rank), in the NS dtype (`ns_dtype`, bfloat16 by default); a replica level has no gather, and its
                scatter hands the owner's result to every rank; Gram mode all-reduces one fp32 norm per matrix and
                its fp32 m x m Gram at each NS step over tp.

Estimated for rank 0 of every group (the estimator's rank, `RankEstimate`): its own NS work (the owned matrices'
FLOPs) and its all-to-all inputs, exactly as it runs them; `busiest` is the most loaded owner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch.optim._muon import DEFAULT_NS_STEPS as NS_STEPS  # lit_lm.optim.Muon's default, torch's

from lit_lm.param_groups import is_matrix
from lit_lm.strategies.orthogonalize import NS_MODES, Level, Unit, assign_owners, gram_moves_less, long_cut

OPTIMIZERS = ("adamw", "muon")
NS_BYTES = {"bfloat16": 2, "float32": 4}  # Muon's `ns_dtype`: the pieces travel in it


def optimizer_fields(spec: Any) -> dict[str, Any]:
    """`Workload`'s optimizer fields from `model.init_args.optimizer` as a config or a checkpoint gives it
    ({class_path, init_args}; None: the default AdamW; any other class is planned as AdamW, two moments)."""
    if not isinstance(spec, dict) or spec.get("class_path") != "lit_lm.optim.Muon":
        return {"optimizer": "adamw"}
    args = spec.get("init_args") or {}
    return {"optimizer": "muon", "ns_mode": args.get("ns_mode", "auto"), "ns_dtype": args.get("ns_dtype", "bfloat16"),
            "ns_steps": args.get("ns_steps", NS_STEPS)}


def muon_matrix(name: str, shape: Sequence[int]) -> bool:
    """Whether Muon steps this parameter (its param groups' rule, on a shape)."""
    return is_matrix(name, torch.empty(tuple(shape), device="meta"))


def state_bytes(numels: Sequence[int], matrix: Sequence[bool], sbytes: int) -> int:
    """Optimizer-state bytes of the tensors stepped (their numels, `sbytes` per element): AdamW's m, v and a 4-byte
    step per tensor; a Muon matrix's one momentum buffer."""
    return sum(n * sbytes if m else 2 * n * sbytes + 4 for n, m in zip(numels, matrix))


@dataclass(frozen=True)
class Cut:
    """One cut of a matrix to undo, as the estimator knows it: over `group` (a layout group name) of `size` ranks,
    along `dim` of the 2-D matrix, whose `length` there is cut in `torch.chunk` parts (dim None: a replica group,
    each rank holds it whole)."""

    group: str
    size: int
    dim: Optional[int] = None
    length: int = 0


@dataclass
class NSWork:
    """Rank 0's Newton-Schulz work and traffic per optimizer step."""

    flops: float = 0.0  # rank 0's
    busiest: float = 0.0  # the most loaded rank's
    comm: dict[tuple[str, str], int] = field(default_factory=dict)  # (group, op) -> logical bytes
    sizes: dict[str, int] = field(default_factory=dict)

    def add(self, group: str, op: str, nbytes: int, size: int) -> None:
        if nbytes and size > 1:
            self.comm[(group, op)] = self.comm.get((group, op), 0) + int(nbytes)
            self.sizes[group] = size


def ns_work(matrices: Sequence[tuple[tuple[int, int], tuple[Cut, ...]]], mode: str = "auto", nbytes: int = 2,
            ns_steps: int = NS_STEPS) -> NSWork:
    """`matrices`: (global 2-D shape, its cuts inner first) of each matrix this rank holds a part of (an expert
    stack's experts each); rank 0's work under `mode` (`lit_lm.strategies.orthogonalize.NS_MODES`), the pieces
    `nbytes` per element."""
    if mode not in NS_MODES:
        raise ValueError(f"ns_mode {mode!r}: choose one of {', '.join(NS_MODES)}")
    out, pools = NSWork(), {}
    for shape, cuts in matrices:
        if mode == "replicated":
            cuts = tuple(c for c in cuts if c.dim is not None)
        levels = tuple(Level(None, c.group, c.dim, c.length, c.size, 0) for c in cuts)  # type: ignore[arg-type]
        tp = levels[-1] if levels and levels[-1].name == "tp" else None
        gram = tp is not None and long_cut(shape, tp.dim) and (
            mode == "gram" or (mode == "auto" and gram_moves_less(shape, tp.size, nbytes)))
        unit = Unit(0, None, shape, levels, gram=gram)
        if not levels:
            out.flops += unit.flops
            out.busiest += unit.flops
            continue
        pools.setdefault(tuple(level.name for level in levels), []).append(unit)
    out.flops *= ns_steps
    out.busiest *= ns_steps
    for units in pools.values():
        _pool(out, units, mode, nbytes, ns_steps)
    return out


def _pool(out: NSWork, units: list[Unit], mode: str, nbytes: int, ns_steps: int) -> None:
    """One pool's (matrices with the same groups) work and all-to-alls for rank 0, and its busiest cell's load."""
    sizes = [level.size for level in units[0].levels]
    if mode == "replicated":
        for unit in units:
            unit.owners = (None,) * len(sizes)
    else:
        assign_owners(units)
    load = [0] * math.prod(sizes)
    for unit in units:
        for cell in range(len(load)):
            coords = [cell // math.prod(sizes[:k]) % size for k, size in enumerate(sizes)]
            if all(o is None or o == c for o, c in zip(unit.owners, coords)):
                load[cell] += unit.rank_flops
    out.flops += load[0] * ns_steps
    out.busiest += max(load) * ns_steps
    for k, level in enumerate(units[0].levels):
        # the units rank 0 holds at level k (it owns them at the levels before) that this level moves
        moving = [u for u in units if all(o in (None, 0) for o in u.owners[:k]) and u.moves(k)]
        owned = [u for u in moving if u.owners[k] in (None, 0)]
        gather = 0 if level.dim is None else sum(math.prod(u.shape_at(k)) for u in moving)
        if mode == "replicated":  # every piece to every rank: an all-gather by all-to-all; the scatter keeps its part
            gather *= level.size
            scatter = 0
        else:
            scatter = sum(math.prod(u.shape_at(k + 1)) * (level.size if level.dim is None else 1) for u in owned)
        out.add(level.name, "all_to_all", (gather + scatter) * nbytes, level.size)
    for unit in units:  # Gram mode over tp: the norms, then one fp32 m x m Gram per NS step
        if unit.gram and all(o in (None, 0) for o in unit.owners):
            m = min(unit.shape)
            out.add(unit.levels[-1].name, "all_reduce", (ns_steps * m * m + 1) * 4, unit.levels[-1].size)
