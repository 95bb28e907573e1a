"""`lit-lm prepare`: a corpus tokenized once, by a pool of worker processes, into a folder that `fit` reads as it is.

    lit-lm prepare --files web/*.jsonl --tokenizer_dir models/Qwen2-0.5B --out prepared/web --workers 8

The input (text files, each one document; `.jsonl` rows; `.parquet` row groups; a `save_to_disk` folder's rows) is
planned into chunks of about `--chunk_mb` of text (a text or jsonl file is cut at byte offsets: before a newline
after an ASCII letter or digit, the safe cut of `lit_lm.data.corpus`, or at a line's start) that depend on the input and
the settings only, never on `--workers`. Each chunk becomes one shard, `shards/NNNNN.bin` (uint16 ids where the
vocabulary fits, else uint32; documents as `[BOS] + ids + [EOS]`), and its record `shards/NNNNN.json`, both written
whole (a temporary name, then a rename), so the shards are byte-identical for any number of workers and an
interrupted run resumes with the chunks not yet recorded. The last `--val_fraction` of each shard's tokens is the
source's held-out split. `index.json`, written last, lists the shards with their documents and tokens and the
tokenizer's hash; `tokenizer/` holds the tokenizer. Memory is one chunk per worker, whatever the corpus's size.

`--format chat` reads rows of `messages` (rendered with the tokenizer's chat template) or `prompt`/`completion` pairs
(`lit_lm.data.chat`): each shard also gets `NNNNN.flags`, one byte per token (who wrote it, where a conversation
begins: `lit_lm.data.loss_mask`), and the index says `"flags": true`; which tokens are trained on is chosen at `fit`.

A `tokenizers` tokenizer runs one thread per worker here (`RAYON_NUM_THREADS=1` unless set): the workers are the
parallelism.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from lit_lm.config import ConfigError
from lit_lm.data.chat import ChatEncoder
from lit_lm.data.corpus import builder_for, check_utf8, cuttable, split_text
from lit_lm.data.token_file import DocumentPart, TokenFile, encode_documents, token_dtype
from lit_lm.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer, tokenizer_from_state, tokenizer_hash

FORMAT = "lit-lm-prepared"
VERSION = 1
INDEX = "index.json"
PLAN = "plan.json"
WORKER_BATCH_CHARS = 1 << 20  # text per encode call inside a worker (one thread each)
_TEXT_CUT = re.compile(rb"(?<=[A-Za-z0-9])\n")  # a byte-level subset of corpus.SAFE_CUT
_LINE_END = re.compile(rb"\n")


# -- the plan: chunks that depend on the input and the settings only ------------------------------------------
def _next_cut(f: Any, pos: int, pattern: re.Pattern, after: bool) -> Optional[int]:
    """The first offset >= pos where `pattern` allows a cut (its match's start, or end with `after`)."""
    f.seek(pos - 1)
    prev = f.read(1)
    offset = pos - len(prev)
    while block := f.read(1 << 16):
        m = pattern.search(prev + block)
        if m:
            return offset + (m.end() if after else m.start())
        offset += len(prev + block) - 1
        prev = block[-1:]
    return None


def _byte_chunks(path: Path, chunk_bytes: int, kind: str) -> list[tuple[int, int]]:
    size = path.stat().st_size
    bounds = [0]
    with open(path, "rb") as f:
        while bounds[-1] + chunk_bytes < size:
            cut = _next_cut(f, bounds[-1] + chunk_bytes, _TEXT_CUT if kind == "text" else _LINE_END, kind == "json")
            if cut is None or cut >= size:
                break
            bounds.append(cut)
    return list(zip(bounds, bounds[1:] + [size]))


def plan_chunks(files: Sequence[str], text_field: str, chunk_bytes: int) -> list[dict[str, Any]]:
    """The chunks of the input, in order: {"file", "kind", "start", "end"} (bytes, rows or a row group)."""
    paths = [Path(f) for f in files]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise ConfigError(f"--files: {missing[:3]} do not exist; fix the paths")
    chunks: list[dict[str, Any]] = []
    for path in paths:
        if path.is_dir():
            ds = _saved_dataset(path, text_field)
            rows = len(ds)
            per_chunk = max(1, int(chunk_bytes * rows / max(ds.data.nbytes, 1)))
            chunks += [{"file": str(path), "kind": "saved", "start": a, "end": min(a + per_chunk, rows)}
                       for a in range(0, rows, per_chunk)]
            continue
        kind = builder_for(path)
        if kind == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path)
            if text_field is not None and text_field not in meta.schema_arrow.names:
                raise ConfigError(f"--text_field {text_field!r} is not a column of {path}; available columns: "
                                  f"{meta.schema_arrow.names}")
            chunks += [{"file": str(path), "kind": kind, "start": g, "end": g + 1}
                       for g in range(meta.metadata.num_row_groups)]
            continue
        check_utf8(path, "--files")
        if kind == "json":
            with open(path, "rb") as f:
                if f.read(4096).lstrip()[:1] == b"[":
                    raise ConfigError(f"{path} is a JSON array: prepare reads JSON Lines (one object per line); "
                                      "write it as .jsonl")
        chunks += [{"file": str(path), "kind": kind, "start": a, "end": b}
                   for a, b in _byte_chunks(path, chunk_bytes, kind) if b > a]
    if not chunks:
        raise ConfigError(f"--files {[str(p) for p in paths[:3]]} hold no text")
    return chunks


