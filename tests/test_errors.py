"""Bad input through the `lit-lm` command: one line `lit-lm: error: <what> (<key>); <fix>`, printed once (rank 0),
no traceback unless --debug, exit status 2 on every rank."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lit_lm.config import ConfigError
from lit_lm.errors import check_environment, check_trainer_config
from test_cli import REPO, run_cli, tiny_args


def _with(tmp_path: Path, key: str, value: str) -> list[str]:
    """tiny_args with `key` set to `value` (replacing its earlier value)."""
    args = tiny_args(tmp_path)
    return args[: args.index(key)] + args[args.index(key) + 2:] + [key, value]


def _binary_file(tmp_path: Path) -> tuple[list[str], str]:
    blob = tmp_path / "image.txt"
    blob.write_bytes(b"def f():\n" + bytes([0x89, 0x50, 0x4E, 0x47]) + b"\x00" * 64)
    args = _with(tmp_path, "--data.init_args.files", f"[{tmp_path / 'corpus.txt'}, {blob}]")
    return ["fit", *args, "--trainer.devices", "2", "--config", str(REPO / "configs/strategies/ddp.yaml")], (
        f"{blob} is not UTF-8 text: byte 9 is 0x89 (data.init_args.files); remove binary files from the list or "
        "convert the file to UTF-8")


def _missing_text(tmp_path: Path) -> tuple[list[str], str]:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in [{"text": "x = 1\n" * 50}, {"body": "y"}, {"text": "z"}]))
    args = _with(tmp_path, "--data.init_args.files", f"[{rows}]")
    return ["fit", *args], (f"1 of 3 rows of ['{rows}'] have no 'text' (data.init_args.text_field); fix those rows, "
                            "name the right field, or set data.init_args.skip_missing_text: true to train without them")


def _small_val_split(tmp_path: Path) -> tuple[list[str], str]:
    args = _with(tmp_path, "--data.init_args.val_fraction", "0.05")
    return ["fit", *args, "--trainer.devices", "2", "--config", str(REPO / "configs/strategies/ddp.yaml")], (
        "the val split has 2 windows of seq_len 16 (42 tokens), fewer than one batch of 4 x 2 data-parallel ranks "
        "(data.init_args.val_fraction); raise val_fraction, lower batch_size or seq_len, or add data")


def _small_vocab(tmp_path: Path) -> tuple[list[str], str]:
    return ["fit", *_with(tmp_path, "--data.init_args.vocab_size", "4096")], (
        "the corpus yields only ")


def _unknown_strategy(tmp_path: Path) -> tuple[list[str], str]:
    return ["fit", *tiny_args(tmp_path), "--trainer.strategy", "zero4"], (
        "unknown strategy 'zero4' (trainer.strategy); use one of lit-lm's: ep, lm_ddp, lm_parallel, pp, tp, zero1, "
        "zero2, zero3 (configs/strategies/*.yaml compose them), or one of Lightning's (e.g. ddp, fsdp)")


def _pp_stages(tmp_path: Path) -> tuple[list[str], str]:
    return ["fit", *tiny_args(tmp_path), "--config", str(REPO / "configs/strategies/pp.yaml"),
            "--trainer.devices", "2"], (
        "pipeline_parallel_size = 2 stages but the model has 1 layers: every stage needs at least one layer; lower "
        "pipeline_parallel_size")


def _fp16(tmp_path: Path) -> tuple[list[str], str]:
    return ["fit", *tiny_args(tmp_path), "--trainer.precision", "16-mixed"], (
        "fp16 precision '16-mixed' is not supported (trainer.precision): its loss scaler skips steps from one "
        "rank's gradients only; use bf16-mixed, bf16-true or 32-true")


def _truncated_meta(tmp_path: Path) -> tuple[list[str], str]:
    ckpt = tmp_path / "run/checkpoints/last.ckpt"
    ckpt.mkdir(parents=True)
    torch.save({"global_step": 4, "hyper_parameters": {"lr": 1.0, "blob": list(range(10_000))}}, ckpt / "meta.pt")
    (ckpt / "meta.pt").write_bytes((ckpt / "meta.pt").read_bytes()[:200])
    (ckpt / "COMPLETE").write_text("{}")
    return ["validate", *tiny_args(tmp_path), "--ckpt_path", "last"], f"{ckpt / 'meta.pt'} cannot be read ("


def _small_train_split(tmp_path: Path) -> tuple[list[str], str]:
    """The advice for a train split too small is the opposite of the val split's: a smaller val_fraction."""
    return ["fit", *_with(tmp_path, "--data.init_args.val_fraction", "0.95")], (
        "the train split has 2 windows of seq_len 16 (43 tokens), fewer than one batch of 4 x 1 data-parallel ranks "
        "(data.init_args.val_fraction); lower val_fraction, lower batch_size or seq_len, or add data")


