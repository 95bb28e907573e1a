"""No host sync in the training step between logging intervals: a CPU test that counts them.

On a GPU, reading a device value on the host (`.item()`, `.tolist()`, `bool(t)`, `.cpu()`, ...) or running an op
whose output shape depends on the data (`nonzero`, a boolean-mask index, `repeat_interleave` without
`output_size`; `bincount` and `one_hot`, which read the input's max back) waits for every kernel queued before it:
the CPU stops running ahead and the GPU idles while the next kernels are launched. So does `torch.tensor(data,
device=...)` (a blocking copy from pageable host memory: Lightning's `self.log` of a Python number). On the CPU none of
this costs anything, so nothing would notice a new one; this test does.

`SyncCounter` is a `TorchFunctionMode`: every torch call made in Python while it is active (the backward's Python
code too) passes through it, and each call of that kind is recorded with its call site, the innermost frame in the
project's packages (lit_lm/, lit_lm/strategies/, lit_lm/callbacks/, lit_lm/kernels/) or, if none, in Lightning or
torch. `CountSteps` switches it on at the start of each training batch that does not log (Lightning's
`should_update_logs`) and off at the start of the next batch, so the whole step is covered: forward, backward, the
strategy's gradient sync, clipping, the optimizer step and every `on_train_batch_end`. Runs (one pair of gloo
processes): lm_ddp and zero3 (dense) and ep (MoE, dropless and with a capacity), `LanguageModel` with NanGuard,
Throughput, the progress line, a CSV logger and gradient clipping.

The sites found must be exactly `ALLOWED` (each with its reason and calls per step), so a new sync fails with its
file:line, and an allowed one that disappears asks for the list to shrink. `test_the_counter_sees_a_sync` shows
the check failing on a real sync. What it cannot see: a sync inside a C++ kernel with no Python call of its own
(the ops above are listed because their CUDA kernels sync); `.to(device)` with the run's device (here the CPU, so
only a spelled-out `.to("cpu")` counts); and anything outside the counted steps (the logging steps, step 0).
"""

from __future__ import annotations

import os
import re
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader

from dist_utils import TINY, rank_share, run_distributed, token_data
from lit_lm.parity import MOE
from lit_lm.callbacks.nan_guard import NanGuard
from lit_lm.callbacks.progress import StepProgress
from lit_lm.callbacks.throughput import Throughput
from lit_lm.config import ModelConfig
from lit_lm.model import Transformer
from lit_lm.module import LanguageModel
from lit_lm.moe import moe_layers

ROOT = Path(__file__).resolve().parents[1]
PROJECT = (str(ROOT / "lit_lm") + os.sep,)

# Tensor methods that copy a value to the host, whatever the call.
READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "numpy", "cpu"}
# Ops whose output shape depends on the data (their CUDA kernels read a count back before allocating), and
# bincount and one_hot, whose CUDA kernels read the input's max/min back.
DATA_SHAPED = {"nonzero", "argwhere", "masked_select", "unique", "_unique2", "unique_consecutive", "bincount",
               "one_hot"}


def _is_sync(func: Callable, args: tuple, kwargs: dict) -> Optional[str]:
    """The name of the host sync `func(*args, **kwargs)` is, or None."""
    name = getattr(func, "__name__", "")
    if name in READS:
        return name
    if name == "where" and len(args) + len(kwargs) == 1:  # torch.where(cond): nonzero
        return "where(cond)"
    if name in DATA_SHAPED:
        return name
    if name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 4 \
            and any(isinstance(a, torch.Tensor) and a.numel() > 1 for a in (*args[1:2], kwargs.get("repeats"))):
        return "repeat_interleave without output_size"
    if name in ("__getitem__", "__setitem__") and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
            return f"boolean mask {name}"
    if name in ("tensor", "as_tensor") and kwargs.get("device") not in (None, "cpu") \
            and not isinstance(args[0] if args else kwargs.get("data"), torch.Tensor):
        return "Python data copied to the device"  # a blocking host-to-device copy from pageable memory
    if name == "to" and "cpu" in (*args[1:2], kwargs.get("device")):  # spelled out; see the module docstring
        return "to('cpu')"
    return None


