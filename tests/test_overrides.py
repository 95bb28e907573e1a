"""Every Lightning hook a strategy overrides carries `@override`, and every `@override` names a Lightning hook.

lightning is pinned <2.7 and some hooks are private (`_configure_launcher`): if a release renames one, a subclass
method silently stops being called. This test turns that into a failure at once (and type checkers flag it too).
"""

from __future__ import annotations

import pytest
from lightning.pytorch.strategies.parallel import ParallelStrategy

from lit_lm.strategies.base import BaseStrategy
from lit_lm.strategies.composed import ComposedStrategy
from lit_lm.strategies.ddp import DataParallelStrategy
from lit_lm.strategies.ep import ExpertParallelStrategy
from lit_lm.strategies.pp import PipelineStrategy
from lit_lm.strategies.tp import TensorParallelStrategy
from lit_lm.strategies.zero import ZeroStrategy


def _function(attr: object) -> object:
    attr = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
    return getattr(attr, "__wrapped__", attr)  # @contextmanager


@pytest.mark.parametrize("cls", [BaseStrategy, ComposedStrategy, DataParallelStrategy, ZeroStrategy,
                                 TensorParallelStrategy, PipelineStrategy, ExpertParallelStrategy])
def test_overrides_are_marked_and_exist(cls: type) -> None:
    for name, attr in vars(cls).items():
        if name.startswith("__") or not callable(_function(attr)):
            continue
        marked = getattr(_function(attr), "__override__", False)
        in_lightning = hasattr(ParallelStrategy, name)
        assert marked == in_lightning, (f"{cls.__name__}.{name}: " + (
            "overrides a Lightning hook without @override" if in_lightning else
            "is marked @override but Lightning's ParallelStrategy has no such hook (renamed?)"))
