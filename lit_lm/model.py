"""A decoder-only Transformer as in modern LLMs (Llama family): pre-norm blocks, RMSNorm, RoPE (optionally with
Llama 3's scaling), grouped-query attention (optionally windowed: Mistral), SwiGLU MLP, no biases but Qwen2's
optional q/k/v ones.

Every operation that `lit_lm/kernels/` can replace is its own small module (`RMSNorm`, `RotaryEmbedding`,
`CausalAttention`, `SwiGLU`, `LMLoss`), so a Triton version is swapped in without touching this file and with the
same state-dict keys. `blocks` is keyed by the *global* layer index: strategies gather, wrap and split it, and the
names stay the same under any split.
"""

from __future__ import annotations

import math
import weakref
import zlib
from typing import Optional, Protocol, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_lm.attention_sinks import SinkAttention, causal_mask, sink_attention
from lit_lm.config import ConfigError, ModelConfig
from lit_lm.kernels.logit_max import LogitMaxRecord, logit_max
from lit_lm.lora import init_factor, lora_factor
from lit_lm.mla import LatentAttention
from lit_lm.moe import MoE, moe_aux_loss, moe_layers
from lit_lm.mtp import MTPModule, mtp_loss
from lit_lm.yarn import yarn_attention_factor, yarn_frequencies


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, with the statistics in fp32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: Optional[dict] = None) -> Tensor:
    """fp64 (D/2,) angular frequencies theta^(-2i/D); with Llama 3's `scaling` (`ModelConfig.rope_scaling`), the
    wavelengths longer than original_max_position_embeddings / low_freq_factor are stretched by `factor`, those
    shorter than original / high_freq_factor kept, and the band between interpolated smoothly (Meta's formula);
    with rope_type "yarn", YaRN's (`lit_lm.yarn`)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.get("rope_type", scaling.get("type")) == "yarn":
        return yarn_frequencies(inv_freq, head_dim, theta, scaling)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((context / wavelen - low) / (high - low)).clamp(0.0, 1.0)  # 0: long waves, 1: short waves
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half convention) applied to q and k of shape (B, T, H, D).

    Position t rotates the pair (x_i, x_{i+D/2}) by angle t * theta^(-2i/D), so q_t . k_s depends on t - s only.
    cos/sin tables are cached per (length, device) and never stored in checkpoints.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, scaling: Optional[dict] = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.inv_freq = rope_frequencies(head_dim, theta, scaling)  # fp64 (D/2,): theta^(-2i/D), maybe rescaled
        # YaRN's attention factor: cos and sin (so q and k) scaled by it; 1 otherwise
        yarn = scaling is not None and scaling.get("rope_type", scaling.get("type")) == "yarn"
        self.attention_factor = yarn_attention_factor(scaling) if yarn else 1.0
        self._cache: dict[tuple[int, int, torch.device], tuple[Tensor, Tensor]] = {}
        self._at: Optional[tuple[Tensor, torch.device, tuple[Tensor, Tensor]]] = None  # see cos_sin_at
        self._freq_on: dict[torch.device, Tensor] = {}  # inv_freq per device (`tables`)

    def cos_sin(self, seq_len: int, device: torch.device, offset: int = 0) -> tuple[Tensor, Tensor]:
        if torch.compiler.is_compiling():  # in the graph, no cache: a lookup that fills it would recompile at step 2
            return self.tables(torch.arange(offset, offset + seq_len), device)
        key = (seq_len, offset, device)
        if key not in self._cache:
            self._cache[key] = self.cos_sin_at(torch.arange(offset, offset + seq_len), device)
        return self._cache[key]

    def cos_sin_at(self, positions: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
        """fp32 (T, D/2) tables for arbitrary token positions (T,), e.g. a context-parallel rank's zigzag chunks;
        built in fp64 like the contiguous tables, so a position gets the same angle whichever rank holds it.
        The last tables are kept against the positions tensor itself: context parallelism passes the same one
        every step (`lit_lm.strategies.cp.zigzag_batch`), so they are built once, not on the host per layer per step."""
        if torch.compiler.is_compiling():
            return self.tables(positions, device)
        if self._at is not None and self._at[0] is positions and self._at[1] == device:
            return self._at[2]
        tables = self.tables(positions, device)
        self._at = (positions, device, tables)
        return tables

    def tables(self, positions: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
        """Built where the positions are: a device's positions are never read to the host (context parallelism's
        document balance hands new ones every step), with the frequencies copied there once."""
        angles = torch.outer(positions.to(torch.float64), self._freq(positions.device))  # (T, D/2)
        m = self.attention_factor
        return (angles.cos() * m).float().to(device), (angles.sin() * m).float().to(device)

    def row_tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """fp32 (B, T, D/2) tables for per-row positions (B, T) of any value, on their device (no host read), in
        fp64 as `tables`: a position's angles are those it has in a row of its own. Any value, so a context-parallel
        rank's share of a row (whose positions reach the whole row's length) needs no table of that length."""
        angles = positions.to(torch.float64).unsqueeze(-1) * self._freq(positions.device)
        m = self.attention_factor
        return (angles.cos() * m).float(), (angles.sin() * m).float()

    def _freq(self, at: torch.device) -> Tensor:
        """inv_freq on `at`, copied there once (a host-to-device copy every step would wait on the device); in a
        compiled graph a constant of the graph, not a cache entry (one filled there would recompile at step 2)."""
        if torch.compiler.is_compiling():
            return self.inv_freq.to(at)
        if at not in self._freq_on:
            self._freq_on[at] = self.inv_freq.to(at)
        return self._freq_on[at]

    @staticmethod
    def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads: (T, 1, D/2) or (B, T, 1, D/2)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)

    def forward(self, q: Tensor, k: Tensor, positions: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """`positions` (T,): the sequence positions of the T tokens; None means 0..T-1. (B, T): each row's own
        positions (documents restarting at 0, `lit_lm.data.packing`; under cp a rank's share of them): `row_tables`,
        made on the device, so a position gets the same angle as in a row of its own."""
        if positions is not None and positions.ndim == 2:
            cos, sin = self.row_tables(positions)
        else:
            cos, sin = self.cos_sin(q.shape[1], q.device) if positions is None else \
                self.cos_sin_at(positions, q.device)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)


class WeightSource(Protocol):
    """Initial values read from elsewhere (`lit_lm.hf.importer.HFWeights`), by parameter name and global slice."""

    def read(self, name: str, tensor: Tensor, index: tuple[slice, ...] = ()) -> None: ...

    def holds(self, name: str) -> bool: ...  # whether `read` has a value for parameter or buffer `name`


def document_mask(documents: Tensor, window: Optional[int] = None) -> Tensor:
    """(B, 1, T, T) bool for SDPA: query t sees key s iff they are in one document (`documents` (B, T), see
    `lit_lm.data.packing`), s <= t and t - s < window. Made once per (`documents` tensor, window), so every layer of
    a forward (and a checkpointed block's recompute) shares one mask per window kind instead of holding one each for
    backward; the masks are dropped with the `documents` tensor (B·T² bytes each: not kept between steps)."""
    if torch.compiler.is_compiling():
        return _block_causal(documents, window)
    held = _MASKS.get("documents")
    if held is None or held() is not documents:
        _MASKS.clear()
        _MASKS["documents"] = weakref.ref(documents, lambda _: _MASKS.clear())
    key = ("window", window)
    if key not in _MASKS:
        _MASKS[key] = _block_causal(documents, window)
    return _MASKS[key]


def _block_causal(documents: Tensor, window: Optional[int]) -> Tensor:
    t = torch.arange(documents.shape[1], device=documents.device)
    distance = t[:, None] - t[None, :]
    allowed = (distance >= 0) & (distance < (window or documents.shape[1]))
    return (allowed & (documents[:, :, None] == documents[:, None, :]))[:, None]


_MASKS: dict = {}  # document_mask's: "documents" -> a weak reference to the tensor, ("window", w) -> its mask


class CausalAttention(LogitMaxRecord, nn.Module):
    """softmax(q k^T / sqrt(D) + causal[/sliding-window] mask) v for q (B, Hq, T, D) and k, v (B, Hkv, T, D);
    with `documents` (B, T), within each document too (a block-diagonal causal mask: `document_mask`).

    Grouped-query attention is handled by SDPA's `enable_gqa`: kv heads are shared, never repeated in memory.
    While QK-clip measures (`LogitMaxRecord`), the per-head maximum logit is recomputed from the same q, k.
    """

    def __init__(self, sliding_window: Optional[int] = None) -> None:
        super().__init__()
        self.sliding_window = sliding_window

    def forward(self, q: Tensor, k: Tensor, v: Tensor, documents: Optional[Tensor] = None) -> Tensor:
        if self.measuring:
            self.record_logit_max(logit_max(q, k, self.sliding_window, documents))
        gqa = q.shape[1] != k.shape[1]
        if documents is not None:
            mask = document_mask(documents, self.sliding_window)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        if self.sliding_window is None or self.sliding_window >= q.shape[2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        t = torch.arange(q.shape[2], device=q.device)
        distance = t[:, None] - t[None, :]
        mask = (distance >= 0) & (distance < self.sliding_window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class KVCache:
    """One layer's keys and values (B, Hkv, L, D) of the positions processed so far, for incremental decoding."""

    def __init__(self) -> None:
        self.k: Optional[Tensor] = None
        self.v: Optional[Tensor] = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


def cached_attention(q: Tensor, k: Tensor, v: Tensor, sliding_window: Optional[int]) -> Tensor:
    """Attention of the last q.shape[2] positions over all k.shape[2] cached ones (causal, optional window)."""
    q_pos = torch.arange(k.shape[2] - q.shape[2], k.shape[2], device=q.device)
    distance = q_pos[:, None] - torch.arange(k.shape[2], device=q.device)[None, :]
    mask = (distance >= 0) & (distance < (sliding_window or k.shape[2]))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    """Grouped-query self-attention with separate q/k/v projections (so tensor parallelism and checkpoint
    resharding split heads without de-interleaving a fused weight), optional QK-norm, q/k/v biases (Qwen2), an
    output bias and attention sinks (gpt-oss: `lit_lm.attention_sinks`); the window of block `layer`
    (`ModelConfig.window`)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.o_bias)
        # QK-norm over each head (Qwen3: a head_dim weight shared by the heads) or over the whole projection (OLMoE)
        per_head = cfg.qk_norm_scope == "head"
        self.q_norm = RMSNorm(cfg.head_dim if per_head else cfg.n_heads * cfg.head_dim, cfg.norm_eps) \
            if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim if per_head else cfg.n_kv_heads * cfg.head_dim, cfg.norm_eps) \
            if cfg.qk_norm else None
        self.norm_projection = cfg.qk_norm and not per_head
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.sliding_window = cfg.window(layer)
        self.core = SinkAttention(cfg.n_heads, self.sliding_window) if cfg.attn_sinks else \
            CausalAttention(self.sliding_window)

    def forward(self, x: Tensor, positions: Optional[Tensor] = None, cache: Optional[KVCache] = None,
                documents: Optional[Tensor] = None) -> Tensor:
        b, t, _ = x.shape
        # Head counts come from the weights, so a tensor-parallel shard runs the same code on its heads.
        q, k = self.wq(x), self.wk(x)
        if self.norm_projection:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(b, t, -1, self.head_dim), k.view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None and not self.norm_projection:
            q, k = self.q_norm(q), self.k_norm(k)
        if cache is None:
            q, k = self.rope(q, k, positions)
            qkv = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            y = self.core(*qkv) if documents is None else self.core(*qkv, documents)
        else:  # decoding: positions continue after the cached ones
            q, k = self.rope(q, k, torch.arange(cache.length, cache.length + t))
            k, v = cache.append(k.transpose(1, 2), v.transpose(1, 2))
            if isinstance(self.core, SinkAttention):
                mask = causal_mask(t, k.shape[2], self.sliding_window, q.device)
                y = sink_attention(q.transpose(1, 2), k, v, self.core.sinks, mask)
            else:
                y = cached_attention(q.transpose(1, 2), k, v, self.sliding_window)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    """w_down(silu(w_gate x) * w_up x): gate and up are separate weights so a TP split keeps them paired."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ff, bias=False)
        self.w_up = nn.Linear(d_model, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(.)); the mlp is an MoE layer when the config
    says block `layer` is one."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = LatentAttention(cfg, layer) if cfg.mla_kv_rank else Attention(cfg, layer)  # MLA: lit_lm.mla
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.is_moe_layer(layer):
            shared = SwiGLU(cfg.d_model, cfg.moe_shared_experts * cfg.moe_d_ff) if cfg.moe_shared_experts else None
            self.mlp: nn.Module = MoE(cfg, shared)
        else:
            self.mlp = SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x: Tensor, positions: Optional[Tensor] = None, cache: Optional[KVCache] = None,
                documents: Optional[Tensor] = None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), positions, cache, documents=documents)
        return x + self.mlp(self.mlp_norm(x))


