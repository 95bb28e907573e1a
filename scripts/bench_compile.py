"""compile ÷ eager training tokens/s per preset on the CPU (docs/benchmarks/2026-12-compile-cpu.md).

    flock /tmp/heavy.lock python scripts/bench_compile.py --rounds 5 --out docs/bench_compile_cpu.json
    python scripts/bench_compile.py --one lm_ddp:compile     # one contender (what each round runs)

Each contender (preset x eager | compile | fp8) is a fresh 2-rank gloo world (`lit_lm.spawn.run_distributed`) training
the bench model for `--steps` steps; tokens/s counts the steps after `--warmup` (the compile is in the warmup).
Contenders alternate in shuffled rounds (`bench_runner.py`); the JSON records the machine and the load per run, and
the compile ÷ eager ratio paired per round.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_runner import MARK, paired, run_rounds, summarize, write_json  # noqa: E402

PRESETS = {"lm_ddp": {}, "zero3": {"zero_stage": 3}, "tp2": {"tensor_parallel_size": 2}}
VARIANTS = {"eager": {}, "compile": {"compile": True}, "fp8": {"fp8": "tensorwise"}}
MODEL = dict(vocab_size=512, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=128)


def _rank(preset: str, variant: str, steps: int, warmup: int, batch: int) -> dict[str, Any]:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lit_lm.config import ModelConfig
    from lit_lm.module import LanguageModel
    from lit_lm.strategies.composed import ComposedStrategy

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self.marks.append(time.perf_counter())

        def on_train_end(self, *args: Any) -> None:
            self.marks.append(time.perf_counter())

    L.seed_everything(0, verbose=False)
    tokens = torch.randint(0, MODEL["vocab_size"], (steps * batch, MODEL["max_seq_len"] + 1))
    module = LanguageModel(ModelConfig(**MODEL), warmup_steps=2, **VARIANTS[variant])
    timer = Timer()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ComposedStrategy(**PRESETS[preset]), max_steps=steps,
                        callbacks=[timer], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    trainer.fit(module, DataLoader(tokens, batch_size=batch))
    spans = [b - a for a, b in zip(timer.marks, timer.marks[1:])][warmup:]
    return {"step_s": sum(spans) / len(spans), "first_steps_s": sum(b - a for a, b in
                                                                   zip(timer.marks, timer.marks[1:warmup + 1]))}


def one(name: str, steps: int, warmup: int, batch: int) -> None:
    from lit_lm.spawn import run_distributed

    preset, variant = name.split(":")
    results = run_distributed(_rank, 2, preset, variant, steps, warmup, batch, init_process_group=False)
    step_s = max(r["step_s"] for r in results)  # the slowest rank sets the pace
    dp = 1 if preset == "tp2" else 2  # ranks reading other rows: each rank reads `batch` rows per step
    print(MARK + json.dumps({"tokens_per_s": dp * batch * MODEL["max_seq_len"] / step_s, "step_s": step_s,
                             "first_steps_s": max(r["first_steps_s"] for r in results)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--one", help="PRESET:VARIANT, one contender")
    p.add_argument("--presets", nargs="+", default=["lm_ddp", "zero3"], choices=list(PRESETS))
    p.add_argument("--variants", nargs="+", default=["eager", "compile"], choices=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--batch", type=int, default=4, help="rows per rank per step")
    p.add_argument("--out", default="runs/bench_compile.json")
    args = p.parse_args()
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch)]
    if args.one:
        one(args.one, args.steps, args.warmup, args.batch)
        return
    contenders = {f"{p}:{v}": [sys.executable, __file__, "--one", f"{p}:{v}", *common]
                  for p in args.presets for v in args.variants}
    rounds = run_rounds(contenders, args.rounds)
    table = summarize(rounds)
    ratios = {f"{p}: {v} / eager": paired(rounds, f"{p}:{v}", f"{p}:eager", "tokens_per_s")
              for p in args.presets for v in args.variants if v != "eager"}
    write_json(args.out, rounds, table, ratios=ratios, model=MODEL, args=vars(args))
    for name, row in table.items():
        t = row["tokens_per_s"]
        print(f"{name:>16}: {t['median']:9.0f} tokens/s ({t['min']:.0f}-{t['max']:.0f})")
    for name, r in ratios.items():
        print(f"{name}: {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}, paired per round)")


if __name__ == "__main__":
    main()
