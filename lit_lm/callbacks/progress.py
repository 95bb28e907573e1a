"""`StepProgress`: training progress as optimizer steps of `max_steps`, on a terminal or in a log file.

Lightning's bar counts the batches of the current epoch ("Epoch 0/-2" when only max_steps ends the run, "15/4"
after a resume) and shows the logger's version as a metric (`v_num: 0.000`). This one shows one bar for the
whole run, `step N/max_steps`, and, when stdout is not a terminal (a SLURM log, a pipe), where a bar draws
nothing until the end and then dumps its last frame into the log, draws no bar and prints plain lines instead: one
every `every_n_steps` steps and one per validation during fit:

    step 120/400 | loss 4.3121 | lr 2.91e-03 | 5,123 tokens/s | grad_norm 0.8312 | eta 2m13s
    validation at step 200 | val_loss 4.5012 | val_ppl 90.14

The bar's metrics and the line are read from the device, so they are refreshed at logging steps (the bar) and
at the line's steps only: between them a step runs without a host sync (align `every_n_steps` with the trainer's
`log_every_n_steps`). tokens/s is `lit_lm.callbacks.throughput.Throughput`'s (the `lit-lm` command adds it),
measured over the last logging interval.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar

from lit_lm.log_steps import logs_this_batch

SHOWN = ("train_loss", "tokens_per_s")  # LanguageModel's loss, Throughput's tokens/s: shown by the bar


class StepProgress(RichProgressBar):
    def __init__(self, every_n_steps: int = 10, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if every_n_steps <= 0:
            raise ValueError(f"StepProgress every_n_steps must be positive, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        if not sys.stdout.isatty():  # a log file: lines, not a bar's frames
            self.disable()
        self._started: Optional[tuple[float, int]] = None  # (time, step) when this run's training began
        self._printed = -1

    @property
    def total_train_batches(self) -> int:
        return self.trainer.max_steps if self.trainer.max_steps > 0 else int(self.trainer.estimated_stepping_batches)

    def _get_train_description(self, current_epoch: int) -> str:
        return "train (steps)"

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """Lightning's progress-bar metrics plus the loss and tokens/s, which `LanguageModel` logs without
        `prog_bar` (Lightning would read a prog_bar metric on the host every step)."""
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        for key in SHOWN:
            if key in trainer.callback_metrics and key not in metrics:
                metrics[key] = float(trainer.callback_metrics[key])
        return metrics

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._started = (time.monotonic(), trainer.global_step)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.train_progress_bar_id is None:  # one bar for all epochs
            super().on_train_epoch_start(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)
        if logs_this_batch(trainer):  # metrics are host reads: at logging steps only, not every step
            self._update_metrics(trainer, pl_module)
        self.refresh()
        step = trainer.global_step
        if self._prints(trainer, step) and step != self._printed and trainer.is_global_zero:
            self._printed = step  # once per step, not per accumulated micro-batch
            print(self.line(trainer), flush=True)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if sys.stdout.isatty() or trainer.sanity_checking or trainer.state.fn != "fit":
            return
        if trainer.is_global_zero:
            print(self.validation_line(trainer), flush=True)

    def validation_line(self, trainer: L.Trainer) -> str:
        m = trainer.callback_metrics
        values = [f"{key} {float(m[key]):.4f}" for key in sorted(m) if key.startswith("val_")]
        return " | ".join([f"validation at step {trainer.global_step}", *values])

    def _prints(self, trainer: L.Trainer, step: int) -> bool:
        return not sys.stdout.isatty() and (step % self.every_n_steps == 0 or step == self.total_train_batches)

    def line(self, trainer: L.Trainer) -> str:
        step, total, m = trainer.global_step, self.total_train_batches, trainer.callback_metrics
        parts = [f"step {step}/{total}"]
        for key, label, fmt in (("train_loss", "loss", ".4f"), ("lr", "lr", ".2e"),
                                ("tokens_per_s", "tokens/s", ",.0f"), ("grad_norm", "grad_norm", ".4f")):
            value = m.get(key)
            if value is not None:
                parts.append(f"{label} {float(value):{fmt}}")
        if self._started is not None and step > self._started[1]:
            per_step = (time.monotonic() - self._started[0]) / (step - self._started[1])
            parts.append(f"eta {_duration(per_step * (total - step))}")
        return " | ".join(parts)


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{s:02d}s"
