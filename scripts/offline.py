"""What the offline tools (ptq.py, sensitivity.py) share: a trained checkpoint as a model, the run's data module,
batches drawn without loading a whole split, and the validation loss they compare."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lit_lm.data import TextDataModule  # noqa: E402
from lit_lm.module import LanguageModel  # noqa: E402
from strategies.checkpoint import is_sharded_checkpoint, to_single_file  # noqa: E402


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A plain checkpoint dict from a single-file Lightning checkpoint or a lit-lm sharded directory."""
    if is_sharded_checkpoint(path):
        with tempfile.TemporaryDirectory() as tmp:
            to_single_file(path, Path(tmp) / "model.ckpt")
            return torch.load(Path(tmp) / "model.ckpt", map_location="cpu", weights_only=False)
    return torch.load(path, map_location="cpu", weights_only=False)


def build_model(ckpt: dict[str, Any], **overrides: Any) -> LanguageModel:
    """The checkpoint's LanguageModel with its weights (hyper-parameters overridden by `overrides`), in eval mode."""
    module = LanguageModel(**{**ckpt["hyper_parameters"], **overrides})
    module.configure_model()
    module.load_state_dict(ckpt["state_dict"])
    return module.eval()


def data_module(configs: list[Path]) -> TextDataModule:
    """The data module of the run's config files (their `data.init_args`, later files win), set up: checkpoints
    keep the model's hyper-parameters, not the data's."""
    init_args: dict[str, Any] = {}
    for path in configs:
        init_args.update((yaml.safe_load(Path(path).read_text()).get("data") or {}).get("init_args") or {})
    data = TextDataModule(**init_args)
    data.setup("fit")
    return data


def batches(dataset: Any, batch_size: int, n: int, shuffle: bool = True) -> list[torch.Tensor]:
    """`n` batches in a seeded random order (or in order), reading only the windows they hold."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)) if shuffle \
        else torch.arange(len(dataset))
    picks = order[: n * batch_size].view(-1, batch_size)
    return [torch.stack([dataset[int(i)] for i in rows]) for rows in picks]


@torch.no_grad()
def val_loss(module: LanguageModel, windows: list[torch.Tensor]) -> float:
    """Mean next-token cross-entropy over equal-sized batches of (B, T+1) windows."""
    module.eval()
    return sum(float(module.model.loss(b[:, :-1], b[:, 1:])[1]) for b in windows) / len(windows)
