"""The planner held to real peaks: each preset's resident peak per rank, measured, next to the estimator's figure.

    python scripts/bench_peaks.py --size 217M                        # every preset, 2 gloo ranks, the 217M model
    python scripts/bench_peaks.py --one zero3 --size 350M            # one contender once (what the rounds run)
    python scripts/bench_peaks.py --table runs/a.json runs/b.json    # saved runs as one Markdown table

What a user runs: `LanguageModel` (its AdamW param groups: torch's default implementation, on CPU a per-tensor
loop) through the Trainer under a preset name (`lm_ddp`, `zero1`-`zero3`, `tp`: tp2 with sequence parallelism), 2
gloo ranks of one thread each, fp32, a batch of one 128-token sequence per data-parallel rank, `--steps` optimizer
steps (the second is the first with the optimizer's state alive through forward and backward).

Memory, per rank, from /proc/self/status: the baseline is VmRSS once torch, Lightning and lit-lm are imported (each
rank is forked from a parent that imported them); Linux's `clear_refs` 5 resets the high-water mark VmHWM at each
phase boundary, so every phase's peak is read alone: `setup` (the baseline to the first batch: the model built and
split, the engines, the optimizer), then per step `fwd_bwd` (to `on_before_optimizer_step`: forward, backward, the
gradient reduction) and `step` (the optimizer step, ZeRO's all-gather after it, to the batch's end). The peak is
the largest phase peak above the baseline. Beside each, the estimator's figure for the same phase
(`lit_lm.planner.estimate`: `RankEstimate.phase_peaks`), per named category.

`--malloc` runs each contender under each of lit-lm's choices for glibc's malloc on a CPU rank
(lit_lm/strategies/host_malloc.py, `LIT_LM_MALLOC`): `trim` (free heap pages handed back after backward and after the
step), `fixed` (glibc's mmap threshold fixed at 128 KiB), `glibc` (its default dynamic threshold: the allocator's
retention is the difference). Each phase's wall time is kept too: the steps after the first tell a choice's cost.

Each contender (preset x size) runs in its own processes; `--rounds` alternate them in an order shuffled per round.
They start with torch's huge pages for blocks from 2 MiB (`THP_MEM_ALLOC_ENABLE=1`) where the `lit-lm` command asks
for them (no GPU, the kernel's THP not `never`; the variable set beforehand wins, 0 turns them off); under them
`large` maps blocks from 2 MiB. `--one` runs as its environment says.
Resident memory is not a clock: the spread over rounds is the allocator's, a few MB; the JSON keeps every round.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.multiprocessing as mp
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import lit_lm.strategies.registry  # noqa: E402,F401  (registers the presets with Lightning)
from bench_runner import MARK, run_once  # noqa: E402
from lit_lm.config import ModelConfig  # noqa: E402
from lit_lm.planner.estimate import Workload, estimate  # noqa: E402
from lit_lm.module import LanguageModel  # noqa: E402
from lit_lm.resident import reset_peak, status_bytes  # noqa: E402
from machine import describe, machine  # noqa: E402
from lit_lm.strategies.host_malloc import DEFAULT, HUGE_PAGES, MODES, ask_huge_pages  # noqa: E402
from lit_lm.strategies.zero_engine import model_state_bytes  # noqa: E402

PRESETS = ["lm_ddp", "zero1", "zero2", "zero3", "tp"]
SIZES = {"52M": dict(d_model=512, n_layers=6), "217M": dict(d_model=1024, n_layers=12),
         "350M": dict(d_model=1024, n_layers=22)}  # 52.0M, 217.3M, 343.8M
WORLD, SEQ, VOCAB = 2, 128, 32000


def model_config(size: str) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, n_heads=16, max_seq_len=SEQ, tie_embeddings=False, **SIZES[size]).resolved()


class PhasePeaks(L.Callback):
    """Each phase's VmHWM above `baseline` (reset at its start), its VmRSS at its end, and the model-state tensor
    bytes before each optimizer step."""

    def __init__(self, baseline: int) -> None:
        self.baseline = baseline
        self.phases: list[dict[str, Any]] = []
        self.state: dict[str, int] = {}
        self._phase, self._step, self._start = "setup", 0, time.perf_counter()

    def _close(self, name: str) -> None:
        now = time.perf_counter()
        self.phases.append({"phase": self._phase, "step": self._step, "peak": status_bytes("VmHWM") - self.baseline,
                            "rss_end": status_bytes("VmRSS") - self.baseline, "seconds": now - self._start})
        self._phase, self._start = name, now
        reset_peak()

    def on_train_batch_start(self, *args: Any) -> None:
        self._close("fwd_bwd")

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        self.state = model_state_bytes(module, getattr(optimizer, "_optimizer", optimizer))
        self._close("step")

    def on_train_batch_end(self, *args: Any) -> None:
        self._close("next")
        self._step += 1


def worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), NODE_RANK="0",
                      RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    reset_peak()
    baseline = status_bytes("VmRSS")
    probe = PhasePeaks(baseline)
    config = model_config(args.size)
    strategy = StrategyRegistry.get(args.one)
    dp = WORLD // strategy.config.tp
    gen = torch.Generator().manual_seed(1000 + rank // strategy.config.tp)  # tp peers read the same rows
    tokens = torch.randint(0, VOCAB, (args.steps, SEQ + 1), generator=gen)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=args.steps,
                        callbacks=[probe], logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                        precision="32-true")
    # `args.lora` (scripts/bench_finetune.py): LoRA adapters, the base frozen
    trainer.fit(LanguageModel(config, lora=getattr(args, "lora", None)), DataLoader(tokens, batch_size=1))
    phases = probe.phases
    result = {"rank": rank, "baseline": baseline, "phases": phases, "peak": max(p["peak"] for p in phases),
              "state": probe.state, "dp": dp}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def estimated(preset: str, size: str) -> dict[str, Any]:
    """The estimator's per-rank figures for the run `worker` makes: phase peaks and their categories."""
    config = StrategyRegistry.get(preset).config
    layout = dataclasses.replace(config, dp_shard=config.dims(WORLD).dp_shard)
    dp = layout.dims().dp
    rank = estimate(Workload(model_config(size), SEQ, dp, "32-true", device="cpu"), layout).ranks[0]
    return {"peak": rank.peak, "phases": rank.phase_peaks(), "categories": rank.categories()}


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        # fork: the ranks start with the imports loaded, so their baseline is the same imports
        mp.start_processes(worker, args=(args, port, out), nprocs=WORLD, join=True, start_method="fork")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {"ranks": ranks, "estimate": estimated(args.one, args.size), "phi": model_config(args.size).num_params()}


