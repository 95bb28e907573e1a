"""`lit-lm check --full-size`: the user's model at its real size on its real world size, one process per rank role,
on fake ranks (`full_size_rank.py`), its memory and bytes beside the planner's (`lit_lm.planner.estimate`).

    lit-lm check --full-size --config configs/default.yaml --config configs/models/llama3_8b.yaml \
        --config my_layout.yaml --trainer.devices 8 --trainer.num_nodes 8

A rank role is what decides a rank's bytes: its pipeline stage (the first holds the embedding, the last the norm,
head and loss; middle stages of the same layer count are one role), its position in a group whose shards can
differ (the last tensor-parallel rank where a size is not divisible by tp; the last ZeRO row, whose `torch.chunk`
rows may be short), and nothing else (dp replicas, cp peers and ep peers under balanced routing hold the same
shapes). Each role runs in its own process (two at a time), builds nothing but shapes, and reports:

    model state     parameters (with ZeRO master shards), gradients, optimizer state: bytes after the gradients
                    are final, before the update (exact; each storage once)
    activations     the most bytes the step's forward held at once (what autograd saved, the pipeline's held
                    stage outputs and received inputs)
    buffers         transient gathers (ZeRO-3's whole units) and the data-parallel engines' communication
                    buffers, live at the peak
    peak            the most bytes live at once in the step, and what it was made of
    communication   bytes per (group, op) of one optimizer step (the accounting layer's logical bytes)

Each figure stands beside the planner's for the role's pipeline rank (the planner reports the largest shard of a
group: its rank 0). A figure disagrees when it differs by more than `TOLERANCE` (5%) of the planner's, and, for
memory, by more than `MEMORY_FLOOR` (1%) of the role's measured peak (a category too small to change whether the
run fits does not fail it). The planner counts a pipeline's held outputs as buffers: they are compared with the
activations here, where the step holds them. What a shapes-only run cannot see: the allocator's cache and
fragmentation, library workspaces (cuBLAS, NCCL), CUDA context; and bf16 autocast, which runs on CUDA and CPU
tensors only: under `bf16-mixed` the run (and the planner's figure it is compared with) is fp32, the planner's
bf16-mixed peak is printed beside.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lit_lm.check.build import CheckPlan
from lit_lm.check.fake_memory import COMM, GATHER, HELD
from lit_lm.check.fit import checkpointing, fit, lines, run_estimate
from lit_lm.check.full_size_rank import RankJob, measure_rank
from lit_lm.check.report import _count, _plain
from lit_lm.config import ConfigError
from lit_lm.planner.estimate import Estimate
from lit_lm.strategies.pp_split import split_layers

TOLERANCE = 0.05
MEMORY_FLOOR = 0.01
STEPS = 2  # the first step creates the optimizer state; the second is measured
MEMORY = ("parameters", "gradients", "optimizer state", "activations", "buffers", "peak")


@dataclass(frozen=True)
class Role:
    """One kind of rank: its name in the report and the global rank that stands for it."""

    name: str
    rank: int
    pp_rank: int


@dataclass
class FullSize:
    """One `--full-size` check: the plan it came from, its roles, what each measured and the planner's figures."""

    plan: CheckPlan
    precision: str  # what the fake ranks run (bf16-mixed runs as fp32: no autocast on meta tensors)
    checkpointing: str
    roles: list[Role]
    results: list[dict[str, Any]] = field(default_factory=list)


def measured_precision(precision: str) -> str:
    return "bf16-true" if precision == "bf16-true" else "32-true"


def roles(plan: CheckPlan) -> list[Role]:
    """The rank roles of the plan's layout (see the module docstring), each with the lowest global rank of it."""
    d, cfg, par = plan.dims, plan.model, plan.parallel
    p, v = (par.pp, par.virtual_stages) if par.pp > 1 else (1, 1)
    stages = split_layers(cfg.n_layers, p, v, list(par.layers_per_stage) if par.layers_per_stage else None)
    kinds: dict[tuple, int] = {}
    for r in range(p):
        chunks = tuple(tuple(cfg.is_moe_layer(i) for i in stages[c * p + r]) for c in range(v))
        kinds.setdefault((r == 0, r == p - 1, chunks), r)
    sizes = (cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.padded_vocab_size, cfg.moe_d_ff or 0)
    tps = [0] + ([d["tp"] - 1] if d["tp"] > 1 and any(s % d["tp"] for s in sizes) else [])
    rows = d["dp_shard"] * d["cp"]
    shards = [0] + ([d["dp_shard"] - 1] if par.zero_stage and rows > 1 else [])
    out = []
    for r in sorted(kinds.values()):
        for tp in tps:
            for shard in shards:
                rank = (((r * d["dp_replicate"]) * d["dp_shard"] + shard) * d["cp"]) * d["tp"] + tp
                parts = [f"stage {r}/{p}" if p > 1 else "", f"tp rank {tp}" if d["tp"] > 1 else "",
                         ("last ZeRO row" if shard else "first ZeRO row") if len(shards) > 1 else ""]
                out.append(Role(", ".join(x for x in parts if x) or "every rank", rank, r))
    return out


