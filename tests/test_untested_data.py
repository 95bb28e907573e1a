"""Data paths no earlier test reached (issue #55, item 4), each checked with a one-line mutant:

- windows of a token array or a prepared shard whose length is a multiple of seq_len (or one more): the last
  whole window is read, none is short, none that fits is dropped;
- a mixture source read into its second epoch is reshuffled (a new permutation per epoch, the same for the same
  seed);
- a stream resumed at a start the world size does not divide: each rank takes exactly its windows, together
  every window once.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_data_mixture import FakeTrainer, words
from test_stream import B, SEQ, make_dm, shards, take  # noqa: F401  (shards: the fixture)

from lit_lm.data.datamodule import TextDataModule, TokenWindows
from lit_lm.data.mixture import MixtureWindows, ShardWindows
from lit_lm.data.prepare import PreparedSource, prepare
from lit_lm.data.stream import rank_batches
from lit_lm.data.tokenizer import BPETokenizer


# -- a: the last window ------------------------------------------------------------------------------------------
def windows_of(kind: str, tokens: np.ndarray, seq_len: int):
    return TokenWindows(tokens, seq_len) if kind == "token file" else ShardWindows([tokens], seq_len)


@pytest.mark.parametrize("kind", ["token file", "shard"])
@pytest.mark.parametrize("seq_len", [3, 8])
@pytest.mark.parametrize("extra", [-1, 0, 1, 2])  # length k * seq_len + extra
def test_the_last_whole_window_is_read_and_none_is_short(kind, seq_len, extra):
    n = 5 * seq_len + extra
    tokens = np.arange(100, 100 + n, dtype=np.uint16)
    ds = windows_of(kind, tokens, seq_len)
    got = [ds[i].tolist() for i in range(len(ds))]
    assert all(w == list(range(100 + i * seq_len, 100 + i * seq_len + seq_len + 1)) for i, w in enumerate(got))
    unread = n - (len(got) - 1) * seq_len - (seq_len + 1)  # tokens after the last window
    assert 0 <= unread < seq_len, (n, len(got))  # no short window; no whole window left out
    if extra == 1:
        assert got[-1][-1] == tokens[-1]  # k * seq_len + 1 tokens: the last window ends on the last token


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("exact")
    BPETokenizer.train([words(200, 99)], 280).save_hf(root / "tok")
    (root / "text.txt").write_text(words(400, 5))
    return root


def prepare_with_train_tokens(root: Path, train_tokens: int, out: str) -> list[np.ndarray]:
    """The text prepared as one shard whose train split is `train_tokens` long (its val_fraction chosen so)."""
    args = [str(root / "text.txt")], str(root / "tok")
    total = prepare(*args, str(root / "probe"), val_fraction=0.2, progress=False)["tokens"]
    prepare(*args, str(root / out), val_fraction=(total - train_tokens) / total, progress=False)
    train = PreparedSource(root / out).parts("train")
    assert [len(p) for p in train] == [train_tokens]
    return train


@pytest.mark.parametrize("extra", [0, 1])
def test_a_prepared_shard_of_a_multiple_of_seq_len_serves_its_last_window(text, extra):
    """A shard whose train split is k * seq_len (+ 1) tokens: a pass of the data module's train loader serves every
    window of it, the last one included, each seq_len + 1 tokens."""
    seq_len, k = 8, 200
    (train,) = prepare_with_train_tokens(text, k * seq_len + extra, f"src{extra}")
    dm = TextDataModule(sources=[{"path": str(text / f"src{extra}")}], seq_len=seq_len, batch_size=1)
    dm.trainer = FakeTrainer(1, 0)
    dm.setup("fit")
    assert len(dm.train_set) == (k if extra else k - 1)
    loader = iter(dm.train_dataloader())
    served = {tuple(next(loader)[0].tolist()) for _ in range(len(dm.train_set))}  # one epoch: each window once
    want = {tuple(train[i * seq_len: i * seq_len + seq_len + 1].astype(np.int64).tolist())
            for i in range(len(dm.train_set))}
    assert served == want and {len(w) for w in served} == {seq_len + 1}
    if extra:
        assert tuple(train[-seq_len - 1:].tolist()) in served  # the shard's last token is read


# -- b: a mixture source's second epoch ----------------------------------------------------------------------------
def source_epochs(seed: int, epochs: int = 4) -> list[list[int]]:
    """The windows of the small source of a 50/50 mixture, in stream order, cut into its epochs."""
    big = ShardWindows([np.arange(8 * 60 + 1, dtype=np.uint16)], 8)
    small = ShardWindows([np.arange(8 * 10 + 1, dtype=np.uint16)], 8)  # 10 windows: an epoch every ~20 positions
    mix = MixtureWindows([big, small], [0.5, 0.5], seed)
    order = [w for s, w in (mix.locate(p) for p in range(2 * 10 * epochs + 1)) if s == 1]
    return [order[e * 10: (e + 1) * 10] for e in range(epochs)]


def test_a_mixture_source_is_reshuffled_in_each_epoch():
    epochs = source_epochs(seed=3)
    assert all(sorted(e) == list(range(10)) for e in epochs)  # each epoch: every window once
    assert all(a != b for a, b in zip(epochs, epochs[1:])), epochs  # a new order per epoch
    assert source_epochs(seed=3) == epochs  # the same for the same seed
    assert source_epochs(seed=4) != epochs


# -- c: a stream resumed at a start the world size does not divide -------------------------------------------------
def test_rank_batches_from_an_odd_start():
    """rank_batches alone, start 7 on 3 ranks of 2 windows: rank r's batch k is windows 7 + r + 3 (2k + j)."""
    per_rank = []
    for rank in range(3):
        windows = ((p, np.full(2, p), {"window": p}) for p in range(7, 100))
        batches = [(b[:, 0].tolist(), p) for b, p, _ in rank_batches(windows, 7, 2, 3, rank)][:4]
        assert [p for _, p in batches] == [13, 19, 25, 31]  # the next global window after each batch
        assert [b for b, _ in batches] == [[7 + rank + 3 * (2 * k + j) for j in range(2)] for k in range(4)]
        per_rank.append([w for b, _ in batches for w in b])
    assert sorted(w for r in per_rank for w in r) == list(range(7, 31))  # every window once, none twice


def test_a_stream_resumed_at_a_start_the_world_size_does_not_divide(shards):  # noqa: F811
    whole = torch.cat(take(make_dm(shards), 12))  # one rank, uninterrupted: windows 0..23
    dm = make_dm(shards)
    take(dm, 2)  # 4 windows consumed on one rank; resumed on 3 ranks: 4 % 3 != 0
    state = json.loads(json.dumps({k: dm.state_dict()[k] for k in ("samples_consumed", "stream")}))
    assert state["samples_consumed"] == 4
    got = []
    for rank in range(3):
        resumed = make_dm(shards, 3, rank)
        resumed.load_state_dict(state)
        rows = torch.cat(take(resumed, 3))  # 3 batches of B
        assert torch.equal(rows, whole[[4 + rank + 3 * i for i in range(3 * B)]]), rank
        got.append(rows)
    merged = torch.stack([got[i % 3][i // 3] for i in range(9 * B)])  # back in global order
    assert torch.equal(merged, whole[4: 4 + 9 * B]) and merged.shape[1] == SEQ + 1
