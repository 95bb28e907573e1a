"""lit-lm's strategy names as data: each is `ComposedStrategy` with a few settings.

    Trainer(strategy="zero3")            trainer.strategy: tp            (a yaml, or --trainer.strategy tp)

One row per name: the class Lightning builds (what a yaml's `class_path` names), the arguments the name gives it,
and a line for listings. `lit_lm/strategies/registry.py` registers every row with Lightning. A new preset is a new row;
with `lit_lm.strategies.composed.ComposedStrategy` as its class it needs no class of its own, e.g.

    "zero3_tp": Preset("lit_lm.strategies.composed.ComposedStrategy",
                       {"zero_stage": 3, "tensor_parallel_size": 2, "sequence_parallel": True}, "ZeRO-3 x tp2"),

The preset classes (lit_lm/strategies/ddp.py, zero.py, tp.py, pp.py, ep.py) keep the class paths of the yaml files in
configs/strategies/; their signatures take their defaults from their row, so `TensorParallelStrategy()` and
`strategy="tp"` build the same strategy and jsonargparse shows those defaults (`ZeroStrategy` calls ComposedStrategy's
`zero_stage` `stage`; `ZeroStrategy()` is `zero2`). This module imports none of them, so each may import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lit_lm.strategies.pp_schedules import SCHEDULES
from lit_lm.strategies.zero_engine import STAGES


@dataclass(frozen=True)
class Preset:
    cls: str  # the class Lightning builds: a yaml's class_path
    args: dict[str, Any]  # its keyword arguments the name sets (a yaml's init_args, or the Trainer's, add to them)
    description: str


PRESETS: dict[str, Preset] = {
    "lm_parallel": Preset("lit_lm.strategies.composed.ComposedStrategy", {},
                          "dp x ZeRO x tp x cp x pp x ep, composed (every size 1 unless set)"),
    "lm_ddp": Preset("lit_lm.strategies.ddp.DataParallelStrategy", {}, "hand-written bucketed DDP"),
    **{f"zero{stage}": Preset("lit_lm.strategies.zero.ZeroStrategy", {"stage": stage}, f"ZeRO-{stage}: shards {what}")
       for stage, what in STAGES.items()},
    "tp": Preset("lit_lm.strategies.tp.TensorParallelStrategy", {"tensor_parallel_size": 2, "sequence_parallel": True},
                 "Megatron tensor (+sequence) parallelism, dp over the rest"),
    "pp": Preset("lit_lm.strategies.pp.PipelineStrategy", {"pipeline_parallel_size": 2},
                 f"pipeline parallelism ({', '.join(SCHEDULES)}), dp over the rest"),
    "ep": Preset("lit_lm.strategies.ep.ExpertParallelStrategy", {"expert_parallel_size": 2},
                 "expert parallelism (all-to-all), dp over the rest"),
}


def default(name: str, arg: str) -> Any:
    """Preset `name`'s setting of `arg`: the default of that argument in the preset's class."""
    return PRESETS[name].args[arg]
