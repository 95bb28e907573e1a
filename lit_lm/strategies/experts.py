"""Expert parallelism by hand: experts sharded over an `ep` group carved from the data-parallel ranks.

Layout (`lit_lm/strategies/layout.py`): ep groups are runs of ep consecutive ranks of dp_shard x cp, each holding all E
experts between them (E/ep per rank); "edp" groups join the ranks holding the *same* experts:

    world 4, ep 2:  ep groups [0, 1] [2, 3]      edp groups [0, 2] [1, 3]

Per MoE layer, forward (the backward runs the same all-to-alls in reverse, through `_AllToAll`):
    1. all-to-all of the token counts (E/ep per peer): every rank learns how many rows it will receive (the
       layer's one host read: all-to-all takes its split sizes as Python lists);
    2. all-to-all dispatch of the token rows, already grouped by expert, so each peer's slice is contiguous;
    3. the local experts on the received rows, regrouped by expert (they arrive grouped by source rank);
    4. all-to-all combine: the outputs go back to where the tokens came from, in the original order.
A rank that receives no rows for an expert runs a 0-row matmul and still joins every collective: no hang.

Gradients (`lit_lm/strategies/composed.py`): dense parameters are averaged over dp; expert parameters, which already
hold the sum of every ep peer's contributions (the combine's backward brings them), are averaged over edp and divided by
ep, so both come out as the gradient of the global-batch mean loss. Under ZeRO 1-2 one engine shards the dense
parameters over dp, a second the expert parameters over edp.

This module is the engine only (no Lightning); the `ep` strategy is a preset of `ComposedStrategy`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lit_lm.strategies import comm
from lit_lm.strategies.plan import ExpertModel


def check_expert_parallel(ep: int, dp: int, num_experts: Optional[int] = None) -> None:
    """Refuse sizes that cannot be laid out, naming the setting to change."""
    if ep < 1 or dp % ep:
        raise ValueError(f"`expert_parallel_size`={ep} must divide the data-parallel size {dp}: the ep groups are "
                         f"carved from the dp ranks (pick a divisor of {dp}, or change `trainer.devices`)")
    if num_experts is not None and num_experts % ep:
        raise ValueError(f"`moe_experts`={num_experts} is not divisible by `expert_parallel_size`={ep}: every "
                         "ep rank holds the same number of experts (change either)")


class _AllToAll(torch.autograd.Function):
    """Rows of `x` split by `in_splits` go to the group's ranks; `out_splits` rows arrive from each. Its backward
    is the reverse all-to-all (the splits swapped)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    @override
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None, None]:
        in_splits, out_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    comm.all_to_all(out, x.contiguous(), group, out_splits, in_splits)
    return out


class ExpertShard:
    """This rank's E/ep experts of an expert module, and the token exchange around its forward.

    The expert module stays where it is (its parameters keep their names, so the state-dict keys do not change); its
    parameters are cut to this rank's experts in place, and two forward hooks move the tokens: the pre-hook
    dispatches them to the ranks holding their experts, the post-hook combines the outputs back. Nothing else holds
    the parameters, so a strategy may replace them (materialising from the meta device) with nothing to re-point.
    The hooks belong to a `TokenExchange`, which holds no reference to the module: a module the pipeline drops (a
    layer of another stage) is freed with its experts at once, not left in a module <-> hook cycle until Python's
    cyclic collector finds it (issue 58). Calling the shard calls the expert module.
    """

    def __init__(self, experts: nn.Module, num_experts: int, group: dist.ProcessGroup) -> None:
        self.experts, self.group = experts, group
        self.ep_size, ep_rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_experts, self.num_local = num_experts, num_experts // self.ep_size
        self.start = ep_rank * self.num_local
        for name, p in list(experts.named_parameters(recurse=False)):
            setattr(experts, name, nn.Parameter(p.detach()[self.start: self.start + self.num_local].clone(),
                                                p.requires_grad))
        self.exchange = TokenExchange(group, self.ep_size, self.num_local)
        self._hooks = [experts.register_forward_pre_hook(self.exchange.dispatch),
                       experts.register_forward_hook(self.exchange.combine)]

    def __call__(self, x: Tensor, counts: Tensor) -> Tensor:
        return self.experts(x, counts)

    def global_shapes(self) -> dict[str, torch.Size]:
        """Each parameter's shape over all E experts, by its name in the expert module."""
        return {name: torch.Size((self.num_experts, *p.shape[1:]))
                for name, p in self.experts.named_parameters(recurse=False)}


class TokenExchange:
    """The two all-to-alls around one expert module's forward (its hooks), and the routes of the forwards in
    flight; it knows the group and this rank's number of experts, not the module."""

    def __init__(self, group: dist.ProcessGroup, ep_size: int, num_local: int) -> None:
        self.group, self.ep_size, self.num_local = group, ep_size, num_local
        self._routes: list[tuple[Tensor, list[int], list[int], int]] = []  # one per forward in flight

    def dispatch(self, _module: nn.Module, args: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """`x` grouped by expert, `counts[e]` rows for expert e, then rows of no expert (dropped by a capacity: not
        sent, zero in the output) -> the rows of this rank's experts from every peer, grouped by expert."""
        x, counts = args
        send = counts.view(self.ep_size, self.num_local)  # rows for each peer's experts, in expert order
        recv = torch.empty_like(send)
        comm.all_to_all(recv, send.contiguous(), self.group)
        # The layer's one host read: all_to_all takes the split sizes as Python lists (NCCL's too).
        in_splits, out_splits = torch.stack([send.sum(1), recv.sum(1)]).tolist()
        sent = sum(in_splits)
        received = _AllToAll.apply(x[:sent], out_splits, in_splits, self.group)  # grouped by source, then expert
        local = torch.arange(self.num_local, device=x.device).repeat(self.ep_size)
        order = torch.repeat_interleave(local, recv.reshape(-1), output_size=sum(out_splits)).argsort(stable=True)
        self._routes.append((order, in_splits, out_splits, x.shape[0] - sent))
        return received[order], recv.sum(0)

    def combine(self, _module: nn.Module, _args: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
        """The experts' outputs back to where their tokens came from, in the original order."""
        order, in_splits, out_splits, dropped = self._routes.pop()
        out = _AllToAll.apply(y[order.argsort()], in_splits, out_splits, self.group)
        return F.pad(out, (0, 0, 0, dropped))


def shard_experts(root: nn.Module, group: dist.ProcessGroup) -> dict[str, ExpertShard]:
    """Shard every expert module of the `ExpertModel` inside `root` (`ExpertShard`); returns the shards by the expert
    module's name (relative to `root`). Raises when the experts cannot be split evenly over the group."""
    found = [(prefix, m) for prefix, m in root.named_modules() if isinstance(m, ExpertModel)]
    if not found:
        raise ValueError("expert parallelism needs a model with an `expert_plan()` "
                         "(lit_lm.strategies.plan.ExpertModel)")
    prefix, model = found[0]
    shards = {}
    for name, spec in model.expert_plan().items():
        check_expert_parallel(dist.get_world_size(group), dist.get_world_size(group), spec.num_experts)
        shards[f"{prefix}.{name}" if prefix else name] = ExpertShard(model.get_submodule(name), spec.num_experts,
                                                                     group)
    return shards

