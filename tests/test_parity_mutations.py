"""The parity harness can fail: engines broken on purpose (inside the worker processes) must be reported.

Each mutation is a classic scale bug that AdamW (invariant to a constant gradient factor) and clipping every step
would hide from a loss-and-parameters comparison: the harness compares the gradients themselves under plain SGD,
so the report names step 0, the parameter, and the factor (2 on 2 ranks). The un-mutated twins of these cases
pass in test_ddp, test_zero and test_ep.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from parity import MOE, TINY, Case, assert_parity, run_parity
from strategies import comm, composed, ddp, zero_engine
from strategies.composed import ComposedStrategy
from strategies.ddp import DataParallelStrategy
from strategies.ep import ExpertParallelStrategy
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


MUTANTS = {  # case, the parameter the report must name
    "grad_sync_sums": (Case(partial(DataParallelStrategy, bucket_cap_mb=0.01), mutation=grad_sync_sums,
                            label="lm_ddp, GradSync sums"), r"model\.\w+"),
    "zero2_doubled": (Case(partial(ZeroStrategy, stage=2), mutation=zero_reduce_scatter_doubled,
                           label="zero2, reduce-scatter doubled"), r"model\.\w+"),
    "zero3_doubled_adamw": (Case(partial(ZeroStrategy, stage=3), optimizer="adamw",
                                 mutation=zero_reduce_scatter_doubled, label="zero3 AdamW, reduce-scatter doubled"),
                            r"model\.\w+"),
    "ep_no_division": (Case(partial(ExpertParallelStrategy, expert_parallel_size=2), model=MOE,
                            mutation=ep_forgets_division, label="ep2, no / ep"), r"model\.blocks\.1\.mlp\.experts\.w_"),
    "pp_tied_doubled": (Case(partial(PipelineStrategy, microbatches=2), model=dict(TINY, tie_embeddings=True),
                             mutation=pp_tied_doubled,
                             label="pp2, tied embedding reduced twice over"), r"model\.tok_embeddings\.weight"),
}


@pytest.fixture(scope="module")
def mutant_runs() -> dict[str, dict]:
    return dict(zip(MUTANTS, run_parity([case for case, _ in MUTANTS.values()], 2)))


@pytest.mark.parametrize("name", list(MUTANTS))
def test_harness_reports_the_mutant(mutant_runs: dict[str, dict], name: str) -> None:
    parameter = MUTANTS[name][1]
    with pytest.raises(AssertionError, match=rf"step 0 rank \d: gradient of {parameter}.*ratio of norms 2\.0000"):
        assert_parity(mutant_runs[name])
