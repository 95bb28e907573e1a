"""Sharded state: the one translation between what this rank holds and the checkpoint's format.

A checkpoint names every tensor by its global name and global shape, whatever the layout (base.py's docstring):
a tp or ep slice is saved as a DTensor sharded over its group, ZeRO rows of an unsplit parameter as a DTensor
sharded over the dense group (replicated over HSDP's dp_replicate), ZeRO rows of a split parameter are first
gathered into the slice (one format whatever the stage). `torch.distributed.checkpoint` then reshards across
world sizes. Loading is the inverse (`live`), from what DCP filled in or from a single file's whole tensors.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim import Optimizer

from lit_lm.strategies import checkpoint as ckpt
from lit_lm.strategies import comm
from lit_lm.strategies.dp_engine import DataParallelEngine
from lit_lm.strategies.errors import ConfigError
from lit_lm.strategies.layout import ParallelLayout
from lit_lm.strategies.params import ParamIndex, ParamRecord


class ShardedState:
    """Checkpoint state of the parameters `index` holds, on `layout` (ZeRO rows sharded over `dense_group`)."""

    def __init__(self, index: ParamIndex, layout: ParallelLayout, device_type: str, dense_group: str) -> None:
        self.index, self.layout, self.device_type, self.dense_group = index, layout, device_type, dense_group

    def _dtensor(self, rec: ParamRecord, local: Tensor, rows: bool) -> DTensor:
        """`local` (the rank's placement slice, or under ZeRO its rows of a not-split parameter) as a DTensor."""
        shape, mesh_of = rec.global_shape, self.layout.device_mesh
        if rows:
            mesh, placements = mesh_of(self.device_type, "dp_replicate", self.dense_group), [Replicate(), Shard(0)]
        elif rec.placement.over == "tp":
            mesh, placements = mesh_of(self.device_type, "tp"), [Shard(rec.placement.dim)]
        else:
            mesh, placements = mesh_of(self.device_type, "edp", "ep"), [Replicate(), Shard(0)]
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    def saved(self, rec: ParamRecord, value: Any) -> Any:
        """A tensor shaped like the optimizer's (a parameter, or ZeRO rows) in the checkpoint's format."""
        if not (isinstance(value, Tensor) and value.dim() > 0):
            return value
        if rec.rows is not None and rec.placement is None:
            return self._dtensor(rec, value, rows=True)
        if rec.rows is not None:
            value = rec.rows.gather_rows(value, rec.engine.group)
        return self._dtensor(rec, value, rows=False) if rec.placement is not None else value

    @staticmethod
    def live(rec: ParamRecord, value: Any) -> Any:
        """The inverse of `saved`, from what DCP filled in (a DTensor) or a single-file checkpoint's whole tensor."""
        if not (isinstance(value, Tensor) and value.dim() > 0):
            return value
        if isinstance(value, DTensor):
            local = value.to_local()
            if rec.rows is not None and rec.placement is None:
                return local
        else:
            local = value[rec.placement.index] if rec.placement is not None else value
        return local[rec.rows.start: rec.rows.end].clone() if rec.rows is not None else local

    def model_state(self, module: nn.Module) -> dict[str, Any]:
        """The module's state dict, every parameter (tied aliases too) in the checkpoint's format."""
        aliases = self.index.aliases
        return {name: self.saved(aliases[name], aliases[name].optimized.detach()) if name in aliases else value
                for name, value in module.state_dict().items()}

    def optimizer_state(self, state: dict[str, Any], pp_group: Optional[dist.ProcessGroup]) -> dict[str, Any]:
        """An optimizer's state keyed by global name (`ckpt.optimizer_state_by_fqn`) in the checkpoint's format;
        with `pp_group` every stage's parameter names in the param groups (one rank's groups are written)."""
        by_name = self.index.by_name
        # new dicts: torch's optimizer state_dict() hands out its live per-parameter dicts
        state["state"] = {fqn: {k: self.saved(by_name[fqn], v) for k, v in s.items()}
                          for fqn, s in state["state"].items()}
        if pp_group is not None:
            stages = comm.all_gather_object([g["params"] for g in state["param_groups"]], pp_group,
                                            label="optimizer groups of every stage")
            for i, group in enumerate(state["param_groups"]):  # in stage order: the one-process order
                group["params"] = list(dict.fromkeys(fqn for names in stages for fqn in names[i]))
        return state

    def load(self, module: nn.Module, state: dict[str, Any], optimizers: list[Optimizer],
             engines: Sequence[DataParallelEngine]) -> None:
        """Apply a loaded {"model", "optimizer_<i>"} dict (DCP-filled, or a single file's whole tensors) to the
        module's parameters and buffers and to the optimizers (by global name); then the data-parallel `engines`
        bring what the forward reads up to date (ZeRO 1-2: the loaded master rows into the replicated parameters)."""
        missing = [k for k in module.state_dict() if k not in state["model"]]
        if missing and module.strict_loading:
            raise ConfigError(f"the checkpoint lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}: it holds "
                              "another model; load it with strict_loading = False to skip them")
        aliases, buffers = self.index.aliases, dict(module.named_buffers())
        with torch.no_grad():
            for name, value in state["model"].items():
                if name in aliases:
                    aliases[name].optimized.copy_(self.live(aliases[name], value))
                elif name in buffers:
                    buffers[name].copy_(value.to_local() if isinstance(value, DTensor) else value)
        by_name = self.index.by_name
        for i, optimizer in enumerate(optimizers):
            saved = state.get(f"optimizer_{i}")
            if saved is None:
                continue
            saved["state"] = {fqn: {k: self.live(by_name[fqn], v) for k, v in s.items()}
                              for fqn, s in saved["state"].items() if fqn in by_name}
            ckpt.load_optimizer_state_by_fqn(optimizer, saved, self.index.param_names())
        for engine in engines:
            engine.after_step()
