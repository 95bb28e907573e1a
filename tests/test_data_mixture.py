"""Mixtures of prepared sources: each source's share of the tokens follows its weight, any step's batch is a pure
function of (seed, step, rank layout) so a run resumes under another world size with the same samples, and the
validation loss is logged per source."""

import random
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch

from lit_lm.config import ConfigError, ModelConfig
from lit_lm.data.datamodule import TextDataModule
from lit_lm.data.mixture import BLOCK, MixtureWindows, ShardWindows, apportion
from lit_lm.module import LanguageModel
from lit_lm.data.prepare import prepare
from lit_lm.data.tokenizer import BPETokenizer

WEIGHTS = {"web": 0.5, "code": 0.3, "books": 0.2}


def words(n_lines: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = ["alpha", "beta", "gamma", "x1", "y2", "(", ")", ":"]
    return "".join(" ".join(rng.choices(vocab, k=rng.randint(1, 9))) + "\n" for _ in range(n_lines))


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("mix")
    BPETokenizer.train([words(200, 99)], 280).save_hf(root / "tok")
    out = []
    for i, (name, weight) in enumerate(WEIGHTS.items()):
        f = root / f"{name}.txt"
        f.write_text(words(300 * (i + 1), i))  # sources of different sizes
        prepare([str(f)], str(root / "tok"), str(root / name), chunk_mb=0.004, val_fraction=0.25, progress=False)
        out.append({"path": str(root / name), "weight": weight})
    return out


class FakeTrainer:
    """What the data module reads of a Trainer: the DP layout and Lightning's processed-batch counter."""

    def __init__(self, replicas: int, rank: int) -> None:
        self.strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": replicas, "rank": rank})
        self.progress = SimpleNamespace(processed=0)
        self.fit_loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(
            total=self.progress)))


def make_dm(sources, replicas=1, rank=0, **kw) -> TextDataModule:
    dm = TextDataModule(sources=sources, seq_len=8, batch_size=4, seed=7, **kw)
    dm.trainer = FakeTrainer(replicas, rank)
    dm.setup("fit")
    return dm


def run_steps(sources, replicas: int, steps: int, samples_consumed: int = 0) -> list[torch.Tensor]:
    """`steps` global batches on `replicas` ranks (resumed at `samples_consumed`), each rank's samples put back in
    global stream order."""
    per_rank = []
    for rank in range(replicas):
        dm = make_dm(sources, replicas, rank)
        if samples_consumed:
            dm.load_state_dict({"samples_consumed": samples_consumed})
        batches = iter(dm.train_dataloader())
        per_rank.append([next(batches) for _ in range(steps)])
    out = []
    for step in range(steps):
        for j in range(4):
            out += [per_rank[r][step][j] for r in range(replicas)]  # rank r holds positions r, r + R, ...
    return out


def test_token_share_per_source_follows_the_weights(sources):
    dm = make_dm(sources)
    steps, positions = 200, 200 * 4
    counts = np.bincount([dm.train_set.locate(p)[0] for p in range(positions)], minlength=3)
    shares = counts / positions  # every window is seq_len + 1 tokens: the token share is the sample share
    assert np.abs(shares - np.array(list(WEIGHTS.values()))).max() <= 0.02, shares
    assert steps * 4 % BLOCK == 0 and list(apportion([0.5, 0.3, 0.2])) == [50, 30, 20]
    assert list(apportion([1, 1, 1])) == [34, 33, 33] and apportion([0.7, 0.3], 7).tolist() == [5, 2]


def test_resume_under_another_world_size_gives_the_same_batches(sources):
    reference = run_steps(sources, 1, 12)  # one rank, uninterrupted: 48 samples
    first = run_steps(sources, 2, 3)  # 3 steps on 2 ranks: 24 samples, then "killed"
    resumed = run_steps(sources, 3, 2, samples_consumed=24)  # resumed on 3 ranks: 24 more
    assert all(torch.equal(a, b) for a, b in zip(reference, first + resumed))
    dm = make_dm(sources, 2, 1)
    dm.trainer.progress.processed = 3
    assert dm.state_dict()["samples_consumed"] == 3 * 4 * 2
    assert not all(torch.equal(a, b) for a, b in zip(reference, run_steps(sources, 1, 12)[1:]))  # not constant


