"""The parity harness of the strategy tests: a run under a strategy on N gloo ranks against one process, step by step.

    runs = run_parity([Case(partial(ZeroStrategy, stage=2)), Case(partial(ZeroStrategy, stage=3), optimizer="adamw")],
                      world_size=2)
    for run in runs:
        assert_parity(run)          # AssertionError naming the case, the step, the rank and the parameter

Both sides train lit_lm's `LanguageModel` (so MoE auxiliary losses and the router bias update are in) on the same
global batches, each dp replica reading its rows (tp and pp peers of a replica the same rows). Just before each
update (`on_before_optimizer_step`: after the gradient collectives, before clipping) every rank records

    loss        the logged `train_loss` of each micro-batch (the dp mean, through the strategy's `reduce`);
    grad_norm   the pre-clip global gradient norm from the strategy's own norm service (`grad_norm_shards`);
    grads       every gradient part it holds under its global name (the strategy's `named_grads()`), in fp32;

and after training the final parameters under global names. `assert_parity` checks each rank's every part
against the same slice of the single-process gradient (relative to the parameter's gradient norm, see
`_assert_grads`), that the parts
cover every parameter, and the losses, norms and final parameters (all at 1e-5 for fp32).

Why gradients and plain SGD: AdamW is invariant to a constant gradient factor and clipping every step hides one
too, so a strategy that sums instead of averaging passes a loss/parameter comparison under AdamW almost exactly;
the gradients themselves show it at step 0 (the mutation tests in test_parity_mutations.py prove it).

A `Case` is picklable: the strategy is a factory (a class or `functools.partial`) called in each worker, and
`mutation(monkeypatch)` (a module-level function) breaks an engine inside the workers for the mutation tests.
Single-process references are cached per (model, optimizer, data, trainer settings) for the test session.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import lightning as L
import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from dist_utils import TINY, rank_share, run_distributed, token_data
from lit_lm.config import ModelConfig
from lit_lm.module import LanguageModel
from strategies.base import BaseStrategy, GradPart
from strategies.clip import global_grad_norm, local_grad_shards


# block 0 dense, block 1 MoE (4 experts, top-2, a shared expert), z-loss and aux-free balancing; dropless
MOE = dict(TINY, moe_experts=4, moe_top_k=2, moe_d_ff=16, moe_shared_experts=1, moe_first_dense=1, moe_z_loss=1e-3,
           moe_bias_update=1e-3)


@dataclass(frozen=True)
class Case:
    """One run to compare. `strategy` builds the strategy in the worker (None: the one-process reference)."""

    strategy: Optional[Callable[[], Any]] = None
    model: dict = field(default_factory=lambda: dict(TINY))  # ModelConfig arguments
    optimizer: str = "sgd"  # "sgd": plain SGD (no momentum); "adamw": AdamW, decay on matrices only
    steps: int = 3
    global_batch: int = 8
    trainer: dict = field(default_factory=dict)  # e.g. accumulate_grad_batches, gradient_clip_val, precision
    frozen: tuple[str, ...] = ()  # parameters (global names) with requires_grad=False, still in the optimizer
    lr: Optional[float] = None  # default: 0.1 (sgd), 3e-3 (adamw)
    mutation: Optional[Callable[[pytest.MonkeyPatch], None]] = None  # applied in every worker, undone after
    callbacks: tuple[L.Callback, ...] = ()  # run on both sides; returned trained (e.g. to read what they recorded)
    label: str = ""

    def reference(self) -> "Case":
        """The same run on one process."""
        return replace(self, strategy=None, mutation=None, label="single")

    @property
    def key(self) -> str:
        callbacks = [(type(c).__name__, sorted(vars(c).items())) for c in self.callbacks]
        return repr((sorted(self.model.items()), self.optimizer, self.steps, self.global_batch,
                     sorted(self.trainer.items()), self.frozen, self.lr, callbacks))


class ParityLM(LanguageModel):
    """`LanguageModel` with the case's optimizer, frozen parameters and data (read after the layout exists)."""

    def __init__(self, case: Case) -> None:
        super().__init__(ModelConfig(**case.model))
        self.case = case

    def configure_model(self) -> None:
        super().configure_model()
        for name in self.case.frozen:
            self.get_parameter(name).requires_grad_(False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = list(self.parameters())  # frozen ones too: torch's optimizers skip a parameter with grad None
        if self.case.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.case.lr or 0.1)
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        # eps 1e-6, not 1e-8: Adam's first update is lr * g / (|g| + eps), whose slope lr / eps turns fp32
        # summation-order noise in near-zero gradient elements into weight differences the next step's gradients
        # show (1e-8: up to a sign flip, 2 lr); 1e-6 bounds that, and the gradients are compared directly anyway
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=self.case.lr or 3e-3, eps=1e-6)

    def train_dataloader(self) -> DataLoader:
        strategy = self.trainer.strategy
        dp_rank, dp = (strategy.layout.dp_rank, strategy.layout.dp_size) if isinstance(strategy, BaseStrategy) \
            else (0, 1)
        case = self.case
        windows = case.steps * case.trainer.get("accumulate_grad_batches", 1)
        tokens = token_data(windows * case.global_batch, case.model["max_seq_len"])
        tokens = tokens % case.model["vocab_size"]
        return DataLoader(rank_share(tokens, case.global_batch, dp_rank, dp), batch_size=case.global_batch // dp)


class Probe(L.Callback):
    """Per micro-batch losses; per optimizer step the pre-clip global norm and this rank's gradient parts."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, BaseStrategy):
            parts, shards = strategy.named_grads(), strategy.grad_norm_shards()
        else:
            parts = [GradPart(n, p.shape, (), p.grad) for n, p in module.named_parameters()]
            shards = local_grad_shards(module)
        self.steps.append({"grad_norm": float(global_grad_norm(shards)), "grads": [
            (p.name, p.global_shape, p.index, None if p.grad is None else p.grad.detach().float().clone())
            for p in parts]})


def _final_params(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    strategy = trainer.strategy
    state = strategy.lightning_module_state_dict() if isinstance(strategy, BaseStrategy) \
        else trainer.lightning_module.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().clone() for k, v in state.items()}


def fit_case(case: Case, devices: int = 1) -> dict[str, Any]:
    """Train `case` on this process (one of `devices` ranks); the per-step records and final parameters."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        if case.mutation is not None:
            case.mutation(monkeypatch)
        L.seed_everything(0, verbose=False)
        module, probe, callbacks = ParityLM(case), Probe(), copy.deepcopy(list(case.callbacks))
        strategy = case.strategy() if case.strategy else "auto"
        trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=case.steps,
                            callbacks=[probe, *callbacks], logger=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                            enable_checkpointing=False, **case.trainer)
        trainer.fit(module)
        return {"losses": probe.losses, "steps": probe.steps, "params": _final_params(trainer), "callbacks": callbacks}


