"""The estimator (`lit_lm.planner.estimate`) against measurement: real strategies on 4 gloo ranks, per rank model-state
bytes (exact), saved activations (within 10%) and communication (exact, from the accounting layer); and its
figures against the textbook theory."""

from __future__ import annotations

import dataclasses
import gc
import os
import platform
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader, TensorDataset

from dist_utils import REFERENCE_TILES, TINY, TinyLM, rank_share, run_distributed, token_data
from lit_lm.check.meter import CONTROL
from lit_lm.config import ModelConfig
from lit_lm.lora import LoRA, add_adapters
import lit_lm.planner.estimate as estimate_module
from lit_lm.planner.estimate import GLOO_STAGING, Workload, estimate, flops_per_token, peak_in_flight
from lit_lm.model import Transformer
from lit_lm.optim import Muon
from lit_lm.param_groups import param_groups
from lit_lm.resident import ResidentPeak
from lit_lm.strategies.comm import COMM_LOG
from lit_lm.strategies.composed import ComposedStrategy
from lit_lm.strategies.cp import METHODS, comm_theory
import lit_lm.strategies.host_malloc as host_malloc
from lit_lm.strategies.host_malloc import CHOICE, HostMalloc
from lit_lm.strategies.layout import ParallelConfig
from lit_lm.strategies.orthogonalize import ns_flops
from lit_lm.strategies.pp_schedules import build_schedule
from lit_lm.strategies.zero_engine import ZeroEngine, model_state_bytes

# uneven rows on purpose: 61 vocabulary rows split 16/16/16/13 over 4 ZeRO ranks, 31/30 over 2 tp ranks
MODEL = dict(TINY, vocab_size=61, vocab_multiple_of=1, n_layers=4)
GLOBAL_BATCH, SEQ = 8, TINY["max_seq_len"]
WORLD = 4
LAYOUTS = {  # name: the configuration on 4 ranks, estimated and run (`ComposedStrategy(**strategy_args())`)
    "zero1": ParallelConfig(dp_shard=4, zero_stage=1),
    "zero2": ParallelConfig(dp_shard=4, zero_stage=2),
    "zero3": ParallelConfig(dp_shard=4, zero_stage=3),
    "tp2_zero1": ParallelConfig(dp_shard=2, tp=2, zero_stage=1),
    "pp2_1f1b": ParallelConfig(dp_shard=2, pp=2, schedule="1f1b", microbatches=4),
    "pp2_gpipe": ParallelConfig(dp_shard=2, pp=2, schedule="gpipe", microbatches=2),
    "pp2_zero1": ParallelConfig(dp_shard=2, pp=2, schedule="1f1b", microbatches=2, zero_stage=1),  # the last
    # stage's root unit is empty, and still first in the all-gathers' walk: which slot each unit takes
    "tp2_moe_zero1": ParallelConfig(dp_shard=2, tp=2, sequence_parallel=False, zero_stage=1),
    "cp2_ring": ParallelConfig(dp_shard=2, cp=2, cp_method="ring"),  # the ring's sends and recvs, K/V and dK/dV
    "cp2_allgather_zero2": ParallelConfig(dp_shard=2, cp=2, cp_method="allgather", zero_stage=2),
}
# block 0 dense, blocks 1-3 MoE (replicated over tp: the model's plan), a shared expert; experts as wide as the MLP
# (at moe_d_ff 16 the routing's small tensors the estimate leaves out pass 10% of this tiny model's activations)
MODELS = {"tp2_moe_zero1": dict(MODEL, moe_experts=4, moe_top_k=2, moe_d_ff=64, moe_shared_experts=1,
                                moe_first_dense=1),
          "pp2_zero1": dict(MODEL, vocab_size=640)}  # the head (the tail unit) larger than a block: it sizes both slots


class EstimateLM(TinyLM):
    def __init__(self, model: dict) -> None:
        super().__init__()
        self.config = ModelConfig(**model)

    def configure_model(self) -> None:
        if self.model is None:
            self.model = Transformer(self.config)


class LiveSavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """The most bytes autograd held saved for backward at once (each storage once; parameters are model state),
    while active: every saved tensor is wrapped in a holder whose release (when backward frees the graph)
    subtracts its bytes again. Weights saved by matmuls (as transposed views) are parameters too."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage address -> [holders alive, bytes]
        self.current = self.peak = 0

        def pack(t: torch.Tensor) -> Any:
            if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or not t.untyped_storage().nbytes():
                return t
            key = t.untyped_storage().data_ptr()
            entry = self.live.setdefault(key, [0, t.untyped_storage().nbytes()])
            if entry[0] == 0:
                self.current += entry[1]
                self.peak = max(self.peak, self.current)
            entry[0] += 1
            holder = _Holder(t)
            weakref.finalize(holder, self._release, key)
            return holder

        super().__init__(pack, lambda h: h.tensor if isinstance(h, _Holder) else h)

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]


class _Holder:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class LiveTensorBytes(TorchDispatchMode):
    """The most bytes of tensor storage made while active and alive at once (each storage once, counted at its
    size when made; what existed before is not counted): every op's outputs are registered, and a storage's
    release (its last tensor gone) subtracts it again. `peak` since the last `reset()`."""

    def __init__(self) -> None:
        super().__init__()
        self.live: set[int] = set()
        self.current = self.peak = 0

    def reset(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:  # new storages only: not an input's (in place, out=, views)
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live and key not in given and storage.nbytes():
                    self.live.add(key)
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._release, key, storage.nbytes())
        return out

    def _release(self, key: int, nbytes: int) -> None:
        self.live.discard(key)
        self.current -= nbytes


class Measure(L.Callback):
    """On the second step (the optimizer state exists): model-state bytes before the update, the peak of saved
    activations, and the step's collectives as {(group, op): bytes}."""

    def __init__(self) -> None:
        self.steps = 0
        self.out: dict[str, Any] = {}

    def on_train_batch_start(self, *args: Any) -> None:
        COMM_LOG.reset()
        self.saved = LiveSavedBytes()
        self.saved.__enter__()

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        self.out["state"] = model_state_bytes(module, getattr(optimizer, "_optimizer", optimizer))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.saved.__exit__()
        self.out["slots"] = sum(e.slots.nbytes for e in trainer.strategy._engines if isinstance(e, ZeroEngine))
        comm: dict[tuple[str, str], int] = {}
        for r in COMM_LOG.records:
            if r.label in CONTROL:  # metric sync, the clip norm, cp's loss: a few bytes, as `lit-lm check` leaves out
                continue
            comm[(r.group, r.op)] = comm.get((r.group, r.op), 0) + r.nbytes
        self.out.update(activations=self.saved.peak, comm=comm)


def _measure(names: list[str], layouts: dict[str, ParallelConfig] = LAYOUTS, world: int = WORLD,
             module: type = None) -> list[dict[str, Any]]:
    out = []
    for name in names:
        layout = layouts[name]
        rank = int(os.environ["LOCAL_RANK"])
        dp_rank = rank // (layout.tp * layout.cp) % layout.dp  # cp peers read the same rows (each its zigzag share)
        data = rank_share(token_data(2 * GLOBAL_BATCH) % MODEL["vocab_size"], GLOBAL_BATCH, dp_rank, layout.dp)
        loader = DataLoader(TensorDataset(data), batch_size=GLOBAL_BATCH // layout.dp)
        L.seed_everything(0, verbose=False)
        probe = Measure()
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=ComposedStrategy(**layout.strategy_args()),
                            max_steps=2,
                            callbacks=[probe], logger=False, enable_progress_bar=False, enable_model_summary=False,
                            use_distributed_sampler=False, num_sanity_val_steps=0, enable_checkpointing=False)
        trainer.fit((module or EstimateLM)(MODELS.get(name, MODEL)), loader)
        out.append(probe.out)
    return out


class MuonLM(EstimateLM):
    """Muon on the hidden matrices, AdamW on the rest (the module's groups for a matrix-wise optimizer)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return Muon(param_groups(self.model, 0.1, self.config.tie_embeddings, split_matrices=True), lr=2e-3)


MUON_LAYOUTS = {"lm_ddp": ParallelConfig(dp_shard=2), "zero2": ParallelConfig(dp_shard=2, zero_stage=2),
                "zero3": ParallelConfig(dp_shard=2, zero_stage=3), "tp2": ParallelConfig(tp=2)}


def test_muon_state_and_orthogonalizer_traffic_equal_a_real_run() -> None:
    """Muon's optimizer state (one fp32 buffer per matrix, AdamW's m, v, step for the rest) and the step's
    collectives (the orthogonalizer's all-to-alls to the owners and back, tp's Gram all-reduces) as a 2-rank run
    allocates and records them, rank 0 exactly."""
    names = list(MUON_LAYOUTS)
    ranks = run_distributed(_measure, 2, names, MUON_LAYOUTS, 2, MuonLM, init_process_group=False,
                            env=REFERENCE_TILES)
    for i, name in enumerate(names):
        work = Workload(ModelConfig(**dict(MODEL, max_seq_len=SEQ)), SEQ, GLOBAL_BATCH, "32-true", device="cpu",
                        optimizer="muon")
        expected, measured = estimate(work, MUON_LAYOUTS[name]).ranks[0], ranks[0][i]
        adamw = estimate(dataclasses.replace(work, optimizer="adamw"), MUON_LAYOUTS[name]).ranks[0]
        assert measured["state"]["optimizer"] == expected.optimizer < adamw.optimizer, name
        assert measured["comm"] == expected.comm, (name, measured["comm"], expected.comm)
        assert any(op == "all_to_all" or group == "tp" for group, op in expected.comm), name


ADAPTERS = LoRA(rank=4)


class LoRALM(EstimateLM):
    """The model with LoRA's adapters (`lit_lm.lora`): the factors train, the rest is frozen."""

    def configure_model(self) -> None:
        if self.model is None:
            super().configure_model()
            add_adapters(self.model, ADAPTERS)


LORA_LAYOUTS = {"lm_ddp": ParallelConfig(dp_shard=2), "zero1": ParallelConfig(dp_shard=2, zero_stage=1),
                "zero3": ParallelConfig(dp_shard=2, zero_stage=3), "tp2": ParallelConfig(tp=2)}


