"""`lit-lm fit|validate|test|predict`: LightningCLI with the model and the data in subclass mode;
`lit-lm generate` (lit_lm/generate.py) streams text from a checkpoint; `lit-lm check` (lit_lm/check/) trains the
run's layout against one process for a few steps before it spends cluster time.

Errors in the configuration or the input print one line (`lit-lm: error: ...`); `--debug` shows the traceback.

`lit-lm fit` with no `--config` runs `configs/default.yaml`; more `--config` fragments compose on top of it
(later files win; lists such as callbacks are replaced unless a fragment uses jsonargparse's `callbacks+:` form).
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any, NoReturn, Optional

from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lit_lm.strategies.registry  # noqa: F401  (registers lm_ddp, zero1/2/3, ... by name before any Trainer is built)
from lit_lm.strategies import preemption
from lit_lm import generate
from lit_lm.callbacks.throughput import Throughput
from lit_lm.checkpoints import prepare_run
from lit_lm.config_keys import config_files, unknown_keys
from lit_lm.data.datamodule import TextDataModule, model_vocab_size
from lit_lm.errors import (EXIT_CODE, check_trainer_config, config_error, pop_debug_flag, reporting_errors,
                           stop_other_ranks)
from lit_lm.module import LanguageModel
from lit_lm.moved import current_argv, parser_mode
from lit_lm.quiet import silence_known_noise

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
SUBCOMMANDS = ("fit", "validate", "test", "predict")
_DATA_FIELDS = tuple(inspect.signature(TextDataModule.__init__).parameters)[1:]


class ReportingParser(LightningArgumentParser):
    """Fit's parser, whose error caused by a lit-lm `ConfigError` (in a link's compute_fn, ...) is that error, for
    `reporting_errors`' one line instead of jsonargparse's usage text."""

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        cause = config_error(ex) if ex is not None else None
        if cause is not None:
            raise cause
        super().error(message, ex)


class LitLMCLI(LightningCLI):
    @staticmethod
    def parser_kwargs(defaults: list[str], subcommands: tuple[str, ...] = ()) -> dict[str, Any]:
        """The parsers' settings: `defaults` read first; old class paths in any yaml read as today's (`lit_lm.moved`,
        set on the main parser too: it loads the subcommands' values in its own mode)."""
        one = {"default_config_files": defaults, "parser_mode": parser_mode()}
        return {"parser_mode": parser_mode(), **{cmd: one for cmd in subcommands}} if subcommands else one

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        self.parser_class = ReportingParser
        return super().init_parser(**kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # One vocabulary and one context length: the data decides (a given tokenizer's size), the model follows.
        parser.link_arguments(("data.init_args.vocab_size", "data.init_args.tokenizer_dir", "data.init_args.sources"),
                              "model.init_args.config.vocab_size", compute_fn=model_vocab_size)
        parser.link_arguments("data.init_args.seq_len", "model.init_args.config.max_seq_len")

    def before_instantiate_classes(self) -> None:
        """Route the default loggers into `trainer.default_root_dir`, so one directory holds every output: CSV
        (`lightning_logs/version_N/metrics.csv`) and TensorBoard (`tensorboard/version_N`)."""
        cfg = self.config[self.subcommand].trainer
        check_trainer_config(cfg)
        if cfg.logger in (None, True):
            root = cfg.default_root_dir or "."
            cfg.logger = [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": root}},
                          {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                           "init_args": {"save_dir": root, "name": "tensorboard", "default_hp_metric": False}}]

    def instantiate_classes(self) -> None:
        """Also keep the data module's settings in every checkpoint (`datamodule_hyper_parameters`), so the
        offline tools rebuild the run's data from the checkpoint alone (`lit_lm.checkpoints.data_from_checkpoint`);
        not logged (the config.yaml beside the logs has them). Every run measures tokens/s, MFU and peak memory:
        a `Throughput` callback is added unless the config has one (e.g. with its `peak_flops`)."""
        super().instantiate_classes()
        add_throughput(self.trainer.callbacks)
        data = self.datamodule
        if isinstance(data, TextDataModule) and not data.hparams:  # plain types: a checkpoint loads weights_only
            values = {k: getattr(data, k) for k in _DATA_FIELDS}
            data.save_hyperparameters({k: str(v) if isinstance(v, Path) else v for k, v in values.items()},
                                      logger=False)

    def _parse_ckpt_path(self) -> None:
        """Lightning's version lets a single file's hyper-parameters replace the config (and cannot read a sharded
        directory); lit-lm instead refuses a checkpoint of another model, in `_run_subcommand`."""

    def _run_subcommand(self, subcommand: str) -> None:
        """lit-lm's checkpoint handling (`lit_lm.checkpoints.prepare_run`) and the predictions file around
        Lightning's run."""
        kwargs = self.config_init[subcommand]
        kwargs["ckpt_path"] = prepare_run(self.trainer, kwargs.get("ckpt_path"), self.model, subcommand == "fit")
        if subcommand == "predict":
            predictions = Path(self.trainer.default_root_dir) / "predictions.jsonl"
            self.trainer.callbacks.append(generate.GenerationWriter(predictions))
        try:
            super()._run_subcommand(subcommand)
        except BaseException:
            stop_other_ranks(self.trainer)  # the ranks this process launched may wait in a collective for it
            raise
        if getattr(self.trainer.strategy, "preempted", False):  # saved at a common step (strategies/preemption.py)
            sys.exit(preemption.exit_code())

    def after_fit(self) -> None:
        trainer = self.trainer
        if not trainer.is_global_zero:
            return
        ckpt = trainer.checkpoint_callback
        val = trainer.callback_metrics.get("val_loss")
        if val is not None:
            print(f"[lit-lm] final val_loss {float(val):.4f}")
        if ckpt is not None and (ckpt.last_model_path or ckpt.best_model_path):
            print(f"[lit-lm] checkpoint: {ckpt.last_model_path or ckpt.best_model_path}")


def add_throughput(callbacks: list) -> None:
    """A `Throughput` before the checkpoint callbacks (where Lightning puts a module's own callbacks), if none."""
    if not any(isinstance(c, Throughput) for c in callbacks):
        at = next((i for i, c in enumerate(callbacks) if isinstance(c, Checkpoint)), len(callbacks))
        callbacks.insert(at, Throughput())


def current_args(args: Optional[list[str]]) -> Optional[list[str]]:
    """The command line with old class paths rewritten (`lit_lm.moved`), in sys.argv too: spawned ranks re-read it."""
    if args is None:
        sys.argv[1:] = current_argv(sys.argv[1:])
        return None
    return current_argv(args)


def refuse_unknown_keys(argv: list[str], defaults: list[str]) -> None:
    """Every misspelled key of the yaml files and the dotted options, one line each, exit 2."""
    messages = unknown_keys(config_files(argv, defaults), argv)
    if messages:
        print("\n".join(f"lit-lm: error: {m}" for m in messages), file=sys.stderr, flush=True)
        sys.exit(EXIT_CODE)


def main(args: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["plan"]:  # `lit-lm plan` (lit_lm.planner.cli) is not a LightningCLI subcommand: no Trainer
        from lit_lm.planner.cli import main as plan
        return plan(argv[1:])
    silence_known_noise()
    defaults = [str(DEFAULT_CONFIG)] if DEFAULT_CONFIG.is_file() else []
    args, debug = pop_debug_flag(args)
    args = current_args(args)
    argv = sys.argv[1:] if args is None else args
    with reporting_errors(debug):
        if argv[:1] == ["generate"]:
            generate.main(argv[1:])
            return
        if argv[:1] == ["prepare"]:  # lit_lm/data/prepare.py: tokenize a corpus once into a folder fit reads
            from lit_lm.data.prepare import main as prepare

            return prepare(argv[1:])
        if argv[:1] == ["check"]:  # lit_lm/check: the run's own layout against one process, through fit's parser
            from lit_lm.check.command import main as check

            refuse_unknown_keys(argv, defaults)
            return check(argv[1:], LitLMCLI, defaults)
        if argv[:1] and argv[0] in SUBCOMMANDS:
            refuse_unknown_keys(argv, defaults)
        LitLMCLI(
            LanguageModel,
            TextDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            parser_kwargs=LitLMCLI.parser_kwargs(defaults, SUBCOMMANDS),
            args=args,
        )

if __name__ == "__main__":
    main()
