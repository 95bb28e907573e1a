"""Every benchmark figure names its machine: `scripts/machine.py`'s record is in each JSON the runner writes, and
the line printed beside a table names the CPU, its kernel-relevant flags, the cores, torch and the date."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_runner import summarize, write_json  # noqa: E402
from machine import FLAGS, describe, machine  # noqa: E402


def test_machine_record_and_line() -> None:
    m = machine()
    assert m["cpu"] and m["cores"] >= 1 and m["torch"] == torch.__version__
    assert set(m["cpu_flags"]) <= set(FLAGS)
    line = describe(m)
    assert m["cpu"] in line and f"{m['cores']} cores" in line and m["date"] in line and torch.__version__ in line
    assert describe({**m, "cpu_flags": ["avx2"]}).count("avx2") == 1
    assert describe({}) == "machine not recorded"


def test_runner_json_carries_the_machine(tmp_path: Path) -> None:
    rounds = [[("a", {"x": 1.0, "load_1min": 0.5})] for _ in range(2)]
    write_json(tmp_path / "run.json", rounds, summarize(rounds))
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved["machine"]["cpu"] == machine()["cpu"] and "cpu_flags" in saved["machine"]
