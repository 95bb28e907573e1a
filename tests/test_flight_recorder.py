"""Every collective a strategy or callback issues is in the accounting layer, labelled by its caller: metric sync
(`self.log(sync_dist=True)` -> `strategy.reduce`), broadcasts, barriers, the checkpoint's phases (DCP included) and
the gradient traffic, so the flight recorder (`format_history`) names whichever a hung rank was in."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint

from dist_utils import fit_tiny, run_distributed
from lit_lm.strategies.comm import COMM_LOG, format_history
from lit_lm.strategies.ddp import DataParallelStrategy


def _train_and_save(ckpt_dir: str) -> dict:
    COMM_LOG.reset()  # count from here (records accumulate only after a reset)
    fit_tiny(DataParallelStrategy(), devices=2, steps_per_epoch=2, max_steps=2,
             callbacks=(ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1),))
    return {"records": {(r.op, r.label) for r in COMM_LOG.records}, "history": format_history()}


def test_recorder_names_every_kind_of_collective(tmp_path: Path) -> None:
    for rank in run_distributed(_train_and_save, 2, str(tmp_path), init_process_group=False):
        records = rank["records"]
        for expected in [("broadcast", "broadcast parameters"), ("all_reduce", "GradSync bucket"),
                         ("all_reduce", "strategy.reduce"), ("broadcast_object", "strategy.broadcast"),
                         ("broadcast_object", "checkpoint save: directory"),
                         ("all_gather_object", "checkpoint save: shards written"),  # each rank's write failure, if any
                         ("broadcast_object", "checkpoint save: published")]:  # rank 0's rename, told to all
            assert expected in records, (expected, sorted(records))
        assert any(op == "dcp_save" and label.startswith("checkpoint save") for op, label in records)
        assert "[checkpoint save: published]" in rank["history"]  # the last thing each rank entered


def test_records_accumulate_only_after_a_reset(monkeypatch) -> None:
    """A training run that never measures keeps only the bounded history (no list growing by a record per
    collective); a reset starts counting."""
    from lit_lm.strategies import comm

    monkeypatch.setattr(comm.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(comm, "group_name", lambda group: "dp")
    log = comm.CommLog(history=4)
    for _ in range(10):
        log.add("all_reduce", None, 8, 4, "GradSync bucket")
    assert log.records == [] and len(log.history) == 4
    log.reset()
    log.add("all_reduce", None, 8, 4)
    assert len(log.records) == 1 and log.summary()["all_reduce"]["calls"] == 1
