"""Memory and speed at the size users run: the engines against torch's references at ~4M and ~217M parameters.

    python scripts/bench_size.py --size 4m                             # every contender, CPU/gloo, 2 processes
    python scripts/bench_size.py --size 217m --kinds fsdp2 zero3       # a subset (each command: a few minutes)
    python scripts/bench_size.py --size 217m --one zero3 --loop plain  # one contender once (what the rounds run)
    python scripts/bench_size.py --table runs/bench_size.json          # a saved run as Markdown

Contenders, every one driven by the same plain per-tensor AdamW (`foreach=False`, torch's default on the CPU):

- references, in a plain PyTorch loop: `ddp` (torch `DistributedDataParallel`), `zero_torch` (DDP with AdamW inside
  `ZeroRedundancyOptimizer`), `fsdp2` (`fully_shard` per block and on the model, built on the meta device);
- lit-lm's engines in a plain loop (`plain`: `scripts/bench_overhead.py`'s, the engine built as the strategy
  builds it; `lm_ddp` with torch's own AdamW, ZeRO with `dp_engine.bind_optimizer`'s master shards and flat step)
  and the same presets through the Trainer (`trainer`:
  `bench_overhead.py`'s minimal LightningModule that logs nothing): `lm_ddp`, `zero1`, `zero2`, `zero3`. ZeRO's
  collectives take their default form (`zero_collectives: auto`: gloo's all-reduce and broadcasts for ZeRO-1/2 on
  CPU ranks, docs/zero.md).

Per contender: the step time (rank 0's median steady step, with min and max), and per rank the peak resident
memory above imports: the worker resets the resident high-water mark (Linux `clear_refs` 5) once everything is
imported and reads VmHWM at the end, minus the VmRSS it started from. Each contender runs in its own fresh
processes, alternated over >= 5 rounds in an order shuffled per round (`bench_runner.py`); `--one`, `--table` and
the rounds are `bench_ddp.py`'s dispatch.

Allocator: the Trainer's strategy applies lit-lm's choice for glibc's malloc on a CPU rank (`LIT_LM_MALLOC`,
lit_lm/strategies/host_malloc.py; default `large`: blocks from 8 MiB, 2 MiB under huge pages, mapped and returned when
freed); the plain loops and the references run on glibc's own malloc unless `--malloc` names a choice, which every
contender then applies (its threshold from the start, the heap trimmed once before the first step), so that the
loops differ by the loop alone. The engines' processes, both loops, start with torch's huge pages for big blocks, as
the `lit-lm` command starts its ranks; torch's references without, as torch starts (`--huge-pages` chooses).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ddp import _spread, table_one_or_rounds  # noqa: E402
from bench_overhead import ENGINES, LOOPS, Clock, ClockCallback, plain_loop, trainer_loop  # noqa: E402
import bench_runner  # noqa: E402
from bench_runner import MARK, summarize, write_json  # noqa: E402
from bench_strategies import BenchLM, _env, add_run_args, footer, forwarded, model_config, token_loader  # noqa: E402
from lit_lm.config import ModelConfig  # noqa: E402
from lit_lm.model import Transformer  # noqa: E402
from lit_lm.resident import ResidentPeak  # noqa: E402
from lit_lm.strategies.host_malloc import CHOICE, HUGE_PAGES, MODES, HostMalloc  # noqa: E402

REFERENCES = ["ddp", "zero_torch", "fsdp2"]
KINDS = REFERENCES + ENGINES
# the reference each engine is held to (issue 36): speed >= it, peak memory <= it (zero3: <= 1.05x FSDP2's)
REFERENCE_OF = {"lm_ddp": "ddp", "zero1": "zero_torch", "zero2": "zero_torch", "zero3": "fsdp2"}
SIZES = {  # the issue's two sizes: bench_strategies' default model (Φ 4.3M) and d 1024 x 12 layers, vocab 32,000
    "4m": {"d_model": 256, "n_layers": 4, "vocab_size": 2048, "n_heads": 8, "global_batch": 8, "seq_len": 128},
    "217m": {"d_model": 1024, "n_layers": 12, "vocab_size": 32000, "n_heads": 16, "global_batch": 2, "seq_len": 128},
}


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, foreach=False)


def reference_loop(kind: str, args: argparse.Namespace, config: ModelConfig, accelerator: str,
                   device: torch.device, clock: Clock) -> None:
    """torch's references driven like `bench_overhead.plain_loop` drives the engines."""
    dist.init_process_group("nccl" if accelerator == "gpu" else "gloo", device_id=device if accelerator == "gpu"
                            else None)
    loader = token_loader(args, config, dist.get_rank(), dist.get_world_size())
    torch.manual_seed(0)
    if kind == "fsdp2":
        with torch.device("meta"):
            model = Transformer(config)
        for block in model.blocks.values():
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device=device)
        with torch.no_grad():  # each rank draws its own local rows (the values do not matter here, the sizes do)
            for p in model.parameters():
                p.to_local().normal_(0.0, config.init_std)  # type: ignore[attr-defined]
        forward, optimizer = model, adamw(model.parameters())
    else:
        model = Transformer(config).to(device)
        forward = DistributedDataParallel(model)
        optimizer = (ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4, foreach=False)
                     if kind == "zero_torch" else adamw(model.parameters()))
    for (tokens,) in loader:
        clock.mark()
        tokens = tokens.to(device)
        inner = forward.module if isinstance(forward, DistributedDataParallel) else forward
        # DDP hooks its reducer into forward(): the loss goes through the wrapper's forward
        logits = forward(tokens[:, :-1])
        loss = inner.loss_fn(logits, tokens[:, 1:])[0]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


