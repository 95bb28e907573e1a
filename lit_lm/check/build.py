"""From the user's config files to the harness's cases: what `lit-lm check` trains, on how many ranks.

The files are read by `fit`'s own parser (the `LitLMCLI` class `lit_lm.cli` passes in: its defaults, links and
checks), so the check sees the run `fit` would start. From them:
- the model: the user's `LanguageModel` (sub)class and its arguments, its config (as the class resolves it, e.g.
  from `init_from`) scaled down by `scale.scaled_config` for the strategy's parallel degrees;
- the strategy: the yaml's class and arguments (or registered name), built again in every rank;
- the trainer settings that change a step: `accumulate_grad_batches`, `gradient_clip_val` and its algorithm;
- the callbacks, but the ones that only watch or write files (checkpoints, progress, LR monitor, ...); a callback
  scheduled by step (`*start_step`, `*end_step`, `frequency`) acts at once: its schedule starts and ends at step
  0 (pruning: its final sparsity after the first step, so the next steps train the pruned weights);
- the data: random token ids over the scaled model's whole vocabulary (every row is looked up and a target, under
  tp every rank's vocabulary shard); with `data.init_args.document_mask` (packed documents) the rows are packed:
  every token drawn as a multiple of 5 becomes an EOS (`DOCUMENT_EOS`: documents of about 5 tokens, crossing the
  cp chunks and the rows, one-token ones among them) and both sides mask attention at them, `position_reset` too;
- chat data (`data.init_args.format: chat`): the rows carry loss masks (every target whose id is a multiple of
  `CHAT_MASK` is not trained on, so rows, micro-batches and ranks hold different numbers of targets; the loss is per
  target of the global batch) and, `packed` (the default), conversations of about 5 tokens as packed documents;
  with `model.init_args.lora` the module trains its adapters alone (an SFT + LoRA layout);
- two cases: plain SGD (every gradient compared: a constant factor shows) and the module's own optimizer, param
  groups and LR schedule (its sharded state and update: a final parameter shows).
Precision is fp32 on the CPU: the layout's maths is what is checked (bf16 rounding would hide a 1e-5 difference).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from unittest import mock

import lightning as L
from jsonargparse import Namespace
from lightning.pytorch.callbacks import (Checkpoint, DeviceStatsMonitor, EarlyStopping, LearningRateMonitor,
                                         ModelSummary, ProgressBar, Timer)

from lit_lm.check.meter import Meter
from lit_lm.check.scale import model_args, scaled_config
from lit_lm.config import ConfigError, ModelConfig
from lit_lm.data.datamodule import TextDataModule, model_vocab_size
from lit_lm.module import LanguageModel
from lit_lm.parity import Case
from lit_lm.strategies.composed import ComposedStrategy
from lit_lm.strategies.layout import ParallelConfig

# callbacks that do not change a step: dropped (they write files or draw bars)
WATCHERS = (Checkpoint, ProgressBar, LearningRateMonitor, ModelSummary, EarlyStopping, Timer, DeviceStatsMonitor)
WATCHER_PATHS = ("lit_lm.callbacks.progress.", "lit_lm.callbacks.throughput.")
TRAINER_KEYS = ("accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm")
MODEL_ARGS_DROPPED = ("config", "init_from")  # the config goes in scaled; weights are not loaded
CHAT_MASK = 3  # chat data: targets whose id is a multiple of it are not trained on (`Case.loss_mask`)
CHAT_EOS = 1  # chat data, packed: the id that ends the check's conversations (the harness packs at an EOS)
DOCUMENT_EOS = 1  # with document_mask: the EOS id of the check's packed rows (any id of the scaled vocabulary)


@dataclass
class CheckPlan:
    """One `lit-lm check`: the user's run and the cases that stand for it."""

    argv: list[str]
    world: int
    model: ModelConfig  # the user's
    small: ModelConfig  # what is trained
    notes: list[str]  # what the check changed, one line each
    parallel: ParallelConfig
    strategy: str  # as the yaml names it
    precision: str  # the user's (the check trains fp32)
    batch_size: int  # the user's per-device batch
    accumulate: int
    dims: dict[str, int]  # sizes of the parallel dimensions (dp, tp, ...) on `world` ranks
    cases: list[Case] = field(default_factory=list)  # [plain SGD, the module's optimizer]
    nodes: int = 1  # trainer.num_nodes: `world` is devices x nodes
    runs: list[dict[str, Any]] = field(default_factory=list)  # the harness's results, filled by `run_checks`


