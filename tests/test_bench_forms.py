"""scripts/bench_allreduce.py times the other forms of a reduce-scatter and an all-gather (list forms, one reduce or
broadcast per rank, point-to-point): each must compute what the collective computes, or its time says nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_allreduce import op_on  # noqa: E402

REDUCE_FORMS = ("reduce_scatter", "reduce_scatter_list", "reduce_per_rank", "reduce_scatter_p2p")
GATHER_FORMS = ("all_gather", "all_gather_list", "broadcast_per_rank")


def _forms(chunk: int) -> dict[str, torch.Tensor]:
    """Every form's result on this rank: a reduce-scatter's chunk, an all-gather's whole."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(chunk, dtype=torch.float64) * (rank + 1) + 1000 * rank  # distinct on every rank and row
    results = {}
    for op in REDUCE_FORMS:
        full = torch.cat([mine + 100 * c for c in range(world)])
        shard = torch.full((chunk,), float("nan"), dtype=torch.float64)
        op_on(op, full, shard)()
        results[op] = full.chunk(world)[rank].clone() if op == "reduce_per_rank" else shard
    for op in GATHER_FORMS:
        full = torch.full((chunk * world,), float("nan"), dtype=torch.float64)
        full.chunk(world)[rank].copy_(mine)  # the in-place forms read their input there
        op_on(op, full, mine.clone())()
        results[op] = full
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_every_form_computes_its_collective(world: int) -> None:
    chunk = 5
    per_rank = run_distributed(_forms, world, chunk)
    mine = [torch.arange(chunk, dtype=torch.float64) * (r + 1) + 1000 * r for r in range(world)]
    gathered = torch.cat(mine)
    for rank, results in enumerate(per_rank):
        reduced = sum(m + 100 * rank for m in mine)  # chunk `rank` of every rank's whole, summed
        for op in REDUCE_FORMS:
            assert torch.equal(results[op], reduced), (op, rank)
        for op in GATHER_FORMS:
            assert torch.equal(results[op], gathered), (op, rank)


def _comm_forms(chunk: int) -> dict[tuple[str, str, bool], torch.Tensor]:
    """`comm.reduce_scatter` and `comm.all_gather` in each of their forms (`comm.zero_forms`), in place (this rank's
    chunk of the whole) and into a tensor of their own: the result on this rank."""
    from lit_lm.strategies import comm

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(chunk, dtype=torch.float64) * (rank + 1) + 1000 * rank
    results = {}
    for reduce, gather in comm.ZERO_COLLECTIVES.values():
        for in_place in (True, False):
            full = torch.cat([mine + 100 * c for c in range(world)])
            out = full.view(world, -1)[rank] if in_place else torch.full((chunk,), float("nan"), dtype=torch.float64)
            comm.reduce_scatter(out, full, form=reduce, async_op=True).wait()
            results[("reduce", reduce, in_place)] = out.clone()
            whole = torch.full((chunk * world,), float("nan"), dtype=torch.float64)
            src = whole.view(world, -1)[rank] if in_place else mine.clone()
            src.copy_(mine)
            comm.all_gather(whole, src, form=gather, async_op=True).wait()
            results[("gather", gather, in_place)] = whole
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_zero_forms_compute_their_collective(world: int) -> None:
    """ZeRO's reduce-scatter as an all-reduce and its all-gather as a broadcast per rank (gloo's forms, the default
    there) compute what the collective computes, as the collective itself does, in place or not."""
    chunk = 5
    per_rank = run_distributed(_comm_forms, world, chunk)
    mine = [torch.arange(chunk, dtype=torch.float64) * (r + 1) + 1000 * r for r in range(world)]
    for rank, results in enumerate(per_rank):
        assert len(results) == 8
        for (kind, form, in_place), got in results.items():
            expected = sum(m + 100 * rank for m in mine) if kind == "reduce" else torch.cat(mine)
            assert torch.equal(got, expected), (kind, form, in_place, rank)
