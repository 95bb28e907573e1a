"""LoRA against full fine-tuning at Φ ≈ 217M under zero3 x 2 gloo ranks: step time and peak resident memory per rank,
next to the memory LoRA should save, computed from the parameter counts (issue 59's "How to measure").

    python scripts/bench_finetune.py --lock /tmp/heavy.lock --out docs/benchmarks/2026-12-finetune-cpu.json
    python scripts/bench_finetune.py --one lora              # one contender once (what the rounds run)
    python scripts/bench_finetune.py --table docs/benchmarks/2026-12-finetune-cpu.json

Each contender is `bench_peaks.py`'s run (the planner-peaks method: `LanguageModel` with its AdamW through the
Trainer under the `zero3` preset, 2 gloo ranks of one thread, fp32, one 128-token row per rank per step; per rank the
peak resident memory above imports, Linux's VmHWM reset at each phase: setup, forward+backward, optimizer step; the
tensor bytes of parameters, gradients and optimizer state at the step, `model_state_bytes`) with
`model.init_args.lora` unset (`full`) or `{rank: 16, alpha: 32, targets: [q, k, v, o, gate, up, down]}` (`lora`).
Step time: rank 0's median over the steps after the first. Each contender runs in its own fresh processes, alternated
over rounds in an order shuffled per round (`bench_runner.py`); `--lock` holds a flock for each contender's run only.

The expectation (`expected`): under ZeRO-3 over N ranks a rank holds 1/N of every parameter's rows. Full fine-tuning
adds for each of the Φ weights a gradient (4 B) and AdamW's m and v (8 B); LoRA adds the adapters' Φ_A weights with
their gradients and state (16 B each) and freezes the rest, so the model state per rank falls by

    (12 Φ - 16 Φ_A) / N  bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_peaks  # noqa: E402
import bench_runner  # noqa: E402
from bench_ddp import _spread  # noqa: E402
from bench_runner import MARK, paired, run_rounds, summarize, write_json  # noqa: E402
from bench_size import locked_run  # noqa: E402
from machine import describe  # noqa: E402
from lit_lm.lora import LoRA, add_adapters, lora_factor  # noqa: E402
from lit_lm.model import Transformer  # noqa: E402
from lit_lm.strategies.host_malloc import HUGE_PAGES  # noqa: E402

CONTENDERS = {"full": None, "lora": LoRA(rank=16, alpha=32.0)}  # every target: q, k, v, o, gate, up, down
PRESET = "zero3"


def expected(size: str = "217M", world: int = bench_peaks.WORLD) -> dict[str, int]:
    """Parameter counts of the model and its adapters, and the model-state bytes per rank LoRA should save
    under ZeRO-3 over `world` ranks with fp32 AdamW: (12 Φ - 16 Φ_A) / world."""
    with torch.device("meta"):
        model = Transformer(bench_peaks.model_config(size))
        add_adapters(model, CONTENDERS["lora"])
    adapters = sum(p.numel() for n, p in model.named_parameters() if lora_factor(n))
    phi = sum(p.numel() for p in model.parameters()) - adapters
    return {"phi": phi, "adapters": adapters, "world": world, "saving_per_rank": (12 * phi - 16 * adapters) // world,
            "full_grads_optimizer_per_rank": 12 * phi // world}


def one(name: str, steps: int, size: str) -> dict[str, Any]:
    """One contender: bench_peaks' run, reduced to this page's figures."""
    args = argparse.Namespace(one=PRESET, size=size, steps=steps, lora=CONTENDERS[name])
    run = bench_peaks.run_one(args)
    ranks = run["ranks"]
    phases = {phase: max(p["peak"] for r in ranks for p in r["phases"] if p["phase"] == phase)
              for phase in ("setup", "fwd_bwd", "step")}
    steps_s = bench_peaks.step_seconds(ranks[0])
    return {"step_s": statistics.median(steps_s), "step_min_s": min(steps_s), "step_max_s": max(steps_s),
            "peak_bytes": max(r["peak"] for r in ranks), **{f"peak_{k}_bytes": v for k, v in phases.items()},
            **{f"state_{k}_bytes": v for k, v in ranks[0]["state"].items()},
            "planner_full_estimate_bytes": run["estimate"]["peak"]}


def contenders(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each contender's command; its processes start with torch's huge pages for big blocks, as `lit-lm` starts
    its ranks (bench_peaks' rounds do the same)."""
    return {name: ["env", f"{HUGE_PAGES}=1", sys.executable, __file__, "--one", name, "--steps", str(args.steps),
             "--size", args.size]
            for name in CONTENDERS}


