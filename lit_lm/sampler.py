"""A data-parallel sampler that is deterministic from the seed and resumable from "global samples consumed".

The sample order of an epoch is one global permutation. DP rank r of R takes global positions
start + r, start + r + R, ... so a global batch of B·R consecutive positions is spread over the ranks. The only
state needed to resume is `start`, the number of global samples already consumed in the epoch: it does not depend
on R, so a run saved with 4 ranks continues the same token stream on 2.

It subclasses `DistributedSampler` only so that Lightning leaves it in place instead of wrapping it.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DistributedSampler


class ResumableSampler(DistributedSampler):
    """Global-order sampler over `num_samples` indices.

    The epoch is trimmed to a multiple of `num_replicas`, so every rank runs the same number of batches
    (strategies that communicate inside forward, e.g. ZeRO-3, would otherwise hang on the last one).
    """

    def __init__(self, num_samples: int, num_replicas: int = 1, rank: int = 0, shuffle: bool = True,
                 seed: int = 0) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"sampler rank {rank} is outside [0, num_replicas={num_replicas})")
        # DistributedSampler's own __init__ would query torch.distributed; set its attributes ourselves.
        self.num_samples_total = num_samples
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.start = 0  # global samples of `self.epoch` already consumed

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start = 0  # a resume offset applies to the epoch it was saved in only
        self.epoch = epoch

    def resume(self, epoch: int, samples_consumed: int) -> None:
        self.epoch = epoch
        self.start = samples_consumed

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples_total)
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples_total, generator=gen)

    def __len__(self) -> int:
        return max(self.num_samples_total - self.start, 0) // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        positions = self.start + self.rank + self.num_replicas * torch.arange(len(self))
        return iter(order[positions].tolist())
