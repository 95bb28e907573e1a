"""A source read as a stream: shards of text read in order by a background process, tokenized on the fly, served
to each data-parallel rank as (B, T+1) batches, with the position in every checkpoint.

The source is a directory of shards (its files, recursively, in sorted path order), one file, a glob, or a list of
those: text files (each file one document) or JSON Lines (`.jsonl`/`.json`, one document per line's `text_field`).
Nothing is prepared or cached: the shards are read once per pass, in order, and each pass continues the token
stream (after the last shard comes the first again).

Tokens: each document is `[BOS] + ids + [EOS]` (`lit_lm.data.token_file.encode_documents`, what `lit-lm prepare` and the
tokenize-at-start path write), in input order (not shuffled); a text file is read in units of about `UNIT_BYTES`
cut at byte offsets before a newline that follows an ASCII letter or digit (prepare's safe cut: the units' ids are
the whole file's). Window p of the stream is tokens[p*T : p*T + T + 1] of the whole stream, as `TokenWindows` cuts
a token file (windows span documents and shards).

Ranks: DP rank r of R takes windows start + r, start + r + R, ... (`PositionSampler`'s rule), batch k being its
windows start + r + R*(k*B + j), j < B. Every rank reads and tokenizes the whole stream and keeps its share (simple
and exact under any world size; it costs R times the reading).

Position: window p begins at (pass, shard, byte offset of a unit, tokens to skip after it); the data module saves
the position of its next global window (`samples_consumed`) and a resume reads from there, under any world size.

Errors: the worker's read errors (a missing or unreadable shard, a row without text) and a worker that sends no
batch for `timeout` seconds (a stalled read) raise `StreamError` on that rank, one line naming the shard.
"""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import queue
import re
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import IterableDataset

from lit_lm.config import ConfigError
from lit_lm.data.corpus import JSON_SUFFIXES, TEXT_SUFFIXES, split_text
from lit_lm.data.token_file import DocumentPart, encode_documents
from lit_lm.data.tokenizer import Tokenizer, tokenizer_from_state

UNIT_BYTES = 1 << 20  # a text file is read and encoded in units of about this much
_TEXT_CUT = re.compile(rb"(?<=[A-Za-z0-9])\n")  # prepare's safe cut (bytes)
FIELD = "data.init_args.sources"
KEYS = {"path", "stream", "name", "timeout", "prefetch"}


class StreamError(ConfigError):
    """A stream source could not be read (one line: the rank, the shard, what to do)."""


def _fail(message: str) -> StreamError:
    """The error, printed here too on a rank other than 0 (`lit_lm.errors` prints rank 0's only)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    if getattr(rank_zero_only, "rank", 0) != 0:
        print(f"lit-lm: error: {message}", file=sys.stderr, flush=True)
    return StreamError(message)


def shard_list(path: Any) -> list[str]:
    """The shards of a stream source's `path` (a directory, a file, a glob, or a list of those), in order."""
    out: list[str] = []
    for item in path if isinstance(path, (list, tuple)) else [path]:
        p = Path(item)
        if p.is_dir():
            out += sorted(str(q) for q in p.rglob("*") if q.is_file() and not q.name.startswith("."))
        elif p.is_file():
            out.append(str(p))
        else:
            found = sorted(glob.glob(str(item), recursive=True))
            if not found:
                raise ConfigError(f"{FIELD}: stream path {item} matches no file; fix the path")
            out += [f for f in found if Path(f).is_file()]
    for f in out:
        if Path(f).suffix.lower() not in TEXT_SUFFIXES | JSON_SUFFIXES:
            raise ConfigError(f"{FIELD}: stream shard {f} is not text or JSON Lines (a stream reads .txt/.md/.jsonl "
                              "...); prepare other formats with `lit-lm prepare`")
    if not out:
        raise ConfigError(f"{FIELD}: stream path {path} holds no file")
    return out


def stream_spec(entry: dict[str, Any], index: int) -> dict[str, Any]:
    """A checked `{path, stream: true, name, timeout, prefetch}` entry."""
    unknown = set(entry) - KEYS
    if unknown or "path" not in entry:
        raise ConfigError(f"{FIELD}[{index}] = {entry}: a stream source is {{path: <dir, file, glob or list>, stream: "
                          f"true}} (optional name, timeout, prefetch)"
                          f"{'; unknown keys ' + str(sorted(unknown)) if unknown else ''}")
    timeout, prefetch = float(entry.get("timeout", 300)), int(entry.get("prefetch", 8))
    if not (timeout > 0 and prefetch > 0):
        raise ConfigError(f"{FIELD}[{index}]: timeout (seconds) and prefetch (batches) must be positive")
    return {"path": entry["path"], "shards": shard_list(entry["path"]), "timeout": timeout, "prefetch": prefetch}


