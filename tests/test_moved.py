"""A config that names a path from before the one import root (`class_path: strategies.composed.ComposedStrategy`)
keeps working for a release: it is read as the new path with one one-line FutureWarning naming it, on the command
line, in a yaml that `fit` parses, and in the yamls that `plan` and the offline tools read; what is not an old path
(a file called callbacks.yaml, a new `lit_lm.data.sampler` path) is left alone. CHANGELOG.md lists every move."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from lit_lm import moved
from lit_lm.moved import MOVED, current_argv, current_path, load_yaml
from lit_lm.planner.cli import read_configs

REPO = Path(__file__).resolve().parents[1]
OLD_YAML = """\
trainer:
  strategy:
    class_path: strategies.composed.ComposedStrategy
    init_args: {zero_stage: 1}
  callbacks:
    - class_path: callbacks.progress.StepProgress
data:
  class_path: lit_lm.data.TextDataModule
"""


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moved, "_warned", set())
    for name in moved.RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("old, new", [
    ("strategies.composed.ComposedStrategy", "lit_lm.strategies.composed.ComposedStrategy"),
    ("callbacks.compress.QAT", "lit_lm.callbacks.compress.QAT"),
    ("kernels.rope.RotaryEmbedding", "lit_lm.kernels.rope.RotaryEmbedding"),
    ("lit_lm.data.TextDataModule", "lit_lm.data.datamodule.TextDataModule"),
    ("lit_lm.tokenizer.bpe.BPETokenizer", "lit_lm.data.tokenizer.bpe.BPETokenizer"),
    ("lit_lm.hf_import", "lit_lm.hf.importer"),
    ("lit_lm.plan.strategy_yaml", "lit_lm.planner.plan.strategy_yaml"),
])
def test_an_old_path_is_read_as_the_new_one_with_one_warning(old: str, new: str) -> None:
    _resolve(new)  # the new path is real
    with pytest.warns(FutureWarning) as caught:
        assert current_path(old) == new
        assert current_path(old) == new  # once per path
    assert len(caught) == 1
    message = str(caught[0].message)
    assert old in message and f"use {new}" in message and moved.UNTIL in message
    line = warnings.formatwarning(caught[0].message, caught[0].category, caught[0].filename, caught[0].lineno)
    assert line.count("\n") == 1  # one line


def _resolve(path: str) -> object:
    try:
        return importlib.import_module(path)
    except ImportError:
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("path", ["callbacks.yaml", "kernels", "strategies", "corpus.txt", "lit_lm.data.sampler",
                                  "lit_lm.data.datamodule.TextDataModule", "lit_lm.strategies.zero.ZeroStrategy",
                                  "runs/strategies.zero", "lightning.pytorch.callbacks.ModelCheckpoint"])
def test_what_is_not_an_old_path_is_left_alone(path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert current_path(path) == path


def test_only_rank_zero_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert current_path("strategies.tp.TensorParallelStrategy") == "lit_lm.strategies.tp.TensorParallelStrategy"


def test_every_move_lands_on_a_module_and_is_in_the_changelog() -> None:
    changelog = (REPO / "CHANGELOG.md").read_text().splitlines()
    for old, new in MOVED.items():
        assert importlib.util.find_spec(new) is not None, new
        assert not (REPO / Path(*old.split("."))).with_suffix(".py").exists(), old
        assert any(f"`{old}" in line and f"`{new}" in line for line in changelog), (old, new)


def test_the_command_line_and_the_yamls_that_lit_lm_reads_itself(tmp_path: Path) -> None:
    argv = ["fit", "--config", "callbacks.yaml", "--trainer.strategy", "strategies.zero.ZeroStrategy",
            "--trainer.callbacks+=callbacks.clip.GlobalNormClip"]
    with pytest.warns(FutureWarning):
        assert current_argv(argv) == ["fit", "--config", "callbacks.yaml", "--trainer.strategy",
                                      "lit_lm.strategies.zero.ZeroStrategy",
                                      "--trainer.callbacks+=lit_lm.callbacks.clip.GlobalNormClip"]
    with pytest.warns(FutureWarning):
        tree = load_yaml(OLD_YAML)
    assert tree["trainer"]["strategy"]["class_path"] == "lit_lm.strategies.composed.ComposedStrategy"
    assert tree["data"]["class_path"] == "lit_lm.data.datamodule.TextDataModule"
    old = tmp_path / "old.yaml"
    old.write_text(OLD_YAML)
    assert read_configs([str(old)])["trainer"]["callbacks"][0]["class_path"] == "lit_lm.callbacks.progress.StepProgress"


@pytest.mark.slow
def test_fit_parses_an_old_yaml_and_an_old_command_line(tmp_path: Path) -> None:
    """Through the `lit-lm` command as a user runs it: the old yaml and an old class path on the command line parse
    (print_config shows the new paths), each old path warned about in one line on stderr, and nothing else."""
    old = tmp_path / "old.yaml"
    old.write_text(OLD_YAML)
    done = subprocess.run([sys.executable, "-m", "lit_lm", "fit", "--config", str(old), "--trainer.callbacks+",
                           "callbacks.nan_guard.NanGuard", "--print_config"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for new in ("lit_lm.strategies.composed.ComposedStrategy", "lit_lm.callbacks.progress.StepProgress",
                "lit_lm.callbacks.nan_guard.NanGuard", "lit_lm.data.datamodule.TextDataModule"):
        assert f"class_path: {new}" in done.stdout
    warned = [line for line in done.stderr.splitlines() if "FutureWarning" in line]
    assert len(warned) == 4, done.stderr
    for old_path in ("strategies.composed.ComposedStrategy", "callbacks.progress.StepProgress",
                     "callbacks.nan_guard.NanGuard", "lit_lm.data.TextDataModule"):
        assert sum(f" {old_path} is deprecated: use lit_lm." in line for line in warned) == 1, done.stderr
