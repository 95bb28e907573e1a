"""What pruning, QAT and k-means share: which weights to compress, and how to see a weight's *global* tensor
from the part this rank holds (the strategy's `owned_weights()` service, see `lit_lm.strategies.base.WeightShard`).

Every compression decision (a threshold, an N:M group, a channel's scale, a cluster's mean) is taken on the
global tensor, identically on every rank, then applied to the local part: so the result does not depend on
whether the weight is whole, ZeRO-sharded (dim 0 over dp), TP-sharded (dim 0 or 1 over tp) or both (the tp slice's
rows over dp): the helpers here walk the `WeightShard`'s levels, the callbacks never look at the topology.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Iterable, Optional, Sequence

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lit_lm.config import ConfigError
from lit_lm.strategies import comm
from lit_lm.strategies.base import BaseStrategy, WeightShard, whole_weights

# The token embedding and the LM head carry the most information per weight (and may be one tied tensor).
DEFAULT_EXCLUDE = ("*tok_embeddings", "*lm_head")


def owned_weights(trainer: L.Trainer, pl_module: L.LightningModule) -> list[WeightShard]:
    """The strategy's service, or every parameter whole under a strategy that does not offer it."""
    if isinstance(trainer.strategy, BaseStrategy):
        return trainer.strategy.owned_weights()
    return whole_weights(pl_module)


def layer_groups(trainer: L.Trainer) -> list[Optional[dist.ProcessGroup]]:
    """The groups to reduce a statistic of one layer over (`BaseStrategy.layer_groups`: the world but under
    pipeline parallelism); none in one process."""
    if not (dist.is_available() and dist.is_initialized()) or trainer.world_size == 1:
        return []
    strategy = trainer.strategy
    return strategy.layer_groups() if isinstance(strategy, BaseStrategy) else [None]


def warn_if_never_reached(trainer: L.Trainer, owner: str, start_step: int, last_step: int) -> None:
    """Warn when a run stops before the callback compresses anything (`last_step` of `trainer.max_steps`: the last
    step at which `start_step` still takes effect)."""
    if trainer.max_steps is not None and trainer.max_steps >= 0 and start_step > last_step:
        rank_zero_warn(f"{owner}.start_step={start_step} is past trainer.max_steps={trainer.max_steps}: the run ends "
                       f"before it compresses anything; lower start_step or raise max_steps")


def log_per_layer(pl_module: L.LightningModule, prefix: str, values: dict[str, float]) -> None:
    """`<prefix>/<layer module>` for every layer this callback compresses, at this step (a layer belongs to one
    callback of a kind, so several callbacks never log the same key)."""
    for name, value in values.items():
        pl_module.log(f"{prefix}/{name.removesuffix('.weight')}", float(value), on_step=True, on_epoch=False)


