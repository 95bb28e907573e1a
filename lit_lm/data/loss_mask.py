"""Loss masks: which tokens of a row are trained on, and where its conversations begin, carried in the row itself.

On disk (beside the tokens: the data cache's `flags.bin`, a prepared shard's `NNNNN.flags`) one uint8 per token:

    ASSISTANT = 1    an assistant wrote it (a message's content and the template's end of turn; a completion + EOS)
    LAST      = 2    it is in the conversation's last assistant message
    START     = 4    the first token of a conversation (its document boundary: an EOS may sit inside a conversation,
                     e.g. Qwen's `<|im_end|>` or Llama 3's `<|eot_id|>` end every turn, so EOS cannot mark it)

A row served to training is (T+1) int64 values, each `id | NOT_TARGET·[not trained on] | DOC_START·[starts a
conversation]` (bits 32 and 33; ids are below 2^32). `train_on` is applied when the row is read:

    all         every token is a target          assistant   ASSISTANT tokens only (default)
    last        LAST tokens only                 padding (one conversation per row, `packed: false`): never

So a row stays one tensor: samplers, mixtures, resumes and every strategy's split of the batch carry its mask and
boundaries with it. `decode` turns a (B, T+1) batch into the inputs (B, T), the targets (B, T) with -100 where token
t+1 is not a target (the losses' ignore index: `LMLoss`, the vocab-parallel loss, the fused kernel), and the
conversation starts of the inputs (B, T), all on the batch's device without a host read.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

from lit_lm.config import ConfigError

ASSISTANT, LAST, START = 1, 2, 4
NOT_TARGET, DOC_START = 1 << 32, 1 << 33
ID_BITS = (1 << 32) - 1
IGNORE = -100
TRAIN_ON = ("all", "assistant", "last")


def check_train_on(train_on: str, where: str = "data.init_args.train_on") -> str:
    if train_on not in TRAIN_ON:
        raise ConfigError(f"{where} must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
    return train_on


def eos_flags(ids: np.ndarray, eos_id: int) -> np.ndarray:
    """Flags of plain text (a pre-training source mixed with chat ones): every token trained on, a document starting
    after each EOS and at the array's start."""
    flags = np.full(len(ids), ASSISTANT | LAST, np.uint8)
    if len(ids):
        flags[0] |= START
        flags[1:][ids[:-1] == eos_id] |= START
    return flags


def encode_row(ids: np.ndarray, flags: np.ndarray, train_on: str, pad_to: Optional[int] = None,
               pad_id: int = 0) -> torch.Tensor:
    """A row's int64 values (see the module doc); `pad_to`: truncated or padded with `pad_id` (never a target)."""
    row = ids.astype(np.int64)
    trained = np.ones(len(row), bool) if train_on == "all" else \
        (flags & (ASSISTANT if train_on == "assistant" else LAST)) != 0
    row |= np.where(trained, 0, NOT_TARGET) | np.where(flags & START, DOC_START, 0)
    if pad_to is not None:
        row = np.concatenate([row[:pad_to], np.full(max(pad_to - len(row), 0), pad_id | NOT_TARGET, np.int64)])
    return torch.from_numpy(row)


def decode(batch: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(inputs, targets with -100 where not trained on, conversation starts of the inputs) of a (B, T+1) batch."""
    ids = batch & ID_BITS
    targets = torch.where((batch[:, 1:] & NOT_TARGET) != 0, IGNORE, ids[:, 1:])
    return ids[:, :-1], targets, (batch[:, :-1] & DOC_START) != 0


def targets_of(rows: Tensor) -> int:
    """How many targets (B, T+1) rows hold (host rows: the data module counts a step's global batch)."""
    return int(((rows[..., 1:] & NOT_TARGET) == 0).sum())

