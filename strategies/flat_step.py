"""One flat optimizer step: the optimizer steps a few flat tensors instead of hundreds of small ones.

An elementwise optimizer (SGD, Adam, AdamW, ...) computes the same thing on one flat tensor as on its pieces, but
its per-tensor cost (torch's default on CPU is a Python loop of ~10 ops per tensor; foreach and fused still group
and launch per tensor) grows with the number of parameters. So the tensors a param group steps are laid out back to
back in flat buffers by the engine that owns them, and so are their gradients and the optimizer's state tensors
(m, v, momentum: per-tensor views of one flat state tensor each, created at the first step):

- ZeRO (`ZeroEngine.flatten`): per group and engine, the trainable fp32 master shards (stage 3, or parameters
  below fp32, own a flat master buffer) and their reduced gradients (stages 2-3 write each reduced shard into its
  slice of one flat gradient buffer);
- data parallel (`GradSync.flatten`): per group and gradient bucket, the parameters themselves, made views of one
  flat buffer laid out as the bucket's gradient buffer (where autograd already accumulates their gradients), as
  Megatron's distributed data parallel keeps its parameter and gradient buffers.

The optimizer itself keeps holding the per-tensor members, so param groups, LR schedulers, hyper-parameters and the
checkpoint format (state keyed by global name, `strategies/checkpoint.py`) are exactly as before: the step swaps
each group's members for their flat tensors (with flat gradients and flat state), torch's own `step` runs on them
(lr, weight decay, foreach/fused settings of that group), and they are swapped back (the optimizer's `step` is
wrapped: `try`/`finally`, so an exception leaves the groups as they were). The flat is a view layout, not a file
format: a loaded (or freshly initialised) per-tensor state is copied into the flat state before the next step and
the per-tensor entries become views of it again.

Where a member is not (or no longer) a view of a flat buffer, the step copies through a transient flat and back:
fp32 master shards under ZeRO stages 1-2 are the parameter's own rows (free, by design), stage 1's gradient shards
are rows of the full gradient it keeps, and a parameter whose `.data` someone replaced has left its buffer. Frozen
parameters (requires_grad=False) are in no flat: they stay in their group as they are, gradient None, skipped by
torch as before.
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


@dataclass(eq=False)
class FlatShard:
    """Tensors one param group steps (ZeRO master shards, or parameters), back to back in one flat tensor."""

    members: list[Tensor]  # the tensors the optimizer holds, in flat order
    master: Optional[Tensor]  # persistent flat (members are views of it), or None: a transient one per step
    grad: Optional[Tensor]  # persistent flat gradient (the members' grads are views of it), or None: copied in
    state: dict[str, Any] = field(default_factory=dict)  # the optimizer's state for the flat tensor
    installed: list[Optional[dict]] = field(init=False)  # the per-member state dicts made views of it

    def __post_init__(self) -> None:
        self.numel = sum(m.numel() for m in self.members)
        self.installed = [None] * len(self.members)
        # where each member's values and gradient live when they are views of the flats (compared by address)
        self._master_at = [v.data_ptr() for v in self.views(self.master)] if self.master is not None else None
        self._grad_at = [v.data_ptr() for v in self.views(self.grad)] if self.grad is not None else None

    def views(self, flat: Tensor) -> list[Tensor]:
        return [v.view_as(m) for v, m in zip(flat.split([m.numel() for m in self.members]), self.members)]

    def aliased(self) -> bool:
        """The members are still views of the flat master (a `.data` replaced since makes a member its own)."""
        return self._master_at is not None and [m.data_ptr() for m in self.members] == self._master_at


class FlatStep:
    """Installs the swap on `optimizer` (see the module docstring); `flats[i]` are the flat shards of group i."""

    def __init__(self, optimizer: Optimizer, flats: list[list[FlatShard]]) -> None:
        self.optimizer = optimizer
        self.flats = flats
        self._saved: list[tuple[list[Tensor], list[Tensor]]] = []  # per group: (its params, the ones swapped in)
        self._live: list[tuple[FlatShard, Tensor]] = []
        step = optimizer.step  # torch's, or an LR scheduler's counting wrapper of it

        def flat_step(opt: Optimizer, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
            """A closure (Lightning passes its forward and backward as one) runs first: the gradients it computes
            are what the flats must hold. The per-parameter groups come back even if the step raises (a
            checkpoint written on the way out must not see the flats)."""
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._swap_in(opt)
            try:
                step(**kwargs)
            finally:
                self._swap_out(opt)
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
            flat_params = []
            for fs in flats:
                if not all(m in present for m in fs.members):  # hidden from this step (NanGuard's skip)
                    continue
                flat = self._prepare(fs)
                if flat is not None:
                    in_flat.update(fs.members)
                    flat_params.append(flat)
                    self._live.append((fs, flat))
            swapped = flat_params + [p for p in group["params"] if p not in in_flat]
            self._saved.append((group["params"], swapped))
            group["params"] = swapped

    def _prepare(self, fs: FlatShard) -> Optional[Tensor]:
        """The flat tensor of `fs` with its gradient and state, ready for torch's step; None: nothing to step."""
        grads = [m.grad for m in fs.members]
        if all(g is None for g in grads):
            return None  # like torch: a parameter without a gradient is skipped
        if any(g is None for g in grads):
            raise RuntimeError("the flat optimizer step: some trainable tensors of a param group have a gradient and "
                               "some have none; the engine gives every trainable one a gradient (zeros if unused)")
        first = fs.members[0]
        if fs.aliased():
            flat = fs.master
        else:
            flat = torch.empty(fs.numel, dtype=first.dtype, device=first.device)
            torch._foreach_copy_(fs.views(flat), fs.members)
        flat_grad = fs.grad if fs.grad is not None else torch.empty_like(flat)
        at = fs._grad_at if fs.grad is not None else [None] * len(grads)
        stray = [(v, g) for v, g, a in zip(fs.views(flat_grad), grads, at) if g.data_ptr() != a]
        if stray:  # stage 1 (rows of the full gradient), or a gradient someone replaced
            torch._foreach_copy_([v for v, _ in stray], [g for _, g in stray])
        flat.grad = flat_grad
        self._adopt_state(fs)
        self.optimizer.state[flat] = fs.state
        return flat

    def _adopt_state(self, fs: FlatShard) -> None:
        """Make the flat state hold what the per-member entries hold, unless they are already its views (a
        `load_state_dict` or a first step through another path replaces them)."""
        state = self.optimizer.state
        current = [state.get(m) for m in fs.members]
        if all(c is i for c, i in zip(current, fs.installed)):
            return
        if not any(current):
            fs.state = {}
            return
        if not all(current):
            raise RuntimeError("the flat optimizer step: the optimizer holds state for some tensors of a param group "
                               "and not for others; load a checkpoint of the same param groups")
        first = current[0]
        fs.state = {}
        for key, value in first.items():
            if isinstance(value, Tensor) and value.shape == fs.members[0].shape and value.dim() > 0:
                fs.state[key] = torch.cat([c[key].reshape(-1) for c in current])
            else:
                fs.state[key] = value.clone() if isinstance(value, Tensor) else value

    @torch.no_grad()
    def _swap_out(self, optimizer: Optimizer) -> None:
        for group, (params, swapped) in zip(optimizer.param_groups, self._saved):
            if group["params"] is swapped:  # (a callback's hook may have put its own list back already)
                group["params"] = params
        for fs, flat in self._live:
            optimizer.state.pop(flat)
            if flat is not fs.master:
                torch._foreach_copy_(fs.members, fs.views(flat))
            flat.grad = None
            self._install_views(fs)
        self._saved, self._live = [], []

    def _install_views(self, fs: FlatShard) -> None:
        """Per-member state entries as views of the flat state (what checkpoints and callbacks read). Scalars such
        as Adam's `step` stay one tensor per member, as torch keeps them, brought up to date by one copy."""
        state = self.optimizer.state
        if fs.installed[0] is not None and all(state.get(m) is i for m, i in zip(fs.members, fs.installed)):
            for key, value in fs.state.items():
                if isinstance(value, Tensor) and value.dim() == 0:
                    torch._foreach_copy_([i[key] for i in fs.installed], [value] * len(fs.members))
            return
        split = {k: fs.views(v) for k, v in fs.state.items() if isinstance(v, Tensor) and v.numel() == fs.numel
                 and v.dim() == 1}
        for i, m in enumerate(fs.members):
            entry = {k: split[k][i] if k in split else v.clone() if isinstance(v, Tensor) else v
                     for k, v in fs.state.items()}
            state[m] = entry
            fs.installed[i] = entry


def elementwise(optimizer: Optimizer) -> bool:
    """Whether a flat tensor is the same computation for `optimizer` as its pieces."""
    return type(optimizer) in ELEMENTWISE
