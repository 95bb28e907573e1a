"""DeepSeek-V3's multi-token prediction layers in and out (`lit_lm.mtp`; `held_mtp_layers`, `families.MTP`).

The released checkpoints store `num_nextn_predict_layers` of them past the decoder's, layer n = num_hidden_layers:
a decoder layer's tensors (input_layernorm, self_attn.*, post_attention_layernorm, mlp.*) under model.layers.<n>.,
and enorm, hnorm, eh_proj, shared_head.norm, with copies of the embedding (embed_tokens) and the head
(shared_head.head); transformers' model skips them. The folder here is a tiny transformers DeepSeek-V3 with such a
layer added under those names (its decoder-layer tensors taken from a transformers model one layer deeper).

- imported into `mtp.0` (enorm, hnorm, eh_proj, norm = shared_head.norm, block = layer n), value for value; the
  copies are not read; the logits stay transformers' (the module is the training loss's only);
- exported back tensor for tensor (the copies written from the shared embedding and head), config.json's
  num_nextn_predict_layers 1, and transformers loads the export with the same logits;
- a layer with a tensor missing is refused in one line; `mtp_weight` 0 skips them (no loss would train them), and a
  transformers folder (num_nextn_predict_layers 1, no such tensor) imports none, as before.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from lit_lm.config import ConfigError, ModelConfig  # noqa: E402
from lit_lm.hf.exporter import export_hf  # noqa: E402
from lit_lm.hf.importer import HFWeights, as_checkpoint, load_model, model_config  # noqa: E402
from test_deepseek_v3 import IDS, SHAPE, save_deepseek  # noqa: E402

LAYER = SHAPE["num_hidden_layers"]  # the prediction layer's index, as DeepSeek-V3's 61
OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")  # beside a decoder layer's
COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


def save_with_mtp(folder: Path, drop: str = "") -> dict[str, torch.Tensor]:
    """A tiny DeepSeek-V3 folder with one multi-token prediction layer stored as released (module docstring);
    `drop`: a tensor left out. Returns the files' tensors."""
    save_deepseek(folder, seed=30, q_lora_rank=24)
    deeper = folder.parent / f"{folder.name}_deeper"
    save_deepseek(deeper, seed=31, q_lora_rank=24, num_hidden_layers=LAYER + 1)
    tensors = load_file(folder / "model.safetensors")
    prefix = f"model.layers.{LAYER}."
    tensors.update({k: v for k, v in load_file(deeper / "model.safetensors").items() if k.startswith(prefix)})
    g, d = torch.Generator().manual_seed(32), SHAPE["hidden_size"]
    for name in OWN:
        shape = (d, 2 * d) if name.startswith("eh_proj") else (d,)
        tensors[prefix + name] = torch.randn(shape, generator=g) * (0.1 if len(shape) == 2 else 0.2) + \
            (0.0 if len(shape) == 2 else 1.0)
    tensors.update({prefix + ours: tensors[main].clone() for ours, main in COPIES.items()})
    tensors.pop(drop, None)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return tensors


def test_mtp_layers_import_and_export_tensor_for_tensor(tmp_path):
    folder = tmp_path / "mtp"
    tensors = save_with_mtp(folder)
    ours = load_model(folder)
    assert ours.config.mtp_layers == 1
    module, prefix = ours.mtp["0"], f"model.layers.{LAYER}."
    for name, hf in [("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
                     ("eh_proj.weight", "eh_proj.weight"), ("norm.weight", "shared_head.norm.weight"),
                     ("block.attn_norm.weight", "input_layernorm.weight"),
                     ("block.attn.wkv_b.weight", "self_attn.kv_b_proj.weight"),
                     ("block.mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"),
                     ("block.mlp.shared.w_down.weight", "mlp.shared_experts.down_proj.weight")]:
        assert torch.equal(module.get_parameter(name) if "bias" not in name else module.get_buffer(name),
                           tensors[prefix + hf]), name
    assert torch.equal(module.block.mlp.experts.w_up[3], tensors[prefix + "mlp.experts.3.up_proj.weight"])
    weights = HFWeights(folder, ours.config)  # the copies of the embedding and head are no parameter's source
    assert not any(s.startswith(tuple(prefix + c for c in COPIES)) for n, _ in ours.named_parameters()
                   for s in weights._sources(n))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = theirs(IDS).logits
        torch.testing.assert_close(ours(IDS), expected, rtol=1e-5, atol=1e-5)
    export_hf(as_checkpoint(folder), tmp_path / "out", dtype="float32")
    written = load_file(tmp_path / "out/model.safetensors")
    assert sorted(written) == sorted(tensors)
    assert all(torch.equal(written[k], tensors[k]) for k in tensors)
    assert json.loads((tmp_path / "out/config.json").read_text())["num_nextn_predict_layers"] == 1
    with torch.no_grad():
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
        torch.testing.assert_close(again(IDS).logits, expected, rtol=0, atol=0)


def test_incomplete_mtp_layers_refused_and_skipped_on_request(tmp_path):
    save_with_mtp(tmp_path / "broken", drop=f"model.layers.{LAYER}.hnorm.weight")
    with pytest.raises(ConfigError, match=rf"holds multi-token prediction layers \(num_nextn_predict_layers 1\) but "
                                          rf"not all of them: no tensor model\.layers\.{LAYER}\.hnorm\.weight"):
        load_model(tmp_path / "broken")
    assert model_config(tmp_path / "broken", ModelConfig(mtp_weight=0.0)).mtp_layers == 0
    assert load_model(tmp_path / "broken", ModelConfig(mtp_weight=0.0)).mtp is None
    save_deepseek(tmp_path / "plain", seed=30, q_lora_rank=24)  # transformers' own: no prediction layer stored
    assert json.loads((tmp_path / "plain/config.json").read_text()).get("num_nextn_predict_layers") == 1
    assert model_config(tmp_path / "plain").mtp_layers == 0
