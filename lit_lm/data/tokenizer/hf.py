"""A `tokenizer.json` of the `tokenizers` library (any Hugging Face model folder's: Llama, Mistral, Qwen2, GPT-2, ...)
as lit-lm's `Tokenizer`.

The library does the encoding (its batch encode runs on its own thread pool: `RAYON_NUM_THREADS` caps it) and the
decoding; this wrapper adds what lit-lm needs from the folder around it: which token begins a document (BOS) and
which ends it (EOS). They are read, in order of precedence, from
- BOS: `tokenizer_config.json`'s `add_bos_token` (true: its `bos_token`; false: none) when it says, else the one
  special token the `tokenizer.json`'s post-processor puts before a sequence (Llama's `<s>`, `<|begin_of_text|>`),
  else none (GPT-2, Qwen2);
- EOS: `tokenizer_config.json`'s `eos_token`, else `special_tokens_map.json`'s, else the first of the usual names
  (`<|endoftext|>`, `</s>`, `<|end_of_text|>`, `<eos>`) among the special tokens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from tokenizers import Tokenizer as _LibraryTokenizer
from tokenizers.decoders import DecodeStream

FILE_NAME = "tokenizer.json"
CONFIG_NAME = "tokenizer_config.json"
FORMAT = "hf-tokenizers"
VERSION = 1
USUAL_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


def _token_text(value: Any) -> Optional[str]:
    """A special token as transformers writes it: a string, or an AddedToken dict with its `content`."""
    return value.get("content") if isinstance(value, dict) else value


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the document's BOS and EOS tokens (`None` where it has none)."""

    def __init__(self, tokenizer: _LibraryTokenizer, bos_token: Optional[str], eos_token: Optional[str],
                 source: str = "the tokenizer", chat: Optional[dict[str, Any]] = None) -> None:
        self._tok = tokenizer
        self._source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.chat = chat  # the folder's chat template and the special tokens it reads (lit_lm.data.chat), or None
        for role, token in (("BOS", bos_token), ("EOS", eos_token)):
            if token is not None and tokenizer.token_to_id(token) is None:
                raise ValueError(f"{source}: its {role} token {token!r} is not in its vocabulary")
        self._vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    # ---- loading ----

    @classmethod
    def load(cls, directory: str | os.PathLike) -> HFTokenizer:
        """The `tokenizer.json` of `directory`, with BOS and EOS from the files beside it (see the module doc)."""
        directory = Path(directory)
        path = directory / FILE_NAME
        tokenizer = _LibraryTokenizer.from_file(str(path))
        config = _read_json(directory / CONFIG_NAME)
        specials_map = _read_json(directory / "special_tokens_map.json")
        if "add_bos_token" in config:
            bos = _token_text(config.get("bos_token") or specials_map.get("bos_token")) if config["add_bos_token"] \
                else None
        else:
            bos = _post_processor_bos(tokenizer, str(path))
        eos = _token_text(config.get("eos_token") or specials_map.get("eos_token"))
        if eos is None:
            specials = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
            eos = next((t for t in USUAL_EOS if t in specials), None)
        from lit_lm.data.chat import read_chat_template

        return cls(tokenizer, bos, eos, str(path), read_chat_template(directory))

    # ---- the Tokenizer interface ----

    @property
    def vocab_size(self) -> int:
        """One more than the largest id (an embedding needs that many rows)."""
        return self._vocab_size

    @property
    def special_tokens(self) -> dict[str, int]:
        return {t.content: i for i, t in sorted(self._tok.get_added_tokens_decoder().items()) if t.special}

    @property
    def bos_id(self) -> Optional[int]:
        return None if self.bos_token is None else self._tok.token_to_id(self.bos_token)

    @property
    def eos_id(self) -> Optional[int]:
        return None if self.eos_token is None else self._tok.token_to_id(self.eos_token)

    def encode(self, text: str) -> list[int]:
        """Text -> ids, without the post-processor's additions (lit-lm adds BOS/EOS around documents itself)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], num_workers: int = 1) -> list[list[int]]:
        """`encode` of each text, on the library's thread pool (`num_workers` is for lit-lm's BPE processes)."""
        return [e.ids for e in self._tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        ids = list(ids)
        bad = next((i for i in ids if not 0 <= i < self._vocab_size or self._tok.id_to_token(i) is None), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is not in this tokenizer (vocab_size={self._vocab_size}): were the ids "
                             "made by another tokenizer?")
        return self._tok.decode(ids, skip_special_tokens=False)

    def stream(self, prompt_ids: Sequence[int] = ()) -> "TextStream":
        """A decoder for ids generated one at a time after `prompt_ids` (whose text is not repeated)."""
        return TextStream(self._tok, prompt_ids)

    def state_dict(self) -> dict[str, Any]:
        """Everything `from_state_dict` needs, as plain types (kept inside every checkpoint)."""
        state = {"format": FORMAT, "version": VERSION, "tokenizer_json": self._tok.to_str(),
                 "bos_token": self.bos_token, "eos_token": self.eos_token}
        return state if self.chat is None else {**state, "chat": self.chat}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], source: str = "the tokenizer state") -> HFTokenizer:
        if state.get("format") != FORMAT or state.get("version") != VERSION:
            raise ValueError(f"{source} is not a {FORMAT} v{VERSION} state (format={state.get('format')!r}, "
                             f"version={state.get('version')!r})")
        return cls(_LibraryTokenizer.from_str(state["tokenizer_json"]), state["bos_token"], state["eos_token"],
                   source, state.get("chat"))

    def save(self, directory: str | os.PathLike) -> Path:
        """`tokenizer.json` and a `tokenizer_config.json` naming BOS and EOS: `load` reads the same tokenizer back,
        and `transformers.AutoTokenizer` loads the folder."""
        self.save_hf(directory)
        return Path(directory) / FILE_NAME

    def save_hf(self, directory: str | os.PathLike, **config: Any) -> None:
        """As `save`, with more `tokenizer_config.json` entries (e.g. model_max_length)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / FILE_NAME).write_text(self._tok.to_str(pretty=False), encoding="utf-8")
        (directory / CONFIG_NAME).write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos_token, "eos_token": self.eos_token,
            "add_bos_token": self.bos_token is not None, **self._chat_config(), **config}, indent=1), encoding="utf-8")

    def _chat_config(self) -> dict[str, Any]:
        """The chat template and the special tokens it reads, as tokenizer_config.json holds them."""
        if self.chat is None:
            return {}
        return {**self.chat["tokens"], "chat_template": self.chat["template"]}


