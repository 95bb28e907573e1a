"""`--gpu-memory`: whether the checked run fits its GPUs, per rank, and if not the nearest layout that does.

    fit(plan, run_estimate(plan), gpu_memory=80e9)
        -> {"budget": ..., "ranks": [{"pp_rank", "peak", "fits"}], "fits": ..., "nearest": {...} or None}

A rank fits when the planner's peak for the run (the user's precision, on CUDA: what `lit-lm plan` ranks by) is
within the planner's budget, `USABLE_MEMORY` of the GPU's memory (the CUDA context, the allocator's fragmentation
and library workspaces take the rest). Where a rank does not fit, the nearest layout that does comes from the
planner's own search (`lit_lm.planner.plan.nearest`: activation checkpointing, a larger tp or pp, more
accumulation, as few changed as possible, then the fastest), with the yaml that runs it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from lit_lm.check.build import CheckPlan, build_strategy
from lit_lm.lora import lora_from
from lit_lm.planner.estimate import PRECISIONS, Estimate, Workload, estimate
from lit_lm.planner.optimizer import optimizer_fields
from lit_lm.planner.plan import USABLE_MEMORY, Cluster, nearest, strategy_yaml


def checkpointing(plan: CheckPlan) -> str:
    """The strategy's activation checkpointing mode (none where it has none)."""
    return getattr(build_strategy(plan.cases[0].strategy.args[0]), "activation_checkpointing", "none")


def run_workload(plan: CheckPlan, precision: str = "", device: str = "cuda") -> Workload:
    """The checked run as the planner takes it: the user's model, sequence, global batch, accumulation,
    checkpointing and FP8 recipe; by default at the user's precision on CUDA (what the cluster runs, and what
    `lit-lm plan` ranks by)."""
    precision = precision or (plan.precision if plan.precision in PRECISIONS else "32-true")
    module = dict(plan.cases[0].module[1]) if plan.cases and plan.cases[0].module else {}
    return Workload(plan.model, plan.model.max_seq_len, plan.batch_size * plan.dims["dp"] * plan.accumulate,
                    precision, checkpointing(plan), plan.accumulate, device, module.get("fp8"),
                    lora=lora_from(module.get("lora")), **optimizer_fields(module.get("optimizer")))


def run_estimate(plan: CheckPlan, precision: str = "", device: str = "cuda") -> Estimate:
    """The planner's estimate of the checked run (`run_workload`) on the plan's layout."""
    layout = dataclasses.replace(plan.parallel, dp_shard=plan.dims["dp_shard"])
    return estimate(run_workload(plan, precision, device), layout)


def fit(plan: CheckPlan, est: Estimate, gpu_memory: float) -> dict[str, Any]:
    budget = gpu_memory * USABLE_MEMORY
    ranks = [{"pp_rank": r, "peak": rank.peak, "fits": rank.peak <= budget} for r, rank in enumerate(est.ranks)]
    out: dict[str, Any] = {"gpu_memory": gpu_memory, "usable": USABLE_MEMORY, "budget": budget, "ranks": ranks,
                           "fits": all(r["fits"] for r in ranks), "nearest": None}
    if out["fits"]:
        return out
    cluster = Cluster(plan.nodes, plan.world // plan.nodes, gpu_memory)
    best = nearest(est.workload, est.config, cluster)
    if best is not None:
        out["nearest"] = {"layout": best.estimate.describe(), "checkpointing": best.estimate.workload.checkpointing,
                          "peak": best.estimate.peak_bytes, "step_time": best.step_time, "reason": best.reason,
                          "yaml": strategy_yaml(best, cluster, plan.precision)}
    return out


def lines(result: dict[str, Any], roles: list[tuple[str, int]], count: Any) -> list[str]:
    """The verdict on fitting as text, one line per rank role (`roles`: its name and pipeline rank), then the
    nearest layout that fits (or that none does); `count` formats bytes."""
    where = f"{count(result['budget'])}B usable of {count(result['gpu_memory'])}B ({result['usable']:.0%})"
    out = []
    for name, pp_rank in roles:
        r = result["ranks"][pp_rank]
        verdict = "fits" if r["fits"] else "does NOT fit"
        out.append(f"{name}: {count(r['peak'])}B at peak for the run, {verdict} in {where}")
    if result["fits"]:
        return out
    best = result["nearest"]
    if best is None:
        out.append("nearest layout that fits: none with activation checkpointing, a larger tp or pp, or more "
                   "accumulation on these GPUs (lit-lm plan searches every layout)")
    else:
        out.append(f"nearest layout that fits: {best['layout']}, activation checkpointing {best['checkpointing']}: "
                   f"{count(best['peak'])}B at peak ({best['reason']})")
        out.append("  as yaml, after your configs: " + yaml.safe_dump(best["yaml"], default_flow_style=True,
                                                                       width=10**6, sort_keys=False).strip())
    return out
