"""Expert parallelism (`lit_lm.strategies.experts`): the dispatch engine on its own, then `ep` and dp x ep (with
ZeRO-1/2) against one process, and checkpoints resumed across ZeRO stages."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from dist_utils import TINY, Recorder, rank_share, run_distributed, token_data
from lit_lm.parity import MOE, Case, assert_parity, run_parity
from lit_lm.config import ModelConfig
from lit_lm.module import LanguageModel
from lit_lm.model import Transformer
from lit_lm.moe import GroupedExperts, moe_layers
from lit_lm.strategies import safe_load
from lit_lm.strategies.checkpoint import to_single_file
from lit_lm.strategies.comm import COMM_LOG
from lit_lm.strategies.ep import ExpertParallelStrategy
from lit_lm.strategies.experts import ExpertShard, check_expert_parallel
from lit_lm.strategies.layout import ParallelDims, ParallelLayout

STEPS = 5  # odd: the sign updates cannot cancel to a zero bias


# -- the engine: a rank that receives no tokens ------------------------------------------------------------------
def _engine_case() -> dict:
    """Every token of both ranks goes to experts 0 and 1 (rank 0's): rank 1's experts receive nothing."""
    torch.manual_seed(0)
    full = GroupedExperts(4, 8, 6)
    for p in full.parameters():
        torch.nn.init.normal_(p)
    rank = dist.get_rank()
    x = torch.randn(5 + rank, 8, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    counts = torch.tensor([2, 3 + rank, 0, 0])
    expected = full(x, counts)
    expected.square().sum().backward()
    local_grads = {n: p.grad.clone() for n, p in full.named_parameters()}
    x.grad = None
    experts = GroupedExperts(4, 8, 6)
    experts.load_state_dict(full.state_dict())
    shard = ExpertShard(experts, 4, ParallelLayout.get(ParallelDims.of(2, ep=2)).group("ep"))
    COMM_LOG.reset()
    out = shard(x, counts)
    out.square().sum().backward()
    return {"out": out.detach(), "expected": expected.detach(), "x_grad": x.grad.clone(),
            "grads": {n: p.grad.clone() for n, p in shard.experts.named_parameters()}, "local_grads": local_grads,
            "a2a": [r.numel for r in COMM_LOG.records if r.op == "all_to_all"]}


# -- Lightning runs ----------------------------------------------------------------------------------------------
class SingleGradNorm(L.Callback):
    """The pre-clip gradient norm of a single-process run (the strategies log their global one as grad_norm)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, *args: object) -> None:
        self.norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in module.parameters()])))


def fit_moe(strategy: object = "auto", devices: int = 1, global_batch: int = 8, one_batch: bool = False,
            ckpt_dir: str | None = None, resume: str | None = None) -> dict:
    """LanguageModel with the MoE config on fixed tokens, the same global batch on any number of ranks; with
    `ckpt_dir` a checkpoint after every step. `one_batch` repeats one global batch: a resume then sees the same
    data whatever batch Lightning re-enters the loader at."""
    rank = int(os.environ.get("LOCAL_RANK", 0))
    tokens = token_data(global_batch).repeat(STEPS, 1) if one_batch else token_data(STEPS * global_batch)
    loader = DataLoader(rank_share(tokens, global_batch, rank, devices), batch_size=global_batch // devices,
                        shuffle=False)  # batches of (B, T+1) tensors
    L.seed_everything(0, verbose=False)
    module, recorder, norms = LanguageModel(config=ModelConfig(**MOE), warmup_steps=2), Recorder(), SingleGradNorm()
    callbacks = [recorder, norms] if devices == 1 else [recorder]  # ZeRO-2 frees the parameters' grads
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, callbacks=callbacks,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0, enable_checkpointing=bool(ckpt_dir),
                        gradient_clip_val=0.5)
    trainer.fit(module, loader, ckpt_path=resume)
    state = trainer.optimizers[0].state.values()
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms or norms.norms,
            "params": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "state_numel": sum(t.numel() for s in state for t in s.values() if t.dim())}  # Adam's m and v


