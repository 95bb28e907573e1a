"""Export a dense lit-lm checkpoint as a Hugging Face model: `model.safetensors`, `config.json`,
`generation_config.json` and the tokenizer as `tokenizer.json` in the `tokenizers` library's format
(`Tokenizer.save_hf`: lit-lm's BPE converted, a `tokenizers` one as it is).

lit-lm's Transformer is Llama's architecture with the same conventions (rotate-half RoPE, RMSNorm with fp32
statistics, SwiGLU, separate q/k/v projections), so the export is a renaming of tensors through the one name map
of `lit_lm.hf_import` (`hf_name`), and `config.json` is `hf_import.model_config` backwards: a Llama model (with
Llama 3's rope scaling if set), a Mistral one when the attention is windowed, a Qwen2 one with q/k/v biases. A
model imported from Hugging Face comes back tensor for tensor (the same names, shapes and values). The embedding
keeps its padded rows (config `vocab_size` is the padded size; the tokenizer never produces the extra ids). Not
exportable: MoE layers and QK-norm.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file

from lit_lm.checkpoints import model_state_dict, tokenizer_from
from lit_lm.config import ConfigError, ModelConfig
from lit_lm.hf_import import FIELDS, HF_FOLDER, hf_name
from lit_lm.tokenizer import Tokenizer


def check_exportable(cfg: ModelConfig) -> None:
    unsupported = [name for name, on in (("moe_experts", cfg.moe_experts), ("qk_norm", cfg.qk_norm)) if on]
    if cfg.qkv_bias and cfg.sliding_window:
        unsupported.append("sliding_window")  # with biases it is a Qwen2, whose windows are per layer
    if unsupported:
        raise ConfigError(f"the model uses {', '.join(unsupported)}, which the exported Llama / Mistral / Qwen2 "
                          f"does not have (model.init_args.config.{unsupported[0]}); only dense models without them "
                          "are exported")


def hf_config(cfg: ModelConfig, bos_id: Optional[int], eos_id: Optional[int]) -> dict[str, Any]:
    """config.json of the model: Qwen2 when it has q/k/v biases, Mistral when windowed, else Llama."""
    family = "qwen2" if cfg.qkv_bias else "mistral" if cfg.sliding_window else "llama"
    rope = {"rope_type": "default"} if cfg.rope_scaling is None else dict(cfg.rope_scaling)
    out: dict[str, Any] = {
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM"}[family]], "model_type": family,
        **{theirs: getattr(cfg, ours) for theirs, ours in FIELDS.items()}, "vocab_size": cfg.padded_vocab_size,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "rope_parameters": {**rope, "rope_theta": cfg.rope_theta}, "initializer_range": cfg.init_std,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": "float32",
    }
    if family == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    elif family == "mistral":
        out["sliding_window"] = cfg.sliding_window
    else:
        out.update(use_sliding_window=False, sliding_window=None)
    return out


def write_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, tokenizer: Optional[Tokenizer], out_dir: Path) -> None:
    """The Transformer's state dict (lit-lm names) and config as a Hugging Face model folder in out_dir."""
    check_exportable(cfg)
    state = dict(state)
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)  # transformers ties it to embed_tokens itself (tie_word_embeddings)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {hf_name(k): v.detach().to(torch.float32).contiguous() for k, v in state.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    umask = os.umask(0)  # safetensors writes 0600 (a temporary file renamed): give it the mode open() would
    os.umask(umask)
    os.chmod(out_dir / "model.safetensors", 0o666 & ~umask)
    # lit-lm's BPE has no BOS: its documents follow an EOS, which is what transformers gets as bos_token_id
    bos, eos = None, None
    if tokenizer is not None:
        bos, eos = (tokenizer.eos_id if tokenizer.bos_id is None else tokenizer.bos_id), tokenizer.eos_id
    (out_dir / "config.json").write_text(json.dumps(hf_config(cfg, bos, eos), indent=1))
    (out_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    if tokenizer is not None:
        tokenizer.save_hf(out_dir, model_max_length=cfg.max_seq_len)


def export_hf(checkpoint: dict[str, Any], out_dir: Path) -> None:
    """Write the Hugging Face export of a lit-lm checkpoint dict (`lit_lm.checkpoints.read_checkpoint`, which also
    reads a Hugging Face folder: a round trip) to out_dir; a checkpoint without a tokenizer (a Hugging Face folder
    that has none) is exported without one."""
    cfg = ModelConfig(**checkpoint["hyper_parameters"]["config"])
    check_exportable(cfg)
    try:
        tokenizer = tokenizer_from(checkpoint)
    except ConfigError:
        if HF_FOLDER not in checkpoint:
            raise
        tokenizer = None
    write_hf(model_state_dict(checkpoint), cfg, tokenizer, out_dir)
