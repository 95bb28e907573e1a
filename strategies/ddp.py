"""Data parallelism by hand: a bucketed, overlapped gradient all-reduce (`GradSync`), the engine of `lm_ddp`.

Every rank holds the whole model and a different slice of the global batch. After backward, each gradient must
be the average over the ranks. Doing one all-reduce per parameter at the end would serialise communication behind
backward; instead (as torch DDP does):

- parameters are packed, in *reverse* registration order (roughly the order backward produces their gradients),
  into flat buckets of about `bucket_cap_mb`;
- a `post_accumulate_grad_hook` per parameter marks it ready; when a bucket's parameters are all ready its
  gradients are copied into the flat buffer and an *asynchronous* all-reduce is launched, so it overlaps the rest
  of backward. Buckets launch strictly in order, so every rank issues the same collectives in the same order even
  when gradients arrive in a different order;
- `finish()` launches what is left (a parameter that got no gradient on this rank, i.e. unused, contributes zeros,
  so no rank waits forever), waits, divides by the group size and copies back into `.grad`. Every trainable
  parameter then has the same gradient on every rank (zeros if no rank used it), so the replicas cannot drift.

Averaging is a post-division (sum, then divide the flat buffer once): the sum of bf16 or fp32 gradients cannot
overflow (bf16 has fp32's exponent range; pre-division is the fp16 remedy), and dividing the sum rounds once
where pre-division rounds every rank's contribution.

Tied parameters are one `Parameter` reachable twice: `parameters()` yields it once, autograd accumulates both uses
before its hook fires, so it is reduced once. Frozen parameters (`requires_grad=False`) are left out.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generator, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from strategies import comm


def broadcast_parameters(module: nn.Module, group: Optional[dist.ProcessGroup] = None) -> None:
    """Make every replica start from the group's first rank's parameters and buffers."""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            comm.broadcast(tensor.detach(), src, group, label="broadcast parameters")


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    flat: Tensor  # the communication buffer
    views: list[Tensor]  # flat's slices, shaped like params
    ready: set[int] = field(default_factory=set)  # indices into params whose gradient is final
    work: Optional[dist.Work] = None

    @property
    def full(self) -> bool:
        return len(self.ready) == len(self.params)

    @classmethod
    def of(cls, params: list[nn.Parameter]) -> "_Bucket":
        flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        views = [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in params]), params)]
        return cls(params, flat, views)


def _bucketize(params: Iterable[nn.Parameter], cap_bytes: float) -> list[list[nn.Parameter]]:
    """Consecutive runs of `params` with one dtype and device, closed once they reach `cap_bytes`."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        if not buckets or size >= cap_bytes or (p.dtype, p.device) != (buckets[-1][0].dtype, buckets[-1][0].device):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    return buckets


class GradSync(nn.Module):
    """Averages the gradients of `module` over `group` during backward. Usable without Lightning:

        model = GradSync(model, group=None, bucket_cap_mb=25)   # on an initialised process group
        loss = model(x).sum(); loss.backward(); model.finish(); optimizer.step()
        with model.no_sync(): ...                                # accumulate locally, no communication

    Construction broadcasts the first rank's parameters and buffers so the replicas start equal.
    """

    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup] = None, bucket_cap_mb: float = 25.0,
                 broadcast: bool = True) -> None:
        super().__init__()
        self.module = module
        self.group = group
        self.sync_enabled = True
        if broadcast:
            broadcast_parameters(module, group)
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = [_Bucket.of(b) for b in _bucketize(reversed(params), bucket_cap_mb * 2**20)]
        self._slot = {p: (i, j) for i, b in enumerate(self.buckets) for j, p in enumerate(b.params)}
        self._next = 0  # the first bucket not launched yet
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

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

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.sync_enabled:
            return
        i, j = self._slot[param]
        bucket = self.buckets[i]
        if j in bucket.ready:
            raise RuntimeError(
                "a parameter got a second gradient in one synchronised step (several backward passes before "
                "finish()): run all but the last of them inside no_sync()"
            )
        bucket.ready.add(j)
        while self._next < len(self.buckets) and self.buckets[self._next].full:
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: _Bucket) -> None:
        for p, view in zip(bucket.params, bucket.views):
            if p.grad is None:
                view.zero_()  # unused on this rank: contribute nothing, but take part in the collective
            else:
                view.copy_(p.grad)
        bucket.work = comm.all_reduce(bucket.flat, self.group, async_op=True, label="GradSync bucket")
        self._next += 1

    def finish(self) -> None:
        """Launch the remaining buckets, wait for all, and write the averaged gradients into `.grad`."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        world = dist.get_world_size(self.group)
        with torch.no_grad():
            for bucket in self.buckets:
                assert bucket.work is not None
                bucket.work.wait()
                bucket.flat.div_(world)
                for p, view in zip(bucket.params, bucket.views):
                    if p.grad is None:
                        p.grad = view.clone()
                    else:
                        p.grad.copy_(view)
                bucket.ready.clear()
                bucket.work = None
        self._next = 0

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def __getattr__(name: str) -> Any:
    """`strategies.ddp.DataParallelStrategy` (the class path of configs/strategies/ddp.yaml) is the `lm_ddp` preset,
    resolved lazily so this engine imports without Lightning."""
    if name == "DataParallelStrategy":
        from strategies.registry import DataParallelStrategy

        return DataParallelStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
