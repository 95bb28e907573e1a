"""Checkpoints as a user moves them around: where a run keeps them, which one `last` is, reading any of them on
one process, and refusing one whose model differs from the config. A Hugging Face model folder is accepted
wherever a checkpoint is (`lit_lm.hf.importer`): read as a checkpoint dict, and as `--ckpt_path` of a run its weights
start the run (`init_from`).

Two formats exist: a single `torch.save` file (Lightning's own strategies) and a sharded directory (lit-lm's
strategies, `lit_lm/strategies/checkpoint.py`). Both hold the model's hyper-parameters, the data module's settings
(`datamodule_hyper_parameters`, saved by the CLI) and its state, which includes the tokenizer, so a checkpoint
alone is enough to generate text or to rebuild the run's data (`data_from_checkpoint`) for the offline tools.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import uuid
import zipfile
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info

from lit_lm.config import ConfigError, ModelConfig
from lit_lm.hf import importer
from lit_lm.data.datamodule import TextDataModule
from lit_lm.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_from_state
from lit_lm.strategies import checkpoint as sharded
from lit_lm.strategies import safe_load

CHECKPOINTS = "checkpoints"  # <default_root_dir>/checkpoints: one folder per run, the same across restarts
DATA_SETTINGS = "datamodule_hyper_parameters"  # Lightning's key for the data module's init args
# The data settings that decide which tokens the model sees and in which windows: a config that sets one of them
# to another value than the run's would evaluate the model on other data (or other token ids), so it is refused.
# The rest (batch_size, data_dir, seed, workers) only say how to read the same data and may be overridden.
DATA_IDENTITY = ("files", "text_field", "vocab_size", "seq_len", "val_fraction", "corpus_mb", "tokenizer_dir",
                 "skip_missing_text")
PathLike = Union[str, Path]


def find_last(*folders: PathLike, resumable: bool = False) -> Optional[Path]:
    """The newest complete checkpoint in `folders`: sharded directories count once their `COMPLETE` marker is
    written, single files are written atomically (`AtomicCheckpointIO`), leftovers of crashed saves never count.
    Newest by the time it was completed, so a kill while `last.ckpt` is written resumes from the step before.
    `resumable` (a fit's `--ckpt_path last`): only one with optimizer state, not a weights-only save beside it."""
    done: dict[Path, float] = {}
    for path in (p for folder in map(Path, folders) if folder.is_dir() for p in folder.iterdir()):
        if path.suffix != ".ckpt":  # also skips *.tmp-<id> and *.old-<id> leftovers
            continue
        if sharded.is_sharded_checkpoint(path):
            if (path / sharded.COMPLETE).is_file():
                done[path] = (path / sharded.COMPLETE).stat().st_mtime
        elif path.is_file():
            done[path] = path.stat().st_mtime
    newest_first = sorted(done, key=lambda p: (done[p], p.name.startswith("last")), reverse=True)
    return next((p for p in newest_first if not resumable or _has_optimizer_state(p)), None)


def _has_optimizer_state(path: Path) -> bool:
    """Whether a complete checkpoint holds optimizer state (its marker says; a single file's keys, read without
    its tensors). One that cannot be read counts: loading it says what is wrong."""
    if path.is_dir():
        return sharded.check_complete(path).get("optimizers", 1) > 0  # markers before the count: full saves
    try:
        return bool(safe_load.load(path, mmap=True).get("optimizer_states"))
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, RuntimeError, OSError, ValueError):
        return True


