"""The training sections of `scripts/gpu_check.py`: `fits`, `sync_debug` and `mfu`.

Everything is built in Python (the project's `LanguageModel`, a strategy object, a Lightning `Trainer` on one
device) and fed random tokens from a tensor: no CLI, no data module, so neither `jsonargparse` nor `datasets` is
imported (the GPU machine has neither). World size 1 still goes through the strategy's process group (NCCL on a
GPU, gloo on the CPU), its gradient sync and its optimizer step.
"""

from __future__ import annotations

import gc
import os
import socket
import time
import traceback
import warnings
from typing import Any, Callable, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader

from lit_lm.callbacks.throughput import peak_flops_for, synchronized_clock
from lit_lm.kernels import KERNELS
from lit_lm.config import ModelConfig
from lit_lm.planner.estimate import flops_per_token
from lit_lm.module import LanguageModel
from lit_lm.strategies.compile import COMPILES
from lit_lm.strategies.ddp import DataParallelStrategy
from lit_lm.strategies.zero import ZeroStrategy

STRATEGIES: dict[str, Callable[[], Any]] = {
    "lm_ddp": DataParallelStrategy,
    "zero1": lambda: ZeroStrategy(stage=1),
    "zero2": lambda: ZeroStrategy(stage=2),
    "zero3": lambda: ZeroStrategy(stage=3),
}
# Loss agreement across strategies at world size 1 (the same maths, so only the order of float additions may
# differ), and between kernels on and off (other kernels: rounding differs from the first step and compounds).
STRATEGY_TOL = {"32-true": 1e-5, "bf16-mixed": 5e-3}  # relative to the loss
KERNEL_TOL = {"32-true": 1e-3, "bf16-mixed": 3e-2}


class LossRecorder(L.Callback):
    """Keeps each step's loss on the device (no host sync inside the loop); read after the fit."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(outputs["loss"].detach())

    def values(self) -> list[float]:
        return [float(x) for x in self.losses]


class StepTimer(L.Callback):
    """The steps after the first `warmup` timed as one window, batch start of step `warmup` to the end of training
    (optimizer steps included), the device synchronised only at those two ends: no measured step waits for the
    device, as a run's steady state does not. Also each batch start on the host clock (`step_seconds`, unsynchronised:
    on CUDA the host may run ahead of the device, so one step's figure is indicative; the window's total is exact)
    and what torch.compile did in each step (`lit_lm.strategies.compile.COMPILES`: graphs and seconds), so the compile
    time is reported apart and a compile inside the window shows."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.marks: list[float] = []
        self.compiles: list[tuple[int, float]] = []  # COMPILES (count, seconds) at each mark
        self.window: list[float] = []  # synchronised: [start, end]

    def _mark(self, pl_module: L.LightningModule, synchronise: bool) -> None:
        if synchronise:
            self.window.append(synchronized_clock(pl_module.device))
        self.marks.append(time.perf_counter())
        self.compiles.append((COMPILES.count, COMPILES.seconds))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._mark(pl_module, synchronise=batch_idx == self.warmup)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mark(pl_module, synchronise=True)

    def step_seconds(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]

    def measured(self, batch: int, seq_len: int) -> dict[str, Any]:
        """tokens/s over the window; the compiles (graphs, seconds) of each step; those inside the window."""
        start, end = self.window
        steps = len(self.marks) - 1 - self.warmup
        per_step = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(self.compiles, self.compiles[1:])]
        return dict(tokens_per_s=batch * seq_len * steps / (end - start), window_s=end - start, measured_steps=steps,
                    compile_s=sum(s for _, s in per_step), compile_graphs_per_step=[g for g, _ in per_step],
                    compiles_in_window=sum(g for g, _ in per_step[self.warmup:]))


