"""Run a function on N local gloo processes and collect what each returns: the harness of the parallel tests.

    results = run_distributed(fn, 2, arg1, arg2)            # fn(arg1, arg2) on ranks 0 and 1 -> [r0, r1]
    results = run_distributed(fn, 2, init_process_group=False)  # Lightning workers: the strategy initialises

Each call uses a fresh free port (parallel test workers never collide), sets the environment a launcher would
(MASTER_ADDR/PORT, RANK, LOCAL_RANK, WORLD_SIZE, NODE_RANK: Lightning then sees externally created processes and
spawns nothing), pins OMP_NUM_THREADS=1 so N ranks do not oversubscribe the cores, and re-raises a rank's
exception in the caller with its traceback. `fn` and its arguments must be picklable (module-level functions);
results travel back through `torch.save`, so tensors and plain containers are fine.

The second half is a tiny Lightning training harness (`TinyLM`, `fit_tiny`) for strategy parity tests: the
same fixed token data and global batch on any number of ranks, so runs are comparable step by step.
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, TensorDataset

from lit_lm.config import ModelConfig
from lit_lm.model import Transformer


def free_port() -> int:
    """A port free now, chosen at random below the kernel's ephemeral range (32768+): an ephemeral port that is free
    now can be taken by one of the many client sockets other tests' gloo ranks open before our store binds it."""
    rng = random.SystemRandom()
    while True:
        port = rng.randrange(20000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, init_process_group: bool = True,
                    env: dict[str, str] | None = None) -> list[Any]:
    """Run `fn(*args)` on `world_size` spawned processes; return the per-rank results in rank order."""
    with tempfile.TemporaryDirectory() as out:
        base_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size),
                    "NODE_RANK": "0", "OMP_NUM_THREADS": "1", **(env or {})}
        mp.spawn(_worker, args=(fn, args, base_env, init_process_group, out), nprocs=world_size, join=True)
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _worker(rank: int, fn: Callable[..., Any], args: tuple, env: dict[str, str], init_process_group: bool,
            out: str) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if init_process_group:
        dist.init_process_group("gloo", rank=rank, world_size=int(env["WORLD_SIZE"]))
    try:
        result = fn(*args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(result, Path(out) / f"rank{rank}.pt")


# -- a tiny Lightning run, shared by the strategy parity and checkpoint tests --------------------------------
TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)


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
        loss = self.model.loss(tokens[:, :-1], tokens[:, 1:])[0]
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


def token_data(n_samples: int, seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"], (n_samples, seq_len + 1), generator=gen)


def rank_share(data: torch.Tensor, global_batch: int, rank: int, world: int) -> torch.Tensor:
    """This rank's rows, ordered so that its k-th local batch is its slice of the k-th global batch."""
    local = global_batch // world
    return data.view(-1, world, local, data.shape[-1])[:, rank].reshape(-1, data.shape[-1])


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
