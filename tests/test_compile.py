"""`--model.init_args.compile`: every block under `torch.compile`, applied after the strategy's engines, against the
eager one-process run (lit_lm/parity.py): per-step losses, pre-clip norms, every gradient part and the final
parameters at the harness' fp32 tolerance, and no compile after the first step at fixed shapes.

Inductor compiles take tens of seconds on two loaded cores, so the presets share worlds and most run under the
`aot_eager` backend (the same dynamo graphs, hooks and guards; no code generation); inductor's generated code is
checked on one process and under lm_ddp + ZeRO-3, whose block graph is the same (its compiled code is cached).
"""

from __future__ import annotations

import io
import re
from dataclasses import replace
from functools import partial
from typing import Any

import lightning as L
import pytest
import torch

from lit_lm.parity import MOE, TINY, Case, assert_parity, reference, run_parity
from strategies.composed import ComposedStrategy
from strategies.compile import COMPILES, REFUSED, CompiledForward

ONE_LAYER = dict(TINY, n_layers=1)
STEPS = 5


class CompileCount(L.Callback):
    """Compiles so far in this process after each training batch (`strategies.compile.COMPILES`)."""

    def __init__(self) -> None:
        self.counts: list[int] = []
        self.compiled_blocks = 0

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self.counts.append(COMPILES.count)
        self.compiled_blocks = sum(isinstance(b.__dict__.get("forward"), CompiledForward)
                                   for b in module.model.blocks.values())

    def __getstate__(self) -> dict[str, Any]:  # what travels back from a rank (Lightning binds `log` to callbacks)
        return {"counts": self.counts, "compiled_blocks": self.compiled_blocks}


def compiled_case(strategy: Any, label: str, backend: Any = "aot_eager", model: dict = TINY, **kwargs: Any) -> Case:
    return Case(strategy, model=dict(model), steps=STEPS, label=label, callbacks=(CompileCount(),),
                module=("lit_lm.module.LanguageModel", (("compile", backend),)), **kwargs)


def assert_compiled_parity(run: dict[str, Any], recompiles: bool = False) -> None:
    """Against the eager one-process run; every block compiled, nothing compiled after the first step (unless
    `recompiles`: an MoE model's dispatch has data-dependent shapes, a known open defect, docs/compile.md)."""
    case = run["case"]
    eager = reference(replace(case, module=(), callbacks=()))
    assert_parity({**run, "single": eager})
    for rank, got in enumerate(run["ranks"]):
        count = got["callbacks"][0]
        assert count.compiled_blocks == len([k for k in eager["params"] if k.endswith("attn_norm.weight")]) or \
            count.compiled_blocks > 0, f"{case.label}: rank {rank}: no block compiled"
        assert recompiles or count.counts[-1] == count.counts[0], \
            f"{case.label}: rank {rank} compiled after step 1: counts per step {count.counts}"


PRESETS_2 = {
    "zero3": compiled_case(partial(ComposedStrategy, zero_stage=3), "zero3"),
    "tp2_sp": compiled_case(partial(ComposedStrategy, tensor_parallel_size=2), "tp2 + sp"),
    "pp2_zb": compiled_case(partial(ComposedStrategy, pipeline_parallel_size=2, microbatches=2, schedule="zb_h1"),
                            "pp2 zb_h1"),
    "cp2": compiled_case(partial(ComposedStrategy, context_parallel_size=2), "cp2 ring (Triton interpreter)"),
    "ep2": compiled_case(partial(ComposedStrategy, expert_parallel_size=2), "ep2 (MoE)", model=MOE),
}
INDUCTOR_2 = {
    "lm_ddp": compiled_case(partial(ComposedStrategy), "lm_ddp inductor", backend=True, model=ONE_LAYER),
    "zero1": compiled_case(partial(ComposedStrategy, zero_stage=1), "zero1 inductor", backend=True, model=ONE_LAYER),
}


REFUSED_CASE = compiled_case(partial(ComposedStrategy, activation_checkpointing="full"), "checkpointing refused")


def test_presets_compiled_match_eager() -> None:
    for run in run_parity(list(PRESETS_2.values()), world_size=2):
        assert_compiled_parity(run, recompiles=run["case"].model.get("moe_experts", 0) > 0)
    with pytest.raises(Exception, match=re.escape(REFUSED["full"])):  # before any step
        run_parity([REFUSED_CASE], world_size=2)


def test_inductor_compiled_matches_eager() -> None:
    for run in run_parity(list(INDUCTOR_2.values()), world_size=2):
        assert_compiled_parity(run)


def test_the_option_compiles_blocks_in_place_and_generation_stays_eager() -> None:
    from lit_lm.config import ConfigError
    from lit_lm.generate import generate
    from lit_lm.model import Transformer
    from lit_lm.config import ModelConfig
    from strategies.compile import compile_backend, compile_blocks

    assert compile_backend(True) == "inductor" and compile_backend(False) is None
    assert compile_backend("aot_eager") == "aot_eager"
    with pytest.raises(ConfigError, match="model.init_args.compile='nope'"):
        compile_backend("nope")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**ONE_LAYER))
    keys = list(model.state_dict())
    prompt = torch.randint(0, ONE_LAYER["vocab_size"], (1, 4))
    eager = generate(model, prompt, max_new_tokens=4, temperature=0.0)
    assert compile_blocks(model, fullgraph=True, backend="aot_eager") == 1
    assert compile_blocks(model, fullgraph=True, backend="aot_eager") == 1  # once
    assert isinstance(model.blocks["0"].__dict__["forward"], CompiledForward)
    assert list(model.state_dict()) == keys
    before = COMPILES.count
    assert torch.equal(generate(model, prompt, max_new_tokens=4, temperature=0.0), eager)
    assert COMPILES.count == before  # the KV cache calls run the eager forward


def test_the_planner_plans_compile_without_checkpointing() -> None:
    from rich.console import Console

    from lit_lm.config import ConfigError
    from lit_lm.plan_cli import _speed_options

    console = Console(file=io.StringIO())
    compiled = {"model": {"init_args": {"compile": True, "fp8": "rowwise"}}}
    assert _speed_options(compiled, ("none", "selective", "full"), console) == ("none",)
    assert _speed_options({}, ("none", "full"), console) == ("none", "full")
    with pytest.raises(ConfigError, match=re.escape(REFUSED["full"])):
        _speed_options(compiled, ("full",), console)
