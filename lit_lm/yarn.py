"""YaRN RoPE scaling (Peng et al., 2023; gpt-oss, DeepSeek-V3): `ModelConfig.rope_scaling` with rope_type "yarn".

With base frequencies f_i = theta^(-2i/D) (i < D/2), a wave of f_i turns f_i * L / (2 pi) times over the original
context L = original_max_position_embeddings. YaRN keeps the fast waves (turning more than beta_fast times) as they
are, divides the slow ones (turning fewer than beta_slow times) by `factor`, and ramps linearly between, over the
dimension indices where those counts are reached:

    dim(r) = D * ln(L / (2 pi r)) / (2 ln theta)        low = dim(beta_fast), high = dim(beta_slow)
    ramp_i = clamp((i - low) / (high - low), 0, 1)      (floor(low), ceil(high) when `truncate`, the default)
    f'_i   = f_i / factor * ramp_i + f_i * (1 - ramp_i)

and the attention logits are sharpened by scaling cos and sin (so q and k) by the "attention factor"
m = 0.1 ln(factor) + 1 (or mscale(factor, mscale) / mscale(factor, mscale_all_dim), or `attention_factor` as given).
This is transformers' `_compute_yarn_parameters` (modeling_rope_utils), whose defaults are kept: beta_fast 32,
beta_slow 1. Computed in fp64 (transformers: fp32), like lit-lm's other tables.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: dict) -> float:
    """m, the factor cos and sin are multiplied by."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    return yarn_mscale(factor)


def yarn_frequencies(inv_freq: Tensor, head_dim: int, theta: float, scaling: dict) -> Tensor:
    """The (D/2,) frequencies f'_i of the module docstring from the plain ones `inv_freq`."""
    factor, context = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim(rotations: float) -> float:
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim(beta_fast), dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0.0, 1.0)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)
