"""What the check's ranks measured against the planner's figures (`lit_lm.planner.estimate`) for the same model and
layout: communication bytes per (group, op) of one optimizer step, model-state bytes per rank, seconds per step; and the
planner's figures for the user's full-size model, which is what the cluster will see."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Optional

from lit_lm.check.build import CheckPlan
from lit_lm.check.meter import Meter
from lit_lm.config import ConfigError
from lit_lm.check.fit import run_estimate
from lit_lm.lora import lora_from
from lit_lm.planner.estimate import Workload, estimate
from lit_lm.planner.optimizer import optimizer_fields


def costs(plan: CheckPlan, run: dict[str, Any]) -> dict[str, Any]:
    """Measured against estimated for the case's run (the module's optimizer: the state the planner counts)."""
    case = run["case"]
    meters = [_meter(r) for r in run["ranks"]]
    out: dict[str, Any] = {"time": _times(meters, _meter(run["single"]), plan.accumulate)}
    small = _estimate(plan, plan.small, case.global_batch * plan.accumulate, "32-true", device="cpu")  # its ranks
    try:  # the full-size run's figure, as `--gpu-memory` and `--full-size` give it (`lit_lm.check.fit`)
        full: Any = run_estimate(plan)
    except (ConfigError, ValueError, KeyError) as err:
        full = f"no estimate: {err}"
    steps = [_step_comm(m, plan.accumulate) for m in meters]
    measured = {k: max(s.get(k, 0) for s in steps) for s in steps for k in s}
    if isinstance(small, str):
        out["estimate_error"] = small
    else:
        keys = sorted(set(measured) | {k for r in small.ranks for k in r.comm})
        out["comm"] = [_comm_row(g, op, measured.get((g, op), 0), max(r.comm.get((g, op), 0) for r in small.ranks),
                                 _stage_mean(steps, meters, (g, op))) for g, op in keys]
        state = [m.state[-1] for m in meters if m.state]
        out["memory"] = {"measured": max((s["total"] for s in state), default=0),
                         "estimate": max(r.model_state for r in small.ranks)}
    if not isinstance(full, str):
        worst = full.worst
        out["full_model"] = {"peak_bytes": worst.peak, "model_state_bytes": worst.model_state,
                             "activation_bytes": worst.activations,
                             "wire_bytes": {g: full.wire_bytes(g) for g in full.groups}}
    return out


def _meter(records: dict[str, Any]) -> Meter:
    return next(c for c in records["callbacks"] if isinstance(c, Meter))


def _estimate(plan: CheckPlan, cfg: Any, global_batch: int, precision: str, device: str = "cuda") -> Any:
    """The planner's estimate, or why there is none (a layout it does not model); `device`: what the ranks run on
    (the check's own run: CPU gloo ranks, whose ZeRO-1/2 collectives take gloo's forms)."""
    layout = dataclasses.replace(plan.parallel, dp_shard=plan.dims["dp_shard"])
    try:
        module = dict(plan.cases[0].module[1]) if plan.cases and plan.cases[0].module else {}
        return estimate(Workload(cfg, cfg.max_seq_len, global_batch, precision, accumulate=plan.accumulate,
                                 fp8=module.get("fp8"), device=device, lora=lora_from(module.get("lora")),
                                 **optimizer_fields(module.get("optimizer"))),
                        layout)
    except (ConfigError, ValueError, KeyError) as err:
        return f"no estimate: {err}"


# ops whose bytes depend on the data: the planner's figure is their expectation, which the mean over the ranks of a
# pipeline stage meets exactly (ep's all-to-all: every rank sends its own tokens' rows, and the rows it received,
# which under imbalanced routing are more on some ranks and fewer on others, the same in total)
EXPECTED = {"all_to_all"}


def _comm_row(group: str, op: str, measured: int, estimate: int, mean: float) -> dict[str, Any]:
    """One (group, op): the most bytes a rank moved, the planner's figure and whether they agree; for an op of
    `EXPECTED` the ranks' mean is what agrees."""
    row = {"group": group, "op": op, "measured": measured, "estimate": estimate, "agree": measured == estimate}
    if op in EXPECTED:
        row.update(mean=mean, agree=abs(mean - estimate) < 0.5)
    return row


def _step_comm(meter: Meter, accumulate: int) -> dict[tuple[str, str], int]:
    """Bytes per (group, op) of a rank's last optimizer step."""
    step: dict[tuple[str, str], int] = {}
    for batch in meter.batches[-accumulate:]:
        for key, nbytes in batch["comm"].items():
            step[key] = step.get(key, 0) + nbytes
    return step


def _stage_mean(steps: list[dict[tuple[str, str], int]], meters: list[Meter], key: tuple[str, str]) -> float:
    """The mean over each pipeline stage's ranks of their bytes for `key`, the largest over the stages (the
    planner's figure is per stage)."""
    stages: dict[int, list[int]] = {}
    for step, m in zip(steps, meters):
        stages.setdefault(m.pp_rank, []).append(step.get(key, 0))
    return max((statistics.fmean(b) for b in stages.values()), default=0.0)


def _times(meters: list[Meter], single: Meter, accumulate: int) -> dict[str, Optional[float]]:
    """Median seconds per optimizer step after the first (setup and first-call costs), the slowest rank."""
    def per_step(m: Meter) -> Optional[float]:
        steps = [sum(b["seconds"] for b in m.batches[i:i + accumulate]) for i in range(0, len(m.batches), accumulate)]
        later = steps[1:] or steps
        return statistics.median(later) if later else None

    ranks = [t for t in map(per_step, meters) if t is not None]
    return {"ranks": max(ranks) if ranks else None, "single": per_step(single)}