def all_trained(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutant: the frozen base weights counted as trained (gradients and optimizer state)."""
    inventory = estimate_module._inventory
    monkeypatch.setattr(estimate_module, "_inventory", lambda key, lora=None: tuple(
        dataclasses.replace(q, trains=True) for q in inventory(key, lora)))


def test_lora_state_and_reductions_equal_a_real_run(monkeypatch) -> None:
    """LoRA (`Workload.lora`): the frozen base weights held as in full fine-tuning, only the adapters with gradients,
    optimizer state and gradient reductions, as a 2-rank run allocates and records them (rank 0 exactly), under
    lm_ddp, ZeRO-1, ZeRO-3 and tp2 (the factors cut with their base linear); counting the frozen weights as trained
    (the mutant) misses."""
    names = list(LORA_LAYOUTS)
    ranks = run_distributed(_measure, 2, names, LORA_LAYOUTS, 2, LoRALM, init_process_group=False,
                            env=REFERENCE_TILES)
    work = Workload(ModelConfig(**dict(MODEL, max_seq_len=SEQ)), SEQ, GLOBAL_BATCH, "32-true", device="cpu",
                    lora=ADAPTERS)

    def check(name: str) -> None:
        expected, measured = estimate(work, LORA_LAYOUTS[name]).ranks[0], ranks[0][names.index(name)]
        for part in ("params", "grads", "optimizer"):
            assert measured["state"][part] == getattr(expected, part), (name, part)
        assert measured["comm"] == expected.comm, (name, measured["comm"], expected.comm)

    for name in names:
        check(name)
        full = estimate(dataclasses.replace(work, lora=None), LORA_LAYOUTS[name]).ranks[0]
        assert ranks[0][names.index(name)]["state"]["optimizer"] < full.optimizer / 4, name
    all_trained(monkeypatch)
    for name in names:
        with pytest.raises(AssertionError):
            check(name)


def test_newton_schulz_flops_per_rank_fall_as_one_over_n() -> None:
    """Owner ranks share the matrices (balanced by FLOPs, as the orthogonalizer assigns them): the busiest rank's
    NS work is the one-process total over N (within the greedy balance's granularity), under ZeRO and plain DP; the
    replicated baseline does all of it on every rank."""
    cfg = ModelConfig(**dict(MODEL, n_layers=8, max_seq_len=SEQ))
    work = Workload(cfg, SEQ, 64, "32-true", optimizer="muon")
    total = estimate(work, ParallelConfig()).ranks[0].optimizer_flops
    # 5 NS steps of wq, wk, wv, wo, w_gate, w_up, w_down in each of the 8 blocks
    assert total == 5 * 8 * sum(ns_flops(s) for s in ((32, 32), (16, 32), (16, 32), (32, 32), (128, 32), (128, 32),
                                                        (32, 128)))
    for n in (2, 4, 8):  # 8 of each shape: the greedy balance splits them evenly
        for layout in (ParallelConfig(dp_shard=n, zero_stage=1), ParallelConfig(dp_shard=n, zero_stage=3),
                       ParallelConfig(dp_shard=n)):
            assert estimate(work, layout).ranks[0].optimizer_flops * n == total, (n, layout.describe())
        replicated = dataclasses.replace(work, ns_mode="replicated")
        assert estimate(replicated, ParallelConfig(dp_shard=n, zero_stage=2)).ranks[0].optimizer_flops == total


def test_estimate_matches_measurement_of_every_strategy() -> None:
    names = list(LAYOUTS)
    ranks = run_distributed(_measure, WORLD, names, init_process_group=False, env=REFERENCE_TILES)
    for i, name in enumerate(names):
        layout = LAYOUTS[name]
        work = Workload(ModelConfig(**dict(MODELS.get(name, MODEL), max_seq_len=SEQ)), SEQ, GLOBAL_BATCH, "32-true",
                        device="cpu")  # the measured ranks' (gloo: ZeRO-1/2 in its forms, `comm.zero_forms`)
        est = estimate(work, layout)
        assert est.refused is None, name
        for rank, measured in enumerate(r[i] for r in ranks):
            expected = est.ranks[rank // (layout.dp * layout.cp * layout.tp)]  # its pipeline rank's
            if rank // layout.tp % (layout.dp * layout.cp) == 0 and rank % layout.tp == 0:  # the largest shards:
                # torch.chunk gives rank 0 of the ZeRO group (dp x cp) the ceil rows
                state = measured["state"]
                assert (state["params"], state["grads"], state["optimizer"]) == \
                    (expected.params, expected.grads, expected.optimizer), (name, rank)
            assert measured["activations"] == pytest.approx(expected.activations, rel=0.1), (name, rank)
            if rank % layout.tp == 0:  # tp rank 1 holds 30 of the 61 vocabulary rows: less to reduce over dp
                assert measured["comm"] == expected.comm, (name, rank)
                assert measured["slots"] == expected.slots, (name, rank)  # ZeRO-1/2's two comm slots


# -- against the textbook ----------------------------------------------------------------------------------------
def _phi(cfg: ModelConfig) -> int:
    return cfg.num_params()


def test_model_state_follows_the_zero_paper() -> None:
    """fp32 Adam: DP 16Φ, ZeRO-1 8Φ + 8Φ/N, ZeRO-2 4Φ + 12Φ/N, ZeRO-3 16Φ/N (within the padding and `step`s)."""
    cfg = ModelConfig(d_model=256, n_layers=4, n_heads=8, vocab_size=4096)
    work, n, phi = Workload(cfg, 128, 64, "32-true"), 8, _phi(cfg)
    theory = {0: 16, 1: 8 + 8 / n, 2: 4 + 12 / n, 3: 16 / n}
    for stage, k in theory.items():
        rank = estimate(work, ParallelConfig(dp_shard=n, zero_stage=stage)).ranks[0]
        assert rank.model_state == pytest.approx(k * phi, rel=0.01), stage
        wire = rank.wire("dp_shard" if stage else "dp")
        assert wire == pytest.approx((3 if stage == 3 else 2) * (n - 1) / n * phi * 4, rel=0.01), stage


def test_moe_parameters_flops_and_expert_sharding() -> None:
    cfg = ModelConfig(d_model=64, n_layers=3, n_heads=4, vocab_size=256, moe_experts=8, moe_top_k=2, moe_d_ff=32,
                      moe_first_dense=1, moe_shared_experts=1)
    model = Transformer(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    expert = 3 * 64 * 32
    assert cfg.num_params(active=True) == cfg.num_params() - 2 * (8 - 2) * expert  # 2 MoE layers
    work = Workload(cfg, 64, 16, "32-true")
    est = estimate(work, ParallelConfig(dp_shard=4, ep=2, zero_stage=1))
    assert est.refused is None
    one = estimate(work, ParallelConfig())
    tokens = 16 * 64
    assert one.flops == flops_per_token(cfg.num_params(False, active=True), 3, 64, 64) * tokens
    assert est.flops == pytest.approx(one.flops / 4)
    experts = 2 * 8 * expert
    # each rank keeps 4 of the 8 experts: its parameters are the dense ones plus half the experts
    assert est.ranks[0].params == (cfg.num_params() - experts + experts // 2) * 4
    assert ("ep", "all_to_all") in est.ranks[0].comm and ("edp", "reduce_scatter") in est.ranks[0].comm


def test_pipeline_bubble_and_in_flight_microbatches() -> None:
    cfg = ModelConfig(d_model=64, n_layers=8, n_heads=4, vocab_size=256)
    work = Workload(cfg, 32, 16, "32-true")
    gpipe = estimate(work, ParallelConfig(pp=4, microbatches=8, schedule="gpipe"))
    one_f = estimate(work, ParallelConfig(pp=4, microbatches=8, schedule="1f1b"))
    assert gpipe.bubble == one_f.bubble == pytest.approx(3 / 11)
    # rank 1 holds 2 blocks of every microbatch: all 8 under GPipe, 3 (p - rank) under 1F1B
    assert gpipe.ranks[1].activations / one_f.ranks[1].activations == pytest.approx(8 / 3)
    assert estimate(work, ParallelConfig(pp=4, microbatches=8, schedule="zb_h1")).bubble < one_f.bubble
    # the steady state: simulating 2pv microbatches gives the peak of any larger count
    for name, p, v in (("1f1b", 4, 1), ("interleaved_1f1b", 4, 2), ("zb_h1", 3, 1), ("interleaved_1f1b", 2, 3)):
        for m in (3 * p * v, 5 * p * v):
            assert peak_in_flight(name, p, m, v) == build_schedule(name, p, m, v).peak_in_flight(), (name, m)


def test_refused_configurations_are_estimated_and_marked() -> None:
    cfg = ModelConfig(d_model=64, n_layers=4, n_heads=4, vocab_size=256)
    work = Workload(cfg, 64, 16, "bf16-mixed", checkpointing="full")
    est = estimate(work, ParallelConfig(dp_replicate=2, dp_shard=2, zero_stage=3, tp=2, cp=2))
    assert est.refused is None  # HSDP ZeRO-3 x tp x cp composes (tests/test_composed.py)
    piped = estimate(work, ParallelConfig(dp_shard=2, zero_stage=1, tp=2, cp=2, pp=2, microbatches=2))
    assert piped.refused is not None and piped.refused.message.startswith("context_parallel_size > 1 with pipeline")
    none = estimate(Workload(cfg, 64, 16, "bf16-mixed"),
                    ParallelConfig(dp_replicate=2, dp_shard=2, zero_stage=3, tp=2, cp=2))
    assert est.ranks[0].activations < none.ranks[0].activations
    assert est.ranks[0].recompute_flops == pytest.approx(est.flops / 3)
    # under cp the dense gradients are sharded over dp_shard x cp: the strategy's group, by its name
    assert {"cp", "tp", "dp_shard_cp", "dp_replicate"} <= set(est.groups)


def test_moe_under_tensor_parallelism_replicates_the_moe_layers() -> None:
    """The model's tp plan splits attention, the dense MLP, embedding and head, and replicates MoE layers over tp
    (`batch` style): their parameters are whole on every tp rank, their FLOPs repeated, their block has one tp
    region (attention) instead of two; sequence parallelism is refused for them (`REFUSED`)."""
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, vocab_size=256, moe_experts=4, moe_top_k=2, moe_d_ff=32,
                      moe_first_dense=1)  # block 0 dense, block 1 MoE
    work = Workload(cfg, 32, 8, "32-true")
    one, dense = estimate(work, ParallelConfig()), Workload(dataclasses.replace(cfg, moe_experts=0), 32, 8, "32-true")
    tp = estimate(work, ParallelConfig(tp=2, sequence_parallel=False))
    assert tp.refused is None
    params = dict(Transformer(cfg).named_parameters())
    whole = sum(p.numel() for n, p in params.items() if n.startswith("blocks.1.mlp.") or "norm" in n)
    split = cfg.num_params() - whole  # every other parameter is split in two (even shapes here)
    assert tp.ranks[0].params == (split // 2 + whole) * 4
    moe_active = 4 * 64 + 2 * 3 * 64 * 32  # router, top-2 experts
    assert tp.flops == pytest.approx(one.flops / 2)  # model FLOPs: what MFU counts
    assert tp.ranks[0].replicated_flops == pytest.approx(6 * moe_active * 8 * 32 / 2)
    tp_dense = estimate(dense, ParallelConfig(tp=2, sequence_parallel=False))
    act = 8 * 32 * 64 * 4
    assert tp_dense.ranks[0].comm[("tp", "all_reduce")] - tp.ranks[0].comm[("tp", "all_reduce")] == 2 * act
    refused = estimate(work, ParallelConfig(tp=2)).refused
    assert refused is not None and refused.moe and "set sequence_parallel: false" in refused.message


def test_zero2_under_a_pipeline_reduces_once_per_step() -> None:
    """The pipeline runs many backwards per step: ZeRO-2 then keeps the full gradient and reduce-scatters it once
    (as ZeRO-1), with its flat buffer of owned rows besides; it never costs less than ZeRO-1 there."""
    cfg = ModelConfig(d_model=64, n_layers=4, n_heads=4, vocab_size=256)
    work = Workload(cfg, 32, 16, "32-true", accumulate=2)
    zero = {z: estimate(work, ParallelConfig(dp_shard=2, pp=2, zero_stage=z, microbatches=4)).ranks[0] for z in (1, 2)}
    assert zero[2].comm == zero[1].comm
    assert zero[2].grads > zero[1].grads and zero[2].grads - zero[1].grads == pytest.approx(zero[2].optimizer / 2,
                                                                                           rel=0.01)
    flat = estimate(work, ParallelConfig(dp_shard=2, zero_stage=2)).ranks[0]  # no pipeline: once per micro-step
    assert flat.comm[("dp_shard", "reduce_scatter")] == 2 * estimate(work, ParallelConfig(dp_shard=2, zero_stage=1)
                                                                      ).ranks[0].comm[("dp_shard", "reduce_scatter")]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("moe", [False, True])
def test_saved_activations_of_one_process(precision: str, moe: bool) -> None:
    """Dense and MoE blocks, fp32 and bf16 autocast (which saves its own cast of each projection's input and of
    every matmul weight): the peak of saved tensors within 10% of the estimate (dense: within 1%)."""
    extra = dict(moe_experts=8, moe_top_k=2, moe_d_ff=32, moe_first_dense=1, moe_shared_experts=1) if moe else {}
    cfg = ModelConfig(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=32, **extra)
    model, batch = Transformer(cfg), 4
    tokens = torch.randint(0, 256, (batch, 33), generator=torch.Generator().manual_seed(0))
    saved = LiveSavedBytes()
    with saved, torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        model.loss(tokens[:, :-1], tokens[:, 1:])
    expected = estimate(Workload(cfg, 32, batch, precision), ParallelConfig()).ranks[0].activations
    assert saved.peak == pytest.approx(expected, rel=0.1 if moe else 0.01)


@pytest.mark.parametrize("method", METHODS)
def test_cp_wire_bytes_follow_the_attention_theory(method: str) -> None:
    """The estimate's cp records (per op, as the accounting layer counts them) send on the wire what
    `lit_lm.strategies.cp.comm_theory` says one attention call sends, once per layer; under the ring each send has its
    recv (which puts nothing more on the wire)."""
    cfg, cp = ModelConfig(**dict(MODEL, max_seq_len=SEQ)), 4
    u = {"ulysses": cp, "ulysses+ring": 2}.get(method, 1)  # the hybrid as 2 x 2
    config = ParallelConfig(dp_shard=2, cp=cp, cp_method=method, ulysses_size=2 if method == "ulysses+ring" else None)
    est = estimate(Workload(cfg, SEQ, GLOBAL_BATCH, "bf16-mixed"), config)
    kv_numel = 2 * GLOBAL_BATCH // 2 * SEQ // cp * cfg.n_kv_heads * cfg.head_dim
    q_numel, copies = GLOBAL_BATCH // 2 * SEQ // cp * cfg.n_heads * cfg.head_dim, max(1, u // cfg.n_kv_heads)
    theory = comm_theory(method, cp, kv_numel, 2, q_numel, copies, u)
    assert sum(est.wire_bytes(g) for g in ("cp", "cp_ulysses", "cp_ring")) == cfg.n_layers * sum(theory.values())
    comm = est.ranks[0].comm
    if method == "ring":
        assert comm[("cp", "send")] == comm[("cp", "recv")] == est.wire_bytes("cp")


# -- the moments of a step: the estimator's transients against the tensors a real run makes ----------------------
PEAK_MODEL = dict(MODEL, vocab_size=4096)  # the root unit outweighs activations; a bucket over 2^18 elements
PEAK_SEQ = 8
PEAK_LAYOUTS = {"lm_ddp": ParallelConfig(dp_shard=2), "zero1": ParallelConfig(dp_shard=2, zero_stage=1),
                "zero2": ParallelConfig(dp_shard=2, zero_stage=2), "zero3": ParallelConfig(dp_shard=2, zero_stage=3),
                "tp": ParallelConfig(tp=2)}  # the presets of scripts/bench_peaks.py, on 2 ranks


class StepMoments(L.Callback):
    """The tensor bytes made in each phase (`LiveTensorBytes`): on the last step `fwd_bwd`, the most alive at once
    from the batch's start to `on_before_optimizer_step` (forward, backward, the reduction); `step`, the most made
    from there to the batch's end (the optimizer step, ZeRO's all-gather) above what was alive when it began, on the
    first step, less the optimizer state that step creates (torch makes a group's state before stepping it), and
    `later_step` the same on the last step. The first step's are the run's largest: from the second on, the flat
    step hands torch a member larger than its piece limit in parts (lit_lm/strategies/flat_step.py)."""

    def __init__(self) -> None:
        self.out: dict[str, int] = {}
        self.mode: LiveTensorBytes | None = None

    def on_train_batch_start(self, *args: Any) -> None:
        gc.collect()  # see on_before_optimizer_step
        self.mode = LiveTensorBytes()
        self.mode.__enter__()

    def on_before_optimizer_step(self, *args: Any) -> None:
        assert self.mode is not None
        self.out["fwd_bwd"] = self.mode.peak
        # Garbage in reference cycles (alive until the collector runs) is not live; collected here, and the
        # collector's counters reset, no automatic collection inside the step depends on what the process ran
        # before (a pytest worker's earlier tests). One full-suite run measured tp's step 1,152 bytes short; not
        # reproduced alone, nor with the collector's threshold at 5 or 50, so this is a guard, not a proven cause.
        gc.collect()
        self.mode.reset()
        self.start = self.mode.current

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        assert self.mode is not None
        made = self.mode.peak - self.start
        if "step" not in self.out:  # the first step: its state (m and v; the scalars are counted by the test)
            state = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for o in trainer.optimizers
                     for entry in o.state.values() for t in entry.values() if torch.is_tensor(t) and t.dim() > 0}
            self.out["step"] = made - sum(state.values())
            self.out["scalars"] = sum(torch.is_tensor(t) and t.dim() == 0 for o in trainer.optimizers
                                      for entry in o.state.values() for t in entry.values())
        self.out["later_step"] = made
        self.mode.__exit__(None, None, None)


def _moments(names: list[str]) -> list[dict[str, int]]:
    out = []
    for name in names:
        layout = PEAK_LAYOUTS[name]
        dp = layout.dims(2).dp
        data = rank_share(token_data(2) % PEAK_MODEL["vocab_size"], 2, int(os.environ["LOCAL_RANK"]) // layout.tp, dp)
        L.seed_everything(0, verbose=False)
        probe = StepMoments()
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ComposedStrategy(**layout.strategy_args()),
                            max_steps=2, callbacks=[probe], logger=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                            enable_checkpointing=False)
        trainer.fit(EstimateLM(dict(PEAK_MODEL, max_seq_len=PEAK_SEQ)),
                    DataLoader(TensorDataset(data[:, :PEAK_SEQ + 1]), batch_size=2 // dp))
        out.append(probe.out)
    return out


def _peak_estimate(name: str) -> Any:
    layout = PEAK_LAYOUTS[name]
    layout = dataclasses.replace(layout, dp_shard=layout.dims(2).dp_shard)
    work = Workload(ModelConfig(**dict(PEAK_MODEL, max_seq_len=PEAK_SEQ)), PEAK_SEQ, layout.dims().dp, "32-true",
                    device="cpu")
    return estimate(work, layout).ranks[0]


def test_step_transients_equal_the_tensors_a_run_makes() -> None:
    """The optimizer step's temporaries (torch's for-loop AdamW over the flat step's pieces or the members one by
    one, the previous tensor's denominator still bound) are exactly the tensor bytes the step makes (ZeRO-1/2's
    all-gathers after it reuse the two comm slots the first step made: nothing); at the end of backward ZeRO-3's
    reduce-scatters in flight (two units) and the whole gradients being packed are exactly what the backward made
    and still holds, where they outweigh the activations (a large vocabulary, 8 positions; ZeRO-1's full gradients
    are model state the backward makes)."""
    names = list(PEAK_LAYOUTS)
    ranks = run_distributed(_moments, 2, names, init_process_group=False)
    for i, name in enumerate(names):
        est = _peak_estimate(name)  # gloo's staging is made on its own thread, by C++: resident memory shows it
        moments = {m: sum(v for k, v in terms.items() if k != GLOO_STAGING) for m, terms in est.transients.items()}
        step = max(moments.get("step", 0), moments.get("after_step", 0))
        for rank in ranks:  # rank 0 holds the larger shards (equal here: even rows)
            # beyond the temporaries: the first step's scalars (Adam's `step`: one per tensor torch stepped, 4 bytes)
            assert 0 <= rank[i]["step"] - step <= 4 * rank[i]["scalars"], (name, rank[i], est.transients)
            assert rank[i]["later_step"] <= rank[i]["step"] + 4 * rank[i]["scalars"], (name, rank[i])
            # beyond them only the step's scalars (the loss, its log): a few bytes. ZeRO-2 reduces the tail (final
            # norm, head) first: what its backward end holds (the embedding's gradient, packed) no longer outweighs
            # the activations at the head's backward, so there is no moment of its own to compare here
            if name in ("zero1", "zero3"):
                # ZeRO-1 (no sends of its own: the reused slots), at the embedding's gradient: its full gradients
                # and the gradient of the embedding's output (1 x 8 positions x d_model, fp32), still alive
                made = (moments.get("backward_end", 0)
                        + (est.grads + PEAK_SEQ * MODEL["d_model"] * 4) * (name == "zero1"))
                assert 0 <= rank[i]["fwd_bwd"] - made <= 64, (name, rank[i], est.transients)


RESIDENT_MODEL = dict(TINY, vocab_size=32000, vocab_multiple_of=1, d_model=256, n_layers=2, n_heads=4, n_kv_heads=4)


class StepResident(L.Callback):
    """The resident memory (VmHWM, Linux) the last optimizer step and the all-gathers after it add above what the
    rank held when the step began."""

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.peak = ResidentPeak()

    def on_train_batch_end(self, *args: Any) -> None:
        self.rise = self.peak.above()


def _step_resident(malloc: str) -> Any:
    # the strategy applies `malloc` on a CPU rank (lit_lm/strategies/host_malloc.py): `fixed` maps every block from
    # 128 KiB and unmaps it when freed, so resident memory follows the tensors the step makes and frees (`trim`, the
    # default, leaves the heap's fragmentation within the step: not held here)
    os.environ[CHOICE] = malloc
    probe = StepResident()
    data = rank_share(token_data(2) % RESIDENT_MODEL["vocab_size"], 2, int(os.environ["LOCAL_RANK"]), 2)
    strategy = ComposedStrategy(zero_stage=2, zero_collectives="reduce_scatter")  # gloo's all-gather: staged
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2,
                        callbacks=[probe], logger=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0, enable_checkpointing=False)
    trainer.fit(EstimateLM(dict(RESIDENT_MODEL, max_seq_len=PEAK_SEQ)),
                DataLoader(TensorDataset(data[:, :PEAK_SEQ + 1]), batch_size=1))
    return probe.rise


@pytest.mark.skipif(not ResidentPeak().supported or platform.libc_ver()[0] != "glibc",
                    reason="Linux's /proc and glibc's mallopt")
def test_resident_step_holds_gloo_staging() -> None:
    """ZeRO-2 at 18M parameters (a 32k vocabulary: the root unit is most of it) on 2 gloo ranks: the resident memory
    the step and its all-gathers add is the estimate's (the all-gathers two units in flight, and gloo's flat staging
    of the gathered output, a whole root unit: without it the estimate is 40% short), within 10% (pages, gloo's
    small buffers), under the strategy's `fixed` malloc (without it, the step reuses what backward left in glibc's
    heap and the check fails)."""
    est = estimate(Workload(ModelConfig(**dict(RESIDENT_MODEL, max_seq_len=PEAK_SEQ)), PEAK_SEQ, 2, "32-true",
                            device="cpu"), ParallelConfig(dp_shard=2, zero_stage=2, zero_collectives="reduce_scatter")
                   ).ranks[0]
    expected = max(sum(est.transients["step"].values()), sum(est.transients["after_step"].values()))
    for rise in run_distributed(_step_resident, 2, "fixed", init_process_group=False):
        assert rise == pytest.approx(expected, rel=0.1), (rise, est.transients)


HEAP_RETENTION = r"""
import ctypes, importlib.util, sys
spec = importlib.util.spec_from_file_location("host_malloc", sys.argv[1])
host_malloc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(host_malloc)
chosen = host_malloc.HostMalloc()
chosen.start()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
MiB = 1 << 20
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) * 1024
def made(size):
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)  # resident
    return block