class LMLoss(nn.Module):
    """Mean token cross-entropy in fp32 plus z_loss * mean(logsumexp(logits)^2) (PaLM), ignoring target -100.

    Returns (loss, ce): `loss` is optimised, `ce` is what perplexity is computed from.
    """

    def __init__(self, z_loss: float = 0.0) -> None:
        super().__init__()
        self.z_loss = z_loss

    def forward(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        logits = logits.reshape(-1, logits.shape[-1]).float()
        targets = targets.reshape(-1)
        ce = F.cross_entropy(logits, targets, ignore_index=-100)
        if self.z_loss == 0.0:
            return ce, ce.detach()
        valid = targets != -100  # masked, not indexed: `logits[valid]` is a host sync (nonzero) on an accelerator
        lse = torch.logsumexp(logits, dim=-1).masked_fill(~valid, 0.0)
        return ce + self.z_loss * lse.pow(2).sum() / valid.sum(), ce.detach()


class Transformer(nn.Module):
    """Token embedding -> blocks -> final norm -> LM head.

    Implements the parallel-plan protocol of `lit_lm.strategies.plan`: `blocks` (keyed by global layer index) and
    `init_parameter(name, tensor)`, which initialises any parameter from its name alone so a block materialised
    on one rank (ZeRO-3, pipeline stages) gets exactly the values a single-process model would.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.padded_vocab_size, config.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(config, i) for i in range(config.n_layers)})
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.padded_vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        self.loss_fn = LMLoss(config.z_loss)
        # multi-token prediction (lit_lm.mtp): training's extra loss only, keyed by depth - 1
        self.mtp = nn.ModuleDict({str(k): MTPModule(config, config.n_layers + k) for k in range(config.mtp_layers)}) \
            if config.mtp_layers else None
        self.init_seed = torch.initial_seed()
        # Where the initial values come from instead of the seeded init (`lit_lm.hf.importer.HFWeights`): anything
        # with `read(name, tensor, index=())` filling `tensor` with `global[index]` of parameter `name`.
        self.weights: Optional[WeightSource] = None
        if not self.tok_embeddings.weight.is_meta:
            self.init_weights()

    # -- initialisation -------------------------------------------------------------------------------------
    def init_parameter(self, name: str, tensor: Tensor) -> None:
        """Fill `tensor` in place with the initial value of parameter `name` (a name of `named_parameters()`).

        Norm weights are 1; output projections (wo, w_down, the experts' stacked w_down) use std/sqrt(2 * n_layers)
        so the residual stream's variance does not grow with depth (GPT-2); MoE routers std/10 (near-uniform
        routing at the start); everything else N(0, std). The values come from a generator
        seeded by (init seed, name), so they do not depend on device, order, or which rank builds the block.
        Biases start at 0. With `weights` set (`init_from`), the value is read from them instead. LoRA's factors
        (`lit_lm.lora`: in no weights source) draw A from the same generator, B = 0.
        """
        factor = lora_factor(name)
        if self.weights is not None and factor is None:
            self.weights.read(name, tensor)
            return
        if name.endswith((".bias", "_bias")):  # the experts' gate_bias, up_bias, down_bias too
            with torch.no_grad():
                tensor.zero_()
            return
        if name.endswith("norm.weight"):
            with torch.no_grad():
                tensor.fill_(1.0)
            return
        std = self.config.init_std
        if name.endswith(("wo.weight", "w_down.weight", "experts.w_down")):
            std /= math.sqrt(2 * self.config.n_layers)
        elif name.endswith("router.weight"):
            std /= 10
        gen = torch.Generator().manual_seed((self.init_seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        if factor is not None:
            init_factor(tensor, factor, gen)
            return
        values = torch.empty(tensor.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
        with torch.no_grad():
            tensor.copy_(values)

    def init_parameter_part(self, name: str, tensor: Tensor, index: tuple[slice, ...]) -> bool:
        """Fill `tensor` with `global[index]` of parameter `name` without building the whole one, when the values
        are read from `weights` (a tp, ep or ZeRO-3 rank reads only its slice of the files); False otherwise (the
        seeded init draws the whole tensor: the strategy initialises it whole and slices it)."""
        if self.weights is None or lora_factor(name) is not None:
            return False
        self.weights.read(name, tensor, index)
        return True

    def init_buffer(self, name: str, tensor: Tensor) -> None:
        """Fill a buffer built on the meta device: the MoE routers' bias and token counts start at zero, a bias the
        weights hold (DeepSeek-V3's e_score_correction_bias) is read from them."""
        if not name.endswith(("expert_bias", "step_counts")):
            raise ValueError(f"no initial value for buffer {name}")
        if name.endswith("expert_bias") and self.weights is not None and self.weights.holds(name):
            self.weights.read(name, tensor)
            return
        with torch.no_grad():
            tensor.zero_()

    def init_weights(self) -> None:
        for name, param in self.named_parameters():
            self.init_parameter(name, param)

    def _refuse_moe(self, what: str, why: str) -> None:
        if moe_layers(self):
            raise ConfigError(f"{what} does not support MoE layers yet ({why}): set "
                              "model.init_args.config.moe_experts to 0 or use the `ep` strategy")

    def tensor_parallel_plan(self) -> dict:
        """WHAT tensor parallelism splits (Megatron): heads in attention, the hidden features in the MLP, the
        vocabulary in the embedding, head and loss; norms are replicated (sequence-parallel). See
        `lit_lm.strategies.plan.TensorParallel` for the styles; the strategy decides HOW."""
        from lit_lm.strategies.plan import TensorParallel as TP  # the protocol's types; strategies never import lit_lm

        heads, kv_heads = (TP("column", self.config.head_dim, name) for name in ("query heads", "kv heads"))
        plan = {"tok_embeddings": TP("vocab_embedding"), "norm": TP("sequence"), "lm_head": TP("vocab_head"),
                "loss_fn": TP("vocab_loss")}
        if self.mtp is not None:
            raise ConfigError("tensor parallelism does not split the multi-token prediction modules yet: set "
                              "model.init_args.config.mtp_layers to 0 or use ZeRO or ep")
        for i in self.blocks:
            b = f"blocks.{i}"
            plan.update({f"{b}.attn_norm": TP("sequence"), f"{b}.mlp_norm": TP("sequence")})
            if isinstance(self.blocks[i].attn, LatentAttention):  # its own projections and replicas (lit_lm.mla)
                plan.update(self.blocks[i].attn.tensor_parallel_plan(f"{b}.attn"))
            else:
                plan.update({f"{b}.attn": TP("region"), f"{b}.attn.wq": heads, f"{b}.attn.wk": kv_heads,
                             f"{b}.attn.wv": kv_heads, f"{b}.attn.wo": TP("row", self.config.head_dim, "query heads")})
            if isinstance(self.blocks[i].mlp, MoE):  # experts replicated over tp (shard them with ep)
                plan[f"{b}.mlp"] = TP("batch")
            else:
                plan.update({f"{b}.mlp": TP("region"), f"{b}.mlp.w_gate": TP("column"), f"{b}.mlp.w_up": TP("column"),
                             f"{b}.mlp.w_down": TP("row")})
            if self.config.qk_norm and self.config.qk_norm_scope == "all":
                raise ConfigError("tensor parallelism splits the heads, and `qk_norm_scope` all (OLMoE) normalises q "
                                  "and k over all of them (model.init_args.config.qk_norm_scope): use ZeRO-3 or ep")
            if self.config.qk_norm:
                plan.update({f"{b}.attn.q_norm": TP("per_head"), f"{b}.attn.k_norm": TP("per_head")})
            if self.config.attn_sinks:  # one sink per query head: split with the heads
                plan[f"{b}.attn.core"] = TP("heads", 1, "query heads")
        return plan

    # -- forward --------------------------------------------------------------------------------------------
    def forward(self, idx: Tensor, positions: Optional[Tensor] = None, cache: Optional[list[KVCache]] = None,
                documents: Optional[Tensor] = None, targets: Optional[Tensor] = None) -> Tensor:
        """idx (B, T) token ids -> logits (B, T, padded_vocab_size). `positions` (T,) are the tokens' places in
        the sequence (for RoPE): None means 0..T-1; a context-parallel rank passes those of the chunks it holds;
        (B, T): per row (documents restarting at 0). `documents` (B, T): each token's document in its row
        (`lit_lm.data.packing`): attention stays inside it; None: the row is one sequence.
        With `cache` (one `KVCache` per block), idx continues the cached positions and the cache is extended
        (`lit_lm.generate`). With `targets` and multi-token prediction, its loss is left in `mtp_loss` (as MoE
        layers leave theirs): inside forward, so a strategy's hooks on it (ZeRO-3's gathers) cover its modules."""
        x = self.tok_embeddings(idx)
        for i, block in enumerate(self.blocks.values()):
            x = block(x, positions, None if cache is None else cache[i], documents=documents)
        if targets is not None and self.mtp is not None:
            self.mtp_loss = mtp_loss(self, x, idx, targets, positions, documents)
        return self.lm_head(self.norm(x))

    def loss(self, idx: Tensor, targets: Tensor, positions: Optional[Tensor] = None,
             documents: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """(loss to optimise, detached cross-entropy) for next-token prediction; MoE balancing losses and the
        multi-token prediction loss (`lit_lm.mtp`) included, `ce` the next token's only."""
        loss, ce = self.loss_fn(self(idx, positions, documents=documents, targets=targets), targets)
        if self.mtp is not None:
            loss = loss + self.mtp_loss
        return loss + moe_aux_loss(self), ce

    def context_parallel_plan(self) -> dict:
        """WHAT context parallelism replaces (lit_lm.strategies.plan.ContextParallelModel): each block's attention core,
        the only op that mixes tokens; RoPE follows the `positions` given to `forward`."""
        from lit_lm.strategies.plan import ContextParallel  # the protocol's types; strategies never import lit_lm

        self._refuse_moe("context parallelism", "the balancing losses would count one rank's tokens only")
        cfg = self.config
        if cfg.mla_kv_rank and cfg.mla_v_dim > cfg.mla_qk_nope_dim + cfg.mla_qk_rope_dim:
            raise ConfigError(f"context parallelism pads latent attention's values to the key width (lit_lm.mla): "
                              f"`mla_v_dim` {cfg.mla_v_dim} must be <= mla_qk_nope_dim + mla_qk_rope_dim")
        heads = (cfg.n_heads, cfg.n_heads if cfg.mla_kv_rank else cfg.n_kv_heads)  # latent attention: a key per head
        return {f"blocks.{i}.attn.core": ContextParallel(cfg.window(int(i)), cfg.attn_sinks, heads)
                for i in self.blocks}

    def expert_plan(self) -> dict:
        """WHAT expert parallelism shards (lit_lm.strategies.plan.ExpertModel): each MoE layer's `GroupedExperts`, whose
        parameters are stacked over the expert dim and whose forward takes tokens grouped by expert."""
        from lit_lm.strategies.plan import ExpertParallel  # the protocol's types; strategies never import lit_lm

        return {f"{name}.experts": ExpertParallel(m.n_experts) for name, m in moe_layers(self).items()}

    def set_batch_group(self, group: Optional[torch.distributed.ProcessGroup]) -> None:
        """The ranks the global batch is split over (lit_lm.strategies.plan.ExpertModel): MoE load statistics are
        computed over them (`moe_balance: global`)."""
        for m in moe_layers(self).values():
            m.batch_group = group

    # -- pipeline protocol (lit_lm.strategies.plan.PipelineModel) --------------------------------------------------
    def pipeline_split(self, stage_layers: list[int], is_first: bool, is_last: bool) -> None:
        """Keep only what one pipeline stage owns: its blocks (still keyed by global index), the embedding on the
        first stage, the final norm and head on the last. A tied head keeps its Parameter on the last stage."""
        if self.mtp is not None:
            raise ConfigError("pipeline parallelism does not run the multi-token prediction modules (they need the "
                              "first stage's embedding on the last): set model.init_args.config.mtp_layers to 0")
        keep = {str(i) for i in stage_layers}
        for key in [k for k in self.blocks if k not in keep]:
            del self.blocks[key]
        if not is_first:
            self.tok_embeddings = None
        if not is_last:
            self.norm = self.lm_head = None

    def pipeline_activation(self, batch: int, seq_len: int) -> tuple[torch.Size, torch.dtype]:
        """Shape and dtype of the hidden state between stages, so receivers can allocate before data arrives.
        The residual stream keeps the weights' dtype (under bf16 autocast the residual add promotes to fp32)."""
        return torch.Size((batch, seq_len, self.config.d_model)), next(self.parameters()).dtype

    def stage_forward(self, x: Tensor, layers: list[int], targets: Optional[Tensor] = None,
                      positions: Optional[Tensor] = None, documents: Optional[Tensor] = None
                      ) -> Union[Tensor, tuple[Tensor, Tensor]]:
        """Run `layers` of a split model: embeds `x` when it holds token ids (integer dtype), and finishes with
        norm, head and loss -> (loss, ce) when `targets` are given; otherwise returns the hidden state.
        `positions`, `documents`: this microbatch's, as `forward` takes them."""
        if not x.is_floating_point():
            x = self.tok_embeddings(x)
        for i in layers:
            x = self.blocks[str(i)](x, positions, documents=documents)
        aux = sum((moe_aux_loss(self.blocks[str(i)]) for i in layers), 0.0)  # these layers' balancing losses
        if targets is None:
            return (x, aux) if isinstance(aux, Tensor) else x
        loss, ce = self.loss_fn(self.lm_head(self.norm(x)), targets)
        return loss + aux, ce
