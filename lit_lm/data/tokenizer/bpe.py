"""Byte-level BPE tokenizer (GPT-2 style): a trainer and an encoder/decoder, lit-lm's own `Tokenizer`.

Ids: 0..255 are the single bytes, merge i creates id 256 + i, and the special tokens take the ids after the
merges, in the order given. Text is first split at special tokens (they are never merged with their
neighbours), then pre-tokenized with the GPT-2 regex; merges never cross pre-token boundaries.

Saved as one human-readable JSON file, `tokenizer.json` (see `BPETokenizer.save`; `lit_lm.data.tokenizer.load_tokenizer`
tells it from a Hugging Face `tokenizer.json` by its "format" key), or in the `tokenizers` library's format for
`transformers` (`BPETokenizer.save_hf`: the same ids for every text).
"""

from __future__ import annotations

import codecs
import heapq
import itertools
import json
import multiprocessing
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

import regex

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"
FILE_NAME = "tokenizer.json"
FORMAT = "lit-lm-bpe"
VERSION = 1

_PRETOKEN_RE = regex.compile(GPT2_PATTERN)
# The GPT-2 pattern makes a newline that is followed by a non-space character a pre-token of its own (only a
# literal " " may prefix a word; a whitespace run stops before its last character), so text can be cut just
# before such a newline without changing the pre-tokens.
_LAST_NEWLINE_BEFORE_NONSPACE = regex.compile(r"\n(?=\S)", regex.REVERSE)
_BATCH_CHARS = 1 << 20  # text per pre-tokenization task: large enough to amortize pickling
_CACHE_SIZE = 1 << 17  # pre-token -> ids entries kept by the encoder before the cache is cleared
# Text below which encode_batch stays in one process: the stdlib's 4 MB took 8 s in one, 70 s in two (2 loaded cores)
PARALLEL_CHARS = 32 << 20


def _special_split_re(special_tokens: Iterable[str]) -> Optional[regex.Pattern]:
    """A pattern that splits text at special tokens; longest first, so a token that extends another wins."""
    tokens = sorted(special_tokens, key=len, reverse=True)
    return regex.compile("(" + "|".join(regex.escape(t) for t in tokens) + ")") if tokens else None


def _check_special_tokens(special_tokens: Sequence[str]) -> list[str]:
    if isinstance(special_tokens, str):
        raise TypeError(f"special_tokens must be a list of strings, got one str: pass [{special_tokens!r}]")
    if len(set(special_tokens)) != len(special_tokens) or "" in special_tokens:
        raise ValueError(f"special_tokens must be distinct non-empty strings, got {list(special_tokens)}")
    return list(special_tokens)


def _merge_pair(ids: list[int], a: int, b: int, new_id: int) -> list[int]:
    """Replace every non-overlapping occurrence of (a, b), left to right, by new_id."""
    out, i, n = [], 0, len(ids)
    while i < n:
        if i + 1 < n and ids[i] == a and ids[i + 1] == b:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def _descending_key(token: bytes) -> tuple[int, ...]:
    """A key that sorts byte strings in *descending* order, so heapq (a min-heap) pops ties as the
    lexicographically greatest pair, as in GPT-2. The trailing 256 puts a prefix after its extensions."""
    return tuple(255 - x for x in token) + (256,)


def _count_pretokens(pieces: list[str]) -> Counter:
    """Pre-token -> count over text pieces that contain no special tokens (runs in a worker process)."""
    counts: Counter = Counter()
    for piece in pieces:
        counts.update(_PRETOKEN_RE.findall(piece))
    return counts


