"""The flat optimizer step: the optimizer steps a few pieces of flat buffers instead of hundreds of small tensors.

An elementwise optimizer (SGD, Adam, AdamW, ...) computes the same thing on a flat tensor as on its pieces, but
its per-tensor cost (torch's default on CPU is a Python loop of ~10 ops per tensor; foreach and fused still group
and launch per tensor) grows with the number of parameters. So the tensors a param group steps are laid out back
to back in flat buffers by the engine that owns them, and so are their gradients:

- ZeRO (`ZeroEngine.flatten`): per group and engine, the trainable fp32 master shards (stage 3, or parameters
  below fp32, own a flat master buffer) and their reduced gradients (stages 2-3 write each reduced shard into its
  slice of one flat gradient buffer);
- data parallel (`GradSync.flatten`): per group and gradient bucket, the parameters themselves, made views of one
  flat buffer laid out as the bucket's gradient buffer (where autograd already accumulates their gradients), as
  Megatron's distributed data parallel keeps its parameter and gradient buffers.

What the step hands torch is not the whole flat but *pieces* of it (`Piece`): runs of consecutive members of at
most `piece_numel(device)` elements (a member larger than that is a piece of its own). torch's per-tensor step
allocates temporaries the size of the tensor it steps (AdamW: two, `sqrt(v)` and the denominator), so over one
flat shard they would be the size of the whole shard (at 217M parameters on 2 ranks, 2 x 434 MB per step, freshly
mapped and faulted in every step: 2.5x slower than per-tensor, issue 36); over pieces they are the size of one
piece, cache-resident and reused by the allocator. On the CPU a piece is at most `CPU_PIECE_NUMEL` elements; on an
accelerator the whole flat is one piece (one foreach or fused launch over one tensor; foreach's temporaries there are
the size of everything it steps either way). The optimizer's state (m, v, momentum) is one tensor per piece and
key, created by torch at the first step at piece size: no full-size copy is ever made.

A piece larger than the limit (one member larger than it) is stepped whole only at its first step, where torch makes
its state; after that torch steps it in *parts* of at most the limit, each part's state entries slices (views) of
the piece's and its scalars (Adam's `step`, counted per tensor by torch) its own, copied back after the step. So
from the second step on no temporary exceeds a part, at any model size: at 217M parameters a whole member's were up
to 131 MB (the embedding), mapped and faulted in afresh every step under `LIT_LM_MALLOC=large`, and the Trainer ran
0.93x a plain loop over torch's per-tensor AdamW; in parts it ran 1.08x (issue 55,
docs/benchmarks/2026-12-trainer-217m-cpu.md).

The optimizer itself keeps holding the per-tensor members, so param groups, LR schedulers, hyper-parameters and the
checkpoint format (state keyed by global name, `lit_lm/strategies/checkpoint.py`) are exactly as before: the step swaps
each group's members for their pieces (with their gradients and state), torch's own `step` runs on them (lr,
weight decay, foreach/fused settings of that group), and they are swapped back (the optimizer's `step` is wrapped:
`try`/`finally`, so an exception leaves the groups as they were). The pieces are a view layout, not a file format:
each member's state entries are views of its piece's state (what checkpoints and callbacks read), and a loaded (or
freshly initialised) per-member state is copied into its piece's state before the next step.

Where the members are not views of a flat buffer, or their gradients are not views of the flat gradient, the group
steps them one by one as torch would (no transient flat, no copy): fp32 master shards under ZeRO stages 1-2 are the
parameter's own rows (free, by design), stage 1's gradient shards are rows of the full gradient it keeps, and a
parameter whose `.data` (or a gradient someone) replaced has left its buffer. Frozen parameters
(requires_grad=False) are in no flat: they stay in their group as they are, gradient None, skipped by torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MethodType
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

# Exact types whose update of an element depends only on that element (and the group's hyper-parameters): on
# these a flat tensor is the same computation. Anything else (factored or matrix-wise optimizers: Adafactor, Muon,
# Shampoo, LBFGS) keeps its per-parameter step.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
               torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop)

# The largest piece stepped on the CPU (elements; 256 KB of fp32): its temporaries stay in the core's cache and in the
# allocator's reused blocks. Measured by `scripts/bench_size.py` and docs/benchmarks/2026-12-size-cpu.md.
CPU_PIECE_NUMEL = 2**16


def piece_numel(device: torch.device) -> Optional[int]:
    """The largest piece torch steps at once on `device`; None: the whole flat (accelerators: one launch)."""
    return CPU_PIECE_NUMEL if device.type == "cpu" else None


@dataclass(eq=False)
class Piece:
    """Members [first, last) of a flat shard, stepped as one tensor: a view of the flat master and of its gradient.
    A piece larger than the device's limit (one member larger than it) is handed torch as `parts` of at most the
    limit once it has state: its first step makes that state whole-piece sized (`_parts`)."""

    shard: FlatShard
    first: int
    last: int
    value: Tensor
    grad: Tensor
    state: dict[str, Any] = field(default_factory=dict)  # the optimizer's state for `value` (torch fills it)
    parts: list[tuple[Tensor, dict[str, Any], dict[str, Any]]] = field(default_factory=list)  # (part, its state,
    parts_of: Optional[dict[str, Any]] = None  # the entries it was cut with); `state` as `parts` were cut from it


@dataclass(eq=False)
class FlatShard:
    """Tensors one param group steps (ZeRO master shards, or parameters), back to back in one flat tensor."""

    members: list[Tensor]  # the tensors the optimizer holds, in flat order
    master: Optional[Tensor]  # flat the members are views of, or None: they are stepped one by one
    grad: Optional[Tensor]  # flat gradient (the members' grads are views of it), or None: stepped one by one
    installed: list[Optional[dict]] = field(init=False)  # the per-member state dicts made views of their piece's
    pieces: list[Piece] = field(init=False)

    def __post_init__(self) -> None:
        self.numel = sum(m.numel() for m in self.members)
        self.installed = [None] * len(self.members)
        # where each member's values and gradient live when they are views of the flats (compared by address)
        self._master_at = [v.data_ptr() for v in self.views(self.master)] if self.master is not None else None
        self._grad_at = [v.data_ptr() for v in self.views(self.grad)] if self.grad is not None else None
        self.pieces = self._cut() if self.master is not None and self.grad is not None else []

    def _cut(self) -> list[Piece]:
        assert self.master is not None and self.grad is not None
        limit = piece_numel(self.master.device) or self.numel
        pieces, first, start, size = [], 0, 0, 0
        for i, m in enumerate(self.members):
            if size and size + m.numel() > limit:
                pieces.append(Piece(self, first, i, self.master[start: start + size], self.grad[start: start + size]))
                first, start, size = i, start + size, 0
            size += m.numel()
        pieces.append(Piece(self, first, len(self.members), self.master[start: start + size],
                            self.grad[start: start + size]))
        return pieces

    def views(self, flat: Tensor, first: int = 0, last: Optional[int] = None) -> list[Tensor]:
        """Members [first, last)'s shapes over `flat` (which holds exactly them)."""
        members = self.members[first:last]
        return [v.view_as(m) for v, m in zip(flat.split([m.numel() for m in members]), members)]

    def flat(self, grads: list[Tensor]) -> bool:
        """Whether the members and these gradients are still views of the flats (a `.data` or a `.grad` replaced
        since makes a member its own: then the group steps it as it is)."""
        return (bool(self.pieces) and [m.data_ptr() for m in self.members] == self._master_at
                and [g.data_ptr() for g in grads] == self._grad_at)


