"""lit-lm: what is trained (model, tokenizer, data, LightningModule, CLI). How it is parallelised lives in
`lit_lm/strategies/`, kernels in `lit_lm/kernels/`, callbacks in `lit_lm/callbacks/`."""

from lit_lm.config import ConfigError, ModelConfig
from lit_lm.model import Transformer

__all__ = ["ConfigError", "ModelConfig", "Transformer"]
