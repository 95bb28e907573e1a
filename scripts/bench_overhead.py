"""What the Lightning step costs over the engines: each data-parallel engine driven by the Trainer and by a plain loop.

    python scripts/bench_overhead.py                          # lm_ddp, zero1-3; CPU/gloo, 2 processes, 6 rounds
    python scripts/bench_overhead.py --one zero2 --loop plain # one contender once (what the rounds run)
    python scripts/bench_overhead.py --one zero2 --loop trainer --profile runs/zero2.prof   # cProfile, rank 0
    python scripts/bench_overhead.py --table docs/benchmarks/2026-12-trainer-overhead-cpu.json   # a saved run

Per engine, two contenders that run the same computation on the same objects:

- `trainer`: `Trainer.fit` with the engine's strategy (`lm_ddp`: `GradSync`; `zero1`-`zero3`: `ZeroEngine`), the
  benchmark module of `bench_strategies.py` (its `training_step` returns `model.loss`), AdamW;
- `plain`: the same `Transformer`, batches, AdamW and engine object, built as the strategy builds them (the engine
  over the layout's dp group, `dp_engine.bind_optimizer`'s flat step), driven by a plain PyTorch loop through the
  engine protocol (`lit_lm/strategies/dp_engine.py`): forward, `zero_grad`, backward, `finish_grad_sync`, `step`,
  `after_step`; no Lightning.

A step is timed from one batch's start to the next (data loading, every hook and the optimizer step included), in
both loops by the same clock; tokens/s is the global batch over the median steady step. Each contender runs in its
own fresh processes, alternated over >= 5 rounds in an order shuffled per round (`bench_runner.py`); the Trainer's
cost is the paired ratio trainer / plain tokens/s within each round (they ran minutes apart, under the same load),
reported as the median with its min-max. `--profile` writes cProfile statistics of rank 0's steady steps (and
prints the 25 functions with the most own time): where the Trainer's extra time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ddp import _spread, table_one_or_rounds  # noqa: E402
from bench_runner import MARK, paired, summarize, write_json  # noqa: E402
from bench_strategies import (BenchLM, _env, add_run_args, footer, forwarded, make_strategy,  # noqa: E402
                              make_trainer, model_config, token_loader)
from lit_lm.config import ModelConfig  # noqa: E402
from lit_lm.model import Transformer  # noqa: E402
from lit_lm.strategies.ddp import DataParallelStrategy  # noqa: E402
from lit_lm.strategies.dp_engine import DataParallelEngine, bind_optimizer  # noqa: E402
from lit_lm.strategies.grad_sync import GradSync  # noqa: E402
from lit_lm.strategies.layout import ParallelDims, ParallelLayout  # noqa: E402
from lit_lm.strategies.zero_engine import ZeroEngine  # noqa: E402

ENGINES = ["lm_ddp", "zero1", "zero2", "zero3"]
LOOPS = ["trainer", "plain"]  # the paired contenders: the Trainer over its baseline
ALL_LOOPS = [*LOOPS, "flat"]  # `flat`: lm_ddp's plain loop with lit-lm's flat step (what the Trainer binds)
WITHIN = 0.03  # the target: the Trainer within 3% of the plain loop
BASELINE = ("plain: torch.optim.AdamW(model.parameters(), lr=1e-4), torch's defaults (foreach=None, fused=None: per "
            "tensor on the CPU); lm_ddp without lit-lm's flat step, ZeRO with its master shards bound")


class Clock:
    """Marks the start of every step (the device synchronised first); with `profile`, rank 0's steady steps run
    under cProfile, from the start of step `warmup` to the start of the last step."""

    def __init__(self, device: torch.device, steps: int, warmup: int, profile: Optional[str]) -> None:
        self.device, self.steps, self.warmup, self.marks, self.cpu_marks = device, steps, warmup, [], []
        self.profile = profile if profile and int(os.environ["RANK"]) == 0 else None
        self.profiler = cProfile.Profile() if self.profile else None

    def mark(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.marks.append(time.perf_counter())
        self.cpu_marks.append(time.process_time())
        if self.profiler is not None and len(self.marks) == self.warmup + 1:
            self.profiler.enable()
        if self.profiler is not None and len(self.marks) == self.steps:
            self.profiler.disable()
            self.profiler.dump_stats(self.profile)
            pstats.Stats(self.profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)

    def steady(self, cpu: bool = False) -> list[float]:
        """The steady steps' durations, between consecutive starts, after `warmup`: wall time, or with `cpu` this
        process's CPU time (all its threads; a rank waiting in a collective spends none), which other jobs on the
        machine disturb less."""
        marks = self.cpu_marks if cpu else self.marks
        return [b - a for a, b in zip(marks, marks[1:])][self.warmup:]


class ClockCallback(L.Callback):
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def on_train_batch_start(self, *args: Any) -> None:
        self.clock.mark()


def _stage(engine: str) -> int:
    return 0 if engine == "lm_ddp" else int(engine[len("zero"):])


def trainer_loop(engine: str, args: argparse.Namespace, config: ModelConfig, accelerator: str, device: torch.device,
                 clock: Clock) -> None:
    strategy = make_strategy(engine, args.devices) if _stage(engine) else DataParallelStrategy(
        bucket_cap_mb=args.bucket_cap_mb)  # the plain loop's GradSync cap
    loader = token_loader(args, config, int(os.environ["LOCAL_RANK"]), args.devices)
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(args, accelerator, strategy, [ClockCallback(clock)])
    trainer.fit(BenchLM(config, fsdp2=False), loader)


def plain_loop(engine: str, args: argparse.Namespace, config: ModelConfig, accelerator: str, device: torch.device,
               clock: Clock) -> None:
    """The strategy's engine and optimizer as `ComposedStrategy` builds them (its layout's groups, ZeRO-3 on the meta
    device, the flat step), driven by hand in Lightning's order (zero_grad between forward and backward)."""
    dist.init_process_group("nccl" if accelerator == "gpu" else "gloo", device_id=device if accelerator == "gpu"
                            else None)
    layout = ParallelLayout.get(ParallelDims.of(dist.get_world_size()))
    loader = token_loader(args, config, layout.dp_rank, layout.dp_size)
    torch.manual_seed(0)
    stage = _stage(engine)
    with torch.device("meta") if stage == 3 else nullcontext():
        model = Transformer(config)
    if stage < 3:
        model.to(device)
    sync: DataParallelEngine = (ZeroEngine(model, stage, layout.group("dp_shard"), device) if stage else
                                GradSync(model, layout.group("dp"), args.bucket_cap_mb))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)  # torch's default on the CPU: per tensor
    if stage or args.loop == "flat":  # ZeRO steps its master shards; `flat`: lit-lm's flat step over GradSync's buckets
        bind_optimizer(optimizer, [sync])
    for (tokens,) in loader:
        clock.mark()
        tokens = tokens.to(device)
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])[0]
        optimizer.zero_grad()
        loss.backward()
        sync.finish_grad_sync()
        optimizer.step()
        sync.after_step()


