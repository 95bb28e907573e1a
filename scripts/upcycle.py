"""Sparse upcycling: turn a dense lit-lm checkpoint into an MoE one by copying each MLP into every expert.

    python scripts/upcycle.py runs/default/checkpoints/last.ckpt moe.ckpt --experts 8 --top-k 2 [--every 1]
        [--first-dense 0] [--capacity-factor 1.25] [--bias-update 1e-3] [--aux-loss 0.01]

Every expert of an upcycled block starts as the dense block's SwiGLU (moe_d_ff = d_ff, no shared experts) and the
router gets the model's small router init, so before any training the MoE model computes exactly the dense
function (the chosen experts are identical and the gates sum to 1). Any checkpoint a run writes is read (a single
file or a sharded directory). The output is a weights-only Lightning checkpoint (`state_dict` + `hyper_parameters`,
with the run's data settings and tokenizer carried over, so `lit-lm generate` and the offline tools read it alone)
for `LanguageModel.load_from_checkpoint`, `lit-lm validate/test/generate --ckpt_path`; it holds no optimizer state, so
`lit-lm fit --ckpt_path` refuses it (a fit resumes the optimizer too).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lit_lm.checkpoints import DATA_SETTINGS, read_checkpoint  # noqa: E402
from lit_lm.config import ModelConfig  # noqa: E402
from lit_lm.data.datamodule import TextDataModule  # noqa: E402
from lit_lm.errors import pop_debug_flag, reporting_errors  # noqa: E402
from lit_lm.model import Transformer  # noqa: E402


def upcycle_state_dict(dense: dict[str, Tensor], moe_config: ModelConfig, prefix: str = "") -> dict[str, Tensor]:
    """The MoE model's state dict (keys under `prefix`) from a dense one with the same non-MLP shapes."""
    moe = Transformer(moe_config)  # fresh routers (small init) and the right set of keys
    out = {f"{prefix}{k}": v for k, v in moe.state_dict().items()}
    for key, value in dense.items():
        name = key[len(prefix):]
        parts = name.split(".")  # blocks.<i>.mlp.<w>.weight for a dense MLP weight
        if name.startswith("blocks.") and parts[2] == "mlp" and moe_config.is_moe_layer(int(parts[1])):
            stacked = f"{prefix}blocks.{parts[1]}.mlp.experts.{parts[3]}"
            out[stacked] = value.unsqueeze(0).expand(moe_config.moe_experts, *value.shape).clone()
        else:
            out[key] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dense", type=Path, help="dense checkpoint (.ckpt file or sharded directory)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--experts", type=int, required=True)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--first-dense", type=int, default=0)
    parser.add_argument("--capacity-factor", type=float, default=None)
    parser.add_argument("--bias-update", type=float, default=0.0)
    parser.add_argument("--aux-loss", type=float, default=0.0)
    args = parser.parse_args()
    checkpoint = read_checkpoint(args.dense)
    hparams = checkpoint["hyper_parameters"]
    dense_config = ModelConfig(**hparams["config"])
    config = replace(dense_config, moe_experts=args.experts, moe_top_k=args.top_k, moe_every=args.every,
                     moe_first_dense=args.first_dense, moe_d_ff=dense_config.d_ff, moe_shared_experts=0,
                     moe_capacity_factor=args.capacity_factor, moe_bias_update=args.bias_update,
                     moe_aux_loss=args.aux_loss)
    state = upcycle_state_dict(checkpoint["state_dict"], config, prefix="model.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = {k: checkpoint[k] for k in (DATA_SETTINGS, TextDataModule.__qualname__) if k in checkpoint}
    torch.save({"state_dict": state, "hyper_parameters": {**hparams, "config": asdict(config)}, **data,
                "pytorch-lightning_version": checkpoint.get("pytorch-lightning_version")}, args.out)
    n_moe = sum(config.is_moe_layer(i) for i in range(config.n_layers))
    print(f"upcycled {n_moe}/{config.n_layers} blocks to {args.experts} experts (top-{args.top_k}) -> {args.out}")


if __name__ == "__main__":
    with reporting_errors(pop_debug_flag(None)[1]):
        main()
