"""Point-to-point exchanges that NCCL cannot deadlock: the cp ring and every pipeline schedule, replayed on a strict
model of NCCL's semantics (no processes: what the engines issue is recorded or derived by their own code).

The model. Each rank has one stream per communicator (here: per group) on which its point-to-point ops run in the
order they were issued. A batch (`batch_isend_irecv`) is one fused op; a lone send or recv is a batch of one. Ops
match in issue order per (src, dst) pair: the k-th send from a to b is the k-th recv on b from a. An op completes
once its match sits in the peer's head batch (the batch at the head of the peer's stream) and it sits in its own;
a batch retires when all its ops have completed, and the next batch becomes the head. No buffering: a send waits
for its recv however small the message (real NCCL slips small ones through, which hides the bug on toy tensors).
Run to a fixed point; ops left over mean a deadlock, reported with every stuck rank's head batch. Paired ops must
also agree on what they carry (a send of microbatch 3 met by the recv meant for microbatch 2 is a silent bug).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Hashable, Optional

import pytest
import torch

import lit_lm.strategies.cp as context
from lit_lm.config import ModelConfig
from lit_lm.model import Transformer
from lit_lm.strategies import comm
from lit_lm.strategies.pp_runner import PipelineRunner
from lit_lm.strategies.pp_schedules import SCHEDULES, Schedule, build_schedule, is_message
from lit_lm.strategies.pp_split import split_layers


# -- the model ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Op:
    kind: str  # "send" or "recv"
    peer: int  # the rank at the other end
    what: Hashable = None  # what the message carries; a send and the recv it meets must agree

    def __str__(self) -> str:
        return f"{self.kind} {'->' if self.kind == 'send' else '<-'} {self.peer} {self.what}"


Streams = dict[int, list[tuple[Op, ...]]]  # rank -> its batches, in issue order


class Deadlock(AssertionError):
    pass


def replay(streams: Streams) -> None:
    """Run every rank's stream to a fixed point; raise `Deadlock` naming the stuck ranks and their head batches,
    or AssertionError when two paired ops disagree on what they carry."""
    queues: dict[int, list[list[tuple[tuple[str, int, int, int], Op]]]] = {}
    for rank, batches in streams.items():
        count: dict[tuple[str, int, int], int] = {}
        queues[rank] = []
        for batch in batches:
            keyed = []
            for op in batch:
                pair = (op.kind, rank, op.peer) if op.kind == "send" else (op.kind, op.peer, rank)  # (kind, src, dst)
                keyed.append(((*pair, count.get(pair, 0)), op))
                count[pair] = count.get(pair, 0) + 1
            queues[rank].append(keyed)
    done: set[tuple[str, int, int, int]] = set()
    progressed = True
    while progressed:
        progressed = False
        heads = {rank: dict(q[0]) for rank, q in queues.items() if q}
        for head in heads.values():
            for (kind, src, dst, k), op in head.items():
                match = ("recv" if kind == "send" else "send", src, dst, k)
                peer_op = heads.get(op.peer, {}).get(match)
                if (kind, src, dst, k) in done or peer_op is None:
                    continue
                sent, received = (op, peer_op) if kind == "send" else (peer_op, op)
                assert sent.what == received.what, f"{src} -> {dst} message {k}: sent {sent} but received as {received}"
                done |= {(kind, src, dst, k), match}
                progressed = True
        for q in queues.values():
            while q and all(key in done for key, _ in q[0]):
                q.pop(0)
    stuck = {rank: q[0] for rank, q in queues.items() if q}
    if stuck:
        raise Deadlock("deadlock: " + "; ".join(f"rank {rank} waits in [{', '.join(str(op) for _, op in head)}]"
                                                 for rank, head in sorted(stuck.items())))


def unbatched(streams: Streams) -> Streams:
    """The same ops, each posted alone in the order it was issued (what a lone isend/irecv per op does)."""
    return {rank: [(op,) for batch in batches for op in batch] for rank, batches in streams.items()}


def test_the_model_can_fail_both_ways() -> None:
    """Crossed lone sends deadlock; a recv posted first, or the pair batched, does not; a paired op carrying the
    wrong payload is caught; ops still queued behind a retired batch are not skipped."""
    crossed = {0: [(Op("send", 1),), (Op("recv", 1),)], 1: [(Op("send", 0),), (Op("recv", 0),)]}
    with pytest.raises(Deadlock, match=r"rank 0 waits in \[send -> 1 None\]; rank 1 waits in \[send -> 0 None\]"):
        replay(crossed)
    replay({0: crossed[0], 1: [(Op("recv", 0),), (Op("send", 0),)]})
    replay({0: [(Op("send", 1), Op("recv", 1))], 1: [(Op("send", 0), Op("recv", 0))]})
    with pytest.raises(AssertionError, match="sent send -> 1 a but received as recv <- 0 b"):
        replay({0: [(Op("send", 1, "a"),)], 1: [(Op("recv", 0, "b"),)]})
    with pytest.raises(Deadlock, match="rank 1 waits in"):  # a send nobody receives
        replay({0: [(Op("send", 1),)], 1: [(Op("send", 0),)]})


# -- context parallelism: record what the ring issues, on fake groups ------------------------------------------------
_DONE = SimpleNamespace(wait=lambda: True)  # the handle of an op the recorders below complete at once


class _Recorder:
    """Stands in for torch.distributed and for `comm.p2p_batch` under `lit_lm.strategies.cp`: cp rank `rank` of a group
    whose global ranks are `ranks`; every batch is recorded as `Op`s (what: the payload's dtype, which tells K/V
    from the fp32 dK/dV accumulator) and completes at once, its recvs zero-filled."""

    def __init__(self, ranks: list[int], rank: int) -> None:
        self.ranks, self.rank, self.batches = ranks, rank, []
        self.group = SimpleNamespace(WORLD=object())

    def get_rank(self, group: Any = None) -> int:
        return self.ranks[self.rank] if group is None else self.rank

    def get_world_size(self, group: Any = None) -> int:
        return len(self.ranks)

    def get_process_group_ranks(self, group: Any) -> list[int]:
        return self.ranks

    def p2p_batch(self, ops: list[comm.P2P], group: Any = None, label: str = "") -> list[SimpleNamespace]:
        self.batches.append(tuple(Op(o.op, o.peer, str(o.tensor.dtype)) for o in ops))
        for o in ops:
            if o.op == "recv":
                o.tensor.zero_()
        return [_DONE] * len(ops)


def ring_streams(cp: int, monkeypatch: pytest.MonkeyPatch) -> tuple[Streams, Streams]:
    """(forward, backward) batches each rank of a cp ring issues through `comm.p2p_batch`: one attention call of
    bf16 K/V, ring_forward and ring_backward of lit_lm/strategies/cp.py run for each rank in turn. The group's global
    ranks are not 0..cp-1, so a group rank passed where a global one belongs shows up as a peer nobody is."""
    ranks = [3 + 2 * r for r in range(cp)]
    forward, backward = {}, {}
    for r in range(cp):
        fake = _Recorder(ranks, r)
        monkeypatch.setattr(context, "dist", fake)
        monkeypatch.setattr(comm, "p2p_batch", fake.p2p_batch)
        call = context.Call(object(), seq_len=4 * cp, window=4 * cp, backend="reference")
        q = torch.randn(1, 1, 2, 4, 8, dtype=torch.bfloat16)  # (B, Hkv, G, L = 2c, D), c = 2
        kv = torch.randn(2, 1, 1, 4, 8, dtype=torch.bfloat16)
        out, lse = context.ring_forward(q, kv, call)
        forward[ranks[r]], fake.batches = fake.batches, []
        context.ring_backward(q, kv, torch.randn_like(q), lse, torch.zeros_like(lse), call)
        backward[ranks[r]] = fake.batches
    return forward, backward


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_cp_ring_is_batched_and_cannot_deadlock(cp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring as issued: cp−1 K/V exchanges forward; backward, cp−1 K/V and cp dK/dV exchanges, each one batch
    of (send to the next rank, recv from the previous). Replayed, it completes; the same ops posted as a lone send
    then a lone recv (the ring before this fix) deadlock, every rank stuck on its send."""
    forward, backward = ring_streams(cp, monkeypatch)
    ranks = sorted(forward)
    for streams in (forward, backward):
        replay(streams)
        with pytest.raises(Deadlock) as stuck:
            replay(unbatched(streams))
        for i, rank in enumerate(ranks):
            assert f"rank {rank} waits in [send -> {ranks[(i + 1) % cp]}" in str(stuck.value)
    for i, rank in enumerate(ranks):
        ring = (Op("send", ranks[(i + 1) % cp], "torch.bfloat16"), Op("recv", ranks[i - 1], "torch.bfloat16"))
        assert forward[rank] == [ring] * (cp - 1)
        kinds = [batch[0].what for batch in backward[rank]]
        assert kinds.count("torch.bfloat16") == cp - 1 and kinds.count("torch.float32") == cp
        assert all([op.kind for op in batch] == ["send", "recv"] for batch in backward[rank])