class TextStream:
    """The library's streaming decoder: text as soon as the ids so far make whole characters; `end` gives what it
    still holds back (an incomplete character as U+FFFD, as `decode` writes it)."""

    def __init__(self, tokenizer: _LibraryTokenizer, prompt_ids: Sequence[int]) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids)
        self._stream = DecodeStream(skip_special_tokens=False)
        for token_id in self._ids:  # the context the first new token's text depends on (e.g. a leading space)
            self._stream.step(tokenizer, token_id)
        self._written = len(tokenizer.decode(self._ids, skip_special_tokens=False))

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._stream.step(self._tok, token_id) or ""
        self._written += len(text)
        return text

    def end(self) -> str:
        return self._tok.decode(self._ids, skip_special_tokens=False)[self._written:]


def _post_processor_bos(tokenizer: _LibraryTokenizer, source: str) -> Optional[str]:
    """The special token the post-processor puts before a single sequence, if any (Llama's template "<s> $A")."""
    encoding = tokenizer.encode("x", add_special_tokens=True)
    prefix = encoding.ids[:encoding.sequence_ids.index(0)] if 0 in encoding.sequence_ids else []
    if len(prefix) > 1:
        raise ValueError(f"{source}: its post-processor puts {len(prefix)} tokens before a sequence "
                         f"({[tokenizer.id_to_token(i) for i in prefix]}); lit-lm's documents begin with one BOS at "
                         "most: set add_bos_token (and bos_token) in tokenizer_config.json beside it")
    return tokenizer.id_to_token(prefix[0]) if prefix else None
