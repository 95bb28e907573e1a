"""`lit-lm plan` end to end: a ranked table, and a yaml that `lit-lm fit` runs on the planned number of ranks."""

from __future__ import annotations

import dataclasses
import importlib
import itertools
from pathlib import Path

import pytest
import yaml

from lit_lm.config import ConfigError, ModelConfig
from lit_lm.planner.estimate import CHECKPOINTING, Workload, estimate
from lit_lm.planner.plan import USABLE_MEMORY, Cluster, Ranked, _divisors, _estimate, fitting, layouts, nearest, \
    plan, step_time, strategy_yaml
from lit_lm.planner.cli import parser, quantity, read_configs, workload_from
from lit_lm.strategies.composed import ComposedStrategy
from lit_lm.strategies.layout import ParallelConfig
from test_cli import CORPUS, REPO, read_metrics, run_cli

STRATEGIES = {"lit_lm.strategies.composed.ComposedStrategy"}


def tiny_config(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    config = {"trainer": {"default_root_dir": str(tmp_path / "run"), "max_steps": 2, "limit_val_batches": 1},
              "model": {"init_args": {"warmup_steps": 1,
                                      "config": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}}},
              "data": {"init_args": {"files": [str(corpus)], "data_dir": str(tmp_path / "data"), "vocab_size": 300,
                                     "seq_len": 16, "batch_size": 4, "val_fraction": 0.5}}}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_plan_yaml_runs_under_fit(tmp_path: Path) -> None:
    """The acceptance run, on CPU: plan 1 node x 4 GPUs for a tiny model, then fit two steps with the plan."""
    configs = ["--config", str(REPO / "configs/default.yaml"), "--config", str(tiny_config(tmp_path))]
    out = tmp_path / "plan.yaml"
    planned = run_cli("plan", *configs, "--nodes", "1", "--gpus-per-node", "4", "--gpu-memory", "80GB",
                      "--out", str(out), cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "layouts that fit, fastest first" in planned.stdout and f"wrote {out}" in planned.stdout
    emitted = yaml.safe_load(out.read_text())
    trainer = emitted["trainer"]
    assert (trainer["num_nodes"], trainer["devices"]) == (1, 4)
    assert trainer["strategy"]["class_path"] in STRATEGIES
    # the global batch of the config (4 per device on 4 devices) is kept
    dp = 4 // trainer["strategy"]["init_args"].get("tensor_parallel_size", 1) // \
        trainer["strategy"]["init_args"].get("pipeline_parallel_size", 1)
    assert emitted["data"]["init_args"]["batch_size"] * dp * trainer["accumulate_grad_batches"] == 16

    fit = run_cli("fit", *configs, "--config", str(out), cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    losses = [float(r["train_loss"]) for r in read_metrics(tmp_path / "run", 0) if r.get("train_loss")]
    assert len(losses) == 2


def test_plan_for_two_nodes_ranks_layouts_and_answers(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    planned = run_cli("plan", "--config", str(REPO / "configs/default.yaml"), "--nodes", "2", "--gpus-per-node",
                      "8", "--gpu-memory", "80GB", "--out", str(out), "--answer", "--tokens", "1e9", cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr[-3000:]
    rows = [line for line in planned.stdout.splitlines() if line.startswith("│")]
    assert len(rows) == 8  # --top's default
    assert "largest Llama-shaped model that fits 16 GPUs" in planned.stdout and "days" in planned.stdout
    assert "on the configured model" in planned.stdout  # not to be read as the largest model's time
    with_layout = [line for line in planned.stdout.splitlines() if line.startswith("  with ")]
    assert len(with_layout) == 1  # the fastest (every ranked layout runs)
    assert yaml.safe_load(out.read_text())["trainer"]["num_nodes"] == 2

    bad = run_cli("plan", "--gpu-memory", "eighty", cwd=tmp_path)
    assert bad.returncode != 0 and "--gpu-memory" in bad.stderr
    missing = run_cli("plan", "--config", str(tmp_path / "none.yaml"), cwd=tmp_path)
    assert missing.returncode != 0 and "none.yaml: no such file" in missing.stderr


def test_the_3d_rule_comes_out_of_the_estimates() -> None:
    """A model that fits one GPU trains data-parallel; one whose state needs sharding gets ZeRO or tp inside the
    node; tp never spans nodes; a refused layout is never emitted."""
    small = Workload(ModelConfig(d_model=512, n_layers=8, n_heads=8, vocab_size=32000, max_seq_len=1024), 1024,
                     256, "bf16-mixed")
    cluster = Cluster(nodes=2, gpus_per_node=8, gpu_memory=80e9)
    ranked = plan(small, cluster, ("none",))
    assert ranked[0].config.tp == ranked[0].config.pp == 1
    big = Workload(ModelConfig(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672, vocab_size=128256,
                               max_seq_len=4096), 4096, 512, "bf16-mixed")
    ranked = plan(big, Cluster(nodes=8, gpus_per_node=8, gpu_memory=80e9), ("none",))
    assert ranked and all(r.config.tp <= 8 for r in ranked)
    assert all(r.estimate.peak_bytes <= 80e9 for r in ranked)
    assert ranked[0].config.tp * ranked[0].config.pp > 1 or ranked[0].config.zero_stage == 3
    assert strategy_yaml(ranked[0], cluster)["trainer"]["strategy"]["class_path"] in STRATEGIES
    needs = estimate(big, ParallelConfig(dp_shard=4, tp=8, cp=8, pp=2, microbatches=4, zero_stage=1))  # cp x pp
    assert needs.refused is not None
    with pytest.raises(ConfigError, match="context_parallel_size > 1 with pipeline_parallel_size > 1: "):
        strategy_yaml(Ranked(needs, 1.0, {}), cluster)


def test_fitting_takes_the_least_accumulation_that_fits() -> None:
    """Layouts of a 7B model on one node (every third: 25): `fitting` returns the estimate of the least accumulation
    whose peak fits (a scan of every one), None when none fits (it stops at the largest accumulation, which holds
    the least, instead of bisecting below it)."""
    work = Workload(ModelConfig(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336, vocab_size=32000,
                                max_seq_len=4096), 4096, 32, "bf16-mixed")
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_memory=80e9)
    budget = cluster.gpu_memory * USABLE_MEMORY
    seen = set()
    for layout in itertools.islice(layouts(work, cluster), 0, None, 3):
        local = work.global_batch // layout.dp
        scan = [_estimate(work, layout, a) for a in _divisors(local) if layout.pp == 1 or local // a >= layout.pp]
        least = next((e for e in scan if e is not None and e.peak_bytes <= budget), None)
        got = fitting(work, layout, budget)
        assert (got and (got.workload.accumulate, got.peak_bytes)) == (least and (least.workload.accumulate,
                                                                                   least.peak_bytes)), layout
        seen.add("none" if least is None else "one" if least.workload.accumulate == 1 else "more")
    assert seen == {"none", "one", "more"}  # layouts that never fit, fit at once, and fit only with accumulation


def test_nearest_changes_the_fewest_of_checkpointing_tp_pp_and_accumulation() -> None:
    """`nearest` (what `lit-lm check --gpu-memory` proposes): a 7B model under ZeRO-3 over one node that does not fit
    80 GB at one 16k sequence per GPU. The nearest fitting layout keeps cp, ep and ZeRO, never shrinks tp or pp, and
    changes as few of activation checkpointing, tp, pp and accumulation as any fitting candidate does (a scan of
    them): here not the fastest (tp2, accumulation and selective checkpointing), but tp4 with accumulation."""
    work = Workload(ModelConfig(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336, vocab_size=32000,
                                max_seq_len=16384), 16384, 8, "bf16-mixed")
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_memory=80e9)
    layout = ParallelConfig(dp_shard=8, zero_stage=3)
    budget = cluster.gpu_memory * USABLE_MEMORY
    assert estimate(work, layout).peak_bytes > budget
    best = nearest(work, layout, cluster)
    assert best is not None and best.estimate.peak_bytes <= budget
    got, mode = best.config, best.estimate.workload.checkpointing
    assert (got.cp, got.ep, got.zero_stage) == (1, 1, 3) and got.tp >= 1 and got.pp >= 1

    def changes(c: ParallelConfig, w: Workload) -> int:
        return (w.checkpointing != "none") + (c.tp != 1) + (c.pp != 1) + (w.accumulate != 1)

    fewest = min(changes(e.config, e.workload) for m in CHECKPOINTING for c in layouts(work, cluster)
                 if c.zero_stage == 3 and c.cp == 1 and c.dp_replicate == 1
                 for e in [fitting(dataclasses.replace(work, checkpointing=m), c, budget)] if e is not None)
    assert changes(got, best.estimate.workload) == fewest >= 1, (best.estimate.describe(), mode)
    assert nearest(work, ParallelConfig(dp_shard=8, zero_stage=3), Cluster(1, 8, 1e9)) is None  # nothing fits 1 GB


FEATURES = {"tp": dict(tp=2, sequence_parallel=True), "tp_no_sp": dict(tp=2, sequence_parallel=False),
            "pp": dict(pp=2), "cp": dict(cp=2), "ep": dict(ep=2), "hsdp": dict(dp_replicate=2),
            "zero1": dict(zero_stage=1), "zero2": dict(zero_stage=2), "zero3": dict(zero_stage=3)}


def _features(config: ParallelConfig) -> set[str]:
    """The FEATURES `config` has: a dimension of any size > 1, an option or ZeRO stage equal."""
    def has(key: str, value: object) -> bool:
        return (getattr(config, key) > 1 if key in ("tp", "pp", "cp", "ep", "dp_replicate")
                else getattr(config, key) == value)

    return {name for name, kwargs in FEATURES.items() if all(has(k, v) for k, v in kwargs.items())}


@pytest.mark.parametrize("moe", [False, True])
def test_the_planner_tries_every_pair_the_table_allows_and_proposes_no_refused_one(moe: bool) -> None:
    """Every pair of features (tp, sequence parallelism off, pp, cp, ep, HSDP, a ZeRO stage) that `REFUSED`
    allows for the model is among the layouts the planner tries (tp x MoE, ZeRO-2 x pp, HSDP with ZeRO-1/2
    included), no layout it tries or ranks is refused, and the yaml of each ranked kind constructs."""
    extra = dict(moe_experts=4, moe_d_ff=64) if moe else {}
    work = Workload(ModelConfig(d_model=64, n_layers=4, n_heads=4, vocab_size=256, **extra), 16384, 64, "bf16-mixed")
    cluster = Cluster(nodes=4, gpus_per_node=4, gpu_memory=80e9)  # pp2 leaves dp across nodes: HSDP is tried
    tried = list(layouts(work, cluster))
    assert all(c.refusal(moe) is None for c in tried)
    seen = {frozenset(p) for c in tried for f in [_features(c)] for p in itertools.combinations(sorted(f), 2)}
    for a, b in itertools.combinations(FEATURES, 2):
        if a[:2] == b[:2] or (not moe and "ep" in (a, b)):  # two ZeRO stages, tp with and without SP: no pair
            continue
        kwargs = {**FEATURES[a], **FEATURES[b]}
        allowed = {"hsdp": dict(zero_stage=1)}.get(a, {}) | {"hsdp": dict(zero_stage=1)}.get(b, {}) | kwargs
        if ParallelConfig(**allowed).refusal(moe) is None:  # HSDP needs a ZeRO stage: paired with one
            assert frozenset((a, b)) in seen, (a, b)
        else:
            assert frozenset((a, b)) not in seen or "hsdp" in (a, b), (a, b)
    ranked = plan(work, cluster, ("full",))
    assert ranked and all(r.config.refusal(moe) is None for r in ranked)
    assert any(r.config.tp > 1 for r in ranked)  # with MoE layers too (sequence parallelism off)
    for r in {tuple(sorted(_features(r.config))): r for r in ranked}.values():
        ComposedStrategy(**strategy_yaml(r, cluster)["trainer"]["strategy"]["init_args"])


@pytest.mark.parametrize("layout", [
    ParallelConfig(), ParallelConfig(dp_shard=4, zero_stage=2), ParallelConfig(dp_shard=2, tp=2, zero_stage=1),
    ParallelConfig(dp_shard=2, pp=2, microbatches=4, schedule="zb_h1"), ParallelConfig(dp_shard=4, ep=2, zero_stage=1),
    ParallelConfig(dp_shard=2, cp=2, zero_stage=3), ParallelConfig(dp_shard=2, ep=2, tp=2, sequence_parallel=False)])
@pytest.mark.parametrize("checkpointing", ["none", "selective"])
def test_emitted_strategy_arguments_are_the_strategies_own(layout: ParallelConfig, checkpointing: str) -> None:
    """Every runnable kind's yaml names a strategy class and arguments its constructor takes, the activation
    checkpointing the estimate assumed included; read back, they are the configuration planned."""
    moe = dict(moe_experts=4, moe_d_ff=64) if layout.ep > 1 else {}
    work = Workload(ModelConfig(d_model=64, n_layers=4, n_heads=4, vocab_size=256, **moe), 32, 16, "32-true",
                    checkpointing)
    est = estimate(work, layout)
    emitted = strategy_yaml(Ranked(est, 1.0, {}), Cluster(1, 4, 80e9))
    strategy = emitted["trainer"]["strategy"]
    module, _, name = strategy["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    assert cls(**strategy["init_args"]).activation_checkpointing == checkpointing
    args = {k: v for k, v in strategy["init_args"].items() if k != "activation_checkpointing"}
    assert ParallelConfig.from_args(**args) == dataclasses.replace(layout, dp_shard=None)
    assert emitted["data"]["init_args"]["batch_size"] == 16 // layout.dp


def test_quantities() -> None:
    assert quantity("80GB", "x") == 80e9 and quantity("80GiB", "x") == 80 * 2**30
    assert quantity("450GB/s", "x") == 450e9 and quantity("989T", "x") == 989e12 and quantity("1e9", "x") == 1e9
    with pytest.raises(ConfigError, match="--x"):
        quantity("lots", "x")


def test_plan_reads_muon_from_the_config_and_counts_its_step(tmp_path: Path) -> None:
    """`model.init_args.optimizer: lit_lm.optim.Muon` plans with Muon's state (one buffer per matrix: less than
    AdamW's), its Newton-Schulz work in the step time and the orthogonalizer's all-to-alls (exposed: in the step),
    and the table's notes say so."""
    muon = tmp_path / "muon.yaml"
    muon.write_text(yaml.safe_dump({"model": {"init_args": {"optimizer": {
        "class_path": "lit_lm.optim.Muon", "init_args": {"lr": 0.02, "ns_mode": "replicated"}}}}}))
    configs = ["--config", str(REPO / "configs/default.yaml"), "--config", str(tiny_config(tmp_path))]
    args = parser().parse_args([*configs, "--config", str(muon)])
    work = workload_from(read_configs(args.config), args, 4)
    assert (work.optimizer, work.ns_mode, work.ns_dtype) == ("muon", "replicated", "bfloat16")
    adamw = dataclasses.replace(work, optimizer="adamw")
    cluster = Cluster(1, 4, 80e9, 450e9, 50e9, 989e12, 0.4)
    layout = ParallelConfig(dp_shard=4, zero_stage=2)
    ours, theirs = estimate(work, layout), estimate(adamw, layout)
    assert ours.worst.optimizer < theirs.worst.optimizer and ours.work_flops > theirs.work_flops
    assert ours.wire_bytes("dp_shard", "all_to_all") > 0 == theirs.wire_bytes("dp_shard", "all_to_all")
    assert step_time(ours, cluster)[0] > step_time(theirs, cluster)[0]

    planned = run_cli("plan", *configs, "--config", str(muon), "--nodes", "1", "--gpus-per-node", "4", cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "Muon: optimizer state" in planned.stdout and "Newton-Schulz" in planned.stdout