def markdown(run: dict[str, Any]) -> str:
    """Step time and memory per contender (median, min-max over rounds), LoRA against full (paired per round), and
    the measured fall in peak and model state against the expectation."""
    t, exp = run["summary"], run["expected"]
    gb = 1e-9
    lines = ["| contender | step s | peak RSS/rank above imports, GB | setup / fwd+bwd / step peak, GB | "
             "trainable params / grads / optimizer state per rank, GB |", "|---|---|---|---|---|"]
    for name in CONTENDERS:
        row = t[name]
        phases = " / ".join(f"{row[f'peak_{p}_bytes']['median'] * gb:.2f}" for p in ("setup", "fwd_bwd", "step"))
        state = " / ".join(f"{row[f'state_{k}_bytes']['median'] * gb:.3f}" for k in ("params", "grads", "optimizer"))
        lines.append(f"| {name} | {_spread(row['step_s'], 1, '.2f')} | {_spread(row['peak_bytes'], gb, '.2f')} | "
                     f"{phases} | {state} |")
    full, lora = t["full"], t["lora"]
    # gradients and optimizer state: expected to fall by 12 (Φ - Φ_A) / N (`params` counts what the module and the
    # optimizer reference at the step: the trainable rows, not ZeRO-3's frozen row shards, so it is not compared)
    state_fall = sum(full[f"state_{k}_bytes"]["median"] - lora[f"state_{k}_bytes"]["median"]
                     for k in ("grads", "optimizer"))
    state_expected = 12 * (exp["phi"] - exp["adapters"]) // exp["world"]
    peak_fall = full["peak_bytes"]["median"] - lora["peak_bytes"]["median"]
    lines += ["", f"LoRA / full step time, paired per round: {_spread(run['paired']['step_s'], 1, '.2f')}×; "
              f"peak / rank: {lora['peak_bytes']['median'] / full['peak_bytes']['median']:.2f}×.",
              f"Expected fall per rank, (12 Φ - 16 Φ_A) / {exp['world']} with Φ = {exp['phi']:,}, "
              f"Φ_A = {exp['adapters']:,}: {exp['saving_per_rank'] * gb:.3f} GB; measured peak RSS: "
              f"{peak_fall * gb:.3f} GB ({peak_fall / exp['saving_per_rank']:.2f} of the expectation). Gradients + "
              f"optimizer state (`model_state_bytes`): fell {state_fall * gb:.3f} GB, expected 12 (Φ - Φ_A) / "
              f"{exp['world']} = {state_expected * gb:.3f} GB.",
              "", f"{len(run['rounds'])} rounds, load average (1 min) {run['load_1min']['min']:.1f}–"
              f"{run['load_1min']['max']:.1f} (median {run['load_1min']['median']:.1f}) on "
              f"{describe(run.get('machine', {}))}."]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--one", choices=CONTENDERS, help="run this contender once and print its metrics")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--size", choices=list(bench_peaks.SIZES), default="217M", help="bench_peaks' model sizes")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0, help="of the per-round shuffles")
    p.add_argument("--lock", help="hold this file's flock for each contender's run (a shared machine)")
    p.add_argument("--out", default="runs/bench_finetune.json")
    p.add_argument("--table", help="print a saved run (its --out JSON) as Markdown, and exit")
    args = p.parse_args(argv)
    if args.table:
        print(markdown(json.loads(Path(args.table).read_text())))
        return
    if args.one:
        print(MARK + json.dumps(one(args.one, args.steps, args.size)), flush=True)
        return
    if args.lock:
        bench_runner.run_once = partial(locked_run, bench_runner.run_once, args.lock)
    rounds = run_rounds(contenders(args), args.rounds, args.seed, timeout=1200)
    write_json(args.out, rounds, summarize(rounds), args=vars(args), expected=expected(args.size),
               paired={"step_s": paired(rounds, "lora", "full", "step_s"),
                       "peak_bytes": paired(rounds, "lora", "full", "peak_bytes")},
               tree=bench_peaks.tree(), threads=os.environ.get("OMP_NUM_THREADS"))
    print(markdown(json.loads(Path(args.out).read_text())))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
