"""The Hugging Face model families lit-lm reads and writes, as data: one `Family` entry each, used both ways by
`lit_lm.hf.importer` (config.json -> `ModelConfig`, tensor names -> parameters) and `lit_lm.hf.exporter` (back).

A family is what its `config.json` keys mean in `ModelConfig` fields (`fields`: the first key present wins; the
exporter writes the first), the values transformers assumes when a key is absent (`defaults`), the `ModelConfig`
fields the family fixes (`sets`: Qwen2's q/k/v biases, Qwen3's per-head QK-norm), the keys whose truthy value
lit-lm cannot express (`refuse`: refused in one line naming the key), the constant keys the export writes
(`writes`) and, for a Mixture-of-Experts family, how it stores an MoE layer (`Experts`: one tensor per expert and
projection; lit-lm stacks them over a leading expert dim, so an expert-parallel rank reads its experts' tensors
only). The next family is one entry here and a test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from lit_lm.config import ModelConfig
from lit_lm.hf.gpt_oss import GptOssExperts

# config.json key(s) -> ModelConfig field, for every family (the first key present is read; the export writes it)
COMMON_FIELDS: dict[str, tuple[str, ...]] = {
    "vocab_size": ("vocab_size",), "d_model": ("hidden_size",), "d_ff": ("intermediate_size",),
    "n_layers": ("num_hidden_layers",), "n_heads": ("num_attention_heads",), "n_kv_heads": ("num_key_value_heads",),
    "head_dim": ("head_dim",), "norm_eps": ("rms_norm_eps",), "tie_embeddings": ("tie_word_embeddings",)}
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
NO_BIAS = (("attention_bias", "lit-lm's projections have no biases (but Qwen2's q/k/v ones)"),
           ("mlp_bias", "lit-lm's MLP has no biases"))
NO_LAYER_WINDOWS = (("use_sliding_window", "lit-lm windows every layer or none (Mistral), not per layer"),)

# lit-lm module (under blocks.<i>.) -> Hugging Face module (under model.layers.<i>.), every family
# multi-head latent attention's (lit_lm.mla, DeepSeek-V3)
MLA_BLOCK = {"attn.wq": "self_attn.q_proj", "attn.wq_a": "self_attn.q_a_proj", "attn.q_norm": "self_attn.q_a_layernorm",
             "attn.wq_b": "self_attn.q_b_proj", "attn.wkv_a": "self_attn.kv_a_proj_with_mqa",
             "attn.kv_norm": "self_attn.kv_a_layernorm", "attn.wkv_b": "self_attn.kv_b_proj"}
BLOCK = {"attn_norm": "input_layernorm", "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj",
         "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj", "attn.q_norm": "self_attn.q_norm",
         "attn.k_norm": "self_attn.k_norm", "mlp_norm": "post_attention_layernorm", "mlp.w_gate": "mlp.gate_proj",
         "mlp.w_up": "mlp.up_proj", "mlp.w_down": "mlp.down_proj",
         "attn.core": "self_attn"}  # the core's parameters: attention sinks (gpt-oss's self_attn.sinks)
TOP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"}
# multi-token prediction module k (lit_lm.mtp: mtp.<k>.*) as DeepSeek-V3 stores it: layer n_layers + k of the
# decoder (model.layers.<n_layers + k>.*: its block's tensors named as a layer's, and these), plus copies of the
# embedding and head it shares with the model (`MTP_SHARED`: not read, written back as copies)
MTP = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": "shared_head.norm"}
MTP_SHARED = {"tok_embeddings.weight": "embed_tokens.weight", "lm_head.weight": "shared_head.head.weight"}


@dataclass(frozen=True)
class Experts:
    """How a family stores an MoE layer (names under model.layers.<i>.): the router's linear, and expert e's
    gate, up and down projections as `{prefix}.{e}.{gate|up|down}.weight` (lit-lm's stacked w_gate/w_up/w_down)."""

    router: str = "mlp.gate"
    prefix: str = "mlp.experts"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    shared: Optional[str] = None  # the shared experts' SwiGLU (DeepSeek-V3: mlp.shared_experts), gate/up/down named so
    bias: Optional[str] = None  # the router's selection bias (lit-lm's expert_bias buffer: e_score_correction_bias)

    def names(self, layer: str, param: str, n_experts: int) -> Union[str, list[str]]:
        """The Hugging Face name(s) of MoE parameter `param` (relative to the block's mlp) of layer `layer`."""
        if param == "router.weight":
            return f"model.layers.{layer}.{self.router}.weight"
        if param == "router.expert_bias" and self.bias is not None:
            return f"model.layers.{layer}.{self.bias}"
        if param.startswith("shared.w_") and self.shared is not None:
            proj = {"w_gate": self.gate, "w_up": self.up, "w_down": self.down}[param.split(".")[1]]
            return f"model.layers.{layer}.{self.shared}.{proj}.weight"
        proj = {"experts.w_gate": self.gate, "experts.w_up": self.up, "experts.w_down": self.down}.get(param)
        if proj is None:
            raise KeyError(param)
        return [f"model.layers.{layer}.{self.prefix}.{e}.{proj}.weight" for e in range(n_experts)]


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # transformers' class, config.json `architectures`
    fields: dict[str, tuple[str, ...]] = field(default_factory=dict)  # beyond COMMON_FIELDS
    defaults: dict[str, Any] = field(default_factory=dict)  # config.json key -> transformers' value when absent
    sets: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields the family fixes
    refuse: tuple[tuple[str, str], ...] = ()  # (config.json key, why) refused when truthy
    writes: dict[str, Any] = field(default_factory=dict)  # constant config.json keys of the export
    experts: Optional[Union[Experts, GptOssExperts]] = None  # an MoE family's layer names
    block: Optional[dict[str, str]] = None  # module names beyond (and before) BLOCK's (MLA's)
    # what an export writes unless asked otherwise (`lit_lm.hf.exporter.EXPORT_DTYPES`): float32, lossless for a
    # model trained with fp32 masters; bfloat16 where the family's released checkpoints are bf16 or lower
    export_dtype: str = "float32"
    # Hugging Face names (suffixes) written in float32 whatever the export's dtype: what transformers keeps in fp32
    # (`_keep_in_fp32_modules_strict`), DeepSeek-V3's router, whose discrete top-k choices bf16 rounding would flip
    keep_fp32: tuple[str, ...] = ()
    mtp: bool = False  # stores multi-token prediction layers past the decoder's (`MTP`; num_nextn_predict_layers)

    @property
    def all_fields(self) -> dict[str, tuple[str, ...]]:
        return {**COMMON_FIELDS, **self.fields}

    def hf_name(self, name: str, config: ModelConfig) -> Union[str, list[str]]:
        """lit-lm's parameter name -> the Hugging Face one (blocks.3.attn.wq.bias -> model.layers.3.self_attn.q_proj
        .bias), or the per-expert names of a stacked expert weight (in expert order)."""
        module, _, kind = name.rpartition(".")
        if module.startswith("mtp.") and self.mtp:  # mtp.<k>.block.<rest> is layer n_layers + k's <rest>
            _, k, rest = module.split(".", 2)
            layer = config.n_layers + int(k)
            if rest.startswith("block."):
                return self.hf_name(f"blocks.{layer}.{rest.removeprefix('block.')}.{kind}", config)
            if rest in MTP:
                return f"model.layers.{layer}.{MTP[rest]}.{kind}"
        if not module.startswith("blocks."):
            return f"{TOP[module]}.{kind}"
        _, layer, rest = module.split(".", 2)
        if self.block is not None and rest in self.block:
            return f"model.layers.{layer}.{self.block[rest]}.{kind}"
        if rest in BLOCK:
            return f"model.layers.{layer}.{BLOCK[rest]}.{kind}"
        if self.experts is not None and rest.startswith("mlp."):
            try:
                return self.experts.names(layer, name.split(".", 3)[3], config.moe_experts)
            except KeyError:
                pass
        raise KeyError(f"parameter {name} has no name in a {self.model_type} checkpoint")


MOE_FIELDS = {"moe_top_k": ("num_experts_per_tok",)}
DEFAULT = {"num_key_value_heads": None, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "head_dim": None,
           "rope_theta": 10000.0}  # transformers' values when a key is absent (a family's `defaults` first)
# stated null: no window, or derived (the heads, hidden / heads), or DeepSeek's direct query (no q_lora_rank), as
# transformers reads it, not the value for an absent key (Mistral-7B-v0.3's null window)
NULL_IS_NONE = ("num_key_value_heads", "head_dim", "sliding_window", "q_lora_rank")

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", refuse=NO_BIAS, writes={"attention_bias": False, "mlp_bias": False}),
    Family("mistral", "MistralForCausalLM", fields={"sliding_window": ("sliding_window",)},
           defaults={"num_key_value_heads": 8, "sliding_window": 4096}),
    Family("qwen2", "Qwen2ForCausalLM", defaults={"num_key_value_heads": 32}, sets={"qkv_bias": True},
           refuse=NO_LAYER_WINDOWS, writes={"use_sliding_window": False}),
    Family("qwen3", "Qwen3ForCausalLM", defaults={"head_dim": 128, "num_key_value_heads": 32},
           sets={"qk_norm": True, "qk_norm_scope": "head"}, refuse=NO_BIAS[:1] + NO_LAYER_WINDOWS,
           writes={"attention_bias": False, "use_sliding_window": False}),
    Family("mixtral", "MixtralForCausalLM",
           fields={"sliding_window": ("sliding_window",), "moe_experts": ("num_local_experts", "num_experts"),
                   "moe_d_ff": ("intermediate_size",), **MOE_FIELDS},
           defaults={"rms_norm_eps": 1e-5, "num_key_value_heads": 8, "rope_theta": 1e6}, sets={"moe_norm_topk": True},
           refuse=(("router_jitter_noise", "lit-lm's router has no input jitter"),),
           experts=Experts(router="block_sparse_moe.gate", prefix="block_sparse_moe.experts", gate="w1", up="w3",
                           down="w2")),
    Family("qwen3_moe", "Qwen3MoeForCausalLM",
           fields={"moe_experts": ("num_experts", "num_local_experts"), "moe_d_ff": ("moe_intermediate_size",),
                   "moe_norm_topk": ("norm_topk_prob",), **MOE_FIELDS},
           defaults={"norm_topk_prob": False, "num_key_value_heads": 4, "moe_intermediate_size": 768},
           sets={"qk_norm": True, "qk_norm_scope": "head"}, refuse=NO_BIAS[:1] + NO_LAYER_WINDOWS,
           writes={"attention_bias": False, "use_sliding_window": False, "decoder_sparse_step": 1},
           experts=Experts()),
    Family("olmoe", "OlmoeForCausalLM",
           fields={"moe_experts": ("num_experts", "num_local_experts"), "moe_d_ff": ("intermediate_size",),
                   "moe_norm_topk": ("norm_topk_prob",), **MOE_FIELDS},
           defaults={"norm_topk_prob": False, "rms_norm_eps": 1e-5}, sets={"qk_norm": True, "qk_norm_scope": "all"},
           refuse=NO_BIAS[:1] + (("clip_qkv", "lit-lm does not clip q, k and v"),), writes={"attention_bias": False},
           experts=Experts()),
    # DeepSeek-V3 (also Moonlight, Kimi K2's architecture): MLA, sigmoid node-limited routing with a selection bias
    # and a scale, a shared expert, the first blocks dense. Its multi-token prediction layers (model.layers.<n>.*,
    # num_nextn_predict_layers), which transformers skips, are lit_lm.mtp's modules (`MTP`) when the files hold them.
    Family("deepseek_v3", "DeepseekV3ForCausalLM",
           fields={"moe_experts": ("n_routed_experts",), "moe_d_ff": ("moe_intermediate_size",),
                   "moe_norm_topk": ("norm_topk_prob",), "moe_shared_experts": ("n_shared_experts",),
                   "moe_first_dense": ("first_k_dense_replace",), "moe_groups": ("n_group",),
                   "moe_topk_groups": ("topk_group",), "moe_routed_scale": ("routed_scaling_factor",),
                   "mla_kv_rank": ("kv_lora_rank",), "mla_q_rank": ("q_lora_rank",),
                   "mla_qk_nope_dim": ("qk_nope_head_dim",), "mla_qk_rope_dim": ("qk_rope_head_dim",),
                   "mla_v_dim": ("v_head_dim",), "mla_rope_interleave": ("rope_interleave",), **MOE_FIELDS,
                   "head_dim": ("qk_rope_head_dim",)},  # transformers' head_dim is always the rope dims
           defaults={"moe_intermediate_size": 2048, "n_shared_experts": 1,
                     "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
                     "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
                     "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
                     "rope_interleave": True},
           sets={"moe_score": "sigmoid", "moe_every": 1, "n_kv_heads": None},  # MLA: no kv heads
           refuse=NO_BIAS[:1] + (("quantization_config", "lit-lm reads unquantized weights, not DeepSeek-V3's FP8 "
                                  "blocks (weight_scale_inv): convert them to bf16 first"),),
           writes={"attention_bias": False}, mtp=True,
           experts=Experts(shared="mlp.shared_experts", bias="mlp.gate.e_score_correction_bias"), block=MLA_BLOCK,
           export_dtype="bfloat16", keep_fp32=("mlp.gate.weight", "mlp.gate.e_score_correction_bias")),  # as
    # released: FP8 blocks (bf16 once converted), the router's selection bias fp32
    # gpt-oss: attention sinks (self_attn.sinks), sliding and full layers (layer_types), YaRN, biases in attention,
    # router and experts, the clamped SwiGLU; its experts fused (lit_lm.hf.gpt_oss), in MXFP4 as released
    Family("gpt_oss", "GptOssForCausalLM",
           fields={"sliding_window": ("sliding_window",), "layer_types": ("layer_types",),
                   "moe_experts": ("num_local_experts", "num_experts"), "moe_d_ff": ("intermediate_size",),
                   "qkv_bias": ("attention_bias",), "o_bias": ("attention_bias",),
                   "swiglu_limit": ("swiglu_limit",), "swiglu_alpha": ("swiglu_alpha",), **MOE_FIELDS},
           defaults={"num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
                     "sliding_window": 128, "attention_bias": True, "swiglu_limit": 7.0, "swiglu_alpha": 1.702,
                     "num_local_experts": 128, "num_experts_per_tok": 4,
                     "layer_types": lambda hf: ["sliding_attention" if i % 2 == 0 else "full_attention"
                                                for i in range(hf["num_hidden_layers"])],
                     "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "original_max_position_embeddings": 4096}},
           sets={"attn_sinks": True, "moe_biases": True, "moe_norm_topk": True}, experts=GptOssExperts(),
           export_dtype="bfloat16"),  # as released: bf16, the experts MXFP4
)}

# families recognised but refused, with the config.json key that lit-lm cannot express
REFUSED = {"qwen2_moe": ("shared_expert_intermediate_size",
                         "Qwen2-MoE's shared expert is scaled by a sigmoid gate (shared_expert_gate), which lit-lm's "
                         "shared experts do not have")}
