"""The per-head maximum attention logit, QK-clip's statistic (Kimi K2's MuonClip, `lit_lm.callbacks.qk_clip`):

    S_max^h = max over the batch and the (query i, key j) pairs the mask allows of  q_i^h . k_j^h / sqrt(D)

from the q and k the attention core is given (after RoPE and qk-norm: exactly its logits). The cores compute
attention without materialising the (T x T) scores, so the maximum is recomputed here, under no_grad, only while
a core is told to measure (`LogitMaxRecord`): tile by tile, each tile M queries on N consecutive keys with query
row i sitting `offset` + i positions after key 0 (keys with 0 <= offset + i - j < window attend, as in
`lit_lm.strategies.cp.tile_mask`), so memory stays bounded whatever the sequence length.

Grouped-query attention: q (B, Hkv, G, M, D) holds the G query heads sharing each kv head; query head h = kv·G + g
(what SDPA's `enable_gqa` and the cp cores pair), so a (Hkv, G) result flattens to the Hq query heads in order.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

TILE_ELEMENTS = 1 << 22  # fp32 scores per tile of the contiguous case: 16 MiB, whatever T


@torch.no_grad()
def tile_logit_max(q: Tensor, k: Tensor, offset: int, window: int, same_document: Optional[Tensor] = None
                   ) -> Tensor:
    """max over batch, query rows and attended keys of q k^T / sqrt(D), per (kv head, query in group): q (B, Hkv,
    G, M, D), k (B, Hkv, N, D) -> (Hkv, G) fp32; -inf for a head no row of the tile attends with. `same_document`
    (B, M, N): the pairs of packed rows in one document (the others are masked too)."""
    b, hk, g, m, d = q.shape
    n = k.shape[-2]
    s = torch.matmul(q.reshape(b, hk, g * m, d).float(), k.float().transpose(-1, -2)).view(b, hk, g, m, n)
    distance = offset + torch.arange(m, device=q.device)[:, None] - torch.arange(n, device=q.device)[None, :]
    allowed = (distance >= 0) & (distance < window)
    if same_document is not None:
        allowed = allowed & same_document[:, None, None]
    s = s.masked_fill(~allowed, float("-inf"))
    return s.amax(dim=(0, 3, 4)) * d ** -0.5


@torch.no_grad()
def logit_max(q: Tensor, k: Tensor, window: Optional[int] = None, documents: Optional[Tensor] = None) -> Tensor:
    """Causal (optionally windowed) attention's S_max per query head for q (B, Hq, T, D), k (B, Hkv, T, D) at
    positions 0..T-1 -> (Hq,) fp32; with `documents` (B, T) (packed rows), within each document only. Queries in
    chunks of rows, each on the keys it may see: [p − window + 1, p + n)."""
    b, hq, t, d = q.shape
    hk = k.shape[1]
    q5 = q.view(b, hk, hq // hk, t, d)
    window = window or t
    rows = max(1, TILE_ELEMENTS // (b * hq * t))
    best = torch.full((hk, hq // hk), float("-inf"), device=q.device)
    for p in range(0, t, rows):
        n = min(rows, t - p)
        lo = max(0, p - window + 1)
        same = None if documents is None else documents[:, p:p + n, None] == documents[:, None, lo:p + n]
        tile = tile_logit_max(q5[..., p:p + n, :], k[..., lo:p + n, :], p - lo, window, same)
        torch.maximum(best, tile, out=best)
    return best.flatten()


class LogitMaxRecord:
    """Mixed into an attention core: while `measure_logits` is set (by `lit_lm.callbacks.qk_clip.QKClip`) and the
    module is training, its forward keeps the running per-head maximum in `logit_max` ((Hq,) fp32 on the device:
    the max over every forward since the reader last took it, micro-batches and activation recomputation included,
    which the max does not mind). No host sync: the maximum stays a tensor."""

    measure_logits: bool = False
    logit_max: Optional[Tensor] = None

    @property
    def measuring(self) -> bool:
        return self.measure_logits and getattr(self, "training", False)

    def record_logit_max(self, heads: Tensor) -> None:
        self.logit_max = heads if self.logit_max is None else torch.maximum(self.logit_max, heads)

    def take_logit_max(self) -> Optional[Tensor]:
        """The maximum since the last call (None: no training forward ran), and a fresh start."""
        value, self.logit_max = self.logit_max, None
        return value
