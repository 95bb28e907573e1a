"""Every collective a strategy issues goes through here, so its volume can be counted and compared to theory.

The accounting layer records (op, group name, bytes of the payload a rank contributes, elements, the caller's label)
per call. Tests and benchmarks read `COMM_LOG`; the last entries also tell which collective a hung rank entered (a
flight recorder). Recording is a list append: cheap enough to stay on in training.

Besides the tensor collectives of the engines, everything else a strategy or callback synchronises on goes through
here too, so a hang in any of them is named: barriers, object collectives (`broadcast_object`,
`all_gather_object`), Lightning's `reduce` (metric sync of `self.log(sync_dist=True)`, the MoE router-bias counts)
and the checkpoint's collectives (`note` records DCP's save and load, whose collectives are DCP's own). Object
collectives and notes count no bytes (their payload is pickled Python, not training traffic).

Bytes are counted per rank as the size of the *full* logical tensor of the op (the all-reduce input, the
reduce-scatter input, the all-gather output), so the classic ring-algorithm volumes follow by the factors
all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class CommRecord:
    op: str
    group: str
    world: int  # ranks in the group
    numel: int  # elements of the full logical tensor
    nbytes: int
    label: str = ""  # who issued it (e.g. "GradSync", "zero reduce blocks.3", "checkpoint save")

    @property
    def wire_bytes(self) -> float:
        """Bytes each rank sends under a ring algorithm."""
        return wire_factor(self.op, self.world) * self.nbytes


def wire_factor(op: str, world: int) -> float:
    """Bytes a rank sends per byte of an op's full logical tensor (ring algorithm): the volume theory's one place.
    Barriers, object collectives and notes count nothing here (they are recorded for the flight recorder)."""
    n = world
    if n <= 1:
        return 0.0
    return {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n,
            "all_to_all": (n - 1) / n, "broadcast": 1.0, "send": 1.0}.get(op, 0.0)


class CommLog:
    """Counts collectives. `enabled` turns accounting off entirely; `history` keeps the last calls for hang reports
    (bounded). `records` keeps every call since the last `reset()` (a measurement starts with one): before any reset
    nothing accumulates, so a long training run does not grow a list by one record per collective."""

    def __init__(self, history: int = 64) -> None:
        self.enabled = True
        self.recording = False
        self.records: list[CommRecord] = []
        self.history: deque[CommRecord] = deque(maxlen=history)

    def add(self, op: str, group: Optional[dist.ProcessGroup], numel: int, element_size: int,
            label: str = "") -> None:
        if not self.enabled:
            return
        rec = CommRecord(op, group_name(group), dist.get_world_size(group), numel, numel * element_size, label)
        if self.recording:
            self.records.append(rec)
        self.history.append(rec)

    def reset(self) -> None:
        """Start (or restart) counting: `records` and `summary()` cover the calls from here on."""
        self.records.clear()
        self.recording = True

    def summary(self) -> dict[str, dict[str, float]]:
        """{op: {"calls", "numel", "bytes", "wire_bytes"}} over the records since the last reset."""
        out: dict[str, dict[str, float]] = {}
        for r in self.records:
            s = out.setdefault(r.op, {"calls": 0, "numel": 0, "bytes": 0, "wire_bytes": 0.0})
            s["calls"] += 1
            s["numel"] += r.numel
            s["bytes"] += r.nbytes
            s["wire_bytes"] += r.wire_bytes
        return out


COMM_LOG = CommLog()
# torch 2.13 renamed the single-tensor collectives (the old names warn); older releases only have the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_GROUP_NAMES: dict[int, str] = {}


def name_group(group: dist.ProcessGroup, name: str) -> None:
    """Give a process group a readable name ("dp", "tp", "pp", ...) for the accounting records."""
    _GROUP_NAMES[id(group)] = name


def group_name(group: Optional[dist.ProcessGroup]) -> str:
    return "world" if group is None else _GROUP_NAMES.get(id(group), "group")


class Done:
    """The handle of a collective that completed before it was returned."""

    def wait(self) -> bool:
        return True


ZERO_COLLECTIVES = {  # a strategy's `zero_collectives` choice -> (how gradients are reduced, how weights gathered)
    "reduce_scatter": ("reduce_scatter", "all_gather"),  # NCCL's: the least bytes, each in one collective
    "all_reduce": ("all_reduce", "broadcast"),  # gloo's fast forms: an all-reduce, and one broadcast per rank
}


def zero_forms(choice: str, device: str, stage: int) -> tuple[str, str]:
    """The collectives ZeRO runs for its gradient reduce-scatter and its parameter all-gather (the ops the accounting
    layer records, and the planner counts): `choice` "auto" picks per backend, from the ranks' `device` type.

    gloo (CPU ranks, and the meta tensors of `lit-lm check --full-size`'s fake ranks, which stand for them) is slow
    at its own reduce-scatter and all-gather and fast at an all-reduce and a broadcast: 64 MiB on 2 ranks, 122 and
    98 ms against 78 ms for an all-reduce of the same 64 MiB and 26 ms for one broadcast per rank of its half
    (docs/benchmarks/2026-12-size-cpu.md). So under "auto" ZeRO-1/2 reduce gradients by an all-reduce (twice the
    bytes on the wire, in less time) and gather weights by a broadcast per rank, as torch's
    `ZeroRedundancyOptimizer` + DDP do; ZeRO-3 keeps the collectives as written there, as FSDP2 does (its gathers
    are per unit, in the forward). NCCL (any accelerator): reduce-scatter and all-gather, the fewest bytes.
    "reduce_scatter" or "all_reduce" forces one form."""
    if choice == "auto":
        choice = "all_reduce" if device in ("cpu", "meta") and stage in (1, 2) else "reduce_scatter"
    if choice not in ZERO_COLLECTIVES:
        raise ValueError(f"zero_collectives={choice!r}: choose auto, {', '.join(ZERO_COLLECTIVES)}")
    return ZERO_COLLECTIVES[choice]


class _Then:
    """The handle of a collective followed by local work (`then`) once it completes."""

    def __init__(self, work: Any, then: Callable[[], Any]) -> None:
        self.work, self.then = work, then

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
            self.then()
        return True


def _handle(work: Any, async_op: bool) -> Optional[Any]:
    """As torch.distributed: the handle when `async_op`, else completed here and None."""
    if async_op:
        return work
    work.wait()
    return None


def all_reduce(tensor: Tensor, group: Optional[dist.ProcessGroup] = None, op: dist.ReduceOp = dist.ReduceOp.SUM,
               async_op: bool = False, label: str = "") -> Optional[dist.Work]:
    COMM_LOG.add("all_reduce", group, tensor.numel(), tensor.element_size(), label)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def _in_place_at_own_chunk(whole: Tensor, part: Tensor, group: Optional[dist.ProcessGroup], op: str) -> None:
    """NCCL's rule for an in-place reduce-scatter or all-gather: `part`, where it lies inside `whole`, must be this
    rank's chunk of it (gloo copies through staging and forgives a misplaced one; NCCL would read or write the wrong
    rows). Addresses only: no host sync."""
    offset = part.data_ptr() - whole.data_ptr()
    nbytes = whole.numel() * whole.element_size()
    if 0 <= offset < nbytes and offset != dist.get_rank(group) * (nbytes // dist.get_world_size(group)):
        raise ValueError(f"{op}: the in-place chunk is at byte {offset} of the whole, not this rank's "
                         f"({dist.get_rank(group)} of {dist.get_world_size(group)})")


def reduce_scatter(output: Tensor, input: Tensor, group: Optional[dist.ProcessGroup] = None,
                   op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False,
                   label: str = "", form: str = "reduce_scatter") -> Optional[dist.Work]:
    """`input` is the concatenation of N equal chunks; rank r receives the reduced chunk r in `output` (which may be
    that chunk of `input`: in place, as NCCL allows). `form` "all_reduce" (`zero_forms`): an in-place all-reduce of
    `input` (which it overwrites), then the copy of chunk r where `output` is not it."""
    _in_place_at_own_chunk(input, output, group, "reduce_scatter")
    if form == "all_reduce" and dist.get_world_size(group) > 1:
        COMM_LOG.add("all_reduce", group, input.numel(), input.element_size(), label)
        mine = input.view(dist.get_world_size(group), -1)[dist.get_rank(group)]
        work = dist.all_reduce(input, op=op, group=group, async_op=True)
        in_place = output.data_ptr() == mine.data_ptr()  # the result is already where it belongs
        return _handle(work if in_place else _Then(work, lambda: output.view(-1).copy_(mine)), async_op)
    COMM_LOG.add("reduce_scatter", group, input.numel(), input.element_size(), label)
    return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def all_gather(output: Tensor, input: Tensor, group: Optional[dist.ProcessGroup] = None,
               async_op: bool = False, label: str = "", form: str = "all_gather") -> Optional[dist.Work]:
    """`output` is the concatenation of every rank's equal-size `input` (which may be this rank's chunk of `output`:
    in place). `form` "broadcast" (`zero_forms`): one broadcast per rank, each of its own chunk of `output`, in
    place."""
    _in_place_at_own_chunk(output, input, group, "all_gather")
    if form == "broadcast" and dist.get_world_size(group) > 1:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        chunks = output.view(world, -1)
        if input.data_ptr() != chunks[rank].data_ptr():  # not in place
            chunks[rank].copy_(input.view(-1))
        works = []
        for i in range(world):
            COMM_LOG.add("broadcast", group, chunks[i].numel(), output.element_size(), label)
            works.append(dist.broadcast(chunks[i], src=i if group is None else dist.get_global_rank(group, i),
                                        group=group, async_op=True))
        return _handle(_Batch(works), async_op)
    COMM_LOG.add("all_gather", group, output.numel(), output.element_size(), label)
    return _all_gather_single(output, input, group=group, async_op=async_op)


def broadcast(tensor: Tensor, src: int, group: Optional[dist.ProcessGroup] = None,
              async_op: bool = False, label: str = "") -> Optional[dist.Work]:
    """`src` is a global rank, as in torch.distributed."""
    COMM_LOG.add("broadcast", group, tensor.numel(), tensor.element_size(), label)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_to_all(output: Tensor, input: Tensor, group: Optional[dist.ProcessGroup] = None,
               output_split_sizes: Optional[list[int]] = None, input_split_sizes: Optional[list[int]] = None,
               async_op: bool = False, label: str = "") -> Optional[dist.Work]:
    COMM_LOG.add("all_to_all", group, input.numel(), input.element_size(), label)
    return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                  async_op=async_op)


@dataclass(frozen=True)
class P2P:
    """One point-to-point op of a batch: send `tensor` to global rank `peer` ("send"), or receive into it ("recv")."""

    op: str
    tensor: Tensor
    peer: int


def p2p_batch(ops: Sequence[P2P], group: Optional[dist.ProcessGroup] = None, label: str = "") -> list[Any]:
    """Post `ops` together as one batch (`batch_isend_irecv`) and return one handle per op, to wait where needed.

    Why batches: NCCL runs a rank's point-to-point ops on one stream in the order they are issued, and a send
    completes only once its peer has posted the matching recv. Two ranks that each post a lone send to the other
    before their recv wait for each other forever (a ring's every rank does). A batch is one fused operation whose
    sends and recvs progress together. Between two ranks in one direction, ops still match in issue order (no
    tags). Where the backend fuses the batch (NCCL), one handle stands for all of it and is each op's handle."""
    if not ops:
        return []
    for o in ops:
        if o.op not in ("send", "recv"):
            raise ValueError(f"a point-to-point op is 'send' or 'recv', got {o.op!r}")
        COMM_LOG.add(o.op, group, o.tensor.numel(), o.tensor.element_size(), label)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend if o.op == "send" else dist.irecv, o.tensor, o.peer, group)
                                    for o in ops])
    return works if len(works) == len(ops) else [_Batch(works)] * len(ops)


