"""Muon under every layout against one process running lit_lm.optim.Muon (torch.optim.Muon's update on the hidden
matrices, each expert a matrix; AdamW on the rest: tests/test_muon.py), through the parity harness.

float32 Newton-Schulz (`ns_dtype="float32"`, most cases): every layout equals one process at the harness's fp32
tolerance (1e-5) on every step: losses, gradients, final parameters. The owner route moves pieces that are the
one-process matrix bit for bit; Gram mode (tp's default for a matrix cut along its long dimension) sums the
partial Grams in another order, a difference of fp32 rounding that NS leaves at that size (tests/test_muon_sharded.py:
~1e-6 of the matrix). tp2, zero1 dp2 x tp2 and zero3 x tp2 run in Gram ("gram") and owner mode, each at 1e-5 from
one process and from each other, and count Gram's all-reduces per optimizer step.

bfloat16 Newton-Schulz (torch's function, the default; the "bf16" cases): the first steps are held to 1e-5 and the
rest to MUON_RTOL 1e-2. NS in bfloat16 amplifies the small singular directions of its input (each step multiplies
them by ~a = 3.4445): a gradient that differs from the one-process gradient by fp32 summation order (~1e-7
relative: the dp mean of two halves is not the mean of the whole batch) crosses a bfloat16 rounding boundary here
and there, and the difference grows through the updates. Measured on one process (gradients multiplied by
1 + 1e-7 noise): the final parameters move by 2e-2 of their norm after three steps at lr 0.02, linearly less at a
lower lr. So the cases train at MUON_LR 2e-3 and are compared
- strictly, at the harness's fp32 1e-5, the losses of steps 0 and 1 and the gradients of step 0, and step 1's
  gradients at 1e-3 (after the first Muon update: the gathers, owners and scatters of step 0 are exact,
  `assert_exact_until_step_1`), and
- over all steps at MUON_RTOL 1e-2 (measured noise: 1.5e-3 of a parameter's norm at the third step): a matrix
  orthogonalized from a shard alone, an expert stack orthogonalized as one matrix or a momentum lost on resume
  changes the update by O(1), ~10% of the parameters after 3 steps (test_muon_mutations.py reports each).
Where the gradients are bit-identical (owner and replicated mode of one layout), the runs are equal bit for bit, in
either dtype.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lit_lm.parity import MOE, Case, _assert_grads, _close, assert_parity, fit_case, run_parity
from lit_lm.spawn import run_distributed
from lit_lm.strategies import comm
from lit_lm.strategies.checkpoint import read_whole
from lit_lm.strategies.composed import ComposedStrategy

MUON_RTOL = 1e-2  # bfloat16 NS, after step 1 (module docstring)
MOE_PP = dict(MOE, moe_aux_loss=0.0, moe_first_dense=0)  # as test_composed: per-token losses only under pp
GRAM_LABELS = ["orthogonalize gram norms tp"] + ["orthogonalize gram tp"] * 5  # per optimizer step, on every rank


class GramAllReduces(L.Callback):
    """The orthogonalizer's all-reduces of each optimizer step, as (group, label), from the accounting layer."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, str]]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        comm.COMM_LOG.reset()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self.steps.append([(r.group, r.label) for r in comm.COMM_LOG.records
                           if r.op == "all_reduce" and r.label.startswith("orthogonalize")])


def muon_case(label: str, ns_dtype: str = "float32", **kwargs: object) -> Case:
    strategy = partial(ComposedStrategy, **{k: v for k, v in kwargs.items() if k not in Case.__dataclass_fields__})
    suffix = "Muon" if ns_dtype == "float32" else f"Muon, {ns_dtype} NS"
    return Case(strategy, label=f"{label} ({suffix})", optimizer="muon", ns_dtype=ns_dtype,
                **{k: v for k, v in kwargs.items() if k in Case.__dataclass_fields__})


RESUMED = Case(label="one process, Muon", optimizer="muon", ns_dtype="float32", steps=2)  # the resumed runs' start
TP = dict(tensor_parallel_size=2)