def test_windows_and_schedule_are_pure_functions_of_the_position():
    parts = [np.arange(100, dtype=np.uint16), np.arange(1000, 1050, dtype=np.uint16)]
    windows = ShardWindows(parts, 8)
    assert len(windows) == 12 + 6 and windows[12].tolist() == list(range(1000, 1009))  # no window spans two parts
    mix = MixtureWindows([windows, ShardWindows([np.arange(20, dtype=np.uint16)], 8)], [0.9, 0.1], seed=3)
    again = MixtureWindows(mix.sources, [0.9, 0.1], seed=3)
    order = [mix.locate(p) for p in range(300)]
    assert order == [again.locate(p) for p in reversed(range(300))][::-1]  # no hidden state: any access order
    seen = [w for s, w in order[:BLOCK * 2] if s == 0]
    assert sorted(seen[:len(windows)]) == list(range(len(windows)))  # each source's epoch is a permutation


class ValBatches(L.Callback):
    """The number of validation batches run from each loader."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.counts[dataloader_idx] = self.counts.get(dataloader_idx, 0) + 1


@pytest.mark.parametrize("limit", [2, 4])
def test_every_source_is_validated_on_the_same_budget(sources, limit):
    """limit_val_batches is each source's: with 3 sources and 2 (fewer than the sources) or 4 (not a multiple of
    3), every source runs that many batches and logs val_loss/<name>; val_loss is the mean over every validated
    token, here (equal batches of each) the mean of the sources' losses."""
    dm = TextDataModule(sources=sources, seq_len=8, batch_size=2)
    model = LanguageModel(ModelConfig(vocab_size=280, d_model=16, n_layers=1, n_heads=2, max_seq_len=8))
    seen = ValBatches()
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, limit_val_batches=limit, callbacks=[seen])
    metrics = {k: v for m in trainer.validate(model, datamodule=dm, verbose=False) for k, v in m.items()}
    assert {f"val_loss/{name}" for name in WEIGHTS} | {"val_loss", "val_ppl"} == set(metrics)
    assert seen.counts == {0: limit, 1: limit, 2: limit}
    per_source = [metrics[f"val_loss/{name}"] for name in WEIGHTS]
    assert len(set(per_source)) == 3  # three sources, three losses
    assert metrics["val_loss"] == pytest.approx(sum(per_source) / 3, rel=1e-5)


def test_a_mixture_through_the_command_logs_every_source_and_its_normalised_weights(sources, tmp_path):
    """`lit-lm fit` on 3 sources weighted 2:1:1 with limit_val_batches 2: one line gives the weights normalised,
    and every validation logs each source's loss and the overall one."""
    from test_cli import REPO, read_metrics, run_cli

    entries = ", ".join(f"{{path: {e['path']}, weight: {w}}}" for e, w in zip(sources, (2, 1, 1)))
    done = run_cli("fit", "--config", str(REPO / "configs/default.yaml"), "--trainer.default_root_dir",
                   str(tmp_path / "run"), "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                   "--trainer.limit_val_batches", "2", "--data.init_args.sources", f"[{entries}]",
                   "--data.init_args.seq_len", "8", "--data.init_args.batch_size", "2",
                   "--model.init_args.config.d_model", "16", "--model.init_args.config.n_layers", "1",
                   "--model.init_args.config.n_heads", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "normalised" in line]
    assert lines == ["[lit-lm data] source weights normalised to sum to 1: web 0.5, code 0.25, books 0.25"]
    rows = [r for r in read_metrics(tmp_path / "run", 0) if r.get("val_loss")]
    assert len(rows) == 1 and all(rows[0][f"val_loss/{name}"] for name in WEIGHTS)


def test_bad_sources_are_refused_in_one_line(sources, tmp_path):
    with pytest.raises(ConfigError, match="weight must be a positive number"):
        TextDataModule(sources=[{"path": sources[0]["path"], "weight": 0}])
    with pytest.raises(ConfigError, match="named alike"):
        TextDataModule(sources=[sources[0], sources[0]])
    with pytest.raises(ConfigError, match="not a prepared folder"):
        TextDataModule(sources=[{"path": str(tmp_path)}]).prepare_data()
    other = tmp_path / "tok2"
    BPETokenizer.train([words(50, 5)], 270).save_hf(other)
    prepare([str(Path(sources[0]["path"]).parent / "web.txt")], str(other), str(tmp_path / "web2"), progress=False)
    with pytest.raises(ConfigError, match="another tokenizer"):
        TextDataModule(sources=[sources[0], {"path": str(tmp_path / "web2")}]).prepare_data()
