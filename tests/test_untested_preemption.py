"""Preemption (lit_lm/strategies/preemption.py) never exits before its checkpoint is published (issue #55, item 4):
`lit-lm fit` sent SIGTERM mid-run, its checkpoint written in the background (lit_lm/strategies/async_save.py) and made
slow on purpose, exits with the requeue code only once `last.ckpt` is whole and renamed into place."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
from test_cli import run_cli, tiny_args

from lit_lm.strategies import checkpoint as ckpt
from lit_lm.strategies.preemption import REQUEUE_EXIT_CODE

TESTS = Path(__file__).resolve().parent


class TermAtStep(L.Callback):
    """Loaded by the CLI as `test_untested_preemption.TermAtStep`: this process sends itself SIGTERM at the end of
    training step `step`, and every checkpoint write (on the background writer's thread) starts `delay` seconds late,
    so that a process that exits without waiting for the write leaves no published checkpoint."""

    def __init__(self, step: int, delay: float) -> None:
        self.step, self.delay = step, delay

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        real = ckpt.dcp.save

        def slow_save(*args: Any, **kwargs: Any) -> Any:
            time.sleep(self.delay)
            return real(*args, **kwargs)

        ckpt.dcp.save = slow_save  # this run's process only (a fork of the CLI server)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_exits_only_after_the_checkpoint_is_published(tmp_path: Path) -> None:
    callbacks = tmp_path / "callbacks.yaml"
    callbacks.write_text(
        "trainer:\n  callbacks:\n"
        "    - class_path: test_untested_preemption.TermAtStep\n      init_args: {step: 2, delay: 2.0}\n"
        "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
        "      init_args: {every_n_train_steps: 100}\n")  # the folder of last.ckpt; it saves nothing itself here
    run = run_cli("fit", *tiny_args(tmp_path), "--trainer.strategy", "lm_ddp", "--trainer.max_steps", "50",
                  "--config", str(callbacks), cwd=tmp_path,
                  env={"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))})
    assert run.returncode == REQUEUE_EXIT_CODE, run.stderr[-3000:]
    folder = tmp_path / "run" / "checkpoints"
    marker = ckpt.check_complete(folder / "last.ckpt")  # whole: every shard, the marker, renamed into place
    assert [p.name for p in folder.iterdir()] == ["last.ckpt"]  # no write left half done
    assert "SIGTERM received" in run.stderr, run.stderr[-3000:]
    saved = re.search(r"preempted: saved (\S+) at step (\d+)", run.stderr)
    assert saved and Path(saved[1]) == folder / "last.ckpt", run.stderr[-3000:]
    assert marker["step"] == int(saved[2]) and 2 < marker["step"] < 50  # saved after the signal, then stopped
