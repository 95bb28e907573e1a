"""Throughput callback: tokens/s, model FLOPs per token, MFU and peak memory, logged at Lightning's logging steps.

The one place tokens/s is measured (the `lit-lm` command adds this callback unless the trainer has one already:
`lit_lm.cli`)."""

from __future__ import annotations

import resource
import sys
import time
from typing import Any, Optional

import lightning as L
import torch

from lit_lm.log_steps import logs_this_batch
from lit_lm.planner.estimate import flops_per_token  # noqa: F401  (one formula, shared with the planner)

# Dense bf16 tensor-core peak FLOP/s per GPU (NVIDIA datasheets, no sparsity), matched by substring of the CUDA
# device name, first match wins (so "H100 PCIe" is tested before "H100", "L40S" before "L4").
PEAK_FLOPS: list[tuple[str, float]] = [
    ("H200 NVL", 835e12),  # the NVL (PCIe) parts before their SXM names
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
]


def peak_flops_for(device_name: str) -> Optional[float]:
    """Peak bf16 FLOP/s of a device from its name (e.g. `torch.cuda.get_device_name()`), None if unknown."""
    return next((flops for key, flops in PEAK_FLOPS if key in device_name), None)


def data_parallel_size(trainer: L.Trainer) -> int:
    """How many model replicas consume different batches: the strategy's sampler replicas (dp; tp and pp peers of
    a replica read the same tokens), 1 without a distributed sampler."""
    return (getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}).get("num_replicas", 1)


def synchronized_clock(device: torch.device) -> float:
    """perf_counter once the device has finished the work queued so far (on CUDA: kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def peak_memory_bytes(device: torch.device) -> int:
    """Peak CUDA memory allocated by tensors, or on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # bytes on macOS, KiB on Linux


class Throughput(L.Callback):
    """Logs `tokens_per_s` and `throughput/{flops_per_token, mfu, peak_memory_gb}` at the steps Lightning writes
    (every `log_every_n_steps` optimizer steps, `logs_this_batch`), over the interval since the last of them.

    Reads the model shape from `pl_module.model.config` (a `lit_lm` ModelConfig: `num_params` (MoE: the active
    ones), `n_layers`, `d_model`) and the sequence length from the batch, a (B, T + 1) LongTensor. The interval's time
    runs from batch start to batch end (data loading and optimizer steps included, validations inside it not), read
    with the device synchronised once per interval, so it measures kernels run, not launched, and the steps in
    between run without a host read. tokens/s is summed over the data-parallel replicas (tp and pp peers of a
    replica read the same tokens: counting them would overcount); MFU = achieved model FLOP/s per device (the
    replicas' FLOP/s over all `trainer.world_size` devices) / `peak_flops` (looked up from the device name when not
    given; without a peak, MFU is not logged).
    """

    def __init__(self, peak_flops: Optional[float] = None) -> None:
        super().__init__()
        self.peak_flops = peak_flops
        self._start: Optional[float] = None  # when the current interval began (synchronised clock)
        self._tokens = 0
        self._paused: Optional[float] = None  # when a validation inside the interval began

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.peak_flops is None and pl_module.device.type == "cuda":
            self.peak_flops = peak_flops_for(torch.cuda.get_device_name(pl_module.device))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start, self._tokens, self._paused = None, 0, None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._start is None:
            self._start = synchronized_clock(pl_module.device)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        seq_len = batch.shape[1] - 1
        self._tokens += batch.shape[0] * seq_len * data_parallel_size(trainer)
        if not logs_this_batch(trainer):
            return
        now = synchronized_clock(pl_module.device)
        tokens_per_sec = self._tokens / max(now - self._start, 1e-9)
        cfg = pl_module.model.config
        flops = flops_per_token(cfg.num_params(include_embedding=False, active=True), cfg.n_layers, cfg.d_model,
                                seq_len)
        metrics = {
            "tokens_per_s": tokens_per_sec,
            "throughput/flops_per_token": float(flops),
            "throughput/peak_memory_gb": peak_memory_bytes(pl_module.device) / 1e9,
        }
        if self.peak_flops:
            metrics["throughput/mfu"] = tokens_per_sec * flops / (trainer.world_size * self.peak_flops)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)
        self._start, self._tokens = now, 0

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._start is not None:  # inside a fit's interval: its time is not the interval's
            self._paused = synchronized_clock(pl_module.device)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._paused is not None:
            self._start += synchronized_clock(pl_module.device) - self._paused
            self._paused = None
