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
with fixed seeds into rows that start inside a document (as `scripts/bench_document_mask.py` packs rows). A fixed
length would hide the imbalance below: equal documents aligned with the chunks give every chunk the same work.

Under context parallelism the step waits for the busiest rank. Its work is counted by the strategy's own split
(`lit_lm.strategies.cp_balance.attention_work`: the zigzag split, or `cp_balance: documents`' document-aware one)
over a micro-batch's rows: `imbalance` is the busiest rank's visible pairs over the mean rank's, and the busiest
rank's attention FLOPs are the mean's times that. Ulysses attends the whole sequence on every rank (a head share
each): no imbalance.
"""

from __future__ import annotations

import functools
import random

import torch
from torch import Tensor

from lit_lm.strategies.cp_balance import attention_work, visible_keys

ROWS = 8  # rows drawn at most: a rank's work is summed over the rows of its micro-batch


@functools.lru_cache(maxsize=64)
def document_ids(seq_len: int, mean: int, seed: int = 0) -> Tensor:
    """(1, T) document ids of one row packed with documents of exponentially distributed lengths (`mean` tokens on
    average, at least 1), seeded by `seed`, starting inside its first document. (Cached: do not modify it.)"""
    rng = random.Random(seed)
    starts = torch.zeros(seq_len, dtype=torch.long)
    at = -rng.randrange(max(1, mean))  # the row starts inside its first document
    while True:
        at += 1 + int(rng.expovariate(1 / mean))
        if at >= seq_len:
            break
        if at > 0:
            starts[at] = 1
    return starts.cumsum(0)[None]


def _rows(seq_len: int, mean: int, rows: int) -> Tensor:
    return torch.cat([document_ids(seq_len, mean, seed) for seed in range(max(1, min(rows, ROWS)))])


@functools.lru_cache(maxsize=256)
def allowed_share(seq_len: int, mean: int) -> float:
    """The share of causal (query, key) pairs the document mask leaves, allowed / (T (T + 1) / 2), over `ROWS` rows."""
    return float(visible_keys(_rows(seq_len, mean, ROWS)).sum()) / (ROWS * seq_len * (seq_len + 1) / 2)


@functools.lru_cache(maxsize=256)
def imbalance(seq_len: int, cp: int, mean: int, rows: int = 1, method: str = "ring", balance: str = "zigzag"
              ) -> float:
    """The busiest cp rank's attention work over the mean rank's, with documents of `mean` tokens, for a micro-batch
    of `rows` rows (at most `ROWS` drawn), under the `balance` split (`lit_lm.strategies.cp_balance`); 1 under
    Ulysses (every rank attends the whole sequence of its heads)."""
    if cp == 1 or method == "ulysses":
        return 1.0
    return attention_work(_rows(seq_len, mean, rows), cp, balance).imbalance
