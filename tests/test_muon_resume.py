"""Muon's state resumes under any other layout and world size: a run saved under zero2 on 2 ranks (Muon on the
hidden matrices, AdamW on the rest, built by `LanguageModel(optimizer=...)` as a config names it) resumes under tp2,
zero3, one process (lit-lm's strategy on one rank) and, converted to one file by `scripts/ckpt.py convert`, under
Lightning's own one-device strategy.

Two checks per target:
- the state right after the load, gathered whole under global names, equals the saved run's final state bit for
  bit: every `momentum_buffer` (each shaped as the tensor its rank holds: ZeRO rows, tp slices) and AdamW's `step`,
  `exp_avg`, `exp_avg_sq`, and every parameter;
- the continued run equals the uninterrupted one-process run (the harness's reference resumed from its own save of
  the same K steps) at test_muon_parity's MUON_RTOL (bfloat16 Newton-Schulz amplifies fp32 summation order:
  tests/test_muon_parity.py's docstring).
`scripts/ckpt.py inspect` names the optimizer class and counts each state key of the sharded directory.
"""

from __future__ import annotations

import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from dist_utils import REFERENCE_TILES
from lit_lm.parity import MUON_LR, Case, assert_parity, fit_case, reference
from lit_lm.spawn import run_distributed
from lit_lm.strategies.base import BaseStrategy
from lit_lm.strategies.checkpoint import optimizer_state_by_fqn
from lit_lm.strategies.composed import ComposedStrategy
from test_muon_parity import MUON_RTOL

REPO = Path(__file__).resolve().parents[1]
K, MORE = 2, 2  # save after K steps, resume for MORE
MUON = {"class_path": "lit_lm.optim.Muon", "init_args": {"lr": MUON_LR, "adamw_lr": 3e-3, "adamw_eps": 1e-6}}
# the user's module: LanguageModel with Muon from its config, a flat schedule (no warmup: every step moves)
MODULE = ("lit_lm.module.LanguageModel", (("optimizer", MUON), ("schedule", {"name": "constant"}),
                                          ("warmup_steps", 0)))


class OptimizerState(L.Callback):
    """The optimizer's state and the parameters, whole under global names: at the start (after a resume's load) and
    at the end of training."""

    def __init__(self) -> None:
        self.start: dict[str, torch.Tensor] = {}
        self.end: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.start = named_state(trainer)

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.end = named_state(trainer)


def _whole(value: Any) -> Any:
    value = value.full_tensor() if isinstance(value, DTensor) else value
    return value.detach().clone() if isinstance(value, torch.Tensor) else torch.tensor(value)


def named_state(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """"<name>:<state key>" for the optimizer's state, "<name>" for the parameters (collective under a strategy)."""
    strategy, optimizer, module = trainer.strategy, trainer.optimizers[0], trainer.lightning_module
    if isinstance(strategy, BaseStrategy):
        state, params = strategy.optimizer_state(optimizer)["state"], strategy.lightning_module_state_dict()
    else:
        names = {p: n for n, p in module.named_parameters()}
        state, params = optimizer_state_by_fqn(optimizer, names)["state"], module.state_dict()
    names = {n for n, _ in module.named_parameters()}
    return {**{f"{fqn}:{k}": _whole(v) for fqn, s in state.items() for k, v in s.items()},
            **{n: _whole(v) for n, v in params.items() if n in names}}


def muon_case(strategy: Optional[Any], label: str, resume: Optional[Case] = None) -> Case:
    return Case(strategy, optimizer="module", module=MODULE, steps=MORE if resume else K, resume=resume,
                callbacks=(OptimizerState(),), label=label)


SAVED = muon_case(None, "one process, Muon")  # the reference's K steps (what `reference` resumes from)
SOURCE = muon_case(partial(ComposedStrategy, zero_stage=2), "zero2 (source)")
TWO_RANKS = {"tp2": muon_case(partial(ComposedStrategy, tensor_parallel_size=2), "zero2 -> tp2", SAVED),
             "zero3": muon_case(partial(ComposedStrategy, zero_stage=3), "zero2 -> zero3", SAVED)}
ONE_PROCESS = muon_case(partial(ComposedStrategy), "zero2 -> one process", SAVED)
CONVERTED = muon_case(None, "zero2 -> one file -> Lightning's one device", SAVED)


def _save_and_resume(directory: str) -> list[dict[str, Any]]:
    """On 2 ranks: the source trained K steps and saved in `directory`, then each two-rank target resumed from it."""
    runs = [fit_case(SOURCE, 2, save_to=directory)]
    return runs + [fit_case(case, 2, ckpt_path=directory) for case in TWO_RANKS.values()]


def _resume_one(case: Case, path: str) -> dict[str, Any]:
    return fit_case(case, 1, ckpt_path=path)


def _ckpt_script(*args: str) -> str:
    done = subprocess.run([sys.executable, str(REPO / "scripts/ckpt.py"), *args], capture_output=True, text=True,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _assert_loaded(run: dict[str, Any], saved: dict[str, torch.Tensor], label: str) -> None:
    """Every rank's state after the load equals the saved run's final state, bit for bit."""
    for rank, got in enumerate(run["ranks"]):
        start = got["callbacks"][0].start
        assert start.keys() == saved.keys(), f"{label}: rank {rank}: {sorted(start.keys() ^ saved.keys())[:4]}"
        for key, value in saved.items():
            assert torch.equal(start[key], value), f"{label}: rank {rank}: {key} not resumed as saved"


def test_muon_state_saved_under_zero2_resumes_under_tp2_zero3_and_one_process(tmp_path: Path) -> None:
    directory = str(tmp_path / "zero2.ckpt")
    per_rank = run_distributed(_save_and_resume, 2, directory, init_process_group=False, env=REFERENCE_TILES)
    saved = per_rank[0][0]["callbacks"][0].end
    assert any(key.endswith(":momentum_buffer") for key in saved) and any(key.endswith(":exp_avg") for key in saved)
    assert not any(key.endswith(":exp_avg") and "blocks" in key and "norm" not in key and "router" not in key
                   for key in saved)  # the hidden matrices are Muon's: one buffer each

    inspect = _ckpt_script("inspect", directory)
    assert "optimizer lit_lm.optim.Muon" in inspect, inspect
    n_matrices = sum(key.endswith(":momentum_buffer") for key in saved)
    assert f"momentum_buffer x {n_matrices}" in inspect, inspect
    single_file = str(tmp_path / "zero2-converted.ckpt")
    _ckpt_script("convert", directory, single_file)

    runs = {name: {"case": case, "ranks": [r[1 + i] for r in per_rank], "single": reference(case)}
            for i, (name, case) in enumerate(TWO_RANKS.items())}
    runs["one process"] = {"case": ONE_PROCESS, "single": reference(ONE_PROCESS), "ranks": run_distributed(
        _resume_one, 1, ONE_PROCESS, directory, init_process_group=False, env=REFERENCE_TILES)}
    runs["converted"] = {"case": CONVERTED, "single": reference(CONVERTED),
                         "ranks": [fit_case(CONVERTED, 1, ckpt_path=single_file)]}
    for name, run in runs.items():
        _assert_loaded(run, saved, name)
        assert_parity(run, rtol=MUON_RTOL)
