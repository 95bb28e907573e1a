"""Errors a user can fix, as one line: `lit-lm: error: <what> (<key>); <how to fix>`.

Printed by rank 0 only, without a traceback (`--debug` or LIT_LM_DEBUG=1 restores it); every rank exits with
status 2. The ranks a launcher process spawned are stopped with it, so none waits for a peer that is gone.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Generator, Optional

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from lit_lm.config import ConfigError
from lit_lm.strategies import host_malloc

DEBUG_ENV = "LIT_LM_DEBUG"
EXIT_CODE = 2
FP16 = {"16", "16-mixed", "16-true"}


def pop_debug_flag(args: Optional[list[str]]) -> tuple[Optional[list[str]], bool]:
    """`--debug` is lit-lm's, not the parser's: remove it (from sys.argv too: spawned ranks re-read it)."""
    argv = sys.argv[1:] if args is None else list(args)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    if "--debug" in argv:
        os.environ[DEBUG_ENV] = "1"
        argv = [a for a in argv if a != "--debug"]
        if args is None:
            sys.argv = sys.argv[:1] + argv
    return (None if args is None else argv), debug


def config_error(error: BaseException) -> Optional[ConfigError]:
    """`error` if it is a ConfigError, else the one it was raised from (`raise ... from`), if any: jsonargparse
    raises a ConfigError of the data module's or the model's constructor as the cause of its union-type ValueError
    ("Does not validate against any of the Union subtypes")."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, ConfigError):
            return error
        seen.add(id(error))
        error = error.__cause__
    return None


@contextmanager
def reporting_errors(debug: bool) -> Generator[None, None, None]:
    try:
        yield
    except Exception as raised:
        e = config_error(raised)
        if e is None or debug:
            raise
        if getattr(rank_zero_only, "rank", 0) == 0:
            print(f"lit-lm: error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CODE)


def stop_other_ranks(trainer: Optional[Trainer]) -> None:
    """In the process that launched the local ranks (Lightning's subprocess launcher), terminate them. Lightning's
    observer of those ranks is disarmed first: seeing one stopped by a signal, it would SIGKILL this process (every
    5 s it looks), before it exits with its own code (the one-line error's 2)."""
    launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
    if isinstance(launcher, _SubprocessScriptLauncher) and launcher.procs:
        for thread in threading.enumerate():
            if isinstance(thread, _ChildProcessObserver):
                thread._child_processes = []  # none left to watch: it ends at its next look
        launcher.kill(signal.SIGTERM)


def check_environment() -> None:
    """lit-lm's environment switches, which the ranks read later: a bad value stops the run here, in one line."""
    for name, modes in ((host_malloc.CHOICE, host_malloc.MODES),):
        value = os.environ.get(name)
        if value and value not in modes:
            raise ConfigError(f"{name}={value!r} is not one of {', '.join(modes)} (environment); unset it or pick one")


def check_trainer_config(trainer: Any) -> None:
    """Trainer values Lightning would accept silently or report in its own terms (and the environment's switches)."""
    check_environment()
    if str(trainer.precision) in FP16:
        raise ConfigError(f"fp16 precision {trainer.precision!r} is not supported (trainer.precision): its loss "
                          "scaler skips steps from one rank's gradients only; use bf16-mixed, bf16-true or 32-true")
    name = trainer.strategy
    if isinstance(name, str) and name != "auto" and name not in StrategyRegistry:
        ours = sorted(n for n in StrategyRegistry
                      if StrategyRegistry[n]["strategy"].__module__.startswith("lit_lm.strategies"))
        raise ConfigError(f"unknown strategy {name!r} (trainer.strategy); use one of lit-lm's: {', '.join(ours)} "
                          "(configs/strategies/*.yaml compose them), or one of Lightning's (e.g. ddp, fsdp)")
