"""Checkpoints as a user moves them around: where a run keeps them, which one `last` is, reading any of them on
one process, and refusing one whose model differs from the config.

Two formats exist: a single `torch.save` file (Lightning's own strategies) and a sharded directory (lit-lm's
strategies, `strategies/checkpoint.py`). Both hold the model's hyper-parameters and the data module's state,
which includes the tokenizer, so a checkpoint alone is enough to generate text.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info

from lit_lm.config import ConfigError, ModelConfig
from lit_lm.tokenizer import BPETokenizer
from strategies import checkpoint as sharded

CHECKPOINTS = "checkpoints"  # <default_root_dir>/checkpoints: one folder per run, the same across restarts
PathLike = Union[str, Path]


def find_last(*folders: PathLike) -> Optional[Path]:
    """The newest complete checkpoint in `folders`: sharded directories count once their `COMPLETE` marker is
    written, single files are written atomically (`AtomicCheckpointIO`), leftovers of crashed saves never count.
    Newest by the time it was completed, so a kill while `last.ckpt` is written resumes from the step before."""
    done: dict[Path, float] = {}
    for path in (p for folder in map(Path, folders) if folder.is_dir() for p in folder.iterdir()):
        if path.suffix != ".ckpt":  # also skips *.tmp-<id> and *.old-<id> leftovers
            continue
        if sharded.is_sharded_checkpoint(path):
            if (path / sharded.COMPLETE).is_file():
                done[path] = (path / sharded.COMPLETE).stat().st_mtime
        elif path.is_file():
            done[path] = path.stat().st_mtime
    return max(done, key=lambda p: (done[p], p.name.startswith("last"))) if done else None


def prepare_run(trainer: Trainer, ckpt_path: Optional[str], config: Optional[ModelConfig]) -> Optional[str]:
    """Give the trainer's checkpoint callbacks their stable folder, let its strategy read and atomically write
    any format, resolve `ckpt_path` (`last` = the newest complete checkpoint, or a fresh start when there is
    none) and refuse a checkpoint of another model. Returns the path to load."""
    folder = Path(trainer.default_root_dir) / CHECKPOINTS
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
            callback.dirpath = str(folder.resolve())
    if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
        trainer.strategy.checkpoint_io = AtomicCheckpointIO()
    if ckpt_path == "last":
        folders = {c.dirpath for c in trainer.checkpoint_callbacks if getattr(c, "dirpath", None)} or {str(folder)}
        last = find_last(*folders)
        rank_zero_info(f"[lit-lm] --ckpt_path last: resuming from {last}" if last else
                       f"[lit-lm] --ckpt_path last: no complete checkpoint in {', '.join(sorted(folders))}; "
                       "starting from step 0")
        ckpt_path = None if last is None else str(last)
    if ckpt_path is not None and config is not None and ckpt_path not in ("best", "hpc"):
        check_architecture(ckpt_path, config)
    return ckpt_path


def read_checkpoint(path: PathLike) -> dict[str, Any]:
    """Any lit-lm checkpoint as Lightning's checkpoint dict with whole tensors, on one process."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"checkpoint {path} does not exist (ckpt_path); give a .ckpt file or directory a run "
                          f"wrote under <default_root_dir>/{CHECKPOINTS}/, or `last`")
    if path.is_dir():
        return sharded.read_whole(path)
    return torch.load(path, map_location="cpu", weights_only=False)


def read_hyper_parameters(path: PathLike) -> dict[str, Any]:
    """The model's hyper-parameters without reading the tensors (memory-mapped for a file)."""
    path = Path(path)
    if sharded.is_sharded_checkpoint(path):
        return sharded.read_meta(path).get("hyper_parameters", {})
    if not path.is_file():
        return read_checkpoint(path)  # raises with the message for a missing or foreign path
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True).get("hyper_parameters", {})


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


def tokenizer_from(checkpoint: dict[str, Any]) -> BPETokenizer:
    """The tokenizer the data module stored in the checkpoint (see `TextDataModule.state_dict`)."""
    for value in checkpoint.values():
        if isinstance(value, dict) and isinstance(value.get("tokenizer"), dict):
            return BPETokenizer.from_state_dict(value["tokenizer"], "the checkpoint's tokenizer")
    raise ConfigError("the checkpoint holds no tokenizer (it predates lit-lm storing one); pass --tokenizer_dir "
                      "with the run's data_dir/cache/<hash>/tokenizer")


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
        if Path(path).is_dir():
            return sharded.read_whole(path)
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: PathLike) -> None:
        sharded.remove(path)
