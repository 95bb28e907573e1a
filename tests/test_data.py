"""TextDataModule: formats, caching, windows, DP-aware loaders, resumable position, and clear errors."""

import json
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch
from lightning.fabric.utilities.types import _Stateful

from lit_lm.config import ConfigError
from lit_lm.data.datamodule import TextDataModule

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 40


def make_dm(tmp_path: Path, files, **kw) -> TextDataModule:
    args = dict(data_dir=str(tmp_path / "data"), vocab_size=300, seq_len=16, batch_size=4, tokenizer_workers=1)
    args.update(kw)
    return TextDataModule(files=[str(f) for f in files] if files is not None else None, **args)


@pytest.fixture
def text_files(tmp_path: Path) -> list[Path]:
    files = []
    for i in range(3):
        f = tmp_path / f"doc{i}.txt"
        f.write_text(TEXT + f"# file {i}\n")
        files.append(f)
    return files


def test_windows_are_shifted_pairs_and_cache_is_reused(tmp_path, text_files):
    dm = make_dm(tmp_path, text_files)
    dm.prepare_data()
    dm.setup("fit")
    x = dm.train_set[0]
    assert x.shape == (17,) and x.dtype == torch.int64
    assert torch.equal(dm.train_set[1][0], x[16])  # window i+1 starts where window i's targets end
    assert int(x.max()) < 300
    marker = dm.cache_dir / "tokens.json"
    stamp = marker.stat().st_mtime_ns
    again = make_dm(tmp_path, text_files)
    again.prepare_data()
    assert marker.stat().st_mtime_ns == stamp  # unchanged inputs: nothing rebuilt
    text_files[0].write_text(TEXT + "# edited\n")
    edited = make_dm(tmp_path, text_files)
    assert edited.cache_dir != dm.cache_dir
    # the decoded stream round-trips the corpus (documents joined by <|endoftext|>)
    decoded = dm.tokenizer.decode(dm.train_set.tokens[:200].tolist())
    assert decoded.startswith(TEXT[:100])


def test_jsonl_parquet_and_saved_dataset(tmp_path):
    import datasets

    rows = [{"body": TEXT, "id": i} for i in range(3)]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "c.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    sizes = []
    for files in ([jsonl], [tmp_path / "c.parquet"], [tmp_path / "saved"]):
        dm = make_dm(tmp_path, files, text_field="body")
        dm.setup("fit")
        sizes.append(len(dm.train_set.tokens))
    assert len(set(sizes)) == 1  # the same texts give the same tokens, whatever the container


def test_loaders_follow_the_dp_rank_and_resume(tmp_path, text_files):
    dm = make_dm(tmp_path, text_files)
    dm.setup("fit")

    class FakeStrategy:
        distributed_sampler_kwargs = {"num_replicas": 2, "rank": 1}

    class FakeTrainer:
        strategy = FakeStrategy()
        progress = SimpleNamespace(processed=0)  # Lightning's fit_loop.epoch_loop.batch_progress.total
        fit_loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(total=progress)))

    dm.trainer = FakeTrainer()
    loader = dm.train_dataloader()
    assert loader.sampler.num_replicas == 2 and loader.sampler.rank == 1
    first = next(iter(loader))
    assert first.shape == (4, 17)
    FakeTrainer.progress.processed = 5  # restored by Lightning from the checkpoint, before the loader is made
    dm.load_state_dict({"samples_consumed": 8})
    resumed = dm.train_dataloader()
    assert resumed.sampler.start == 8 and len(resumed.sampler) == len(loader.sampler)
    assert isinstance(resumed, _Stateful)  # what Lightning checks before warning that a resume is not exact
    FakeTrainer.progress.processed = 8  # three more steps of 4 samples on 2 ranks
    assert dm.state_dict() == {"samples_consumed": 8 + 3 * 4 * 2, "tokenizer": dm.tokenizer.state_dict()}


def test_missing_file_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match="data.init_args.files"):
        make_dm(tmp_path, [tmp_path / "nope.txt"]).setup("fit")


def test_empty_files_and_empty_list(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ConfigError, match="contain no text"):
        make_dm(tmp_path, [empty]).setup("fit")
    with pytest.raises(ConfigError, match="empty list"):
        make_dm(tmp_path, [])


def test_unknown_text_field_lists_the_columns(tmp_path):
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text(json.dumps({"body": TEXT}))
    with pytest.raises(ConfigError, match=r"text_field='text'.*\['body'\]"):
        make_dm(tmp_path, [jsonl]).setup("fit")


def test_sequence_longer_than_the_corpus(tmp_path, text_files):
    with pytest.raises(ConfigError, match="the train split has 0 windows of seq_len 100000"):
        make_dm(tmp_path, text_files, seq_len=100_000).setup("fit")


def test_bad_numbers_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="batch_size"):
        make_dm(tmp_path, None, batch_size=0)
    with pytest.raises(ConfigError, match="val_fraction"):
        make_dm(tmp_path, None, val_fraction=1.5)
