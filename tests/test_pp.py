"""Pipeline parallelism: schedules as data, the runner without Lightning (every schedule, p = 2 and 4), then the
`pp` strategy against one-process training (clipping, tied embeddings, dp x pp, MoE on the first stage) and a
pp=2 -> pp=1 resume."""

from __future__ import annotations

import copy
import itertools
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from dist_utils import TINY, fit_tiny, run_distributed
from lit_lm.parity import MOE, Case, assert_parity, run_parity
from lit_lm.config import ModelConfig
from lit_lm.model import Transformer
from lit_lm.strategies import pp_runner
from lit_lm.strategies.comm import COMM_LOG
from lit_lm.strategies.errors import ConfigError
from lit_lm.strategies.pp import PipelineStrategy
from lit_lm.strategies.pp_runner import PipelineRunner
from lit_lm.strategies.pp_schedules import SCHEDULES, Action, bubble_theory, build_schedule, print_timeline
from lit_lm.strategies.pp_split import split_layers


def _cases(p: int) -> list[tuple[str, int, int]]:
    """(schedule, microbatches, virtual stages) for p stages: every schedule, m in {p, 2p}."""
    return [(name, m, 2 if spec.chunked else 1) for name, spec in SCHEDULES.items() for m in (p, 2 * p)]


# -- schedules as data ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 4])
def test_schedules_are_valid_with_bounded_memory(p: int) -> None:
    for name, m, v in _cases(p):
        schedule = build_schedule(name, p, m, v)
        schedule.validate()
        schedule.forward_only().validate()
        peaks = schedule.peak_in_flight()
        if name == "gpipe":
            assert peaks == [m] * p
        elif name == "1f1b":
            assert peaks == [min(p - r, m) for r in range(p)]
        elif name == "zb_h1":
            assert peaks == [p] * p  # deferred W's hold activations: never more than 1F1B's first stage
        else:
            assert max(peaks) <= 2 * p + (v - 1) * p  # Megatron's warm-up bound


@pytest.mark.parametrize("p", [2, 4])
def test_simulated_bubble_is_theory_and_zb_h1_beats_1f1b(p: int) -> None:
    for m in (p, 2 * p, 3 * p):
        lengths = {}
        for name, spec in SCHEDULES.items():
            v = 2 if spec.chunked else 1
            schedule = build_schedule(name, p, m, v)
            assert schedule.simulated_bubble() == pytest.approx([bubble_theory(name, p, m, v)] * p, abs=1e-12)
            lengths[name] = max(end for line in schedule.timeline for _, end, _ in line)
        assert lengths["zb_h1"] < lengths["1f1b"] == lengths["gpipe"]


def test_timeline_prints_one_row_per_rank() -> None:
    from rich.console import Console

    console = Console(record=True, width=200, color_system=None)
    print_timeline(build_schedule("zb_h1", 2, 4), console)
    text = console.export_text()
    assert "zb_h1  p=2 m=4 v=1" in text and "peak in flight [2, 2]" in text
    rows = [line.split() for line in text.splitlines() if line.startswith("rank")]
    assert [row[1] for row in rows] == ["0", "1"]
    assert rows[0][2:5] == ["F0", "F1", "."] and "W0" not in rows[0] and "W0" in rows[1]  # stage 0 does not split


def test_validate_catches_a_broken_schedule() -> None:
    schedule = build_schedule("1f1b", 2, 2)
    schedule.actions[1].remove(Action("RECV_F", 1))
    with pytest.raises(ValueError, match="RECV_F1"):
        schedule.validate()
    swapped = build_schedule("1f1b", 2, 4)
    acts = swapped.actions[0]
    i, j = acts.index(Action("SEND_F", 0)), acts.index(Action("SEND_F", 1))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ValueError):
        swapped.validate()


def test_an_unknown_schedule_is_one_error_everywhere() -> None:
    """The registry answers for every reader: the strategy, the schedule builder and the bubble formula (which
    once gave any new name ZB-H1's)."""
    message = "schedule: unknown 'pipedream'; choose one of " + ", ".join(SCHEDULES)
    for read in (lambda: PipelineStrategy(schedule="pipedream"), lambda: build_schedule("pipedream", 2, 4),
                 lambda: bubble_theory("pipedream", 2, 4)):
        with pytest.raises(ConfigError) as error:
            read()
        assert str(error.value) == message


def test_bad_configurations_name_the_field() -> None:
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule: interleaved_1f1b"):
        PipelineStrategy(schedule="1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size = 4 stages but the model has 3 layers"):
        split_layers(3, 4)
    with pytest.raises(ValueError, match="lower virtual_stages"):
        split_layers(5, 2, chunks=3)
    with pytest.raises(ValueError, match=r"layers_per_stage=\[3, 3\]"):
        split_layers(5, 2, layers_per_stage=[3, 3])


