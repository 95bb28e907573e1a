"""`lit-lm check` (lit_lm/check/): the user's own config against one process, through the parity harness.

- every preset of configs/strategies passes on the world size it needs (one spawned world per size, shared);
- the suite's mutants (tests/test_parity_mutations.py), injected through the harness's `mutation` switch, make it
  fail with the parameter named and the ratio of norms shown (or, for the bugs that move no single gradient, the
  norm or the rows named), and `lit-lm check` exit 1;
- a user's own module (a frozen, tied embedding) with a pruning callback under tp2 x ZeRO-2 passes.
Two optimizer steps (the mutants: one) of the scaled-down model: the cost is the spawns.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

import test_parity_mutations as mutants
from dist_utils import REFERENCE_TILES
from lit_lm.check.build import parse, plan_check
from lit_lm.check.command import report, run_checks
from lit_lm.check.report import render
from lit_lm.check.scale import scaled_config
from lit_lm.cli import DEFAULT_CONFIG, LitLMCLI, main
from lit_lm.config import ConfigError, ModelConfig
from lit_lm.module import LanguageModel
from lit_lm.strategies.layout import ParallelConfig

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
MOE = ["--config", str(CONFIGS / "models" / "moe_tiny.yaml")]
DEFAULTS = [str(DEFAULT_CONFIG)]


def _argv(preset: str, devices: int, *extra: str) -> list[str]:
    model = MOE if preset.startswith("ep") else []
    return [*model, "--config", str(CONFIGS / "strategies" / f"{preset}.yaml"), "--trainer.devices", str(devices),
            *extra]


def _checked(argvs: list[list[str]], steps: int = 2, mutations: list = (), optimizers: list = ()) -> list[dict]:
    """Each argv checked (all of one world size in one spawn), as its report."""
    mutations = list(mutations) or [None] * len(argvs)
    optimizers = list(optimizers) or [("sgd", "module")] * len(argvs)
    plans = [plan_check(parse(a, LitLMCLI, DEFAULTS), a, steps=steps, mutation=m, optimizers=o)
             for a, m, o in zip(argvs, mutations, optimizers)]
    errors = run_checks(plans, env=REFERENCE_TILES)  # cp's tiles by the PyTorch reference, as `lit-lm check` on CPU
    return [report(p, 1e-5, errors.get(i, "")) for i, p in enumerate(plans)]


# (world size, presets): a spawn each; the dp-only presets share one model, so one pair of one-process references
PRESETS = [(2, ["ddp", "zero1", "zero2", "zero3"]), (2, ["tp", "cp", "pp", "ep"]),
           (4, ["dp_pp", "dp_tp", "dp_tp_zero", "ep_zero", "fsdp_tp"]), (8, ["3d"])]


def test_every_preset_is_listed() -> None:
    listed = sorted(p for _, presets in PRESETS for p in presets)
    assert listed == sorted(p.stem for p in (CONFIGS / "strategies").glob("*.yaml"))


@pytest.mark.parametrize("world, presets", PRESETS, ids=lambda x: x if isinstance(x, int) else "+".join(x))
def test_every_preset_passes(world: int, presets: list[str]) -> None:
    reports = _checked([_argv(p, world) for p in presets])
    failed = [f"{p}: {r['verdict']}" for p, r in zip(presets, reports) if not r["ok"]]
    assert not failed, "\n".join(failed)
    for preset, r in zip(presets, reports):
        assert r["verdict"].startswith("PASS"), (preset, r["verdict"])
        assert all(run["params"] and all(row["error"] <= 1e-5 for row in run["params"]) for run in r["runs"]), preset
        comm = r["costs"].get("comm")
        assert comm and any(c["measured"] for c in comm), (preset, r["costs"])  # collectives were measured
        # the planner counts what the accounting layer counts (ep's all-to-all: its expectation, the ranks' mean)
        assert all(c["agree"] for c in comm), (preset, [c for c in comm if not c["agree"]])
        assert r["costs"]["memory"]["measured"] == r["costs"]["memory"]["estimate"], (preset, r["costs"]["memory"])


# mutant, config, what the verdict must name: a parameter (regex) with its ratio of norms, or the norm or rows;
# cp's bugs may move the first loss before the gradients: the verdict then names the worst gradient of that step
GRADIENT = r"gradient.* model\.\S+.*ratio of norms"
MUTANTS_2 = {
    "grad_sync_sums": (mutants.grad_sync_sums, _argv("ddp", 2), r"gradient of model\.\S+ .*ratio of norms 2\.0000"),
    "flat_step_wrong_group": (mutants.flat_step_wrong_group, _argv("ddp", 2), r"final value of model\.\S+"),
    "zero2_doubled": (mutants.zero_reduce_scatter_doubled, _argv("zero2", 2),
                      r"gradient of model\.\S+ .*ratio of norms 2\.0000"),
    "zero3_doubled": (mutants.zero_reduce_scatter_doubled, _argv("zero3", 2),
                      r"gradient of model\.\S+ .*ratio of norms 2\.0000"),
    "ep_no_division": (mutants.ep_forgets_division, _argv("ep", 2),
                       r"gradient of model\.blocks\.\d\.mlp\.experts\.\S+ .*ratio of norms 2\.0000"),
    "pp_tied_doubled": (mutants.pp_tied_doubled, _argv("pp", 2),
                        r"gradient of model\.(tok_embeddings|lm_head)\.weight .*ratio of norms 2\.0000"),
    "cp_grads_over_dp": (mutants.cp_grads_over_dp, _argv("cp", 2), GRADIENT),
    "cp_ring_backward_tile_lse": (mutants.ring_backward_tile_lse, _argv("cp", 2), GRADIENT),
    "cp_rope_contiguous": (mutants.rope_positions_contiguous, _argv("cp", 2), GRADIENT),
    "cp_merge_keeps_lse": (mutants.merge_keeps_lse, _argv("cp", 2), GRADIENT),
    "clip_uncapped": (mutants.clip_uncapped, _argv("ddp", 2, "--trainer.gradient_clip_val", "2.0"),
                      r"(final value|gradient) of model\.\S+"),
}
MUTANTS_4 = {
    "norm_counts_tp_replicated": (mutants.tp_replicated_counted_everywhere, _argv("dp_tp", 4),
                                  r"pre-clip gradient norm of step 0"),
    "hsdp_sampler_from_dp_shard": (mutants.sampler_from_dp_shard, _argv(
        "zero3", 4, "--trainer.strategy.init_args.data_parallel_replicate_size", "2"), r"read the same row"),
    # ZeRO's rows at another rank's offsets (the global rank wrapped into the group's range): its in-place
    # collectives' chunk is not the rank's own, refused at launch (lit_lm/strategies/comm.py; gloo ran it, gradients
    # differed)
    "zero_global_rank": (mutants.zero_global_rank, _argv("dp_tp_zero", 4), r"in-place chunk .* not this rank's"),
}


@pytest.mark.parametrize("world, table", [(2, MUTANTS_2), (4, MUTANTS_4)], ids=["2 ranks", "4 ranks"])
def test_every_mutant_fails_the_check(world: int, table: dict) -> None:
    names = list(table)
    # plain SGD shows every one but the flat step's (an update, not a gradient: the module's AdamW shows it)
    optimizers = [("module",) if n == "flat_step_wrong_group" else ("sgd",) for n in names]
    reports = _checked([table[n][1] for n in names], steps=1, mutations=[table[n][0] for n in names],
                       optimizers=optimizers)
    missed = [f"{n}: {r['verdict']}" for n, r in zip(names, reports)
              if r["ok"] or not re.search(table[n][2], r["verdict"])]
    assert not missed, "\n".join(missed)


def test_the_command_exits_1_naming_the_parameter_and_the_cause(capsys: pytest.CaptureFixture) -> None:
    """Through `lit-lm check` itself (the mutation passed where a test can): exit 1, the JSON's verdict and cause."""
    from lit_lm.check import command

    with pytest.raises(SystemExit) as exit_:
        command.main(["--json", "--steps", "1", *_argv("ddp", 2)], LitLMCLI, DEFAULTS, mutation=mutants.grad_sync_sums)
    assert exit_.value.code == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["ok"] and re.search(r"gradient of model\.\S+ .*ratio of norms 2\.0000", out["verdict"])
    assert "summed, not averaged, over dp (2 ranks)" in out["verdict"]
    lead = out["runs"][0]["lead"]
    assert lead["kind"] == "gradient" and lead["step"] == 0 and abs(lead["ratio"] - 2) < 1e-3
    # the same report as a table, to a file: plain text (no colour codes), the breaking parameter's row, the verdict
    text = io.StringIO()
    render(out, Console(file=text, width=160))
    table = text.getvalue()
    assert "\x1b[" not in table and out["verdict"][:60] in table.replace("\n", " ")
    assert re.search(rf"{re.escape(lead['param'])} .*2\.0000 .*step 0", table), table