class SetupTrimClock(Clock):
    """A Clock that, at the first step's start, hands back what the setup freed (`HostMalloc.trim`), as a strategy
    does at the end of its setup."""

    def __init__(self, host: HostMalloc, *args: Any) -> None:
        super().__init__(*args)
        self.host = host

    def mark(self) -> None:
        if not self.marks:
            self.host.trim(setup=True)
        super().mark()


def worker_one(rank: int, args: argparse.Namespace, port: int, accelerator: str, out: str) -> None:
    """One contender; every rank writes its metrics to `out`/rank<r>.json (the parent prints them)."""
    peak = ResidentPeak()  # everything imported (the ranks are forked from the parent): the baseline
    config = _env(rank, args, port, accelerator)
    device = torch.device("cuda", rank) if accelerator == "gpu" else torch.device("cpu")
    if accelerator == "gpu":
        torch.cuda.set_device(device)
    clock = Clock(device, args.steps, args.warmup, None)
    if args.malloc:  # every loop on the same allocator: the strategy applies it itself under the Trainer
        os.environ[CHOICE] = args.malloc
        if accelerator == "cpu" and (args.one in REFERENCES or args.loop == "plain"):
            host = HostMalloc()
            host.start()
            clock = SetupTrimClock(host, device, args.steps, args.warmup, None)
    if args.one in REFERENCES:
        reference_loop(args.one, args, config, accelerator, device, clock)
    else:
        # the Trainer's module runs the model first and its clock reads no weight: ZeRO-1/2's gathers after the step
        # may run beside the next forward (lit_lm/strategies/weight_readers.py), as under LanguageModel
        BenchLM.reads_weights = ClockCallback.reads_weights = False
        (trainer_loop if args.loop == "trainer" else plain_loop)(args.one, args, config, accelerator, device, clock)
    steady = clock.steady()
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "step_s": statistics.median(steady), "step_min_s": min(steady), "step_max_s": max(steady),
        "peak_bytes": peak.above(), "cuda_peak_bytes": torch.cuda.max_memory_allocated(device)
        if accelerator == "gpu" else None}))


