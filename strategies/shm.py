"""An all-reduce through shared memory, for the ranks of a group that share a host and train on the CPU (gloo).

gloo carries a CPU all-reduce over TCP on the loopback device: each byte goes into the kernel and out again, in
a reduce-scatter and then an all-gather, on the rank's own core. Ranks on one host can read each other's memory
instead. Every rank of the group maps one file in /dev/shm, cut into one region per rank; a tensor allocated in
this rank's region (GradSync's gradient buckets: the gradients live there) is reduced where it lies:

1. barrier: every rank's copy of the buffer holds its contribution;
2. rank r sums chunk r of the buffer over the ranks, in rank order (x_0 + x_1 + ...: one order, so every replica
   gets the same bits) and writes the sum into chunk r of every rank's copy;
3. barrier: every chunk is reduced in every copy.

A rank reads and writes its 1/N of each of the N copies, Φ each way, with no copy in or out; on the 2-core CPU
machine this is about three times faster than gloo's all-reduce (`scripts/bench_allreduce.py`). The barriers are
the group's own, issued by the calling thread, so the operation is synchronous: GradSync runs it where it would
wait for its asynchronous all-reduces (nothing could hide the work anyway: it is the rank's own core that sums).

The file is unlinked as soon as every rank has mapped it, so nothing is left behind when a rank dies. Writes are
ordered by the barriers (a system call on each side), which x86 and ARM both treat as a full fence.
"""

from __future__ import annotations

import mmap
import os
import uuid
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from strategies import comm

SHM_DIR = "/dev/shm"


def _free_bytes() -> int:
    """What /dev/shm can still hold (0 where there is none): a container's default is 64 MiB."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def share(numel: int, world: int, rank: int) -> slice:
    """The elements `rank` reduces for everyone: its 1/world of the buffer (the shares tile it)."""
    return slice(numel * rank // world, numel * (rank + 1) // world)


def _layout(buffers: list[tuple[int, torch.dtype]]) -> tuple[list[int], int]:
    """Byte offsets of `buffers` ((numel, dtype) each) laid end to end, each aligned for its dtype; total bytes."""
    starts, end = [], 0
    for numel, dtype in buffers:
        size = dtype.itemsize
        starts.append(-(-end // size) * size)
        end = starts[-1] + numel * size
    return starts, end


class SharedArena:
    """Shared memory for the ranks of `group`: every rank's copy of the `buffers` given to `create`, at the same
    offsets in each rank's region. `tensors` are this rank's copies; `all_reduce` sums one over the ranks."""

    def __init__(self, group: Optional[dist.ProcessGroup], regions: list[Tensor],
                 buffers: list[tuple[int, torch.dtype]]) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.regions = regions  # uint8, one per rank of the group; regions[self.rank] is this rank's
        starts, _ = _layout(buffers)
        self.tensors = [regions[self.rank][s: s + n * dtype.itemsize].view(dtype)
                        for s, (n, dtype) in zip(starts, buffers)]

    @classmethod
    def create(cls, group: Optional[dist.ProcessGroup],
               buffers: list[tuple[int, torch.dtype]]) -> Optional["SharedArena"]:
        """Map a region for `buffers` ((numel, dtype) each, the same on every rank) per rank of `group` (a
        collective; zeros), or None where the ranks do not share a /dev/shm (another host or container, not Linux):
        the caller then uses the group's own collectives."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        _, nbytes = _layout(buffers)
        stride = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE  # a mapping starts on a page
        path = os.path.join(SHM_DIR, f"lit-lm-{uuid.uuid4().hex}") if rank == 0 else None
        if path is not None and nbytes and _free_bytes() >= stride * world:  # a full tmpfs kills with SIGBUS
            with open(path, "wb") as f:
                f.truncate(stride * world)  # a new file reads as zeros
        path = comm.broadcast_object(path, dist.get_global_rank(group, 0) if group is not None else 0, group,
                                     label="shared memory")
        regions = None
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            pass
        else:
            try:
                regions = [torch.frombuffer(mmap.mmap(fd, nbytes, offset=r * stride), dtype=torch.uint8)
                           for r in range(world)]
            finally:
                os.close(fd)
        mapped = all(comm.all_gather_object(regions is not None, group, label="shared memory"))
        if rank == 0 and os.path.exists(path):
            os.unlink(path)  # every rank that could map it has: the mappings keep the memory alive
        return cls(group, regions, buffers) if mapped and regions is not None else None

    def all_reduce(self, tensor: Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        """Sum (or, with `op=AVG`, average: the sum divided by the world size, as a gloo sum and a division would
        round it) `tensor` (one of `tensors`, or a contiguous part) over the ranks, in place; every rank calls it
        for the same tensor."""
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"the shared-memory all-reduce sums or averages; got {op}")
        mine = self.regions[self.rank]
        offset = tensor.data_ptr() - mine.data_ptr()
        if not (0 <= offset and offset + tensor.nbytes <= mine.numel() and tensor.is_contiguous()):
            raise ValueError("SharedArena.all_reduce: the tensor must be a contiguous part of this arena's tensors")
        copies = [r[offset: offset + tensor.nbytes].view(tensor.dtype) for r in self.regions]
        world = len(copies)
        chunk = share(tensor.numel(), world, self.rank)
        dist.barrier(self.group)  # every copy holds its rank's contribution
        with torch.no_grad():
            total = copies[0][chunk]
            for other in copies[1:]:
                total.add_(other[chunk])
            if op == dist.ReduceOp.AVG:  # on this rank's 1/N only, where a division after the sum takes a pass
                total.div_(world)
            for other in copies[1:]:
                other[chunk].copy_(total)
        dist.barrier(self.group)  # every chunk is reduced everywhere
