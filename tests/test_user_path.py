"""The user's path end to end, through the `lit-lm` command: move checkpoints between strategies and formats,
resume `last` after a kill, generate text from any checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import cli_server
import pytest
import torch

from lit_lm.checkpoints import model_state_dict, read_checkpoint, tokenizer_from
from lit_lm.config import ModelConfig
from lit_lm.model import Transformer
from lit_lm.module import LanguageModel
from lit_lm.strategies.checkpoint import is_sharded_checkpoint
from test_cli import REPO, read_metrics, run_cli, run_script, tiny_args


def every_2_steps(tmp_path: Path) -> list[str]:
    """`tiny_args` with the default ModelCheckpoint (the last callback) saving and validating every 2 steps."""
    return [a for a in tiny_args(tmp_path) if "LearningRateMonitor" not in a] + [
        "--trainer.val_check_interval", "2", "--trainer.callbacks.every_n_train_steps", "2"]


def _steps(run: Path, version: int) -> list[int]:
    return [int(r["step"]) for r in read_metrics(run, version) if r.get("train_loss")]


def _val_losses(run: Path, version: int) -> list[float]:
    return [float(r["val_loss"]) for r in read_metrics(run, version) if r.get("val_loss")]


def test_single_file_resumes_under_zero2_then_loads_anywhere(tmp_path):
    """`make train`'s single file (tied embeddings) resumed by zero2 on one device from `--ckpt_path last`; its
    sharded checkpoint validated by the plain single-device default, converted and loaded strictly; a model of
    another shape is refused with the differences listed."""
    run = tmp_path / "run"
    base = every_2_steps(tmp_path)
    first = run_cli("fit", *base, "--trainer.max_steps", "4", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    last = run / "checkpoints/last.ckpt"
    assert last.is_file() and f"checkpoint: {last}" in first.stdout

    zero2 = ["--config", str(REPO / "configs/strategies/zero2.yaml"), "--trainer.devices", "1"]
    resumed = run_cli("fit", *base, *zero2, "--trainer.max_steps", "6", "--ckpt_path", "last", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {last}" in resumed.stdout + resumed.stderr
    assert _steps(run, 1) == [4, 5]
    assert is_sharded_checkpoint(last)  # re-saved by zero2 over the single file, under the same name
    assert not [p.name for p in (run / "checkpoints").iterdir() if "-v" in p.name or ".tmp-" in p.name]

    validate = run_cli("validate", *tiny_args(tmp_path), "--ckpt_path", str(last), cwd=tmp_path)
    assert validate.returncode == 0, validate.stderr[-3000:]
    assert _val_losses(run, 2) == pytest.approx(_val_losses(run, 1)[-1:], rel=1e-5)

    predict = run_cli("predict", *tiny_args(tmp_path), "--ckpt_path", "last", cwd=tmp_path)
    assert predict.returncode == 0, predict.stderr[-3000:]
    assert f"predictions: {run / 'predictions.jsonl'}" in predict.stdout
    rows = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * 2 and all(r["prompt"] and r["completion"] for r in rows)  # 2 val batches of 4

    converted = tmp_path / "model.ckpt"
    done = run_script("scripts/ckpt.py", "convert", last, converted, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    module = LanguageModel.load_from_checkpoint(converted, strict=True)
    whole = read_checkpoint(last)
    for name, tensor in module.model.state_dict().items():
        assert torch.equal(tensor, model_state_dict(whole)[name]), name
    assert "def main" in tokenizer_from(whole).decode(tokenizer_from(whole).encode("def main(argv):"))

    other = run_cli("validate", *tiny_args(tmp_path), "--ckpt_path", str(last),
                    "--model.init_args.config.n_layers", "2", "--model.init_args.config.n_heads", "2", cwd=tmp_path)
    assert other.returncode == 2
    assert other.stderr.strip().splitlines()[-1] == (
        f"lit-lm: error: checkpoint {last} holds a different model: n_layers 1 (checkpoint) != 2 (config); n_heads "
        "4 (checkpoint) != 2 (config) (model.init_args.config); use the training run's config (its config.yaml "
        "beside the logs) or a checkpoint of this model")
    assert "Traceback" not in other.stderr


KILL_IN_LAST_SAVE = """
import os, sys
from pathlib import Path
publish = os.replace
def killed_before_publishing_last(src, dst):
    if Path(dst).name == "last.ckpt":  # the file is written under its temporary name: die before the rename
        os.kill(os.getpid(), 9)
    publish(src, dst)
