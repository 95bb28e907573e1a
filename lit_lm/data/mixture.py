"""Several prepared sources mixed by weight, as one dataset indexed by the global stream position.

Position p (the p-th sample the run consumes, counted over all ranks; `lit_lm.data.sampler.PositionSampler` hands rank r
of R positions start + r, start + r + R, ...) is a pure function of (seed, p):
- its source: positions come in blocks of `BLOCK` = 100; each block holds every source's share of the weights
  (largest remainders: source s gets round(w_s * 100) positions, within 0.5%), in an order shuffled by (seed, block);
- its window: the k-th position given to source s is window perm_e[k mod N_s] of that source's N_s windows, epoch
  e = k div N_s, perm_e shuffled by (seed, s, e); k counts s's positions in the blocks before p and in p's block.
So a batch never depends on the rank layout that came before: a run resumes at "global samples consumed" under any
world size, as the single stream does. Windows are T+1 tokens cut from each shard part separately (none spans two
shards), as `TokenWindows` cuts them from one array.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from lit_lm.data.loss_mask import START, encode_row, eos_flags

BLOCK = 100


def apportion(weights: Sequence[float], total: int = BLOCK) -> np.ndarray:
    """Integer counts summing to `total`, each within 1 of weight * total (largest remainders; ties: first)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    order = sorted(range(len(w)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - int(counts.sum())]:
        counts[i] += 1
    return counts


class ShardWindows(Dataset):
    """Non-overlapping windows of T+1 tokens over several arrays (shard parts): window i of part j is
    part[i*T : i*T + T + 1]; the parts' windows follow each other.

    With `flags` (one uint8 array per part, `lit_lm.data.loss_mask`: chat data) a window is served as its int64 row
    values carrying `train_on`'s loss mask and the conversations' starts; a part without flags (plain text mixed
    with chat) is read as every token a target, documents after each EOS (`eos_id`). `packed=False`: window i is
    conversation i alone, cut or padded (with `eos_id`, never a target) to T+1 tokens."""

    def __init__(self, parts: Sequence[np.ndarray], seq_len: int,
                 flags: Optional[Sequence[Optional[np.ndarray]]] = None, train_on: str = "assistant",
                 packed: bool = True, eos_id: int = 0) -> None:
        self.parts = list(parts)
        self.seq_len = seq_len
        self.flags = None if flags is None else list(flags)
        self.train_on, self.packed, self.eos_id = train_on, packed, eos_id
        if packed:
            counts = [max((len(p) - 1) // seq_len, 0) for p in self.parts]
        else:  # one conversation per window: where each begins
            self.starts = [np.flatnonzero(self._flags(j) & START) for j in range(len(self.parts))]
            counts = [len(s) for s in self.starts]
        self.ends = np.cumsum(counts)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    @property
    def n_tokens(self) -> int:
        return int(sum(len(p) for p in self.parts))

    def _flags(self, j: int, a: int = 0, b: Optional[int] = None) -> np.ndarray:
        flags = self.flags[j] if self.flags is not None else None
        if flags is None:
            return eos_flags(np.asarray(self.parts[j][a:b]), self.eos_id)
        return np.asarray(flags[a:b])

    def __getitem__(self, i: int) -> torch.Tensor:
        j = int(np.searchsorted(self.ends, i, side="right"))
        local = i - (int(self.ends[j - 1]) if j else 0)
        if not self.packed:
            starts = self.starts[j]
            a = int(starts[local])
            b = min(int(starts[local + 1]) if local + 1 < len(starts) else len(self.parts[j]), a + self.seq_len + 1)
            return encode_row(np.asarray(self.parts[j][a:b]), self._flags(j, a, b), self.train_on,
                              self.seq_len + 1, self.eos_id)
        start = local * self.seq_len
        ids = self.parts[j][start: start + self.seq_len + 1]
        if self.flags is None:
            return torch.from_numpy(ids.astype(np.int64))
        return encode_row(np.asarray(ids), self._flags(j, start, start + self.seq_len + 1), self.train_on)


class MixtureWindows(Dataset):
    """`sources` (their train windows) mixed by `weights`: item p is the sample at global stream position p (see
    the module doc); any p >= 0 is valid. `len` is the sources' windows together (one nominal epoch)."""

    def __init__(self, sources: Sequence[ShardWindows], weights: Sequence[float], seed: int) -> None:
        self.sources = list(sources)
        self.counts = apportion(weights)
        self.pattern = np.repeat(np.arange(len(self.sources)), self.counts)
        self.seed = seed
        self._block: tuple[int, np.ndarray] = (-1, self.pattern)
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def __len__(self) -> int:
        return sum(len(s) for s in self.sources)

    def _block_order(self, block: int) -> np.ndarray:
        if self._block[0] != block:
            rng = np.random.default_rng([self.seed, block])
            self._block = (block, rng.permutation(self.pattern))
        return self._block[1]

    def locate(self, p: int) -> tuple[int, int]:
        """(source, window in that source) of global position p."""
        block, j = divmod(int(p), BLOCK)
        order = self._block_order(block)
        s = int(order[j])
        k = block * int(self.counts[s]) + int(np.count_nonzero(order[:j] == s))
        n = len(self.sources[s])
        epoch, i = divmod(k, n)
        key = (s, epoch)
        if key not in self._perms:
            if len(self._perms) > 2 * len(self.sources):
                self._perms.clear()
            self._perms[key] = np.random.default_rng([self.seed, s, epoch]).permutation(n)
        return s, int(self._perms[key][i])

    def __getitem__(self, p: int) -> torch.Tensor:
        s, w = self.locate(p)
        return self.sources[s][w]