def prepare_run(trainer: Trainer, ckpt_path: Optional[str], module: Any, fitting: bool = False) -> Optional[str]:
    """Give the trainer's checkpoint callbacks their stable folder, let its strategy read and atomically write
    any format, resolve `ckpt_path` (`last` = the newest complete checkpoint, or a fresh start when there is
    none), let `module` take the checkpoint's values of the config fields it left to derivation
    (`adopt_checkpoint_config`) and refuse a checkpoint of another model; a fresh fit says which earlier
    checkpoints it will replace. Returns the path to load."""
    folder = Path(trainer.default_root_dir) / CHECKPOINTS
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
            callback.dirpath = str(folder.resolve())
    if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
        trainer.strategy.checkpoint_io = AtomicCheckpointIO()
    if ckpt_path == "last":
        folders = {c.dirpath for c in trainer.checkpoint_callbacks if getattr(c, "dirpath", None)} or {str(folder)}
        last = find_last(*folders, resumable=fitting)  # a fit resumes the optimizers: not a weights-only save
        full = " with optimizer state" if fitting else ""
        rank_zero_info(f"[lit-lm] --ckpt_path last: resuming from {last}" if last else
                       f"[lit-lm] --ckpt_path last: no complete checkpoint{full} in {', '.join(sorted(folders))}; "
                       "starting from step 0")
        ckpt_path = None if last is None else str(last)
    if ckpt_path is not None and importer.is_hf_folder(ckpt_path) and hasattr(module, "start_from"):
        rank_zero_info(f"[lit-lm] --ckpt_path {ckpt_path} is a Hugging Face model: its weights start the run "
                       "(model.init_args.init_from: a fresh optimizer at step 0; nothing to resume)")
        module.start_from(ckpt_path)
        return None
    if ckpt_path is None and fitting:
        _say_what_a_fresh_run_replaces(trainer)
    config = getattr(module, "config", None)
    if ckpt_path is not None and isinstance(config, ModelConfig) and ckpt_path not in ("best", "hpc"):
        saved = read_hyper_parameters(ckpt_path).get("config")
        if saved is not None and hasattr(module, "adopt_checkpoint_config"):
            module.adopt_checkpoint_config(saved)
        check_architecture(ckpt_path, module.config)
    return ckpt_path


def _say_what_a_fresh_run_replaces(trainer: Trainer) -> None:
    """A fresh fit into a folder that holds an earlier run's checkpoints writes over them (`last.ckpt`, the same
    step names): said in one line, with how to keep them, before any step runs."""
    folders = sorted({c.dirpath for c in trainer.checkpoint_callbacks if getattr(c, "dirpath", None)})
    last = find_last(*folders)
    if last is not None:
        rank_zero_info(f"[lit-lm] {last.parent} holds an earlier run's checkpoints (newest {last.name}): this run "
                       "starts from step 0 and replaces them as it saves; to continue that run pass --ckpt_path "
                       "last, to keep both set --trainer.default_root_dir runs/<name>")


