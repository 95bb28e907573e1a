"""Bad input through the `lit-lm` command: one line `lit-lm: error: <what> (<key>); <fix>`, printed once (rank 0),
no traceback unless --debug, exit status 2 on every rank."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

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
        "unknown strategy 'zero4' (trainer.strategy); use one of lit-lm's: ep, lm_ddp, lm_parallel, pp, tp, zero1, zero2, zero3 "
        "(configs/strategies/*.yaml compose them), or one of Lightning's (e.g. ddp, fsdp)")


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


CASES = {f.__name__.lstrip("_"): f for f in (_binary_file, _missing_text, _small_val_split, _small_vocab,
                                              _unknown_strategy, _pp_stages, _fp16, _truncated_meta)}


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


def test_debug_shows_the_traceback(tmp_path):
    done = run_cli("fit", *tiny_args(tmp_path), "--trainer.precision", "16-mixed", "--debug", cwd=tmp_path)
    assert done.returncode != 0 and "Traceback" in done.stderr and "ConfigError: fp16 precision" in done.stderr
