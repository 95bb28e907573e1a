"""ZeRO-1/2/3 against single-process training: losses and parameters, bytes on the wire and bytes in memory
against theory, sharded checkpoints resumed on another world size, and the bad configurations."""

from __future__ import annotations

import os
import zlib
from contextlib import nullcontext
from datetime import timedelta
from functools import partial
from typing import Any, Callable

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dist_utils import Recorder, TinyLM, rank_share, run_distributed, token_data
from lit_lm.parity import (BF16_TRUE_RTOL, Case, assert_bf16_parity, assert_parity, bf16_cases, bf16_true_case,
                           reference, run_parity)
from lit_lm.strategies import comm
from lit_lm.strategies.comm import COMM_LOG, wire_factor
from lit_lm.strategies.base import _unwrap
from lit_lm.strategies.zero import ZeroStrategy
from lit_lm.strategies.zero_engine import ZeroEngine, model_state_bytes

STEPS = 20
PLAIN: dict[str, Any] = {}
CLIP_ACCUM: dict[str, Any] = {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2}


class TwoGroupLM(TinyLM):
    """AdamW with a weight-decay group (matrices) and a no-decay group (norm gains), as LLM recipes do."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = list(self.parameters())
        return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                                 lr=self.hparams.lr)


class Probe(L.Callback):
    """Collectives issued per optimizer step (COMM_LOG) and model-state bytes just before each update, when the
    gradients are reduced and the optimizer state exists (from the second step on)."""

    def __init__(self) -> None:
        self.comm: list[dict] = []
        self.memory: list[dict] = []

    def on_train_batch_start(self, *args: Any) -> None:
        COMM_LOG.reset()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.memory.append(model_state_bytes(pl_module, getattr(optimizer, "_optimizer", optimizer)))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.comm.append(COMM_LOG.summary())


def fit(strategy: Any = "auto", devices: int = 1, global_batch: int = 8, max_steps: int = STEPS,
        steps_per_epoch: int = STEPS, ckpt_dir: str | None = None, resume: str | None = None,
        one_batch: bool = False, lr: float = 3e-3, **trainer_kwargs: Any) -> dict[str, Any]:
    """TwoGroupLM on fixed tokens, global batch constant over `devices`; returns losses, full params, probes.
    "zeroN" builds `ZeroStrategy(stage=N)`; `one_batch` repeats one global batch (see dist_utils.fit_tiny)."""
    if isinstance(strategy, str) and strategy.startswith("zero"):
        strategy = ZeroStrategy(stage=int(strategy[4:]))
    accumulate = trainer_kwargs.get("accumulate_grad_batches", 1)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    windows = 1 if one_batch else steps_per_epoch
    tokens = token_data(windows * accumulate * global_batch).repeat(steps_per_epoch // windows, 1)
    loader = DataLoader(TensorDataset(rank_share(tokens, global_batch, rank, devices)),
                        batch_size=global_batch // devices, shuffle=False)
    L.seed_everything(0, verbose=False)
    module, recorder, probe = TwoGroupLM(lr), Recorder(), Probe()
    callbacks: list[L.Callback] = [recorder, probe]
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps,
                        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0,
                        enable_checkpointing=ckpt_dir is not None, **trainer_kwargs)
    trainer.fit(module, loader, ckpt_path=resume)
    params = {k: v.detach().clone() for k, v in module.state_dict().items()}  # ZeRO-3: whole after teardown
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "params": params, "comm": probe.comm,
            "memory": probe.memory}


def _runs(configs: list[tuple[Any, dict]], devices: int, global_batch: int) -> list[dict]:
    return [fit(strategy, devices, global_batch, **cfg) for strategy, cfg in configs]


def _assert_parity(run: dict, single: dict, tag: str) -> None:
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0,
                               msg=lambda m: f"{tag}: {m}")
    for name, value in single["params"].items():
        rel = ((run["params"][name] - value).norm() / value.norm()).item()
        assert rel < 1e-5, (tag, name, rel)


def _phi() -> int:
    module = TinyLM()
    module.configure_model()
    return sum(p.numel() for p in module.parameters())


# -- parity (the harness), communication and memory with 2 ranks ---------------------------------------------
class StepProbe(L.Callback):
    """Per optimizer step: the collectives issued (COMM_LOG) and the model-state bytes just before the update;
    per backward: the gradient bytes held right after it (the accumulation window's peak). It reads no weight after
    the step (`lit_lm/strategies/weight_readers.py`)."""

    reads_weights = False

    def __init__(self) -> None:
        self.comm: list[dict] = []
        self.memory: list[dict] = []
        self.grad_bytes: list[int] = []

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._step = trainer.global_step
        COMM_LOG.reset()

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.grad_bytes.append(model_state_bytes(pl_module, _unwrap(trainer.optimizers[0]))["grads"])

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.memory.append(model_state_bytes(pl_module, _unwrap(optimizer)))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self._step:  # the window closed: this optimizer step's collectives
            self.comm.append(COMM_LOG.summary())
            COMM_LOG.reset()
            self._step = trainer.global_step


CLIP_ACCUM_4 = {"gradient_clip_val": 0.05, "accumulate_grad_batches": 4}
# NCCL's forms (reduce-scatter and all-gather), forced on gloo: the ones GPU ranks run
PARITY = [Case(partial(ZeroStrategy, stage=s, zero_collectives="reduce_scatter"), optimizer=opt, trainer=trainer,
               callbacks=(StepProbe(),), label=f"zero{s} {opt} {trainer} reduce_scatter")
          for s in (1, 2, 3) for opt, trainer in (("sgd", {}), ("adamw", CLIP_ACCUM_4))]


def test_zero_matches_single_process_with_theoretical_comm_and_memory() -> None:
    runs = run_parity(PARITY, 2)
    for run in runs:
        assert_parity(run)
        if run["case"].trainer:
            assert min(s["grad_norm"] for s in run["single"]["steps"]) > 0.05  # clipped every step

    # Wire bytes per rank per step: reduce-scatter + all-gather = 2(N-1)/N Φ (stage 3: one more all-gather).
    # Under accumulation stages 2 and 3 reduce-scatter every micro-step (the gradients stay sharded).
    phi, n = _phi(), 2
    for run in runs:
        case, probe = run["case"], run["ranks"][0]["callbacks"][0]
        stage, accumulate = case.strategy.keywords["stage"], case.trainer.get("accumulate_grad_batches", 1)
        reduces = accumulate if stage >= 2 else 1
        gathers = 1 if stage < 3 else 2 * accumulate  # stage 3: forward and backward of every micro-step
        expected = (reduces + gathers) * (n - 1) / n * phi * 4
        assert len(probe.comm) == case.steps
        for step in probe.comm[1:] if stage < 3 else probe.comm:  # ZeRO-1/2: some gathers in the next step's forward
            wire = sum(op["wire_bytes"] for name, op in step.items() if name in ("reduce_scatter", "all_gather"))
            assert wire == pytest.approx(expected, rel=0.02), case.label

    # Model-state bytes (params + grads + Adam m, v), fp32: DP 16Φ, ZeRO-1 8Φ + 8Φ/N, ZeRO-2 4Φ + 12Φ/N,
    # ZeRO-3 16Φ/N, measured before the last update (AdamW state exists); and the gradient bytes right after
    # every backward of the accumulation window: 4Φ (stage 1: full gradients), exactly 4Φ/N (stages 2, 3).
    theory = {1: 8 + 8 / n, 2: 4 + 12 / n, 3: 16 / n}
    for run in runs:
        case, probe = run["case"], run["ranks"][0]["callbacks"][0]
        stage = case.strategy.keywords["stage"]
        if case.optimizer == "adamw":
            assert probe.memory[-1]["total"] == pytest.approx(theory[stage] * phi, rel=0.05), case.label
            if stage == 1:
                assert max(probe.grad_bytes) == pytest.approx(4 * phi, rel=0.05), (case.label, probe.grad_bytes)
            else:  # the flat gradient buffer of the owned rows (every row count here is even): exactly 4Φ/N
                assert max(probe.grad_bytes) == 4 * phi // n, (case.label, probe.grad_bytes, phi)
    single = reference(PARITY[1])["callbacks"][0]
    assert single.memory[-1]["total"] == pytest.approx(16 * phi, rel=0.05)


class InFlight(L.Callback):
    """Whether ZeRO-1/2's after-step gathers were still in flight when the step's batch ended (they then run beside
    the next forward); it reads no weight, and says so."""

    reads_weights = False

    def __init__(self) -> None:
        self.in_flight: list[bool] = []
        self.step = 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self.step:  # a step ended this batch
            self.step = trainer.global_step
            engines = getattr(trainer.strategy, "_engines", [])
            self.in_flight.append(any(getattr(e, "gathers_in_flight", False) for e in engines))


def test_gloo_forms_are_the_default_and_match_single_process() -> None:
    """On gloo (CPU ranks) ZeRO-1/2 reduce by an all-reduce and gather by one broadcast per rank unless told
    otherwise (`comm.zero_forms`), ZeRO-3 by reduce-scatter and all-gather; every stage matches one process (SGD;
    AdamW with clipping and accumulation) with the bytes the planner counts for the form, and the gathers after the
    step run into the next forward (in flight at the batch's end: nothing else read the weights)."""
    cases = [Case(partial(ZeroStrategy, stage=s), optimizer=opt, trainer=trainer,
                  callbacks=(StepProbe(), InFlight()), label=f"zero{s} {opt} auto")
             for s in (1, 2) for opt, trainer in (("sgd", {}), ("adamw", CLIP_ACCUM_4))]
    cases.append(Case(partial(ZeroStrategy, stage=3, zero_collectives="all_reduce"), optimizer="sgd",
                      callbacks=(StepProbe(), InFlight()), label="zero3 sgd all_reduce (forced)"))
    phi, n = _phi(), 2
    for run in run_parity(cases, 2):
        assert_parity(run)
        case, probe, flight = run["case"], *run["ranks"][0]["callbacks"]
        ops = {name for step in probe.comm for name in step}
        assert {"all_reduce", "broadcast"} <= ops and not ops & {"reduce_scatter", "all_gather"}, (case.label, ops)
        stage, accumulate = case.strategy.keywords["stage"], case.trainer.get("accumulate_grad_batches", 1)
        reduces = accumulate if stage >= 2 else 1
        gathers = 1 if stage < 3 else 2 * accumulate
        expected = (reduces * wire_factor("all_reduce", n) + gathers * wire_factor("broadcast", n)) * phi * 4
        # ZeRO-1/2's gathers after step k are launched in step k + 1's forward but the first two: counted in it
        for step in probe.comm[1:] if stage < 3 else probe.comm:
            wire = sum(op["wire_bytes"] for name, op in step.items() if name in ("all_reduce", "broadcast"))
            assert wire == pytest.approx(expected, rel=0.02), case.label
        assert len(flight.in_flight) == case.steps and all(flight.in_flight) == (stage < 3), case.label


class WeightReader(L.Callback):
    """Reads every weight right after each optimizer step (`on_train_batch_end`): what a user's callback sees."""

    def __init__(self) -> None:
        self.seen: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self.seen.append({n: p.detach().clone() for n, p in module.named_parameters()})


READERS = [Case(partial(ZeroStrategy, stage=s, zero_collectives=form), optimizer="adamw", callbacks=(WeightReader(),),
                label=f"zero{s} {form} reader") for s in (1, 2) for form in ("all_reduce", "reduce_scatter")]


def test_a_callback_after_the_step_reads_the_updated_weights() -> None:
    """The gathers after the step run into the next forward unless something reads the weights first: a callback
    reading every parameter in `on_train_batch_end` gets the one-process run's values after every step (both
    forms; it fails with the gathers left in flight there: `FlushBeforeReaders` not flushing)."""
    for run in run_parity(READERS, 2):
        assert_parity(run)
        single, label = run["single"]["callbacks"][0].seen, run["case"].label
        for rank in run["ranks"]:
            seen = rank["callbacks"][0].seen
            assert len(seen) == len(single) == run["case"].steps
            for k, (got, ref) in enumerate(zip(seen, single)):
                for name, value in ref.items():
                    rel = ((got[name] - value).norm() / value.norm()).item()
                    assert rel < 1e-5, (label, k, name, rel)


def _misplaced_in_place() -> list[str]:
    whole, other = torch.arange(8.0), 1 - dist.get_rank()
    refused = []
    for call in (lambda: comm.all_gather(whole, whole.view(2, -1)[other]),
                 lambda: comm.reduce_scatter(whole.view(2, -1)[other], whole)):
        try:
            call()
        except ValueError as e:
            refused.append(str(e))
    comm.all_gather(whole, whole.view(2, -1)[dist.get_rank()])  # its own chunk: in place, allowed
    return refused


def test_in_place_collectives_take_this_ranks_chunk() -> None:
    """NCCL's rule, held where gloo forgives it (gloo stages through copies): an in-place all-gather's input, or an
    in-place reduce-scatter's output, is this rank's chunk of the whole; another chunk is refused before launch."""
    for refused in run_distributed(_misplaced_in_place, 2):
        assert [m.split(":")[0] for m in refused] == ["all_gather", "reduce_scatter"], refused
        assert all("not this rank's" in m for m in refused), refused


# -- bf16-mixed against one bf16-mixed process, with a tolerance that rejects frozen weights; bf16-true (ZeRO's fp32
# master rows) against one bf16-true process at every stage --------------------------------------------------------
def test_zero_bf16_matches_single_bf16_and_rejects_frozen_weights() -> None:
    true_cases = [bf16_true_case(partial(ZeroStrategy, stage=s), f"zero{s}") for s in (1, 2, 3)]
    mixed, frozen, *true = run_parity([*bf16_cases(partial(ZeroStrategy, stage=3), "zero3"), *true_cases], 2)
    assert_bf16_parity(mixed, frozen)
    for run in true:
        assert_parity(run, rtol=BF16_TRUE_RTOL)


# -- defects found by the harness -------------------------------------------------------------------------------
FROZEN = ("model.blocks.0.attn.wq.weight", "model.norm.weight")


def test_frozen_parameters_are_untouched_like_torch_adamw() -> None:
    """requires_grad=False parameters in the optimizer: torch's AdamW skips them (grad None); ZeRO must too."""
    runs = run_parity([Case(partial(ZeroStrategy, stage=s), optimizer="adamw", frozen=FROZEN, label=f"zero{s} frozen")
                       for s in (1, 2, 3)], 2)
    for run in runs:
        assert_parity(run)
        for rank in run["ranks"]:
            for name in FROZEN:
                assert all(g is None for n, _, _, g in rank["steps"][-1]["grads"] if n == name), name
    model = TinyLM()
    model.configure_model()
    for name in FROZEN:  # and untouched in the reference, so the parity above means untouched
        torch.testing.assert_close(runs[0]["single"]["params"][name], model.get_parameter(name), rtol=0, atol=0)


# -- ZeRO-3 on 3 ranks: a parameter count (and row counts) not divisible by 3 --------------------------------
class ToyBlocks(nn.Module):
    """A BlockModel whose parameters have fewer rows than ranks (empty shards) and an output bias of one row."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 2)
        self.blocks = nn.ModuleDict({"0": nn.Linear(2, 2), "1": nn.Linear(2, 2)})
        self.out = nn.Linear(2, 1)

    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        with torch.no_grad():
            tensor.copy_(torch.randn(tensor.shape, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for block in self.blocks.values():
            x = torch.tanh(block(x))
        return self.out(x).square().mean()


def _toy_step(model: ToyBlocks, x: torch.Tensor, engine: ZeroEngine | None, gather: bool = True,
              opt: type = torch.optim.SGD) -> dict[str, torch.Tensor]:
    optimizer = opt(model.parameters(), lr=0.1)
    if engine is not None:
        engine.shard_optimizer(optimizer)
    for _ in range(2):
        model(x).backward()
        if engine is not None:
            engine.finish_grad_sync()
        optimizer.step()
        optimizer.zero_grad()
        if engine is not None:
            engine.after_step()
    if engine is None:
        return {n: p.detach() for n, p in model.named_parameters()}
    if not gather:
        return {}
    out = {}
    for sp in engine.sharded_params():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, sp.master.detach())
        out[sp.fqn] = torch.cat(parts)
    return out


def _toy_worker() -> dict[str, torch.Tensor]:
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    with torch.device("meta"):
        model = ToyBlocks()
    engine = ZeroEngine(model, stage=3)
    return _toy_step(model, x.chunk(dist.get_world_size())[dist.get_rank()], engine)


def _three_rank_worker() -> tuple[dict, dict]:
    lightning_run = fit("zero3", 3, 6, lr=1e-3, **CLIP_ACCUM)
    dist.barrier()
    return lightning_run, _toy_worker()


def test_zero3_on_3_ranks_with_uneven_and_empty_shards() -> None:
    run, toy = run_distributed(_three_rank_worker, 3, init_process_group=False)[0]
    _assert_parity(run, fit(global_batch=6, lr=1e-3, **CLIP_ACCUM), "zero3 x3")

    single = _toy_step(_toy_model(), torch.randn(6, 5, generator=torch.Generator().manual_seed(1)), None)
    for name, value in single.items():
        torch.testing.assert_close(toy[name], value, rtol=1e-5, atol=1e-6)


class PerTensorSGD(torch.optim.SGD):
    """SGD's maths, but not an exact elementwise type: the flat step leaves it alone, so each master shard's gradient
    is the reduced shard itself (`ZeroEngine._complete_reduce`), which must not stay a view of a comm slot."""


def _toy_model() -> ToyBlocks:
    model = ToyBlocks()
    for name, p in model.named_parameters():
        model.init_parameter(name, p)
    return model


def _per_tensor_worker() -> dict[int, dict[str, torch.Tensor]]:
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1)).chunk(dist.get_world_size())[dist.get_rank()]
    out = {}
    for stage in (1, 2):
        model = _toy_model()
        out[stage] = _toy_step(model, x, ZeroEngine(model, stage=stage), opt=PerTensorSGD)
    return out


def test_zero12_per_tensor_optimizer_gradients_outlive_the_comm_slots() -> None:
    """Stages 1-2 reduce through two slots the next units reuse (`CommSlots`); a per-tensor optimizer's gradient
    shards are copied out of them: two steps on 2 ranks equal one process (a view left in the slot is overwritten by
    the units reduced after it, and the update goes wrong)."""
    ranks = run_distributed(_per_tensor_worker, 2)
    single = _toy_step(_toy_model(), torch.randn(6, 5, generator=torch.Generator().manual_seed(1)), None)
    for stage in (1, 2):
        for name, value in single.items():
            torch.testing.assert_close(ranks[0][stage][name], value, rtol=1e-5, atol=1e-6, msg=f"zero{stage} {name}")


# -- the ZeRO group a strict subgroup of the world: two dp groups of 2 in a world of 4 (dp2 x tp2's dp groups) -----
DP_GROUPS = ([0, 2], [1, 3])  # rank = dp_rank * tp + tp_rank: each dp group interleaves with the other


def _subgroup_worker(mutation: Callable[[pytest.MonkeyPatch], None] | None) -> dict[int, dict[str, tuple]]:
    """Per stage: this rank's (group, rank in it, {fqn: (start, end, master rows)}) after two steps of ToyBlocks,
    each dp group training on the same batch (its rows split by the rank in the group)."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a mismatch fails instead of hanging
    groups = [dist.new_group(ranks, timeout=timedelta(seconds=60)) for ranks in DP_GROUPS]
    index = next(i for i, ranks in enumerate(DP_GROUPS) if dist.get_rank() in ranks)
    group, rank = groups[index], DP_GROUPS[index].index(dist.get_rank())
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1)).chunk(2)[rank]
    out = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        if mutation is not None:
            mutation(monkeypatch)
        for stage in (1, 2, 3):
            with torch.device("meta"):
                model = ToyBlocks()
            engine = ZeroEngine(model, stage=stage, group=group)
            _toy_step(model, x, engine, gather=False)
            out[stage] = (DP_GROUPS[index], rank, {sp.fqn: (sp.start, sp.end, sp.master.detach().clone())
                                                   for sp in engine.sharded_params()})
    return out


