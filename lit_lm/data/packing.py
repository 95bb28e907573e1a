"""Packed documents: where a training row's documents begin and end, read from the row itself.

Every document enters the token stream as `[BOS] + text + [EOS]` (`lit_lm.data.tokenizer.document_ids`), and rows are
plain (T+1)-token windows of that stream (token files, prepared shards, mixtures, streams), so a row's document
boundaries are its EOS tokens: nothing else is stored, and whatever serves rows (samplers, mixtures, a stream, a
resume under another world size) serves their boundaries with them. For the T inputs of a row,

    documents[t] = #{s < t : inputs[s] = EOS}      (a document's EOS is its last token; the next one starts after it)
    positions[t] = t - (first t' with documents[t'] = documents[t])      (`position_reset`: RoPE restarts at 0)

A row that starts inside a document gives that tail document id 0 (a segment of its own, positions from 0). The
targets are not touched: an EOS still predicts the next document's first token (its BOS, when there is one).
Both tensors are (B, T) int64 on the rows' device, made there without a host read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


def document_ids(inputs: Tensor, eos_id: int) -> Tensor:
    """(B, T) document index of each input token: the number of EOS tokens strictly before it in its row."""
    ends = (inputs == eos_id).long()
    return ends.cumsum(-1) - ends


def document_positions(documents: Tensor) -> Tensor:
    """(B, T) each token's offset from the first token of its document (`documents` non-decreasing along T)."""
    t = torch.arange(documents.shape[-1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    first = torch.where(starts, t, torch.zeros_like(t)).cummax(-1).values
    return t - first


def documents_from_starts(starts: Tensor) -> Tensor:
    """(B, T) document ids from explicit starts (chat rows: `lit_lm.data.loss_mask`, where an EOS may end a turn
    inside a conversation): the number of starts at or before each token (a row's leading tail gets id 0)."""
    return starts.long().cumsum(-1)


@dataclass(frozen=True)
class Packing:
    """How a run reads its rows' documents (`TextDataModule.packing()`): the EOS id that ends every document, and
    whether RoPE positions restart at each document."""

    eos_id: int
    position_reset: bool = False
    starts: bool = False  # the rows carry their documents' first tokens (chat data: lit_lm.data.loss_mask)

    def rows(self, inputs: Tensor, starts: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
        """(documents, positions or None) of (B, T) input rows: from their EOS tokens, or from `starts` (B, T) bool
        where the rows carry their documents' first tokens."""
        documents = document_ids(inputs, self.eos_id) if starts is None else documents_from_starts(starts)
        return documents, document_positions(documents) if self.position_reset else None
