"""Chat data: conversations rendered with the tokenizer's own chat template, each token flagged by who wrote it.

A row is `{"messages": [{"role": ..., "content": ...}, ...]}` (rendered by the template) or `{"prompt": ...,
"completion": ...}` (no template: `[BOS] + encode(prompt) + encode(completion) + [EOS]`, as a document is). The
template is the `chat_template` of the tokenizer folder's `tokenizer_config.json` (or its `chat_template.jinja`),
rendered as transformers' `apply_chat_template` renders it (its jinja2 sandbox, `trim_blocks`/`lstrip_blocks`, loop
controls, its `tojson`, `raise_exception`, `strftime_now` and `namespace`, the special tokens as variables) and
encoded whole without added specials, so the ids equal `apply_chat_template(messages, tokenize=True)`'s
(tests/test_chat.py checks it token for token against transformers).

Which tokens an assistant wrote: assistant message i spans the characters from the end of the rendering of
messages[:i] with the generation prompt to the end of the rendering of messages[:i+1] (its content and the
template's end-of-turn, e.g. `<|im_end|>`: the model learns to stop), mapped to tokens by the longest common prefix
of the whole encoding with the encoding of the text before the cut. The flags (one uint8 per token, stored beside
the tokens: `lit_lm.data.loss_mask`) say ASSISTANT, LAST (the last assistant message) and START (a conversation's
first token); which of them are trained on (`train_on: all | assistant | last`) is chosen when rows are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import numpy as np

from lit_lm.config import ConfigError
from lit_lm.data.loss_mask import ASSISTANT, LAST, START
from lit_lm.data.tokenizer import Tokenizer

TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_chat_template(directory: str | Path) -> Optional[dict[str, Any]]:
    """{"template": str, "tokens": {bos_token: ..., ...}} of a tokenizer folder, or None without a template: the
    `chat_template` of tokenizer_config.json (a string, or a list of {name, template}: the "default" one), else the
    folder's chat_template.jinja (where transformers >= 4.43 saves it)."""
    directory = Path(directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if not template:
        return None
    tokens = {}
    for name in TEMPLATE_TOKENS:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if value is not None:
            tokens[name] = value
    return {"template": template, "tokens": tokens}


def _environment() -> Any:
    """The jinja2 environment transformers renders chat templates in (`_compile_jinja_template`)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = jinja2.utils.Namespace
    return env


@dataclass
class ChatTemplate:
    """A tokenizer's chat template (`read_chat_template`'s dict), compiled once."""

    template: str
    tokens: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._compiled = _environment().from_string(self.template)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        return self._compiled.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.tokens)


def chat_template_of(tokenizer: Tokenizer, where: str) -> ChatTemplate:
    """The tokenizer's template, or a one-line refusal naming the fix."""
    chat = getattr(tokenizer, "chat", None)
    if not chat:
        raise ConfigError(f"the tokenizer ({where}) has no chat_template in its tokenizer_config.json, so `messages` "
                          "cannot be rendered; use the instruct model's tokenizer folder (one with a chat_template), "
                          "or give rows of prompt/completion")
    return ChatTemplate(chat["template"], dict(chat.get("tokens", {})))


def chat_prompt_ids(tokenizer: Tokenizer, message: str, where: str = "--chat") -> list[int]:
    """A user message as a chat prompt (`lit-lm generate --chat`): the template's rendering of it with the
    assistant's generation prompt, encoded as in training."""
    return tokenizer.encode(chat_template_of(tokenizer, where).render([{"role": "user", "content": message}],
                                                                      add_generation_prompt=True))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def encode_messages(tokenizer: Tokenizer, template: ChatTemplate, messages: list[dict[str, Any]]
                    ) -> tuple[list[int], np.ndarray]:
    """(ids, flags) of one conversation (see the module doc)."""
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    text = template.render(messages)
    ids = tokenizer.encode(text)
    flags = np.zeros(len(ids), np.uint8)
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    for i in turns:
        start_text = template.render(messages[:i], add_generation_prompt=True)
        end_text = template.render(messages[: i + 1])
        if not (text.startswith(end_text) and end_text.startswith(start_text)):
            raise ConfigError("the chat template does not render a conversation as the renderings of its beginnings "
                              "(it rewrites earlier turns), so the assistant's tokens cannot be found; use "
                              "train_on: all or another template")
        a = _common_prefix(ids, tokenizer.encode(start_text)) if start_text else 0
        b = _common_prefix(ids, tokenizer.encode(end_text))
        flags[a:b] |= ASSISTANT | (LAST if i == turns[-1] else 0)
    if len(ids):
        flags[0] |= START
    return ids, flags


