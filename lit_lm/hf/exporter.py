"""Export a lit-lm checkpoint as a Hugging Face model: `model.safetensors`, `config.json`,
`generation_config.json` and the tokenizer as `tokenizer.json` in the `tokenizers` library's format
(`Tokenizer.save_hf`: lit-lm's BPE converted, a `tokenizers` one as it is).

lit-lm's Transformer is Llama's architecture with the same conventions (rotate-half RoPE, RMSNorm with fp32
statistics, SwiGLU, separate q/k/v projections), so the export is a renaming of tensors through the family's
entry in `lit_lm.hf.families` (the one map the import reads too; stacked expert weights are written one tensor
per expert, as the family stores them), and `config.json` is the import backwards. The family is the first of
`families.FAMILIES` whose config, imported again, is the model's own (`export_family`): Llama, Mistral when
windowed, Qwen2 with q/k/v biases, Qwen3 with per-head QK-norm, Mixtral / Qwen3-MoE / OLMoE for MoE models; a
model no family holds (shared experts, sigmoid routing, ...) is refused naming the field. A model imported from
Hugging Face comes back tensor for tensor (the same names, shapes and values). The embedding keeps its padded
rows (config `vocab_size` is the padded size; the tokenizer never produces the extra ids). Tensors are written in
`dtype` (`EXPORT_DTYPES`), by default the family's (`Family.export_dtype`): bfloat16 for DeepSeek-V3 and gpt-oss (as
they are released), float32 (lossless from fp32 masters) for the others; config.json's `torch_dtype` says which.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file

from lit_lm.checkpoints import model_state_dict, tokenizer_from
from lit_lm.config import ARCHITECTURE, ConfigError, ModelConfig
from lit_lm.hf.families import FAMILIES, MTP_SHARED, Family
from lit_lm.hf.gpt_oss import FusedSource, fuse
from lit_lm.hf.importer import HF_FOLDER, config_from_hf
from lit_lm.data.tokenizer import Tokenizer

# what an exported model must keep besides ARCHITECTURE: the function of each layer
FUNCTION = ("rope_theta", "rope_scaling", "sliding_window", "norm_eps", "moe_top_k", "moe_score", "moe_norm_topk",
            "padded_vocab_size", "moe_groups", "moe_topk_groups", "moe_routed_scale", "mla_rope_interleave",
            "layer_types", "swiglu_limit", "swiglu_alpha")


EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def export_dtype(cfg: ModelConfig, dtype: Optional[str] = None) -> str:
    """The dtype an export writes: `dtype`, else the model's family's (`Family.export_dtype`)."""
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ConfigError(f"export dtype {dtype!r}: choose one of {', '.join(EXPORT_DTYPES)}")
    return dtype or export_family(cfg).export_dtype


def _signature(cfg: ModelConfig) -> dict[str, Any]:
    """The fields that decide the model's tensors and function, less those that decide nothing here (the MoE
    fields of a dense model, d_ff when every block is MoE, the vocabulary's padding rule: its padded size counts)."""
    names = [n for n in ARCHITECTURE + FUNCTION if n not in ("vocab_size", "vocab_multiple_of", "mtp_layers")]
    if not cfg.mla_kv_rank:
        names = [n for n in names if not n.startswith("mla_")]
    else:  # multi-head latent attention has neither kv heads nor one head_dim
        names = [n for n in names if n not in ("n_kv_heads", "head_dim")]
    if not cfg.moe_experts:
        names = [n for n in names if not n.startswith("moe_")]
    elif all(cfg.is_moe_layer(i) for i in range(cfg.n_layers)):
        names.remove("d_ff")
    if not cfg.qk_norm:
        names.remove("qk_norm_scope")
    if cfg.swiglu_limit is None:  # alpha is read by the clamped SwiGLU only
        names = [n for n in names if n != "swiglu_alpha"]
    return {n: getattr(cfg, n) for n in names}


def family_config(cfg: ModelConfig, family: Family) -> dict[str, Any]:
    """The config.json keys of `family` that carry `cfg`'s fields (the import's map backwards)."""
    out: dict[str, Any] = {"architectures": [family.architecture], "model_type": family.model_type}
    for ours, keys in family.all_fields.items():  # family fields after the common ones (Mixtral's experts'
        out[keys[0]] = getattr(cfg, ours)  # intermediate_size is theirs)
    out["vocab_size"] = cfg.padded_vocab_size
    if family.experts is not None and cfg.moe_first_dense:
        out["mlp_only_layers"] = list(range(cfg.moe_first_dense))
    if family.mtp:
        out["num_nextn_predict_layers"] = cfg.mtp_layers
    rope = {"rope_type": "default"} if cfg.rope_scaling is None else dict(cfg.rope_scaling)
    out.update(family.writes, rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
               rope_parameters={**rope, "rope_theta": cfg.rope_theta})
    return out


def export_family(cfg: ModelConfig) -> Family:
    """The first family whose config.json, imported again, is `cfg` (its `_signature`); else a one-line refusal
    naming the first field the closest family cannot hold."""
    want = _signature(cfg)
    misses = []
    for family in FAMILIES.values():
        try:
            back = _signature(config_from_hf(family_config(cfg, family), cfg))
        except ConfigError:
            continue
        differ = [n for n in want if back.get(n) != want[n]] + [n for n in back if n not in want]
        differ.sort(key=lambda n: n == "d_ff")  # a family's d_ff follows its experts': name the cause first
        if not differ:
            return family
        misses.append((len(differ), differ[0], family.model_type))
    _, field, family = min(misses)
    raise ConfigError(f"the model's {field} {getattr(cfg, field)} is in no Hugging Face family lit-lm exports "
                      f"({', '.join(FAMILIES)}; the closest, {family}, does not have it) "
                      f"(model.init_args.config.{field})")


