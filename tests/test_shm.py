"""The shared-memory all-reduce (`strategies/shm.py`) on its own: bits, layout, averaging, falling back, cleanup."""

from __future__ import annotations

import mmap
import os
import subprocess
import threading
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from strategies.composed import ComposedStrategy
from strategies.ddp import GradSync
from strategies import shm
from strategies.errors import ConfigError
from strategies.shm import SharedArena

# an fp32 buffer after 7 bf16 elements (14 bytes) must start 2 bytes later, on a 4-byte boundary
BUFFERS = [(10, torch.float32), (7, torch.bfloat16), (1001, torch.float32)]


def _contribution(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def _arena_worker() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    arena = SharedArena.create(None, BUFFERS)
    assert arena is not None
    for t, (numel, dtype) in zip(arena.tensors, BUFFERS):
        t.copy_(_contribution(rank, numel, dtype))
    arena.all_reduce(arena.tensors[0])
    arena.all_reduce(arena.tensors[1])
    arena.all_reduce(arena.tensors[2][3:500], dist.ReduceOp.AVG)  # a part: the rest stays this rank's own
    maps = [line for line in open("/proc/self/maps") if "lit-lm-" in line]
    with pytest.raises(ValueError, match="contiguous part of this arena"):
        arena.all_reduce(torch.zeros(4))
    with pytest.raises(ValueError, match="sums or averages"):
        arena.all_reduce(arena.tensors[0], dist.ReduceOp.MAX)

    # one rank cannot map the file (another host): every rank falls back, and shared_memory=True says why
    real_open = os.open
    with mock.patch("os.open", side_effect=OSError if rank == world - 1 else real_open):
        fallback = SharedArena.create(None, BUFFERS)
        with pytest.raises(RuntimeError, match=r"do not share /dev/shm.*shared_memory to None"):
            GradSync(torch.nn.Linear(3, 3), shared_memory=True)
    auto = GradSync(torch.nn.Linear(3, 3))  # the default on CPU and gloo
    return {"tensors": [t.clone() for t in arena.tensors], "offsets": [t.data_ptr() - arena.regions[rank].data_ptr() for t in arena.tensors],
            "region": arena.regions[rank].numel(), "maps": maps, "fallback": fallback, "auto": auto.arena is not None}


def test_shared_memory_all_reduce() -> None:
    world = 3
    per_rank = run_distributed(_arena_worker, world)
    parts = [[_contribution(r, n, dtype) for r in range(world)] for n, dtype in BUFFERS]
    summed = [parts[i][0] + parts[i][1] + parts[i][2] for i in (0, 1)]  # rank order, as gloo's ring would not be
    for rank, r in enumerate(per_rank):
        assert r["offsets"] == [0, 40, 56] and r["region"] == 56 + 4 * 1001  # aligned, exact
        for i in (0, 1):
            assert torch.equal(r["tensors"][i], summed[i]), (rank, i)
        third = r["tensors"][2]
        mean = (parts[2][0][3:500] + parts[2][1][3:500] + parts[2][2][3:500]) / world
        assert torch.equal(third[3:500], mean)
        assert torch.equal(third[:3], parts[2][rank][:3]) and torch.equal(third[500:], parts[2][rank][500:])
        # one mapping per rank's region and the barrier's control page, of a file already unlinked: nothing to leak
        assert len(r["maps"]) == world + 1 and all(line.rstrip().endswith("(deleted)") for line in r["maps"])
        assert r["fallback"] is None and r["auto"]


def test_shared_memory_is_a_replicated_dp_option() -> None:
    with pytest.raises(ConfigError, match="shared_memory is an option of the replicated data parallelism"):
        ComposedStrategy(zero_stage=1, shared_memory=True)


def test_barrier_names_a_peer_that_exited_or_never_came(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spinning barrier (x86-64), two ranks on one page in one process: both arrive (threads); a peer whose
    process has exited, or that is alive but never arrives, ends the wait with an error naming it."""
    monkeypatch.setattr(shm, "PEER_CHECK_S", 0.01)
    page = memoryview(mmap.mmap(-1, mmap.PAGESIZE))
    ranks = [shm._Flags(page, r, 2) for r in range(2)]
    other = threading.Thread(target=ranks[1].wait)
    other.start()
    ranks[0].wait()  # returns once rank 1 has arrived
    other.join()
    dead = subprocess.Popen(["true"])
    dead.wait()
    page.cast("q")[shm.SLOT + 1] = dead.pid  # rank 1's pid: a process that has exited
    with pytest.raises(RuntimeError, match=rf"rank 1 of the group \(pid {dead.pid}\) has exited"):
        ranks[0].wait()
    page.cast("q")[shm.SLOT + 1] = os.getpid()  # alive, but it never arrives
    monkeypatch.setattr(shm, "TIMEOUT_S", 0.05)
    with pytest.raises(RuntimeError, match=r"ranks \[1\] of the group did not arrive in 0 s"):
        ranks[0].wait()
