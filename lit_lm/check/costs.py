"""What the check's ranks measured against the planner's figures (`lit_lm.estimate`) for the same model and layout:
communication bytes per (group, op) of one optimizer step, model-state bytes per rank, seconds per step; and the
planner's figures for the user's full-size model, which is what the cluster will see."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Optional

from lit_lm.check.build import CheckPlan
from lit_lm.check.meter import Meter
from lit_lm.config import ConfigError
from lit_lm.estimate import PRECISIONS, Workload, estimate


def costs(plan: CheckPlan, run: dict[str, Any]) -> dict[str, Any]:
    """Measured against estimated for the case's run (the module's optimizer: the state the planner counts)."""
    case = run["case"]
    meters = [_meter(r) for r in run["ranks"]]
    out: dict[str, Any] = {"time": _times(meters, _meter(run["single"]), plan.accumulate)}
    small = _estimate(plan, plan.small, case.global_batch * plan.accumulate, "32-true")
    full = _estimate(plan, plan.model, plan.batch_size * plan.dims.get("dp", plan.world) * plan.accumulate,
                     plan.precision if plan.precision in PRECISIONS else "32-true")
    measured = _step_comm(meters, plan.accumulate)
    if isinstance(small, str):
        out["estimate_error"] = small
    else:
        keys = sorted(set(measured) | {k for r in small.ranks for k in r.comm})
        out["comm"] = [{"group": g, "op": op, "measured": measured.get((g, op), 0),
                        "estimate": max(r.comm.get((g, op), 0) for r in small.ranks)} for g, op in keys]
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


def _estimate(plan: CheckPlan, cfg: Any, global_batch: int, precision: str) -> Any:
    """The planner's estimate, or why there is none (a layout it does not model)."""
    layout = dataclasses.replace(plan.parallel, dp_shard=plan.dims["dp_shard"])
    try:
        return estimate(Workload(cfg, cfg.max_seq_len, global_batch, precision, accumulate=plan.accumulate), layout)
    except (ConfigError, ValueError, KeyError) as err:
        return f"no estimate: {err}"


def _step_comm(meters: list[Meter], accumulate: int) -> dict[tuple[str, str], int]:
    """Bytes per (group, op) of the last optimizer step, the largest over the ranks."""
    out: dict[tuple[str, str], int] = {}
    for m in meters:
        step: dict[tuple[str, str], int] = {}
        for batch in m.batches[-accumulate:]:
            for key, nbytes in batch["comm"].items():
                step[key] = step.get(key, 0) + nbytes
        for key, nbytes in step.items():
            out[key] = max(out.get(key, 0), nbytes)
    return out


def _times(meters: list[Meter], single: Meter, accumulate: int) -> dict[str, Optional[float]]:
    """Median seconds per optimizer step after the first (setup and first-call costs), the slowest rank."""
    def per_step(m: Meter) -> Optional[float]:
        steps = [sum(b["seconds"] for b in m.batches[i:i + accumulate]) for i in range(0, len(m.batches), accumulate)]
        later = steps[1:] or steps
        return statistics.median(later) if later else None

    ranks = [t for t in map(per_step, meters) if t is not None]
    return {"ranks": max(ranks) if ranks else None, "single": per_step(single)}