libc.free(made(16 * MiB))  # a mapped block freed: glibc's dynamic threshold rises to 16 MiB
before = rss()
size = int(sys.argv[3]) * MiB
blocks = [made(size) for _ in range(16)]  # a layer's tensors, say
for block in blocks[::2]:  # every other one freed: holes between live blocks, none at the heap's top
    libc.free(block)
chosen.trim(setup=sys.argv[2] == "setup")  # where a strategy calls it: end of setup, after backward, after the step
print(chosen.mode, rss() - before - 8 * size)  # resident beyond the 8 blocks alive
"""


@pytest.mark.skipif(not ResidentPeak().supported or platform.libc_ver()[0] != "glibc", reason="Linux and glibc")
def test_cpu_ranks_return_freed_blocks_to_the_system() -> None:
    """What the estimate counts is what a CPU rank has resident only if glibc's malloc returns freed blocks: by
    default, once a mapped block is freed, blocks below its size come from the heap and stay resident when freed
    (32 MiB of freed 4 MiB blocks here; 7-26% over the estimate at 52M-217M parameters). `HostMalloc`, which every
    lit-lm strategy applies on a CPU rank, returns them with `trim` and `fixed`, and with `large` (the default)
    those from 8 MiB, which it maps, from 2 MiB under torch's huge pages (lit_lm/strategies/host_malloc.py)."""
    def retained(mode: str, at: str = "step", mib: int = 4, huge: bool = False) -> tuple[str, int]:
        env = {k: v for k, v in {**os.environ, CHOICE: mode}.items()
               if k not in ("MALLOC_MMAP_THRESHOLD_", host_malloc.HUGE_PAGES)}
        env.update({host_malloc.HUGE_PAGES: "1"} if huge else {})
        out = subprocess.run([sys.executable, "-c", HEAP_RETENTION, host_malloc.__file__, at, str(mib)], env=env,
                             check=True, capture_output=True, text=True).stdout.split()
        return out[0], int(out[1])

    for mode, at, mib in (("trim", "step", 4), ("fixed", "step", 4), ("large", "step", 8), ("setup", "setup", 4)):
        applied, kept = retained(mode, at, mib)
        assert applied == mode and kept < 4 << 20, (mode, at, applied, kept)
    # the retention the others remove, still there: glibc's own; `setup` trims once, after setup, not every step;
    # `large` leaves blocks below 8 MiB to glibc's heap
    for mode, at, mib in (("glibc", "setup", 4), ("setup", "step", 4), ("large", "step", 4)):
        applied, kept = retained(mode, at, mib)
        assert applied == mode and kept >= 30 << 20, (mode, at, kept)
    if host_malloc.thp_mode() in ("always", "madvise"):  # under torch's huge pages `large` maps blocks from 2 MiB:
        applied, kept = retained("large", "step", 4, huge=True)  # the ones torch advises, never the heap's
        assert applied == "large" and kept < 4 << 20, kept