def _site() -> tuple[str, str]:
    """(key, place): the innermost frame in the project's packages (else in Lightning, else in torch), followed by
    `<-` and the innermost frame that made the call when that is another (Lightning's, torch's). The key names
    files and functions (the allowlist's form, stable under edits elsewhere in a file), the place adds lines."""
    frames = [f for f in traceback.extract_stack()[:-2] if "/tests/" not in f.filename]  # not _site, the mode
    for prefixes in (PROJECT, ("/lightning/",), ("/torch/",)):
        found = next((f for f in reversed(frames) if any(p in f.filename for p in prefixes)), None)
        if found is not None:
            break
    chain = [found or frames[-1]] + ([frames[-1]] if found is not None and found is not frames[-1] else [])
    key = " <- ".join(f"{_file(f)} ({f.name})" for f in chain)
    return key, " <- ".join(f"{_file(f)}:{f.lineno}" for f in chain)


def _file(frame: traceback.FrameSummary) -> str:
    name = re.sub(r".*/site-packages/", "", frame.filename)
    return name[len(str(ROOT)) + 1:] if name.startswith(str(ROOT)) else name


class SyncCounter(TorchFunctionMode):
    """Counts host syncs by call site while active (`with SyncCounter() as c:` or enter/exit by hand)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()  # "key: what" -> calls
        self.places: dict[str, str] = {}  # "key: what" -> where, with line numbers

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        what = _is_sync(func, args, kwargs)
        if what is not None:
            key, place = _site()
            self.sites[f"{key}: {what}"] += 1
            self.places[f"{key}: {what}"] = f"{place}: {what}"
        return func(*args, **kwargs)


class CountSteps(L.Callback):
    """The counter is on from the start of a batch that does not log to the start of the next batch."""

    def __init__(self) -> None:
        self.counter = SyncCounter()
        self.on = False
        self.counted = 0

    def _stop(self) -> None:
        if self.on:
            self.counter.__exit__(None, None, None)
            self.on = False

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._stop()
        if trainer.global_step > 0 and not trainer._logger_connector.should_update_logs:  # step 0: warm-up
            self.counter.__enter__()
            self.on = True
            self.counted += 1

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._stop()


@dataclass(frozen=True)
class Allowed:
    """A host sync that stays in the step, and why."""

    site: str  # "file (function) [<- file (function)]: what", as SyncCounter keys it
    reason: str
    per_step: Optional[int]  # calls per counted step and rank; None: as many as the strategy's flat shards
    moe: Optional[bool] = None  # only in MoE runs (True), only in dense ones (False), or both (None)


ALLOWED = (  # Lightning's per-step SIGTERM broadcast (a device copy and an item) runs after logging steps: base.py
    Allowed("lit_lm/strategies/flat_step.py (flat_step) <- torch/optim/optimizer.py (_get_value): item",
            "not a device sync: torch's optimizers keep `step` a CPU tensor (unless capturable or fused) and read "
            "it for the bias correction, once per flat shard", None),
    Allowed("lit_lm/strategies/preemption.py (agreed): item",
            "not a device sync: the preemption flag is a CPU tensor all-reduced on its own gloo group, posted a step "
            "earlier (async) and read once per step (docs/reliability.md)", 1),
    Allowed("lit_lm/callbacks/nan_guard.py (on_before_optimizer_step): tolist",
            "NanGuard decides on the host whether to skip the step: opt-in, one read of both flags per step", 1),
    Allowed("lit_lm/strategies/experts.py (dispatch): tolist",
            "dropless expert parallelism: all_to_all takes its split sizes as Python lists (torchtitan and "
            "Megatron read them too); one read per MoE layer (one MoE layer here)", 1, moe=True),
)

STEPS, LOG_EVERY, GLOBAL_BATCH = 8, 4, 4  # steps 1, 2, 4, 5, 6 are counted: not step 0, not the logging 3 and 7


CASES = {"lm_ddp": ("lm_ddp", TINY), "zero3": ("zero3", TINY), "ep": ("ep", MOE),
         "ep_capacity": ("ep", dict(MOE, moe_capacity_factor=1.0))}


def _fit(strategy_name: str, config: dict, log_dir: str) -> dict:
    """LanguageModel on 2 ranks under `strategy_name`, with NanGuard, Throughput, the progress line, a logger and
    clipping; returns the sites counted (with their places), how many steps were counted and the keys logged."""
    rank = int(os.environ["LOCAL_RANK"])
    tokens = token_data(STEPS * GLOBAL_BATCH)
    loader = DataLoader(rank_share(tokens, GLOBAL_BATCH, rank, 2), batch_size=GLOBAL_BATCH // 2, shuffle=False)
    L.seed_everything(0, verbose=False)
    count = CountSteps()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy_name, max_steps=STEPS,
                        logger=CSVLogger(log_dir), log_every_n_steps=LOG_EVERY, gradient_clip_val=1.0,
                        callbacks=[count, NanGuard(), Throughput(), StepProgress(LOG_EVERY)],
                        enable_model_summary=False, use_distributed_sampler=False, enable_checkpointing=False)
    real, sigterm_steps = _TrainingEpochLoop._broadcast_sigterm_tensor, []

    def recorded(loop: _TrainingEpochLoop) -> None:  # Lightning's own broadcast, run as it is, its steps noted
        sigterm_steps.append(loop.trainer.global_step)
        real(loop)

    _TrainingEpochLoop._broadcast_sigterm_tensor = recorded
    try:
        trainer.fit(LanguageModel(config=ModelConfig(**config), warmup_steps=2), loader)
    finally:
        _TrainingEpochLoop._broadcast_sigterm_tensor = real
    return {"sites": dict(count.counter.sites), "places": count.counter.places, "counted": count.counted,
            "logged": set(trainer.logged_metrics), "sigterm_steps": sigterm_steps}


def _fit_all(log_dir: str) -> dict[str, dict]:
    """Every case in one pair of processes (a spawn costs more than a tiny fit)."""
    import lit_lm.strategies.registry  # noqa: F401  (registers lm_ddp, zero3, ep in this process)

    return {name: _fit(strategy, config, f"{log_dir}/{name}") for name, (strategy, config) in CASES.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict]]:
    return run_distributed(_fit_all, 2, str(tmp_path_factory.mktemp("logs")), init_process_group=False)


def check_sites(sites: dict[str, int], places: dict[str, str], steps: int, moe: bool) -> None:
    """The sites found are exactly the allowed ones for this run, each as often as allowed; the message names every
    new sync with its file:line."""
    allowed = {a.site: a for a in ALLOWED if a.moe in (None, moe)}
    new = [f"{places[s]} ({n} calls in {steps} steps)" for s, n in sorted(sites.items()) if s not in allowed]
    assert not new, "host syncs in steps that do not log:\n  " + "\n  ".join(new)
    gone = sorted(set(allowed) - set(sites))
    assert not gone, f"allowed syncs that no longer happen (shrink ALLOWED): {gone}"
    for site, a in allowed.items():
        if a.per_step is not None:
            assert sites[site] == a.per_step * steps, f"{places[site]}: {sites[site]} calls in {steps} steps"


@pytest.mark.parametrize("case", list(CASES))
def test_no_host_sync_between_logging_steps(case: str, runs: list[dict[str, dict]]) -> None:
    moe = "moe_experts" in CASES[case][1]
    for rank in runs:
        r = rank[case]
        assert r["counted"] == 5
        check_sites(r["sites"], r["places"], r["counted"], moe=moe)
        assert {"train_loss", "tokens_per_s", "lr"} <= r["logged"]  # still logged, at the logging steps
        assert r["sigterm_steps"] == [0, 4]  # rank 0's SIGTERM flag still broadcast: after each logging step
        assert not moe or {"moe/1/load_e0", "moe/1/dropped"} <= r["logged"]


def test_the_counter_sees_a_sync() -> None:
    """The vocabulary check of a loop's first batch (`int(batch.max())`) is a real host sync; the other batches have
    none; and a site that is not allowed fails the check with its file:line."""
    module = LanguageModel(ModelConfig(**TINY))
    module.configure_model()
    batch = token_data(2)
    module.training_step(batch, 1)  # warm-up: the RoPE tables are built (on the host) at the first forward
    with SyncCounter() as first:
        module.training_step(batch, 0)
    with SyncCounter() as later:
        module.training_step(batch, 1)
    assert set(first.sites) == {"lit_lm/module.py (_split): __int__"}
    assert re.fullmatch(r"lit_lm/module\.py:\d+: __int__", first.places["lit_lm/module.py (_split): __int__"])
    assert not later.sites
    with pytest.raises(AssertionError, match=r"lit_lm/module\.py:\d+: __int__ \(1 calls in 1 steps\)"):
        check_sites({**dict.fromkeys((a.site for a in ALLOWED if not a.moe), 1), **first.sites},
                    {**{a.site: a.site for a in ALLOWED}, **first.places}, 1, moe=False)


@pytest.mark.parametrize("capacity", [None, 1.0])
def test_an_moe_layer_runs_without_a_host_sync(capacity: Optional[float]) -> None:
    """Router, dispatch, grouped experts, combine and backward, dropless and with drops, on one process; the old
    `x.split(counts.tolist())` would show here as `lit_lm/moe.py (forward): tolist`."""
    model = Transformer(ModelConfig(**dict(MOE, moe_capacity_factor=capacity)))
    tokens = token_data(4)
    model.loss(tokens[:, :-1], tokens[:, 1:])  # warm-up: the RoPE tables are built at the first forward
    with SyncCounter() as counter:
        model.loss(tokens[:, :-1], tokens[:, 1:])[0].backward()
    assert not counter.sites, counter.places
    assert all(p.grad is not None for n, p in model.named_parameters() if "experts." in n)
    if capacity is not None:
        assert float(moe_layers(model)["blocks.1.mlp"].stats["dropped"]) > 0  # the drop path ran


def _z_loss_sites() -> dict[str, int]:
    """Each loss of the model with a z-loss and ignored targets (chat data's -100), forward and backward, on a
    1-rank tp group for the vocab-parallel one."""
    import torch.distributed as dist

    from lit_lm.kernels.cross_entropy import cross_entropy_reference
    from lit_lm.model import LMLoss
    from lit_lm.strategies.tp_layers import TPGroup, VocabParallelLoss

    targets = torch.tensor([3, -100, 5, -100, 7, 1, -100, 2, 0])
    losses = [LMLoss(1e-2), lambda x, t: cross_entropy_reference(x, t, 1e-2),
              VocabParallelLoss(1e-2, 0, TPGroup(dist.group.WORLD, 2, 0))]  # size 2: the collectives run
    with SyncCounter() as counter:
        for loss in losses:
            logits = torch.randn(9, 16, requires_grad=True)
            loss(logits, targets)[0].backward()
    return dict(counter.sites)


def test_the_z_loss_over_kept_targets_has_no_host_sync() -> None:
    """The z-loss's mean over the kept targets is a mask and a count, not `lse[valid]` (a boolean index: a nonzero,
    a host sync every step on an accelerator) in LMLoss, the kernels' reference loss and the vocab-parallel one."""
    assert run_distributed(_z_loss_sites, 2) == [{}, {}]
