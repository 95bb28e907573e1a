"""Text corpus -> tokens in a memory-mapped file -> fixed-length (B, T+1) windows, as a LightningDataModule.

The corpus is read through `datasets` (text / jsonl / parquet files, or a dataset saved with `save_to_disk`);
the default corpus is the Python standard library's source, which exists on every machine with no download.
The tokenizer is lit-lm's BPE trained on the corpus, or any tokenizer `lit_lm.data.tokenizer.load_tokenizer` reads from
`tokenizer_dir` (a Hugging Face model folder's `tokenizer.json` included). Documents are shuffled, encoded as
`[BOS] + text + [EOS]` (`lit_lm.data.tokenizer.document_ids`) and concatenated. Tokenizing happens once: the tokenizer
and the token file are cached under `data_dir`, keyed by a hash of the inputs (paths, sizes, modification times,
field, and the vocabulary size or the given tokenizer's content), and reused while the inputs are unchanged.
"""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
from functools import cached_property
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import numpy as np
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset

from lit_lm.config import ConfigError
from lit_lm.data.chat import ChatEncoder, read_rows
from lit_lm.data.corpus import Corpus, cuttable, log
from lit_lm.data.loss_mask import START, check_train_on, targets_of
from lit_lm.data.mixture import MixtureWindows, ShardWindows
from lit_lm.data.packing import Packing
from lit_lm.data.prepare import PreparedSource
from lit_lm.data.sampler import PositionSampler, ResumableSampler
from lit_lm.data.stream import StreamBatches, stream_spec
from lit_lm.data.token_file import TokenFile, batch_chars, encode_documents, token_dtype
from lit_lm.data.tokenizer import EOT, BPETokenizer, Tokenizer, load_tokenizer, tokenizer_hash

_CACHE_VERSION = 3