def _fit_cases(cases: list[Case], devices: int) -> list[dict[str, Any]]:
    return [fit_case(case, devices) for case in cases]


_REFERENCES: dict[str, dict[str, Any]] = {}


def reference(case: Case) -> dict[str, Any]:
    """The single-process run of `case` (cached for the session)."""
    if case.key not in _REFERENCES:
        _REFERENCES[case.key] = fit_case(case.reference())
    return _REFERENCES[case.key]


def run_parity(cases: list[Case], world_size: int) -> list[dict[str, Any]]:
    """Run every case on `world_size` ranks (one spawn for all) and its one-process reference here. Each result:
    {"case", "ranks": [per-rank records], "single": the reference records}."""
    per_rank = run_distributed(_fit_cases, world_size, cases, world_size, init_process_group=False)
    return [{"case": case, "ranks": [r[i] for r in per_rank], "single": reference(case)}
            for i, case in enumerate(cases)]


def _close(got: float, expected: float, rtol: float) -> bool:
    return math.isclose(got, expected, rel_tol=rtol, abs_tol=1e-12)


def assert_parity(run: dict[str, Any], rtol: float = 1e-5, params: bool = True, grads: bool = True) -> None:
    """Every rank against the one-process run: losses, pre-clip norms, gradient parts (relative to the parameter's
    whole gradient), coverage of every parameter, final parameters. The first mismatch raises, naming the case,
    the step, the rank and the parameter."""
    case, single = run["case"], run["single"]
    tag = case.label or repr(case.strategy)
    accumulate = case.trainer.get("accumulate_grad_batches", 1)
    for rank, got in enumerate(run["ranks"]):
        assert len(got["losses"]) == len(single["losses"]), f"{tag}: rank {rank} ran {len(got['losses'])} batches"
        assert len(got["steps"]) == len(single["steps"]) == case.steps, f"{tag}: rank {rank} optimizer steps"
    for k in range(case.steps):  # in training order: the first difference is reported, not its consequences
        for rank, got in enumerate(run["ranks"]):
            for b in range(k * accumulate, (k + 1) * accumulate):
                a, e = got["losses"][b], single["losses"][b]
                assert _close(a, e, rtol), f"{tag}: batch {b} rank {rank}: loss {a!r} != single-process {e!r}"
            step, ref = got["steps"][k], single["steps"][k]
            if grads:
                _assert_grads(step["grads"], ref["grads"], rtol, f"{tag}: step {k} rank {rank}")
            a, e = step["grad_norm"], ref["grad_norm"]
            assert _close(a, e, rtol), f"{tag}: step {k} rank {rank}: pre-clip grad norm {a!r} != single {e!r}"
    if grads:
        _assert_covered(run, tag)
    if params:
        _assert_params(run, rtol, tag)