def parse(argv: list[str], cli_class: type, defaults: list[str]) -> Namespace:
    """The config `fit` would run, through its parser (defaults, links, one-line errors)."""

    class Parsed(cli_class):
        def before_instantiate_classes(self) -> None:
            pass

        def instantiate_classes(self) -> None:
            pass

    with mock.patch.object(sys, "argv", sys.argv[:1]):  # the args are given: Lightning warns when sys.argv has more
        cli = Parsed(LanguageModel, TextDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
                     args=argv, parser_kwargs=cli_class.parser_kwargs(defaults))
    return cli.config


def build_strategy(spec: Any) -> Any:
    """The strategy in a rank: a registered name as is, or (class path, init args) built."""
    if isinstance(spec, str):
        return spec
    return _import(spec[0])(**spec[1])


def plan_check(config: Namespace, argv: list[str], steps: int = 2, mutation: Any = None,
               optimizers: tuple[str, ...] = ("sgd", "module")) -> CheckPlan:
    """The cases that check the run `config` describes (a `parse` result): plain SGD and the module's optimizer
    (`optimizers` picks; a test of a mutant that SGD shows needs no second run)."""
    trainer = config.trainer
    world = _world(trainer)
    spec, strategy_name, strategy = _strategy(trainer.strategy)
    if not isinstance(strategy, ComposedStrategy):
        raise ConfigError(f"trainer.strategy {strategy_name}: the check runs lit-lm's strategies (ComposedStrategy "
                          "and its presets, configs/strategies/*.yaml), whose gradients it can name")
    parallel = strategy.config
    dims_obj = strategy.parallel_dims(world)
    dims = {**dataclasses.asdict(dims_obj), "dp": dims_obj.dp}
    dp = dims_obj.dp
    module_path, module_kwargs, full = _model(config)
    small, notes = scaled_config(full, parallel)
    accumulate = int(trainer.accumulate_grad_batches or 1)
    micro = parallel.microbatches if parallel is not None and parallel.pp > 1 else 2
    settings = {k: trainer[k] for k in TRAINER_KEYS if trainer[k] is not None}
    if settings.get("accumulate_grad_batches") == 1:
        del settings["accumulate_grad_batches"]
    callbacks, dropped = _callbacks(trainer.callbacks or [])
    notes += [f"callback {name} not run (it only watches or writes files)" for name in dropped]
    if str(trainer.precision) != "32-true":
        notes.append(f"precision {trainer.precision} -> 32-true (the layout's maths, without bf16 rounding)")
    module = (module_path, tuple(sorted(module_kwargs.items())))
    packing, note = _packing(config.data.init_args)
    notes += [note] if note else []
    common = dict(packing=packing, strategy=partial(build_strategy, spec), model=model_args(small), steps=steps,
                  global_batch=micro * dp, trainer=settings, callbacks=(*callbacks, Meter()), module=module,
                  mutation=mutation, token_vocab=small.vocab_size)  # every row: a tp rank's vocabulary shard too
    labels = {"sgd": "SGD", "module": "the module's optimizer"}
    common.update(_chat(config.data.init_args, parallel, notes))
    cases = [Case(optimizer=o, label=f"{strategy_name}, {labels[o]}", **common) for o in optimizers]
    data = config.data.init_args
    return CheckPlan(argv=list(argv), world=world, model=full, small=small, notes=notes, parallel=parallel,
                     strategy=strategy_name, precision=str(trainer.precision), batch_size=int(data.batch_size),
                     accumulate=accumulate, dims=dims, cases=cases, nodes=int(trainer.num_nodes or 1))


def _packing(data: Namespace) -> tuple[tuple, str]:
    """The harness's `Case.packing` for the user's data settings, and the report's line on it."""
    if not data.get("document_mask"):
        return (), ""
    reset = bool(data.get("position_reset"))
    return (DOCUMENT_EOS, reset), (f"document_mask: rows packed with documents of ~5 tokens (every token drawn as a "
                                   f"multiple of 5 is EOS id {DOCUMENT_EOS}), attention masked at them on both sides"
                                   + (", RoPE positions reset per document" if reset else ""))


