"""Export a dense lit-lm checkpoint as a Hugging Face Llama model: `model.safetensors`, `config.json`,
`generation_config.json` and the tokenizer as `tokenizer.json` in the `tokenizers` library's format
(`Tokenizer.save_hf`: lit-lm's BPE converted, a `tokenizers` one as it is).

lit-lm's Transformer is Llama's architecture with the same conventions (rotate-half RoPE, RMSNorm with fp32
statistics, SwiGLU, separate q/k/v projections), so the export is a renaming of tensors; the embedding keeps its
padded rows (config `vocab_size` is the padded size; the tokenizer never produces the extra ids). Not exportable:
MoE layers, QK-norm and sliding-window attention (Llama has none of them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lit_lm.checkpoints import model_state_dict, tokenizer_from
from lit_lm.config import ConfigError, ModelConfig

_BLOCK = {"attn_norm": "input_layernorm", "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj",
          "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
          "mlp.w_gate": "mlp.gate_proj", "mlp.w_up": "mlp.up_proj", "mlp.w_down": "mlp.down_proj"}


def hf_name(name: str) -> str:
    """lit-lm's parameter name -> the Llama one."""
    if name.startswith("blocks."):
        _, layer, rest = name.split(".", 2)
        return f"model.layers.{layer}.{_BLOCK[rest.removesuffix('.weight')]}.weight"
    return {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "lm_head.weight": "lm_head.weight"}[name]


def check_exportable(cfg: ModelConfig) -> None:
    unsupported = [name for name, on in (("moe_experts", cfg.moe_experts), ("qk_norm", cfg.qk_norm),
                                         ("sliding_window", cfg.sliding_window)) if on]
    if unsupported:
        raise ConfigError(f"the model uses {', '.join(unsupported)}, which Llama does not have "
                          f"(model.init_args.config.{unsupported[0]}); only dense models without them are exported")


def llama_config(cfg: ModelConfig, bos_id: int, eos_id: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.padded_vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "initializer_range": cfg.init_std, "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": "float32",
    }


def export_hf(checkpoint: dict[str, Any], out_dir: Path) -> None:
    """Write the Llama export of a lit-lm checkpoint dict (`lit_lm.checkpoints.read_checkpoint`) to out_dir."""
    cfg = ModelConfig(**checkpoint["hyper_parameters"]["config"])
    check_exportable(cfg)
    tokenizer = tokenizer_from(checkpoint)
    state = model_state_dict(checkpoint)
    if cfg.tie_embeddings:
        state.pop("lm_head.weight")  # Llama ties it to embed_tokens itself (tie_word_embeddings)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {hf_name(k): v.detach().to(torch.float32).contiguous() for k, v in state.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    umask = os.umask(0)  # safetensors writes 0600 (a temporary file renamed): give it the mode open() would
    os.umask(umask)
    os.chmod(out_dir / "model.safetensors", 0o666 & ~umask)
    # lit-lm's BPE has no BOS: its documents follow an EOS, which is what transformers gets as bos_token_id
    bos, eos = (tokenizer.eos_id if tokenizer.bos_id is None else tokenizer.bos_id), tokenizer.eos_id
    (out_dir / "config.json").write_text(json.dumps(llama_config(cfg, bos, eos), indent=1))
    (out_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    tokenizer.save_hf(out_dir, model_max_length=cfg.max_seq_len)
