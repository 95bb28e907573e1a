"""Muon against AdamW at the size users run (Φ ≈ 217M): step time, peak memory and the Newton-Schulz (NS) work per
rank under lm_ddp, zero1, zero3 and tp2, owner mode against the replicated baseline (issue 56); and a small model's
loss against tokens, Muon vs AdamW, on one process.

    python scripts/bench_muon.py --lock /tmp/heavy.lock           # every contender, 2 gloo ranks, 3 rounds
    python scripts/bench_muon.py --one zero3 --optim muon          # one contender once (what the rounds run)
    python scripts/bench_muon.py --flops                           # NS FLOPs per rank, counted, N = 1, 2, 4, 8
    python scripts/bench_muon.py --curve --lock /tmp/heavy.lock    # the default tiny run, AdamW then Muon, + plot
    python scripts/bench_muon.py --table docs/benchmarks/2026-12-muon-cpu.json

Contenders (`layout optim`), each through the Trainer with lit-lm's strategy (`bench_size.py`'s `trainer` loop: the
strategy binds Muon's orthogonalizer in `setup_optimizers`, as under `lit-lm fit`), the parameters in
`lit_lm.param_groups`' groups as `LanguageModel` builds them:

- `adamw`: torch.optim.AdamW (lr 1e-4, torch's CPU default: per tensor), the flat step under ZeRO;
- `muon`: lit_lm.optim.Muon with `ns_mode: owner` (each matrix orthogonalized once, by one rank of the ranks that
  hold it, owners balanced by NS FLOPs), NS in bfloat16 (torch's);
- `muon_replicated`: `ns_mode: replicated` (every rank gathers and orthogonalizes every matrix: the baseline);
- `muon_gram` (tp2 only): `ns_mode: gram`, tp's Gram mode for the matrices cut along their long dimension.

Per contender, as `bench_size.py` measures (its `run_one`, `locked_run`, its rank files): rank 0's median steady step
(min, max), the peak resident memory above imports per rank, and rank 0's median wall time in the orthogonalizer
(NS with its all-to-alls or Gram all-reduces: the part of the optimizer step Muon adds). Each contender runs in its own
fresh processes, alternated over rounds in an order shuffled per round (`bench_runner.py`); `--lock` holds a flock
for each contender's run. Muon / AdamW step time is also given paired within each round.

`--flops` counts (does not time) the NS FLOPs per rank and optimizer step from the owner assignment
(`lit_lm.strategies.orthogonalize.assign_owners`, the one the runs use) for N ranks of one level: lm_ddp's replica
group, ZeRO's rows and tp's owner route give the same assignment (one level of N over the same matrices); tp's Gram
mode splits the long-cut matrices' 4 m^2 n over N and leaves each rank all of their 2 m^3.

`--curve` runs `lit-lm fit --config configs/default.yaml` twice on one process (AdamW as configured; Muon with the
same lr, weight decay and schedule through `adjust_lr_fn: match_rms_adamw`, as Moonlight reuses AdamW's) and draws
train and validation loss against tokens.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ddp import _spread, table_one_or_rounds  # noqa: E402
from bench_overhead import Clock, ClockCallback  # noqa: E402
import bench_runner  # noqa: E402
from bench_runner import paired, summarize, write_json  # noqa: E402
from bench_size import SIZES, locked_run, run_one  # noqa: E402
from machine import machine  # noqa: E402
from bench_strategies import (BenchLM, _env, add_run_args, data_rank, footer, forwarded, make_strategy,  # noqa: E402
                              make_trainer, model_config, token_loader)
from plot_run import find_fragments, read_run  # noqa: E402
from plotting import figure, save  # noqa: E402
from lit_lm.config import ModelConfig  # noqa: E402
from lit_lm.model import Transformer  # noqa: E402
from lit_lm.optim import Muon  # noqa: E402
from lit_lm.param_groups import param_groups  # noqa: E402
from lit_lm.resident import ResidentPeak  # noqa: E402
from lit_lm.strategies.ddp import DataParallelStrategy  # noqa: E402
from lit_lm.strategies.host_malloc import HUGE_PAGES  # noqa: E402
from lit_lm.strategies.orthogonalize import NS_MODES, Level, Unit, assign_owners, long_cut  # noqa: E402
from lit_lm.strategies.tp import TensorParallelStrategy  # noqa: E402

LAYOUTS = ["lm_ddp", "zero1", "zero3", "tp2"]
# -> Muon's ns_mode; Gram forced where tp cuts a matrix along its long side ("gram"; before it existed "auto" did)
OPTIMS = {"adamw": None, "muon": "owner", "muon_replicated": "replicated",
          "muon_gram": "gram" if "gram" in NS_MODES else "auto"}
NS_STEPS = 5  # torch's, Muon's default
LR = 1e-4  # the timing runs' (bench_size's AdamW); the values do not matter here, the work does


def strategy_of(layout: str, args: argparse.Namespace) -> Any:
    if layout == "tp2":
        return TensorParallelStrategy(2, sequence_parallel=False)
    return DataParallelStrategy(bucket_cap_mb=args.bucket_cap_mb) if layout == "lm_ddp" else \
        make_strategy(layout, args.devices)


class OptimLM(BenchLM):
    """bench_strategies' module with `LanguageModel`'s parameter groups and AdamW or Muon (`ns_mode`)."""

    def __init__(self, config: ModelConfig, ns_mode: Optional[str]) -> None:
        super().__init__(config, fsdp2=False)
        self.ns_mode = ns_mode

    def configure_optimizers(self) -> torch.optim.Optimizer:
        tied = self.config.tie_embeddings
        if self.ns_mode is None:
            return torch.optim.AdamW(param_groups(self.model, 0.1, tied), lr=LR)
        return Muon(param_groups(self.model, 0.1, tied, split_matrices=True), lr=LR, ns_mode=self.ns_mode)


class TimedOrthogonalizer:
    """The optimizer's orthogonalizer, each call's wall time kept (one call per optimizer step: one matrix group)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.times = inner, []

    def matrix_shape(self, tensor: torch.Tensor) -> tuple[int, int]:
        return self.inner.matrix_shape(tensor)

    def __call__(self, *args: Any) -> Any:
        start = time.perf_counter()
        out = self.inner(*args)
        self.times.append(time.perf_counter() - start)
        return out