class SyncDebug(L.Callback):
    """From step `start` on, `torch.cuda.set_sync_debug_mode("warn")`: every host synchronisation warns. The first
    step is left out (one-off checks, e.g. the token-id range, sync by design). Only when training on CUDA."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.applied = False

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step == self.start and pl_module.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
            self.applied = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.applied:
            torch.cuda.set_sync_debug_mode(0)


class SyncSites:
    """Within the block, every warning about a synchronising CUDA operation (what sync debug mode "warn" emits) is
    counted by call site, the Python `file:line` the warning names, with the message and a short stack; other
    warnings go on as before."""

    def __init__(self) -> None:
        self.sites: dict[str, dict[str, Any]] = {}
        self._catch = warnings.catch_warnings()

    @property
    def count(self) -> int:
        return sum(site["count"] for site in self.sites.values())

    def __enter__(self) -> "SyncSites":
        self._catch.__enter__()
        warnings.simplefilter("always")  # every occurrence, not the first per location
        shown = warnings.showwarning

        def record(message: Any, category: type, filename: str, lineno: int, file: Any = None,
                   line: Any = None) -> None:
            if "synchroniz" not in str(message):
                return shown(message, category, filename, lineno, file, line)
            stack = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
            site = self.sites.setdefault(f"{filename}:{lineno}", dict(count=0, message=str(message)[:300], stack=[
                f"{f.filename}:{f.lineno} {f.name}" for f in stack[-6:]]))
            site["count"] += 1

        warnings.showwarning = record
        return self

    def __exit__(self, *exc: Any) -> None:
        self._catch.__exit__(*exc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fit(config: ModelConfig, strategy: str, kernels: bool, precision: str, steps: int, batch: int, seq_len: int,
        device: torch.device, callbacks: tuple[L.Callback, ...] = (), lr: float = 1e-3, compile: Any = False,
        fp8: Optional[str] = None) -> dict[str, Any]:
    """`steps` optimizer steps of `LanguageModel` under a fresh `strategy` object on one device, seed 0, random
    tokens (the same for every call); returns the per-step losses."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))  # the process group, once made, serves every fit
    tokens = torch.randint(0, config.vocab_size, (steps * batch, seq_len + 1),
                           generator=torch.Generator().manual_seed(1234))
    L.seed_everything(0, verbose=False)
    module = LanguageModel(config, lr=lr, warmup_steps=2, kernels=list(KERNELS) if kernels else None,
                           compile=compile, fp8=fp8)
    recorder = LossRecorder()
    trainer = L.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
                        strategy=STRATEGIES[strategy](), precision=precision, max_steps=steps, gradient_clip_val=1.0,
                        callbacks=[recorder, *callbacks], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        num_sanity_val_steps=0, limit_val_batches=0)
    t0 = time.perf_counter()
    # pinned: the batch's copy to the GPU is then asynchronous (from pageable memory it waits for the stream: a
    # host sync in every step)
    trainer.fit(module, DataLoader(tokens, batch_size=batch, pin_memory=device.type == "cuda"))
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    del trainer, module
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next fit starts from an empty device
    return dict(strategy=strategy, kernels=list(KERNELS) if kernels else [], precision=precision, compile=compile,
                fp8=fp8, process_group_backend=backend, seconds=time.perf_counter() - t0, losses=recorder.values())


def fit_shapes(dry_run: bool) -> tuple[ModelConfig, dict[str, int]]:
    if dry_run:  # the wiring at the least cost: the Triton interpreter's time grows with every size (a kernels-on
        # fit of 2 layers, batch 2, vocabulary 256 and 3 steps took 8-10 s on 2 cores; this one 1.5 s)
        return (ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32),
                dict(steps=2, batch=1, seq_len=16))
    return (ModelConfig(vocab_size=8192, d_model=512, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=512),
            dict(steps=10, batch=8, seq_len=512))  # 9 fits in the section's 70 s: setup and compile, not steps


def _max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)) if len(a) == len(b) and a else float("inf")