def zero_subgroups(mutation: Callable[[pytest.MonkeyPatch], None] | None = None) -> list[dict]:
    return run_distributed(_subgroup_worker, 4, mutation, init_process_group=False)


def assert_zero_subgroups(per_rank: list[dict]) -> None:
    """In each group the ranks, in group order, hold consecutive rows that make every parameter whole, with the
    one-process values; the first difference names the stage, the group, the rank and the parameter."""
    model = ToyBlocks()
    for name, p in model.named_parameters():
        model.init_parameter(name, p)
    single = _toy_step(model, torch.randn(6, 5, generator=torch.Generator().manual_seed(1)), None)
    for stage in (1, 2, 3):
        for ranks in DP_GROUPS:
            members = sorted((per_rank[r][stage][1], r, per_rank[r][stage][2]) for r in ranks)
            for fqn, value in single.items():
                row = 0
                for _, r, shards in members:
                    start, end, master = shards[fqn]
                    where = f"zero{stage}, dp group {ranks}: rank {r}: {fqn} "
                    assert start == row, f"{where}holds rows {start}:{end}, the group's next rows start at {row}"
                    err = (master - value[start:end]).norm().item()
                    assert err <= 1e-5 * value.norm().item(), f"{where}rows {start}:{end} differ by {err:.3e}"
                    row = end
                assert row == value.shape[0], \
                    f"zero{stage}, dp group {ranks}: rank {r}: {fqn}: the group holds {row} of {value.shape[0]} rows"


