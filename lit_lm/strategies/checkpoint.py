"""Sharded, topology-free, crash-safe checkpoints: a `torch.distributed.checkpoint` (DCP) directory, a rank-0
`meta.pt` and a `COMPLETE` marker.

    <dir>/            DCP files of {"model": {fqn: tensor}, "optimizer_<i>": {"state": {fqn: {...}},
                                                                           "param_groups": [{..., "params": [fqn]}]}}
    <dir>/meta.pt     the rest of Lightning's checkpoint (loops, lr_schedulers, callbacks, hparams, datamodule)
    <dir>/COMPLETE    json {step, epoch, world_size, optimizers, strategy, pp, dp_replicate, dp_shard, cp, tp, ep}:
                      written last, after every rank's shards (optimizers: how many have state here, 0 in a
                      weights-only save)

Every tensor is named by its FQN relative to the LightningModule, never by rank or parameter index, and sharded
tensors are DTensors with their global shape, so DCP reshards on load: a checkpoint saved on N ranks resumes on
M ranks. `to_single_file` turns a directory into an ordinary Lightning `.ckpt` (index-keyed optimizer state) for
`LightningModule.load_from_checkpoint`, a single-device `Trainer.fit(ckpt_path=...)`, export or inspection.

Crash safety: a save writes `<dir>.tmp-<id>`, and only after every rank has finished and the marker is on disk
does rank 0 publish it with a rename, so a process killed mid-save leaves the previous checkpoint of that name whole
and only a `.tmp-` directory behind (removed by the next save into the same folder). What rank 0 alone does (make
the directory, publish it) it tells every rank, so a failure there raises on all of them at once. Lightning's
`ckpt_path="last"` only considers `last*.ckpt` names, so it never picks a `.tmp-` directory; `load` refuses a
directory without the marker, naming the missing file.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import pickle
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.optim import Optimizer

from lit_lm.strategies import comm, safe_load
from lit_lm.strategies.errors import ConfigError

META = "meta.pt"
# In a single-file checkpoint: the FQNs of each optimizer's param groups, in order (torch keys the state by
# position), so a strategy holding other parameters (a pipeline stage) can tell which state is whose.
OPTIMIZER_FQNS = "optimizer_param_fqns"
COMPLETE = "COMPLETE"
TMP, OLD = ".tmp-", ".old-"  # + 8 hex digits: a save in progress (or killed), a replaced checkpoint
PathLike = Union[str, Path]


def is_sharded_checkpoint(path: PathLike) -> bool:
    """A directory in this format (complete or not: `check_complete` tells)."""
    return Path(path).is_dir() and (Path(path) / META).is_file()


def check_complete(path: PathLike) -> dict[str, Any]:
    """The marker's contents; raises, naming the file, for a directory a crashed save left unfinished."""
    marker = Path(path) / COMPLETE
    if not marker.is_file():
        raise FileNotFoundError(
            f"{marker} is missing: {path} is not a complete checkpoint (its save was interrupted, or it predates "
            f"the marker). Resume from an earlier checkpoint, or `touch {marker}` if you know every rank finished")
    return json.loads(marker.read_text() or "{}")


class CheckpointSaveError(ConfigError):
    """A save that could not be written (a full disk, a lost mount): nothing was published, the previous
    checkpoint of that name is whole."""


def save(path: PathLike, state: dict[str, Any], meta: dict[str, Any], info: dict[str, Any],
         background: Optional[Any] = None) -> None:
    """Collective: every rank writes its part of `state`; rank 0 writes `meta` and a marker of `info`, then
    publishes the directory at `path` (replacing whatever was there) by a rename.

    With `background` (a `lit_lm.strategies.async_save.AsyncSaver` whose previous save is done, `state` staged by it)
    all of it but serialising `meta` runs on its thread and group: this returns at once."""
    path = Path(path)
    # serialised now: `meta` may hold live values (a callback's tensors)
    meta_bytes = serialize_meta(meta) if dist.get_rank() == 0 else io.BytesIO()
    marker = {"step": meta.get("global_step"), "epoch": meta.get("epoch"), "world_size": dist.get_world_size(),
              "optimizers": sum(key.startswith("optimizer_") for key in state), **info}
    if background is None:
        _write(path, state, meta_bytes, marker, group=None)
    else:
        group = background.group  # made here, by every rank at the same save, not on the thread
        background.submit(lambda: _write(path, state, meta_bytes, marker, group=group))


