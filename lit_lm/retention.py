"""Which step checkpoints a run keeps: the newest `keep_last` and every `keep_every`-th step's.

    trainer:
      callbacks:
        - class_path: lit_lm.retention.RetainingCheckpoint
          init_args: {every_n_train_steps: 100, keep_last: 3, keep_every: 1000, save_last: true}

A `ModelCheckpoint` (every option of Lightning's, `filename` must keep `{step}`) whose retention is by step: after
each save the step checkpoints in its folder (`step=N` in the name; `last*` is never touched) that are neither
among the newest `keep_last` nor at a multiple of `keep_every` are removed. Removal goes through the strategy, so
under lit-lm's background saves it happens only once the newest checkpoint is published: a crash never leaves
fewer complete checkpoints than retention keeps. Checkpoints of earlier attempts of the run (a restart, a requeue)
in the same folder count as well.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lit_lm.config import ConfigError

STEP = re.compile(r"(?:^|[^a-z])step=(\d+)")


class RetainingCheckpoint(ModelCheckpoint):
    """ModelCheckpoint keeping the newest `keep_last` step checkpoints and every `keep_every`-th step's (0: none)."""

    def __init__(self, keep_last: int = 3, keep_every: int = 0, filename: Optional[str] = "{step:05d}",
                 **kwargs: Any) -> None:
        if keep_last < 1 or keep_every < 0:
            raise ConfigError(f"keep_last={keep_last}, keep_every={keep_every} (RetainingCheckpoint): keep_last must "
                              "be >= 1 (the newest checkpoints kept) and keep_every >= 0 (0: no periodic ones)")
        if filename is None or "{step" not in filename:
            raise ConfigError(f"filename={filename!r} (RetainingCheckpoint): it must contain {{step}}, by which "
                              "retention tells the checkpoints apart")
        kwargs["save_top_k"] = -1  # every save is kept by Lightning; retention is this class's
        super().__init__(filename=filename, **kwargs)
        self.keep_last, self.keep_every = keep_last, keep_every

    @override
    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        if Path(filepath).name.startswith(self.CHECKPOINT_NAME_LAST or "last"):
            return
        for path in self.expired(Path(filepath)):
            trainer.strategy.remove_checkpoint(path)
            self.best_k_models.pop(str(path), None)

    def expired(self, newest: Path) -> list[Path]:
        """The step checkpoints in `newest`'s folder retention drops, `newest` (maybe still being written) counted."""
        steps = {newest: _step(newest.name)}
        for path in newest.parent.iterdir() if newest.parent.is_dir() else ():
            step = _step(path.name)
            if step is not None and path.suffix == self.FILE_EXTENSION:  # *.tmp-<id> leftovers end otherwise
                steps[path] = step
        ordered = sorted((p for p in steps if steps[p] is not None), key=lambda p: steps[p])
        keep = set(ordered[-self.keep_last:])
        keep |= {p for p in ordered if self.keep_every and steps[p] % self.keep_every == 0}
        return [p for p in ordered if p not in keep]


def _step(name: str) -> Optional[int]:
    if name.startswith("last"):
        return None
    match = STEP.search(name)
    return int(match.group(1)) if match else None
