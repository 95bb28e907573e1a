"""Multi-node launch, exercised on one machine: two torchrun agents ("nodes") on 127.0.0.1 train as one job with
the same losses as one node of the same world size, and `scripts/launch/torchrun.sh` restarts a job whose worker
dies after a checkpoint, resuming from `--ckpt_path last` with the uninterrupted run's losses.

`DieOnce` is the fault injector: a callback the CLI loads as `test_launch.DieOnce` (with tests/ on PYTHONPATH)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import cli_server
import lightning as L
import pytest

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


class DieOnce(L.Callback):
    """`os._exit(1)` on `rank` when training step `step` begins, on the first attempt of a torchrun job only
    (torchrun numbers its attempts in TORCHELASTIC_RESTART_COUNT), as a crashed worker would."""

    def __init__(self, step: int, rank: int = 0) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and trainer.global_rank == self.rank and trainer.global_step == self.step:
            wait = getattr(trainer.strategy, "wait_for_checkpoints", None)
            if wait is not None:
                wait()  # the step's checkpoint is written in the background: die once it is published
            print(f"[test] rank {self.rank} dies at step {self.step}", file=sys.stderr, flush=True)
            os._exit(1)


def _env() -> dict[str, str]:
    """The CLI's environment, tests/ on its path; torchrun's agent starts its workers (`PYTHON_EXEC -u -m lit_lm
    ...`) through this worker's CLI server (tests/cli_server.py: forked, not ~8 s of imports each; the agent is a
    real `python -m torch.distributed.run`)."""
    path = os.pathsep.join(p for p in (str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=path)
    return dict(env, PYTHON_EXEC=cli_server.python(env=env))


def _free_port() -> int:
    from dist_utils import free_port

    return free_port()


def _args(tmp_path: Path, batch: int, steps: int) -> list[str]:
    """tests/test_cli.py's tiny run under lm_ddp, without its LearningRateMonitor (so the config's last callback
    stays the ModelCheckpoint, which torchrun.sh points at CKPT_DIR)."""
    from test_cli import tiny_args

    args = [a for a in tiny_args(tmp_path) if not a.startswith("--trainer.callbacks+=")]
    return args + ["--config", str(REPO / "configs/strategies/ddp.yaml"), "--trainer.max_steps", str(steps),
                   "--data.init_args.batch_size", str(batch)]


def _losses(run_dir: Path) -> dict[int, float]:
    """step -> train_loss over every logger version under `run_dir` (a restarted attempt logs a new version)."""
    out: dict[int, float] = {}
    for version in sorted((run_dir / "lightning_logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1])):
        with open(version / "metrics.csv") as f:
            out.update({int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")})
    return out


REFERENCE_STEPS = 10  # one reference run for every torchrun test here and in test_resilience.py (conftest.py)


def _one_node(tmp_path: Path, args: list[str], run_dir: Path, devices: int) -> dict[int, float]:
    proc = subprocess.run([cli_server.python(), "-m", "lit_lm", "fit", *args, "--trainer.devices", str(devices),
                           "--trainer.default_root_dir", str(run_dir)], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _losses(run_dir)


def test_two_torchrun_nodes_match_one_node(tmp_path: Path, torchrun_reference: tuple) -> None:
    """2 nodes x 1 process (c10d rendezvous on 127.0.0.1) == 1 node x 2 processes, per-device batch 2."""
    # the reference ran first, so it also built the data cache the two "nodes" then share (each would build its own)
    args, reference = torchrun_reference
    assert sorted(reference) == list(range(REFERENCE_STEPS))

    port, run_dir = _free_port(), tmp_path / "two"
    nodes = [subprocess.Popen([*TORCHRUN, "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                               "--rdzv-id", "two-nodes", "-m", "lit_lm", "fit", *args, "--trainer.devices", "1",
                               "--trainer.num_nodes", "2", "--trainer.default_root_dir", str(run_dir)],
                              cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in (0, 1)]
    try:
        outputs = [node.communicate(timeout=180)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, out in zip(nodes, outputs):
        assert node.returncode == 0, out[-3000:]
    losses = _losses(run_dir)
    assert sorted(losses) == sorted(reference)
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=0), step
    # one job of world size 2: only global rank 0 logs, once
    assert len(list((run_dir / "lightning_logs").glob("version_*"))) == 1


def test_torchrun_sh_restarts_and_resumes_from_last(tmp_path: Path, torchrun_reference: tuple) -> None:
    """torchrun.sh, 1 node x 2 processes, MAX_RESTARTS=1: rank 1 dies as step 4 begins (checkpoints every 2
    steps); torchrun restarts both workers, which resume from last.ckpt (step 4) and finish steps 4-9 with the
    losses of an uninterrupted run."""
    steps = REFERENCE_STEPS
    args, reference = torchrun_reference
    assert sorted(reference) == list(range(steps))

    # the config's callbacks replaced: the fault, then a ModelCheckpoint every 2 steps (last: torchrun.sh sets
    # its dirpath to CKPT_DIR)
    callbacks = tmp_path / "callbacks.yaml"
    callbacks.write_text(
        "trainer:\n  callbacks:\n"
        "    - class_path: test_launch.DieOnce\n      init_args: {step: 4, rank: 1}\n"
        "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
        "      init_args: {every_n_train_steps: 2, save_top_k: -1, save_last: true}\n")
    run_dir = tmp_path / "elastic"
    env = dict(_env(), NNODES="1", NPROC_PER_NODE="2", MASTER_PORT=str(_free_port()), MAX_RESTARTS="1",
               RUN_DIR=str(run_dir), RDZV_ID="elastic", PYTHON=sys.executable)
    log = tmp_path / "torchrun.log"
    with open(log, "w") as f:
        proc = subprocess.run(["bash", str(REPO / "scripts/launch/torchrun.sh"), *args, "--config", str(callbacks)],
                              cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=300)
    out = log.read_text()
    assert proc.returncode == 0, out[-4000:]
    assert "rank 1 dies at step 4" in out
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "last.ckpt" / "COMPLETE").is_file()
    assert f"checkpoint: {ckpts / 'last.ckpt'}" in out

    # attempt 0 logged steps 0-3 (version_0), attempt 1 resumed at step 4 (version_1)
    versions = sorted(p.name for p in (run_dir / "lightning_logs").glob("version_*"))
    assert versions == ["version_0", "version_1"]
    with open(run_dir / "lightning_logs/version_1/metrics.csv") as f:
        assert sorted({int(r["step"]) for r in csv.DictReader(f) if r.get("train_loss")}) == list(range(4, steps))
    losses = _losses(run_dir)
    assert sorted(losses) == sorted(reference)
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=0), step
