"""The dp x pp x tp process-group layout: the rank arithmetic (pure), then the real groups on 4 processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from strategies import comm
from strategies.layout import ParallelLayout, rank_grid


def test_dp2_tp2() -> None:
    grid = rank_grid(4, tp=2)
    assert grid["tp"] == [[0, 1], [2, 3]]  # tensor-parallel peers are neighbours
    assert grid["dp"] == [[0, 2], [1, 3]]
    assert grid["pp"] == [[0], [1], [2], [3]]


def test_pp2_dp2() -> None:
    grid = rank_grid(4, dp=2, pp=2)
    assert grid["pp"] == [[0, 2], [1, 3]]  # stages are farthest apart
    assert grid["dp"] == [[0, 1], [2, 3]]
    assert grid["tp"] == [[0], [1], [2], [3]]


def test_dp2_pp2_tp2_covers_every_rank_once_per_dimension() -> None:
    grid = rank_grid(8, pp=2, tp=2)
    for dim, size in (("dp", 2), ("pp", 2), ("tp", 2)):
        assert sorted(r for g in grid[dim] for r in g) == list(range(8))
        assert all(len(g) == size for g in grid[dim])
    assert grid["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_bad_sizes_are_explained() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        rank_grid(6, tp=4)
    with pytest.raises(ValueError, match="world size"):
        rank_grid(4, dp=4, tp=2)


def _layout_worker() -> dict:
    layout = ParallelLayout.get(tp=2)
    assert ParallelLayout.get(tp=2) is layout  # cached: no second round of new_group
    summed = torch.tensor([float(dist.get_rank() + 1)])
    comm.all_reduce(summed, layout.tp_group)
    mesh = layout.device_mesh("cpu")
    return {"dp": (layout.dp_rank, layout.dp_size), "tp": (layout.tp_rank, layout.tp_size), "tp_sum": summed.item(),
            "mesh": mesh.mesh.tolist(), "mesh_tp_rank": mesh.get_local_rank("tp"),
            "group": comm.COMM_LOG.records[-1].group}


def test_groups_on_2_processes() -> None:
    results = run_distributed(_layout_worker, 2)
    assert [r["dp"] for r in results] == [(0, 1), (0, 1)]
    assert [r["tp"] for r in results] == [(0, 2), (1, 2)]
    assert [r["tp_sum"] for r in results] == [3.0, 3.0]
    assert results[0]["mesh"] == [[[0, 1]]]
    assert [r["mesh_tp_rank"] for r in results] == [0, 1]
    assert results[0]["group"] == "tp"
