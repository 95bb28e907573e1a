"""ZeRO-1/2's weights between steps: the all-gathers of the updated rows run beside the next forward
(`ZeroEngine.refresh_params(defer=True)`: each unit waited for in its first module's forward pre-hook), so whatever
reads the weights before that forward must find them gathered. `FlushBeforeReaders`, which the strategy puts first
among the trainer's callbacks, completes the gathers (`ZeroEngine.flush`):

- at the step's end (its `on_train_batch_end`, before any other callback's or the module's), unless every hook that
  runs between the step and the next forward is known to read no weight: the base class's (a no-op), one of
  `WEIGHT_FREE` (Lightning's progress bars, lr monitor, timer and checkpoint callback, lit-lm's own: their saves go
  through the strategy's state dict, which flushes), or one of a class that says `reads_weights = False` (a
  callback or LightningModule of the user's). A user callback that reads parameters in `on_train_batch_end`, a
  `training_step` that reads one before the model runs: the gathers are completed before them;
- at the start of training (after a resume's load), of validation, and at an epoch's and the training's end;
- the strategy's checkpoint state (`lightning_module_state_dict`) flushes too.

The forward and backward need nothing from here: a unit's first module waits for its gather, and the first
reduce-scatter of the backward flushes what no forward used (the same comm slots).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import lightning as L

# hooks that run between the optimizer step and the next training forward: the callbacks', then the module's
CALLBACK_HOOKS = ("on_train_batch_end", "on_train_batch_start", "on_before_zero_grad")
MODULE_HOOKS = (*CALLBACK_HOOKS, "optimizer_step", "optimizer_zero_grad", "on_before_batch_transfer",
                "transfer_batch_to_device", "on_after_batch_transfer", "training_step")
# known to read no weight in those hooks (by qualified name: lit_lm.strategies imports no other room of lit_lm)
WEIGHT_FREE = frozenset({
    "lightning.pytorch.callbacks.progress.tqdm_progress.TQDMProgressBar.on_train_batch_end",
    "lightning.pytorch.callbacks.progress.rich_progress.RichProgressBar.on_train_batch_end",
    "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint.on_train_batch_end",
    "lightning.pytorch.callbacks.lr_monitor.LearningRateMonitor.on_train_batch_start",
    "lightning.pytorch.callbacks.timer.Timer.on_train_batch_end",
    "lit_lm.callbacks.throughput.Throughput.on_train_batch_start",
    "lit_lm.callbacks.throughput.Throughput.on_train_batch_end",
    "lit_lm.callbacks.progress.StepProgress.on_train_batch_end",
    "lit_lm.strategies.preemption.Preemption.on_train_batch_end",
    "lit_lm.parity.Probe.on_train_batch_end",
    "lit_lm.module.LanguageModel.on_train_batch_end",
    "lit_lm.module.LanguageModel.training_step",  # the model runs first: its modules wait for their units
    "lit_lm.module.LanguageModel.optimizer_step",  # the routers' bias is a buffer
})


def reads_weights(obj: Any, hooks: Iterable[str], base: type) -> bool:
    """Whether any of `obj`'s `hooks` may read a weight: overridden from `base`, not in `WEIGHT_FREE`, and its class
    does not say `reads_weights = False`."""
    if getattr(type(obj), "reads_weights", True) is False:
        return False
    for hook in hooks:
        fn = getattr(type(obj), hook, None)
        if fn is None or fn is getattr(base, hook, None):
            continue
        if f"{fn.__module__}.{fn.__qualname__}" not in WEIGHT_FREE:
            return True
    return False


class FlushBeforeReaders(L.Callback):
    """Completes ZeRO-1/2's after-step gathers (`engines()`'s `flush`) before any reader of the weights (see the
    module docstring)."""

    def __init__(self, engines: Callable[[], list[Any]]) -> None:
        self.engines = engines
        self.overlap = False  # whether the gathers may run into the next forward (decided at the start of training)

    def flush(self) -> None:
        for engine in self.engines():
            engine.flush()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        others = [c for c in trainer.callbacks if c is not self]
        self.overlap = not (any(reads_weights(c, CALLBACK_HOOKS, L.Callback) for c in others)
                            or reads_weights(pl_module, MODULE_HOOKS, L.LightningModule))
        self.flush()

    def on_train_batch_end(self, *args: Any) -> None:
        if not self.overlap:
            self.flush()

    def on_train_epoch_end(self, *args: Any) -> None:
        self.flush()

    def on_validation_start(self, *args: Any) -> None:
        self.flush()

    def on_train_end(self, *args: Any) -> None:
        self.flush()
