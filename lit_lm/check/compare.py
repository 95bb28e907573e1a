"""The harness's records of one case read as a report: per parameter, how its gradient and final value compare with
one process; losses and global norms per step; the verdict (`assert_parity`'s first failure, in training order) and
the likely cause of a disagreement, from the ratio of gradient norms and the layout's sizes.

    error  |g - g1| / max(|g1|, 1% of the whole gradient's norm), the harness's measure (`_assert_grads`): g is a
           rank's part of the gradient, g1 the same slice of the one-process gradient; the worst part and step
    ratio  |g| / |g1| of the worst part at the step it first breaks (or at its worst step when it does not): 2.0
           on 2 data-parallel ranks is a gradient summed, not averaged
    final  |w - w1| / |w1| of the parameter after the last step (worst rank)
"""

from __future__ import annotations

import math
from typing import Any, Optional

from lit_lm.parity import assert_parity

TOLERANCE = 1e-5  # the harness's fp32 tolerance


def compare(run: dict[str, Any], rtol: float = TOLERANCE) -> dict[str, Any]:
    """{"ok", "verdict", "params": rows, "losses", "norms", "lead"} for one harness result."""
    case, single = run["case"], run["single"]
    accumulate = case.trainer.get("accumulate_grad_batches", 1)
    rows = _gradient_rows(run, rtol)
    _final_values(run, rows)
    losses = [max(_rel(got["losses"][b], e) for got in run["ranks"]) if b < min(len(g["losses"]) for g in run["ranks"])
              else math.inf for b, e in enumerate(single["losses"])]
    norms = [max(_rel(got["steps"][k]["grad_norm"], s["grad_norm"]) for got in run["ranks"] if k < len(got["steps"]))
             for k, s in enumerate(single["steps"])]
    try:
        assert_parity(run, rtol=rtol)
        message = ""
    except AssertionError as err:
        message = str(err)
    lead = _lead(rows, losses, norms, accumulate, case.steps, rtol)
    return {"label": case.label, "optimizer": case.optimizer, "ok": not message, "message": message, "lead": lead,
            "params": list(rows.values()), "losses": losses, "norms": norms}


def _rel(got: float, expected: float) -> float:
    return abs(got - expected) / max(abs(expected), 1e-12)


def _gradient_rows(run: dict[str, Any], rtol: float) -> dict[str, dict[str, Any]]:
    single, rows = run["single"], {}
    for k, ref_step in enumerate(single["steps"]):
        ref = {name: g for name, _, _, g in ref_step["grads"]}
        total = math.sqrt(sum(g.square().sum().item() for g in ref.values() if g is not None))
        worst: dict[str, tuple[float, Optional[float], int, str]] = {}  # name -> (error, ratio, rank, problem)
        for name, g in ref.items():
            rows.setdefault(name, {"name": name, "shape": None if g is None else list(g.shape), "error": 0.0,
                                   "ratio": None, "step": None, "rank": None, "final": None, "problem": ""})
        for rank, got in enumerate(run["ranks"]):
            for name, shape, index, grad in got["steps"][k]["grads"] if k < len(got["steps"]) else []:
                expected = ref.get(name, "absent")
                if isinstance(expected, str):
                    result = (math.inf, None, rank, "a parameter the one-process model does not have")
                    rows.setdefault(name, {"name": name, "shape": list(shape), "error": 0.0, "ratio": None,
                                           "step": None, "rank": None, "final": None, "problem": ""})
                elif expected is None:
                    frozen_ok = grad is None or not grad.any()
                    result = (0.0 if frozen_ok else math.inf, None, rank,
                              "" if frozen_ok else "has a gradient; one process: none (frozen)")
                elif grad is None:
                    result = (math.inf, 0.0, rank, "no gradient; one process: one")
                elif tuple(grad.shape) != tuple(expected[index].shape):
                    held, wanted = tuple(grad.shape), tuple(expected[index].shape)
                    result = (math.inf, None, rank, f"holds {held}, expected {wanted}")
                else:
                    part = expected[index]
                    scale = max(expected.norm().item(), 0.01 * total, 1e-30)
                    result = ((grad - part).norm().item() / scale, grad.norm().item() / max(part.norm().item(), 1e-30),
                              rank, "")
                if name not in worst or result[0] > worst[name][0]:
                    worst[name] = result
        for name, (error, ratio, rank, problem) in worst.items():
            row = rows[name]
            breaks = error > rtol and row["step"] is None
            if breaks or (row["step"] is None and error >= row["error"]):
                row.update(ratio=ratio, rank=rank, problem=problem or row["problem"])
            if breaks:
                row["step"] = k
            row["error"] = max(row["error"], error)
    return rows


