"""Pipeline schedules as data: for each rank, the ordered list of actions one runner executes.

    schedule = build_schedule("1f1b", stages=4, microbatches=8)
    schedule.actions[rank]   -> [RECV_F0, F0, SEND_F0, RECV_F1, ...]   (what pp_runner.PipelineRunner runs)
    schedule.validate()      -> raises if an action list is inconsistent (F before B before W, sends = recvs)
    schedule.peak_in_flight() -> per rank, most microbatches whose activations are held at once
    schedule.simulated_bubble() -> per rank, idle fraction of the unit-time simulation (= bubble_theory)
    print_timeline(schedule) -> a rich table, one row per rank, one column per unit of time

Vocabulary. Stage `s` of `S = p * v` runs on rank `s % p` as its chunk `s // p` (Megatron's interleaving: with
v > 1 a rank holds v non-adjacent slices of the model). F = forward of one microbatch through one chunk, B = its
backward (the input gradient only, when the schedule splits backward), W = the weight gradient of a split
backward. SEND_F/RECV_F carry activations to the next stage, SEND_B/RECV_B input gradients to the previous one.

The schedules. `SCHEDULES` holds one `ScheduleSpec` per name: each rank's order of forwards and backwards, whether
the backward splits into B and W, the bubble in theory, whether it runs virtual stages and what else it needs. GPipe
(all forwards, then all backwards), 1F1B (p - r - 1 warm-up forwards on rank r, then one forward and one backward
in turn), Megatron's interleaved order, or for ZB-H1 1F1B's order with the backward split in B and W, the W's
deferred to fill the time a rank would wait (as in the zero-bubble paper; the first stage does not split, nothing
waits for its input gradient). An unknown name is one error everywhere (`schedule_spec`).

How a schedule is made. The order is played on a unit-time simulation (F = 1, B = 2, or B = W = 1 when split), which
proves it free of deadlock (or raises), gives the theoretical bubble and fixes where the messages go: a send right
after the action that produced it, and the receiver posts its recv at the time of that send. So between any two
ranks, recvs are posted in exactly the order sends are issued: the non-blocking point-to-point messages pair up by
order alone (no tags), whatever the real timing. And all messages follow one global order, (time, sending rank, the
sender's order), of which each rank's are a part: where a rank's point-to-point ops run one after another and a send
waits for its receive (NCCL's stream), the earliest unfinished message always has both ends at the head, so none
deadlocks. `Schedule.issue_order` is how a runner posts them: runs of consecutive messages as one batch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Optional

from lit_lm.strategies.errors import ConfigError

COSTS = {"F": 1, "B": 2, "W": 1}  # unit time of the simulation; B is 1 where the backward is split


@dataclass(frozen=True)
class Action:
    op: str  # F, B, W, SEND_F, RECV_F, SEND_B, RECV_B
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.op}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


@dataclass
class Schedule:
    name: str
    stages: int  # p, the pipeline ranks
    microbatches: int  # m
    chunks: int  # v, model chunks per rank
    split_backward: bool  # B computes input gradients only; W the weight gradients
    actions: list[list[Action]]  # per rank, in execution order
    timeline: list[list[tuple[int, int, Action]]]  # per rank: (start, end, compute action) in simulated time

    @property
    def num_stages(self) -> int:
        return self.stages * self.chunks

    def stage(self, rank: int, chunk: int) -> int:
        return chunk * self.stages + rank

    def has_weight_pass(self, stage: int) -> bool:
        return _has_weight_pass(self.split_backward, stage)

    def place(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) running a global stage."""
        return stage % self.stages, stage // self.stages

    def peer_stage(self, rank: int, message: Action) -> int:
        """The stage at the other end of a SEND/RECV: activations go to the next stage, gradients to the previous."""
        s = self.stage(rank, message.chunk)
        return s + 1 if message.op in ("SEND_F", "RECV_B") else s - 1

    def issue_order(self, rank: int) -> list[tuple[Action, ...]]:
        """What rank's runner issues, in order: each compute action alone, each run of consecutive SEND/RECV
        actions together, posted as ONE batch (`comm.p2p_batch`). The one place that order is decided: the runner
        follows it and tests/test_p2p_order.py replays it on a strict model of NCCL (see the module docstring)."""
        steps: list[tuple[Action, ...]] = []
        for a in self.actions[rank]:
            if is_message(a) and steps and is_message(steps[-1][0]):
                steps[-1] += (a,)
            else:
                steps.append((a,))
        return steps

    def forward_only(self) -> "Schedule":
        """The same order without backward: dropping actions only removes dependencies, so it stays valid."""
        keep = ("F", "SEND_F", "RECV_F")
        return Schedule(self.name, self.stages, self.microbatches, self.chunks, False,
                        [[a for a in acts if a.op in keep] for acts in self.actions],
                        [[e for e in line if e[2].op == "F"] for line in self.timeline])

    def peak_in_flight(self) -> list[int]:
        """Per rank: the most microbatch-chunks whose activations are held (forward done, backward not finished)."""
        peaks = []
        for rank, acts in enumerate(self.actions):
            held = peak = 0
            for a in acts:
                release = "W" if self.has_weight_pass(self.stage(rank, a.chunk)) else "B"
                held += (a.op == "F") - (a.op == release)
                peak = max(peak, held)
            peaks.append(peak)
        return peaks

    def simulated_bubble(self) -> list[float]:
        """Per rank: the idle fraction of the unit-time simulation, over the whole pipeline's step."""
        end = max((e for line in self.timeline for _, e, _ in line), default=0)
        return [1 - sum(e - s for s, e, _ in line) / end if end else 0.0 for line in self.timeline]

    def validate(self) -> None:
        """Raise ValueError unless every rank runs each (microbatch, chunk) once through F, B (and W) in that
        order, receives before it computes, sends after, and every pair of ranks posts sends and recvs alike."""
        forward_only = self.actions and not any(a.op == "B" for acts in self.actions for a in acts)
        sent: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        received: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        for rank, acts in enumerate(self.actions):
            position = {(a.op, a.mb, a.chunk): i for i, a in enumerate(acts)}
            if len(position) != len(acts):
                raise ValueError(f"rank {rank}: an action appears twice")
            for mb, chunk in itertools.product(range(self.microbatches), range(self.chunks)):
                s = self.stage(rank, chunk)
                ops = ("F",) if forward_only else ("F", "B", "W") if self.has_weight_pass(s) else ("F", "B")
                at = [position.get((op, mb, chunk)) for op in ops]
                if None in at or at != sorted(at):
                    raise ValueError(f"rank {rank}: microbatch {mb} chunk {chunk} needs {'<'.join(ops)}, got {at}")
                needs = [("RECV_F", s > 0, "F", True), ("SEND_F", s < self.num_stages - 1, "F", False)]
                if "B" in ops:
                    needs += [("RECV_B", s < self.num_stages - 1, "B", True), ("SEND_B", s > 0, "B", False)]
                for comm, wanted, compute, before in needs:
                    i = position.get((comm, mb, chunk))
                    if (i is not None) != wanted or (i is not None and (i < position[(compute, mb, chunk)]) != before):
                        raise ValueError(f"rank {rank}: {comm}{mb}.{chunk} missing, extra or on the wrong side of "
                                         f"{compute}")
            for a in acts:
                if is_message(a):
                    s, other = self.stage(rank, a.chunk), self.peer_stage(rank, a)
                    receiver = other if a.op.startswith("SEND") else s
                    book, key = (sent, (rank, other % self.stages)) if a.op.startswith("SEND") else \
                        (received, (other % self.stages, rank))
                    book.setdefault(key, []).append((a.op[-1], a.mb, receiver))
        if sent != received:
            raise ValueError(f"sends and recvs do not pair up in order: sent {sent}, received {received}")