def run_one(args: argparse.Namespace, worker: Any = None) -> None:
    """`--one`: the contender on `args.devices` processes, then one BENCH_RESULT line with every rank's figures.
    `worker` (default `worker_one`) writes `out`/rank<r>.json; rank 0's numbers besides the peaks are its figures."""
    with tempfile.TemporaryDirectory() as out:
        table_one_or_rounds(args, markdown, contenders, partial(worker or worker_one, out=out))
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.devices)]
    metrics = {k: v for k, v in ranks[0].items() if k not in ("peak_bytes", "cuda_peak_bytes")}
    metrics.update({f"peak_bytes_rank{r}": m["peak_bytes"] for r, m in enumerate(ranks)},
                   peak_bytes=max(m["peak_bytes"] for m in ranks))
    if ranks[0]["cuda_peak_bytes"] is not None:
        metrics["cuda_peak_bytes"] = max(m["cuda_peak_bytes"] for m in ranks)
    print(MARK + json.dumps(metrics), flush=True)


def contenders(args: argparse.Namespace) -> dict[str, list[str]]:
    base = [sys.executable, __file__, *forwarded(args)]
    out = {}
    for kind in args.kinds:
        loops = ["plain"] if kind in REFERENCES else args.loops
        out.update({f"{kind} {loop}": [*base, "--one", kind, "--loop", loop] for loop in loops})
    out = {name: [*cmd, "--malloc", args.malloc] if args.malloc else cmd for name, cmd in out.items()}
    return {name: ["env", f"{HUGE_PAGES}={int(huge_pages(args, name.split()[0]))}", *cmd] for name, cmd in out.items()}


def huge_pages(args: argparse.Namespace, kind: str) -> bool:
    """Whether `kind`'s processes start with torch's huge pages on (`--huge-pages`;
    lit_lm/strategies/host_malloc.py)."""
    return args.huge_pages == "all" or (args.huge_pages == "lit-lm" and kind not in REFERENCES)


def markdown(run: dict[str, Any]) -> str:
    """Per contender: step time and peak resident memory above imports (the larger rank), each median (min-max)
    over the rounds, and both against the reference the engine is held to (ratio of medians)."""
    table = run["summary"]
    lines = ["| contender | step s | peak RSS above imports, GB (max over ranks) | speed vs reference | "
             "memory vs reference | Trainer speed vs plain loop |", "|---|---|---|---|---|---|"]
    for name, t in table.items():
        kind, loop = name.split()
        ref = table.get(f"{REFERENCE_OF.get(kind, '')} plain")
        speed = f"{ref['step_s']['median'] / t['step_s']['median']:.2f}×" if ref else "reference"
        memory = f"{t['peak_bytes']['median'] / ref['peak_bytes']['median']:.2f}×" if ref else "reference"
        plain = table.get(f"{kind} plain") if loop == "trainer" else None
        trainer = f"{plain['step_s']['median'] / t['step_s']['median']:.2f}×" if plain else ""
        lines.append(f"| {name} | {_spread(t['step_s'], 1, '.2f')} | {_spread(t['peak_bytes'], 1e-9, '.2f')} | "
                     f"{speed} | {memory} | {trainer} |")
    lines.append(f"\n{footer(run)}")
    return "\n".join(lines)