class TimeOrthogonalizer(L.Callback):
    """Wraps the bound orthogonalizer once training starts (after the strategy's `setup_optimizers`)."""

    timed: Optional[TimedOrthogonalizer] = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        optimizer = getattr(trainer.optimizers[0], "_optimizer", trainer.optimizers[0])
        if isinstance(optimizer, Muon):
            self.timed = optimizer.orthogonalizer = TimedOrthogonalizer(optimizer.orthogonalizer)


def worker_one(rank: int, args: argparse.Namespace, port: int, accelerator: str, out: str) -> None:
    """One contender on `args.devices` processes; every rank writes its figures to `out`/rank<r>.json."""
    peak = ResidentPeak()  # everything imported (the ranks are forked from the parent): the baseline
    config = _env(rank, args, port, accelerator)
    device = torch.device("cpu")
    clock, timer = Clock(device, args.steps, args.warmup, None), TimeOrthogonalizer()
    strategy = strategy_of(args.one, args)
    loader = token_loader(args, config, *data_rank(strategy, args.devices, rank))
    L.seed_everything(0, verbose=False)
    BenchLM.reads_weights = ClockCallback.reads_weights = False  # as bench_size's trainer loop
    trainer = make_trainer(args, accelerator, strategy, [ClockCallback(clock), timer])
    trainer.fit(OptimLM(config, OPTIMS[args.optim]), loader)
    steady = clock.steady()
    ortho = timer.timed.times[args.warmup:] if timer.timed else None
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "step_s": statistics.median(steady), "step_min_s": min(steady), "step_max_s": max(steady),
        "orthogonalize_s": statistics.median(ortho) if ortho else None, "ns_mode": OPTIMS[args.optim],
        "peak_bytes": peak.above(),
        "cuda_peak_bytes": None}))


