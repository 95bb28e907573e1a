"""The parity harness can fail: engines broken on purpose (inside the worker processes) must be reported.

The first mutations are classic scale bugs that AdamW (invariant to a constant gradient factor) and clipping every
step would hide from a loss-and-parameters comparison: the harness compares the gradients themselves under plain
SGD, so the report names step 0, the parameter, and the factor (2 on 2 ranks). The context-parallel ones (cp2 ring)
are the bugs of a sequence split: gradients reduced without the cp ranks, ring attention's backward with each
tile's own log-sum-exp, and RoPE positions that do not follow the zigzag tokens are reported at step 0 by the
gradient of a named parameter (the RoPE bug moves the first loss by less than 1e-5: at initialisation attention
hardly shapes the logits, its gradients do); a merge that loses the running log-sum-exp by the first batch's loss
(or, were that within 1e-5, by the gradients).
A flat optimizer step that runs a group's flat tensors under another group's settings (no weight decay) changes
no gradient, only the update: it is reported by a final parameter.
The un-mutated twins of these cases pass in test_ddp, test_zero, test_ep and test_composed.
"""

from __future__ import annotations

import re
from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from parity import MOE, TINY, Case, assert_parity, run_parity
from strategies import comm, composed, ddp, zero_engine
from strategies import cp as context
from strategies.composed import ComposedStrategy
from strategies.ddp import DataParallelStrategy
from strategies.ep import ExpertParallelStrategy
from strategies.flat_step import FlatStep
from strategies.pp import PipelineStrategy
from strategies.zero import ZeroStrategy


def _scaled_comm(module: object, op: str, factor: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """`module`'s `comm.<op>` multiplies its input by `factor` first (other modules keep the real layer)."""
    real = getattr(comm, op)

    def scaled(*args: object, **kwargs: object) -> object:
        tensor = args[1] if op == "reduce_scatter" else args[0]  # the input of the collective
        tensor.mul_(factor)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "comm", SimpleNamespace(**{**vars(comm), op: scaled}))


def grad_sync_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    """GradSync sums instead of averaging: world x the input, then its division by the world."""
    _scaled_comm(ddp, "all_reduce", 2.0, monkeypatch)


def zero_reduce_scatter_doubled(monkeypatch: pytest.MonkeyPatch) -> None:
    _scaled_comm(zero_engine, "reduce_scatter", 2.0, monkeypatch)


def pp_tied_doubled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The composed strategy's all-reduce of the tied embedding/head over the first and last stage doubles."""
    _scaled_comm(composed, "all_reduce", 2.0, monkeypatch)


def ep_forgets_division(monkeypatch: pytest.MonkeyPatch) -> None:
    """The expert gradients keep the sum over the ep peers (finish_grad_sync's `/ ep` undone)."""
    finish = ComposedStrategy.finish_grad_sync

    def without_division(self: ComposedStrategy) -> None:
        finish(self)
        grads = [rec.grad for rec in self._params if rec.expert and rec.grad is not None]
        torch._foreach_mul_(grads, self.ep_size)

    monkeypatch.setattr(ComposedStrategy, "finish_grad_sync", without_division)


