"""Attention work with packed documents (`data.init_args.document_mask`), for the planner: how much of the causal
attention the mask leaves, and how unevenly the context-parallel split shares it out.

With document masking a token attends only to the earlier tokens of its own document, so a row of T tokens packed
with documents of n_1, n_2, ... tokens holds

    allowed = sum_i n_i (n_i + 1) / 2      (query, key) pairs, against T (T + 1) / 2 causal ones.

The planner counts attention FLOPs as PaLM does (`estimate.flops_per_token`: 12 L d T per token, the causal half not
discounted); with documents that term is scaled by allowed / causal, the share of pairs the mask leaves, which is
what a varlen FlashAttention kernel (and cp's skipped tiles, docs/cp.md) computes, up to its tile granularity.

The document lengths are an assumption, stated where the planner prints it: exponentially distributed with a given
mean (`lit-lm plan --document-length`, or the prepared sources' own mean, tokens / documents of their index), drawn
with a fixed seed into one row that starts inside a document (as `scripts/bench_document_mask.py` packs rows). A
fixed length would hide the imbalance below: equal documents aligned with the chunks give every chunk the same work.

Under context parallelism the step waits for the busiest rank. The zigzag split (`lit_lm.strategies.cp`) gives
every rank the same causal work, not the same document work: rank r holds chunks r and 2 cp - 1 - r, and its pairs
are the sum over its tokens of (position - first position of the token's document + 1). `imbalance` is the busiest
rank's pairs over the mean; the busiest rank's attention FLOPs are the mean's times that. Ulysses attends the whole
sequence on every rank (a head share each): no imbalance.
"""

from __future__ import annotations

import functools
import random

import torch

SEED = 0


ROWS = 8  # rows drawn at most: a rank's work is summed over the rows of its micro-batch


@functools.lru_cache(maxsize=64)
def pairs_per_token(seq_len: int, mean: int, seed: int = 0) -> torch.Tensor:
    """(T,) the keys each token of one row attends to (its position less its document's first, plus one), the row
    packed with documents of exponentially distributed lengths (`mean` tokens on average, at least 1), seeded by
    `seed`, starting inside its first document. (Cached: do not modify it.)"""
    rng = random.Random(seed)
    starts = torch.zeros(seq_len, dtype=torch.long)
    at = -rng.randrange(max(1, mean))  # the row starts inside its first document
    while True:
        at += 1 + int(rng.expovariate(1 / mean))
        if at >= seq_len:
            break
        if at > 0:
            starts[at] = at
    return torch.arange(seq_len) - starts.cummax(0).values + 1


@functools.lru_cache(maxsize=256)
def allowed_share(seq_len: int, mean: int) -> float:
    """The share of causal (query, key) pairs the document mask leaves, allowed / (T (T + 1) / 2), over `ROWS` rows."""
    allowed = sum(float(pairs_per_token(seq_len, mean, seed).sum()) for seed in range(ROWS))
    return allowed / (ROWS * seq_len * (seq_len + 1) / 2)


def zigzag_rank_pairs(seq_len: int, cp: int, mean: int, rows: int = 1) -> list[int]:
    """The allowed pairs each cp rank's queries hold under the zigzag split (chunks r and 2 cp - 1 - r), summed over
    `rows` rows (a micro-batch: each rank holds its chunks of every row)."""
    c = seq_len // (2 * cp)
    chunks = sum(pairs_per_token(seq_len, mean, seed)[: 2 * cp * c].view(2 * cp, c).sum(-1) for seed in range(rows))
    return [int(chunks[r] + chunks[2 * cp - 1 - r]) for r in range(cp)]


@functools.lru_cache(maxsize=256)
def imbalance(seq_len: int, cp: int, mean: int, rows: int = 1, method: str = "ring") -> float:
    """The busiest cp rank's attention work over the mean rank's, with documents of `mean` tokens, for a micro-batch
    of `rows` rows (at most `ROWS` drawn): the zigzag split's for ring and all-gather, 1 for Ulysses (every rank
    attends the whole sequence of its heads)."""
    if cp == 1 or method == "ulysses":
        return 1.0
    pairs = zigzag_rank_pairs(seq_len, cp, mean, max(1, min(rows, ROWS)))
    return max(pairs) * cp / sum(pairs)
