"""lit-lm's strategy names are data (lit_lm/strategies/presets.py): every row is registered with Lightning as its
class and arguments, a preset class built with no argument is its row's strategy, and every yaml in configs/strategies/
names a preset's class and builds with its init_args."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import yaml
from lightning.pytorch.strategies import StrategyRegistry

import lit_lm.strategies.registry  # noqa: F401  (registers the names, as lit-lm's CLI does)
from lit_lm.strategies.base import BaseStrategy
from lit_lm.strategies.presets import PRESETS
from lit_lm.strategies.registry import preset_class

REPO = Path(__file__).resolve().parents[1]
HOME = ("lm_parallel", "lm_ddp", "zero2", "tp", "pp", "ep")  # the row whose arguments are its class's defaults


def _settings(strategy: Any) -> dict[str, Any]:
    """What ComposedStrategy's constructor sets beyond the base's plumbing (which the Trainer fills in): public
    values and dataclasses (the parallel configuration), not groups or engines, which exist only after setup."""
    plumbing = vars(BaseStrategy())
    return {k: v for k, v in vars(strategy).items() if k not in plumbing and not k.startswith("_") and
            (isinstance(v, (bool, int, float, str, type(None))) or dataclasses.is_dataclass(v))}


def _by_name(name: str) -> Any:
    return L.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False).strategy


@pytest.mark.parametrize("name", PRESETS)
def test_every_row_is_registered_as_its_class_and_arguments(name: str) -> None:
    row, entry = PRESETS[name], StrategyRegistry[name]
    assert f"{entry['strategy'].__module__}.{entry['strategy'].__qualname__}" == row.cls
    assert entry["init_params"] == row.args and entry["description"] == row.description
    strategy = _by_name(name)
    assert type(strategy) is entry["strategy"] and _settings(strategy) == _settings(entry["strategy"](**row.args))


def test_a_preset_class_defaults_to_its_row_and_the_rows_differ() -> None:
    by_name = {name: _settings(_by_name(name)) for name in PRESETS}
    for name in HOME:
        assert _settings(preset_class(PRESETS[name].cls)()) == by_name[name], name
    assert len({repr(sorted(s.items())) for s in by_name.values()}) == len(by_name) - 1  # lm_ddp is lm_parallel's


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "strategies").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_strategy_yaml_names_a_preset_class_and_builds(path: Path) -> None:
    spec = yaml.safe_load(path.read_text())["trainer"]["strategy"]
    assert spec["class_path"] in {row.cls for row in PRESETS.values()}, spec["class_path"]
    preset_class(spec["class_path"])(**spec.get("init_args", {}))