def is_message(a: Action) -> bool:
    return a.op.startswith(("SEND", "RECV"))


def bubble_theory(name: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Idle fraction of a rank in theory, with F = W and B = 2F (B + W = 2F when split): the schedule's formula."""
    return schedule_spec(name).bubble(stages, microbatches, chunks)


def _has_weight_pass(split: bool, stage: int) -> bool:
    """Whether a stage's backward is split into B and W. The first stage's never is: nothing waits for its input
    gradient, so its B is the whole backward (cost 2, as unsplit) and it has no W."""
    return split and stage > 0


# -- building ------------------------------------------------------------------------------------------------------
Pick = Callable[[int, list[Action]], Optional[Action]]  # (rank, ready actions) -> the one to start, or None


def build_schedule(name: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """Play `name`'s order of forwards and backwards (its `ScheduleSpec`) on p = `stages` ranks, m =
    `microbatches`, v = `chunks` model chunks per rank; ValueError (ConfigError) on a combination it cannot run."""
    spec, p, m, v = schedule_spec(name), stages, microbatches, chunks
    if p < 1 or m < 1 or v < 1:
        raise ConfigError(f"need pipeline_parallel_size, microbatches and virtual_stages >= 1, got {p}, {m}, {v}")
    if v > 1 and not spec.chunked:
        chunked = " or ".join(n for n, s in SCHEDULES.items() if s.chunked)
        raise ConfigError(f"virtual_stages={v} needs schedule: {chunked} (got {name!r}); set virtual_stages: 1")
    why = spec.refuses(p, m, v)
    if why:
        raise ConfigError(f"{name} needs {why}; got pipeline_parallel_size={p}, microbatches={m}")
    orders = [spec.order(p, m, v, r) for r in range(p)]
    timeline = _simulate(p, m, v, spec.split_backward, _follow(orders, max_waiting_w=p))
    return Schedule(name, p, m, v, spec.split_backward, _with_messages(p, v, timeline), timeline)


def _one_f_one_b_order(p: int, m: int, v: int, rank: int) -> list[Action]:
    """p - r - 1 warm-up forwards on rank r, then one forward and one backward in turn, so at most p - r
    microbatches are in flight on rank r (ZB-H1's F/B order too: its split W's are placed by `_follow`)."""
    return _warmup_then_alternate(m, min(p - rank - 1, m))


def _gpipe_order(p: int, m: int, v: int, rank: int) -> list[Action]:
    """All forwards, then all backwards."""
    return _warmup_then_alternate(m, m)


def _warmup_then_alternate(m: int, warmup: int) -> list[Action]:
    order = [Action("F", k) for k in range(warmup)]
    for k in range(m - warmup):
        order += [Action("F", warmup + k), Action("B", k)]
    return order + [Action("B", k) for k in range(m - warmup, m)]


def _interleaved_order(p: int, m: int, v: int, rank: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B: forwards go round the chunks in groups of p microbatches, backwards the
    same way with the chunks reversed; rank r warms up with 2(p - r - 1) + (v - 1)p forwards."""
    total = m * v

    def unit(k: int, op: str) -> Action:
        chunk = (k // p) % v
        return Action(op, (k // (p * v)) * p + k % p, v - 1 - chunk if op == "B" else chunk)

    warmup = total if m == p else min(total, 2 * (p - rank - 1) + (v - 1) * p)
    order = [unit(k, "F") for k in range(warmup)]
    for k in range(total - warmup):
        order += [unit(warmup + k, "F"), unit(k, "B")]
    return order + [unit(k, "B") for k in range(total - warmup, total)]


# -- the registry: one spec per schedule --------------------------------------------------------------------------
@dataclass(frozen=True)
class ScheduleSpec:
    """Everything lit-lm knows about a schedule, read by `build_schedule` (and so the runner), `bubble_theory`,
    the planner (lit_lm/planner/plan.py), the estimator and scripts/bench_pipeline.py. A new schedule is one entry
    here."""

    order: Callable[[int, int, int, int], list[Action]]  # (p, m, v, rank) -> the rank's forwards and backwards
    split_backward: bool  # B computes input gradients only, a later W the weight gradients (zero-bubble)
    bubble: Callable[[int, int, int], float]  # (p, m, v) -> a rank's idle fraction in theory (= the simulation's)
    summary: str
    chunked: bool = False  # runs v > 1 model chunks per rank (virtual stages); the others need v = 1
    refuses: Callable[[int, int, int], str] = lambda p, m, v: ""  # (p, m, v) -> what it lacks, or "" if it runs
    planned: bool = True  # the planner tries it (GPipe: 1F1B's bubble with every microbatch held, never better)


def _fill_drain(p: int, m: int, v: int) -> float:
    return (p - 1) / (m + p - 1)


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(_gpipe_order, False, _fill_drain, "all forwards, then all backwards", planned=False),
    "1f1b": ScheduleSpec(_one_f_one_b_order, False, _fill_drain,
                         "one forward and one backward in turn after p - r - 1 warm-up forwards on rank r"),
    # the cool-down bubble is filled with W; what remains is (p-1)(F + B - W) = (p-1) F out of 3mF per rank
    "zb_h1": ScheduleSpec(_one_f_one_b_order, True, lambda p, m, v: (p - 1) / (3 * m + p - 1),
                          "1F1B with backward split in B and W, the W's filling the wait (zero-bubble H1)"),
    "interleaved_1f1b": ScheduleSpec(
        _interleaved_order, False, lambda p, m, v: (p - 1) / v / (m + (p - 1) / v),
        "Megatron's 1F1B over v = virtual_stages chunks per rank: the bubble / v", chunked=True,
        refuses=lambda p, m, v: "" if p >= 2 and m % p == 0 else
        "pipeline_parallel_size >= 2 dividing microbatches (Megatron's order goes round the ranks in groups of p)"),
}


def schedule_spec(name: str) -> ScheduleSpec:
    """`name`'s spec; the one error for an unknown schedule, wherever it is named (strategy, planner, scripts)."""
    if name not in SCHEDULES:
        raise ConfigError(f"schedule: unknown {name!r}; choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def _follow(orders: list[list[Action]], max_waiting_w: int) -> Pick:
    """Start each rank's next forward or backward in order when it is ready. Deferred weight gradients (split
    backward) fill the time a rank would otherwise wait; one is forced before a forward when `max_waiting_w`
    microbatches already wait for their W, which bounds the activations held to 1F1B's peak (p, on rank 0)."""
    waiting_w = [0] * len(orders)

    def pick(rank: int, ready: list[Action]) -> Optional[Action]:
        order = orders[rank]
        ws = [a for a in ready if a.op == "W"]
        if order and order[0] in ready and not (order[0].op == "F" and ws and waiting_w[rank] >= max_waiting_w):
            action = order.pop(0)
            waiting_w[rank] += action.op == "F"
        elif ws:
            action = ws[0]
        else:
            return None
        waiting_w[rank] -= action.op == "W"
        return action

    return pick


def _simulate(p: int, m: int, v: int, split: bool, pick: Pick) -> list[list[tuple[int, int, Action]]]:
    """Play the policy in unit time; a (stage, op, microbatch) may start once what it depends on has finished."""
    num_stages = p * v
    finish: dict[tuple[str, int, int], int] = {}  # (op, mb, stage) -> end time
    todo = [[Action(op, mb, c) for c in range(v) for mb in range(m)
             for op in (("F", "B", "W") if _has_weight_pass(split, c * p + rank) else ("F", "B"))] for rank in range(p)]

    def cost(a: Action, rank: int) -> int:
        return 1 if a.op == "B" and _has_weight_pass(split, a.chunk * p + rank) else COSTS[a.op]

    busy = [0] * p
    timeline: list[list[tuple[int, int, Action]]] = [[] for _ in range(p)]

    def done_by(key: tuple[str, int, int], t: int) -> bool:
        return key in finish and finish[key] <= t

    def is_ready(rank: int, a: Action, t: int) -> bool:
        s = a.chunk * p + rank
        if a.op == "F":
            return s == 0 or done_by(("F", a.mb, s - 1), t)
        if a.op == "B":
            return done_by(("F", a.mb, s), t) and (s == num_stages - 1 or done_by(("B", a.mb, s + 1), t))
        return done_by(("B", a.mb, s), t)

    t, horizon = 0, 4 * sum(COSTS.values()) * m * num_stages + 4
    while any(todo):
        if t > horizon:
            raise RuntimeError(f"schedule deadlocks: ranks still hold {[list(map(str, x[:3])) for x in todo]}")
        for rank in range(p):
            if busy[rank] > t or not todo[rank]:
                continue
            action = pick(rank, [a for a in todo[rank] if is_ready(rank, a, t)])
            if action is None:
                continue
            todo[rank].remove(action)
            busy[rank] = t + cost(action, rank)
            finish[(action.op, action.mb, action.chunk * p + rank)] = busy[rank]
            timeline[rank].append((t, busy[rank], action))
        t += 1
    return timeline


def _with_messages(p: int, v: int, timeline: list[list[tuple[int, int, Action]]]) -> list[list[Action]]:
    """Insert sends after the producing action and the matching recvs, at the same simulated time, on the peer."""
    num_stages = p * v
    events: list[list[tuple[int, int, Action]]] = [[] for _ in range(p)]  # (time, 0 = message / 1 = compute, ...)
    for rank, line in enumerate(timeline):
        for start, end, a in line:
            events[rank].append((start, 1, a))
            s = a.chunk * p + rank
            target = s + 1 if a.op == "F" else s - 1
            if a.op == "W" or not 0 <= target < num_stages:
                continue
            peer, peer_chunk = target % p, target // p
            events[rank].append((end, 0, Action(f"SEND_{a.op}", a.mb, a.chunk)))
            events[peer].append((end, 0, Action(f"RECV_{a.op}", a.mb, peer_chunk)))
    # A stable sort keeps a rank's sends in time order and its recvs in its peers' send order.
    return [[a for _, _, a in sorted(evs, key=lambda e: e[:2])] for evs in events]


def print_timeline(schedule: Schedule, console: Optional["rich.console.Console"] = None) -> None:  # noqa: F821
    """One row per rank, one column per simulated time unit: F green, B blue, W magenta, idle '.'."""
    from rich.console import Console
    from rich.table import Table

    colours = {"F": "green", "B": "blue", "W": "magenta"}
    width = max((end for line in schedule.timeline for _, end, _ in line), default=0)
    table = Table(title=f"{schedule.name}  p={schedule.stages} m={schedule.microbatches} v={schedule.chunks}  "
                        f"peak in flight {schedule.peak_in_flight()}", show_header=False, box=None, padding=0)
    for rank, line in enumerate(schedule.timeline):
        cells = ["[dim] . [/dim]"] * width
        for start, end, a in line:
            label = f"{a.op}{a.mb}" + ("'" * a.chunk)
            for t in range(start, end):
                cells[t] = f"[{colours[a.op]}]{label:^4}[/]"
        table.add_row(f"rank {rank} ", *cells)
    (console or Console()).print(table)
