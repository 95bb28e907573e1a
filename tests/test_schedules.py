"""LR schedules (lit_lm/schedules.py): each curve is its formula; the default is today's LR sequence, bit for bit;
WSD's decay branched off a stable checkpoint (`decay_start: resume`) is the uninterrupted run with the decay starting
at that step, and a branch resumed mid-decay goes on with the same decay."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lit_lm.config import ConfigError, ModelConfig
from lit_lm.module import DECAY_START, LanguageModel
from lit_lm.schedules import Schedule, warmup_cosine

CFG = ModelConfig(vocab_size=61, d_model=32, n_layers=1, n_heads=4, max_seq_len=16)
R = 0.1  # min_lr_ratio


def todays_warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """lit_lm.module.warmup_cosine as it was before the schedules (commit 13ca694), verbatim."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def test_the_default_is_todays_cosine_bit_for_bit():
    for warmup, horizon in ((10, 110), (0, 7), (3, 3), (100, 400), (30, 1)):
        for step in range(horizon + 20):
            today = todays_warmup_cosine(step, warmup, horizon, R)
            assert Schedule().multiplier(step, warmup, horizon, R) == today
            assert warmup_cosine(step, warmup, horizon, R) == today


@pytest.mark.parametrize("decay, f", [("linear", lambda p: 1 - p),
                                      ("cosine", lambda p: (1 + math.cos(math.pi * p)) / 2),
                                      ("1-sqrt", lambda p: 1 - math.sqrt(p))])
@pytest.mark.parametrize("length", ["fraction", "steps"])
def test_wsd_is_warmup_stable_then_decay(decay, f, length):
    """W = 10, H = 100; the decay over L = 20 steps (a fifth of the horizon, or 20 steps), from D = H - L = 80, or
    from a stated D = 50."""
    kwargs = {"decay_fraction": 0.2} if length == "fraction" else {"decay_steps": 20, "decay_fraction": 0.9}
    wsd = Schedule(name="wsd", decay=decay, **kwargs)
    m = lambda s, start=None: wsd.multiplier(s, 10, 100, R, start)  # noqa: E731
    assert [m(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert m(10) == m(45) == m(79) == m(80) == 1.0
    for step in (81, 85, 90, 97, 100, 130):
        p = min((step - 80) / 20, 1.0)
        assert m(step) == pytest.approx(R + (1 - R) * f(p), abs=1e-12)
    assert m(100) == pytest.approx(R) and m(99) > R
    assert m(49, 50) == m(50, 50) == 1.0 and m(60, 50) == pytest.approx(R + (1 - R) * f(0.5))
    assert m(70, 50) == pytest.approx(R) and m(95, 50) == pytest.approx(R)


def test_linear_and_constant():
    linear, constant = Schedule(name="linear"), Schedule(name="constant")
    for step in (10, 35, 60, 109, 110, 150):
        p = min((step - 10) / 100, 1.0)
        assert linear.multiplier(step, 10, 110, R) == pytest.approx(R + (1 - R) * (1 - p))
        assert constant.multiplier(step, 10, 110, R) == 1.0
    assert linear.multiplier(3, 10, 110, R) == constant.multiplier(3, 10, 110, R) == pytest.approx(0.4)


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "wsdd"}, "name 'wsdd'"), ({"decay": "exp"}, "decay 'exp'"), ({"decay_fraction": 0.0}, "decay_fraction"),
    ({"decay_steps": 0}, "decay_steps"), ({"name": "wsd", "decay_start": "later"}, "decay_start='later'"),
    ({"decay_start": 5}, "decay_start=5 is WSD's")])
def test_a_bad_schedule_is_one_config_error(kwargs, message):
    with pytest.raises(ConfigError, match="^model.init_args.schedule") as raised:
        Schedule(**kwargs)
    assert message in str(raised.value) and "\n" not in str(raised.value)


# -- through the Trainer -----------------------------------------------------------------------------------------
class Record(L.Callback):
    """Each step's LR (as the optimizer steps with it) and loss."""

    def __init__(self) -> None:
        self.lrs: dict[int, float] = {}
        self.losses: dict[int, float] = {}

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        self.lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: object) -> None:
        self.losses[trainer.global_step - 1] = float(outputs["loss"])


def fit(folder: Path, max_steps: int, ckpt_path: str | None = None, **module_kwargs: Any) -> tuple[Record, Any]:
    """A tiny LanguageModel stepping on one fixed batch of 4 windows (a resumed run restarts its epoch's loader:
    the same batch is what keeps its data the uninterrupted run's), saving `last.ckpt`; (its record, the module)."""
    torch.manual_seed(0)
    batch = torch.randint(0, CFG.vocab_size, (4, CFG.max_seq_len + 1), generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(batch.repeat(2, 1), batch_size=4)
    record = Record()
    trainer = L.Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[record, L.pytorch.callbacks.ModelCheckpoint(folder, save_last=True)],
                        num_sanity_val_steps=0, limit_val_batches=0, accelerator="cpu")
    module = LanguageModel(CFG, lr=1e-2, warmup_steps=2, **module_kwargs)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return record, module


def test_the_default_run_steps_with_todays_lrs(tmp_path):
    record, _ = fit(tmp_path, 8)
    assert record.lrs == {s: 1e-2 * todays_warmup_cosine(s, 2, 8, 0.1) for s in range(8)}