TWO_RANKS = {
    "lm_ddp": muon_case("lm_ddp"),
    "zero1": muon_case("zero1", zero_stage=1),
    "zero2": muon_case("zero2", zero_stage=2),
    "zero2 replicated": muon_case("zero2 replicated NS", zero_stage=2, ns_mode="replicated"),
    "zero3": muon_case("zero3", zero_stage=3),
    "tp": muon_case("tp2 + sp, Gram where it applies", **TP, ns_mode="gram", callbacks=(GramAllReduces(),)),
    "tp owner": muon_case("tp2 + sp owner NS", **TP, ns_mode="owner"),
    "tp replicated": muon_case("tp2 + sp replicated NS", **TP, ns_mode="replicated"),
    "ep": muon_case("ep2 (MoE)", expert_parallel_size=2, model=MOE),
    "pp 1f1b": muon_case("pp2 1f1b", pipeline_parallel_size=2, microbatches=2, schedule="1f1b", model=MOE_PP),
    "pp zb_h1": muon_case("pp2 zb_h1", pipeline_parallel_size=2, microbatches=2, schedule="zb_h1"),
    # 4 micro-batches of 2 rows per step: the rows of the 8-row steps of "zero3"
    "zero3 accumulate 4": muon_case("zero3, accumulate 4", zero_stage=3, global_batch=2,
                                    trainer={"accumulate_grad_batches": 4}),
    "zero2 resumed": muon_case("zero2, resumed from one process", zero_stage=2, resume=RESUMED),
    "tp resumed": muon_case("tp2, resumed from one process", **TP, resume=RESUMED),
    # torch's bfloat16 NS (the default), with its own tolerance
    "zero2 bf16": muon_case("zero2", "bfloat16", zero_stage=2),
    "tp bf16": muon_case("tp2 + sp, Gram where it applies", "bfloat16", **TP, ns_mode="gram"),
    "tp owner bf16": muon_case("tp2 + sp owner NS", "bfloat16", **TP, ns_mode="owner"),
}

ZERO3_TP, ZERO1_TP = dict(zero_stage=3, **TP), dict(zero_stage=1, **TP)
FOUR_RANKS = {
    "zero3 x tp": muon_case("zero3 dp2 x tp2, Gram where it applies", **ZERO3_TP, ns_mode="gram",
                            callbacks=(GramAllReduces(),)),
    "zero3 x tp owner": muon_case("zero3 dp2 x tp2 owner NS", **ZERO3_TP, ns_mode="owner"),
    "zero3 x tp replicated": muon_case("zero3 dp2 x tp2 replicated NS", **ZERO3_TP, ns_mode="replicated"),
    "zero1 x tp": muon_case("zero1 dp2 x tp2, Gram where it applies", **ZERO1_TP, ns_mode="gram"),
    "zero1 x tp owner": muon_case("zero1 dp2 x tp2 owner NS", **ZERO1_TP, ns_mode="owner"),
    "dp x tp": muon_case("dp2 x tp2", **TP),
    "hsdp": muon_case("HSDP 2 x 2 zero3", zero_stage=3, data_parallel_replicate_size=2),
    "dp x pp": muon_case("zero1 dp2 x pp2", zero_stage=1, pipeline_parallel_size=2, microbatches=2),
    "tp x pp": muon_case("tp2 x pp2 1f1b", **TP, pipeline_parallel_size=2, microbatches=2, schedule="1f1b"),
    "zero2 x ep": muon_case("zero2 dp2 x ep2 (MoE): ZeRO's rows of an expert stack are whole experts", zero_stage=2,
                            expert_parallel_size=2, model=MOE),
    "ep x tp": muon_case("ep2 x tp2 (MoE)", expert_parallel_size=2, **TP, sequence_parallel=False, model=MOE),
}

EIGHT_RANKS = {
    "dp x tp x pp": muon_case("zero1 dp2 x tp2 x pp2", zero_stage=1, **TP, pipeline_parallel_size=2,
                              microbatches=2, schedule="1f1b"),
}


def assert_exact_until_step_1(run: dict) -> None:
    """The harness's fp32 tolerance for the first two steps' losses and step 0's gradients, and 1e-3 for step 1's
    gradients (measured: up to 1e-4 after a resume, whose momentum is larger): they see the first Muon update,
    every gather, owner and scatter of step 0."""
    case, single = run["case"], run["single"]
    accumulate = case.trainer.get("accumulate_grad_batches", 1)
    for rank, got in enumerate(run["ranks"]):
        for k, rtol in ((0, 1e-5), (1, 1e-3)):
            for b in range(k * accumulate, (k + 1) * accumulate):
                assert _close(got["losses"][b], single["losses"][b], 1e-5), f"{case.label}: batch {b} rank {rank}"
            _assert_grads(got["steps"][k]["grads"], single["steps"][k]["grads"], rtol,
                          f"{case.label}: step {k} rank {rank}")


def assert_muon_parity(run: dict) -> None:
    """float32 NS: the harness's 1e-5 on every step; bfloat16 NS: exact until step 1, then MUON_RTOL."""
    if run["case"].ns_dtype == "float32":
        assert_parity(run)
    else:
        assert_exact_until_step_1(run)
        assert_parity(run, rtol=MUON_RTOL)