def _final_values(run: dict[str, Any], rows: dict[str, dict[str, Any]]) -> None:
    single = run["single"]["params"]
    for got in run["ranks"]:
        for name, value in got["params"].items():
            if name in rows and name in single:
                expected = single[name]
                err = (value - expected).norm().item() / max(expected.norm().item(), 1e-12)
                rows[name]["final"] = max(rows[name]["final"] or 0.0, err)


def _lead(rows: dict[str, dict[str, Any]], losses: list[float], norms: list[float], accumulate: int, steps: int,
          rtol: float) -> Optional[dict[str, Any]]:
    """The first disagreement in training order: a loss of the step's batches, a gradient (the worst at that step),
    the pre-clip norm; after the last step a final value."""
    for k in range(steps):
        broken = [r for r in rows.values() if r["step"] == k]
        worst = max(broken, key=lambda r: r["error"]) if broken else None
        param = {} if worst is None else {"param": worst["name"], "ratio": worst["ratio"], "problem": worst["problem"],
                                          "param_error": worst["error"]}
        for b in range(k * accumulate, (k + 1) * accumulate):
            if b < len(losses) and losses[b] > rtol:  # with the worst gradient of that step, if one breaks
                return {"kind": "loss", "step": k, "batch": b, "error": losses[b], **param}
        if worst is not None:
            return {"kind": "gradient", "step": k, "error": worst["error"], **param}
        if k < len(norms) and norms[k] > rtol:
            return {"kind": "norm", "step": k, "error": norms[k]}
    final = [r for r in rows.values() if (r["final"] or 0.0) > rtol]
    if final:
        row = max(final, key=lambda r: r["final"])
        return {"kind": "final", "step": steps - 1, "param": row["name"], "error": row["final"], "ratio": None,
                "problem": ""}
    return None


def likely_cause(lead: Optional[dict[str, Any]], message: str, dims: dict[str, int], tied: bool) -> str:
    """What usually produces this disagreement, from its kind, the ratio of norms and the layout's sizes."""
    if rows_message(message):
        return "the ranks read the wrong rows: sampler settings (distributed_sampler_kwargs) from the wrong group"
    if lead is None:
        if "no rank holds" in message:
            return "no rank returns part of a gradient: a parameter left out of the strategy's named_grads"
        return "a parameter or buffer differs after loading or training (see the message)"
    kind = lead["kind"]
    if kind == "loss":
        forward = ("the forward differs: attention over a split sequence (cp), a sharded layer (tp), a pipeline "
                   "stage's inputs or the batch split")
        if lead.get("param"):
            return f"{forward}; its gradients: {ratio_cause(lead['ratio'], dims, lead['param'], tied, lead['problem'])}"
        return forward
    if kind == "norm":
        return "the global norm counts some gradient shards twice or misses some (the groups it is summed over)"
    if kind == "final":
        return ("the update differs, not the gradient: the optimizer's param groups or settings on sharded state "
                "(weight decay, lr, eps), clipping, or a step callback (pruning masks) applied differently")
    return ratio_cause(lead.get("ratio"), dims, lead.get("param", ""), tied, lead.get("problem", ""))


def rows_message(message: str) -> bool:
    """`assert_parity`'s report of the rows the ranks read (checked before anything else)."""
    return any(m in message for m in ("read the same row", "read other rows", "read a row twice",
                                      "not the one-process batch"))


def ratio_cause(ratio: Optional[float], dims: dict[str, int], name: str = "", tied: bool = False,
                problem: str = "") -> str:
    if problem:
        return problem
    if ratio is None or not math.isfinite(ratio):
        return "the gradient has another shape or is missing"
    if ratio < 1e-3:
        return "the gradient is (almost) zero where one process has one: a collective or a hook skipped"
    causes = []
    if tied and dims.get("pp", 1) > 1 and abs(ratio - 2) < 0.04 and ("tok_embeddings" in name or "lm_head" in name):
        causes.append("the tied embedding/head's gradient summed twice over the first and last pipeline stage")
    names = ["dp", "tp", "cp", "ep", "pp"] if dims.get("dp_replicate", 1) == 1 else \
        ["dp", "dp_shard", "dp_replicate", "tp", "cp", "ep", "pp"]
    for dim in names:
        n = dims.get(dim, 1)
        if n > 1 and abs(ratio - n) <= 0.02 * n:
            causes.append(f"a gradient summed, not averaged, over {dim} ({n} ranks)")
        elif n > 1 and abs(ratio - 1 / n) <= 0.02 / n:
            causes.append(f"a gradient averaged over {dim} ({n} ranks) once too often, or only 1/{n} of it arrived")
    if not causes and abs(ratio - 1) < 0.02:
        causes.append("the right size in another direction: rows of another shard or rank, a reduction missing "
                      "among ranks that saw other tokens, or the wrong token positions")
    if not causes:
        causes.append(f"a factor {ratio:.3g} no parallel size explains: a scale applied on some ranks only (loss "
                      "weighting, microbatch count, clipping coefficient)")
    return "; or ".join(causes)
