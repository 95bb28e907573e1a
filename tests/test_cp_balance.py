"""The document balance of context parallelism's split (lit_lm/strategies/cp_balance.py): the split's cuts, the
imbalance bound on a fixed synthetic length distribution, the attention of every method under a balanced split
against one process, and through the composed strategy (cp_balance documents) parity with one process, with the
assignment not applied to one rank's targets or positions reported."""

from __future__ import annotations

import random
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lit_lm.config import ConfigError
from lit_lm.model import RotaryEmbedding, document_mask
from lit_lm.parity import Case, assert_parity, case_tokens, run_parity, unreported_mutants
from lit_lm.spawn import run_distributed
from lit_lm.strategies import cp as context
from lit_lm.strategies.composed import ComposedStrategy
from lit_lm.strategies.cp import METHODS, ContextParallelAttention, row_documents, split_gather
from lit_lm.strategies.cp_balance import (DocumentBalancer, SequenceSplit, attention_work, balance_documents,
                                          chunk_pairs, imbalance, plan_split, zigzag)
from lit_lm.strategies.layout import ParallelConfig

REFERENCE_TILES = {"TRITON_INTERPRET": "0"}


def packed(lengths: list[int], seq_len: int, start: int = 0) -> Tensor:
    """(T,) document ids of a row cut from documents of these lengths laid end to end, from offset `start`."""
    ends = torch.tensor(lengths).cumsum(0) - start
    return torch.searchsorted(ends, torch.arange(seq_len), right=True)


def synthetic_rows(seq_len: int, rows: int, seed: int = 0) -> Tensor:
    """(rows, T): a fixed heavy-tailed length distribution (log-normal, median 300 tokens, a few documents longer
    than a row), as source files are."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        lengths = [1 + int(rng.lognormvariate(5.7, 1.5)) for _ in range(4 * seq_len // 300 + 8)]
        out.append(packed(lengths, seq_len, rng.randrange(lengths[0])))
    return torch.stack(out)


# -- the split --------------------------------------------------------------------------------------------------
def test_a_split_cuts_and_merges_back_and_groups_as_the_hybrid_needs() -> None:
    """share/merge round trip; zigzag is chunks (i, 2cp−1−i); grouped(u) of zigzag is zigzag over cp/u (the hybrid's
    ring level), and within(u, j) is how group j's ranks share what it holds."""
    x = torch.arange(2 * 32).view(2, 32)
    split = SequenceSplit(32, 2, ((0, 5, 9, 15), (1, 4, 10, 14), (2, 7, 8, 13), (3, 6, 11, 12)))
    for s in (split, zigzag(32, 4)):
        assert torch.equal(s.merge(torch.stack([s.share(x, r) for r in range(4)]), dim=1), x)
        assert sorted(p for r in range(4) for p in s.positions(r).tolist()) == list(range(32))
    assert zigzag(32, 4).chunks == ((0, 7), (1, 6), (2, 5), (3, 4)) and zigzag(32, 4).runs(3) == ((12, 8),)
    assert zigzag(32, 4).grouped(2) == zigzag(32, 2) and zigzag(32, 4).within(2, 1) == zigzag(16, 2)
    grouped = split.grouped(2)
    for j in range(2):  # group j's tokens, shared among its 2 ranks by within(2, j), are ranks 2j, 2j+1's shares
        inner = split.within(2, j)
        held = grouped.share(x, j)
        for i in range(2):
            assert torch.equal(inner.share(held, i), split.share(x, 2 * j + i))


def test_the_work_counts_visible_pairs() -> None:
    """Per chunk, Σ min(t − start(t) + 1, window) over its queries and the rows: brute force on a small row."""
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 2]])
    brute = [sum(int(ids[b, q] == ids[b, k]) for b in range(2) for q in range(c, c + 2) for k in range(q + 1)
                 if q - k < 3) for c in range(0, 8, 2)]
    assert chunk_pairs(ids, 2, (3,)) == brute
    assert chunk_pairs(ids, 2, (3, None)) == [a + b for a, b in zip(brute, chunk_pairs(ids, 2))]