def test_zero_in_dp_subgroups_of_a_larger_world() -> None:
    """The engine's rank is its rank in the group (a strict subgroup here), not the global one."""
    assert_zero_subgroups(zero_subgroups())


# -- reduce-scatters in one order on every rank, with a parameter used on one rank only ---------------------------
class MaybeExtra(nn.Module):
    """A linear layer, then (when `use_extra`) a second one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.extra = nn.Linear(2, 2), nn.Linear(2, 2)
        self.use_extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.lin(x))
        return self.extra(x) if self.use_extra else x


class RankDependentBlocks(ToyBlocks):
    """Block 1 holds a layer only rank 1 uses: on rank 0 that unit's gradients are never all ready in backward."""

    def __init__(self, use_extra: bool) -> None:
        super().__init__()
        self.blocks["1"] = MaybeExtra()
        self.blocks["1"].use_extra = use_extra


def _order_worker() -> dict[Any, dict]:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a mismatch fails instead of hanging
    return {**{stage: _order_case(stage) for stage in (1, 2, 3)}, "1 unsynced": _order_case(1, last_synced=False)}


def _order_case(stage: int, last_synced: bool = True) -> dict:
    rank = dist.get_rank()
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    torch.manual_seed(0)
    local = RankDependentBlocks(use_extra=rank == 1)
    for name, p in local.named_parameters():
        local.init_parameter(name, p)
    for _ in range(2):
        local(x).backward()
    expected = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in local.named_parameters()}
    for g in expected.values():
        dist.all_reduce(g)
        g.div_(2)
    with torch.device("meta"):
        model = RankDependentBlocks(use_extra=rank == 1)
    engine = ZeroEngine(model, stage=stage)
    COMM_LOG.reset()
    with engine.no_sync():  # stage 1 accumulates locally; stages 2-3 reduce every backward regardless
        model(x).backward()
    with nullcontext() if last_synced else engine.no_sync():  # (unsynced: finish_grad_sync reduces instead)
        model(x).backward()
    reduces = [r for r in COMM_LOG.records if r.label.startswith("zero reduce")]  # in either form
    order = [(r.label, r.numel) for r in reduces]  # launched by the backwards
    engine.finish_grad_sync()
    finished = [r.label for r in COMM_LOG.records if r.label.startswith("zero reduce")][len(order):]
    errors = {sp.fqn: (sp.master.grad - expected[sp.fqn][sp.start: sp.end]).norm().item()
              for sp in engine.sharded_params()}
    refused = ""
    if stage == 1 and last_synced:  # a second backward in the synchronised step would add to the reduced rows
        model(x).backward()
        try:
            model(x).backward()
        except RuntimeError as e:
            refused = str(e)
    return {"order": order, "finished": finished, "errors": errors, "refused": refused}


