"""Compression on sharded weights: masks, observers, TTQ's learned scales and k-means codebooks computed under
zero2, zero3 and tp=2 (2 gloo ranks) and under tp=2 x ZeRO-2 and tp=2 x ZeRO-3 (4 ranks: each weight cut twice)
are the single-process ones, as are the losses of int8, ternary (TWN, TTQ), binary and k-means layers; weights,
the replicas the forward reads and optimizer state stay masked (or on their centroids) on every shard, and a
shard-local mask would differ."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lit_lm.callbacks.compress import QAT, KMeansQuantization, Pruning
from lit_lm.callbacks.compress.core import local_part, owned_weights
from dist_utils import TinyLM, rank_share, run_distributed, token_data
from lit_lm.config import ConfigError
from lit_lm.strategies.base import WeightShard
from lit_lm.strategies.pp import PipelineStrategy
from lit_lm.strategies.tp import TensorParallelStrategy
from lit_lm.strategies.zero import ZeroStrategy


class FrozenLM(TinyLM):
    """lr = 0 but for the LM head: the pruned and quantized blocks keep the deterministic initial weights, so masks
    must agree exactly (with training, last-bit differences between strategies could flip a weight sitting on the
    threshold); the head, which k-means clusters, trains, so its centroids follow updated weights."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        head = [p for name, p in self.named_parameters() if "lm_head" in name]
        rest = [p for name, p in self.named_parameters() if "lm_head" not in name]
        groups = [{"params": rest, "lr": 0.0}] + ([{"params": head, "lr": 1e-2}] if head else [])
        return torch.optim.AdamW(groups)


class PartsKept(L.Callback):
    """At the end: on every rank, each pruned weight part, the replica the forward reads and the part's Adam
    moments are zero outside the mask; each k-means weight part and replica hold its centroids."""

    def __init__(self, prunings: list[Pruning], kmeans: KMeansQuantization) -> None:
        self.prunings, self.kmeans, self.ok = prunings, kmeans, []

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        for ws in owned_weights(trainer, pl_module):
            for p in self.prunings:
                if ws.name in p.masks:
                    moments = [(optimizer.state[ws.local][k], local_part(p.masks[ws.name], ws))
                               for k in ("exp_avg", "exp_avg_sq")]
                    self.ok.extend(float(t.detach()[~mask].abs().sum()) == 0
                                   for t, mask in _held(ws, p.masks[ws.name]) + moments)
            if ws.name in self.kmeans.codebooks:
                snapped = self.kmeans.codebooks[ws.name][self.kmeans.assignments[ws.name]]
                self.ok.extend(torch.equal(t.detach(), value) for t, value in _held(ws, snapped))


def _held(ws: WeightShard, full: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, its part of the global-shaped `full`): the optimizer's part and, under ZeRO-1/2, the replica."""
    return [(ws.local, local_part(full, ws))] + ([(ws.replica, full[ws.param_index])] if ws.replica is not None else [])


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


class SavedState(L.Callback):
    """At the end: what the compression callbacks would put in a checkpoint (merged over the ranks)."""

    def __init__(self, callbacks: list[L.Callback]) -> None:
        self.callbacks, self.saved = callbacks, []

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.saved = [c.state_dict() for c in self.callbacks]


