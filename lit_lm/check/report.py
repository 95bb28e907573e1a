"""The report of `lit-lm check`: a verdict line, the layout, what was scaled, a table per case (every parameter's
gradient agreement), losses and norms, communication and memory against the planner; or the same as JSON.

Colour only on a terminal: rich drops styles when stdout is a file or a pipe (CI logs stay plain text). Every text
put into rich markup is escaped (`_e`): a rank's error (gloo's start with a bracketed source path), a parameter or
callback name, a path read as markup would raise rich's MarkupError or lose its brackets."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Optional

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lit_lm.check.build import CheckPlan
from lit_lm.check.compare import rows_message
from lit_lm.check.fit import lines


def summary(plan: CheckPlan, results: list[dict[str, Any]], costs: dict[str, Any], rtol: float,
            error: str = "", fits: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Everything the report says, JSON-ready; `ok` and `verdict` first; `fits`: whether the full-size run fits its
    GPUs (`lit_lm.check.fit`), said in the verdict (a run that does not fit is not ok)."""
    failed = next((r for r in results if not r["ok"]), None)
    if error:
        verdict = f"FAIL: the run does not start under {plan.strategy} on {plan.world} ranks: {error}"
    elif failed is not None:
        verdict = f"FAIL ({failed['label']}): {_what(failed, rtol)} -- likely: {failed['cause']}"
    else:
        steps = plan.cases[0].steps
        n = len(results[0]["params"]) if results else 0
        verdict = (f"PASS: {plan.strategy} on {plan.world} ranks agrees with one process within {rtol:g}: losses, "
                   f"pre-clip norms, the gradients of all {n} parameters and their final values over {steps} steps, "
                   "plain SGD and the module's optimizer")
    if fits is not None and not error:
        verdict += _fit_verdict(fits)
    return _plain({"ok": not error and failed is None and (fits is None or fits["fits"]), "verdict": verdict,
                   "strategy": plan.strategy, "fit": fits,
                   "world": plan.world, "layout": _layout(plan),
                   "dims": plan.dims, "tolerance": rtol, "config": plan.argv,
                   "model": {"params": plan.model.num_params(), "checked_params": plan.small.num_params(),
                             "changes": plan.notes},
                   "runs": results, "costs": costs, "error": error})


def _fit_verdict(fits: dict[str, Any]) -> str:
    gpu = f"{_count(fits['gpu_memory'])}B GPUs"
    if fits["fits"]:
        return f"; at full size every rank fits {gpu}"
    short = ", ".join(f"stage {r['pp_rank']}" for r in fits["ranks"] if not r["fits"])
    best = fits["nearest"]
    nearest = f"{best['layout']}, activation checkpointing {best['checkpointing']}" if best else "none"
    return f"; at full size it does NOT fit {gpu} ({short}); nearest that fits: {nearest}"


def _layout(plan: CheckPlan) -> str:
    return dataclasses.replace(plan.parallel, dp_shard=plan.dims["dp_shard"]).describe()


def _what(result: dict[str, Any], rtol: float) -> str:
    lead, message = result["lead"], result["message"]
    if lead is None or rows_message(message):
        return message.splitlines()[0] if message else "disagrees"
    ratio = "" if lead.get("ratio") is None else f", ratio of norms {lead['ratio']:.4f}"
    if lead["kind"] == "loss":
        text = f"the loss of batch {lead['batch']} (step {lead['step']}) differs by {lead['error']:.2e} (> {rtol:g})"
        if lead.get("param"):
            text += (f"; the worst gradient of that step: {lead['param']}, error {lead['param_error']:.2e}{ratio}")
        return text
    if lead["kind"] == "norm":
        return f"the pre-clip gradient norm of step {lead['step']} differs by {lead['error']:.2e} (> {rtol:g})"
    what = "gradient" if lead["kind"] == "gradient" else "final value"
    return (f"the {what} of {lead['param']} differs from step {lead['step']}: error {lead['error']:.2e} "
            f"(> {rtol:g}){ratio}")


