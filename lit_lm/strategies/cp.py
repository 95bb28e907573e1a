"""Context parallelism: each of `cp` ranks holds T/cp tokens of every sequence, so activations fall as 1/cp;
attention, the only op that mixes tokens, exchanges keys/values between the ranks.

Load-balanced (zigzag) split: the sequence is cut into 2·cp chunks of c = T/(2·cp) tokens and rank i holds chunks
i and 2·cp−1−i, so under a causal mask every rank has the same work (an early chunk with few keys, a late one
with many). Inputs, targets and RoPE positions are split alike (`zigzag_batch`).

Four ways to attend over the whole sequence (`METHODS`), one autograd function:
- `ring`: K/V blocks travel around the ring (rank r sends to r+1); while the next block is in flight the rank
  attends to the block in hand, and merges the partial outputs by their log-sum-exp (online softmax):
      lse = logaddexp(lse_a, lse_b),  o = exp(lse_a − lse)·o_a + exp(lse_b − lse)·o_b.
  Backward sends K/V around again, with a dK/dV accumulator travelling beside each block; after a full turn plus
  one hop every block's gradient is home. Blocks no query of this rank may see (causally or outside the sliding
  window) are skipped: with the zigzag split, every step but the first is exactly half a block.
- `allgather` (Llama 3): all-gather K/V (small under GQA), attend locally, reduce-scatter dK/dV in backward
  (K/V are gathered again there rather than kept, so saved activations stay 1/cp).
- `ulysses` (DeepSpeed-Ulysses): one all-to-all turns this rank's sequence share of every head into the whole
  sequence of Hq/cp heads (kv heads copied when fewer than cp), attention runs locally, one all-to-all turns the
  output back; under tp, the heads tp left this rank are split again.
- `ulysses+ring` (hybrid; Megatron-Core's `a2a+p2p`): the cp ranks form a u x r grid, cp rank j·u + i being
  Ulysses rank i of ring rank j (`HybridGroups`). Ulysses' all-to-all over the u consecutive ranks gives each the
  sequence those u ranks hold, of Hq/u heads; that sequence is zigzag share j of a split over r (chunks j·u..j·u+u−1
  and their mirrors are chunks j and 2r−1−j of u·c tokens), so the ring runs over the r ranks with the same i
  exactly as `ring` over r ranks, zigzag-balanced, and the output's all-to-all goes back.
Packed documents (`Documents`, from the rows' ids every cp peer holds): a tile also masks pairs of two documents,
and `block_plan` skips the keys before the earliest document a tile's rows are in, so a tile whose rows' documents
no key shares is skipped, not computed.
Grouped-query attention folds the query heads sharing a kv head into the rows of one matmul: K/V are never
repeated. Attention runs in tiles of consecutive positions (`block_plan`), each by lit-lm's FlashAttention kernel
(`lit_lm.kernels.attention.flash_attention_lse`) on CUDA tensors or under TRITON_INTERPRET=1, else by the PyTorch
reference here (fp32 scores): `block_forward`/`block_backward` are that seam.
QK-clip's per-head maximum logit is measured where the keys are: while the core measures (`LogitMaxRecord`), each
tile's maximum (`lit_lm.kernels.logit_max.tile_logit_max`) is taken beside its forward, on the K/V in hand, so a
rank's maximum covers its queries against the whole sequence; the maximum over the cp ranks is its reader's.

Plain torch.distributed through `lit_lm.strategies.comm`; no Lightning.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lit_lm.kernels.attention import flash_attention_lse, flash_attention_lse_backward
from lit_lm.kernels.logit_max import LogitMaxRecord, tile_logit_max
from lit_lm.kernels.runtime import check_backend, use_triton
from lit_lm.strategies import comm
from lit_lm.strategies.cp_balance import DocumentBalancer, Runs, SequenceSplit, check_seq_len, zigzag
from lit_lm.strategies.errors import ConfigError
from lit_lm.strategies.plan import ContextParallelModel

HYBRID = "ulysses+ring"
METHODS = ("ring", "allgather", "ulysses", HYBRID)


# -- the split: zigzag by default (`lit_lm.strategies.cp_balance`: the `SequenceSplit`, and the document balance) ---
def zigzag_runs(seq_len: int, rank: int, cp: int) -> Runs:
    """The positions cp rank `rank` holds under the zigzag split, as runs: chunks `rank` and 2·cp−1−`rank` (one run
    when they touch, cp = 1). Plain integers: the step plans its tiles without reading a tensor."""
    return zigzag(seq_len, cp).runs(rank)


def zigzag_positions(seq_len: int, rank: int, cp: int) -> Tensor:
    """The sequence positions (2c,) that cp rank `rank` holds: chunks `rank` and 2·cp−1−`rank`, in that order."""
    return zigzag(seq_len, cp).positions(rank)


@functools.lru_cache(maxsize=64)
def _positions_on(split: SequenceSplit, rank: int, device: torch.device) -> Tensor:
    """`split.positions(rank)` on `device`, made once per split: the zigzag split's is the same tensor every step,
    so the model's RoPE tables for it are built once (they are cached against it) rather than per layer per step.
    Never modify it in place."""
    return split.positions(rank).to(device)


def zigzag_split(x: Tensor, rank: int, cp: int, dim: int = 1) -> Tensor:
    """This rank's zigzag share of `x` along `dim` (the sequence dimension)."""
    return zigzag(x.shape[dim], cp).share(x, rank, dim)


def zigzag_merge(shares: Tensor, dim: int) -> Tensor:
    """The inverse: `shares` stacks every rank's share along dim 0 (rank order); returns the whole sequence."""
    return zigzag(shares.shape[0] * shares[0].shape[dim], shares.shape[0]).merge(shares, dim)


def split_gather(x: Tensor, split: SequenceSplit, group: Optional[dist.ProcessGroup] = None, dim: int = 1
                 ) -> Tensor:
    """Every rank's share of a tensor split by `split`, put back in sequence order (on every rank)."""
    cp = dist.get_world_size(group)
    shares = x.new_empty((cp * x.shape[0], *x.shape[1:]))  # gloo wants the concatenation along dim 0
    comm.all_gather(shares, x.contiguous(), group)
    return split.merge(shares.view(cp, *x.shape), dim)


def zigzag_gather(x: Tensor, group: Optional[dist.ProcessGroup] = None, dim: int = 1) -> Tensor:
    """`split_gather` of the zigzag split."""
    return split_gather(x, zigzag(x.shape[dim] * dist.get_world_size(group), dist.get_world_size(group)), group, dim)