def _fit(strategy: Any, devices: int, dp: int, scope: str = "global", tp: int = 1) -> dict[str, Any]:
    prunings = [Pruning("unstructured", 0.6, start_step=1, scope=scope, include=["*.attn.*"]),
                Pruning("nm", start_step=1, include=["*.blocks.0.mlp.*"]),
                Pruning("structured", 0.5, start_step=1, importance="l2", include=["*.blocks.1.mlp.*"])]
    # int8, TWN, TTQ and binary, on layers that TP splits by rows (wo, w_down) and by columns
    qats = [QAT(8, include=["*.blocks.0.attn.*"]), QAT(2, include=["*.blocks.0.mlp.*"]),
            QAT(2, ternary="ttq", scale_lr=0.01, include=["*.blocks.1.attn.*"]), QAT(1, include=["*.blocks.1.mlp.*"])]
    kmeans = KMeansQuantization(bits=3, include=["*lm_head"], exclude=())  # split by rows under tp (vocab)
    check, losses = PartsKept(prunings, kmeans), Losses()
    saved = SavedState([*prunings, *qats])
    dp_rank = int(os.environ.get("LOCAL_RANK", 0)) // tp % dp  # tp innermost; tp peers (and pp stages): one batch
    data = rank_share(token_data(16), 8, dp_rank, dp)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, logger=False,
                        callbacks=[*prunings, *qats, kmeans, check, saved, losses], enable_progress_bar=False,
                        enable_model_summary=False,
                        enable_checkpointing=False, use_distributed_sampler=False, num_sanity_val_steps=0)
    trainer.fit(FrozenLM(), DataLoader(TensorDataset(data), batch_size=8 // dp))
    return {"masks": [p.masks for p in prunings], "observers": {k: v for q in qats for k, v in q.observers.items()},
            "ttq": qats[2].ttq_scales, "ok": check.ok, "losses": losses.losses,
            "codebooks": kmeans.codebooks, "assignments": kmeans.assignments,
            "saved_masks": [state["masks"] for state in saved.saved[: len(prunings)]],
            "saved_observers": {k: v for state in saved.saved[len(prunings):] for k, v in state["observers"].items()},
            "saved_ttq": saved.saved[-2]["ttq_scales"]}


def _sharded_runs() -> list[dict[str, Any]]:
    return [_fit(ZeroStrategy(stage=2), 2, 2), _fit(ZeroStrategy(stage=3), 2, 2),
            _fit(TensorParallelStrategy(tensor_parallel_size=2), 2, 1, tp=2)]


def _tp_zero_runs() -> list[dict[str, Any]]:
    """dp=2 x tp=2: ZeRO shards the rows of each tp slice (of a row-parallel weight: rows of a column slice)."""
    return [_fit(ZeroStrategy(stage=stage, tensor_parallel_size=2), 4, 2, tp=2) for stage in (2, 3)]


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    run = _fit("auto", 1, 1)
    assert run["ok"] and all(run["ok"]) and run["codebooks"]
    return run


def _assert_like_single(run: dict[str, Any], single: dict[str, Any], tag: str) -> None:
    assert run["ok"] and all(run["ok"]), tag
    for got, want in zip(run["masks"], single["masks"]):
        assert got.keys() == want.keys(), tag
        for name in want:
            assert torch.equal(got[name], want[name]), (tag, name)
    for name, observer in single["observers"].items():  # a range over the same global batch
        torch.testing.assert_close(run["observers"][name], observer, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, t=tag, n=name: f"{t} {n}: {m}")
    assert run["ttq"].keys() == single["ttq"].keys() and len(single["ttq"]) == 4
    for name, scales in single["ttq"].items():  # the same gradient, summed from the shards
        assert not scales.isnan().any() and scales[3, 0] == 2  # two Adam steps
        torch.testing.assert_close(run["ttq"][name], scales, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, t=tag, n=name: f"{t} {n}: {m}")
    assert run["codebooks"].keys() == single["codebooks"].keys(), tag
    for name, codebook in single["codebooks"].items():  # clustered on the gathered head, then means of the parts
        assert torch.equal(run["assignments"][name], single["assignments"][name]), (tag, name)
        torch.testing.assert_close(run["codebooks"][name], codebook, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, t=tag, n=name: f"{t} {n}: {m}")
    torch.testing.assert_close(run["losses"], single["losses"], rtol=1e-5, atol=1e-6)


def test_masks_and_observers_match_single_process_under_zero_and_tp(single: dict[str, Any]) -> None:
    per_rank = run_distributed(_sharded_runs, 2, init_process_group=False)
    for rank_runs in per_rank:
        for tag, run in zip(("zero2", "zero3", "tp"), rank_runs):
            _assert_like_single(run, single, tag)


def test_compression_matches_single_process_under_tp_with_zero(single: dict[str, Any]) -> None:
    per_rank = run_distributed(_tp_zero_runs, 4, init_process_group=False)
    for rank_runs in per_rank:
        for tag, run in zip(("tp2_zero2", "tp2_zero3"), rank_runs):
            _assert_like_single(run, single, tag)


def _pipeline_runs() -> list[dict[str, Any]]:
    """pp=2, one microbatch (so observers see the whole batch once a step, as one process does); each stage holds one
    of TinyLM's two blocks. A global threshold over different layers per rank is refused."""
    try:
        _fit(PipelineStrategy(pipeline_parallel_size=2, microbatches=1), 2, 1, scope="global")
        refused = ""
    except ConfigError as err:
        refused = str(err)
    return [_fit(PipelineStrategy(pipeline_parallel_size=2, microbatches=1), 2, 1, scope="layer"), refused]


def test_pipeline_stages_compress_their_layers_like_one_process_and_save_all() -> None:
    single = _fit("auto", 1, 1, scope="layer")
    per_rank = run_distributed(_pipeline_runs, 2, init_process_group=False)
    for rank, (run, refused) in enumerate(per_rank):
        assert "scope: layer" in refused
        assert run["ok"] and all(run["ok"]) and run["masks"][0]  # (the attention pruning runs on both stages)
        for got, saved, want in zip(run["masks"], run["saved_masks"], single["masks"]):
            assert all(f"blocks.{rank}." in name for name in got)  # a stage's own layers ...
            assert saved.keys() == want.keys()  # ... and every stage's in the checkpoint
            for name in want:
                assert torch.equal(saved[name], want[name]), name
        assert run["saved_observers"].keys() == single["observers"].keys()
        assert run["saved_ttq"].keys() == single["ttq"].keys()
        for name, observer in single["observers"].items():
            torch.testing.assert_close(run["saved_observers"][name], observer, rtol=1e-5, atol=1e-6)


def test_shard_local_masks_differ_from_global() -> None:
    """What the service prevents: each ZeRO shard (rows) pruned to 50% on its own, or each TP row-parallel shard
    (columns) taking its own channel scale, is not the global answer when the shards' magnitudes differ."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 16, generator=gen) * torch.tensor([1.0] * 4 + [3.0] * 4)[:, None]
    from lit_lm.callbacks.compress.pruning import magnitude_masks
    from lit_lm.callbacks.compress.qat import weight_scale

    global_mask = magnitude_masks([w], 0.5)[0]
    local = torch.cat([magnitude_masks([part], 0.5)[0] for part in w.chunk(2, 0)])
    assert global_mask.sum() == local.sum() == 64 and not torch.equal(global_mask, local)
    w[:, 8:] *= 0.1
    shard_scale = weight_scale(w[:, 8:], 8)
    assert not torch.allclose(shard_scale, weight_scale(w, 8))