# -- the stream: units -> tokens -> windows with their positions (pure; runs in the worker) ------------------------
def _units(path: str, offset: int, text_field: str) -> Iterator[tuple[int, DocumentPart]]:
    """(byte offset, document part) of a shard from `offset` (a unit start)."""
    json_file = Path(path).suffix.lower() in JSON_SUFFIXES
    with open(path, "rb") as f:
        f.seek(offset)
        if json_file:
            for line in iter(f.readline, b""):
                start, offset = offset, offset + len(line)
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise StreamError(f"stream shard {path}: the line at byte {start} is not JSON ({e.msg})") from None
                text = row.get(text_field) if isinstance(row, dict) else None
                if text is None:
                    raise StreamError(f"stream shard {path}: the line at byte {start} has no {text_field!r} "
                                      "(data.init_args.text_field)")
                if text:
                    yield start, DocumentPart(split_text(text), True, True)
            return
        rest = b""
        while True:
            block = f.read(UNIT_BYTES)
            data = rest + block
            if not block:  # end of file: the last unit
                if data:
                    yield offset, DocumentPart([_decode(data)], offset == 0, True)
                return
            cut = max((m.start() for m in _TEXT_CUT.finditer(data, 1)), default=0)
            if cut:
                yield offset, DocumentPart([_decode(data[:cut])], offset == 0, False)
                offset += cut
            rest = data[cut:]


def _decode(data: bytes) -> str:
    return data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")  # as prepare reads text


def stream_windows(shards: list[str], tokenizer: Tokenizer, seq_len: int, text_field: str = "text",
                   position: Optional[dict[str, Any]] = None, on_shard: Any = None
                   ) -> Iterator[tuple[int, np.ndarray, dict[str, Any]]]:
    """(p, window p, position of window p) for p = position's window, p + 1, ... (endless: passes repeat)."""
    pos = position or {"pass": 0, "shard": 0, "offset": 0, "skip": 0, "window": 0}
    if pos["shard"] >= len(shards) or Path(shards[pos["shard"]]).name != pos.get("name", Path(
            shards[pos["shard"]]).name):
        raise StreamError(f"the stream's saved position names shard {pos['shard']} ({pos.get('name')}) but the "
                          f"source now lists {len(shards)} shards ({FIELD}): resume with the same shards")
    p = int(pos["window"])
    tok = p * seq_len - int(pos["skip"])  # stream index of the first token read
    buf = np.empty(0, np.int64)
    buf_start = tok
    marks: list[tuple[int, dict[str, Any]]] = []  # (token index, unit start) of the units in buf
    pass_, shard, offset = int(pos["pass"]), int(pos["shard"]), int(pos["offset"])
    while True:
        read = 0
        for i in range(shard, len(shards)):
            if on_shard is not None:
                on_shard(shards[i])
            try:
                for start, part in _units(shards[i], offset if i == shard else 0, text_field):
                    ids = next(encode_documents(tokenizer, [part]))[0].astype(np.int64)
                    marks.append((tok, {"pass": pass_, "shard": i, "name": Path(shards[i]).name, "offset": start}))
                    buf = np.concatenate([buf, ids])
                    tok += len(ids)
                    read += len(ids)
                    while buf_start + len(buf) >= p * seq_len + seq_len + 1:
                        at = p * seq_len
                        mark_tok, mark = next(m for m in reversed(marks) if m[0] <= at)
                        yield p, buf[at - buf_start: at - buf_start + seq_len + 1], \
                            {**mark, "skip": at - mark_tok, "window": p}
                        p += 1
                    at = p * seq_len
                    keep = max(j for j, m in enumerate(marks) if m[0] <= at)
                    marks = marks[keep:]
                    drop = min(at - buf_start, len(buf))  # tokens before the next window (those read so far)
                    buf, buf_start = buf[drop:], buf_start + drop
            except (OSError, UnicodeDecodeError) as e:
                why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
                raise StreamError(f"stream shard {shards[i]} is missing or unreadable ({why}; {FIELD}): restore "
                                  "it, or remove it from the source and start a new run") from None
        if not read and shard == 0 and offset == 0:
            raise StreamError(f"the stream source's {len(shards)} shards hold no text ({FIELD})")
        pass_, shard, offset = pass_ + 1, 0, 0


