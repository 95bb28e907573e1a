"""The data-parallel engine protocol: the verbs a strategy drives `GradSync` (lm_ddp) and `ZeroEngine` (ZeRO 1-3) with.

A strategy holds ONE list of engines (dense parameters, and under expert parallelism a second engine for the
experts) and calls, per accumulation window:

    with engine.no_sync(): backward ...     all but the window's last backward: accumulate, do not communicate
    backward                                the last one: the engine reduces as the gradients arrive
    engine.finish_grad_sync()               wait; the reduced gradients are where the optimizer reads them
    optimizer.step()                        (bound once with `bind_optimizer`)
    engine.after_step()                     the tensors the forward reads follow what the optimizer holds (ZeRO
                                            all-gathers its updated rows; also after loading a checkpoint)

`detach()` removes the engine's hooks (teardown, or between a fit and a validate) and `attach()` puts them back.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Generator, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from lit_lm.strategies.grad_sync import GradSync, flat_step
from lit_lm.strategies.zero_engine import ZeroEngine, shard_optimizer


@runtime_checkable
class DataParallelEngine(Protocol):
    def no_sync(self) -> AbstractContextManager[None]: ...

    def finish_grad_sync(self) -> None: ...

    def after_step(self) -> None: ...

    def attach(self) -> None: ...

    def detach(self) -> None: ...


@contextmanager
def no_sync(engines: Sequence[DataParallelEngine]) -> Generator[None, None, None]:
    """Every engine's `no_sync()` at once: backward passes inside accumulate without communicating."""
    with ExitStack() as stack:
        for engine in engines:
            stack.enter_context(engine.no_sync())
        yield


def bind_optimizer(optimizer: torch.optim.Optimizer, engines: Sequence[DataParallelEngine]) -> None:
    """Make `optimizer` step what `engines` hold: ZeRO points its param groups at the master shards (`shard_optimizer`),
    `GradSync` lays the parameters out as its buckets for one flat step per bucket (`flat_step`); both give an
    elementwise optimizer (AdamW, SGD) its flat step. One kind of engine per strategy."""
    zero = [e for e in engines if isinstance(e, ZeroEngine)]
    syncs = [e for e in engines if isinstance(e, GradSync)]
    if len(zero) + len(syncs) != len(engines) or (zero and syncs):
        raise TypeError(f"bind_optimizer: engines of one kind, GradSync or ZeroEngine; got "
                        f"{sorted({type(e).__name__ for e in engines})}")
    if zero:
        shard_optimizer(optimizer, zero)
    elif syncs:
        flat_step(optimizer, syncs)


def param_holder(params: list[nn.Parameter]) -> nn.Module:
    """A module over exactly these Parameters (not copies), for an engine that must see only them (the experts'
    engine and the dense one under expert parallelism)."""
    holder = nn.Module()
    holder.params = nn.ParameterList(params)
    return holder
