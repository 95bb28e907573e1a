"""`lm_ddp`: the model replicated on every data-parallel rank, gradients averaged by the hand-written bucketed
all-reduce of `lit_lm/strategies/grad_sync.py`: `ComposedStrategy` with its defaults (a preset,
`lit_lm/strategies/presets.py`). This class keeps the class path of configs/strategies/ddp.yaml.

Deprecated (kept for one release, each access warns with the new name): the engine's names that lived here before
it moved to `lit_lm.strategies.grad_sync` (`GradSync`, `broadcast_parameters`, `flat_step`), and the old verbs of the
`GradSync` imported from here (`finish()` is `finish_grad_sync()`, `remove_hooks()` is `detach()`). The public
engine API is listed in docs/architecture.md ("The engines outside Lightning")."""

from __future__ import annotations

import warnings
from typing import Any

from lit_lm.strategies import grad_sync
from lit_lm.strategies.composed import ComposedStrategy

MOVED = ("GradSync", "broadcast_parameters", "flat_step")  # to lit_lm.strategies.grad_sync


class DataParallelStrategy(ComposedStrategy):
    """`lm_ddp`: the model replicated on every dp rank, gradients averaged by `GradSync`."""


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated and will be removed: use {new}", DeprecationWarning, stacklevel=3)


class _GradSync(grad_sync.GradSync):
    """`lit_lm.strategies.grad_sync.GradSync` with its verbs from before the engine protocol (`dp_engine.py`)."""

    def finish(self) -> None:
        _deprecated("GradSync.finish()", "GradSync.finish_grad_sync()")
        self.finish_grad_sync()

    def remove_hooks(self) -> None:
        _deprecated("GradSync.remove_hooks()", "GradSync.detach()")
        self.detach()


def __getattr__(name: str) -> Any:
    """The names that moved to `lit_lm.strategies.grad_sync`, with a DeprecationWarning naming the new one."""
    if name in MOVED:
        _deprecated(f"lit_lm.strategies.ddp.{name}", f"lit_lm.strategies.grad_sync.{name}")
        return _GradSync if name == "GradSync" else getattr(grad_sync, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
