"""The parity harness of `lit-lm check` and the strategy tests: a run under a strategy on N gloo ranks against one
process, step by step.

    runs = run_parity([Case(partial(ZeroStrategy, stage=2)), Case(partial(ZeroStrategy, stage=3), optimizer="adamw")],
                      world_size=2)
    for run in runs:
        assert_parity(run)          # AssertionError naming the case, the step, the rank and the parameter

Both sides train lit_lm's `LanguageModel` (so MoE auxiliary losses and the router bias update are in) on the same
global batches. Each rank reads its rows as a Lightning run does: through the strategy's own sampler settings
(`trainer.strategy.distributed_sampler_kwargs` -> num_replicas, rank), with the micro-batch a user would set
(global batch / dp); sampler rank r takes the r-th contiguous share of each global batch, so the dp ranks in order
hold the one-process batch in its order (token-order effects such as MoE capacity drops stay comparable).
`assert_parity` first checks that the dp replicas read disjoint rows that together make the one-process batch, and
the tp, cp and pp peers of a replica the same rows (sampler settings from the wrong group are then reported even
where they would not move the mean gradient). Just before each
update (`on_before_optimizer_step`: after the gradient collectives, before clipping) every rank records

    loss        the logged `train_loss` of each micro-batch (the dp mean, through the strategy's `reduce`);
    grad_norm   the pre-clip global gradient norm from the strategy's own norm service (`grad_norm_shards`);
    grads       every gradient part it holds under its global name (the strategy's `named_grads()`), in fp32;

and after training the final parameters under global names. `assert_parity` checks each rank's every part
against the same slice of the single-process gradient (relative to the parameter's gradient norm, see
`_assert_grads`), that the parts
cover every parameter, and the losses, norms and final parameters (all at 1e-5 for fp32).

A case can start from a checkpoint (`resume`: a one-process run saved as one Lightning file): both sides resume
from it (the reference through Lightning's own loading, the strategy through its `load_checkpoint`), and the state
each rank starts from (every parameter and persistent buffer, e.g. the MoE router bias) is compared first.
Clipping is compared with an independent reference: Lightning's own `Trainer(gradient_clip_val)` clips the
one-process run with `torch.nn.utils.clip_grad_norm_`: a callback with a `one_process_reference()` (`GlobalNormClip`)
is replaced there by what that returns.

Why gradients and plain SGD: AdamW is invariant to a constant gradient factor and clipping every step hides one
too, so a strategy that sums instead of averaging passes a loss/parameter comparison under AdamW almost exactly;
the gradients themselves show it at step 0 (the mutation tests in test_parity_mutations.py prove it).

A `Case` is picklable: the strategy is a factory (a class or `functools.partial`) called in each worker, and
`mutation(monkeypatch)` (a module-level function, given a `pytest.MonkeyPatch`: pytest is then needed) breaks an
engine inside the workers for the mutation tests. Single-process references are cached per (model, optimizer, data,
trainer settings) for the process (a test session, one `lit-lm check`).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import importlib
import math
import re
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from types import MethodType
from typing import Any, Callable, Optional

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lit_lm.config import ModelConfig
from lit_lm.data.loss_mask import NOT_TARGET, targets_of
from lit_lm.data.packing import Packing
from lit_lm.module import LanguageModel
from lit_lm.optim import Muon
from lit_lm.param_groups import param_groups
from lit_lm.spawn import returnable, run_distributed
from lit_lm.strategies.base import BaseStrategy, GradPart
from lit_lm.strategies.clip import global_grad_norm, local_grad_shards


# the tiny model of the harness's cases (and the suite's): 2 layers, GQA 4:2
TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)

# block 0 dense, block 1 MoE (4 experts, top-2, a shared expert), z-loss and aux-free balancing; dropless
MOE = dict(TINY, moe_experts=4, moe_top_k=2, moe_d_ff=16, moe_shared_experts=1, moe_first_dense=1, moe_z_loss=1e-3,
           moe_bias_update=1e-3)


# Muon's learning rate in the harness's cases (its AdamW groups: 3e-3, as the "adamw" cases); low, because bfloat16
# Newton-Schulz amplifies fp32 summation-order noise through the steps (tests/test_muon_parity.py measures it)
MUON_LR = 2e-3


@dataclass(frozen=True)
class Case:
    """One run to compare. `strategy` builds the strategy in the worker (None: the one-process reference)."""

    strategy: Optional[Callable[[], Any]] = None
    model: dict = field(default_factory=lambda: dict(TINY))  # ModelConfig arguments
    optimizer: str = "sgd"  # "sgd": plain SGD (no momentum); "adamw": AdamW, decay on matrices only; "muon":
    # lit_lm.optim.Muon on the hidden matrices (param_groups' "matrix" group), AdamW on the rest; "module": the
    # module's own configure_optimizers (its optimizer, param groups and LR schedule: `lit-lm check`)
    ns_mode: str = "auto"  # Muon's: how the strategy spreads Newton-Schulz ("auto": tp's Gram mode where it
    # applies, owner elsewhere; "owner"; "replicated")
    ns_dtype: str = "bfloat16"  # Muon's Newton-Schulz dtype ("bfloat16": torch's; "float32")
    steps: int = 3
    global_batch: int = 8
    trainer: dict = field(default_factory=dict)  # e.g. accumulate_grad_batches, gradient_clip_val, precision
    frozen: tuple[str, ...] = ()  # parameters (global names) with requires_grad=False, still in the optimizer
    lr: Optional[float] = None  # default: 0.1 (sgd), 3e-3 (adamw)
    mutation: Optional[Callable[[Any], None]] = None  # applied in every worker, undone after
    callbacks: tuple[L.Callback, ...] = ()  # run on both sides; returned trained (e.g. to read what they recorded;
    # None for one that cannot be pickled back from a rank)
    label: str = ""
    resume: Optional["Case"] = None  # a one-process run (same model) saved as one file; this run continues it
    init_from: Optional[str] = None  # a Hugging Face model folder both sides start from (LanguageModel's init_from)
    # the LightningModule: a `LanguageModel` subclass's class path and its init arguments but `config`, as sorted
    # (name, value) pairs (`lit-lm check` trains the user's own); empty: `LanguageModel` itself
    module: tuple = ()
    # token ids drawn from [0, token_vocab) (then taken modulo the model's vocabulary); None: TINY's 64, the suite's
    # data. `lit-lm check` draws from its model's whole vocabulary, so every row (a tp rank's vocabulary shard past
    # id 64 included) is looked up and a target
    token_vocab: Optional[int] = None
    # packed documents (lit_lm.data.packing): (eos id, position_reset); every token drawn as a multiple of 5 becomes
    # that EOS (documents of ~5 tokens crossing rows, one-token ones), and both sides mask attention at them
    packing: tuple = ()
    # loss masks (lit_lm.data.loss_mask): every target whose id is a multiple of `loss_mask` is not trained on (so
    # each row, micro-batch and rank holds a different number of targets); the loss is per target of the step
    loss_mask: int = 0
    # (first, stop): only targets at these positions of each row are trained on (with or without `loss_mask`), e.g.
    # a span a context-parallel rank's share misses entirely, so that rank holds no target
    loss_span: tuple = ()

    def reference(self) -> "Case":
        """The same run on one process; a callback that names its `one_process_reference()` runs that there
        (`GlobalNormClip`: torch's own `clip_grad_norm_`)."""
        callbacks = tuple(c.one_process_reference() if hasattr(c, "one_process_reference") else c
                          for c in self.callbacks)
        return replace(self, strategy=None, mutation=None, callbacks=callbacks, label="single")

    @property
    def key(self) -> str:
        callbacks = [(type(c).__name__, sorted(vars(c).items())) for c in self.callbacks]
        return repr((sorted(self.model.items()), self.optimizer, self.ns_dtype, self.steps, self.global_batch,
                     sorted(self.trainer.items()), self.frozen, self.lr, callbacks,
                     self.resume.key if self.resume else None, self.init_from, self.module, self.token_vocab,
                     self.packing, self.loss_mask, self.loss_span))


class HarnessModule:
    """Mixed in before a `LanguageModel` (sub)class: the case's optimizer, frozen parameters and data (read after
    the layout exists)."""

    case: Case

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.case.packing:
            self.packing = Packing(*self.case.packing)
        self.loss_masks = bool(self.case.loss_mask or self.case.loss_span)

    def step_targets(self, batch_idx: int, micro_batches: int) -> int:
        """The step's targets: the case's global batches `batch_idx`.. (every rank's k-th batch is the k-th's share)."""
        g = self.case.global_batch
        return targets_of(case_tokens(self.case)[batch_idx * g: (batch_idx + micro_batches) * g])

    def configure_model(self) -> None:
        super().configure_model()
        for name in self.case.frozen:
            self.get_parameter(name).requires_grad_(False)

    def configure_optimizers(self) -> Any:
        if self.case.optimizer == "module":
            return super().configure_optimizers()
        params = list(self.parameters())  # frozen ones too: torch's optimizers skip a parameter with grad None
        if self.case.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.case.lr or 0.1)
        if self.case.optimizer == "muon":  # Muon on the hidden matrices, AdamW on the rest (the module's groups)
            groups = param_groups(self.model, 0.1, self.model.config.tie_embeddings, split_matrices=True)
            return Muon(groups, lr=self.case.lr or MUON_LR, adamw_lr=3e-3, adamw_eps=1e-6, ns_mode=self.case.ns_mode,
                        ns_dtype=self.case.ns_dtype)
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        # eps 1e-6, not 1e-8: Adam's first update is lr * g / (|g| + eps), whose slope lr / eps turns fp32
        # summation-order noise in near-zero gradient elements into weight differences the next step's gradients
        # show (1e-8: up to a sign flip, 2 lr); 1e-6 bounds that, and the gradients are compared directly anyway
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=self.case.lr or 3e-3, eps=1e-6)

    def train_dataloader(self) -> DataLoader:
        """This rank's rows as Lightning hands them out: which ones from the strategy's `distributed_sampler_kwargs`
        (what lit_lm's data module reads), how many per batch from the layout (the user's micro-batch setting)."""
        strategy = self.trainer.strategy
        sampler = getattr(strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        dp = strategy.layout.dp_size if isinstance(strategy, BaseStrategy) else 1
        case = self.case
        tokens = case_tokens(case)
        local, replicas = case.global_batch // dp, sampler["num_replicas"]
        return DataLoader(rank_share(tokens, local * replicas, sampler["rank"], replicas), batch_size=local)


class ParityLM(HarnessModule, LanguageModel):
    def __init__(self, case: Case) -> None:
        super().__init__(ModelConfig(**case.model), init_from=case.init_from)
        self.case = case


def harness_module(case: Case) -> LanguageModel:
    """The case's module: `ParityLM`, or the user's `LanguageModel` subclass (`case.module`) with the harness mixed in
    and the case's model config."""
    if not case.module:
        return ParityLM(case)
    class_path, kwargs = case.module
    module_name, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module_name), name)
    if not (isinstance(cls, type) and issubclass(cls, LanguageModel)):
        raise TypeError(f"{class_path} is not a LanguageModel subclass")
    module = type(f"Harness{cls.__name__}", (HarnessModule, cls), {})(config=ModelConfig(**case.model), **dict(kwargs))
    module.case = case
    return module