def run_fits(report: Any, dry_run: bool, device: torch.device) -> str:
    """The `fits` section: lm_ddp, zero1-3, kernels off and on; every strategy's losses must equal lm_ddp's at
    each step, and kernels on must track kernels off; then lm_ddp with the kernels under torch.compile must track
    them eager."""
    config, shape = fit_shapes(dry_run)
    precision = "32-true" if dry_run else "bf16-mixed"
    tol, ktol = STRATEGY_TOL[precision], KERNEL_TOL[precision]
    report.update(model=vars(config), **shape, precision=precision, strategy_rtol=tol, kernels_rtol=ktol, runs=[])
    runs: list[dict[str, Any]] = []
    for kernels in (False, True):
        for name in STRATEGIES:
            try:
                runs.append(fit(config, name, kernels, precision, device=device, **shape))
            except Exception as err:
                runs.append(dict(strategy=name, kernels=list(KERNELS) if kernels else [], precision=precision,
                                 error=f"{type(err).__name__}: {err}"[:500], traceback=traceback.format_exc()[-3000:]))
            run = runs[-1]
            print(f"  {name:>7} kernels {'on ' if kernels else 'off'}: "
                  f"{run.get('losses') or run.get('error')}", flush=True)
            report.update(runs=runs)
    # the Triton kernels under torch.compile (`lit_lm.kernels.runtime.Op`: triton_op, launched from inductor's code
    # on a GPU)
    compiled = "aot_eager" if dry_run else True
    try:
        runs.append(fit(config, "lm_ddp", True, precision, device=device, compile=compiled, **shape))
    except Exception as err:
        runs.append(dict(strategy="lm_ddp", kernels=list(KERNELS), precision=precision, compile=compiled,
                         error=f"{type(err).__name__}: {err}"[:500], traceback=traceback.format_exc()[-3000:]))
    print(f"   lm_ddp kernels on, compiled: {runs[-1].get('losses') or runs[-1].get('error')}", flush=True)
    report.update(runs=runs)
    checks = []
    for kernels in (False, True):
        base = next(r for r in runs if r["strategy"] == "lm_ddp" and bool(r["kernels"]) == kernels)
        for run in runs:
            if bool(run["kernels"]) != kernels or run is base or run.get("compile"):
                continue
            diff = _max_rel_diff(run.get("losses", []), base.get("losses", []))
            checks.append(dict(compare=f"{run['strategy']} vs lm_ddp", kernels=kernels, max_rel_diff=diff,
                               rtol=tol, passed=diff <= tol))
    for name in STRATEGIES:
        off, on = (next(r for r in runs if r["strategy"] == name and bool(r["kernels"]) == k) for k in (False, True))
        diff = _max_rel_diff(on.get("losses", []), off.get("losses", []))
        checks.append(dict(compare=f"{name}: kernels on vs off", max_rel_diff=diff, rtol=ktol, passed=diff <= ktol))
    eager, compiled_run = (next(r for r in runs if r["strategy"] == "lm_ddp" and r["kernels"] and
                                bool(r.get("compile")) == c) for c in (False, True))
    diff = _max_rel_diff(compiled_run.get("losses", []), eager.get("losses", []))
    checks.append(dict(compare="lm_ddp kernels on: compiled vs eager", max_rel_diff=diff, rtol=ktol,
                       passed=diff <= ktol))
    finite = all(r.get("losses") and all(x == x and abs(x) < float("inf") for x in r["losses"]) for r in runs)
    report.update(runs=runs, checks=checks, all_finite=finite)
    return "ok" if finite and all(c["passed"] for c in checks) else "failed"


