"""The N-D process-group layout: the rank arithmetic (pure), its validation, then the real groups on 4 processes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from lit_lm.strategies import comm
from lit_lm.strategies.errors import ConfigError
from lit_lm.strategies.layout import DIMS, GROUPS, REFUSED, ParallelConfig, ParallelDims, ParallelLayout, rank_grid


def test_dp2_tp2() -> None:
    grid = rank_grid(ParallelDims.of(4, tp=2))
    assert grid["tp"] == [[0, 1], [2, 3]]  # tensor-parallel peers are neighbours
    assert grid["dp"] == grid["dp_shard"] == [[0, 2], [1, 3]]
    assert grid["pp"] == [[0], [1], [2], [3]]


def test_pp2_dp2() -> None:
    grid = rank_grid(ParallelDims.of(4, pp=2))
    assert grid["pp"] == [[0, 2], [1, 3]]  # stages are farthest apart
    assert grid["dp"] == [[0, 1], [2, 3]]
    assert grid["pp_embedding"] == [[0, 2], [1, 3]]  # first and last stage of each pipeline


def test_every_dimension_covers_every_rank_once() -> None:
    dims = ParallelDims.of(16, pp=2, dp_replicate=2, tp=2, cp=1)  # dp_shard 2
    grid = rank_grid(dims)
    for name in GROUPS:
        assert sorted(r for g in grid[name] for r in g) == list(range(16)), name
    for name in DIMS:
        assert all(len(g) == getattr(dims, name) for g in grid[name]), name
    assert grid["dp"][0] == [0, 2, 4, 6]  # dp_replicate x dp_shard, tp fixed
    assert grid["dp_replicate"][0] == [0, 4] and grid["dp_shard"][0] == [0, 2]
    assert rank_grid(ParallelDims.of(8, pp=2, tp=2))["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_ep_is_carved_from_dp_shard_x_cp() -> None:
    grid = rank_grid(ParallelDims.of(8, tp=2, ep=2))  # dp_shard 4
    assert grid["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]  # consecutive dp ranks, the same tp rank
    assert grid["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # the ranks holding the same experts


def test_cp_groups_average_over_dp_x_cp() -> None:
    grid = rank_grid(ParallelDims.of(8, cp=2, tp=2))  # dp_shard 2
    assert grid["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]  # between tp and dp_shard
    assert grid["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # the sampler: cp peers read the same rows
    assert grid["dp_cp"] == grid["dp_shard_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # every rank with other tokens
    hsdp = rank_grid(ParallelDims.of(8, dp_replicate=2, cp=2))  # dp_shard 2
    assert hsdp["dp_shard_cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and hsdp["dp_cp"] == [list(range(8))]


def test_bad_sizes_name_every_size_and_the_world() -> None:
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4, expert_parallel_size=1 on a world of 6 ranks"):
        ParallelDims.of(6, tp=4)
    with pytest.raises(ConfigError, match=r"pp=1 x dp_replicate=1 x dp_shard=3 x cp=1 x tp=2 x ep=1 on a world of 8"):
        ParallelDims(dp_shard=3, tp=2).validate(8)
    with pytest.raises(ConfigError, match="expert_parallel_size must divide"):
        ParallelDims.of(4, tp=2, ep=4)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1"):
        ParallelDims.of(4, tp=0)


def test_group_sizes_are_the_grids() -> None:
    for dims in (ParallelDims.of(16, pp=2, dp_replicate=2, tp=2), ParallelDims.of(8, cp=2, tp=2, ep=2),
                 ParallelDims.of(8, dp_replicate=2, cp=2, ep=2)):
        for name, groups in rank_grid(dims).items():
            assert {len(g) for g in groups} == {dims.size(name)}, (dims, name)


def test_parallel_config_is_the_strategys_arguments() -> None:
    """`from_args` reads ComposedStrategy's arguments (None: not given), `strategy_args` writes them back: options
    only where their dimension is on; validation and the option-without-its-dimension errors on the way in."""
    configs = [ParallelConfig(), ParallelConfig(tp=2, sequence_parallel=False, zero_stage=3, dp_replicate=2),
               ParallelConfig(pp=4, schedule="interleaved_1f1b", virtual_stages=2, microbatches=8,
                              layers_per_stage=(1, 2, 2, 1), balance="params"),
               ParallelConfig(cp=2, cp_method="allgather", zero_stage=1), ParallelConfig(ep=4, zero_stage=2)]
    for config in configs:
        args = config.strategy_args()
        assert ParallelConfig.from_args(**args) == config, args
    assert "sequence_parallel" not in ParallelConfig(sequence_parallel=False).strategy_args()  # tp 1: nobody reads it
    assert ParallelConfig.from_args(tensor_parallel_size=2).sp and not ParallelConfig(sequence_parallel=True).sp
    assert hash(ParallelConfig.from_args(pipeline_parallel_size=2, layers_per_stage=[1, 3]))  # a yaml list: a tuple
    for kwargs, message in [(dict(sequence_parallel=True), "sequence_parallel is a tensor-parallel option"),
                            (dict(cp_method="ring"), "cp_method is a context-parallel option"),
                            (dict(schedule="gpipe", balance="params"), "schedule, balance: pipeline options, but "
                                                                       "pipeline_parallel_size is 1"),
                            (dict(expert_parallel_size=0), "expert_parallel_size=0: must be an integer >= 1"),
                            (dict(pipeline_parallel_size=2, microbatches=1.5), "microbatches=1.5: must be an integer"),
                            (dict(zero_stage=4), "unknown ZeRO stage 4"),
                            (dict(context_parallel_size=2, cp_method="star"), "cp_method: unknown 'star'"),
                            (dict(pipeline_parallel_size=2, balance="flops"), "balance: unknown 'flops'")]:
        with pytest.raises(ConfigError, match=message):
            ParallelConfig.from_args(**kwargs)


def test_parallel_config_dims_and_group_roles() -> None:
    assert ParallelConfig(tp=2, pp=2).dims(8) == ParallelDims(pp=2, dp_shard=2, tp=2)  # dp_shard: what is left
    assert ParallelConfig(tp=2, dp_shard=4).dims() == ParallelDims(dp_shard=4, tp=2)  # the estimator's: no world
    with pytest.raises(ConfigError, match="on a world of 6 ranks"):
        ParallelConfig(tp=4).dims(6)
    assert [ParallelConfig(zero_stage=z, cp=c).dense_group for z in (0, 2) for c in (1, 2)] == \
        ["dp", "dp_cp", "dp_shard", "dp_shard_cp"]
    norms = {ParallelConfig(tp=2, pp=2): ["tp", "pp"], ParallelConfig(zero_stage=3, cp=2): ["dp_shard_cp"],
             ParallelConfig(zero_stage=1, ep=2): ["dp"], ParallelConfig(ep=2): ["ep"], ParallelConfig(): [],
             ParallelConfig(zero_stage=3, dp_replicate=4): []}  # HSDP over 4 replicas of one shard: pure replicas
    for config, names in norms.items():
        assert config.norm_groups(config.dims(4)) == names, config


def test_refusals_are_checked_in_table_order() -> None:
    assert ParallelConfig(tp=2, pp=2, zero_stage=2).check().refusal() is None
    for entry in REFUSED:  # every entry is reachable: some config matches it first
        assert any(c.refusal(moe=True) is entry for c in _small_configs()), entry.combination
    moe_sp = ParallelConfig(tp=2)
    assert moe_sp.refusal() is None and moe_sp.refusal(moe=False) is None  # MoE entries once the model is known
    with pytest.raises(ConfigError, match="set sequence_parallel: false"):
        moe_sp.check(moe=True)
    ParallelConfig(tp=2, sequence_parallel=False).check(moe=True)


def _small_configs() -> list[ParallelConfig]:
    return [ParallelConfig(tp=tp, pp=pp, cp=cp, ep=ep, dp_replicate=r, zero_stage=z, sequence_parallel=sp)
            for tp in (1, 2) for pp in (1, 2) for cp in (1, 2) for ep in (1, 2) for r in (1, 2) for z in range(4)
            for sp in (True, False)]


def _layout_worker() -> dict:
    dims = ParallelDims.of(4, tp=2, ep=2)
    layout = ParallelLayout.get(dims)
    assert ParallelLayout.get(dims) is layout  # cached: no second round of new_group
    summed = torch.tensor([float(dist.get_rank() + 1)])
    comm.all_reduce(summed, layout.tp_group)
    mesh = layout.device_mesh("cpu")
    expert_mesh = layout.device_mesh("cpu", "edp", "ep")
    return {"dp": (layout.dp_rank, layout.dp_size), "tp": (layout.tp_rank, layout.tp_size), "tp_sum": summed.item(),
            "mesh": mesh.mesh.tolist(), "mesh_tp_rank": mesh.get_local_rank("tp"),
            "expert_mesh": expert_mesh.mesh.tolist(), "group": comm.COMM_LOG.history[-1].group}


def test_groups_on_4_processes() -> None:
    results = run_distributed(_layout_worker, 4)
    assert [r["dp"] for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [r["tp"] for r in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [r["tp_sum"] for r in results] == [3.0, 3.0, 7.0, 7.0]
    assert results[0]["mesh"] == [[[[[0, 1]], [[2, 3]]]]]  # (pp, dp_replicate, dp_shard, cp, tp)
    assert [r["mesh_tp_rank"] for r in results] == [0, 1, 0, 1]
    assert [r["expert_mesh"] for r in results] == [[[0, 2]], [[1, 3]], [[0, 2]], [[1, 3]]]  # (edp, ep) slabs
    assert results[0]["group"] == "tp"


# -- the strategy's timeout reaches every group ------------------------------------------------------------------
def _group_timeouts(timeout_s: float) -> dict:
    """A `ComposedStrategy(timeout=...)` set up on an initialised world (as Lightning does in each process): the
    timeout of every group its layout created, read from the backend; then a collective on the `dp` subgroup that
    rank 1 never joins must fail on rank 0 (within the strategy's timeout, not gloo's 30 min default)."""
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.accelerators import CPUAccelerator

    from lit_lm.strategies.composed import ComposedStrategy

    strategy = ComposedStrategy(tensor_parallel_size=2, timeout=timeout_s, accelerator=CPUAccelerator(),
                                parallel_devices=[torch.device("cpu")] * 4, cluster_environment=LightningEnvironment())
    strategy.setup_environment()
    layout = strategy.layout
    cpu = torch.device("cpu")
    out = {"timeouts": {name: layout.group(name)._get_backend(cpu).options._timeout.total_seconds()
                        for name in GROUPS}}
    # dp groups: {0, 2} and {1, 3}. Rank 0 enters an all-reduce that rank 2 never joins; rank 2 waits (outside
    # every collective) for rank 0 to report, so the failure is rank 0's timeout and not a peer that hung up.
    flag = Path(os.environ["LIT_LM_TEST_DIR"]) / "rank0_done"
    if dist.get_rank() == 0:
        try:
            comm.all_reduce(torch.ones(1), layout.dp_group)
            out["error"] = None
        except RuntimeError as error:
            out["error"] = str(error)
        flag.touch()
    elif dist.get_rank() == 2:
        for _ in range(600):  # at most a minute: the old code (30 min) fails the test instead of hanging it
            if flag.exists():
                break
            time.sleep(0.1)
    return out


def test_strategy_timeout_reaches_every_subgroup(tmp_path: Path) -> None:
    results = run_distributed(_group_timeouts, 4, 2.5, env={"LIT_LM_TEST_DIR": str(tmp_path)})
    for r in results:
        assert r["timeouts"] == {name: 2.5 for name in GROUPS}
    assert results[0]["error"] is not None and "timed out" in results[0]["error"].lower(), results[0]["error"]