def contenders(args: argparse.Namespace) -> dict[str, list[str]]:
    """{"preset size malloc": command}, for each of `--malloc` (`LIT_LM_MALLOC`: with `glibc`, freed blocks below
    the largest mapped block freed so far stay in the heap, resident: that tells the allocator's retention apart from
    what the program holds)."""
    base = [sys.executable, __file__, "--steps", str(args.steps)]
    return {f"{p} {s} {m}": ["env", f"LIT_LM_MALLOC={m}", *base, "--one", p, "--size", s]
            for s in args.sizes for p in args.presets for m in args.malloc}


def tree() -> dict[str, Any]:
    """The commit measured, and whether the engines' files differed from it (a shared working tree)."""
    root = Path(__file__).resolve().parents[1]

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "modified": git("status", "--porcelain", "lit_lm")}


def rounds(args: argparse.Namespace) -> dict[str, Any]:
    """Every contender once per round, in an order shuffled per round (seeded); every round kept, the JSON
    rewritten after each run (a long run stopped half-way keeps what it measured)."""
    rng, done = random.Random(args.seed), []
    ask_huge_pages()  # the contenders start as the `lit-lm` command starts its ranks (lit_lm/strategies/host_malloc.py)
    run = {"args": vars(args), "machine": machine(), "tree": tree(), HUGE_PAGES: os.environ.get(HUGE_PAGES),
           "runs": done}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for r in range(args.rounds):
        order = list(contenders(args).items())
        rng.shuffle(order)
        for name, command in order:
            result = run_once(command, timeout=1200)
            print(f"round {r + 1}/{args.rounds} {name}: peak/rank "
                  f"{[round(x['peak'] / 2**20) for x in result['ranks']]} MiB, estimate "
                  f"{result['estimate']['peak'] / 2**20:.0f} MiB, load {result['load_1min']:.1f}", file=sys.stderr,
                  flush=True)
            done.append({"name": name, "round": r, **result})
            Path(args.out).write_text(json.dumps(run, indent=1))
    return run


def step_seconds(rank: dict[str, Any]) -> list[float]:
    """The wall time of each step after the first (forward, backward and optimizer step), one rank's."""
    steps: dict[int, float] = {}
    for p in rank["phases"]:
        if p["phase"] in ("fwd_bwd", "step") and p["step"] > 0 and "seconds" in p:
            steps[p["step"]] = steps.get(p["step"], 0.0) + p["seconds"]
    return list(steps.values())


