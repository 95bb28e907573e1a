"""gpt-oss's expert tensors (transformers `GptOssExperts`) as lit-lm's stacked experts, both ways, and MXFP4.

gpt-oss stores each MoE layer's experts fused and transposed (x @ W), gate and up interleaved by column:

    gate_up_proj (E, d, 2I):   w_gate[e] = gate_up_proj[e][:, 0::2]^T,  w_up[e] = gate_up_proj[e][:, 1::2]^T
    gate_up_proj_bias (E, 2I): gate_bias = [:, 0::2],  up_bias = [:, 1::2]
    down_proj (E, I, d):       w_down[e] = down_proj[e]^T;   down_proj_bias (E, d) = down_bias

The released weights store gate_up_proj and down_proj in MXFP4 (OCP microscaling): `<name>_blocks` (E, rows, G, 16)
uint8, two e2m1 values a byte (low nibble first), and `<name>_scales` (E, rows, G) uint8, an e8m0 exponent per
block of 32 values: value = e2m1 * 2^(scale - 127), rows the *output* features (the transposed layout: (E, 2I, d)
for gate_up, (E, d, I) for down), as transformers' `convert_moe_packed_tensors` decodes them. The import
dequantizes (exactly: every value is a float32) the rows and blocks it needs only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch import Tensor

from lit_lm.config import ConfigError

# e2m1: sign bit, 2 exponent bits, 1 mantissa bit -> these 16 values (transformers' FP4_VALUES)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per e8m0 scale

# lit-lm's expert parameter -> (gpt-oss tensor under model.layers.<i>.mlp.experts., its part)
PARTS = {"w_gate": ("gate_up_proj", "even"), "w_up": ("gate_up_proj", "odd"), "w_down": ("down_proj", "all"),
         "gate_bias": ("gate_up_proj_bias", "even"), "up_bias": ("gate_up_proj_bias", "odd")}

Reader = Callable[[str, tuple[slice, ...]], Tensor]  # (tensor name in the files, index) -> that slice


def dequantize_mxfp4(blocks: Tensor, scales: Tensor) -> Tensor:
    """(..., G, 16) uint8 blocks and (..., G) uint8 scales -> (..., G * 32) fp32 values."""
    lut = torch.tensor(E2M1, dtype=torch.float32)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # low nibble first
    values = values.reshape(*blocks.shape[:-1], BLOCK)
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.reshape(*blocks.shape[:-2], -1)


def quantize_mxfp4(values: Tensor) -> tuple[Tensor, Tensor]:
    """The inverse for values that are exactly e2m1 * 2^(s - 127) with one s per block of 32 (tests): (..., n)
    -> blocks (..., n / 32, 16) uint8, scales (..., n / 32) uint8. The scale is the block's largest exponent that
    makes every value an e2m1 number; a value that is not is refused."""
    blocks = values.float().reshape(*values.shape[:-1], -1, BLOCK)
    top = blocks.abs().amax(-1).clamp(min=2.0 ** -126)
    scales = (torch.floor(torch.log2(top)) - 2).clamp(-127, 127)  # 6 = 1.5 * 2^2: the largest magnitude
    lut = torch.tensor(E2M1)
    scaled = blocks / torch.exp2(scales).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(-1)
    if not torch.equal(lut[codes] * torch.exp2(scales).unsqueeze(-1), blocks):
        raise ValueError("values are not e2m1 numbers times one power of two per block of 32")
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (scales + 127).to(torch.uint8)


@dataclass(frozen=True)
class FusedSource:
    """Where a lit-lm expert parameter lives in a gpt-oss checkpoint: `part` of the fused tensor `tensor`."""

    tensor: str  # e.g. model.layers.0.mlp.experts.gate_up_proj
    part: str  # even, odd (the interleaved gate / up columns) or all
    transposed: bool  # a weight (stored x @ W): its last two dims swapped; a bias is not

    def files(self, available: set[str]) -> list[str]:
        """The tensors of the files this parameter is read from: the tensor itself, or its MXFP4 blocks and scales
        (a blocks tensor without its scales refused)."""
        if self.tensor in available or not self.transposed:
            return [self.tensor]
        blocks, scales = f"{self.tensor}_blocks", f"{self.tensor}_scales"
        if blocks in available and scales not in available:
            raise ConfigError(f"{blocks} is MXFP4 but the files hold no {scales} to dequantize it "
                              "(model.init_args.init_from)")
        return [blocks, scales] if blocks in available else [self.tensor]

    def read(self, read: Reader, available: set[str], shape: torch.Size, index: tuple[slice, ...]) -> Tensor:
        """`global[index]` of the lit-lm parameter of `shape`, reading only the rows (and MXFP4 blocks) it needs."""
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        spans = [range(n)[i] for n, i in zip(shape, index)]
        experts = slice(spans[0].start, spans[0].stop)
        if not self.transposed:  # a bias (E, 2I) or (E, d): features last
            return read(self.tensor, (experts, self._features(spans[1])))
        out_rows, in_cols = spans[1], spans[2]  # lit-lm's (E, out, in)
        if self.tensor in available:  # stored (E, in, out): in_cols x this part's out columns, then swapped
            return read(self.tensor, (experts, slice(in_cols.start, in_cols.stop), self._features(out_rows))
                        ).transpose(-1, -2)
        first, last = in_cols.start // BLOCK, -(-in_cols.stop // BLOCK)  # MXFP4 (E, out, G, 16): whole blocks
        rows = self._features(out_rows)
        blocks = read(f"{self.tensor}_blocks", (experts, rows, slice(first, last)))
        scales = read(f"{self.tensor}_scales", (experts, rows, slice(first, last)))
        return dequantize_mxfp4(blocks, scales)[..., in_cols.start - first * BLOCK: in_cols.stop - first * BLOCK]

    def _features(self, features: range) -> slice:
        """Where lit-lm's `features` are in the fused tensor's feature dim: every other one when interleaved (a
        strided read: only this part's bytes)."""
        if self.part == "all":
            return slice(features.start, features.stop)
        odd = self.part == "odd"
        return slice(2 * features.start + odd, 2 * features.stop, 2)


def fused_source(layer: str, param: str) -> FusedSource:
    tensor, part = PARTS[param]
    return FusedSource(f"model.layers.{layer}.mlp.experts.{tensor}", part, not tensor.endswith("_bias"))


def fuse(parts: dict[str, Tensor]) -> dict[str, Tensor]:
    """The export: lit-lm's stacked expert parameters of one layer (by name: w_gate, ...) -> gpt-oss's tensors
    (names relative to the layer's mlp.experts.), unquantized."""
    def interleave(even: Tensor, odd: Tensor) -> Tensor:
        return torch.stack([even, odd], dim=-1).flatten(-2)

    return {"gate_up_proj": interleave(parts["w_gate"].transpose(-1, -2), parts["w_up"].transpose(-1, -2)),
            "gate_up_proj_bias": interleave(parts["gate_bias"], parts["up_bias"]),
            "down_proj": parts["w_down"].transpose(-1, -2)}


@dataclass(frozen=True)
class GptOssExperts:
    """A gpt-oss MoE layer's names (`lit_lm.hf.families.Experts`' interface): the router `mlp.router` (weight and
    bias), the experts fused (`FusedSource`), the down projection's bias as it is."""

    bias: Optional[str] = None  # no selection bias (lit-lm's expert_bias buffer): exported only while zero

    def names(self, layer: str, param: str, n_experts: int) -> Union[str, FusedSource]:
        if param in ("router.weight", "router.bias"):
            return f"model.layers.{layer}.mlp.{param}"
        if param == "experts.down_bias":
            return f"model.layers.{layer}.mlp.experts.down_proj_bias"
        kind = param.removeprefix("experts.")
        if not param.startswith("experts.") or kind not in PARTS:
            raise KeyError(param)
        return fused_source(layer, kind)
