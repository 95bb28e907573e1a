"""`QKClip`: Kimi K2's QK-clip (the "Clip" of MuonClip), whatever the strategy.

Every attention head h has its maximum pre-softmax logit measured in the step's forwards (every micro-batch),

    S_h = max of q_i^h . k_j^h / sqrt(D) over the batch and the (query i, key j) pairs the mask allows

from the q, k the attention core uses (after RoPE), by the cores themselves (`lit_lm.kernels.logit_max`). After the
optimizer step, with eta_h = tau / S_h for every head over the threshold tau and 1 for the others:

    a kv head per query head (MHA):          W_q^h <- eta_h^alpha W_q^h,   W_k^h <- eta_h^(1-alpha) W_k^h
    G > 1 query heads share a kv head (GQA): W_q^h <- eta_h W_q^h,         the shared W_k untouched

The logits of a head are bilinear in its q and k rows, so a clipped head's logits scale by exactly eta_h (its
maximum becomes tau) and no other head's change. A shared key is left alone because scaling it would also scale
the heads of its group that did not ask: Kimi K2 does the same with MLA's rotary key, which every head shares (the
head's own rotary query takes the whole eta); taking the group's smallest eta for the key instead (another common
choice) clips heads that stayed under tau.

What is scaled: the head's rows of wq (and wk) and, with Qwen2's q/k biases, the same rows of the bias (q = W_q x +
b_q scales as a whole). The optimizer state (momentum, Adam's moments) is left as it is, as in MuonClip. QK-norm is
refused: the norm undoes any scale of W_q, and its per-head weight is shared by all heads.

Where the maximum is taken (`max_groups`): over the data-parallel replicas and the ZeRO shard group (each saw
other rows of the batch) and the context-parallel ranks (each holds other queries; its cores measured them
against every rank's keys), never across tensor-parallel ranks (each holds its own heads, and a head's maximum is
its own) and per pipeline stage (a stage holds its layers). One all-reduce (max) of every layer's heads per step,
on the device: the clip is a mask, `where(S > tau, tau / S, 1)`, so nothing waits for the host.

The weights are edited as this rank holds them (the strategy's `owned_weights()`, `WeightShard`): the rows of the
tp slice its heads own, ZeRO's rows of them (the optimizer's fp32 part) and, under ZeRO-1/2, the replica the
forward reads (completed before this callback by the strategy's flush: `lit_lm.strategies.weight_readers`).

Logs `qk_max` (the largest logit over every layer and head) and `qk_clipped` (heads clipped at this step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor

from lit_lm.callbacks.compress.core import owned_weights
from lit_lm.config import ConfigError
from lit_lm.kernels.logit_max import LogitMaxRecord
from lit_lm.model import Attention
from lit_lm.strategies import comm
from lit_lm.strategies.base import BaseStrategy, WeightShard


def max_groups(trainer: L.Trainer) -> list[Optional[dist.ProcessGroup]]:
    """The groups the per-head maximum is reduced over: this rank's data-parallel x context-parallel group (the
    ranks running the same heads of the same layers on other tokens); the world under another strategy's data
    parallelism; none in one process."""
    if not (dist.is_available() and dist.is_initialized()) or trainer.world_size == 1:
        return []
    strategy = trainer.strategy
    if not isinstance(strategy, BaseStrategy):
        return [None]
    return [strategy.layout.group("dp_cp")] if strategy.layout.size("dp_cp") > 1 else []


def log_groups(trainer: L.Trainer) -> list[dist.ProcessGroup]:
    """The groups that hold other heads (tp) or other layers (pp), for the logged totals only."""
    strategy = trainer.strategy
    if not isinstance(strategy, BaseStrategy) or trainer.world_size == 1:
        return []
    return [strategy.layout.group(name) for name in ("tp", "pp") if strategy.layout.size(name) > 1]


def _rows(index: tuple[slice, ...], shape: torch.Size) -> tuple[int, int]:
    """The global rows (dim 0) an index of a tensor of `shape` covers."""
    if not index or index[0] == slice(None):
        return 0, shape[0]
    return index[0].start, index[0].stop


@torch.no_grad()
def scale_heads_(ws: WeightShard, scale: Tensor, head_dim: int) -> None:
    """Multiply the rows of each head of `ws` (a q or k projection's weight or bias, heads along dim 0) by `scale`,
    one factor per head of the tensor the forward reads (`param`): in `local` (the optimizer's part) and in the
    replica the forward reads where that is another tensor (ZeRO-1/2; once where `local` is a view of it)."""
    per_row = scale.repeat_interleave(head_dim)
    first, _ = _rows(ws.param_index, ws.global_shape)
    start, stop = _rows(ws.index, ws.global_shape)
    targets = [(ws.local, per_row[start - first:stop - first])]
    replica = ws.replica
    if replica is not None:
        aliased = ws.local.untyped_storage().data_ptr() == replica.untyped_storage().data_ptr()
        targets = [(replica, per_row)] + ([] if aliased else targets)
    for tensor, factor in targets:
        tensor.mul_(factor.to(tensor.dtype).view(-1, *[1] * (tensor.ndim - 1)))


@dataclass
class _Layer:
    """One attention layer as this rank holds it: its core (which measures), the q/k weights and biases (found in
    the strategy's `owned_weights()` at each clip: an engine may re-point its parts after setup), and how many
    query heads it runs here and share each kv head."""

    core: LogitMaxRecord
    q: list[torch.nn.Parameter]
    k: list[torch.nn.Parameter]
    heads: int
    group: int
    head_dim: int
    device: torch.device


class QKClip(L.Callback):
    """Rescale the q/k projections of every attention head whose maximum logit passed `threshold` (tau), by
    eta = tau / S_max: queries by eta^alpha and keys by eta^(1 - alpha) (see the module docstring; under
    grouped-query attention the query takes all of eta)."""

    def __init__(self, threshold: float = 100.0, alpha: float = 0.5) -> None:
        if not threshold > 0:
            raise ConfigError(f"QKClip.threshold must be positive, got {threshold}")
        if not 0.0 <= alpha <= 1.0:
            raise ConfigError(f"QKClip.alpha must be in [0, 1], got {alpha}")
        self.threshold = threshold
        self.alpha = alpha
        self.clipped: Any = 0  # heads clipped so far, all ranks' (a device tensor once training ran)
        self.qk_max: Any = None  # the last step's largest logit (a device tensor)
        self._layers: list[_Layer] = []
        self._step = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._layers = self._find_layers(trainer, pl_module)
        if not self._layers:
            raise ConfigError("QKClip found no attention layer (lit_lm.model.Attention) in the model")
        for layer in self._layers:
            layer.core.take_logit_max()
            layer.core.measure_logits = True
        self._step = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for layer in self._layers:
            layer.core.measure_logits = False
            layer.core.take_logit_max()
        self._layers = []  # the model's modules stay with the model

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self._step:  # accumulating: no optimizer step yet
            return
        self._step = trainer.global_step
        s = self._measured(trainer)
        eta = torch.where(s > self.threshold, self.threshold / s, torch.ones_like(s))
        by_param = {id(ws.param): ws for ws in owned_weights(trainer, pl_module)}
        for layer, layer_eta in zip(self._layers, eta.split([layer.heads for layer in self._layers])):
            self._clip(layer, layer_eta, by_param)
        self._log(trainer, pl_module, s)

    def _measured(self, trainer: L.Trainer) -> Tensor:
        """Every layer's per-head maximum, this rank's heads, maximised over `max_groups` (one all-reduce)."""
        parts = []
        for layer in self._layers:
            got = layer.core.take_logit_max()
            parts.append(got if got is not None else torch.full((layer.heads,), float("-inf"), device=layer.device))
        s = torch.cat(parts)
        for group in max_groups(trainer):
            comm.all_reduce(s, group, dist.ReduceOp.MAX, label="qk-clip max logit")
        return s

    def _clip(self, layer: _Layer, eta: Tensor, by_param: dict[int, WeightShard]) -> None:
        if layer.group == 1:
            q_scale, k_scale = eta.pow(self.alpha), eta.pow(1.0 - self.alpha)
        else:
            q_scale, k_scale = eta, None
        for p in layer.q:
            scale_heads_(by_param[id(p)], q_scale, layer.head_dim)
        for p in layer.k if k_scale is not None else ():
            scale_heads_(by_param[id(p)], k_scale, layer.head_dim)

    def _log(self, trainer: L.Trainer, pl_module: L.LightningModule, s: Tensor) -> None:
        """`qk_max` and `qk_clipped` over every head of every layer (other tp ranks' heads, other stages' layers)."""
        top = s.max().reshape(1)
        count = (s > self.threshold).sum().to(top.dtype).reshape(1)
        for group in log_groups(trainer):
            comm.all_reduce(top, group, dist.ReduceOp.MAX, label="qk-clip log")
            comm.all_reduce(count, group, label="qk-clip log")
        self.qk_max, self.clipped = top[0], count[0] + self.clipped
        pl_module.log("qk_max", top[0], on_step=True, on_epoch=False)
        pl_module.log("qk_clipped", count[0], on_step=True, on_epoch=False)

    def _find_layers(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[_Layer]:
        by_param = {id(ws.param): ws for ws in owned_weights(trainer, pl_module)}
        layers = []
        for name, attn in pl_module.named_modules():
            if not isinstance(attn, Attention):
                continue
            if attn.q_norm is not None:
                raise ConfigError(f"QKClip cannot clip {name}: QK-norm (model.init_args.config.qk_norm) undoes any "
                                  "scale of wq and shares its weight between heads; it bounds the logits itself")
            if not isinstance(attn.core, LogitMaxRecord):
                raise ConfigError(f"QKClip cannot measure the logits of {name}.core ({type(attn.core).__name__}): "
                                  "use lit-lm's attention cores (lit_lm.kernels.logit_max.LogitMaxRecord)")
            q, k = list(attn.wq.parameters()), list(attn.wk.parameters())
            if not all(p.requires_grad for p in q + k):
                raise ConfigError(f"QKClip cannot clip {name}: it scales wq and wk in place, and they are frozen "
                                  "(LoRA, model.init_args.lora, trains adapters beside them); drop QKClip")
            q_rows, k_rows = (_rows(by_param[id(ws[0])].param_index, by_param[id(ws[0])].global_shape)
                              for ws in (q, k))
            heads, kv_heads = ((stop - start) // attn.head_dim for start, stop in (q_rows, k_rows))
            device = by_param[id(q[0])].local.device
            layers.append(_Layer(attn.core, q, k, heads, heads // kv_heads, attn.head_dim, device))
        return layers
