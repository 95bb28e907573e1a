"""lit-lm beside the Hugging Face stack, from the repository's root and from any other directory.

transformers >= 5.25 requires Hugging Face's `kernels` package and imports it. When lit-lm had a top-level
`kernels/`, Python run from the repo root found lit-lm's first (transformers could not build a Llama there), and
from anywhere else lit-lm found Hugging Face's (`kernels.apply` missing). With one import root both hold
everywhere: `import kernels` is Hugging Face's, `lit_lm.kernels` is lit-lm's, and a fit with Triton kernels runs
from a directory that is not the repository."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
LIT_LM = Path(sys.executable).parent / "lit-lm"  # the console script a user runs
PROBE = """
import json
import kernels, transformers
from transformers import LlamaConfig, LlamaForCausalLM
from lit_lm import kernels as ours
from lit_lm.config import ModelConfig
from lit_lm.model import Transformer

llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2))
model = ours.apply(Transformer(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4)), ["rmsnorm", "swiglu"])
print(json.dumps({"kernels": kernels.__file__, "hub_api": hasattr(kernels, "get_kernel"),
                  "transformers": transformers.__version__, "llama_params": sum(p.numel() for p in llama.parameters()),
                  "swapped": sorted({type(m).__module__ for m in model.modules()
                                     if type(m).__module__.startswith("lit_lm.kernels")})}))
"""


@pytest.mark.parametrize("where", ["repo root", "another directory"])
def test_hugging_faces_kernels_and_lit_lms_side_by_side(where: str, tmp_path: Path) -> None:
    """`python -c` puts the current directory first on sys.path: at the repo root it used to find lit-lm's folder."""
    cwd = REPO if where == "repo root" else tmp_path
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads(done.stdout.strip().splitlines()[-1])
    site = Path(sysconfig.get_paths()["purelib"])
    assert Path(info["kernels"]).is_relative_to(site) and info["hub_api"], info  # Hugging Face's package
    assert Version(info["transformers"]) >= Version("5.25"), info  # the release that requires and imports it
    assert info["llama_params"] > 0
    assert info["swapped"] == ["lit_lm.kernels.rmsnorm", "lit_lm.kernels.swiglu"], info


def test_a_fit_with_triton_kernels_from_another_directory(tmp_path: Path) -> None:
    """The README's `lit-lm fit`, as the installed command, with two Triton kernels (interpreted) and the repo's
    default config, run from a directory that is not the repository: two steps, losses logged."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def main(argv):\n    for arg in argv:\n        print(arg.upper())\n    return 0\n" * 40)
    args = ["fit", "--config", str(REPO / "configs" / "default.yaml"), "--trainer.default_root_dir", "run",
            "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0", "--trainer.log_every_n_steps", "1",
            "--data.init_args.files", f"[{corpus}]", "--data.init_args.data_dir", "data",
            "--data.init_args.vocab_size", "300", "--data.init_args.seq_len", "16", "--data.init_args.batch_size", "2",
            "--data.init_args.val_fraction", "0.2", "--model.init_args.config.d_model", "32",
            "--model.init_args.config.n_layers", "1", "--model.init_args.config.n_heads", "4",
            "--model.init_args.kernels", "[rmsnorm, swiglu]"]
    done = subprocess.run([str(LIT_LM), *args], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1", PYTHONWARNINGS="ignore"))
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "run" / "lightning_logs" / "version_0" / "metrics.csv") as f:
        losses = [float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")]
    assert len(losses) == 2 and all(loss > 0 for loss in losses), losses
