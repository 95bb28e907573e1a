"""The flat optimizer step (`lit_lm/strategies/flat_step.py`) against the per-parameter step it replaces, engines only.

Per engine (ZeRO stages 1-3, and `GradSync`, lm_ddp's), on 2 gloo ranks: the same training (two param groups with
different lr and weight decay, a frozen weight inside the decay group, gradient accumulation, zero_grad to None and
to zeros; fp32, and bf16 parameters (with fp32 master shards under ZeRO stages 1-2) with the flat step and with
torch's per-parameter step must give the same values; the optimizer must really have stepped flat tensors (one per
group, per bucket for GradSync), the gradients (ZeRO stages 2-3, GradSync), GradSync's parameters and the optimizer
state must be views of flat buffers, with the gradient bytes exactly Φ_trainable/N·4 (ZeRO) or Φ_trainable·4
(GradSync), and a state saved and loaded mid-run (torch's per-parameter `state_dict`) must continue exactly as the
run that never stopped; an exception inside torch's step leaves the optimizer's groups as they were.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist

import lit_lm.strategies.flat_step as flat_step
from lit_lm.config import ModelConfig
from lit_lm.model import Transformer
from lit_lm.strategies.dp_engine import bind_optimizer
from lit_lm.strategies.grad_sync import GradSync
from lit_lm.strategies.zero_engine import ZeroEngine, model_state_bytes
from tests.dist_utils import TINY, run_distributed, token_data

FROZEN = "blocks.0.attn.wq.weight"
STEPS, ACCUMULATE = 4, 2
DDP = 0  # "stage 0": GradSync, with small buckets (several per group)
BUCKET_MB = 0.05


def _shards(engine: ZeroEngine | GradSync) -> dict[str, torch.Tensor]:
    """What the optimizer steps, by global name (GradSync: the whole parameters)."""
    if isinstance(engine, GradSync):
        return dict(engine.module.named_parameters())
    return {sp.fqn: sp.master for sp in engine.sharded_params()}


def _build(stage: int, optimizer: str, dtype: torch.dtype
           ) -> tuple[Transformer, ZeroEngine | GradSync, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**TINY)).to(dtype)
    model.get_parameter(FROZEN).requires_grad_(False)
    engine = ZeroEngine(model, stage) if stage != DDP else GradSync(model, bucket_cap_mb=BUCKET_MB)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    if optimizer == "adamw":
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0,
                                                                           "lr": 1e-2}], lr=3e-3)
    else:
        opt = torch.optim.SGD([{"params": decay, "weight_decay": 0.1}, {"params": other, "lr": 1e-2}], lr=3e-2,
                              momentum=0.9)
    bind_optimizer(opt, [engine])
    return model, engine, opt


def _step(model: Transformer, engine: ZeroEngine | GradSync, opt: torch.optim.Optimizer, k: int,
          probe: dict) -> None:
    data = token_data(STEPS * ACCUMULATE * 4, seed=3).view(STEPS, ACCUMULATE, 2, 2, -1)
    for micro in range(ACCUMULATE):
        tokens = data[k, micro, dist.get_rank()]
        with engine.no_sync() if micro < ACCUMULATE - 1 else nullcontext():
            model.loss(tokens[:, :-1], tokens[:, 1:])[0].backward()
    engine.finish_grad_sync()
    probe.setdefault("grad_bytes", model_state_bytes(model, opt)["grads"])
    probe.setdefault("grad_storages", {t.grad.untyped_storage().data_ptr()
                                       for t in _shards(engine).values() if t.grad is not None})
    probe.setdefault("param_storages", {t.untyped_storage().data_ptr() for t in _shards(engine).values()})
    opt.step()
    opt.zero_grad(set_to_none=k % 2 == 0)
    engine.after_step()


def _masters(engine: ZeroEngine | GradSync) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in _shards(engine).items()}


def _train(stage: int, optimizer: str, dtype: torch.dtype) -> dict[str, Any]:
    model, engine, opt = _build(stage, optimizer, dtype)
    frozen = _shards(engine)[FROZEN]
    frozen_before = frozen.detach().clone()
    seen: list[list[int]] = []
    largest: list[int] = []  # the largest tensor torch's step saw (its temporaries are that size)

    def look(o: torch.optim.Optimizer, *_: Any) -> None:
        seen.append([len(g["params"]) for g in o.param_groups])
        largest.append(max(p.numel() for g in o.param_groups for p in g["params"] if p.grad is not None))

    opt.register_step_pre_hook(look)
    probe: dict[str, Any] = {}
    for k in range(STEPS):
        if k == 2:
            saved = (copy.deepcopy(opt.state_dict()), _masters(engine))
        _step(model, engine, opt, k, probe)
    trainable = [t for name, t in _shards(engine).items() if name != FROZEN]
    state_storages = {v.untyped_storage().data_ptr() for t in trainable for v in opt.state[t].values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0}
    # a fresh run loads the state of step 2 (per-parameter, as a checkpoint holds it) and does steps 2-3
    model2, engine2, opt2 = _build(stage, optimizer, dtype)
    with torch.no_grad():
        for name, t in _shards(engine2).items():
            t.copy_(saved[1][name])
    opt2.load_state_dict(saved[0])
    engine2.after_step()  # the loaded masters into the parameters the forward reads
    for k in range(2, STEPS):
        _step(model2, engine2, opt2, k, {})
    # one flat per group (GradSync: per bucket holding any of it), the frozen weight left in its group as it is
    buckets = engine.buckets if isinstance(engine, GradSync) else [None]
    runs = [sum(b is None or any((p.dim() >= 2) == decay for p in b.params) for b in buckets) for decay in (1, 0)]
    members = max(t.numel() for t in trainable)
    return {"masters": _masters(engine), "resumed": _masters(engine2), "seen": seen, "raised": _raise_in_step(opt2),
            "largest": max(largest), "largest_later": max(largest[1:]), "largest_member": members,
            "frozen_unchanged": torch.equal(frozen, frozen_before), "frozen_state": frozen in opt.state,
            "phi_trainable": sum(t.numel() for t in trainable), "state_storages": len(state_storages),
            "state_keys": len({k for t in trainable for k in opt.state[t]}), "flats": [runs[0] + 1, runs[1]],
            "buckets": len(buckets), **probe}


def _raise_in_step(opt: torch.optim.Optimizer) -> bool:
    """An exception inside torch's step (here a hook's) leaves the per-parameter groups and state in place, and
    an LR scheduler made after the flat step was installed still counts the steps."""
    groups = [list(g["params"]) for g in opt.param_groups]
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)

    def fail(*_: Any) -> None:
        raise ValueError("boom")

    handle = opt.register_step_pre_hook(fail)
    try:
        opt.step()
    except ValueError:
        pass
    handle.remove()
    return ([list(g["params"]) for g in opt.param_groups] == groups
            and set(opt.state) <= {p for g in groups for p in g}  # no flat tensor left behind
            and getattr(opt, "_opt_called", False) and scheduler.last_epoch == 0)


PIECE = 700  # a piece limit below the tiny model's flats (its largest member has 2048 elements)


def _both(stage: int) -> dict[str, tuple[dict, dict]]:
    """AdamW and SGD on fp32 parameters; under stages 1-2 also AdamW on bf16 ones (separate fp32 master shards:
    views of the flat master buffer); where the step runs flat, AdamW and SGD again with pieces of at most PIECE
    elements (several pieces per flat; a member larger than that alone at its first step, in parts after)."""
    out = {}
    runs = [("adamw", torch.float32, None), ("sgd", torch.float32, None)] + [("adamw", torch.bfloat16, None)] * (
        stage < 3) + [("adamw", torch.float32, PIECE), ("sgd", torch.float32, PIECE)] * (stage in (3, DDP))
    for optimizer, dtype, piece in runs:
        limit, flat_step.CPU_PIECE_NUMEL = flat_step.CPU_PIECE_NUMEL, piece or flat_step.CPU_PIECE_NUMEL
        try:
            flat = _train(stage, optimizer, dtype)
        finally:
            flat_step.CPU_PIECE_NUMEL = limit
        elementwise, flat_step.ELEMENTWISE = flat_step.ELEMENTWISE, ()  # the per-parameter step, as before
        try:
            out[f"{optimizer} {dtype}" + (f" pieces of {piece}" if piece else "")] = (flat, _train(stage, optimizer,
                                                                                                dtype))
        finally:
            flat_step.ELEMENTWISE = elementwise
    return out


@pytest.mark.parametrize("stage", [1, 2, 3, DDP])
def test_flat_step_equals_per_parameter_step(stage: int) -> None:
    for rank, runs in enumerate(run_distributed(_both, 2, stage)):
        for optimizer, (flat, per_param) in runs.items():
            where = f"zero{stage} {optimizer} rank {rank}" if stage != DDP else f"GradSync {optimizer} rank {rank}"
            for name, value in per_param["masters"].items():
                torch.testing.assert_close(flat["masters"][name], value, rtol=1e-6, atol=1e-7,
                                           msg=lambda m: f"{where} {name}: {m}")  # noqa: B023 (called at once)
                torch.testing.assert_close(flat["resumed"][name], value, rtol=1e-6, atol=1e-7,
                                           msg=lambda m: f"{where} resumed {name}: {m}")  # noqa: B023
            assert per_param["seen"][0][0] > 10, where
            assert flat["frozen_unchanged"] and not flat["frozen_state"], where
            assert flat["raised"], where
            # flat where the shards and their gradients are views of flat buffers (stage 3, GradSync, stage 2's
            # bf16 parameters with their fp32 master buffer); stage 1 and stage 2's fp32 shards (the parameters'
            # own rows, or rows of stage 1's full gradient) step one by one, as torch does: no transient flat
            if stage == 3 or stage == DDP or (stage == 2 and "bfloat16" in optimizer):
                if "pieces" in optimizer:  # several pieces, none larger than the limit or a member
                    assert flat["seen"][0][0] > flat["flats"][0], (where, flat["seen"])  # the matrices' group
                    assert flat["largest"] <= max(PIECE, flat["largest_member"]) < flat["phi_trainable"], where
                    # once the state exists, a member larger than the limit is stepped in parts of at most it
                    assert flat["largest_later"] <= PIECE < flat["largest_member"], where
                else:  # one piece per flat
                    assert flat["seen"] == [flat["flats"]] * STEPS, (where, flat["seen"])
                    # optimizer state: one tensor per key and piece (AdamW m, v; SGD momentum)
                    flats = sum(flat["flats"]) - 1
                    assert flat["state_storages"] == flats * (flat["state_keys"] - optimizer.startswith("adamw")), \
                        where
            else:
                assert flat["seen"] == per_param["seen"], (where, flat["seen"])
                assert flat["largest"] == flat["largest_member"], where
            if stage == DDP:  # parameters and gradients: one buffer per bucket (and the frozen weight on its own)
                assert flat["buckets"] >= 2 and len(flat["param_storages"]) == flat["buckets"] + 1, where
                assert len(flat["grad_storages"]) == flat["buckets"], where  # the gradients: one buffer a bucket
                assert flat["grad_bytes"] == flat["phi_trainable"] * (2 if "bfloat16" in optimizer else 4), where
            elif stage >= 2:  # the gradients live in one flat buffer of exactly Φ_trainable / N
                assert len(flat["grad_storages"]) == 1, where
                assert flat["grad_bytes"] == 4 * flat["phi_trainable"], where