def test_a_decay_branched_off_a_stable_checkpoint_is_the_uninterrupted_run(tmp_path, monkeypatch):
    """Stable to step 4 (WSD planned over 100 steps), then `decay_start: resume` with decay_steps 4: the same LRs,
    losses and final weights as one run told to decay from step 4; resumed mid-decay (step 6) with the same command,
    the branch goes on with its decay (the start is in the checkpoint), not a new one from step 6."""
    said: list[str] = []
    monkeypatch.setattr("lit_lm.module.rank_zero_info", said.append)
    plan = {"schedule_steps": 100}
    wsd = dict(name="wsd", decay="linear", decay_steps=4)
    whole, whole_module = fit(tmp_path / "whole", 8, **plan, schedule=Schedule(**wsd, decay_start=4))
    fit(tmp_path / "branch", 4, **plan, schedule=Schedule(**wsd))  # the stable phase
    assert not any("WSD" in line for line in said)
    branch = Schedule(**wsd, decay_start="resume")
    first, _ = fit(tmp_path / "branch", 6, str(tmp_path / "branch" / "last.ckpt"), **plan, schedule=branch)
    assert [line for line in said if "WSD" in line] == [
        "[lit-lm] LR schedule: WSD decays from step 4 (decay_start: resume) over 4 steps, to step 8: the LR "
        "multiplier at step 5 moves from 1 to 0.775"]
    assert torch.load(tmp_path / "branch" / "last.ckpt", weights_only=True)[DECAY_START] == 4
    said.clear()
    second, module = fit(tmp_path / "branch", 8, str(tmp_path / "branch" / "last.ckpt"), **plan, schedule=branch)
    assert [line for line in said if "WSD" in line] == [
        "[lit-lm] LR schedule: continues the checkpoint's WSD decay from step 4"]
    assert {**first.lrs, **second.lrs} == {s: whole.lrs[s] for s in range(4, 8)}
    assert [whole.lrs[s] / 1e-2 for s in (3, 4, 5, 6, 7)] == pytest.approx([1, 1, 0.775, 0.55, 0.325])
    assert {**first.losses, **second.losses} == {s: whole.losses[s] for s in range(4, 8)}
    for (name, p), q in zip(module.named_parameters(), whole_module.parameters()):
        assert torch.equal(p, q), name


def test_resuming_the_branch_without_the_flag_continues_the_decay(tmp_path):
    """The decay start is run state, like the horizon: a resume that no longer says `resume` keeps it."""
    wsd = dict(name="wsd", decay="cosine", decay_steps=4)
    fit(tmp_path, 2, schedule_steps=100, schedule=Schedule(**wsd))
    fit(tmp_path, 4, str(tmp_path / "last.ckpt"), schedule_steps=100, schedule=Schedule(**wsd, decay_start="resume"))
    later, _ = fit(tmp_path, 6, str(tmp_path / "last.ckpt"), schedule_steps=100, schedule=Schedule(**wsd))
    assert later.lrs[5] == pytest.approx(1e-2 * (R + (1 - R) * (1 + math.cos(math.pi * 3 / 4)) / 2))


def test_decay_at_resume_needs_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="pass --ckpt_path"):
        fit(tmp_path, 2, schedule=Schedule(name="wsd", decay_start="resume"))


def test_every_schedule_keeps_the_checkpoints_horizon(tmp_path):
    """Today's horizon rule, for the linear schedule: a 4-step run resumed to 8 steps stays at the floor."""
    fit(tmp_path, 4, schedule=Schedule(name="linear"))
    resumed, _ = fit(tmp_path, 8, str(tmp_path / "last.ckpt"), schedule=Schedule(name="linear"))
    assert resumed.lrs == pytest.approx({s: 1e-2 * R for s in range(4, 8)})


def test_decay_anytime_through_the_command_under_zero2(tmp_path):
    """The recipe of docs/optim.md under a lit-lm strategy (2 ranks, sharded checkpoints restored after setup): one
    flag branches the decay off the stable run's `last`, and the branch resumed mid-decay goes on with it."""
    from test_cli import REPO, read_metrics, run_cli, tiny_args

    base = [*tiny_args(tmp_path), "--config", str(REPO / "configs/strategies/zero2.yaml"), "--trainer.devices", "2",
            "--data.init_args.batch_size", "2", "--trainer.val_check_interval", "2",
            "--model.init_args.schedule.name", "wsd", "--model.init_args.schedule.decay", "linear",
            "--model.init_args.schedule_steps", "100", "--model.init_args.schedule.decay_steps", "4"]
    branch = ["--ckpt_path", "last", "--model.init_args.schedule.decay_start", "resume"]
    for version, steps, extra in ((0, 4, []), (1, 6, branch), (2, 8, branch)):
        done = run_cli("fit", *base, "--trainer.max_steps", str(steps), *extra, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        said = [line for line in (done.stdout + done.stderr).splitlines() if "WSD" in line]
        assert said == {0: [], 1: ["[lit-lm] LR schedule: WSD decays from step 4 (decay_start: resume) over 4 steps, "
                                   "to step 8: the LR multiplier at step 5 moves from 1 to 0.775"],
                        2: ["[lit-lm] LR schedule: continues the checkpoint's WSD decay from step 4"]}[version]
    # the branch's and its resumption's logged LRs, in order (logged after each step's scheduler step: the LR of the
    # next step, 5 to 8)
    lrs = [float(r["lr"]) for v in (1, 2) for r in read_metrics(tmp_path / "run", v) if r.get("lr")]
    assert lrs == pytest.approx([3e-3 * m for m in (0.775, 0.55, 0.325, 0.1)])