def final_difference(a: dict, b: dict) -> float:
    """The largest difference of two runs' final parameters, relative to the parameter's norm, over ranks."""
    return max(((value - y["params"][name]).norm() / value.norm()).item()
               for x, y in zip(a["ranks"], b["ranks"]) for name, value in x["params"].items() if value.norm() > 0)


def assert_same_run(a: dict, b: dict) -> None:
    """Two layouts' runs equal bit for bit (the same gradients in, so the same matrices into NS)."""
    for rank, (x, y) in enumerate(zip(a["ranks"], b["ranks"])):
        assert x["losses"] == y["losses"], f"{b['case'].label}: rank {rank} losses"
        for name, value in x["params"].items():
            assert torch.equal(value, y["params"][name]), f"{b['case'].label}: rank {rank}: {name} differs"


def assert_gram_all_reduces(run: dict) -> None:
    """One all-reduce of the norms and one per NS step over tp, per optimizer step, on every rank."""
    for rank, got in enumerate(run["ranks"]):
        steps = got["callbacks"][0].steps
        assert steps == [[("tp", label) for label in GRAM_LABELS]] * run["case"].steps, (rank, steps)


def test_muon_on_two_ranks_matches_one_process() -> None:
    runs = dict(zip(TWO_RANKS, run_parity(list(TWO_RANKS.values()), world_size=2)))
    for run in runs.values():
        assert_muon_parity(run)
    assert_same_run(runs["zero2"], runs["zero2 replicated"])
    assert_same_run(runs["tp owner"], runs["tp replicated"])
    assert final_difference(runs["tp"], runs["tp owner"]) <= 1e-5  # Gram == owner
    assert not final_difference(runs["tp"], runs["tp owner"]) == 0  # (Gram mode ran: another summation order)
    assert_gram_all_reduces(runs["tp"])
    # bfloat16 NS: Gram's fp32 Gram sum, rounded once, against the owner's whole bfloat16 matmul (docs/optim.md)
    assert final_difference(runs["tp bf16"], runs["tp owner bf16"]) <= MUON_RTOL
    # accumulation: one orthogonalization per optimizer step, of the window's gradient: the 4 x 2-row steps are
    # the 8-row steps (same rows; fp32 order apart)
    accumulated, whole = runs["zero3 accumulate 4"]["ranks"][0]["params"], runs["zero3"]["single"]["params"]
    for name, value in whole.items():
        assert (accumulated[name] - value).norm() <= 1e-5 * value.norm(), name


def _save_sharded(case: Case, path: str) -> None:
    fit_case(case, devices=2, save_to=path)


def test_muon_momentum_saved_by_zero2_and_tp_is_the_one_process_momentum(tmp_path: Path) -> None:
    """N ranks -> a checkpoint of whole tensors: each rank's momentum rows (ZeRO-2) or slice (tp) land where the
    one-process run keeps its momentum (the other way, 1 -> N, is the resumed cases above; DCP reshards between)."""
    cases = {"zero2": replace(TWO_RANKS["zero2"], steps=2), "tp": replace(TWO_RANKS["tp"], steps=2, callbacks=())}
    single = tmp_path / "single.ckpt"
    fit_case(cases["zero2"].reference(), save_to=str(single))
    expected = torch.load(single, weights_only=False)["optimizer_states"][0]["state"]
    assert len(expected) > 20 and all("momentum_buffer" in s or "exp_avg" in s for s in expected.values())
    for name, case in cases.items():
        run_distributed(_save_sharded, 2, case, str(tmp_path / name), init_process_group=False)
        got = read_whole(tmp_path / name)["optimizer_states"][0]["state"]
        assert got.keys() == expected.keys(), name
        for i, state in expected.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    assert got[i][key].shape == value.shape, (name, i, key)
                    assert (got[i][key] - value).norm() <= 1e-5 * value.norm(), (name, i, key)


def test_muon_on_four_ranks_matches_one_process() -> None:
    runs = dict(zip(FOUR_RANKS, run_parity(list(FOUR_RANKS.values()), world_size=4)))
    for run in runs.values():
        assert_muon_parity(run)
    assert_same_run(runs["zero3 x tp owner"], runs["zero3 x tp replicated"])
    for layout in ("zero3 x tp", "zero1 x tp"):  # Gram (ZeRO's rows to the dp owner first) == owner
        assert 0 < final_difference(runs[layout], runs[f"{layout} owner"]) <= 1e-5, layout
    assert_gram_all_reduces(runs["zero3 x tp"])


def test_muon_on_eight_ranks_matches_one_process() -> None:
    for run in run_parity(list(EIGHT_RANKS.values()), world_size=8):
        assert_muon_parity(run)

