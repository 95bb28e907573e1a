"""How context parallelism splits a sequence over its cp ranks: the zigzag split, or one balanced by documents.

A split cuts the T positions into n equal chunks of c = T/n tokens and gives each of the cp ranks n/cp of them, so
every rank holds exactly T/cp tokens (activations and everything token-wise stay equal). A rank holds its chunks in
position order; inputs, targets, positions, document ids and the loss weight are all cut by the one `SequenceSplit`.

**Zigzag** (`zigzag`, the default): n = 2·cp, rank i holds chunks i and 2·cp−1−i. Under a causal mask the queries
of chunk j see j·c + (c+1)/2 keys on average, so the pair (i, 2·cp−1−i) sees the same number on every rank.

**Documents** (`balance_documents`): with packed documents (attention never crosses one) a query at position t sees

    w(t) = min(t − start(t) + 1, window)        keys (start(t): the first position of t's document)

so a chunk's work is the sum of w over its queries and over the rows of the batch (one split serves every row), and
summed over the layers' windows. Chunks that follow a document start are cheap, chunks deep in a long document dear;
the zigzag pairs no longer even out. The balancer assigns chunks to ranks, n/cp each, to even out the sums:
largest first to the least-loaded rank that still has room, then swaps between the busiest rank and another while
the larger of the two falls. It tries n = 2·cp (the zigzag itself first: kept when within `tolerance`), then
4·cp, 8·cp, ... while c divides T and stays at least `min_chunk`, and keeps the first within `tolerance` (else the
most even). Integer arithmetic on host ids: every cp peer holds the same rows and computes the same split, so
nothing is sent. A batch's ids must be on the host (the strategy plans from the batch before its transfer to the
device: `DocumentBalancer`); a device tensor is refused rather than read.

Attention work is counted as visible (query, key) pairs (`rank_pairs`, `attention_work`); one pair costs 4·D
FLOPs per query head forward (Q·Kᵀ and P·V) and 2.5 times that backward (FlashAttention-2's five matmuls to two).
Under `ulysses` every rank attends its heads over the whole sequence, so its attention work is even whatever the
split (the balance still serves the ring across `ulysses+ring` groups).

Plain torch; no Lightning, no torch.distributed.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from lit_lm.strategies.errors import ConfigError

BALANCES = ("zigzag", "documents")  # cp_balance: how the sequence is split over the cp ranks

Runs = tuple[tuple[int, int], ...]  # (first position, count) per run of consecutive positions, in the tokens' order


@dataclass(frozen=True)
class SequenceSplit:
    """Which chunks of `chunk` tokens each cp rank holds (`chunks[r]`: increasing chunk indices, the same count per
    rank), of a sequence of `seq_len` tokens. Hashable: positions and RoPE tables are cached against it."""

    seq_len: int
    chunk: int
    chunks: tuple[tuple[int, ...], ...]

    @property
    def cp(self) -> int:
        return len(self.chunks)

    @property
    def local_len(self) -> int:
        """T/cp: the tokens every rank holds."""
        return self.seq_len // self.cp

    def runs(self, rank: int) -> Runs:
        """The positions `rank` holds as runs of consecutive positions (touching chunks make one run). Plain
        integers: the step plans its tiles without reading a tensor."""
        out: list[list[int]] = []
        for j in self.chunks[rank]:
            if out and out[-1][0] + out[-1][1] == j * self.chunk:
                out[-1][1] += self.chunk
            else:
                out.append([j * self.chunk, self.chunk])
        return tuple((first, n) for first, n in out)

    def positions(self, rank: int) -> Tensor:
        """The sequence positions (T/cp,) that `rank` holds, in its tokens' order."""
        return torch.cat([torch.arange(first, first + n) for first, n in self.runs(rank)])

    def share(self, x: Tensor, rank: int, dim: int = 1) -> Tensor:
        """This rank's share of `x` along `dim` (the sequence dimension): a tensor of its own, never a view that
        would keep the whole sequence's storage alive."""
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"a split of {self.seq_len} positions cannot cut a sequence of {x.shape[dim]}")
        return torch.cat([x.narrow(dim, first, n) for first, n in self.runs(rank)], dim=dim)

    def merge(self, shares: Tensor, dim: int) -> Tensor:
        """The inverse: `shares` stacks every rank's share along dim 0 (rank order); the whole sequence along `dim`
        (of each share's dims, so `dim` counts without the stacking one)."""
        pieces: list[Tensor] = [torch.empty(0)] * (self.seq_len // self.chunk)
        for r, held in enumerate(self.chunks):
            for j, piece in zip(held, shares[r].split(self.chunk, dim=dim)):
                pieces[j] = piece
        return torch.cat(pieces, dim=dim)

    def grouped(self, u: int) -> "SequenceSplit":
        """The split over cp/u ranks where rank j holds what ranks j·u .. j·u+u−1 hold (the hybrid's ring level:
        what a Ulysses group of u consecutive ranks holds together). The zigzag split over cp gives the zigzag
        split over cp/u (chunks u times longer)."""
        if u == 1:
            return self
        chunks = tuple(tuple(sorted(sum(self.chunks[j * u:(j + 1) * u], ()))) for j in range(self.cp // u))
        split = SequenceSplit(self.seq_len, self.chunk, chunks)
        coarse = zigzag(self.seq_len, self.cp // u) if self.seq_len % (2 * self.cp // u) == 0 else None
        same = coarse is not None and all(split.runs(j) == coarse.runs(j) for j in range(split.cp))
        return coarse if same else split  # type: ignore[return-value]

    def within(self, u: int, j: int) -> "SequenceSplit":
        """How group j of `grouped(u)` shares its tokens (in their sequence order) among its u ranks: the split
        Ulysses' exchange over those u ranks puts back together. `within(cp, 0)` is the split itself."""
        union = sorted(sum(self.chunks[j * u:(j + 1) * u], ()))
        at = {chunk: i for i, chunk in enumerate(union)}
        return SequenceSplit(len(union) * self.chunk, self.chunk,
                             tuple(tuple(at[c] for c in held) for held in self.chunks[j * u:(j + 1) * u]))


def check_seq_len(seq_len: int, cp: int) -> int:
    """The zigzag chunk length c = T / (2·cp); refuses a T the split cannot cut evenly."""
    if seq_len % (2 * cp):
        raise ValueError(f"context parallelism cp={cp} needs the sequence length divisible by 2·cp={2 * cp}, "
                         f"got {seq_len}: change data.seq_len (or cp)")
    return seq_len // (2 * cp)


@functools.lru_cache(maxsize=64)
def zigzag(seq_len: int, cp: int) -> SequenceSplit:
    """The zigzag split: 2·cp chunks, rank i holds chunks i and 2·cp−1−i (causal work equal on every rank)."""
    c = check_seq_len(seq_len, cp)
    return SequenceSplit(seq_len, c, tuple(tuple(sorted({i, 2 * cp - 1 - i})) for i in range(cp)))


# -- the work a split gives each rank ----------------------------------------------------------------------------
def _host(ids: Tensor) -> Tensor:
    if ids.device.type != "cpu":
        raise ValueError("the cp balance reads document ids on the host: give the batch's CPU ids (before the "
                         "transfer), never a device tensor (a host read would stall the step)")
    return ids


def visible_keys(ids: Tensor, window: Optional[int] = None) -> Tensor:
    """(B, T): how many keys each query sees, w(t) = min(t − start(t) + 1, window), within its document (`ids`
    (B, T), non-decreasing along T, on the host)."""
    ids = _host(ids)
    t = torch.arange(ids.shape[-1]).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[..., 1:] = ids[..., 1:] != ids[..., :-1]
    first = torch.where(starts, t, torch.zeros_like(t)).cummax(-1).values
    seen = t - first + 1
    return seen if window is None else seen.clamp(max=window)


def chunk_pairs(ids: Tensor, chunk: int, windows: Sequence[Optional[int]] = (None,)) -> list[int]:
    """The visible (query, key) pairs whose query lies in each chunk of `chunk` positions, summed over the rows of
    `ids` (B, T) and over the attention layers' `windows` (one entry per layer; None: no window)."""
    per_query = sum(count * visible_keys(ids, w) for w, count in Counter(windows).items())
    return per_query.sum(0).view(-1, chunk).sum(1).tolist()  # type: ignore[union-attr]


def rank_pairs(ids: Tensor, split: SequenceSplit, windows: Sequence[Optional[int]] = (None,)) -> tuple[int, ...]:
    """Per cp rank, the visible (query, key) pairs of the queries it holds under `split`: its attention work
    under ring and allgather (causal, document and window masks; `windows` one per layer)."""
    pairs = chunk_pairs(ids, split.chunk, windows)
    return tuple(sum(pairs[j] for j in held) for held in split.chunks)


def imbalance(work: Sequence[float]) -> float:
    """max / mean of the ranks' work (1.0: even; 1.0 as well when there is none)."""
    mean = sum(work) / len(work)
    return max(work) / mean if mean else 1.0


@dataclass(frozen=True)
class AttentionWork:
    """A batch's attention work per cp rank under one split (`attention_work`): `pairs` per rank, their
    `imbalance` (max/mean), and `flops(q_heads, head_dim)` per rank."""

    split: SequenceSplit
    pairs: tuple[int, ...]

    @property
    def imbalance(self) -> float:
        return imbalance(self.pairs)

    def flops(self, q_heads: int, head_dim: int, backward: bool = True) -> tuple[float, ...]:
        """Per rank: 4·D FLOPs per pair and query head forward (Q·Kᵀ, P·V), times 3.5 with the backward."""
        per_pair = 4 * q_heads * head_dim * (3.5 if backward else 1.0)
        return tuple(per_pair * p for p in self.pairs)


def attention_work(ids: Tensor, cp: int, balance: str = "documents", windows: Sequence[Optional[int]] = (None,),
                   tolerance: float = 0.05, min_chunk: int = 1) -> AttentionWork:
    """Per-rank attention work (visible pairs) of a batch's document ids (B, T) (on the host) split over `cp` ranks
    by `balance` ("zigzag", or "documents": `balance_documents` with `tolerance` and `min_chunk`); for the planner
    and benchmarks: `.pairs`, `.imbalance`, `.flops(q_heads, head_dim)`."""
    split = plan_split(ids, cp, balance, windows, tolerance, min_chunk)
    return AttentionWork(split, rank_pairs(ids, split, windows))


# -- the balancer ---------------------------------------------------------------------------------------------
def assign(costs: Sequence[int], cp: int) -> tuple[tuple[int, ...], ...]:
    """Chunks to ranks, len(costs)/cp each, evening out the ranks' summed costs: largest first to the least-loaded
    rank with room (ties by index), then the best swap between the busiest rank and another, while it lowers the
    larger of the two. Deterministic: every cp peer computes the same assignment."""
    n = len(costs)
    per = n // cp
    held: list[list[int]] = [[] for _ in range(cp)]
    load = [0] * cp
    for j in sorted(range(n), key=lambda j: (-costs[j], j)):
        r = min((r for r in range(cp) if len(held[r]) < per), key=lambda r: (load[r], r))
        held[r].append(j)
        load[r] += costs[j]
    for _ in range(n * n):
        busy = max(range(cp), key=lambda r: (load[r], -r))
        best: Optional[tuple[int, int, int, int]] = None  # (new larger load, other rank, busy's chunk, other's)
        for r in (r for r in range(cp) if r != busy):
            for a, b in ((a, b) for a in held[busy] for b in held[r] if costs[a] > costs[b]):
                larger = max(load[busy] - costs[a] + costs[b], load[r] + costs[a] - costs[b])
                if larger < load[busy] and (best is None or larger < best[0]):
                    best = (larger, r, a, b)
        if best is None:
            break
        _, r, a, b = best
        held[busy][held[busy].index(a)], held[r][held[r].index(b)] = b, a
        d = costs[a] - costs[b]
        load[busy], load[r] = load[busy] - d, load[r] + d
    return tuple(tuple(sorted(h)) for h in held)


def balance_documents(ids: Tensor, cp: int, windows: Sequence[Optional[int]] = (None,), tolerance: float = 0.05,
                      min_chunk: int = 1) -> SequenceSplit:
    """A split of the rows `ids` (B, T) (host document ids) whose ranks' attention work (`rank_pairs`) is within
    `tolerance` of the mean where the chunk sizes allow: the zigzag split when it already is, else `assign` over
    2·cp, 4·cp, ... chunks (c = T/n a whole number >= `min_chunk`), the first within `tolerance`, else the most
    even found."""
    seq_len = ids.shape[-1]
    best = zigzag(seq_len, cp)
    best_imbalance = imbalance(rank_pairs(ids, best, windows))
    n = 2 * cp
    while best_imbalance > 1 + tolerance and seq_len % n == 0 and seq_len // n >= min_chunk:
        split = SequenceSplit(seq_len, seq_len // n, assign(chunk_pairs(ids, seq_len // n, windows), cp))
        found = imbalance(rank_pairs(ids, split, windows))
        if found < best_imbalance:
            best, best_imbalance = split, found
        n *= 2
    return best


def plan_split(ids: Tensor, cp: int, balance: str = "documents", windows: Sequence[Optional[int]] = (None,),
               tolerance: float = 0.05, min_chunk: int = 1) -> SequenceSplit:
    """The split `balance` ("zigzag" | "documents") gives rows with these host document ids (B, T)."""
    if balance not in BALANCES:
        raise ConfigError(f"cp_balance: unknown {balance!r}; choose one of {', '.join(BALANCES)}")
    if balance == "zigzag":
        return zigzag(ids.shape[-1], cp)
    return balance_documents(_host(ids), cp, windows, tolerance, min_chunk)


# -- where the strategy plans it: from the batch on the host, before its transfer ---------------------------------
@runtime_checkable
class HostDocuments(Protocol):
    """A LightningModule whose batches' document ids can be read on the host, before the batch goes to the device
    (`lit_lm.module.LanguageModel`): (B, T) ids, or None when its rows are not packed documents."""

    def host_documents(self, batch: Any) -> Optional[Tensor]: ...


@dataclass
class DocumentBalancer:
    """The split for the next step's batch, planned on the host: the strategy's `batch_to_device` calls `plan` with
    the batch's CPU ids before moving it, and the step's loss `take`s it (once) for the documents it was given.
    Every cp peer transfers the same rows, so each plans the same split with no communication."""

    cp: int
    windows: tuple[Optional[int], ...] = (None,)
    tolerance: float = 0.05
    min_chunk: int = 1
    _next: Optional[SequenceSplit] = field(default=None, repr=False)

    def plan(self, ids: Optional[Tensor]) -> None:
        self._next = None if ids is None else balance_documents(ids, self.cp, self.windows, self.tolerance,
                                                                self.min_chunk)

    def take(self, documents: Tensor) -> SequenceSplit:
        split, self._next = self._next, None
        if split is None or split.seq_len != documents.shape[-1]:
            raise RuntimeError("cp_balance documents: no split planned on the host for this batch (the strategy's "
                               "batch_to_device plans one from the batch before its transfer)")
        return split
