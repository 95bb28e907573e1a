"""`QAT`: quantization-aware training by fake quantization, and the export to real integer weights.

Weights: symmetric int`bits` (3, 4 or 8), one scale per output channel or per group of `group_size` inputs,
scale = absmax / (2^(bits-1) - 1), recomputed from the current weight at every forward. `bits: 2` is ternary
{-a, 0, +a}: TWN (Li & Liu 2016: per channel, threshold 0.7 * mean|w|, a = mean |w| over the weights above it, the
scale minimising the L2 error for that mask) or TTQ (Zhu et al. 2017: per layer, threshold `ttq_threshold` * max|w|,
separate positive and negative scales W_p, W_n learned from the loss). `bits: 1` is binary {-a, +a}: sign(w) with
a = mean |w| per channel. Activations (the input of each quantized linear): 7-bit asymmetric per tensor (uint8
codes 0..127, not 0..255: `ACT_QMAX` says why), range from EMA min/max observers that stop at
`freeze_observers_step`. Both use the straight-through estimator: the rounding's gradient is taken as 1 inside
the representable range and 0 outside (torch's fake_quantize ops), so weights and activations learn to sit
where the integer grid can represent them. (Ternary and binary weights pass the gradient through unclipped; TTQ
scales it by W_p, 1, W_n on the positive, zero and negative weights, as the paper does.)

TTQ's scales are the callback's state, not model parameters (so no strategy has to shard or sync them): the
gradient of the loss with respect to W_p is the sum of the loss gradients of the weights at +W_p, which is what the
strategy's synchronised weight gradient holds divided by W_p; each rank sums its part (`owned_weights()`), the
parts are all-reduced, and every rank takes the same Adam step (`scale_lr`) before the optimizer's.

No module is swapped while training: each selected linear's `forward` is overridden on the instance, so parameter
names, checkpoints and every strategy's hooks stay as they are. Under tensor parallelism a row-parallel weight's
output channel is split over tp: its per-channel absmax is all-reduced (MAX) over the group the strategy names
(`owned_weights()`: the splits of the tensor the forward reads, so ZeRO's rows never enter); observers are reduced
over every rank that runs the layer (all ranks; one pipeline stage's under pp, where each microbatch updates them),
so those ranks (and a single-process run over the same global batch) hold the same range. The observers and
TTQ's scales live on the device of the data they meet (no host sync in the step); the checkpoint keeps every
stage's, on CPU. `convert` replaces the linears by `IntLinear`: packed integer weights (2 bits a ternary
weight, 1 a binary one), fp32 scales, an integer-matmul reference forward that matches the fake-quant model, and on
CPU PyTorch's fbgemm int8 kernel for every width.

Logged every step: `bits/<layer>`, the weight bits the layer trains with (32 before `start_step`). A `start_step`
the run never reaches is warned about at the start.
"""

from __future__ import annotations

import math
import types
import warnings
from typing import Any, Literal, Optional, Sequence

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lit_lm.callbacks.compress.core import DEFAULT_EXCLUDE, all_reduce_, layer_groups, log_per_layer, \
    merged_over_ranks, owned_weights, pack_bits, select, unpack_bits, warn_if_never_reached
from lit_lm.config import ConfigError
from lit_lm.strategies import comm
from lit_lm.strategies.base import Split, WeightShard

TWN_DELTA = 0.7  # TWN's threshold, in units of mean |w| (optimal for Gaussian or uniform weights, the paper shows)


def qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def weight_scale(w: Tensor, bits: int, group_size: Optional[int] = None,
                 groups: Sequence[dist.ProcessGroup] = ()) -> Tensor:
    """(out, n_groups) symmetric scales: absmax / qmax per output channel (group_size None) or input group;
    with `groups`, the absmax is the MAX over their parts of the row (a TP row-parallel split)."""
    size = w.shape[1] if group_size is None else group_size
    amax = w.detach().float().abs().reshape(w.shape[0], -1, size).amax(-1)
    all_reduce_(amax, groups, dist.ReduceOp.MAX)
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


