"""A stream source (`lit_lm.data.stream`): shards read in order by a background worker, tokenized on the fly, served to
each rank with its position in the checkpoint; read errors and stalls are one-line data errors on that rank."""

import json
import time
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from test_data_mixture import FakeTrainer, words

from lit_lm.data import stream
from lit_lm.config import ConfigError, ModelConfig
from lit_lm.data.datamodule import TextDataModule, TokenWindows
from lit_lm.module import LanguageModel
from lit_lm.data.stream import StreamError
from lit_lm.data.token_file import DocumentPart, encode_documents
from lit_lm.data.tokenizer import BPETokenizer, load_tokenizer

SEQ, B = 8, 2


@pytest.fixture()
def shards(tmp_path, monkeypatch) -> Path:
    """A tokenizer and a directory of 4 shards: text files and JSON Lines; text read in units of 64 bytes."""
    monkeypatch.setattr(stream, "UNIT_BYTES", 64)
    BPETokenizer.train([words(200, 99)], 280).save_hf(tmp_path / "tok")
    d = tmp_path / "shards"
    d.mkdir()
    (d / "a.txt").write_text(words(40, 1))
    (d / "b.jsonl").write_text("".join(json.dumps({"text": words(3, 10 + i)}) + "\n" for i in range(12)))
    (d / "c.txt").write_text(words(25, 2))
    (d / "d.jsonl").write_text("".join(json.dumps({"text": words(2, 30 + i)}) + "\n" for i in range(9)))
    return d


def make_dm(shards, replicas=1, rank=0, **entry) -> TextDataModule:
    dm = TextDataModule(sources=[{"path": str(shards), "stream": True, **entry}], seq_len=SEQ, batch_size=B,
                        tokenizer_dir=str(shards.parent / "tok"))
    dm.trainer = FakeTrainer(replicas, rank)
    dm.setup("fit")
    return dm


def prepared_windows(shards: Path) -> TokenWindows:
    """The same shards tokenized whole, in order, by the prepare path's encoder, cut as a token file is."""
    tok = load_tokenizer(shards.parent / "tok")
    docs = []
    for f in sorted(shards.iterdir()):
        if f.suffix == ".jsonl":
            docs += [DocumentPart([json.loads(line)["text"]], True, True) for line in f.read_text().splitlines()]
        else:
            docs.append(DocumentPart([f.read_text()], True, True))
    return TokenWindows(np.concatenate([ids for ids, _, _ in encode_documents(tok, docs)]), SEQ)


def take(dm, n: int) -> list[torch.Tensor]:
    it = iter(dm.train_dataloader())
    out = [next(it) for _ in range(n)]
    dm.trainer.progress.processed += n
    return out


def test_streamed_windows_equal_the_prepared_text_in_order(shards):
    windows = prepared_windows(shards)
    n = len(windows) // B
    batches = take(make_dm(shards), n + 3)  # a few past the end: the second pass continues the stream
    got = torch.cat(batches)
    assert torch.equal(got[: n * B], torch.stack([windows[i] for i in range(n * B)]))
    assert got.shape == (B * (n + 3), SEQ + 1)


def test_each_rank_takes_every_nth_window(shards):
    windows = prepared_windows(shards)
    for rank in range(2):
        got = torch.cat(take(make_dm(shards, 2, rank), 3))
        assert torch.equal(got, torch.stack([windows[rank + 2 * i] for i in range(3 * B)]))


def test_resume_continues_exactly_under_another_world_size(shards):
    whole = torch.cat(take(make_dm(shards), 12))
    dm = make_dm(shards, 2, 0)
    take(dm, 3)  # 3 batches of 2 on 2 ranks: 12 windows consumed
    state = dm.state_dict()
    assert state["samples_consumed"] == 12 and state["stream"]["window"] == 12
    resumed = make_dm(shards)  # a new data module, one rank
    resumed.load_state_dict(json.loads(json.dumps({k: state[k] for k in ("samples_consumed", "stream")})))
    assert torch.equal(torch.cat(take(resumed, 6)), whole[12:])


def test_resume_mid_file_and_mid_unit(shards):
    whole = torch.cat(take(make_dm(shards), 20))
    for k in (1, 5, 13):
        dm = make_dm(shards)
        take(dm, k)
        state = dm.state_dict()
        again = make_dm(shards)
        again.load_state_dict(state)
        assert torch.equal(torch.cat(take(again, 20 - k)), whole[k * B:]), k
    assert any(make_state(shards, k)["skip"] for k in (1, 5, 13))  # some resume points are inside a unit


def make_state(shards, k):
    dm = make_dm(shards)
    take(dm, k)
    return dm.state_dict()["stream"]


def test_missing_shard_is_a_one_line_error_naming_it(shards):
    dm = make_dm(shards)
    (shards / "c.txt").unlink()  # deleted after the listing, mid-run
    with pytest.raises(StreamError, match=r"rank 0: stream shard .*c\.txt is missing or unreadable") as e:
        take(dm, 40)
    assert "\n" not in str(e.value)


def test_stalled_read_raises_within_the_timeout(shards, monkeypatch):
    real = stream._units

    def slow(path, offset, field):
        if path.endswith("b.jsonl"):
            time.sleep(60)
        return real(path, offset, field)

    monkeypatch.setattr(stream, "_units", slow)  # the forked worker has it too
    dm = make_dm(shards, timeout=2, prefetch=1)
    t0 = time.monotonic()
    with pytest.raises(StreamError, match=r"rank 0: no batch from the stream for 2 s while reading .*b\.jsonl"):
        take(dm, 40)
    assert time.monotonic() - t0 < 20


def test_bad_stream_configs_are_refused(shards, tmp_path):
    with pytest.raises(ConfigError, match="read alone"):
        TextDataModule(sources=[{"path": str(shards), "stream": True}, {"path": str(tmp_path), "weight": 1}],
                       tokenizer_dir=str(shards.parent / "tok"))
    with pytest.raises(ConfigError, match="needs data.init_args.tokenizer_dir"):
        TextDataModule(sources=[{"path": str(shards), "stream": True}])
    with pytest.raises(ConfigError, match="matches no file"):
        TextDataModule(sources=[{"path": str(tmp_path / "none*.txt"), "stream": True}],
                       tokenizer_dir=str(shards.parent / "tok"))


class Seen(L.Callback):
    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(batch.clone())


def fit(shards, steps: int, ckpt_path=None, save=None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    dm = TextDataModule(sources=[{"path": str(shards), "stream": True}], seq_len=SEQ, batch_size=B,
                        tokenizer_dir=str(shards.parent / "tok"))
    model = LanguageModel(ModelConfig(vocab_size=280, d_model=16, n_layers=1, n_heads=2, max_seq_len=SEQ))
    seen = Seen()
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, max_steps=steps, callbacks=[seen])
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(save)
    return seen.batches


def test_fit_saves_the_position_and_resumes_from_the_checkpoint(shards, tmp_path):
    whole = fit(shards, 5)
    first = fit(shards, 2, save=tmp_path / "a.ckpt")
    saved = torch.load(tmp_path / "a.ckpt", weights_only=True)["TextDataModule"]
    assert saved["samples_consumed"] == 2 * B and saved["stream"]["window"] == 2 * B
    rest = fit(shards, 5, ckpt_path=tmp_path / "a.ckpt")
    assert len(first) == 2 and len(rest) == 3
    assert torch.equal(torch.stack(first + rest), torch.stack(whole))
