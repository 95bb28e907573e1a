"""Hugging Face checkpoints in: a model folder (`config.json` + safetensors) as lit-lm's `ModelConfig` and weights.

    lit-lm fit --model.init_args.init_from path/to/hf_model ...     # weights only: fresh optimizer, step 0

Llama (2, 3 with its RoPE scaling), Mistral (sliding window) and Qwen2 (q/k/v biases) are lit-lm's architecture
under other names: `config.json` maps onto `ModelConfig` field by field (`model_config`), and every parameter has
one Hugging Face name (`hf_name`, the one map both import and `lit_lm.hf_export` use). A config lit-lm cannot
express is refused with its field named.

`HFWeights.read(name, tensor, index)` reads `global[index]` of one parameter straight from the safetensors file
(`safe_open(...).get_slice(name)[index]`): a strategy that builds the model on the meta device fills each rank's
slice only (tp columns/rows, ZeRO-3 rows, a pipeline stage's layers), so no rank reads the whole model.
The vocabulary is not padded (`vocab_multiple_of` 1): the logits and the loss are those of `transformers`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import safe_open
from torch import Tensor

from lit_lm.config import ARCHITECTURE, ConfigError, ModelConfig

PathLike = Union[str, Path]
CONFIG = "config.json"
INDEX = "model.safetensors.index.json"  # a sharded model's tensor -> file map
FAMILIES = ("llama", "mistral", "qwen2")  # config.json `model_type`s lit-lm imports (and exports)
HF_FOLDER = "lit_lm_hf_folder"  # key of `as_checkpoint`'s dict: the folder it was read from

# -- the one name map, used both ways --------------------------------------------------------------------------
_BLOCK = {"attn_norm": "input_layernorm", "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj",
          "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
          "mlp.w_gate": "mlp.gate_proj", "mlp.w_up": "mlp.up_proj", "mlp.w_down": "mlp.down_proj"}
_TOP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"}


def hf_name(name: str) -> str:
    """lit-lm's parameter name -> the Hugging Face one (blocks.3.attn.wq.bias -> model.layers.3.self_attn.q_proj.bias)."""
    module, _, kind = name.rpartition(".")
    if module.startswith("blocks."):
        _, layer, rest = module.split(".", 2)
        if rest not in _BLOCK:
            raise ConfigError(f"parameter {name} has no Hugging Face name (MoE and QK-norm layers are not exported)")
        return f"model.layers.{layer}.{_BLOCK[rest]}.{kind}"
    return f"{_TOP[module]}.{kind}"


# -- config.json <-> ModelConfig --------------------------------------------------------------------------------
# the fields that are the same number under another name, both ways (`model_config`; `lit_lm.hf_export.hf_config`)
FIELDS = {"vocab_size": "vocab_size", "hidden_size": "d_model", "intermediate_size": "d_ff",
          "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
          "rms_norm_eps": "norm_eps", "tie_word_embeddings": "tie_embeddings"}
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def is_hf_folder(path: PathLike) -> bool:
    """A folder holding a Hugging Face model: `config.json` and safetensors weights."""
    path = Path(path)
    return path.is_dir() and (path / CONFIG).is_file() and any(path.glob("*.safetensors"))


def read_hf_config(folder: PathLike) -> dict[str, Any]:
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise ConfigError(f"{folder} holds no {CONFIG} (model.init_args.init_from); give a Hugging Face model folder "
                          "(config.json and *.safetensors, as save_pretrained writes them)")
    return json.loads(path.read_text())


