"""`KMeansQuantization`: weight-only quantization to a per-layer codebook of 2^bits centroids (Deep Compression,
Han et al. 2016).

At `start_step` each selected weight is clustered (1-D k-means on the global tensor, initialised linearly over
[min, max], so every rank gets the same codebook); from then on every weight holds its centroid, and after each
optimizer step a centroid becomes the mean of its cluster's updated weights (the gradient of a shared weight is
the sum of its members'). Assignments are fixed. The means are sums and counts over each rank's part, all-reduced
over the groups the strategy names (tp, then ZeRO's dp rows of the tp slice): exact for whole, ZeRO-, TP- and
TP-then-ZeRO-sharded weights alike, without a gather. Codebooks and assignments live on the weights' device (a
checkpoint keeps them on CPU and they move back at the start of training).
Exported: bits per weight (packed) plus 2^bits fp32 centroids per layer.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import lightning as L
import torch
from torch import Tensor

from lit_lm.callbacks.compress.core import DEFAULT_EXCLUDE, all_reduce_, check_bits, gather_global, local_part, \
    log_per_layer, merged_over_ranks, owned_weights, select, warn_if_never_reached, write


def kmeans_1d(values: Tensor, k: int, iterations: int = 20) -> tuple[Tensor, Tensor]:
    """(centroids (k,), assignment like values (int64)), on values' device: Lloyd's algorithm from linearly spaced
    centroids."""
    flat = values.detach().float().reshape(-1)
    lo, hi = flat.min(), flat.max()
    centroids = lo + (hi - lo) * torch.linspace(0.0, 1.0, k, device=flat.device)
    for _ in range(iterations):
        assign = (flat[:, None] - centroids[None]).abs().argmin(1)
        sums = flat.new_zeros(k).index_add_(0, assign, flat)
        counts = flat.new_zeros(k).index_add_(0, assign, torch.ones_like(flat))
        centroids = torch.where(counts > 0, sums / counts.clamp(min=1), centroids)
    return centroids, (flat[:, None] - centroids[None]).abs().argmin(1).view(values.shape)


class KMeansQuantization(L.Callback):
    """Cluster the selected linears' weights from `start_step` and fine-tune the centroids (see the docstring)."""

    def __init__(self, bits: int = 4, start_step: int = 0, iterations: int = 20,
                 include: Optional[list[str]] = None, exclude: Sequence[str] = DEFAULT_EXCLUDE) -> None:
        self.bits = check_bits(bits, "KMeansQuantization")
        self.start_step, self.iterations = start_step, iterations
        self.include, self.exclude = include, tuple(exclude)
        self.codebooks: dict[str, Tensor] = {}  # name -> centroids (2^bits,)
        self.assignments: dict[str, Tensor] = {}  # name -> global int64 cluster index per weight
        self._last_step = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        warn_if_never_reached(trainer, "KMeansQuantization", self.start_step, trainer.max_steps)
        self._weights = select(owned_weights(trainer, pl_module), self.include, self.exclude, "KMeansQuantization")
        self._last_step = trainer.global_step
        for ws in self._weights:  # restored from a checkpoint on CPU: to the weight's device
            if ws.name in self.codebooks:
                self.codebooks[ws.name] = self.codebooks[ws.name].to(ws.local.device)
                self.assignments[ws.name] = self.assignments[ws.name].to(ws.local.device)
        self._snap(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return
        self._last_step = step
        if step >= self.start_step and not self.codebooks:
            for ws in self._weights:
                self.codebooks[ws.name], self.assignments[ws.name] = kmeans_1d(gather_global(ws), 2 ** self.bits,
                                                                               self.iterations)
        elif self.codebooks:
            self._update_centroids()
        self._snap(trainer)
        log_per_layer(pl_module, "bits", {ws.name[: -len(".weight")]: self.bits if self.codebooks else 32
                                          for ws in self._weights})

    @torch.no_grad()
    def _update_centroids(self) -> None:
        k = 2 ** self.bits
        for ws in self._weights:
            assign = local_part(self.assignments[ws.name], ws).reshape(-1)
            stats = torch.zeros(2, k, device=ws.local.device)
            stats[0].index_add_(0, assign, ws.local.detach().float().reshape(-1))
            stats[1].index_add_(0, assign, torch.ones_like(assign, dtype=torch.float32))
            all_reduce_(stats, ws.groups)
            sums, counts = stats
            self.codebooks[ws.name] = torch.where(counts > 0, sums / counts.clamp(min=1), self.codebooks[ws.name])

    def _snap(self, trainer: L.Trainer) -> None:
        """Every weight := its centroid (the local part, and the replica the forward reads)."""
        for ws in self._weights:
            if ws.name in self.codebooks:
                write(ws, self.codebooks[ws.name][self.assignments[ws.name]])

    def exported_bytes(self) -> int:
        return sum(-(-a.numel() * self.bits // 8) + c.numel() * 4
                   for a, c in zip(self.assignments.values(), self.codebooks.values()))

    def state_dict(self) -> dict[str, Any]:  # saved on CPU (a checkpoint loads on any machine)
        return {"codebooks": merged_over_ranks({k: v.to("cpu", copy=True) for k, v in self.codebooks.items()}),
                "assignments": merged_over_ranks({k: v.to("cpu", torch.uint8) for k, v in self.assignments.items()})}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.codebooks = dict(state_dict["codebooks"])
        self.assignments = {k: v.to(torch.int64) for k, v in state_dict["assignments"].items()}