class Probe(L.Callback):
    """Per micro-batch losses and the rows read; per optimizer step the pre-clip global norm and this rank's gradient
    parts; with `start`, the state training starts from (after a resume's load)."""

    def __init__(self, start: bool = False) -> None:
        self.losses: list[float] = []
        self.rows: list[torch.Tensor] = []
        self.steps: list[dict[str, Any]] = []
        self.start: Optional[dict[str, torch.Tensor]] = {} if start else None
        self.dp_rank, self.sampler = 0, {}

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, BaseStrategy):
            self.dp_rank, self.sampler = strategy.layout.dp_rank, dict(strategy.distributed_sampler_kwargs)
        if self.start is not None:
            self.start = _state(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: torch.Tensor,
                           *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))
        self.rows.append(batch.detach().cpu().clone())

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


def _state(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer under its global name, whole, in fp32."""
    strategy = trainer.strategy
    state = strategy.lightning_module_state_dict() if isinstance(strategy, BaseStrategy) \
        else trainer.lightning_module.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().clone() for k, v in state.items()}


def fit_case(case: Case, devices: int = 1, ckpt_path: Optional[str] = None, save_to: Optional[str] = None
             ) -> dict[str, Any]:
    """Train `case` on this process (one of `devices` ranks), from `ckpt_path` (the saved `case.resume`) if given;
    the per-step records and final parameters. `save_to`: write the trained run there as one Lightning file."""
    with _mutated(case):
        L.seed_everything(0, verbose=False)
        module, callbacks = harness_module(case), copy.deepcopy(list(case.callbacks))
        probe = Probe(start=ckpt_path is not None)
        strategy = case.strategy() if case.strategy else "auto"
        trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy,
                            max_steps=case.steps + (case.resume.steps if ckpt_path else 0),
                            callbacks=[probe, *callbacks], logger=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                            enable_checkpointing=False, log_every_n_steps=1, **case.trainer)
        trainer.fit(module, ckpt_path=ckpt_path)
        if save_to is not None:
            trainer.save_checkpoint(save_to, weights_only=False)  # said so (None: Lightning logs its default)
        return {"losses": probe.losses, "rows": probe.rows, "dp_rank": probe.dp_rank, "sampler": probe.sampler,
                "start": probe.start, "steps": probe.steps, "params": _state(trainer),
                "callbacks": [c if _portable(c) else None for c in callbacks]}


def _portable(callback: L.Callback) -> bool:
    """Whether a trained callback can travel back from a rank (through the harness's safe loader): one that keeps
    the module (a user's pruning callback, `lit-lm check`) comes back as None. Lightning binds the module's `log`
    and `log_dict` onto every callback (its callback connector): those are the module's, so they stay behind."""
    for name in ("log", "log_dict"):
        if isinstance(callback.__dict__.get(name), MethodType):
            del callback.__dict__[name]
    return returnable(callback)


@contextlib.contextmanager
def _mutated(case: Case) -> Any:
    """`case.mutation` applied for the run and undone after (through pytest's MonkeyPatch, imported only then)."""
    if case.mutation is None:
        yield
        return
    import pytest

    with pytest.MonkeyPatch.context() as monkeypatch:
        case.mutation(monkeypatch)
        yield


def token_data(n_samples: int, seq_len: int = 16, seed: int = 0, vocab: int = TINY["vocab_size"]) -> torch.Tensor:
    """Fixed random tokens in [0, vocab) (default TINY's vocabulary; a larger model takes them modulo its own)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n_samples, seq_len + 1), generator=gen)


def case_tokens(case: Case) -> torch.Tensor:
    """Every window `case` trains on, in global batch order: (steps x accumulation x global_batch, T+1)."""
    windows = case.steps * case.trainer.get("accumulate_grad_batches", 1)
    vocab = case.token_vocab or TINY["vocab_size"]
    tokens = token_data(windows * case.global_batch, case.model["max_seq_len"], vocab=vocab)
    if case.packing:
        tokens[tokens % 5 == 0] = case.packing[0]
    tokens = tokens % case.model["vocab_size"]
    masked = tokens % case.loss_mask == 0 if case.loss_mask else torch.zeros_like(tokens, dtype=torch.bool)
    if case.loss_span:  # row value t + 1 is the target of position t
        position = torch.arange(tokens.shape[1]) - 1
        masked |= (position < case.loss_span[0]) | (position >= case.loss_span[1])
    return tokens | torch.where(masked, NOT_TARGET, 0) if case.loss_mask or case.loss_span else tokens


def rank_share(data: torch.Tensor, global_batch: int, rank: int, world: int) -> torch.Tensor:
    """This rank's rows, ordered so that its k-th local batch is its slice of the k-th global batch."""
    local = global_batch // world
    return data.view(-1, world, local, data.shape[-1])[:, rank].reshape(-1, data.shape[-1])


def _fit_cases(cases: list[Case], devices: int, ckpt_paths: list[Optional[str]]) -> list[dict[str, Any]]:
    return [fit_case(case, devices, path) for case, path in zip(cases, ckpt_paths)]


_REFERENCES: dict[str, dict[str, Any]] = {}
_SAVED: dict[str, str] = {}


def saved_checkpoint(case: Optional[Case]) -> Optional[str]:
    """`case` trained on one process and saved as one Lightning checkpoint file (once per session)."""
    if case is None:
        return None
    if case.key not in _SAVED:
        if not _SAVE_DIR:  # made on first use (importing the harness leaves nothing behind)
            _SAVE_DIR.append(tempfile.mkdtemp(prefix="parity-ckpt-"))
            atexit.register(shutil.rmtree, _SAVE_DIR[0], ignore_errors=True)
        path = f"{_SAVE_DIR[0]}/{len(_SAVED)}.ckpt"
        fit_case(case.reference(), save_to=path)
        _SAVED[case.key] = path
    return _SAVED[case.key]


_SAVE_DIR: list[str] = []  # the session's checkpoint folder, once made


def reference(case: Case) -> dict[str, Any]:
    """The single-process run of `case` (cached for the session)."""
    if case.key not in _REFERENCES:
        _REFERENCES[case.key] = fit_case(case.reference(), ckpt_path=saved_checkpoint(case.resume))
    return _REFERENCES[case.key]


def run_parity(cases: list[Case], world_size: int, env: Optional[dict[str, str]] = None) -> list[dict[str, Any]]:
    """Run every case on `world_size` ranks (one spawn for all, `env` added to the ranks' environment) and its
    one-process reference here. Each result: {"case", "ranks": [per-rank records], "single": the reference records}."""
    paths = [saved_checkpoint(case.resume) for case in cases]  # before the spawn: the workers read them
    per_rank = run_distributed(_fit_cases, world_size, cases, world_size, paths, init_process_group=False, env=env)
    return [{"case": case, "ranks": [r[i] for r in per_rank], "single": reference(case)}
            for i, case in enumerate(cases)]


def unreported_mutants(runs: list[tuple[str, str, dict[str, Any]]], check: Callable[[dict[str, Any]], None]
                       ) -> tuple[list[str], dict[str, str]]:
    """Each (name, report pattern, run) of a mutant must fail `check` (e.g. `assert_parity`) with a message that
    matches its pattern. Returns the mutants that did not — passed, or failed for another reason — and every
    mutant's report, by name."""
    missed, reports = [], {}
    for name, report, run in runs:
        try:
            check(run)
        except AssertionError as error:
            reports[name] = str(error)
            if not re.search(report, str(error)):
                missed.append(f"{name}: reported as {error}, expected /{report}/")
            continue
        missed.append(f"{name}: not reported")
    return missed, reports


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
    _assert_rows(run, tag)
    if single["start"] is not None:  # every parameter and persistent buffer
        _assert_state(run, "start", rtol, tag, "restored", list(single["start"]))
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
        _assert_state(run, "params", rtol, tag, "final", [name for name, *_ in single["steps"][0]["grads"]])


# a clip limit above every step's pre-clip norm (~0.75 at fp32 with the default cases): clipping must be a no-op
CLIP_ABOVE = 2.0


# bf16-mixed: a strategy against a one-process bf16-mixed run of the same seed, losses and pre-clip norms at
# BF16_RTOL (bf16 matmuls sum in another order when split); the same tolerance must reject a run whose weights
# never move (lr=1e-12), or it would show nothing
BF16_RTOL = 2e-3


# bf16-true: bf16 weights on both sides, but ZeRO updates fp32 master rows where the one process rounds every update
# into its bf16 weights; at step 0 the weights are the same and a gradient differs by its bf16 rounding and
# summation order only (measured: 2e-3 of the parameter's gradient norm; losses 1e-5, norms 4e-5), and two SGD steps
# later by the master weights' rounding as well (measured: 4e-3, weights 2e-3). 1e-2 holds those, while a gradient
# or norm off by a factor 2 is off by 1.0 = 100x the tolerance (test_parity_mutations.py has one: reported)
BF16_TRUE_RTOL = 1e-2


def bf16_true_case(strategy: Callable[[], Any], label: str, **kwargs: Any) -> Case:
    """Two plain-SGD steps in bf16-true (compare with `assert_parity(run, rtol=BF16_TRUE_RTOL)`)."""
    return Case(strategy, steps=2, trainer={"precision": "bf16-true"}, label=f"{label} bf16-true", **kwargs)


def bf16_cases(strategy: Callable[[], Any], label: str, **kwargs: Any) -> list[Case]:
    """A 6-step AdamW bf16-mixed case and its frozen-weights twin (lr=1e-12)."""
    common = dict(optimizer="adamw", steps=6, trainer={"precision": "bf16-mixed"}, **kwargs)
    return [Case(strategy, label=f"{label} bf16", **common), Case(strategy, lr=1e-12, label=f"{label} bf16 lr=1e-12",
                                                                   **common)]


def assert_bf16_parity(trained: dict[str, Any], frozen: dict[str, Any]) -> None:
    """`trained` within BF16_RTOL of its reference, and its frozen-weights twin reported against the same reference
    after step 0 (so the tolerance can see training)."""
    assert_parity(trained, rtol=BF16_RTOL, grads=False, params=False)
    try:
        assert_parity({**frozen, "single": trained["single"]}, rtol=BF16_RTOL, grads=False, params=False)
    except AssertionError as error:
        assert re.search(r"(batch|step) [1-5] rank \d: (loss|pre-clip grad norm)", str(error)), \
            f"frozen weights reported, but not after step 0 by a loss or norm: {error}"
    else:
        raise AssertionError(f"{frozen['case'].label}: frozen weights (lr=1e-12) pass at BF16_RTOL {BF16_RTOL}")


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


def _assert_rows(run: dict[str, Any], tag: str) -> None:
    """Per batch: the dp replicas read disjoint rows that together are the one-process batch; the ranks of one
    replica (tp, cp, pp peers) the same rows."""
    for b, expected in enumerate(run["single"]["rows"]):
        replicas: dict[int, tuple[int, set[tuple[int, ...]]]] = {}
        for rank, got in enumerate(run["ranks"]):
            rows = {tuple(row.tolist()) for row in got["rows"][b]}
            where = f"{tag}: batch {b}: rank {rank} (dp rank {got['dp_rank']}, sampler settings {got['sampler']})"
            assert len(rows) == len(got["rows"][b]), f"{where} read a row twice"
            peer, peer_rows = replicas.setdefault(got["dp_rank"], (rank, rows))
            assert rows == peer_rows, f"{where} read other rows than rank {peer} of the same dp replica"
        seen: dict[tuple[int, ...], int] = {}
        for dp_rank, (rank, rows) in sorted(replicas.items()):
            for row in rows:
                assert row not in seen, (f"{tag}: batch {b}: dp ranks {seen[row]} and {dp_rank} read the same row "
                                         f"(distributed_sampler_kwargs {run['ranks'][rank]['sampler']})")
                seen[row] = dp_rank
        assert set(seen) == {tuple(row.tolist()) for row in expected}, \
            f"{tag}: batch {b}: the dp replicas read {len(seen)} rows, not the one-process batch of {len(expected)}"


def _assert_state(run: dict[str, Any], key: str, rtol: float, tag: str, what: str, required: list[str]) -> None:
    """The parameters and persistent buffers some rank returned (`key`: "params" after training, "start" after a
    resume's load) against the one-process run's; `required`: the names some rank must return."""
    single = run["single"][key]
    seen: set[str] = set()
    for rank, got in enumerate(run["ranks"]):
        for name, value in got[key].items():
            if name not in single:
                continue
            seen.add(name)
            expected = single[name]
            err = (value - expected).norm().item()
            assert err <= rtol * expected.norm().item() + 1e-12, \
                f"{tag}: rank {rank}: {what} {name} differs by {err:.3e} (norm {expected.norm().item():.3e})"
    missing = [name for name in required if name not in seen]
    assert not missing, f"{tag}: no rank returned the {what} value of {missing}"


def _fmt(index: tuple[slice, ...]) -> str:
    if not index:
        return ""
    return "[" + ", ".join(":" if s == slice(None) else f"{s.start}:{s.stop}" for s in index) + "]"
