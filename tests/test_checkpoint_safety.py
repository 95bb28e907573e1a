"""Nothing from a checkpoint runs as code: a pickle that would call `os.system` (here: create a marker file) is
refused in one line wherever a checkpoint is read (a single file, a directory's meta.pt, DCP's `.metadata` and its
non-tensor values), and the marker never appears."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lit_lm.checkpoints import read_checkpoint, read_meta
from lit_lm.strategies import checkpoint as ckpt
from lit_lm.strategies.safe_load import UnsafeCheckpointError
from test_cli import run_cli, run_script

REPO = Path(__file__).resolve().parent.parent


class _RunsCode:
    """Unpickling this calls `os.system(command)`: what a crafted checkpoint can carry."""

    def __init__(self, marker: Path) -> None:
        self.command = f"touch {marker}"

    def __reduce__(self) -> tuple:
        return os.system, (self.command,)


def _hparams(marker: Path) -> dict:
    return {"config": {"d_model": 32}, "lr": _RunsCode(marker)}


def _directory(path: Path, meta: object, value: object = 0.1) -> Path:
    """A complete-looking sharded checkpoint directory whose meta.pt is `meta` and one non-tensor value `value`."""
    state = {"model": {"w": torch.ones(2)},
             "optimizer_0": {"state": {"w": {"step": torch.tensor(1.0)}},
                             "param_groups": [{"lr": value, "params": ["w"]}]}}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    torch.save(meta, path / ckpt.META)
    (path / ckpt.COMPLETE).write_text(json.dumps({"step": 1}))
    return path


def test_crafted_single_file_is_refused_by_the_cli(tmp_path: Path) -> None:
    """`lit-lm validate --ckpt_path evil.ckpt`: one line, exit 2, and os.system never runs."""
    marker, evil = tmp_path / "pwned", tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": _hparams(marker), "global_step": 0}, evil)
    proc = run_cli("validate", "--config", str(REPO / "configs/default.yaml"),
                   "--trainer.default_root_dir", str(tmp_path / "run"), "--ckpt_path", str(evil), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lit-lm: error:")]
    assert len(errors) == 1 and f"{evil} is refused" in errors[0] and "posix.system" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not marker.exists()


def test_crafted_directory_is_refused_everywhere(tmp_path: Path) -> None:
    """A directory: its meta.pt, DCP's `.metadata` pickle and DCP's non-tensor values are each refused."""
    marker = tmp_path / "pwned"
    evil_meta = _directory(tmp_path / "meta.ckpt", {"global_step": 1, "hyper_parameters": _hparams(marker)})
    with pytest.raises(UnsafeCheckpointError, match="meta.pt is refused"):
        read_meta(evil_meta)
    with pytest.raises(UnsafeCheckpointError, match="meta.pt is refused"):
        read_checkpoint(evil_meta)

    evil_value = _directory(tmp_path / "value.ckpt", {"global_step": 1}, value=_RunsCode(marker))
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        read_checkpoint(evil_value)

    evil_metadata = _directory(tmp_path / "metadata.ckpt", {"global_step": 1})
    (evil_metadata / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata is refused.*posix\.system"):
        read_checkpoint(evil_metadata)
    report = run_script("scripts/ckpt.py", "inspect", evil_metadata, cwd=REPO)
    assert report.returncode == 2 and "is refused" in report.stderr and "Traceback" not in report.stderr
    assert not marker.exists()

    # the same directories with plain values read as before
    plain = read_checkpoint(_directory(tmp_path / "plain.ckpt", {"global_step": 1}))
    assert plain["global_step"] == 1 and plain["optimizer_states"][0]["param_groups"][0]["lr"] == 0.1
    torch.testing.assert_close(plain["state_dict"]["w"], torch.ones(2))


def test_plain_single_file_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "plain.ckpt"
    buffer = io.BytesIO()
    torch.save({"state_dict": {"w": torch.ones(3)}, "hyper_parameters": {"config": {"d_model": 32}}}, buffer)
    path.write_bytes(buffer.getvalue())
    assert read_checkpoint(path)["hyper_parameters"]["config"]["d_model"] == 32
