"""A data-parallel sampler over one endless, seeded stream of samples, resumable from "global samples consumed".

Global stream position p is sample `perm_e[p mod N]` of epoch e = p div N, where perm_e is a permutation seeded by
(seed, e). DP rank r of R takes positions start + r, start + r + R, ... so each global batch is B·R consecutive
positions spread over the ranks. The only state is `start`, the number of global samples consumed so far: it does
not depend on R, so a run saved with 4 ranks continues the same stream on 2, and it does not depend on where
Lightning's epochs begin and end (a run stopped by `max_steps` counts as a finished epoch there).

It subclasses `DistributedSampler` only so that Lightning leaves it in place instead of wrapping it.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DistributedSampler


class ResumableSampler(DistributedSampler):
    """Yields `batches_per_pass · batch_size` indices per pass and rank, then advances the stream by as many
    global samples, so no partial batch is ever dropped and every rank runs the same number of batches
    (strategies that communicate inside forward, e.g. ZeRO-3, would otherwise hang on a short last batch).
    With `advance=False` every pass replays the same positions (validation: the same samples each time)."""

    def __init__(self, num_samples: int, batch_size: int, num_replicas: int = 1, rank: int = 0,
                 shuffle: bool = True, seed: int = 0, start: int = 0, advance: bool = True) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"sampler rank {rank} is outside [0, num_replicas={num_replicas})")
        # DistributedSampler's own __init__ would query torch.distributed: set its attributes ourselves.
        self.num_samples_total = num_samples
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.start = start
        self.advance = advance

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the stream position, not Lightning's epoch counter, decides what comes next."""

    def __len__(self) -> int:
        return self.num_samples_total // (self.batch_size * self.num_replicas) * self.batch_size

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples_total)
        return torch.randperm(self.num_samples_total, generator=torch.Generator().manual_seed(self.seed + epoch))

    def indices(self, start: int, count: int) -> list[int]:
        """This rank's `count` samples of the stream from global position `start`."""
        positions = start + self.rank + self.num_replicas * torch.arange(count)
        epochs = positions // self.num_samples_total
        out = torch.empty_like(positions)
        for epoch in epochs.unique().tolist():
            here = epochs == epoch
            out[here] = self._epoch_order(epoch)[positions[here] % self.num_samples_total]
        return out.tolist()

    def __iter__(self) -> Iterator[int]:
        count = len(self)
        chunk = self.indices(self.start, count)
        if self.advance:
            self.start += count * self.num_replicas
        return iter(chunk)


class PositionSampler(ResumableSampler):
    """The same positions as `ResumableSampler` (rank r of R: start + r, start + r + R, ...), yielded as they are:
    for a dataset indexed by the global stream position (`lit_lm.data.mixture.MixtureWindows`), which does its own
    shuffling. `num_samples` only sets the length of a pass."""

    def indices(self, start: int, count: int) -> list[int]:
        return (start + self.rank + self.num_replicas * torch.arange(count)).tolist()
