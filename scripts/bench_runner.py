"""An alternating benchmark runner: contenders that cannot flatter each other by running first, last or warm.

    from bench_runner import run_rounds, summarize
    rounds = run_rounds({"a": [python, "bench.py", "--one", "a"], "b": [...]}, rounds=5, seed=0)
    table = summarize(rounds)        # {contender: {metric: {"median", "min", "max", "n"}}}

Why: timings of identical work on a shared machine drift with position (caches, turbo, other jobs). Here every
contender runs in its own fresh processes (nothing inherited: allocator, compiled kernels, page cache of the
interpreter), and the contenders are alternated in rounds, A B C ... A B C ..., the order shuffled per round
(seeded), at least 5 rounds; each metric is reported as the median with its min-max over the rounds, so a reader
sees the spread. The machine's 1-minute load average is recorded before every run.

Contract for a contender: a command that prints its metrics as one JSON object on a line starting with
`BENCH_RESULT ` (the last such line counts) and exits 0. Numbers are summarised; other values are kept from the
last round.

    python scripts/bench_runner.py --rounds 5 --out runs/x.json -- name1 "cmd ..." name2 "cmd ..."
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine  # noqa: E402

MIN_ROUNDS = 5
MARK = "BENCH_RESULT "


def run_once(command: list[str], timeout: float | None = None) -> dict[str, Any]:
    """Run one contender in its own process; its metrics plus the wall time and the load average before it."""
    load = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"contender {shlex.join(command)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        raise RuntimeError(f"contender {shlex.join(command)} printed no '{MARK.strip()}' line:\n{proc.stdout[-2000:]}")
    return {**json.loads(lines[-1][len(MARK):]), "wall_s": wall, "load_1min": load}


def run_rounds(contenders: dict[str, list[str]], rounds: int = MIN_ROUNDS, seed: int = 0,
               timeout: float | None = None, verbose: bool = True, round_lock: str | None = None
               ) -> list[list[tuple[str, dict[str, Any]]]]:
    """`rounds` rounds; in each, every contender once, in a freshly shuffled order. [[(name, metrics), ...], ...]
    `round_lock`: a file whose flock each round holds (a shared machine: other work runs between rounds, never
    beside a contender; one wait per round rather than per contender)."""
    if rounds < MIN_ROUNDS:
        raise ValueError(f"rounds={rounds}: use at least {MIN_ROUNDS}, or the min-max spread means little")
    rng = random.Random(seed)
    out = []
    for r in range(rounds):
        order = list(contenders)
        rng.shuffle(order)
        this_round = []
        with open(round_lock or os.devnull, "a") as lock:
            if round_lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
            for name in order:
                metrics = run_once(contenders[name], timeout)
                this_round.append((name, metrics))
                if verbose:
                    print(f"round {r + 1}/{rounds} {name}: {json.dumps(metrics)}", file=sys.stderr, flush=True)
        out.append(this_round)
    return out


def summarize(rounds: list[list[tuple[str, dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """Per contender and numeric metric: median, min, max and n over the rounds; other values as last seen."""
    samples: dict[str, dict[str, list[Any]]] = {}
    for this_round in rounds:
        for name, metrics in this_round:
            for key, value in metrics.items():
                samples.setdefault(name, {}).setdefault(key, []).append(value)
    table: dict[str, dict[str, Any]] = {}
    for name, metrics in samples.items():
        table[name] = {}
        for key, values in metrics.items():
            numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if numbers and len(numbers) == len(values):
                table[name][key] = {"median": statistics.median(numbers), "min": min(numbers), "max": max(numbers),
                                    "n": len(numbers)}
            else:
                table[name][key] = values[-1]
    return table


def paired(rounds: list[list[tuple[str, dict[str, Any]]]], a: str, b: str, metric: str,
           how: str = "ratio") -> dict[str, Any]:
    """`a`'s `metric` over `b`'s (`how="ratio"`) or minus it (`"difference"`) in each round where both ran (minutes
    apart, under about the same load): median, min, max, n and the values in round order. Steadier than comparing
    the medians when the load drifts between rounds."""
    values = []
    for this_round in rounds:
        got = dict(this_round)
        if a in got and b in got:
            x, y = got[a][metric], got[b][metric]
            values.append(x / y if how == "ratio" else x - y)
    if not values:
        raise ValueError(f"no round ran both {a!r} and {b!r}")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values),
            "values": values}


def write_json(path: str | Path, rounds: list, table: dict, **extra: Any) -> None:
    """Everything: the raw rounds (order included), the summary, the load averages, the machine (`machine.py`:
    CPU model and flags, cores, GPU, torch, date) and `extra` (arguments)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    loads = [m["load_1min"] for r in rounds for _, m in r]
    path.write_text(json.dumps({**extra, "load_1min": {"min": min(loads), "median": statistics.median(loads),
                                                       "max": max(loads)},
                                "cpus": os.cpu_count(), "machine": machine(),
                                "order": [[name for name, _ in r] for r in rounds],
                                "summary": table, "rounds": rounds}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench_runner.json")
    p.add_argument("pairs", nargs="+", help="name command name command ... (each command one quoted string)")
    args = p.parse_args()
    if len(args.pairs) % 2:
        p.error("give contenders as pairs: NAME 'COMMAND'")
    contenders = {args.pairs[i]: shlex.split(args.pairs[i + 1]) for i in range(0, len(args.pairs), 2)}
    rounds = run_rounds(contenders, args.rounds, args.seed)
    table = summarize(rounds)
    write_json(args.out, rounds, table, args=vars(args))
    print(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