def cp_grads_over_dp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense gradients averaged over dp only, as without cp: each cp rank keeps the gradient of its own tokens."""
    monkeypatch.setattr(ComposedStrategy, "_dense_group", property(lambda self: "dp"))


def ring_backward_tile_lse(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ring attention's backward recomputes each tile's probabilities with that tile's own log-sum-exp instead of
    the merged one (every tile's P then sums to 1); the forward is untouched."""
    backward = context.block_backward

    def with_tile_lse(q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, delta: Tensor, offset: int,
                      window: int, backend: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
        _, tile_lse = context.block_forward(q, k, v, offset, window, backend)
        return backward(q, k, v, do, tile_lse, delta, offset, window, backend)

    monkeypatch.setattr(context, "block_backward", with_tile_lse)


def rope_positions_contiguous(monkeypatch: pytest.MonkeyPatch) -> None:
    """The zigzag tokens, rotated by RoPE at the positions of a contiguous split (rank r: r·L ... r·L + L − 1)."""
    split = context.zigzag_batch

    def contiguous(inputs: Tensor, targets: Tensor, group: object = None) -> tuple[Tensor, Tensor, Tensor, float]:
        x, y, positions, weight = split(inputs, targets, group)
        return x, y, torch.arange(len(positions)) + dist.get_rank(group) * len(positions), weight

    monkeypatch.setattr(context, "zigzag_batch", contiguous)


def merge_keeps_lse(monkeypatch: pytest.MonkeyPatch) -> None:
    """The online-softmax merge rescales the output but does not write back the merged log-sum-exp."""
    merge = context.merge_into

    def stale(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
        before = lse.clone()
        merge(out, lse, block_out, block_lse)
        lse.copy_(before)

    monkeypatch.setattr(context, "merge_into", stale)


def flat_step_wrong_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flat step runs the first param group's flat tensors (the matrices) under the last group's settings: no
    weight decay. Gradients stay right, only the update is wrong, so the report is a final parameter."""
    swap_in = FlatStep._swap_in

    def misplaced(self: FlatStep, optimizer: torch.optim.Optimizer) -> None:
        swap_in(self, optimizer)
        live = {id(flat) for _, flat in self._live}
        first, last = optimizer.param_groups[0]["params"], optimizer.param_groups[-1]["params"]
        last.extend(t for t in first if id(t) in live)
        first[:] = [t for t in first if id(t) not in live]

    monkeypatch.setattr(FlatStep, "_swap_in", misplaced)


def _doubled(parameter: str) -> str:
    """The report of a gradient scaled by 2 on 2 ranks."""
    return rf"step 0 rank \d: gradient of {parameter}.*ratio of norms 2\.0000"


def _cp2(mutation: object, label: str) -> Case:
    return Case(partial(ComposedStrategy, context_parallel_size=2), mutation=mutation, label=f"cp2 ring, {label}")


GRADIENT = r"step 0 rank \d: gradient of model\.\S+ differs"
MUTANTS = {  # case, the report it must raise
    "grad_sync_sums": (Case(partial(DataParallelStrategy, bucket_cap_mb=0.01), mutation=grad_sync_sums,
                            label="lm_ddp, GradSync sums"), _doubled(r"model\.\w+")),
    "lm_ddp_flat_wrong_group": (Case(DataParallelStrategy, optimizer="adamw", mutation=flat_step_wrong_group,
                                     label="lm_ddp AdamW, flat step under the wrong group"),
                                r"rank \d: final model\.\S+ differs"),
    "zero2_doubled": (Case(partial(ZeroStrategy, stage=2), mutation=zero_reduce_scatter_doubled,
                           label="zero2, reduce-scatter doubled"), _doubled(r"model\.\w+")),
    "zero3_doubled_adamw": (Case(partial(ZeroStrategy, stage=3), optimizer="adamw",
                                 mutation=zero_reduce_scatter_doubled, label="zero3 AdamW, reduce-scatter doubled"),
                            _doubled(r"model\.\w+")),
    "ep_no_division": (Case(partial(ExpertParallelStrategy, expert_parallel_size=2), model=MOE,
                            mutation=ep_forgets_division, label="ep2, no / ep"),
                       _doubled(r"model\.blocks\.1\.mlp\.experts\.w_")),
    "pp_tied_doubled": (Case(partial(PipelineStrategy, microbatches=2), model=dict(TINY, tie_embeddings=True),
                             mutation=pp_tied_doubled, label="pp2, tied embedding reduced twice over"),
                        _doubled(r"model\.tok_embeddings\.weight")),
    "cp_grads_over_dp": (_cp2(cp_grads_over_dp, "gradients averaged over dp, not dp x cp"),
                         GRADIENT),
    "cp_ring_backward_tile_lse": (_cp2(ring_backward_tile_lse, "backward with each tile's own lse"),
                                  GRADIENT),
    "cp_rope_contiguous": (_cp2(rope_positions_contiguous, "RoPE positions of a contiguous split"),
                           GRADIENT),
    # the loss moves by 1.6e-5 (relative) at step 0, barely past 1e-5; were it not, the gradients (non-finite) would
    "cp_merge_keeps_lse": (_cp2(merge_keeps_lse, "merge without the new lse"), rf"batch 0 rank \d: loss|{GRADIENT}"),
}


def test_harness_reports_every_mutant() -> None:
    """One launch for all of them (a module fixture would run again on every xdist worker that gets a share)."""
    runs = run_parity([replace(case, steps=1) for case, _ in MUTANTS.values()], 2)  # every report names step 0
    missed = []
    for (name, (_, report)), run in zip(MUTANTS.items(), runs):
        try:
            assert_parity(run)
        except AssertionError as error:
            if not re.search(report, str(error)):
                missed.append(f"{name}: reported as {error}, expected /{report}/")
            continue
        missed.append(f"{name}: not reported")
    assert not missed, "\n".join(missed)