def run_sync_debug(report: Any, dry_run: bool, device: torch.device) -> str:
    """The `sync_debug` section: one lm_ddp fit, kernels on, with every host sync after the first step reported;
    the count and the distinct call sites (file:line of the Python caller, with a short stack) are recorded."""
    config, shape = fit_shapes(dry_run)
    shape["steps"] = 2 if dry_run else 4
    debug = SyncDebug(start=1)
    with SyncSites() as syncs:
        run = fit(config, "lm_ddp", True, "32-true" if dry_run else "bf16-mixed", device=device,
                  callbacks=(debug,), **shape)
    report.update(model=vars(config), **shape, fit=run, mode_applied=debug.applied, from_step=debug.start,
                  sync_count=syncs.count, distinct_sites=len(syncs.sites), sites=syncs.sites)
    if not debug.applied:
        report.update(note="skipped on CPU: torch.cuda.set_sync_debug_mode needs CUDA (the fit and the hook that "
                           "would set it still ran)")
        return "skipped"
    return "ok"


def mfu_shapes(dry_run: bool) -> tuple[ModelConfig, dict[str, int]]:
    if dry_run:  # as `fit_shapes`: the least that runs every step (the interpreter's attention costs T^2)
        return (ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, max_seq_len=16),
                dict(steps=2, warmup=1, batch=1, seq_len=16))
    # ~1.04B parameters, Llama-style (head_dim 128, SwiGLU d_ff 5504, untied 32k vocabulary); a step is ~0.1-0.2 s
    # at 40% MFU on an H200, so 6 timed steps after 2 of warm-up (Triton's or inductor's compiles in the first)
    return (ModelConfig(vocab_size=32000, d_model=2048, n_layers=18, n_heads=16, max_seq_len=2048),
            dict(steps=8, warmup=2, batch=4, seq_len=2048))


def run_mfu(report: Any, dry_run: bool, device: torch.device, peak_tflops: Optional[float],
            precision: str) -> str:
    """The `mfu` section: the ~1B model, all kernels on, lm_ddp on one device; tokens/s over the steps after the
    warmup and MFU = flops_per_token (6N + 12·L·d·T) x tokens/s / peak."""
    config, shape = mfu_shapes(dry_run)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if peak_tflops:
        peak, source = peak_tflops * 1e12, "--peak-tflops"
    elif peak_flops_for(name):
        peak, source = peak_flops_for(name), "lit_lm.callbacks.throughput.PEAK_FLOPS"
    elif dry_run:
        peak, source = 1e12, "dry-run nominal 1 TFLOP/s"
    else:
        raise RuntimeError(f"no peak FLOP/s known for {name!r}: pass --peak-tflops")
    timer = StepTimer(shape["warmup"])
    run = fit(config, "lm_ddp", True, precision, shape["steps"], shape["batch"], shape["seq_len"], device,
              callbacks=(timer,))
    window = timer.measured(shape["batch"], shape["seq_len"])
    tokens_per_s = window["tokens_per_s"]
    n = config.num_params(include_embedding=False)
    per_token = flops_per_token(n, config.n_layers, config.d_model, shape["seq_len"])
    memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    report.update(dry_run=dry_run, device_name=name, model=vars(config), params=config.num_params(),
                  params_without_embedding=n, **shape, precision=precision, kernels=run["kernels"],
                  strategy="lm_ddp", losses=run["losses"], step_seconds=timer.step_seconds(),
                  window_s=window["window_s"], measured_steps=window["measured_steps"],
                  tokens_per_s=tokens_per_s, flops_per_token=per_token,
                  flops_formula="6N + 12·L·d·T per token (PaLM appendix B; N without the input embedding, "
                                "causal attention not halved, recomputation not counted)",
                  peak_flops=peak, peak_source=source, mfu=per_token * tokens_per_s / peak,
                  mfu_6n_only=6 * n * tokens_per_s / peak, peak_memory_bytes=memory)
    return "ok"


# the `speed` section's variants: (name, compile option, fp8 recipe), most wanted first: each variant runs under
# every strategy before the next (zero3's compile then reuses lm_ddp's graphs from inductor's cache: ZeRO-3's hooks
# sit outside the blocks), so a section cut by its budget loses the last variant, with every row before it written.
# The dry-run compiles with aot_eager (the same dynamo graphs, no inductor code generation: minutes less on a CPU)
SPEED_VARIANTS = [("eager", False, None), ("compile", True, None), ("compile+fp8 tensorwise", True, "tensorwise"),
                  ("compile+fp8 rowwise", True, "rowwise")]