def _rope(hf: dict[str, Any], refuse: Any) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) from `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        refuse("rope_scaling", f"rope_type {kind!r}", "lit-lm implements Llama 3's (llama3) only")
    scaling = {"rope_type": "llama3", **{k: params.get(k) for k in ModelConfig.ROPE_SCALING_KEYS}}
    return theta, scaling


def model_config(folder: PathLike, base: Optional[ModelConfig] = None) -> ModelConfig:
    """`base` (default `ModelConfig()`) with the architecture of the Hugging Face model in `folder`; the fields that
    decide no tensor's shape (max_seq_len, z_loss, init_std, ...) stay `base`'s."""
    hf = read_hf_config(folder)

    def refuse(field: str, value: Any, why: str) -> None:
        raise ConfigError(f"{Path(folder) / CONFIG}: `{field}` {value} cannot be imported: {why} "
                          "(model.init_args.init_from)")

    family = hf.get("model_type")
    if family not in FAMILIES:
        refuse("model_type", repr(family), f"lit-lm imports {', '.join(FAMILIES)} models (a decoder with RMSNorm, "
               "RoPE and SwiGLU)")
    missing = [key for key in REQUIRED if key not in hf]
    if missing:
        refuse(missing[0], "(missing)", "a decoder's config.json states its shape")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", repr(hf["hidden_act"]), "lit-lm's MLP is SwiGLU (silu)")
    for flag in ("attention_bias", "mlp_bias"):  # Llama's biases on every projection; Qwen2's q/k/v ones are below
        if hf.get(flag):
            refuse(flag, "true", "lit-lm's projections have no biases (but Qwen2's q/k/v ones)")
    if family == "qwen2" and (hf.get("use_sliding_window") or
                              any(t != "full_attention" for t in hf.get("layer_types") or [])):
        refuse("use_sliding_window", "true", "lit-lm windows every layer or none (Mistral), not Qwen2's mix")
    d_model, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, d_model // n_heads) or d_model % n_heads:
        refuse("head_dim", hf.get("head_dim"), "lit-lm's head_dim is hidden_size / num_attention_heads")
    theta, scaling = _rope(hf, refuse)
    defaults = {"num_key_value_heads": n_heads, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    values = {ours: hf.get(theirs) if hf.get(theirs) is not None else defaults.get(theirs)
              for theirs, ours in FIELDS.items()}
    return replace(base or ModelConfig(), **values, vocab_multiple_of=1, rope_theta=theta, rope_scaling=scaling,
                   sliding_window=hf.get("sliding_window") if family == "mistral" else None,
                   qkv_bias=family == "qwen2", qk_norm=False, moe_experts=0)


def overridden(before: ModelConfig, after: ModelConfig) -> list[str]:
    """`field before -> after` for every field the Hugging Face config changed (for the one line that says so)."""
    names = [f.name for f in fields(ModelConfig)
             if f.name in ARCHITECTURE + ("rope_theta", "rope_scaling", "sliding_window", "norm_eps")]
    return [f"{n} {getattr(before, n)} -> {getattr(after, n)}" for n in names if getattr(before, n) != getattr(after, n)]


# -- weights ----------------------------------------------------------------------------------------------------
class HFWeights:
    """The parameters of a Hugging Face model folder, read by lit-lm name and global slice (`read`).

    `bytes_read` counts the tensor bytes read so far: what a rank took from the files."""

    def __init__(self, folder: PathLike, config: ModelConfig) -> None:
        self.folder = Path(folder)
        self.config = config
        index = self.folder / INDEX
        if index.is_file():
            self.files = {k: self.folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            self.files = {}
            for file in sorted(self.folder.glob("*.safetensors")):
                with safe_open(str(file), "pt") as f:
                    self.files.update(dict.fromkeys(f.keys(), file))
        if not self.files:
            raise ConfigError(f"{self.folder} holds no safetensors weights (model.init_args.init_from)")
        self.bytes_read = 0
        self._check_names()

    def _check_names(self) -> None:
        """Every parameter of the model is in the files, and every tensor of the files is a parameter."""
        from lit_lm.model import Transformer

        with torch.device("meta"):
            names = [n for n, _ in Transformer(self.config).named_parameters()]
        wanted = {self._source(n) for n in names}
        missing = sorted(wanted - set(self.files))
        extra = sorted(k for k in set(self.files) - wanted - {"lm_head.weight"} if not k.endswith("inv_freq"))
        if missing or extra:
            what = f"has no tensor {missing[0]}" if missing else f"has a tensor {extra[0]} lit-lm's model has not"
            raise ConfigError(f"{self.folder}: the weights do not match its {CONFIG}: it {what} "
                              f"({len(missing)} missing, {len(extra)} unexpected) (model.init_args.init_from)")

    def _source(self, name: str) -> str:
        """The tensor in the files that holds parameter `name` (a tied head is the embedding)."""
        if name == "lm_head.weight" and self.config.tie_embeddings:
            return hf_name("tok_embeddings.weight")
        return hf_name(name)

    def read(self, name: str, tensor: Tensor, index: tuple[slice, ...] = ()) -> None:
        """Fill `tensor` with `global[index]` of parameter `name`, reading that slice only."""
        source = self._source(name)
        with safe_open(str(self.files[source]), "pt") as f:
            part = f.get_slice(source)[index] if index else f.get_tensor(source)
        if part.shape != tensor.shape:
            raise ConfigError(f"{self.folder}: {source}{list(index) if index else ''} has shape {list(part.shape)}, "
                              f"lit-lm's {name} {list(tensor.shape)} (model.init_args.init_from)")
        self.bytes_read += part.numel() * part.element_size()
        with torch.no_grad():
            tensor.copy_(part)

    def tensor_info(self) -> list[tuple[str, str, list[int]]]:
        """(name, dtype, shape) of every tensor in the files, from their headers (no data read)."""
        out = []
        for file in sorted(set(self.files.values())):
            with safe_open(str(file), "pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    out.append((key, sl.get_dtype(), list(sl.get_shape())))
        return out


def load_model(folder: PathLike, base: Optional[ModelConfig] = None, device: str = "cpu") -> Any:
    """The `Transformer` of a Hugging Face folder, whole, on one process."""
    from lit_lm.model import Transformer
    from strategies.placement import materialize

    config = model_config(folder, base)
    with torch.device("meta"):
        model = Transformer(config)
    model.weights = HFWeights(folder, config)
    materialize(model, torch.device(device), model.init_parameter, model.init_buffer)
    model.weights = None  # read once: the model owns its values now
    return model


def as_checkpoint(folder: PathLike) -> dict[str, Any]:
    """A Hugging Face folder as a lit-lm checkpoint dict (`lit_lm.checkpoints.read_checkpoint`): the model's
    hyper-parameters and state dict; the folder itself under HF_FOLDER (its tokenizer is read from there)."""
    model = load_model(folder)
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    return {"hyper_parameters": {"config": asdict(model.config)}, "state_dict": state, HF_FOLDER: str(folder),
            "global_step": 0, "epoch": 0}


def as_meta(folder: PathLike) -> dict[str, Any]:
    """`as_checkpoint` without the tensors (`lit_lm.checkpoints.read_meta`)."""
    return {"hyper_parameters": {"config": asdict(model_config(folder))}, HF_FOLDER: str(folder),
            "global_step": 0, "epoch": 0}