def test_reduce_scatters_in_backward_in_one_order_with_a_parameter_unused_on_one_rank() -> None:
    per_rank = run_distributed(_order_worker, 2, init_process_group=False)
    for stage in (1, 2, 3):
        ranks = [r[stage] for r in per_rank]
        backwards = 1 if stage == 1 else 2  # stage 1 reduces during the window's last backward only
        # the reverse of the forward: stages 1-2 the tail (`out`, after the blocks) first, then blocks 1, 0, the
        # root (`inp`); stage 3 gathers the root around the whole forward, so `out` reduces with `inp`, last
        units = [*(["tail"] if stage < 3 else []), "blocks.1", "blocks.0", "root"]
        assert ranks[0]["order"] == ranks[1]["order"], stage  # sizes too: block 1's extra parameter on rank 1 only
        assert [label for label, _ in ranks[0]["order"]] == [f"zero reduce {u}" for u in units] * backwards
        for r in ranks:
            assert max(r["errors"].values()) < 1e-6, (stage, r["errors"])
            assert ("second backward" in r["refused"]) == (stage == 1) and not r["finished"]
    for r in (r["1 unsynced"] for r in per_rank):  # every backward inside no_sync(): finish_grad_sync reduces
        assert not r["order"] and len(r["finished"]) == 4 and max(r["errors"].values()) < 1e-6, r  # with the tail


