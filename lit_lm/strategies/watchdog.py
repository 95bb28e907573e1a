"""Turn a failed collective into a report that names the lost rank, instead of a bare transport error.

A rank that dies (crash, OOM kill, lost node) makes its peers' next collective fail: gloo raises at once on the
closed connection, NCCL and gloo raise when the process group's `timeout` expires on a hung peer. The error
names a socket, not a rank. So every surviving rank checks in on the rendezvous store (a TCP server on rank 0,
separate from the broken collective transport) and waits `grace_s` for the others: whoever has not checked in is
lost (dead, hung, or partitioned). If the store itself does not answer, rank 0, which hosts it, is gone.
"""

from __future__ import annotations

import time
from typing import Optional

import torch.distributed as dist

from lit_lm.strategies.comm import format_history

_KEY = "lit_lm/failed/{}"
_TRANSPORT_ERRORS = ("gloo", "NCCL", "Connection closed", "Connection reset", "Broken pipe", "timed out",
                     "Timed out", "timeout")


def is_collective_failure(exception: BaseException) -> bool:
    return isinstance(exception, dist.DistError) or (
        isinstance(exception, RuntimeError) and any(s in str(exception) for s in _TRANSPORT_ERRORS))


def lost_ranks(grace_s: float) -> Optional[list[int]]:
    """The ranks that did not check in within `grace_s` (this rank checks in); None: the store is gone."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(_KEY.format(rank), "1")
        missing, deadline = set(range(world)) - {rank}, time.monotonic() + grace_s
        while missing and time.monotonic() < deadline:
            time.sleep(0.2)
            missing = {r for r in missing if not store.check([_KEY.format(r)])}
        return sorted(missing)
    except Exception:  # the store's own errors (DistStoreError, RuntimeError, OSError) all mean: unreachable
        return None


def failure_report(exception: BaseException, grace_s: float) -> str:
    """What this rank prints when a collective failed: who is lost, and the collectives it issued last."""
    lost = lost_ranks(grace_s)
    if lost is None:
        who = "rank 0 lost (the rendezvous store it hosts does not answer)"
    elif lost:
        who = f"{', '.join(f'rank {r}' for r in lost)} lost (no check-in within {grace_s:g} s after the failure)"
    else:
        who = "no rank lost (every rank reported the failure): see the error below"
    return (f"[lit-lm] rank {dist.get_rank()}: a collective failed: {who}\n"
            f"  error: "
            f"{str(exception).strip().splitlines()[0] if str(exception).strip() else type(exception).__name__}\n"
            f"{format_history()}")
