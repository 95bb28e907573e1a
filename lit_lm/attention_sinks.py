"""Attention sinks (gpt-oss): a learned logit s_h per query head that joins the head's softmax once, its
probability mass dropped, so a query may attend to "nothing":

    p_ts = exp(l_ts) / (sum_u exp(l_tu) + exp(s_h)),     out_t = sum_s p_ts v_s

over the keys s the query t may see (causal, window, document). With lse_t = log sum_u exp(l_tu), the output of
plain attention `o_t` gives the same result rescaled once per row:

    out_t = o_t * exp(lse_t) / (exp(lse_t) + exp(s_h)) = o_t * sigmoid(lse_t - s_h)

which is how a core that computes (o, lse) tile by tile (context parallelism's ring, all-gather and Ulysses)
adds the sink: after its tiles are merged, never per tile or per rank (each would count exp(s_h) once more):
`lit_lm.strategies.cp.join_sink`, with its backward. The one-process core here (`SinkAttention`) writes the
softmax out: SDPA returns no differentiable lse on CPU.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from lit_lm.kernels.logit_max import LogitMaxRecord, logit_max


def sink_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, mask: Tensor) -> Tensor:
    """softmax over [q k^T / sqrt(D) where `mask`, sink] with the sink's column dropped, times v.
    q (B, Hq, T, D), k and v (B, Hkv, S, D) (grouped-query: query head h uses kv head h // (Hq / Hkv)), sinks (Hq,),
    mask bool (T, S) or (B, 1, T, S), True where a query sees a key. Returns (B, Hq, T, D) in q's dtype, computed in
    fp32 at least."""
    b, hq, t, d = q.shape
    hkv, dtype = k.shape[1], torch.promote_types(q.dtype, torch.float32)
    q5 = q.to(dtype).view(b, hkv, hq // hkv, t, d)
    scores = q5 @ k.to(dtype).unsqueeze(2).transpose(-1, -2) / d ** 0.5  # (B, Hkv, G, T, S)
    mask = mask.view(mask.shape[0], 1, 1, t, -1) if mask.ndim == 4 else mask
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(dtype).view(1, hkv, hq // hkv, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return (probs @ v.to(dtype).unsqueeze(2)).reshape(b, hq, t, d).to(q.dtype)


def causal_mask(n_q: int, n_k: int, window: Optional[int], device: torch.device) -> Tensor:
    """(n_q, n_k) bool: the last n_q of n_k positions, each seeing itself and at most `window` - 1 before it."""
    q_pos = torch.arange(n_k - n_q, n_k, device=device)
    distance = q_pos[:, None] - torch.arange(n_k, device=device)[None, :]
    return (distance >= 0) & (distance < (window or n_k))


class SinkAttention(LogitMaxRecord, nn.Module):
    """The attention core of a model with sinks: `sinks` (n_heads,) is its parameter (under tensor parallelism each
    rank keeps its query heads' sinks). Same call as `lit_lm.model.CausalAttention`: (q, k, v[, documents]), and
    QK-clip's measurement (the sink is no logit of a key: not measured)."""

    def __init__(self, n_heads: int, sliding_window: Optional[int] = None) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        self.sinks = nn.Parameter(torch.zeros(n_heads))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, documents: Optional[Tensor] = None) -> Tensor:
        if self.measuring:
            self.record_logit_max(logit_max(q, k, self.sliding_window, documents))
        if documents is not None:
            from lit_lm.model import document_mask  # the model imports this module

            mask = document_mask(documents, self.sliding_window)
        else:
            mask = causal_mask(q.shape[2], k.shape[2], self.sliding_window, q.device)
        return sink_attention(q, k, v, self.sinks, mask)