# -- checkpoints -------------------------------------------------------------------------------------------------
K = 4  # steps per epoch; checkpoint at the end of epoch 0, train to 2K


def _ckpt_worker(root: str, devices: int) -> dict[str, list[dict]]:
    """On 2 ranks: the uninterrupted run (checkpointing epoch 0), then a resume; on 1 rank: a resume."""
    runs: dict[str, list[dict]] = {}
    for stage in ("zero2", "zero3"):
        path = f"{root}/{stage}"
        common = dict(max_steps=2 * K, steps_per_epoch=K, one_batch=True)
        runs[stage] = [fit(stage, devices, ckpt_dir=path, **common)] if devices == 2 else []
        runs[stage].append(fit(stage, devices, resume=f"{path}/epoch=0-step={K}.ckpt", **common))
    return runs


def test_checkpoint_resumes_on_2_and_1_ranks(tmp_path: Any) -> None:
    on_two = run_distributed(_ckpt_worker, 2, str(tmp_path), 2, init_process_group=False)[0]
    on_one = run_distributed(_ckpt_worker, 1, str(tmp_path), 1, init_process_group=False)[0]
    for stage, (full, resumed_two) in on_two.items():
        for world, run in ((2, resumed_two), (1, on_one[stage][0])):
            torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(full["losses"][K:]),
                                       rtol=1e-5, atol=0,
                                       msg=lambda m: f"{stage} on {world}: {m}")  # noqa: B023 (called at once)
            for name, value in full["params"].items():
                assert ((run["params"][name] - value).norm() / value.norm()).item() < 1e-5, (stage, world, name)


