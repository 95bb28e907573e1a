"""`LiveBytes`: the bytes a process holds, op by op, for tensors that have shapes but no data (the meta device).

A `TorchDispatchMode` sees every tensor an op returns. Each new storage is recorded once, with a weak reference
(torch keeps one Python object per storage for as long as the storage lives, so a finalizer on it runs exactly when
the storage is freed), its size and a tag: the phase that allocated it ("forward", "backward" when autograd's engine
runs the op, or what the caller set in `phase`), or "comm" once a collective of a data-parallel group read or wrote
it (the engines' send and receive buffers: the group is the one `lit_lm.strategies.comm` just recorded; a tp, cp, ep
or pp collective moves activations, which keep their tag). Running totals per tag are kept up to date at each record,
free and resize, so an op costs O(its outputs): the peak, each tag's maximum, and (`HELD`) the most bytes of
forward ("forward", and "recompute": a checkpointed block's forward run again inside the backward) live while a
backward runs: what the forwards left for it, plus the block being recomputed. What was live at the peak is found
afterwards from each record's birth and death (op counts), so labels given later (`label`: parameters, gradients...)
name it.

ZeRO-3 frees a gathered parameter by resizing its storage to 0 and grows it again for the next gather, outside any
op: the resident storages that are empty at `start` are watched (their size read after every op), and what they
hold above their size at `start` counts as "gather". Exact, and simple: no allocator, no cache, no fragmentation
(the report says so), one storage counted once however many views share it.

    live = LiveBytes()
    with live:
        model = build()                     # every storage is recorded (tag "setup")
        live.start("forward")               # the peak and the maxima restart here; what lives is resident
        loss = model(x); loss.backward()
    live.peak, live.maxima, live.at_peak_by_name()

A read of a meta tensor's values (`.tolist()`, `.item()`) has nothing to read: `host_read(tensor)` answers it (a
CPU tensor of the same shape), or the read raises naming the op (the caller decides what the data would have been,
e.g. balanced expert routing).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lit_lm.strategies.comm import COMM_LOG

SETUP, FORWARD, BACKWARD, RECOMPUTE = "setup", "forward", "backward", "recompute"
COMM, GATHER = "comm", "gather"
HELD = "held for backward"  # in `maxima` only: the most forward (and recomputed) bytes live during a backward
DP_GROUPS = ("dp", "dp_shard", "dp_shard_cp", "dp_cp", "dp_replicate", "edp", "world")


class _Storage:
    """One recorded storage: a weak reference to it, its tag, its size, when it was born and freed (op counts)."""

    __slots__ = ("ref", "key", "tag", "nbytes", "born", "died", "name", "watched")

    def __init__(self, storage: Any, tag: str, born: float) -> None:
        self.ref = weakref.ref(storage)
        self.key = id(storage)
        self.watched = False  # resident and empty at `start`: its size is read after every op
        self.tag = tag
        self.nbytes = storage.nbytes()
        self.born = born
        self.died: Optional[float] = None
        self.name: Optional[str] = None  # what the caller says it is (`LiveBytes.label`)


class LiveBytes(TorchDispatchMode):
    def __init__(self, host_read: Optional[Callable[[Tensor], Optional[Tensor]]] = None, device: str = "meta") -> None:
        super().__init__()
        self.device = device  # the tensors counted: meta (the fake ranks), or e.g. cpu to hold it to a real step
        self.phase = SETUP
        self.host_read = host_read
        self._live: dict[int, _Storage] = {}  # id(storage object) -> record, while it lives
        self._since_start: list[_Storage] = []  # every record live at or born after `start`
        self._totals: dict[str, int] = {}
        self._watch: list[tuple[_Storage, Any]] = []  # (record, the storage): resident and empty at `start`
        self.ops = 0
        self._sampled = False
        self.peak = 0
        self._peak_op = 0.0
        self._peak_gather: dict[int, int] = {}  # id(record) -> bytes gathered into it at the peak
        self.maxima: dict[str, int] = {}  # each tag's own maximum since `start` (and HELD)

    # -- the mode -------------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and _meta_to_host(args[0], kwargs):
            return self._host_read(args[0], func, kwargs.get("dtype"))
        if func is torch.ops.aten._local_scalar_dense.default and _is_meta(args[0]):
            return self._host_read(args[0], func)
        backward = torch._C._current_graph_task_id() != -1  # autograd's engine runs this op
        recompute = backward and torch.is_grad_enabled()  # activation checkpointing's forward again (`ac.recomputing`)
        if backward:  # from its start on: what the forwards left for it, and the block a checkpoint recomputes
            self._bump(HELD, self._totals.get(FORWARD, 0) + self._totals.get(RECOMPUTE, 0))
        self.ops += 1
        self._sampled = False
        out = func(*args, **kwargs)
        comm = func.namespace == "c10d" and bool(COMM_LOG.history) and COMM_LOG.history[-1].group in DP_GROUPS
        tag = COMM if comm else RECOMPUTE if recompute else BACKWARD if backward else self.phase
        for t in tree_leaves((out, args, kwargs) if comm else out):
            if isinstance(t, Tensor):
                self._record(t, tag, retag=comm)
        self._sample()
        return out

    def _host_read(self, t: Tensor, func: Any, dtype: Optional[torch.dtype] = None) -> Any:
        value = self.host_read(t) if self.host_read is not None else None
        if value is None:
            raise RuntimeError(f"{func}: the values of a meta tensor of shape {tuple(t.shape)} are read on the host; "
                               "a shapes-only run cannot know them (no host_read answers this read)")
        return value.item() if func is torch.ops.aten._local_scalar_dense.default else value.to(dtype or value.dtype)

    def _record(self, t: Tensor, tag: str, retag: bool = False) -> None:
        if t.device.type != self.device:
            return
        storage = t.untyped_storage()
        rec = self._live.get(id(storage))
        if rec is None or rec.ref() is not storage:
            rec = _Storage(storage, tag, self.ops)
            self._live[id(storage)] = rec
            self._since_start.append(rec)
            self._add(rec.tag, rec.nbytes)
            weakref.finalize(storage, self._freed, rec)
            return
        n = storage.nbytes()
        if n != rec.nbytes and not rec.watched:  # resized in place (aten.resize_, set_)
            self._add(rec.tag, n - rec.nbytes)
            rec.nbytes = n
        if retag and rec.tag not in (SETUP, COMM):
            self._add(rec.tag, -rec.nbytes)
            rec.tag = COMM
            self._add(COMM, rec.nbytes)

    def _freed(self, rec: _Storage) -> None:
        if self._live.get(rec.key) is rec:
            del self._live[rec.key]
        rec.died = self.ops + (0.5 if self._sampled else 0.0)  # freed after this op's sample: live in it
        self._add(rec.tag, -rec.nbytes)

    def _add(self, tag: str, n: int) -> None:
        self._totals[tag] = self._totals.get(tag, 0) + n

    def _bump(self, tag: str, n: int) -> None:
        if n > self.maxima.get(tag, 0):
            self.maxima[tag] = n

    # -- the sums -------------------------------------------------------------------------------------------------
    def _gathered(self) -> dict[int, int]:
        out = {}
        for rec, storage in self._watch:
            grown = storage.nbytes()
            if grown:
                out[id(rec)] = grown
        return out

    def sizes(self) -> dict[str, int]:
        """Live bytes per tag now (and "gather")."""
        out = {k: v for k, v in self._totals.items() if v}
        gathered = sum(self._gathered().values())
        if gathered:
            out[GATHER] = gathered
        return out

    def _sample(self) -> None:
        self._sampled = True
        gathered = self._gathered() if self._watch else {}
        for tag, n in self._totals.items():
            self._bump(tag, n)
        total = sum(self._totals.values())
        if gathered:
            g = sum(gathered.values())
            self._bump(GATHER, g)
            total += g
        if total > self.peak:
            self.peak, self._peak_op, self._peak_gather = total, self.ops, gathered

    def start(self, phase: str) -> None:
        """Restart the peak and the maxima here; what is live now is resident ("setup"), at its present size (one
        that is empty now is watched: what it holds later is "gather")."""
        self._since_start, self._watch, self._totals = [], [], {}
        for rec in self._live.values():
            storage = rec.ref()
            if storage is None:
                continue
            rec.tag, rec.nbytes = SETUP, storage.nbytes()
            self._since_start.append(rec)
            self._add(SETUP, rec.nbytes)
            rec.watched = rec.nbytes == 0
            if rec.watched:
                self._watch.append((rec, storage))
        self.phase, self.peak, self.maxima = phase, 0, {}
        self._sample()

    def label(self, tensors: Any, name: str) -> None:
        """File the storages of `tensors` under `name` ("parameters", "gradients"...) in `at_peak_by_name`, also
        for a peak taken before (and after their storages are freed)."""
        for t in tree_leaves(tensors):
            if isinstance(t, Tensor) and t.device.type == self.device:
                storage = t.untyped_storage()
                rec = self._live.get(id(storage))
                if rec is not None and rec.ref() is storage:
                    rec.name = name

    def at_peak_by_name(self) -> dict[str, int]:
        """The bytes live at the peak: a labelled storage under its label, the others under their tag ("setup":
        "other resident"), and what the watched storages held under "gather"."""
        out: dict[str, int] = {}
        p = self._peak_op
        for rec in self._since_start:
            if rec.born <= p and (rec.died is None or rec.died > p):
                name = rec.name or ("other resident" if rec.tag == SETUP else rec.tag)
                out[name] = out.get(name, 0) + rec.nbytes
        gathered = sum(self._peak_gather.values())
        if gathered:
            out[GATHER] = gathered
        return out


def _is_meta(t: Any) -> bool:
    return isinstance(t, Tensor) and t.device.type == "meta"


def _meta_to_host(t: Any, kwargs: dict) -> bool:
    device = kwargs.get("device")
    return _is_meta(t) and device is not None and torch.device(device).type != "meta"
