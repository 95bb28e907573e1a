"""Resume anywhere: a checkpoint saved under one topology resumes under others and continues the same run.

Every topology trains TinyLM on one fixed global batch of 8 rows (each dp replica reads its rows; tp and pp
peers of a replica read the same ones), fp32, and all of them match one process within 1e-5 (the strategies'
parity tests), so a resumed run's losses must equal the single-process run's losses from the saved step on.
Runs are grouped by world size, one process launch per group, in the order the sources must exist in.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from dist_utils import TINY, Recorder, TinyLM, run_distributed, token_data
from strategies.ddp import DataParallelStrategy
from strategies.pp import PipelineStrategy
from strategies.tp import TensorParallelStrategy
from strategies.zero import ZeroStrategy

K, MORE, GLOBAL_BATCH = 2, 2, 8  # save at step K, resume for MORE steps


class Topology(NamedTuple):
    dp: int
    tp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp


TOPOLOGIES = {
    "single": Topology(1), "lm_ddp": Topology(2), "zero3": Topology(2), "tp": Topology(1, tp=2),
    "pp": Topology(1, pp=2), "dp2_tp2": Topology(2, tp=2),
}


def _strategy(name: str) -> Any:
    topo = TOPOLOGIES[name]
    if name == "zero3":
        return ZeroStrategy(stage=3)
    if topo.tp > 1:
        return TensorParallelStrategy(topo.tp, sequence_parallel=True)
    if topo.pp > 1:
        return PipelineStrategy(pipeline_parallel_size=topo.pp, microbatches=2, schedule="1f1b")
    return DataParallelStrategy()


def _fit(name: str, max_steps: int, ckpt_dir: Optional[str] = None, resume: Optional[str] = None) -> list[float]:
    topo = TOPOLOGIES[name]
    dp_rank = int(os.environ.get("LOCAL_RANK", 0)) // topo.tp % topo.dp  # rank = (pp_rank * dp + dp_rank) * tp + tp_rank
    rows = token_data(GLOBAL_BATCH).view(topo.dp, -1, TINY["max_seq_len"] + 1)[dp_rank]
    loader = DataLoader(TensorDataset(rows.repeat(K + MORE, 1)), batch_size=len(rows))
    L.seed_everything(0, verbose=False)
    recorder = Recorder()
    callbacks: list[L.Callback] = [recorder]
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=K, save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=topo.world, strategy=_strategy(name), max_steps=max_steps,
                        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0, enable_checkpointing=bool(ckpt_dir))
    trainer.fit(TinyLM(), loader, ckpt_path=resume)
    return recorder.losses



def _checkpoint(root: str, source: str) -> str:
    return f"{root}/{source}/step={K}.ckpt"


def _run_group(root: str, jobs: list[tuple[Optional[str], str]]) -> list[list[float]]:
    """On one world size: (None, name) trains `name` K steps saving; (source, name) resumes `source` under `name`."""
    return [_fit(name, K, ckpt_dir=f"{root}/{name}") if source is None
            else _fit(name, K + MORE, resume=_checkpoint(root, source)) for source, name in jobs]


def run_matrix(root: Path, pairs: list[tuple[str, str]]) -> dict[tuple[Optional[str], str], list[float]]:
    """Save every source, resume every (source, target) pair; {(None, source) or (source, target): losses}."""
    pending: list[tuple[Optional[str], str]] = [(None, s) for s in dict.fromkeys(s for s, _ in pairs)] + pairs
    results: dict[tuple[Optional[str], str], list[float]] = {}
    while pending:
        # the world size with the most runnable jobs; a resume is runnable once its source is saved (before it)
        saved = {name for source, name in results if source is None}
        by_world: dict[int, list[tuple[Optional[str], str]]] = {}
        for job in pending:
            world = TOPOLOGIES[job[1]].world
            group = by_world.setdefault(world, [])
            if job[0] is None or job[0] in saved or (None, job[0]) in group:
                group.append(job)
        world, jobs = max(by_world.items(), key=lambda item: len(item[1]))
        losses = run_distributed(_run_group, world, str(root), jobs, init_process_group=False)[0]
        results.update(zip(jobs, losses))
        pending = [job for job in pending if job not in jobs]
    return results


def _check(root: Path, pairs: list[tuple[str, str]]) -> None:
    matrix = run_matrix(root, pairs)
    reference = run_distributed(_fit, 1, "single", K + MORE, init_process_group=False)[0]
    for (source, name), losses in matrix.items():
        expected = reference[:K] if source is None else reference[K:]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{source or 'fresh'} -> {name}: {m}")  # noqa: B023 (called at once)


# every source resumed under at least three other topologies
FULL = [("single", t) for t in ("lm_ddp", "tp", "pp", "dp2_tp2")] + [
    ("lm_ddp", "single"), ("lm_ddp", "zero3"), ("lm_ddp", "tp"),
    ("zero3", "single"), ("zero3", "tp"), ("zero3", "pp"),
    ("tp", "single"), ("tp", "lm_ddp"), ("tp", "pp"),
    ("pp", "single"), ("pp", "zero3"), ("pp", "lm_ddp"),
    ("dp2_tp2", "single"), ("dp2_tp2", "zero3"), ("dp2_tp2", "pp"),
]
# the representative cycle on 2 ranks: ZeRO-3 shards -> TP slices -> pipeline stages -> ZeRO-3, and each to 1
SUBSET = [("zero3", "tp"), ("tp", "pp"), ("pp", "zero3"), ("zero3", "single"), ("tp", "single"), ("pp", "single")]


def test_resume_matrix_subset(tmp_path: Path) -> None:
    _check(tmp_path, SUBSET)


@pytest.mark.slow
def test_resume_matrix_full(tmp_path: Path) -> None:
    _check(tmp_path, FULL)
