"""`Pruning`: magnitude pruning during training on a step schedule, on whole, ZeRO-, TP- or TP x ZeRO-sharded weights.

Methods (Zhu & Gupta 2017 for the gradual schedule; Mishra et al. 2021 for N:M):
    unstructured  the |w| below the k-th smallest are zeroed: per layer, or one threshold over all selected layers
                  (`scope: global`) and all ranks' shards: exactly round(s * numel) weights go.
    nm            N of every M consecutive weights along the input dimension are kept (2:4 by default): the
                  pattern sparse tensor cores run; the sparsity is 1 - N/M whatever the schedule says.
    structured    whole units go, with the weights that only make sense together: an MLP hidden unit is a row of
                  w_gate and w_up and a column of w_down; an attention unit is a kv group (its query heads' rows of
                  wq, its k and v head, the matching columns of wo), so grouped-query attention stays valid.
                  Importance is the L1 or L2 norm of the unit over all its pieces. `make_permanent` then shrinks the
                  layers: a smaller, faster dense model.

Masks are computed on the global tensor (all-gathered from the shards, see `core`) identically on every rank,
applied to the weights *and* their optimizer state after every optimizer step, logged every step
(`sparsity/<layer>`),
and saved in the checkpoint (the callback's state, merged over the ranks since a pipeline stage holds only its own
layers' masks; global shapes: any topology resumes it). `scope: global` needs every rank to hold the same
weights, so it is refused under pp (and ep with experts selected): use `scope: layer` there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Sequence

import lightning as L
import torch
from torch import Tensor, nn

from lit_lm.callbacks.compress.core import DEFAULT_EXCLUDE, gather_global, log_per_layer, merged_over_ranks, \
    owned_weights, same_on_every_rank, select, warn_if_never_reached, write
from lit_lm.config import ConfigError
from lit_lm.strategies.base import WeightShard

Method = Literal["unstructured", "nm", "structured"]
Kind = Literal["constant", "linear", "cubic"]


@dataclass(frozen=True)
class SparsitySchedule:
    """Target sparsity per optimizer step. Nothing before `start_step`; `constant` is `final` from then on;
    `linear` and `cubic` (s_t = s_f + (s_i - s_f)(1 - progress)^3: prune fast while the network has redundancy,
    slowly near the end) go from `initial` to `final` between `start_step` and `end_step`. Masks are recomputed
    every `frequency` steps in that window (and at `end_step`), then frozen."""

    final: float
    initial: float = 0.0
    start_step: int = 0
    end_step: Optional[int] = None  # None: one shot at start_step
    frequency: int = 100
    kind: Kind = "cubic"

    def __post_init__(self) -> None:
        for field in ("final", "initial"):
            if not 0.0 <= getattr(self, field) < 1.0:
                raise ConfigError(f"Pruning.{'sparsity' if field == 'final' else 'initial_sparsity'} must be in "
                                  f"[0, 1), got {getattr(self, field)}")
        if self.kind not in ("constant", "linear", "cubic"):
            raise ConfigError(f"Pruning.schedule must be constant, linear or cubic, got {self.kind!r}")
        if self.frequency < 1 or self.start_step < 0 or self.end < self.start_step:
            raise ConfigError(f"Pruning: need frequency >= 1 and 0 <= start_step <= end_step, got frequency="
                              f"{self.frequency}, start_step={self.start_step}, end_step={self.end_step}")

    @property
    def end(self) -> int:
        return self.start_step if self.end_step is None else self.end_step

    def __call__(self, step: int) -> float:
        if step < self.start_step:
            return 0.0
        if self.kind == "constant" or self.end == self.start_step:
            return self.final
        progress = min((step - self.start_step) / (self.end - self.start_step), 1.0)
        if self.kind == "linear":
            return self.initial + (self.final - self.initial) * progress
        return self.final + (self.initial - self.final) * (1.0 - progress) ** 3

    def updates_at(self, step: int) -> bool:
        return self.start_step <= step <= self.end and ((step - self.start_step) % self.frequency == 0
                                                        or step == self.end)


# -- masks on global tensors (pure functions) ---------------------------------------------------------------------
def magnitude_masks(weights: Sequence[Tensor], sparsity: float) -> list[Tensor]:
    """One threshold over all `weights` together: exactly round(sparsity * total) smallest |w| are dropped (ties
    broken by position, so the count is exact and the same on every rank)."""
    flat = torch.cat([w.detach().abs().reshape(-1).float() for w in weights])
    keep = torch.ones_like(flat, dtype=torch.bool)
    keep[torch.argsort(flat, stable=True)[: round(sparsity * flat.numel())]] = False
    return [m.view(w.shape) for m, w in zip(keep.split([w.numel() for w in weights]), weights)]


def nm_mask(weight: Tensor, n: int, m: int) -> Tensor:
    """Keep the n largest |w| of every m consecutive weights along the input dimension (dim 1)."""
    groups = weight.detach().abs().reshape(weight.shape[0], -1, m)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, groups.topk(n, dim=-1).indices, True)
    return keep.view(weight.shape)


@dataclass(frozen=True)
class UnitGroup:
    """Weights pruned together: unit j is the slice [j*size, (j+1)*size) along `dim` of every member."""

    module: str
    members: tuple[tuple[str, int, int], ...]  # (weight name, dim, unit size)

    def n_units(self, shapes: dict[str, torch.Size]) -> int:
        name, dim, size = self.members[0]
        return shapes[name][dim] // size

    def keep_units(self, weights: dict[str, Tensor], sparsity: float, norm: str) -> Tensor:
        scores = 0.0
        for name, dim, size in self.members:
            w = weights[name].detach().float().movedim(dim, 0)
            units = w.reshape(w.shape[0] // size, -1)
            scores = scores + (units.abs().sum(1) if norm == "l1" else units.pow(2).sum(1))
        keep = torch.ones(len(scores), dtype=torch.bool, device=scores.device)
        keep[torch.argsort(scores, stable=True)[: round(sparsity * len(scores))]] = False
        return keep

    def masks(self, keep: Tensor, shapes: dict[str, torch.Size]) -> dict[str, Tensor]:
        out = {}
        for name, dim, size in self.members:
            along = keep.repeat_interleave(size)
            view = [1] * len(shapes[name])
            view[dim] = -1
            out[name] = along.view(view).expand(shapes[name]).contiguous()
        return out


# Which linears of lit_lm's Transformer belong together (by their names inside one parent module).
MLP_UNITS = (("w_gate", 0), ("w_up", 0), ("w_down", 1))
ATTENTION_UNITS = (("wq", 0), ("wk", 0), ("wv", 0), ("wo", 1))


def unit_groups(shapes: dict[str, torch.Size], head_dims: dict[str, int]) -> list[UnitGroup]:
    """The MLPs and attentions among the selected weights (`head_dims`: attention module -> head_dim)."""
    parents: dict[str, set[str]] = {}
    for name in shapes:
        parent, leaf = name[: -len(".weight")].rpartition(".")[::2]
        parents.setdefault(parent, set()).add(leaf)
    groups, grouped = [], set()
    for parent, leaves in parents.items():
        def w(leaf: str, parent: str = parent) -> str:
            return f"{parent}.{leaf}.weight"

        if leaves >= {leaf for leaf, _ in MLP_UNITS}:
            groups.append(UnitGroup(parent, tuple((w(leaf), dim, 1) for leaf, dim in MLP_UNITS)))
        elif leaves >= {leaf for leaf, _ in ATTENTION_UNITS}:
            hd = head_dims[parent]
            per_group = shapes[w("wq")][0] // shapes[w("wk")][0] * hd  # query features per kv head
            sizes = {"wq": per_group, "wk": hd, "wv": hd, "wo": per_group}
            groups.append(UnitGroup(parent, tuple((w(leaf), dim, sizes[leaf]) for leaf, dim in ATTENTION_UNITS)))
        else:
            continue
        grouped.update(name for name, _, _ in groups[-1].members)
    loose = sorted(set(shapes) - grouped)
    if loose:
        raise ConfigError(f"Pruning(method=structured) prunes whole MLP units and attention kv groups; {loose} are "
                          "not part of one: leave them out with Pruning.exclude")
    return groups


class Pruning(L.Callback):
    """Magnitude pruning on a schedule (see the module docstring).

    Args:
        method: unstructured | nm | structured.
        sparsity, initial_sparsity, start_step, end_step, frequency, schedule: the `SparsitySchedule`
            (ignored by nm except for the steps: its sparsity is 1 - n/m).
        scope: unstructured only: `layer` (each layer to the target) or `global` (one threshold for all).
        n, m: the N:M pattern.
        importance: structured only: l1 or l2 norm of a unit.
        include, exclude: module-name globs (fnmatch) of the linears to prune; embeddings and head excluded.
    """

    def __init__(self, method: Method = "unstructured", sparsity: float = 0.5, initial_sparsity: float = 0.0,
                 start_step: int = 0, end_step: Optional[int] = None, frequency: int = 100, schedule: Kind = "cubic",
                 scope: Literal["layer", "global"] = "layer", n: int = 2, m: int = 4,
                 importance: Literal["l1", "l2"] = "l1", include: Optional[list[str]] = None,
                 exclude: Sequence[str] = DEFAULT_EXCLUDE) -> None:
        if method not in ("unstructured", "nm", "structured"):
            raise ConfigError(f"Pruning.method must be unstructured, nm or structured, got {method!r}")
        if method == "nm" and not 0 < n < m:
            raise ConfigError(f"Pruning: N:M needs 0 < n < m, got n={n}, m={m}")
        if scope not in ("layer", "global") or importance not in ("l1", "l2"):
            raise ConfigError(f"Pruning.scope must be layer or global and Pruning.importance l1 or l2, got "
                              f"{scope!r}, {importance!r}")
        self.method, self.scope, self.n, self.m, self.importance = method, scope, n, m, importance
        final = 1.0 - n / m if method == "nm" else sparsity
        self.schedule = SparsitySchedule(final, initial_sparsity, start_step, end_step, frequency, schedule)
        self.include, self.exclude = include, tuple(exclude)
        self.masks: dict[str, Tensor] = {}  # global name -> global bool mask (same on every rank)
        self._last_step = -1

    @property
    def state_key(self) -> str:  # several Pruning callbacks (on different layers) keep separate checkpoint state
        return self._generate_state_key(method=self.method, include=self.include, exclude=self.exclude)

    # -- Lightning hooks ---------------------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        warn_if_never_reached(trainer, "Pruning", self.schedule.start_step, trainer.max_steps)
        self._weights = select(owned_weights(trainer, pl_module), self.include, self.exclude, "Pruning")
        if self.method == "unstructured" and self.scope == "global" and \
                not same_on_every_rank([ws.name for ws in self._weights]):
            raise ConfigError("Pruning.scope=global takes one threshold over all pruned weights, but the ranks hold "
                              "different layers (pipeline stages or experts): set scope: layer")
        if self.method == "nm":
            bad = {ws.name: ws.global_shape[1] for ws in self._weights if ws.global_shape[1] % self.m}
            if bad:
                raise ConfigError(f"Pruning.m={self.m} must divide the input dimension of every pruned layer; "
                                  f"{bad} do not: choose m or exclude them")
        if self.method == "structured":
            self._groups = self._unit_groups(pl_module, {ws.name: ws.global_shape for ws in self._weights})
        self._last_step = trainer.global_step
        self._apply(trainer)  # resumed masks (the weights were saved masked; the optimizer state too)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == self._last_step:  # an accumulation micro-step: no update happened
            return
        self._last_step = step
        if self.schedule.updates_at(step):
            self.masks = self.compute_masks(self._weights, self.schedule(step))
        self._apply(trainer)
        if self.masks:
            log_per_layer(pl_module, "sparsity", {k: v for k, v in self.sparsity().items() if k != "all"})

    @staticmethod
    def _unit_groups(module: nn.Module, shapes: dict[str, torch.Size]) -> list[UnitGroup]:
        parents = {name[: -len(".weight")].rpartition(".")[0] for name in shapes}
        heads = {p: module.get_submodule(p).head_dim for p in parents if hasattr(module.get_submodule(p), "head_dim")}
        return unit_groups(shapes, heads)

    def _apply(self, trainer: L.Trainer) -> None:
        for ws in self._weights:
            if ws.name in self.masks:
                write(ws, self.masks[ws.name], trainer.optimizers, multiply=True)

    # -- masks ------------------------------------------------------------------------------------------------
    def compute_masks(self, weights: Sequence[WeightShard], sparsity: float) -> dict[str, Tensor]:
        """Global masks from the (gathered) global weights: a collective, in the same order on every rank."""
        full = {ws.name: gather_global(ws) for ws in weights}
        if self.method == "nm":
            return {name: nm_mask(w, self.n, self.m) for name, w in full.items()}
        if self.method == "structured":
            shapes = {name: w.shape for name, w in full.items()}
            return {name: mask for g in self._groups
                    for name, mask in g.masks(g.keep_units(full, sparsity, self.importance), shapes).items()}
        if self.scope == "global":
            return dict(zip(full, magnitude_masks(list(full.values()), sparsity)))
        return {name: magnitude_masks([w], sparsity)[0] for name, w in full.items()}

    def sparsity(self) -> dict[str, float]:
        """Per pruned layer, and `all` over them together."""
        out = {name: 1.0 - m.float().mean().item() for name, m in self.masks.items()}
        total = sum(m.numel() for m in self.masks.values())
        out["all"] = 1.0 - sum(m.sum().item() for m in self.masks.values()) / max(total, 1)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"masks": merged_over_ranks({k: v.cpu() for k, v in self.masks.items()})}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.masks = dict(state_dict["masks"])

    # -- export -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def make_permanent(self, module: nn.Module) -> nn.Module:
        """Fold the masks into the whole weights of `module` (the LightningModule the names are relative to);
        structured pruning also cuts the pruned units out, so the layers shrink. In place; returns `module`."""
        params = dict(module.named_parameters())
        for name, mask in self.masks.items():
            if params[name].shape != mask.shape:
                raise ValueError(f"make_permanent needs whole weights; {name} is {tuple(params[name].shape)}, the "
                                 f"mask {tuple(mask.shape)}: call it on a consolidated (single-process) model")
            params[name].mul_(mask.to(params[name].device))
        if self.method == "structured":
            for group in self._unit_groups(module, {name: m.shape for name, m in self.masks.items()}):
                for name, dim, _ in group.members:
                    mask = self.masks[name]
                    kept = mask.any(dim=1 - dim).nonzero().squeeze(1).to(params[name].device)
                    linear = module.get_submodule(name[: -len(".weight")])
                    linear.weight = nn.Parameter(params[name].index_select(dim, kept))
                    linear.out_features, linear.in_features = linear.weight.shape
        return module
