"""The one table of refused combinations (`lit_lm.strategies.layout.REFUSED`): the strategy raises every entry with its
text, docs/parallelism.md lists exactly the table, and no other page keeps a copy. (That the planner never
proposes a refused configuration is tests/test_plan.py's.)"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Optional

import lightning as L
import pytest
from torch.utils.data import DataLoader, TensorDataset

from dist_utils import TinyLM, run_distributed, token_data
from lit_lm.config import ModelConfig
from lit_lm.model import Transformer
from lit_lm.parity import MOE
from lit_lm.strategies.composed import ComposedStrategy
from lit_lm.strategies.errors import ConfigError
from lit_lm.strategies.layout import REFUSED, ParallelConfig, Refusal

REPO = Path(__file__).resolve().parents[1]
HEADING = "## Combinations the engines do not compose"


def first_match(entry: Refusal) -> ParallelConfig:
    """The smallest configuration (sizes 1 or 2) whose first matching entry is `entry`."""
    for tp, pp, cp, ep, replicate, zero, sp in itertools.product((1, 2), (1, 2), (1, 2), (1, 2), (1, 2), range(4),
                                                                 (True, False)):
        config = ParallelConfig(tp=tp, pp=pp, cp=cp, ep=ep, dp_replicate=replicate, zero_stage=zero,
                                sequence_parallel=sp)
        if config.refusal(moe=True) is entry:
            return config
    raise AssertionError(f"no configuration reaches {entry.combination!r}")


@pytest.mark.parametrize("entry", [r for r in REFUSED if not r.moe], ids=lambda r: r.combination)
def test_the_strategy_refuses_every_entry_at_construction(entry: Refusal) -> None:
    config = first_match(entry)
    with pytest.raises(ConfigError, match=f"^{re.escape(entry.message)}$"):
        ComposedStrategy(**config.strategy_args())


class MoELM(TinyLM):
    def configure_model(self) -> None:
        if self.model is None:
            self.model = Transformer(ModelConfig(**MOE))


def _fit_moe(configs: list[ParallelConfig]) -> list[Optional[str]]:
    """Each config's first step on 2 ranks with the MoE model: the ConfigError's message, or None if it trained."""
    out = []
    for config in configs:
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ComposedStrategy(**config.strategy_args()),
                            max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            use_distributed_sampler=False, num_sanity_val_steps=0, enable_checkpointing=False)
        loader = DataLoader(TensorDataset(token_data(4) % MOE["vocab_size"]), batch_size=2)
        try:
            trainer.fit(MoELM(), loader)
            out.append(None)
        except ConfigError as err:
            out.append(str(err))
    return out


def test_the_moe_entries_are_raised_once_the_model_is_known() -> None:
    """A MoE model under cp, and under tp with sequence parallelism: refused with the table's text before any
    engine is applied; tp without sequence parallelism trains (the plan replicates MoE layers over tp)."""
    moe = [r for r in REFUSED if r.moe]
    configs = [first_match(r) for r in moe] + [ParallelConfig(tp=2, sequence_parallel=False)]
    assert all(c.world == 2 and c.refusal() is None for c in configs)  # construction cannot know the model
    messages = run_distributed(_fit_moe, 2, configs, init_process_group=False)
    for rank in messages:
        assert rank == [r.message for r in moe] + [None]


def documented_rows() -> list[tuple[str, ...]]:
    """The rows of docs/parallelism.md's table of refused combinations."""
    text = (REPO / "docs/parallelism.md").read_text()
    section = text[text.index(HEADING):]
    section = section[: section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert rows[0] == "| combination | why | instead |", rows[0]
    return [tuple(cell.strip() for cell in row.strip("|").split(" | ")) for row in rows[2:]]


def test_the_docs_list_exactly_the_table_and_nothing_else_keeps_a_copy() -> None:
    expected = [(r.combination, r.why, r.instead) for r in REFUSED]
    table = "\n".join(f"| {' | '.join(row)} |" for row in expected)
    assert documented_rows() == expected, f"docs/parallelism.md's table should read:\n{table}"
    pages = [REPO / "README.md", *(p for p in (REPO / "docs").rglob("*.md") if p.name != "parallelism.md")]
    for page in pages:
        text = " ".join(page.read_text().split())
        copies = [r.why for r in REFUSED if r.why in text]
        assert not copies, f"{page.relative_to(REPO)} keeps a copy of the refused combinations: {copies}"
