"""`scripts/ckpt.py export-hf`: what transformers loads from the export is lit-lm's model and tokenizer."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lit_lm.checkpoints import model_state_dict, read_checkpoint, tokenizer_from
from lit_lm.config import ConfigError, ModelConfig
from lit_lm.hf_export import check_exportable
from lit_lm.model import Transformer
from test_cli import REPO, run_cli, tiny_args

transformers = pytest.importorskip("transformers")  # a dev dependency (pyproject.toml)


@pytest.mark.parametrize("tied", ["true", "false"])
def test_export_loads_in_transformers_with_the_same_logits_and_ids(tmp_path, tied):
    fit = run_cli("fit", *tiny_args(tmp_path), "--trainer.max_steps", "3", "--model.init_args.config.n_layers", "2",
                  "--model.init_args.config.tie_embeddings", tied, cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    last, out = tmp_path / "run/checkpoints/last.ckpt", tmp_path / "hf"
    export = subprocess.run([sys.executable, str(REPO / "scripts/ckpt.py"), "export-hf", str(last), str(out)],
                            capture_output=True, text=True)
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


@pytest.mark.parametrize("field, value", [("moe_experts", 4), ("qk_norm", True), ("sliding_window", 8)])
def test_what_llama_cannot_hold_is_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=f"uses {field}, which Llama does not have"):
        check_exportable(ModelConfig(n_layers=2, **{field: value}))
