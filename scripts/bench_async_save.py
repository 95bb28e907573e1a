"""How long a checkpoint save stops the training step: a background (async) save against a synchronous save of the
same state, a ~350M-parameter model under ZeRO-3 x 2 on CPU ranks.

    flock /tmp/heavy.lock .venv/bin/python scripts/bench_async_save.py --rounds 2 --out docs/benchmarks/X.json
    .venv/bin/python scripts/bench_async_save.py --size small      # 20M parameters, no lock needed

Each contender runs in its own 2-rank world (a fresh pair of processes per run), the contenders alternated over
shuffled rounds. A run trains `--steps` steps with ModelCheckpoint-free saves made by a callback at the end of
every step from step 1 on (`trainer.save_checkpoint`, what ModelCheckpoint calls): the stall is the time that call
keeps the training thread (rank max), in wall time and in that thread's CPU time (which a loaded machine
inflates less). Between saves the previous write is let finish outside the timed window
(`wait_for_checkpoints`), so a stall is the save's own cost, not a wait for the last one. The first background
save also allocates its host buffers (reported apart); the steady figure is the median of the later ones. The
ratio is async stall / sync stall (median over rounds, min-max beside it), with the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODEL = dict(vocab_size=32000, d_model=1024, n_layers=24, n_heads=16, max_seq_len=64)  # 0.37B parameters
SMALL = dict(vocab_size=8192, d_model=384, n_layers=8, n_heads=6, max_seq_len=64)  # 20M: --size small
TINY = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=16)  # --size tiny: a check of the script
SIZES = {"350m": MODEL, "small": SMALL, "tiny": TINY}


def _run(async_checkpoint: bool, steps: int, out_dir: str, model: dict[str, Any]) -> dict[str, Any]:
    """One rank of one run: the stall of every save, the step times."""
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from lit_lm.config import ModelConfig
    from lit_lm.model import Transformer
    from lit_lm.strategies.composed import ComposedStrategy
    from lit_lm.strategies.plan import step_loss_fn

    class LM(L.LightningModule):
        def configure_model(self) -> None:
            if not hasattr(self, "model"):
                self.model = Transformer(ModelConfig(**model))

        def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
            tokens = batch[0]
            return step_loss_fn(self.trainer.strategy, self.model)(tokens[:, :-1], tokens[:, 1:])[0]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Saves(L.Callback):
        def __init__(self) -> None:
            self.stalls: list[float] = []
            self.cpu: list[float] = []  # the training thread's CPU time in the call: robust to a loaded machine
            self.steps: list[float] = []
            self._start = 0.0

        def on_train_batch_start(self, *args: Any) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            self.steps.append(time.perf_counter() - self._start)
            start, cpu = time.perf_counter(), time.thread_time()
            trainer.save_checkpoint(Path(out_dir) / f"step={trainer.global_step}.ckpt", weights_only=False)
            self.stalls.append(time.perf_counter() - start)
            self.cpu.append(time.thread_time() - cpu)
            trainer.strategy.wait_for_checkpoints()  # outside the window: the next save starts with none in flight

    tokens = torch.randint(0, model["vocab_size"], (steps, model["max_seq_len"] + 1),
                           generator=torch.Generator().manual_seed(0))
    saves = Saves()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ComposedStrategy(zero_stage=3,
                        async_checkpoint=async_checkpoint), max_steps=steps, callbacks=[saves], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0)
    trainer.fit(LM(), DataLoader(TensorDataset(tokens), batch_size=1))
    state_bytes = sum(f.stat().st_size for f in Path(out_dir).glob(f"step={steps}.ckpt/*.distcp"))
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    return {"rank": rank, "stalls": saves.stalls, "cpu": saves.cpu, "steps": saves.steps, "shard_bytes": state_bytes}


def _one(async_checkpoint: bool, steps: int, model: dict[str, Any]) -> dict[str, Any]:
    from lit_lm.spawn import run_distributed

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as out:
        ranks = run_distributed(_run, 2, async_checkpoint, steps, out, model, init_process_group=False)
    stalls = [max(r["stalls"][i] for r in ranks) for i in range(len(ranks[0]["stalls"]))]
    cpu = [max(r["cpu"][i] for r in ranks) for i in range(len(ranks[0]["cpu"]))]
    return {"async": async_checkpoint, "stalls_s": stalls, "first_s": stalls[0],
            "steady_s": statistics.median(stalls[1:]) if len(stalls) > 1 else stalls[0],
            "cpu_s": cpu, "steady_cpu_s": statistics.median(cpu[1:]) if len(cpu) > 1 else cpu[0],
            "step_s": [max(r["steps"][i] for r in ranks) for i in range(len(ranks[0]["steps"]))],
            "shard_bytes": ranks[0]["shard_bytes"]}


def main() -> None:
    from machine import describe, machine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="steps per run; a save after each")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--size", choices=sorted(SIZES), default="350m")
    args = parser.parse_args()
    model = SIZES[args.size]
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = [True, False]
        random.Random(r).shuffle(order)
        for mode in order:
            load = os.getloadavg()[0]
            run = _one(mode, args.steps, model)
            run.update(round=r, load_before=load, load_after=os.getloadavg()[0])
            runs.append(run)
            print(json.dumps(run), flush=True)
    ratios = []
    for r in range(args.rounds):
        a, s = (next(x for x in runs if x["round"] == r and x["async"] == m) for m in (True, False))
        ratios.append({"steady": a["steady_s"] / s["steady_s"], "first": a["first_s"] / s["first_s"],
                       "steady_cpu": a["steady_cpu_s"] / s["steady_cpu_s"]})
    summary = {k: {"median": statistics.median(x[k] for x in ratios), "min": min(x[k] for x in ratios),
                   "max": max(x[k] for x in ratios)} for k in ("steady", "first", "steady_cpu")}
    result = {"model": model, "strategy": "zero3 x 2 (gloo, CPU ranks, 1 thread each)", "runs": runs,
              "ratios": ratios, "summary": summary, "machine": machine()}
    print(f"async/sync stall, steady: {summary['steady']['median']:.3f} "
          f"(min {summary['steady']['min']:.3f}, max {summary['steady']['max']:.3f}); first save (allocates its "
          f"buffers): {summary['first']['median']:.3f}; training-thread CPU time, steady: "
          f"{summary['steady_cpu']['median']:.3f}   [{describe(result['machine'])}]")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    import bench_async_save  # the ranks import `_run` from this module by name, not from __main__

    bench_async_save.main()