# -- configuration ---------------------------------------------------------------------------------------------
def test_unknown_stage_is_explained() -> None:
    with pytest.raises(ValueError, match=r"unknown ZeRO stage 4: choose 1 .*, 2 .* or 3"):
        ZeroStrategy(stage=4)


def test_registered_names_select_the_stage() -> None:
    import lit_lm.strategies.registry  # noqa: F401  (registers the presets' names, as lit-lm's CLI does)
    for stage in (1, 2, 3):
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=f"zero{stage}", logger=False)
        assert isinstance(trainer.strategy, ZeroStrategy) and trainer.strategy.config.zero_stage == stage


# -- resident memory at a size where it shows: ZeRO-3 against FSDP2 --------------------------------------------

# ~44M parameters (176 MB fp32): large enough that a full-size temporary of the shard (88 MB per rank) or a copy of
# the model is far outside the margin, small enough for two steps in seconds
MEMORY_MODEL = dict(vocab_size=16000, d_model=512, n_layers=8, n_heads=8, max_seq_len=64)
# zero3's resident peak above imports may exceed FSDP2's by 5% (issue 36) plus 24 MB of the allocator's and gloo's
# own noise between fresh processes. Measured on 2 loaded CPU cores (MB, larger rank): FSDP2 1012-1056, zero3
# 896-985; before issue 36's fixes zero3 was 1149 (every unit's reduce-scatter buffer held to the end of the
# backward: 1142 with only that reverted). The flat step's piece size is held by tests/test_flat_step.py.
PEAK_RATIO, PEAK_SLACK = 1.05, 24 * 2**20