class _Batch:
    """The handle of a fused batch: waits for all of it."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


def scalar_all_reduce(value: Tensor, group: Optional[dist.ProcessGroup] = None,
                      op: dist.ReduceOp = dist.ReduceOp.SUM, label: str = "") -> Tensor:
    """All-reduce a small tensor (norms, flags) in fp32 and return it: the "plus scalars" of the volume theory."""
    out = value.detach().to(torch.float32).clone()
    all_reduce(out, group, op, label=label)
    return out


def barrier(group: Optional[dist.ProcessGroup] = None, label: str = "") -> None:
    COMM_LOG.add("barrier", group, 0, 0, label)
    dist.barrier(group=group)


def broadcast_object(obj: Any, src: int = 0, group: Optional[dist.ProcessGroup] = None, label: str = "") -> Any:
    """`src`'s `obj` on every rank of `group` (`src` a global rank)."""
    COMM_LOG.add("broadcast_object", group, 1, 0, label)
    holder = [obj]
    dist.broadcast_object_list(holder, src, group=group)
    return holder[0]


def all_gather_object(obj: Any, group: Optional[dist.ProcessGroup] = None, label: str = "") -> list[Any]:
    """Every rank's `obj`, in rank order."""
    COMM_LOG.add("all_gather_object", group, 1, 0, label)
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def note(op: str, group: Optional[dist.ProcessGroup] = None, label: str = "") -> None:
    """Record a collective phase run by another library (DCP's save and load), so a hang inside it is named."""
    COMM_LOG.add(op, group, 0, 0, label)


def format_history(log: CommLog = COMM_LOG) -> str:
    """The flight recorder as text, oldest first: the last entries say which collective a rank was in when a
    peer died or hung (compare them across ranks: the one that differs is where the ranks parted)."""
    if not log.history:
        return "no collectives recorded on this rank"
    lines = [f"last {len(log.history)} collectives on this rank (oldest first):"]
    lines += [f"  {r.op:<17} group={r.group} ({r.world} ranks)  {r.numel} elements, {r.nbytes} bytes"
              + (f"  [{r.label}]" if r.label else "") for r in log.history]
    return "\n".join(lines)