def _saved_dataset(path: Path, text_field: Optional[str]) -> Any:
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise ConfigError(f"--files: {path} is a folder but not one written by datasets' save_to_disk") from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    if text_field is not None and text_field not in ds.column_names:
        raise ConfigError(f"--text_field {text_field!r} is not a column of {path}; available columns: "
                          f"{ds.column_names}")
    return ds


# -- one chunk -> one shard ----------------------------------------------------------------------------------------
def _rows(texts: Iterator[Optional[str]], where: str, skip_missing_text: bool) -> Iterator[DocumentPart]:
    for text in texts:
        if text is None and not skip_missing_text:
            raise ConfigError(f"a row of {where} has no text (--text_field); fix it, name the right field, or pass "
                              "--skip_missing_text")
        if text:
            yield DocumentPart(split_text(text, -1 if not _CUT else None), True, True)


def _chunk_rows(chunk: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A jsonl/parquet/saved chunk's rows, whole (chat data)."""
    path, kind, start, end = Path(chunk["file"]), chunk["kind"], chunk["start"], chunk["end"]
    if kind == "json":
        with open(path, "rb") as f:
            f.seek(start)
            lines = f.read(end - start).split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)
    elif kind == "parquet":
        import pyarrow.parquet as pq

        yield from pq.ParquetFile(path).read_row_group(start).to_pylist()
    elif kind == "saved":
        yield from _saved_dataset(path, None).select(range(start, end)).to_list()
    else:
        raise ConfigError(f"--format chat reads .jsonl/.parquet rows or save_to_disk folders, not {path}")


def _chunk_documents(chunk: dict[str, Any], text_field: str, skip_missing_text: bool) -> Iterator[DocumentPart]:
    path, kind, start, end = Path(chunk["file"]), chunk["kind"], chunk["start"], chunk["end"]
    if kind == "text":
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read(end - start).decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
        size = path.stat().st_size
        yield DocumentPart(split_text(text, -1 if not _CUT else None), start == 0, end == size)
    elif kind == "json":
        with open(path, "rb") as f:
            f.seek(start)
            lines = f.read(end - start).split(b"\n")

        def texts() -> Iterator[Optional[str]]:
            for n, line in enumerate(lines):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}: a line after byte {start} is not JSON ({e.msg}, line {n + 1} of the "
                                      "chunk)") from None
                if not isinstance(row, dict):
                    raise ConfigError(f"{path}: a line after byte {start} is not a JSON object")
                yield row.get(text_field)

        yield from _rows(texts(), str(path), skip_missing_text)
    elif kind == "parquet":
        import pyarrow.parquet as pq

        column = pq.ParquetFile(path).read_row_group(start, columns=[text_field]).column(0)
        yield from _rows(iter(column.to_pylist()), str(path), skip_missing_text)
    else:
        ds = _saved_dataset(path, text_field)
        yield from _rows(iter(ds.select_columns([text_field])[start:end][text_field]), str(path), skip_missing_text)