def prepare(plan: CheckPlan) -> FullSize:
    return FullSize(plan, measured_precision(plan.precision), checkpointing(plan), roles(plan))


def jobs(check: FullSize) -> list[RankJob]:
    plan, case = check.plan, check.plan.cases[0]
    return [RankJob(rank=r.rank, world=plan.world, strategy=case.strategy.args[0], module=case.module,
                    config=dataclasses.asdict(plan.model), batch_size=plan.batch_size, accumulate=plan.accumulate,
                    precision=check.precision, steps=STEPS) for r in check.roles]


def run(check: FullSize, workers: int = 2) -> FullSize:
    """Every role in its own process (`workers` at a time): a fake process group lives once per process. The
    processes are forked from the fork server `lit_lm.spawn` starts for its worlds (torch and Lightning imported
    once, each process otherwise fresh), not spawned (those imports paid again per role)."""
    from lit_lm.spawn import PRELOAD

    todo = jobs(check)
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call)
    context = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(todo))), mp_context=context,
                             max_tasks_per_child=1) as pool:
        check.results = list(pool.map(measure_rank, todo))
    return check


def planner(check: FullSize, precision: Optional[str] = None, device: str = "cpu") -> Estimate:
    """The planner's estimate of the checked run: by default as the fake ranks run it (their precision, torch's
    optimizer step as on the CPU: meta tensors get its single-tensor implementation, not CUDA's foreach)."""
    return run_estimate(check.plan, precision or check.precision, device)


def compare(check: FullSize, est: Optional[Estimate] = None) -> list[dict[str, Any]]:
    """Per role: its rows (memory categories, then (group, op) bytes), measured beside planned."""
    est = est or planner(check)
    pipeline = check.plan.parallel.pp > 1
    out = []
    for role, got in zip(check.roles, check.results):
        mine = est.ranks[role.pp_rank]
        at_peak = got["at_peak"]
        measured = {**{k: got["state"].get(k, 0) for k in ("parameters", "gradients", "optimizer state")},
                    "activations": got["maxima"].get(HELD, 0),
                    "buffers": got["maxima"].get(GATHER, 0), "peak": got["peak"]}
        planned = {"parameters": mine.params, "gradients": mine.grads, "optimizer state": mine.optimizer,
                   "activations": mine.activations + (mine.buffers if pipeline else 0),
                   "buffers": 0 if pipeline else mine.buffers, "peak": mine.peak}
        rows = [_row(k, measured[k], planned[k], floor=MEMORY_FLOOR * got["peak"]) for k in MEMORY]
        rows.append({"what": "comm buffers", "kind": "info", "measured": got["maxima"].get(COMM, 0),
                     "planner": None, "rel": None, "agree": True})
        comm = {tuple(k.split("/")): b for k, b in got["comm"].items()}
        for key in sorted(set(comm) | set(mine.comm)):
            rows.append(_row(f"{key[0]} {key[1]}", comm.get(key, 0), mine.comm.get(key, 0), floor=0, kind="comm"))
        out.append({"role": role.name, "rank": role.rank, "pp_rank": role.pp_rank, "rows": rows, "at_peak": at_peak,
                    "seconds": got["seconds"], "ops": got["ops"]})
    return out


def _row(what: str, measured: int, planned: int, floor: float, kind: str = "memory") -> dict[str, Any]:
    diff = measured - planned
    rel = diff / planned if planned else (math.inf if diff else 0.0)
    agree = abs(diff) <= max(TOLERANCE * planned, floor)
    return {"what": what, "kind": kind, "measured": measured, "planner": planned, "rel": rel, "agree": agree}


