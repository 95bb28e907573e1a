"""Multi-token prediction (DeepSeek-V3 section 2.2): `ModelConfig.mtp_layers` extra modules, an optional loss.

Module k (1..D) predicts token t_{i+k+1} at position i from the previous depth's hidden state and the embedding
of token t_{i+k}, through one more Transformer block, the model's own embedding and head (shared):

    h^0 = the main model's last hidden state (before its final norm), positions 0..T-1
    h'  = eh_proj([enorm(emb(t_{i+k})); hnorm(h^{k-1}_i)])          i < T - k
    h^k = block_k(h'),   logits^k = lm_head(norm_k(h^k)),   CE_k against t_{i+k+1}
    loss_MTP = mtp_weight / D * sum_k CE_k                          (added to the main loss)

With inputs idx (T) and targets = idx shifted by one, t_{i+k} = idx[i + k] and t_{i+k+1} = targets[i + k].
The modules run in `Transformer.loss` only: `forward` (logits, generation) never calls them. The embedding order
of the concatenation and the names (enorm, hnorm, eh_proj) are DeepSeek's checkpoint's (vLLM's deepseek_mtp).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from lit_lm.config import ModelConfig


class MTPModule(nn.Module):
    """One prediction depth: the norms, the 2d -> d projection, a block (block index `layer` decides dense or
    MoE, as DeepSeek's layer 61) and its final norm."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        from lit_lm.model import Block, RMSNorm  # model.py builds this class

        self.enorm, self.hnorm = RMSNorm(cfg.d_model, cfg.norm_eps), RMSNorm(cfg.d_model, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.block = Block(cfg, layer)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, h: Tensor, emb: Tensor, positions: Optional[Tensor] = None,
                documents: Optional[Tensor] = None) -> Tensor:
        x = self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(h)), dim=-1))
        return self.block(x, positions, documents=documents)


def _first(t: Optional[Tensor], n: int) -> Optional[Tensor]:
    """The first n positions of `positions` ((T,) or (B, T)) or `documents` (B, T)."""
    return None if t is None else t[..., :n]


def mtp_loss(model: nn.Module, h: Tensor, idx: Tensor, targets: Tensor, positions: Optional[Tensor] = None,
             documents: Optional[Tensor] = None) -> Tensor:
    """mtp_weight / D * sum_k CE_k over `model.mtp`'s D modules (module docstring); `h` the main hidden state."""
    modules = list(model.mtp.values())
    total = h.new_zeros((), dtype=torch.float32)
    for k, module in enumerate(modules, start=1):
        n = idx.shape[1] - k
        h = module(h[:, :n], model.tok_embeddings(idx[:, k:]), _first(positions, n), _first(documents, n))
        loss, _ = model.loss_fn(model.lm_head(module.norm(h)), targets[:, k:])
        total = total + loss
    return model.config.mtp_weight / len(modules) * total