def _n_heads(tmp_path: Path) -> tuple[list[str], str]:
    """Raised while jsonargparse builds the model: reported before, not inside its union-type error."""
    return ["fit", *_with(tmp_path, "--model.init_args.config.n_heads", "5")], (
        "model config `n_heads`=5 must divide `d_model`=32 (model.init_args.config.n_heads); pick n_heads from the "
        "divisors of d_model, e.g. 4 (head_dim 8)")


def _cp_seq_len(tmp_path: Path) -> tuple[list[str], str]:
    """Refused at setup, not at the first step's zigzag split."""
    return ["fit", *_with(tmp_path, "--data.init_args.seq_len", "18"), "--config",
            str(REPO / "configs/strategies/cp.yaml"), "--trainer.devices", "2"], (
        "context_parallel_size=2 splits each sequence into 2·cp=4 zigzag chunks, but seq_len is 18 "
        "(data.init_args.seq_len); use a multiple of 4, or another cp")


CASES = {f.__name__.lstrip("_"): f for f in (_binary_file, _missing_text, _small_val_split, _small_vocab,
                                              _unknown_strategy, _pp_stages, _fp16, _truncated_meta,
                                              _small_train_split, _n_heads, _cp_seq_len)}


def _sources(tmp_path: Path, *entries: str) -> list[str]:
    """tiny_args reading `data.init_args.sources` (the yaml flow entries, `{dir}` the folder of two existing
    folders `a` and `b`) instead of files: these refusals come before any folder is read."""
    for name in "ab":
        (tmp_path / name).mkdir(exist_ok=True)
    args = tiny_args(tmp_path)
    args = args[: args.index("--data.init_args.files")] + args[args.index("--data.init_args.files") + 2:]
    return ["fit", *args, "--data.init_args.sources", "[" + ", ".join(entries).format(dir=tmp_path) + "]"]


# Raised while jsonargparse builds the data module (or links its vocabulary to the model): it wraps them in its
# own errors (a union-type ValueError, ~80 lines of traceback), which the report unwraps to their one line.
SOURCE_CASES = {
    "negative weight": (["{{path: {dir}/a, weight: -1}}", "{{path: {dir}/b}}"],
                        "data.init_args.sources[0].weight must be a positive number, got -1"),
    "one zero weight": (["{{path: {dir}/a}}", "{{path: {dir}/b, weight: 0}}"],
                        "data.init_args.sources[1].weight must be a positive number, got 0"),
    "all zero weights": (["{{path: {dir}/a, weight: 0}}", "{{path: {dir}/b, weight: 0}}"],
                         "data.init_args.sources[0].weight must be a positive number, got 0"),
    "not a number": (["{{path: {dir}/a, weight: heavy}}", "{{path: {dir}/b}}"],
                     "data.init_args.sources[0].weight must be a positive number, got heavy"),
    "stream with weighted": (["{{path: {dir}/a, stream: true}}", "{{path: {dir}/b, weight: 0.5}}"],
                             "data.init_args.sources: a stream source is read alone"),
    "duplicate names": (["{{path: {dir}/a}}", "{{path: {dir}/b, name: a}}"],
                        "data.init_args.sources: two sources are named alike (['a', 'a'])"),
    "missing path": (["{{path: {dir}/a}}", "{{path: {dir}/nowhere}}"],
                     "data.init_args.sources[1].path {dir}/nowhere does not exist"),
}

