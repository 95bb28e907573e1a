"""Packed documents under context parallelism (lit_lm/strategies/cp.py: ring, allgather, ulysses, ulysses+ring):
attention against one process with the same block-diagonal causal mask, forward and backward; the tiles a document
mask skips (wholly masked ones, never partly masked ones); training parity, RoPE positions reset at each document
too; the mutants reported: the mask dropped on one rank, Ulysses' heads back in the wrong order, a tile skipped that
had a visible pair, the hybrid's groups swapped or its ring's sequence out of order, positions not reset."""

from __future__ import annotations

import itertools
import re
from dataclasses import replace
from functools import partial
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lit_lm.config import ConfigError, ModelConfig
from lit_lm.model import Transformer, document_mask
from lit_lm.parity import TINY, Case, assert_parity, run_parity
from lit_lm.spawn import run_distributed
from lit_lm.strategies import cp as context
from lit_lm.strategies.comm import COMM_LOG
from lit_lm.strategies.composed import ComposedStrategy
from lit_lm.strategies.layout import ParallelConfig
from lit_lm.strategies.cp import (HYBRID, METHODS, ContextParallelAttention, HybridGroups, block_plan, comm_theory,
                                  row_documents, zigzag_gather, zigzag_runs, zigzag_split)

REFERENCE_TILES = {"TRITON_INTERPRET": "0"}


