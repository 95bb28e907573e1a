"""`PipelineRunner`: executes one rank's action list of a `Schedule` (any of them) on a split `PipelineModel`.

    runner = PipelineRunner(model, schedule, rank, chunk_layers, group=pp_group)
    loss, ce = runner.run(inputs, targets, train=True)   # every rank: the batch loss, from the last stage
    runner.stats                                         # busy / wall seconds of that step, per-action times

Messages are non-blocking and batched: each run of consecutive SEND/RECV actions of the schedule is posted as one
`batch_isend_irecv` (`Schedule.issue_order`, `comm.p2p_batch`); a RECV's buffer (shape and dtype from the model's
protocol, `pipeline_activation`; on the data's device) is waited by the compute action that needs it, sends at
the end of the step. The schedule pairs sends and recvs by order, so no tags are needed, and its messages follow
one global order, so NCCL, which runs a rank's point-to-point ops in issue order, cannot deadlock on them
(tests/test_p2p_order.py replays every schedule on a strict model of it).

The loss is the mean of the microbatch losses (each backward starts from loss / m): with equal microbatches this
is the whole batch's mean, so gradients match one-process training (exactly when no target is ignored). A stage
before the last may add an auxiliary loss (MoE balancing: `stage_forward` returns (hidden, aux)): it is attached to
the stage's output so that its backward starts from aux / m too, and the reported loss sums every stage's part.

Split backward (ZB-H1). B must produce the input gradient fast and leave the weight gradients for a later W,
without running the stage's backward twice. B calls `torch.autograd.grad(output, stage_input)` and, through
pre-hooks, keeps the gradient arriving at each "weight boundary" node: a node on the path to the input with a
branch that leads only to parameters (e.g. the matmul of `x @ W.T`). W later runs only those branches,
`torch.autograd.grad(GradientEdge(node, i), params)`, so each piece of the backward runs once. (The same idea as
torch.distributed.pipelining's stage_backward_input/weight.) The first stage has no input gradient to produce:
its B is the whole backward and the schedule gives it no W.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from lit_lm.strategies import comm
from lit_lm.strategies.plan import PipelineModel
from lit_lm.strategies.pp_schedules import Action, Schedule, is_message


class _AttachLoss(torch.autograd.Function):
    """Identity on the stage's output whose backward also starts `aux`'s: gradient `scale` (1/m, the microbatch
    weight the last stage's loss gets), so one backward from the output covers the stage's auxiliary loss."""

    @staticmethod
    def forward(ctx: Any, output: Tensor, aux: Tensor, scale: float) -> Tensor:
        ctx.aux_shape, ctx.scale = aux.shape, scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        return grad, grad.new_full(ctx.aux_shape, ctx.scale), None


@dataclass
class StepStats:
    start: float = 0.0  # time.perf_counter() at the step's start: one clock for all processes of a host
    wall: float = 0.0
    busy: float = 0.0
    events: list[tuple[Action, float, float]] = field(default_factory=list)  # (compute action, start, end)


@dataclass
class _Slot:
    """What one (microbatch, chunk) keeps between its actions."""

    input: Optional[Tensor] = None
    output: Optional[Tensor] = None  # hidden state, or the loss on the last stage
    input_grad: Optional[Tensor] = None
    weight_grads: list[tuple[list[GradientEdge], list[Tensor], list[nn.Parameter]]] = field(default_factory=list)


class PipelineRunner:
    def __init__(self, model: PipelineModel, schedule: Schedule, rank: int, chunk_layers: list[list[int]],
                 group: Optional[dist.ProcessGroup] = None, seq_shards: int = 1) -> None:
        if len(chunk_layers) != schedule.chunks:
            raise ValueError(f"{len(chunk_layers)} layer lists for a schedule with {schedule.chunks} chunks per rank")
        self.model = model
        self.schedule = schedule
        self.rank = rank
        self.chunk_layers = chunk_layers
        self.group = group
        self.seq_shards = seq_shards  # sequence parallelism: stages exchange 1/seq_shards of the positions
        self.stats = StepStats()
        self._waited = 0.0  # seconds the current compute action spent waiting for its message
        self._grad_scale = 1.0
        self._rows: list[dict[str, Optional[Tensor]]] = []  # each microbatch's positions/documents (packed rows)

    def _global(self, pp_rank: int) -> int:
        return pp_rank if self.group is None else dist.get_global_rank(self.group, pp_rank)

    def run(self, inputs: Tensor, targets: Tensor, train: bool, loss_scale: float = 1.0,
            **rows: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """One pass of the schedule (forward-only when not `train`) over `inputs`/`targets` split into the
        schedule's microbatches; returns (mean loss, mean ce), broadcast from the last stage to every rank.
        `rows` (`positions`, `documents`: (B, T) or None, packed documents) are split into the same microbatches."""
        sched = self.schedule if train else self.schedule.forward_only()
        m = sched.microbatches
        xs, ys = inputs.chunk(m), targets.chunk(m)
        self._rows = [{k: None if v is None else v.chunk(m)[i] for k, v in rows.items()} for i in range(m)]
        shape, dtype = self.model.pipeline_activation(xs[0].shape[0], xs[0].shape[1] // self.seq_shards)
        slots: dict[tuple[int, int], _Slot] = {}
        recvs: dict[tuple[str, int, int], tuple[Tensor, Any]] = {}
        sends: list[tuple[Tensor, Any]] = []
        totals = torch.zeros(2, device=inputs.device)  # sum of microbatch (loss, ce) on the last stage
        # each microbatch's backward starts from loss_scale / m (loss_scale: 1 / gradient-accumulation steps)
        self._grad_scale = loss_scale / m
        self.stats = StepStats(start=time.perf_counter())
        with torch.enable_grad() if train else torch.no_grad():
            for step in sched.issue_order(self.rank):
                if is_message(step[0]):
                    sends += self._post(sched, step, slots, recvs, shape, dtype, inputs.device)
                else:
                    self._compute(sched, step[0], slots.setdefault((step[0].mb, step[0].chunk), _Slot()), xs, ys,
                                  recvs, train, totals)
                for a in step:
                    if a == self._last_use(sched, a, sched.stage(self.rank, a.chunk), train):
                        slot = slots[(a.mb, a.chunk)]
                        slot.input = slot.output = None  # free this microbatch's activations (and autograd graph)
            for _, work in sends:
                work.wait()
        self.stats.wall = time.perf_counter() - self.stats.start
        # the last stage holds (loss, ce), the others their auxiliary losses: the sum is every rank's answer
        comm.all_reduce(totals, self.group, label="pp step loss")
        return totals[0] / m, totals[1] / m

    def _post(self, sched: Schedule, messages: tuple[Action, ...], slots: dict[tuple[int, int], _Slot],
              recvs: dict, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> list[tuple[Tensor, Any]]:
        """Post a run of consecutive SEND/RECV actions as one batch. Each recv's (buffer, handle) goes to `recvs`,
        for the compute action that needs it to wait; the sends' are returned, to wait at the end of the step."""
        ops, keys = [], []
        for a in messages:
            peer = self._global(sched.peer_stage(self.rank, a) % sched.stages)
            if a.op.startswith("RECV"):
                ops.append(comm.P2P("recv", torch.empty(shape, dtype=dtype, device=device), peer))
                keys.append((a.op[-1], a.mb, a.chunk))
                continue
            slot = slots[(a.mb, a.chunk)]
            tensor = slot.output.detach() if a.op == "SEND_F" else slot.input_grad
            if tensor.shape != shape or tensor.dtype != dtype:
                raise RuntimeError(f"stage {sched.stage(self.rank, a.chunk)} sends {tuple(tensor.shape)} "
                                   f"{tensor.dtype}, but the model's pipeline_activation() promised {tuple(shape)} "
                                   f"{dtype}")
            ops.append(comm.P2P("send", tensor.contiguous(), peer))
            keys.append(None)
        sends = []
        for op, key, work in zip(ops, keys, comm.p2p_batch(ops, self.group, "pp")):
            if key is None:
                sends.append((op.tensor, work))
            else:
                recvs[key] = (op.tensor, work)
        return sends

    def _compute(self, sched: Schedule, a: Action, slot: _Slot, xs: tuple[Tensor, ...], ys: tuple[Tensor, ...],
                 recvs: dict, train: bool, totals: Tensor) -> None:
        """Run F, B or W; the time spent waiting for a message counts as idle, the rest as busy."""
        stage = sched.stage(self.rank, a.chunk)
        t0, self._waited = time.perf_counter(), 0.0
        if a.op == "F":
            self._forward(a, slot, stage, xs, ys, recvs, train, totals)
        elif a.op == "B":
            self._backward_input(a, slot, stage, recvs, sched.has_weight_pass(stage))
        else:
            self._backward_weight(slot)
        t0, t1 = t0 + self._waited, time.perf_counter()
        self.stats.busy += t1 - t0
        self.stats.events.append((a, t0 - self.stats.start, t1 - self.stats.start))

    @staticmethod
    def _last_use(sched: Schedule, a: Action, stage: int, train: bool) -> Action:
        """The action after which a (microbatch, chunk)'s activations are no longer needed."""
        if train:
            return Action("W" if sched.has_weight_pass(stage) else "B", a.mb, a.chunk)
        return Action("F" if stage == sched.num_stages - 1 else "SEND_F", a.mb, a.chunk)

    def _wait(self, recvs: dict, key: tuple[str, int, int]) -> Tensor:
        buf, work = recvs.pop(key)
        t0 = time.perf_counter()
        work.wait()
        self._waited += time.perf_counter() - t0
        return buf

    def _forward(self, a: Action, slot: _Slot, stage: int, xs: tuple[Tensor, ...], ys: tuple[Tensor, ...],
                 recvs: dict, train: bool, totals: Tensor) -> None:
        last = stage == self.schedule.num_stages - 1
        slot.input = xs[a.mb] if stage == 0 else self._wait(recvs, ("F", a.mb, a.chunk)).requires_grad_(train)
        out = self.model.stage_forward(slot.input, self.chunk_layers[a.chunk], ys[a.mb] if last else None,
                                       **self._rows[a.mb])
        if last:
            loss, ce = out
            totals += torch.stack([loss.detach().float(), ce.float()])
            out = loss
        elif isinstance(out, tuple):  # (hidden, auxiliary loss)
            out, aux = out
            totals[0] += aux.detach().float()
            out = _AttachLoss.apply(out, aux, self._grad_scale) if train else out
        slot.output = out

    def _backward_input(self, a: Action, slot: _Slot, stage: int, recvs: dict, split: bool) -> None:
        if stage == self.schedule.num_stages - 1:
            grad = torch.full_like(slot.output, self._grad_scale)
        else:
            grad = self._wait(recvs, ("B", a.mb, a.chunk))
        if not split:  # also the first stage of ZB-H1: no input gradient to hurry for, it has no W
            torch.autograd.backward(slot.output, grad)
            slot.input_grad = slot.input.grad if stage > 0 else None
            return
        groups = _weight_boundaries(slot.output, slot.input, self._params())
        captured: dict[Node, tuple[Optional[Tensor], ...]] = {}
        hooks = [node.register_prehook(lambda grads, node=node: captured.__setitem__(node, grads))
                 for node in groups]
        try:
            (slot.input_grad,) = torch.autograd.grad(slot.output, slot.input, grad, retain_graph=True)
        finally:
            for hook in hooks:
                hook.remove()
        for node, params in groups.items():
            used = [(GradientEdge(node, i), g) for i, g in enumerate(captured.get(node, ())) if g is not None]
            if used:
                edges, grads = zip(*used)
                slot.weight_grads.append((list(edges), list(grads), params))

    def _backward_weight(self, slot: _Slot) -> None:
        # One call per boundary, asking only for its own parameters: a single call for all of them would also run
        # each boundary's input-side branch down into the lower layers' weights, counting those twice.
        for edges, grads, params in slot.weight_grads:
            for p, g in zip(params, torch.autograd.grad(edges, params, grads, allow_unused=True)):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad.add_(g)
        slot.weight_grads = []

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def _weight_boundaries(output: Tensor, stage_input: Tensor, params: list[nn.Parameter]
                       ) -> dict[Node, list[nn.Parameter]]:
    """Autograd nodes on the path from `output` to `stage_input` with a branch reaching only parameters, and the
    parameters behind each. Input-gradient backward runs these nodes; weight gradients resume from them."""
    target = get_gradient_edge(stage_input).node
    acc_to_param = {get_gradient_edge(p).node: p for p in params}
    reaches: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(output.grad_fn, False)]
    while stack:  # iterative post-order: does each node's backward reach the stage input?
        node, expanded = stack.pop()
        if node in reaches:
            continue
        children = [c for c, _ in node.next_functions if c is not None]
        if expanded or not children:
            reaches[node] = node is target or any(reaches[c] for c in children)
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in reaches)
    groups: dict[Node, list[nn.Parameter]] = {}
    owner: dict[nn.Parameter, Node] = {}
    for node, on_path in reaches.items():
        if not on_path:
            continue
        for child, _ in node.next_functions:
            if child is None or reaches[child]:
                continue
            todo, seen = [child], set()
            while todo:  # everything under a branch that does not reach the input
                n = todo.pop()
                if n in seen:
                    continue
                seen.add(n)
                if n in acc_to_param:
                    p = acc_to_param[n]
                    if owner.setdefault(p, node) is not node:
                        raise RuntimeError("split backward (schedule zb_h1): a parameter is used at two places in "
                                           "one stage's forward; B/W splitting supports weights used once per stage "
                                           "(use schedule 1f1b)")
                    group = groups.setdefault(node, [])
                    if all(q is not p for q in group):
                        group.append(p)
                todo.extend(c for c, _ in n.next_functions if c is not None)
    return groups