def contenders(args: argparse.Namespace) -> dict[str, list[str]]:
    """Every layout with AdamW, Muon owner and replicated; tp2 with Gram mode too. The processes start with torch's
    huge pages for big blocks, as the `lit-lm` command starts its ranks."""
    base = ["env", f"{HUGE_PAGES}=1", sys.executable, __file__, *forwarded(args),
            "--bucket-cap-mb", str(args.bucket_cap_mb)]
    return {f"{layout} {optim}": [*base, "--one", layout, "--optim", optim]
            for layout in args.layouts for optim in args.optims if optim != "muon_gram" or layout == "tp2"}


# --- counted, not timed: NS FLOPs per rank from the owner assignment


def matrices(config: ModelConfig) -> list[tuple[tuple[int, int], Optional[int]]]:
    """(global shape, the dim tp cuts: 0 column-parallel, 1 row-parallel) of every matrix Muon orthogonalizes."""
    with torch.device("meta"):
        model = Transformer(config)
    plan, names = model.tensor_parallel_plan(), {id(p): n for n, p in model.named_parameters()}
    group = param_groups(model, 0.1, config.tie_embeddings, split_matrices=True)[0]
    out = []
    for p in group["params"]:
        style = plan.get(names[id(p)].rsplit(".", 1)[0])
        out.append((tuple(p.shape[-2:]), {"column": 0, "row": 1}.get(getattr(style, "style", None))))
    return out


def flops_per_rank(config: ModelConfig, n: int, mode: str) -> list[int]:
    """NS FLOPs of one optimizer step on each of n ranks: `owner` (one level of n: lm_ddp, ZeRO, tp's owner route),
    `gram` (tp n, "auto": Gram for the long-cut matrices, owner for the rest) or `replicated` (every rank all)."""
    units = []
    for i, (shape, dim) in enumerate(matrices(config)):
        level = Level(None, "bench", dim if mode == "gram" else 0, shape[dim or 0], n, 0)  # type: ignore[arg-type]
        units.append(Unit(i, None, shape, (level,), gram=mode == "gram" and n > 1 and long_cut(shape, dim)))
    if mode == "replicated" or n == 1:
        return [NS_STEPS * sum(u.flops for u in units)] * n
    assign_owners(units)
    load = [0] * n
    for u in units:
        for r in range(n) if u.gram else [u.owners[0]]:
            load[r] += NS_STEPS * u.rank_flops
    return load


def flops_table(config: ModelConfig, sizes: tuple[int, ...] = (1, 2, 4, 8)) -> dict[str, dict[str, list[int]]]:
    return {mode: {str(n): flops_per_rank(config, n, mode) for n in sizes} for mode in ("owner", "gram", "replicated")}


def flops_markdown(table: dict[str, dict[str, list[int]]]) -> str:
    """Per mode and N: GFLOP per rank (max, min), the max against total / N (the imbalance) and against N = 1."""
    whole = table["owner"]["1"][0]
    lines = ["| mode | N | GFLOP per rank per step, max (min) | max / (total / N) | max / one process |",
             "|---|---|---|---|---|"]
    names = {"owner": "owner (lm_ddp, ZeRO, tp owner route)", "gram": "tp `gram` (Gram + owner for wq, wk, wv)",
             "replicated": "replicated"}
    for mode, by_n in table.items():
        for n, load in by_n.items():
            lines.append(f"| {names[mode]} | {n} | {max(load) / 1e9:.0f} ({min(load) / 1e9:.0f}) | "
                         f"{max(load) / (whole / int(n)):.3f} | {max(load) / whole:.3f} |")
    return "\n".join(lines)


# --- the timed rounds' table


