"""The parallel-plan protocol: what a model publishes so that strategies can parallelise it without importing it.

torchtitan-style separation: the model says *what* its repeated unit is and how to initialise any parameter
from its name; each strategy decides *how* to shard, gather, split or wrap it.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Generator, Literal, Optional, Protocol, Union, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lit_lm.strategies.errors import ConfigError


@runtime_checkable
class BlockModel(Protocol):
    """A model with a repeated unit and name-addressed initialisation.

    - `blocks`: an `nn.ModuleDict` keyed by the *global* layer index ("0", "1", ...). It is the unit that ZeRO-3
      gathers, activation checkpointing wraps and pipeline stages own; checkpoint names never depend on a split.
    - `init_parameter(name, tensor)`: fill `tensor` in place with the initial value of parameter `name` (a name of
      the model's own `named_parameters()`), independent of device, order and rank. This lets a strategy build
      the model on the meta device and materialise one piece at a time.
    """

    blocks: nn.ModuleDict

    def init_parameter(self, name: str, tensor: Tensor) -> None: ...


def find_block_model(root: nn.Module) -> tuple[str, Optional[BlockModel]]:
    """The first submodule of `root` (itself included) honouring `BlockModel`, with its qualified name prefix."""
    for prefix, module in root.named_modules():
        if isinstance(module, BlockModel) and isinstance(getattr(module, "blocks", None), nn.ModuleDict):
            return prefix, module
    return "", None


def require_plan(model: Optional[nn.Module], protocol: type, setting: str, method: str, root: nn.Module) -> None:
    """Refuse `setting` (e.g. "tensor_parallel_size=2") for a LightningModule `root` whose block model lacks
    `method`."""
    if not isinstance(model, protocol):
        raise ConfigError(f"{setting}: {type(root).__name__} holds no model with a {method} "
                          f"(lit_lm.strategies.plan.{protocol.__name__})")


# -- tensor parallelism: what the model says about each submodule (the strategy decides how) -------------------
TensorParallelStyle = Literal[
    "column",  # nn.Linear split over its output features; its input is the whole (replicated) activation
    "row",  # nn.Linear split over its input features; its output is a partial sum over the tp ranks
    "region",  # a module made of column -> row linears: its input enters and its output leaves the tp region
    "sequence",  # replicated weights applied token by token (norms): under sequence parallelism they see 1/t of
    #              the tokens, so their gradients are partial and summed over tp
    "per_head",  # replicated weights applied to every head (QK-norm): each rank sees its heads only, so their
    #              gradients are partial and summed over tp
    "vocab_embedding",  # nn.Embedding split over the vocabulary rows
    "vocab_head",  # nn.Linear split over the vocabulary (output) rows; its logits stay split
    "vocab_loss",  # the loss on vocab-split logits: forward(logits, targets) -> (loss, detached ce), as LMLoss
    "batch",  # replicated weights whose forward needs statistics of the whole batch (MoE routing balance): every
    #           tp rank runs it on the same tokens, so it refuses sequence parallelism
    "heads",  # a module whose own parameters hold one value per query head along dim 0 (attention sinks): each
    #           rank keeps its heads' values, split as the column-parallel query projection splits the heads
]


@dataclass(frozen=True)
class TensorParallel:
    """How one submodule is tensor-parallel. `unit`: a column/row split may only cut at multiples of this many
    features (head_dim for attention projections, so whole heads stay on one rank); `unit_name` names a unit in
    errors ("query heads")."""

    style: TensorParallelStyle
    unit: int = 1
    unit_name: str = "features"


@runtime_checkable
class TensorParallelModel(Protocol):
    """A model that can be tensor-parallel: `tensor_parallel_plan()` maps submodule names (relative to the model)
    to a `TensorParallel` style. Modules not named are replicated and see the same data on every tp rank."""

    def tensor_parallel_plan(self) -> dict[str, TensorParallel]: ...


@runtime_checkable
class PipelineModel(BlockModel, Protocol):
    """A `BlockModel` that can be cut into pipeline stages (used by `lit_lm.strategies.pp`).

    - `pipeline_split(stage_layers, is_first, is_last)`: delete what the stage does not own (blocks not in
      `stage_layers`, the embedding unless first, norm/head unless last), keeping the global names.
    - `pipeline_activation(batch, seq_len)`: shape and dtype of the tensor passed between stages, so a stage can
      post its receive before the data exists.
    - `stage_forward(x, layers, targets, positions=None, documents=None)`: token ids or a hidden state through
      `layers` (in order), with the microbatch's `positions` / `documents` (B, T) when the rows pack documents; with
      `targets`, finish the model and return (loss, detached cross-entropy). Without, the hidden state, or
      (hidden state, auxiliary loss) when these layers add a loss of their own (MoE balancing): the runner
      backpropagates it with the stage and adds it to the reported loss.
    - `loss(inputs, targets)`: the whole model's (loss, ce). Under pipeline parallelism the LightningModule's
      step asks the strategy for the loss function instead (`LossSeam`), which runs the schedule.
    """

    def pipeline_split(self, stage_layers: list[int], is_first: bool, is_last: bool) -> None: ...

    def pipeline_activation(self, batch: int, seq_len: int) -> tuple[torch.Size, torch.dtype]: ...

    def stage_forward(self, x: Tensor, layers: list[int], targets: Optional[Tensor] = None
                      ) -> Union[Tensor, tuple[Tensor, Tensor]]: ...

    def loss(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]: ...


# -- expert parallelism: which modules hold experts (the strategy decides how to shard and dispatch) -----------
@dataclass(frozen=True)
class ExpertParallel:
    """A module holding `num_experts` experts: every parameter of it is stacked over the experts along dim 0, and
    its `forward(x, counts)` takes tokens grouped by expert (`counts[e]` rows for expert e, in order, a tensor of
    length `num_experts`) and returns one output row per input row. Expert parallelism gives each rank a slice of
    the experts (the same parameter names, fewer rows) and moves the tokens to them and back."""

    num_experts: int


@runtime_checkable
class ExpertModel(Protocol):
    """A model with experts: `expert_plan()` maps module names (relative to the model) to `ExpertParallel`.
    Everything not named is dense and replicated over the expert-parallel ranks. `set_batch_group(group)` tells it
    which ranks the global batch is split over (dp), so batch statistics (MoE load balancing) can be global."""

    def expert_plan(self) -> dict[str, ExpertParallel]: ...

    def set_batch_group(self, group: Optional[dist.ProcessGroup]) -> None: ...


# -- context parallelism: which modules are the attention cores (the strategy swaps them for ring attention) ---
@dataclass(frozen=True)
class ContextParallel:
    """A causal attention core `forward(q, k, v) -> out` on (B, H, T, D) tensors (Hkv dividing Hq), attending to at
    most `sliding_window` past positions (itself included; None: all). Everything else in the model is token-wise,
    so under context parallelism only these modules see other ranks' tokens: the strategy replaces them, and the
    model only has to accept the `positions` of the tokens a rank holds (for RoPE). `sinks`: the core holds a
    parameter `sinks` (Hq,), a learned logit per query head joining its softmax once, its mass dropped (attention
    sinks), which the replacement takes over."""

    sliding_window: Optional[int] = None
    sinks: bool = False
    heads: tuple[int, ...] = ()  # (query, kv) heads of q and k on one process (before tp); () unknown


@runtime_checkable
class ContextParallelModel(Protocol):
    """A model that can be context-parallel: `context_parallel_plan()` maps module names (relative to the model) to
    `ContextParallel`, and its forward/loss take `positions` (T,) of the tokens given."""

    def context_parallel_plan(self) -> dict[str, ContextParallel]: ...


# -- the loss seam: a strategy that computes the model's loss its own way -----------------------------------------
# (inputs, targets) -> (loss, detached ce). A step whose rows pack documents (lit_lm.data.packing) also passes the
# whole rows' `documents=` (B, T) document index of each token and `positions=` (B, T) RoPE positions or None, as
# keywords (only then: a loss function without them keeps working); a strategy that splits the batch (pipeline
# microbatches, context parallelism's sequence chunks) splits them exactly as it splits the inputs.
LossFn = Callable[..., tuple[Tensor, Tensor]]


@runtime_checkable
class LossSeam(Protocol):
    """A strategy that computes the loss of a step its own way (a pipeline runs its schedule, a context split feeds the
    model its share of the tokens). A LightningModule's step takes its loss function from the strategy,

        loss, ce = trainer.strategy.loss_fn(self.model)(inputs, targets)   # or step_loss_fn(strategy, model)

    which is `model.loss` itself where the strategy has nothing to add (dp, ZeRO, tp): calling `model.loss` directly
    keeps working there. Where it has (`StepLoss`), calling the model directly inside a step is refused."""

    def loss_fn(self, model: nn.Module) -> LossFn: ...


def step_loss_fn(strategy: object, model: nn.Module) -> LossFn:
    """The loss function of a step of `model` under `strategy`: its `loss_fn(model)` for a `LossSeam`, else (any other
    Lightning strategy) `model.loss`."""
    return strategy.loss_fn(model) if isinstance(strategy, LossSeam) else model.loss


class StepLoss:
    """One step's loss function for a strategy whose model must not be called directly: `fn(inputs, targets,
    **step_kwargs)` called exactly once inside each `step(...)`, the one place this rule is kept. A second call, no
    call, or the model's forward run by the step outside `fn` raises, naming `what` and the seam."""

    def __init__(self, model: nn.Module, fn: Callable[..., tuple[Tensor, Tensor]], what: str) -> None:
        self.fn, self.what = fn, what
        self._calls: Optional[int] = None  # calls in the open step; None: no step open
        self._kwargs: dict[str, Any] = {}
        self._inside = False
        model.register_forward_pre_hook(self._guard)

    @contextmanager
    def step(self, **kwargs: Any) -> Generator["StepLoss", None, None]:
        self._calls, self._kwargs = 0, kwargs
        try:
            yield self
        finally:
            calls, self._calls = self._calls, None
        if not calls:
            raise RuntimeError(f"{self.what} needs the LightningModule's step to compute its loss with the "
                               "strategy's `loss_fn(model)(inputs, targets)`; the step never called it")

    def __call__(self, inputs: Tensor, targets: Tensor, **rows: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """`rows`: the whole rows' `positions` / `documents` (B, T) when the data packs documents (see `LossFn`)."""
        if self._calls is None:
            raise RuntimeError(f"{self.what}: the strategy's loss function runs inside a training, validation or "
                               "test step only")
        self._calls += 1
        if self._calls > 1:
            raise RuntimeError(f"{self.what} computes the whole step's loss per call of the strategy's loss "
                               "function: call it once per step")
        self._inside = True
        try:
            return self.fn(inputs, targets, **rows, **self._kwargs)
        finally:
            self._inside = False

    def _guard(self, module: nn.Module, args: Any) -> None:
        if self._calls is not None and not self._inside:
            raise RuntimeError(f"{self.what}: the step called the model directly; compute the loss with "
                               "`trainer.strategy.loss_fn(model)(inputs, targets)` (lit_lm.strategies.plan.LossSeam)")
