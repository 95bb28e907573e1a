"""`lit-lm prepare`: shards equal to encoding each document whole, byte-identical for 1 and 4 workers, resumed
after an interruption as if never stopped, every input format, and `fit` reading the folder as it is."""

import json
import random
from pathlib import Path

import numpy as np
import pytest

import lit_lm.data.prepare as prepare_module
from lit_lm.config import ConfigError
from lit_lm.data.datamodule import TextDataModule
from lit_lm.data.prepare import PreparedSource, prepare
from lit_lm.data.tokenizer import BPETokenizer, load_tokenizer


def words(n_lines: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = ["alpha", "beta", "gamma", "x1", "y2", "déjà", "(", ")", ":", "  ", "\t"]
    return "".join(" ".join(rng.choices(vocab, k=rng.randint(0, 9))) + rng.choice(["\n", "\n", "\n\n", ".\n"])
                   for _ in range(n_lines))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A `tokenizers` library tokenizer.json (GPT-2's pre-tokenizer, 300 tokens)."""
    out = tmp_path_factory.mktemp("tok")
    BPETokenizer.train([words(300, 99)], 300).save_hf(out)
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("corpus")
    files = []
    for i, n in enumerate((3000, 200, 0, 1500)):  # ~60 KB, 4 KB, an empty file, ~30 KB
        f = root / f"part{i}.txt"
        f.write_text(words(n, i), encoding="utf-8")
        files.append(f)
    return files


def shard_ids(folder: Path) -> np.ndarray:
    src = PreparedSource(folder)
    return np.concatenate([np.memmap(folder / "shards" / s["file"], dtype=src.dtype, mode="r") for s in
                           src.index["shards"] if s["tokens"]])


def run(files, tok_dir, out, **kw) -> dict:
    return prepare([str(f) for f in files], str(tok_dir), str(out), chunk_mb=0.01, progress=False, **kw)


def test_shards_are_the_documents_encoded_whole_and_workers_do_not_change_a_byte(tmp_path, tok_dir, corpus):
    one = run(corpus, tok_dir, tmp_path / "one", workers=1)
    assert run(corpus, tok_dir, tmp_path / "four", workers=4) == one
    assert len(one["shards"]) > 6  # the 60 KB file is cut into several chunks
    for a in sorted((tmp_path / "one").rglob("*")):
        b = tmp_path / "four" / a.relative_to(tmp_path / "one")
        assert a.is_dir() or a.read_bytes() == b.read_bytes(), a.name
    tok = load_tokenizer(tok_dir)
    expected = [i for f in corpus if f.stat().st_size for i in tok.encode(f.read_text()) + [tok.eos_id]]
    assert shard_ids(tmp_path / "one").tolist() == expected  # cut at safe places only: the same ids as whole files
    assert one["documents"] == 3 and one["tokens"] == len(expected) and one["dtype"] == "uint16"


def test_an_interrupted_prepare_resumes_as_if_never_stopped(tmp_path, tok_dir, corpus, monkeypatch):
    whole = run(corpus, tok_dir, tmp_path / "whole")
    run_chunk, calls = prepare_module.run_chunk, []

    def interrupted(job):
        calls.append(job[0])
        if len(calls) == 4:
            raise KeyboardInterrupt
        return run_chunk(job)

    monkeypatch.setattr(prepare_module, "run_chunk", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(corpus, tok_dir, tmp_path / "resumed")
    monkeypatch.setattr(prepare_module, "run_chunk", run_chunk)
    kept = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "resumed" / "shards").glob("*.bin")}
    assert len(kept) == 3 and not (tmp_path / "resumed" / "index.json").exists()
    with pytest.raises(ConfigError, match="unfinished prepare"):
        PreparedSource(tmp_path / "resumed")
    assert run(corpus, tok_dir, tmp_path / "resumed") == whole
    assert {p: (tmp_path / "resumed" / "shards" / p).stat().st_mtime_ns for p in kept} == kept  # not redone
    for a in (tmp_path / "whole" / "shards").iterdir():
        assert a.read_bytes() == (tmp_path / "resumed" / "shards" / a.name).read_bytes()
    with pytest.raises(ConfigError, match="holds a prepare of other inputs"):
        run(corpus[:1], tok_dir, tmp_path / "resumed")


def test_jsonl_parquet_and_saved_dataset_give_the_same_tokens(tmp_path, tok_dir):
    import datasets

    rows = [{"body": words(40 * (i + 1), i), "id": i} for i in range(12)] + [{"body": "", "id": 99}]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "c.parquet"), batch_size=4)  # row groups: the parquet chunks
    ds.save_to_disk(str(tmp_path / "saved"))
    tokens = [shard_ids(tmp_path / name).tolist() if run([src], tok_dir, tmp_path / name, text_field="body") else None
              for name, src in (("j", jsonl), ("p", tmp_path / "c.parquet"), ("s", tmp_path / "saved"))]
    assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) > 0
    assert PreparedSource(tmp_path / "j").index["documents"] == 12
    with pytest.raises(ConfigError, match="'text' is not a column"):
        run([tmp_path / "c.parquet"], tok_dir, tmp_path / "bad")


def test_fit_reads_a_prepared_folder_without_tokenizing(tmp_path, tok_dir, corpus):
    run(corpus, tok_dir, tmp_path / "web", val_fraction=0.2)
    dm = TextDataModule(sources=[{"path": str(tmp_path / "web")}], data_dir=str(tmp_path / "data"), seq_len=16,
                        batch_size=2)
    dm.prepare_data()
    dm.setup("fit")
    assert not (tmp_path / "data").exists()  # nothing tokenized, nothing cached
    window = dm.train_set[0]
    assert window.shape == (17,) and dm.tokenizer.vocab_size == 300
    train_ids = set(map(tuple, (dm.train_set[p].tolist() for p in range(50))))
    ids = shard_ids(tmp_path / "web")
    assert all(any(np.array_equal(ids[s:s + 17], w) for s in range(0, len(ids) - 16)) for w in list(train_ids)[:3])
    with pytest.raises(ConfigError, match="not both"):
        TextDataModule(files=[str(corpus[0])], sources=[{"path": str(tmp_path / "web")}])
    shard = tmp_path / "web" / "shards" / "00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])  # a truncated copy
    with pytest.raises(ConfigError, match="00000.bin is missing or not the"):
        PreparedSource(tmp_path / "web")


def test_the_command_reports_bad_input_in_one_line(tmp_path, tok_dir, capsys):
    from lit_lm.cli import main

    for argv, message in ((["--files", str(tmp_path / "nope.txt")], "do not exist"),
                          (["--files", str(tok_dir / "tokenizer.json"), "--workers", "0"], "--workers must be")):
        with pytest.raises(SystemExit) as exit_:
            main(["prepare", *argv, "--tokenizer_dir", str(tok_dir), "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith("lit-lm: error: ") and message in err, err
        assert len(err.strip().splitlines()) == 1
