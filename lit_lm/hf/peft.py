"""Export a LoRA run (`model.init_args.lora`, `lit_lm.lora`): merged into a plain Hugging Face model, or the adapter
alone as a PEFT folder.

    merged   W' = W + (alpha / r) B A for every adapted linear (per expert for an expert stack), then the ordinary
             export (`lit_lm.hf.exporter`): a model transformers loads by itself, computing what the adapted one did
    adapter  adapter_config.json + adapter_model.safetensors, PEFT's LoRA format: the factors under the base model's
             Hugging Face module names with PEFT's prefix, `base_model.model.` + `model.layers.3.self_attn.q_proj` +
             `.lora_A.weight` (r, in) / `.lora_B.weight` (out, r) (PEFT's saved keys carry no adapter name); an
             expert stack's factors one pair per expert (`...experts.5.gate_proj.lora_A.weight`). The config names
             r, lora_alpha, lora_dropout and target_modules by their Hugging Face leaf names (q_proj, ..., a Mixtral
             expert's w1/w3/w2), and base_model_name_or_path: the `init_from` folder the run started from, if any.
             `peft.PeftModel.from_pretrained(base, folder)` adds W x + (lora_alpha / r) B A x, the same update.

The tensor names come from the family the export picks (`lit_lm.hf.families`), so the adapter matches the merged or
base export of the same checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file

from lit_lm.checkpoints import model_state_dict
from lit_lm.config import ConfigError, ModelConfig
from lit_lm.hf.exporter import export_family, export_hf
from lit_lm.lora import LoRA, lora_factor, lora_from, merge_adapters

PREFIX = "base_model.model."  # PEFT's wrapper (PeftModelForCausalLM.base_model.model) around the HF model


def checkpoint_lora(checkpoint: dict[str, Any]) -> Optional[LoRA]:
    """The LoRA settings a checkpoint was trained with (its hyper-parameters), or None."""
    return lora_from(checkpoint.get("hyper_parameters", {}).get("lora"))


def base_weight(factor_name: str) -> str:
    """The base parameter an adapter factor belongs to: blocks.0.attn.wq.lora_A -> blocks.0.attn.wq.weight,
    blocks.1.mlp.experts.w_up_lora_B -> blocks.1.mlp.experts.w_up."""
    leaf = factor_name.rpartition(".")[2]
    if leaf in ("lora_A", "lora_B"):
        return factor_name[: -len(leaf)] + "weight"
    return factor_name[: -len("_lora_A")]


def peft_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The factors of a state dict (lit-lm names) under PEFT's key names, fp32, one pair per expert of a stack."""
    family = export_family(cfg)
    out = {}
    for name, value in state.items():
        factor = lora_factor(name)
        if factor is None:
            continue
        target = family.hf_name(base_weight(name), cfg)
        pairs = [(target, value)] if isinstance(target, str) else list(zip(target, value.unbind(0)))
        for hf_weight, v in pairs:
            out[f"{PREFIX}{hf_weight.removesuffix('.weight')}.lora_{factor}.weight"] = v.detach().float().contiguous()
    return out


def adapter_config(lora: LoRA, tensors: dict[str, torch.Tensor], base_model: Optional[str]) -> dict[str, Any]:
    """adapter_config.json: PEFT's LoraConfig fields for plain LoRA on the adapted modules."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "target_modules": sorted({k.split(".")[-3] for k in tensors}),
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "base_model_name_or_path": base_model}


def export_lora(checkpoint: dict[str, Any], out_dir: Path, merge: bool) -> str:
    """Write `checkpoint`'s LoRA run to `out_dir`: merged into a Hugging Face model (`merge`), or the adapter alone in
    PEFT's folder format. Returns what was written, in words."""
    lora = checkpoint_lora(checkpoint)
    if lora is None:
        raise ConfigError("--merge-lora: the checkpoint has no LoRA adapters (it was not trained with "
                          "model.init_args.lora); export it without the flag")
    state = model_state_dict(checkpoint)
    if merge:
        merged = {f"model.{k}": v for k, v in merge_adapters(state, lora).items()}
        export_hf({**checkpoint, "state_dict": merged}, out_dir)
        return "the adapters merged into the base weights (load with transformers.AutoModelForCausalLM)"
    cfg = ModelConfig(**checkpoint["hyper_parameters"]["config"])
    tensors = peft_tensors(state, cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    base = checkpoint["hyper_parameters"]["lora"].get("base_model")
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config(lora, tensors, base), indent=1))
    return (f"the LoRA adapter alone, PEFT's format ({len(tensors) // 2} adapted modules; load with "
            "peft.PeftModel.from_pretrained(base model, folder), or export again with --merge-lora)")


__all__ = ["PREFIX", "adapter_config", "base_weight", "checkpoint_lora", "export_lora", "peft_tensors"]
