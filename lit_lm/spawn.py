"""Run a function on N local gloo processes and collect what each returns: the worlds of `lit-lm check` and the suite.

    results = run_distributed(fn, 2, arg1, arg2)            # fn(arg1, arg2) on ranks 0 and 1 -> [r0, r1]
    results = run_distributed(fn, 2, init_process_group=False)  # Lightning workers: the strategy initialises

Each call uses a fresh free port (parallel test workers never collide), sets the environment a launcher would
(MASTER_ADDR/PORT, RANK, LOCAL_RANK, WORLD_SIZE, NODE_RANK: Lightning then sees externally created processes and
spawns nothing), pins OMP_NUM_THREADS=1 so N ranks do not oversubscribe the cores, and re-raises a rank's
exception in the caller with its traceback. `fn` and its arguments must be picklable (module-level functions);
results travel back through `torch.save` and are read with `weights_only=True` (`load_result`), so tensors, plain
containers and classes of lit-lm's or the suite's own modules (and torch.nn's layers) are fine.

The ranks are forked from a fork server (`multiprocessing`'s "forkserver" start method) that has imported torch
and Lightning once per calling process: a world then starts in a fraction of a second where each spawned rank
paid those imports again (seconds each, the bulk of a small test's time). A rank still starts as a fresh process
would: in the caller's working directory and `sys.path`, with the caller's environment of the moment, and with no
state of the caller's (the server is a clean single-threaded process that only imported modules).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import random
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# the third-party imports of every rank (seconds), imported once in the fork server; lit-lm's own modules are
# imported by each rank (a fraction of a second): one that fails to import (an edit in progress) then fails in the
# rank with its traceback, where in the server it would stop the server and every later call with an EOFError
# (the suite appends tests/forkserver_preload.py, which imports its ranks' own modules and skips one that fails)
PRELOAD = ["torch", "lightning", "torch.distributed.checkpoint"]
OWN_PACKAGES = ("lit_lm",)  # whose classes a rank's result may hold


def free_port() -> int:
    """A port free now, chosen at random below the kernel's ephemeral range (32768+): an ephemeral port that is free
    now can be taken by one of the many client sockets other tests' gloo ranks open before our store binds it."""
    rng = random.SystemRandom()
    while True:
        port = rng.randrange(20000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, init_process_group: bool = True,
                    env: dict[str, str] | None = None) -> list[Any]:
    """Run `fn(*args)` on `world_size` spawned processes; return the per-rank results in rank order."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call)
    with tempfile.TemporaryDirectory() as out:
        base_env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                    "WORLD_SIZE": str(world_size), "NODE_RANK": "0", "OMP_NUM_THREADS": "1", **(env or {})}
        mp.start_processes(_rank, args=(fn, args, base_env, init_process_group, out), nprocs=world_size,
                           join=True, start_method="forkserver")
        return [load_result(Path(out) / f"rank{r}.pt") for r in range(world_size)]


def load_result(path: Path | io.BytesIO) -> Any:
    """A rank's result, read with `weights_only=True`: the harness's own file, yet nothing in it runs as code. Beyond
    torch's tensors and plain values it may construct only classes (never functions) of lit-lm's own packages, of
    the suite's modules (the dataclasses and NamedTuples callers return) and of torch.nn's layers (a whole model);
    anything else is refused by torch, naming the global."""
    allowed = [cls for cls in map(_own_class, torch.serialization.get_unsafe_globals_in_checkpoint(path)) if cls]
    allowed.append(slice)  # the parity harness's gradient parts are indexed by slices (tp, ZeRO rows)
    if isinstance(path, io.BytesIO):
        path.seek(0)
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, weights_only=True)


def returnable(obj: Any) -> bool:
    """Whether `obj` can come back from a rank through `load_result` (a trained callback that picked up a bound
    method or a foreign class cannot: the caller sends None in its place)."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        buffer.seek(0)
        load_result(buffer)
    except (pickle.PicklingError, pickle.UnpicklingError, TypeError, AttributeError):
        return False
    return True


def _own_class(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    ours = (module.split(".")[0] in OWN_PACKAGES or module.startswith("test_") or module in ("dist_utils", "conftest")
            or module.startswith("torch.nn.modules."))  # a whole model's containers and layers
    if not ours or module not in sys.modules:  # only classes of modules this process already imported
        return None
    obj = getattr(sys.modules[module], attr, None)
    return obj if isinstance(obj, type) else None


def _rank(rank: int, fn: Callable[..., Any], args: tuple, env: dict[str, str], init_process_group: bool,
          out: str) -> None:
    os.environ.clear()  # the caller's environment at the call, not the fork server's from its start
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if init_process_group:
        dist.init_process_group("gloo", rank=rank, world_size=int(env["WORLD_SIZE"]))
    try:
        result = fn(*args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(result, Path(out) / f"rank{rank}.pt")

