"""Expert parallelism by hand: experts sharded over an `ep` group carved from the data-parallel ranks (`ep`).

Layout (dp = the world here; ep divides it): ep groups are runs of ep consecutive ranks, each holding all E experts
between them (E/ep per rank); "edp" groups join the ranks holding the *same* experts (dp/ep replicas):

    world 4, ep 2:  ep groups [0, 1] [2, 3]      edp groups [0, 2] [1, 3]

Per MoE layer, forward (the backward runs the same all-to-alls in reverse, through `_AllToAll`):
    1. all-to-all of the token counts (E/ep per peer): every rank learns how many rows it will receive;
    2. all-to-all dispatch of the token rows, already grouped by expert, so each peer's slice is contiguous;
    3. the local experts on the received rows, regrouped by expert (they arrive grouped by source rank);
    4. all-to-all combine: the outputs go back to where the tokens came from, in the original order.
A rank that receives no rows for an expert runs a 0-row matmul and still joins every collective: no hang.

Gradients: dense parameters are averaged over dp by `GradSync`; expert parameters, which already hold the sum of
every ep peer's contributions (the combine's backward brings them), are averaged over the edp replicas by a second
`GradSync` and divided by ep, so both come out as the gradient of the global-batch mean loss.

With `zero_stage` 1 or 2 two ZeRO engines (`strategies.zero_engine`) replace the `GradSync`s: one over dp for the
dense parameters, one over edp for the expert parameters (each rank's E/ep experts, split again by rows over their
dp/ep replicas); the same averages come out as reduce-scatters, each rank keeping (and updating) its rows only.

Checkpoints hold expert tensors as DTensors `[Replicate(), Shard(0)]` on the ("edp", "ep") mesh under their global
names and shapes, so DCP reshards them to any ep (or to a single file). Under ZeRO the optimizer state is first
all-gathered over the engine's group into what `zero_stage=0` holds: one format, whatever the stage.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Generator, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim import Optimizer
from typing_extensions import override

from strategies import comm
from strategies.base import BaseStrategy, WeightShard, _unwrap
from strategies.clip import GradShards
from strategies.ddp import GradSync, broadcast_parameters
from strategies.plan import ExpertModel
from strategies.zero_engine import ShardedParam, ZeroEngine


def check_expert_parallel(ep: int, dp: int, num_experts: Optional[int] = None) -> None:
    """Refuse sizes that cannot be laid out, naming the setting to change."""
    if ep < 1 or dp % ep:
        raise ValueError(f"`expert_parallel_size`={ep} must divide the data-parallel size {dp}: the ep groups are "
                         f"carved from the dp ranks (pick a divisor of {dp}, or change `trainer.devices`)")
    if num_experts is not None and num_experts % ep:
        raise ValueError(f"`moe_experts`={num_experts} is not divisible by `expert_parallel_size`={ep}: every "
                         "ep rank holds the same number of experts (change either)")


@dataclass
class ExpertLayout:
    """This rank's expert-parallel groups: `ep` (different experts) and `edp` (replicas of the same experts)."""

    ep_group: dist.ProcessGroup
    edp_group: dist.ProcessGroup
    ep_size: int
    edp_size: int

    @classmethod
    def get(cls, ep: int) -> "ExpertLayout":
        """Collective on first use (every rank builds every group), then cached like `ParallelLayout`."""
        world = dist.get_world_size()
        check_expert_parallel(ep, world)
        key = (id(dist.group.WORLD), world, ep)
        if key not in _CACHE:
            ep_group, _ = dist.new_subgroups_by_enumeration([list(range(i, i + ep)) for i in range(0, world, ep)])
            edp_group, _ = dist.new_subgroups_by_enumeration([list(range(j, world, ep)) for j in range(ep)])
            comm.name_group(ep_group, "ep")
            comm.name_group(edp_group, "edp")
            _CACHE[key] = cls(ep_group, edp_group, ep, world // ep)
        return _CACHE[key]

    def device_mesh(self, device_type: str) -> "torch.distributed.device_mesh.DeviceMesh":
        from torch.distributed.device_mesh import DeviceMesh

        mesh = torch.arange(self.ep_size * self.edp_size).view(self.edp_size, self.ep_size)
        return DeviceMesh.from_group([self.edp_group, self.ep_group], device_type, mesh=mesh,
                                     mesh_dim_names=("edp", "ep"))


_CACHE: dict[tuple, ExpertLayout] = {}


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


class ExpertShard(nn.Module):
    """Holds this rank's E/ep experts of an expert module and moves the tokens to the experts and back.

    The expert module keeps computing (on its sliced parameters); this wrapper registers those same Parameters
    under the same names, so the state-dict keys do not change. The expert module itself is kept out of the
    module tree for that reason.
    """

    def __init__(self, experts: nn.Module, num_experts: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group
        self.ep_size, ep_rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_experts, self.num_local = num_experts, num_experts // self.ep_size
        self.start = ep_rank * self.num_local
        for name, p in list(experts.named_parameters(recurse=False)):
            shard = nn.Parameter(p.detach()[self.start: self.start + self.num_local].clone(), p.requires_grad)
            setattr(experts, name, shard)
            self.register_parameter(name, shard)
        self._experts = [experts]

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        send = counts.view(self.ep_size, self.num_local)  # rows for each peer's experts, in expert order
        recv = torch.empty_like(send)
        comm.all_to_all(recv, send.contiguous(), self.group)
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        received = _AllToAll.apply(x, out_splits, in_splits, self.group)  # grouped by source, then expert
        local = torch.arange(self.num_local, device=x.device).repeat(self.ep_size)
        order = torch.repeat_interleave(local, recv.reshape(-1)).argsort(stable=True)
        y = self._experts[0](received[order], recv.sum(0))
        return _AllToAll.apply(y[order.argsort()], in_splits, out_splits, self.group)


def shard_experts(root: nn.Module, group: dist.ProcessGroup) -> dict[str, ExpertShard]:
    """Replace every expert module of the `ExpertModel` inside `root` by its `ExpertShard`; returns them by name
    (relative to `root`). Raises when the experts cannot be split evenly over the group."""
    found = [(prefix, m) for prefix, m in root.named_modules() if isinstance(m, ExpertModel)]
    if not found:
        raise ValueError("expert parallelism needs a model with an `expert_plan()` (strategies.plan.ExpertModel)")
    prefix, model = found[0]
    shards = {}
    for name, spec in model.expert_plan().items():
        check_expert_parallel(dist.get_world_size(group), dist.get_world_size(group), spec.num_experts)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        shard = ExpertShard(getattr(parent, child), spec.num_experts, group)
        setattr(parent, child, shard)
        shards[f"{prefix}.{name}" if prefix else name] = shard
    return shards


def _param_holder(params: list[nn.Parameter]) -> nn.Module:
    """A module over exactly these Parameters (not copies), for a `GradSync` that must see only them."""
    holder = nn.Module()
    holder.params = nn.ParameterList(params)
    return holder


class ExpertParallelStrategy(BaseStrategy):
    """`ep`: experts sharded over `expert_parallel_size` ranks, everything else data-parallel (see the module
    docstring). `expert_parallel_size` = the dp size is pure EP; smaller composes EP with DP replicas.
    `zero_stage` 1 or 2 shards the optimizer state (2: and the gradients) of the dense parameters over dp and of
    the expert parameters over edp."""

    def __init__(self, expert_parallel_size: int = 2, bucket_cap_mb: float = 25.0, zero_stage: int = 0,
                 **kwargs: Any) -> None:
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"`zero_stage`={zero_stage!r} with expert parallelism: choose 0 (replicated optimizer "
                             "state), 1 (optimizer state sharded: dense over dp, experts over their edp replicas) "
                             "or 2 (and gradients); ZeRO-3 is not supported with ep")
        super().__init__(**kwargs)
        self.expert_parallel_size = expert_parallel_size
        self.bucket_cap_mb = bucket_cap_mb
        self.zero_stage = zero_stage
        self._experts: Optional[ExpertLayout] = None
        self._shards: dict[str, ExpertShard] = {}
        self._syncs: list[GradSync] = []
        self._engines: list[ZeroEngine] = []  # ZeRO: [dense over dp, experts over edp]
        self._zero: dict[nn.Parameter, tuple[ZeroEngine, ShardedParam]] = {}  # parameter -> its rows (ZeRO)

    @override
    def setup_environment(self) -> None:
        if self._tp_size * self._pp_size != 1:
            raise ValueError("`ep` carves its groups from dp = the world: tensor_parallel_size and "
                             "pipeline_parallel_size must be 1 with it")
        super().setup_environment()
        check_expert_parallel(self.expert_parallel_size, self.layout.dp_size)
        self._experts = ExpertLayout.get(self.expert_parallel_size)

    # -- parameters and gradients ------------------------------------------------------------------------------
    def _expert_params(self) -> list[nn.Parameter]:
        return [p for shard in self._shards.values() for p in shard.parameters()]

    def parallelize(self, fitting: bool) -> None:
        assert self._experts is not None
        if not self._shards:  # a validate/test after fit keeps the shards
            self._shards = shard_experts(self.lightning_module, self._experts.ep_group)
        for model in (m for m in self.lightning_module.modules() if isinstance(m, ExpertModel)):
            model.set_batch_group(self.layout.dp_group)  # balancing statistics over the global batch
        experts = self._expert_params()  # a list: every rank must walk the parameters in the same order
        expert_ids = {id(p) for p in experts}
        dense = _param_holder([p for p in self.lightning_module.parameters() if id(p) not in expert_ids])
        replicas = _param_holder(experts)
        if not fitting:
            broadcast_parameters(dense, self.layout.dp_group)
            broadcast_parameters(replicas, self._experts.edp_group)
        elif self.zero_stage:  # the engines broadcast from their group's first rank, as GradSync does
            self._engines = [ZeroEngine(dense, self.zero_stage, self.layout.dp_group, self.root_device),
                             ZeroEngine(replicas, self.zero_stage, self._experts.edp_group, self.root_device)]
            self._zero = {sp.param: (engine, sp) for engine in self._engines for sp in engine.sharded_params()}
        else:
            self._syncs = [GradSync(dense, self.layout.dp_group, self.bucket_cap_mb)]
            if self._experts.edp_size > 1:
                self._syncs.append(GradSync(replicas, self._experts.edp_group, self.bucket_cap_mb))

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        """ZeRO: point the param groups at the master rows in place (as `ZeroEngine.shard_optimizer`, over the two
        engines), so the optimizer's state is created at shard size."""
        super().setup_optimizers(trainer)
        if self._zero:
            for optimizer in self.optimizers:
                for group in _unwrap(optimizer).param_groups:
                    group["params"] = [self._zero[p][1].master for p in group["params"]]

    def _grad(self, param: nn.Parameter) -> Optional[Tensor]:
        """What the optimizer steps with: the parameter's gradient, or under ZeRO its master rows' gradient."""
        return self._zero[param][1].master.grad if self._zero else param.grad

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        with super().block_backward_sync(), ExitStack() as stack:
            for sync in self._syncs:  # ZeRO engines reduce after every backward (see strategies.zero_engine)
                stack.enter_context(sync.no_sync())
            yield

    def finish_grad_sync(self) -> None:
        for sync in self._syncs:
            sync.finish()
        for engine in self._engines:
            engine.finish_grad_sync()
        grads = [g for g in map(self._grad, self._expert_params()) if g is not None]
        if grads:  # each holds the sum over its ep peers' losses: make it the mean
            torch._foreach_div_(grads, self.expert_parallel_size)

    def after_optimizer_step(self, optimizer: Union[Optimizer, LightningOptimizer]) -> None:
        for engine in self._engines:
            engine.after_step()  # all-gather the updated rows into the replicated parameters

    def grad_norm_shards(self) -> GradShards:
        """Expert grads are disjoint over ep; dense grads are counted on ep rank 0 only, then summed over ep. Under
        ZeRO every rank's rows are disjoint across the world (dense: over dp; experts: over edp, then ep)."""
        assert self._experts is not None
        params = [p for p in self.lightning_module.parameters() if self._grad(p) is not None]
        grads = [self._grad(p) for p in params]
        if self._zero:
            return GradShards(grads, groups=[self.layout.dp_group], device=self.root_device)
        experts = set(self._expert_params())
        first = dist.get_rank(self._experts.ep_group) == 0
        owned = [p.grad for p in params if p in experts or first]
        return GradShards(grads, owned, groups=[self._experts.ep_group], device=self.root_device)

    def owned_weights(self) -> list[WeightShard]:
        """Experts are this rank's E/ep rows of the global (E, ...) tensor; under ZeRO a parameter is its engine's
        rows of those (dense: of the whole tensor), all contiguous along dim 0 and spread over the world."""
        assert self._experts is not None
        owner = {p: shard for shard in self._shards.values() for p in shard.parameters()}
        out = []
        for name, p in self.lightning_module.named_parameters():
            shard = owner.get(p)
            first = shard.start if shard is not None else 0
            shape = torch.Size((shard.num_experts, *p.shape[1:])) if shard is not None else p.shape
            local, start, end = p, first, first + (p.shape[0] if p.dim() else 1)
            group = self._experts.ep_group if shard is not None else None
            if self._zero:
                sp = self._zero[p][1]
                local, start, end, group = sp.master, first + sp.start, first + sp.end, self.layout.dp_group
            out.append(WeightShard(name, local, p, shape, 0, start, end, group))
        return out

    @override
    def teardown(self) -> None:
        for sync in self._syncs:
            sync.remove_hooks()
        for engine in self._engines:
            engine.detach()
        self._syncs, self._engines, self._zero = [], [], {}
        super().teardown()

    # -- checkpoints: expert tensors as DTensors under global names, optimizer state whole on its rank ------------
    def _expert_fqns(self) -> dict[str, ExpertShard]:
        return {f"{name}.{p}": shard for name, shard in self._shards.items() for p, _ in shard.named_parameters()}

    def _dtensor(self, shard: ExpertShard, local: Tensor) -> DTensor:
        assert self._experts is not None
        shape = torch.Size((shard.num_experts, *local.shape[1:]))
        return DTensor.from_local(local, self._experts.device_mesh(self.root_device.type), [Replicate(), Shard(0)],
                                  run_check=False, shape=shape, stride=torch.empty(shape, device="meta").stride())

    def param_names(self) -> dict[Tensor, str]:
        names = super().param_names()
        if not self._zero:
            return names
        return {sp.master: names[p] for p, (_, sp) in self._zero.items()}  # what the optimizer holds

    def _gather_rows(self, fqn: str, rows: Tensor) -> Tensor:
        """ZeRO: the whole (rank-local) tensor from its engine's ranks' rows, i.e. what `zero_stage=0` holds."""
        engine, sp = self._zero[self.lightning_module.get_parameter(fqn)]
        return sp.gather_rows(rows, engine.group)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        experts = self._expert_fqns()
        state = self.lightning_module.state_dict()
        return {k: self._dtensor(experts[k], v) if k in experts else v for k, v in state.items()}

    @override
    def optimizer_state(self, optimizer: Union[Optimizer, LightningOptimizer]) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        experts = self._expert_fqns()

        def saved(fqn: str, value: Any) -> Any:
            if not _is_rows(value):
                return value
            value = self._gather_rows(fqn, value) if self._zero else value
            return self._dtensor(experts[fqn], value) if fqn in experts else value

        # new dicts: torch's optimizer state_dict() hands out its live per-parameter dicts
        state["state"] = {fqn: {k: saved(fqn, v) for k, v in s.items()} for fqn, s in state["state"].items()}
        return state

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        """DCP filled DTensors (to unwrap); a single-file checkpoint brings whole expert tensors (to slice). Under
        ZeRO the optimizer keeps this rank's rows of each state tensor."""
        experts = self._expert_fqns()

        def local(fqn: str, value: Any) -> Any:
            if isinstance(value, DTensor):
                return value.to_local()
            if fqn in experts and _is_rows(value) and value.shape[0] == experts[fqn].num_experts:
                shard = experts[fqn]
                return value[shard.start: shard.start + shard.num_local]
            return value

        def live(fqn: str, value: Any) -> Any:
            value = local(fqn, value)
            if not self._zero or not _is_rows(value):
                return value
            sp = self._zero[self.lightning_module.get_parameter(fqn)][1]
            return value[sp.start: sp.end].clone()

        state["model"] = {k: local(k, v) for k, v in state["model"].items()}
        for key in [k for k in state if k.startswith("optimizer_")]:
            saved = state[key]["state"]
            state[key]["state"] = {fqn: {k: live(fqn, v) for k, v in s.items()} for fqn, s in saved.items()}
        super().load_sharded_state(state)
        with torch.no_grad():  # bf16-true keeps separate fp32 masters: take the loaded weights' rows
            for _, sp in self._zero.values():
                if sp.master.dtype != sp.param.dtype:
                    sp.master.copy_(sp.param[sp.start: sp.end])


def _is_rows(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0
