"""Preemption: SIGUSR1 or SIGTERM (SLURM's `--signal` before the time limit, a preemption, `scancel`) makes every
rank save a checkpoint at the end of the same step and stop, for a requeue that resumes from it.

A signal only sets a flag on the rank that receives it. At the end of every training step each rank posts its flag
in an asynchronous MAX all-reduce over a small gloo group of its own and reads the result of the one it posted at
the previous step (long done: no wait, and no device sync: the flag is a CPU tensor); so every rank sees the same
value at the end of the same step, one step after the first signal, and then saves `last.ckpt` in the run's
checkpoint folder (ModelCheckpoint's `dirpath`), waits for it to be published and stops (`trainer.should_stop`).
`REQUEUE_EXIT_CODE` is what the process then exits with (lit_lm/cli.py), except under torchrun, whose agent would
restart failed workers: there the workers exit 0 and scripts/launch/torchrun.sh, which received the signal too,
exits with it (slurm.sbatch requeues the job on it).

Lightning's own SIGTERM handling (stop at the end of the batch, no checkpoint) is replaced for the training and
restored after it.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"; slurm.sbatch and torchrun.sh requeue on it
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Preemption(L.Callback):
    """Added by lit-lm's strategies to a fit (see the module docstring); `preempted` tells the CLI how to exit."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.received: Optional[int] = None  # the signal number this rank received
        self.preempted = False  # every rank agreed and the checkpoint is saved
        self._decided = False
        self._posted: Optional[tuple[Any, torch.Tensor]] = None
        self._previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
            print(f"[lit-lm] rank {dist.get_rank()}: {signal.Signals(signum).name} received: saving at the end of "
                  "a step every rank agrees on, then exiting for a requeue", file=sys.stderr, flush=True)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.preempted, self._decided, self._posted = False, False, None
        for sig in SIGNALS:  # after Lightning registered its own (replaced until the end of training)
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def agreed(self) -> bool:
        """Collective, at the end of every step: whether any rank had received a signal when the previous step's
        flags were posted; posts this step's."""
        decided = False
        if self._posted is not None:
            work, flag = self._posted
            work.wait()  # posted a step ago on a CPU group: done by now
            decided = bool(flag.item())
        flag = torch.tensor([int(self.received is not None)], dtype=torch.int32)
        self._posted = (dist.all_reduce(flag, dist.ReduceOp.MAX, group=self.group, async_op=True), flag)
        return decided

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.preempted:
            return
        self._decided = self.agreed() or self._decided
        if not self._decided or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # no signal, or inside an accumulation window: at its end
        path = last_checkpoint_path(trainer)
        trainer.save_checkpoint(path, weights_only=False)  # a full one, said so (None: Lightning logs its default)
        wait = getattr(trainer.strategy, "wait_for_checkpoints", None)
        if wait is not None:
            wait()  # published before anyone exits
        self.preempted = True
        trainer.should_stop = True
        if trainer.is_global_zero:
            print(f"[lit-lm] preempted: saved {path} at step {trainer.global_step}; exiting for a requeue "
                  f"(--ckpt_path last resumes it)", file=sys.stderr, flush=True)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore(wait=True)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore(wait=False)  # a peer may be gone

    def _restore(self, wait: bool) -> None:
        if self._posted is not None and wait:
            self._posted[0].wait()  # no collective left pending on the group
        self._posted = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def exit_code() -> int:
    """What a preempted rank exits with: `REQUEUE_EXIT_CODE`, or 0 under torchrun (whose agent restarts failed
    workers; torchrun.sh exits with the code itself)."""
    return 0 if os.environ.get("TORCHELASTIC_RUN_ID") else REQUEUE_EXIT_CODE


def last_checkpoint_path(trainer: L.Trainer) -> Path:
    """`last.ckpt` in the folder of the trainer's ModelCheckpoint (where `--ckpt_path last` looks), else in
    `<default_root_dir>/checkpoints`."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.dirpath:
        return Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
    return Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"