def shard_layout(d_model: int, n_layers: int, vocab: int, ranks: int) -> list[int]:
    """The sizes of the tensors one rank's optimizer steps under ZeRO-3 (row shards of each parameter), in order."""
    d_ff = ModelConfig(d_model=d_model, n_heads=1, vocab_size=vocab).d_ff or 0
    block = [d_model * d_model // ranks] * 4 + [d_ff * d_model // ranks] * 3 + [d_model // ranks] * 2
    return [vocab * d_model // ranks] + block * n_layers + [d_model // ranks, vocab * d_model // ranks]


def optimizer_step(reps: int = 7) -> None:
    """`--optimizer-step`: AdamW (foreach=False) over one rank's ZeRO-3 shards laid out as one flat tensor, per
    tensor, and as the flat step's pieces of 2^16, 2^18 and 2^20 elements; rank 0's CPU time per step (process time:
    what the load disturbs least), the layouts alternated in one process, median (min) of `reps`."""
    import lit_lm.strategies.flat_step as flat_step
    from lit_lm.strategies.flat_step import FlatShard

    torch.set_num_threads(1)
    for name, sizes in {"4m": shard_layout(256, 4, 2048, 2), "44m": shard_layout(512, 8, 16000, 2)}.items():
        layouts: dict[str, list[int]] = {"whole flat": [sum(sizes)], "per tensor": sizes}
        for bits in (16, 18, 20):
            flat_step.CPU_PIECE_NUMEL = 2**bits
            fs = FlatShard([torch.empty(s) for s in sizes], torch.empty(sum(sizes)), torch.empty(sum(sizes)))
            layouts[f"pieces of 2^{bits}"] = [piece.value.numel() for piece in fs.pieces]
        optimizers = {}
        for label, layout in layouts.items():
            params = [torch.zeros(n) for n in layout]
            for p in params:
                p.grad = torch.full_like(p, 1e-3)
            optimizers[label] = adamw(params)
            optimizers[label].step()
        times: dict[str, list[float]] = {label: [] for label in layouts}
        for _ in range(reps):
            for label, optimizer in optimizers.items():
                start = time.process_time()
                optimizer.step()
                times[label].append(time.process_time() - start)
        print(f"\n{name}: {sum(sizes):,} elements per rank, {len(sizes)} shards; load {os.getloadavg()[0]:.1f}")
        for label, t in times.items():
            print(f"  {label:<16} {len(layouts[label]):>4} tensors  {statistics.median(t) * 1e3:7.1f} ms "
                  f"({min(t) * 1e3:.1f})")


def locked_run(run_once: Any, lock: str, command: list[str], timeout: Optional[float] = None) -> dict[str, Any]:
    """`run_once` of one contender while holding `lock`'s flock."""
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        return run_once(command, timeout)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.set_defaults(steps=6, warmup=2)
    p.add_argument("--size", choices=SIZES, help="the model and batch of one of the issue's sizes (overrides them)")
    p.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
    p.add_argument("--loops", nargs="+", default=LOOPS, choices=LOOPS, help="the engines' loops")
    p.add_argument("--one", choices=KINDS, help="run this contender once (with --loop) and print its metrics")
    p.add_argument("--loop", choices=LOOPS, default="plain")
    p.add_argument("--malloc", choices=MODES, help="every contender on this LIT_LM_MALLOC choice (unset: the plain "
                   "loops and references on glibc's own malloc, the Trainer on the strategy's default)")
    p.add_argument("--huge-pages", choices=("lit-lm", "all", "none"), default="lit-lm",
                   help=f"whose processes start with {HUGE_PAGES}=1: lit-lm's engines, as the lit-lm command starts "
                   "its ranks (the default), every contender's, or none")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="GradSync's (lm_ddp), as the strategy's default")
    p.add_argument("--lock", help="hold this file's flock for each contender's run (a shared machine: other work runs "
                   "between the runs, never beside one), the load average read once it is held")
    p.add_argument("--out", default="runs/bench_size.json")
    p.add_argument("--table", help="print a saved run (its --out JSON) as Markdown, and exit")
    p.add_argument("--optimizer-step", action="store_true", help="time AdamW over the flat step's layouts, and exit")
    args = p.parse_args(argv)
    if args.optimizer_step:
        optimizer_step()
        return
    if args.size:
        for key, value in SIZES[args.size].items():
            setattr(args, key, value)
    args.profile = None  # bench_overhead's loops read it
    if args.one:
        run_one(args)
        return
    if args.lock:
        bench_runner.run_once = partial(locked_run, bench_runner.run_once, args.lock)
    rounds = table_one_or_rounds(args, markdown, contenders, worker_one)
    if rounds is None:
        return
    write_json(args.out, rounds, summarize(rounds), args=vars(args), phi=model_config(args).num_params(),
               threads=os.environ.get("OMP_NUM_THREADS"))
    print(markdown(json.loads(Path(args.out).read_text())))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
