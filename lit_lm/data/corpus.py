"""A corpus read as a stream: its documents, each as pieces of at most about `PIECE_CHARS` characters, never the
whole text (or its ids) in memory at once.

Formats: text files (each file is one document, read in blocks), `.jsonl`/`.json` and `.parquet` files, or one
directory written by `datasets.Dataset.save_to_disk` (one document per row's `text_field`; read through `datasets`,
which keeps the rows in a memory-mapped Arrow file). Documents come in a fixed shuffled order (seeded), so the tail
held out for validation is a random sample of them.

A long document is cut into pieces only before a newline that follows a letter or a digit (`SAFE_CUT`): there every
GPT-2-style pre-tokenizer (lit-lm's BPE, GPT-2, Llama 3, Qwen2) ends a pre-token whatever comes after, so encoding
the pieces one by one gives exactly the ids of the whole document. (A sentencepiece-style tokenizer that prepends
"▁" to its input, as Llama 2's and Mistral's, adds that token at each cut; only documents over `PIECE_CHARS` are cut.)
"""

from __future__ import annotations

import codecs
import random
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import regex

from lit_lm.config import ConfigError

PIECE_CHARS = 1 << 20  # a document longer than this is encoded in pieces (safe cuts only)
SAFE_CUT = regex.compile(r"(?<=[\p{L}\p{N}])\n", regex.REVERSE)  # the last safe cut in a span
_NEXT_SAFE_CUT = regex.compile(r"(?<=[\p{L}\p{N}])\n")
TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".text", ""}
JSON_SUFFIXES = {".json", ".jsonl"}


def builder_for(path: Path) -> str:
    """The `datasets` builder that reads a file: json, parquet or text."""
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        return "json"
    if suffix == ".parquet":
        return "parquet"
    return "text"


def check_utf8(path: Path, field: str = "data.init_args.files") -> None:
    """Refuse a file that is not UTF-8 text (a binary file in the list), naming it and the first bad byte."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            pending = len(decoder.getstate()[0])  # bytes of a character cut by the previous chunk
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path} is not UTF-8 text: byte {offset - pending + e.start} is "
                                  f"0x{e.object[e.start]:02x} ({field}); remove binary files from "
                                  "the list or convert the file to UTF-8") from None
            if not chunk:
                return
            offset += len(chunk)


def split_text(text: str, size: Optional[int] = None) -> Iterator[str]:
    """`text` in pieces of about `size` characters (default PIECE_CHARS), cut at safe places only (a piece is longer
    where the text has none; size -1: uncut); the pieces join to `text`."""
    size = size or PIECE_CHARS
    if size < 0:
        yield text
        return
    start = 0
    while len(text) - start > size:
        m = SAFE_CUT.search(text, start + 1, start + size)
        if m is None:
            m = _NEXT_SAFE_CUT.search(text, start + size)
            if m is None:
                break
        yield text[start:m.start()]
        start = m.start()
    yield text[start:]


def read_pieces(path: Path, size: Optional[int] = None) -> Iterator[str]:
    """A text file's content in pieces (as `split_text`), read a block at a time."""
    size = size or PIECE_CHARS
    with open(path, encoding="utf-8") as f:
        if size < 0:
            yield f.read()
            return
        rest = ""
        while block := f.read(size):
            text = rest + block
            m = SAFE_CUT.search(text, 1)
            cut = m.start() if m else 0
            if cut:
                yield text[:cut]
            rest = text[cut:]
        if rest:
            yield rest


def log(msg: str) -> None:
    from lightning.pytorch.utilities import rank_zero_info

    rank_zero_info(f"[lit-lm data] {msg}")


def cuttable(special_tokens: Iterable[str]) -> bool:
    """Whether a cut before a newline can never fall inside one of these tokens' strings."""
    return not any("\n" in t for t in special_tokens)