def rank_batches(windows: Iterator[tuple[int, np.ndarray, dict[str, Any]]], start: int, batch_size: int,
                 replicas: int, rank: int) -> Iterator[tuple[np.ndarray, int, dict[str, Any]]]:
    """(batch, next global window, its position) of rank `rank`: its windows start + rank + replicas*i, B at a time;
    a batch is given once the next global batch's first window is read (its position goes with the batch)."""
    rows: list[np.ndarray] = []
    per_batch = batch_size * replicas
    for p, window, pos in windows:
        if p > start and (p - start) % per_batch == 0:
            yield np.stack(rows), p, pos
            rows = []
        if (p - start) % replicas == rank:
            rows.append(window)


# -- the worker process and the rank's side ------------------------------------------------------------------------
def _worker(out: Any, shards: list[str], tokenizer_state: dict[str, Any], seq_len: int, text_field: str,
            position: dict[str, Any], batch_size: int, replicas: int, rank: int) -> None:
    try:
        tokenizer = tokenizer_from_state(tokenizer_state)
        windows = stream_windows(shards, tokenizer, seq_len, text_field, position,
                                 on_shard=lambda s: out.put(("shard", s)))
        for batch, p, pos in rank_batches(windows, int(position["window"]), batch_size, replicas, rank):
            out.put(("batch", batch, p, pos))
    except ConfigError as e:
        out.put(("error", str(e)))
    except BaseException as e:  # anything else, named, rather than a silent dead worker
        out.put(("error", f"the stream worker failed reading {FIELD}: {type(e).__name__}: {e}"))


class StreamBatches(IterableDataset):
    """This rank's (B, T+1) batches of a stream source, from `position` (the global window `samples_consumed`),
    made by a background worker process with `prefetch` batches queued. `positions[n]` is the position of global
    window n for the batch boundaries yielded so far (what the data module saves)."""

    def __init__(self, spec: dict[str, Any], tokenizer: Tokenizer, seq_len: int, batch_size: int, replicas: int,
                 rank: int, text_field: str = "text", position: Optional[dict[str, Any]] = None) -> None:
        self.spec, self.tokenizer, self.seq_len, self.batch_size = spec, tokenizer, seq_len, batch_size
        self.replicas, self.rank, self.text_field = replicas, rank, text_field
        self.position = position or {"pass": 0, "shard": 0, "name": Path(spec["shards"][0]).name, "offset": 0,
                                     "skip": 0, "window": 0}
        self.positions: dict[int, dict[str, Any]] = {int(self.position["window"]): self.position}

    def position_at(self, window: int) -> dict[str, Any]:
        if window not in self.positions:
            raise StreamError(f"rank {self.rank}: no stream position recorded for global window {window} "
                              f"(recorded: {sorted(self.positions)[-3:]})")
        return self.positions[window]

    def __iter__(self) -> Iterator[torch.Tensor]:
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        q = ctx.Queue(maxsize=self.spec["prefetch"])
        start = self.positions[max(self.positions)]  # continue after the batches already yielded
        worker = ctx.Process(target=_worker, daemon=True, name=f"lit-lm-stream-rank{self.rank}",
                             args=(q, self.spec["shards"], self.tokenizer.state_dict(), self.seq_len,
                                   self.text_field, start, self.batch_size, self.replicas, self.rank))
        worker.start()
        reading = self.spec["shards"][int(start["shard"])]
        try:
            while True:
                message = self._get(q, worker, reading)
                if message[0] == "shard":
                    reading = message[1]
                elif message[0] == "error":
                    raise _fail(f"rank {self.rank}: {message[1]}")
                else:
                    _, batch, p, pos = message
                    self.positions[p] = pos
                    for old in sorted(self.positions)[:-64]:
                        del self.positions[old]
                    yield torch.from_numpy(batch)
        finally:
            worker.kill()
            worker.join(5)
            q.close()

    def _get(self, q: Any, worker: Any, reading: str) -> tuple:
        """The worker's next message; a stall past the timeout or a dead worker is a `StreamError` naming the
        shard being read."""
        timeout = self.spec["timeout"]
        waited = 0.0
        while True:
            try:
                return q.get(timeout=min(1.0, timeout - waited))
            except queue.Empty:
                waited += min(1.0, timeout - waited)
            if not worker.is_alive() and q.empty():
                raise _fail(f"rank {self.rank}: the stream worker exited (code {worker.exitcode}) while "
                                  f"reading {reading} ({FIELD})")
            if waited >= timeout:
                raise _fail(f"rank {self.rank}: no batch from the stream for {timeout:g} s while reading "
                                  f"{reading} ({FIELD}'s timeout): the storage is slow or stalled; check the "
                                  "file, or raise timeout")