def _batches(texts: Iterable[str], special_re: Optional[regex.Pattern]) -> Iterator[list[str]]:
    """Split each text at special tokens and group the pieces into ~_BATCH_CHARS tasks for the workers."""
    batch, size = [], 0
    for text in texts:
        for piece in special_re.split(text)[::2] if special_re else [text]:
            batch.append(piece)
            size += len(piece)
            if size >= _BATCH_CHARS:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def _word_counts(texts: Iterable[str], special_tokens: Sequence[str], num_workers: int) -> Counter:
    """Count the pre-tokens of a corpus, in `num_workers` processes (1 = inline, no pool; nor for a corpus of one
    task: starting the spawned processes costs seconds of imports, far more than counting ~1 MB of text)."""
    batches = _batches(texts, _special_split_re(special_tokens))
    first = list(itertools.islice(batches, 2))
    batches = itertools.chain(first, batches)
    counts: Counter = Counter()
    if num_workers == 1 or len(first) < 2:
        for batch in batches:
            counts.update(_count_pretokens(batch))
        return counts
    # spawn, not fork: safe when the parent already runs threads (Lightning, torch, CUDA)
    with multiprocessing.get_context("spawn").Pool(num_workers) as pool:
        for batch_counts in pool.imap(_count_pretokens, batches):
            counts.update(batch_counts)
    return counts


def _learn_merges(word_counts: dict[bytes, int], num_merges: int) -> list[tuple[int, int]]:
    """BPE on a word -> count table with incremental pair counts.

    A merge only revisits the words that contain the merged pair (found through `where`), and the best pair
    comes from a max-heap with lazy invalidation: an entry is stale when its count no longer matches.
    Ties: highest count, then the lexicographically greatest (bytes(left), bytes(right)), then smallest ids.
    """
    words = [list(w) for w in word_counts]
    counts = list(word_counts.values())
    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    where: dict[tuple[int, int], set[int]] = defaultdict(set)
    for wid, word in enumerate(words):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += counts[wid]
            where[pair].add(wid)
    vocab = [bytes([i]) for i in range(256)]
    keys = [_descending_key(t) for t in vocab]
    heap = [(-c, keys[a], keys[b], a, b) for (a, b), c in pair_counts.items()]
    heapq.heapify(heap)

    merges: list[tuple[int, int]] = []
    while len(merges) < num_merges and heap:
        neg_count, _, _, a, b = heapq.heappop(heap)
        if pair_counts.get((a, b)) != -neg_count:
            continue  # stale entry: the pair's count changed after it was pushed
        new_id = len(vocab)
        merges.append((a, b))
        vocab.append(vocab[a] + vocab[b])
        keys.append(_descending_key(vocab[-1]))

        delta: dict[tuple[int, int], int] = defaultdict(int)
        for wid in where.pop((a, b)):
            old, new, count = words[wid], _merge_pair(words[wid], a, b, new_id), counts[wid]
            old_pairs, new_pairs = list(zip(old, old[1:])), list(zip(new, new[1:]))
            for pair in old_pairs:
                delta[pair] -= count
            for pair in new_pairs:
                delta[pair] += count
                where[pair].add(wid)
            for pair in set(old_pairs).difference(new_pairs):
                where[pair].discard(wid)
            words[wid] = new
        for pair, d in delta.items():
            if d == 0:
                continue
            pair_counts[pair] += d
            if pair_counts[pair] > 0:
                heapq.heappush(heap, (-pair_counts[pair], keys[pair[0]], keys[pair[1]], *pair))
            else:
                del pair_counts[pair]
                where.pop(pair, None)
    return merges


def _read_file_chunks(path: str | os.PathLike, chunk_chars: int, cuttable: bool) -> Iterator[str]:
    """Yield a file's text in ~chunk_chars pieces, each cut before a newline that precedes a non-space
    character, so that pre-tokenizing the pieces separately equals pre-tokenizing the whole file."""
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        rest = ""
        while block := f.read(chunk_chars):
            text = rest + block
            m = _LAST_NEWLINE_BEFORE_NONSPACE.search(text) if cuttable else None
            cut = m.start() if m else 0
            if cut:
                yield text[:cut]
            rest = text[cut:]
        yield rest