def check_qat_bits(bits: int, owner: str) -> int:
    if bits not in (1, 2, 3, 4, 8):
        raise ConfigError(f"{owner}.bits must be one of 1 (binary), 2 (ternary), 3, 4, 8, got {bits!r}")
    return bits


def _row_stats(values: Tensor, counted: Tensor, groups: Sequence[dist.ProcessGroup]) -> Tensor:
    """(2, out, groups): sum of `values` and count of `counted` per row group, summed over `groups`' parts."""
    stats = torch.stack([values.sum(-1), counted.sum(-1).to(values.dtype)])
    return all_reduce_(stats, groups)


def twn_codes(w: Tensor, group_size: Optional[int] = None,
              groups: Sequence[dist.ProcessGroup] = ()) -> tuple[Tensor, Tensor]:
    """TWN: (codes in {-1, 0, 1} like w, scales (out, n_groups)); threshold 0.7 * mean|w| per channel (or group),
    scale = mean |w| over the weights above it. With `groups`, the row's parts are spread over them (sums reduced)."""
    size = w.shape[1] if group_size is None else group_size
    rows = w.detach().float().reshape(w.shape[0], -1, size)
    total, count = _row_stats(rows.abs(), torch.ones_like(rows), groups)
    keep = rows.abs() > (TWN_DELTA * total / count)[..., None]
    kept_sum, kept = _row_stats(rows.abs() * keep, keep, groups)
    return (torch.sign(rows) * keep).view(w.shape), kept_sum / kept.clamp(min=1)


def binary_codes(w: Tensor, group_size: Optional[int] = None,
                 groups: Sequence[dist.ProcessGroup] = ()) -> tuple[Tensor, Tensor]:
    """(codes in {-1, 1} like w (0 -> +1), scales (out, n_groups) = mean |w| per channel or group)."""
    size = w.shape[1] if group_size is None else group_size
    rows = w.detach().float().reshape(w.shape[0], -1, size)
    total, count = _row_stats(rows.abs(), torch.ones_like(rows), groups)
    return torch.where(rows >= 0, 1.0, -1.0).view(w.shape), total / count


def ttq_codes(w: Tensor, threshold: float, groups: Sequence[dist.ProcessGroup] = ()) -> tuple[Tensor, Tensor]:
    """TTQ: (codes in {-1, 0, 1} like w, the layer's threshold `threshold` * max|w|, a 0-d tensor on w's device: no
    host sync); with `groups`, the layer's parts are spread over them (max reduced)."""
    wd = w.detach().float()
    delta = threshold * all_reduce_(wd.abs().max().reshape(1), groups, dist.ReduceOp.MAX)[0]
    return torch.sign(wd) * (wd.abs() > delta), delta


def dequantize(codes: Tensor, scale: Tensor, neg_scale: Optional[Tensor] = None) -> Tensor:
    """codes * scale per (channel, group); negative codes take `neg_scale` when given (TTQ's W_n)."""
    rows = codes.reshape(codes.shape[0], scale.shape[-1], -1)
    pos, neg = scale[..., None], (scale if neg_scale is None else neg_scale)[..., None]
    return torch.where(rows > 0, rows * pos, rows * neg).view(codes.shape)


def straight_through(w: Tensor, q: Tensor, factor: Optional[Tensor] = None) -> Tensor:
    """The value `q`, the gradient of w (times `factor` elementwise when given)."""
    moving = w - w.detach()
    return q.to(w.dtype).detach() + (moving if factor is None else moving * factor.to(w.dtype))


