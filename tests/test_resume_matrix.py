"""Resume anywhere: a checkpoint saved under one topology resumes under others and continues the same run.

Every topology trains TinyLM on one fixed global batch of 8 rows (each dp replica reads its rows; tp, pp and cp
peers of a replica read the same ones), fp32, and all of them match one process within 1e-5 (the strategies'
parity tests), so a resumed run's losses must equal the single-process run's losses from the saved step on, and
its final parameters and AdamW state (m, v, step), gathered under global names, the single-process run's.
Runs are grouped by world size, one process launch per group, in the order the sources must exist in.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from dist_utils import REFERENCE_TILES, TINY, Recorder, TinyLM, run_distributed, token_data
from lit_lm.strategies.checkpoint import read_whole
from lit_lm.strategies.composed import ComposedStrategy

K, MORE, GLOBAL_BATCH = 2, 2, 8  # save at step K, resume for MORE steps


class Topology(NamedTuple):
    dp: int
    tp: int = 1
    pp: int = 1
    zero: int = 0
    cp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


TOPOLOGIES = {
    "single": Topology(1), "lm_ddp": Topology(2), "zero3": Topology(2, zero=3), "tp": Topology(1, tp=2),
    "pp": Topology(1, pp=2), "dp2_tp2": Topology(2, tp=2), "tp2_pp2": Topology(1, tp=2, pp=2),
    "zero3_dp4": Topology(4, zero=3), "dp2_tp2_pp2": Topology(2, tp=2, pp=2, zero=1), "cp2": Topology(1, cp=2),
    "zero3_dp2_cp2": Topology(2, zero=3, cp=2),
}


def _strategy(name: str) -> ComposedStrategy:
    topo = TOPOLOGIES[name]
    pipeline = dict(microbatches=2, schedule="1f1b") if topo.pp > 1 else {}
    return ComposedStrategy(tensor_parallel_size=topo.tp, pipeline_parallel_size=topo.pp, zero_stage=topo.zero,
                            context_parallel_size=topo.cp, **pipeline)


def _whole(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _fit(name: str, max_steps: int, ckpt_dir: Optional[str] = None, resume: Optional[str] = None) -> dict[str, Any]:
    """The losses, and this rank's final parameters and optimizer state under global names (whole tensors)."""
    topo = TOPOLOGIES[name]
    # rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank; cp peers read the same rows
    dp_rank = int(os.environ.get("LOCAL_RANK", 0)) // (topo.tp * topo.cp) % topo.dp
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
    strategy = trainer.strategy
    names = {n for n, _ in trainer.lightning_module.named_parameters()}
    params = {k: _whole(v).detach().clone() for k, v in strategy.lightning_module_state_dict().items() if k in names}
    state = strategy.optimizer_state(trainer.optimizers[0])["state"]
    optim = {f"{fqn}:{k}": _whole(v).detach().clone() for fqn, s in state.items() for k, v in s.items()}
    return {"losses": recorder.losses, "params": params, "optim": optim}



def _checkpoint(root: str, source: str) -> str:
    return f"{root}/{source}/step={K}.ckpt"


def _run_group(root: str, jobs: list[tuple[Optional[str], str]]) -> list[dict[str, Any]]:
    """On one world size: (None, name) trains `name` K steps saving; (source, name) resumes `source` under `name`."""
    return [_fit(name, K, ckpt_dir=f"{root}/{name}") if source is None
            else _fit(name, K + MORE, resume=_checkpoint(root, source)) for source, name in jobs]


def _merged(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's losses; the union of the ranks' parameters and optimizer state (pipeline stages hold their own)."""
    return {"losses": per_rank[0]["losses"], **{key: {k: v for r in per_rank for k, v in r[key].items()}
                                                 for key in ("params", "optim")}}


def run_matrix(root: Path, pairs: list[tuple[str, str]]) -> dict[tuple[Optional[str], str], dict[str, Any]]:
    """Save every source, resume every (source, target) pair; {(None, source) or (source, target): run}."""
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
        per_rank = run_distributed(_run_group, world, str(root), jobs, init_process_group=False, env=REFERENCE_TILES)
        results.update((job, _merged([r[i] for r in per_rank])) for i, job in enumerate(jobs))
        pending = [job for job in pending if job not in jobs]
    return results


def _check(root: Path, pairs: list[tuple[str, str]]) -> None:
    matrix = run_matrix(root, pairs)
    reference = run_distributed(_fit, 1, "single", K + MORE, init_process_group=False)[0]
    for (source, name), run in matrix.items():
        tag = f"{source or 'fresh'} -> {name}"
        expected = reference["losses"][:K] if source is None else reference["losses"][K:]
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(expected), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{tag}: {m}")  # noqa: B023 (called at once)
        if source is None:
            continue
        for key in ("params", "optim"):  # every parameter and every m, v, step of the single-process run
            for k, value in reference[key].items():
                assert k in run[key], f"{tag}: {key} {k} missing after the resume"
                err = (run[key][k].float() - value.float()).norm().item()
                assert err <= 1e-5 * value.float().norm().item() + 1e-12, f"{tag}: {key} {k} differs by {err:.3e}"


# the first-wave sources and targets SUBSET and COMPOSED lack (lm_ddp, dp2 x tp2): every name users know is resumed
# from and into; since those strategies became presets of one strategy with one checkpoint path, the 15-pair
# matrix of the first wave re-ran that one path
FULL = [("single", "lm_ddp"), ("lm_ddp", "zero3"), ("tp", "lm_ddp"), ("single", "dp2_tp2"), ("dp2_tp2", "pp")]
# the representative cycle on 2 ranks: ZeRO-3 shards -> TP slices -> pipeline stages -> ZeRO-3, and each to 1
SUBSET = [("zero3", "tp"), ("tp", "pp"), ("pp", "zero3"), ("zero3", "single"), ("tp", "single"), ("pp", "single")]


# the composed layouts: 3D (zero1 x tp2 x pp2 on 8 ranks) to and from one process, tp x pp to ZeRO-3 on 4 (and to
# ZeRO-3 sharded over dp x cp); cp2 to and from one process (cp is not in the checkpoint)
COMPOSED = [("dp2_tp2_pp2", "single"), ("single", "dp2_tp2_pp2"), ("tp2_pp2", "zero3_dp4"),
            ("tp2_pp2", "zero3_dp2_cp2"), ("cp2", "single")]


def test_resume_matrix(tmp_path: Path) -> None:
    """Every pair of the three lists in one matrix: each world size launches once per round of runnable jobs, the
    sources saved once, one reference run."""
    _check(tmp_path, list(dict.fromkeys(SUBSET + FULL + COMPOSED)))
    # Lightning's own single-device strategy reads the 3D directory whole (`lit-lm fit --ckpt_path` on 1 device):
    # its optimizer groups must name every stage's parameters in the one-process order, or torch refuses the load
    whole = read_whole(_checkpoint(str(tmp_path), "dp2_tp2_pp2"))
    model = TinyLM()
    model.configure_model()
    groups = whole["optimizer_states"][0]["param_groups"]
    assert [i for g in groups for i in g["params"]] == list(range(len(list(model.parameters()))))