os.replace = killed_before_publishing_last
from lit_lm.cli import main
main(sys.argv[1:])
"""


def test_kill_during_the_first_save_resumes_the_step_before(tmp_path):
    run = tmp_path / "run"
    base = every_2_steps(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")  # run_cli's, so its server forks it
    killed = subprocess.run([cli_server.python(env=env), "-c", KILL_IN_LAST_SAVE, "fit", *base,
                             "--trainer.max_steps", "4"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    left = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert left[0].startswith("last.ckpt.tmp-") and left[1:] == ["step=00002.ckpt"]

    resumed = run_cli("fit", *base, "--trainer.max_steps", "4", "--ckpt_path", "last", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {run / 'checkpoints/step=00002.ckpt'}" in resumed.stdout + resumed.stderr
    assert _steps(run, 1) == [2, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt", "step=00002.ckpt",
                                                                       "step=00004.ckpt"]


def test_generate_from_a_zero3_checkpoint_streams_the_greedy_continuation(tmp_path):
    """zero3 on 2 ranks writes a sharded checkpoint; `lit-lm generate` on one process prints what a greedy decode
    without a cache (the whole context re-run for every token) produces from the same weights."""
    fit = run_cli("fit", *tiny_args(tmp_path), "--config", str(REPO / "configs/strategies/zero3.yaml"),
                  "--trainer.devices", "2", "--data.init_args.batch_size", "2", "--trainer.max_steps", "3",
                  "--model.init_args.config.n_layers", "2", "--model.init_args.config.n_kv_heads", "2", cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    last = tmp_path / "run/checkpoints/last.ckpt"
    assert is_sharded_checkpoint(last)

    prompt, n = "def main(argv):\n", 12
    out = run_cli("generate", "--ckpt_path", str(last), "--prompt", prompt, "--max_new_tokens", str(n),
                  "--temperature", "0", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]

    checkpoint = read_checkpoint(last)
    model = Transformer(ModelConfig(**checkpoint["hyper_parameters"]["config"]))
    model.load_state_dict(model_state_dict(checkpoint))
    tokenizer = tokenizer_from(checkpoint)
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]))[0, -1, : model.config.vocab_size]
            if int(logits.argmax()) == tokenizer.eos_id:
                break
            ids.append(int(logits.argmax()))
    assert out.stdout == tokenizer.decode(ids) + "\n"
    assert len(ids) > len(tokenizer.encode(prompt))


def test_single_file_resumes_under_pp_like_one_process(tmp_path):
    """A single file holds every stage's tensors and names its optimizer's parameters: pp on 2 ranks takes each
    stage's share and continues with the losses of a one-process resume (tied embeddings: the head's state is the
    embedding's)."""
    base = every_2_steps(tmp_path) + ["--model.init_args.config.n_layers", "2"]
    first = run_cli("fit", *base, "--trainer.max_steps", "4", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.copytree(tmp_path / "run", tmp_path / "pp")
    losses = {}
    for name, extra in (("run", []), ("pp", ["--config", str(REPO / "configs/strategies/pp.yaml"),
                                               "--trainer.devices", "2", "--trainer.default_root_dir",
                                               str(tmp_path / "pp")])):
        resumed = run_cli("fit", *base, "--trainer.max_steps", "6", "--ckpt_path", "last", *extra, cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        losses[name] = {int(r["step"]): float(r["train_loss"]) for r in read_metrics(tmp_path / name, 1)
                        if r.get("train_loss")}
    assert sorted(losses["run"]) == [4, 5]
    assert losses["pp"] == pytest.approx(losses["run"], rel=1e-5)