# -- pipeline parallelism: every schedule as the runner issues it ----------------------------------------------------
def pp_streams(schedule: Schedule) -> Streams:
    """Each rank's message batches, from `Schedule.issue_order` (the runner's order); what: (F activations or B
    gradients, microbatch, receiving stage)."""
    streams: Streams = {}
    for rank in range(schedule.stages):
        streams[rank] = []
        for step in schedule.issue_order(rank):
            if not is_message(step[0]):
                continue
            batch = []
            for a in step:
                other = schedule.peer_stage(rank, a)
                receiver = other if a.op.startswith("SEND") else schedule.stage(rank, a.chunk)
                batch.append(Op("send" if a.op.startswith("SEND") else "recv", other % schedule.stages,
                                (a.op[-1], a.mb, receiver)))
            streams[rank].append(tuple(batch))
    return streams


def _sizes(name: str) -> list[tuple[int, int, int]]:
    """(stages, microbatches, virtual chunks): p = 2, 3, 4 (odd p too), m = p and 2p; interleaved with v = 2, 3."""
    chunks = (2, 3) if SCHEDULES[name].chunked else (1,)
    return [(p, m, v) for p in (2, 3, 4) for m in (p, 2 * p) for v in chunks]


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_replays_without_deadlock(name: str) -> None:
    """Training and forward-only (validation), batched as the runner posts them, and even each message alone:
    the schedule orders all messages by one global clock, so the order itself is safe; batching only lets ops
    progress sooner."""
    for p, m, v in _sizes(name):
        schedule = build_schedule(name, p, m, v)
        for sched in (schedule, schedule.forward_only()):
            streams = pp_streams(sched)
            assert sum(len(b) for batches in streams.values() for b in batches) == sum(
                is_message(a) for acts in sched.actions for a in acts)
            replay(streams)
            replay(unbatched(streams))


