"""Importing this module registers lit-lm's presets (`lit_lm/strategies/presets.py`) with Lightning's
`StrategyRegistry`, so `Trainer(strategy="zero3")` and `trainer.strategy: tp` resolve; lit_lm's CLI imports it before
any Trainer."""

from __future__ import annotations

import importlib

from lightning.pytorch.strategies import StrategyRegistry

from lit_lm.strategies.presets import PRESETS


def preset_class(path: str) -> type:
    """The class a preset (or a yaml's class_path) names, e.g. "lit_lm.strategies.tp.TensorParallelStrategy"."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


for _name, _preset in PRESETS.items():
    StrategyRegistry.register(_name, preset_class(_preset.cls), description=_preset.description, override=True,
                              **_preset.args)
