"""The tools that take a checkpoint read everything from it: ptq.py and sensitivity.py rebuild the run's data (its
settings and tokenizer, not the default config's) with no --config and refuse a config that disagrees, by field;
ckpt.py inspects and converts the single file `make train` writes; upcycle.py carries the data into its output;
a path that is not a checkpoint is one line with exit status 2; exports get the umask's mode; one parameter count.

One tiny run (vocab 300, seq_len 16: not the default config's 4096 and 128) serves every test of the module."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lit_lm.planner import estimate
from lit_lm.checkpoints import DATA_SETTINGS, data_from_checkpoint, read_checkpoint, tokenizer_from
from lit_lm.config import ModelConfig
from lit_lm.model import Transformer
from lit_lm.module import LanguageModel
from test_cli import REPO, run_cli, run_script, tiny_args

sys.path.insert(0, str(REPO / "scripts"))
from offline import batches, build_model, val_loss  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("tiny")
    fit = run_cli("fit", *tiny_args(root), "--trainer.max_steps", "2", cwd=root)
    assert fit.returncode == 0, fit.stderr[-3000:]
    return {"root": root, "ckpt": root / "run/checkpoints/last.ckpt", "stdout": fit.stdout + fit.stderr}


def script(name: str, *args: str, cwd: Path, umask: int | None = None) -> subprocess.CompletedProcess:
    return run_script(f"scripts/{name}", *args, cwd=cwd, umask=umask)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    """The single `lit-lm: error:` line of a run that failed as a user error should (exit 2, no traceback)."""
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lit-lm: error: "), done.stderr[-3000:]
    return lines[0].removeprefix("lit-lm: error: ")


def test_the_data_comes_from_the_checkpoint_with_its_tokenizer(run, tmp_path):
    ckpt = read_checkpoint(run["ckpt"])
    settings = ckpt[DATA_SETTINGS]
    assert (settings["vocab_size"], settings["seq_len"], settings["val_fraction"]) == (300, 16, 0.2)
    data = data_from_checkpoint(ckpt)
    assert data.tokenizer.state_dict() == tokenizer_from(ckpt).state_dict()
    assert not (Path(settings["data_dir"]) / "checkpoint_tokenizers").exists()  # the run's own cache was reused
    windows = [data.val_set[i] for i in range(len(data.val_set))]

    # the cache gone (another machine): the corpus is tokenized again with the checkpoint's tokenizer
    moved = data_from_checkpoint(ckpt, data_dir=str(tmp_path / "elsewhere"))
    assert moved.tokenizer_dir is not None and "checkpoint_tokenizers" in moved.tokenizer_dir
    assert moved.tokenizer.state_dict() == tokenizer_from(ckpt).state_dict()
    assert all(torch.equal(moved.val_set[i], w) for i, w in enumerate(windows)) and len(moved.val_set) == len(windows)


def test_ptq_runs_on_the_checkpoint_alone(run, tmp_path):
    """No --config: the default config's data (vocab 4096) would index past this model's 320-row embedding."""
    done = script("ptq.py", "--ckpt_path", run["ckpt"], "--method", "mse", "--qat-steps", "0", "--calib-batches", "1",
                  "--val-batches", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "batches of 4 x 16" in done.stdout
    ckpt = read_checkpoint(run["ckpt"])
    data = data_from_checkpoint(ckpt)
    expected = val_loss(build_model(ckpt), batches(data.val_set, data.batch_size, 2, shuffle=False))
    row = re.search(r"\| float \| fp32 \| ([0-9.]+) ", done.stdout)
    assert row and float(row.group(1)) == pytest.approx(expected, abs=1e-4)
    assert re.search(r"\| PTQ mse \| int8 per channel \| [0-9.]+ \(", done.stdout)


@pytest.mark.parametrize("tool, section, field, value, key", [
    ("ptq.py --ckpt_path", "data", "seq_len", 32, "data.init_args.seq_len"),
    ("sensitivity.py --ckpt", "model", "d_model", 64, "model.init_args.config.d_model"),
])
def test_a_config_that_disagrees_with_the_checkpoint_is_refused_by_field(run, tmp_path, tool, section, field, value,
                                                                         key):
    config = tmp_path / "other.yaml"
    args = {"data": {"init_args": {field: value}}, "model": {"init_args": {"config": {field: value}}}}[section]
    config.write_text(yaml.safe_dump({section: args}))
    saved = 16 if field == "seq_len" else 32
    name, flag = tool.split()
    message = one_error_line(script(name, flag, run["ckpt"], "--config", config, cwd=tmp_path))
    assert message.startswith(f"{config} sets {field}={value} but the checkpoint's run used {saved} ({key}); ") \
        or message.startswith(f"{config} sets {field}={value} but the checkpoint's model has {saved} ({key}); "), \
        message


def test_sensitivity_runs_on_the_checkpoint_alone(run, tmp_path):
    done = script("sensitivity.py", "--ckpt", run["ckpt"], "--out", tmp_path / "out", "--sparsities", "0.5",
                  "--val-batches", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out/sensitivity.json").read_text())
    assert len(report["val_loss"]) == 7  # wq wk wv wo w_gate w_up w_down of the one block


def test_ckpt_inspects_and_converts_the_single_file(run, tmp_path):
    inspect = script("ckpt.py", "inspect", run["ckpt"], cwd=tmp_path)
    assert inspect.returncode == 0, inspect.stderr[-3000:]
    assert "global_step 2" in inspect.stdout
    assert re.search(r"state_dict\.model\.tok_embeddings\.weight +float32 +\[320, 32\]  40,960 B", inspect.stdout)

    out = tmp_path / "plain.ckpt"
    convert = script("ckpt.py", "convert", run["ckpt"], out, cwd=tmp_path)
    assert convert.returncode == 0, convert.stderr[-3000:]
    module = LanguageModel.load_from_checkpoint(out, strict=True)
    saved = read_checkpoint(run["ckpt"])["state_dict"]
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, saved[name]), name


def test_upcycled_checkpoint_generates_alone_and_exports_as_mixtral(run, tmp_path):
    moe = tmp_path / "moe.ckpt"
    up = script("upcycle.py", run["ckpt"], moe, "--experts", "2", cwd=tmp_path)
    assert up.returncode == 0, up.stderr[-3000:]
    assert (tokenizer_from(read_checkpoint(moe)).state_dict()
            == tokenizer_from(read_checkpoint(run["ckpt"])).state_dict())
    generated = run_cli("generate", "--ckpt_path", str(moe), "--prompt", "def ", "--max_new_tokens", "4",
                        "--temperature", "0", cwd=tmp_path)
    assert generated.returncode == 0 and generated.stdout.startswith("def "), generated.stderr[-3000:]

    # every block MoE, softmax top-2 renormalised: a Mixtral (lit_lm.hf.families; logits: tests/test_hf_families.py)
    export = script("ckpt.py", "export-hf", moe, tmp_path / "hf", cwd=tmp_path)
    assert export.returncode == 0, export.stderr[-3000:]
    assert json.loads((tmp_path / "hf/config.json").read_text())["model_type"] == "mixtral"


def test_a_path_that_is_not_a_checkpoint_is_one_line(run, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    folder = run["root"] / "run"  # a directory, but no checkpoint
    for path, why in ((folder, "a directory without meta.pt, nor a Hugging Face model folder (config.json and "
                               "*.safetensors)"), (text, "not a file torch.save wrote")):
        expected = f"{path} is not a checkpoint: {why} (ckpt_path); "
        assert one_error_line(run_cli("generate", "--ckpt_path", str(path), cwd=tmp_path)).startswith(expected)
    assert one_error_line(script("ckpt.py", "inspect", text, cwd=tmp_path)).startswith(f"{text} is not a ")
    assert one_error_line(script("ptq.py", "--ckpt_path", folder, cwd=tmp_path)).startswith(f"{folder} is not a ")


def test_exported_files_get_the_umasks_mode(run, tmp_path):
    """safetensors writes a 0600 temporary file and renames it: the export must still be readable as the umask
    says (0640 under umask 027: the group that serves the model reads it)."""
    out = tmp_path / "hf"
    done = script("ckpt.py", "export-hf", run["ckpt"], out, cwd=tmp_path, umask=0o027)
    assert done.returncode == 0, done.stderr[-3000:]
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o640}, modes


def _configs() -> list[ModelConfig]:
    return [ModelConfig(vocab_size=300, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, tie_embeddings=True),
            ModelConfig(vocab_size=500, d_model=64, n_layers=2, n_heads=4, qk_norm=True),
            ModelConfig(vocab_size=256, d_model=64, n_layers=3, n_heads=4, moe_experts=4, moe_shared_experts=1,
                        moe_first_dense=1)]


@pytest.mark.parametrize("cfg", _configs(), ids=["tied", "qk_norm", "moe"])
def test_one_parameter_count(cfg):
    """`ModelConfig.num_params()` (embedding included, tied head once) is what the model holds (Lightning's
    summary counts the same) and what the estimator's inventory sums to."""
    with torch.device("meta"):
        model = Transformer(cfg)
    inventory = estimate._inventory(estimate._config_key(cfg))
    assert cfg.num_params() == sum(p.numel() for p in model.parameters()) == \
        sum(torch.Size(p.shape).numel() for p in inventory)