class Corpus:
    """The documents of `files` (see the module doc), checked when made: missing files, mixed formats, text that is
    not UTF-8, an unknown `text_field`, rows without text (refused unless `skip_missing_text`), no text at all.

    `documents()` yields each document as an iterator of its pieces, in a shuffled order fixed by `seed`;
    `texts()` yields all pieces in that order; `chars` is the corpus's size in characters (bytes for text files)."""

    def __init__(self, files: list[str], text_field: str = "text", cache_dir: Optional[Path] = None,
                 skip_missing_text: bool = False, seed: int = 0, field: str = "data.init_args.files") -> None:
        self.files = [Path(f) for f in files]
        self.text_field = text_field
        self.field = field
        missing = [str(p) for p in self.files if not p.exists()]
        if missing:
            raise ConfigError(f"{field}: {missing[:3]} do not exist; fix the paths")
        self._dataset: Any = None
        if len(self.files) == 1 and self.files[0].is_dir():
            self._dataset = self._load_saved(self.files[0])
        else:
            builders = {builder_for(p) for p in self.files}
            if len(builders) > 1:
                raise ConfigError(f"{field} mixes formats {sorted(builders)}: use one kind per run")
            builder = builders.pop()
            if builder in ("text", "json"):
                for path in self.files:
                    check_utf8(path, field)
            if builder != "text":
                import datasets

                datasets.disable_progress_bars()
                self._dataset = datasets.load_dataset(builder, data_files=[str(p) for p in self.files],
                                                      split="train", cache_dir=str(cache_dir) if cache_dir else None)
        if self._dataset is None:
            keep = [i for i, p in enumerate(self.files) if p.stat().st_size > 0]
            self.chars = sum(self.files[i].stat().st_size for i in keep)
        else:
            keep = self._rows_with_text(skip_missing_text)
        if not keep:
            raise ConfigError(f"{field} {[str(f) for f in self.files[:3]]}... contain no text in field "
                              f"{text_field!r}")
        random.Random(seed).shuffle(keep)
        self.order = keep

    @staticmethod
    def _load_saved(path: Path) -> Any:
        import datasets

        datasets.disable_progress_bars()
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return ds

    def _rows_with_text(self, skip_missing_text: bool) -> list[int]:
        """Indices of the rows whose text is non-empty (read as Arrow batches, not Python strings); counts `chars`."""
        import pyarrow.compute as pc

        ds = self._dataset
        if self.text_field not in ds.column_names:
            raise ConfigError(f"data.init_args.text_field={self.text_field!r} is not a column of the dataset; "
                              f"available columns: {ds.column_names}")
        keep, missing, row, self.chars = [], 0, 0, 0
        for table in ds.select_columns([self.text_field]).with_format("arrow").iter(batch_size=4096):
            column = table.column(0)
            lengths = pc.fill_null(pc.utf8_length(column), 0).to_numpy(zero_copy_only=False)
            missing += column.null_count
            keep += (row + lengths.nonzero()[0]).tolist()
            self.chars += int(lengths.sum())
            row += len(lengths)
        if missing and not skip_missing_text:
            raise ConfigError(f"{missing} of {row} rows of {[str(f) for f in self.files[:3]]} have no "
                              f"{self.text_field!r} (data.init_args.text_field); fix those rows, name the right field, "
                              "or set data.init_args.skip_missing_text: true to train without them")
        if missing:
            log(f"skipping {missing} of {row} rows without {self.text_field!r} (data.init_args.skip_missing_text)")
        return keep

    def __len__(self) -> int:
        return len(self.order)

    def documents(self, cut: bool = True, size: Optional[int] = None) -> Iterator[Iterator[str]]:
        """Each document as its pieces of about `size` characters (PIECE_CHARS; one piece, uncut, with `cut=False`)."""
        size = size if cut else -1
        if self._dataset is None:
            for i in self.order:
                yield read_pieces(self.files[i], size)
            return
        rows = self._dataset.select_columns([self.text_field]).select(self.order)
        for batch in rows.iter(batch_size=256):
            for text in batch[self.text_field]:
                yield split_text(text, size)

    def texts(self, cut: bool = True) -> Iterator[str]:
        return (piece for doc in self.documents(cut) for piece in doc)