def _ep(zero_stage: int = 0) -> ExpertParallelStrategy:
    return ExpertParallelStrategy(expert_parallel_size=2, bucket_cap_mb=0.01, zero_stage=zero_stage)


def _ep2_worker(ckpt_dir: str) -> dict:
    engine = _engine_case()
    return {"engine": engine, **fit_moe(_ep(), devices=2, ckpt_dir=ckpt_dir)}


def _dp_ep_worker(ckpt_dir: str) -> list[dict]:
    """dp2 x ep2: plain; ZeRO-2 (a checkpoint every step); zero_stage 0 resuming ZeRO-2's step 3 (checkpoints
    every step); ZeRO-1 resuming that one's step 4."""
    step = f"{ckpt_dir}/{{}}/epoch=0-step={{}}.ckpt"
    return [fit_moe(_ep(0), devices=4),
            fit_moe(_ep(2), devices=4, one_batch=True, ckpt_dir=f"{ckpt_dir}/zero2"),
            fit_moe(_ep(0), devices=4, one_batch=True, ckpt_dir=f"{ckpt_dir}/zero0", resume=step.format("zero2", 3)),
            fit_moe(_ep(1), devices=4, one_batch=True, resume=step.format("zero0", 4))]


def _check_parity(single: dict, ranks: list[dict], ep: int, first: int = 0) -> None:
    """Every rank's losses from step `first` on; the final parameters and buffers (the aux-free bias) of every
    replica, expert rows concatenated over its ep ranks."""
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(single["losses"][first:]), rtol=1e-5,
                                   atol=0)
    for name, value in single["params"].items():
        for replica in range(0, len(ranks), ep):
            group = ranks[replica: replica + ep]
            if "experts." in name:
                got = torch.cat([r["params"][name] for r in group])
            else:
                got = group[0]["params"][name]
            rel = ((got - value).norm() / value.norm().clamp_min(1e-12)).item()
            assert rel < 1e-5, (name, rel)


@pytest.fixture(scope="module")
def single() -> dict:
    return fit_moe()


@pytest.fixture(scope="module")
def single_one_batch() -> dict:
    return fit_moe(one_batch=True)


def test_ep_engine_and_parity(single: dict, tmp_path: Path) -> None:
    results = run_distributed(_ep2_worker, 2, str(tmp_path / "ckpt"))
    for r in results:
        e = r["engine"]
        torch.testing.assert_close(e["out"], e["expected"], rtol=1e-5, atol=1e-6)
        assert e["x_grad"].abs().sum() > 0
        assert e["a2a"][0] == 4  # the counts first (E entries), then tokens: dispatch, combine, their backwards
        assert len(e["a2a"]) == 5
    # expert grads: rank 0 holds experts 0-1, whose grad is the sum of both ranks' contributions
    for i, r in enumerate(results):
        for name, g in r["engine"]["grads"].items():
            expected = sum(x["engine"]["local_grads"][name] for x in results)[2 * i: 2 * i + 2]
            torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-5)
    assert results[1]["engine"]["grads"]["w_gate"].abs().sum() == 0  # its experts got no token

    bias = "model.blocks.1.mlp.router.expert_bias"
    assert single["params"][bias].abs().sum() > 0  # the aux-free balancing moved
    _check_parity(single, results, ep=2)
    # the sharded checkpoint holds the experts whole under their global names
    to_single_file(tmp_path / "ckpt" / f"epoch=0-step={STEPS}.ckpt", tmp_path / "whole.ckpt")
    saved = safe_load.load(tmp_path / "whole.ckpt")["state_dict"]
    name = "model.blocks.1.mlp.experts.w_up"
    assert saved[name].shape == single["params"][name].shape
    torch.testing.assert_close(saved[name], torch.cat([r["params"][name] for r in results]))


