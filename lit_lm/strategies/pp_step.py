"""The pipeline inside Lightning's step: the stage split, the schedule as the step's loss, the gradients kept aside.

`split_pipeline` cuts the block model to this rank's stage (`lit_lm/strategies/pp_split.py` chooses the layers) and
builds its `PipelineRunner`. One Lightning step runs the whole schedule: the LightningModule's step (its batch handling,
metrics and logging) stays as it is and its call of the strategy's loss function (`lit_lm.strategies.plan.LossSeam`)
becomes the schedule, which runs every forward and backward. Lightning then calls `optimizer.zero_grad()` and
`backward()` on the returned loss: `PipelineStep` keeps the schedule's gradients out of their way and puts them back.
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Generator, Optional

from torch import Tensor, nn

from lit_lm.strategies.errors import ConfigError
from lit_lm.strategies.layout import ParallelConfig, ParallelLayout
from lit_lm.strategies.plan import PipelineModel, StepLoss
from lit_lm.strategies.pp_runner import PipelineRunner
from lit_lm.strategies.pp_schedules import Schedule
from lit_lm.strategies.pp_split import split_layers


def split_pipeline(model: Optional[nn.Module], dot: str, first_use: dict[str, str], layout: ParallelLayout,
                   config: ParallelConfig, schedule: Schedule) -> tuple[PipelineRunner, set[str]]:
    """Cut `model` (the block model, under prefix `dot`) to this rank's stage; its runner, and the global names of
    the parameters whose other use (a tied embedding/head) lives on another stage."""
    if not isinstance(model, PipelineModel):
        raise ConfigError(f"pipeline_parallel_size={config.pp}: the model must honour "
                          "lit_lm.strategies.plan.PipelineModel (blocks, pipeline_split, pipeline_activation, "
                          "stage_forward, loss)")
    p, rank, v = layout.pp_size, layout.pp_rank, config.virtual_stages
    costs, extras = None, (0.0, 0.0)
    if config.balance == "params":
        costs = [float(sum(q.numel() for q in block.parameters())) for block in model.blocks.values()]
        extras = (_outside_blocks(model, first=True), _outside_blocks(model, first=False))
    layers = list(config.layers_per_stage) if config.layers_per_stage is not None else None
    stages = split_layers(len(model.blocks), p, v, layers, costs, *extras)
    chunk_layers = [stages[c * p + rank] for c in range(v)]
    model.pipeline_split(sorted(layer for chunk in chunk_layers for layer in chunk), is_first=rank == 0,
                         is_last=rank == p - 1)
    kept = {dot + n for n, _ in model.named_parameters(remove_duplicate=False)}
    aliases: dict[str, set[str]] = {}
    for name, first in first_use.items():
        aliases.setdefault(first, set()).add(name)
    tied = {first_use[dot + n] for n, _ in model.named_parameters() if not aliases[first_use[dot + n]] <= kept}
    runner = PipelineRunner(model, schedule, rank, chunk_layers, layout.pp_group,
                            seq_shards=config.tp if config.sp else 1)
    return runner, tied


def _outside_blocks(model: nn.Module, first: bool) -> float:
    """Parameters the first (or last) stage holds besides its blocks, from a split of a copy (free on meta)."""
    probe = copy.deepcopy(model)
    probe.pipeline_split([], is_first=first, is_last=not first)
    return float(sum(q.numel() for q in probe.parameters()))


class PipelineStep:
    """The schedule as one step's loss (`loss`, a `StepLoss`), and the gradient stash around Lightning's
    zero_grad/backward. `no_sync()`: the data-parallel engines' (the schedule runs every backward of the step)."""

    def __init__(self, model: nn.Module, runner: PipelineRunner, microbatches: int,
                 no_sync: Callable[[], AbstractContextManager[None]]) -> None:
        self.runner, self.microbatches, self.no_sync = runner, microbatches, no_sync
        self.loss = StepLoss(model, self._run, "pipeline parallelism")
        self._stash: list[tuple[Tensor, Optional[Tensor]]] = []
        self._window_open = False

    def _run(self, inputs: Tensor, targets: Tensor, train: bool, scale: float, **rows: Optional[Tensor]
             ) -> tuple[Tensor, Tensor]:
        """The schedule over the step's batch. Lightning scales the returned loss by 1 / accumulate_grad_batches
        (`scale`) before a backward that is a no-op here (the schedule ran it): the runner scales its backwards."""
        if inputs.shape[0] % self.microbatches:
            raise ConfigError(f"microbatches={self.microbatches} must divide the per-replica batch size "
                              f"{inputs.shape[0]}: change microbatches or the batch size")
        if not train:
            return self.runner.run(inputs, targets, False, loss_scale=scale, **rows)
        with self.no_sync():
            return self.runner.run(inputs, targets, True, loss_scale=scale, **rows)

    @contextmanager
    def stash(self, module: nn.Module) -> Generator[None, None, None]:
        """Around Lightning's training step: the last window's gradients cleared first (Lightning zeroes only after
        this step), this step's kept out of Lightning's zero_grad until `backward`."""
        params = [q for q in module.parameters() if q.requires_grad]
        if not self._window_open:
            for q in params:
                q.grad = None
            self._window_open = True
        yield
        self._stash = [(q, q.grad) for q in params]
        for q in params:
            q.grad = None

    def backward(self, closure_loss: Tensor, precision: Any, module: nn.Module) -> Tensor:
        """Lightning's backward: every backward already ran inside the schedule; its gradients come back between
        the precision plugin's hooks (the callbacks' on_before_backward / on_after_backward)."""
        closure_loss = precision.pre_backward(closure_loss, module)
        for q, grad in self._stash:
            q.grad = grad
        self._stash = []
        return precision.post_backward(closure_loss, module)

    def window_closed(self) -> None:
        """After the optimizer step: the next training step starts a new accumulation window."""
        self._window_open = False

