"""The import layering (pyproject.toml's `[tool.importlinter]`, checked by `make lint` before the suite) holds, and
its contracts can fail: a copy of the packages with a deliberate import cycle among strategies/, or strategies/
importing lit_lm/, breaks exactly the contract that forbids it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("strategies", "kernels", "lit_lm", "callbacks")
# the contracts' names in pyproject.toml, as lint-imports reports them
FORBIDDEN = ("strategies/ and kernels/ never import lit_lm/ or callbacks/ (the model's plan vocabulary is "
             "strategies/plan.py)")
ACYCLIC = "no import cycle among the modules of strategies/"


def _lint_imports(root: Path) -> tuple[int, str]:
    """`lint-imports` on the packages under `root` (the same config), without the cache."""
    lint = Path(sys.executable).parent / "lint-imports"
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([str(lint), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def _copy(tmp_path: Path) -> Path:
    for name in PACKAGES:
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_tree_keeps_its_layering() -> None:
    config = (REPO / "pyproject.toml").read_text()
    assert f'name = "{FORBIDDEN}"' in config and f'name = "{ACYCLIC}"' in config
    rc, out = _lint_imports(REPO)
    assert rc == 0 and "Contracts: 2 kept, 0 broken." in out, out


@pytest.mark.parametrize("module, line, broken", [
    ("strategies/comm.py", "import strategies.composed  # noqa: F401", ACYCLIC),  # composed imports comm
    ("strategies/plan.py", "import lit_lm.config  # noqa: F401", FORBIDDEN),
    ("kernels/runtime.py", "import callbacks.throughput  # noqa: F401", FORBIDDEN),
])
def test_a_deliberate_violation_breaks_its_contract(tmp_path: Path, module: str, line: str, broken: str) -> None:
    root = _copy(tmp_path)
    with open(root / module, "a") as f:
        f.write(f"\n{line}\n")
    rc, out = _lint_imports(root)
    assert rc != 0 and "Contracts: 1 kept, 1 broken." in out, out
    assert f"{broken} BROKEN" in " ".join(out.split()), out
