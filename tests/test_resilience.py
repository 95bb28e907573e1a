"""Checkpoints that never stop the run, and runs that come back by themselves: a save written in the background
and killed with SIGKILL leaves the previous checkpoint whole (2 ranks), retention keeps exactly the newest k and
every N-th step's (zero3 x 2), and a full disk is one line with nothing published."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import FileSystemWriter

import lit_lm.strategies.registry  # noqa: F401  (registers lm_ddp, zero3)
from dist_utils import fit_tiny, run_distributed
from lit_lm.retention import RetainingCheckpoint
from lit_lm.strategies import checkpoint as ckpt
from lit_lm.strategies.async_save import AsyncSaver
from test_crash import _launch


def _every(n: int, ckpt_dir: str) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=n, save_top_k=-1, save_last=True)


class _Progress(L.Callback):
    """Write the global step reached after every batch (rank-named file)."""

    def __init__(self, file: str) -> None:
        self.file = file

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        Path(f"{self.file}.{trainer.global_rank}").write_text(str(trainer.global_step))


# -- kill -9 during a background save, 2 ranks ------------------------------------------------------------------
def _train_and_hang_in_background_save(ckpt_dir: str, mark: str) -> None:
    """lm_ddp x 2, 8 steps, a save every 2 (`step=N.ckpt`, then `last.ckpt`: hard links to the same shards); the 2nd
    write (step=4) stops after its shards are written, on the writer thread, as a process killed in the middle of a
    save would."""
    real_save, calls = ckpt.dcp.save, [0]

    def hanging_save(state: dict, **kwargs: Any) -> None:
        real_save(state, **kwargs)
        calls[0] += 1
        if calls[0] == 2:
            rank = int(os.environ["RANK"])
            on_thread = threading.current_thread() is not threading.main_thread()
            Path(f"{mark}.hung.{rank}").write_text(f"{kwargs['checkpoint_id']}|{on_thread}")
            time.sleep(600)

    ckpt.dcp.save = hanging_save
    fit_tiny("lm_ddp", devices=2, max_steps=8, callbacks=(_every(2, ckpt_dir), _Progress(mark)), one_batch=True)


def _resume(ckpt_dir: str, max_steps: int) -> dict:
    return fit_tiny("lm_ddp", devices=2, max_steps=max_steps, callbacks=(_every(2, ckpt_dir),), ckpt_path="last",
                    one_batch=True)


def test_kill_during_background_save_resumes_from_the_previous_checkpoint(tmp_path: Path) -> None:
    ckpt_dir, mark = tmp_path / "ckpt", str(tmp_path / "mark")
    procs = _launch("test_resilience._train_and_hang_in_background_save", 2, str(ckpt_dir), mark)
    progress = [Path(f"{mark}.{r}") for r in (0, 1)]
    hung = [Path(f"{mark}.hung.{r}") for r in (0, 1)]
    deadline = time.monotonic() + 240
    try:
        # the step-4 write hangs on both ranks while training goes on to step 6 (whose save waits for it)
        while time.monotonic() < deadline and all(p.poll() is None for p in procs) and not (
                all(h.exists() for h in hung) and all(p.exists() and int(p.read_text() or 0) >= 6 for p in progress)):
            time.sleep(0.2)
        assert all(h.exists() for h in hung), [p.communicate(timeout=30)[1][-3000:] for p in procs if p.poll()]
        assert all(int(p.read_text()) >= 5 for p in progress)  # the step did not wait for the write
    finally:
        for p in procs:
            p.kill()  # SIGKILL: no cleanup runs
            p.wait()
    for h in hung:
        partial, on_thread = h.read_text().split("|")
        assert on_thread == "True" and Path(partial).name.startswith("step=4.ckpt" + ckpt.TMP)
        assert not (Path(partial) / ckpt.COMPLETE).exists()
    assert not (ckpt_dir / "step=4.ckpt").exists()
    assert ckpt.check_complete(ckpt_dir / "last.ckpt")["step"] == 2  # the previous checkpoint, whole

    resumed = run_distributed(_resume, 2, str(ckpt_dir), 8, init_process_group=False)[0]
    full = fit_tiny(devices=1, max_steps=8, one_batch=True)
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"][2:]), rtol=1e-5, atol=0)
    assert not list(ckpt_dir.glob(f"*{ckpt.TMP}*"))  # the killed save's leftovers are gone
    assert ckpt.check_complete(ckpt_dir / "last.ckpt")["step"] == 8


# -- retention ------------------------------------------------------------------------------------------------
def _retained_run(ckpt_dir: str) -> list[str]:
    keeper = RetainingCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, keep_last=3, keep_every=5,
                                 save_last=True)
    fit_tiny("zero3", devices=2, max_steps=20, steps_per_epoch=4, callbacks=(keeper,), one_batch=True)
    return sorted(p.name for p in Path(ckpt_dir).iterdir())


def test_retention_keeps_the_newest_and_every_nth(tmp_path: Path) -> None:
    """A save every step for 20 steps under zero3 x 2 (in the background) ends with steps 5, 10, 15 (every 5th)
    and 18, 19, 20 (the newest 3), each complete, and last.ckpt; nothing else."""
    names = run_distributed(_retained_run, 2, str(tmp_path), init_process_group=False)[0]
    assert names == ["last.ckpt"] + [f"step={s:05d}.ckpt" for s in (5, 10, 15, 18, 19, 20)]
    assert ckpt.check_complete(tmp_path / "last.ckpt")["step"] == 20
    for s in (5, 10, 15, 18, 19, 20):
        assert ckpt.check_complete(tmp_path / f"step={s:05d}.ckpt")["step"] == s


def test_retention_refuses_a_filename_without_step() -> None:
    with pytest.raises(ValueError, match="must contain {step}"):
        RetainingCheckpoint(filename="model")


# -- a full disk ------------------------------------------------------------------------------------------------
def _fill_the_disk_at_save(ckpt_dir: str, failing: str, background: bool) -> str:
    real_write = FileSystemWriter.write_data

    def write_data(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        if Path(self.path).name.startswith(failing + ckpt.TMP):  # inside the temporary directory of `failing`
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, plan, planner)

    FileSystemWriter.write_data = write_data
    from lit_lm.strategies.ddp import DataParallelStrategy

    try:
        fit_tiny(DataParallelStrategy(async_checkpoint=background), devices=1, max_steps=6,
                 callbacks=(_every(2, ckpt_dir),), one_batch=True)
    except ckpt.CheckpointSaveError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("background", [True, False])
def test_full_disk_is_one_line_and_publishes_nothing(tmp_path: Path, background: bool) -> None:
    """The write of step=4 fails with ENOSPC: one line naming it; step=4 never appears, last.ckpt stays at step 2,
    no temporary directory is left."""
    message = run_distributed(_fill_the_disk_at_save, 1, str(tmp_path), "step=4.ckpt", background,
                              init_process_group=False)[0]
    assert "\n" not in message and f"saving checkpoint {tmp_path / 'step=4.ckpt'} failed" in message, message
    assert "No space left on device" in message and "nothing was published" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=2.ckpt"]
    assert ckpt.check_complete(tmp_path / "last.ckpt")["step"] == 2


def _save_where_rank_zero_cannot_make_the_folder(folder: str) -> str:
    """A background save into `<file>/step=1.ckpt`: rank 0 alone makes the directory, and fails."""
    saver = AsyncSaver(timedelta(seconds=60))  # a rank left behind would wait this long, then fail otherwise
    ckpt.save(Path(folder) / "step=1.ckpt", saver.stage({"model": {"w": torch.ones(3)}}), {"global_step": 1}, {},
              background=saver)
    try:
        saver.wait()
    except ckpt.CheckpointSaveError as e:
        return str(e)
    return "no error"


def test_a_folder_rank_zero_cannot_make_fails_on_every_rank(tmp_path: Path) -> None:
    """What rank 0 alone does in a save is told to every rank: each raises the same one line (before, rank 1 sat in
    the next barrier until the group's timeout)."""
    (tmp_path / "a_file").write_text("")
    messages = run_distributed(_save_where_rank_zero_cannot_make_the_folder, 2, str(tmp_path / "a_file"))
    assert messages[0] == messages[1], messages
    assert f"saving checkpoint {tmp_path / 'a_file' / 'step=1.ckpt'} failed" in messages[0], messages


def test_removals_queued_behind_a_save_run_before_wait_returns() -> None:
    """Retention's removals (and last.ckpt's alias) run on the writer thread after its save; the next save starts
    only after `wait()`, which covers them, so the two never touch the folder at once (they did: the next save's
    `remove_stale` deleted the alias's `last.ckpt.tmp-*` and one rank stopped, the other hung)."""
    saver, gate, removing, release, order = AsyncSaver(), threading.Event(), threading.Event(), threading.Event(), []

    def slow_removal() -> None:
        removing.set()
        release.wait(timeout=60)
        order.append("removed")

    saver.submit(lambda: gate.wait(timeout=60))
    saver.after_publish(slow_removal)
    gate.set()
    assert removing.wait(timeout=60)
    assert saver.in_flight  # the removal is still part of the save in flight
    waiter = threading.Thread(target=lambda: (saver.wait(), order.append("waited")))
    waiter.start()
    waiter.join(timeout=1)  # wait() must not return while the removal runs
    release.set()
    waiter.join(timeout=60)
    assert order == ["removed", "waited"]
    saver.after_publish(lambda: order.append("at once"))  # nothing in flight: runs in the caller
    assert order[-1] == "at once" and not saver.in_flight


def test_nothing_runs_behind_a_failed_save_even_once_its_thread_has_ended(tmp_path: Path) -> None:
    """The `last.ckpt` alias of a save that failed must not run: queued while the write is on the thread (skipped
    there), or submitted after the thread ended but before `wait()` raised (it ran in the caller, linked from a
    folder that was never published, and left `last.ckpt.tmp-*` behind: the full-disk test's flake)."""
    saver, ran = AsyncSaver(), []

    def failing_write() -> None:
        raise OSError(28, "No space left on device")

    saver.submit(failing_write)
    while saver.in_flight:  # the thread ends; wait() has not raised yet
        time.sleep(0.01)
    source, meta = tmp_path / "step=4.ckpt", ckpt.serialize_meta({"global_step": 4})
    saver.after_publish(lambda: (ran.append("alias"), ckpt.save_alias(source, tmp_path / "last.ckpt", meta)))
    with pytest.raises(OSError, match="No space left"):
        saver.wait()
    assert ran == [] and list(tmp_path.iterdir()) == []


def test_an_alias_whose_source_is_gone_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ckpt.save_alias(tmp_path / "step=4.ckpt", tmp_path / "last.ckpt", ckpt.serialize_meta({"global_step": 4}))
    assert list(tmp_path.iterdir()) == []


def test_a_failed_removal_warns_and_the_next_save_goes_on() -> None:
    """A removal is rank 0's alone: raised, it would stop rank 0 while the others wait in their next collective."""
    saver, gate = AsyncSaver(), threading.Event()

    def failing_removal() -> None:
        raise PermissionError(13, "Permission denied", "step=1.ckpt")

    saver.submit(lambda: gate.wait(timeout=60))
    saver.after_publish(failing_removal)
    with pytest.warns(UserWarning, match="housekeeping after a save failed.*Permission denied"):
        gate.set()
        saver.wait()  # no error: the save itself was published
    assert not saver.in_flight


# -- preemption and requeue (loopback torchrun, 2 ranks) ---------------------------------------------------------
class SlowAfter(L.Callback):
    """From training step `step` on, rank 0 writes `file` and every rank sleeps a little per step, so that a test
    has time to send its signal before the run ends (loaded by the CLI as `test_resilience.SlowAfter`)."""

    def __init__(self, step: int, file: str) -> None:
        self.step, self.file = step, file

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            if trainer.global_rank == 0:
                Path(self.file).write_text(str(trainer.global_step))
            time.sleep(0.3)


def test_preemption_saves_at_a_common_step_and_the_requeued_job_finishes_the_run(tmp_path: Path,
                                                                                  torchrun_reference: tuple) -> None:
    """torchrun.sh, 1 node x 2 workers: SIGUSR1 to the script and its agent (as SLURM's --signal sends) mid-run ->
    both workers save last.ckpt at the same step and stop, the script exits 75; the same command again resumes
    there and ends with the uninterrupted run's losses."""
    from test_launch import REFERENCE_STEPS, REPO, _env, _free_port, _losses

    steps = REFERENCE_STEPS
    args, reference = torchrun_reference  # the one-node run (lm_ddp x 2, batch 2 per device, 10 steps)
    assert sorted(reference) == list(range(steps))
    reached = tmp_path / "reached"
    callbacks = tmp_path / "callbacks.yaml"
    callbacks.write_text(
        "trainer:\n  callbacks:\n"
        f"    - class_path: test_resilience.SlowAfter\n      init_args: {{step: 3, file: '{reached}'}}\n"
        "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
        "      init_args: {every_n_train_steps: 100, save_last: true}\n")
    run_dir = tmp_path / "job"
    command = ["bash", str(REPO / "scripts/launch/torchrun.sh"), *args, "--config", str(callbacks)]

    def submit(signal_it: bool) -> tuple[int, str]:
        env = dict(_env(), NNODES="1", NPROC_PER_NODE="2", MASTER_PORT=str(_free_port()), MAX_RESTARTS="1",
                   RUN_DIR=str(run_dir), RDZV_ID="preempt", PYTHON=sys.executable)
        log = tmp_path / f"torchrun-{signal_it}.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            deadline = time.monotonic() + 240
            while signal_it and not reached.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if signal_it and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGUSR1)  # the script and its torchrun agent
            try:
                proc.wait(timeout=240)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
        return proc.returncode, log.read_text()

    code, out = submit(signal_it=True)
    assert code == 75, out[-4000:]
    assert out.count("SIGUSR1 received") == 2 and "preempted: saved" in out, out[-4000:]
    marker = ckpt.check_complete(run_dir / "checkpoints" / "last.ckpt")  # one save, collective: a common step
    assert 3 <= marker["step"] < steps and marker["world_size"] == 2
    assert max(_losses(run_dir)) == marker["step"] - 1  # nobody trained past it

    code, out = submit(signal_it=False)  # the requeued job: the same command line
    assert code == 0, out[-4000:]
    assert f"resuming from {run_dir / 'checkpoints' / 'last.ckpt'}" in out
    losses = _losses(run_dir)
    assert sorted(losses) == sorted(reference)
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=0), step
