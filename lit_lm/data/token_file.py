"""Documents -> ids -> a token file on disk, a batch of text at a time: what the data module's cache and
`lit-lm prepare`'s shards are written with. Memory holds one batch's text and ids, whatever the corpus's size.

A document in the file is `[BOS] + encode(text) + [EOS]` (`lit_lm.data.tokenizer.document_ids`); its pieces
(`lit_lm.data.corpus`) are encoded separately and joined. Ids are uint16 where the vocabulary fits, else uint32.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple, Optional, Union

import numpy as np

from lit_lm.data.tokenizer import BPETokenizer, Tokenizer
from lit_lm.data.tokenizer.bpe import PARALLEL_CHARS

BATCH_CHARS = 4 << 20  # text per encode_batch call (a `tokenizers` one spreads it over its threads)


class DocumentPart(NamedTuple):
    """Pieces of a document that a token file holds only part of (`lit-lm prepare` cuts a long text file into
    chunks): BOS only where it `begins` the document, EOS only where it `ends` it."""
    pieces: Iterable[str]
    begins: bool
    ends: bool


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def batch_chars(tokenizer: Tokenizer, workers: int) -> int:
    """lit-lm's BPE encodes in processes only from PARALLEL_CHARS of text on: give it batches that large."""
    return PARALLEL_CHARS if isinstance(tokenizer, BPETokenizer) and workers > 1 else BATCH_CHARS


def encode_documents(tokenizer: Tokenizer, documents: Iterable[Union[Iterable[str], DocumentPart]], workers: int = 1,
                     chars: Optional[int] = None) -> Iterator[tuple[np.ndarray, int, int]]:
    """(ids, documents ended, characters) per batch of about `chars` characters (BATCH_CHARS), in order: the
    concatenation of the ids is every document's `[BOS] + ids + [EOS]` (a `DocumentPart`: only its own ends)."""
    chars = chars or BATCH_CHARS
    dtype = token_dtype(tokenizer.vocab_size)
    bos = np.array([] if tokenizer.bos_id is None else [tokenizer.bos_id], dtype)
    eos = np.array([tokenizer.eos_id], dtype)
    pieces: list[str] = []
    marks: list[tuple[bool, bool]] = []  # (begins a document, ends one) per piece
    size = 0

    def flush() -> tuple[np.ndarray, int, int]:
        parts = []
        for (begins, ends), ids in zip(marks, tokenizer.encode_batch(pieces, workers)):
            parts += [bos] if begins else []
            parts.append(np.asarray(ids, dtype))
            parts += [eos] if ends else []
        return np.concatenate(parts), sum(ends for _, ends in marks), size

    for document in documents:
        part = document if isinstance(document, DocumentPart) else DocumentPart(document, True, True)
        piece = next(iter_ := iter(part.pieces), None)
        begins = part.begins
        while piece is not None:
            following = next(iter_, None)
            pieces.append(piece)
            marks.append((begins, following is None and part.ends))
            size += len(piece)
            begins, piece = False, following
            if size >= chars:
                yield flush()
                pieces, marks, size = [], [], 0
    if pieces:
        yield flush()


class TokenFile:
    """Ids appended to `path` (written as `path.tmp`, renamed on `close`: a file at `path` is always complete)."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._file = open(self._tmp, "wb")
        self.n_tokens = 0
        self.max_id = -1

    def append(self, ids: np.ndarray) -> None:
        if len(ids):
            ids.astype(self.dtype, copy=False).tofile(self._file)
            self.n_tokens += len(ids)
            self.max_id = max(self.max_id, int(ids.max()))

    def close(self) -> None:
        self._file.close()
        os.replace(self._tmp, self.path)

    def discard(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)