def markdown(run: dict[str, Any]) -> str:
    """Per contender: step time, rank 0's orthogonalizer time and the peak resident memory (larger rank), each median
    (min-max) over the rounds; step time and memory against the layout's AdamW (Muon / AdamW, paired per round)."""
    table, pairs = run["summary"], run.get("paired", {})
    lines = ["| layout | optimizer | step s | orthogonalize s (rank 0) | peak RSS above imports, GB | "
             "step vs AdamW, paired | memory vs AdamW |", "|---|---|---|---|---|---|---|"]
    for name in sorted(table, key=lambda n: (LAYOUTS.index(n.split()[0]), list(OPTIMS).index(n.split()[1]))):
        (layout, optim), t = name.split(), table[name]
        ref = table.get(f"{layout} adamw")
        ortho = _spread(t["orthogonalize_s"], 1, ".2f") if isinstance(t.get("orthogonalize_s"), dict) else "–"
        speed = _spread(pairs[name], 1, ".2f") + "×" if name in pairs else ""
        memory = f"{t['peak_bytes']['median'] / ref['peak_bytes']['median']:.2f}×" if ref and ref is not t else ""
        lines.append(f"| {layout} | {optim} | {_spread(t['step_s'], 1, '.2f')} | {ortho} | "
                     f"{_spread(t['peak_bytes'], 1e-9, '.2f')} | {speed} | {memory} |")
    lines.append(f"\n{footer(run)}")
    if "ns_flops" in run:
        lines.append(f"\n{flops_markdown(run['ns_flops'])}")
    return "\n".join(lines)


# --- the loss curve: the default tiny run, AdamW against Muon


CURVE_MUON = ["--model.init_args.optimizer", "lit_lm.optim.Muon", "--model.init_args.optimizer.lr", "3.0e-3",
              "--model.init_args.optimizer.weight_decay", "0.1",
              "--model.init_args.optimizer.adjust_lr_fn", "match_rms_adamw"]


def curve(args: argparse.Namespace) -> None:
    """Each optimizer's run (`lit-lm fit`, one process, the default config: its data, lr 3e-3, warmup-cosine) under
    the lock, then train/validation loss against tokens in one picture and the final figures as JSON."""
    root, lit_lm = Path(args.curve_dir), Path(sys.executable).with_name("lit-lm")
    runs = {"AdamW": [], "Muon": CURVE_MUON}
    # checkpoints off: saving one fails today ("Can't pickle local object 'LanguageModel.configure_optimizers.<locals>.
    # <lambda>'", found by this run) and the curve needs none
    command = [str(lit_lm), "fit", "--config", "configs/default.yaml", "--trainer.enable_checkpointing", "false",
               "--trainer.callbacks", '[{"class_path": "lit_lm.callbacks.progress.StepProgress"}]']
    out: dict[str, Any] = {"command": command, "muon_args": CURVE_MUON}
    for name, extra in runs.items():
        run_dir = root / name.lower()
        command = [*out["command"], "--trainer.default_root_dir", str(run_dir), "--trainer.max_steps",
                   str(args.curve_steps), "--data.init_args.data_dir", str(root / "data"), *extra]
        command += ["--seed_everything", str(args.curve_seed)] if args.curve_seed is not None else []
        with open(args.lock, "a") if args.lock else nullcontext() as lock:
            if lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
            load, start = os.getloadavg()[0], time.perf_counter()
            subprocess.run(command, check=True)  # the lock holds the machine: torch takes its cores
            out[name] = {"wall_s": time.perf_counter() - start, "load_1min": load}
        out[name]["series"] = {k: v for k, v in read_run(find_fragments(run_dir)).items()
                               if k in ("train_loss", "val_loss", "lr")}
    draw_curve(out, args.curve_tokens_per_step, Path(args.curve_out))
    Path(args.curve_json).write_text(json.dumps({**out, "tokens_per_step": args.curve_tokens_per_step,
                                                 "seed": args.curve_seed,
                                                 "machine": machine()}, indent=1))
    print(f"wrote {args.curve_out} and {args.curve_json}")


