"""ZeRO over a group of one rank issues no collective: the experts' ZeRO group (edp) when ep equals dp.

dp2 x ep2 on 2 ranks: each rank holds its own experts, so their ZeRO group is that rank alone; a reduce-scatter or
all-gather over it is a copy at best. Through `lit-lm check` (the parity harness, the module's AdamW): the run
still trains as one process does, the accounting layer records nothing on edp (until 2026-12-01 it recorded the
experts' whole reduce-scatter and all-gather there: Mixtral's 22.55 GB each way per step, see
docs/benchmarks/2026-12-full-size.md), and every (group, op) agrees with the planner, which counts none.
"""

from __future__ import annotations

from pathlib import Path

from lit_lm.check.build import parse, plan_check
from lit_lm.check.command import report, run_checks
from lit_lm.cli import DEFAULT_CONFIG, LitLMCLI

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_zero_over_a_group_of_one_moves_nothing_and_keeps_parity() -> None:
    stages = (1, 2)  # one world: both plans
    argvs = [["--config", str(CONFIGS / "models" / "moe_tiny.yaml"),
              "--config", str(CONFIGS / "strategies" / "ep.yaml"),
              "--trainer.devices", "2", "--trainer.strategy.init_args.zero_stage", str(s)] for s in stages]
    plans = [plan_check(parse(a, LitLMCLI, [str(DEFAULT_CONFIG)]), a, optimizers=("module",)) for a in argvs]
    assert all(p.dims["dp"] == 2 for p in plans)
    errors = run_checks(plans)
    for i, stage in enumerate(stages):
        r = report(plans[i], 1e-5, errors.get(i, ""))
        assert r["ok"], (stage, r["verdict"])
        comm = r["costs"]["comm"]
        assert not [c for c in comm if c["group"] == "edp" and c["measured"]], (stage, comm)
        assert all(c["agree"] for c in comm), (stage, [c for c in comm if not c["agree"]])
        # the dense ZeRO, in gloo's form (its all-reduce: `comm.zero_forms`)
        assert any(c["group"] == "dp_shard" and c["op"] == "all_reduce" and c["measured"] for c in comm), (stage, comm)