def test_host_malloc_leaves_a_chosen_allocator_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHOICE, "fixed")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # glibc read the user's setting at start
    assert HostMalloc().mode == "glibc"
    monkeypatch.setenv(CHOICE, "jemalloc")
    with pytest.raises(ValueError, match="LIT_LM_MALLOC='jemalloc': choose one of large, setup, trim, fixed, glibc"):
        HostMalloc()


HUGE_PAGE_PROBE = """
import sys
import torch
from lit_lm.strategies import host_malloc
if sys.argv[1] == "entry":  # the lit-lm command: its entry, then the CLI (help only)
    from lit_lm.__main__ import main
    try:
        main(["--help"])
    except SystemExit:
        pass
else:  # asked for after `import lightning` has allocated: too late
    import lightning  # noqa: F401
    host_malloc.ask_huge_pages()
block = torch.empty(4 << 20)  # 16 MiB: mapped, and above torch's 2 MiB threshold
block.fill_(1.0)
print(host_malloc.huge_page_eligible(block))
"""


@pytest.mark.skipif(host_malloc.thp_mode() != "madvise" or torch.cuda.is_available(),
                    reason="the kernel's THP mode decides alone unless madvise; not asked for where torch sees a GPU")
def test_the_lit_lm_command_asks_for_huge_pages_before_anything_allocates() -> None:
    """torch's CPU allocator reads THP_MEM_ALLOC_ENABLE at its first allocation: the `lit-lm` entry sets it before
    the CLI's imports allocate, so big blocks may take huge pages (the faults of ~1 GB mapped afresh per step at 217M);
    set after `import lightning`, it does nothing. Whether the kernel found huge pages is not asserted (that depends
    on its free memory): the mapping's eligibility is the advice, deterministic under the `madvise` mode."""
    env = {k: v for k, v in os.environ.items() if k != host_malloc.HUGE_PAGES}

    def eligible(how: str) -> str:
        out = subprocess.run([sys.executable, "-c", HUGE_PAGE_PROBE, how], env=env, check=True, capture_output=True,
                             text=True).stdout
        return out.split()[-1]

    assert eligible("entry") == "True"
    assert eligible("late") == "False"