def read_checkpoint(path: PathLike) -> dict[str, Any]:
    """Any lit-lm checkpoint (or Hugging Face model folder) as Lightning's checkpoint dict with whole tensors, on
    one process."""
    path = Path(path)
    _check_is_checkpoint(path)
    if importer.is_hf_folder(path):
        return _with_hf_tokenizer(importer.as_checkpoint(path), path)
    if path.is_dir():
        return sharded.read_whole(path)
    try:
        return safe_load.load(path)
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, RuntimeError) as e:
        raise _not_a_checkpoint(path, str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def _with_hf_tokenizer(checkpoint: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A Hugging Face folder's tokenizer where a checkpoint keeps its data module's (`tokenizer_from`), if it has
    one."""
    if (folder / "tokenizer.json").is_file():
        checkpoint["hf_tokenizer"] = {"tokenizer": load_tokenizer(folder, "--ckpt_path").state_dict()}
    return checkpoint


def _not_a_checkpoint(path: Path, why: str) -> ConfigError:
    return ConfigError(f"{path} is not a checkpoint: {why} (ckpt_path); give a .ckpt file or directory a run "
                       f"wrote under <default_root_dir>/{CHECKPOINTS}/, or `last`")


def _check_is_checkpoint(path: Path) -> None:
    if not path.exists():
        raise ConfigError(f"checkpoint {path} does not exist (ckpt_path); give a .ckpt file or directory a run "
                          f"wrote under <default_root_dir>/{CHECKPOINTS}/, or `last`")
    if path.is_dir() and not sharded.is_sharded_checkpoint(path) and not importer.is_hf_folder(path):
        raise _not_a_checkpoint(path, f"a directory without {sharded.META}, nor a Hugging Face model folder "
                                      "(config.json and *.safetensors)")
    if path.is_file() and not zipfile.is_zipfile(path):
        raise _not_a_checkpoint(path, "not a file torch.save wrote")


def read_hyper_parameters(path: PathLike) -> dict[str, Any]:
    """The model's hyper-parameters without reading the tensors (memory-mapped for a file)."""
    return read_meta(path).get("hyper_parameters", {})


def read_meta(path: PathLike) -> dict[str, Any]:
    """Everything of a checkpoint but its tensors' data, cheaply: a directory's `meta.pt`, or a file loaded
    memory-mapped (its tensors are not read until used)."""
    path = Path(path)
    _check_is_checkpoint(path)
    if importer.is_hf_folder(path):
        return importer.as_meta(path)
    if path.is_dir():
        return sharded.read_meta(path)
    try:
        return safe_load.load(path, mmap=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, RuntimeError) as e:
        raise _not_a_checkpoint(path, str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def check_architecture(path: PathLike, config: ModelConfig) -> None:
    """Refuse a checkpoint whose model is not `config`'s (every difference listed), before any tensor loads."""
    saved = read_hyper_parameters(path).get("config")
    if saved is None:
        return  # not written by LanguageModel: nothing to compare
    differences = config.architecture_differences(ModelConfig(**saved))
    if differences:
        raise ConfigError(f"checkpoint {path} holds a different model: {'; '.join(differences)} "
                          "(model.init_args.config); use the training run's config (its config.yaml beside the "
                          "logs) or a checkpoint of this model")


def model_state_dict(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The `Transformer`'s state dict from a LightningModule checkpoint (any strategy's)."""
    state = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
    return with_tied_head(state, checkpoint["hyper_parameters"]["config"]["tie_embeddings"])


def with_tied_head(state: dict[str, Any], tied: bool, prefix: str = "") -> dict[str, Any]:
    """A tied head is the embedding: sharded checkpoints store it once, under its first name."""
    head, embedding = f"{prefix}lm_head.weight", f"{prefix}tok_embeddings.weight"
    if tied and head not in state and embedding in state:
        state[head] = state[embedding]
    return state


def tokenizer_from(checkpoint: dict[str, Any]) -> Tokenizer:
    """The tokenizer the data module stored in the checkpoint (see `TextDataModule.state_dict`)."""
    for value in checkpoint.values():
        if isinstance(value, dict) and isinstance(value.get("tokenizer"), dict):
            return tokenizer_from_state(value["tokenizer"], "the checkpoint's tokenizer")
    raise ConfigError("the checkpoint holds no tokenizer (it predates lit-lm storing one); pass --tokenizer_dir "
                      "with the run's data_dir/cache/<hash>/tokenizer")


def data_settings(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The run's data module init args. Checkpoints written before the CLI saved them hold only what the model
    shares with the data (the vocabulary and the window length); the other settings take their defaults."""
    saved = checkpoint.get(DATA_SETTINGS)
    if saved:
        return dict(saved)
    config = checkpoint.get("hyper_parameters", {}).get("config", {})
    return {k: config[m] for k, m in (("vocab_size", "vocab_size"), ("seq_len", "max_seq_len")) if m in config}


def check_config(checkpoint: dict[str, Any], config: dict[str, Any], source: str) -> None:
    """Refuse a config (a parsed yaml: `model:` and `data:` sections) that disagrees with the checkpoint, in one
    line naming the first field that differs."""
    saved = data_settings(checkpoint)
    data = ((config.get("data") or {}).get("init_args") or {})
    for name in DATA_IDENTITY:
        if name in data and name in saved and data[name] != saved[name]:
            raise ConfigError(f"{source} sets {name}={data[name]!r} but the checkpoint's run used {saved[name]!r} "
                              f"(data.init_args.{name}); drop the config (the checkpoint has the run's settings) "
                              "or give the run's own config")
    model = (((config.get("model") or {}).get("init_args") or {}).get("config") or {})
    stored = checkpoint.get("hyper_parameters", {}).get("config", {})
    for name in (n for n in model if n in stored and n != "max_seq_len" and model[n] != stored[n]):
        raise ConfigError(f"{source} sets {name}={model[name]!r} but the checkpoint's model has {stored[name]!r} "
                          f"(model.init_args.config.{name}); drop the config (the checkpoint has the run's model) "
                          "or give the run's own config")


def data_from_checkpoint(checkpoint: dict[str, Any], **overrides: Any) -> TextDataModule:
    """The run's data module, set up, with the checkpoint's tokenizer: its settings from the checkpoint
    (`overrides` may change how the data is read, e.g. batch_size or data_dir). When the run's token cache is
    gone or was made by another tokenizer (the corpus changed), the corpus is tokenized again with the
    checkpoint's tokenizer, saved under `data_dir/checkpoint_tokenizers/<hash>` (once per tokenizer)."""
    wrong = [k for k in overrides if k in DATA_IDENTITY and k != "tokenizer_dir"]
    if wrong:
        raise ConfigError(f"{wrong[0]} is the checkpoint's (data.init_args.{wrong[0]}); it cannot be overridden")
    settings = {**data_settings(checkpoint), **overrides}
    data = TextDataModule(**settings)
    tokenizer = _stored_tokenizer(checkpoint)
    if tokenizer is not None and not _cache_has(data, tokenizer):
        state = tokenizer.state_dict()
        digest = hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()[:16]
        folder = data.data_dir / "checkpoint_tokenizers" / digest
        if not (folder / "tokenizer.json").is_file():
            tokenizer.save(folder)
        data = TextDataModule(**{**settings, "tokenizer_dir": str(folder)})
    data.setup("fit")
    return data


def _stored_tokenizer(checkpoint: dict[str, Any]) -> Optional[Tokenizer]:
    try:
        return tokenizer_from(checkpoint)
    except ConfigError:
        return None  # an old checkpoint: the data's own tokenizer it is


def _cache_has(data: TextDataModule, tokenizer: Tokenizer) -> bool:
    """Whether the data module's token cache exists and was written with `tokenizer`."""
    if data.tokenizer_dir is not None and not (Path(data.tokenizer_dir) / "tokenizer.json").is_file():
        return False  # the run's tokenizer folder is gone (before cache_dir, which reads it)
    cache = data.cache_dir
    folder = Path(data.tokenizer_dir) if data.tokenizer_dir is not None else cache / "tokenizer"
    if not (cache / "tokens.json").is_file() or not (folder / "tokenizer.json").is_file():
        return False
    return load_tokenizer(folder).state_dict() == tokenizer.state_dict()


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's single-file checkpoints, written to `<path>.tmp-<id>` and renamed into place (a killed save
    never leaves a half-written `last.ckpt`), and able to read a sharded directory, so the plain single-device
    strategy resumes from a checkpoint written by any lit-lm strategy."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: PathLike, storage_options: Optional[Any] = None
                        ) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        sharded.remove_stale(path.parent)
        tmp = path.with_name(f"{path.name}{sharded.TMP}{uuid.uuid4().hex[:8]}")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        if path.is_dir():  # a sharded checkpoint of the same name (an earlier run under another strategy)
            sharded.remove(path)
        os.replace(tmp, path)

    def load_checkpoint(self, path: PathLike, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Either format, read safely whatever `weights_only` says (`lit_lm/strategies/safe_load.py`)."""
        if Path(path).is_dir():
            return sharded.read_whole(path)
        return safe_load.load(path, map_location=map_location or "cpu")

    def remove_checkpoint(self, path: PathLike) -> None:
        sharded.remove(path)
