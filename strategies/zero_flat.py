"""One flat optimizer step for ZeRO: the optimizer steps a few flat shards instead of hundreds of small ones.

An elementwise optimizer (SGD, Adam, AdamW, ...) computes the same thing on one flat tensor as on its pieces, but
its per-tensor cost (torch's default on CPU is a Python loop of ~10 ops per tensor; foreach and fused still group
and launch per tensor) grows with the number of parameters. So, per optimizer param group and ZeRO engine, the
trainable shards of a group are laid out back to back in one fp32 flat buffer (`ZeroEngine.flatten`), and so are
their reduced gradients (stages 2-3: the engine writes each reduced shard straight into its slice) and the
optimizer's state tensors (m, v, momentum: per-parameter views of one flat state tensor each, created at the first
step).

The optimizer itself keeps holding the per-parameter master shards, so param groups, LR schedulers, hyper-parameters
and the checkpoint format (state keyed by global name, `strategies/checkpoint.py`) are exactly as before: a step
pre-hook swaps each group's members for their flat tensor (with its flat gradient and flat state), torch's own
`step` runs on it (lr, weight decay, foreach/fused settings of that group), and a post-hook swaps them back. The
flat is a view layout, not a file format: a loaded (or freshly initialised) per-parameter state is copied into the
flat state before the next step and the per-parameter entries become views of it again.

Where a master shard *is* the parameter's own rows (fp32 parameters under stages 1-2: free by design) it cannot
also be a slice of a flat buffer; there the step copies the shards into a transient flat and back (two passes over
Φ/N, the size of the temporaries a foreach AdamW allocates anyway). Stage 1's gradients are rows of the full
gradient it keeps, likewise copied. Frozen parameters (requires_grad=False) are in no flat: they stay in their
group as they are, gradient None, skipped by torch as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

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
    """Trainable master shards of one param group and engine, back to back in one fp32 flat tensor."""

    members: list[Tensor]  # the master shards the optimizer holds, in flat order
    master: Optional[Tensor]  # persistent flat (members are views of it), or None: a transient one per step
    grad: Optional[Tensor]  # persistent flat gradient (stages 2-3), or None: copied in per step
    state: dict[str, Any] = field(default_factory=dict)  # the optimizer's state for the flat tensor
    installed: list[Optional[dict]] = field(init=False)  # the per-member state dicts made views of it

    def __post_init__(self) -> None:
        self.numel = sum(m.numel() for m in self.members)
        self.installed = [None] * len(self.members)

    def views(self, flat: Tensor) -> list[Tensor]:
        return [v.view_as(m) for v, m in zip(flat.split([m.numel() for m in self.members]), self.members)]


class FlatStep:
    """Installs the swap on `optimizer` (see the module docstring); `flats[i]` are the flat shards of group i."""

    def __init__(self, optimizer: Optimizer, flats: list[list[FlatShard]]) -> None:
        self.optimizer = optimizer
        self.flats = flats
        self._saved: list[list[Tensor]] = []
        self._live: list[tuple[FlatShard, Tensor]] = []
        optimizer.register_step_pre_hook(self._before)
        optimizer.register_step_post_hook(self._after)

    def _before(self, optimizer: Optimizer, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """Swap in the flats. A closure (Lightning passes its forward and backward as one) runs first: the
        gradients it computes are what the flats must hold; torch's step then gets one returning its loss."""
        kwargs = dict(kwargs)  # args[0] is the optimizer
        closure = kwargs.pop("closure", args[1] if len(args) > 1 else None)
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            args, kwargs = args[:1], {**kwargs, "closure": lambda: loss}
        self._swap_in(optimizer)
        return args, kwargs

    @torch.no_grad()
    def _swap_in(self, optimizer: Optimizer) -> None:
        self._saved, self._live = [], []
        for group, flats in zip(optimizer.param_groups, self.flats):
            self._saved.append(group["params"])
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
            group["params"] = flat_params + [p for p in group["params"] if p not in in_flat]

    def _prepare(self, fs: FlatShard) -> Optional[Tensor]:
        """The flat tensor of `fs` with its gradient and state, ready for torch's step; None: nothing to step."""
        grads = [m.grad for m in fs.members]
        if all(g is None for g in grads):
            return None  # like torch: a parameter without a gradient is skipped
        if any(g is None for g in grads):
            raise RuntimeError("ZeRO's flat optimizer step: some trainable shards of a param group have a gradient "
                               "and some have none; the engine gives every trainable shard one (zeros if unused)")
        flat = fs.master if fs.master is not None else torch.empty(fs.numel, device=fs.members[0].device)
        if fs.master is None:
            torch._foreach_copy_(fs.views(flat), fs.members)
        flat_grad = fs.grad if fs.grad is not None else torch.empty_like(flat)
        views = fs.views(flat_grad)
        stray = [(v, g) for v, g in zip(views, grads) if g is not v]
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
            raise RuntimeError("ZeRO's flat optimizer step: the optimizer holds state for some shards of a param "
                               "group and not for others; load a checkpoint of the same param groups")
        first = current[0]
        fs.state = {}
        for key, value in first.items():
            if isinstance(value, Tensor) and value.shape == fs.members[0].shape and value.dim() > 0:
                fs.state[key] = torch.cat([c[key].reshape(-1) for c in current])
            else:
                fs.state[key] = value.clone() if isinstance(value, Tensor) else value

    @torch.no_grad()
    def _after(self, optimizer: Optimizer, *_: Any) -> None:
        for group, params in zip(optimizer.param_groups, self._saved):
            group["params"] = params
        for fs, flat in self._live:
            optimizer.state.pop(flat)
            if fs.master is None:
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


def flat_groups(optimizer: Optimizer, engines: list[Any]) -> Optional[list[list[FlatShard]]]:
    """Lay out each param group's trainable shards flat, per engine (`ZeroEngine.flatten`), or None where the
    optimizer is not elementwise (its per-parameter step stays)."""
    if type(optimizer) not in ELEMENTWISE:
        return None
    groups = [set(g["params"]) for g in optimizer.param_groups]
    out: list[list[FlatShard]] = [[] for _ in groups]
    for engine in engines:
        order = [[sp for sp in engine.sharded_params() if sp.param.requires_grad and sp.param in g] for g in groups]
        for i, (members, (master, grad)) in enumerate(zip(order, engine.flatten(order))):
            if members:
                out[i].append(FlatShard([sp.master for sp in members], master, grad))
    return out
