"""ZeRO's flat optimizer step (`strategies/zero_flat.py`) against the per-parameter step it replaces, engine only.

Per stage, on 2 gloo ranks: the same training (two param groups with different lr and weight decay, a frozen
weight inside the decay group, gradient accumulation, zero_grad to None and to zeros; fp32, and bf16 parameters
with fp32 master shards under stages 1-2) with the flat step and with
torch's per-parameter step must give the same master shards; the optimizer must really have stepped flat tensors
(one per group), the gradients (stages 2-3) and the optimizer state must be views of one flat buffer each, with
the gradient bytes exactly Φ_trainable/N·4, and a state saved and loaded mid-run (torch's per-parameter
`state_dict`) must continue exactly as the run that never stopped.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

import strategies.zero_flat as zero_flat
from lit_lm.config import ModelConfig
from lit_lm.model import Transformer
from strategies.zero_engine import ZeroEngine, model_state_bytes
from tests.dist_utils import TINY, run_distributed, token_data

FROZEN = "blocks.0.attn.wq.weight"
STEPS, ACCUMULATE = 4, 2


def _build(stage: int, optimizer: str, dtype: torch.dtype) -> tuple[Transformer, ZeroEngine, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**TINY)).to(dtype)
    model.get_parameter(FROZEN).requires_grad_(False)
    engine = ZeroEngine(model, stage)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    if optimizer == "adamw":
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0,
                                                                           "lr": 1e-2}], lr=3e-3)
    else:
        opt = torch.optim.SGD([{"params": decay, "weight_decay": 0.1}, {"params": other, "lr": 1e-2}], lr=3e-2,
                              momentum=0.9)
    engine.shard_optimizer(opt)
    return model, engine, opt


def _step(model: Transformer, engine: ZeroEngine, opt: torch.optim.Optimizer, k: int, probe: dict) -> None:
    data = token_data(STEPS * ACCUMULATE * 4, seed=3).view(STEPS, ACCUMULATE, 2, 2, -1)
    for micro in range(ACCUMULATE):
        tokens = data[k, micro, dist.get_rank()]
        model.loss(tokens[:, :-1], tokens[:, 1:])[0].backward()
    engine.finish_grad_sync()
    probe.setdefault("grad_bytes", model_state_bytes(model, opt)["grads"])
    probe.setdefault("grad_storages", {sp.master.grad.untyped_storage().data_ptr() for sp in engine.sharded_params()
                                       if sp.master.grad is not None})
    opt.step()
    opt.zero_grad(set_to_none=k % 2 == 0)
    engine.after_step()


def _masters(engine: ZeroEngine) -> dict[str, torch.Tensor]:
    return {sp.fqn: sp.master.detach().clone() for sp in engine.sharded_params()}


def _train(stage: int, optimizer: str, dtype: torch.dtype) -> dict[str, Any]:
    model, engine, opt = _build(stage, optimizer, dtype)
    frozen = next(sp for sp in engine.sharded_params() if sp.fqn == FROZEN)
    frozen_before = frozen.master.detach().clone()
    seen: list[list[int]] = []
    opt.register_step_pre_hook(lambda o, *_: seen.append([len(g["params"]) for g in o.param_groups]))
    probe: dict[str, Any] = {}
    for k in range(STEPS):
        if k == 2:
            saved = (copy.deepcopy(opt.state_dict()), _masters(engine))
        _step(model, engine, opt, k, probe)
    trainable = [sp for sp in engine.sharded_params() if sp.param.requires_grad]
    state_storages = {opt.state[sp.master][key].untyped_storage().data_ptr() for sp in trainable
                      for key in opt.state[sp.master] if opt.state[sp.master][key] is not None
                      and opt.state[sp.master][key].dim() > 0}
    # a fresh run loads the state of step 2 (per-parameter, as a checkpoint holds it) and does steps 2-3
    model2, engine2, opt2 = _build(stage, optimizer, dtype)
    with torch.no_grad():
        for sp in engine2.sharded_params():
            sp.master.copy_(saved[1][sp.fqn])
    opt2.load_state_dict(saved[0])
    engine2.refresh_params()
    for k in range(2, STEPS):
        _step(model2, engine2, opt2, k, {})
    return {"masters": _masters(engine), "resumed": _masters(engine2), "seen": seen,
            "frozen_unchanged": torch.equal(frozen.master, frozen_before), "frozen_state": frozen.master in opt.state,
            "phi_trainable": sum(sp.local_numel for sp in trainable), "state_storages": len(state_storages),
            "state_keys": len({k for sp in trainable for k in opt.state[sp.master]}), **probe}


def _both(stage: int) -> dict[str, tuple[dict, dict]]:
    """AdamW and SGD on fp32 parameters; under stages 1-2 also AdamW on bf16 ones (separate fp32 master shards:
    views of the flat master buffer)."""
    out = {}
    runs = [("adamw", torch.float32), ("sgd", torch.float32)] + [("adamw", torch.bfloat16)] * (stage < 3)
    for optimizer, dtype in runs:
        flat = _train(stage, optimizer, dtype)
        elementwise, zero_flat.ELEMENTWISE = zero_flat.ELEMENTWISE, ()  # the per-parameter step, as before
        try:
            out[f"{optimizer} {dtype}"] = (flat, _train(stage, optimizer, dtype))
        finally:
            zero_flat.ELEMENTWISE = elementwise
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_flat_step_equals_per_parameter_step(stage: int) -> None:
    for rank, runs in enumerate(run_distributed(_both, 2, stage)):
        for optimizer, (flat, per_param) in runs.items():
            where = f"zero{stage} {optimizer} rank {rank}"
            for name, value in per_param["masters"].items():
                torch.testing.assert_close(flat["masters"][name], value, rtol=1e-6, atol=1e-7,
                                           msg=lambda m: f"{where} {name}: {m}")  # noqa: B023 (called at once)
                torch.testing.assert_close(flat["resumed"][name], value, rtol=1e-6, atol=1e-7,
                                           msg=lambda m: f"{where} resumed {name}: {m}")  # noqa: B023
            # the flat step saw one tensor per group (plus the frozen weight, left in its group as it is)
            assert flat["seen"] == [[2, 1]] * STEPS, (where, flat["seen"])
            assert per_param["seen"][0][0] > 10, where
            assert flat["frozen_unchanged"] and not flat["frozen_state"], where
            # optimizer state: one flat tensor per key and group (AdamW m, v; SGD momentum)
            assert flat["state_storages"] == 2 * (flat["state_keys"] - optimizer.startswith("adamw")), where
            if stage >= 2:  # the gradients live in one flat buffer of exactly Φ_trainable / N
                assert len(flat["grad_storages"]) == 1, where
                assert flat["grad_bytes"] == 4 * flat["phi_trainable"], where