SPEED_STRATEGIES = ("lm_ddp", "zero3")


def peak_for(device: torch.device, dry_run: bool, peak_tflops: Optional[float]) -> tuple[float, str, str]:
    """(dense bf16 peak FLOP/s, where it came from, the device's name) for the MFU denominator."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if peak_tflops:
        return peak_tflops * 1e12, "--peak-tflops", name
    if peak_flops_for(name):
        return peak_flops_for(name), "lit_lm.callbacks.throughput.PEAK_FLOPS", name
    if dry_run:
        return 1e12, "dry-run nominal 1 TFLOP/s", name
    raise RuntimeError(f"no peak FLOP/s known for {name!r}: pass --peak-tflops")


def speed_shapes(dry_run: bool) -> tuple[ModelConfig, dict[str, int]]:
    config, shape = mfu_shapes(dry_run)
    return config, dict(shape, steps=2 if dry_run else 6)  # compile's first step is warm-up: 2 of the GPU's 6


def run_speed(report: Any, dry_run: bool, device: torch.device, peak_tflops: Optional[float],
              precision: str) -> str:
    """The `speed` section: the ~1B model under lm_ddp and zero3 on one device, eager, per-block compile, and
    compile + FP8 (tensorwise, rowwise): tokens/s over the steps after the warmup (`StepTimer`: no host sync
    inside them; the compile falls in the warmup and is reported apart, `compile_s`, with the graphs compiled per
    step and `compiles_in_window`, which must stay 0) and MFU against the device's dense bf16 peak, each with its
    ratio to eager of the same strategy. A variant that fails is recorded with its error; the others still run."""
    config, shape = speed_shapes(dry_run)
    peak, source, name = peak_for(device, dry_run, peak_tflops)
    n = config.num_params(include_embedding=False)
    per_token = flops_per_token(n, config.n_layers, config.d_model, shape["seq_len"])
    report.update(device_name=name, model=vars(config), params=config.num_params(), params_without_embedding=n,
                  **shape, precision=precision, flops_per_token=per_token, peak_flops=peak, peak_source=source,
                  runs=[])
    runs: list[dict[str, Any]] = []
    for variant, compile, recipe in SPEED_VARIANTS:
        for strategy in SPEED_STRATEGIES:
            compile = "aot_eager" if compile and dry_run else compile
            timer = StepTimer(shape["warmup"])
            row: dict[str, Any] = dict(strategy=strategy, variant=variant, compile=compile, fp8=recipe)
            try:
                run = fit(config, strategy, False, precision, shape["steps"], shape["batch"], shape["seq_len"],
                          device, callbacks=(timer,), compile=compile, fp8=recipe)
                measured = timer.measured(shape["batch"], shape["seq_len"])
                tokens_per_s = measured["tokens_per_s"]
                eager = next((r for r in runs if r["strategy"] == strategy and r["variant"] == "eager"
                              and "tokens_per_s" in r), None)
                row.update(losses=run["losses"], step_seconds=timer.step_seconds(), **measured,
                           mfu=per_token * tokens_per_s / peak,
                           vs_eager=(1.0 if variant == "eager"
                                     else tokens_per_s / eager["tokens_per_s"] if eager else None),
                           peak_memory_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)
            except Exception as err:
                row.update(error=f"{type(err).__name__}: {err}"[:500], traceback=traceback.format_exc()[-3000:])
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            runs.append(row)
            print(f"  {strategy:>6} {variant:<24} {row.get('tokens_per_s', row.get('error'))}", flush=True)
            report.update(runs=runs)
    return "ok" if all("tokens_per_s" in r and r["compiles_in_window"] == 0 for r in runs) else "failed"
