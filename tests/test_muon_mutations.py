"""Muon's layouts can fail: orthogonalizers broken on purpose inside the workers are reported by the Muon parity
checks (tests/test_muon_parity.py: float32 NS at 1e-5 on every step), and an optimizer that is neither elementwise
nor matrix-wise is refused where the layout splits parameters.

- a shard orthogonalized alone (every cut ignored: each rank runs NS on its ZeRO rows or tp slice);
- tp's Gram mode without its all-reduces (each tp rank's norm and Gram matrix of its own slice: its shard
  orthogonalized alone, for the matrices cut along their long dimension);
- an expert stack orthogonalized as one [E * out, in] matrix;
- momentum not carried over a resume (the loaded momentum_buffer dropped: the resumed run restarts it at zero);
- Newton-Schulz per micro-batch (each micro-batch's gradient orthogonalized before it is accumulated, as
  DeepSpeed's ZeRO-3 Muon did, #8443).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from lit_lm.parity import run_parity, unreported_mutants
from lit_lm.strategies import comm, orthogonalize, sharded_state
from lit_lm.strategies.base import BaseStrategy
from lit_lm.strategies.composed import ComposedStrategy
from lit_lm.strategies.errors import ConfigError
from test_muon_parity import TWO_RANKS, assert_muon_parity


def shard_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(orthogonalize, "_levels", lambda shard, replica, mode: ())


def gram_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    all_reduce = comm.all_reduce

    def but_gram(tensor: torch.Tensor, group: Any = None, *args: Any, label: str = "", **kwargs: Any) -> Any:
        return None if label.startswith("orthogonalize gram") else all_reduce(tensor, group, *args, label=label,
                                                                              **kwargs)

    monkeypatch.setattr(comm, "all_reduce", but_gram)


def stack_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    whole = orthogonalize.orthogonalize_whole

    def as_one(update: torch.Tensor, ns: Any) -> torch.Tensor:
        return ns(update.reshape(-1, update.shape[-1])).view(update.shape) if update.ndim == 3 else whole(update, ns)

    monkeypatch.setattr(orthogonalize, "orthogonalize_whole", as_one)


def momentum_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    load = sharded_state.ckpt.load_optimizer_state_by_fqn

    def without_momentum(optimizer: Any, state: dict, names: Any) -> None:
        state["state"] = {fqn: {k: v for k, v in s.items() if k != "momentum_buffer"}
                          for fqn, s in state["state"].items()}
        load(optimizer, state, names)

    monkeypatch.setattr(sharded_state.ckpt, "load_optimizer_state_by_fqn", without_momentum)


def ns_per_micro_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """After each micro-batch's backward, the matrices' new gradient (what it added) is replaced by its
    orthogonalization through the bound orthogonalizer (every rank runs the same backwards: same collectives)."""
    backward = BaseStrategy.backward

    def orthogonalized(self: ComposedStrategy, loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        opt = self.optimizers[0]
        matrices = [p for g in opt.param_groups if g.get("matrix") for p in g["params"]]
        before = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in matrices]
        out = backward(self, loss, optimizer, *args, **kwargs)
        added = [p.grad - b if p.grad is not None else torch.zeros_like(p) for p, b in zip(matrices, before)]
        ns = orthogonalize.LocalOrthogonalizer()([], added, _ns())
        for p, b, o in zip(matrices, before, ns):
            if p.grad is not None:
                p.grad.copy_(b + o.float())
        return out

    monkeypatch.setattr(ComposedStrategy, "backward", orthogonalized)


def _ns() -> Any:
    from lit_lm.strategies.newton_schulz import NewtonSchulz
    return NewtonSchulz((3.4445, -4.7750, 2.0315), 5, 1e-7, torch.float32)


REPORTED = r"(step \d rank \d: gradient of model\.\S+ differs|rank \d: final model\.\S+ differs|batch \d+ rank \d)"
MUTANTS = {  # case, the report it must raise
    "zero2 shard alone": (replace(TWO_RANKS["zero2"], mutation=shard_alone), REPORTED),
    "tp shard alone": (replace(TWO_RANKS["tp owner"], mutation=shard_alone), REPORTED),
    "tp Gram without its all-reduces": (replace(TWO_RANKS["tp"], mutation=gram_alone, callbacks=()), REPORTED),
    "ep stack as one": (replace(TWO_RANKS["ep"], mutation=stack_as_one), REPORTED),
    "resume momentum dropped": (replace(TWO_RANKS["zero2 resumed"], mutation=momentum_dropped), REPORTED),
    "lm_ddp NS per micro-batch": (replace(TWO_RANKS["zero3 accumulate 4"], strategy=ComposedStrategy,
                                          mutation=ns_per_micro_batch, label="lm_ddp accumulate 4 (Muon)"), REPORTED),
}


def test_muon_parity_reports_every_mutant() -> None:
    runs = run_parity([case for case, _ in MUTANTS.values()], world_size=2)
    missed, _ = unreported_mutants([(name, report, run) for (name, (_, report)), run in zip(MUTANTS.items(), runs)],
                                   assert_muon_parity)
    assert not missed, "\n".join(missed)


class Adafactorish(torch.optim.Adagrad):
    """Not elementwise as far as lit-lm knows (a subclass: the flat step checks exact types) and not matrix-wise."""


@pytest.mark.parametrize("kwargs,refused", [(dict(zero_stage=2), True), (dict(tensor_parallel_size=2), True),
                                            (dict(expert_parallel_size=2), True), ({}, False),
                                            (dict(pipeline_parallel_size=2), False)])
def test_an_optimizer_neither_elementwise_nor_matrix_wise_is_refused_where_parameters_are_split(
        kwargs: dict, refused: bool) -> None:
    strategy = ComposedStrategy(**kwargs)
    optimizer = Adafactorish([torch.nn.Parameter(torch.zeros(2, 2))])
    if refused:
        with pytest.raises(ConfigError, match=r"Adafactorish under .*neither elementwise \(SGD, Adam, AdamW.*"
                                              r"nor matrix-wise \(lit_lm\.optim\.Muon\)"):
            strategy._check_optimizer(optimizer)
    else:
        strategy._check_optimizer(optimizer)
    strategy._check_optimizer(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, 2))]))  # always fine