def _chat(data: Namespace, parallel: ParallelConfig, notes: list[str]) -> dict[str, Any]:
    """The harness's loss masks (and packed conversations) for chat data, with the report's line; {} for text."""
    if data.get("format") != "chat":
        return {}
    if parallel is not None and parallel.pp > 1:  # as `LanguageModel.setup` refuses the run itself
        raise ConfigError("data.init_args.format chat under pipeline parallelism: loss masks are not built for the "
                          "pipeline's schedule yet; check (and run) chat data with dp, ZeRO, tp, cp or ep")
    packed = data.get("packed", True)
    notes.append(f"format chat: loss masks on the check's rows (targets whose id is a multiple of {CHAT_MASK} not "
                 "trained on), the loss per target of the global batch" + (
                     f"; conversations packed (~5 tokens, ended by id {CHAT_EOS}), attention masked at them" if packed
                     else ""))
    return dict(loss_mask=CHAT_MASK, **({"packing": (CHAT_EOS, False)} if packed else {}))


def _world(trainer: Namespace) -> int:
    devices, nodes = trainer.devices, int(trainer.num_nodes or 1)
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    if not isinstance(devices, int) and not str(devices).isdigit():
        raise ConfigError(f"trainer.devices={devices!r}: the check needs a number of ranks (--trainer.devices N)")
    world = int(devices) * nodes
    if world < 2:
        raise ConfigError(f"trainer.devices x num_nodes = {world}: one process has nothing to compare with one "
                          "process; give the run's device count (--trainer.devices N)")
    return world


def _strategy(value: Any) -> tuple[Any, str, Any]:
    """(what a rank builds it from, its name in the yaml, an instance built here: validates the arguments)."""
    if isinstance(value, str):
        if value in ("auto", "single_device"):
            raise ConfigError(f"trainer.strategy={value!r}: name the run's strategy (configs/strategies/*.yaml)")
        from lightning.pytorch.strategies import StrategyRegistry

        return value, value, StrategyRegistry.get(value)
    if isinstance(value, Namespace):
        init = {k: v for k, v in (value.init_args or Namespace()).as_dict().items() if v is not None}
        spec = (value.class_path, init)
        return spec, value.class_path.rpartition(".")[2], build_strategy(spec)
    raise ConfigError(f"trainer.strategy: give it in the yaml (a name or class_path/init_args), not {type(value)}")


def _model(config: Namespace) -> tuple[str, dict[str, Any], ModelConfig]:
    """The user's module class path, its arguments but the config, and the config the class resolves (built here:
    a LanguageModel builds no weights before `configure_model`)."""
    model = config.model
    kwargs = model.init_args.as_dict() if model.init_args is not None else {}
    data = config.data.init_args  # the vocabulary as `fit` links it: the tokenizer's with a tokenizer_dir
    cfg = dict(kwargs.get("config") or {}, vocab_size=model_vocab_size(data.vocab_size, data.get("tokenizer_dir"),
                                                                       data.get("sources")),
               max_seq_len=data.seq_len)
    module = _import(model.class_path)(**{**kwargs, "config": ModelConfig(**cfg)})
    kept = {k: v for k, v in kwargs.items() if k not in MODEL_ARGS_DROPPED}
    return model.class_path, kept, module.config


def _callbacks(values: list[Any]) -> tuple[list[L.Callback], list[str]]:
    kept, dropped = [], []
    for value in values:
        if not isinstance(value, Namespace):
            raise ConfigError("trainer.callbacks: give each as class_path/init_args in the yaml")
        cls = _import(value.class_path)
        name = value.class_path.rpartition(".")[2]
        if issubclass(cls, WATCHERS) or value.class_path.startswith(WATCHER_PATHS):
            dropped.append(name)
            continue
        kwargs = (value.init_args or Namespace()).as_dict()
        kept.append(cls(**_retimed(kwargs)))
    return kept, dropped


def _retimed(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A step-scheduled callback's settings moved to step 0 (start and end), every step."""
    out = dict(kwargs)
    for key, value in kwargs.items():
        if (key.endswith("start_step") or key.endswith("end_step")) and value is not None:
            out[key] = 0
        elif key == "frequency" and value is not None:
            out[key] = 1
    return out


def _import(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)