class BPETokenizer:
    """Byte-level BPE: `merges[i] = (left, right)` creates id 256 + i; special tokens follow the merges."""

    def __init__(self, merges: Sequence[tuple[int, int]], special_tokens: Sequence[str] = (EOT,)):
        special_tokens = _check_special_tokens(special_tokens)
        self._vocab = [bytes([i]) for i in range(256)]
        self._ranks: dict[tuple[int, int], int] = {}
        for rank, (a, b) in enumerate(merges):
            if not (0 <= a < len(self._vocab) and 0 <= b < len(self._vocab)):
                raise ValueError(f"merge {rank} = ({a}, {b}) refers to an id that does not exist yet "
                                 f"(ids 0..{len(self._vocab) - 1}): merges must be in creation order")
            if (a, b) in self._ranks:
                raise ValueError(f"merge {rank} = ({a}, {b}) repeats merge {self._ranks[(a, b)]}")
            self._ranks[(a, b)] = rank
            self._vocab.append(self._vocab[a] + self._vocab[b])
        self._special_ids = {t: len(self._vocab) + i for i, t in enumerate(special_tokens)}
        self._vocab += [t.encode("utf-8") for t in special_tokens]
        self._special_re = _special_split_re(special_tokens)
        self._cache: dict[str, list[int]] = {}

    # ---- training ----

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str] = (EOT,),
              num_workers: int = 1) -> BPETokenizer:
        """Learn merges from `texts` (each an independent document; pre-tokens never span two texts).

        vocab_size counts the 256 bytes, the merges and the special tokens; training stops early (a smaller
        vocabulary) when no pair of adjacent tokens is left. num_workers > 1 pre-tokenizes in a process pool.
        """
        if isinstance(texts, str):
            raise TypeError("texts must be an iterable of strings, got one str: pass [text]")
        special_tokens = _check_special_tokens(special_tokens)
        if vocab_size < 256 + len(special_tokens):
            raise ValueError(f"vocab_size={vocab_size} is too small: it must be at least 256 (bytes) + "
                             f"{len(special_tokens)} (special tokens) = {256 + len(special_tokens)}")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        word_counts = _word_counts(texts, special_tokens, num_workers)
        if not word_counts:
            raise ValueError("the training corpus is empty: texts contain no text outside special tokens; "
                             "pass non-empty texts (or paths to non-empty files)")
        word_counts = {w.encode("utf-8"): c for w, c in word_counts.items()}
        return cls(_learn_merges(word_counts, vocab_size - 256 - len(special_tokens)), special_tokens)

    @classmethod
    def train_from_files(cls, paths: Iterable[str | os.PathLike], vocab_size: int,
                         special_tokens: Sequence[str] = (EOT,), num_workers: int = 1,
                         chunk_chars: int = 1 << 20) -> BPETokenizer:
        """`train` on UTF-8 files (each one document), read in ~chunk_chars pieces so memory stays bounded
        and big files are spread over the workers. Same merges as training on the files' whole texts."""
        if isinstance(paths, (str, os.PathLike)):
            raise TypeError(f"paths must be an iterable of paths, got one path: pass [{str(paths)!r}]")
        cuttable = not any("\n" in t for t in special_tokens)  # a cut must never fall inside a special token
        texts = (chunk for path in paths for chunk in _read_file_chunks(path, chunk_chars, cuttable))
        return cls.train(texts, vocab_size, special_tokens, num_workers)

    # ---- properties ----

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def merges(self) -> list[tuple[int, int]]:
        return list(self._ranks)  # dicts keep insertion order, which is rank order

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special_ids)

    @property
    def eos_id(self) -> Optional[int]:
        """<|endoftext|>: it ends every document of the training stream (no BOS: see `bos_id`)."""
        return self._special_ids.get(EOT)

    @property
    def bos_id(self) -> Optional[int]:
        """None: documents are separated by <|endoftext|> alone, as in GPT-2."""
        return None

    def token_bytes(self, token_id: int) -> bytes:
        self._check_ids([token_id])
        return self._vocab[token_id]

    # ---- encoding ----

    def encode(self, text: str) -> list[int]:
        """Text -> ids. Any occurrence of a special token's string is encoded as that token's id."""
        ids: list[int] = []
        parts = self._special_re.split(text) if self._special_re else [text]
        for i, part in enumerate(parts):  # split with a capture group: odd parts are special tokens
            if i % 2:
                ids.append(self._special_ids[part])
            else:
                for word in _PRETOKEN_RE.findall(part):
                    ids.extend(self._encode_word(word))
        return ids

    def encode_batch(self, texts: Sequence[str], num_workers: int = 1) -> list[list[int]]:
        """`encode` of each text, in `num_workers` processes when there is enough text to pay for starting them
        (each imports lit-lm and starts with a cold cache: below PARALLEL_CHARS one process is faster)."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if num_workers == 1 or sum(map(len, texts)) < PARALLEL_CHARS:
            return [self.encode(text) for text in texts]
        groups, group, size = [], [], 0  # ~_BATCH_CHARS of text per task, in order
        for text in texts:
            group.append(text)
            size += len(text)
            if size >= _BATCH_CHARS:
                groups.append(group)
                group, size = [], 0
        groups += [group] if group else []
        with multiprocessing.get_context("spawn").Pool(num_workers, _start_encoder, (self.state_dict(),)) as pool:
            return [ids for done in pool.imap(_encode_group, groups) for ids in done]

    def encode_iterable(self, texts: Iterable[str]) -> Iterator[int]:
        """Stream ids for the concatenation of `texts` (e.g. the lines of a file), holding back only the
        tail that later text could still change; yields exactly `encode("".join(texts))`."""
        buffer = ""
        for text in texts:
            buffer += text
            # A suffix that is a proper prefix of a special token may still become one; special tokens that
            # start before it are final, and so is the plain text up to the last of them.
            pending = len(buffer) - self._longest_special_prefix_suffix(buffer)
            plain_start = self._end_of_final_specials(buffer, pending)
            yield from self.encode(buffer[:plain_start])
            # After it, the pre-tokens are final except the last two: a pre-token's end depends on at most
            # the next two characters ("'" + "l" may become "'ll"; "\t\n" + "\n" splits before a letter).
            # They are encoded from these matches, not re-split: a cut prefix could pre-tokenize differently.
            words = list(_PRETOKEN_RE.finditer(buffer, plain_start, max(plain_start, pending)))
            for word in words[:-2]:
                yield from self._encode_word(word.group())
            buffer = buffer[words[-2].start() if len(words) >= 2 else plain_start:]
        yield from self.encode(buffer)

    def _end_of_final_specials(self, buffer: str, pending: int) -> int:
        """End of the last special token that starts before `pending` (0 if none)."""
        end = 0
        for m in self._special_re.finditer(buffer) if self._special_re else ():
            if m.start() >= pending:
                break
            end = m.end()
        return end

    def _longest_special_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some special token."""
        longest = 0
        for token in self._special_ids:
            for k in range(min(len(token) - 1, len(text)), longest, -1):
                if text.endswith(token[:k]):
                    longest = k
                    break
        return longest

    def _encode_word(self, word: str) -> list[int]:
        """One pre-token -> ids: repeatedly merge the adjacent pair with the lowest rank (cached)."""
        cached = self._cache.get(word)
        if cached is not None:
            return cached
        ids = list(word.encode("utf-8"))
        while len(ids) > 1:
            pair = min(zip(ids, ids[1:]), key=lambda p: self._ranks.get(p, len(self._ranks)))
            rank = self._ranks.get(pair)
            if rank is None:
                break
            ids = _merge_pair(ids, *pair, 256 + rank)
        if len(self._cache) >= _CACHE_SIZE:
            self._cache.clear()
        self._cache[word] = ids
        return ids

    # ---- decoding ----

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text; byte sequences that are not valid UTF-8 (a cut multi-byte char) become U+FFFD."""
        ids = list(ids)
        self._check_ids(ids)
        return b"".join([self._vocab[i] for i in ids]).decode("utf-8", errors="replace")

    def stream(self, prompt_ids: Sequence[int] = ()) -> "ByteStream":
        """A decoder for ids generated one at a time after `prompt_ids` (whose text is not repeated)."""
        return ByteStream(self)

    def _check_ids(self, ids: list[int]) -> None:
        if ids and (min(ids) < 0 or max(ids) >= len(self._vocab)):
            bad = next(i for i in ids if not 0 <= i < len(self._vocab))
            raise ValueError(f"token id {bad} is out of range for this tokenizer (vocab_size={len(self._vocab)}, "
                             f"valid ids 0..{len(self._vocab) - 1}): were the ids made by another tokenizer?")

    # ---- save / load ----

    def state_dict(self) -> dict:
        """Everything `from_state_dict` needs, as plain types (kept inside every checkpoint)."""
        return {"format": FORMAT, "version": VERSION, "pattern": GPT2_PATTERN, "vocab_size": self.vocab_size,
                "special_tokens": self._special_ids, "merges": [f"{a} {b}" for a, b in self.merges]}

    @classmethod
    def from_state_dict(cls, state: dict, source: str = "the tokenizer state") -> BPETokenizer:
        if state.get("format") != FORMAT or state.get("version") != VERSION:
            raise ValueError(f"{source} is not a {FORMAT} v{VERSION} file (format={state.get('format')!r}, "
                             f"version={state.get('version')!r})")
        if state["pattern"] != GPT2_PATTERN:
            raise ValueError(f"{source} uses a different pre-tokenization pattern than this code supports")
        merges = [tuple(int(i) for i in m.split()) for m in state["merges"]]
        specials = sorted(state["special_tokens"], key=state["special_tokens"].__getitem__)
        tokenizer = cls(merges, specials)
        if tokenizer.special_tokens != state["special_tokens"]:
            raise ValueError(f"{source}: special token ids {state['special_tokens']} are not the ids after the "
                             f"merges ({tokenizer.special_tokens}); the file was edited or is corrupt")
        return tokenizer

    def save(self, directory: str | os.PathLike) -> Path:
        """Write `directory/tokenizer.json`: merges as "left right" id pairs (merge i creates id 256 + i),
        special tokens with their ids, and every token's text for reading (not used by `load`)."""
        path = Path(directory) / FILE_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {**self.state_dict(), "tokens": [t.decode("utf-8", errors="backslashreplace") for t in self._vocab]}
        path.write_text(json.dumps(state, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        return path

    def save_hf(self, directory: str | os.PathLike, **config: Any) -> None:
        """Write `tokenizer.json` in the `tokenizers` library's format and `tokenizer_config.json` (plus `config`),
        which `transformers.AutoTokenizer` loads to encode every text to this tokenizer's ids."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / FILE_NAME).write_text(json.dumps(self.hf_json(), ensure_ascii=False), encoding="utf-8")
        eos = EOT if self.eos_id is not None else None
        (directory / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eos, "eos_token": eos, "unk_token": None,
            "add_bos_token": False, "add_prefix_space": False, **config}, indent=1), encoding="utf-8")

    def hf_json(self) -> dict[str, Any]:
        """This tokenizer in the `tokenizers` library's format: the same ids, merges, pre-tokenizer regex and
        special tokens (byte-level BPE writes every byte as GPT-2's printable stand-in for it)."""
        alphabet = _byte_to_unicode()
        specials = self.special_tokens
        text = {i: "".join(alphabet[b] for b in self._vocab[i])
                for i in range(self.vocab_size) if i not in specials.values()}
        return {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for t, i in specials.items()],
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": GPT2_PATTERN}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {t: i for i, t in text.items()},
                      "merges": [[text[a], text[b]] for a, b in self.merges]},
        }

    @classmethod
    def load(cls, directory: str | os.PathLike) -> BPETokenizer:
        path = Path(directory) / FILE_NAME
        if not path.is_file():
            raise ValueError(f"no tokenizer in {directory}: {path} does not exist; pass the directory that "
                             "BPETokenizer.save() wrote (or train one with BPETokenizer.train)")
        return cls.from_state_dict(json.loads(path.read_text(encoding="utf-8")), str(path))


class ByteStream:
    """Text of ids arriving one at a time: a token may end inside a multi-byte character, whose bytes wait for the
    next token; `end` flushes what is left (an incomplete character becomes U+FFFD)."""

    def __init__(self, tokenizer: BPETokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def end(self) -> str:
        return self._utf8.decode(b"", final=True)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte, the alphabet of byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


_worker_tokenizer: Optional[BPETokenizer] = None  # one per encode_batch worker process


def _start_encoder(state: dict) -> None:
    global _worker_tokenizer
    _worker_tokenizer = BPETokenizer.from_state_dict(state)


def _encode_group(texts: list[str]) -> list[list[int]]:
    return [_worker_tokenizer.encode(text) for text in texts]
