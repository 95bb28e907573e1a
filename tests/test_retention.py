"""Retention removes only what its own callback wrote, newest by write, across resumes: a rollback's new saves survive
beside the abandoned branch's (left alone), another callback's best checkpoint in the shared default folder stays,
and a resumed run retires its earlier attempt's saves but not a file the user put there (lm_ddp on 1 rank, saves in
the background). tests/test_resilience.py has the keep_last/keep_every count under zero3 x 2."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lit_lm.strategies.registry  # noqa: F401  (registers lm_ddp)
from dist_utils import fit_tiny, run_distributed
from lit_lm.retention import RetainingCheckpoint
from lit_lm.strategies import checkpoint as ckpt


def _keeper(folder: str | None = None, **kwargs: Any) -> RetainingCheckpoint:
    return RetainingCheckpoint(dirpath=folder, every_n_train_steps=1, **kwargs)


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _step_names(*steps: int) -> list[str]:
    return [f"step={s:05d}.ckpt" for s in steps]


# -- a rollback -------------------------------------------------------------------------------------------------
def _rollback(folder: str) -> tuple[list[str], list[str]]:
    """12 steps (keep 3, every 5th), then a fit resumed from step 5 to step 9 in the same folder."""
    fit_tiny("lm_ddp", max_steps=12, callbacks=(_keeper(folder, keep_last=3, keep_every=5),), one_batch=True)
    first = _names(Path(folder))
    fit_tiny("lm_ddp", max_steps=9, callbacks=(_keeper(folder, keep_last=3, keep_every=5),), one_batch=True,
             ckpt_path=str(Path(folder) / "step=00005.ckpt"))
    return first, _names(Path(folder))


def test_a_rollback_keeps_its_new_saves_and_leaves_the_abandoned_branch(tmp_path: Path) -> None:
    """Resumed at step 5 with the first attempt's 10/11/12 still there: the new run's newest 3 by write (7, 8, 9)
    and step 5 (every 5th) stay, 6 is retired; 10/11/12 are not this run's and stay. On main every new save was
    deleted as soon as it was published (10/11/12 were the highest steps)."""
    first, after = run_distributed(_rollback, 1, str(tmp_path), init_process_group=False)[0]
    assert first == _step_names(5, 10, 11, 12)
    assert after == _step_names(5, 7, 8, 9, 10, 11, 12)
    for step in (7, 8, 9):
        assert ckpt.check_complete(tmp_path / f"step={step:05d}.ckpt")["step"] == step


# -- the shared default folder ------------------------------------------------------------------------------------
class _ValLoss(L.Callback):
    """A val_loss lowest at step 2, set before the checkpoint callbacks run (Lightning runs them last)."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        trainer.callback_metrics["val_loss"] = torch.tensor(float(abs(trainer.global_step - 2)))


def _shared_folder(root: str) -> tuple[list[str], str]:
    best = ModelCheckpoint(monitor="val_loss", save_top_k=1, every_n_train_steps=1)
    fit_tiny("lm_ddp", max_steps=6, callbacks=(_ValLoss(), best, _keeper(keep_last=1)), one_batch=True,
             default_root_dir=root)
    folder = Path(root) / "checkpoints"  # Lightning's default, shared by both callbacks
    return _names(folder), best.best_model_path


def test_another_callbacks_best_checkpoint_in_the_shared_folder_stays(tmp_path: Path) -> None:
    """A val-loss ModelCheckpoint (top 1) and a RetainingCheckpoint (keep_last=1) in the default folder: the best
    (step 2) stays beside retention's newest; on main retention deleted it at step 3 (`step=2` in its name)."""
    names, best = run_distributed(_shared_folder, 1, str(tmp_path), init_process_group=False)[0]
    assert Path(best).name == "epoch=0-step=2.ckpt"
    assert names == ["epoch=0-step=2.ckpt", "step=00006.ckpt"]
    assert ckpt.check_complete(best)["step"] == 2


# -- across a resume ----------------------------------------------------------------------------------------------
def _resumed(folder: str) -> list[str]:
    """4 steps (keep 2), a copy the user makes of step 3, then `last` resumed to step 6."""
    fit_tiny("lm_ddp", max_steps=4, callbacks=(_keeper(folder, keep_last=2, save_last=True),), one_batch=True)
    shutil.copytree(Path(folder) / "step=00003.ckpt", Path(folder) / "mine-step=00003.ckpt")
    fit_tiny("lm_ddp", max_steps=6, callbacks=(_keeper(folder, keep_last=2, save_last=True),), one_batch=True,
             ckpt_path=str(Path(folder) / "last.ckpt"))
    return _names(Path(folder))


def test_a_resumed_run_retires_its_earlier_saves_but_not_the_users_copy(tmp_path: Path) -> None:
    """The resumed callback knows the first attempt's saves from its state in last.ckpt: 3 and 4 are retired when
    5 and 6 are written; the user's copy of step 3 is no save of its and stays (on main it went, by its name)."""
    names = run_distributed(_resumed, 1, str(tmp_path), init_process_group=False)[0]
    assert names == ["last.ckpt", "mine-step=00003.ckpt", *_step_names(5, 6)]