def render(report: dict[str, Any], console: Console) -> None:
    ok = report["ok"]
    console.print(f"[bold]lit-lm check[/]: {_e(report['strategy'])} on {report['world']} CPU gloo ranks "
                  f"({_e(report['layout'])}), {_count(report['model']['checked_params'])} of the model's "
                  f"{_count(report['model']['params'])} parameters")
    for note in report["model"]["changes"]:
        console.print(f"  scaled: {_e(note)}")
    for run in report["runs"]:
        console.print(_param_table(run, report["tolerance"]))
        console.print(f"  losses: worst {_num(_worst(run['losses']))}; pre-clip norms: worst "
                      f"{_num(_worst(run['norms']))} (relative to one process)")
        if not run["ok"]:
            console.print(f"  [red]{_e(run['message'].splitlines()[0]) if run['message'] else ''}[/]")
    costs = report["costs"]
    if costs.get("comm"):
        table = Table(title="communication per optimizer step (the check's model), bytes per rank",
                      title_justify="left")
        for col in ("group", "op", "measured", "planner", "agree"):
            table.add_column(col, justify="left" if col in ("group", "op") else "right")
        for c in costs["comm"]:
            agree = "yes" if c["agree"] else "[yellow]no[/]"
            if "mean" in c:  # a data-dependent op: the planner's expectation against the ranks' mean
                agree += f" (mean {_count(round(c['mean']))})"
            table.add_row(_e(c["group"]), _e(c["op"]), _count(c["measured"]), _count(c["estimate"]), agree)
        console.print(table)
    if costs.get("memory"):
        m = costs["memory"]
        console.print(f"model state per rank (the check's model, fp32): measured {_count(m['measured'])}B, "
                      f"planner {_count(m['estimate'])}B")
    if costs.get("estimate_error"):
        console.print(f"planner: {_e(costs['estimate_error'])}")
    if costs.get("full_model"):
        f = costs["full_model"]
        wire = ", ".join(f"{_e(g)} {_count(b)}B" for g, b in f["wire_bytes"].items()) or "none"
        console.print(f"your model at full size (planner): {_count(f['peak_bytes'])}B per rank at peak (state "
                      f"{_count(f['model_state_bytes'])}B, activations {_count(f['activation_bytes'])}B); on the "
                      f"wire per step: {wire}")
    if report.get("fit") is not None:
        names = [(f"stage {r['pp_rank']}", r["pp_rank"]) for r in report["fit"]["ranks"]]
        for line in lines(report["fit"], names, _count):
            console.print(_e(line))
    t = costs.get("time") or {}
    if t.get("ranks") is not None:
        console.print(f"time per step (the check's model, CPU): {t['ranks'] * 1e3:.0f} ms on the ranks, "
                      f"{(t['single'] or 0) * 1e3:.0f} ms in one process")
    style = "bold green" if ok else "bold red"
    console.print(f"[{style}]{_e(report['verdict'])}[/]")


def _param_table(run: dict[str, Any], rtol: float) -> Table:
    table = Table(title=f"{_e(run['label'])}: gradients against one process (tolerance {rtol:g})", title_justify="left")
    for col in ("parameter", "shape", "ratio of norms", "error", "breaks at", "final"):
        table.add_column(col, justify="left" if col in ("parameter", "shape") else "right")
    for row in run["params"]:
        bad = row["step"] is not None or (row["final"] is not None and float(row["final"]) > rtol)
        name = f"[red]{_e(row['name'])}[/]" if bad else _e(row["name"])
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.4f}"
        step = "-" if row["step"] is None else f"step {row['step']}"
        shape = "none" if row["shape"] is None else "x".join(map(str, row["shape"]))
        problem = f" {_e(row['problem'])}" if row["problem"] else ""
        table.add_row(name, shape, ratio, _num(row["error"]), step + problem, _num(row["final"]))
    return table


def _e(text: Any) -> str:
    """`text` as rich markup that shows it as it is."""
    return escape(str(text))


def _worst(values: list[Any]) -> float:
    return max((float(v) for v in values), default=0.0)


def _num(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return f"{x:.1e}" if x else "0"


def _count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:g}"


def _plain(x: Any) -> Any:
    """JSON-ready: tuples to lists, infinities and NaN to strings."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2)
