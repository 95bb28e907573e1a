"""Measured pipeline bubbles next to theory, per schedule, on CPU processes (gloo): injected compute and the real model.

    python scripts/bench_pipeline.py --stages 2 --microbatches 8 --layers 8 --json bench_pp.json

`--model sleep`: a toy `PipelineModel` of `--layers` layers does almost no arithmetic but sleeps per layer
`--sleep-ms` in forward, as much in the input-gradient backward and in the weight-gradient backward (F = B = W,
an unsplit backward costs 2F: the costs theory assumes). `--model real`: lit-lm's Transformer, so the costs are
whatever F, B and W really take (printed). `both` (default) runs one, then the other.

A rank's bubble = 1 - busy / T, busy the time in its compute actions (waiting for a message is idle), T the
pipeline's step from the first rank's start to the last rank's end; each step starts after a barrier, the first
of `--steps` is a warm-up and the others are averaged. Theory: each schedule's bubble formula in the registry
(`lit_lm/strategies/pp_schedules.py` SCHEDULES; `--schedules` picks some, by default all, a schedule with virtual stages
runs `--virtual-stages` chunks). Each action also pays a fixed ~1 ms here (a message's latency, Python);
the default 50 ms sleep per layer makes that noise. Peak microbatches in flight per rank come from the schedule.
`--plot FILE` draws the last measured step of every schedule as a per-rank timeline of its F, B and W actions
(measured start and end times, one clock for all processes of the host; gaps are idle), one PNG per model kind.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from machine import machine  # noqa: E402  (scripts/: where the figures were measured)
from lit_lm.strategies.pp_runner import PipelineRunner  # noqa: E402
from lit_lm.strategies.errors import ConfigError  # noqa: E402
from lit_lm.strategies.pp_schedules import SCHEDULES, bubble_theory, build_schedule, schedule_spec  # noqa: E402
from lit_lm.strategies.pp_split import split_layers  # noqa: E402

KINDS = {"sleep": ("sleep",), "real": ("real",), "both": ("sleep", "real")}


class _Sleep(torch.autograd.Function):
    """Identity that sleeps `fwd` seconds in forward and `bwd` in backward: injected compute."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, fwd: float, bwd: float) -> Tensor:
        ctx.bwd = bwd
        time.sleep(fwd)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        time.sleep(ctx.bwd)
        return grad, None, None


class SleepyLayer(nn.Module):
    """x + x @ w, sleeping in forward, on the input-gradient path and on the weight-gradient path."""

    def __init__(self, dim: int, sleep: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dim))
        self.sleep = sleep

    def forward(self, x: Tensor) -> Tensor:
        return x + _Sleep.apply(x, self.sleep, self.sleep) @ _Sleep.apply(self.weight, 0.0, self.sleep)


