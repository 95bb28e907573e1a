"""`QKClip`: Kimi K2's QK-clip (the "Clip" of MuonClip), whatever the strategy.

Every attention head h has its maximum pre-softmax logit measured in the step's forwards (every micro-batch),

    S_h = max of q_i^h . k_j^h / sqrt(D) over the batch and the (query i, key j) pairs the mask allows

from the q, k the attention core uses (after RoPE; MLA's q already carries YaRN's mscale^2, so this is exactly its
softmax's logit), by the cores themselves (`lit_lm.kernels.logit_max`). After the optimizer step, with
eta_h = tau / S_h for every head over the threshold tau and 1 for the others:

    a kv head per query head (MHA):          W_q^h <- eta_h^alpha W_q^h,   W_k^h <- eta_h^(1-alpha) W_k^h
    G > 1 query heads share a kv head (GQA): W_q^h <- eta_h W_q^h,         the shared W_k untouched
    multi-head latent attention (MLA):       q_C^h <- eta_h^alpha q_C^h,   k_C^h <- eta_h^(1-alpha) k_C^h,
                                             q_R^h <- eta_h q_R^h,         the shared rotary key k_R untouched

The logits of a head are bilinear in its q and k rows, so a clipped head's logits scale by exactly eta_h (its
maximum becomes tau) and no other head's change. A shared key is left alone because scaling it would also scale
the heads of its group that did not ask; taking the group's smallest eta for the key instead (another common
choice) clips heads that stayed under tau.

MLA (`lit_lm.mla`, Kimi K2's section "QK-Clip", alpha = 1/2 there): a head's logit is q_C . k_C + q_R . k_R (times
its softmax scale). The head-specific q_C (q nope) and k_C (k nope) share eta as MHA's q and k do; the rotary key
k_R is one for all heads (from wkv_a), so the head's own rotary query q_R takes the whole eta. In lit-lm's weights,
per head h (Dn, Dr, Dv the nope, rope and value dims): rows [h (Dn + Dr), h (Dn + Dr) + Dn) of wq_b (wq without
mla_q_rank) are q_C, the next Dr rows q_R; rows [h (Dn + Dv), h (Dn + Dv) + Dn) of wkv_b are k_C, its Dv value rows
untouched; wq_a, wkv_a (the latent and k_R) and the latents' norms are shared by the heads and untouched.

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
from lit_lm.mla import LatentAttention
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


@dataclass(frozen=True)
class HeadRows:
    """Which rows of some weights (and biases) each head owns and the power of its eta each row is scaled by: the
    heads' rows lie one head after the other (heads along dim 0), each head's as `segments`, (rows, power) in order.
    MHA's wq is [(D, alpha)]; MLA's wkv_b [(Dn, 1 - alpha), (Dv, 0)] (k nope, then the values, untouched)."""

    params: tuple[torch.nn.Parameter, ...]
    segments: tuple[tuple[int, float], ...]

    @property
    def per_head(self) -> int:
        return sum(rows for rows, _ in self.segments)

    def factors(self, eta: Tensor) -> Tensor:
        """(heads * per_head,) the factor of every row, from the heads' eta (heads,)."""
        return torch.cat([eta.pow(power)[:, None].expand(-1, rows) for rows, power in self.segments], 1).flatten()


@torch.no_grad()
def scale_rows_(ws: WeightShard, per_row: Tensor) -> None:
    """Multiply the rows (dim 0) of `ws` by `per_row`, one factor per row of the tensor the forward reads (`param`):
    in `local` (the optimizer's part) and in the replica the forward reads where that is another tensor (ZeRO-1/2;
    once where `local` is a view of it)."""
    first, _ = _rows(ws.param_index, ws.global_shape)
    start, stop = _rows(ws.index, ws.global_shape)
    targets = [(ws.local, per_row[start - first:stop - first])]
    replica = ws.replica
    if replica is not None:
        aliased = ws.local.untyped_storage().data_ptr() == replica.untyped_storage().data_ptr()
        targets = [(replica, per_row)] + ([] if aliased else targets)
    for tensor, factor in targets:
        tensor.mul_(factor.to(tensor.dtype).view(-1, *[1] * (tensor.ndim - 1)))


