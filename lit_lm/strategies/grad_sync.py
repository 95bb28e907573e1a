"""Data parallelism by hand: a bucketed, overlapped gradient all-reduce (`GradSync`), the engine of `lm_ddp`.

Every rank holds the whole model and a different slice of the global batch. After backward, each gradient must
be the average over the ranks. Doing one all-reduce per parameter at the end would serialise communication behind
backward; instead (as torch DDP does):

- parameters are packed, in *reverse* registration order (roughly the order backward produces their gradients),
  into flat buckets of about `bucket_cap_mb`, the first of them smaller (`first_bucket_mb`, 1 MB as torch DDP's):
  it holds the last layers, whose gradients are ready first, so communication starts early in backward instead
  of waiting for a whole 25 MB bucket (a model under 25 MB would otherwise be one bucket, launched only once
  backward is over, with nothing left to overlap);
- gradients live in the buckets (torch DDP's `gradient_as_bucket_view`, Megatron's grad buffer): each
  parameter's `.grad` is a view into its bucket's flat buffer, allocated once, and autograd accumulates into it in
  place. A gradient pre-hook re-points a `.grad` that `zero_grad(set_to_none=True)` dropped (zeroing its slice)
  just before autograd accumulates into it, so one gradient copy of Φ exists, never two, and nothing is copied;
- a `post_accumulate_grad_hook` per parameter marks it ready; when a bucket's parameters are all ready an
  *asynchronous* in-place all-reduce of its buffer is launched, so it overlaps the rest of backward. Buckets
  launch strictly in order, so every rank issues the same collectives in the same order even when gradients
  arrive in a different order;
- `finish_grad_sync()` launches what is left (a parameter that got no gradient on this rank, i.e. unused, contributes
  its zeroed slice, so no rank waits forever), waits, and divides each buffer by the group size in place. Every
  trainable parameter then has the same gradient on every rank (zeros if no rank used it), so the replicas cannot
  drift.

Averaging is a post-division (sum, then divide the flat buffer once): the sum of bf16 or fp32 gradients cannot
overflow (bf16 has fp32's exponent range; pre-division is the fp16 remedy), and dividing the sum rounds once
where pre-division rounds every rank's contribution.

Tied parameters are one `Parameter` reachable twice: `parameters()` yields it once, autograd accumulates both uses
before its hook fires, so it is reduced once. Frozen parameters (`requires_grad=False`) are left out. A `.grad`
that someone replaced by another tensor is copied into its slice and re-pointed at launch (correct, one copy).
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generator, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lit_lm.strategies import comm
from lit_lm.strategies.flat_step import FlatShard, FlatStep, elementwise


def broadcast_parameters(module: nn.Module, group: Optional[dist.ProcessGroup] = None) -> None:
    """Make every replica start from the group's first rank's parameters and buffers."""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            comm.broadcast(tensor.detach(), src, group, label="broadcast parameters")


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    flat: Tensor  # the communication buffer, where the gradients live
    views: list[Tensor]  # flat's slices, shaped like params: their `.grad`
    ready: set[int] = field(default_factory=set)  # indices into params whose gradient is final
    work: Optional[dist.Work] = None

    @property
    def full(self) -> bool:
        return len(self.ready) == len(self.params)

    @classmethod
    def of(cls, params: list[nn.Parameter], flat: Optional[Tensor] = None) -> "_Bucket":
        """A bucket of `params` over `flat` (zeros of their total size: a new one unless given)."""
        if flat is None:
            flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        views = [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in params]), params)]
        return cls(params, flat, views)

    def attach(self) -> None:
        """Point every `.grad` of the bucket at its slice: a dropped one (None) starts from zeros, a replaced one
        is copied in. Cheap when all are attached already (the common case inside backward)."""
        with torch.no_grad():
            dropped = all(p.grad is None for p in self.params)  # zero_grad(set_to_none=True): one fill, not one
            if dropped:                                          # per parameter
                self.flat.zero_()
            for p, view in zip(self.params, self.views):
                if p.grad is view:
                    continue
                if p.grad is None:
                    if not dropped:
                        view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view


def _bucketize(params: Iterable[nn.Parameter], cap_bytes: float,
               first_cap_bytes: Optional[float] = None) -> list[list[nn.Parameter]]:
    """Consecutive runs of `params` with one dtype and device, closed once they reach `cap_bytes` (the first one
    once it reaches `first_cap_bytes`, if smaller)."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    first = cap_bytes if first_cap_bytes is None else min(first_cap_bytes, cap_bytes)
    for p in params:
        if (not buckets or size >= (first if len(buckets) == 1 else cap_bytes)
                or (p.dtype, p.device) != (buckets[-1][0].dtype, buckets[-1][0].device)):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    return buckets


