"""With loss masks and accumulation, the logged `train_loss` of a micro-batch is that micro-batch's own global mean
over its targets (what `training_step` promises a monitoring callback), not its weighted share of the step's."""

from __future__ import annotations

import pytest

from lit_lm.data.loss_mask import targets_of
from lit_lm.parity import Case, case_tokens, fit_case

MASKED = 3  # every target whose id is a multiple of 3 is not trained on: micro-batches hold unequal targets
FROZEN = dict(optimizer="sgd", lr=1e-30)  # SGD too small to move an fp32 weight: every batch sees the initial model


def test_an_accumulated_micro_batch_logs_its_own_mean():
    accumulated = Case(loss_mask=MASKED, trainer={"accumulate_grad_batches": 2}, global_batch=4, steps=1, **FROZEN)
    alone = Case(loss_mask=MASKED, global_batch=4, steps=2, **FROZEN)  # the same two micro-batches, each a step
    rows = case_tokens(accumulated)
    assert targets_of(rows[:4]) != targets_of(rows[4:8])
    assert fit_case(accumulated)["losses"] == pytest.approx(fit_case(alone)["losses"], rel=1e-6)