def rows(seq_len: int) -> Tensor:
    """(2, T) document ids of two packed rows: one-token documents, documents crossing chunk boundaries and one
    longer than a chunk (T/(2·cp) <= T/4); the tiles skip what neither row's documents see."""
    def row(ends: set[int]) -> Tensor:  # EOS positions: a document ends at each
        return torch.tensor([sum(e < t for e in ends) for t in range(seq_len)])

    return torch.stack((row({0, 1, 2, 5, seq_len // 2 + 3, seq_len - 2}), row({3, 4, 7, seq_len // 2 + 1})))


def reference(q: Tensor, k: Tensor, v: Tensor, ids: Optional[Tensor], window: Optional[int]) -> Tensor:
    """One process: SDPA with the block-diagonal causal mask the model uses (`lit_lm.model.document_mask`)."""
    t = q.shape[2]
    mask = document_mask(ids if ids is not None else torch.zeros(q.shape[0], t, dtype=torch.long), window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def drop_mask_on_rank_1(patch: pytest.MonkeyPatch) -> None:
    """Mutant: rank 1's core attends across documents (it is given no documents)."""
    forward = ContextParallelAttention.forward

    def without(self: Any, q: Tensor, k: Tensor, v: Tensor, documents: Any = None) -> Tensor:
        return forward(self, q, k, v, None if dist.get_rank() == 1 else documents)

    patch.setattr(ContextParallelAttention, "forward", without)


def heads_reversed(patch: pytest.MonkeyPatch) -> None:
    """Mutant: Ulysses' return all-to-all puts the head groups back in reverse order."""
    exchange = context.heads_to_sequence

    def reversed_heads(out: Tensor, group: Any, *split: Any) -> Tensor:
        y = exchange(out, group, *split)
        b, h, length, d = y.shape
        cp = dist.get_world_size(group)
        return y.view(b, cp, h // cp, length, d).flip(1).reshape(b, h, length, d)

    patch.setattr(context, "heads_to_sequence", reversed_heads)


def skip_one_key_too_many(patch: pytest.MonkeyPatch) -> None:
    """Mutant: each piece's first visible key is taken one position late (its first key never computed)."""
    plan = context.row_documents

    def late(ids: Tensor, cp: int) -> context.Documents:
        docs = plan(ids, cp)
        return replace(docs, first_key=tuple(k + 1 for k in docs.first_key))

    patch.setattr(context, "row_documents", late)


def hybrid_groups_swapped(patch: pytest.MonkeyPatch) -> None:
    """Mutant: the hybrid's Ulysses and ring groups swapped (the all-to-all across the ring ranks, the ring inside)."""
    made = context.hybrid_groups
    patch.setattr(context, "hybrid_groups", lambda *args: HybridGroups(made(*args).ring, made(*args).ulysses))


def ring_sequence_reversed(patch: pytest.MonkeyPatch) -> None:
    """Mutant: after the hybrid's all-to-all, the sequence its Ulysses group holds (zigzag chunks j and 2r−1−j of
    the ring level) put together in the wrong order: the mirror chunk first."""
    exchange = context.sequence_to_heads

    def reordered(*args: Any) -> tuple[Tensor, ...]:
        return tuple(torch.cat(t.chunk(2, dim=-2)[::-1], dim=-2) for t in exchange(*args))

    patch.setattr(context, "sequence_to_heads", reordered)


MUTANTS = {"mask dropped on rank 1": drop_mask_on_rank_1, "ulysses heads reversed": heads_reversed,
           "a visible key skipped": skip_one_key_too_many}
HYBRID_MUTANTS = {"hybrid groups swapped": hybrid_groups_swapped, "ring sequence reversed": ring_sequence_reversed}


def _attention_worker(seq_len: int, cases: list[tuple], backend: str = "reference", ulysses: int = 1,
                      methods: tuple[str, ...] = METHODS) -> dict[str, Any]:
    """Every (method, heads, window, documents): max |error| of out, dq, dk, dv against one process, wire bytes of
    forward and backward (with documents) and their theory, and whether the packed-row output equals the unpacked
    one when every row is a single document. The hybrid runs on a `ulysses` x cp/ulysses grid."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    hybrid = context.hybrid_groups([list(range(cp))], ulysses) if HYBRID in methods else None
    out: dict[str, Any] = {}
    for method, (hq, hk, window, packed) in itertools.product(methods, cases):
        gen = torch.Generator().manual_seed(hq * 100 + hk * 10 + (window or 0))
        q, k, v, grad = (torch.randn(2, h, seq_len, 8, generator=gen) for h in (hq, hk, hk, hq))
        ids = rows(seq_len) if packed else torch.zeros(2, seq_len, dtype=torch.long)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        reference(*leaves, ids, window).backward(grad)
        local = [zigzag_split(t, rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
        core = ContextParallelAttention(None, method, window, backend, hybrid=hybrid if method == HYBRID else None)
        COMM_LOG.reset()
        y = core(*local, documents=context.row_documents(ids, cp))
        forward = COMM_LOG.summary()
        COMM_LOG.reset()
        y.backward(zigzag_split(grad, rank, cp, dim=2))
        backward = COMM_LOG.summary()
        errors = [(zigzag_gather(y.detach(), dim=2) - reference(q, k, v, ids, window)).abs().max()]
        errors += [(zigzag_gather(t.grad, dim=2) - leaf.grad).abs().max() for t, leaf in zip(local, leaves)]
        u = {"ulysses": cp, HYBRID: ulysses}.get(method, 1)  # the ranks its heads are exchanged over
        name = f"{method} {hq}/{hk} w={window} {'packed' if packed else 'one document'}"
        out[name] = {
            "errors": [float(e) for e in errors],
            "wire": [sum(s["wire_bytes"] for s in summary.values()) for summary in (forward, backward)],
            "theory": comm_theory(method, cp, 2 * k.numel() // cp, 4, q.numel() // cp,
                                  context.ulysses_kv_copies(hq, hk, u), u)}
        if not packed:  # a row of one document is today's result, bit for bit
            out[name]["today"] = torch.equal(y.detach(), core(*local).detach())
    return out


# (query heads, kv heads, window, packed): MHA, GQA (kv heads fewer than cp: ulysses copies them), a window
# across chunks, rows of a single document
CASES = [(4, 4, None, True), (4, 2, None, True), (4, 1, 5, True), (4, 2, None, False)]


# the tiles by the PyTorch reference; at cp=2 also by the FlashAttention kernel as varlen (Triton's interpreter,
# which the suite turns on in conftest.py; slow, so two cases, the hybrid's tiles being the ring's left out), and the
# hybrid's own at cp=4 (2 x 2: the ring level's tiles on what each Ulysses group holds) on one; the hybrid at cp=2
# as 1 x 2 (a ring behind a one-rank exchange), at cp=4 as 2 x 2
@pytest.mark.parametrize("cp, seq_len, backend, cases, ulysses, methods",
                         [(2, 12, "reference", CASES, 1, METHODS), (4, 16, "reference", CASES, 2, METHODS),
                          (2, 12, "triton", CASES[1:3], 1, METHODS[:3]), (4, 16, "triton", CASES[1:2], 2, (HYBRID,))])
def test_attention_with_documents_matches_one_process(cp: int, seq_len: int, backend: str, cases: list, ulysses: int,
                                                      methods: tuple[str, ...]) -> None:
    env = REFERENCE_TILES if backend == "reference" else None
    for rank in run_distributed(_attention_worker, cp, seq_len, cases, backend, ulysses, methods, env=env):
        for name, r in rank.items():
            assert max(r["errors"]) < 1e-5, (name, r["errors"])
            assert r["wire"] == [r["theory"]["forward"], r["theory"]["backward"]], name
            assert r.get("today", True), name


def _mutant_worker(seq_len: int, mutants: dict = MUTANTS, ulysses: int = 1, methods: tuple[str, ...] = METHODS
                   ) -> dict[str, dict[str, float]]:
    """Each mutant in turn (undone after): the largest error of the packed cases, per method."""
    found: dict[str, dict[str, float]] = {}
    for name, mutant in mutants.items():
        with pytest.MonkeyPatch.context() as patch:
            mutant(patch)
            result = _attention_worker(seq_len, [case for case in CASES if case[3]], "reference", ulysses, methods)
        found[name] = {}
        for case, r in result.items():
            method = case.split()[0]
            found[name][method] = max(found[name].get(method, 0.0), *r["errors"])
    return found


def test_the_mutants_are_reported() -> None:
    """cp=2: the mask dropped on rank 1 and a visible key skipped break every method; Ulysses' heads in the wrong
    order break Ulysses (the others never exchange heads)."""
    for rank in run_distributed(_mutant_worker, 2, 12, env=REFERENCE_TILES):
        for method in METHODS:
            assert rank["mask dropped on rank 1"][method] > 1e-2, method
            assert rank["a visible key skipped"][method] > 1e-2, method
        assert rank["ulysses heads reversed"]["ulysses"] > 1e-2
        assert rank["ulysses heads reversed"][HYBRID] < 1e-5  # at cp=2 (1 x 2) its exchange is one rank's


def test_the_hybrid_mutants_are_reported() -> None:
    """cp=4 as 2 x 2: the Ulysses and ring groups swapped, or the sequence a Ulysses group holds put together in the
    wrong order for the ring, break the hybrid; so do Ulysses' heads back in the wrong order and the mask dropped on
    one rank."""
    mutants = dict(HYBRID_MUTANTS, **{k: MUTANTS[k] for k in ("ulysses heads reversed", "mask dropped on rank 1")})
    for rank in run_distributed(_mutant_worker, 4, 16, mutants, 2, (HYBRID,), env=REFERENCE_TILES):
        for name in mutants:
            assert rank[name][HYBRID] > 1e-2, name


# -- the tiles a document mask skips ---------------------------------------------------------------------------
def visible(ids: Tensor, q_pos: int, k_pos: int, window: int) -> bool:
    """Whether some row's query at q_pos sees the key at k_pos (causal, window, one document)."""
    return 0 <= q_pos - k_pos < window and bool((ids[:, q_pos] == ids[:, k_pos]).any())


@pytest.mark.parametrize("cp, window, tile_rows", [(2, 16, 512), (4, 16, 512), (2, 5, 512), (2, 16, 2)])
def test_the_tiles_hold_every_visible_pair_and_no_tile_is_wholly_masked(cp: int, window: int, tile_rows: int
                                                                        ) -> None:
    """Ring (each rank's queries on each rank's keys) and Ulysses/all-gather (the whole sequence): every visible pair
    in exactly one tile, and every tile holds a visible pair (a wholly masked tile is skipped); tiles a chunk tall
    (c = 4, 2) or, `tile_rows` 2, half a chunk."""
    seq_len = 16
    for ids in (rows(seq_len), rows(seq_len)[:1]):  # two rows (the skip is the least over them), one row
        _check_tiles(ids, cp, window, tile_rows)
    assert row_documents(torch.zeros(2, 16, dtype=torch.long), cp, tile_rows).piece == 16 // (2 * cp)  # one each


def _check_tiles(ids: Tensor, cp: int, window: int, tile_rows: int) -> None:
    seq_len = ids.shape[1]
    docs = row_documents(ids, cp, tile_rows)
    assert docs.piece == min(seq_len // (2 * cp), tile_rows) and any(docs.first_key)  # something to skip
    whole = ((0, seq_len),)
    plans = [(zigzag_runs(seq_len, r, cp), zigzag_runs(seq_len, s, cp)) for r in range(cp) for s in range(cp)]
    for q_runs, k_runs in plans + [(whole, whole)]:
        q_at = [p for first, n in q_runs for p in range(first, first + n)]
        k_at = [p for first, n in k_runs for p in range(first, first + n)]
        covered = []
        for rows_, keys, _ in block_plan(q_runs, k_runs, window, docs.piece, docs.first_key):
            pairs = [(q_at[i], k_at[j]) for i in range(rows_.start, rows_.stop) for j in range(keys.start, keys.stop)]
            assert any(visible(ids, *pair, window) for pair in pairs), (q_runs, k_runs, rows_, keys)
            covered += [pair for pair in pairs if visible(ids, *pair, window)]
        expected = [(i, j) for i in q_at for j in k_at if visible(ids, i, j, window)]
        assert sorted(covered) == sorted(expected)


def test_a_wholly_masked_tile_is_skipped_and_a_partly_masked_one_is_not() -> None:
    """cp=2, T=16 (chunks of 4): rank 0's second chunk (positions 12-15) against rank 1's block (4-11). A document
    starting at 12 in every row masks the whole tile: skipped. Starting at 10 in one row: the tile is computed, on
    keys 10-11 (the keys before the earliest row's document are masked for every row and not computed either)."""
    def tiles(starts: list[int]) -> list[tuple[slice, slice, int]]:
        ids = torch.stack([(torch.arange(16) >= s).long() for s in starts])
        first_key = row_documents(ids, 2).first_key
        return list(block_plan(((12, 4),), zigzag_runs(16, 1, 2), 16, 4, first_key))

    assert len(list(block_plan(((12, 4),), zigzag_runs(16, 1, 2), 16, 4))) == 1  # unpacked: 4 x 8 keys
    assert tiles([12, 12]) == []
    assert tiles([12, 10]) == [(slice(0, 4), slice(6, 8), 2)]  # keys 10, 11; query 12 sits 2 after key 10


# -- through the composed strategy: parity with one process (lit_lm/parity.py, documents at every EOS) -----------
PACKED = (1, False)  # the harness's EOS id (every token drawn as a multiple of 5), RoPE positions not reset
RESET = (1, True)  # and RoPE positions reset at each document (data.init_args.position_reset)


def _case(label: str, cp: int = 2, packing: tuple = PACKED, **strategy: Any) -> Case:
    reset = ", positions reset" if packing[1] else ""
    return Case(partial(ComposedStrategy, context_parallel_size=cp, **strategy), packing=packing,
                label=f"{label}, packed documents{reset}")


PARITY = {2: [_case("cp2 ring"), _case("cp2 allgather", cp_method="allgather"),
              _case("cp2 ulysses", cp_method="ulysses"), _case("cp2 ulysses+ring (2 x 1)", cp_method=HYBRID),
              _case("cp2 ring", packing=RESET)],
          4: [_case("dp2 x cp2 ring"), _case("cp2 x tp2 ulysses", cp_method="ulysses", tensor_parallel_size=2),
              _case("cp4 allgather", cp=4, cp_method="allgather"), _case("cp4 ring", cp=4, packing=RESET),
              _case("cp4 ulysses", cp=4, cp_method="ulysses"),
              _case("cp4 ulysses+ring (2 x 2)", cp=4, cp_method=HYBRID, ulysses_size=2, packing=RESET),
              _case("dp2 x cp2 ulysses+ring (1 x 2)", cp_method=HYBRID, ulysses_size=1),
              _case("cp2 x tp2 ulysses+ring (2 x 1)", cp_method=HYBRID, tensor_parallel_size=2, packing=RESET)]}


def positions_not_reset_on_rank_1(patch: pytest.MonkeyPatch) -> None:
    """Mutant: rank 1 takes the sequence positions it holds, not the rows' reset ones."""
    positions = context.rope_positions
    patch.setattr(context, "rope_positions",
                  lambda reset, held, *rest: positions(None if dist.get_rank() == 1 else reset, held, *rest))


MASK_DROPPED = Case(partial(ComposedStrategy, context_parallel_size=2), packing=PACKED, steps=1,
                    mutation=drop_mask_on_rank_1, label="cp2 ring, the mask dropped on rank 1")
NOT_RESET = Case(partial(ComposedStrategy, context_parallel_size=2), packing=RESET, steps=1,
                 mutation=positions_not_reset_on_rank_1, label="cp2 ring, positions not reset on rank 1")


@pytest.mark.parametrize("world", PARITY)
def test_packed_documents_match_one_process_under_cp(world: int) -> None:
    """Parity under ring, allgather, ulysses and ulysses+ring (cp2, dp2 x cp2, cp2 x tp2, cp4 and 2 x 2), RoPE
    positions reset at each document in some; at world 2, in the same launch, the mask dropped on one rank and the
    positions not reset on one rank are reported at the first step (by its loss; by the gradients)."""
    mutants = [(MASK_DROPPED, r"batch 0 rank \d: loss"), (NOT_RESET, r"step 0 rank \d: gradient of")]
    mutants = mutants if world == 2 else []
    runs = run_parity(PARITY[world] + [case for case, _ in mutants], world_size=world, env=REFERENCE_TILES)
    for run in runs[:len(PARITY[world])]:
        assert_parity(run)
    for (mutant, report), run in zip(mutants, runs[len(PARITY[world]):]):
        with pytest.raises(AssertionError, match=rf"{re.escape(mutant.label)}: {report}"):
            assert_parity(run)


def test_ulysses_shares_out_heads_or_refuses_in_one_line() -> None:
    """kv heads fewer than the cp ranks are copied (each rank's query heads share one); heads the ranks cannot share
    out are refused, naming cp_method."""
    assert context.ulysses_kv_copies(8, 8, 4) == 1 and context.ulysses_kv_copies(8, 4, 4) == 1
    assert context.ulysses_kv_copies(8, 2, 4) == 2 and context.ulysses_kv_copies(8, 1, 8) == 8
    for hq, hk, cp in [(2, 2, 4), (12, 6, 4)]:
        with pytest.raises(ConfigError, match=r"cp_method ulysses splits attention heads over the \d cp ranks"):
            context.ulysses_kv_copies(hq, hk, cp)


def test_the_hybrid_grid_and_its_ulysses_size() -> None:
    """cp rank j·u + i is Ulysses rank i of ring rank j, in every cp group (here under tp 2: cp groups of every other
    rank); u defaults to the largest divisor of cp the heads (after tp) allow, and a bad ulysses_size is refused in
    one line, as is the option without its method."""
    assert context.hybrid_grid([[0, 1, 2, 3]], 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert context.hybrid_grid([[0, 2, 4, 6], [1, 3, 5, 7]], 2) == ([[0, 2], [4, 6], [1, 3], [5, 7]],
                                                                    [[0, 4], [2, 6], [1, 5], [3, 7]])
    assert context.ulysses_size_for(4, {(4, 2)}) == 4 and context.ulysses_size_for(8, {(6, 6)}) == 2
    assert context.ulysses_size_for(8, {(4, 4), (2, 1)}) == 2 and context.ulysses_size_for(4, {(3, 3)}) == 1
    model = Transformer(ModelConfig(**TINY))  # 4 query heads, 2 kv heads
    assert context.model_ulysses_size(model, 4) == 4 and context.model_ulysses_size(model, 4, tp=2) == 2
    assert context.model_ulysses_size(model, 4, ulysses_size=2) == 2
    config = ParallelConfig.from_args(context_parallel_size=4, cp_method=HYBRID, ulysses_size=2)
    assert config.strategy_args()["ulysses_size"] == 2 and "ulysses+ring u2" in config.describe()
    for args, message in [(dict(cp_method=HYBRID, ulysses_size=3), r"^ulysses_size=3 must divide context_parallel"),
                          (dict(cp_method="ring", ulysses_size=2), r"^ulysses_size is an option of cp_method ulysses"),
                          (dict(cp_method=HYBRID, ulysses_size=0), r"^ulysses_size=0 must divide")]:
        with pytest.raises(ConfigError, match=message):
            ParallelConfig.from_args(context_parallel_size=4, **args)
    with pytest.raises(ConfigError, match=r"^cp_method ulysses\+ring: ulysses_size=4 cannot share out a rank's 2 "):
        context.model_ulysses_size(model, 4, tp=2, ulysses_size=4)


def test_no_host_read_off_the_cpu() -> None:
    """On an accelerator the documents' tiles are planned without reading the ids to the host (NCCL's path: no host
    sync in the step): chunk-tall tiles, each masked, the kernel skipping inside. Ids on the meta device, which has
    no values to read, stand for one."""
    ids = torch.tensor([[0] * 5 + [1] * 11 + [2] * 16])
    on_cpu, off_cpu = row_documents(ids, 2, rows=4), row_documents(ids.to("meta"), 2, rows=4)
    assert on_cpu.piece == 4 and any(on_cpu.first_key)  # the CPU plans finer tiles from the ids
    assert off_cpu.piece == 8 and off_cpu.first_key == (0,) * 4