class SleepyModel(nn.Module):
    """The smallest `PipelineModel`: an elementwise "embedding" on the first stage (so that its first layer runs
    its input-gradient backward, as a real model's does for the embedding's gradient), layers, a squared-mean
    loss on the last stage."""

    def __init__(self, layers: int, dim: int, sleep: float) -> None:
        super().__init__()
        self.dim = dim
        self.embed = nn.Parameter(torch.ones(dim))
        self.blocks = nn.ModuleDict({str(i): SleepyLayer(dim, sleep) for i in range(layers)})

    def init_parameter(self, name: str, tensor: Tensor) -> None:
        nn.init.normal_(tensor, std=0.01)

    def pipeline_split(self, stage_layers: list[int], is_first: bool, is_last: bool) -> None:
        for key in [k for k in self.blocks if int(k) not in stage_layers]:
            del self.blocks[key]
        if not is_first:
            del self.embed

    def pipeline_activation(self, batch: int, seq_len: int) -> tuple[torch.Size, torch.dtype]:
        return torch.Size((batch, seq_len, self.dim)), torch.float32

    def stage_forward(self, x: Tensor, layers: list[int], targets: Optional[Tensor] = None) -> Any:
        if layers[0] == 0:
            x = x * self.embed
        for i in layers:
            x = self.blocks[str(i)](x)
        if targets is None:
            return x
        loss = (x - targets).pow(2).mean()
        return loss, loss.detach()

    def loss(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        return self.stage_forward(inputs, [int(k) for k in self.blocks], targets)


def _stage_model(kind: str, args: argparse.Namespace, chunks: list[list[int]], rank: int) -> nn.Module:
    """The sleepy toy, or lit-lm's Transformer (untied, so that ZB-H1 can split every stage's backward), split."""
    torch.manual_seed(0)
    if kind == "sleep":
        model: nn.Module = SleepyModel(args.layers, args.dim, args.sleep_ms / 1000)
    else:
        from lit_lm.config import ModelConfig
        from lit_lm.model import Transformer

        model = Transformer(ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers,
                                        n_heads=args.d_model // 64, max_seq_len=args.seq_len))
    for n, q in model.named_parameters():
        model.init_parameter(n, q)
    model.pipeline_split(sum(chunks, []), rank == 0, rank == args.stages - 1)
    return model


def _batch(kind: str, args: argparse.Namespace) -> tuple[Tensor, Tensor]:
    rows = args.microbatches * args.micro_batch
    if kind == "sleep":
        x = torch.randn(rows, 4, args.dim)
        return x, torch.zeros_like(x)
    return torch.randint(args.vocab, (rows, args.seq_len)), torch.randint(args.vocab, (rows, args.seq_len))


def _worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.stages)
    p, m = args.stages, args.microbatches
    results = {}
    for kind, name in itertools.product(KINDS[args.model], args.schedules):
        v = _chunks(name, args)
        stages = split_layers(args.layers, p, v, args.layers_per_stage if v == 1 else None)
        chunks = [stages[c * p + rank] for c in range(v)]
        schedule = build_schedule(name, p, m, v)
        runner = PipelineRunner(_stage_model(kind, args, chunks, rank), schedule, rank, chunks)
        inputs, targets = _batch(kind, args)
        steps = []  # (start, end, busy) of each measured step
        costs: dict[str, list[float]] = {}  # seconds of each compute action, by op
        for step in range(args.steps):
            dist.barrier()
            runner.run(inputs, targets, train=True)
            if step > 0:
                steps.append((runner.stats.start, runner.stats.start + runner.stats.wall, runner.stats.busy))
                for a, t0, t1 in runner.stats.events:
                    costs.setdefault(a.op, []).append(t1 - t0)
        start = runner.stats.start  # the last step's compute actions, on the host's clock
        results[(kind, name)] = {"v": v, "steps": steps, "theory": bubble_theory(name, p, m, v),
                                 "peak_in_flight": schedule.peak_in_flight()[rank],
                                 "costs": {op: sum(ts) / len(ts) for op, ts in costs.items()},
                                 "timeline": [(a.op, a.mb, a.chunk, start + t0, start + t1)
                                              for a, t0, t1 in runner.stats.events]}
        if rank == 0:  # progress: a schedule takes (steps x its step time), up to ~20 s with the defaults
            print(f"[bench_pipeline] {kind} {name}: {args.steps} steps done", flush=True)
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _chunks(name: str, args: argparse.Namespace) -> int:
    return args.virtual_stages if SCHEDULES[name].chunked else 1


def _schedule(name: str) -> str:
    """argparse type: a registered schedule, or the registry's one error."""
    try:
        schedule_spec(name)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def _summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One schedule's figures from every rank's: a step lasts from the first rank's start to the last rank's end."""
    measured = len(rows[0]["steps"])
    times = [max(r["steps"][i][1] for r in rows) - min(r["steps"][i][0] for r in rows) for i in range(measured)]
    bubbles = [sum(1 - r["steps"][i][2] / t for i, t in enumerate(times)) / measured for r in rows]
    ops = {op for r in rows for op in r["costs"]}
    return {"v": rows[0]["v"], "step_s": sum(times) / measured, "bubble_mean": sum(bubbles) / len(bubbles),
            "bubble_per_rank": bubbles, "theory": rows[0]["theory"],
            "costs": {op: sum(r["costs"][op] for r in rows if op in r["costs"]) /
                      sum(op in r["costs"] for r in rows) for op in ops},
            "peak_in_flight": [r["peak_in_flight"] for r in rows]}


COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}


def plot_timelines(per_rank: list[dict[Any, Any]], kind: str, schedules: list[str], path: Path) -> Path:
    """One panel per schedule: a row per rank, a bar per measured F / B / W action labelled with its microbatch
    (and chunk), time from the step's first action."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from matplotlib.patches import Patch
    from plotting import figure, save

    fig, axes = figure(7.5, 1.0 + 1.1 * len(schedules), nrows=len(schedules), squeeze=False)
    for ax, name in zip(axes[:, 0], schedules):
        timelines = [r[(kind, name)]["timeline"] for r in per_rank]
        origin = min(t0 for events in timelines for _, _, _, t0, _ in events)
        for rank, events in enumerate(timelines):
            for op, mb, chunk, t0, t1 in events:
                ax.barh(rank, 1000 * (t1 - t0), left=1000 * (t0 - origin), color=COLOURS[op], edgecolor="white",
                        linewidth=0.5, height=0.8)
                label = f"{mb}" + (f".{chunk}" if chunk else "")
                ax.text(1000 * ((t0 + t1) / 2 - origin), rank, label, ha="center", va="center", fontsize=5,
                        color="white")
        ax.set_yticks(range(len(timelines)), [f"rank {r}" for r in range(len(timelines))], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(name, fontsize=8, loc="left")
        ax.tick_params(axis="x", labelsize=7)
    axes[-1, 0].set_xlabel("ms since the step's first action", fontsize=8)
    handles = [Patch(color=colour, label=op) for op, colour in COLOURS.items()]
    fig.legend(handles=handles, fontsize=7, loc="upper right", ncol=3)
    return save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedules", type=_schedule, nargs="+", default=list(SCHEDULES),
                        help=f"default: every one ({', '.join(SCHEDULES)})")
    parser.add_argument("--virtual-stages", type=int, default=2, help="of the schedules that interleave chunks")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--layers-per-stage", type=int, nargs="+", default=None,
                        help="fixed split for the v = 1 schedules, e.g. 5 3 (the last stage also runs head and loss)")
    parser.add_argument("--sleep-ms", type=float, default=50.0, help="per layer, for each of F, B and W")
    parser.add_argument("--dim", type=int, default=16, help="width of the sleepy toy")
    parser.add_argument("--model", choices=tuple(KINDS), default="both",
                        help="sleep: compute injected as sleeps; real: lit-lm's Transformer; both")
    parser.add_argument("--d-model", type=int, default=256, help="of the real model (n_heads = d_model / 64)")
    parser.add_argument("--seq-len", type=int, default=128, help="of the real model")
    parser.add_argument("--vocab", type=int, default=4096, help="of the real model")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="the first is a warm-up, the others are averaged")
    parser.add_argument("--timeline", action="store_true", help="print each schedule's simulated timeline")
    parser.add_argument("--json", type=str, default=None)
    parser.add_argument("--plot", type=str, default=None, help="per-rank timelines of the last measured step (PNG; "
                        "with --model both, one file per kind: NAME_sleep.png, NAME_real.png)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first is a warm-up)")

    import socket
    import tempfile

    from rich.console import Console
    from rich.table import Table

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(args, port, out), nprocs=args.stages, join=True)
        per_rank = [torch.load(Path(out) / f"rank{r}.pt") for r in range(args.stages)]

    console = Console()
    if args.timeline:
        from lit_lm.strategies.pp_schedules import print_timeline

        for name in args.schedules:
            print_timeline(build_schedule(name, args.stages, args.microbatches, _chunks(name, args)), console)
    report: dict[str, Any] = {"args": vars(args)}
    for kind in KINDS[args.model]:
        compute = (f"sleep {args.sleep_ms} ms per layer for each of F, B, W" if kind == "sleep" else
                   f"lit-lm Transformer d_model={args.d_model} seq={args.seq_len}")
        table = Table(title=f"pipeline bubbles: p={args.stages} m={args.microbatches} layers={args.layers}, {compute}")
        for col in ("schedule", "v", "step ms", "F / B / W ms", "bubble measured (mean / per rank)", "theory",
                    "measured / theory", "peak in flight"):
            table.add_column(col)
        report[kind] = {}
        for name in args.schedules:
            row = _summarise([r[(kind, name)] for r in per_rank])
            report[kind][name] = row
            table.add_row(name, str(row["v"]), f"{1000 * row['step_s']:.0f}",
                          " / ".join(f"{1000 * row['costs'][op]:.1f}" if op in row["costs"] else "-" for op in "FBW"),
                          f"{row['bubble_mean']:.3f} / " + " ".join(f"{b:.3f}" for b in row["bubble_per_rank"]),
                          f"{row['theory']:.3f}", f"{row['bubble_mean'] / row['theory']:.2f}",
                          str(row["peak_in_flight"]))
        console.print(table)
    for kind in KINDS[args.model] if args.plot else ():
        path = Path(args.plot)
        path = path if args.model != "both" else path.with_name(f"{path.stem}_{kind}{path.suffix}")
        print(f"wrote {plot_timelines(per_rank, kind, args.schedules, path)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), **report}, indent=2))


if __name__ == "__main__":
    main()