def test_layer_split() -> None:
    assert split_layers(5, 2) == [[0, 1, 2], [3, 4]]
    assert split_layers(5, 2, layers_per_stage=[1, 4]) == [[0], [1, 2, 3, 4]]
    assert split_layers(8, 2, chunks=2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # a heavy embedding (balance: params) pushes layers to the later stages
    assert split_layers(4, 2, first_extra=2.0) == [[0], [1, 2, 3]]


# -- the runner without Lightning ----------------------------------------------------------------------------------
ENGINE = dict(vocab_size=64, d_model=16, n_heads=2, n_kv_heads=1, max_seq_len=8)


def _runner_worker() -> dict:
    """Every schedule on this world's pipeline: losses and gradients against the whole model, and the traffic."""
    p, rank = dist.get_world_size(), dist.get_rank()
    cfg = ModelConfig(**ENGINE, n_layers=2 * p + 1)  # not divisible by the stages
    torch.manual_seed(0)
    full = Transformer(cfg)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2 * 2 * p, 9), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    loss, _ = full.loss(x, y)
    loss.backward()
    reference = {n: q.grad for n, q in full.named_parameters()}
    out: dict = {}
    for name, m, v in _cases(p):
        schedule = build_schedule(name, p, m, v)
        stages = split_layers(cfg.n_layers, p, v)
        chunk_layers = [stages[c * p + rank] for c in range(v)]
        stage = copy.deepcopy(full)
        stage.zero_grad(set_to_none=True)
        stage.pipeline_split(sorted(itertools.chain(*chunk_layers)), rank == 0, rank == p - 1)
        runner = PipelineRunner(stage, schedule, rank, chunk_layers)
        COMM_LOG.reset()
        got, _ = runner.run(x, y, train=True)
        err = max(((q.grad - reference[n]).norm() / reference[n].norm()).item() for n, q in stage.named_parameters())
        records = [(r.op, r.numel) for r in COMM_LOG.records]
        out[(name, m)] = {"loss": (got.item(), loss.item()), "grad_err": err, "comm": records,
                          "sends": sum(a.op.startswith("SEND") for a in schedule.actions[rank]),
                          "all_grads": all(q.grad is not None for q in stage.parameters())}
        eval_loss, _ = runner.run(x, y, train=False)
        out[(name, m)]["eval"] = eval_loss.item()
    return out


@pytest.mark.parametrize("p", [2, 4])
def test_runner_matches_the_whole_model(p: int) -> None:
    results = run_distributed(_runner_worker, p)
    batch = 2 * 2 * p
    for rank, per_rank in enumerate(results):
        for (name, m), r in per_rank.items():
            got, expected = r["loss"]
            assert got == pytest.approx(expected, rel=1e-5) and r["eval"] == pytest.approx(expected, rel=1e-5)
            assert r["all_grads"] and r["grad_err"] < 1e-5, (name, m, rank, r["grad_err"])
            # traffic: activation-sized p2p messages only, plus the all-reduce of (loss, ce)
            activation = batch // m * 8 * ENGINE["d_model"]
            p2p = [numel for op, numel in r["comm"] if op in ("send", "recv")]
            assert set(p2p) == {activation}, (name, m)
            assert sum(op == "send" for op, _ in r["comm"]) == r["sends"]
            assert [rec for rec in r["comm"] if rec[0] not in ("send", "recv")] == [("all_reduce", 2)]


# -- the strategy against one process --------------------------------------------------------------------------------
TIED_ODD = dict(n_layers=3, tie_embeddings=True)  # tied embedding/head across stages, 3 layers on 2 stages
K = 3  # optimizer steps per epoch; a checkpoint at the end of epoch 0, training to 2K
CLIP = dict(gradient_clip_val=0.05)  # small enough to clip every step


def _fit_pp(devices: int, pp: int, schedule: str, ckpt_dir: str | None, resume: str | None) -> dict:
    import dist_utils

    dist_utils.TINY.update(TIED_ODD)
    # fit_tiny shards a global batch over all ranks as DP does, but the stages of one pipeline must see the same
    # rows: ask for 8 x pp rows a step (a rank's loader batch is then 8 / dp), keep the first 8 of each global
    # batch and shard them over dp only (rank = pp_rank * dp + dp_rank, see lit_lm.strategies.layout)
    dp_share, dp = dist_utils.rank_share, devices // pp

    def share(data: torch.Tensor, batch: int, rank: int, world: int) -> torch.Tensor:
        first = data.view(-1, batch, data.shape[-1])[:, : batch // pp].reshape(-1, data.shape[-1])
        return dp_share(first, batch // pp, rank % dp, dp)

    dist_utils.rank_share = share
    callbacks = (ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1),) if ckpt_dir else ()
    options = dict(microbatches=2, schedule=schedule) if pp > 1 else {}  # one stage runs no pipeline
    strategy = PipelineStrategy(pipeline_parallel_size=pp, **options)
    return fit_tiny(strategy, devices=devices, global_batch=8 * pp, steps_per_epoch=K, max_steps=2 * K,
                    ckpt_path=resume, callbacks=callbacks, one_batch=True, **CLIP)


def _assert_same(run: dict, reference: dict, first_step: int = 0) -> None:
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference["losses"][first_step:]),
                               rtol=1e-5, atol=0)
    assert run["params"].keys() == reference["params"].keys()
    for name, value in reference["params"].items():
        rel = ((run["params"][name] - value).norm() / value.norm()).item()
        assert rel < 1e-5, (name, rel)