def test_fit_and_plan_print_that_count(run):
    cfg = ModelConfig(**read_checkpoint(run["ckpt"])["hyper_parameters"]["config"])
    assert f"[lit-lm] model: {cfg.num_params() / 1e6:.2f}M parameters" in run["stdout"]
    plan = run_cli("plan", cwd=REPO)
    assert plan.returncode == 0, plan.stderr[-3000:]
    default = yaml.safe_load((REPO / "configs/default.yaml").read_text())
    shape = default["model"]["init_args"]["config"]
    data = default["data"]["init_args"]
    n = ModelConfig(**shape, vocab_size=data["vocab_size"], max_seq_len=data["seq_len"]).num_params()
    assert plan.stdout.startswith(f"{n / 1e6:.3g}M parameters")
    assert f"a {n / 1e6:.2f}M-parameter Transformer" in (REPO / "configs/default.yaml").read_text()



def test_a_fresh_fit_says_which_checkpoints_it_replaces(tmp_path, monkeypatch):
    """`lit-lm fit` without --ckpt_path into a folder holding an earlier run's checkpoints overwrites them as it saves:
    one line says so (and how to keep them) before any step; nothing is said when the folder is empty, or for
    validate."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_lm import checkpoints

    lines: list[str] = []
    monkeypatch.setattr(checkpoints, "rank_zero_info", lines.append)
    trainer = L.Trainer(default_root_dir=tmp_path, callbacks=[ModelCheckpoint()], logger=False, accelerator="cpu",
                        devices=1, enable_progress_bar=False)
    assert checkpoints.prepare_run(trainer, None, object(), fitting=True) is None and lines == []
    (tmp_path / "checkpoints").mkdir()
    torch.save({"state_dict": {}}, tmp_path / "checkpoints" / "last.ckpt")
    checkpoints.prepare_run(trainer, None, object(), fitting=False)  # validate / predict: nothing is written over
    assert lines == []
    checkpoints.prepare_run(trainer, None, object(), fitting=True)
    assert len(lines) == 1 and "holds an earlier run's checkpoints (newest last.ckpt)" in lines[0], lines
    assert "--ckpt_path last" in lines[0] and "--trainer.default_root_dir" in lines[0]
