"""Measured pipeline bubbles next to theory, per schedule, with compute injected as sleeps (CPU, gloo).

    python scripts/bench_pipeline.py --stages 4 --microbatches 8 --layers 8 --sleep-ms 2 --json bench_pp.json

A toy `PipelineModel` of `--layers` layers does almost no arithmetic but sleeps per layer `sleep` in forward,
`sleep` in the input-gradient backward and `sleep` in the weight-gradient backward (F = B = W, so an unsplit
backward costs 2F). The runner times its compute actions; bubble = 1 - busy / wall per rank (the last step of
`--steps`). Theory: (p-1)/(m+p-1) for GPipe and 1F1B, that over v for interleaved, (p-1)/(3m+p-1) for ZB-H1.
Also prints each rank's peak of microbatches in flight (from the schedule).
"""

from __future__ import annotations

import argparse
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
from strategies.pp import split_layers  # noqa: E402
from strategies.pp_runner import PipelineRunner  # noqa: E402
from strategies.pp_schedules import SCHEDULES, bubble_theory, build_schedule  # noqa: E402


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
    """The smallest `PipelineModel`: layers, a squared-mean loss on the last stage."""

    def __init__(self, layers: int, dim: int, sleep: float) -> None:
        super().__init__()
        self.dim = dim
        self.blocks = nn.ModuleDict({str(i): SleepyLayer(dim, sleep) for i in range(layers)})

    def init_parameter(self, name: str, tensor: Tensor) -> None:
        nn.init.normal_(tensor, std=0.01)

    def pipeline_split(self, stage_layers: list[int], is_first: bool, is_last: bool) -> None:
        for key in [k for k in self.blocks if int(k) not in stage_layers]:
            del self.blocks[key]

    def pipeline_activation(self, batch: int, seq_len: int) -> tuple[torch.Size, torch.dtype]:
        return torch.Size((batch, seq_len, self.dim)), torch.float32

    def stage_forward(self, x: Tensor, layers: list[int], targets: Optional[Tensor] = None) -> Any:
        for i in layers:
            x = self.blocks[str(i)](x)
        if targets is None:
            return x
        loss = (x - targets).pow(2).mean()
        return loss, loss.detach()

    def loss(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        return self.stage_forward(inputs, [int(k) for k in self.blocks], targets)


def _worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.stages)
    p, m = args.stages, args.microbatches
    results = {}
    for name in SCHEDULES:
        v = args.virtual_stages if name == "interleaved_1f1b" else 1
        torch.manual_seed(0)
        model = SleepyModel(args.layers, args.dim, args.sleep_ms / 1000)
        for n, q in model.named_parameters():
            model.init_parameter(n, q)
        stages = split_layers(args.layers, p, v)
        chunks = [stages[c * p + rank] for c in range(v)]
        model.pipeline_split(sum(chunks, []), rank == 0, rank == p - 1)
        schedule = build_schedule(name, p, m, v)
        runner = PipelineRunner(model, schedule, rank, chunks)
        x = torch.randn(m * args.micro_batch, 4, args.dim)
        for _ in range(args.steps):
            dist.barrier()
            runner.run(x, torch.zeros_like(x), train=True)
        results[name] = {"v": v, "wall": runner.stats.wall, "busy": runner.stats.busy,
                         "bubble": runner.stats.idle_fraction, "theory": bubble_theory(name, p, m, v),
                         "peak_in_flight": schedule.peak_in_flight()[rank]}
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--virtual-stages", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--sleep-ms", type=float, default=2.0, help="per layer, for each of F, B and W")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="the last one is measured")
    parser.add_argument("--timeline", action="store_true", help="print each schedule's simulated timeline")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()

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
        from strategies.pp_schedules import print_timeline

        for name in SCHEDULES:
            v = args.virtual_stages if name == "interleaved_1f1b" else 1
            print_timeline(build_schedule(name, args.stages, args.microbatches, v), console)
    table = Table(title=f"pipeline bubbles: p={args.stages} m={args.microbatches} layers={args.layers} "
                        f"sleep={args.sleep_ms} ms per layer for each of F, B, W")
    for col in ("schedule", "v", "wall ms", "bubble measured (mean / per rank)", "theory", "peak in flight"):
        table.add_column(col)
    report = {"args": vars(args), "schedules": {}}
    for name in SCHEDULES:
        rows = [r[name] for r in per_rank]
        mean = sum(r["bubble"] for r in rows) / len(rows)
        report["schedules"][name] = {"v": rows[0]["v"], "wall_s": max(r["wall"] for r in rows), "bubble_mean": mean,
                                     "bubble_per_rank": [r["bubble"] for r in rows], "theory": rows[0]["theory"],
                                     "peak_in_flight": [r["peak_in_flight"] for r in rows]}
        table.add_row(name, str(rows[0]["v"]), f"{1000 * max(r['wall'] for r in rows):.0f}",
                      f"{mean:.3f} / " + " ".join(f"{r['bubble']:.2f}" for r in rows), f"{rows[0]['theory']:.3f}",
                      str([r["peak_in_flight"] for r in rows]))
    console.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
