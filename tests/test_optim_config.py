"""The optimizer as config (`model.init_args.optimizer`, Lightning's OptimizerCallable): the class jsonargparse's
callable builds is read before the groups are (a `matrix_wise` class gets the matrices' group), the run trains
with the arguments the user gave, the checkpoint keeps them as plain types, a bad name or key is one line, and the
default is today's AdamW, whose checkpoints of before still resume."""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import pytest
import torch
import yaml
from jsonargparse import ArgumentParser
from lightning.pytorch.cli import OptimizerCallable

from lit_lm.config import ConfigError
from lit_lm.module import DECAY_START, LanguageModel, optimizer_target
from lit_lm.param_groups import is_matrix, param_groups
from test_cli import REPO, run_cli, tiny_args
from test_schedules import CFG, fit


class MatrixSGD(torch.optim.SGD):
    matrix_wise = True  # what lit_lm.optim.Muon says: give me the hidden matrices as a group of their own


class _Takes:
    def __init__(self, optimizer: Optional[OptimizerCallable] = None) -> None:
        self.optimizer = optimizer


def parsed(*args: str) -> OptimizerCallable:
    """The callable jsonargparse gives `LanguageModel` for `--optimizer ...` (its own representation, not a guess)."""
    parser = ArgumentParser()
    parser.add_class_arguments(_Takes, "m")
    return parser.instantiate(parser.parse_args([f"--m.{a}" if a.startswith("optimizer") else a for a in args])).m \
        .optimizer


def test_the_class_behind_each_form_of_callable():
    sgd = parsed("optimizer", "torch.optim.SGD", "optimizer.momentum", "0.9")
    target, kwargs = optimizer_target(sgd)
    assert target is torch.optim.SGD and kwargs["momentum"] == 0.9 and kwargs["lr"] == 1e-3
    assert optimizer_target(parsed("optimizer", f"{__name__}.MatrixSGD"))[0] is MatrixSGD
    assert optimizer_target(torch.optim.Adam) == (torch.optim.Adam, {})
    assert optimizer_target(functools.partial(torch.optim.Adam, lr=0.5)) == (torch.optim.Adam, {"lr": 0.5})
    assert optimizer_target(lambda params: torch.optim.Adam(params)) == (None, {})


def _groups(optimizer: Optional[OptimizerCallable], **kwargs: object) -> tuple[LanguageModel, torch.optim.Optimizer]:
    module = LanguageModel(CFG, optimizer=optimizer, **kwargs)
    module.configure_model()
    return module, module.configure_optimizers()["optimizer"]


def test_a_matrix_wise_class_gets_the_matrices_as_a_group_and_an_elementwise_one_todays_two():
    module, matrix = _groups(parsed("optimizer", f"{__name__}.MatrixSGD", "optimizer.weight_decay", "0.01"))
    names = {p: n for n, p in module.model.named_parameters()}
    assert [g.get("matrix", False) for g in matrix.param_groups] == [True, False, False]
    assert [names[p] for p in matrix.param_groups[0]["params"]] == [n for n, p in module.model.named_parameters()
                                                                   if is_matrix(n, p)]
    assert [g["weight_decay"] for g in matrix.param_groups] == [0.01, 0.01, 0.0]  # the optimizer's own decay
    module, sgd = _groups(parsed("optimizer", "torch.optim.SGD", "optimizer.momentum", "0.9"))
    today = param_groups(module.model, 0.1, False)
    assert [g["params"] for g in sgd.param_groups] == [g["params"] for g in today]
    assert [(g["momentum"], g["weight_decay"]) for g in sgd.param_groups] == [(0.9, 0.0), (0.9, 0.0)]


def test_the_default_is_todays_adamw_on_todays_groups():
    module, adamw = _groups(None, lr=2e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05, warmup_steps=0)
    assert type(adamw) is torch.optim.AdamW and module.hparams["optimizer"] is None
    today = param_groups(module.model, 0.05, False)
    assert [g["params"] for g in adamw.param_groups] == [g["params"] for g in today]
    for group, decay in zip(adamw.param_groups, (0.05, 0.0)):
        assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (2e-3, (0.8, 0.9), 1e-6, decay)