_TOKENIZER: Optional[Tokenizer] = None  # the worker's
_CUT = True
_SETTINGS: dict[str, Any] = {}


def _start_worker(state: dict[str, Any], settings: dict[str, Any]) -> None:
    global _TOKENIZER, _CUT, _SETTINGS
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    _TOKENIZER = tokenizer_from_state(state)
    _CUT = cuttable(_TOKENIZER.special_tokens)
    _SETTINGS = settings


def _shard_paths(out: Path, i: int) -> tuple[Path, Path]:
    return out / "shards" / f"{i:05d}.bin", out / "shards" / f"{i:05d}.json"


def run_chunk(job: tuple[int, dict[str, Any]]) -> dict[str, Any]:
    """Encode chunk `i` into its shard and record it; returns the record."""
    i, chunk = job
    out = Path(_SETTINGS["out"])
    bin_path, record_path = _shard_paths(out, i)
    tokens = TokenFile(bin_path, token_dtype(_TOKENIZER.vocab_size))
    flags = TokenFile(bin_path.with_suffix(".flags"), np.dtype(np.uint8)) if _SETTINGS["format"] == "chat" else None
    documents, chars = 0, 0
    try:
        if flags is not None:  # chat rows: ids and their flags (lit_lm.data.chat)
            for ids, row_flags in ChatEncoder(_TOKENIZER, str(chunk["file"])).encode_rows(_chunk_rows(chunk)):
                tokens.append(ids)
                flags.append(row_flags)
                documents += 1
        else:
            docs = _chunk_documents(chunk, _SETTINGS["text_field"], _SETTINGS["skip_missing_text"])
            for ids, ended, n in encode_documents(_TOKENIZER, docs, 1, WORKER_BATCH_CHARS):
                tokens.append(ids)
                documents += ended
                chars += n
    except BaseException:
        tokens.discard()
        if flags is not None:
            flags.discard()
        raise
    tokens.close()
    if flags is not None:
        flags.close()
    n_tokens = tokens.n_tokens
    record = {"file": bin_path.name, "tokens": n_tokens, "val_tokens": int(round(n_tokens * _SETTINGS["val_fraction"])),
              "documents": documents, "chars": chars, "max_id": tokens.max_id,
              "sha256": hashlib.sha256(bin_path.read_bytes()).hexdigest(), "bytes": chunk["end"] - chunk["start"]}
    _write_json(record_path, record)
    return record


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