def save_alias(source: Path, path: Path, meta: io.BytesIO) -> None:
    """Rank 0, once `source` is published: `path` as a second name for the same state (a `last.ckpt` saved at the
    step of a `step=N.ckpt`), its shard files hard-linked (copied across filesystems), its own `meta`
    (`serialize_meta`'d), published
    like a save."""
    tmp = path.with_name(f"{path.name}{TMP}{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        for file in source.iterdir():
            if file.name not in (META, COMPLETE):
                try:
                    os.link(file, tmp / file.name)
                except OSError:
                    shutil.copy2(file, tmp / file.name)
        _write_synced(tmp / META, meta.getvalue())
        _write_synced(tmp / COMPLETE, (source / COMPLETE).read_text())
    except BaseException:  # nothing half-made is left behind (the source gone, a full disk)
        remove(tmp)
        raise
    _publish(tmp, path)


def serialize_meta(meta: dict[str, Any]) -> io.BytesIO:
    out = io.BytesIO()
    torch.save(meta, out)
    return out


def _write(path: Path, state: dict[str, Any], meta: io.BytesIO, marker: dict[str, Any],
           group: Optional[dist.ProcessGroup]) -> None:
    """Collective over `group`: a temporary directory, the shards, then (rank 0) meta.pt, the marker and the
    rename. A failed write on any rank (DCP tells every rank) publishes nothing, removes the temporary directory
    and raises one line."""
    # every rank writes into the same temporary directory
    tmp = Path(comm.broadcast_object(f"{path}{TMP}{uuid.uuid4().hex[:8]}", group=group,
                                     label="checkpoint save: directory"))
    _on_rank_zero(lambda: (remove_stale(path.parent), tmp.mkdir(parents=True)), path, group,
                  label="checkpoint save: directory made")
    comm.note("dcp_save", group, label=f"checkpoint save: {path.name}")
    failure = None
    try:
        dcp.save(state, checkpoint_id=tmp, process_group=group)
        if dist.get_rank() == 0:
            _write_synced(tmp / META, meta.getvalue())
    except (OSError, CheckpointException) as e:
        failure = _failure(e)
    failures = comm.all_gather_object(failure, group, label="checkpoint save: shards written")  # on every rank
    failure = next((f for f in failures if f), None)
    if failure is not None:
        if dist.get_rank() == 0:
            remove(tmp)
        raise _save_error(path, failure)
    # nobody removes an older one before it is visible
    _on_rank_zero(lambda: (_write_synced(tmp / COMPLETE, json.dumps(marker)), _publish(tmp, path)), path, group,
                  label="checkpoint save: published")


def _on_rank_zero(action: Callable[[], Any], path: Path, group: Optional[dist.ProcessGroup], label: str) -> None:
    """Collective: `action` on rank 0, then every rank learns how it went. A failure (a folder rank 0 cannot make)
    raises on every rank, where a barrier would leave the others waiting in it until the timeout."""
    failure = None
    if dist.get_rank() == 0:
        try:
            action()
        except Exception as e:
            failure = _failure(e)
    failure = comm.broadcast_object(failure, group=group, label=label)
    if failure is not None:
        raise _save_error(path, failure)


def _save_error(path: Path, failure: str) -> CheckpointSaveError:
    return CheckpointSaveError(
        f"saving checkpoint {path} failed ({failure}): nothing was published; the previous checkpoint of that "
        "name, if any, is whole. Free space or fix the folder, then resume with --ckpt_path last")


def _failure(error: BaseException) -> str:
    """The first underlying error of a failed save, in a few words ('[Errno 28] No space left on device')."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (first, _) = next(iter(sorted(error.failures.items(), key=lambda kv: kv[0])))
        return f"rank {rank}: {_failure(first)}"
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:200]


def _write_synced(file: Path, data: Union[str, bytes]) -> None:
    with open(file, "w" if isinstance(data, str) else "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _publish(tmp: Path, path: Path) -> None:
    """Rename `tmp` to `path`. A directory cannot be renamed over a non-empty one, so an existing `path` (a
    re-saved `last.ckpt`) is first renamed aside: a crash between the two renames leaves it as `<path>.old-<id>`."""
    if path.exists() or path.is_symlink():
        old = path.with_name(path.name + OLD + tmp.name.rsplit(TMP, 1)[1])
        os.rename(path, old)
        os.rename(tmp, path)
        remove(old)
    else:
        os.rename(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)  # make the renames durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: PathLike) -> None:
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def remove_stale(folder: PathLike) -> None:
    """Remove what crashed saves left in `folder` (`*.tmp-<id>`, `*.old-<id>`). Only one save runs at a time."""
    folder = Path(folder)
    if folder.is_dir():
        for leftover in folder.iterdir():
            if re.search(rf"({re.escape(TMP)}|{re.escape(OLD)})[0-9a-f]{{8}}$", leftover.name):
                remove(leftover)


def load(path: PathLike, state: dict[str, Any]) -> dict[str, Any]:
    """Collective: fill `state` in place from the directory (resharding as needed); return the metadata. Every
    file is read safely (`lit_lm/strategies/safe_load.py`): a pickle that would run code is refused.

    Top-level entries the checkpoint does not have (the optimizers of a weights-only checkpoint) are dropped
    from `state`, so the caller can tell what was loaded.
    """
    check_complete(path)
    saved = {key.split(".", 1)[0]
             for key in safe_load.SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata}
    for key in [k for k in state if k not in saved]:
        del state[key]
    comm.note("dcp_load", label=f"checkpoint load: {Path(path).name}")
    with safe_load.refusals_unwrapped():
        dcp.load(state, storage_reader=safe_load.SafeFileSystemReader(str(path)), planner=safe_load.SafeLoadPlanner())
    return read_meta(path)


# -- optimizer state keyed by FQN (torch keys it by the parameter's position in the param groups) --------------
def optimizer_state_by_fqn(optimizer: Optimizer, names: Mapping[Tensor, str]) -> dict[str, Any]:
    groups = [[names[p] for p in g["params"]] for g in optimizer.param_groups]
    return fqn_keyed(optimizer.state_dict(), groups)


def load_optimizer_state_by_fqn(optimizer: Optimizer, state: dict[str, Any], names: Mapping[Tensor, str]) -> None:
    groups = [[names[p] for p in g["params"]] for g in optimizer.param_groups]
    optimizer.load_state_dict(index_keyed(state, groups))


def fqn_keyed(state: dict[str, Any], groups: list[list[str]]) -> dict[str, Any]:
    """torch's index-keyed optimizer state -> FQN-keyed; `groups` are the FQNs of each param group, in order."""
    fqns = list(itertools.chain.from_iterable(groups))
    return {
        "state": {fqns[i]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def index_keyed(state: dict[str, Any], groups: Optional[list[list[str]]] = None) -> dict[str, Any]:
    """FQN-keyed -> torch's index-keyed optimizer state. `groups` (default: the saved ones) gives the order."""
    groups = groups if groups is not None else [g["params"] for g in state["param_groups"]]
    if len(groups) != len(state["param_groups"]):
        raise ValueError(f"the checkpoint has {len(state['param_groups'])} optimizer param groups, the optimizer "
                         f"{len(groups)}: configure_optimizers must build the same groups")
    index = {fqn: i for i, fqn in enumerate(itertools.chain.from_iterable(groups))}
    return {
        "state": {index[fqn]: s for fqn, s in state["state"].items() if fqn in index},
        "param_groups": [{**saved, "params": [index[f] for f in fqns]}
                         for saved, fqns in zip(state["param_groups"], groups)],
    }


def read_whole(directory: PathLike) -> dict[str, Any]:
    """A sharded checkpoint directory as the ordinary Lightning checkpoint dict (whole tensors, index-keyed
    optimizer state), read on one process without a process group; raises, naming the file, for a truncated
    or missing `meta.pt` and for an incomplete directory."""
    directory = Path(directory)
    if not is_sharded_checkpoint(directory):
        raise FileNotFoundError(f"{directory} is not a lit-lm sharded checkpoint (a directory with {META})")
    check_complete(directory)
    checkpoint = read_meta(directory)
    reader = safe_load.SafeFileSystemReader(str(directory))
    reader.read_metadata()  # a refusal here comes out as itself (DCP would turn it into "metadata is None")
    sharded: dict[str, Any] = {}
    with safe_load.refusals_unwrapped():
        _load_state_dict(sharded, storage_reader=reader,
                         planner=safe_load.SafeEmptyLoadPlanner(), no_dist=True)  # whole tensors from every shard file
    checkpoint["state_dict"] = sharded.pop("model")
    n_optimizers = sum(key.startswith("optimizer_") for key in sharded)
    checkpoint["optimizer_states"] = [index_keyed(sharded[f"optimizer_{i}"]) for i in range(n_optimizers)]
    return checkpoint


def read_meta(directory: PathLike) -> dict[str, Any]:
    """`meta.pt` of a checkpoint directory, read safely (weights_only); a truncated or unreadable one is reported
    by its path, one that would run code is refused (`safe_load.UnsafeCheckpointError`)."""
    meta = Path(directory) / META
    try:
        return safe_load.load(meta)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
        raise ConfigError(f"{meta} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:120]}): the "
                              "checkpoint is damaged; resume from an earlier one") from e


def to_single_file(directory: PathLike, out_file: PathLike) -> None:
    """Convert a sharded checkpoint directory into one ordinary Lightning checkpoint file (on one process)."""
    checkpoint = read_whole(directory)
    Path(out_file).parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, out_file)
