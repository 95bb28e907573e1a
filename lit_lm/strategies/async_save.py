"""Checkpoints written in the background: the step waits only while the state is copied into host buffers.

    saver = AsyncSaver(timeout)              # one per strategy (rank)
    saver.wait()                             # the previous save, if any, has been published (at most one in flight)
    staged = saver.stage(state)              # copies every tensor into host buffers kept between saves (pinned on
                                             # GPUs); DTensors keep their placement; plain values are copied
    ckpt.save(path, staged, meta, info, background=saver)   # the write, marker and rename run on saver's thread

The background thread runs DCP's save and the crash-safe publish of `lit_lm/strategies/checkpoint.py` (every rank's
shards written -> marker -> rename) over its own gloo group, so its collectives never interleave with the training's; a
process killed meanwhile leaves the previous checkpoint whole. A removal requested while a save is in flight
(ModelCheckpoint's retention, last.ckpt's alias) runs after that save is published, so the newest complete
checkpoints never drop below what retention keeps; it runs on the writer thread and `wait()` covers it, so the next
save never touches the folder while one runs; a failed one is a warning (`_housekeep`). A failed write is raised
(one line, `CheckpointSaveError`) by the next `wait()`: at the next save or at teardown. Memory: one host copy of
this rank's checkpoint state, kept for reuse.
"""

from __future__ import annotations

import threading
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor


class AsyncSaver:
    """One background checkpoint write at a time, on a thread with its own process group."""

    def __init__(self, timeout: Optional[timedelta] = None) -> None:
        self._timeout = timeout
        self._group: Optional[dist.ProcessGroup] = None
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._buffers: dict[str, Tensor] = {}
        self._lock = threading.Lock()
        self._removals: list[Callable[[], None]] = []
        self.last: Optional[tuple[Any, Path]] = None  # (contents, path) of the last save started, for aliases

    @property
    def group(self) -> dist.ProcessGroup:
        """The background writes' gloo group (collective to create: every rank creates it at its first save)."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        return self._group

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- staging --------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def stage(self, state: Any) -> Any:
        """`state` with every tensor copied into this saver's host buffers (reused while the shapes stay the same),
        ready to be written while training changes the live tensors."""
        staged = self._copy(state, "")
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()  # the non-blocking device-to-host copies have landed
        return staged

    def _copy(self, value: Any, key: str) -> Any:
        if isinstance(value, DTensor):
            return DTensor(self._host(value._local_tensor, key), value._spec, requires_grad=False)
        if isinstance(value, Tensor):
            return self._host(value, key)
        if isinstance(value, dict):
            return {k: self._copy(v, f"{key}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [self._copy(v, f"{key}.{i}") for i, v in enumerate(value)]
            return items if isinstance(value, list) else type(value)(items)
        return value  # ints, floats, strings, None: immutable

    def _host(self, tensor: Tensor, key: str) -> Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
            self._buffers[key] = buffer
        return buffer.copy_(tensor.detach(), non_blocking=tensor.device.type == "cuda")

    # -- the write ------------------------------------------------------------------------------------------------
    def submit(self, write: Callable[[], None]) -> None:
        """Run `write` (collective over `group`) on the background thread; the caller has waited for the last one."""
        if self.in_flight:
            raise RuntimeError("AsyncSaver.submit: a save is still in flight (call wait() first)")
        def run() -> None:
            try:
                write()
            except BaseException as e:  # raised in the training thread by the next wait()
                self._error = e
            while True:  # the removals queued meanwhile (or while they run), on this thread: wait() covers them
                with self._lock:
                    removals, self._removals = self._removals, []
                    if not removals:
                        self._thread = None  # from here on a removal runs at once, in the caller
                        return
                for remove in removals if self._error is None else ():  # a failed save: the older ones stay
                    _housekeep(remove)

        with self._lock:  # assigned before it runs: its end (which clears it) waits for this lock
            self._thread = threading.Thread(target=run, name="lit-lm checkpoint writer", daemon=True)
            self._thread.start()

    def after_publish(self, remove: Callable[[], None]) -> None:
        """Run `remove` once the save in flight is published (now when none is). Removals run one at a time, in
        order, and before `wait()` returns: the next save never touches the folder while one runs. Behind a failed save
        nothing runs, whether it is still on the thread or already ended (its error not yet raised by `wait()`): a
        `last.ckpt` alias of it would name shards that were never published."""
        with self._lock:
            if self._thread is not None:
                self._removals.append(remove)
                return
            if self._error is not None:  # the save it follows failed (not yet raised by wait()): nothing to follow
                return
        _housekeep(remove)

    def wait(self) -> None:
        """Until the save in flight (if any) is published and the removals queued behind it have run; re-raise
        the save's error here."""
        thread = self._thread
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Wait for the last save; free the host buffers."""
        try:
            self.wait()
        finally:
            self._buffers.clear()
            self.last = None


def _housekeep(remove: Callable[[], None]) -> None:
    """Run a removal; a failure is a warning: it is rank 0's alone, and raised it would stop rank 0 while the other
    ranks wait in their next collective."""
    try:
        remove()
    except OSError as e:
        warnings.warn(f"checkpoint housekeeping after a save failed, the run goes on: {e}", stacklevel=1)
