"""CPU forward latency of several models, each alone in its own process, alternated in shuffled rounds.

    from time_forward import forward_latency
    latency, loads = forward_latency({"dense": module_a, "int8": module_b}, batch=8, seq_len=128, rounds=5)

Why: on a shared machine, timings of one model drift with the others' (allocator, caches, threads) and with time
(other jobs). So every model is pickled and served by a worker process of its own (`python time_forward.py
MODEL.pt`: load with `weights_only=True`, warm up, then time `reps` forwards per request line on stdin), started
once; the parent asks the workers in turn, one at a time, in an order shuffled every round (seeded), over at least
`bench_runner.MIN_ROUNDS` rounds, and reports per model the median over rounds of each round's median, with its min
and max (`bench_runner.summarize`), and the 1-minute load average seen before every timing. A worker waiting for its
turn blocks on its stdin: it takes no CPU from the one being timed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the pickled classes: lit_lm, callbacks
from bench_runner import MARK, MIN_ROUNDS, summarize  # noqa: E402

# the classes a pickled model holds, imported: load_result allows only classes of modules already imported
import lit_lm.callbacks.compress.qat  # noqa: E402,F401
import lit_lm.model  # noqa: E402,F401
from lit_lm.spawn import load_result  # noqa: E402


@torch.no_grad()
def forward_ms(model: nn.Module, idx: torch.Tensor, reps: int) -> float:
    """Median wall time of one forward, in ms."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        model(idx)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def forward_latency(models: dict[str, nn.Module], batch: int, seq_len: int, rounds: int = MIN_ROUNDS,
                    threads: int = 1, reps: int = 5, seed: int = 0) -> tuple[dict[str, dict[str, Any]], list[float]]:
    """({name: {"median", "min", "max", "n"} ms of one forward of `batch` x `seq_len` tokens}, load averages) for
    modules with a `.model` taking token ids (see the module docstring)."""
    if rounds < MIN_ROUNDS:
        raise ValueError(f"rounds={rounds}: use at least {MIN_ROUNDS}, or the min-max spread means little")
    workers: dict[str, subprocess.Popen] = {}
    results: list[list[tuple[str, dict[str, Any]]]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, module in models.items():  # one at a time: a loading worker slows no timing
                path = Path(tmp) / f"{name}.pt"
                torch.save(module.model, path)
                workers[name] = subprocess.Popen(
                    [sys.executable, __file__, str(path), "--batch", str(batch), "--seq-len", str(seq_len),
                     "--threads", str(threads), "--reps", str(reps)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    text=True)
                _reply(workers[name], name)  # loaded and warm
            rng = random.Random(seed)
            for _ in range(rounds):
                order = list(models)
                rng.shuffle(order)
                this_round = []
                for name in order:
                    load = os.getloadavg()[0]
                    workers[name].stdin.write("time\n")
                    workers[name].stdin.flush()
                    this_round.append((name, {**_reply(workers[name], name), "load_1min": load}))
                results.append(this_round)
    finally:
        for worker in workers.values():
            worker.stdin.close()
            worker.wait(timeout=60)
    summary = summarize(results)
    return {name: summary[name]["forward_ms"] for name in models}, [m["load_1min"] for r in results for _, m in r]


def _reply(worker: subprocess.Popen, name: str) -> dict[str, Any]:
    line = worker.stdout.readline()
    if not line.startswith(MARK):
        raise RuntimeError(f"the timing worker of {name} exited {worker.poll()} instead of answering: {line!r}")
    return json.loads(line[len(MARK):])


def serve() -> None:
    """The worker: load the model, warm up (the first forward also packs integer weights for fbgemm), answer."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, help="a whole pickled model (torch.save) taking token ids")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    model = load_result(opts.model).eval()  # weights_only: only lit-lm's and torch.nn's classes, nothing that runs
    idx = torch.randint(0, model.config.vocab_size, (opts.batch, opts.seq_len),
                        generator=torch.Generator().manual_seed(0))
    print(MARK + json.dumps({"warmup_ms": forward_ms(model, idx, 2)}), flush=True)
    for _ in sys.stdin:
        print(MARK + json.dumps({"forward_ms": forward_ms(model, idx, opts.reps)}), flush=True)


if __name__ == "__main__":
    serve()
