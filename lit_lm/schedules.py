"""Learning-rate schedules: the multiplier m(s) of the peak lr at optimizer step s (0-based), for a `LambdaLR`.

Every schedule starts with the same linear warmup over W = `warmup_steps` steps, m(s) = (s + 1) / W for s < W, and
ends at the floor r = `min_lr_ratio` (constant: never). H is the horizon (`LanguageModel.schedule_horizon`: the
run's state, kept by checkpoints), p a progress clamped to [0, 1]:

    cosine    (default)  p = (s - W) / (H - W)            m = r + (1 - r) · ½ (1 + cos π p)
    linear               p = (s - W) / (H - W)            m = r + (1 - r) · (1 - p)
    constant                                              m = 1
    wsd                  stable until D, then decays over L steps:
                         p = (s - D) / L                  m = r + (1 - r) · f(p)   (m = 1 for W <= s < D)
                         f(p) = 1 - p (linear),  ½ (1 + cos π p) (cosine),  1 - √p (1-sqrt)
                         L = decay_steps, or round(decay_fraction · H);  D = decay_start, or H - L

WSD's decay can start at any step ("decay anytime"): `decay_start: resume` starts it at the step a fit resumes from
(`--ckpt_path <a stable-phase checkpoint>`); the step is then the run's state, saved in later checkpoints like the
horizon, so resuming the branch continues the same decay. See docs/optim.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Union

from lit_lm.config import ConfigError

DECAYS: dict[str, Callable[[float], float]] = {  # f(p): 1 at p = 0, 0 at p = 1
    "linear": lambda p: 1 - p,
    "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
    "1-sqrt": lambda p: 1 - math.sqrt(p),
}


NAMES = ("cosine", "wsd", "linear", "constant")


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1 over `warmup_steps`, then cosine decay to `min_lr_ratio` at `total_steps`."""
    return Schedule().multiplier(step, warmup_steps, total_steps, min_lr_ratio)


def decayed(progress: float, min_lr_ratio: float, shape: str) -> float:
    """r + (1 - r) · f(p), with p clamped to [0, 1]: from 1 down to the floor r."""
    return min_lr_ratio + (1 - min_lr_ratio) * DECAYS[shape](min(max(progress, 0.0), 1.0))


@dataclass(frozen=True)
class Schedule:
    """`model.init_args.schedule`: the LR's shape after the warmup (warmup_steps, min_lr_ratio and the horizon,
    schedule_steps, are the model's own arguments: they hold for every shape).

    Args:
        name: cosine (the default), wsd (warmup, stable at the peak, decay), linear (to the floor at the
            horizon) or constant (flat after the warmup).
        decay: WSD's decay shape f: linear, cosine or 1-sqrt.
        decay_fraction: WSD's decay length as a fraction of the horizon (unless `decay_steps`).
        decay_steps: WSD's decay length in steps (wins over `decay_fraction`).
        decay_start: the step WSD's decay starts at; null: the horizon minus the decay's length; `resume`: the
            step `fit --ckpt_path` resumes from (decay anytime: branch a decay off a stable-phase checkpoint).
    """

    name: str = "cosine"  # (a str, not a Literal: a wrong name is one ConfigError line, not jsonargparse's page)
    decay: str = "1-sqrt"
    decay_fraction: float = 0.2
    decay_steps: Optional[int] = None
    decay_start: Union[int, Literal["resume"], None] = None

    def __post_init__(self) -> None:
        key = "model.init_args.schedule"
        if self.name not in NAMES or self.decay not in DECAYS:
            raise ConfigError(f"{key}: name {self.name!r}, decay {self.decay!r}; use name cosine, wsd, linear or "
                              "constant and decay linear, cosine or 1-sqrt")
        if not 0 < self.decay_fraction <= 1 or (self.decay_steps is not None and self.decay_steps < 1):
            raise ConfigError(f"{key}: decay_fraction={self.decay_fraction}, decay_steps={self.decay_steps}; need "
                              "0 < decay_fraction <= 1 and decay_steps >= 1 (or null)")
        start = self.decay_start
        if not (start is None or start == "resume" or (isinstance(start, int) and start >= 0)):
            raise ConfigError(f"{key}.decay_start={start!r}: a step >= 0, resume, or null")
        if start is not None and self.name != "wsd":
            raise ConfigError(f"{key}.decay_start={start!r} is WSD's; set {key}.name wsd")

    def decay_length(self, horizon: int) -> int:
        """L: `decay_steps`, else `decay_fraction` of the horizon (at least one step)."""
        return self.decay_steps if self.decay_steps is not None else max(round(self.decay_fraction * horizon), 1)

    def multiplier(self, step: int, warmup_steps: int, horizon: int, min_lr_ratio: float,
                   decay_start: Optional[int] = None) -> float:
        """m(step) (the module docstring's table). `decay_start`: WSD's D as resolved for the run (None: H - L)."""
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if self.name == "constant":
            return 1.0
        if self.name == "wsd":
            length = self.decay_length(horizon)
            start = horizon - length if decay_start is None else decay_start
            return 1.0 if step < start else decayed((step - start) / length, min_lr_ratio, self.decay)
        progress = (step - warmup_steps) / max(horizon - warmup_steps, 1)
        return decayed(progress, min_lr_ratio, "cosine" if self.name == "cosine" else "linear")


__all__ = ["DECAYS", "NAMES", "Schedule", "decayed", "warmup_cosine"]
