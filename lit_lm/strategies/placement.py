"""Where this rank's piece of a parameter sits in the global one, and building a split model on the meta device.

Tensor and expert parallelism keep a slice of some parameters along one dim (`Placement`); ZeRO then keeps rows
[start, end) of that local tensor. Everything that names a gradient or a weight globally (the parity harness's
`named_grads`, checkpoints, callbacks) composes the two with `global_index`, so there is one answer to "which
elements of the global tensor does this rank hold".

`materialize` gives a model built on the meta device storage and the values a single process would have: each
parameter is initialised whole from its global name (the model's `init_parameter`) and sliced to its placement,
one parameter at a time, so the peak is one global parameter beyond the rank's share.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Placement:
    """This rank holds `global[start:end]` along `dim` of a parameter of `global_shape`, one of the parts spread over
    the layout group `over` ("tp": a tensor-parallel split, "ep": this rank's experts)."""

    global_shape: torch.Size
    dim: int
    start: int
    end: int
    over: str

    @property
    def index(self) -> tuple[slice, ...]:
        return (slice(None),) * self.dim + (slice(self.start, self.end),)


def nested_index(levels: Iterable[tuple[int, int, int]]) -> tuple[slice, ...]:
    """The part of the global tensor nested cuts leave: each level (dim, start, end), outer to inner, keeps
    [start, end) along `dim` of what the levels before it left, so the starts add up per dim (() for no cut)."""
    index: list[slice] = []
    for dim, start, end in levels:
        index += [slice(None)] * (dim + 1 - len(index))
        offset = index[dim].start or 0
        index[dim] = slice(offset + start, offset + end)
    return tuple(index)


def global_index(placement: Optional[Placement], rows: Optional[tuple[int, int]] = None) -> tuple[slice, ...]:
    """The index of this rank's elements in the global tensor: its placement's slice, narrowed to ZeRO's `rows`
    (dim 0 of the local tensor) when given."""
    levels = [(placement.dim, placement.start, placement.end)] if placement is not None else []
    return nested_index(levels + ([(0, *rows)] if rows is not None else []))


def init_local(init: Callable[[str, Tensor], None], name: str, tensor: Tensor, placement: Optional[Placement],
               init_part: Optional[Callable[[str, Tensor, tuple[slice, ...]], bool]] = None,
               rows: Optional[tuple[int, int]] = None) -> bool:
    """Fill `tensor` with this rank's part of parameter `name`'s initial value: the whole value when it is not
    split, else the global tensor is initialised on the same device and sliced (the values do not depend on the
    split). `init_part(name, tensor, index)` (the model's `init_parameter_part`, when it has one) fills the part
    directly, e.g. read from files, and says whether it could. `rows`: `tensor` is only ZeRO-3's rows
    [start, end) of the local tensor, filled by `init_part` only. Returns whether `tensor` was filled (False: rows
    that `init_part` could not fill; the caller initialises the whole local tensor instead)."""
    index = global_index(placement, rows)
    if index and init_part is not None and init_part(name, tensor, index):
        return True
    if rows is not None:
        return False
    if placement is None:
        init(name, tensor)
        return True
    full = torch.empty(placement.global_shape, dtype=tensor.dtype, device=tensor.device)
    init(name, full)
    with torch.no_grad():
        tensor.copy_(full[placement.index])
    return True


def materialize(model: nn.Module, device: torch.device, init: Callable[[str, Tensor], None],
                init_buffer: Callable[[str, Tensor], None]) -> None:
    """Give every meta parameter and buffer of `model` storage on `device`, then its value `init(name, tensor)`
    (`init_buffer` for buffers that were on meta); a parameter used under several names (tied) stays one
    Parameter and is initialised from its first name."""
    uses: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        uses.setdefault(id(param), []).append(name)
    if not any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        return
    meta_buffers = [name for name, b in model.named_buffers() if b.is_meta]
    model.to_empty(device=device)
    for names in uses.values():  # to_empty gives each use its own Parameter: tie them again
        for name in names[1:]:
            module_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(module_name) if module_name else model, leaf, model.get_parameter(names[0]))
    for names in uses.values():
        init(names[0], model.get_parameter(names[0]).data)
    for name in meta_buffers:
        init_buffer(name, model.get_buffer(name))