def draw_curve(run: dict[str, Any], tokens_per_step: int, path: Path) -> None:
    fig, ax = figure(6.0, 3.6)
    for name, colour in (("AdamW", "tab:blue"), ("Muon", "tab:red")):
        series = run[name]["series"]
        steps, values = series["train_loss"]
        smooth = [statistics.fmean(values[max(0, i - 9):i + 1]) for i in range(len(values))]  # 10-step mean
        ax.plot([(s + 1) * tokens_per_step / 1e6 for s in steps], smooth, color=colour, linewidth=1,
                label=f"{name} train (10-step mean)")
        if "val_loss" in series:
            steps, values = series["val_loss"]
            ax.plot([(s + 1) * tokens_per_step / 1e6 for s in steps], values, color=colour, marker="o",
                    linestyle="--", markersize=4, linewidth=1, label=f"{name} validation")
    ax.set_xlabel("tokens (millions)")
    ax.set_ylabel("loss")
    ax.legend(fontsize=7)
    ax.tick_params(labelsize=7)
    save(fig, path)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.set_defaults(rounds=3, steps=5, warmup=2, **SIZES["217m"])
    p.add_argument("--layouts", nargs="+", default=LAYOUTS, choices=LAYOUTS)
    p.add_argument("--optims", nargs="+", default=list(OPTIMS), choices=OPTIMS)
    p.add_argument("--one", choices=LAYOUTS, help="run this layout once (with --optim) and print its metrics")
    p.add_argument("--optim", choices=OPTIMS, default="adamw")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="GradSync's (lm_ddp), as the strategy's default")
    p.add_argument("--lock", help="hold this file's flock for each contender's run (bench_size's --lock)")
    p.add_argument("--out", default="runs/bench_muon.json")
    p.add_argument("--table", help="print a saved run (its --out JSON) as Markdown, and exit")
    p.add_argument("--flops", action="store_true", help="count NS FLOPs per rank for N = 1, 2, 4, 8, and exit")
    p.add_argument("--curve", action="store_true", help="the default tiny run with AdamW and with Muon, and exit")
    p.add_argument("--curve-steps", type=int, default=400)
    p.add_argument("--curve-tokens-per-step", type=int, default=16 * 128, help="the default config's batch x seq_len")
    p.add_argument("--curve-seed", type=int, help="seed_everything of both runs (default: the config's, 1337)")
    p.add_argument("--curve-dir", default="runs/bench_muon_curve")
    p.add_argument("--curve-out", help="the picture (default: loss.png in --curve-dir)")
    p.add_argument("--curve-json", help="the curves and wall times (default: loss.json in --curve-dir)")
    args = p.parse_args(argv)
    args.profile = None
    if args.flops:
        print(flops_markdown(flops_table(model_config(args))))
        return
    if args.curve:
        args.curve_out = args.curve_out or str(Path(args.curve_dir, "loss.png"))
        args.curve_json = args.curve_json or str(Path(args.curve_dir, "loss.json"))
        curve(args)
        return
    if args.one:
        run_one(args, worker_one)
        return
    if args.lock:
        bench_runner.run_once = partial(locked_run, bench_runner.run_once, args.lock)
    # the machine-time budget (~40 min at 217M on 2 cores) allows 3 rounds; the page says so
    bench_runner.MIN_ROUNDS = min(bench_runner.MIN_ROUNDS, args.rounds)
    rounds = table_one_or_rounds(args, markdown, contenders, worker_one)
    if rounds is None:
        return
    names = {name for r in rounds for name, _ in r}
    pairs = {name: paired(rounds, name, f"{name.split()[0]} adamw", "step_s")
             for name in names if not name.endswith("adamw") and f"{name.split()[0]} adamw" in names}
    write_json(args.out, rounds, summarize(rounds), args=vars(args), phi=model_config(args).num_params(),
               paired=pairs, ns_flops=flops_table(model_config(args)), threads=os.environ.get("OMP_NUM_THREADS"))
    print(markdown(json.loads(Path(args.out).read_text())))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