# Activation codes are 7-bit (0 .. ACT_QMAX = 127), not uint8's 0 .. 255, and this is the one place that decides
# it. fbgemm's AVX2 kernel (x86 without VNNI) multiplies the uint8 activations by the int8 weights with vpmaddubsw,
# which adds each *pair* of neighbouring products in int16 with saturation: full-range codes reach
# 255 * 127 * 2 = 64770 > 32767 and the sum is silently clipped (wrong outputs), while VNNI's vpdpbusd accumulates
# in int32 and does not. Which kernel runs is decided by the machine that *serves* the exported model, which the
# exporting machine cannot know, so the range is always reduced (PyTorch's x86 recipe, `reduce_range=True`, for the
# same reason). Bound: codes 0..127 times int8 weights -128..127 (our weights reach -127..127; any int8 fits):
# |a1 * w1 + a2 * w2| <= 2 * 127 * 128 = 32512 < 2^15 - 1 = 32767. Fake quantization (QAT, PTQ) uses the same
# range, so the exported model computes what the fake-quantized one did.
ACT_QMAX = 127


def act_qparams(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """Asymmetric scale (float32) and zero point (int32) of 7-bit activation codes 0..ACT_QMAX for the ranges
    [lo, hi] (elementwise, on their device), each widened to contain 0 (exact zero padding)."""
    lo, hi = lo.float().clamp(max=0.0), hi.float().clamp(min=0.0)
    scale = ((hi - lo) / ACT_QMAX).clamp(min=1e-8)
    return scale, torch.round(-lo / scale).clamp(0, ACT_QMAX).to(torch.int32)


def export_act(lo: float | Tensor, hi: float | Tensor) -> tuple[float, int]:
    """`act_qparams` of one range as the Python numbers `IntLinear` keeps (at export: not per step)."""
    scale, zero_point = act_qparams(torch.as_tensor(lo, device="cpu"), torch.as_tensor(hi, device="cpu"))
    return float(scale), int(zero_point)


def fake_quant_act(x: Tensor, scale: Tensor | float, zero_point: Tensor | int) -> Tensor:
    """dequant(quant(x)) on the 7-bit grid, straight-through inside it (scale, zero point: tensors on x's device, or
    Python numbers)."""
    return torch.fake_quantize_per_tensor_affine(x.float(), scale, zero_point, 0, ACT_QMAX).to(x.dtype)


def quantize_act(x: Tensor, scale: float, zero_point: int) -> Tensor:
    """x's codes 0..ACT_QMAX (int64), rounded exactly as `fake_quant_act` rounds them."""
    return torch.round(fake_quant_act(x.float(), scale, zero_point) / scale).to(torch.int64) + zero_point


class IntLinear(nn.Module):
    """An exported linear: packed integer weight codes, fp32 scales, optional activation parameters (7-bit codes in
    uint8), and an integer-matmul reference forward: y = s_x * sum_g s_w[o, g] * sum_{i in g} (x_q[i] - z_x) *
    w_q[o, i]. Binary codes are stored as 1 bit, ternary as 2; TTQ's negative codes take `neg_scale` (its W_n)
    instead of `scale`.

    With quantized activations on CPU every width runs PyTorch's fbgemm kernel instead
    (`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`: uint8 x int8, the same quantization of the input,
    fp32 out; its input is first clamped to the 7-bit grid, which the kernel's uint8 rounding would not do), so the
    export is faster, not only smaller. fbgemm has int8 weights with one scale per output row and no sub-byte
    matmul, so at the first forward the codes are unpacked to int8 (4-, 2- and 1-bit codes are int8 values too) and
    prepacked once: one kernel call per input group (its slice of x against that group's codes, the group's scales
    per row), the calls summed; TTQ's negative codes are extra rows with W_n as their scale, added to the positive
    rows' output. The stored weight stays packed; in memory the prepacked one is int8. The kernel quantizes x as
    round(x * (1 / s_x)) like `fake_quant_act` (the reference's rounding), but its vector and scalar paths may
    differ from it by one level at a rounding boundary.
    """

    def __init__(self, codes: Tensor, scale: Tensor, bits: int, act: Optional[tuple[float, int]],
                 neg_scale: Optional[Tensor] = None) -> None:
        super().__init__()
        self.bits, self.shape = bits, tuple(codes.shape)
        if bits == 8:
            stored = codes.to(torch.int8)
        elif bits == 1:
            stored = pack_bits(codes > 0, 1)
        else:
            stored = pack_bits(codes.to(torch.int64) + 2 ** (bits - 1), bits)
        self.register_buffer("qweight", stored)
        self.register_buffer("scale", scale.float())
        self.register_buffer("neg_scale", None if neg_scale is None else neg_scale.float())
        self.act = act
        self._packed: list[Any] = []  # fbgemm's prepacked weights (one per input group), built at the first forward

    @property
    def uses_kernel(self) -> bool:
        return (self.act is not None and self.qweight.device.type == "cpu"
                and "fbgemm" in torch.backends.quantized.supported_engines)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._packed = []  # new weights: pack again
        super()._load_from_state_dict(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_packed": []}  # fbgemm's packed weights do not pickle: packed again after loading

    def _parts(self) -> list[tuple[Tensor, Tensor]]:
        """[(codes (out, groups, group size), scales (out, groups))]: one part, or TTQ's positive and negative."""
        out, groups = self.shape[0], self.scale.shape[-1]
        w = self.codes().view(out, groups, -1)
        if self.neg_scale is None:
            return [(w, self.scale)]
        return [(w.clamp(min=0), self.scale.expand(out, groups)), (w.clamp(max=0), self.neg_scale.expand(out, groups))]

    def _prepack(self) -> list[Any]:
        """Per input group, fbgemm's packed int8 weight: every part's codes of that group stacked along the rows."""
        parts, packed = self._parts(), []
        engine = torch.backends.quantized.engine
        torch.backends.quantized.engine = "fbgemm"  # the packed weight is fbgemm's, whatever the default
        try:
            for g in range(self.scale.shape[-1]):
                codes = torch.cat([w[:, g] for w, _ in parts]).float()
                scale = torch.cat([s[:, g] for _, s in parts]).float().clamp(min=1e-30)  # an all-zero row: any
                with warnings.catch_warnings():  # quantized tensors are deprecated (pytorch#184982), kernels kept
                    warnings.simplefilter("ignore", UserWarning)
                    qweight = torch.quantize_per_channel(codes * scale[:, None], scale.double(),
                                                         torch.zeros_like(scale, dtype=torch.int64), 0, torch.qint8)
                packed.append(torch.ops.quantized.linear_prepack(qweight, None))
        finally:
            torch.backends.quantized.engine = engine
        return packed

    def _kernel(self, x: Tensor) -> Tensor:
        if not self._packed:
            self._packed = self._prepack()
        s_x, z_x = self.act
        # the kernel would round x outside the range to uint8 codes up to 255: clamp it to the 7-bit grid's ends
        rows = x.reshape(-1, x.shape[-1]).float().clamp(-z_x * s_x, (ACT_QMAX - z_x) * s_x)
        size = rows.shape[-1] // len(self._packed)
        y = sum(torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            rows[:, g * size:(g + 1) * size].contiguous(), s_x, z_x, packed) for g, packed in enumerate(self._packed))
        y = y.view(rows.shape[0], -1, self.shape[0]).sum(1)  # TTQ: positive rows' output + negative rows'
        return y.to(x.dtype).view(*x.shape[:-1], self.shape[0])

    def codes(self) -> Tensor:
        if self.bits == 8:
            return self.qweight.to(torch.int64)
        raw = unpack_bits(self.qweight, self.bits, math.prod(self.shape)).view(self.shape)
        return 2 * raw - 1 if self.bits == 1 else raw - 2 ** (self.bits - 1)

    def forward(self, x: Tensor) -> Tensor:
        return self._kernel(x) if self.uses_kernel else self.reference(x)

    def reference(self, x: Tensor) -> Tensor:
        out, groups = self.shape[0], self.scale.shape[-1]
        lead, dtype = x.shape[:-1], x.dtype
        x = x.reshape(-1, groups, self.shape[1] // groups)
        if self.act is None:
            x = x.double()
        else:
            x = quantize_act(x, *self.act) - self.act[1]
        # integer accumulation when the input is quantized; negative codes apart when they have their own scale
        y = sum((torch.einsum("ngi,ogi->nog", x, w.to(x.dtype)).double() * s.double()).sum(-1)
                for w, s in self._parts())
        if self.act is not None:
            y = y * self.act[0]
        return y.to(dtype).view(*lead, out)


class QAT(L.Callback):
    """Fake-quantize the selected linears from `start_step` (see the module docstring).

    Args:
        bits: weight bits: 8, 4, 3; 2 ternary; 1 binary. group_size: inputs per weight scale (None: one per output
            channel; TTQ has one pair per layer).
        ternary: for bits 2: twn (threshold 0.7 mean|w|, optimal scale) or ttq (learned positive and negative
            scales). ttq_threshold: TTQ's threshold as a fraction of max|w|. scale_lr: Adam's lr for TTQ's scales.
        activations: also fake-quantize each linear's input (7-bit codes, per tensor).
        start_step: first optimizer step trained with fake quantization (before it the float model trains).
        freeze_observers_step: from this step on the activation ranges stay fixed (None: never).
        ema_decay: observer update lo <- decay * lo + (1 - decay) * batch_min (the first batch sets it).
        include, exclude: module-name globs of the linears to quantize; embeddings and head excluded.
    """

    def __init__(self, bits: int = 8, group_size: Optional[int] = None, ternary: Literal["twn", "ttq"] = "twn",
                 ttq_threshold: float = 0.05, scale_lr: float = 1e-3, activations: bool = True, start_step: int = 0,
                 freeze_observers_step: Optional[int] = None, ema_decay: float = 0.9,
                 include: Optional[list[str]] = None, exclude: Sequence[str] = DEFAULT_EXCLUDE) -> None:
        self.bits = check_qat_bits(bits, "QAT")
        if group_size is not None and group_size < 1:
            raise ConfigError(f"QAT.group_size must be a positive integer or null (per channel), got {group_size}")
        if not 0.0 <= ema_decay < 1.0:
            raise ConfigError(f"QAT.ema_decay must be in [0, 1), got {ema_decay}")
        if ternary not in ("twn", "ttq") or not 0.0 < ttq_threshold < 1.0:
            raise ConfigError(f"QAT.ternary must be twn or ttq and QAT.ttq_threshold in (0, 1), got {ternary!r}, "
                              f"{ttq_threshold}")
        self.group_size, self.activations, self.start_step = group_size, activations, start_step
        self.ternary, self.ttq_threshold, self.scale_lr = ternary, ttq_threshold, scale_lr
        self.freeze_observers_step, self.ema_decay = freeze_observers_step, ema_decay
        self.include, self.exclude = include, tuple(exclude)
        self.observers: dict[str, Tensor] = {}  # module name -> [lo, hi] (nan until the first batch)
        # TTQ: module name -> (4, 2): rows W = (W_p, W_n), then Adam's m, v and step count (nan until first use)
        self.ttq_scales: dict[str, Tensor] = {}
        # the names whose observers / TTQ scales hold values (not nan): known without reading the device in the step
        self._filled: dict[str, set[str]] = {"observers": set(), "ttq_scales": set()}
        self._step = 0
        self._groups: list[Optional[dist.ProcessGroup]] = []  # where an observer's batch range is reduced
        self._weights: dict[str, WeightShard] = {}
        self._delta: dict[str, Tensor] = {}  # TTQ: each layer's threshold in the last forward

    @property
    def ttq(self) -> bool:
        return self.bits == 2 and self.ternary == "ttq"

    @property
    def state_key(self) -> str:  # several QAT callbacks (on different layers) keep separate checkpoint state
        return self._generate_state_key(bits=self.bits, include=self.include, exclude=self.exclude)

    # -- Lightning hooks ---------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        warn_if_never_reached(trainer, "QAT", self.start_step, trainer.max_steps - 1)  # steps 0 .. max_steps - 1
        self._groups = layer_groups(trainer)
        self.attach(pl_module, select(owned_weights(trainer, pl_module), self.include, self.exclude, "QAT"))

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        """The weight bits each layer trained with at this step (32 before `start_step`)."""
        log_per_layer(pl_module, "bits", {name: self.bits if self._step >= self.start_step else 32
                                          for name in self._weights})

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.ttq and self._step >= self.start_step:
            self._update_ttq_scales()

    def state_dict(self) -> dict[str, Any]:  # saved on CPU (a checkpoint loads on any machine)
        return {"observers": merged_over_ranks({k: v.to("cpu", copy=True) for k, v in self.observers.items()}),
                "ttq_scales": merged_over_ranks({k: v.to("cpu", copy=True) for k, v in self.ttq_scales.items()})}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.observers.update(state_dict["observers"])
        self.ttq_scales.update(state_dict.get("ttq_scales", {}))
        for key, table in (("observers", self.observers), ("ttq_scales", self.ttq_scales)):
            self._filled[key] = {name for name, value in table.items() if not value.isnan().any()}

    @staticmethod
    def _on(table: dict[str, Tensor], name: str, device: torch.device) -> Tensor:
        """`table[name]`, moved once to `device`, the device of the data it meets (created, or restored from a
        checkpoint, on CPU)."""
        if table[name].device != device:
            table[name] = table[name].to(device)
        return table[name]

    # -- fake quantization -------------------------------------------------------------------------------------
    def attach(self, root: nn.Module, weights: Sequence[WeightShard]) -> None:
        """Override the forward of each selected linear (names relative to `root`)."""
        for ws in weights:
            name = ws.name[: -len(".weight")]
            local_in = ws.param.shape[1]
            if self.group_size is not None and (ws.global_shape[1] % self.group_size or local_in % self.group_size):
                raise ConfigError(f"QAT.group_size={self.group_size} must divide the input dimension of {name} "
                                  f"({ws.global_shape[1]}, {local_in} on this rank)")
            # on CPU, as a checkpoint restores them; `_on` moves them to the data's device at their first use
            self.observers.setdefault(name, torch.full((2,), float("nan"), device="cpu"))
            if self.ttq:
                self.ttq_scales.setdefault(name, torch.full((4, 2), float("nan"), device="cpu"))
            self._weights[name] = ws
            module = root.get_submodule(name)
            module.forward = types.MethodType(self._forward_fn(name, ws.param_splits), module)

    def _forward_fn(self, name: str, splits: Sequence[Split]):  # noqa: ANN202
        def forward(module: nn.Module, x: Tensor) -> Tensor:
            bias = getattr(module, "bias", None)
            if self._step < self.start_step:
                return F.linear(x, module.weight, bias)
            if self.activations:
                x = self._quantize_input(name, x, module.training)
            return F.linear(x, self.fake_weight(name, module.weight, splits), bias)
        return forward

    def fake_weight(self, name: str, w: Tensor, splits: Sequence[Split] = ()) -> Tensor:
        """The weight as the integer model will hold it, with the straight-through gradient. `splits`: how the
        forward's `w` is cut from the layer (a TP shard): layer statistics (TTQ) are reduced over all their groups,
        a channel's (or a row-parallel shard's) over those that split the inputs (dim 1)."""
        layer_groups = [split.group for split in splits]
        row_groups = [split.group for split in splits if split.dim == 1] if self.group_size is None else []
        if self.bits >= 3:
            return fake_quant_weight(w, weight_scale(w, self.bits, self.group_size, row_groups), self.bits)
        if self.bits == 1:
            return straight_through(w, dequantize(*binary_codes(w, self.group_size, row_groups)))
        if not self.ttq:
            return straight_through(w, dequantize(*twn_codes(w, self.group_size, row_groups)))
        codes, self._delta[name] = ttq_codes(w, self.ttq_threshold, layer_groups)
        state = self._on(self.ttq_scales, name, w.device)
        if name not in self._filled["ttq_scales"]:  # first use: the L2-optimal scales for this mask, then learnt
            wd = w.detach().float().abs()
            sums = torch.stack([(wd * (codes > 0)).sum(), (wd * (codes < 0)).sum(), (codes > 0).sum(),
                                (codes < 0).sum()]).float()
            sums = all_reduce_(sums, layer_groups)
            state.zero_()
            state[0] = sums[:2] / sums[2:].clamp(min=1)
            self._filled["ttq_scales"].add(name)
        w_p, w_n = state[0]
        factor = torch.where(codes > 0, w_p, torch.where(codes < 0, w_n, torch.ones_like(w_p)))
        return straight_through(w, dequantize(codes, w_p.reshape(1, 1), w_n.reshape(1, 1)), factor)

    @torch.no_grad()
    def _update_ttq_scales(self) -> None:
        """dL/dW_p = sum of dL/dq over q = +W_p = (the weight gradient there) / W_p; likewise -W_n. Every rank sums
        its part of the synchronised gradient, the parts are all-reduced, and all take the same Adam step."""
        for name, ws in self._weights.items():
            grad = ws.local.grad
            if name not in self._delta or grad is None or name not in self._filled["ttq_scales"]:
                continue
            state = self._on(self.ttq_scales, name, grad.device)
            w = ws.local.detach().float()
            g = grad.detach().float()
            sums = torch.stack([(g * (w > self._delta[name])).sum(), -(g * (w < -self._delta[name])).sum()])
            g_scales = all_reduce_(sums, ws.groups) / state[0]
            beta1, beta2 = 0.9, 0.999
            state[3] += 1
            state[1].mul_(beta1).add_(g_scales, alpha=1 - beta1)
            state[2].mul_(beta2).addcmul_(g_scales, g_scales, value=1 - beta2)
            m_hat, v_hat = state[1] / (1 - beta1 ** state[3]), state[2] / (1 - beta2 ** state[3])
            state[0] = (state[0] - self.scale_lr * m_hat / (v_hat.sqrt() + 1e-8)).clamp(min=1e-8)

    def _quantize_input(self, name: str, x: Tensor, training: bool) -> Tensor:
        observer = self._on(self.observers, name, x.device)
        frozen = self.freeze_observers_step is not None and self._step >= self.freeze_observers_step
        observed = name in self._filled["observers"]
        if training and not frozen:
            batch = torch.stack([-x.detach().min(), x.detach().max()]).float()
            for group in self._groups:  # one range for the global batch: MAX of (-min, max) over the layer's ranks
                comm.all_reduce(batch, group, dist.ReduceOp.MAX)
            batch[0] = -batch[0]
            decay = self.ema_decay if observed else 0.0
            observer.copy_(torch.nan_to_num(observer, 0.0) * decay + batch * (1 - decay))
            self._filled["observers"].add(name)
        elif not observed:  # nothing observed yet (e.g. the sanity check before training)
            return x
        return fake_quant_act(x, *act_qparams(observer[0], observer[1]))

    # -- export -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def convert(self, root: nn.Module) -> nn.Module:
        """Replace every fake-quantized linear of the whole model `root` by an `IntLinear`, in place."""
        for name, observer in self.observers.items():
            w = root.get_submodule(name).weight
            act = export_act(*observer) if self.activations and name in self._filled["observers"] else None
            neg_scale = None
            if self.bits >= 3:
                scale = weight_scale(w, self.bits, self.group_size)
                codes = quantize_weight(w, scale, self.bits)
            elif self.bits == 1:
                codes, scale = binary_codes(w, self.group_size)
            elif not self.ttq:
                codes, scale = twn_codes(w, self.group_size)
            else:
                codes, _ = ttq_codes(w, self.ttq_threshold)
                scale, neg_scale = (s.reshape(1, 1).to(w.device) for s in self.ttq_scales[name][0])
            root.set_submodule(name, IntLinear(codes, scale, self.bits, act, neg_scale))
        return root


def model_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer (each storage once): the size of the exported model."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
