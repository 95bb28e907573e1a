"""`QAT`: quantization-aware training by fake quantization, and the export to real integer weights.

Weights: symmetric int`bits` (2, 3, 4 or 8), one scale per output channel or per group of `group_size` inputs,
scale = absmax / (2^(bits-1) - 1), recomputed from the current weight at every forward. Activations (the input of
each quantized linear): int8 asymmetric per tensor, range from EMA min/max observers that stop at
`freeze_observers_step`. Both use the straight-through estimator: the rounding's gradient is taken as 1 inside
the representable range and 0 outside (torch's fake_quantize ops), so weights and activations learn to sit
where the integer grid can represent them.

No module is swapped while training: each selected linear's `forward` is overridden on the instance, so parameter
names, checkpoints and every strategy's hooks stay as they are. Under tensor parallelism a row-parallel weight's
output channel is split over tp: its per-channel absmax is all-reduced (MAX) over the group the strategy names
(`owned_weights()`); observers are reduced over every rank that runs the layer (all ranks; one pipeline stage's
under pp, where each microbatch updates them), so those ranks (and a single-process run over the same global
batch) hold the same range. The checkpoint keeps every stage's observers. `convert` replaces the linears by
`IntLinear`: packed integer weights, fp32 scales and an integer-matmul reference forward that matches the
fake-quant model.
"""

from __future__ import annotations

import math
import types
from typing import Any, Optional, Sequence

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from callbacks.compress.core import DEFAULT_EXCLUDE, all_reduce_, check_bits, layer_groups, merged_over_ranks, \
    owned_weights, pack_bits, select, unpack_bits
from lit_lm.config import ConfigError
from strategies import comm


def qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def weight_scale(w: Tensor, bits: int, group_size: Optional[int] = None,
                 group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """(out, n_groups) symmetric scales: absmax / qmax per output channel (group_size None) or input group;
    with `group`, the absmax is the MAX over that group's parts of the row (a TP row-parallel split)."""
    size = w.shape[1] if group_size is None else group_size
    amax = w.detach().float().abs().reshape(w.shape[0], -1, size).amax(-1)
    all_reduce_(amax, group, dist.ReduceOp.MAX)
    return amax.clamp(min=1e-8) / qmax(bits)


def quantize_weight(w: Tensor, scale: Tensor, bits: int) -> Tensor:
    """Integer codes in [-2^(bits-1), 2^(bits-1) - 1] (int64, the shape of w)."""
    q = torch.round(w.detach().float().reshape(*scale.shape, -1) / scale[..., None])
    return q.clamp(-qmax(bits) - 1, qmax(bits)).to(torch.int64).view(w.shape)


def fake_quant_weight(w: Tensor, scale: Tensor, bits: int) -> Tensor:
    """dequant(quant(w)) with the straight-through gradient."""
    rows = w.float().reshape(scale.numel(), -1)
    zero = torch.zeros(scale.numel(), dtype=torch.int32, device=w.device)
    fq = torch.fake_quantize_per_channel_affine(rows, scale.reshape(-1), zero, 0, -qmax(bits) - 1, qmax(bits))
    return fq.view(w.shape).to(w.dtype)


def act_qparams(lo: float, hi: float) -> tuple[float, int]:
    """uint8 asymmetric scale and zero point for the range [lo, hi] widened to contain 0 (exact zero padding)."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = max((hi - lo) / 255.0, 1e-8)
    return scale, int(min(max(round(-lo / scale), 0), 255))


def fake_quant_act(x: Tensor, scale: float, zero_point: int) -> Tensor:
    return torch.fake_quantize_per_tensor_affine(x.float(), scale, zero_point, 0, 255).to(x.dtype)


class IntLinear(nn.Module):
    """An exported linear: packed integer weight codes, fp32 scales, optional uint8 activation parameters, and an
    integer-matmul reference forward: y = s_x * sum_g s_w[o, g] * sum_{i in g} (x_q[i] - z_x) * w_q[o, i]."""

    def __init__(self, codes: Tensor, scale: Tensor, bits: int, act: Optional[tuple[float, int]]) -> None:
        super().__init__()
        self.bits, self.shape = bits, tuple(codes.shape)
        stored = codes.to(torch.int8) if bits == 8 else pack_bits(codes + 2 ** (bits - 1), bits)
        self.register_buffer("qweight", stored)
        self.register_buffer("scale", scale.float())
        self.act = act

    def codes(self) -> Tensor:
        if self.bits == 8:
            return self.qweight.to(torch.int64)
        return (unpack_bits(self.qweight, self.bits, math.prod(self.shape)) - 2 ** (self.bits - 1)).view(self.shape)

    def forward(self, x: Tensor) -> Tensor:
        out, groups = self.scale.shape
        w = self.codes().view(out, groups, -1)
        lead = x.shape[:-1]
        x = x.reshape(-1, groups, w.shape[-1])
        if self.act is None:
            acc = torch.einsum("ngi,ogi->nog", x.double(), w.double())
            y = (acc * self.scale.double()).sum(-1)
        else:
            s_x, z_x = self.act
            xq = torch.clamp(torch.round(x.float() / s_x) + z_x, 0, 255).to(torch.int64) - z_x
            acc = torch.einsum("ngi,ogi->nog", xq, w)  # integer accumulation
            y = (acc.double() * self.scale.double()).sum(-1) * s_x
        return y.to(x.dtype).view(*lead, out)


class QAT(L.Callback):
    """Fake-quantize the selected linears from `start_step` (see the module docstring).

    Args:
        bits: weight bits (2, 3, 4, 8). group_size: inputs per weight scale (None: one per output channel).
        activations: also fake-quantize each linear's input (int8, per tensor).
        start_step: first optimizer step trained with fake quantization (before it the float model trains).
        freeze_observers_step: from this step on the activation ranges stay fixed (None: never).
        ema_decay: observer update lo <- decay * lo + (1 - decay) * batch_min (the first batch sets it).
        include, exclude: module-name globs of the linears to quantize; embeddings and head excluded.
    """

    def __init__(self, bits: int = 8, group_size: Optional[int] = None, activations: bool = True,
                 start_step: int = 0, freeze_observers_step: Optional[int] = None, ema_decay: float = 0.9,
                 include: Optional[list[str]] = None, exclude: Sequence[str] = DEFAULT_EXCLUDE) -> None:
        self.bits = check_bits(bits, "QAT")
        if group_size is not None and group_size < 1:
            raise ConfigError(f"QAT.group_size must be a positive integer or null (per channel), got {group_size}")
        if not 0.0 <= ema_decay < 1.0:
            raise ConfigError(f"QAT.ema_decay must be in [0, 1), got {ema_decay}")
        self.group_size, self.activations, self.start_step = group_size, activations, start_step
        self.freeze_observers_step, self.ema_decay = freeze_observers_step, ema_decay
        self.include, self.exclude = include, tuple(exclude)
        self.observers: dict[str, Tensor] = {}  # module name -> [lo, hi] (nan until the first batch)
        self._step = 0
        self._groups: list[Optional[dist.ProcessGroup]] = []  # where an observer's batch range is reduced

    # -- Lightning hooks ---------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._groups = layer_groups(trainer)
        self.attach(pl_module, select(owned_weights(trainer, pl_module), self.include, self.exclude, "QAT"))

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._step = trainer.global_step

    def state_dict(self) -> dict[str, Any]:
        return {"observers": merged_over_ranks({k: v.clone() for k, v in self.observers.items()})}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.observers.update(state_dict["observers"])

    # -- fake quantization -------------------------------------------------------------------------------------
    def attach(self, root: nn.Module, weights: Sequence[Any]) -> None:
        """Override the forward of each selected linear (names relative to `root`)."""
        for ws in weights:
            name = ws.name[: -len(".weight")]
            local_in = ws.param.shape[1]
            if self.group_size is not None and (ws.global_shape[1] % self.group_size or local_in % self.group_size):
                raise ConfigError(f"QAT.group_size={self.group_size} must divide the input dimension of {name} "
                                  f"({ws.global_shape[1]}, {local_in} on this rank)")
            # a TP row-parallel shard holds part of each output channel: its absmax is reduced over the group
            split_rows = ws.param is ws.local and ws.group is not None and ws.dim == 1 and self.group_size is None
            self.observers.setdefault(name, torch.full((2,), float("nan")))
            module = root.get_submodule(name)
            module.forward = types.MethodType(self._forward_fn(name, ws.group if split_rows else None), module)

    def _forward_fn(self, name: str, group: Optional[dist.ProcessGroup]):  # noqa: ANN202 (a bound forward)
        def forward(module: nn.Module, x: Tensor) -> Tensor:
            bias = getattr(module, "bias", None)
            if self._step < self.start_step:
                return F.linear(x, module.weight, bias)
            if self.activations:
                x = self._quantize_input(name, x, module.training)
            scale = weight_scale(module.weight, self.bits, self.group_size, group)
            return F.linear(x, fake_quant_weight(module.weight, scale, self.bits), bias)
        return forward

    def _quantize_input(self, name: str, x: Tensor, training: bool) -> Tensor:
        observer = self.observers[name]
        frozen = self.freeze_observers_step is not None and self._step >= self.freeze_observers_step
        if training and not frozen:
            batch = torch.stack([-x.detach().min(), x.detach().max()]).float().cpu()
            for group in self._groups:  # one range for the global batch: MAX of (-min, max) over the layer's ranks
                comm.all_reduce(batch, group, dist.ReduceOp.MAX)
            batch[0] = -batch[0]
            decay = self.ema_decay if not observer.isnan().any() else 0.0
            observer.copy_(torch.nan_to_num(observer, 0.0) * decay + batch * (1 - decay))
        if observer.isnan().any():  # nothing observed yet (e.g. the sanity check before training)
            return x
        return fake_quant_act(x, *act_qparams(*observer.tolist()))

    # -- export -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def convert(self, root: nn.Module) -> nn.Module:
        """Replace every fake-quantized linear of the whole model `root` by an `IntLinear`, in place."""
        for name, observer in self.observers.items():
            linear = root.get_submodule(name)
            scale = weight_scale(linear.weight, self.bits, self.group_size)
            act = act_qparams(*observer.tolist()) if self.activations and not observer.isnan().any() else None
            root.set_submodule(name, IntLinear(quantize_weight(linear.weight, scale, self.bits), scale, self.bits,
                                               act))
        return root


def model_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer (each storage once): the size of the exported model."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