def encode_pair(tokenizer: Tokenizer, prompt: str, completion: str) -> tuple[list[int], np.ndarray]:
    """(ids, flags) of a prompt/completion row: `[BOS] prompt completion [EOS]`, the completion and EOS assistant's."""
    head = ([] if tokenizer.bos_id is None else [tokenizer.bos_id]) + tokenizer.encode(prompt)
    tail = tokenizer.encode(completion) + [tokenizer.eos_id]
    flags = np.zeros(len(head) + len(tail), np.uint8)
    flags[len(head):] = ASSISTANT | LAST
    flags[0] |= START
    return head + tail, flags


class ChatEncoder:
    """Rows -> (ids, flags), refusing rows that are neither a conversation nor a prompt/completion pair."""

    def __init__(self, tokenizer: Tokenizer, where: str) -> None:
        self.tokenizer, self.where = tokenizer, where
        self._template: Optional[ChatTemplate] = None

    def encode(self, row: dict[str, Any]) -> tuple[list[int], np.ndarray]:
        if row.get("messages") is not None:
            if self._template is None:
                self._template = chat_template_of(self.tokenizer, self.where)
            messages = row["messages"]
            if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
                raise ConfigError(f"a row of {self.where} has `messages` that are not a list of {{role, content}}")
            return encode_messages(self.tokenizer, self._template, messages)
        if row.get("prompt") is not None and row.get("completion") is not None:
            if self.tokenizer.eos_id is None:
                raise ConfigError(f"prompt/completion rows of {self.where} end with the tokenizer's EOS token (the "
                                  "last target, and where packed conversations part), but the tokenizer has none: "
                                  "use one whose tokenizer_config.json names an eos_token")
            return encode_pair(self.tokenizer, str(row["prompt"]), str(row["completion"]))
        raise ConfigError(f"a row of {self.where} has neither `messages` nor `prompt` and `completion` (keys "
                          f"{sorted(row)[:6]}); chat data is rows of messages or prompt/completion pairs")

    def encode_rows(self, rows: Iterable[dict[str, Any]]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for row in rows:
            ids, flags = self.encode(row)
            if len(ids):
                yield np.asarray(ids, np.int64), flags


def read_rows(files: list[str], seed: int, where: str = "data.init_args.files") -> list[dict[str, Any]]:
    """Every row of jsonl/parquet files or a save_to_disk folder, in an order shuffled by `seed`."""
    import random

    import datasets

    from lit_lm.data.corpus import builder_for

    datasets.disable_progress_bars()
    paths = [Path(f) for f in files]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise ConfigError(f"{where}: {missing[:3]} do not exist; fix the paths")
    if len(paths) == 1 and paths[0].is_dir():
        ds = datasets.load_from_disk(str(paths[0]))
        ds = ds["train"] if isinstance(ds, datasets.DatasetDict) else ds
    else:
        kinds = {builder_for(p) for p in paths}
        if kinds - {"json", "parquet"} or len(kinds) > 1:
            raise ConfigError(f"{where}: chat data is .jsonl or .parquet files (one kind), got {sorted(kinds)}")
        ds = datasets.load_dataset(kinds.pop(), data_files=[str(p) for p in paths], split="train")
    rows = ds.to_list()
    random.Random(seed).shuffle(rows)
    return rows
