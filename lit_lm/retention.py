"""Which step checkpoints a run keeps: the newest `keep_last` and every `keep_every`-th step's.

    trainer:
      callbacks:
        - class_path: lit_lm.retention.RetainingCheckpoint
          init_args: {every_n_train_steps: 100, keep_last: 3, keep_every: 1000, save_last: true}

A `ModelCheckpoint` (every option of Lightning's, `filename` must keep `{step}`) that removes only what it wrote
itself: it records its step saves (`saves`: file name and step, in the order written) and after each one removes
those that are neither among its newest `keep_last` by write nor at a multiple of `keep_every`; the save it just
made is always the newest. `last*` is Lightning's and never touched, and so is every other file of the folder: another
callback's (a val-loss `ModelCheckpoint` sharing lit-lm's default `checkpoints/` folder), the user's, and an
abandoned branch's after a rollback (resumed from step 100 with 150-200 of the first attempt still there, those stay:
this run did not write them; delete them by hand). The record is part of the callback's state in every checkpoint,
so a resumed run (`--ckpt_path last`, a requeue) still retires the saves of its earlier attempts, and a run resumed
from an earlier checkpoint knows only the saves that led to it. Removal goes through the strategy, so under
lit-lm's background saves it happens only once the newest checkpoint is published: a crash never leaves fewer
complete checkpoints than retention keeps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lit_lm.config import ConfigError


class RetainingCheckpoint(ModelCheckpoint):
    """ModelCheckpoint keeping the newest `keep_last` of its step checkpoints and every `keep_every`-th step's (0:
    none)."""

    def __init__(self, keep_last: int = 3, keep_every: int = 0, filename: Optional[str] = "{step:05d}",
                 **kwargs: Any) -> None:
        if keep_last < 1 or keep_every < 0:
            raise ConfigError(f"keep_last={keep_last}, keep_every={keep_every} (RetainingCheckpoint): keep_last must "
                              "be >= 1 (the newest checkpoints kept) and keep_every >= 0 (0: no periodic ones)")
        if filename is None or "{step" not in filename:
            raise ConfigError(f"filename={filename!r} (RetainingCheckpoint): it must contain {{step}}, so that "
                              "every save has a name of its own")
        kwargs["save_top_k"] = -1  # every save is kept by Lightning; retention is this class's
        super().__init__(filename=filename, **kwargs)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.saves: list[tuple[str, int]] = []  # (file name in dirpath, step) of this callback's saves, oldest first

    @override
    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        path = Path(filepath)
        if path.name.startswith(self.CHECKPOINT_NAME_LAST or "last"):
            super()._save_checkpoint(trainer, filepath)
            return
        saves = [s for s in self.saves if s[0] != path.name] + [(path.name, trainer.global_step)]
        expired = self.expired(saves)
        self.saves = [s for s in saves if s not in expired]  # recorded in the checkpoint being written
        super()._save_checkpoint(trainer, filepath)
        for name, _ in expired:
            trainer.strategy.remove_checkpoint(path.parent / name)
            self.best_k_models.pop(str(path.parent / name), None)

    def expired(self, saves: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """Of `saves` (oldest first, the one just made last), those retention drops."""
        keep = saves[-self.keep_last:]
        return [s for s in saves if s not in keep and not (self.keep_every and s[1] % self.keep_every == 0)]

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "saves": [list(s) for s in self.saves]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if state_dict.get("dirpath", self.dirpath) == self.dirpath:  # as Lightning restores its own record
            # names from a file stay in the folder: a bare file name, nothing that climbs out of it
            self.saves = [(name, step) for name, step in state_dict.get("saves", [])
                          if isinstance(name, str) and isinstance(step, int) and name not in ("", ".", "..")
                          and Path(name).name == name]