def stdlib_corpus(max_mb: float) -> list[str]:
    """About `max_mb` MB of the standard library's .py files, a seeded random sample (the same on every machine
    with the same Python), so the corpus spans the library instead of its alphabetically first packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    random.Random(0).shuffle(paths)
    files, total = [], 0
    for path in paths:
        files.append(str(path))
        total += path.stat().st_size
        if total >= max_mb * 2**20:
            break
    return files


def model_vocab_size(vocab_size: int, tokenizer_dir: Optional[str], sources: Optional[list[Any]] = None) -> int:
    """The model's vocabulary for these data settings (the CLI links it to model.init_args.config.vocab_size): the
    given tokenizer's size, else the prepared sources' tokenizer's, else `vocab_size` (the BPE trained on the corpus
    has at most that many tokens)."""
    if tokenizer_dir is not None:
        return load_tokenizer(tokenizer_dir).vocab_size
    if sources and _stream_entry(sources) is None:
        return int(PreparedSource(_source_specs(sources)[0][1]).index["vocab_size"])
    return vocab_size


def _stream_entry(sources: list[Any]) -> Optional[dict[str, Any]]:
    """The stream source (`{path, stream: true}`, `lit_lm.data.stream`) if `sources` is one, else None. A stream is read
    alone: mixing it with weighted prepared sources is not built."""
    if not any(isinstance(e, dict) and e.get("stream") for e in sources):
        return None
    if len(sources) > 1:
        raise ConfigError("data.init_args.sources: a stream source is read alone (mixing a stream with other "
                          "sources is not built); give one {path: <shards>, stream: true}, or prepare the sources")
    return stream_spec(dict(sources[0]), 0)


def _source_specs(sources: list[Any]) -> list[tuple[str, str, float]]:
    """(name, path, weight) of each `data.init_args.sources` entry: {path, weight (default 1), name (default: the
    folder's name)}."""
    specs = []
    for i, entry in enumerate(sources):
        entry = {"path": entry} if isinstance(entry, str) else dict(entry)
        unknown = set(entry) - {"path", "weight", "name"}
        if "path" not in entry or unknown:
            raise ConfigError(f"data.init_args.sources[{i}] = {entry}: give {{path: <prepared folder>, weight: <w>}} "
                              f"(optional name){'; unknown keys ' + str(sorted(unknown)) if unknown else ''}")
        try:
            weight = float(entry.get("weight", 1.0))
        except (TypeError, ValueError):
            weight = float("nan")
        if not 0 < weight < float("inf"):
            raise ConfigError(f"data.init_args.sources[{i}].weight must be a positive number, got "
                              f"{entry.get('weight')}")
        if not Path(entry["path"]).exists():
            raise ConfigError(f"data.init_args.sources[{i}].path {entry['path']} does not exist; give a folder "
                              "written by lit-lm prepare")
        specs.append((str(entry.get("name") or Path(entry["path"]).name), str(entry["path"]), weight))
    names = [n for n, _, _ in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"data.init_args.sources: two sources are named alike ({names}); give each a `name`")
    return specs


def check_vocabulary(tokenizer: Tokenizer, model_vocab: int) -> None:
    """A model must have a row for every token id (more rows are padding, never produced by the tokenizer)."""
    if model_vocab < tokenizer.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary is "
                          f"{model_vocab} (model.init_args.config.vocab_size, or init_from's config.json): it must be "
                          "at least the tokenizer's; use the model's own tokenizer (data.init_args.tokenizer_dir) or "
                          "a model as large")


def _fingerprint(files: list[str], text_field: str, vocabulary: str) -> str:
    h = hashlib.sha256(f"v{_CACHE_VERSION}|{text_field}|{vocabulary}".encode())
    for f in files:
        p = Path(f)
        stats = [(str(q), q.stat().st_size, q.stat().st_mtime_ns) for q in sorted(p.rglob("*") if p.is_dir() else [p])
                 if q.is_file()]
        h.update(repr(stats).encode())
    return h.hexdigest()[:16]


class TokenWindows(Dataset):
    """Non-overlapping windows of T+1 tokens: window i is tokens[i*T : i*T + T + 1] (inputs and shifted targets)."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max((len(self.tokens) - 1) // self.seq_len, 0)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start: start + self.seq_len + 1].astype(np.int64))


class TextDataModule(L.LightningDataModule):
    """Trains a BPE tokenizer (or uses `tokenizer_dir`'s), tokenizes the corpus once into `data_dir`, serves (B, T+1)
    windows.

    Args:
        files: text/markdown/source files, `.jsonl`/`.json`, `.parquet`, or one directory saved with
            `datasets.Dataset.save_to_disk`. None = the Python standard library's source (no download).
        text_field: column holding the text (the `text` builder names it "text").
        data_dir: where the tokenizer and token cache live.
        vocab_size: size of the BPE tokenizer trained on the corpus; with `tokenizer_dir` unused (the tokenizer's
            own size is the vocabulary). The CLI links the vocabulary to the model's `config.vocab_size`.
        seq_len: tokens per training window (T).
        batch_size: windows per device per step (the global batch is this × DP size).
        val_fraction: the tail of the token stream held out for validation (documents are shuffled first).
        corpus_mb: how much of the default corpus to use.
        tokenizer_dir: a folder with the tokenizer to use instead of training one: lit-lm's BPE `tokenizer.json`
            or a `tokenizers` library one (a Hugging Face model folder: `lit_lm.data.tokenizer.load_tokenizer`).
        num_workers: DataLoader workers; tokenizer_workers: processes for BPE training and encoding (a
            `tokenizers` library tokenizer encodes on its own thread pool).
        seed: shuffling seed (the order is a function of seed and epoch only).
        skip_missing_text: train without jsonl/parquet rows that lack `text_field` (default: refuse them).
        sources: folders written by `lit-lm prepare`, mixed by weight, instead of `files`:
            `[{path: prepared/web, weight: 0.7}, {path: prepared/code, weight: 0.3}]` (`lit_lm.data.mixture`); read as
            they are (never re-tokenized), each with its own held-out split, validated per source.
        document_mask: attention never crosses a document boundary inside a row (boundaries are the rows' own EOS
            tokens: `lit_lm.data.packing`, docs/data.md). Default off: documents attend into the previous ones.
        position_reset: with `document_mask`, RoPE positions restart at 0 at each document.
        format: "text" (documents) or "chat": jsonl/parquet rows of `messages` rendered with `tokenizer_dir`'s chat
            template, or `prompt`/`completion` pairs (`lit_lm.data.chat`); needs `tokenizer_dir`.
        train_on: chat data's targets (`lit_lm.data.loss_mask`): "assistant" (default), "last" (the last assistant
            message) or "all"; applied when rows are read (prepared chat sources too).
        packed: chat data: conversations packed into rows, attention never crossing one (default), or false: one
            conversation per row, cut or padded to seq_len + 1. (Not `packing`: that is the method below.)
    """

    def __init__(self, files: Optional[list[str]] = None, text_field: str = "text", data_dir: str = "data",
                 vocab_size: int = 4096, seq_len: int = 256, batch_size: int = 16, val_fraction: float = 0.05,
                 corpus_mb: float = 4.0, tokenizer_dir: Optional[str] = None, num_workers: int = 0,
                 tokenizer_workers: int = 2, seed: int = 1234, skip_missing_text: bool = False,
                 sources: Optional[list[dict[str, Any]]] = None, document_mask: bool = False,
                 position_reset: bool = False, format: str = "text", train_on: str = "assistant",
                 packed: bool = True) -> None:
        super().__init__()
        if format not in ("text", "chat"):
            raise ConfigError(f"data.init_args.format must be text or chat, got {format!r}")
        check_train_on(train_on)
        if format == "chat" and files is not None and tokenizer_dir is None:
            raise ConfigError("data.init_args.format chat renders rows with a tokenizer's chat template: give "
                              "data.init_args.tokenizer_dir (the model folder whose tokenizer_config.json has one)")
        if position_reset and not document_mask:
            raise ConfigError("data.init_args.position_reset restarts positions at each document: it needs "
                              "data.init_args.document_mask true")
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"data.init_args.val_fraction must be in (0, 1), got {val_fraction}")
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("vocab_size", vocab_size)):
            if value <= 0:
                raise ConfigError(f"data.init_args.{name} must be a positive integer, got {value}")
        if files is not None and not files:
            raise ConfigError("data.init_args.files is an empty list: give at least one file, or null for the "
                              "default corpus")
        if sources is not None and (files is not None or not sources):
            raise ConfigError("data.init_args.sources: give prepared folders (a non-empty list) or files, not both")
        self.sources = sources
        self.stream = _stream_entry(sources) if sources else None
        if self.stream is not None and (format == "chat" or not packed):
            raise ConfigError("data.init_args.sources: a stream source is plain text (chat data is read from files or "
                              "prepared folders); drop format: chat / packed: false, or prepare the chat rows")
        if self.stream is not None and tokenizer_dir is None:
            raise ConfigError("data.init_args.sources: a stream source needs data.init_args.tokenizer_dir (no "
                              "tokenizer is trained on a stream)")
        self.source_specs = _source_specs(sources) if sources and self.stream is None else None
        self.files = files
        self.text_field = text_field
        self.data_dir = Path(data_dir)
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.corpus_mb = corpus_mb
        self.tokenizer_dir = tokenizer_dir
        self.num_workers = num_workers
        self.tokenizer_workers = tokenizer_workers
        self.seed = seed
        self.skip_missing_text = skip_missing_text
        self.document_mask, self.position_reset = document_mask, position_reset
        self.format, self.train_on, self.packed = format, train_on, packed
        self.flagged = False  # rows carry loss masks and conversation starts (lit_lm.data.loss_mask): after setup
        self.tokenizer: Optional[Tokenizer] = None
        self.train_set: Optional[TokenWindows] = None
        self.val_set: Optional[Dataset] = None
        self.val_sources: list[Dataset] = []  # a mixture's: each source's validation windows (one loader each)
        self._base_samples = 0  # global samples consumed when the current train loader was made
        self._base_batches = 0  # Lightning's processed-batch counter at that moment
        self._resumed_samples: Optional[int] = None  # from a checkpoint, applied when the loader is made
        self._resumed_stream: Optional[dict[str, Any]] = None  # a stream source's position, from a checkpoint

    # -- corpus and cache ----------------------------------------------------------------------------------
    @cached_property
    def source_files(self) -> list[str]:
        return self.files if self.files is not None else stdlib_corpus(self.corpus_mb)

    @cached_property
    def cache_dir(self) -> Path:
        """Fixed at first use, so an edit of the inputs mid-run cannot move the cache under a running job."""
        vocabulary = str(self.vocab_size)
        if self.given_tokenizer is not None:  # its content: its path says nothing once the file is replaced
            vocabulary = tokenizer_hash(self.given_tokenizer)
        if self.format == "chat":  # the rendering depends on the template, which the tokenizer's hash leaves out
            chat = getattr(self.given_tokenizer, "chat", None)
            vocabulary += "|chat|" + hashlib.sha256(json.dumps(chat, sort_keys=True).encode()).hexdigest()
        field = self.text_field if self.format == "text" else "<chat>"
        return self.data_dir / "cache" / _fingerprint(self.source_files, field, vocabulary)

    @cached_property
    def given_tokenizer(self) -> Optional[Tokenizer]:
        """`tokenizer_dir`'s tokenizer (None without one), read at first use."""
        if self.tokenizer_dir is None:
            return None
        tokenizer = load_tokenizer(self.tokenizer_dir)
        if tokenizer.eos_id is None:
            raise ConfigError(f"the tokenizer in {self.tokenizer_dir} has no EOS token to end documents with "
                              "(data.init_args.tokenizer_dir); name one as eos_token in its tokenizer_config.json")
        return tokenizer

    @cached_property
    def prepared(self) -> list[PreparedSource]:
        """The prepared sources (`sources`), checked to share one tokenizer (and `tokenizer_dir`'s, if given)."""
        folders = [PreparedSource(path) for _, path, _ in self.source_specs]
        want = tokenizer_hash(self.given_tokenizer) if self.given_tokenizer is not None else \
            folders[0].tokenizer_sha256
        for (_, path, _), folder in zip(self.source_specs, folders):
            if folder.tokenizer_sha256 != want:
                other = "data.init_args.tokenizer_dir's" if self.given_tokenizer is not None else \
                    f"{self.source_specs[0][1]}'s"
                raise ConfigError(f"data.init_args.sources: {path} was prepared with another tokenizer than "
                                  f"{other}; prepare every source with the same --tokenizer_dir")
        return folders

    def prepare_data(self) -> None:
        """Build the tokenizer and the token file once (Lightning runs this on one process per node); prepared
        sources are only checked."""
        if self.stream is not None:
            return
        if self.sources:
            _ = self.prepared
            return
        cache = self.cache_dir
        if (cache / "tokens.json").exists():
            return
        cache.mkdir(parents=True, exist_ok=True)
        if self.format == "chat":
            return _write_chat_tokens(read_rows(self.source_files, self.seed), self.given_tokenizer, cache)
        corpus = Corpus(self.source_files, self.text_field, self.data_dir / "hf_cache", self.skip_missing_text)
        tokenizer = self.given_tokenizer
        if tokenizer is None:
            log(f"training a {self.vocab_size}-token BPE tokenizer on {len(corpus)} documents")
            tokenizer = BPETokenizer.train(corpus.texts(), self.vocab_size, special_tokens=[EOT],
                                           num_workers=self.tokenizer_workers)
            if tokenizer.vocab_size < self.vocab_size // 2:  # the corpus has fewer distinct pairs than asked
                raise ConfigError(f"the corpus yields only {tokenizer.vocab_size} tokens, far fewer than asked "
                                  f"(data.init_args.vocab_size={self.vocab_size}); set vocab_size to "
                                  f"{tokenizer.vocab_size} or add data")
            tokenizer.save(cache / "tokenizer")
        _write_tokens(corpus, tokenizer, cache, self.tokenizer_workers)

    def setup(self, stage: str) -> None:
        if self.stream is not None:  # batches made by the stream's worker when the loader is iterated
            self.tokenizer = self.given_tokenizer
            return self._check_model_vocabulary()
        if self.sources:
            return self._setup_mixture()
        cache = self.cache_dir
        if not (cache / "tokens.json").exists():  # e.g. setup() called without a Trainer
            self.prepare_data()
        meta = json.loads((cache / "tokens.json").read_text())
        tokens = np.memmap(cache / "tokens.bin", dtype=meta["dtype"], mode="r", shape=(meta["n_tokens"],))
        flags = np.memmap(cache / "flags.bin", dtype=np.uint8, mode="r", shape=(meta["n_tokens"],)) \
            if meta.get("flags") else None
        self.tokenizer = self.given_tokenizer or load_tokenizer(cache / "tokenizer")
        if meta["max_id"] >= self.tokenizer.vocab_size:
            raise ConfigError(f"token id {meta['max_id']} in {cache} is not the tokenizer's (it has "
                              f"{self.tokenizer.vocab_size} tokens): the cache is stale; delete {cache}")
        self._check_model_vocabulary()
        n_val = int(len(tokens) * self.val_fraction)
        if flags is None and self.packed:
            self.train_set = TokenWindows(tokens[: len(tokens) - n_val], self.seq_len)
            self.val_set = TokenWindows(tokens[len(tokens) - n_val:], self.seq_len)
        else:
            cut = len(tokens) - n_val
            if flags is not None:  # the held-out split begins with a conversation
                starts = np.flatnonzero(flags[cut:] & START)
                cut += int(starts[0]) if len(starts) else 0
            self.train_set = self._windows([tokens[:cut]], None if flags is None else [flags[:cut]])
            self.val_set = self._windows([tokens[cut:]], None if flags is None else [flags[cut:]])
        dp, _ = self._dp()
        for split, ds, n in (("train", self.train_set, len(tokens) - n_val), ("val", self.val_set, n_val)):
            if len(ds) < self.batch_size * dp:
                raise ConfigError(f"the {split} split has {len(ds)} windows of seq_len {self.seq_len} ({n} tokens), "
                                  f"fewer than one batch of {self.batch_size} x {dp} data-parallel ranks "
                                  f"(data.init_args.val_fraction); {'raise' if split == 'val' else 'lower'} "
                                  "val_fraction, lower batch_size or seq_len, or add data")

    def _windows(self, parts: list[np.ndarray], flags: Optional[list[Optional[np.ndarray]]]) -> ShardWindows:
        """Windows whose rows carry loss masks and conversation starts (`lit_lm.data.loss_mask`); `flags` None: plain
        text's (every token a target, documents after each EOS)."""
        self.flagged = True
        return ShardWindows(parts, self.seq_len, flags if flags is not None else [None] * len(parts), self.train_on,
                            self.packed, self.tokenizer.eos_id)

    def step_targets(self, position: int, samples: int) -> int:
        """How many targets the `samples` global samples from stream position `position` hold (every rank's rows of
        an optimizer step: `LanguageModel` normalises the loss by it). Read from the rows on the host (their flags,
        a few bytes per token), the same number on every rank: no collective, no device read."""
        if isinstance(self.train_set, MixtureWindows):
            items = range(position, position + samples)
        else:
            items = ResumableSampler(len(self.train_set), 1, seed=self.seed).indices(position, samples)
        return sum(targets_of(self.train_set[i]) for i in items)

    def packing(self) -> Optional[Packing]:
        """How the LightningModule reads the rows' documents (after `setup`: the tokenizer's EOS); None without
        `document_mask`. Conversations packed into rows (chat data, `packed`) are always masked: from their starts."""
        if not (self.document_mask or (self.flagged and self.packed)):
            return None
        if self.tokenizer is None or self.tokenizer.eos_id is None:
            raise ConfigError("data.init_args.document_mask needs the tokenizer's EOS id, known after setup; the "
                              "tokenizer has none")
        return Packing(self.tokenizer.eos_id, self.position_reset, starts=self.flagged)

    def _check_model_vocabulary(self) -> None:
        model_config = getattr(getattr(self.trainer, "lightning_module", None), "config", None)
        if model_config is not None:
            check_vocabulary(self.tokenizer, model_config.vocab_size)

    def _setup_mixture(self) -> None:
        """Train: the sources' windows mixed by weight (`MixtureWindows`); val: each source's held-out windows, a
        whole number of global batches each, so every validation batch comes from one source."""
        folders = self.prepared
        self.tokenizer = self.given_tokenizer or folders[0].tokenizer()
        self._check_model_vocabulary()
        dp, _ = self._dp()
        per_batch = self.batch_size * dp
        trains, vals = [], []
        flagged = not self.packed or any(folder.flagged for folder in folders)
        for (name, path, _), folder in zip(self.source_specs, folders):
            train, val = (self._windows(folder.parts(split), folder.flag_parts(split)) if flagged else
                          ShardWindows(folder.parts(split), self.seq_len) for split in ("train", "val"))
            for split, ds in (("train", train), ("val", val)):
                if len(ds) < per_batch:
                    raise ConfigError(f"source {name} ({path}) has {len(ds)} {split} windows of seq_len "
                                      f"{self.seq_len} ({ds.n_tokens} tokens), fewer than one batch of "
                                      f"{self.batch_size} x {dp} data-parallel ranks (data.init_args.sources); lower "
                                      "batch_size or seq_len, or prepare it with more data (or a larger "
                                      "--val_fraction)")
            trains.append(train)
            vals.append(val)
        weights = [w for _, _, w in self.source_specs]
        if abs(sum(weights) - 1) > 1e-9:
            log("source weights normalised to sum to 1: " + ", ".join(
                f"{name} {w / sum(weights):.4g}" for (name, _, _), w in zip(self.source_specs, weights)))
        self.train_set = MixtureWindows(trains, weights, self.seed)
        # validation: one loader per source (Lightning applies limit_val_batches to each), whole global batches
        self.val_sources = [Subset(v, range(len(v) // per_batch * per_batch)) for v in vals]
        # the offline tools' one split (scripts/ptq.py, predict): the sources' batches taken in turn
        starts = np.cumsum([0] + [len(v) for v in self.val_sources])
        turns = [(s, b) for b in range(max(len(v) // per_batch for v in vals)) for s in range(len(vals))
                 if b < len(vals[s]) // per_batch]
        self.val_set = Subset(ConcatDataset(self.val_sources), [int(starts[s]) + b * per_batch + j for s, b in turns
                                                                for j in range(per_batch)])

    def val_source(self, dataloader_idx: int) -> Optional[str]:
        """The source whose validation loader is `dataloader_idx` (a mixture's), else None."""
        return self.source_specs[dataloader_idx][0] if self.val_sources else None

    # -- loaders -------------------------------------------------------------------------------------------
    def _dp(self) -> tuple[int, int]:
        """(DP size, DP rank) from the strategy: TP/PP peers of one replica must see the same batch."""
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) if self.trainer else None
        if not kwargs:
            return 1, 0
        return kwargs["num_replicas"], kwargs["rank"]

    def _loader(self, dataset: Dataset, sampler: ResumableSampler, kind: type[DataLoader] = DataLoader) -> DataLoader:
        return kind(dataset, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers,
                    pin_memory=torch.cuda.is_available(), persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> "PositionedLoader":
        size, rank = self._dp()
        # Rebase: consumed = base samples + (batches processed since now) × B × R, with B × R of this run.
        if self._resumed_samples is not None:  # Lightning has restored its batch counter by now
            self._base_samples, self._resumed_samples = self._resumed_samples, None
        else:
            self._base_samples = self.samples_consumed()
        self._base_batches = self._batches_processed()
        if self.stream is not None:
            self.train_set = StreamBatches(self.stream, self.tokenizer, self.seq_len, self.batch_size, size, rank,
                                           self.text_field, self._stream_position(self._base_samples))
            return PositionedLoader(self.train_set, batch_size=None, num_workers=0)
        kind = PositionSampler if isinstance(self.train_set, MixtureWindows) else ResumableSampler
        sampler = kind(len(self.train_set), self.batch_size, size, rank, seed=self.seed, start=self._base_samples)
        return self._loader(self.train_set, sampler, PositionedLoader)

    def _eval_loader(self, dataset: Dataset) -> DataLoader:
        size, rank = self._dp()
        return self._loader(dataset, ResumableSampler(len(dataset), self.batch_size, size, rank, shuffle=False,
                                                      advance=False))

    def val_dataloader(self) -> Union[DataLoader, list[DataLoader]]:
        """The held-out windows; a mixture's as one loader per source (`val_source` names it), so that
        limit_val_batches gives every source the same number of batches."""
        if self.stream is not None:  # a stream has no held-out split: no validation
            return []
        return [self._eval_loader(v) for v in self.val_sources] if self.val_sources else self._eval_loader(self.val_set)

    def test_dataloader(self) -> Union[DataLoader, list[DataLoader]]:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return [] if self.stream is not None else self._eval_loader(self.val_set)

    # -- resumable position --------------------------------------------------------------------------------
    def _batches_processed(self) -> int:
        """Training batches processed since the run began (Lightning restores this counter on resume)."""
        if self.trainer is None:
            return 0
        return self.trainer.fit_loop.epoch_loop.batch_progress.total.processed

    def samples_consumed(self) -> int:
        """Global samples consumed since the run began, counted across resumes with any DP sizes."""
        size, _ = self._dp()
        return self._base_samples + (self._batches_processed() - self._base_batches) * self.batch_size * size

    def state_dict(self) -> dict[str, Any]:
        """The data position, and the tokenizer, so that every checkpoint can be decoded on its own."""
        state: dict[str, Any] = {"samples_consumed": self.samples_consumed()}
        if self.tokenizer is not None:
            state["tokenizer"] = self.tokenizer.state_dict()
        if self.stream is not None:
            state["stream"] = self._stream_position(state["samples_consumed"])
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resumed_samples = int(state["samples_consumed"])
        self._resumed_stream = state.get("stream")

    def _stream_position(self, samples: int) -> Optional[dict[str, Any]]:
        """Where a stream source's global window `samples` begins (None: at the start)."""
        if self._resumed_stream is not None and int(self._resumed_stream["window"]) == samples:
            return self._resumed_stream
        if isinstance(self.train_set, StreamBatches):
            return self.train_set.position_at(samples)
        if samples:
            raise ConfigError(f"the checkpoint holds no stream position for sample {samples} (data.init_args.sources):"
                              " it was not saved by a run reading this stream")
        return None


class PositionedLoader(DataLoader):
    """The train loader. Its position is the data module's (`samples_consumed`, saved with the data module's state,
    given to the sampler when the loader is made), so it has nothing of its own to save; having the `state_dict` /
    `load_state_dict` pair tells Lightning that a mid-epoch resume is exact, instead of warning that the loader is
    "not resumable"."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to load: the data module's own state has placed the sampler."""


def _write_chat_tokens(rows: list[dict[str, Any]], tokenizer: Tokenizer, cache: Path) -> None:
    """Encode chat rows (`lit_lm.data.chat`) into tokens.bin and their flags into flags.bin; tokens.json last."""
    encoder = ChatEncoder(tokenizer, "data.init_args.files")
    out = TokenFile(cache / "tokens.bin", token_dtype(tokenizer.vocab_size))
    flags = TokenFile(cache / "flags.bin", np.dtype(np.uint8))
    conversations = 0
    try:
        for ids, row_flags in encoder.encode_rows(rows):
            out.append(ids)
            flags.append(row_flags)
            conversations += 1
    except BaseException:
        out.discard()
        flags.discard()
        raise
    out.close()
    flags.close()
    meta = {"n_tokens": out.n_tokens, "dtype": out.dtype.name, "max_id": out.max_id, "documents": conversations,
            "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "flags": True}
    (cache / "tokens.json").write_text(json.dumps(meta, indent=1))
    log(f"tokenized {conversations} conversations into {out.n_tokens:,} tokens ({cache})")


def _write_tokens(corpus: Corpus, tokenizer: Tokenizer, cache: Path, workers: int) -> None:
    """Encode the corpus's documents (`document_ids`: [BOS] + text + [EOS]) into tokens.bin a batch of text at a
    time (`lit_lm.data.token_file`: memory bounded by one batch, not the corpus); tokens.json is written last, as the
    marker."""
    from rich.progress import Progress

    out = TokenFile(cache / "tokens.bin", token_dtype(tokenizer.vocab_size))
    documents = corpus.documents(cut=cuttable(tokenizer.special_tokens))
    try:
        with Progress(transient=True, disable=not _is_tty()) as progress:
            task = progress.add_task("tokenizing", total=corpus.chars)
            for ids, _, chars in encode_documents(tokenizer, documents, workers, batch_chars(tokenizer, workers)):
                out.append(ids)
                progress.advance(task, chars)
    except BaseException:
        out.discard()
        raise
    out.close()
    meta = {"n_tokens": out.n_tokens, "dtype": out.dtype.name, "max_id": out.max_id, "documents": len(corpus),
            "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}
    (cache / "tokens.json").write_text(json.dumps(meta, indent=1))
    log(f"tokenized {len(corpus)} documents into {out.n_tokens:,} tokens ({cache})")


def _is_tty() -> bool:
    import sys

    return sys.stderr.isatty()
