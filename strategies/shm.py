"""An all-reduce through shared memory, for the ranks of a group that share a host and train on the CPU (gloo).

gloo carries a CPU all-reduce over TCP on the loopback device: each byte goes into the kernel and out again, in
a reduce-scatter and then an all-gather, on the rank's own core. Ranks on one host can read each other's memory
instead. Every rank of the group maps one file in /dev/shm, cut into one region per rank; a tensor allocated in
this rank's region (GradSync's gradient buckets: the gradients live there) is reduced where it lies:

1. barrier: every rank's copy of the buffer holds its contribution;
2. rank r sums chunk r of the buffer over the ranks, in rank order (x_0 + x_1 + ...: one order, so every replica
   gets the same bits) and writes the sum into chunk r of every rank's copy;
3. barrier: every chunk is reduced in every copy.

A rank reads and writes its 1/N of each of the N copies, Φ each way, with no copy in or out: an order of magnitude
faster than gloo's all-reduce on the 2-core CPU machine (`scripts/bench_allreduce.py`, docs/ddp.md). The operation is
synchronous, in the calling thread: GradSync runs it where it would wait for its asynchronous all-reduces (nothing
could hide the work anyway: the rank's own core does the sums).

The barriers are the arena's own on x86-64: each rank writes its arrival count into its own cache line of a control
page in the same file, then spins until every count has reached it. x86 keeps stores in program order and loads in
program order, so a rank that sees a peer's count also sees what the peer wrote before it. Spinning gives way to
sleeping polls after a millisecond, so ranks that outnumber the cores let their peers run, and a peer process that
has exited ends the wait with an error naming it. (A gloo barrier costs two thread hand-offs and a loopback round
trip, ~0.3 ms, and two per bucket added 1.5-2.5 ms to a 40 ms step of `scripts/bench_ddp.py`.) Where memory
ordering is weaker (ARM), the group's gloo barrier is used: a system call on each side, a full fence.

The file is unlinked as soon as every rank has mapped it, so nothing is left behind when a rank dies.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
import uuid
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from strategies import comm

SHM_DIR = "/dev/shm"
SPIN_S, POLL_S, PEER_CHECK_S, TIMEOUT_S = 1e-3, 1e-4, 1.0, 1800.0  # barrier: spin, then poll; gloo's 30 min timeout
SLOT = 8  # int64 per rank in the control page: a 64-byte cache line each (count, pid)


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


def _pages(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def _layout(buffers: list[tuple[int, torch.dtype]]) -> tuple[list[int], int]:
    """Byte offsets of `buffers` ((numel, dtype) each) laid end to end, each aligned for its dtype; total bytes."""
    starts, end = [], 0
    for numel, dtype in buffers:
        size = dtype.itemsize
        starts.append(-(-end // size) * size)
        end = starts[-1] + numel * size
    return starts, end


class _Flags:
    """The barrier of the module docstring, over `page` (int64 slots: rank r's arrival count at SLOT * r, its pid
    after it)."""

    def __init__(self, page: memoryview, rank: int, world: int) -> None:
        self.slots, self.rank, self.world, self.count = page.cast("q"), rank, world, 0
        self.slots[SLOT * rank + 1] = os.getpid()

    def wait(self) -> None:
        self.count += 1
        self.slots[SLOT * self.rank] = self.count
        start = checked = time.perf_counter()
        while any(self.slots[SLOT * r] < self.count for r in range(self.world)):
            now = time.perf_counter()
            if now - start < SPIN_S:
                continue
            time.sleep(POLL_S)
            if now - checked > PEER_CHECK_S:
                checked = now
                self._check_peers(now - start)

    def _check_peers(self, waited: float) -> None:
        late = [r for r in range(self.world) if self.slots[SLOT * r] < self.count]
        for r in late:
            pid = self.slots[SLOT * r + 1]
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise RuntimeError(f"shared-memory all-reduce: rank {r} of the group (pid {pid}) has exited; "
                                   f"this rank waited {waited:.0f} s for it") from None
            except PermissionError:
                pass  # alive, another user's
        if waited > TIMEOUT_S:
            raise RuntimeError(f"shared-memory all-reduce: ranks {late} of the group did not arrive in "
                               f"{TIMEOUT_S:.0f} s (a hang elsewhere: see the flight recorder)")


class SharedArena:
    """Shared memory for the ranks of `group`: every rank's copy of the `buffers` given to `create`, at the same
    offsets in each rank's region. `tensors` are this rank's copies; `all_reduce` sums one over the ranks."""

    def __init__(self, group: Optional[dist.ProcessGroup], regions: list[Tensor],
                 buffers: list[tuple[int, torch.dtype]], flags: Optional[_Flags]) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.regions = regions  # uint8, one per rank of the group; regions[self.rank] is this rank's
        self._flags = flags  # None: gloo's barrier
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
        stride = _pages(nbytes)  # a mapping starts on a page
        control = _pages(SLOT * 8 * world)
        path = os.path.join(SHM_DIR, f"lit-lm-{uuid.uuid4().hex}") if rank == 0 else None
        if path is not None and nbytes and _free_bytes() >= stride * world + control:  # full tmpfs: SIGBUS
            with open(path, "wb") as f:
                f.truncate(stride * world + control)  # a new file reads as zeros
        path = comm.broadcast_object(path, dist.get_global_rank(group, 0) if group is not None else 0, group,
                                     label="shared memory")
        regions = flags = None
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            pass
        else:
            try:
                regions = [torch.frombuffer(mmap.mmap(fd, nbytes, offset=r * stride), dtype=torch.uint8)
                           for r in range(world)]
                if platform.machine() in ("x86_64", "AMD64"):  # stores seen in program order
                    flags = _Flags(memoryview(mmap.mmap(fd, control, offset=stride * world)), rank, world)
            finally:
                os.close(fd)
        mapped = all(comm.all_gather_object(regions is not None, group, label="shared memory"))
        if rank == 0 and os.path.exists(path):
            os.unlink(path)  # every rank that could map it has: the mappings keep the memory alive
        return cls(group, regions, buffers, flags) if mapped and regions is not None else None

    def barrier(self) -> None:
        """Every rank of the group has arrived (see the module docstring)."""
        if self._flags is None:
            dist.barrier(self.group)
        else:
            self._flags.wait()

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
        self.barrier()  # every copy holds its rank's contribution
        with torch.no_grad():
            total = copies[0][chunk]
            for other in copies[1:]:
                total.add_(other[chunk])
            if op == dist.ReduceOp.AVG:  # on this rank's 1/N only, where a division after the sum takes a pass
                total.div_(world)
            for other in copies[1:]:
                other[chunk].copy_(total)
        self.barrier()  # every chunk is reduced everywhere
