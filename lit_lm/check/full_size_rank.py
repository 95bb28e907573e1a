"""One rank of `lit-lm check --full-size`, in its own process: the user's model at full size on the meta device,
under the user's strategy, on a fake process group of the real world size, for a few optimizer steps.

    measure_rank(RankJob(...)) -> {"state": {...}, "peak": ..., "at_peak": {...}, "maxima": {...}, "comm": {...}}

The process joins torch's fake backend (`FakeStore`, backend "fake" for CPU and meta tensors: every collective is a
no-op that returns at once) as `job.rank` of `job.world`, so `ParallelLayout` builds the real groups and this rank's
coordinates. The strategy is the user's (`ComposedStrategy` and its engines, unchanged), its root device the meta
device: the model is built there (`configure_model`), split, materialised and wrapped by the engines exactly as in
`fit`, with tensors that have shapes and no data. The step is Lightning's automatic optimisation, in its order
(`optimizer.step(closure)`: the closure runs the training step's loss through the strategy's seam, `zero_grad`, the
backward, the strategy's `finish_grad_sync`; then `after_optimizer_step`), without the Lightning loop around it
(logging and progress read values a meta tensor does not have). Expert routing, whose split sizes are the one host
read of a step, is answered as balanced (what the planner assumes).

Measured by `LiveBytes` (lit_lm/check/fake_memory.py) over the last step (the first creates the optimizer state):
the peak of live bytes and what it is made of, each kind's own maximum, and the model state at the optimizer step;
by the accounting layer (`lit_lm.strategies.comm.COMM_LOG`) the bytes per (group, op) of the last step.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from functools import partial
from dataclasses import dataclass
from typing import Any, Generator, Optional
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lit_lm.check.build import _import, build_strategy
from lit_lm.check.fake_memory import LiveBytes
from lit_lm.check.meter import CONTROL
from lit_lm.config import ModelConfig
from lit_lm.kernels import runtime
from lit_lm.strategies import comm
from lit_lm.strategies.comm import COMM_LOG
from lit_lm.strategies.dp_engine import bind_optimizer
from lit_lm.strategies.orthogonalize import bind_orthogonalizer
from lit_lm.strategies.layout import ParallelLayout
from lit_lm.strategies.params import ModelSplit

BACKEND = "cpu:fake,meta:fake"  # meta tensors' collectives and point-to-point batches on the fake backend


@dataclass(frozen=True)
class RankJob:
    """What one fake rank runs (picklable: it travels to the rank's process)."""

    rank: int
    world: int
    strategy: Any  # `build_strategy`'s spec
    module: tuple[str, tuple]  # the LightningModule's class path and its keyword arguments but the config
    config: dict  # the ModelConfig's fields (full size)
    batch_size: int  # sequences per forward on this rank (the data's per-device batch)
    accumulate: int
    precision: str
    steps: int = 2


class _StepTrainer:
    """What a LightningModule's step reads from its trainer here: the strategy and the accumulation."""

    def __init__(self, strategy: Any, accumulate: int) -> None:
        self.strategy, self.accumulate_grad_batches = strategy, accumulate
        self.global_step, self.training, self.estimated_stepping_batches = 0, True, 1


class _NoHooks:
    """The precision plugin's backward hooks of a pipeline's backward, without a trainer to call."""

    def pre_backward(self, loss: Tensor, module: Any) -> Tensor:
        return loss

    def post_backward(self, loss: Tensor, module: Any) -> Tensor:
        return loss


def measure_rank(job: RankJob) -> dict[str, Any]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group(BACKEND, store=FakeStore(), rank=job.rank, world_size=job.world)
    try:
        return measure(job, "meta")
    finally:
        dist.destroy_process_group()


def measure(job: RankJob, device: str, steps: Optional["StepWatch"] = None) -> dict[str, Any]:
    """`job` on this process's rank of the process group: meta tensors (the fake ranks), or CPU tensors with their
    values (a real rank of a gloo world: `full_size_real.py`); `steps` watches the steps (e.g. torch's own count of
    the allocator's bytes)."""
    started = time.perf_counter()
    strategy = build_strategy(job.strategy)
    strategy.parallel_devices = [torch.device(device)]
    strategy._layout = ParallelLayout.get(strategy.parallel_dims(job.world))
    live = LiveBytes(host_read=_host_reads(job, strategy) if device == "meta" else None, device=device)
    with live, _on_meta():
        module, optimizer = _build(job, strategy)
        result = _train(job, strategy, module, optimizer, live, steps or StepWatch())
    result["seconds"] = time.perf_counter() - started
    result["ops"] = live.ops
    return result


class StepWatch:
    """What runs around the steps (`all_steps`) and around the measured one (`measured`): nothing here."""

    def all_steps(self) -> Any:
        return ExitStack()

    def measured(self) -> Any:
        return ExitStack()


def _build(job: RankJob, strategy: Any) -> tuple[Any, torch.optim.Optimizer]:
    """The module as `fit` sets it up under the strategy: configure_model (on the meta device for fake ranks), the
    precision's dtype, the strategy's split and engines, the module's optimizer bound to the engines."""
    path, kwargs = job.module
    module = _import(path)(**dict(kwargs), config=ModelConfig(**job.config))
    module._trainer = _StepTrainer(strategy, job.accumulate)
    strategy._lightning_module = module
    strategy.model = module
    meta = strategy.root_device.type == "meta"
    with torch.device("meta") if meta else strategy.model_sharded_context():
        module.configure_model()
    if job.precision == "bf16-true":
        module.to(torch.bfloat16)
    # every tensor lives on the meta device here: the strategy must take it as materialised (where it would give a
    # meta parameter storage and values, it finds nothing to do), and there are no values to initialise
    with mock.patch.object(torch.Tensor, "is_meta", property(lambda t: False)) if meta else ExitStack(), \
            mock.patch.object(ModelSplit, "init", lambda *a, **k: True) if meta else ExitStack():
        strategy.parallelize(fitting=True)
    configured = module.configure_optimizers()
    optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
    strategy.optimizers = [optimizer]
    bind_optimizer(optimizer, strategy._engines)
    if getattr(optimizer, "matrix_wise", False):  # Muon: the orthogonalizer, as `ComposedStrategy.setup_optimizers`
        bind_orthogonalizer(optimizer, strategy.owned_weights(), strategy._replica_group,
                            strategy.layout.group("tp") if strategy.config.tp > 1 else None)
    return module, optimizer


def _train(job: RankJob, strategy: Any, module: Any, optimizer: torch.optim.Optimizer, live: LiveBytes,
           watch: StepWatch) -> dict[str, Any]:
    """`job.steps` optimizer steps of `job.accumulate` micro-batches each; the last one measured."""
    shape, device = (job.batch_size, module.config.max_seq_len + 1), strategy.root_device
    tokens = torch.empty(shape, dtype=torch.long, device=device) if device.type == "meta" else \
        torch.randint(0, module.config.vocab_size, shape, generator=torch.Generator().manual_seed(dist.get_rank()))
    state: dict[str, int] = {}
    resident = 0
    with watch.all_steps():
        for step in range(job.steps):
            last = step == job.steps - 1
            if last:
                COMM_LOG.reset()
                live.start("forward")
                resident = sum(live.sizes().values())
            with watch.measured() if last else ExitStack():
                for micro in range(job.accumulate):
                    window = _Window(job, strategy, module, optimizer, live, micro, state if last else None)
                    if micro < job.accumulate - 1:
                        window(tokens)
                        continue
                    module.optimizer_step(0, step, optimizer, partial(window, tokens))
                    strategy.after_optimizer_step(optimizer)
    comm: dict[str, int] = {}
    for r in COMM_LOG.records:
        if r.label not in CONTROL and r.nbytes:
            key = f"{r.group}/{r.op}"
            comm[key] = comm.get(key, 0) + r.nbytes
    return {"state": state, "peak": live.peak, "at_peak": live.at_peak_by_name(), "maxima": dict(live.maxima),
            "comm": comm, "resident": resident}


@dataclass
class _Window:
    """One micro-batch as Lightning's closure runs it: the training step's loss through the strategy's seam,
    `zero_grad` (the window's first micro-batch), the backward (the data-parallel engines' sync blocked but on the
    window's last), the strategy's `finish_grad_sync`; `state` (the measured step) gets the model state then."""

    job: RankJob
    strategy: Any
    module: Any
    optimizer: torch.optim.Optimizer
    live: LiveBytes
    micro: int
    state: Optional[dict[str, int]]

    def __call__(self, tokens: Tensor) -> Tensor:
        strategy, module, live = self.strategy, self.module, self.live
        final = self.micro == self.job.accumulate - 1
        live.phase = "forward"
        with ExitStack() if final else strategy.block_backward_sync():
            pipeline = strategy._pipeline
            with pipeline.stash(module) if pipeline else ExitStack(), strategy._step(train=True):
                loss, _ = module.step_loss(tokens[:, :-1], tokens[:, 1:])
            if self.micro == 0:
                self.optimizer.zero_grad()  # Lightning's, after the window's first forward
            if pipeline is not None:
                pipeline.backward(loss, _NoHooks(), module)
            else:
                (loss / self.job.accumulate).backward()
        live.phase = "grad sync"
        if final:
            strategy.finish_grad_sync()
            if self.state is not None:
                self.state.update(_model_state(module, self.optimizer, live))
            live.phase = "optimizer"
        return loss


def _model_state(module: Any, optimizer: torch.optim.Optimizer, live: LiveBytes) -> dict[str, int]:
    """Bytes of parameters (and ZeRO master shards), gradients and optimizer state after the gradients are final,
    before the update (where `lit-lm check`'s Meter reads them), each storage once; the same storages are
    labelled in `live`, so the peak's breakdown names them."""
    held = [*module.parameters(), *(p for g in optimizer.param_groups for p in g["params"])]
    groups = {"parameters": held, "gradients": [p.grad for p in held if p.grad is not None],
              "optimizer state": [t for s in optimizer.state.values() for t in s.values() if isinstance(t, Tensor)]}
    seen: set[int] = set()
    out: dict[str, int] = {}
    for name, tensors in groups.items():
        live.label(tensors, name)
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            if id(storage) not in seen:  # a master shard that is a view of its parameter counts once
                seen.add(id(storage))
                total += storage.nbytes()
        out[name] = total
    return out


_SDPA = F.scaled_dot_product_attention
_AUTOCAST, _ENABLED = torch.autocast, torch.is_autocast_enabled


@contextmanager
def _on_meta() -> Generator[None, None, None]:
    """What the meta device runs otherwise than CUDA and CPU: attention by the flash kernel they pick (not the math
    fallback), `torch.autocast` on it a no-op (it has no autocast: a region that turns autocast off, such as
    the MoE router's fp32, runs as it is), NCCL's in-place chunk rule (`comm._in_place_at_own_chunk`) read
    from addresses only where there are some (every meta tensor's is 0: two separate tensors look in place), and
    no Triton interpreter (under TRITON_INTERPRET=1 a kernel launch copies its tensors to the host: cp's attention
    tiles take the PyTorch reference, the path a CPU run without the interpreter takes)."""
    def autocast(device_type: str, *args: Any, **kwargs: Any) -> Any:
        return ExitStack() if device_type == "meta" else _AUTOCAST(device_type, *args, **kwargs)

    def enabled(device_type: Optional[str] = None) -> bool:
        return device_type != "meta" and (_ENABLED() if device_type is None else _ENABLED(device_type))

    with mock.patch.object(F, "scaled_dot_product_attention", _flash_attention), \
            mock.patch.object(torch, "autocast", autocast), mock.patch.object(torch, "is_autocast_enabled", enabled), \
            mock.patch.object(torch, "_grouped_mm", _grouped_mm), \
            mock.patch.object(comm, "_in_place_at_own_chunk", _in_place_rule), \
            mock.patch.object(runtime, "interpreting", lambda: False):
        yield


_IN_PLACE_RULE = comm._in_place_at_own_chunk


def _in_place_rule(whole: Tensor, part: Tensor, *args: Any) -> None:
    if whole.device.type != "meta" or part.untyped_storage() is whole.untyped_storage():
        _IN_PLACE_RULE(whole, part, *args)


_GROUPED_MM = torch._grouped_mm


class _GroupedMM(torch.autograd.Function):
    """`torch._grouped_mm` of any dtype on meta tensors (torch's meta kernel takes bf16 only, the CUDA kernel's):
    the output's shape; saves both inputs and gives their gradients' shapes, as its derivative does."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
        ctx.save_for_backward(a, b)
        return a.new_empty((a.shape[0], b.shape[-1]))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        a, b = ctx.saved_tensors
        return torch.empty_like(a), torch.empty_like(b), None


def _grouped_mm(a: Tensor, b: Tensor, offs: Optional[Tensor] = None, **kwargs: Any) -> Tensor:
    if a.device.type != "meta" or a.dtype == torch.bfloat16 or offs is None or kwargs:
        return _GROUPED_MM(a, b, offs=offs, **kwargs)
    return _GroupedMM.apply(a, b, offs)


class _EfficientAttention(torch.autograd.Function):
    """SDPA on meta tensors whose values are narrower than the keys (MLA: v_head_dim < qk head dim), as CUDA's
    memory-efficient kernel runs it (flash wants one head size; the CPU's math fallback would hold every (t, t)
    score matrix): the output (B, H, T, Dv), laid out (B, T, H, Dv) as the kernel writes it (the output projection's
    input is a view of it); saves q, k, v, the output and the fp32 log-sum-exp per head and row."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        b, h, t, _ = q.shape
        out = q.new_empty((b, t, h, v.shape[-1])).transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                     is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False) -> Tensor:
    """SDPA as CUDA and CPU run it (a flash kernel: saves q, k, v, the output and the fp32 log-sum-exp; grouped kv
    heads unrepeated). On meta tensors torch picks the math fallback, which would hold every (t, t) score matrix."""
    if q.device.type != "meta" or dropout_p:
        return _SDPA(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=enable_gqa)
    if v.shape[-1] != q.shape[-1]:  # MLA's narrower values: the flash kernel wants one head size
        return _EfficientAttention.apply(q, k, v)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    return flash(q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]


def _host_reads(job: RankJob, strategy: Any) -> Any:
    """The answers to a step's host reads of tensor values, which decide shapes: expert parallelism's
    (`TokenExchange.dispatch`: the rows sent to and received from each ep peer, stacked (2, ep)): every peer gets an
    equal share of this rank's routed rows (top_k per token); context parallelism's token positions (a rank's
    zigzag chunks, read for its RoPE tables: their values change no byte), as 0, 1, ..."""
    cfg = ModelConfig(**job.config)
    ep = strategy.config.ep
    pp = strategy.config
    micro = job.batch_size // (pp.microbatches if pp.pp > 1 else 1)
    rows = micro * cfg.max_seq_len // pp.cp * cfg.moe_top_k

    def read(t: Tensor) -> Optional[Tensor]:
        if t.is_floating_point():
            return None
        if ep > 1 and tuple(t.shape) == (2, ep):
            share = [rows // ep + (i < rows % ep) for i in range(ep)]
            return torch.tensor([share, share], dtype=t.dtype)
        if pp.cp > 1 and t.dim() == 1:
            return torch.arange(t.shape[0], dtype=t.dtype)
        return None

    return read
