"""What a person reads while a run goes: in a log file (stdout not a terminal) a line every N steps, the steps of
max_steps across a resume, TensorBoard beside CSV, and no meaningless figures."""

from __future__ import annotations

import re

from test_cli import REPO, read_metrics, run_cli
from test_user_path import every_2_steps

LINE = re.compile(r"^step (\d+)/(\d+) \| loss \d+\.\d{4} \| lr \d\.\d\de-\d\d \| tokens/s [\d,]+ \| "
                  r"grad_norm \d+\.\d{4} \| eta \d+m\d\ds$", re.M)


def test_plain_lines_every_n_steps_and_across_a_resume(tmp_path):
    run = tmp_path / "run"
    base = every_2_steps(tmp_path)
    first = run_cli("fit", *base, "--trainer.max_steps", "12", cwd=tmp_path)  # single device: lit-lm measures
    assert first.returncode == 0, first.stderr[-3000:]                      # the gradient norm itself
    zero2 = ["--config", str(REPO / "configs/strategies/zero2.yaml"), "--trainer.devices", "1"]
    resumed = run_cli("fit", *base, *zero2, "--trainer.max_steps", "14", "--ckpt_path", "last", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    for done, lines in ((first, [("10", "12"), ("12", "12")]), (resumed, [("14", "14")])):
        assert LINE.findall(done.stdout) == lines, done.stdout
        out = done.stdout + done.stderr
        for meaningless in ("Total FLOPs", "v_num", "Epoch 0/-", "FLOPs: 0"):
            assert meaningless not in out
        assert "MFLOPs per trained token" in out
    # off a terminal no bar is drawn (its last frame used to be dumped into the log at the end), and every
    # validation inside fit is a line of its own
    for done in (first, resumed):
        assert "train (steps)" not in done.stdout and "it/s" not in done.stdout
    vals = re.findall(r"^validation at step (\d+) \| val_loss \d+\.\d{4} \| val_ppl \d+\.\d{4}$", first.stdout,
                      re.M)
    assert vals == [str(s) for s in range(2, 13, 2)], first.stdout
    # the gradient norm is in the CSV on every strategy, the single-device run's included, at every logged step
    for version in (0, 1):
        rows = read_metrics(run, version)
        assert all(r.get("grad_norm") for r in rows if r.get("train_loss")), rows
    assert len(list((run / "tensorboard").glob("version_*/events.out.tfevents.*"))) == 2
    assert (run / "lightning_logs/version_1/metrics.csv").is_file()
