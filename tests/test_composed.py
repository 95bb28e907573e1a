"""Every composition of the N-D strategy against one process (lit_lm/parity.py): per-step losses, the pre-clip norm,
every gradient part under its global name before the update, and the final parameters, fp32 at 1e-5.

The first-wave names are presets of `ComposedStrategy`, so a preset given another dimension's size composes (the
ZeRO-3 x tp case is `ZeroStrategy(stage=3, tensor_parallel_size=2)`, as `configs/strategies/fsdp_tp.yaml` builds it).
"""

from __future__ import annotations

import math
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from dist_utils import REFERENCE_TILES, TinyLM, token_data
from lit_lm.parity import CLIP_ABOVE, MOE, TINY, Case, assert_parity, run_parity
from lit_lm.spawn import run_distributed
from lit_lm.strategies import plan
from lit_lm.strategies.composed import ComposedStrategy
from lit_lm.strategies.errors import ConfigError
from lit_lm.strategies.ep import ExpertParallelStrategy
from lit_lm.strategies.pp import PipelineStrategy
from lit_lm.strategies.tp import TensorParallelStrategy
from lit_lm.strategies.zero import ZeroStrategy

# MoE in every block and no Switch loss: a pipeline computes routing statistics per microbatch (as Megatron does),
# so only per-token losses (z-loss) and the step-summed bias update can match a one-process run exactly
MOE_PP = dict(MOE, moe_aux_loss=0.0, moe_first_dense=0)
DEEP = dict(TINY, n_layers=4)  # interleaved 1F1B needs pp x virtual_stages layers
# a fine-tune of the MLPs and norms (embeddings, head and attention frozen): the norm gains, replicated over tp, are
# ~3% of the squared gradient norm instead of 2e-4, so a norm that counts them on every tp rank is off by ~1.5%,
# orders of magnitude above the 1e-5 tolerance (checked below), not 8x it
NORMS_AND_MLPS = tuple(f"model.{name}" for name in ("tok_embeddings.weight", "lm_head.weight", *(
    f"blocks.{i}.attn.{w}.weight" for i in range(TINY["n_layers"]) for w in ("wq", "wk", "wv", "wo"))))
DP2_TP2 = partial(ComposedStrategy, tensor_parallel_size=2)