def check_exportable(cfg: ModelConfig) -> None:
    export_family(cfg)


def hf_config(cfg: ModelConfig, bos_id: Optional[int], eos_id: Optional[int], dtype: Optional[str] = None
              ) -> dict[str, Any]:
    """config.json of the model, as its family (`export_family`) writes it, its tensors in `dtype` (`export_dtype`)."""
    return {**family_config(cfg, export_family(cfg)), "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
            "initializer_range": cfg.init_std, "bos_token_id": bos_id, "eos_token_id": eos_id,
            "torch_dtype": export_dtype(cfg, dtype)}


def hf_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig, dtype: Optional[str] = None
               ) -> dict[str, torch.Tensor]:
    """The state dict (lit-lm names) under the family's names, in `dtype` (`export_dtype`: rounded to nearest from
    the fp32 values; the family's `keep_fp32` tensors fp32); a stacked expert weight one tensor per expert. A
    router's balancing bias (auxiliary-loss-free balancing) has no Hugging Face tensor: refused unless zero."""
    family = export_family(cfg)
    out = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}  # gpt-oss's experts: a layer's parts, fused at the end
    for name, value in state.items():
        if name.startswith("mtp.") and not family.mtp:  # multi-token prediction: a family without it drops it
            continue
        if name.endswith("expert_bias") and family.experts.bias is None:
            if value.any():
                raise ConfigError(f"{name} is not zero (moe_bias_update trained it) and changes which experts are "
                                  f"chosen; a {family.model_type} router has no such bias, so the export would route "
                                  "differently (model.init_args.config.moe_bias_update)")
            continue
        if name.endswith("step_counts"):
            continue
        target = family.hf_name(name, cfg)
        value = value.detach().to(torch.float32)
        if isinstance(target, FusedSource):
            fused.setdefault(target.tensor.rpartition(".")[0], {})[name.rpartition(".")[2]] = value
        elif isinstance(target, str):
            out[target] = value.contiguous()
        else:
            out.update({t: v.contiguous() for t, v in zip(target, value.unbind(0))})
    for prefix, parts in fused.items():
        out.update({f"{prefix}.{k}": v.contiguous() for k, v in fuse(parts).items()})
    if family.mtp:  # each prediction layer's copies of the embedding and head it shares (as DeepSeek-V3 stores them)
        for k in range(cfg.mtp_layers):
            for ours, theirs in MTP_SHARED.items():
                shared = state.get(ours, state["tok_embeddings.weight"])  # a tied head is the embedding
                out[f"model.layers.{cfg.n_layers + k}.{theirs}"] = shared.detach().to(torch.float32, copy=True)
    torch_dtype = EXPORT_DTYPES[export_dtype(cfg, dtype)]
    return {name: value if name.endswith(family.keep_fp32) else value.to(torch_dtype) for name, value in out.items()}


def write_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, tokenizer: Optional[Tokenizer], out_dir: Path,
             dtype: Optional[str] = None) -> None:
    """The Transformer's state dict (lit-lm names) and config as a Hugging Face model folder in out_dir, its tensors
    in `dtype` (`export_dtype`: None, the family's)."""
    check_exportable(cfg)
    state = dict(state)
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)  # transformers ties it to embed_tokens itself (tie_word_embeddings)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(state, cfg, dtype)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    umask = os.umask(0)  # safetensors writes 0600 (a temporary file renamed): give it the mode open() would
    os.umask(umask)
    os.chmod(out_dir / "model.safetensors", 0o666 & ~umask)
    # lit-lm's BPE has no BOS: its documents follow an EOS, which is what transformers gets as bos_token_id
    bos, eos = None, None
    if tokenizer is not None:
        bos, eos = (tokenizer.eos_id if tokenizer.bos_id is None else tokenizer.bos_id), tokenizer.eos_id
    (out_dir / "config.json").write_text(json.dumps(hf_config(cfg, bos, eos, dtype), indent=1))
    (out_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    if tokenizer is not None:
        tokenizer.save_hf(out_dir, model_max_length=cfg.max_seq_len)


def export_hf(checkpoint: dict[str, Any], out_dir: Path, dtype: Optional[str] = None) -> None:
    """Write the Hugging Face export of a lit-lm checkpoint dict (`lit_lm.checkpoints.read_checkpoint`, which also
    reads a Hugging Face folder: a round trip) to out_dir, its tensors in `dtype` (None: the family's,
    `export_dtype`); a checkpoint without a tokenizer (a Hugging Face folder that has none) is exported without one."""
    cfg = ModelConfig(**checkpoint["hyper_parameters"]["config"])
    export_dtype(cfg, dtype)  # refused before anything is written
    try:
        tokenizer = tokenizer_from(checkpoint)
    except ConfigError:
        if HF_FOLDER not in checkpoint:
            raise
        tokenizer = None
    write_hf(model_state_dict(checkpoint), cfg, tokenizer, out_dir, dtype)
