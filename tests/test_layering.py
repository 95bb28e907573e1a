"""The import layering (pyproject.toml's `[tool.importlinter]`, checked by `make lint` before the suite) holds, its
lists name every room of lit_lm, and its contracts can fail: a copy of the package with a deliberate import cycle
among lit_lm.strategies, lit_lm.strategies importing the model, or the module importing a callback, breaks exactly
the contract that forbids it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONTRACTS = {c["name"]: c for c in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
             ["contracts"]}
# the contracts' names in pyproject.toml, as lint-imports reports them
ENGINES = next(name for name in CONTRACTS if name.startswith("lit_lm.strategies and lit_lm.kernels"))
CALLBACKS = next(name for name in CONTRACTS if name.startswith("no arrow back up to the callbacks"))
ACYCLIC = "no import cycle among the modules of lit_lm.strategies"
COMMANDS = {"lit_lm.cli", "lit_lm.__main__", "lit_lm.check"}  # the only rooms above the callbacks


def _rooms() -> set[str]:
    """lit_lm's direct children: its modules and subpackages."""
    return {f"lit_lm.{p.stem}" for p in (REPO / "lit_lm").iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}


def _lint_imports(root: Path) -> tuple[int, str]:
    """`lint-imports` on the package under `root` (the same config), without the cache."""
    lint = Path(sys.executable).parent / "lint-imports"
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([str(lint), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "lit_lm", tmp_path / "lit_lm", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_tree_keeps_its_layering() -> None:
    assert ACYCLIC in CONTRACTS
    rc, out = _lint_imports(REPO)
    assert rc == 0 and "Contracts: 3 kept, 0 broken." in out, out


def test_the_contracts_name_every_room() -> None:
    """A room added to lit_lm is placed in the layering, not silently left out of both lists."""
    rooms = _rooms()
    engines = {"lit_lm.strategies", "lit_lm.kernels"}
    assert engines < rooms and COMMANDS < rooms and "lit_lm.callbacks" in rooms
    assert set(CONTRACTS[ENGINES]["source_modules"]) == engines
    assert set(CONTRACTS[ENGINES]["forbidden_modules"]) == rooms - engines
    assert set(CONTRACTS[CALLBACKS]["source_modules"]) == rooms - COMMANDS - {"lit_lm.callbacks"}


@pytest.mark.parametrize("module, line, broken", [
    ("lit_lm/strategies/comm.py", "import lit_lm.strategies.composed  # noqa: F401", ACYCLIC),  # composed imports comm
    ("lit_lm/strategies/plan.py", "import lit_lm.config  # noqa: F401", ENGINES),
    ("lit_lm/kernels/runtime.py", "import lit_lm.model  # noqa: F401", ENGINES),
    ("lit_lm/module.py", "import lit_lm.callbacks.throughput  # noqa: F401", CALLBACKS),
    ("lit_lm/parity.py", "from lit_lm.callbacks.clip import GlobalNormClip  # noqa: F401", CALLBACKS),
])
def test_a_deliberate_violation_breaks_its_contract(tmp_path: Path, module: str, line: str, broken: str) -> None:
    root = _copy(tmp_path)
    with open(root / module, "a") as f:
        f.write(f"\n{line}\n")
    rc, out = _lint_imports(root)
    assert rc != 0 and "Contracts: 2 kept, 1 broken." in out, out
    assert f"{broken} BROKEN" in " ".join(out.split()), out
