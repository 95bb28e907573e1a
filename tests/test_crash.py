"""Surviving failures: a save killed with SIGKILL leaves the previous checkpoint loadable, a dead rank makes the
others exit with its number instead of hanging, and NanGuard skips (or stops on) non-finite steps."""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import cli_server
import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lit_lm.strategies.registry  # noqa: F401  (registers lm_ddp, zero2)
from lit_lm.callbacks.nan_guard import NanGuard, NonFiniteError
from dist_utils import fit_tiny, free_port, run_distributed
from test_cli import run_script
from lit_lm.strategies import checkpoint as ckpt
from lit_lm.strategies import safe_load
from lit_lm.strategies.ddp import DataParallelStrategy

TESTS = Path(__file__).resolve().parent


def _launch(fn: str, world: int, *args: Any) -> list[subprocess.Popen]:
    """`fn(*args)` of this module (or `module.fn` of another test module) on `world` separate processes, wired as
    a launcher (torchrun) would; `python -c` through this worker's CLI server (tests/cli_server.py: forked, not ~8 s
    of imports each; a SIGKILL to one kills its child)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               NODE_RANK="0", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    module, _, name = fn.rpartition(".")
    code = f"import {module or 'test_crash'} as m; m.{name}(*{args!r})"
    return [subprocess.Popen([cli_server.python(env=env), "-c", code], cwd=TESTS, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
            for r in range(world)]


def _saver(ckpt_dir: str) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1, save_last=True)


# -- kill -9 during a save -------------------------------------------------------------------------------------
def _train_and_hang_in_save(ckpt_dir: str, sentinel: str, hang_at: int) -> None:
    """Train 4 steps saving every 2, in the step (each save writes `epoch=..-step=N.ckpt` then `last.ckpt`); the
    `hang_at`-th save stops after its shards are written, as a process killed in the middle of a save would."""
    real_save, calls = ckpt.dcp.save, [0]

    def slow_save(state: dict, checkpoint_id: Path, **kwargs: Any) -> None:
        real_save(state, checkpoint_id=checkpoint_id, **kwargs)
        calls[0] += 1
        if calls[0] == hang_at:
            Path(sentinel).write_text(str(checkpoint_id))
            time.sleep(600)

    ckpt.dcp.save = slow_save
    # written in the step (test_resilience.py kills a background save)
    fit_tiny(DataParallelStrategy(async_checkpoint=False), devices=1, max_steps=4, callbacks=(_saver(ckpt_dir),),
             one_batch=True)


def _resume_last(ckpt_dir: str) -> dict:
    return fit_tiny("lm_ddp", devices=1, max_steps=4, callbacks=(_saver(ckpt_dir),), ckpt_path="last",
                    one_batch=True)


def test_save_killed_midway_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    ckpt_dir, sentinel = tmp_path / "ckpt", tmp_path / "hung_in"
    proc = _launch("_train_and_hang_in_save", 1, str(ckpt_dir), str(sentinel), 4)[0]  # 4th: last.ckpt at step 4
    deadline = time.monotonic() + 120
    while not sentinel.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sentinel.exists(), proc.communicate()[1][-3000:]
    proc.kill()  # SIGKILL: no cleanup runs
    proc.wait()

    partial = Path(sentinel.read_text())
    assert partial.name.startswith("last.ckpt" + ckpt.TMP) and partial.is_dir()
    assert not (partial / ckpt.COMPLETE).exists()
    assert ckpt.check_complete(ckpt_dir / "last.ckpt")["step"] == 2  # the previous last.ckpt, whole
    # a directory without the marker is refused, naming the file
    broken = ckpt_dir / "broken.ckpt"
    shutil.copytree(ckpt_dir / "last.ckpt", broken)
    (broken / ckpt.COMPLETE).unlink()
    with pytest.raises(FileNotFoundError, match=str(broken / ckpt.COMPLETE)):
        ckpt.check_complete(broken)
    shutil.rmtree(broken)

    # ckpt_path="last" resumes from step 2 (not the .tmp- directory) and continues the uninterrupted run
    resumed = run_distributed(_resume_last, 1, str(ckpt_dir), init_process_group=False)[0]
    full = fit_tiny(devices=1, max_steps=4, one_batch=True)
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"][2:]), rtol=1e-5, atol=0)
    assert not partial.exists()  # the next save cleared what the killed one left

    # scripts/ckpt.py: inspect (metadata only) and convert (one plain file)
    last, out = ckpt_dir / "last.ckpt", tmp_path / "export.ckpt"
    report = run_script("scripts/ckpt.py", "inspect", last, cwd=TESTS.parent, check=True).stdout
    assert '"step": 4' in report and '"strategy": "DataParallelStrategy"' in report and "model.model." in report
    run_script("scripts/ckpt.py", "convert", last, out, cwd=TESTS.parent, check=True)
    assert safe_load.load(out)["global_step"] == 4


# -- a preemption's save ------------------------------------------------------------------------------------------
class _SignalAt(L.Callback):
    """SIGUSR1 to this process after step `step`, as SLURM's --signal sends it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)