FOUR_RANKS = {
    "tp2_pp2": Case(partial(PipelineStrategy, tensor_parallel_size=2, microbatches=2, activation_checkpointing="full"),
                    label="tp2 x pp2, full checkpointing",
                    trainer={"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}),
    "zero3_dp2_tp2": Case(partial(ZeroStrategy, stage=3, tensor_parallel_size=2, activation_checkpointing="selective"),
                          optimizer="adamw", label="zero3 dp2 x tp2, selective checkpointing"),
    "zero1_dp2_pp2": Case(partial(PipelineStrategy, zero_stage=1, microbatches=2, schedule="gpipe"),
                          label="zero1 dp2 x pp2"),
    "ep2_tp2": Case(partial(ExpertParallelStrategy, tensor_parallel_size=2, sequence_parallel=False), model=MOE,
                    label="ep2 x tp2 (MoE)"),
    "ep2_pp2": Case(partial(ExpertParallelStrategy, pipeline_parallel_size=2, microbatches=2,
                            activation_checkpointing="full"), model=MOE_PP, optimizer="adamw",
                    label="ep2 x pp2 (MoE), full checkpointing"),
    "hsdp_zero3": Case(partial(ZeroStrategy, stage=3, data_parallel_replicate_size=2), label="HSDP 2 x 2 zero3"),
    # clipping under dp x tp with a limit below every norm and one above (a no-op), and the norm with a large share
    # of tp-replicated gradients
    "dp2_tp2_clip_below": Case(DP2_TP2, trainer={"gradient_clip_val": 0.05}, label="dp2 x tp2, clipped"),
    "dp2_tp2_clip_above": Case(DP2_TP2, trainer={"gradient_clip_val": CLIP_ABOVE}, label="dp2 x tp2, limit above"),
    "dp2_tp2_norms_mlps": Case(DP2_TP2, frozen=NORMS_AND_MLPS, label="dp2 x tp2, MLPs and norms trained"),
}


class StepLoss(L.Callback):
    """The loss each rank's training_step returned, unsynchronised: under cp it must be the whole sequence's."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))

    def __getstate__(self) -> dict[str, Any]:
        # without the module's `log` Lightning attaches (its cp cores hold groups)
        return {"losses": self.losses}


# context parallelism: each case's sequences (16 tokens) split in 2 x cp zigzag chunks, both attention methods; two
# steps each (the second after an update: the ring is the slowest engine on CPU)
CP_TWO_RANKS = {
    "cp2_ring": Case(partial(ComposedStrategy, context_parallel_size=2), callbacks=(StepLoss(),), steps=2,
                     label="cp2 ring"),
    "cp2_allgather": Case(partial(ComposedStrategy, context_parallel_size=2, cp_method="allgather"),
                          optimizer="adamw", steps=2, label="cp2 allgather"),
}
CP_FOUR_RANKS = {
    "dp2_cp2": Case(partial(ComposedStrategy, context_parallel_size=2, cp_method="allgather"), optimizer="adamw",
                    trainer={"gradient_clip_val": 0.5}, steps=2, label="dp2 x cp2 allgather, clipped"),
    "cp2_tp2": Case(partial(ComposedStrategy, context_parallel_size=2, tensor_parallel_size=2,
                            activation_checkpointing="full"), steps=2,
                    label="cp2 x tp2 ring (sequence parallel), full AC"),
    "zero3_cp2": Case(partial(ComposedStrategy, zero_stage=3, context_parallel_size=2), optimizer="adamw",
                      trainer={"gradient_clip_val": 0.5}, steps=2, label="zero3 dp2 x cp2 ring, clipped"),
}

HSDP_CP = Case(partial(ComposedStrategy, zero_stage=3, data_parallel_replicate_size=2, context_parallel_size=2),
               optimizer="adamw", steps=2, label="HSDP 2 x 2 zero3 x cp2 ring")
EIGHT_RANKS = {  # dp2 x tp2 x pp2, every schedule once
    "zero1_gpipe": Case(partial(ComposedStrategy, zero_stage=1, tensor_parallel_size=2, pipeline_parallel_size=2,
                                microbatches=2, schedule="gpipe"), model=DEEP, label="3d zero1 gpipe"),
    "zero2_1f1b": Case(partial(ComposedStrategy, zero_stage=2, tensor_parallel_size=2, pipeline_parallel_size=2,
                               microbatches=2, schedule="1f1b"), model=DEEP, optimizer="adamw",
                       label="3d zero2 1f1b"),
    "zero1_interleaved": Case(partial(ComposedStrategy, zero_stage=1, tensor_parallel_size=2,
                                      pipeline_parallel_size=2, microbatches=2, schedule="interleaved_1f1b",
                                      virtual_stages=2, activation_checkpointing="selective"), model=DEEP,
                              label="3d zero1 interleaved, selective checkpointing"),
    "zero2_zb_h1": Case(partial(ComposedStrategy, zero_stage=2, tensor_parallel_size=2, pipeline_parallel_size=2,
                                microbatches=2, schedule="zb_h1", activation_checkpointing="full"), model=DEEP,
                        label="3d zero2 zb_h1, full checkpointing"),
}


@pytest.mark.parametrize("names", [["tp2_pp2", "zero3_dp2_tp2", "zero1_dp2_pp2", "dp2_tp2_clip_below"],
                                   ["ep2_tp2", "ep2_pp2", "hsdp_zero3", "dp2_tp2_clip_above", "dp2_tp2_norms_mlps"]])
def test_four_rank_compositions_match_one_process(names: list[str]) -> None:
    for name, run in zip(names, run_parity([FOUR_RANKS[n] for n in names], world_size=4)):
        assert_parity(run)
        norms = [step["grad_norm"] for step in run["single"]["steps"]]
        if name == "dp2_tp2_clip_below":
            assert min(norms) > 0.05  # clipped every step
        if name == "dp2_tp2_clip_above":
            assert max(norms) < CLIP_ABOVE / 2  # never clipped: an uncapped coefficient would scale by 2x or more
        if name == "dp2_tp2_norms_mlps":  # counting the replicated norm gains twice: sqrt(1 + share) - 1 > 100 rtol
            for step in run["single"]["steps"]:
                squares = {n: g.square().sum().item() for n, _, _, g in step["grads"] if g is not None}
                share = sum(v for n, v in squares.items() if n.endswith("norm.weight")) / sum(squares.values())
                assert math.sqrt(1 + share) - 1 > 100 * 1e-5, share


def test_context_parallel_on_two_ranks_matches_one_process() -> None:
    for run in run_parity(list(CP_TWO_RANKS.values()), world_size=2, env=REFERENCE_TILES):
        assert_parity(run)
        for callback in run["ranks"][0]["callbacks"]:  # logged without a sync, rank 0 shows the whole loss
            assert callback.losses == pytest.approx(run["single"]["callbacks"][0].losses, rel=1e-5)


def test_context_parallel_compositions_on_four_ranks_match_one_process() -> None:
    for run in run_parity(list(CP_FOUR_RANKS.values()), world_size=4, env=REFERENCE_TILES):
        assert_parity(run)


def test_eight_rank_compositions_match_one_process() -> None:
    for run in run_parity([*EIGHT_RANKS.values(), HSDP_CP], world_size=8, env=REFERENCE_TILES):
        assert_parity(run)


@pytest.mark.parametrize("kwargs, message", [
    (dict(zero_stage=3, pipeline_parallel_size=2), "use zero_stage 1 or 2 with pipeline parallelism"),
    (dict(zero_stage=3, expert_parallel_size=2), "use zero_stage 1 or 2 with expert parallelism"),
    (dict(zero_stage=2, expert_parallel_size=2, data_parallel_replicate_size=2),
     "set data_parallel_replicate_size to 1"),
    (dict(data_parallel_replicate_size=2), "set zero_stage"),
    (dict(cp_method="ring"), "cp_method is a context-parallel option: set context_parallel_size > 1"),
    (dict(context_parallel_size=2, cp_method="star"), "cp_method: unknown 'star'; choose one of ring, allgather"),
    (dict(context_parallel_size=2, pipeline_parallel_size=2), "use cp with dp, tp and ZeRO, or pp without cp"),
    (dict(context_parallel_size=2, expert_parallel_size=2), "use ep without cp, or a dense model with cp"),
    (dict(context_parallel_size=0), "context_parallel_size=0: must be an integer >= 1"),
    (dict(microbatches=4), "pipeline options, but pipeline_parallel_size is 1"),
    (dict(sequence_parallel=True), "set tensor_parallel_size > 1"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size=0: must be an integer >= 1"),
    (dict(zero_stage=4), "unknown ZeRO stage 4"),
    (dict(activation_checkpointing="some"), "unknown activation_checkpointing 'some'"),
])
def test_unsupported_combinations_are_refused_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=message):
        ComposedStrategy(**kwargs)


def test_presets_are_the_composed_strategy() -> None:
    tp = TensorParallelStrategy(zero_stage=2, pipeline_parallel_size=2)  # no option is silently ignored any more
    assert isinstance(tp, ComposedStrategy) and (tp.config.tp, tp.config.pp, tp.config.zero_stage) == (2, 2, 2)
    assert ZeroStrategy(stage=3, tensor_parallel_size=2).config.tp == 2


ENGINES = ["ac", "comm", "cp", "dp_engine", "experts", "grad_sync", "layout", "placement", "plan", "pp_runner",
           "pp_schedules", "pp_split", "pp_step",
           "tp_layers", "zero_engine"]


def test_engines_import_without_lightning() -> None:
    """The engines are usable (and testable) without a Trainer: importing them must not import Lightning."""
    code = ("import sys\n" + "".join(f"import lit_lm.strategies.{name}\n" for name in ENGINES) +
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]", out.stdout


# -- the loss seam: one rule (lit_lm.strategies.plan.StepLoss), kept where a strategy computes the step's loss itself
def test_step_loss_is_called_once_per_step_and_the_model_never_directly() -> None:
    model = torch.nn.Linear(2, 2)
    seam = plan.StepLoss(model, lambda x, y, **_: (model(x).sum(), y.sum()), "pipeline parallelism")
    x = torch.ones(1, 2)
    model(x)  # outside a step the model is anyone's (a callback generating, a test)
    with seam.step():
        loss, _ = seam(x, x)
    assert loss.requires_grad
    with pytest.raises(RuntimeError, match=r"pipeline parallelism: the step called the model directly; .*loss_fn"):
        with seam.step():
            model(x)
    with pytest.raises(RuntimeError, match="the step never called it"):
        with seam.step():
            pass
    with pytest.raises(RuntimeError, match="call it once per step"):
        with seam.step():
            seam(x, x)
            seam(x, x)
    with pytest.raises(RuntimeError, match="inside a training, validation or test step only"):
        seam(x, x)


class DirectLossLM(TinyLM):
    """Calls `model.loss` itself, bypassing the strategy's loss seam (`lit_lm.strategies.plan.LossSeam`)."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model.loss(batch[0][:, :-1], batch[0][:, 1:])[0]


def _fit_direct_loss(kind: str) -> str:
    """A module calling `model.loss` directly: fine under dp, refused under pp."""
    strategy = PipelineStrategy(microbatches=2) if kind == "pp" else ComposedStrategy()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(token_data(4)), batch_size=2)
    try:
        trainer.fit(DirectLossLM(), data)
    except RuntimeError as error:
        return str(error)
    return "trained"


def test_a_step_bypassing_the_loss_seam_is_refused_under_pp_only() -> None:
    for kind in ("dp", "pp"):
        out = run_distributed(_fit_direct_loss, 2, kind, init_process_group=False)
        if kind == "dp":
            assert out == ["trained", "trained"]
        else:
            assert all("pipeline parallelism: the step called the model directly" in o for o in out), out