@pytest.mark.parametrize("args, message", [
    (["--config", str(CONFIGS / "strategies" / "ddp.yaml"), "--trainer.devices", "1"],
     "one process has nothing to compare"),
    (["--trainer.strategy", "ddp", "--trainer.devices", "2"], "the check runs lit-lm's strategies"),
], ids=["one device", "Lightning's ddp"])
def test_what_cannot_be_checked_is_refused_in_one_line(args: list[str], message: str,
                                                        capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["check", *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


class FrozenEmbeddingLM(LanguageModel):
    """A user's module: the (tied) embedding frozen, everything else trained."""

    def configure_model(self) -> None:
        super().configure_model()
        self.model.tok_embeddings.weight.requires_grad_(False)


def test_frozen_tied_embedding_with_pruning_under_tp2_zero2_passes(tmp_path: Path) -> None:
    user = tmp_path / "user.yaml"
    user.write_text(f"model:\n  class_path: {__name__}.FrozenEmbeddingLM\n")
    prune = str(CONFIGS / "compress" / "prune_structured.yaml")
    argv = ["--config", str(user), *_argv("dp_tp_zero", 4), "--config", prune]
    (r,) = _checked([argv])
    assert r["ok"], r["verdict"]
    assert "Pruning" not in " ".join(r["model"]["changes"])  # run, not dropped
    for run in r["runs"]:
        rows = {row["name"]: row for row in run["params"]}
        assert rows["model.tok_embeddings.weight"]["shape"] is None  # frozen: no gradient on either side
        assert rows["model.blocks.0.mlp.w_up.weight"]["error"] <= 1e-5


def test_the_scaled_model_keeps_what_the_layout_splits() -> None:
    """GQA ratio, divisibility by tp/ep, padding rows, layer kinds, tying; a small model is kept as it is."""
    big = ModelConfig(vocab_size=50257, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
                      max_seq_len=8192, tie_embeddings=True, moe_experts=64, moe_top_k=6, moe_first_dense=3,
                      moe_every=1, moe_shared_experts=2, qk_norm=True)
    small, notes = scaled_config(big, ParallelConfig(tp=2, ep=4, cp=2))
    assert small.num_params() < 200_000 and notes
    assert small.n_heads // small.n_kv_heads == 4 and small.n_kv_heads % 2 == 0 and small.d_ff % 2 == 0
    assert small.moe_experts % 4 == 0 and small.moe_experts >= small.moe_top_k == 6
    assert small.padded_vocab_size - small.vocab_size == big.padded_vocab_size - big.vocab_size  # 47 padding rows
    assert small.max_seq_len % 4 == 0 and small.tie_embeddings and small.qk_norm
    assert not small.is_moe_layer(0) and small.is_moe_layer(1) and small.moe_shared_experts == 1
    odd, _ = scaled_config(ModelConfig(d_model=768, n_heads=12, n_kv_heads=3, max_seq_len=1024), ParallelConfig(tp=2))
    assert odd.n_kv_heads % 2 == 1  # tp 2 does not divide 3 kv heads: nor the check's (the strategy then refuses)
    tiny = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
    assert scaled_config(tiny, ParallelConfig(tp=2)) == (tiny, [])
    # DeepSeek-V3's node-limited routing (256 experts in 8 groups, the best 4, top 8): kept, on 2 groups, the best 1
    grouped = replace(big, moe_experts=256, moe_top_k=8, moe_groups=8, moe_topk_groups=4)
    small, _ = scaled_config(grouped, ParallelConfig(ep=4))  # builds: a ConfigError was raised here
    assert (small.moe_groups, small.moe_topk_groups) == (2, 1) and small.moe_experts % 4 == 0
    assert small.moe_top_k <= small.moe_experts // 2 and small.num_params() < 400_000


def test_gpu_memory_says_which_stage_does_not_fit_and_the_nearest_layout_that_does() -> None:
    """`lit-lm check --gpu-memory` without `--full-size`: per pipeline stage the planner's figure for the run against
    plan's budget, and where one does not fit, the nearest layout (`lit_lm.planner.plan.nearest`) in the verdict."""
    from lit_lm.check.fit import fit, run_estimate
    from lit_lm.check.report import summary

    argv = _argv("3d", 8)
    plan = plan_check(parse(argv, LitLMCLI, DEFAULTS), argv, optimizers=("module",))
    est = run_estimate(plan)
    low, high = sorted(r.peak for r in est.ranks)
    fits = fit(plan, est, (low + high) / 2 / 0.9)  # stage 0 fits, stage 1 (head and loss) does not
    assert [r["fits"] for r in fits["ranks"]] == [True, False] and fits["nearest"]["peak"] <= fits["budget"], fits
    report = summary(plan, [], {}, 1e-5, fits=fits)
    assert not report["ok"] and "does NOT fit" in report["verdict"] and fits["nearest"]["layout"] in report["verdict"]
    out = io.StringIO()
    render(report, Console(file=out, width=200))
    assert "stage 1: " in out.getvalue() and "does NOT fit" in out.getvalue(), out.getvalue()
    assert "every rank fits" in summary(plan, [], {}, 1e-5, fits=fit(plan, est, 2 * high))["verdict"]


def test_a_muon_config_passes_and_the_planner_counts_its_state_and_traffic(tmp_path: Path) -> None:
    """`model.init_args.optimizer: lit_lm.optim.Muon` under zero2 and tp2: the module's own Muon (the harness's
    "module" case) agrees with one process, and the planner's figures for the check's model are the measured ones:
    Muon's model state (one buffer per matrix) and the orthogonalizer's all-to-alls (zero2: ZeRO rows to their
    owners; tp2: the slices to their owners, or Gram all-reduces where "auto" finds them cheaper)."""
    muon = tmp_path / "muon.yaml"
    muon.write_text("model:\n  init_args:\n    optimizer:\n      class_path: lit_lm.optim.Muon\n      init_args:\n"
                    "        lr: 0.002\n        adamw_lr: 0.003\n")
    reports = _checked([_argv(preset, 2, "--config", str(muon)) for preset in ("zero2", "tp")],
                       optimizers=[("module",)] * 2)
    for preset, r in zip(("zero2", "tp"), reports):
        assert r["ok"], (preset, r["verdict"])
        costs = r["costs"]
        assert costs["memory"]["measured"] == costs["memory"]["estimate"], preset
        rows = {(c["group"], c["op"]): c for c in costs["comm"]}
        assert all(c["agree"] for c in costs["comm"]), (preset, costs["comm"])
        moved = rows[("dp_shard" if preset == "zero2" else "tp", "all_to_all")]
        assert moved["measured"] > 0, preset


def per_micro_batch_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutant: each micro-batch's (so each rank's) own mean, not the mean over the global batch's targets."""
    monkeypatch.setattr(LanguageModel, "per_token", lambda self, loss, targets, batch_idx: loss)


def test_an_sft_lora_layout_passes_and_the_planner_counts_its_state(tmp_path: Path) -> None:
    """Chat data (`format: chat`: loss masks, packed conversations) with LoRA under zero3 and tp2: the module's own
    run agrees with one process, the planner's model state for the adapted model is the measured one, and a loss
    normalised per micro-batch (the mutant) fails the check."""
    sft = tmp_path / "sft.yaml"
    sft.write_text("model:\n  init_args:\n    lora:\n      rank: 4\n      alpha: 8\n"
                   "data:\n  init_args:\n    format: chat\n")
    argvs = [_argv(preset, 2, "--config", str(sft)) for preset in ("zero3", "tp", "zero3")]
    reports = _checked(argvs, mutations=[None, None, per_micro_batch_mean], optimizers=[("module",)] * 3)
    for preset, r in zip(("zero3", "tp"), reports):
        assert r["ok"], (preset, r["verdict"])
        assert any("format chat" in line for line in r["model"]["changes"]), r["model"]["changes"]
        memory = r["costs"]["memory"]
        assert memory["measured"] == memory["estimate"], (preset, memory)
    assert not reports[2]["ok"] and re.search(r"the loss of batch 0|" + GRADIENT, reports[2]["verdict"]), \
        reports[2]["verdict"]


def test_chat_data_under_a_pipeline_is_refused_by_the_check_in_one_line() -> None:
    argv = _argv("pp", 2, "--data.init_args.format", "chat")
    with pytest.raises(ConfigError, match="pipeline parallelism") as e:
        plan_check(parse(argv, LitLMCLI, DEFAULTS), argv)
    assert "\n" not in str(e.value)
