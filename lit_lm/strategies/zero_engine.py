"""ZeRO stages 1-3 on plain torch.distributed (Rajbhandari et al., 2020): one engine, a `stage` knob.

Model-state bytes per rank (params + grads + Adam m, v), Φ parameters, N data-parallel ranks:

    stage   sharded                            fp32 and bf16-mixed (fp32 weights)   bf16-true (ZeRO paper, K = 12)
    DP      -                                  4Φ + 4Φ + 8Φ      = 16Φ               2Φ + 2Φ + 12Φ     = 16Φ
    1       optimizer state, master weights    4Φ + 4Φ + 8Φ/N                        2Φ + 2Φ + 12Φ/N
    2       + gradients                        4Φ + (4 + 8)Φ/N                       2Φ + (2 + 12)Φ/N
    3       + parameters                       (4 + 4 + 8)Φ/N                        (2 + 2 + 12)Φ/N

With fp32 parameters the master weight *is* the parameter (its shard is a view), so it costs nothing; bf16-true
parameters get a separate fp32 master shard (the paper's K = 12: master, m, v).

Communication per rank per step (ring algorithm; reduce-scatter and all-gather each move (N-1)/N·Φ):
stages 1 and 2 reduce-scatter the gradients and all-gather the updated parameters: 2(N-1)/N·Φ, as much as DDP's
all-reduce. Stage 3 all-gathers each unit before its forward and again before its backward: 3(N-1)/N·Φ.
Over a group of one rank (the experts' edp group when ep equals dp, a dense group when dp is 1) the shard is the
whole: stages 1-2 issue no collective (the reduced gradient is the packed one, the parameters are the masters).

Layout: every parameter is split along dim 0 with `torch.chunk` semantics (ceil-sized chunks; the tail chunk may be
short or empty). A rank's shard is then exactly the local part of a `DTensor` with `Shard(0)`, so checkpoints are keyed
by global name and global shape and reshard to any world size. For communication the parameters of a *unit* (one of the
model's `blocks`, or the rest of the model: under stages 1-2 split into the root, registered before the blocks, and the
tail, after them) are packed rank-major into one buffer,
`[rank 0: chunk 0 of p1 | chunk 0 of p2 ...][rank 1: ...]`, each chunk padded to the ceil size, so a unit costs one
collective (stages 1-2 pack into two buffers kept from step to step: `CommSlots`). Stages 2 and 3 launch a unit's
reduce-scatter as soon as its last gradient is accumulated (overlapping the rest of the backward), in one fixed order on
every rank (the reverse of the forward: the tail, the blocks from the last, then the root), as GradSync does: a unit
waits for the ones before it, and a unit whose parameter got no gradient on this rank (unused there) is launched with
zeros at the end of the backward, so every rank issues the same collectives in the same order. Under gradient
accumulation they reduce-scatter after *every* backward and add the result into the gradient shard (as DeepSpeed's
ZeRO-2 does): the gradients never exist in full beyond one unit during a backward, so the memory above holds for any
`accumulate_grad_batches`, at the cost of one reduce-scatter per micro-step instead of one per step (see docs/zero.md).
Stage 1 keeps full gradients anyway: it accumulates them locally (`no_sync()`) and reduces once, the same way, during
the window's last backward. Frozen parameters (requires_grad=False) get no gradient shard, so an optimizer that holds
them leaves them alone, as torch's optimizers leave a parameter whose grad is None. Once the optimizer is sharded, an
elementwise optimizer steps one flat tensor per param group (`lit_lm/strategies/flat_step.py`): stages 2-3 write the
reduced shards into one flat fp32 gradient buffer, and separate master shards are views of one flat master buffer
(`flatten`).
Stage 3 gathers a unit in a forward pre-hook and, through an identity autograd function on its output, again just before
its backward, prefetching the next unit, and frees it right after: at its last parameter gradient, or, for a unit
holding frozen parameters (LoRA's base weights, whose input-gradient matmuls may run after the last adapter gradient),
when the backward has left it (the gradient of its input is complete; the first block's, whose input needs none, at the
end of the backward). """

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lit_lm.strategies import comm
from lit_lm.strategies.fp8 import E4M3, Fp8Gathered, fp8_forwards, weight_scale, weight_to_fp8
from lit_lm.strategies.plan import find_block_model
from lit_lm.strategies.flat_step import FlatShard, FlatStep, elementwise

STAGES = {1: "optimizer state", 2: "optimizer state + gradients", 3: "optimizer state + gradients + parameters"}


def check_stage(stage: int) -> int:
    if stage not in STAGES:
        raise ValueError(
            f"unknown ZeRO stage {stage!r}: choose 1 (shard {STAGES[1]}), 2 (shard {STAGES[2]}) "
            f"or 3 (shard {STAGES[3]})"
        )
    return stage