def test_adamw_arguments_beside_an_optimizer_are_said_unused_once():
    with pytest.warns(UserWarning, match=r"model\.init_args lr=0\.5, eps=1e-06: unused beside "
                                         r"model\.init_args\.optimizer") as caught:
        _groups(functools.partial(torch.optim.SGD, lr=0.1), lr=0.5, eps=1e-6)
    assert sum("unused beside" in str(w.message) for w in caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults beside an optimizer, or any value without one: nothing said
        LanguageModel(CFG, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
        LanguageModel(CFG, lr=0.5, eps=1e-6)


def test_an_optimizer_that_cannot_take_the_groups_is_one_config_error():
    with pytest.raises(ConfigError, match=r"^torch\.optim\.lbfgs\.LBFGS cannot train lit-lm's parameter groups "
                                          r"\(model\.init_args\.optimizer\): LBFGS doesn't support per-parameter"):
        _groups(functools.partial(torch.optim.LBFGS, lr=1.0))


def test_sgd_by_the_command_line_trains_with_what_was_asked(tmp_path):
    """`--model.init_args.optimizer torch.optim.SGD` and its arguments: the run trains, its checkpoint (read with
    weights_only, as LightningCLI reads one) holds SGD's state on today's two groups with the asked numbers, and
    the module rebuilt from the checkpoint's hyper-parameters builds the same optimizer."""
    sgd = ["--model.init_args.optimizer", "torch.optim.SGD", "--model.init_args.optimizer.momentum", "0.9",
           "--model.init_args.optimizer.lr", "0.05", "--model.init_args.optimizer.weight_decay", "0.01"]
    done = run_cli("fit", *tiny_args(tmp_path), *sgd, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt = torch.load(tmp_path / "run/checkpoints/last.ckpt", weights_only=True)
    asked = ckpt["hyper_parameters"]["optimizer"]
    assert asked["class_path"] == "torch.optim.sgd.SGD"
    assert (asked["init_args"]["lr"], asked["init_args"]["momentum"], asked["init_args"]["weight_decay"]) == \
        (0.05, 0.9, 0.01)
    (state,) = ckpt["optimizer_states"]
    assert [(g["initial_lr"], g["momentum"], g["weight_decay"]) for g in state["param_groups"]] == \
        [(0.05, 0.9, 0.01), (0.05, 0.9, 0.0)]
    assert all("momentum_buffer" in s for s in state["state"].values())
    assert ckpt["global_step"] == 6
    module = LanguageModel.load_from_checkpoint(tmp_path / "run/checkpoints/last.ckpt", weights_only=True)
    module.configure_model()
    rebuilt = module.configure_optimizers()["optimizer"]
    assert type(rebuilt) is torch.optim.SGD and rebuilt.defaults["momentum"] == 0.9


def test_print_config_shows_the_options_and_reads_the_yaml_form(tmp_path):
    default = run_cli("fit", "--print_config", cwd=tmp_path)
    assert default.returncode == 0, default.stderr[-3000:]
    init_args = yaml.safe_load(default.stdout)["model"]["init_args"]
    assert init_args["optimizer"] is None
    assert init_args["schedule"] == {"name": "cosine", "decay": "1-sqrt", "decay_fraction": 0.2, "decay_steps": None,
                                     "decay_start": None}
    fragment = tmp_path / "sgd.yaml"
    fragment.write_text("model:\n  init_args:\n    optimizer:\n      class_path: torch.optim.SGD\n      init_args:\n"
                        "        momentum: 0.9\n    schedule:\n      name: wsd\n      decay_steps: 40\n")
    given = run_cli("fit", "--config", str(REPO / "configs/default.yaml"), "--config", str(fragment),
                    "--print_config", cwd=tmp_path)
    assert given.returncode == 0, given.stderr[-3000:]
    init_args = yaml.safe_load(given.stdout)["model"]["init_args"]
    assert init_args["optimizer"]["class_path"] == "torch.optim.SGD"
    assert init_args["optimizer"]["init_args"]["momentum"] == 0.9
    assert (init_args["schedule"]["name"], init_args["schedule"]["decay_steps"]) == ("wsd", 40)


@pytest.mark.parametrize("args, line", [
    (["--model.init_args.optimizer", "torch.optim.Sgd"],
     "lit-lm: error: 'torch.optim.Sgd' is not an optimizer class (model.init_args.optimizer); name a "
     "torch.optim.Optimizer subclass, e.g. torch.optim.SGD (docs/optim.md)"),
    (["--model.init_args.optimizer", "SGD", "--model.init_args.optimizer.momentom", "0.9"],
     "lit-lm: error: unknown key 'momentom' in the command line (model.init_args.optimizer.momentom); did you mean "
     "--model.init_args.optimizer.momentum?"),
    (["--model.init_args.schedule.decay_step", "9"],
     "lit-lm: error: unknown key 'decay_step' in the command line (model.init_args.schedule.decay_step); did you "
     "mean --model.init_args.schedule.decay_steps?"),
    (["--model.init_args.schedule.name", "wsdd"],
     "lit-lm: error: model.init_args.schedule: name 'wsdd', decay '1-sqrt'; use name cosine, wsd, linear or constant "
     "and decay linear, cosine or 1-sqrt")])
def test_a_bad_optimizer_or_schedule_is_one_line(tmp_path, args, line):
    done = run_cli("fit", *tiny_args(tmp_path), *args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [x for x in done.stderr.splitlines() if x.strip() and not x.startswith("Seed set")]
    assert lines == [line]


def test_a_checkpoint_of_before_the_options_resumes(tmp_path):
    """A default AdamW checkpoint saved without the `optimizer` and `schedule` hyper-parameters (as every one before
    them): its optimizer state loads into the default's groups and the resumed steps are the uninterrupted run's;
    `load_from_checkpoint` builds the default."""
    whole, whole_module = fit(tmp_path / "whole", 6, schedule_steps=6)
    fit(tmp_path / "old", 4, schedule_steps=6)
    ckpt = torch.load(tmp_path / "old" / "last.ckpt", weights_only=True)
    for key in ("optimizer", "schedule"):
        del ckpt["hyper_parameters"][key]
    assert DECAY_START not in ckpt
    path = tmp_path / "before.ckpt"  # not in the folder the resumed run saves to
    torch.save(ckpt, path)
    resumed, module = fit(tmp_path / "old", 6, str(path), schedule_steps=6)
    assert resumed.losses == {s: whole.losses[s] for s in (4, 5)}
    assert resumed.lrs == {s: whole.lrs[s] for s in (4, 5)}
    for (name, p), q in zip(module.named_parameters(), whole_module.parameters()):
        assert torch.equal(p, q), name
    assert LanguageModel.load_from_checkpoint(path, weights_only=True).optimizer_fn is None


def test_elementwise_optimizers_by_config_under_zero_equal_one_process():
    """The config's optimizer and schedule through the strategies' flat step (ZeRO-2 and ZeRO-3, 2 gloo ranks):
    SGD with Nesterov momentum and weight decay, and RMSprop with momentum, under WSD, step by step equal to one
    process (the parity harness: losses, every gradient, final parameters)."""
    from functools import partial

    from lit_lm.parity import Case, assert_parity, run_parity
    from lit_lm.strategies.composed import ComposedStrategy

    schedule = {"name": "wsd", "decay": "cosine", "decay_steps": 2}
    optimizers = {"sgd": {"class_path": "torch.optim.SGD",
                          "init_args": {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}},
                  "rmsprop": {"class_path": "torch.optim.RMSprop", "init_args": {"lr": 1e-3, "momentum": 0.5}}}
    cases = [Case(partial(ComposedStrategy, zero_stage=stage), optimizer="module", steps=4, label=f"zero{stage} {name}",
                  module=("lit_lm.module.LanguageModel", (("optimizer", optimizer), ("schedule", schedule),
                                                          ("warmup_steps", 1))))
             for name, optimizer in optimizers.items() for stage in (2, 3)]
    for run in run_parity(cases, world_size=2):
        assert_parity(run)