def _preempted(ckpt_dir: str) -> tuple[list[str], int]:
    """What Lightning logs and warns while lm_ddp (1 rank) saves for a preemption and resumes from that save."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning.pytorch").addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_tiny("lm_ddp", max_steps=8, callbacks=(_SignalAt(2), _saver(ckpt_dir)), one_batch=True)
        preempted_at = ckpt.check_complete(Path(ckpt_dir) / "last.ckpt")["step"]
        fit_tiny("lm_ddp", max_steps=8, callbacks=(_saver(ckpt_dir),), one_batch=True, ckpt_path="last")  # requeued
    return said + [str(w.message) for w in caught], preempted_at


def test_a_preemption_save_says_nothing_about_weights_only(tmp_path: Path) -> None:
    """The preemption's save is a full one, so Lightning's "`weights_only` was not set, defaulting to `False`" (once
    per rank, beside lit-lm's safe-loading claim) is not printed: on main it was."""
    said, preempted_at = run_distributed(_preempted, 1, str(tmp_path), init_process_group=False)[0]
    assert 2 < preempted_at < 8 and any("Restoring states from the checkpoint" in line for line in said), said
    assert not [line for line in said if "weights_only" in line], said


# -- a rank dies -------------------------------------------------------------------------------------------------
class _DieAt(L.Callback):
    def __init__(self, rank: int, batch: int) -> None:
        self.rank, self.batch = rank, batch

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.batch:
            os._exit(1)


def _train_until_rank_1_dies() -> None:
    fit_tiny(DataParallelStrategy(timeout=30), devices=2, max_steps=100, callbacks=(_DieAt(1, 3),))


def test_lost_rank_is_named_and_the_others_exit(tmp_path: Path) -> None:
    start = time.monotonic()
    rank0, rank1 = _launch("_train_until_rank_1_dies", 2)
    try:
        _, err = rank0.communicate(timeout=90)
    finally:
        rank0.kill()
        rank1.kill()
    assert rank0.returncode != 0 and rank1.wait() == 1
    assert time.monotonic() - start < 60
    assert "rank 1 lost" in err, err[-3000:]
    assert "collectives on this rank" in err  # the flight recorder


# -- NaN / inf ---------------------------------------------------------------------------------------------------
class _PoisonLoss(L.Callback):
    """Multiply the loss by NaN at global step `step`, on `rank` only; record the parameters after every step."""

    def __init__(self, step: int, rank: int = 0) -> None:
        self.step, self.rank, self.params = step, rank, []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        pl_module.__dict__.pop("training_step", None)
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            clean = type(pl_module).training_step.__get__(pl_module)
            pl_module.training_step = lambda *a, **k: clean(*a, **k) * math.nan

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.params.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})


def _skip(strategy: Any, devices: int, rank: int) -> dict:
    poison = _PoisonLoss(step=2, rank=rank)
    run = fit_tiny(strategy, devices=devices, max_steps=5, callbacks=(poison, NanGuard("skip")))
    return {"losses": run["losses"], "params": poison.params}


@pytest.mark.parametrize("strategy, devices", [("auto", 1), ("zero2", 2)])
def test_nan_guard_skips_the_step_everywhere(strategy: str, devices: int) -> None:
    """zero2 on 2 ranks with the NaN on rank 1 only: both ranks skip (the decision is global)."""
    run = (run_distributed(_skip, devices, strategy, devices, 1, init_process_group=False)[0] if devices > 1
           else _skip(strategy, 1, 0))
    assert len(run["params"]) == 5  # (the logged loss is the clean one: the NaN multiplies what backward sees)
    before, skipped, after = run["params"][1], run["params"][2], run["params"][3]
    for name in before:
        torch.testing.assert_close(skipped[name], before[name], rtol=0, atol=0)  # no update at the NaN step
    assert any(not torch.equal(after[n], before[n]) for n in before)  # training goes on


def test_nan_guard_stops_with_a_message() -> None:
    with pytest.raises(NonFiniteError, match="non-finite loss and gradients at step 2"):
        fit_tiny(devices=1, max_steps=5, callbacks=(_PoisonLoss(step=2), NanGuard("stop")))