def test_replay_catches_messages_out_of_order() -> None:
    """Two sends swapped on one rank (as `validate` would also refuse) meet the wrong recvs."""
    schedule = build_schedule("1f1b", 2, 4)
    acts = schedule.actions[0]
    i = next(k for k, a in enumerate(acts) if a.op == "SEND_F" and a.mb == 0)
    j = next(k for k, a in enumerate(acts) if a.op == "SEND_F" and a.mb == 1)
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(AssertionError, match="sent send -> 1 .'F', 1, 1. but received as recv <- 0 .'F', 0, 1."):
        replay(pp_streams(schedule))


ENGINE = dict(vocab_size=64, d_model=8, n_heads=2, n_kv_heads=1, max_seq_len=4)


class _PipeRecorder:
    """`comm.p2p_batch` for one pipeline rank run alone: records (op, peer, numel) per batch, recvs are zeros."""

    def __init__(self) -> None:
        self.batches: list[tuple[tuple[str, int, int], ...]] = []

    def p2p_batch(self, ops: list[comm.P2P], group: Any = None, label: str = "") -> list[SimpleNamespace]:
        self.batches.append(tuple((o.op, o.peer, o.tensor.numel()) for o in ops))
        for o in ops:
            if o.op == "recv":
                o.tensor.zero_()
        return [_DONE] * len(ops)


def _no_all_reduce(tensor: torch.Tensor, group: Optional[Any] = None, *args: Any, **kwargs: Any) -> None:
    return None


@pytest.mark.parametrize("name, p, m, v", [("gpipe", 3, 3, 1), ("1f1b", 3, 6, 1), ("interleaved_1f1b", 2, 4, 2),
                                           ("zb_h1", 3, 3, 1)])
def test_the_runner_posts_the_replayed_batches(name: str, p: int, m: int, v: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """PipelineRunner, each rank run alone on a tiny split Transformer, posts exactly the batches replayed above
    (training and forward-only), each tensor activation-sized."""
    schedule = build_schedule(name, p, m, v)
    cfg = ModelConfig(**ENGINE, n_layers=p * v)
    stages = split_layers(cfg.n_layers, p, v)
    tokens = torch.randint(0, cfg.vocab_size, (m, ENGINE["max_seq_len"] + 1),
                           generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(comm, "all_reduce", _no_all_reduce)
    torch.manual_seed(0)
    full = Transformer(cfg)
    for train, sched in ((True, schedule), (False, schedule.forward_only())):
        expected = pp_streams(sched)
        for rank in range(p):
            recorder = _PipeRecorder()
            monkeypatch.setattr(comm, "p2p_batch", recorder.p2p_batch)
            chunk_layers = [stages[c * p + rank] for c in range(v)]
            model = copy.deepcopy(full)
            model.pipeline_split(sorted(layer for layers in chunk_layers for layer in layers), rank == 0, rank == p - 1)
            PipelineRunner(model, schedule, rank, chunk_layers).run(tokens[:, :-1], tokens[:, 1:], train=train)
            activation = ENGINE["max_seq_len"] * ENGINE["d_model"]  # one row per microbatch
            assert recorder.batches == [tuple((op.kind, op.peer, activation) for op in batch)
                                        for batch in expected[rank]], (train, rank)
