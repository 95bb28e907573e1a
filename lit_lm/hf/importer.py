"""Hugging Face checkpoints in: a model folder (`config.json` + safetensors) as lit-lm's `ModelConfig` and weights.

    lit-lm fit --model.init_args.init_from path/to/hf_model ...     # weights only: fresh optimizer, step 0

Llama (2, 3 with its RoPE scaling), Mistral (sliding window, any head_dim), Qwen2 (q/k/v biases), Qwen3 (per-head
QK-norm, head_dim of its own) and the Mixture-of-Experts Mixtral, Qwen3-MoE and OLMoE are lit-lm's architecture
under other names. Each is one entry of `lit_lm.hf.families` (config keys -> `ModelConfig` fields, tensor names,
how experts are stored), read here and by `lit_lm.hf.exporter`. A config lit-lm cannot express is refused with its
field named.

`HFWeights.read(name, tensor, index)` reads `global[index]` of one parameter straight from the safetensors file
(`safe_open(...).get_slice(name)[index]`): a strategy that builds the model on the meta device fills each rank's
slice only (tp columns/rows, ZeRO-3 rows, an expert-parallel rank's experts, a pipeline stage's layers), so no
rank reads the whole model. A stacked expert weight (E, ...) is read expert by expert from the family's
per-expert tensors, only those in the slice. The vocabulary is not padded (`vocab_multiple_of` 1): the logits and
the loss are those of `transformers`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields, replace
from pathlib import Path, PurePath
from typing import Any, Optional, Union

import torch
from safetensors import safe_open
from torch import Tensor

from lit_lm.config import ARCHITECTURE, ConfigError, ModelConfig
from lit_lm.hf.families import DEFAULT, FAMILIES, MTP_SHARED, NULL_IS_NONE, REFUSED, REQUIRED, Family
from lit_lm.hf.gpt_oss import FusedSource

PathLike = Union[str, Path]
CONFIG = "config.json"
INDEX = "model.safetensors.index.json"  # a sharded model's tensor -> file map
HF_FOLDER = "lit_lm_hf_folder"  # key of `as_checkpoint`'s dict: the folder it was read from
# what the import sets whatever the run's config says, before the family's fields (a dense Llama unless stated)
PLAIN = dict(vocab_multiple_of=1, sliding_window=None, qkv_bias=False, qk_norm=False, qk_norm_scope="head",
             moe_experts=0, moe_d_ff=None, moe_norm_topk=True, moe_score="softmax", moe_every=1, moe_first_dense=0,
             moe_shared_experts=0, moe_groups=1, moe_topk_groups=1, moe_routed_scale=1.0, mla_kv_rank=0,
             mla_q_rank=None, mla_qk_nope_dim=0, mla_qk_rope_dim=0, mla_v_dim=0, mla_rope_interleave=True, mtp_layers=0,
             attn_sinks=False, o_bias=False, moe_biases=False, layer_types=None, swiglu_limit=None)


def is_hf_folder(path: PathLike) -> bool:
    """A folder holding a Hugging Face model: `config.json` and safetensors weights (or their index)."""
    path = Path(path)
    return path.is_dir() and (path / CONFIG).is_file() and ((path / INDEX).is_file() or any(path.glob("*.safetensors")))


def read_hf_config(folder: PathLike) -> dict[str, Any]:
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise ConfigError(f"{folder} holds no {CONFIG} (model.init_args.init_from); give a Hugging Face model folder "
                          "(config.json and *.safetensors, as save_pretrained writes them)")
    return json.loads(path.read_text())


def _default(family: Family, key: str, hf: Optional[dict[str, Any]] = None) -> Any:
    """transformers' value of config.json `key` when it is absent, for `family` (a callable: of the config, e.g.
    gpt-oss's alternating layer_types)."""
    value = family.defaults.get(key, DEFAULT.get(key))
    return value(hf) if callable(value) else value


def _rope(hf: dict[str, Any], family: Family, refuse: Any) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) from `rope_parameters` (transformers >= 5) or the top-level `rope_theta` and
    `rope_scaling` (transformers 4.x, most configs on the Hub)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or _default(family, "rope_parameters") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", _default(family, "rope_theta"))))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "yarn":
        return theta, {"rope_type": "yarn", **{k: v for k, v in params.items() if k in YARN_KEYS}}
    if kind != "llama3":
        refuse("rope_scaling", f"rope_type {kind!r}", "lit-lm implements Llama 3's (llama3) and YaRN (yarn)")
    scaling = {"rope_type": "llama3", **{k: params.get(k) for k in ModelConfig.ROPE_SCALING_KEYS}}
    return theta, scaling


YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate", "attention_factor",
             "mscale", "mscale_all_dim")  # what lit_lm.yarn reads


def _family(hf: dict[str, Any], refuse: Any) -> Family:
    model_type = hf.get("model_type")
    if model_type in REFUSED:
        key, why = REFUSED[model_type]
        refuse(key, hf.get(key), why)
    if model_type not in FAMILIES:
        refuse("model_type", repr(model_type), f"lit-lm imports {', '.join(FAMILIES)} models (a decoder with "
               "RMSNorm, RoPE and SwiGLU)")
    return FAMILIES[model_type]


def _moe_layers(hf: dict[str, Any], refuse: Any) -> dict[str, Any]:
    """The MoE layer pattern: every layer (Mixtral, OLMoE) or all but Qwen3-MoE's first `mlp_only_layers`."""
    if hf.get("decoder_sparse_step", 1) != 1:
        refuse("decoder_sparse_step", hf["decoder_sparse_step"], "lit-lm's MoE blocks are every block after the "
               "first dense ones (moe_first_dense)")
    dense = sorted(hf.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        refuse("mlp_only_layers", dense, "lit-lm's dense blocks are the first ones (moe_first_dense)")
    return dict(moe_first_dense=len(dense), moe_every=1, moe_score="softmax", moe_shared_experts=0)


def config_from_hf(hf: dict[str, Any], base: Optional[ModelConfig] = None, where: str = CONFIG) -> ModelConfig:
    """`base` (default `ModelConfig()`) with the architecture of a Hugging Face `config.json` (`hf`, read from
    `where`); the fields that decide no tensor's shape nor the function (max_seq_len, z_loss, init_std, the MoE
    balancing losses, ...) stay `base`'s."""

    def refuse(key: str, value: Any, why: str) -> None:
        raise ConfigError(f"{where}: `{key}` {json.dumps(value) if not isinstance(value, str) else value} cannot "
                          f"be imported: {why} (model.init_args.init_from)")

    family = _family(hf, refuse)
    missing = [key for key in REQUIRED if key not in hf]
    if missing:
        refuse(missing[0], "(missing)", "a decoder's config.json states its shape")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", repr(hf["hidden_act"]), "lit-lm's MLP is SwiGLU (silu)")
    for key, why in family.refuse:
        if hf.get(key):
            refuse(key, hf[key], why)
    if "layer_types" not in family.all_fields and any(t != "full_attention" for t in hf.get("layer_types") or []):
        refuse("layer_types", "with sliding_attention", "lit-lm windows every layer or none (Mistral), not per layer")
    theta, scaling = _rope(hf, family, refuse)
    values: dict[str, Any] = {}
    for ours, keys in family.all_fields.items():
        key = next((k for k in keys if hf.get(k) is not None), None)
        if key is not None:
            values[ours] = hf[key]
        elif keys[0] in NULL_IS_NONE and any(k in hf for k in keys):
            values[ours] = None  # stated null: no window; kv heads and head_dim derived below / by ModelConfig
        else:
            values[ours] = _default(family, keys[0], hf)
    values["n_kv_heads"] = values["n_kv_heads"] or values["n_heads"]
    if family.experts is not None:
        for ours in ("moe_experts", "moe_top_k"):
            if values[ours] is None:
                refuse(family.all_fields[ours][0], "(missing)", "an MoE config states its experts")
        values = {**_moe_layers(hf, refuse), **values}  # a family's own keys for them first (DeepSeek-V3's)
    if family.block is not None:  # DeepSeek-V3: latent attention and MoE blocks, or transformers builds neither
        for ours in ("mla_kv_rank", "moe_experts"):
            if not values[ours]:
                refuse(family.all_fields[ours][0], values[ours], f"{family.model_type}'s attention is latent (MLA) "
                       "and its blocks after the first dense ones are MoE")
    try:
        return replace(base or ModelConfig(), **{**PLAIN, **values, **family.sets}, rope_theta=theta,
                       rope_scaling=scaling)
    except ConfigError as e:  # a value ModelConfig refuses (an odd head_dim, ...): say which file
        raise ConfigError(f"{where}: {e} (model.init_args.init_from)") from None


def model_config(folder: PathLike, base: Optional[ModelConfig] = None) -> ModelConfig:
    """`config_from_hf` of the Hugging Face model in `folder`, with its multi-token prediction layers (`mtp_layers`)
    where the files hold them (`held_mtp_layers`)."""
    hf = read_hf_config(folder)
    config = config_from_hf(hf, base, str(Path(folder) / CONFIG))
    mtp = held_mtp_layers(folder, hf, config)
    return replace(config, mtp_layers=mtp) if mtp and config.mtp_weight > 0 else config


def held_mtp_layers(folder: PathLike, hf: dict[str, Any], config: ModelConfig) -> int:
    """DeepSeek-V3's multi-token prediction layers, `num_nextn_predict_layers` of them stored past the decoder's as
    model.layers.<n_layers + k>.* (the released checkpoints): that many when the files hold any such tensor, else 0
    (transformers saves none; it skips them). Imported as `lit_lm.mtp`'s modules, unless the run's `mtp_weight` is
    0 (no loss would train them); the import then checks that the files hold every tensor of them."""
    family = FAMILIES.get(hf.get("model_type"))
    n = int(hf.get("num_nextn_predict_layers") or 0)
    if family is None or not family.mtp or not n:
        return 0
    layers = {f"model.layers.{config.n_layers + k}." for k in range(n)}
    return n if any(name.startswith(tuple(layers)) for name in tensor_names(folder)) else 0


def tensor_names(folder: PathLike) -> list[str]:
    """The tensors of a Hugging Face folder: its index's names, or its safetensors files' headers (no data read)."""
    index = Path(folder) / INDEX
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    names = []
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            names += list(f.keys())
    return names


def overridden(before: ModelConfig, after: ModelConfig) -> list[str]:
    """`field before -> after` for every field the Hugging Face config changed (for the one line that says so)."""
    names = [f.name for f in fields(ModelConfig)
             if f.name in ARCHITECTURE + ("rope_theta", "rope_scaling", "sliding_window", "norm_eps", "moe_top_k",
                                          "moe_norm_topk")]
    return [f"{n} {getattr(before, n)} -> {getattr(after, n)}" for n in names
            if getattr(before, n) != getattr(after, n)]


# -- weights ----------------------------------------------------------------------------------------------------
class HFWeights:
    """The parameters of a Hugging Face model folder, read by lit-lm name and global slice (`read`).

    The files are checked when opened: a sharded folder's index names files inside the folder that exist and are
    whole safetensors files (a missing or truncated shard is refused in one line naming it). `bytes_read` counts
    the tensor bytes read so far: what a rank took from the files."""

    def __init__(self, folder: PathLike, config: ModelConfig) -> None:
        self.folder = Path(folder)
        self.config = config
        self.family = FAMILIES.get(read_hf_config(folder).get("model_type"), FAMILIES["llama"])
        index = self.folder / INDEX
        if index.is_file():
            self.files = {k: self._inside(index, f) for k, f in json.loads(index.read_text())["weight_map"].items()}
            for file in sorted(set(self.files.values())):
                self._keys(file, index)
        else:
            self.files = {}
            for file in sorted(self.folder.glob("*.safetensors")):
                self.files.update(dict.fromkeys(self._keys(file), file))
        if not self.files:
            raise ConfigError(f"{self.folder} holds no safetensors weights (model.init_args.init_from)")
        self.bytes_read = 0
        self._check_names()

    def _inside(self, index: Path, name: str) -> Path:
        """A shard path of the index, refused when its name leads out of the folder (an absolute path, any `..`).
        The name is judged as written, not where symlinks lead: the Hugging Face cache's snapshot files are
        symlinks into its `../../blobs/`."""
        if PurePath(name).is_absolute() or ".." in PurePath(name).parts:
            raise ConfigError(f"{index}: the shard {name!r} is outside {self.folder}; an index names files of its "
                              "own folder (model.init_args.init_from)")
        return self.folder / name

    @staticmethod
    def _keys(file: Path, index: Optional[Path] = None) -> list[str]:
        """The tensor names in a safetensors file's header; a missing or unreadable (truncated) file refused."""
        if not file.is_file():
            raise ConfigError(f"{file}: missing, though {index} names it: download the folder again "
                              "(model.init_args.init_from)")
        try:
            with safe_open(str(file), "pt") as f:
                return list(f.keys())
        except Exception as e:  # SafetensorError: a truncated download, another format
            raise ConfigError(f"{file}: not a whole safetensors file ({str(e).splitlines()[0]}): truncated? "
                              "download it again (model.init_args.init_from)") from None

    def _check_names(self) -> None:
        """Every parameter of the model is in the files, and every tensor of the files is a parameter (a tied
        checkpoint may also store the head: transformers ties it to the embedding, and so does lit-lm)."""
        from lit_lm.model import Transformer

        with torch.device("meta"):
            model = Transformer(self.config)
        names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers() if self.holds(n)]
        wanted = {s for n in names for s in self._sources(n)}
        missing = sorted(wanted - set(self.files))
        extra = sorted(k for k in set(self.files) - wanted - {"lm_head.weight"}
                       if not k.endswith("inv_freq") and not self._past_layers(k))
        mtp = [k for k in missing if self._past_layers(k, 0)]
        if mtp:
            raise ConfigError(f"{self.folder}: holds multi-token prediction layers (num_nextn_predict_layers "
                              f"{self.config.mtp_layers}) but not all of them: no tensor {mtp[0]} ({len(mtp)} "
                              "missing); give the whole layers, or set model.init_args.config.mtp_weight 0 to skip "
                              "them (model.init_args.init_from)")
        if missing or extra:
            what = f"has no tensor {missing[0]}" if missing else f"has a tensor {extra[0]} lit-lm's model has not"
            raise ConfigError(f"{self.folder}: the weights do not match its {CONFIG}: it {what} "
                              f"({len(missing)} missing, {len(extra)} unexpected) (model.init_args.init_from)")

    def _past_layers(self, key: str, mtp: Optional[int] = None) -> bool:
        """A tensor of a layer past the decoder's and its `mtp` (default: the config's) multi-token prediction
        layers (DeepSeek-V3's, model.layers.<n>): skipped, as transformers skips them; so are an imported
        prediction layer's copies of the embedding and head (`MTP_SHARED`: lit-lm's module shares the model's)."""
        parts = key.split(".")
        if not (key.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= self.config.n_layers):
            return False
        return int(parts[2]) >= self.config.n_layers + (self.config.mtp_layers if mtp is None else mtp) or \
            ".".join(parts[3:]) in MTP_SHARED.values()

    def holds(self, name: str) -> bool:
        """Whether the files hold parameter or buffer `name` (a router's selection bias in DeepSeek-V3 only)."""
        try:
            self.family.hf_name(name, self.config)
        except KeyError:
            return False
        return True

    def _source(self, name: str) -> Union[str, list[str]]:
        """The tensor in the files that holds parameter `name` (a tied head is the embedding), or one per expert
        of a stacked expert weight."""
        if name == "lm_head.weight" and self.config.tie_embeddings:
            name = "tok_embeddings.weight"
        try:
            return self.family.hf_name(name, self.config)
        except KeyError as e:
            raise ConfigError(f"{self.folder}: {e.args[0]} (model.init_args.init_from)") from None

    def _sources(self, name: str) -> list[str]:
        source = self._source(name)
        if isinstance(source, FusedSource):
            try:
                return source.files(set(self.files))
            except ConfigError as e:
                raise ConfigError(f"{self.folder}: {e}") from None
        return [source] if isinstance(source, str) else source

    def _read(self, source: str, index: tuple[slice, ...]) -> Tensor:
        with safe_open(str(self.files[source]), "pt") as f:
            part = f.get_slice(source)[index] if index else f.get_tensor(source)
        self.bytes_read += part.numel() * part.element_size()
        return part

    def read(self, name: str, tensor: Tensor, index: tuple[slice, ...] = ()) -> None:
        """Fill `tensor` with `global[index]` of parameter `name`, reading that slice only (of a stacked expert
        weight: the experts index[0] selects, each sliced by the rest of the index)."""
        source = self._source(name)
        if isinstance(source, FusedSource):  # gpt-oss's fused experts (maybe MXFP4): the slice's rows only
            shape = tensor.shape if not index else self._global_shape(name)
            part, what = source.read(self._read, set(self.files), shape, index), source.tensor
        elif isinstance(source, str):
            part, what = self._read(source, index), source
        else:  # stacked experts (E, ...): index[0] picks the experts, the rest slices each
            experts = range(len(source))[index[0] if index else slice(None)]
            parts = [self._read(source[e], tuple(index[1:])) for e in experts]
            part = torch.stack(parts) if parts else tensor.new_empty(tensor.shape)
            what = f"{source[0]} (experts {experts.start}:{experts.stop} of {len(source)})"
        if part.shape != tensor.shape:
            raise ConfigError(f"{self.folder}: {what}{list(index) if index else ''} has shape {list(part.shape)}, "
                              f"lit-lm's {name} {list(tensor.shape)} (model.init_args.init_from)")
        with torch.no_grad():
            tensor.copy_(part)

    def _global_shape(self, name: str) -> torch.Size:
        """Parameter `name`'s whole shape (a fused read's index is over it)."""
        from lit_lm.model import Transformer

        if not hasattr(self, "_shapes"):
            with torch.device("meta"):
                self._shapes = {n: p.shape for n, p in Transformer(self.config).named_parameters()}
        return self._shapes[name]

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
    from lit_lm.strategies.placement import materialize

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