class GradSync(nn.Module):
    """Averages the gradients of `module` over `group` during backward. Usable without Lightning:

        model = GradSync(model, group=None, bucket_cap_mb=25)   # on an initialised process group
        loss = model(x).sum(); loss.backward(); model.finish_grad_sync(); optimizer.step()
        with model.no_sync(): ...                                # accumulate locally, no communication

    Construction broadcasts the first rank's parameters and buffers so the replicas start equal. After the first
    backward every trainable `.grad` is a view into `buckets[i].flat` (see the module docstring). The verbs are the
    data-parallel engine protocol's (`lit_lm/strategies/dp_engine.py`), shared with `ZeroEngine`.
    """

    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup] = None, bucket_cap_mb: float = 25.0,
                 broadcast: bool = True, first_bucket_mb: float = 1.0) -> None:
        super().__init__()
        self.module = module
        self.group = group
        self.sync_enabled = True
        if broadcast:
            broadcast_parameters(module, group)
        params = [p for p in module.parameters() if p.requires_grad]
        groups = _bucketize(reversed(params), bucket_cap_mb * 2**20, first_bucket_mb * 2**20)
        self.buckets = [_Bucket.of(b) for b in groups]
        self._slot = {p: (i, j) for i, b in enumerate(self.buckets) for j, p in enumerate(b.params)}
        self._next = 0  # the first bucket not launched yet
        self._hooks: list[Any] = []
        self.attach()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Backward passes inside accumulate into `.grad` locally; the next synchronised one reduces the sum."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def _before_accumulate(self, param: nn.Parameter, grad: Tensor) -> None:
        """Runs just before autograd accumulates `grad` into `param.grad`: make that `.grad` the bucket's slice,
        so the accumulation writes into the communication buffer (in place: shapes and strides match)."""
        if param.grad is None:  # the first gradient since zero_grad(set_to_none=True): the whole bucket was dropped
            self.buckets[self._slot[param][0]].attach()

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.sync_enabled:
            return
        i, j = self._slot[param]
        bucket = self.buckets[i]
        if j in bucket.ready:
            raise RuntimeError(
                "a parameter got a second gradient in one synchronised step (several backward passes before "
                "finish_grad_sync()): run all but the last of them inside no_sync()"
            )
        bucket.ready.add(j)
        while self._next < len(self.buckets) and self.buckets[self._next].full:
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: _Bucket) -> None:
        bucket.attach()  # unused on this rank: its zeroed slice takes part in the collective
        bucket.work = comm.all_reduce(bucket.flat, self.group, dist.ReduceOp.SUM, async_op=True,
                                      label="GradSync bucket")
        self._next += 1

    def finish_grad_sync(self) -> None:
        """Launch the remaining buckets, wait for all, and average them in place (the `.grad`s are their views)."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        world = dist.get_world_size(self.group)
        for bucket in self.buckets:
            assert bucket.work is not None
            bucket.work.wait()
            bucket.flat.div_(world)
            bucket.ready.clear()
            bucket.work = None
        self._next = 0

    @torch.no_grad()
    def flatten(self, groups: list[set[nn.Parameter]]) -> list[list[FlatShard]]:
        """For a flat optimizer step (`lit_lm/strategies/flat_step.py`): order each bucket's parameters by the optimizer
        param group that holds them (a bucket launches once all its gradients are ready, whatever their order
        inside it) and make them views of one flat buffer per bucket, laid out as its gradient buffer. Returns, per
        group, one `FlatShard` per bucket holding any of its parameters. Call before the first backward."""
        which = {p: i for i, g in enumerate(groups) for p in g}
        out: list[list[FlatShard]] = [[] for _ in groups]
        for k, bucket in enumerate(self.buckets):
            params = sorted(bucket.params, key=lambda p: which.get(p, len(groups)))  # stable: backward order kept
            bucket = self.buckets[k] = _Bucket.of(params, bucket.flat)
            values = torch.empty_like(bucket.flat)
            starts = [v.storage_offset() - bucket.flat.storage_offset() for v in bucket.views]
            for p, start in zip(params, starts):
                value = values[start: start + p.numel()].view_as(p)
                value.copy_(p.data)
                p.data = value
            for i in range(len(groups)):
                members = [j for j, p in enumerate(params) if which.get(p) == i]
                if members:  # consecutive after the sort
                    span = slice(starts[members[0]], starts[members[-1]] + params[members[-1]].numel())
                    out[i].append(FlatShard([params[j] for j in members], values[span], bucket.flat[span]))
        self._slot = {p: (i, j) for i, b in enumerate(self.buckets) for j, p in enumerate(b.params)}
        return out

    def attach(self) -> None:
        """Register the gradient hooks (construction does); `detach()` removes them."""
        self.detach()
        params = [p for b in self.buckets for p in b.params]
        self._hooks = [h for p in params for h in (p.register_hook(partial(self._before_accumulate, p)),
                                                   p.register_post_accumulate_grad_hook(self._on_grad_ready))]

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def after_step(self) -> None:
        """Nothing to do after the update: every rank stepped the same whole parameters (the protocol's verb)."""


def flat_step(optimizer: torch.optim.Optimizer, syncs: list[GradSync]) -> None:
    """Give `optimizer` a flat step over the parameters `syncs` reduce (`GradSync.flatten`), where it is
    elementwise; other optimizers (and parameters outside every sync: frozen ones) keep their per-tensor step."""
    if not elementwise(optimizer):
        return
    groups = [set(g["params"]) for g in optimizer.param_groups]
    flats: list[list[FlatShard]] = [[] for _ in groups]
    for sync in syncs:
        for mine, theirs in zip(flats, sync.flatten(groups)):
            mine.extend(theirs)
    FlatStep(optimizer, flats)