def worker_one(rank: int, args: argparse.Namespace, port: int, accelerator: str) -> None:
    config = _env(rank, args, port, accelerator)
    device = torch.device("cuda", rank) if accelerator == "gpu" else torch.device("cpu")
    if accelerator == "gpu":
        torch.cuda.set_device(device)
    clock = Clock(device, args.steps, args.warmup, args.profile)
    loop = trainer_loop if args.loop == "trainer" else plain_loop
    loop(args.one, args, config, accelerator, device, clock)
    steady = clock.steady()
    if rank == 0:
        step = statistics.median(steady)
        print(MARK + json.dumps({"tokens_per_s": args.global_batch * args.seq_len / step, "step_s": step,
                                 "mean_step_s": statistics.fmean(steady),
                                 "cpu_step_s": statistics.median(clock.steady(cpu=True))}), flush=True)


def contenders(args: argparse.Namespace) -> dict[str, list[str]]:
    base = [sys.executable, __file__, *forwarded(args), "--bucket-cap-mb", str(args.bucket_cap_mb)]
    return {f"{engine} {loop}": [*base, "--one", engine, "--loop", loop]
            for engine in args.engines for loop in args.loops}


def markdown(run: dict[str, Any]) -> str:
    """Per engine: tokens/s of both loops (median, min-max over rounds), the paired ratio trainer / plain, and the
    paired difference of CPU time per step (rank 0's process), the Trainer's host work."""
    table, paired_runs = run["summary"], run["paired"]
    lines = ["| engine | Trainer tokens/s | plain loop tokens/s | Trainer / plain, paired | median within 3% | "
             "CPU ms per step, Trainer − plain, paired |", "|---|---|---|---|---|---|"]
    for engine, p in paired_runs.items():
        verdict = "yes" if p["tokens_per_s"]["median"] >= 1 - WITHIN else "no"
        lines.append(f"| `{engine}` | {_spread(table[f'{engine} trainer']['tokens_per_s'])} | "
                     f"{_spread(table[f'{engine} plain']['tokens_per_s'])} | "
                     f"{_spread(p['tokens_per_s'], fmt='.3f')} | {verdict} | {_spread(p['cpu_step_s'], 1e3, '.2f')} |")
    lines.append(f"\n{footer(run)}")
    return "\n".join(lines)


def _head() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.set_defaults(rounds=6, steps=40, warmup=5)
    p.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="GradSync's (lm_ddp), as the strategy's default")
    p.add_argument("--one", choices=ENGINES, help="run this engine once (with --loop) and print its metrics")
    p.add_argument("--loop", choices=ALL_LOOPS, default="trainer")
    p.add_argument("--loops", nargs="+", choices=ALL_LOOPS, default=LOOPS, help="the loops of each engine's rounds")
    p.add_argument("--profile", help="with --one: write rank 0's cProfile statistics of the steady steps here")
    p.add_argument("--out", default="runs/bench_overhead.json")
    p.add_argument("--table", help="print a saved run (its --out JSON) as Markdown, and exit")
    p.add_argument("--revision", help="the commit measured, recorded in the JSON (default: this checkout's HEAD)")
    args = p.parse_args(argv)
    args.revision = args.revision or _head()
    rounds = table_one_or_rounds(args, markdown, contenders, worker_one)
    if rounds is None:
        return
    pairs = {engine: {"tokens_per_s": paired(rounds, f"{engine} trainer", f"{engine} plain", "tokens_per_s"),
                      "cpu_step_s": paired(rounds, f"{engine} trainer", f"{engine} plain", "cpu_step_s",
                                           how="difference")}
             for engine in args.engines}
    write_json(args.out, rounds, summarize(rounds), args=vars(args), phi=model_config(args).num_params(),
               paired=pairs, revision=args.revision, baseline=BASELINE,
               environment={k: os.environ.get(k) for k in ("THP_MEM_ALLOC_ENABLE", "OMP_NUM_THREADS", "LIT_LM_MALLOC")})
    print(markdown(json.loads(Path(args.out).read_text())))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