def _resident_peak(kind: str) -> int | None:
    """Two AdamW steps of the memory model on this rank under `kind` (our `zero3` engine with the strategy's flat
    step, or torch's `fsdp2`: `fully_shard` per block and on the model), both built on the meta device; the
    resident high-water mark above what the rank held before building it. None where /proc cannot tell."""
    from torch.distributed.fsdp import fully_shard

    from lit_lm.config import ModelConfig
    from lit_lm.model import Transformer
    from lit_lm.resident import ResidentPeak
    from lit_lm.strategies.dp_engine import bind_optimizer

    peak = ResidentPeak()
    if not peak.supported:
        return None
    config = ModelConfig(**MEMORY_MODEL)
    with torch.device("meta"):
        model = Transformer(config)
    engine = None
    if kind == "fsdp2":
        for block in model.blocks.values():
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().normal_(0.0, config.init_std)
    else:
        engine = ZeroEngine(model, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    if engine is not None:
        bind_optimizer(optimizer, [engine])
    tokens = torch.randint(0, config.vocab_size, (1, config.max_seq_len + 1),
                           generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])[0]
        optimizer.zero_grad()
        loss.backward()
        if engine is not None:
            engine.finish_grad_sync()
        optimizer.step()
        if engine is not None:
            engine.after_step()
    return peak.above()


def test_zero3_resident_peak_is_fsdp2s() -> None:
    """ZeRO-3's promise at the resident level: no full-size optimizer temporaries, gathered units freed, at most two
    packed gradient buffers in flight; its peak resident memory above imports (each in fresh processes, the
    larger rank) within PEAK_RATIO of torch FSDP2's on the same model and optimizer, plus PEAK_SLACK."""
    ours, fsdp2 = (run_distributed(_resident_peak, 2, kind) for kind in ("zero3", "fsdp2"))
    if None in ours + fsdp2:
        pytest.skip("the resident high-water mark cannot be read or reset here (/proc/self/clear_refs, Linux)")
    assert max(ours) <= PEAK_RATIO * max(fsdp2) + PEAK_SLACK, (ours, fsdp2)
