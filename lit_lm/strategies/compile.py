"""`torch.compile` per transformer block, applied after every engine (the last step of `ComposedStrategy`'s order).

    compile_blocks(model, fullgraph=True)     # each block's forward becomes a compiled one, in place
    COMPILES.graphs, COMPILES.seconds         # what dynamo compiled in this process so far (`CompileWatch`)

As torchtitan does under FSDP2, the unit is the block, and what is compiled is the block's *forward*, not its
`__call__`: hooks registered on the block itself (ZeRO-3's gather before the forward and free after it, the pipeline's
stash) stay outside the compiled region and run eagerly, once per call. The module tree, parameter names and
state-dict keys do not change (the compiled function replaces the instance's `forward`, as activation checkpointing's
`Checkpointed` does, which it wraps when both are on: checkpoint inside, compile outside, as torchtitan orders them).

`fullgraph`: True where no engine issues a collective inside a block (data parallel, ZeRO 1-3, pipeline stages): the
block must then be one graph, and anything dynamo cannot trace fails loudly instead of running eagerly. Tensor,
context and expert parallelism put their collectives inside the block (a region's border, the ring's p2p, the
all-to-all), and those go through `lit_lm.strategies.comm`'s accounting layer, which dynamo is kept out of
(`_collectives_run_eagerly`): the block is then compiled in the pieces between the collectives (`fullgraph=False`),
each piece a graph, the collectives eager.
Context parallelism's attention core (the ring: p2p in a loop, one attention tile per peer, each with its own
offsets) runs eagerly as a whole between the block's graphs: traced, every tile's offset would be a new guard.
An MoE layer (the module holding the model's `expert_plan()` experts) runs eagerly as a whole: `torch._grouped_mm` has
no fake-tensor kernel on the CPU in torch 2.13, and under expert parallelism the dispatch reads the tokens per peer on
the host (the all-to-all's split sizes), data-dependent every step: traced, each new split was a guard and a
recompile (ep2: 10, 5, 4, 2 graphs in steps 2-5). Only fixed shapes cross the border (the layer's input and output),
and a dense and an MoE block compile as different code (`block_kind`): nothing compiles after the first step.

The Triton kernels of `kernels.apply` are `torch.library` operators (`lit_lm.kernels.runtime.Op`): one opaque call
each in the block's graph (a `triton_op` inductor launches on a GPU, a `custom_op` under the interpreter), so
`fullgraph` holds with them and nothing is guarded on their launch arguments.

A call that passes something other than tensors (generation's KV cache, whose length changes every token) runs the
block's eager forward: the compiled graphs serve training and validation at their fixed shapes only, so generation
never triggers a compile. Gradient mode is a guard: the first validation compiles its own graph, once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import chain
from types import CodeType, FunctionType
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from lit_lm.strategies import comm
from lit_lm.strategies.cp import ContextParallelAttention
from lit_lm.strategies.errors import ConfigError
from lit_lm.strategies.fp8 import apply_fp8
from torch._functorch import config as functorch_config
from torch._dynamo.callback import CallbackArgs, CallbackTrigger, on_compile_end, on_compile_start

BACKEND = "inductor"


@dataclass
class CompileWatch:
    """Every compile dynamo runs in this process: graphs traced (a recompile is one more), lazy backward compiles,
    and the wall time spent in them (from dynamo's own start/end callbacks)."""

    graphs: int = 0
    backwards: int = 0
    seconds: float = 0.0
    _started: list[float] = field(default_factory=list)

    def start(self, args: CallbackArgs) -> None:
        self._started.append(time.perf_counter())
        if args.callback_trigger == CallbackTrigger.DYNAMO:
            self.graphs += 1
        elif args.callback_trigger == CallbackTrigger.LAZY_BACKWARD:
            self.backwards += 1

    def end(self, args: CallbackArgs) -> None:
        if self._started:
            self.seconds += time.perf_counter() - self._started.pop()

    @property
    def count(self) -> int:
        """Compiles of any kind so far: a step that adds to it compiled (or recompiled) something."""
        return self.graphs + self.backwards


COMPILES = CompileWatch()
on_compile_start(COMPILES.start)
on_compile_end(COMPILES.end)


# one code object per kind of block (`block_kind`): dynamo keeps compiled graphs per code object
_BLOCK_CODES: dict[tuple[str, ...], CodeType] = {}


def block_kind(block: nn.Module) -> tuple[str, ...]:
    """The types of a block's modules: blocks of one kind share their compiled code (a model of N identical blocks
    compiles once), blocks of different kinds (a dense and an MoE block) each have their own. Shared, a graph break
    at the top of one kind's code (an MoE layer or the cp ring run eagerly inside it) leaves an entry whose guards
    do not see the block's modules: the other kind matched it in step 2, ran its forward as a frame of its own and
    compiled it again (ep2: one graph and its backward more in step 2)."""
    return tuple(type(m).__qualname__ for m in block.modules())


class CompiledForward:
    """A block's forward compiled with `torch.compile`; `forward` is the block's own one (bound, or activation
    checkpointing's `Checkpointed`), run eagerly for calls with non-tensor arguments (a KV cache). `kind`: the
    block's `block_kind` (blocks of one kind share compiled code)."""

    def __init__(self, forward: Callable[..., Any], fullgraph: bool, backend: str = BACKEND,
                 kind: tuple[str, ...] = ()) -> None:
        self.forward, self.fullgraph, self.backend = forward, fullgraph, backend

        def block_forward(*args: Any, **kwargs: Any) -> Any:
            return forward(*args, **kwargs)

        code = _BLOCK_CODES.setdefault(kind, block_forward.__code__.replace(
            co_name=f"block_forward_{len(_BLOCK_CODES)}", co_qualname=f"block_forward_{len(_BLOCK_CODES)}"))
        block_forward = FunctionType(code, block_forward.__globals__, code.co_name, None, block_forward.__closure__)
        self.compiled = torch.compile(block_forward, fullgraph=fullgraph, backend=backend)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if all(a is None or isinstance(a, Tensor) for a in chain(args, kwargs.values())):
            return self.compiled(*args, **kwargs)
        return self.forward(*args, **kwargs)


# the accounting layer's tensor collectives, the ones a block issues (tp's region borders, the cp ring, ep's dispatch)
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "p2p_batch")