def summary(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per contender: the median (min, max) over rounds of the larger rank's peak, the largest rank's phase peaks,
    the median step time after the first step (rank 0), and the estimate of the estimator as it is now (the JSON
    keeps the one made at the run)."""
    out: dict[str, dict[str, Any]] = {}
    for r in run["runs"]:
        preset, size = r["name"].split()[:2]
        row = out.setdefault(r["name"], {"peaks": [], "estimate": estimated(preset, size), "phases": {}, "steps": []})
        row["peaks"].append(max(x["peak"] for x in r["ranks"]))
        row["steps"] += step_seconds(r["ranks"][0])
        for x in r["ranks"]:
            for p in x["phases"]:
                row["phases"][p["phase"]] = max(row["phases"].get(p["phase"], 0), p["peak"])
    for row in out.values():
        row["median"] = statistics.median(row["peaks"])
        row["ratio"] = row["estimate"]["peak"] / row["median"]
        row["step_s"] = statistics.median(row["steps"]) if row["steps"] else None
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def markdown(runs: list[dict[str, Any]]) -> str:
    """Saved runs (their JSONs, e.g. one per size) as one table."""
    def named(x: dict[str, Any], r: dict[str, Any]) -> dict[str, Any]:
        # older runs' names: "preset size" ran glibc's default ("mmap": MALLOC_MMAP_THRESHOLD_ set), or, with
        # `args.glibc`, the fixed threshold
        if len(r["name"].split()) == 2:
            return {**r, "name": r["name"] + (" fixed" if "glibc" in x["args"] else " glibc")}
        return r

    run = {**runs[0], "runs": [named(x, r) for x in runs for r in x["runs"]]}
    lines = ["| preset | size | malloc | measured peak/rank, MiB (min–max) | estimate, MiB | estimate / measured | "
             "setup: measured / est. | fwd+bwd: measured / est. | step: measured / est. | s/step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    malloc_name = {"glibc": "glibc default", "mmap": "MALLOC_MMAP_THRESHOLD_", "fixed": "threshold fixed",
                   "trim": "trimmed (lit-lm)", "trim-setup": "trimmed, also after setup",
                   "setup": "trimmed after setup", "large": "mapped from 8 MiB (2 MiB on huge pages; the default)"}
    for name, row in sorted(summary(run).items(), key=lambda kv: (float(kv[0].split()[1][:-1]), kv[0])):
        preset, size, *malloc = name.split()
        est, phases = row["estimate"], row["phases"]
        spread = f"{_mib(row['median'])} ({_mib(min(row['peaks']))}–{_mib(max(row['peaks']))})"
        step = "–" if row["step_s"] is None else f"{row['step_s']:.2f}"
        lines.append(f"| `{preset}` | {size} | {malloc_name[malloc[0]]} | "
                     f"{spread} | {_mib(est['peak'])} | {row['ratio']:.2f} | "
                     + " | ".join(f"{_mib(phases[p])} / {_mib(est['phases'][p])}" for p in ("setup", "fwd_bwd", "step"))
                     + f" | {step} |")
    loads = [r["load_1min"] for r in run["runs"]]
    parts = [part for x in runs for part in x.get("parts", [x])]  # a file may merge several runs' JSONs
    commits = sorted({part.get("tree", {}).get("commit", "?")[:7] for part in parts})
    rounds = "/".join(sorted({str(part["args"]["rounds"]) for part in parts}))
    steps = "/".join(sorted({str(part["args"]["steps"]) for part in parts}))
    lines.append(f"\n{len(run['runs'])} runs, {rounds} round(s), {steps} steps each "
                 f"(s/step: median over the steps after the first, rank 0), load average (1 min) "
                 f"{min(loads):.1f}–{max(loads):.1f} on {describe(run['machine'])}; commit {', '.join(commits)}.")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--one", choices=PRESETS, help="run this preset once and print its metrics")
    p.add_argument("--size", choices=list(SIZES), default="217M", help="with --one")
    p.add_argument("--presets", nargs="+", choices=PRESETS, default=PRESETS)
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=["217M", "350M"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--malloc", nargs="+", choices=MODES, default=[DEFAULT],
                   help="LIT_LM_MALLOC choices to run each with")
    p.add_argument("--out", default="runs/bench_peaks.json")
    p.add_argument("--table", nargs="+", help="print saved runs (their --out JSONs) as one Markdown table, and exit")
    args = p.parse_args(argv)
    if args.table:
        print(markdown([json.loads(Path(t).read_text()) for t in args.table]))
    elif args.one:
        print(MARK + json.dumps(run_one(args)), flush=True)
    else:
        run = rounds(args)
        print(markdown([run]))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