def _full_params(per_rank: list[dict]) -> dict:
    """The union of the stages' state dicts (each rank holds its own keys)."""
    return {k: v for r in per_rank for k, v in r["params"].items()}


def test_pp_matches_one_process_and_resumes_on_one_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dist_utils

    for key, value in TIED_ODD.items():
        monkeypatch.setitem(dist_utils.TINY, key, value)
    # one batch per epoch, repeated (fit_tiny's `one_batch`): a plain DataLoader has no position to resume from
    single = fit_tiny(steps_per_epoch=K, max_steps=2 * K, one_batch=True, **CLIP)

    pp2 = run_distributed(_fit_pp, 2, 2, 2, "1f1b", str(tmp_path), None, init_process_group=False)
    assert pp2[0]["params"].keys().isdisjoint(pp2[1]["params"])  # each stage holds its own keys only
    assert pp2[0]["grad_norms"] == pp2[1]["grad_norms"]  # one global norm ...
    assert min(pp2[0]["grad_norms"]) > CLIP["gradient_clip_val"]  # ... clipping every step (parity checks it)
    _assert_same({"losses": pp2[0]["losses"], "params": _full_params(pp2)}, single)

    # dp 2 x pp 2 with the split-backward schedule: the same run again
    dp_pp = run_distributed(_fit_pp, 4, 4, 2, "zb_h1", None, None, init_process_group=False)
    _assert_same({"losses": dp_pp[0]["losses"], "params": _full_params(dp_pp[:1] + dp_pp[2:3])}, single)

    # the pp=2 checkpoint of epoch 0 resumed on one stage continues the same run
    resumed = run_distributed(_fit_pp, 1, 1, 1, "1f1b", None, str(tmp_path / f"epoch=0-step={K}.ckpt"),
                              init_process_group=False)[0]
    _assert_same(resumed, single, first_step=K)


# -- the parity harness: every stage's gradients (the tied copy under its first name), SGD and AdamW ----------------
def test_harness_parity_pp() -> None:
    pp2 = partial(PipelineStrategy, pipeline_parallel_size=2, microbatches=2, schedule="1f1b")
    model = dict(TINY, **TIED_ODD)
    for run in run_parity([Case(pp2, model=model, label="pp2 1f1b sgd"),
                           Case(partial(pp2, schedule="zb_h1"), model=model, optimizer="adamw", trainer=CLIP,
                                label="pp2 zb_h1 adamw clip")], 2):
        assert_parity(run)


# -- MoE on the first stage: its auxiliary loss leaves the stage through `_AttachLoss`, not the last stage's loss ----
# every block MoE (block 0 on stage 0) and no Switch loss: a pipeline computes routing statistics per microbatch (as
# Megatron does), so only the per-token z-loss and the step-summed router-bias update can match one process exactly
MOE_PP = dict(MOE, moe_aux_loss=0.0, moe_first_dense=0)


def aux_loss_unweighted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-last stage starts its auxiliary loss's backward at 1, not at the 1/m each microbatch's loss gets on
    the last stage: the first stage's router trains on m x its z-loss gradient."""
    attach = pp_runner._AttachLoss
    monkeypatch.setattr(pp_runner, "_AttachLoss",
                        SimpleNamespace(apply=lambda output, aux, scale: attach.apply(output, aux, 1.0)))


# the z-loss's gradient also flows through the router's input into everything before it on the stage, and the
# harness reports the first parameter that differs (the embedding): the mutant's case freezes those, so its report
# names the parameter the mutant is about
BEFORE_ROUTER = tuple(f"model.{name}.weight" for name in (
    "tok_embeddings", "blocks.0.attn_norm", *(f"blocks.0.attn.{w}" for w in ("wq", "wk", "wv", "wo")),
    "blocks.0.mlp_norm"))


def test_harness_parity_pp_moe_and_the_unweighted_aux_loss_mutant() -> None:
    """pp2 with an MoE block on each stage against one process; the same run with the first stage's auxiliary
    loss unweighted is reported at step 0 by the gradient of that stage's router (one launch for both)."""
    pp2 = partial(PipelineStrategy, pipeline_parallel_size=2, microbatches=2, schedule="1f1b")
    clean, mutant = run_parity([Case(pp2, model=MOE_PP, steps=2, global_batch=4, label="pp2 MoE"),
                                Case(pp2, model=MOE_PP, steps=1, global_batch=4, frozen=BEFORE_ROUTER,
                                     mutation=aux_loss_unweighted, label="pp2 MoE, aux loss unweighted")], 2)
    assert_parity(clean)
    with pytest.raises(AssertionError, match=r"unweighted: step 0 rank 0: gradient of model\.blocks\.0\.mlp\.router\."
                                             r"weight differs"):
        assert_parity(mutant)