# -- the command ---------------------------------------------------------------------------------------------------
def prepare(files: Sequence[str], tokenizer_dir: str, out: str, workers: int = 1, text_field: str = "text",
            val_fraction: float = 0.05, chunk_mb: float = 16.0, skip_missing_text: bool = False,
            progress: bool = True, format: str = "text") -> dict[str, Any]:
    """Tokenize `files` into `out` (see the module doc); returns the index. Resumes an interrupted run of the same
    inputs and settings; refuses a folder holding another."""
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"--val_fraction must be in [0, 1), got {val_fraction}")
    if chunk_mb <= 0:
        raise ConfigError(f"--chunk_mb must be positive, got {chunk_mb}")
    tokenizer = load_tokenizer(tokenizer_dir, "--tokenizer_dir")
    if tokenizer.eos_id is None:
        raise ConfigError(f"the tokenizer in {tokenizer_dir} has no EOS token to end documents with "
                          "(--tokenizer_dir); name one as eos_token in its tokenizer_config.json")
    if format not in ("text", "chat"):
        raise ConfigError(f"--format must be text or chat, got {format!r}")
    if format == "chat" and not isinstance(tokenizer, HFTokenizer):
        raise ConfigError("--format chat renders rows with a Hugging Face tokenizer's chat template (or encodes "
                          "prompt/completion pairs): give the model folder as --tokenizer_dir")
    out_dir = Path(out)
    chunks = plan_chunks(files, text_field if format == "text" else None, int(chunk_mb * 2**20))
    plan = {"format": FORMAT, "version": VERSION, "tokenizer_sha256": tokenizer_hash(tokenizer),
            "text_field": text_field, **({"chat": tokenizer.state_dict().get("chat")} if format == "chat" else {}),
            "val_fraction": val_fraction, "skip_missing_text": skip_missing_text,
            "inputs": [_stat(f) for f in files], "chunks": chunks}
    plan = json.loads(json.dumps(plan))  # as read back (tuples are lists)
    if (out_dir / PLAN).is_file():
        if json.loads((out_dir / PLAN).read_text()) != plan:
            raise ConfigError(f"--out {out_dir} holds a prepare of other inputs, settings or tokenizer; give another "
                              "--out or delete it")
    elif out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"--out {out_dir} is not empty and holds no prepare plan; give an empty or new folder")
    (out_dir / "shards").mkdir(parents=True, exist_ok=True)
    tokenizer.save(out_dir / "tokenizer")
    _write_json(out_dir / PLAN, plan)
    if (out_dir / INDEX).is_file():
        return json.loads((out_dir / INDEX).read_text())

    settings = {"out": str(out_dir), "text_field": text_field, "val_fraction": val_fraction,
                "skip_missing_text": skip_missing_text, "format": format}
    records: dict[int, dict[str, Any]] = {}
    for i in range(len(chunks)):
        record_path = _shard_paths(out_dir, i)[1]
        if record_path.is_file():
            records[i] = json.loads(record_path.read_text())
    pending = [(i, c) for i, c in enumerate(chunks) if i not in records]
    started = time.monotonic()
    done_tokens = 0
    with _Progress(sum(c["end"] - c["start"] for _, c in pending), progress) as bar:
        if workers == 1:
            _start_worker(tokenizer.state_dict(), settings)
            results = map(run_chunk, pending)
            for (i, _), record in zip(pending, results):
                records[i] = record
                done_tokens += record["tokens"]
                bar.advance(record["bytes"], done_tokens)
        else:
            ctx = multiprocessing.get_context("spawn")  # spawn: safe beside threads (torch, the tokenizer's)
            with ctx.Pool(workers, _start_worker, (tokenizer.state_dict(), settings)) as pool:
                for record in pool.imap_unordered(run_chunk, pending):
                    i = int(record["file"].split(".")[0])
                    records[i] = record
                    done_tokens += record["tokens"]
                    bar.advance(record["bytes"], done_tokens)
    shards = [records[i] for i in range(len(chunks))]
    index = {"format": FORMAT, "version": VERSION, "dtype": token_dtype(tokenizer.vocab_size).name,
             "tokenizer_sha256": plan["tokenizer_sha256"], "vocab_size": tokenizer.vocab_size,
             "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "val_fraction": val_fraction,
             "documents": sum(s["documents"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
             "max_id": max(s["max_id"] for s in shards), **({"flags": True} if format == "chat" else {}),
             "shards": [{k: s[k] for k in ("file", "tokens", "val_tokens", "documents", "sha256")} for s in shards]}
    _write_json(out_dir / INDEX, index)
    seconds = time.monotonic() - started
    print(f"[lit-lm prepare] {index['documents']:,} documents, {index['tokens']:,} tokens in {len(shards)} shards "
          f"-> {out_dir} ({done_tokens / max(seconds, 1e-9):,.0f} tokens/s over {seconds:.1f} s, {workers} workers)",
          flush=True)
    return index


def _stat(path: str) -> list[Any]:
    p = Path(path)
    files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
    return [str(p), [(str(q.relative_to(p)) if p.is_dir() else "", q.stat().st_size, q.stat().st_mtime_ns)
                     for q in files]]


class _Progress:
    """A rich progress bar over the input's bytes with tokens, tokens/s and the ETA (off where stderr is no tty)."""

    def __init__(self, total: int, enabled: bool) -> None:
        import sys

        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self._started = time.monotonic()
        self._bar = Progress(TextColumn("preparing"), BarColumn(), TextColumn("{task.fields[tokens]}"),
                             TimeRemainingColumn(), disable=not (enabled and sys.stderr.isatty()), transient=True)
        self._task = self._bar.add_task("prepare", total=total, tokens="")

    def __enter__(self) -> "_Progress":
        self._bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._bar.__exit__(*exc)

    def advance(self, nbytes: int, tokens: int) -> None:
        rate = tokens / max(time.monotonic() - self._started, 1e-9)
        self._bar.update(self._task, advance=nbytes, tokens=f"{tokens:,} tokens, {rate:,.0f} tokens/s")


# -- reading a prepared folder -------------------------------------------------------------------------------------
class PreparedSource:
    """A folder written by `prepare`: its index, tokenizer, and the ids of its train or val split as
    [(memory-mapped shard part)], each a separate stream (windows never span two shards)."""

    def __init__(self, path: str | os.PathLike, field: str = "data.init_args.sources") -> None:
        self.path = Path(path)
        index_path = self.path / INDEX
        if not index_path.is_file():
            hint = " (an unfinished prepare: run it again to resume)" if (self.path / PLAN).is_file() else ""
            raise ConfigError(f"{self.path} is not a prepared folder: it has no {INDEX}{hint} ({field}); make it "
                              "with lit-lm prepare")
        self.index = json.loads(index_path.read_text())
        if self.index.get("format") != FORMAT or self.index.get("version") != VERSION:
            raise ConfigError(f"{index_path} is not a {FORMAT} v{VERSION} index ({field})")
        root = self.path.resolve()
        for shard in self.index["shards"]:
            file = (self.path / "shards" / shard["file"]).resolve()
            if root not in file.parents:  # paths read from a file stay in its folder
                raise ConfigError(f"{index_path} names a shard outside its folder: {shard['file']!r} ({field})")
        self.dtype = np.dtype(self.index["dtype"])
        for shard in self.index["shards"]:
            file = self.path / "shards" / shard["file"]
            if not file.is_file() or file.stat().st_size != shard["tokens"] * self.dtype.itemsize:
                raise ConfigError(f"{file} is missing or not the {shard['tokens']} tokens {index_path} lists "
                                  f"({field}); prepare the source again into a new folder")

    @property
    def tokenizer_sha256(self) -> str:
        return self.index["tokenizer_sha256"]

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.path / "tokenizer")

    @property
    def flagged(self) -> bool:
        """Chat data: each shard's `NNNNN.flags` beside it (`lit_lm.data.loss_mask`)."""
        return bool(self.index.get("flags"))

    def parts(self, split: str, flags: bool = False) -> list[np.ndarray]:
        """The train (each shard's head) or val (each shard's tail) ids, one memory-mapped array per shard (`flags`:
        the shards' flags instead)."""
        out = []
        for shard in self.index["shards"]:
            n, v = shard["tokens"], shard["val_tokens"]
            if n == 0:
                continue
            file = shard["file"].replace(".bin", ".flags") if flags else shard["file"]
            ids = np.memmap(self.path / "shards" / file, dtype=np.uint8 if flags else self.dtype, mode="r", shape=(n,))
            out.append(ids[: n - v] if split == "train" else ids[n - v:])
        return out

    def flag_parts(self, split: str) -> Optional[list[np.ndarray]]:
        """`parts(split)`'s flags, None for a text source."""
        return self.parts(split, flags=True) if self.flagged else None


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="lit-lm prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", nargs="+", required=True, help="text/.jsonl/.parquet files or save_to_disk folders")
    parser.add_argument("--tokenizer_dir", required=True,
                        help="folder with lit-lm's BPE or a tokenizers tokenizer.json")
    parser.add_argument("--out", required=True, help="the prepared folder (resumed when it holds this prepare)")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1)), help="worker processes")
    parser.add_argument("--text_field", default="text", help="the text column of jsonl/parquet/saved rows")
    parser.add_argument("--val_fraction", type=float, default=0.05, help="each shard's held-out tail")
    parser.add_argument("--chunk_mb", type=float, default=16.0, help="text per chunk (one shard each)")
    parser.add_argument("--skip_missing_text", action="store_true", help="skip rows without text instead of failing")
    parser.add_argument("--format", default="text", choices=("text", "chat"),
                        help="chat: rows of messages (the tokenizer's chat template) or prompt/completion pairs, "
                             "their loss masks stored beside the tokens")
    args = parser.parse_args(argv)
    prepare(args.files, args.tokenizer_dir, args.out, args.workers, args.text_field, args.val_fraction, args.chunk_mb,
            args.skip_missing_text, format=args.format)
