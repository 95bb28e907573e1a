"""`scripts/ckpt.py export-hf`: what transformers loads from the export is lit-lm's model and tokenizer."""

from __future__ import annotations


import pytest
import torch

from lit_lm.checkpoints import model_state_dict, read_checkpoint, tokenizer_from
from lit_lm.config import ConfigError, ModelConfig
from lit_lm.hf.exporter import check_exportable, export_hf
from lit_lm.model import Transformer
from test_cli import run_cli, run_script, tiny_args

transformers = pytest.importorskip("transformers")  # a dev dependency (pyproject.toml)


@pytest.mark.parametrize("tied", ["true", "false"])
def test_export_loads_in_transformers_with_the_same_logits_and_ids(tmp_path, tied):
    fit = run_cli("fit", *tiny_args(tmp_path), "--trainer.max_steps", "3", "--model.init_args.config.n_layers", "2",
                  "--model.init_args.config.tie_embeddings", tied, cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    last, out = tmp_path / "run/checkpoints/last.ckpt", tmp_path / "hf"
    export = run_script("scripts/ckpt.py", "export-hf", last, out, cwd=tmp_path)
    assert export.returncode == 0, export.stderr[-3000:]

    checkpoint = read_checkpoint(last)
    model = Transformer(ModelConfig(**checkpoint["hyper_parameters"]["config"])).eval()
    model.load_state_dict(model_state_dict(checkpoint))
    ours = tokenizer_from(checkpoint)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert hf.config.tie_word_embeddings == (tied == "true") and hf.config.num_key_value_heads == 2

    text = "import os\n\ndef main(argv):\n    print('héllo ☃', argv)  # 42\t\n<|endoftext|>x = 1"
    ids = ours.encode(text)
    assert hf_tokenizer.encode(text) == ids and hf_tokenizer.decode(ids) == text
    with torch.no_grad():
        expected, got = model(torch.tensor([ids])), hf(torch.tensor([ids])).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("field, config", [("moe_shared_experts", dict(moe_experts=4, moe_shared_experts=1)),
                                           ("moe_score", dict(moe_experts=4, moe_score="sigmoid")),
                                           ("qkv_bias", dict(sliding_window=8, qkv_bias=True))])
def test_what_no_exported_family_holds_is_refused_by_name(field, config):
    """(MoE and QK-norm models are exported as Mixtral, Qwen3, ...: tests/test_hf_families.py)"""
    with pytest.raises(ConfigError, match=f"the model's {field} .* is in no Hugging Face family lit-lm exports"):
        check_exportable(ModelConfig(n_layers=2, **config))


@pytest.mark.parametrize("family", ["llama3 rope scaling", "mistral window 5", "qwen2 tied"])
def test_import_then_export_is_identical_tensor_for_tensor(tmp_path, family):
    """A Hugging Face folder read as a checkpoint (built on meta, filled from the files: the import) and exported
    again: the same tensors under the same names, bit for bit, and transformers loads the same model from it."""
    from safetensors.torch import load_file
    from test_hf_import import FAMILIES, save_hf

    source, out = tmp_path / "in", tmp_path / "out"
    save_hf(source, FAMILIES[family]())
    if family.startswith("qwen2"):  # through the script, as a user runs it
        export = run_script("scripts/ckpt.py", "export-hf", source, out, cwd=tmp_path)
        assert export.returncode == 0, export.stderr[-3000:]
    else:
        export_hf(read_checkpoint(source), out)
    before, after = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    theirs = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(again) is type(theirs)
    ids = torch.randint(0, theirs.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, theirs(ids).logits, rtol=0, atol=0)