def test_the_balance_holds_every_rank_within_ten_percent_where_zigzag_does_not() -> None:
    """A fixed synthetic distribution (log-normal lengths), rows of 8192 and 16384 tokens, one and two per batch:
    at cp 2, 4 and 8 the zigzag split's busiest rank is up to ~1.3x the mean, the document balance's within 10%
    (with and without a sliding window); each rank holds T/cp tokens, every position once."""
    worst_zigzag = 0.0
    for seq_len, rows, seed in ((8192, 1, 0), (8192, 2, 1), (16384, 1, 2)):
        ids = synthetic_rows(seq_len, rows, seed)
        for cp in (2, 4, 8):
            for windows in ((None,), (None, 1024)):
                before = attention_work(ids, cp, "zigzag", windows)
                after = attention_work(ids, cp, "documents", windows)
                worst_zigzag = max(worst_zigzag, before.imbalance)
                assert after.imbalance <= 1.10, (seq_len, rows, cp, windows, after.pairs)
                assert sum(after.pairs) == sum(before.pairs)  # the same work, moved
                assert all(len(after.split.positions(r)) == seq_len // cp for r in range(cp))
    assert worst_zigzag > 1.2  # the distribution is one the zigzag split does not balance


def test_a_single_document_keeps_the_zigzag_split_and_device_ids_are_refused() -> None:
    """Rows of one document: zigzag already balances them, so the balance keeps it (today's result bit for bit).
    Ids on a device are never read (meta stands for one): refused in one line."""
    assert balance_documents(torch.zeros(2, 64, dtype=torch.long), 4) is zigzag(64, 4)
    with pytest.raises(ValueError, match="on the host"):
        plan_split(torch.zeros(1, 16, dtype=torch.long, device="meta"), 2)
    assert imbalance([1, 1, 4]) == 2.0 and attention_work(torch.zeros(1, 16, dtype=torch.long), 2).flops(2, 4) == \
        (4 * 2 * 4 * 3.5 * 68,) * 2


def test_rope_tables_of_device_positions_are_built_on_the_device() -> None:
    """A balanced split hands the model new positions every step: RoPE builds their tables where they are, never
    reading a device tensor to the host (meta stands for a device: it has no values to read); on the CPU the same
    tables as before, bit for bit (`tables` was fp64 on the host)."""
    rope = RotaryEmbedding(8)
    cos, sin = rope.cos_sin_at(torch.arange(4, device="meta"), torch.device("meta"))
    assert cos.device.type == "meta" and cos.shape == (4, 4)
    positions = zigzag(16, 2).positions(1)
    angles = torch.outer(positions.to(torch.float64), rope.inv_freq)
    assert torch.equal(rope.cos_sin_at(positions, torch.device("cpu"))[0], angles.cos().float())


def test_the_balancer_takes_each_planned_split_once() -> None:
    balancer = DocumentBalancer(2)
    ids = synthetic_rows(64, 1)
    balancer.plan(ids)
    assert balancer.take(ids) == balance_documents(ids, 2)
    with pytest.raises(RuntimeError, match="no split planned on the host"):
        balancer.take(ids)


def test_cp_balance_is_a_context_parallel_option_named_in_one_line() -> None:
    assert ParallelConfig.from_args(context_parallel_size=2, cp_balance="documents").cp_balance == "documents"
    with pytest.raises(ConfigError, match="cp_balance is a context-parallel option"):
        ParallelConfig.from_args(cp_balance="documents")
    with pytest.raises(ConfigError, match="cp_balance: unknown 'tokens'; choose one of zigzag, documents"):
        ParallelConfig.from_args(context_parallel_size=2, cp_balance="tokens")


# -- attention under a balanced split -----------------------------------------------------------------------------
def _attention_worker(seq_len: int) -> dict[str, list[float]]:
    """Every method (the hybrid where it has groups): max |error| of out, dq, dk, dv under the balanced split of
    rows of short and long documents, against one process with the same mask."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    ids = torch.stack([packed([3, 1, 9, 2, 30], seq_len), packed([1, 1, 12, 4, 40], seq_len, 2)])
    split = balance_documents(ids, cp)
    assert split != zigzag(seq_len, cp)
    out = {}
    for method in METHODS:
        hybrid = {"hybrid": context.hybrid_groups([list(range(cp))], 2)} if method == "ulysses+ring" else {}
        gen = torch.Generator().manual_seed(0)
        q, k, v, grad = (torch.randn(2, h, seq_len, 8, generator=gen) for h in (4, 2, 2, 4))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        mask = document_mask(ids, None)
        F.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True).backward(grad)
        local = [split.share(t, rank, dim=2).requires_grad_() for t in (q, k, v)]
        core = ContextParallelAttention(None, method, None, "reference", **hybrid)
        y = core(*local, documents=row_documents(ids, cp, split=split))
        y.backward(split.share(grad, rank, dim=2))
        whole = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        errors = [(split_gather(y.detach(), split, dim=2) - whole).abs().max()]
        errors += [(split_gather(t.grad, split, dim=2) - leaf.grad).abs().max() for t, leaf in zip(local, leaves)]
        out[method] = [float(e) for e in errors]
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_every_method_attends_under_a_balanced_split(cp: int) -> None:
    for rank in run_distributed(_attention_worker, cp, 32, env=REFERENCE_TILES):
        for method, errors in rank.items():
            assert max(errors) < 1e-5, (method, errors)


# -- through the composed strategy --------------------------------------------------------------------------------
PACKED = (1, False)  # the harness's EOS id (every token drawn as a multiple of 5), RoPE positions not reset
RESET = (1, True)  # and RoPE positions reset at each document (data.init_args.position_reset)


def _case(label: str, cp: int = 2, packing: tuple = PACKED, **strategy: Any) -> Case:
    reset = ", positions reset" if packing[1] else ""
    return Case(partial(ComposedStrategy, context_parallel_size=cp, cp_balance="documents", **strategy),
                packing=packing, label=f"{label}, documents balanced{reset}")


def shares_of_rank_1_by_zigzag(what: str, patch: pytest.MonkeyPatch) -> None:
    """Mutant: rank 1's `what` ("targets" or "positions") cut by the zigzag split, not the balanced one."""
    split_batch = context.split_batch

    def mutant(inputs: Tensor, targets: Tensor, split: Any, group: Any = None) -> tuple[Tensor, ...]:
        x, y, positions, weight = split_batch(inputs, targets, split, group)
        if dist.get_rank(group) == 1:
            zigzag_share = split_batch(inputs, targets, zigzag(inputs.shape[1], 2), group)
            y, positions = (zigzag_share[1], positions) if what == "targets" else (y, zigzag_share[2])
        return x, y, positions, weight

    patch.setattr(context, "split_batch", mutant)


PARITY = {2: [_case("cp2 ring"), _case("cp2 allgather", cp_method="allgather"),
              _case("cp2 ulysses", cp_method="ulysses"), _case("cp2 ring", packing=RESET)],
          4: [_case("cp4 ring", cp=4), _case("cp4 allgather", cp=4, cp_method="allgather"),
              _case("cp4 ulysses", cp=4, cp_method="ulysses"), _case("dp2 x cp2 ring"),
              _case("cp4 ulysses+ring (2 x 2)", cp=4, cp_method="ulysses+ring", ulysses_size=2),
              _case("cp4 ring", cp=4, packing=RESET)]}
def reset_positions_by_zigzag(patch: pytest.MonkeyPatch) -> None:
    """Mutant: position_reset's positions cut by the zigzag split, not the balanced one the tokens were cut by."""
    patch.setattr(context, "rope_positions", lambda reset, held, split, rank: held if reset is None else
                  zigzag(reset.shape[1], split.cp).share(reset, rank))


MUTANTS = [(what, Case(partial(ComposedStrategy, context_parallel_size=2, cp_balance="documents"), packing=PACKED,
                       steps=1, mutation=partial(shares_of_rank_1_by_zigzag, what), label=f"rank 1's {what} by zigzag"))
           for what in ("targets", "positions")] + [
    ("reset", Case(partial(ComposedStrategy, context_parallel_size=2, cp_balance="documents"), packing=RESET, steps=1,
                   mutation=reset_positions_by_zigzag, label="reset positions by zigzag"))]


def test_the_harness_batches_are_balanced_away_from_zigzag() -> None:
    """The parity cases below test the balance only if it moves chunks: every batch of theirs is split otherwise."""
    tokens = case_tokens(PARITY[2][0])[:, :-1]
    for batch in tokens.split(PARITY[2][0].global_batch):
        ids = (batch == PACKED[0]).long().cumsum(-1) - (batch == PACKED[0]).long()
        for cp in (2, 4):
            assert balance_documents(ids, cp) != zigzag(16, cp)


@pytest.mark.parametrize("world", PARITY)
def test_balanced_documents_match_one_process_under_cp(world: int) -> None:
    """Parity (loss, every gradient, final parameters) under ring, allgather and ulysses at cp 2 and 4, dp2 x cp2 and
    ulysses+ring 2 x 2 with cp_balance documents, and ring with RoPE positions reset at each document; at world 2,
    rank 1's targets or positions cut by zigzag instead, or the reset positions cut by zigzag on every rank, are
    reported. (No rank's positions reset at all is no mutant: under the document mask RoPE sees only offsets within
    a document, which a shift per document leaves as they are.)"""
    mutants = MUTANTS if world == 2 else []
    runs = run_parity(PARITY[world] + [case for _, case in mutants], world_size=world, env=REFERENCE_TILES)
    for run in runs[:len(PARITY[world])]:
        assert_parity(run)
    reports = {"targets": r"batch 0 rank \d: loss", "positions": r"step 0 rank \d: gradient",  # RoPE barely moves
               "reset": r"step 0 rank \d: gradient"}
    missed, _ = unreported_mutants([(what, reports[what], run)  # the first loss at initialisation (docs/cp.md)
                                    for (what, _), run in zip(mutants, runs[len(PARITY[world]):])], assert_parity)
    assert not missed, missed


def test_cp_balance_documents_without_documents_is_refused_in_one_line() -> None:
    case = Case(partial(ComposedStrategy, context_parallel_size=2, cp_balance="documents"), steps=1)
    with pytest.raises(Exception, match="cp_balance documents balances packed documents: set data.init_args"):
        run_parity([case], world_size=2, env=REFERENCE_TILES)