def _collectives_run_eagerly() -> None:
    """Every collective of `lit_lm.strategies.comm` runs eagerly, never traced: traced, dynamo followed the accounting
    into its Python state and guarded on it (the flight recorder's history length, one more after every collective), so
    a block whose graph holds a collective recompiled whenever that length differed (dp2 x tp2 x pp2: 8 graphs more
    in step 2, the history not yet at its bound) until dynamo's recompile limit silently left those frames eager.
    Disabled, a collective is a graph break: the pieces between them are the graphs, the call order is the eager one."""
    for name in COLLECTIVES:
        fn = getattr(comm, name)
        if not getattr(fn, "_torchdynamo_disable", False):
            setattr(comm, name, torch._dynamo.disable(fn))


# what compile refuses, '<combination>: <why>; <instead>' as `lit_lm.strategies.layout.REFUSED` reads (a module
# option, so checked when the strategy applies its engines, not at its construction): activation checkpointing mode ->
# message. Empty in torch 2.13: `full` and `selective` both trace (dynamo's checkpoint higher-order op, the selective
# policy applied by AOTAutograd's partitioner), tests/test_compile.py
REFUSED: dict[str, str] = {}


def check_compile(activation_checkpointing: str) -> None:
    if activation_checkpointing in REFUSED:
        raise ConfigError(REFUSED[activation_checkpointing])


