"""Model configuration: one dataclass that LightningCLI exposes as `model.init_args.config.*`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from lit_lm.strategies.errors import ConfigError

__all__ = ["ARCHITECTURE", "ConfigError", "ModelConfig", "round_up"]


def round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


# The fields that decide which tensors a model has and their shapes: a checkpoint loads only into a model equal in
# all of them (the others, e.g. losses' weights, init_std or max_seq_len, may change between runs).
ARCHITECTURE = ("vocab_size", "vocab_multiple_of", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                "tie_embeddings", "qk_norm", "qk_norm_scope", "qkv_bias", "moe_experts", "moe_every", "moe_first_dense",
                "mla_kv_rank", "mla_q_rank", "mla_qk_nope_dim", "mla_qk_rope_dim", "mla_v_dim", "mtp_layers",
                "moe_d_ff", "moe_shared_experts", "attn_sinks", "o_bias", "moe_biases")


@dataclass
class ModelConfig:
    """Shape of a decoder-only Transformer (Llama-style: pre-norm, RMSNorm, RoPE, GQA, SwiGLU; no biases but
    Qwen2's optional q/k/v ones)."""

    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: Optional[int] = None  # None = n_heads (MHA); 1 = MQA
    head_dim: Optional[int] = None  # None = d_model / n_heads; else any even size (Qwen3-0.6B: 1024 / 16 heads, 128)
    d_ff: Optional[int] = None  # None = 8/3 * d_model rounded up to ffn_multiple_of
    ffn_multiple_of: int = 64
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    # Llama 3's frequency-dependent RoPE scaling: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"} (Hugging Face's `rope_scaling`); None = plain RoPE
    rope_scaling: Optional[dict] = None
    norm_eps: float = 1e-5
    sliding_window: Optional[int] = None  # attend to at most this many past positions (itself included)
    # per layer: "sliding_attention" (windowed by sliding_window) or "full_attention" (gpt-oss alternates them);
    # None = every layer windowed by sliding_window (or none)
    layer_types: Optional[list[str]] = None
    attn_sinks: bool = False  # a learned logit per query head joining its softmax, its mass dropped (gpt-oss)
    qk_norm: bool = False  # RMSNorm on q and k before RoPE
    qk_norm_scope: str = "head"  # over each head's head_dim (Qwen3) or over all heads of the projection (OLMoE)
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    # -- multi-head latent attention (DeepSeek-V2/V3, lit_lm.mla); mla_kv_rank = 0 keeps grouped-query attention ----
    mla_kv_rank: int = 0  # rank of the latent keys and values are made from (kv_lora_rank); > 0 selects MLA
    mla_q_rank: Optional[int] = None  # rank of the query's down-projection (q_lora_rank); None = a direct projection
    mla_qk_nope_dim: int = 0  # per-head query/key dims without position (qk_nope_head_dim)
    mla_qk_rope_dim: int = 0  # the decoupled RoPE dims, the key's shared by all heads (qk_rope_head_dim)
    mla_v_dim: int = 0  # per-head value dims (v_head_dim)
    mla_rope_interleave: bool = True  # the rope dims stored as interleaved pairs (DeepSeek's layout)
    o_bias: bool = False  # a bias on the attention's output projection (gpt-oss)
    tie_embeddings: bool = False
    z_loss: float = 0.0  # weight of the z-loss term mean(logsumexp(logits)^2)
    # multi-token prediction (DeepSeek-V3, lit_lm.mtp): mtp_layers extra blocks, the k-th predicting token t+k+1;
    # their mean cross-entropy times mtp_weight joins the training loss (never the logits: off in generation)
    mtp_layers: int = 0
    mtp_weight: float = 0.3
    init_std: float = 0.02
    vocab_multiple_of: int = 64  # pad the embedding/head rows; independent of any parallel degree
    # -- Mixture-of-Experts (lit_lm.moe); moe_experts = 0 keeps every block dense --------------------------------
    moe_experts: int = 0  # routed experts per MoE layer
    moe_top_k: int = 2  # experts chosen per token
    moe_every: int = 1  # block i is MoE when i >= moe_first_dense and i % moe_every == 0 (DeepSeek's layer_freq)
    moe_first_dense: int = 0  # the first blocks stay dense (DeepSeek's first_k_dense_replace)
    moe_d_ff: Optional[int] = None  # hidden size of each (fine-grained) expert; None = d_ff
    moe_shared_experts: int = 0  # always-on experts, fused into one SwiGLU of moe_shared_experts * moe_d_ff
    moe_score: str = "softmax"  # router scores: softmax (Switch, Mixtral) or sigmoid (DeepSeek-V3)
    moe_norm_topk: bool = True  # the k chosen scores renormalised to sum 1 (Mixtral) or used as they are (OLMoE)
    moe_capacity_factor: Optional[float] = None  # None = dropless; else capacity = ceil(cf * tokens * top_k / E)
    moe_aux_loss: float = 0.0  # weight of the Switch load-balancing loss E * sum_i f_i * P_i
    moe_z_loss: float = 0.0  # weight of the router z-loss mean(logsumexp(router logits)^2)
    moe_bias_update: float = 0.0  # gamma of auxiliary-loss-free balancing (DeepSeek-V3); 0 = off
    # node-limited routing (DeepSeek-V3's n_group, topk_group): the experts in moe_groups equal groups, a token
    # picks its moe_topk_groups best groups (a group's score: the sum of its top-2) and its experts among them only
    moe_groups: int = 1
    moe_topk_groups: int = 1
    moe_routed_scale: float = 1.0  # the routed experts' gates times this (DeepSeek-V3's routed_scaling_factor)
    moe_biases: bool = False  # biases in the router's linear and the experts' three projections (gpt-oss)
    # gpt-oss's clamped SwiGLU in the experts: (clamp(up, -l, l) + 1) * g * sigmoid(alpha * g), g = min(gate, l);
    # None = SwiGLU (silu(gate) * up)
    swiglu_limit: Optional[float] = None
    swiglu_alpha: float = 1.702
    # load statistics (aux loss, capacity) over the global batch (token counts all-gathered over the data-parallel
    # ranks: the same result on any number of ranks) or over each rank's micro-batch (no collective)
    moe_balance: str = "global"

    DERIVED = ("n_kv_heads", "head_dim", "d_ff", "moe_d_ff")  # None = derived from other fields in __post_init__

    @classmethod
    def signature_default(cls) -> "ModelConfig":
        """`ModelConfig()` for a signature default (`LanguageModel(config=...)`) with its derived fields left None.
        jsonargparse takes a default instance's fields as the defaults of a yaml's `config:`: a d_ff derived from
        the default d_model (704 for 256) would otherwise be passed explicitly when the yaml sets d_model 192, and
        `fit` would build another model than `plan` and `ModelConfig(d_model=192)` (d_ff 512)."""
        config = cls()
        for name in cls.DERIVED:
            setattr(config, name, None)
        return config

    def derived_fields(self) -> list[str]:
        """The DERIVED fields whose value is what derivation gives (left open, or stated equal to it). A field whose
        derivation is invalid for this config is stated (gpt-oss: d_model 2880 over 64 heads derives head_dim 45,
        odd, where the config states 64), and the others are derived beside it."""
        for stated in ((), *((n,) for n in self.DERIVED)):
            try:
                fresh = replace(self, **{n: None for n in self.DERIVED if n not in stated})
            except ConfigError:
                continue
            return [n for n in self.DERIVED if n not in stated and
                    (getattr(self, n) is None or getattr(self, n) == getattr(fresh, n))]
        return []

    def resolved(self) -> "ModelConfig":
        """This config with its derived fields filled (itself when they are)."""
        return replace(self) if any(getattr(self, n) is None for n in self.DERIVED) else self

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None and self.n_heads > 0 and self.d_model % self.n_heads == 0:
            self.head_dim = self.d_model // self.n_heads  # (left None when they do not divide: validate says so)
        if self.d_ff is None:
            self.d_ff = round_up(int(8 * self.d_model / 3), self.ffn_multiple_of)
        if self.moe_d_ff is None:
            self.moe_d_ff = self.d_ff
        self.validate()

    def validate(self) -> None:
        positive = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len",
                    "vocab_multiple_of", "ffn_multiple_of")
        for name in positive + (("head_dim",) if self.head_dim is not None else ()):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model config `{name}` must be a positive integer, got {getattr(self, name)}")
        if self.head_dim is None:  # derived from d_model / n_heads, which do not divide
            fits = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0 and self.d_model // h % 2 == 0]
            near = min(fits or [1], key=lambda h: abs(h - self.n_heads))
            raise ConfigError(
                f"model config `n_heads`={self.n_heads} must divide `d_model`={self.d_model} "
                f"(model.init_args.config.n_heads); pick n_heads from the divisors of d_model, e.g. {near} "
                f"(head_dim {self.d_model // near})"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model config `n_kv_heads`={self.n_kv_heads} must divide `n_heads`={self.n_heads} "
                "(grouped-query attention shares each kv head among n_heads/n_kv_heads query heads)"
            )
        if self.head_dim % 2:
            raise ConfigError(f"model config `head_dim` {self.head_dim} (d_model/n_heads unless set) must be even for "
                              "RoPE: change `n_heads` or `head_dim`")
        if self.qk_norm_scope not in ("head", "all"):
            raise ConfigError(f"model config `qk_norm_scope` must be head or all, got {self.qk_norm_scope!r}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"model config `sliding_window` must be positive or null, got {self.sliding_window}")
        self._validate_rope_scaling()
        self._validate_layer_types()
        if self.z_loss < 0:
            raise ConfigError(f"model config `z_loss` must be >= 0, got {self.z_loss}")
        self._validate_moe()
        self._validate_mla()
        if self.mtp_layers < 0 or self.mtp_weight < 0:
            raise ConfigError(f"model config `mtp_layers` and `mtp_weight` must be >= 0, got {self.mtp_layers}, "
                              f"{self.mtp_weight}")

    def _validate_mla(self) -> None:
        if not self.mla_kv_rank:
            return
        for name in ("mla_kv_rank", "mla_qk_nope_dim", "mla_qk_rope_dim", "mla_v_dim") + \
                (("mla_q_rank",) if self.mla_q_rank is not None else ()):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model config `{name}` must be a positive integer with multi-head latent "
                                  f"attention (mla_kv_rank > 0), got {getattr(self, name)}")
        if self.mla_qk_rope_dim % 2:
            raise ConfigError(f"model config `mla_qk_rope_dim` {self.mla_qk_rope_dim} must be even for RoPE")
        if self.qk_norm or self.qkv_bias:
            raise ConfigError("model config `qk_norm` and `qkv_bias` are grouped-query attention's: multi-head latent "
                              "attention (mla_kv_rank > 0) normalises its latents instead and has no biases")

    ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    # YaRN's (lit_lm.yarn): the numbers it needs; beta_fast, beta_slow, truncate, attention_factor, mscale and
    # mscale_all_dim are optional (transformers' defaults)
    YARN_KEYS = ("factor", "original_max_position_embeddings")

    def _validate_rope_scaling(self) -> None:
        if self.rope_scaling is None:
            return
        kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
        if kind not in ("llama3", "yarn"):
            raise ConfigError(f"model config `rope_scaling` rope_type {kind!r} is not supported (llama3 or yarn, or "
                              "null for plain RoPE)")
        keys = self.ROPE_SCALING_KEYS if kind == "llama3" else self.YARN_KEYS
        missing = [k for k in keys if not isinstance(self.rope_scaling.get(k), (int, float))]
        if missing:
            raise ConfigError(f"model config `rope_scaling` ({kind}) needs a number for {', '.join(missing)}")
        if kind == "llama3" and self.rope_scaling["high_freq_factor"] <= self.rope_scaling["low_freq_factor"]:
            raise ConfigError("model config `rope_scaling` needs high_freq_factor > low_freq_factor")

    LAYER_TYPES = ("sliding_attention", "full_attention")

    def _validate_layer_types(self) -> None:
        if self.layer_types is None:
            return
        if len(self.layer_types) != self.n_layers or not set(self.layer_types) <= set(self.LAYER_TYPES):
            raise ConfigError(f"model config `layer_types` must name each of the {self.n_layers} layers "
                              f"sliding_attention or full_attention, got {self.layer_types}")

    def window(self, layer: int) -> Optional[int]:
        """The attention window of block `layer`: `sliding_window` (None: none, as transformers reads a sliding layer
        without one), or None for a full_attention layer."""
        if self.layer_types is not None and self.layer_types[layer] == "full_attention":
            return None
        return self.sliding_window

    def _validate_moe(self) -> None:
        if self.moe_experts < 0:
            raise ConfigError(f"model config `moe_experts` must be >= 0 (0 = dense), got {self.moe_experts}")
        if not self.moe_experts:
            return
        for name in ("moe_top_k", "moe_every", "moe_d_ff"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model config `{name}` must be a positive integer, got {getattr(self, name)}")
        if self.moe_top_k > self.moe_experts:
            raise ConfigError(f"model config `moe_top_k`={self.moe_top_k} must be <= `moe_experts`="
                              f"{self.moe_experts}: a token cannot choose more experts than exist")
        if self.moe_balance not in ("global", "micro_batch"):
            raise ConfigError(f"model config `moe_balance` must be global or micro_batch, got {self.moe_balance!r}")
        if self.moe_score not in ("softmax", "sigmoid"):
            raise ConfigError(f"model config `moe_score` must be softmax or sigmoid, got {self.moe_score!r}")
        if self.moe_groups > 1 and (self.moe_experts % self.moe_groups or self.moe_experts // self.moe_groups < 2 or
                                    not 1 <= self.moe_topk_groups <= self.moe_groups or
                                    self.moe_top_k > self.moe_topk_groups * self.moe_experts // self.moe_groups):
            raise ConfigError(f"model config `moe_groups`={self.moe_groups} must split `moe_experts`="
                              f"{self.moe_experts} into groups of 2 or more, and `moe_topk_groups`="
                              f"{self.moe_topk_groups} groups (1 to moe_groups) must hold `moe_top_k`={self.moe_top_k}")
        if self.moe_routed_scale <= 0:
            raise ConfigError(f"model config `moe_routed_scale` must be > 0, got {self.moe_routed_scale}")
        if self.moe_capacity_factor is not None and self.moe_capacity_factor <= 0:
            raise ConfigError(f"model config `moe_capacity_factor` must be > 0 or null (dropless), "
                              f"got {self.moe_capacity_factor}")
        if self.swiglu_limit is not None and self.swiglu_limit <= 0:
            raise ConfigError(f"model config `swiglu_limit` must be > 0 or null, got {self.swiglu_limit}")
        for name in ("moe_first_dense", "moe_shared_experts", "moe_aux_loss", "moe_z_loss", "moe_bias_update"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model config `{name}` must be >= 0, got {getattr(self, name)}")
        if not any(self.is_moe_layer(i) for i in range(self.n_layers)):
            raise ConfigError(f"model config `moe_experts`={self.moe_experts} but no block is MoE: "
                              f"`moe_first_dense`={self.moe_first_dense} and `moe_every`={self.moe_every} "
                              f"skip all {self.n_layers} layers")

    def architecture_differences(self, saved: ModelConfig) -> list[str]:
        """`name: saved (checkpoint) != this` for every ARCHITECTURE field that differs."""
        return [f"{name} {getattr(saved, name)} (checkpoint) != {getattr(self, name)} (config)"
                for name in ARCHITECTURE if getattr(saved, name) != getattr(self, name)]

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe_experts > 0 and layer >= self.moe_first_dense and layer % self.moe_every == 0

    @property
    def padded_vocab_size(self) -> int:
        return round_up(self.vocab_size, self.vocab_multiple_of)

    def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
        """Parameter count from the shapes alone: lit-lm's one definition of "the model's parameters", printed by
        `fit` and `plan` and equal to the estimator's inventory and to `sum(p.numel() for p in model.parameters())`
        (Lightning's summary): the embedding (padded rows) included, a tied head counted once. FLOPs use
        `include_embedding=False` (6N counts matmuls; an embedding lookup is none). `active`: an MoE layer counts
        its router, shared experts and `moe_top_k` routed experts only (what one token's forward multiplies by)."""
        d, q, kv = self.d_model, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        norms = (2 * self.head_dim if self.qk_norm_scope == "head" else q + kv) if self.qk_norm else 0
        attn = d * q * 2 + d * kv * 2 + norms + (q + 2 * kv if self.qkv_bias else 0) + (d if self.o_bias else 0) + \
            (self.n_heads if self.attn_sinks else 0)
        if self.mla_kv_rank:
            attn = self._mla_params()
        dense_mlp = 3 * d * self.d_ff
        expert = 3 * d * self.moe_d_ff + ((2 * self.moe_d_ff + d) if self.moe_biases else 0)
        moe_mlp = self.moe_experts * (d + self.moe_biases) + self.moe_shared_experts * 3 * d * self.moe_d_ff + \
            (self.moe_top_k if active else self.moe_experts) * expert
        blocks = sum(attn + 2 * d + (moe_mlp if self.is_moe_layer(i) else dense_mlp) for i in range(self.n_layers))
        emb = self.padded_vocab_size * d
        head = 0 if self.tie_embeddings else emb
        mtp = sum(attn + 2 * d + (moe_mlp if self.is_moe_layer(self.n_layers + k) else dense_mlp) + 2 * d * d + 3 * d
                  for k in range(self.mtp_layers))  # a block, its norms, eh_proj, enorm, hnorm and final norm
        return blocks + mtp + d + head + (emb if include_embedding else 0)

    def _mla_params(self) -> int:
        """MLA's parameters per block (lit_lm.mla): q's projections (and norm), wkv_a, kv_norm, wkv_b, wo."""
        d, h, qk = self.d_model, self.n_heads, self.mla_qk_nope_dim + self.mla_qk_rope_dim
        q = d * h * qk if self.mla_q_rank is None else self.mla_q_rank * (d + 1 + h * qk)
        return q + d * (self.mla_kv_rank + self.mla_qk_rope_dim) + self.mla_kv_rank * (
            1 + h * (self.mla_qk_nope_dim + self.mla_v_dim)) + h * self.mla_v_dim * d