def summary(check: FullSize, est: Optional[Estimate] = None, gpu_memory: Optional[float] = None) -> dict[str, Any]:
    """The report: per role the figures beside the planner's; the planner's figure for the run (the user's
    precision on CUDA, per role); with `gpu_memory` (bytes per GPU) whether each role fits and, if one does not,
    the nearest layout that does (`lit_lm.check.fit`). `ok`: every figure agrees and (asked) every role fits."""
    plan = check.plan
    est = est or planner(check)
    rows = compare(check, est)
    bad = [(r["role"], row) for r in rows for row in r["rows"] if not row["agree"]]
    where = (f"{plan.strategy} on {plan.world} fake ranks "
             f"({dataclasses.replace(plan.parallel, dp_shard=plan.dims['dp_shard']).describe()})")
    if bad:
        role, row = bad[0]  # the first role's first figure, memory categories in MEMORY's order first
        verdict = (f"FAIL ({role}): {row['what']} measured {_count(row['measured'])}B, planner "
                   f"{_count(row['planner'])}B ({_pct(row['rel'])}); {len(bad)} figure(s) disagree beyond "
                   f"{TOLERANCE:.0%}")
    else:
        verdict = (f"PASS: {where}: every role's memory and bytes per collective agree with the planner within "
                   f"{TOLERANCE:.0%}")
    run = run_estimate(plan)  # what the cluster will see: the user's precision on CUDA
    for role, r in zip(check.roles, rows):
        r["run_peak"] = run.ranks[role.pp_rank].peak
    fits = None
    if gpu_memory is not None:
        fits = fit(plan, run, gpu_memory)
        short = [r["role"] for r in rows if not fits["ranks"][r["pp_rank"]]["fits"]]
        if short:
            best = fits["nearest"]
            nearest = f"{best['layout']}, activation checkpointing {best['checkpointing']}" if best else "none"
            verdict = (f"FAIL: does NOT fit {_count(gpu_memory)}B GPUs ({'; '.join(short)}); nearest that fits: "
                       f"{nearest}. Planner: {verdict}")
        else:
            verdict += f"; every role fits {_count(gpu_memory)}B GPUs"
    return _plain({"ok": not bad and (fits is None or fits["fits"]), "verdict": verdict, "strategy": plan.strategy,
                   "world": plan.world, "layout": where, "model_params": plan.model.num_params(),
                   "precision": plan.precision, "measured_precision": check.precision,
                   "checkpointing": check.checkpointing, "batch_size": plan.batch_size,
                   "seq_len": plan.model.max_seq_len, "roles": rows, "tolerance": TOLERANCE,
                   "memory_floor": MEMORY_FLOOR, "run_precision": run.workload.precision,
                   "planner_peak_for_the_run": run.peak_bytes, "fit": fits})


def _pct(rel: float) -> str:
    return "new" if not math.isfinite(rel) else f"{rel:+.1%}"


def render(report: dict[str, Any], console: Console) -> None:
    console.print(f"[bold]lit-lm check --full-size[/]: {escape(report['layout'])}, "
                  f"{_count(report['model_params'])} parameters, batch {report['batch_size']} x "
                  f"{report['seq_len']} per rank, {report['measured_precision']}"
                  + (f" (the run's {report['precision']}: no autocast on meta tensors)"
                     if report["precision"] != report["measured_precision"] else "")
                  + f", activation checkpointing {report['checkpointing']}")
    for role in report["roles"]:
        table = Table(title=f"{escape(role['role'])} (rank {role['rank']}; {role['ops']} ops, "
                      f"{role['seconds']:.0f} s)", title_justify="left")
        for col in ("", "measured", "planner", "diff", "agree"):
            table.add_column(col, justify="left" if not col else "right")
        for row in role["rows"]:
            agree = "yes" if row["agree"] else "[red]no[/]"
            if row["planner"] is None:  # what the planner has no figure for
                table.add_row(escape(row["what"]), _count(row["measured"]) + "B", "-", "-", "-")
                continue
            table.add_row(escape(row["what"]), _count(row["measured"]) + "B", _count(row["planner"]) + "B",
                          _pct(float(row["rel"])), agree)
        console.print(table)
        parts = ", ".join(f"{k} {_count(v)}B" for k, v in sorted(role["at_peak"].items(), key=lambda kv: -kv[1]) if v)
        console.print(f"  at the peak: {escape(parts)}")
        console.print(f"  for the run: {_count(role['run_peak'])}B at peak (the planner, {report['run_precision']} "
                      "on CUDA)")
    console.print(f"planner for the run ({report['run_precision']} on CUDA): "
                  f"{_count(report['planner_peak_for_the_run'])}B per rank at peak (the worst role); the tables' "
                  f"planner column is the same planner for what the fake ranks ran ({report['measured_precision']}"
                  + (": no autocast on meta tensors" if report["measured_precision"] != report["run_precision"]
                     else "") + "; torch's single-tensor optimizer step, as on the CPU)")
    console.print("not seen by a shapes-only run: the allocator's cache and fragmentation, library workspaces "
                  "(cuBLAS, NCCL), the CUDA context")
    if report["fit"] is not None:
        for line in lines(report["fit"], [(r["role"], r["pp_rank"]) for r in report["roles"]], _count):
            console.print(escape(line))
    style = "bold green" if report["ok"] else "bold red"
    console.print(f"[{style}]{escape(report['verdict'])}[/]")


def main(plan: CheckPlan, as_json: bool, console: Console, gpu_memory: Optional[float] = None) -> bool:
    """Run, compare, print; whether everything agrees. A layout the planner does not model is a ConfigError."""
    check = prepare(plan)
    try:
        est = planner(check)
    except (ValueError, KeyError) as err:
        raise ConfigError(f"the planner has no estimate for this layout: {err}") from err
    report = summary(run(check), est, gpu_memory)
    if as_json:
        import json

        print(json.dumps(report, indent=2))
    else:
        render(report, console)
    return report["ok"]
