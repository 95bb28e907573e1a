"""What the offline tools (ptq.py, sensitivity.py) share: a trained checkpoint as a model, the run's data module
(settings and tokenizer from the checkpoint; a `--config` may only agree with it), batches drawn without loading a
whole split, and the validation loss they compare."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lit_lm.checkpoints import check_config, data_from_checkpoint, read_checkpoint  # noqa: E402
from lit_lm.config import ConfigError  # noqa: E402
from lit_lm.data.datamodule import TextDataModule  # noqa: E402
from lit_lm.module import LanguageModel  # noqa: E402
from lit_lm.moved import load_yaml  # noqa: E402


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A plain checkpoint dict from a single-file Lightning checkpoint or a lit-lm sharded directory."""
    return read_checkpoint(path)


def build_model(ckpt: dict[str, Any], **overrides: Any) -> LanguageModel:
    """The checkpoint's LanguageModel with its weights (hyper-parameters overridden by `overrides`), in eval mode."""
    module = LanguageModel(**{**ckpt["hyper_parameters"], **overrides})
    module.configure_model()
    module.load_state_dict(ckpt["state_dict"])
    return module.eval()


def data_module(ckpt: dict[str, Any], configs: Optional[list[Path]] = None) -> TextDataModule:
    """The checkpoint's data module (its run's settings and tokenizer), set up. Each of `configs` (optional) must
    agree with the checkpoint (else a one-line ConfigError names the field); its batch_size and data_dir apply."""
    overrides: dict[str, Any] = {}
    for path in configs or []:
        config = load_yaml(Path(path).read_text()) or {}
        check_config(ckpt, config, str(path))
        data = (config.get("data") or {}).get("init_args") or {}
        overrides.update({k: data[k] for k in ("batch_size", "data_dir") if k in data})
    return data_from_checkpoint(ckpt, **overrides)


def batches(dataset: Any, batch_size: int, n: int, shuffle: bool = True, flag: str = "batches"
            ) -> list[torch.Tensor]:
    """`n` batches in a seeded random order (or in order), reading only the windows they hold; at most as many as
    the split holds (said in one line on stderr; a split smaller than one batch is refused in one line). `flag`:
    the option that asked for `n`, named in those lines."""
    held = len(dataset) // batch_size
    if held == 0:
        raise ConfigError(f"{flag} {n}: the split holds {len(dataset)} windows, fewer than one batch of "
                          f"{batch_size}; lower data.init_args.batch_size (--config) or train on more data")
    if n > held:
        print(f"[offline] {flag} {n}: the split holds {held} batches of {batch_size} ({len(dataset)} windows): "
              f"using {held}", file=sys.stderr, flush=True)
        n = held
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)) if shuffle \
        else torch.arange(len(dataset))
    picks = order[: n * batch_size].view(-1, batch_size)
    return [torch.stack([dataset[int(i)] for i in rows]) for rows in picks]


@torch.no_grad()
def val_loss(module: LanguageModel, windows: list[torch.Tensor]) -> float:
    """Mean next-token cross-entropy over equal-sized batches of (B, T+1) windows."""
    module.eval()
    return sum(float(module.model.loss(b[:, :-1], b[:, 1:])[1]) for b in windows) / len(windows)
