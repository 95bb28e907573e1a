"""Byte-level BPE: round trips, special tokens, training vs a brute-force reference, streaming, save/load."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import regex

from lit_lm.data.tokenizer import bpe as tokenizer_module
from lit_lm.data.tokenizer import EOT, BPETokenizer

# The spec's pattern, copied rather than imported so the reference below is independent of the module.
PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. They're sure it'll rain; we've seen it, I'd say.\n",
    "def add(a, b):\n    return a + b\n\n\nclass Foo:\n    pass\n" * 3,
    "Numbers 12345 and 2024-01-01, price $9.99!!! 100% ok?\t\ttabs  and   spaces   \n",
    "naïve café façade — «quotes» ünïcödé; 日本語のテキストです。中文文本。한국어 텍스트.\n",
    "emoji 🙂🙂 👍🏽 👨‍👩‍👧 flags 🇫🇷🇩🇪 and combining e\u0301 a\u0308 o\u0302\u0323\n",
    "aaaaaaa bbbb aaaa abab baba " * 5 + EOT + " after the end of text " + EOT + EOT,
]

# Code point ranges to draw random strings from: ASCII, whitespace, Latin-1, combining marks, Greek/Cyrillic,
# Arabic, Devanagari, CJK, Hangul, emoji, modifiers/ZWJ, private use, supplementary planes.
RANGES = [
    (0x20, 0x7E), (0x09, 0x0D), (0x00, 0x1F), (0xA0, 0xFF), (0x300, 0x36F), (0x370, 0x4FF), (0x600, 0x6FF),
    (0x900, 0x97F), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x1F3FB, 0x1F3FF),
    (0x200B, 0x200D), (0x2000, 0x200A), (0x3000, 0x3000), (0xE000, 0xE0FF), (0x10000, 0x1FFFF),
    (0x20000, 0x2A6DF),
]
PIECES = [EOT, "<|endoftext", "<|", "|>", "'re", "'ll", " '", "\r\n", "   ", "\n\n", " x", "''"]


def random_text(rng: random.Random, length: int) -> str:
    out = []
    while len(out) < length:
        if rng.random() < 0.1:
            out.append(rng.choice(PIECES))
        else:
            lo, hi = rng.choice(RANGES)
            out.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 6))))
    return "".join(out)


@pytest.fixture(scope="module")
def tok() -> BPETokenizer:
    return BPETokenizer.train(CORPUS, vocab_size=256 + 200 + 1)


# ---- reference implementation: re-count every pair after every merge ----

def reference_words(texts: list[str], special_tokens: list[str]) -> Counter:
    split = regex.compile("|".join(regex.escape(t) for t in sorted(special_tokens, key=len, reverse=True)))
    words: Counter = Counter()
    for text in texts:
        for piece in split.split(text) if special_tokens else [text]:
            words.update(tuple(w.encode("utf-8")) for w in PATTERN.findall(piece))
    return words


def reference_merge(word: tuple[int, ...], pair: tuple[int, int], new_id: int) -> tuple[int, ...]:
    out, i = [], 0
    while i < len(word):
        if word[i:i + 2] == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def reference_train(texts: list[str], vocab_size: int, special_tokens: list[str]) -> list[tuple[int, int]]:
    words = reference_words(texts, special_tokens)
    vocab = {i: bytes([i]) for i in range(256)}
    merges: list[tuple[int, int]] = []
    while 256 + len(merges) + len(special_tokens) < vocab_size:
        pairs: Counter = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], vocab[p[0]], vocab[p[1]], -p[0], -p[1]))
        new_id = 256 + len(merges)
        merges.append(best)
        vocab[new_id] = vocab[best[0]] + vocab[best[1]]
        words = Counter({reference_merge(w, best, new_id): c for w, c in words.items()})
    return merges


def reference_encode(tok: BPETokenizer, text: str) -> list[int]:
    """Apply every merge in training order to each pre-token (no ranks, no cache)."""
    ids = []
    for part in regex.split("(" + regex.escape(EOT) + ")", text):
        if part == EOT:
            ids.append(tok.eos_id)
            continue
        for word in PATTERN.findall(part):
            w = tuple(word.encode("utf-8"))
            for rank, pair in enumerate(tok.merges):
                w = reference_merge(w, pair, 256 + rank)
            ids.extend(w)
    return ids


# ---- training ----

def test_training_matches_bruteforce_reference():
    merges = BPETokenizer.train(CORPUS, vocab_size=256 + 300 + 1).merges
    assert merges == reference_train(CORPUS, 256 + 300 + 1, [EOT])


def test_ties_break_to_the_lexicographically_greatest_pair():
    texts = ["ab", "ba", "cd", "dc", "xy", "yx", "zz", "yy"]  # every pair is seen once
    tok = BPETokenizer.train(texts, vocab_size=256 + 12, special_tokens=[])
    assert tok.merges == reference_train(texts, 256 + 12, [])
    assert tok.token_bytes(256) == b"zz"  # greatest of the count-1 pairs


def test_training_is_deterministic_and_stops_when_pairs_run_out():
    a = BPETokenizer.train(CORPUS, vocab_size=400)
    b = BPETokenizer.train(list(reversed(CORPUS)), vocab_size=400)
    assert a.merges == b.merges
    tiny = BPETokenizer.train(["abab"], vocab_size=10_000)
    assert [tiny.token_bytes(i) for i in range(256, 256 + len(tiny.merges))] == [b"ab", b"abab"]
    assert tiny.vocab_size == 256 + 2 + 1 and tiny.eos_id == 258


def test_multiprocess_training_matches_single_process(monkeypatch):
    monkeypatch.setattr(tokenizer_module, "_BATCH_CHARS", 200)  # several tasks, so both workers get some
    texts = CORPUS * 3
    single = BPETokenizer.train(texts, vocab_size=500, num_workers=1)
    multi = BPETokenizer.train(texts, vocab_size=500, num_workers=2)
    assert multi.merges == single.merges


def test_encode_batch_in_worker_processes_matches_encode(tok, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "_BATCH_CHARS", 200)  # several tasks, so both workers get some
    monkeypatch.setattr(tokenizer_module, "PARALLEL_CHARS", 800)
    rng = random.Random(11)
    texts = CORPUS + [random_text(rng, rng.randint(0, 80)) for _ in range(40)]
    assert sum(map(len, texts)) > 800  # enough text for the process pool
    assert tok.encode_batch(texts, num_workers=2) == [tok.encode(t) for t in texts]


def test_train_from_files_matches_training_on_whole_texts(tmp_path):
    paths = []
    for i, text in enumerate(CORPUS):
        paths.append(tmp_path / f"doc{i}.txt")
        paths[-1].write_bytes(text.encode("utf-8"))
    expected = BPETokenizer.train(CORPUS, vocab_size=450).merges
    assert BPETokenizer.train_from_files(paths, vocab_size=450, chunk_chars=7).merges == expected


def test_encode_applies_merges_in_training_order(tok):
    rng = random.Random(0)
    for text in CORPUS + [random_text(rng, 80) for _ in range(30)]:
        assert tok.encode(text) == reference_encode(tok, text)


# ---- codec ----

def test_round_trip_random_unicode(tok):
    rng = random.Random(1234)
    for _ in range(300):
        text = random_text(rng, rng.randint(0, 60))
        assert tok.decode(tok.encode(text)) == text


def test_round_trip_untrained_and_without_special_tokens():
    rng = random.Random(7)
    for tok in (BPETokenizer([]), BPETokenizer([], special_tokens=[])):
        for _ in range(50):
            text = random_text(rng, 40)
            assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_single_ids_and_never_merged_across():
    texts = ["hello" + EOT] * 50 + [EOT + "hello" + EOT + EOT]
    tok = BPETokenizer.train(texts, vocab_size=1000)
    learned = [tok.token_bytes(i) for i in range(256, 256 + len(tok.merges))]
    assert learned and all(t in b"hello" for t in learned)  # nothing spans "o<|..." or "...|>h"
    assert tok.encode(EOT) == [tok.eos_id]
    ids = tok.encode("hello" + EOT + EOT + "hello")
    assert ids.count(tok.eos_id) == 2 and tok.decode(ids) == "hello" + EOT + EOT + "hello"
    assert tok.eos_id not in tok.encode("<|endoftext|")  # an incomplete special token is plain text
    assert tok.special_tokens == {EOT: tok.vocab_size - 1}


def test_longest_special_token_wins():
    tok = BPETokenizer([], special_tokens=["<s>", "<s><s>"])
    assert tok.encode("<s><s><s>") == [257, 256]
    assert BPETokenizer([], special_tokens=[]).eos_id is None


def test_encode_iterable_matches_encode_across_chunk_boundaries():
    specials = [EOT, "<|im|>", "<s>", "<s>>", "aa", "ab"]  # overlapping / prefix-of-another special tokens
    tokenizers = [
        BPETokenizer.train(CORPUS, vocab_size=500),
        BPETokenizer.train(CORPUS, vocab_size=500, special_tokens=specials),
        BPETokenizer.train(CORPUS, vocab_size=500, special_tokens=[]),
    ]
    rng = random.Random(99)
    pieces = PIECES + ["<s>", "<s>>", "<|im|>", "a", "b", " ", "\t", "\n", "'", "l", "r", "e", "x", "1", "!"]
    for _ in range(150):
        text = "".join(rng.choice(pieces) if rng.random() < 0.7 else random_text(rng, 3) for _ in range(40))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 25))))
        chunks = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        for tok in tokenizers:
            assert list(tok.encode_iterable(chunks)) == tok.encode(text)
    tok = tokenizers[0]
    text = "".join(CORPUS)
    assert list(tok.encode_iterable(text)) == tok.encode(text)  # one character at a time
    assert list(tok.encode_iterable(text.splitlines(keepends=True))) == tok.encode(text)


# ---- save / load ----

def test_save_load_round_trip(tok, tmp_path):
    path = tok.save(tmp_path / "tok")
    state = json.loads(path.read_text(encoding="utf-8"))
    assert state["format"] == "lit-lm-bpe" and state["version"] == 1 and state["vocab_size"] == tok.vocab_size
    loaded = BPETokenizer.load(tmp_path / "tok")
    assert loaded.merges == tok.merges and loaded.special_tokens == tok.special_tokens
    rng = random.Random(5)
    for text in CORPUS + [random_text(rng, 50) for _ in range(20)]:
        assert loaded.encode(text) == tok.encode(text)


# ---- errors ----

def test_error_messages(tmp_path):
    with pytest.raises(ValueError, match=r"vocab_size=200 is too small.*256 \(bytes\) \+ 1"):
        BPETokenizer.train(CORPUS, vocab_size=200)
    with pytest.raises(ValueError, match="vocab_size=257 is too small"):
        BPETokenizer.train(CORPUS, vocab_size=257, special_tokens=[EOT, "<pad>"])
    for empty in ([], [""], [EOT, EOT + EOT]):
        with pytest.raises(ValueError, match="training corpus is empty"):
            BPETokenizer.train(empty, vocab_size=300)
    with pytest.raises(TypeError, match=r"pass \[text\]"):
        BPETokenizer.train("a single string", vocab_size=300)
    with pytest.raises(TypeError, match=r"pass \['<\|endoftext\|>'\]"):
        BPETokenizer.train(CORPUS, vocab_size=300, special_tokens=EOT)
    with pytest.raises(TypeError, match="got one path"):
        BPETokenizer.train_from_files(tmp_path / "corpus.txt", vocab_size=300)
    with pytest.raises(ValueError, match="num_workers"):
        BPETokenizer.train(CORPUS, vocab_size=300, num_workers=0)
    with pytest.raises(ValueError, match="no tokenizer in .*tokenizer.json does not exist"):
        BPETokenizer.load(tmp_path)
    with pytest.raises(ValueError, match="distinct non-empty"):
        BPETokenizer([], special_tokens=[EOT, EOT])
    with pytest.raises(ValueError, match=r"merge 0 = \(256, 1\)"):
        BPETokenizer([(256, 1)])
    with pytest.raises(ValueError, match=r"merge 1 = \(97, 98\) repeats merge 0"):
        BPETokenizer([(97, 98), (97, 98)])
    tok = BPETokenizer([(97, 98)])
    with pytest.raises(ValueError, match=r"token id 258 is out of range .*vocab_size=258"):
        tok.decode([97, 258])
    with pytest.raises(ValueError, match="token id -1 is out of range"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="token id 1000 is out of range"):
        tok.token_bytes(1000)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"format": "other", "version": 1}))
    with pytest.raises(ValueError, match="not a lit-lm-bpe v1 file"):
        BPETokenizer.load(tmp_path)