def zigzag_batch(inputs: Tensor, targets: Tensor, group: Optional[dist.ProcessGroup] = None
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`split_batch` of the zigzag split."""
    return split_batch(inputs, targets, zigzag(inputs.shape[1], dist.get_world_size(group)), group)


def split_batch(inputs: Tensor, targets: Tensor, split: SequenceSplit, group: Optional[dist.ProcessGroup] = None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A cp rank's (inputs, targets, positions, loss_weight) under `split` from the whole (B, T) batch every cp peer
    was given, all on the batch's device (no host sync: the weight stays a tensor, the positions are cached).

    A rank's loss is the mean over its own valid targets; times `loss_weight` (cp · local valid / all valid),
    the mean over the cp ranks is the mean over the whole sequence, even when some targets are ignored (-100),
    and so is the gradient once the data-parallel sync averages it over the cp ranks too. A share without a valid
    target (loss masks: e.g. the answers all in other ranks' chunks) has weight 0, and the caller takes exactly 0
    for its loss, whose mean is 0/0 (`context_loss`)."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    local_targets = split.share(targets, rank)
    valid = (targets != -100).sum()
    local_valid = (local_targets != -100).sum()
    weight = cp * local_valid / valid.clamp(min=1)
    positions = _positions_on(split, rank, inputs.device)
    return split.share(inputs, rank), local_targets, positions, weight


# -- blockwise attention with log-sum-exp (the PyTorch reference; the kernel seam) -------------------------------
def tile_mask(n_q: int, n_k: int, offset: int, window: int, device: torch.device) -> Optional[Tensor]:
    """Which (query i, key j) pairs of a tile attend: 0 <= offset + i − j < window (None: all of them)."""
    if offset - (n_k - 1) >= 0 and offset + n_q - 1 < window:
        return None
    distance = offset + torch.arange(n_q, device=device)[:, None] - torch.arange(n_k, device=device)[None, :]
    return (distance >= 0) & (distance < window)


TileDocuments = tuple[Tensor, Tensor]  # a tile's queries' (B, M) and keys' (B, N) document ids, one numbering


def same_document(documents: Optional[TileDocuments]) -> Optional[Tensor]:
    """(B, M, N): which (query row, key) pairs of a tile lie in one document; None without documents."""
    return None if documents is None else documents[0][:, :, None] == documents[1][:, None, :]


def masked_scores(s: Tensor, offset: int, window: int, documents: Optional[TileDocuments]) -> Tensor:
    """Scores s (B, Hkv, G, M, N) with the pairs that do not attend at −inf: `tile_mask`, and with `documents`
    (packed rows) the pairs of two documents too."""
    mask = tile_mask(s.shape[-2], s.shape[-1], offset, window, s.device)
    if documents is not None:
        q_ids, k_ids = documents
        same = (q_ids[:, :, None] == k_ids[:, None, :])[:, None, None]
        mask = same if mask is None else mask & same
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def block_forward_reference(q: Tensor, k: Tensor, v: Tensor, offset: int, window: int,
                            documents: Optional[TileDocuments] = None) -> tuple[Tensor, Tensor]:
    """Causal attention of grouped queries q (B, Hkv, G, M, D) on k, v (B, Hkv, N, D) -> (out fp32, lse fp32),
    query row i sitting `offset` positions after key 0 (see `tile_mask`), within documents (`masked_scores`).

    A row with no key gets out 0 and lse −inf, which the merge weighs by exp(−inf) = 0."""
    b, hk, g, m, d = q.shape
    s = torch.matmul(q.reshape(b, hk, g * m, d), k.transpose(-1, -2)).float().view(b, hk, g, m, -1) * d ** -0.5
    s = masked_scores(s, offset, window, documents)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(lse.isinf(), 0.0, lse).unsqueeze(-1))
    out = torch.matmul(p.view(b, hk, g * m, -1).to(v.dtype), v).float().view(b, hk, g, m, d)
    return out, lse


def block_backward_reference(q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, delta: Tensor,
                             offset: int, window: int, documents: Optional[TileDocuments] = None
                             ) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (fp32) of one tile given the *final* lse and delta = rowsum(dO ∘ O) of the merged output:
    P = exp(S − lse), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − delta), dQ = dS K / √D, dK = dSᵀ Q / √D (FlashAttention-2)."""
    b, hk, g, m, d = q.shape
    scale = d ** -0.5
    qf, dof = q.reshape(b, hk, g * m, d).float(), do.reshape(b, hk, g * m, d).float()
    kf, vf = k.float(), v.float()
    s = masked_scores(torch.matmul(qf, kf.transpose(-1, -2)).view(b, hk, g, m, -1) * scale, offset, window,
                      documents)
    p = torch.exp(s - lse.unsqueeze(-1))
    ds = p * (torch.matmul(dof, vf.transpose(-1, -2)).view(b, hk, g, m, -1) - delta.unsqueeze(-1))
    p, ds = p.view(b, hk, g * m, -1), ds.view(b, hk, g * m, -1)
    dq = torch.matmul(ds, kf).view(b, hk, g, m, d) * scale
    return dq, torch.matmul(ds.transpose(-1, -2), qf) * scale, torch.matmul(p.transpose(-1, -2), dof)


def block_forward(q: Tensor, k: Tensor, v: Tensor, offset: int, window: int, backend: str = "auto",
                  documents: Optional[TileDocuments] = None) -> tuple[Tensor, Tensor]:
    """The kernel seam: lit-lm's FlashAttention where `lit_lm.kernels.runtime.use_triton(backend, q)` says ("auto": CUDA
    tensors, or CPU under TRITON_INTERPRET=1; with `documents`, as varlen), else the reference."""
    if not use_triton(backend, q):
        return block_forward_reference(q, k, v, offset, window, documents)
    b, hk, g, m, d = q.shape
    out, lse = flash_attention_lse(q.reshape(b, hk * g, m, d), k, v, offset, window, documents)
    return out.float().view(b, hk, g, m, d), lse.view(b, hk, g, m)


def block_backward(q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, delta: Tensor, offset: int,
                   window: int, backend: str = "auto", documents: Optional[TileDocuments] = None
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel seam of the backward, as `block_forward`."""
    if not use_triton(backend, q):
        return block_backward_reference(q, k, v, do, lse, delta, offset, window, documents)
    b, hk, g, m, d = q.shape
    dq, dk, dv = flash_attention_lse_backward(q.reshape(b, hk * g, m, d), k, v, do.reshape(b, hk * g, m, d),
                                              lse.reshape(b, hk * g, m), delta.reshape(b, hk * g, m), offset, window,
                                              documents)
    return dq.float().view(b, hk, g, m, d), dk.float(), dv.float()


def block_plan(q_runs: Runs, k_runs: Runs, window: int, chunk: int, first_key: Optional[tuple[int, ...]] = None
               ) -> Iterator[tuple[slice, slice, int]]:
    """The tiles to compute, (query rows, keys, offset), for each piece of at most `chunk` query rows of a run:
    within each run of keys, the keys some row of the piece sees (causal, within `window`), so both sides of a
    tile are consecutive positions and query row i sits `offset` + i positions after its first key. Pieces that
    see no key of a run are skipped (causal block skipping). Key runs must increase in position.

    Integer arithmetic on the runs only: nothing here reads a tensor, so planning a tile never waits for the
    device. A piece of rows at positions [p, p + n) sees key positions [p − window + 1, p + n − 1], and with packed
    documents (`first_key`: per piece p // chunk, the first position of the document p is in, the earliest over
    the batch rows; pieces start at multiples of `chunk`) none before first_key[p // chunk]: every later row is in
    that document or a later one. So a tile whose rows' documents no key shares is skipped, not computed."""
    row = 0
    for q_first, q_len in q_runs:
        for start in range(0, q_len, chunk):
            n, p = min(chunk, q_len - start), q_first + start
            earliest = max(p - window + 1, 0 if first_key is None else first_key[p // chunk])
            key = 0
            for k_first, k_len in k_runs:
                lo, hi = max(k_first, earliest), min(k_first + k_len, p + n)  # seen positions [lo, hi)
                if lo < hi:
                    yield slice(row + start, row + start + n), slice(key + lo - k_first, key + hi - k_first), p - lo
                key += k_len
        row += q_len


def merge_into(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """The online-softmax merge, in place: two softmax-normalised partial outputs over disjoint key sets become
    the output over their union. Rows that have seen no key yet on either side stay at out 0, lse −inf."""
    new = torch.logaddexp(lse, block_lse)
    finite = torch.where(new.isinf(), 0.0, new)
    out.mul_(torch.exp(lse - finite).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - finite).unsqueeze(-1))
    lse.copy_(new)


def join_sink(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Attention sinks (gpt-oss: a learned logit s per query head in its softmax, its mass dropped): the sink is one
    more key of logit s and value 0, joined ONCE to each row's merged (out, lse), never per tile or per rank (each
    would count exp(s) once more):
        lse' = logaddexp(lse, s),  out' = exp(lse − lse')·out.
    `sinks` (Hkv, G) fp32 against lse (B, Hkv, G, L). The backward then needs nothing new: with lse' the rows'
    log-sum-exp and delta' = rowsum(dO'∘out'), the tiles' P = exp(S − lse') and dS = P∘(dO Vᵀ − delta') are the
    sinked softmax's (the sink's value 0 adds nothing to delta'), and the sink's own gradient is
        ds = −Σ_rows exp(s − lse')·delta'    (`sink_grad`)."""
    joined = torch.logaddexp(lse, sinks[..., None])
    return out * torch.exp(lse - joined).unsqueeze(-1), joined


def sink_grad(lse: Tensor, delta: Tensor, sinks: Tensor) -> Tensor:
    """The sinks' gradient (Hkv, G) from the joined lse' and delta' (B, Hkv, G, L) (`join_sink`)."""
    return -(torch.exp(sinks[..., None] - lse) * delta).sum((0, -1))


TILE_ROWS = 512  # with documents, the most query rows of one tile (finer tiles skip more of a short document's row)


@dataclass(frozen=True)
class Documents:
    """Packed rows' documents as the cp cores use them. `ids` (B, T): each token's document in its row, in
    sequence order (`lit_lm.data.packing`: non-decreasing along T); every cp peer was given the whole rows, so each
    rank's keys' ids are read here rather than sent with the keys (no bytes). Tiles are `piece` query rows tall (a
    divisor of the chunk c), and `first_key` (T/piece,): for each piece k, the first position of the document its
    first token is in, the earliest over the rows (`block_plan` skips the keys before it): host integers, read once
    per step on a CPU rank, all 0 (nothing skipped before the kernel) on an accelerator (`row_documents`)."""

    ids: Tensor
    shares: tuple[Tensor, ...]  # split.share(ids, r) for each cp rank r: the ids of rank r's tokens
    first_key: tuple[int, ...]
    piece: int
    split: Optional[SequenceSplit] = None  # how the cp ranks split the rows (None: zigzag)
    _other_splits: dict[int, tuple[Tensor, ...]] = field(default_factory=dict, compare=False, repr=False)

    def share(self, rank: int, ranks: int) -> Tensor:
        """The ids of rank `rank`'s tokens in a zigzag split over `ranks` ranks: `shares` for the cp group's, else
        (the hybrid's ring level, cp/u ranks) split once per step and kept here for every layer."""
        if ranks == len(self.shares):
            return self.shares[rank]
        if ranks not in self._other_splits:
            grouped = (self.split or zigzag(self.ids.shape[1], len(self.shares))).grouped(len(self.shares) // ranks)
            self._other_splits[ranks] = tuple(grouped.share(self.ids, r) for r in range(ranks))
        return self._other_splits[ranks][rank]


def row_documents(ids: Tensor, cp: int, rows: int = TILE_ROWS, split: Optional[SequenceSplit] = None) -> Documents:
    """`Documents` of (B, T) rows for a cp group of `cp` ranks: tiles of the largest divisor of the chunk c up to
    `rows` query rows. On a CPU rank, a host read of T/piece integers per step, before the model runs (a tile's
    skip is a host decision, as varlen kernels' cu_seqlens are); on an accelerator none (NCCL's path: no host sync
    in the step): tiles stay a chunk tall, masked, and the kernel skips inside them. Piece k starts at p = k·piece;
    its first document starts at the first s with ids[s] = ids[p] (ids non-decreasing: a binary search). When no
    piece's document starts after position 0 (one document per row), finer tiles would skip nothing: tiles stay a
    chunk tall, as without documents (so such rows give today's result bit for bit). `split`: the cp ranks' split
    of the rows (None: zigzag; c is its chunk)."""
    split = split or zigzag(ids.shape[1], cp)
    c = split.chunk
    piece = c // next(k for k in range(-(-c // rows), c + 1) if c % k == 0)
    ids = ids.contiguous()
    shares = tuple(split.share(ids, r) for r in range(cp))
    if ids.device.type != "cpu":  # no host read in an accelerator's step: chunk-tall tiles, each masked, and the
        # varlen FlashAttention kernel skips what lies outside a tile's documents inside the tile, on the device
        return Documents(ids, shares, (0,) * (ids.shape[1] // c), c, split)
    starts = torch.searchsorted(ids, ids[:, ::piece].contiguous()).amin(0).tolist()  # (T/piece,) min over rows
    if not any(starts):
        piece, starts = c, [0] * (ids.shape[1] // c)
    return Documents(ids, shares, tuple(starts), piece, split)


@dataclass(frozen=True)
class Call:
    """What every step of one attention call needs: the cp group, the whole sequence's length, the window (the
    sequence length when there is none), the kernel backend (`lit_lm.kernels.runtime.BACKENDS`), while QK-clip
    measures the (Hkv, G) running maximum logit the forward's tiles raise, and the rows' `Documents`, if packed."""

    group: Optional[dist.ProcessGroup]
    seq_len: int
    window: int
    backend: str = "auto"
    logit_max: Optional[Tensor] = field(default=None, compare=False)
    documents: Optional[Documents] = field(default=None, compare=False)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def cp(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def split(self) -> SequenceSplit:
        """How this call's group holds the sequence: the rows' split (`Documents.split`; over a hybrid's ring, what
        each Ulysses group holds together), else zigzag."""
        split = None if self.documents is None else self.documents.split
        if split is None:
            return zigzag(self.seq_len, self.cp)
        return split.grouped(split.cp // self.cp)

    @property
    def chunk(self) -> int:
        """A chunk of the split (zigzag: c = T / (2·cp)), and the query rows of one tile."""
        return self.split.chunk

    def ids(self, rank: Optional[int] = None) -> Optional[Tensor]:
        """The document ids of rank `rank`'s tokens of this call's group (None: of the whole sequence); None
        without documents."""
        docs = self.documents
        return None if docs is None else docs.ids if rank is None else docs.share(rank, self.cp)

    def tiles(self, q_pos: Runs, k_pos: Runs) -> Iterator[tuple[slice, slice, int]]:
        """`block_plan` of this call: a chunk tall, or with documents that skip keys, a piece tall (documents that
        skip nothing, one per row, tile as none do: so the hybrid's ring, whose chunk is u pieces, gives the
        unpacked result bit for bit too)."""
        docs = self.documents
        if docs is None or not any(docs.first_key):
            return block_plan(q_pos, k_pos, self.window, self.chunk)
        return block_plan(q_pos, k_pos, self.window, docs.piece, docs.first_key)


def _tile_ids(q_ids: Optional[Tensor], k_ids: Optional[Tensor], rows: slice, keys: slice
              ) -> Optional[TileDocuments]:
    """A tile's (query ids, key ids); None without documents."""
    return None if q_ids is None or k_ids is None else (q_ids[:, rows], k_ids[:, keys])


def attend(q: Tensor, kv: Tensor, q_pos: Runs, k_pos: Runs, call: Call, out: Tensor, lse: Tensor,
           q_ids: Optional[Tensor] = None, k_ids: Optional[Tensor] = None) -> None:
    """Merge the attention of queries q at `q_pos` on kv = stack(k, v) at `k_pos` into (out, lse), tile by tile;
    `q_ids`/`k_ids` (B, ·): the queries' and keys' document ids, with packed documents."""
    for rows, keys, offset in call.tiles(q_pos, k_pos):
        ids = _tile_ids(q_ids, k_ids, rows, keys)
        block_out, block_lse = block_forward(q[..., rows, :], kv[0][..., keys, :], kv[1][..., keys, :], offset,
                                             call.window, call.backend, documents=ids)
        merge_into(out[..., rows, :], lse[..., rows], block_out, block_lse)
        if call.logit_max is not None:
            tile = tile_logit_max(q[..., rows, :], kv[0][..., keys, :], offset, call.window, same_document(ids))
            torch.maximum(call.logit_max, tile, out=call.logit_max)


def attend_backward(q: Tensor, kv: Tensor, do: Tensor, lse: Tensor, delta: Tensor, q_pos: Runs, k_pos: Runs,
                    call: Call, dq: Tensor, dkv: Tensor, q_ids: Optional[Tensor] = None,
                    k_ids: Optional[Tensor] = None) -> None:
    """Add this (queries, keys) pair's gradients to dq and dkv = stack(dk, dv), tile by tile."""
    for rows, keys, offset in call.tiles(q_pos, k_pos):
        dq_b, dk_b, dv_b = block_backward(q[..., rows, :], kv[0][..., keys, :], kv[1][..., keys, :],
                                          do[..., rows, :], lse[..., rows], delta[..., rows], offset, call.window,
                                          call.backend, documents=_tile_ids(q_ids, k_ids, rows, keys))
        dq[..., rows, :] += dq_b
        dkv[0][..., keys, :] += dk_b
        dkv[1][..., keys, :] += dv_b


# -- the ring ---------------------------------------------------------------------------------------------
def _ring_pass(t: Tensor, group: Optional[dist.ProcessGroup]) -> tuple[Tensor, list[dist.Work]]:
    """Start sending `t` to the next rank of the ring and receiving the previous rank's into a new buffer (on
    t's device), as ONE batch: posted as a lone send then a lone recv, every rank's send would wait on NCCL for
    a recv queued behind its neighbour's own send (`comm.p2p_batch`; tests/test_p2p_order.py replays it)."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    me = ranks.index(dist.get_rank())
    received = torch.empty_like(t)
    works = comm.p2p_batch([comm.P2P("send", t, ranks[(me + 1) % len(ranks)]),
                            comm.P2P("recv", received, ranks[me - 1])], group, "cp ring")
    return received, works


def _wait(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()


def ring_forward(q: Tensor, kv: Tensor, call: Call) -> tuple[Tensor, Tensor]:
    """q (B, Hkv, G, L, D), kv = stack(k, v) (2, B, Hkv, L, D) of this rank -> (out, lse) over the whole ring."""
    rank, cp = call.rank, call.cp
    q_pos = call.split.runs(rank)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
    for step in range(cp):
        if step < cp - 1:
            next_kv, works = _ring_pass(kv, call.group)
        src = (rank - step) % cp  # whose block is in hand
        attend(q, kv, q_pos, call.split.runs(src), call, out, lse, call.ids(rank), call.ids(src))
        if step < cp - 1:
            _wait(works)
            kv = next_kv
    return out, lse


def ring_backward(q: Tensor, kv: Tensor, do: Tensor, lse: Tensor, delta: Tensor, call: Call
                  ) -> tuple[Tensor, Tensor]:
    """(dq, dkv) fp32: K/V go around the ring again, each with the dK/dV accumulator of the ranks it has visited;
    the accumulator makes one extra hop to come home."""
    rank, cp = call.rank, call.cp
    q_pos = call.split.runs(rank)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    in_flight: Optional[tuple[Tensor, list[dist.Work]]] = None  # a dK/dV accumulator on its way to this rank
    for step in range(cp):
        if step < cp - 1:
            next_kv, kv_works = _ring_pass(kv, call.group)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        src = (rank - step) % cp
        attend_backward(q, kv, do, lse, delta, q_pos, call.split.runs(src), call, dq, dkv,
                        call.ids(rank), call.ids(src))
        if in_flight is not None:  # what the ranks before added to this block's gradient
            _wait(in_flight[1])
            dkv += in_flight[0]
        if cp > 1:
            in_flight = _ring_pass(dkv, call.group)
        if step < cp - 1:
            _wait(kv_works)
            kv = next_kv
    if in_flight is None:
        return dq, dkv
    _wait(in_flight[1])  # the last hop brings this rank's own block's gradient home
    return dq, in_flight[0]


# -- all-gather -------------------------------------------------------------------------------------------
def allgather_forward(q: Tensor, kv: Tensor, call: Call) -> tuple[Tensor, Tensor]:
    full = split_gather(kv, call.split, call.group, dim=-2)  # stack(k, v) of the whole sequence
    q_pos = call.split.runs(call.rank)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
    attend(q, full, q_pos, ((0, call.seq_len),), call, out, lse, call.ids(call.rank), call.ids())
    return out, lse


def allgather_backward(q: Tensor, kv: Tensor, do: Tensor, lse: Tensor, delta: Tensor, call: Call
                       ) -> tuple[Tensor, Tensor]:
    rank, cp = call.rank, call.cp
    full = split_gather(kv, call.split, call.group, dim=-2)  # stack(k, v) of the whole sequence
    q_pos = call.split.runs(rank)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv_full = torch.zeros(full.shape, dtype=torch.float32, device=q.device)
    attend_backward(q, full, do, lse, delta, q_pos, ((0, call.seq_len),), call, dq, dkv_full, call.ids(rank),
                    call.ids())
    shares = torch.cat([call.split.share(dkv_full, r, dim=-2) for r in range(cp)])  # rank r's share r-th
    dkv = torch.empty(kv.shape, dtype=torch.float32, device=kv.device)
    comm.reduce_scatter(dkv, shares, call.group)
    return dq, dkv


# -- Ulysses: sequence-sharded to head-sharded and back, by all-to-all ---------------------------------------
def ulysses_kv_copies(q_heads: int, kv_heads: int, cp: int) -> int:
    """How many copies of each kv head the exchange sends (1, or cp / Hkv when fewer kv heads than ranks: a rank's
    Hq/cp query heads then share one kv head, each rank gets a copy, and autograd sums the copies' gradients).
    Refuses heads the cp ranks cannot share out."""
    if q_heads % cp or (kv_heads % cp and cp % kv_heads):
        raise ConfigError(f"cp_method ulysses splits attention heads over the {cp} cp ranks: this rank's {q_heads} "
                          f"query and {kv_heads} kv heads (after tp) do not divide by {cp} (nor kv heads divide {cp})"
                          "; use ring or allgather, or another cp/tp")
    return max(1, cp // kv_heads)


class HeadExchange(torch.autograd.Function):
    """One all-to-all over the cp group of x (cp, ...): part r goes to rank r, and part r of the result came from
    rank r. Its gradient is the same exchange of the gradient (part r of the result's gradient goes back to r)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
        ctx.group = group
        x = x.contiguous()  # (empty_like of a strided view keeps its strides; the collective writes densely)
        out = torch.empty_like(x)
        comm.all_to_all(out, x, group, label="cp ulysses")
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        return HeadExchange.apply(grad, ctx.group), None


def sequence_to_heads(q: Tensor, k: Tensor, v: Tensor, group: Optional[dist.ProcessGroup],
                      split: Optional[SequenceSplit] = None) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's share of q (B, Hq, L, D), k/v (B, Hkv, L, D) -> the whole sequence (T = L·cp, in order)
    of its heads: query heads [r·Hq/cp, (r+1)·Hq/cp) and their kv heads. One all-to-all for q, k and v together:
    head group r of every rank's share goes to rank r, which puts the shares back in sequence order (`split`: how
    the group's ranks hold the sequence; None: zigzag)."""
    cp = dist.get_world_size(group)
    copies = ulysses_kv_copies(q.shape[1], k.shape[1], cp)
    if copies > 1:
        k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
    b, _, length, d = q.shape
    parts = torch.cat([t.view(b, cp, t.shape[1] // cp, length, d) for t in (q, k, v)], dim=2).transpose(0, 1)
    received = HeadExchange.apply(parts, group)  # (cp, B, Hq/cp + 2·Hkv'/cp, L, D): rank r's share r-th
    hq, hk = q.shape[1] // cp, k.shape[1] // cp
    # each merged on its own (a tensor of its own: the attention saves q alone, not a view holding k and v too)
    split = split or zigzag(length * cp, cp)
    return tuple(split.merge(received[:, :, heads], dim=-2)  # type: ignore[return-value]
                 for heads in (slice(0, hq), slice(hq, hq + hk), slice(hq + hk, None)))


def heads_to_sequence(out: Tensor, group: Optional[dist.ProcessGroup], split: Optional[SequenceSplit] = None
                      ) -> Tensor:
    """The inverse for the output: (B, Hq/cp, T, D) of this rank's heads -> (B, Hq, L, D), its share (`split`;
    None: zigzag) of every head (rank r's sequence share to rank r; what comes back from rank r is head group r)."""
    cp = dist.get_world_size(group)
    split = split or zigzag(out.shape[-2], cp)
    shares = torch.stack([split.share(out, r, dim=-2) for r in range(cp)])  # (cp, B, Hq/cp, L, D)
    heads = HeadExchange.apply(shares, group).transpose(0, 1)  # (B, cp, Hq/cp, L, D), head group r from rank r
    return heads.reshape(heads.shape[0], -1, *heads.shape[3:])


def ulysses_forward(q: Tensor, kv: Tensor, call: Call) -> tuple[Tensor, Tensor]:
    """After the exchange: the whole sequence of this rank's heads, attended locally (tiles as the other methods,
    chunks of c = T/(2·cp) query rows; with documents, skipping what no row's document sees)."""
    whole = ((0, call.seq_len),)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
    attend(q, kv, whole, whole, call, out, lse, call.ids(), call.ids())
    return out, lse


def ulysses_backward(q: Tensor, kv: Tensor, do: Tensor, lse: Tensor, delta: Tensor, call: Call
                     ) -> tuple[Tensor, Tensor]:
    whole = ((0, call.seq_len),)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    attend_backward(q, kv, do, lse, delta, whole, whole, call, dq, dkv, call.ids(), call.ids())
    return dq, dkv


# -- the hybrid: Ulysses inside, ring across ----------------------------------------------------------------------
@dataclass(frozen=True)
class HybridGroups:
    """`ulysses+ring`'s 2-D cp group, cp = u x r. Cp rank j·u + i (group order) is Ulysses rank i of ring rank j:
    `ulysses` holds the u consecutive cp ranks of ring rank j (the inner, fast links: tp, then cp, are the
    layout's innermost dimensions), `ring` the r ranks with the same Ulysses rank i.

        cp = 4, u = 2 (2 x 2):   ulysses {0, 1} {2, 3}    ring {0, 2} {1, 3}"""

    ulysses: Optional[dist.ProcessGroup]
    ring: Optional[dist.ProcessGroup]


def hybrid_grid(cp_groups: list[list[int]], ulysses: int) -> tuple[list[list[int]], list[list[int]]]:
    """(Ulysses groups, ring groups) of every cp group (lists of global ranks, in cp-rank order)."""
    inner = [g[j:j + ulysses] for g in cp_groups for j in range(0, len(g), ulysses)]
    outer = [g[i::ulysses] for g in cp_groups for i in range(ulysses)]
    return inner, outer


_HYBRID: dict[tuple, HybridGroups] = {}


def hybrid_groups(cp_groups: list[list[int]], ulysses: int, timeout: Optional[timedelta] = None) -> HybridGroups:
    """This rank's `HybridGroups`, made once per process like every layout group: `new_group` is collective over
    the world, so every rank makes those of every cp group (`cp_groups`: the layout's grid["cp"]), each with the
    strategy's `timeout`; named for the accounting layer "cp_ulysses" and "cp_ring"."""
    key = (id(dist.group.WORLD), tuple(map(tuple, cp_groups)), ulysses, timeout)
    if key not in _HYBRID:
        made = []
        for name, grid in zip(("cp_ulysses", "cp_ring"), hybrid_grid(cp_groups, ulysses)):
            mine, _ = dist.new_subgroups_by_enumeration(grid, timeout=timeout)
            comm.name_group(mine, name)
            made.append(mine)
        _HYBRID[key] = HybridGroups(*made)
    return _HYBRID[key]


def _heads_allow(u: int, q_heads: int, kv_heads: int) -> bool:
    """Whether u Ulysses ranks can share out these heads (`ulysses_kv_copies`: query heads split, kv heads split or
    copied)."""
    return not q_heads % u and (not kv_heads % u or not u % kv_heads)


def ulysses_size_for(cp: int, heads: set[tuple[int, int]], ulysses_size: Optional[int] = None) -> int:
    """The hybrid's u for the attention cores' (query, kv) heads on a rank (after tp): `ulysses_size` checked, or by
    default the largest divisor of cp that every core's heads allow (u = cp is Ulysses alone, u = 1 the ring
    alone). Refuses in one line a u that does not divide cp or that the heads cannot be shared out over."""
    divisors = [u for u in range(1, cp + 1) if cp % u == 0]
    if ulysses_size is None:
        return max(u for u in divisors if all(_heads_allow(u, hq, hk) for hq, hk in heads))
    if ulysses_size not in divisors or not isinstance(ulysses_size, int):
        raise ConfigError(f"ulysses_size={ulysses_size!r} must divide context_parallel_size={cp} (cp = ulysses_size "
                          f"x ring ranks): choose one of {', '.join(map(str, divisors))}")
    bad = sorted((hq, hk) for hq, hk in heads if not _heads_allow(ulysses_size, hq, hk))
    if bad:
        raise ConfigError(f"cp_method {HYBRID}: ulysses_size={ulysses_size} cannot share out a rank's {bad[0][0]} "
                          f"query and {bad[0][1]} kv heads (after tp); use a u dividing the query heads")
    return ulysses_size


def model_ulysses_size(root: nn.Module, cp: int, tp: int = 1, ulysses_size: Optional[int] = None) -> int:
    """`ulysses_size_for` a model's attention cores (`ContextParallel.heads`, split by tp first); a plan that names
    no heads needs ulysses_size."""
    model = next((m for m in root.modules() if isinstance(m, ContextParallelModel)), None)
    heads = {spec.heads for spec in model.context_parallel_plan().values()} if model is not None else {()}
    if () in heads:
        if ulysses_size is None:
            raise ConfigError(f"cp_method {HYBRID}: the model's plan names no attention heads: set ulysses_size")
        return ulysses_size_for(cp, set(), ulysses_size)
    return ulysses_size_for(cp, {(hq // tp, max(1, hk // tp)) for hq, hk in heads}, ulysses_size)


_FORWARD = {"ring": ring_forward, "allgather": allgather_forward, "ulysses": ulysses_forward}
_BACKWARD = {"ring": ring_backward, "allgather": allgather_backward, "ulysses": ulysses_backward}


class ContextAttentionFunction(torch.autograd.Function):
    """Causal attention of q, k, v by one method's forward and backward (`_FORWARD`, `_BACKWARD`): ring and allgather
    take this rank's zigzag share and attend over the whole sequence held by the cp group; ulysses' take the whole
    sequence of this rank's heads. Saves only what it was given (q, k, v, out, lse): 1/cp of the whole."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor], method: str, call: Call
                ) -> Tensor:
        b, hq, length, d = q.shape
        q5 = q.reshape(b, k.shape[1], hq // k.shape[1], length, d)
        kv = torch.stack((k, v))
        out, lse = _FORWARD[method](q5, kv, call)
        if sinks is not None:  # once, on the merged rows (`join_sink`)
            out, lse = join_sink(out, lse, sinks.float().view(k.shape[1], -1))
        out = out.to(q.dtype)
        ctx.save_for_backward(q5, kv, out, lse, sinks)
        ctx.method, ctx.call = method, call
        return out.view(b, hq, length, d)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        q5, kv, out, lse, sinks = ctx.saved_tensors
        do = grad.reshape(q5.shape)
        delta = (do.float() * out.float()).sum(-1)
        dq, dkv = _BACKWARD[ctx.method](q5, kv, do, lse, delta, ctx.call)
        b, hk, g, length, d = q5.shape
        dsinks = None if sinks is None else \
            sink_grad(lse, delta, sinks.float().view(hk, g)).view(-1).to(sinks.dtype)
        return (dq.to(q5.dtype).view(b, hk * g, length, d), dkv[0].to(kv.dtype), dkv[1].to(kv.dtype), dsinks,
                None, None)


def context_attention(q: Tensor, k: Tensor, v: Tensor, group: Optional[dist.ProcessGroup] = None,
                      method: str = "ring", window: Optional[int] = None, backend: str = "auto",
                      logit_max: Optional[Tensor] = None, documents: Optional[Documents] = None,
                      sinks: Optional[Tensor] = None, hybrid: Optional[HybridGroups] = None) -> Tensor:
    """q (B, Hq, L, D), k/v (B, Hkv, L, D): this rank's zigzag share (L = 2c tokens) -> its share of the output of
    causal attention over the whole sequence of L·cp tokens (`group`: the cp group; `hybrid`: its u x r grid, for
    ulysses+ring); `window` as `CausalAttention.sliding_window`;
    `backend` picks the tile kernel as in `kernels.apply`; `logit_max` (Hq,), if given, is raised to the maximum
    logit of this rank's queries over the whole sequence's keys (ulysses: of its heads over the whole sequence, the
    other heads left alone); `documents` (`row_documents`): attention within each document only; `sinks` (Hq,):
    each head's attention sink, joined once to its merged rows (`join_sink`; ulysses: this rank's head group's)."""
    if method not in METHODS:
        raise ValueError(f"unknown cp_method {method!r}: choose one of {', '.join(METHODS)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"kv heads ({k.shape[1]}) must divide query heads ({q.shape[1]})")
    cp = dist.get_world_size(group)
    seq_len = q.shape[2] * cp
    check_seq_len(seq_len, cp)
    exchange, attend_over, core = group, group, method  # the heads' all-to-all's group; the attention's
    if method == HYBRID:  # Ulysses over the inner ranks, then the ring over the outer ones on what they hold
        if hybrid is None or dist.get_world_size(hybrid.ulysses) * dist.get_world_size(hybrid.ring) != cp:
            raise ValueError(f"cp_method {HYBRID} needs the cp group's HybridGroups (u x r = cp = {cp})")
        exchange, attend_over, core = hybrid.ulysses, hybrid.ring, "ring"
    if method in ("ulysses", HYBRID):  # the split over the exchange's ranks: what its group holds, among them
        u = dist.get_world_size(exchange)
        held = None if documents is None or documents.split is None else \
            documents.split.within(u, dist.get_rank(group) // u)
        q, k, v = sequence_to_heads(q, k, v, exchange, held)
        n, rank = q.shape[1], dist.get_rank(exchange)  # this rank's head group, views (tiles raise logit_max in place)
        logit_max = None if logit_max is None else logit_max[rank * n:(rank + 1) * n]
        sinks = None if sinks is None else sinks[rank * n:(rank + 1) * n]
    heads = None if logit_max is None else logit_max.view(k.shape[1], -1)
    call = Call(attend_over, seq_len, window or seq_len, check_backend(backend), heads, documents)
    out = ContextAttentionFunction.apply(q, k, v, sinks, core, call)
    return heads_to_sequence(out, exchange, held) if method in ("ulysses", HYBRID) else out


class ContextParallelAttention(LogitMaxRecord, nn.Module):
    """Drop-in for a causal attention core `forward(q, k, v, documents=None)`, attending over the cp group
    (`documents`: the rows' `Documents`, from `context_loss`); its one possible parameter is the core's `sinks`
    (Hq,) it replaces (attention sinks, taken over under the same name); measures QK-clip's maximum as the other
    cores do (`LogitMaxRecord`), its queries on every rank's keys (ulysses: its heads; the max over cp fills the
    rest). `ulysses+ring` attends over `hybrid`, the groups the strategy made at setup (`hybrid_groups`)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, method: str = "ring",
                 sliding_window: Optional[int] = None, backend: str = "auto",
                 sinks: Optional[nn.Parameter] = None, hybrid: Optional[HybridGroups] = None) -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"unknown cp_method {method!r}: choose one of {', '.join(METHODS)}")
        if method == HYBRID and hybrid is None:
            raise ValueError(f"cp_method {HYBRID} attends over a u x r grid: give its `hybrid_groups`")
        self.group, self.method, self.sliding_window, self.hybrid = group, method, sliding_window, hybrid
        self.backend = check_backend(backend)
        self.register_parameter("sinks", sinks)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, documents: Optional[Documents] = None) -> Tensor:
        heads = torch.full((q.shape[1],), float("-inf"), device=q.device) if self.measuring else None
        out = context_attention(q, k, v, self.group, self.method, self.sliding_window, self.backend, heads, documents,
                                self.sinks, self.hybrid)
        if heads is not None:
            self.record_logit_max(heads)
        return out


def parallelize_context(root: nn.Module, group: Optional[dist.ProcessGroup] = None, method: str = "ring",
                        backend: str = "auto", hybrid: Optional[HybridGroups] = None) -> int:
    """Swap, in place, every attention core the model names in `context_parallel_plan()` for a
    `ContextParallelAttention` over `group` (and `hybrid`, for ulysses+ring); returns how many. The caller feeds each
    rank `zigzag_batch` data. ulysses+ring over the world (`group` None) without `hybrid` makes its groups here (u:
    the most the heads allow), a collective every rank runs at setup."""
    model = next((m for m in root.modules() if isinstance(m, ContextParallelModel)), None)
    if model is None:
        raise TypeError(f"{type(root).__name__} has no context_parallel_plan(): it cannot be context-parallel")
    if method == HYBRID and hybrid is None and group is None:
        world = dist.get_world_size()
        hybrid = hybrid_groups([list(range(world))], model_ulysses_size(model, world))
    plan = model.context_parallel_plan()
    for name, spec in plan.items():
        parent, _, child = name.rpartition(".")
        sinks = model.get_submodule(name).sinks if spec.sinks else None  # the same Parameter, under the same name
        core = ContextParallelAttention(group, method, spec.sliding_window, backend, sinks, hybrid)
        setattr(model.get_submodule(parent), child, core)
    return len(plan)


def check_data_seq_len(module: nn.Module, cp: int) -> None:
    """The LightningModule's data's sequence length against the zigzag split, refused at setup, not at step 1."""
    seq_len = getattr(getattr(getattr(module, "_trainer", None), "datamodule", None), "seq_len", None)
    if isinstance(seq_len, int) and seq_len % (2 * cp):
        raise ConfigError(f"context_parallel_size={cp} splits each sequence into 2·cp={2 * cp} zigzag chunks, but "
                          f"seq_len is {seq_len} (data.init_args.seq_len); use a multiple of {2 * cp}, or another cp")


def rope_positions(reset: Optional[Tensor], held: Tensor, split: SequenceSplit, rank: int) -> Tensor:
    """A cp rank's RoPE positions: the sequence positions it holds (`held`, (L,)), or with `position_reset` the rows'
    (B, T) `reset` positions (each token's offset in its document, made from the whole row's ids, which every cp
    rank was given) cut like the tokens: (B, L), on their device, no host read (the model makes their tables on
    the device: `lit_lm.model.RotaryEmbedding.row_tables`)."""
    return held if reset is None else split.share(reset, rank)


def context_loss(model: nn.Module, group: Optional[dist.ProcessGroup] = None,
                 balancer: Optional[DocumentBalancer] = None) -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """The step's loss under context parallelism: `model.loss(inputs, targets)` of the whole (B, T) sequences run on
    this cp rank's zigzag share (with its positions, for RoPE). Autograd sees this rank's loss times the share of
    valid targets it holds (`zigzag_batch`; none: exactly 0), whose gradients the dp x cp mean makes the whole
    batch's; the VALUE returned, and the cross-entropy, are the cp group's mean, so what the step logs is the whole
    sequences' loss.
    Packed rows' `documents` (B, T) go to the attention cores as `Documents` (`row_documents`: made once per step,
    shared by every layer and recomputation). With a `balancer` (cp_balance documents) the split is the one it
    planned on the host for this batch (`lit_lm.strategies.cp_balance`), and everything is cut by it."""
    cp = dist.get_world_size(group)

    def loss_fn(inputs: Tensor, targets: Tensor, positions: Optional[Tensor] = None,
                documents: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        split = zigzag(inputs.shape[1], cp) if balancer is None or documents is None else balancer.take(documents)
        share, share_targets, sequence_positions, weight = split_batch(inputs, targets, split, group)
        positions = rope_positions(positions, sequence_positions, split, dist.get_rank(group))
        rows = None if documents is None else row_documents(documents, cp, split=split)
        loss, ce = model.loss(share, share_targets, positions) if rows is None else \
            model.loss(share, share_targets, positions, documents=rows)
        # a share without a target: exactly 0, not NaN x 0 (its gradient stays 0: the mean's backward scatters into
        # targets only, and it has none); its tokens still reach the other shares' targets through attention
        loss, ce = (torch.where(weight > 0, x * weight, torch.zeros_like(x)) for x in (loss, ce))
        mean = torch.stack((loss.detach(), ce.detach()))
        comm.all_reduce(mean, group, label="cp loss")
        mean /= cp
        return loss + (mean[0] - loss.detach()), mean[1]

    return loss_fn


# -- communication theory (per rank, per attention call), for tests and benchmarks -----------------------------
def comm_theory(method: str, cp: int, kv_numel: int, element_size: int, q_numel: int = 0, kv_copies: int = 1,
                ulysses: int = 1) -> dict[str, float]:
    """Wire bytes one rank sends for one attention call (as `comm.CommRecord.wire_bytes` counts them), for its share
    of stack(k, v) of `kv_numel` elements (and of q, `q_numel`). Ring and allgather move (cp−1) shares of K/V
    forward and again backward; the dK/dV (fp32) make cp hops around the ring, (cp−1)/cp of cp shares in the
    reduce-scatter. Ulysses sends (cp−1)/cp of its q, k, v (k, v times `kv_copies`) and of its output, forward,
    and the same of their gradients backward (in the model's dtype). The hybrid (`ulysses` = u ranks inside, r =
    cp/u across) is Ulysses over u, then the ring over r on what the exchange left a rank: its heads' K/V of u
    shares, kv_copies · kv_numel elements. Documents add nothing: every rank has the rows' ids."""
    if method not in METHODS:
        raise ValueError(f"unknown cp_method {method!r}: choose one of {', '.join(METHODS)}")
    if method == HYBRID:
        inner = comm_theory("ulysses", ulysses, kv_numel, element_size, q_numel, kv_copies)
        outer = comm_theory("ring", cp // ulysses, kv_copies * kv_numel, element_size)
        return {way: inner[way] + outer[way] for way in inner}
    if method == "ulysses":
        exchanged = (cp - 1) / cp * (2 * q_numel + kv_copies * kv_numel) * element_size
        return {"forward": float(exchanged), "backward": float(exchanged)}
    kv = (cp - 1) * kv_numel * element_size
    dkv_hops = cp if method == "ring" and cp > 1 else cp - 1
    return {"forward": float(kv), "backward": float(kv + dkv_hops * kv_numel * 4)}


def saved_bytes_theory(batch: int, q_heads: int, kv_heads: int, head_dim: int, local_len: int,
                       element_size: int) -> int:
    """Bytes `ContextAttentionFunction` saves for backward on one rank: its own q, k, v and output (the model
    dtype) and the fp32 log-sum-exp per query row; 1/cp of the whole sequence's, whatever the method."""
    return batch * local_len * ((2 * q_heads + 2 * kv_heads) * head_dim * element_size + q_heads * 4)