def test_ask_huge_pages_only_where_it_is_the_choice(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(host_malloc.HUGE_PAGES, "0")
    assert not host_malloc.ask_huge_pages() and os.environ[host_malloc.HUGE_PAGES] == "0"
    monkeypatch.delenv(host_malloc.HUGE_PAGES)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine: its blocks are on the device
    assert not host_malloc.ask_huge_pages() and host_malloc.HUGE_PAGES not in os.environ
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(host_malloc, "THP_MODE", Path("/nonexistent/enabled"))  # a kernel without THP
    assert not host_malloc.ask_huge_pages() and host_malloc.HUGE_PAGES not in os.environ
    monkeypatch.setattr(host_malloc, "THP_MODE", Path(os.devnull))  # a mode file without a choice in brackets
    assert not host_malloc.ask_huge_pages()
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    monkeypatch.setattr(host_malloc, "THP_MODE", tmp_path / "enabled")
    assert host_malloc.ask_huge_pages() and os.environ[host_malloc.HUGE_PAGES] == "1"


def test_loss_gradients_are_two_fp32_logits() -> None:
    """The loss's backward makes the gradients of the fp32 log-probabilities and of the logits, both alive when the
    logits' gradient is handed on to the head: the estimate's `loss gradients`, exactly (beyond the 4-byte seed)."""
    cfg = ModelConfig(**dict(MODEL, vocab_size=512, max_seq_len=SEQ))
    model, batch = Transformer(cfg), 2
    tokens = torch.randint(0, 512, (batch, SEQ + 1), generator=torch.Generator().manual_seed(0))
    logits = model(tokens[:, :-1])
    loss = model.loss_fn(logits, tokens[:, 1:])[0]
    seen = []
    with LiveTensorBytes() as made:
        logits.register_hook(lambda grad: seen.append(made.peak))
        loss.backward()
    expected = estimate(Workload(cfg, SEQ, batch, "32-true", device="cpu"), ParallelConfig()).ranks[0]
    assert seen[0] - 4 == expected.transients["backward"]["loss gradients (log-probabilities, logits; fp32)"]
