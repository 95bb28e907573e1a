"""`lit-lm check`: the user's own layout against one process, before it spends cluster time.

    lit-lm check --config configs/default.yaml --config configs/strategies/zero2.yaml --trainer.devices 2
    lit-lm check --config my_run.yaml --steps 3 --tolerance 1e-5 --json > check.json

Reads the config files as `fit` does (the same parser), trains a scaled-down copy of the model (`scale`) for a few
steps under the yaml's strategy on `trainer.devices` CPU gloo ranks and the same steps in one process, through the
parity harness (`lit_lm.parity`), with plain SGD and with the module's own optimizer; prints per parameter the
gradient agreement, losses and norms, communication and memory against the planner, the time per step and a verdict.
Exit codes: 0 agrees, 1 disagrees (the verdict names the first parameter that breaks, its ratio of norms and the
likely cause), 2 the config cannot run (one line, as `fit` says it). See docs/check.md.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Any, Optional

from rich.console import Console

from lit_lm.check.build import CheckPlan, parse, plan_check
from lit_lm.check.compare import TOLERANCE, compare, likely_cause
from lit_lm.check.costs import costs
from lit_lm.check.fit import fit, run_estimate
from lit_lm.check.report import render, summary, to_json
from lit_lm.parity import run_parity
from lit_lm.planner.cli import quantity

EXIT_DISAGREES = 1


def options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The check's own flags; the rest (--config, --trainer.devices, any dotted key) is `fit`'s."""
    p = argparse.ArgumentParser(prog="lit-lm check", description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps compared (default 2)")
    p.add_argument("--tolerance", type=float, default=TOLERANCE, help=f"relative tolerance (default {TOLERANCE:g})")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--gpu-memory", default=None, help="per GPU, as `lit-lm plan` takes it (e.g. 80GB): whether each "
                   "rank fits, and if not the nearest layout that does")
    p.add_argument("--full-size", action="store_true", help="the model at full size on fake ranks of the real world "
                   "size: memory and bytes per rank role against the planner (lit_lm/check/full_size.py)")
    args, rest = p.parse_known_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args, rest


def run_checks(plans: list[CheckPlan], env: Optional[dict[str, str]] = None) -> dict[int, str]:
    """Every plan's cases, one spawned world per world size (shared by the plans of that size, `env` added to its
    ranks' environment); fills `plan.runs`.
    Returns {plan index: why its world did not run} for worlds whose ranks raised (a world of several plans then runs
    each alone, so one failing config does not hide the others; a world of one plan is not run again: its error
    is the plan's, and a rank that timed out would make the user wait as long again)."""
    errors: dict[int, str] = {}
    for world in sorted({p.world for p in plans}):
        members = [i for i, p in enumerate(plans) if p.world == world]
        try:
            _run(plans, members, world, env)
        except Exception as err:  # noqa: BLE001 - a rank's exception, reported per plan below
            if len(members) == 1:
                errors[members[0]] = _last_line(err)
                continue
            for i in members:
                try:
                    _run(plans, [i], world, env)
                except Exception as err:  # noqa: BLE001
                    errors[i] = _last_line(err)
    return errors


def _run(plans: list[CheckPlan], members: list[int], world: int, env: Optional[dict[str, str]]) -> None:
    cases = [c for i in members for c in plans[i].cases]
    runs = run_parity(cases, world, env=env)
    for i in members:
        n = len(plans[i].cases)
        plans[i].runs, runs = runs[:n], runs[n:]


def _last_line(err: BaseException) -> str:
    """A rank's exception as one line: the last line of its traceback (mp.spawn sends the text)."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()] or \
        traceback.format_exception_only(type(err), err)
    return lines[-1].strip()


def report(plan: CheckPlan, rtol: float, error: str = "", gpu_memory: Optional[float] = None) -> dict[str, Any]:
    """The summary of a plan whose runs are filled (or whose world failed with `error`); with `gpu_memory` (bytes
    per GPU) also whether the full-size run fits (`lit_lm.check.fit`)."""
    if not plan.runs and not error:
        error = "no run came back (run_checks was not called, or its error was not passed)"
    tied = plan.small.tie_embeddings
    results = []
    for run in plan.runs:
        result = compare(run, rtol)
        result["cause"] = "" if result["ok"] else likely_cause(result["lead"], result["message"], plan.dims, tied)
        results.append(result)
    measured = costs(plan, plan.runs[-1]) if plan.runs else {}
    fits = fit(plan, run_estimate(plan), gpu_memory) if gpu_memory is not None else None
    return summary(plan, results, measured, rtol, error, fits)


def main(argv: list[str], cli_class: type, defaults: list[str], mutation: Optional[Any] = None) -> None:
    """`lit-lm check ...` (`lit_lm.cli` passes its LightningCLI class and default configs); exits with the code."""
    args, rest = options(argv)
    gpu_memory = quantity(args.gpu_memory, "gpu-memory") if args.gpu_memory is not None else None
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    if args.full_size:
        from lit_lm.check.full_size import main as full_size

        plan = plan_check(parse(rest, cli_class, defaults), rest, optimizers=("module",))
        if not full_size(plan, args.json, console, gpu_memory):
            sys.exit(EXIT_DISAGREES)
        return
    plan = plan_check(parse(rest, cli_class, defaults), rest, steps=args.steps, mutation=mutation)
    errors = run_checks([plan])
    result = report(plan, args.tolerance, errors.get(0, ""), gpu_memory)
    if args.json:
        print(to_json(result))
    else:
        render(result, console)
    if not result["ok"]:
        sys.exit(2 if result["error"] else EXIT_DISAGREES)