class FlatStep:
    """Installs the swap on `optimizer` (see the module docstring); `flats[i]` are the flat shards of group i."""

    def __init__(self, optimizer: Optimizer, flats: list[list[FlatShard]]) -> None:
        self.optimizer = optimizer
        self.flats = flats
        self._saved: list[tuple[list[Tensor], list[Tensor]]] = []  # per group: (its params, the ones swapped in)
        self._live: list[tuple[Piece, list[Tensor]]] = []  # this step's pieces and the tensors torch steps for them
        step = optimizer.step  # torch's, or an LR scheduler's counting wrapper of it

        def flat_step(opt: Optimizer, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
            """A closure (Lightning passes its forward and backward as one) runs first: the gradients it computes
            are what the pieces must hold. The per-parameter groups come back even if the step raises (a
            checkpoint written on the way out must not see the pieces)."""
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._swap_in(opt)
            stepped = False
            try:
                step(**kwargs)
                stepped = True
            finally:
                self._swap_out(opt, stepped)
            return loss

        # a bound method, as torch's own: an LR scheduler made later wraps `step.__func__`; one made before
        # (Lightning makes both in configure_optimizers) still counts inside `step`, and must see its mark
        if hasattr(step, "_wrapped_by_lr_sched"):
            flat_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        optimizer.step = MethodType(flat_step, optimizer)  # type: ignore[method-assign]

    @torch.no_grad()
    def _swap_in(self, optimizer: Optimizer) -> None:
        self._saved, self._live = [], []
        for group, flats in zip(optimizer.param_groups, self.flats):
            present, in_flat = set(group["params"]), set()
            pieces = []
            for fs in flats:
                if not all(m in present for m in fs.members):  # hidden from this step (NanGuard's skip)
                    continue
                if self._flat(fs):
                    in_flat.update(fs.members)
                    for piece in fs.pieces:
                        self._adopt_state(piece)
                        parts = self._parts(piece)
                        for value, state, _ in parts:
                            self.optimizer.state[value] = state  # torch fills it in place at the first step
                        pieces.extend(value for value, _, _ in parts)
                        self._live.append((piece, [value for value, _, _ in parts]))
            swapped = pieces + [p for p in group["params"] if p not in in_flat]
            self._saved.append((group["params"], swapped))
            group["params"] = swapped

    @staticmethod
    def _flat(fs: FlatShard) -> bool:
        """Whether `fs` steps as its pieces (False: nothing to step, or its members one by one, as torch would)."""
        grads = [m.grad for m in fs.members]
        if all(g is None for g in grads):
            return False  # like torch: a parameter without a gradient is skipped
        if any(g is None for g in grads):
            raise RuntimeError("the flat optimizer step: some trainable tensors of a param group have a gradient and "
                               "some have none; the engine gives every trainable one a gradient (zeros if unused)")
        return fs.flat(grads)  # type: ignore[arg-type]

    @staticmethod
    def _parts(piece: Piece) -> list[tuple[Tensor, dict[str, Any], dict[str, Any]]]:
        """What torch steps for `piece`: the piece itself, or, where it is larger than the device's limit and has
        state, parts of at most the limit, each with the piece state's slices (views) and its own copy of the scalars
        (Adam's `step`: torch counts it per tensor). torch's per-tensor step allocates temporaries the size of what
        it steps (AdamW: two), so at hundreds of millions of parameters a whole member's would be tens of MB,
        mapped and faulted in afresh each time (`lit_lm/strategies/host_malloc.py`) and streamed through memory;
        a part's stay in the cache and the heap. Cut once per state (`parts_of`); the gradient slices stay set."""
        limit = piece_numel(piece.value.device)
        numel = piece.value.numel()
        if limit is None or numel <= limit or not piece.state:
            piece.value.grad = piece.grad
            return [(piece.value, piece.state, piece.state)]
        if piece.parts_of is not piece.state:
            piece.parts = []
            for start in range(0, numel, limit):
                part = piece.value[start: start + limit]
                part.grad = piece.grad[start: start + limit]
                state = {k: v[start: start + limit] if _per_element(v, numel) else v.clone() if isinstance(v, Tensor)
                         else v for k, v in piece.state.items()}
                piece.parts.append((part, state, dict(state)))
            piece.parts_of = piece.state
        return piece.parts

    @staticmethod
    def _gather_parts(piece: Piece) -> None:
        """After torch stepped `piece`'s parts: the scalars they counted into the piece's state; an entry torch
        replaced or added (none for the optimizers of ELEMENTWISE once their state exists) joined into a new one."""
        if not piece.parts or piece.parts_of is not piece.state:
            return
        states = [state for _, state, _ in piece.parts]
        if all(state.keys() == given.keys() and all(state[k] is v for k, v in given.items())
               for _, state, given in piece.parts):
            for key, value in states[0].items():
                if isinstance(value, Tensor) and not _per_element(piece.state[key], piece.value.numel()):
                    piece.state[key].copy_(value)
            return
        piece.state = {k: torch.cat([s[k] for s in states])
                       if all(_per_element(s.get(k), part.numel()) for part, s, _ in piece.parts) else v
                       for k, v in states[0].items()}
        piece.shard.installed[piece.first: piece.last] = [None] * (piece.last - piece.first)  # views made anew

    def _adopt_state(self, piece: Piece) -> None:
        """Make the piece's state hold what its members' entries hold, unless they are already its views (a
        `load_state_dict`, or steps through the one-by-one path, replace them): one piece-sized copy."""
        state, fs = self.optimizer.state, piece.shard
        span = range(piece.first, piece.last)
        current = [state.get(fs.members[i]) for i in span]
        if all(c is fs.installed[i] for c, i in zip(current, span)):
            return
        if not any(current):
            piece.state = {}
            return
        if not all(current):
            raise RuntimeError("the flat optimizer step: the optimizer holds state for some tensors of a param group "
                               "and not for others; load a checkpoint of the same param groups")
        first, shape = current[0], fs.members[piece.first].shape
        piece.state = {}
        for key, value in first.items():
            if isinstance(value, Tensor) and value.shape == shape and value.dim() > 0:
                piece.state[key] = torch.cat([c[key].reshape(-1) for c in current])
            else:
                piece.state[key] = value.clone() if isinstance(value, Tensor) else value

    @torch.no_grad()
    def _swap_out(self, optimizer: Optimizer, stepped: bool = True) -> None:
        for group, (params, swapped) in zip(optimizer.param_groups, self._saved):
            if group["params"] is swapped:  # (a callback's hook may have put its own list back already)
                group["params"] = params
        for piece, values in self._live:
            for value in values:
                optimizer.state.pop(value, None)
            piece.value.grad = None
            self._gather_parts(piece)
            if not stepped:  # torch may have stepped some parts and not others: cut them anew from the piece
                piece.parts_of = None
            self._install_views(piece)
        self._saved, self._live = [], []

    def _install_views(self, piece: Piece) -> None:
        """Per-member state entries as views of the piece's state (what checkpoints and callbacks read). Scalars such
        as Adam's `step` stay one tensor per member, as torch keeps them, brought up to date by one copy."""
        state, fs = self.optimizer.state, piece.shard
        span = range(piece.first, piece.last)
        installed = [fs.installed[i] for i in span]
        if installed[0] is not None and all(state.get(fs.members[i]) is fs.installed[i] for i in span):
            for key, value in piece.state.items():
                if isinstance(value, Tensor) and value.dim() == 0:
                    torch._foreach_copy_([i[key] for i in installed], [value] * len(installed))  # type: ignore[index]
            return
        numel = piece.value.numel()
        split = {k: fs.views(v, piece.first, piece.last) for k, v in piece.state.items()
                 if isinstance(v, Tensor) and v.numel() == numel and v.dim() == 1}
        for j, i in enumerate(span):
            entry = {k: split[k][j] if k in split else v.clone() if isinstance(v, Tensor) else v
                     for k, v in piece.state.items()}
            state[fs.members[i]] = entry
            fs.installed[i] = entry


def _per_element(value: Any, numel: int) -> bool:
    """Whether a state entry holds one value per element of a `numel`-element (flat, 1-d) tensor (AdamW's m and v,
    SGD's momentum), rather than a scalar (Adam's `step`) or a non-tensor."""
    return isinstance(value, Tensor) and value.dim() == 1 and value.numel() == numel


def elementwise(optimizer: Optimizer) -> bool:
    """Whether a flat tensor is the same computation for `optimizer` as its pieces."""
    return type(optimizer) in ELEMENTWISE