# Raised while jsonargparse builds the model from a Hugging Face folder's config.json (model.init_args.init_from).
HF_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4}
HF_CASES = {
    "gpt2": ({"model_type": "gpt2"}, "`model_type` 'gpt2' cannot be imported"),
    "3 heads of hidden 64": ({"num_attention_heads": 3, "num_key_value_heads": 3}, "`n_heads`=3 must divide"),
    "head_dim 33": ({"head_dim": 33}, "`head_dim`"),
    "longrope": ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
                 "`rope_scaling` rope_type 'longrope' cannot"),
    "gelu": ({"hidden_act": "gelu"}, "`hidden_act` 'gelu' cannot be imported"),
}


def _hf_folder(tmp_path: Path, changes: dict) -> list[str]:
    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**HF_LLAMA, **changes}))
    save_file({"model.norm.weight": torch.ones(64)}, str(folder / "model.safetensors"))
    return ["fit", *tiny_args(tmp_path), "--model.init_args.init_from", str(folder)]


@pytest.mark.parametrize("case", [*SOURCE_CASES, *HF_CASES])
def test_an_error_while_the_settings_are_built_is_one_line(tmp_path, case):
    """Through the command, each is the one line naming the problem, exit 2 (a traceback and exit 1 before)."""
    if case in SOURCE_CASES:
        entries, message = SOURCE_CASES[case]
        args, message = _sources(tmp_path, *entries), message.format(dir=tmp_path)
    else:
        changes, message = HF_CASES[case]
        args = _hf_folder(tmp_path, changes)
    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("Seed set")]
    assert len(lines) == 1 and lines[0].startswith("lit-lm: error: "), done.stderr[-3000:]
    assert message in lines[0]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line(tmp_path, case):
    args, message = CASES[case](tmp_path)
    started = time.monotonic()
    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert time.monotonic() - started < 120  # no rank waits for a timeout
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(f"lit-lm: error: {message}"), done.stderr[-3000:]
    assert "Traceback" not in done.stderr


def test_a_bad_environment_switch_is_one_config_error(monkeypatch):
    for name in ("LIT_LM_MALLOC",):
        monkeypatch.setenv(name, "bogus")
        with pytest.raises(ConfigError, match=rf"^{name}='bogus' is not one of \w+, \w+"):
            check_trainer_config(SimpleNamespace(precision="32-true", strategy="auto"))
        monkeypatch.delenv(name)
    check_environment()  # unset: the defaults


def test_debug_shows_the_traceback(tmp_path):
    done = run_cli("fit", *tiny_args(tmp_path), "--trainer.precision", "16-mixed", "--debug", cwd=tmp_path)
    assert done.returncode != 0 and "Traceback" in done.stderr and "ConfigError: fp16 precision" in done.stderr


def test_every_unknown_key_is_one_line_with_the_nearest_key(tmp_path):
    """Three typos in a yaml and one on the command line: four lines, each naming its key and the nearest known
    one, before anything is parsed or trained (jsonargparse alone prints ~50 lines of usage for the first)."""
    bad = tmp_path / "typos.yaml"
    bad.write_text("trainer:\n  max_step: 3\nmodel:\n  init_args:\n    config:\n      n_layer: 2\n"
                   "data:\n  init_args:\n    seq_lenn: 16\n")
    done = run_cli("fit", *tiny_args(tmp_path), "--config", str(bad), "--data.init_args.batch_sise", "2", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"lit-lm: error: unknown key 'max_step' in {bad} (trainer.max_step); did you mean trainer.max_steps?",
        f"lit-lm: error: unknown key 'n_layer' in {bad} (model.init_args.config.n_layer); did you mean "
        "model.init_args.config.n_layers?",
        f"lit-lm: error: unknown key 'seq_lenn' in {bad} (data.init_args.seq_lenn); did you mean "
        "data.init_args.seq_len?",
        "lit-lm: error: unknown key 'batch_sise' in the command line (data.init_args.batch_sise); did you mean "
        "--data.init_args.batch_size?"]


def test_the_repository_configs_have_no_unknown_key(tmp_path):
    """The key check knows every key the shipped configs use (no false alarm), and the options the tests pass."""
    from lit_lm.config_keys import unknown_keys

    configs = sorted((REPO / "configs").rglob("*.yaml"))
    assert len(configs) > 20
    argv = [*tiny_args(tmp_path), "--trainer.callbacks.every_n_train_steps", "2", "--trainer.strategy.init_args.x",
            "1", "--model.init_args.config.n_kv_heads", "2"]
    assert unknown_keys(configs, argv) == []