def attention_rows(attn: Attention, alpha: float, group: int) -> list[HeadRows]:
    """`lit_lm.model.Attention`'s q/k rows: MHA's by eta^alpha and eta^(1-alpha); GQA's query by eta, the key shared
    by the group's query heads untouched."""
    q, k = tuple(attn.wq.parameters()), tuple(attn.wk.parameters())
    if group > 1:
        return [HeadRows(q, ((attn.head_dim, 1.0),))]
    return [HeadRows(q, ((attn.head_dim, alpha),)), HeadRows(k, ((attn.head_dim, 1.0 - alpha),))]


def latent_rows(attn: LatentAttention, alpha: float) -> list[HeadRows]:
    """`lit_lm.mla.LatentAttention`'s (Kimi K2's MLA rule): per head, wq_b's (wq's) q nope rows by eta^alpha and its
    q rope rows by eta, wkv_b's k nope rows by eta^(1-alpha) and its value rows not at all; wkv_a (the shared rope
    key) untouched."""
    wq = attn.wq if hasattr(attn, "wq") else attn.wq_b
    return [HeadRows((wq.weight,), ((attn.nope, alpha), (attn.rope_dim, 1.0))),
            HeadRows((attn.wkv_b.weight,), ((attn.nope, 1.0 - alpha), (attn.v_dim, 0.0)))]


@dataclass
class _Layer:
    """One attention layer as this rank holds it: its core (which measures), the rows its heads own (their weights
    found in the strategy's `owned_weights()` at each clip: an engine may re-point its parts after setup), and how
    many query heads it runs here."""

    core: LogitMaxRecord
    rows: list[HeadRows]
    heads: int
    device: torch.device


class QKClip(L.Callback):
    """Rescale the q/k projections of every attention head whose maximum logit passed `threshold` (tau), by
    eta = tau / S_max: queries by eta^alpha and keys by eta^(1 - alpha) (see the module docstring; under
    grouped-query attention the query takes all of eta, under MLA the rotary query does and the rotary key, shared
    by the heads, is untouched)."""

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
            raise ConfigError("QKClip found no attention layer (lit_lm.model.Attention, lit_lm.mla.LatentAttention) "
                              "in the model")
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
        for rows in layer.rows:
            factors = rows.factors(eta)
            for p in rows.params:
                scale_rows_(by_param[id(p)], factors)

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

        def heads(p: torch.nn.Parameter, per_head: int) -> int:  # this rank's heads (a tp slice's)
            start, stop = _rows(by_param[id(p)].param_index, by_param[id(p)].global_shape)
            return (stop - start) // per_head

        layers = []
        for name, attn in pl_module.named_modules():
            if isinstance(attn, LatentAttention):
                rows = latent_rows(attn, self.alpha)
            elif isinstance(attn, Attention):
                if attn.q_norm is not None:
                    raise ConfigError(f"QKClip cannot clip {name}: QK-norm (model.init_args.config.qk_norm) undoes any "
                                      "scale of wq and shares its weight between heads; it bounds the logits itself")
                q_heads, kv_heads = heads(attn.wq.weight, attn.head_dim), heads(attn.wk.weight, attn.head_dim)
                rows = attention_rows(attn, self.alpha, q_heads // kv_heads)
            else:
                continue
            if not isinstance(attn.core, LogitMaxRecord):
                raise ConfigError(f"QKClip cannot measure the logits of {name}.core ({type(attn.core).__name__}): "
                                  "use lit-lm's attention cores (lit_lm.kernels.logit_max.LogitMaxRecord)")
            if not all(p.requires_grad for r in rows for p in r.params):
                raise ConfigError(f"QKClip cannot clip {name}: it scales the q/k projections in place, and they are "
                                  "frozen (LoRA, model.init_args.lora, trains adapters beside them); drop QKClip")
            q = rows[0].params[0]
            layers.append(_Layer(attn.core, rows, heads(q, rows[0].per_head), by_param[id(q)].local.device))
        return layers