def test_dp_ep_parity_zero_and_resume_across_stages(single: dict, single_one_batch: dict, tmp_path: Path) -> None:
    """dp2 x ep2 (dp > ep: the experts' ZeRO group has 2 ranks); checkpoints cross zero_stage 2 -> 0 -> 1."""
    plain, zero2, zero0_from_2, zero1_from_0 = map(list, zip(*run_distributed(
        _dp_ep_worker, 4, str(tmp_path), init_process_group=False)))
    _check_parity(single, plain, ep=2)
    _check_parity(single_one_batch, zero2, ep=2)
    for r in zero2:  # clipping (on every step) counted every gradient element once
        torch.testing.assert_close(torch.tensor(r["grad_norms"]), torch.tensor(single_one_batch["grad_norms"]),
                                   rtol=1e-5, atol=0)
    assert min(single_one_batch["grad_norms"]) > 0.5
    # the optimizer state: each element on exactly one rank (dense split over dp, experts over ep then edp)
    assert sum(r["state_numel"] for r in zero2) == single["state_numel"]
    _check_parity(single_one_batch, zero0_from_2, ep=2, first=3)
    _check_parity(single_one_batch, zero1_from_0, ep=2, first=4)


# -- the parity harness: every gradient, SGD and AdamW, with the Switch loss and capacity dropping -----------------
BALANCED = dict(MOE, moe_aux_loss=1e-2, moe_capacity_factor=1.0)  # capacity 1.0 x top-2 / 4 experts drops tokens
EP2 = partial(ExpertParallelStrategy, expert_parallel_size=2, bucket_cap_mb=0.01)
HARNESS = [Case(EP2, model=BALANCED, label="ep2 sgd"),
           Case(EP2, model=BALANCED, optimizer="adamw", trainer={"gradient_clip_val": 0.5}, label="ep2 adamw clip"),
           Case(EP2, model=dict(BALANCED, moe_balance="micro_batch"), label="ep2 micro-batch balancing"),
           # ZeRO-1/2 beside ep: their after-step gathers run into the next forward, waited for in the pre-hooks of
           # the model's modules (the engines hold `param_holder`s, which run no forward: the forward read the
           # dense weights mid-gather, and the loss of batch 1 was off)
           Case(partial(EP2, zero_stage=1), model=MOE, label="ep2 zero1"),
           Case(partial(EP2, zero_stage=2), model=MOE, optimizer="adamw", label="ep2 zero2 adamw")]


def test_ep_harness_parity_with_global_batch_balancing() -> None:
    global_sgd, global_adamw, local, zero1, zero2 = run_parity(HARNESS, 2)
    assert_parity(global_sgd)
    assert_parity(global_adamw)
    assert_parity(zero1)
    assert_parity(zero2)
    # balancing over each rank's half of the batch is another objective (and drops other tokens): the harness sees
    # it in the first step's gradients
    with pytest.raises(AssertionError, match=r"step 0 rank \d: gradient of model\."):
        assert_parity(local)
    # the cases exercise what they claim: tokens dropped at capacity, the auxiliary loss in the loss
    model = Transformer(ModelConfig(**BALANCED))
    tokens = token_data(8, TINY["max_seq_len"])
    loss, ce = model.loss(tokens[:, :-1], tokens[:, 1:])
    stats = moe_layers(model)["blocks.1.mlp"].stats
    assert stats["dropped"] > 0 and loss - ce > 1e-2 * stats["aux"] * 0.99


def test_zero3_is_refused() -> None:
    with pytest.raises(ValueError, match=r"zero_stage=3 with expert_parallel_size > 1.*use zero_stage 1 or 2"):
        ExpertParallelStrategy(zero_stage=3)


def test_bad_sizes_name_the_setting() -> None:
    with pytest.raises(ValueError, match=r"`expert_parallel_size`=3 must divide the data-parallel size 4"):
        check_expert_parallel(3, 4)
    with pytest.raises(ValueError, match=r"`moe_experts`=6 is not divisible by `expert_parallel_size`=4"):
        check_expert_parallel(4, 8, 6)