def compile_blocks(model: nn.Module, fullgraph: bool, backend: str = BACKEND, retain_graph: bool = False) -> int:
    """Compile every block of `model` (a `lit_lm.strategies.plan.BlockModel`) in place; the number compiled. Applying it
    again (Lightning sets up again for a validate after fit) keeps the compiled forwards: never twice.
    `retain_graph`: a backward runs more than once over the graph (the pipeline schedules' split input/weight
    backward): AOTAutograd's donated buffers (a backward that frees its saved tensors as it goes) are switched off."""
    if retain_graph:
        functorch_config.donated_buffer = False
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleDict):
        raise ConfigError(f"compile wraps a model's `blocks` (lit_lm.strategies.plan.BlockModel): "
                          f"{type(model).__name__} has none; set model.init_args.compile false")
    _collectives_run_eagerly()
    moe = [model.get_submodule(name.rpartition(".")[0])  # the layers holding experts: routing, dispatch, experts
           for name in (model.expert_plan() if hasattr(model, "expert_plan") else {})]
    fullgraph = fullgraph and not moe
    eager = [m for m in blocks.modules() if isinstance(m, ContextParallelAttention)] + moe
    for module in eager:  # the ring, the MoE layers: eager between the block's graphs
        if not getattr(module.forward, "_torchdynamo_disable", False):
            module.forward = torch._dynamo.disable(module.forward)
    for block in blocks.values():
        if not isinstance(block.__dict__.get("forward"), CompiledForward):
            block.forward = CompiledForward(block.__dict__.get("forward", block.forward), fullgraph, backend,
                                            block_kind(block))
    return len(blocks)


def compile_backend(option: Any) -> Optional[str]:
    """The backend a `compile` option names: True is inductor, False or None nothing, a string a dynamo backend
    (`aot_eager`: the same graphs without inductor's code generation, to tell a tracing problem from a codegen one)."""
    if option in (True, "true"):
        return BACKEND
    if option in (False, None, "false"):
        return None
    backends = torch._dynamo.list_backends(exclude_tags=())
    if not isinstance(option, str) or option not in backends:
        raise ConfigError(f"model.init_args.compile={option!r}: true, false, or a torch.compile backend "
                          f"({', '.join(backends)})")
    return option


def wants_compile(module: nn.Module) -> Optional[str]:
    """The backend of the module's option (lit_lm's `LanguageModel(compile=...)` sets `compile_blocks`): read, never
    imported; None: no compile."""
    return getattr(module, "compile_blocks", None)


class CompileReport:
    """Says once, after the first optimizer step, what compiling cost; counts compiles in later training steps
    (`recompiles`: none at fixed shapes) and warns once if there are any. A validation's own graph (gradient
    mode is a guard) compiles between steps and is not a recompile of the training step."""

    def __init__(self) -> None:
        self.steps, self.recompiles = 0, 0
        self._at_start: Optional[int] = None
        self._first = (COMPILES.count, COMPILES.seconds)

    def step_starts(self) -> None:
        if self._at_start is None:  # the window's first micro-batch
            self._at_start = COMPILES.count

    def after_step(self) -> None:
        start, self._at_start = self._at_start, None
        self.steps += 1
        if self.steps == 1:
            graphs, seconds = COMPILES.count - self._first[0], COMPILES.seconds - self._first[1]
            rank_zero_info(f"[lit-lm] torch.compile: {graphs} graphs compiled in the first step, {seconds:.1f} s")
        elif start is not None and COMPILES.count > start:
            if not self.recompiles:
                rank_zero_warn(f"[lit-lm] torch.compile recompiled in training step {self.steps} (fixed shapes "
                               "should not): see TORCH_LOGS=recompiles for the guard that failed")
            self.recompiles += COMPILES.count - start


def compiled(model: nn.Module) -> bool:
    """Whether `model`'s blocks run compiled forwards."""
    blocks = getattr(model, "blocks", None) or {}
    return any(isinstance(b.__dict__.get("forward"), CompiledForward) for b in blocks.values())


def speed_up(model: nn.Module, fp8: Optional[str], compile: Optional[str]) -> None:
    """One process (no lit-lm strategy): the FP8 linears, then compile, in the order `ComposedStrategy` applies them."""
    apply_fp8(model, fp8)
    if compile:
        compile_blocks(model, fullgraph=True, backend=compile)