def _from_every_rank(obj: Any) -> list[Any]:
    """`obj` of every rank (a collective on the world when distributed: call it on every rank, in step)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    return comm.all_gather_object(obj, label="compression: one object from every rank")


def same_on_every_rank(names: Sequence[str]) -> bool:
    """Whether every rank holds the same weights (not so for pipeline stages or expert-parallel ranks)."""
    return all(other == list(names) for other in _from_every_rank(list(names)))


def merged_over_ranks(entries: dict[str, Any]) -> dict[str, Any]:
    """A callback's per-weight state (masks, ranges) from every rank, for its checkpoint: a pipeline stage holds
    only its own layers' and the checkpoint keeps one rank's copy. Ranks that hold the same layer hold the same
    entry. A collective (Lightning asks every rank for callback state when saving)."""
    return {name: value for part in _from_every_rank(entries) for name, value in part.items()}


def select(weights: Iterable[WeightShard], include: Optional[Sequence[str]], exclude: Sequence[str],
           owner: str) -> list[WeightShard]:
    """Linear weights (`<module>.weight`, 2-D) whose module name matches an `include` glob and no `exclude` one.
    An include pattern that matches nothing on any rank (one pipeline stage may lack a layer) is an error: a typo
    would otherwise silently compress nothing. A collective: call it on every rank."""
    linear = [ws for ws in weights if ws.name.endswith(".weight") and len(ws.global_shape) == 2]
    modules = {ws.name[: -len(".weight")]: ws for ws in linear}
    # (exclude may name what a model lacks, e.g. a head tied to the embedding)
    unmatched = [pattern for pattern in include or () if not fnmatch.filter(modules, pattern)]
    nowhere = set.intersection(*(set(u) for u in _from_every_rank(unmatched)))
    if nowhere:
        raise ConfigError(f"{owner}.include pattern {sorted(nowhere)[0]!r} matches no linear module (names look "
                          f"like {next(iter(modules), 'none')!r})")
    return [ws for m, ws in modules.items()
            if (include is None or any(fnmatch.fnmatch(m, p) for p in include))
            and not any(fnmatch.fnmatch(m, p) for p in exclude)]


def gather_global(ws: WeightShard) -> Tensor:
    """The whole weight on every rank that holds a part of it: the parts are all-gathered level by level, inner to
    outer (ZeRO's rows into the tp slice, then the slices into the weight; a collective)."""
    shapes = [ws.global_shape]
    for split in ws.splits:  # the shape each level cuts from
        shapes.append(shapes[-1][: split.dim] + torch.Size([split.end - split.start]) + shapes[-1][split.dim + 1:])
    out = ws.local.detach().clone()
    for split, shape in zip(reversed(ws.splits), reversed(shapes[:-1])):
        out = _gather_chunks(out, split.dim, shape[split.dim], split.group)
    return out


def _gather_chunks(part: Tensor, dim: int, size: int, group: dist.ProcessGroup) -> Tensor:
    """The tensor of `size` along `dim` whose `torch.chunk` parts the ranks of `group` hold (padded on the wire)."""
    world = dist.get_world_size(group)
    chunk = -(-size // world)
    rows = part.movedim(dim, 0)
    padded = rows.new_zeros((chunk, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    out = padded.new_empty((world * chunk, *rows.shape[1:]))
    comm.all_gather(out, padded.contiguous(), group)
    return out[:size].movedim(0, dim).contiguous()


def local_part(full: Tensor, ws: WeightShard) -> Tensor:
    """This rank's part of a global-shaped tensor (a mask, an assignment)."""
    return full[ws.index]


def all_reduce_(t: Tensor, groups: Sequence[dist.ProcessGroup], op: dist.ReduceOp = dist.ReduceOp.SUM) -> Tensor:
    """In place over each of `groups` in turn (a no-op for none): a statistic of a weight cut at several levels
    (tp, then ZeRO rows: `WeightShard.groups`) covers the whole weight after each level's group has reduced it."""
    for group in groups:
        comm.all_reduce(t, group, op)
    return t


@torch.no_grad()
def write(ws: WeightShard, full: Tensor, optimizers: Sequence[torch.optim.Optimizer] = (),
          multiply: bool = False) -> None:
    """Set (or, with `multiply`, scale) the weight to the global-shaped `full`: the optimizer's part, the
    replica the forward reads (ZeRO-1/2: the whole weight, or under tp its tp slice), and with `multiply` also the
    optimizer state of the part (a pruned weight's Adam moments stay zero, so it does not regrow)."""
    full = full.to(ws.local.device)
    local = local_part(full, ws).to(ws.local.dtype)
    replica = ws.replica
    targets = [(ws.local, local)] + ([(replica, full[ws.param_index].to(replica.dtype))] if replica is not None else [])
    for tensor, value in targets:  # under ZeRO-1/2 fp32 the part is a view of the replica: idempotent
        if multiply:
            tensor.mul_(value)
        else:
            tensor.copy_(value)
    if multiply:
        for optimizer in optimizers:
            for value in optimizer.state.get(ws.local, {}).values():
                if isinstance(value, Tensor) and value.shape == ws.local.shape:
                    value.mul_(local)


def check_bits(bits: int, owner: str) -> int:
    if bits not in (2, 3, 4, 8):
        raise ConfigError(f"{owner}.bits must be one of 2, 3, 4, 8, got {bits!r}")
    return bits


def pack_bits(values: Tensor, bits: int) -> Tensor:
    """Unsigned `bits`-bit integers -> a dense uint8 stream (what an exported low-bit weight costs)."""
    flat = values.reshape(-1).to(torch.int64)
    planes = (flat[:, None] >> torch.arange(bits, device=flat.device)) & 1  # (n, bits), least significant first
    stream = planes.reshape(-1)
    stream = torch.cat([stream, stream.new_zeros(-len(stream) % 8)]).view(-1, 8)
    return (stream << torch.arange(8, device=flat.device)).sum(-1).to(torch.uint8)


def unpack_bits(packed: Tensor, bits: int, numel: int) -> Tensor:
    stream = ((packed.to(torch.int64)[:, None] >> torch.arange(8, device=packed.device)) & 1).reshape(-1)
    return (stream[: numel * bits].view(numel, bits) << torch.arange(bits, device=packed.device)).sum(-1)
