"""Benchmark the data-parallel hot path: `lm_ddp` against torch DDP, and how much of its all-reduce backward hides.

    python scripts/bench_ddp.py                               # CPU/gloo, 2 processes, 5 rounds
    python scripts/bench_ddp.py --one lm_ddp --fused          # one contender once (what the rounds run)
    python scripts/bench_ddp.py --table docs/benchmarks/2026-12-ddp-cpu.json   # a saved run as Markdown

Contenders (each in its own fresh processes, alternated over >= 5 rounds in an order shuffled per round by
`scripts/bench_runner.py`; tokens/s is the median over rounds of each run's median steady step, with min-max):

- `ddp`: torch `DistributedDataParallel` through Lightning's `ddp`; `ddp_view`: the same with
  `gradient_as_bucket_view=True` (its gradients live in its buckets, as ours do);
- `lm_ddp`: `lit_lm.strategies.grad_sync.GradSync` at `--bucket-cap-mb`: asynchronous all-reduces launched from
  the gradient hooks, overlapped with backward (the path every NCCL user runs; on the CPU over gloo, torch DDP's
  transport too);
- with the same AdamW for all (torch's default: on CPU a per-tensor loop), then each with its best setting
  (`--fused`: fused AdamW; torch DDP with bucket views);
- `lm_ddp_overlap` at `--bucket-cap-mb` and each `--sweep` cap: the overlap measurement (below).

Overlap, measured in one process so that both sides see the same machine load: `lm_ddp_overlap` alternates steps
with GradSync's all-reduce and steps with it replaced by a no-op (the step without communication), and at the end
times the step's bucket all-reduces on their own, one after another with nothing to overlap (`comm_s`, the sizes
the accounting layer recorded). The fraction of communication hidden behind backward is
1 - (step - step without communication) / comm_s: 1 is fully hidden, 0 fully exposed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runner import MARK, run_rounds, summarize, write_json  # noqa: E402
from bench_strategies import _env, _spawn, add_run_args, footer, forwarded, model_config, run_one  # noqa: E402
from lit_lm.strategies import comm, grad_sync  # noqa: E402
from lit_lm.strategies.comm import COMM_LOG  # noqa: E402
from lit_lm.strategies.ddp import DataParallelStrategy  # noqa: E402

KINDS = ["ddp", "ddp_view", "lm_ddp", "lm_ddp_overlap"]
LABEL = "GradSync bucket"  # the accounting layer's label of GradSync's all-reduces


def _no_op(output: torch.Tensor, *args: Any, fill: bool = False, **kwargs: Any) -> comm.Done:
    """A collective that does not communicate: its output is left as it is (the all-reduce's local gradient) or,
    with `fill`, zero-filled (a reduce-scatter's fresh shard: uninitialised memory may hold NaNs or denormals,
    which would slow the arithmetic that follows)."""
    if fill:
        output.zero_()
    return comm.Done()


class AlternateComm(L.Callback):
    """Odd steps run with `op` of the engine module `engine` (its `comm`) a no-op (the replicas drift apart: only the
    time matters). Default: GradSync's all-reduce."""

    def __init__(self, engine: Any = grad_sync, op: str = "all_reduce") -> None:
        no_op = partial(_no_op, fill=op == "reduce_scatter")
        self.engine, self.no_comm = engine, SimpleNamespace(**{**vars(comm), op: no_op})

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.engine.comm = self.no_comm if batch_idx % 2 else comm


def _time_alone(op: str, numel: int, device: torch.device) -> Any:
    """A closure running `op` (as `lit_lm.strategies.comm` records it: `numel` elements of the full tensor) once."""
    world = dist.get_world_size()
    if op == "all_reduce":
        buffer = torch.zeros(numel, device=device)
        return lambda: dist.all_reduce(buffer)
    full, shard = torch.zeros(numel, device=device), torch.zeros(numel // world, device=device)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, full)
    return lambda: dist.all_gather_into_tensor(full, shard)


class CommAlone(L.Callback):
    """The last step's collectives `op` whose label starts with `label` (sizes as recorded by `lit_lm.strategies.comm`),
    timed on their own at the end of training: serial, synchronous, nothing to overlap. The median of `reps`."""

    def __init__(self, reps: int = 10, op: str = "all_reduce", label: str = LABEL) -> None:
        self.reps, self.op, self.label, self.sizes, self.seconds = reps, op, label, [], None

    @override
    def on_train_batch_start(self, *args: Any) -> None:
        COMM_LOG.reset()  # this step's collectives only

    @override
    def on_train_batch_end(self, *args: Any) -> None:
        self.sizes = [r.numel for r in COMM_LOG.records if r.op == self.op and r.label.startswith(self.label)
                      ] or self.sizes  # not the no-op steps

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        runs = [_time_alone(self.op, n, pl_module.device) for n in self.sizes]
        times = []
        for _ in range(self.reps):
            dist.barrier()
            start = time.perf_counter()
            for run in runs:
                run()
            times.append(time.perf_counter() - start)
        self.seconds = statistics.median(times)


def overlap_metrics(steady: list[float], warmup: int, alone: CommAlone) -> dict[str, Any]:
    """The steady steps of an `AlternateComm` run (step i is batch warmup + i: even batches communicated) against
    the collectives alone: the fraction hidden, 1 - (step - step without them) / them alone."""
    steps = [t for i, t in enumerate(steady, warmup) if i % 2 == 0]
    without = [t for i, t in enumerate(steady, warmup) if i % 2 == 1]
    step, nocomm = statistics.median(steps), statistics.median(without)
    return {"step_s": step, "nocomm_s": nocomm, "comm_s": alone.seconds, "buckets": len(alone.sizes),
            "hidden": 1 - (step - nocomm) / alone.seconds}


def strategy(kind: str, bucket_cap_mb: float) -> Any:
    if kind.startswith("ddp"):
        return DDPStrategy(gradient_as_bucket_view=kind == "ddp_view", bucket_cap_mb=bucket_cap_mb)
    return DataParallelStrategy(bucket_cap_mb=bucket_cap_mb)


def worker_one(rank: int, args: argparse.Namespace, port: int, accelerator: str) -> None:
    config = _env(rank, args, port, accelerator)
    overlap = args.one == "lm_ddp_overlap"
    alone = CommAlone()
    r = run_one(args.one, args, config, accelerator, strategy(args.one, args.bucket_cap_mb),
                adamw={"fused": True} if args.fused else None, callbacks=[alone, AlternateComm()] if overlap else [])
    if rank != 0:
        return
    metrics = {"tokens_per_s": args.global_batch * args.seq_len / r["step_s"], "step_s": r["step_s"],
               "grad_bytes": r["memory"].get("grads")}
    if overlap:
        metrics = overlap_metrics(r["steady_s"], args.warmup, alone)
    print(MARK + json.dumps(metrics), flush=True)


def contenders(args: argparse.Namespace) -> dict[str, list[str]]:
    """{name: command}: the same-optimizer rows, the best-setting rows, the overlap runs over the bucket caps."""
    base = [sys.executable, __file__, *forwarded(args)]
    cap = ["--bucket-cap-mb", str(args.bucket_cap_mb)]
    out = {kind: [*base, "--one", kind, *cap] for kind in KINDS[:3]}
    out.update({f"{kind} fused": [*base, "--one", kind, "--fused", *cap] for kind in ("ddp_view", "lm_ddp")})
    out.update({f"lm_ddp_overlap {mb:g}": [*base, "--one", "lm_ddp_overlap", "--bucket-cap-mb", str(mb)]
                for mb in [args.bucket_cap_mb, *args.sweep]})
    return out


def _spread(t: dict[str, Any], scale: float = 1.0, fmt: str = ".0f") -> str:
    return f"{t['median'] * scale:{fmt}} ({t['min'] * scale:{fmt}}–{t['max'] * scale:{fmt}})"


def markdown(run: dict[str, Any]) -> str:
    """The speed table (ratio of medians against torch DDP with the same AdamW) and the overlap table."""
    table, cap = run["summary"], run["args"]["bucket_cap_mb"]
    base = {"default": table["ddp"]["tokens_per_s"]["median"],
            "fused": table["ddp_view fused"]["tokens_per_s"]["median"]}
    names = {"ddp": "torch DDP", "ddp_view": "torch DDP, `gradient_as_bucket_view`",
             "lm_ddp": f"`lm_ddp` ({cap:g} MB)"}
    lines = ["| contender | AdamW | tokens/s median (min–max) | vs torch DDP, same AdamW |", "|---|---|---|---|"]
    for name in ("ddp", "ddp_view", "lm_ddp", "ddp_view fused", "lm_ddp fused"):
        t = table[name]
        kind, _, adamw = name.partition(" ")
        adamw = adamw or "default"
        lines.append(f"| {names[kind]} | {adamw} | {_spread(t['tokens_per_s'])} | "
                         f"{t['tokens_per_s']['median'] / base[adamw]:.2f}× |")
    lines += ["", "| `lm_ddp`, bucket cap | buckets | step ms | same, all-reduce a no-op, ms | all-reduces alone, ms "
              "| hidden |", "|---|---|---|---|---|---|"]
    for name, t in sorted(((n, t) for n, t in table.items() if n.startswith("lm_ddp_overlap")),
                          key=lambda item: -float(item[0].split()[1])):
        lines.append(f"| {name.split()[1]} MB | {t['buckets']['median']:.0f} | {_spread(t['step_s'], 1e3, '.1f')} | "
                     f"{_spread(t['nocomm_s'], 1e3, '.1f')} | {_spread(t['comm_s'], 1e3, '.1f')} | "
                     f"{_spread(t['hidden'], 100)} % |")
    lines.append(f"\n{footer(run)}")
    return "\n".join(lines)


def table_one_or_rounds(args: argparse.Namespace, markdown: Callable[[dict[str, Any]], str],
                        contenders: Callable[[argparse.Namespace], dict[str, list[str]]],
                        worker_one: Callable[..., None]) -> Optional[list]:
    """`--table`: print a saved run; `--one`: run one contender (what the alternating runner calls); both return
    None. Otherwise every contender over the shuffled rounds: the rounds."""
    if args.table:
        print(markdown(json.loads(Path(args.table).read_text())))
        return None
    if args.one:
        _spawn(worker_one, args)
        return None
    return run_rounds(contenders(args), args.rounds, args.seed)


def bench_main(p: argparse.ArgumentParser, argv: Optional[list[str]], kinds: list[str], out: str,
               markdown: Callable[[dict[str, Any]], str],
               contenders: Callable[[argparse.Namespace], dict[str, list[str]]],
               worker_one: Callable[..., None]) -> None:
    """The command line bench_ddp and bench_zero share: `--table` prints a saved run, `--one` runs one contender
    (what the alternating runner calls), otherwise every contender over the rounds, then the table and the JSON."""
    add_run_args(p)
    p.add_argument("--one", choices=kinds, help="run this contender once and print its metrics")
    p.add_argument("--fused", action="store_true", help="fused AdamW (with --one)")
    p.add_argument("--out", default=out)
    p.add_argument("--table", help="print a saved run (its --out JSON) as Markdown, and exit")
    args = p.parse_args(argv)
    rounds = table_one_or_rounds(args, markdown, contenders, worker_one)
    if rounds is None:
        return
    run = {"args": vars(args), "phi": model_config(args).num_params()}
    write_json(args.out, rounds, summarize(rounds), **run)
    print(markdown(json.loads(Path(args.out).read_text())))
    print(f"wrote {args.out} ({os.cpu_count()} CPUs)")


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--sweep", type=float, nargs="*", default=[0.25, 1.0], help="more lm_ddp bucket caps (MB)")
    bench_main(p, argv, KINDS, "runs/bench_ddp.json", markdown, contenders, worker_one)


if __name__ == "__main__":
    main()
