"""Benchmark ZeRO's hot path: `zero1`/`zero2` against torch's `ZeroRedundancyOptimizer` + DDP, `zero3` against FSDP2,
and how much of ZeRO-2/3's gradient reduce-scatter backward hides.

    python scripts/bench_zero.py                              # CPU/gloo, 2 processes, 5 rounds
    python scripts/bench_zero.py --one zero2 --fused          # one contender once (what the rounds run)
    python scripts/bench_zero.py --table docs/bench_zero.json  # a saved run as Markdown

Contenders (each in its own fresh processes, alternated over >= 5 rounds in an order shuffled per round by
`scripts/bench_runner.py`; tokens/s is the median over rounds of each run's median steady step, with min-max):

- `zero_torch`: Lightning's `ddp` (torch DDP) with AdamW inside `torch.distributed.optim.ZeroRedundancyOptimizer`
  (optimizer state sharded, full gradients all-reduced, updated parameters broadcast): the reference for ZeRO-1/2;
- `fsdp2`: torch FSDP2 (`fully_shard` per block and on the model, through Lightning's ModelParallelStrategy): the
  reference for ZeRO-3;
- `zero1`, `zero2`, `zero3`: ours (`lit_lm/strategies/zero_engine.py`, the flat optimizer step of
  `lit_lm/strategies/flat_step.py`);
- first all with the same AdamW (torch's default: on CPU a per-tensor loop), then each with its best setting
  (`--fused`: fused AdamW; torch DDP with `gradient_as_bucket_view` under ZeroRedundancyOptimizer);
- `zero1_overlap`, `zero2_overlap`, `zero3_overlap`: the overlap measurement of `scripts/bench_ddp.py` (`AlternateComm`,
  `CommAlone`), here on the engine's gradient reduce-scatters: steps alternate with them replaced by no-ops (their
  shards zero-filled), then the step's reduce-scatters are timed alone. ZeRO-3's all-gathers stay real (a no-op
  gather would leave the weights uninitialised): its row measures the reduce-scatter's share only. The engine's
  communication unit is the model's block (one reduce-scatter per block, one for the rest), so there is no bucket
  cap to sweep; `--n-layers` changes the number of units.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.strategies import DDPStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ddp import AlternateComm, CommAlone, _spread, bench_main, overlap_metrics  # noqa: E402
from bench_runner import MARK  # noqa: E402
from bench_strategies import _env, footer, forwarded, run_one  # noqa: E402
from lit_lm.strategies import zero_engine  # noqa: E402
from lit_lm.strategies.zero import ZeroStrategy  # noqa: E402

SPEED = ["zero_torch", "zero1", "zero2", "fsdp2", "zero3"]
KINDS = [*SPEED, "zero1_overlap", "zero2_overlap", "zero3_overlap"]
REFERENCE = {"zero1": "zero_torch", "zero2": "zero_torch", "zero3": "fsdp2"}
NAMES = {"zero_torch": "torch `ZeroRedundancyOptimizer` + DDP", "fsdp2": "torch FSDP2 `fully_shard`",
         "zero1": "`zero1`", "zero2": "`zero2`", "zero3": "`zero3`"}


def strategy(kind: str, fused: bool) -> Any:
    if kind == "zero_torch":
        return DDPStrategy(gradient_as_bucket_view=fused)
    if kind.startswith("zero"):
        return ZeroStrategy(stage=int(kind[4]))
    return None  # fsdp2: bench_strategies' own


def worker_one(rank: int, args: argparse.Namespace, port: int, accelerator: str) -> None:
    config = _env(rank, args, port, accelerator)
    overlap = args.one.endswith("_overlap")
    alone = CommAlone(op="reduce_scatter", label="zero reduce")
    callbacks = [alone, AlternateComm(zero_engine, "reduce_scatter")] if overlap else []
    r = run_one(args.one.split("_")[0] if overlap else args.one, args, config, accelerator,
                strategy(args.one, args.fused), adamw={"fused": True} if args.fused else None, callbacks=callbacks,
                zero_redundancy=args.one == "zero_torch")
    if rank != 0:
        return
    metrics = {"tokens_per_s": args.global_batch * args.seq_len / r["step_s"], "step_s": r["step_s"],
               "state_bytes": r["memory"].get("total"), "grad_bytes": r["memory"].get("grads")}
    if overlap:
        metrics = overlap_metrics(r["steady_s"], args.warmup, alone)
    print(MARK + json.dumps(metrics), flush=True)


def contenders(args: argparse.Namespace) -> dict[str, list[str]]:
    """{name: command}: the same-optimizer rows, the best-setting rows, the overlap runs."""
    base = [sys.executable, __file__, *forwarded(args)]
    out = {kind: [*base, "--one", kind] for kind in SPEED}
    out.update({f"{kind} fused": [*base, "--one", kind, "--fused"] for kind in SPEED})
    out.update({kind: [*base, "--one", kind] for kind in KINDS if kind.endswith("_overlap")})
    return out


def markdown(run: dict[str, Any]) -> str:
    """The speed table (ratio of medians against the torch reference with the same AdamW) and the overlap table."""
    table = run["summary"]
    lines = ["| contender | AdamW | tokens/s median (min–max) | vs torch reference, same AdamW |",
             "|---|---|---|---|"]
    for adamw in ("default", "fused"):
        for kind in SPEED:
            t = table[kind if adamw == "default" else f"{kind} fused"]
            ref = REFERENCE.get(kind)
            ratio = "reference"
            if ref is not None:
                base = table[ref if adamw == "default" else f"{ref} fused"]["tokens_per_s"]["median"]
                ratio = f"{t['tokens_per_s']['median'] / base:.2f}×"
            lines.append(f"| {NAMES[kind]} | {adamw} | {_spread(t['tokens_per_s'])} | {ratio} |")
    lines += ["", "| stage | reduce-scatters | step ms | same, reduce-scatter a no-op, ms | reduce-scatters alone, ms "
              "| hidden |", "|---|---|---|---|---|---|"]
    for kind in (k for k in KINDS if k.endswith("_overlap")):
        t = table[kind]
        lines.append(f"| `{kind.split('_')[0]}` | {t['buckets']['median']:.0f} | {_spread(t['step_s'], 1e3, '.1f')} | "
                     f"{_spread(t['nocomm_s'], 1e3, '.1f')} | {_spread(t['comm_s'], 1e3, '.1f')} | "
                     f"{_spread(t['hidden'], 100)} % |")
    lines.append(f"\n{footer(run)}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_main(p, argv, KINDS, "runs/bench_zero.json", markdown, contenders, worker_one)


if __name__ == "__main__":
    main()
