"""The suite's small distributed helpers: a tiny Lightning training harness (`TinyLM`, `fit_tiny`) for strategy
parity and checkpoint tests (the same fixed token data and global batch on any number of ranks, so runs are
comparable step by step), and, re-exported from the package where `lit-lm check` shares them, `run_distributed`
(lit_lm/spawn.py) and the tiny model and its data (`TINY`, `token_data`, `rank_share`: lit_lm/parity.py).
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lit_lm.config import ModelConfig
from lit_lm.model import Transformer
from lit_lm.parity import TINY, rank_share, token_data
from lit_lm.spawn import free_port, run_distributed
from lit_lm.strategies.plan import step_loss_fn

__all__ = ["REFERENCE_TILES", "TINY", "Recorder", "TinyLM", "fit_tiny", "free_port", "rank_share", "run_distributed",
           "token_data"]

# the ranks' environment for strategy runs under context parallelism: their attention tiles by the PyTorch reference,
# the path `fit` takes on CPU (lit_lm/strategies/cp.py), not by the FlashAttention kernel in Triton's interpreter,
# which the suite turns on for the kernel tests (conftest.py): there a 2-step cp2 run on 4 ranks took 43-72 s (every
# other layout of test_estimate 0.3-2 s). The kernel's tiles under cp are checked against attention on the whole
# sequence in test_cp's attention test (cp 2, forward and backward), the kernel itself in test_kernels.
REFERENCE_TILES = {"TRITON_INTERPRET": "0"}


# -- a tiny Lightning run, shared by the strategy parity and checkpoint tests --------------------------------


class TinyLM(L.LightningModule):
    """The smallest LightningModule that trains lit_lm's Transformer; built in configure_model, like the real one."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Transformer | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = Transformer(ModelConfig(**TINY))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens = batch[0]
        loss = step_loss_fn(self.trainer.strategy, self.model)(tokens[:, :-1], tokens[:, 1:])[0]  # the loss seam
        self.log("train_loss", loss, sync_dist=True)  # the mean over dp ranks = the global-batch loss
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class Recorder(L.Callback):
    """Per-batch dp-mean loss and (when a clip logs it) the pre-clip global grad norm."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        if trainer.global_step != self._step and "grad_norm" in trainer.callback_metrics:  # not a micro-step
            self.grad_norms.append(float(trainer.callback_metrics["grad_norm"]))
        self._step = trainer.global_step


def fit_tiny(strategy: Any = "auto", devices: int = 1, global_batch: int = 8, steps_per_epoch: int = 4,
             max_steps: int = 8, ckpt_path: str | None = None, callbacks: tuple = (), one_batch: bool = False,
             **trainer_kwargs: Any) -> dict[str, Any]:
    """Train TinyLM on fixed tokens with a constant global batch over `devices` ranks; an epoch is
    `steps_per_epoch` optimizer steps. Returns the per-batch losses, pre-clip grad norms and final parameters.

    `one_batch` repeats a single global batch (or accumulation window) all epoch. Resume tests use it: a plain
    DataLoader has no position to restore, so Lightning re-enters the data at a different batch after a
    resume; with one batch the data stream is the same anyway and the test sees the strategy's state only.
    """
    accumulate = trainer_kwargs.get("accumulate_grad_batches", 1)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    windows = 1 if one_batch else steps_per_epoch
    tokens = token_data(windows * accumulate * global_batch).repeat(steps_per_epoch // windows, 1)
    data = rank_share(tokens, global_batch, rank, devices)
    loader = DataLoader(TensorDataset(data), batch_size=global_batch // devices, shuffle=False)
    L.seed_everything(0, verbose=False)
    module, recorder = TinyLM(), Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps,
                        callbacks=[recorder, *callbacks], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                        enable_checkpointing=any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint)
                                                 for c in callbacks), **trainer_kwargs)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    params = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "params": params}