@dataclass(eq=False)
class ShardedParam:
    """One parameter, its `torch.chunk` rows on this rank and its fp32 master shard."""

    fqn: str
    param: nn.Parameter
    rank: int
    world: int
    offset: int  # start of this parameter's slot inside one rank's segment of the unit buffer
    master: Tensor = field(init=False)
    grad_view: Optional[Tensor] = field(init=False, default=None)  # stages 2-3, once flat: where its grad lives

    def __post_init__(self) -> None:
        if self.param.dim() == 0:
            raise ValueError(f"ZeRO shards along dim 0; parameter {self.fqn} is a scalar: give it shape (1,)")
        self.rows = self.param.shape[0]
        self.row_numel = math.prod(self.param.shape[1:])
        self.chunk_rows = -(-self.rows // self.world)  # ceil: torch.chunk's chunk size
        self.start = min(self.rank * self.chunk_rows, self.rows)
        self.end = min(self.start + self.chunk_rows, self.rows)

    @property
    def slot_numel(self) -> int:
        return self.chunk_rows * self.row_numel

    @property
    def local_numel(self) -> int:
        return (self.end - self.start) * self.row_numel

    def full_2d(self) -> Tensor:
        """The parameter's storage as (rows, row_numel), outside autograd's version tracking."""
        return self.param.data.view(self.rows, self.row_numel)

    def gather_rows(self, rows: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
        """The whole tensor from every rank's `rows` of it (this layout, padded to the chunk size on the wire):
        how an optimizer-state shard becomes what an unsharded run holds, for checkpoints."""
        if self.world == 1:  # a group of one: the rows are the whole tensor
            return rows
        padded = rows.new_zeros((self.chunk_rows, *rows.shape[1:]))
        padded[: rows.shape[0]] = rows
        out = rows.new_empty((self.world * self.chunk_rows, *rows.shape[1:]))
        comm.all_gather(out, padded, group)
        return out[: self.rows]


@dataclass(eq=False)
class Unit:
    """The parameters gathered and reduced together: one block, or the rest of the model."""

    name: str
    params: list[ShardedParam]
    module: Optional[nn.Module]
    segment_numel: int  # one rank's share of the packed buffer (padded)
    gathered: bool = True
    pending_gather: Optional[tuple[dist.Work, Tensor]] = None
    fp8: Optional["Fp8Layout"] = None  # stage 3 under FP8 (tensorwise): its linears' weights gathered in FP8
    pending_fp8: Optional[tuple[list[dist.Work], Tensor, Optional[Tensor], list[Tensor]]] = None
    pending_reduce: Optional[tuple[Optional[dist.Work], Tensor, Tensor]] = None  # no Work: a group of one
    ready: set = field(default_factory=set)  # parameters whose gradient is accumulated in this backward

    @property
    def trainable(self) -> int:
        return sum(sp.param.requires_grad for sp in self.params)

    @property
    def frozen(self) -> bool:
        """Holds a parameter without gradient (LoRA's base weights): its last gradient does not end its backward."""
        return any(not sp.param.requires_grad for sp in self.params)


def _slots(buffer: Tensor, world: int, sp: ShardedParam, offset: Optional[int] = None) -> Tensor:
    """(world, chunk_rows, row_numel) view of `sp`'s padded chunk in every rank's segment of a packed buffer (at
    `offset` in a segment; default: its place in the unit's buffer)."""
    at = sp.offset if offset is None else offset
    return buffer.view(world, -1)[:, at: at + sp.slot_numel].view(world, sp.chunk_rows, sp.row_numel)


@dataclass(eq=False)
class Fp8Layout:
    """ZeRO-3 under FP8 (tensorwise; as torchao's float8 all-gather for FSDP2): a unit's FP8 weights (its linears',
    its expert stacks') travel as e4m3 bytes, each shard cast with the scale of its whole weight (of each whole
    expert), in one all-gather; the unit's other parameters (norms, routers) in their dtype, in another. `offsets`:
    each parameter's place in its own packed segment."""

    weights: list[tuple[ShardedParam, Fp8Gathered]]
    rest: list[ShardedParam]
    offsets: dict[ShardedParam, int]
    fp8_segment: int
    rest_segment: int

    @classmethod
    def of(cls, unit: Unit, forwards: dict[nn.Parameter, Fp8Gathered]) -> Optional["Fp8Layout"]:
        weights = [(sp, forwards[sp.param]) for sp in unit.params if sp.param in forwards]
        if not weights:
            return None
        rest = [sp for sp in unit.params if sp.param not in forwards]
        offsets, segments = {}, []
        for group in ([sp for sp, _ in weights], rest):
            at = 0
            for sp in group:
                offsets[sp] = at
                at += sp.slot_numel
            segments.append(at)
        return cls(weights, rest, offsets, *segments)


def _copy_rows(full: Tensor, slots: Tensor, into_full: bool) -> None:
    """Copy between a (rows, row_numel) tensor and its `torch.chunk` slots (world, chunk_rows, row_numel)."""
    chunk = slots.shape[1]
    whole, rem = divmod(full.shape[0], chunk)  # `whole` complete chunks, then one short chunk of `rem` rows
    pairs = [(full[: whole * chunk].view(whole, chunk, -1), slots[:whole])]
    if rem:
        pairs.append((full[whole * chunk:], slots[whole, :rem]))
    for f, s in pairs:
        (f if into_full else s).copy_(s if into_full else f)


class CommSlots:
    """Stages 1-2: the two buffers the units' reduce-scatters and all-gathers go through, kept from step to step.

    Both walk the units in a fixed order with at most two in flight (unit i waits for unit i - 2), so the unit at
    position i of its walk takes slot i % 2 (the unit at i - 2 is done with it). A slot grows to the largest unit
    that takes it, then stays: buffers the size of a unit (at 217M the root unit, the embedding, is the largest) made
    fresh every step are mapped and faulted in again at every step on the CPU (glibc maps blocks above its mmap
    threshold), about a tenth of stage 2's step at 217M parameters (issue 36). Stage 3 keeps fresh
    buffers: its gathers and reduces interleave, and two whole units held all the time would cost what it saves."""

    def __init__(self) -> None:
        self._slots: list[Optional[Tensor]] = [None, None]

    @property
    def nbytes(self) -> int:
        """What the two slots hold (the planner's `RankEstimate.slots`)."""
        return sum(slot.numel() for slot in self._slots if slot is not None)

    def take(self, position: int, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """Slot `position % 2` as `numel` elements of `dtype` (uninitialised) on `device` (a tensor's)."""
        i, nbytes = position % 2, numel * dtype.itemsize
        slot = self._slots[i]
        if slot is None or slot.numel() < nbytes or slot.device != device:
            slot = self._slots[i] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return slot[:nbytes].view(dtype)


def _free_storage(t: Tensor) -> None:
    t.untyped_storage().resize_(0)


class _BeforeBackward(torch.autograd.Function):
    """Identity; its backward runs `hook` before the gradient flows into the unit that produced the tensors."""

    @staticmethod
    def forward(ctx: Any, hook: Callable[[], None], *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.hook = hook
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Optional[Tensor], ...]:
        ctx.hook()
        return (None, *grads)


def _before_backward(output: Any, hook: Callable[[], None]) -> Any:
    flat, spec = tree_flatten(output)
    idx = [i for i, t in enumerate(flat) if isinstance(t, Tensor) and t.requires_grad]
    if not idx:
        return output
    for i, t in zip(idx, _BeforeBackward.apply(hook, *(flat[i] for i in idx))):
        flat[i] = t
    return tree_unflatten(flat, spec)


class ZeroEngine:
    """Shards `module`'s training state over `group` (the data-parallel group) according to `stage`.

    Use: build (meta parameters are materialised here with the model's `init_parameter`), `shard_optimizer(opt)`,
    then per step: forward/backward (any number of them: accumulation, all but the last inside `no_sync()`),
    `finish_grad_sync()`, clip `owned_grads()`,
    `optimizer.step()`, `optimizer.zero_grad()`, `after_step()`: the data-parallel engine protocol's verbs
    (`lit_lm/strategies/dp_engine.py`), shared with `GradSync`.
    """

    def __init__(self, module: nn.Module, stage: int, group: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None, replicate_group: Optional[dist.ProcessGroup] = None,
                 reduce_in_backward: bool = True, init: Optional[Callable[[str, Tensor], None]] = None,
                 init_rows: Optional[Callable[[str, Tensor, tuple[int, int]], bool]] = None,
                 collectives: str = "auto", forward_root: Optional[nn.Module] = None) -> None:
        self.stage = check_stage(stage)
        # whose forward uses the parameters (stages 1-2 wait for the after-step gathers in its modules' pre-hooks):
        # `module` itself, but the model when `module` is a `param_holder` (ep's dense and expert engines), which
        # runs no forward
        self._forward_root = forward_root if forward_root is not None else module
        self.module = module
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = device
        # how the gradients are reduced and the weights gathered: per backend unless forced (`comm.zero_forms`)
        where = device if device is not None else next((p.device for p in module.parameters()), torch.device("cpu"))
        self.reduce_form, self.gather_form = comm.zero_forms(collectives, where.type, self.stage)
        # HSDP: the shards are replicated over `replicate_group`; each reduced shard is then all-reduced over it
        self.replicate_group = replicate_group
        self.replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        # stages 2-3 reduce-scatter during each backward; off (the pipeline: its split backward assigns weight
        # gradients outside autograd's accumulation hooks) they reduce once per step, in `finish_grad_sync`
        self.reduce_in_backward = reduce_in_backward
        self.sync_enabled = True  # stage 1: False inside `no_sync()` (a micro-step that accumulates locally)
        self._reduced = False  # stage 1: this window's gradients were reduced in a backward
        self._hooks: list[Any] = []
        self._prefix, self._model = find_block_model(module)
        # fills a meta parameter from its name relative to the block model (default: the model's own init; a
        # composed strategy passes one that knows which slice of the global parameter this rank holds)
        self._init = init if init is not None else getattr(self._model, "init_parameter", None)
        self.root, self.blocks, tail = self._build_units(module)
        # stage 3: fills only rows [start, end) of a meta parameter's local tensor, when the model can (its values
        # read from files: `init_parameter_part`); False: the whole tensor is filled, then sliced. Given an `init`
        # (which knows the placement), only the `init_rows` given with it.
        part = getattr(self._model, "init_parameter_part", None)
        self._init_rows = init_rows if init_rows is not None or init is not None or part is None else \
            (lambda name, tensor, rows: part(name, tensor, (slice(*rows),)))
        self.units = [self.root, *self.blocks, *tail]
        self._reduce_order = [*tail, *reversed(self.blocks), self.root]  # roughly the order backward finishes them
        self._next_reduce = 0  # stages 2-3: the first unit of `_reduce_order` not launched in this backward
        self.slots = CommSlots()  # stages 1-2: the reduce-scatters' and all-gathers' buffers
        self._in_backward = False
        # stages 1-2: the all-gathers after the step run into the next forward (`refresh_params(defer=True)`);
        # units[:_gather_next] are launched, each waited for before its first use (`wait_for`) or by `flush`
        self._gather_next = len(self.units)
        self._materialize(module)
        if self.stage == 3:  # FP8 linears (tensorwise) are gathered in FP8
            forwards = fp8_forwards(module)
            for unit in self.units:
                unit.fp8 = Fp8Layout.of(unit, forwards)
        self.attach()

    def attach(self) -> None:
        """Register the hooks (gradients, unless reduced after the step's backwards; stage 3 also gathers).
        `detach()` removes them."""
        self.detach()
        if self.reduce_in_backward:
            self._register_grad_hooks()
        if self.stage == 3:
            self._register_gather_hooks()
        elif self.world > 1:
            self._register_wait_hooks()

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # -- construction ---------------------------------------------------------------------------------------
    def _build_units(self, module: nn.Module) -> tuple[Unit, list[Unit], list[Unit]]:
        """The root unit, the blocks' and (stages 1-2) the tail: the rest of the model registered after the blocks
        (the final norm and the head), whose gradients come first in the backward. Reduced on its own, first, it
        overlaps the blocks' backward instead of waiting for the embedding's gradient at the very end (and its
        whole gradients are not held until then). Stage 3 gathers the root unit around the whole model's forward:
        one unit there."""
        params = dict(module.named_parameters())  # tied parameters appear once
        for fqn, b in module.named_buffers():
            if b.is_meta:
                raise ValueError(f"ZeRO cannot initialise the meta buffer {fqn}: the model protocol initialises "
                                 "parameters only; create buffers on a real device in `configure_model`")
        dot = f"{self._prefix}." if self._prefix else ""
        blocks: list[Unit] = []
        if self._model is not None:
            for key, block in self._model.blocks.items():
                head = f"{dot}blocks.{key}."
                blocks.append(self._unit(f"blocks.{key}", [n for n in params if n.startswith(head)], params, block))
        at = {n: i for i, n in enumerate(params)}
        taken = {sp.fqn for u in blocks for sp in u.params}
        after = max((at[n] for n in taken), default=len(at)) if self.stage < 3 else len(at)
        tail = [n for n in params if n not in taken and at[n] > after]
        rest = [n for n in params if n not in taken and at[n] < after]
        if self.stage == 3:
            if self._model is None:
                raise ValueError("ZeRO-3 gathers the model unit by unit and needs a submodule with `blocks` and "
                                 "`init_parameter` (lit_lm.strategies.plan.BlockModel); none found: use zero1 or zero2")
            outside = [n for n in rest if not n.startswith(dot)]
            if outside:
                raise ValueError(f"ZeRO-3 only gathers parameters of the block model `{self._prefix}`; move "
                                 f"{outside} into it or use zero1/zero2")
        root_module = self._model if isinstance(self._model, nn.Module) else module
        tails = [self._unit("tail", tail, params, root_module)] if tail else []
        return self._unit("root", rest, params, root_module), blocks, tails

    def _unit(self, name: str, fqns: list[str], params: dict[str, nn.Parameter], module: nn.Module) -> Unit:
        dtypes = {params[n].dtype for n in fqns}
        if len(dtypes) > 1:
            raise ValueError(f"ZeRO unit {name} mixes parameter dtypes {dtypes}: use one dtype per block")
        sps, offset = [], 0
        for n in fqns:
            sp = ShardedParam(n, params[n], self.rank, self.world, offset)
            sps.append(sp)
            offset += sp.slot_numel
        return Unit(name, sps, module, offset)

    def _materialize(self, module: nn.Module) -> None:
        """Give meta parameters their values one at a time; keep the local rows as the fp32 master shard."""
        dot = f"{self._prefix}." if self._prefix else ""
        owners: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
        for mod in module.modules():
            for name, p in mod._parameters.items():
                if p is not None:
                    owners.setdefault(p, []).append((mod, name))
        # separate fp32 master shards (stage 3, or parameters below fp32) live in one buffer: `flatten` can then
        # replace it by the optimizer's layout and return all of it to the system at once (many small shards
        # freed one by one stay resident in the allocator's heap)
        own = [sp for unit in self.units for sp in unit.params if self.stage == 3 or sp.param.dtype != torch.float32]
        where = self.device if not own or own[0].param.is_meta else own[0].param.device
        masters = torch.empty(sum(sp.local_numel for sp in own), device=where) if own else None
        offset = 0
        for unit in self.units:
            for sp in unit.params:
                if sp.param.is_meta:  # a meta tensor cannot take real data in place: swap in a new Parameter
                    if self._model is None or not sp.fqn.startswith(dot):
                        raise ValueError(f"parameter {sp.fqn} is on the meta device and outside any block model: "
                                         "ZeRO cannot initialise it")
                    new = nn.Parameter(torch.empty(sp.param.shape, dtype=sp.param.dtype, device=self.device),
                                       requires_grad=sp.param.requires_grad)
                    for mod, name in owners[sp.param]:  # every owner: tied weights stay tied
                        setattr(mod, name, new)
                    sp.param = new
                    rows = (sp.start, sp.end)
                    if not (self.stage == 3 and self._init_rows is not None
                            and self._init_rows(sp.fqn[len(dot):], new.data[sp.start: sp.end], rows)):
                        self._init(sp.fqn[len(dot):], new.data)
                p = sp.param
                rows = p.data[sp.start: sp.end]
                if masters is not None and (self.stage == 3 or p.dtype != torch.float32):
                    sp.master = masters[offset: offset + sp.local_numel].view(rows.shape).detach()
                    sp.master.copy_(rows)
                    offset += sp.local_numel
                    if self.stage == 3:
                        _free_storage(p.data)
                else:  # fp32 params are their own master weights (a view)
                    sp.master = rows
                sp.master.requires_grad_(p.requires_grad)  # a leaf the optimizer (and its state init) accepts
            unit.gathered = self.stage < 3
        # Replicas start equal whatever each rank's seed was: whole parameters (stages 1-2) over the shard group,
        # and what this rank holds over the HSDP replicas.
        held = [sp.param.data if self.stage < 3 else sp.master for unit in self.units for sp in unit.params]
        for group in ([self.group] if self.stage < 3 and self.world > 1 else []) + \
                [g for g in [self.replicate_group] if g is not None]:
            src = dist.get_global_rank(group, 0) if group is not None else 0
            for tensor in held:
                comm.broadcast(tensor, src, group, label="zero broadcast parameters")

    # -- parameters: all-gather -------------------------------------------------------------------------------
    def _gather_rows(self, params: list[ShardedParam], offsets: dict[ShardedParam, int], segment: int,
                     label: str, position: Optional[int] = None) -> tuple[dist.Work, Tensor]:
        """Launch the all-gather of `params`' master rows, packed rank-major at `offsets` in `segment` elements (into
        the comm slot of `position` in the walk, stages 1-2; None: a fresh buffer)."""
        dtype, device = params[0].param.dtype, params[0].master.device
        recv = (torch.empty(self.world * segment, dtype=dtype, device=device) if position is None
                else self.slots.take(position, self.world * segment, dtype, device))
        send = recv.view(self.world, segment)[self.rank]  # in place (as FSDP2's): this rank's part of the output
        for sp in params:
            send[offsets[sp]: offsets[sp] + sp.local_numel].copy_(sp.master.view(-1))
        return comm.all_gather(recv, send, self.group, async_op=True, label=label, form=self.gather_form), recv

    def _fill(self, params: list[ShardedParam], recv: Tensor, offsets: Optional[dict[ShardedParam, int]] = None
              ) -> None:
        """Give `params` their storage back and copy their rows out of the gathered `recv`."""
        for sp in params:
            storage = sp.param.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(sp.param.numel() * sp.param.element_size())
            _copy_rows(sp.full_2d(), _slots(recv, self.world, sp, None if offsets is None else offsets[sp]),
                       into_full=True)

    @torch.no_grad()
    def _launch_gather(self, unit: Unit, full: bool = False, position: Optional[int] = None) -> None:
        """Launch `unit`'s all-gather; an FP8 unit's weights in FP8 unless `full` (whole parameters, for
        `consolidate`); at `position` of the refresh's walk (stages 1-2: `CommSlots`)."""
        if unit.pending_gather is not None or unit.pending_fp8 is not None or not unit.params:
            return
        if unit.fp8 is not None and not full:
            self._launch_fp8_gather(unit, unit.fp8)
            return
        unit.pending_gather = self._gather_rows(unit.params, {sp: sp.offset for sp in unit.params},
                                                unit.segment_numel, f"zero gather {unit.name}", position)

    @torch.no_grad()
    def _complete_gather(self, unit: Unit, full: bool = False) -> None:
        self._launch_gather(unit, full)
        if unit.pending_fp8 is not None:
            self._complete_fp8_gather(unit, unit.fp8)
        self._finish_gather(unit)

    @torch.no_grad()
    def _finish_gather(self, unit: Unit) -> None:
        if unit.pending_gather is not None:
            work, recv = unit.pending_gather
            work.wait()
            unit.pending_gather = None
            self._fill(unit.params, recv)

    # -- stage 3 under FP8: weights gathered as e4m3 bytes with their scales -----------------------------------
    def _fp8_amax(self, unit: Unit, layout: Fp8Layout) -> list[Tensor]:
        """Each FP8 weight's |w| max over the WHOLE weight (a scalar; per expert, (E,), for a stacked `Fp8Stack`,
        whose experts are each whole on one rank: zeros where this rank holds none): the shards' maxima in one
        all-reduce (MAX) over the ZeRO group for all the unit's weights, then the tp-split weights' over tp (as
        `fp8.amax` reduces them)."""
        local = []
        for sp, fwd in layout.weights:
            master = sp.master.detach()
            if fwd.per_row:
                a = master.new_zeros(sp.rows)
                if sp.local_numel:
                    a[sp.start: sp.end] = master.abs().flatten(1).amax(dim=1)
            else:
                a = (master.abs().amax() if sp.local_numel else master.new_zeros(())).reshape(1)
            local.append(a.float())
        amax = torch.cat(local)
        comm.all_reduce(amax, self.group, op=dist.ReduceOp.MAX, label=f"zero fp8 amax {unit.name}")
        parts = list(amax.split([a.numel() for a in local]))
        split = [i for i, (_, fwd) in enumerate(layout.weights) if fwd.scaling.group is not None]
        if split:
            tp = torch.cat([parts[i] for i in split])
            comm.all_reduce(tp, layout.weights[split[0]][1].scaling.group, op=dist.ReduceOp.MAX, label="fp8 amax")
            for i, part in zip(split, tp.split([parts[i].numel() for i in split])):
                parts[i] = part
        return [part if fwd.per_row else part.reshape(()) for part, (_, fwd) in zip(parts, layout.weights)]

    def _launch_fp8_gather(self, unit: Unit, layout: Fp8Layout) -> None:
        amax = self._fp8_amax(unit, layout)
        device = layout.weights[0][0].master.device
        recv = torch.empty(self.world * layout.fp8_segment, dtype=torch.uint8, device=device)
        send = recv.view(self.world, layout.fp8_segment)[self.rank]  # in place, as `_gather_rows`
        scales = []
        for (sp, fwd), a in zip(layout.weights, amax):
            mine = a[sp.start: sp.end].view(-1, *[1] * (sp.master.dim() - 1)) if fwd.per_row else a
            w8, _ = weight_to_fp8(sp.master.detach(), mine)
            send[layout.offsets[sp]: layout.offsets[sp] + sp.local_numel].copy_(w8.view(-1).view(torch.uint8))
            scales.append(weight_scale(a))
        works = [comm.all_gather(recv, send, self.group, async_op=True, label=f"zero gather fp8 {unit.name}",
                                 form=self.gather_form)]
        rest = None
        if layout.rest:
            work, rest = self._gather_rows(layout.rest, layout.offsets, layout.rest_segment, f"zero gather {unit.name}")
            works.append(work)
        unit.pending_fp8 = (works, recv, rest, scales)

    def _complete_fp8_gather(self, unit: Unit, layout: Fp8Layout) -> None:
        works, recv, rest, scales = unit.pending_fp8
        for work in works:
            work.wait()
        unit.pending_fp8 = None
        for (sp, fwd), scale in zip(layout.weights, scales):
            if fwd.weight8 is None:
                fwd.weight8 = torch.empty(sp.param.shape, dtype=E4M3, device=recv.device)
            storage = fwd.weight8.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(sp.param.numel())
            whole = fwd.weight8.data.view(torch.uint8).view(sp.rows, sp.row_numel)  # outside autograd's versions
            _copy_rows(whole, _slots(recv, self.world, sp, layout.offsets[sp]), into_full=True)
            fwd.scale8, fwd.filled = scale, True
        if rest is not None:
            self._fill(layout.rest, rest, layout.offsets)

    def unshard(self, unit: Unit, full: bool = False) -> None:
        if not unit.gathered:
            self._complete_gather(unit, full)
            unit.gathered = True

    def prefetch(self, unit: Optional[Unit]) -> None:
        if unit is not None and not unit.gathered:
            self._launch_gather(unit)

    def reshard(self, unit: Unit) -> None:
        if self.stage == 3 and unit.gathered:
            for sp in unit.params:
                _free_storage(sp.param.data)
            for _, fwd in unit.fp8.weights if unit.fp8 is not None else ():
                if fwd.weight8 is not None:
                    _free_storage(fwd.weight8)
                fwd.filled = False
            unit.gathered = False

    # -- gradients: reduce-scatter ----------------------------------------------------------------------------
    @torch.no_grad()
    def _launch_reduce(self, unit: Unit, position: int) -> None:
        """Pack `unit`'s gradients rank-major and launch their reduce-scatter, `position`-th of this walk."""
        if not unit.params:
            return
        self.flush()  # stages 1-2: the gathers still in flight use the same two slots
        first = unit.params[0].param
        numel = self.world * unit.segment_numel
        send = (self.slots.take(position, numel, first.dtype, first.device) if self.stage < 3
                else torch.empty(numel, dtype=first.dtype, device=first.device))
        for sp in unit.params:
            slots = _slots(send, self.world, sp)
            if sp.param.grad is None:  # unused in this step: contributes zeros
                slots.zero_()
            else:
                _copy_rows(sp.param.grad.view(sp.rows, sp.row_numel), slots, into_full=False)
            if self.stage >= 2:
                sp.param.grad = None  # packed: the full gradient is not kept (stage 1 keeps it)
        if self.world == 1:  # a group of one: the packed gradients are the shard, no collective (nor its bytes)
            unit.pending_reduce = (None, send, send)
            return
        recv = send.view(self.world, -1)[self.rank]  # in place: this rank's part of the input (kept until complete)
        work = comm.reduce_scatter(recv, send, self.group, async_op=True, label=f"zero reduce {unit.name}",
                                   form=self.reduce_form)
        unit.pending_reduce = (work, send, recv)

    @torch.no_grad()
    def _complete_reduce(self, unit: Unit) -> None:
        if unit.pending_reduce is None:
            return
        work, _send, recv = unit.pending_reduce
        if work is not None:  # None: a group of one
            work.wait()
        unit.pending_reduce = None
        if self.replicate_group is not None:  # HSDP: the same shard of every replica, summed
            comm.all_reduce(recv, self.replicate_group, label=f"zero replicate {unit.name}")
        recv.div_(self.world * self.replicas)  # the mean over ranks of per-rank mean losses = the global-batch mean
        first: tuple[list[Tensor], list[Tensor]] = ([], [])  # (flat gradient slices, reduced shards) to copy
        more: tuple[list[Tensor], list[Tensor]] = ([], [])  # ... to add (accumulation)
        for sp in unit.params:
            if not sp.param.requires_grad:
                continue  # frozen: no gradient, so the optimizer skips it (no weight decay either)
            shard = recv[sp.offset: sp.offset + sp.local_numel].view(sp.master.shape)
            in_slot = self.stage < 3  # a view of a comm slot, which the next units reuse (`CommSlots`)
            if self.stage == 1 and sp.param.grad is not None:  # the owned rows of the full gradient
                shard, in_slot = sp.param.grad[sp.start: sp.end].copy_(shard), False
            if sp.grad_view is not None:  # stages 2-3, flat: the gradient lives in the flat buffer
                if sp.master.grad is not sp.grad_view:  # the first micro-step since zero_grad(set_to_none=True)
                    if sp.master.grad is not None:  # a gradient someone replaced: carried over
                        sp.grad_view.copy_(sp.master.grad)
                        more[0].append(sp.grad_view)
                        more[1].append(shard)
                    else:
                        first[0].append(sp.grad_view)
                        first[1].append(shard)
                    sp.master.grad = sp.grad_view
                else:  # accumulation (or zero_grad(set_to_none=False), which zeroed the view)
                    more[0].append(sp.grad_view)
                    more[1].append(shard)
                continue
            if sp.master.grad is not None and self.stage > 1:  # stages 2-3 under accumulation: this micro-step's
                sp.master.grad.add_(shard)  # part of the window's gradient
            else:  # a tensor of its own where the shard is still in a slot
                sp.master.grad = shard.to(sp.master.dtype, copy=in_slot)
        if first[0]:
            torch._foreach_copy_(*first)
        if more[0]:
            torch._foreach_add_(*more)

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Stage 1: backward passes inside accumulate the full gradients locally; the window's last backward
        (outside) reduce-scatters their sum while it runs. Stages 2-3 reduce every backward regardless: their
        gradients never exist in full beyond one unit."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def _on_grad_ready(self, unit: Unit, sp: ShardedParam) -> None:
        if self.stage == 1 and not self.sync_enabled:
            return
        if not self._in_backward:  # the first gradient of this backward
            if self.stage == 1 and self._reduced:
                raise RuntimeError("ZeRO-1: a second backward in one synchronised step (its gradients would be "
                                   "added to the reduced ones): run all but the last of them inside no_sync()")
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        unit.ready.add(sp)
        if len(unit.ready) == unit.trainable and not unit.frozen:
            self.reshard(unit)  # stage 3: its gradients are all out; the reduce reads those, not the weights
        while self._next_reduce < len(self._reduce_order):
            nxt = self._reduce_order[self._next_reduce]
            if len(nxt.ready) < nxt.trainable:
                return  # in order: a later unit that is ready waits for this one
            self._launch_next_reduce()

    def _launch_next_reduce(self) -> None:
        """Launch the next unit's reduce-scatter; the one two places before it is waited for first, so at most two
        packed gradient buffers are in flight (each the size of its whole unit), not every unit's until the end
        of the backward."""
        if self._next_reduce >= 2:
            self._complete_reduce(self._reduce_order[self._next_reduce - 2])
        unit = self._reduce_order[self._next_reduce]
        self._launch_reduce(unit, self._next_reduce)
        self._next_reduce += 1
        if not unit.frozen:  # one with frozen weights: when the backward has left it (`_backward_enters`)
            self.reshard(unit)

    def _end_backward(self) -> None:
        """Stages 2-3, when autograd finishes a backward: launch what is left, in order (a parameter unused on this
        rank contributes zeros), and add every unit's reduced shard into its gradient."""
        while self._next_reduce < len(self._reduce_order):
            self._launch_next_reduce()
        self._next_reduce, self._in_backward = 0, False
        self._reduced = self.stage == 1
        for unit in self._reduce_order:
            unit.ready.clear()
            self._complete_reduce(unit)
            self.reshard(unit)  # a unit with frozen weights the backward never left (the first block: no input grad)

    def _register_grad_hooks(self) -> None:
        for unit in self.units:
            for sp in (s for s in unit.params if s.param.requires_grad):
                hook = (lambda u, s: lambda _p: self._on_grad_ready(u, s))(unit, sp)  # noqa: B023 (bound by the call)
                self._hooks.append(sp.param.register_post_accumulate_grad_hook(hook))

    # -- stage 3: gather around forward and backward ----------------------------------------------------------
    def _register_gather_hooks(self) -> None:
        order = self.units  # forward order: root (embedding) first, then the blocks
        for i, unit in enumerate(order):
            after = order[i + 1] if i + 1 < len(order) else None
            before = self.blocks[-1] if unit is self.root and self.blocks else (order[i - 1] if i > 1 else None)
            reader = None if unit is self.root else (after or self.root)  # the unit its output feeds
            self._hooks.append(unit.module.register_forward_pre_hook(
                lambda _m, _args, u=unit, nxt=after: self._gather(u, nxt)))
            self._hooks.append(unit.module.register_forward_hook(
                lambda _m, _args, out, u=unit, prev=before, r=reader: self._after_forward(u, prev, r, out)))

    def _gather(self, unit: Unit, upcoming: Optional[Unit]) -> None:
        self.unshard(unit)
        self.prefetch(upcoming)

    def _after_forward(self, unit: Unit, prev: Optional[Unit], reader: Optional[Unit], output: Any) -> Any:
        self.reshard(unit)
        if not torch.is_grad_enabled():
            return output
        return _before_backward(output, lambda: self._backward_enters(unit, prev, reader))

    def _backward_enters(self, unit: Unit, prev: Optional[Unit], reader: Optional[Unit]) -> None:
        """The gradient of `unit`'s output is complete: gather `unit` (prefetching `prev`). That gradient is the
        last thing the backward of `reader` (the unit the output fed) computes, so a `reader` with frozen weights,
        which its last parameter gradient does not release (the weights' input-gradient matmuls may run after it),
        is released now."""
        if reader is not None and reader.frozen:
            self.reshard(reader)
        self._gather(unit, prev)

    # -- the step -------------------------------------------------------------------------------------------
    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        shard_optimizer(optimizer, [self])

    @torch.no_grad()
    def flatten(self, groups: list[list[ShardedParam]]) -> list[tuple[Optional[Tensor], Optional[Tensor]]]:
        """Lay `groups` (trainable shards of this engine, one list per flat) out back to back: stages 2-3 write
        their reduced gradients into one flat fp32 buffer (`grad_view`), and master shards that are not views of
        their parameter (stage 3, or parameters below fp32) become views of one flat fp32 master buffer. Returns
        each group's (flat master or None, flat gradient or None); None: the step copies through a transient
        flat (`lit_lm/strategies/flat_step.py`)."""
        sizes = [sum(sp.local_numel for sp in g) for g in groups]
        members = [sp for g in groups for sp in g]
        device = members[0].master.device if members else self.device
        grad = torch.zeros(sum(sizes), device=device) if self.stage >= 2 and members else None
        own = bool(members) and all(self.stage == 3 or sp.param.dtype != torch.float32 for sp in members)
        master = torch.empty(sum(sizes), device=device) if own else None
        offset = 0
        for sp in members:
            span = slice(offset, offset + sp.local_numel)
            offset += sp.local_numel
            if grad is not None:
                sp.grad_view = grad[span].view(sp.master.shape)
            if master is not None:
                old, view = sp.master, master[span].view(sp.master.shape)
                view.copy_(old)
                sp.master = view.detach().requires_grad_(old.requires_grad)
                sp.master.grad = old.grad
        if master is not None:  # the shards left out (frozen, or in no group) leave the construction buffer, which
            taken = set(members)  # is then freed whole
            for sp in self.sharded_params():
                if sp not in taken and (self.stage == 3 or sp.param.dtype != torch.float32):
                    sp.master = sp.master.detach().clone().requires_grad_(sp.master.requires_grad)
        master_of = master.split(sizes) if master is not None else [None] * len(groups)
        grad_of = grad.split(sizes) if grad is not None else [None] * len(groups)
        return list(zip(master_of, grad_of))

    def finish_grad_sync(self) -> None:
        """After the last backward of an accumulation window: every unit's gradient shard is in `master.grad`.
        With `reduce_in_backward` the backwards did it (stages 2-3 after each, stage 1 during the window's last);
        without (the pipeline), or where stage 1's last backward ran inside `no_sync()`, the accumulated full
        gradients are reduced here."""
        self.flush()  # a unit no forward used since the step (its gather is waited for nowhere else)
        if not self.reduce_in_backward or (self.stage == 1 and not self._reduced):
            for i, unit in enumerate(self._reduce_order):  # at most two in flight, as in the backward
                if i >= 2:
                    self._complete_reduce(self._reduce_order[i - 2])
                self._launch_reduce(unit, i)
            for unit in self._reduce_order[-2:]:
                self._complete_reduce(unit)
        self._reduced = False

    def owned_grads(self) -> list[Tensor]:
        """The gradient shards this rank owns: disjoint across the group, together the full gradient."""
        return [sp.master.grad for u in self.units for sp in u.params if sp.master.grad is not None]

    def refresh_params(self, defer: bool = False) -> None:
        """Stages 1 and 2: all-gather the master shards into the replicated parameters (stage 3 gathers lazily), at
        most two units in flight (each gathers into a comm slot: `CommSlots`). `defer`: launch the first two and
        return; each unit is then waited for in the forward pre-hook of its first module (`wait_for`, which keeps
        two launched ahead), so the gathers run beside the next forward; `flush` completes them all."""
        if self.stage < 3 and self.world == 1:  # a group of one: the master rows are the whole parameter
            with torch.no_grad():
                for sp in self.sharded_params():
                    if sp.param.dtype != torch.float32:  # a separate master (fp32 ones are views: nothing to do)
                        sp.param.copy_(sp.master.view(sp.param.shape))
        elif self.stage < 3:
            self.flush()
            self._gather_next = 0
            self._launch_gathers(2)
            if not defer:
                self.flush()

    def _launch_gathers(self, until: int) -> None:
        """Launch the after-step gathers of units[:until] not launched yet, in unit order (every rank issues them
        in the same order); unit i takes slot i % 2, so unit i - 2 is completed first."""
        while self._gather_next < min(until, len(self.units)):
            i = self._gather_next
            if i >= 2:
                self._finish_gather(self.units[i - 2])
            self._launch_gather(self.units[i], position=i)
            self._gather_next += 1

    def wait_for(self, i: int) -> None:
        """Before units[i]'s first use in a forward: its after-step gather complete (launched first, with those
        before it, if it was not yet), and the next two launched."""
        if self._gather_next > i and self.units[i].pending_gather is None:
            return  # nothing in flight for it: every forward but the first after a step
        self._launch_gathers(i + 1)
        self._finish_gather(self.units[i])
        self._launch_gathers(i + 3)

    def flush(self) -> None:
        """Complete every after-step gather still in flight: the weights are then the updated ones. Whatever reads
        them between steps (a checkpoint, a callback, validation, the end of fit) comes after a flush
        (`lit_lm/strategies/weight_readers.py`); so does the next backward's first reduce-scatter (the same
        slots). Stage 3 gathers on demand: nothing to flush."""
        if self.stage == 3:
            return
        self._launch_gathers(len(self.units))
        for unit in self.units:
            self._finish_gather(unit)

    @property
    def gathers_in_flight(self) -> bool:
        return self._gather_next < len(self.units) or any(u.pending_gather is not None for u in self.units)

    def _register_wait_hooks(self) -> None:
        """Stages 1-2: a forward pre-hook on the first module to use each unit (its block; for the rest of the
        model, every module of the forward root holding one of its parameters) waits for the unit's gather
        (`wait_for`)."""
        for i, unit in enumerate(self.units):
            params = {sp.param for sp in unit.params}
            mods = [unit.module] if unit in self.blocks else [m for m in self._forward_root.modules()
                                                                if any(p in params for p in m._parameters.values()
                                                                       if p is not None)]
            for mod in mods:
                self._hooks.append(mod.register_forward_pre_hook(lambda _m, _args, i=i: self.wait_for(i)))

    def after_step(self) -> None:
        """After the update (or a loaded checkpoint): bring the replicas up to date from the master rows and drop the
        full gradients (stage 1 kept them). Stages 1-2 gather beside the next forward (`refresh_params`)."""
        self.refresh_params(defer=True)
        for unit in self.units:
            for sp in unit.params:
                sp.param.grad = None

    def consolidate(self, device: torch.device) -> None:
        """Stage 3: make every parameter whole again on `device`, one unit at a time (peak: one unit on the
        accelerator). Lightning moves the module to the CPU after fit; whole weights keep `state_dict()` valid."""
        for unit in self.units:
            if unit.fp8 is not None:  # its FP8-gathered weights are not the parameters: gather those whole
                self.reshard(unit)
            self.unshard(unit, full=True)
            for sp in unit.params:
                sp.param.data = sp.param.data.to(device)

    def sharded_params(self) -> Iterable[ShardedParam]:
        for unit in self.units:
            yield from unit.params


def shard_optimizer(optimizer: torch.optim.Optimizer, engines: list[ZeroEngine]) -> None:
    """Point the optimizer's param groups at the engines' master shards, in place: schedulers and hyper-parameters
    stay attached to the same optimizer object, and its state (m, v) is created at shard size."""
    if optimizer.state:
        raise ValueError("shard the optimizer before its first step: it already holds state")
    known = {sp.param for engine in engines for sp in engine.sharded_params()}
    for group in optimizer.param_groups:
        unknown = [p for p in group["params"] if p not in known]
        if unknown:
            raise ValueError(f"the optimizer holds {len(unknown)} tensor(s) that are not parameters of the "
                             "sharded module: build param groups from the model's parameters")
    flats = _flat_shards(optimizer, engines) if elementwise(optimizer) else None  # before reading the masters:
    masters = {sp.param: sp.master for engine in engines for sp in engine.sharded_params()}  # they may move
    for group in optimizer.param_groups:
        group["params"] = [masters[p] for p in group["params"]]
    if flats is not None:
        FlatStep(optimizer, flats)


def _flat_shards(optimizer: torch.optim.Optimizer, engines: list[ZeroEngine]) -> list[list[FlatShard]]:
    """Each param group's trainable shards laid out flat, per engine (`ZeroEngine.flatten`)."""
    groups = [set(g["params"]) for g in optimizer.param_groups]
    out: list[list[FlatShard]] = [[] for _ in groups]
    for engine in engines:
        order = [[sp for sp in engine.sharded_params() if sp.param.requires_grad and sp.param in g] for g in groups]
        for i, (members, (master, grad)) in enumerate(zip(order, engine.flatten(order))):
            if members:
                out[i].append(FlatShard([sp.master for sp in members], master, grad))
    return out


def model_state_bytes(module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                      held: Iterable[Tensor] = ()) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state allocated on this rank, by walking the tensors.

    Storage is counted once (a master shard that is a view of its parameter is free) and in full (padding
    counts); DTensors count their local shard. `held`: more parameter tensors a strategy keeps (the master rows of
    parameters outside the optimizer, e.g. LoRA's frozen base under ZeRO: `BaseStrategy.owned_weights`).
    """
    seen: set[int] = set()

    def nbytes(tensors: Iterable[Optional[Tensor]]) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            t = t._local_tensor if hasattr(t, "_local_tensor") else t
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    opt_params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
    params = nbytes([*module.parameters(), *opt_params, *held])
    grads = nbytes([*(p.grad for p in module.parameters()), *(p.grad for p in opt_params)])
    state = nbytes(t for s in (optimizer.state.values() if optimizer else ()) for t in s.values()
                   if isinstance(t, Tensor))
    return {"params": params, "grads": grads, "optimizer": state, "total": params + grads + state}
