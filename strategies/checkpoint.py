"""Sharded, topology-free checkpoints: a `torch.distributed.checkpoint` (DCP) directory plus a rank-0 `meta.pt`.

    <dir>/            DCP files of {"model": {fqn: tensor}, "optimizer_<i>": {"state": {fqn: {...}},
                                                                           "param_groups": [{..., "params": [fqn]}]}}
    <dir>/meta.pt     the rest of Lightning's checkpoint (loops, lr_schedulers, callbacks, hparams, datamodule)

Every tensor is named by its FQN relative to the LightningModule, never by rank or parameter index, and sharded
tensors are DTensors with their global shape, so DCP reshards on load: a checkpoint saved on N ranks resumes on
M ranks. `to_single_file` turns a directory into an ordinary Lightning `.ckpt` (index-keyed optimizer state) for
`LightningModule.load_from_checkpoint`, a single-device `Trainer.fit(ckpt_path=...)`, export or inspection.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.optim import Optimizer

META = "meta.pt"
PathLike = Union[str, Path]


def is_sharded_checkpoint(path: PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / META).is_file()


def save(path: PathLike, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Collective: every rank writes its part of `state`; rank 0 writes `meta`. Replaces whatever is at `path`."""
    path = Path(path)
    if dist.get_rank() == 0 and path.exists():
        # DCP would otherwise write into the old directory and leave a larger world size's shard files behind.
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    dist.barrier()
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(state, checkpoint_id=path)
    if dist.get_rank() == 0:
        torch.save(meta, path / META)


def load(path: PathLike, state: dict[str, Any], weights_only: bool = False) -> dict[str, Any]:
    """Collective: fill `state` in place from the directory (resharding as needed); return the metadata.

    Top-level entries the checkpoint does not have (the optimizers of a weights-only checkpoint) are dropped
    from `state`, so the caller can tell what was loaded.
    """
    saved = {key.split(".", 1)[0] for key in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata}
    for key in [k for k in state if k not in saved]:
        del state[key]
    dcp.load(state, checkpoint_id=path)
    return torch.load(Path(path) / META, map_location="cpu", weights_only=weights_only)


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


def to_single_file(directory: PathLike, out_file: PathLike) -> None:
    """Convert a sharded checkpoint directory into one ordinary Lightning checkpoint file (on one process)."""
    directory, out_file = Path(directory), Path(out_file)
    if not is_sharded_checkpoint(directory):
        raise FileNotFoundError(f"{directory} is not a lit-lm sharded checkpoint (a directory with {META})")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    dcp_to_torch_save(directory, out_file)  # whole tensors, gathered from every shard file
    sharded = torch.load(out_file, map_location="cpu", weights_only=False)
    checkpoint = torch.load(directory / META, map_location="cpu", weights_only=False)
    checkpoint["state_dict"] = sharded.pop("model")
    n_optimizers = sum(key.startswith("optimizer_") for key in sharded)
    checkpoint["optimizer_states"] = [index_keyed(sharded[f"optimizer_{i}"]) for i in range(n_optimizers)]
    torch.save(checkpoint, out_file)
