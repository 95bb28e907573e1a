"""Tokenizers behind one interface, `Tokenizer`: lit-lm's byte-level BPE (`bpe.py`, trained on the corpus) and any
`tokenizers` library `tokenizer.json` (`hf.py`: a Hugging Face model folder's). The data module, generation and the
export use only this interface; `load_tokenizer(dir)` reads either from a folder, `tokenizer_from_state` from a
checkpoint.

The pretraining format (chat-free): every document is `[BOS] + encode(text) + [EOS]`, concatenated into one stream
and cut into windows. EOS always ends a document (lit-lm's BPE: `<|endoftext|>`); BOS begins one only when the
tokenizer has one that its model expects before every sequence (Llama: `<s>`, `<|begin_of_text|>`; none for GPT-2,
Qwen2 or lit-lm's BPE). A prompt to generate from is encoded the same way, without the EOS.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Optional, Protocol, Sequence, Union

from lit_lm.config import ConfigError
from lit_lm.data.tokenizer import bpe, hf
from lit_lm.data.tokenizer.bpe import EOT, GPT2_PATTERN, BPETokenizer
from lit_lm.data.tokenizer.hf import HFTokenizer

__all__ = ["EOT", "GPT2_PATTERN", "BPETokenizer", "HFTokenizer", "Tokenizer", "TokenStream", "load_tokenizer",
           "tokenizer_from_state", "tokenizer_hash", "document_ids", "prompt_ids"]
FILE_NAME = "tokenizer.json"  # both kinds are saved under this name: `load_tokenizer` tells them apart by content


class TokenStream(Protocol):
    """Text of generated ids, one id at a time."""

    def step(self, token_id: int) -> str:
        """The text this id completes ("" while a character is still incomplete)."""

    def end(self) -> str:
        """Whatever is left when generation stops."""


class Tokenizer(Protocol):
    """What the data module, generation and the export need of a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Ids are 0..vocab_size-1: the model's vocabulary must be at least this (larger is padding)."""

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token -> id; their strings in a text encode to these ids."""

    @property
    def bos_id(self) -> Optional[int]:
        """The token before every document and prompt, or None."""

    @property
    def eos_id(self) -> Optional[int]:
        """The token after every document; generation stops at it."""

    def encode(self, text: str) -> list[int]:
        """Text -> ids, nothing added."""

    def encode_batch(self, texts: Sequence[str], num_workers: int = 1) -> list[list[int]]:
        """`encode` of many texts, in parallel."""

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text (special tokens written out)."""

    def stream(self, prompt_ids: Sequence[int] = ()) -> TokenStream:
        """A decoder for ids generated after `prompt_ids`."""

    def state_dict(self) -> dict[str, Any]:
        """Plain types that `tokenizer_from_state` turns back into this tokenizer (kept in every checkpoint)."""

    def save(self, directory: Union[str, os.PathLike]) -> Path:
        """Write `directory/tokenizer.json` (and what else `load_tokenizer` needs); returns the file."""

    def save_hf(self, directory: Union[str, os.PathLike], **config: Any) -> None:
        """Write `tokenizer.json` + `tokenizer_config.json` (plus `config`) as `transformers` loads them."""


def load_tokenizer(directory: Union[str, os.PathLike], field: str = "data.init_args.tokenizer_dir") -> Tokenizer:
    """The tokenizer saved in `directory` (or the `tokenizer.json` given itself): lit-lm's BPE when the file says
    `"format": "lit-lm-bpe"`, else a `tokenizers` library file (a Hugging Face model folder's)."""
    directory = Path(directory)
    if directory.name == FILE_NAME and directory.is_file():
        directory = directory.parent
    path = directory / FILE_NAME
    if not path.is_file():
        hint = (" (it has a sentencepiece tokenizer.model only: save it as tokenizer.json with transformers' "
                "AutoTokenizer.from_pretrained(dir).save_pretrained(dir))" if (directory / "tokenizer.model").is_file()
                else "")
        raise ConfigError(f"no tokenizer in {directory}: {path} does not exist{hint} ({field}); give a folder "
                          "holding lit-lm's BPE tokenizer.json or a Hugging Face tokenizer.json")
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not a JSON tokenizer file: {e} ({field})") from None
    try:
        if isinstance(content, dict) and content.get("format") == bpe.FORMAT:
            return BPETokenizer.from_state_dict(content, str(path))
        if isinstance(content, dict) and "model" in content:
            return HFTokenizer.load(directory)
    except ConfigError:
        raise
    except ValueError as e:  # ours: they name the file
        raise ConfigError(f"{e} ({field})") from None
    except Exception as e:  # the library's own parse errors are plain Exceptions
        raise ConfigError(f"{path} cannot be read: {str(e).splitlines()[0] if str(e) else type(e).__name__} "
                          f"({field})") from None
    raise ConfigError(f"{path} is neither lit-lm's BPE (\"format\": \"{bpe.FORMAT}\") nor a `tokenizers` library "
                      f"file (a \"model\" entry) ({field})")


def tokenizer_from_state(state: dict[str, Any], source: str = "the tokenizer state") -> Tokenizer:
    """The tokenizer of a `state_dict()` (as a checkpoint holds it)."""
    return HFTokenizer.from_state_dict(state, source) if state.get("format") == hf.FORMAT else \
        BPETokenizer.from_state_dict(state, source)


def tokenizer_hash(tokenizer: Tokenizer) -> str:
    """A digest of the tokenizer's content (its state, not its path): token files made with it carry it. The chat
    template is left out (it changes no id of a text; chat data keys its cache on it separately)."""
    state = {k: v for k, v in tokenizer.state_dict().items() if k != "chat"}
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


def document_ids(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """A document's ids in the training stream: `[BOS] + ids + [EOS]` (BOS only if the tokenizer has one)."""
    return ([] if tokenizer.bos_id is None else [tokenizer.bos_id]) + ids + [tokenizer.eos_id]


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """A prompt as a document begins: `[BOS] + encode(text)`; without a BOS, an empty prompt is `[EOS]` (what
    precedes every document in the stream)."""
    ids = tokenizer.encode(text)
    return [tokenizer.bos_id, *ids] if tokenizer.bos_id is not None else ids or [tokenizer.eos_id]