# bf16-mixed: a strategy against a one-process bf16-mixed run of the same seed, losses and pre-clip norms at
# BF16_RTOL (bf16 matmuls sum in another order when split); the same tolerance must reject a run whose weights
# never move (lr=1e-12), or it would show nothing
BF16_RTOL = 2e-3


def bf16_cases(strategy: Callable[[], Any], label: str, **kwargs: Any) -> list[Case]:
    """A 6-step AdamW bf16-mixed case and its frozen-weights twin (lr=1e-12)."""
    common = dict(optimizer="adamw", steps=6, trainer={"precision": "bf16-mixed"}, **kwargs)
    return [Case(strategy, label=f"{label} bf16", **common), Case(strategy, lr=1e-12, label=f"{label} bf16 lr=1e-12",
                                                                   **common)]


def assert_bf16_parity(trained: dict[str, Any], frozen: dict[str, Any]) -> None:
    assert_parity(trained, rtol=BF16_RTOL, grads=False, params=False)
    with pytest.raises(AssertionError, match=r"(batch|step) [1-5] rank \d: (loss|pre-clip grad norm)"):
        assert_parity({**frozen, "single": trained["single"]}, rtol=BF16_RTOL, grads=False, params=False)


def _assert_grads(parts: list[tuple], ref_parts: list[tuple], rtol: float, where: str) -> None:
    """Each part against the same slice of the one-process gradient. The error is measured relative to the larger
    of that parameter's gradient norm and 1% of the whole gradient's: after a few AdamW steps (whose first updates
    are ~lr * sign(grad)) fp32 summation-order noise in near-zero gradients moves the weights a little, and a
    parameter with a tiny gradient would show that noise at a scale nobody trains at."""
    ref = {name: g for name, _, _, g in ref_parts}
    total = math.sqrt(sum(g.square().sum().item() for g in ref.values() if g is not None))
    for name, shape, index, grad in parts:
        assert name in ref, f"{where}: gradient of {name}, a parameter the single-process model does not have"
        expected = ref[name]
        if expected is None:
            assert grad is None or not grad.any(), f"{where}: {name} has a gradient; single-process: none (frozen)"
            continue
        assert grad is not None, f"{where}: {name} has no gradient; single-process: one"
        assert tuple(shape) == tuple(expected.shape), \
            f"{where}: {name} global shape {tuple(shape)} != {tuple(expected.shape)}"
        part = expected[index]
        assert grad.shape == part.shape, \
            f"{where}: {name}{_fmt(index)} holds {tuple(grad.shape)}, expected {tuple(part.shape)}"
        err, scale = (grad - part).norm().item(), max(expected.norm().item(), 0.01 * total)
        ratio = grad.norm().item() / max(part.norm().item(), 1e-30)
        assert err <= rtol * scale, (f"{where}: gradient of {name}{_fmt(index)} differs: |diff| = {err:.3e} = "
                                     f"{err / max(scale, 1e-30):.2e} x {scale:.3e} (ratio of norms {ratio:.4f})")


def _assert_covered(run: dict[str, Any], tag: str) -> None:
    """Every element of every single-process gradient is held by some rank (first step)."""
    covered = {name: torch.zeros(g.shape, dtype=torch.bool) for name, _, _, g in run["single"]["steps"][0]["grads"]
               if g is not None}
    for got in run["ranks"]:
        for name, _, index, grad in got["steps"][0]["grads"]:
            if grad is not None and name in covered:
                covered[name][index] = True
    missing = [name for name, mask in covered.items() if not mask.all()]
    assert not missing, f"{tag}: no rank holds (all of) the gradient of {missing}"


def _assert_params(run: dict[str, Any], rtol: float, tag: str) -> None:
    single = run["single"]["params"]
    seen: set[str] = set()
    for rank, got in enumerate(run["ranks"]):
        for name, value in got["params"].items():
            if name not in single:
                continue
            seen.add(name)
            expected = single[name]
            err = (value - expected).norm().item()
            assert err <= rtol * expected.norm().item() + 1e-12, \
                f"{tag}: rank {rank}: final {name} differs by {err:.3e} (norm {expected.norm().item():.3e})"
    missing = [name for name, *_ in run["single"]["steps"][0]["grads"] if name not in seen]
    assert not missing, f"{tag}: no rank returned the final value of {missing}"


def _fmt(index: tuple[slice, ...]) -> str:
    if not index:
        return ""
    return "[" + ", ".join(":" if s == slice(None) else f"{s.start}:{s.stop}" for s in index) + "]"
