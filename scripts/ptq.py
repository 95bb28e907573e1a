"""Post-training quantization of a trained checkpoint with each range method, against the float model and against
QAT (the `QAT` callback fine-tuning the same checkpoint), in one table of validation loss and perplexity.

    python scripts/ptq.py --ckpt_path runs/default/.../last.ckpt [--method minmax percentile mse kl] \
        [--weights 8 4:64] [--weight-method mse] [--calib-batches 8] [--val-batches 25] \
        [--qat-steps 100] [--config RUN.yaml ...]

`--weights`: one or more weight settings, each `BITS` (one scale per output channel) or `BITS:GROUP` (one per
group of GROUP inputs); every setting gets its rows (each method, then QAT) in the one table.

The checkpoint: a single-file Lightning checkpoint or a lit-lm sharded checkpoint directory. The model, the data
settings and the tokenizer come from it (`lit_lm.checkpoints.data_from_checkpoint`); a `--config` is optional and
refused in one line if it disagrees with the checkpoint (its batch_size and data_dir apply). Calibration batches
come from the training split (seeded shuffle), validation from the validation split.
Each method is evaluated on the exported model (`IntLinear`: packed integer weights, uint8 activations). The QAT
row fine-tunes the float checkpoint for `--qat-steps` steps (lr x0.1, no warmup) with fake quantization of the same
bits, observers frozen for the last quarter, and is evaluated exported too: it has had those extra steps of
training, PTQ none.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path
from typing import Any

import lightning as L
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lit_lm.callbacks.compress import QAT  # noqa: E402
from lit_lm.callbacks.compress.ptq import METHODS, PTQ  # noqa: E402
from lit_lm.data.datamodule import TextDataModule  # noqa: E402
from lit_lm.errors import pop_debug_flag, reporting_errors  # noqa: E402
from lit_lm.module import LanguageModel  # noqa: E402
from offline import batches, build_model, data_module, load_checkpoint, val_loss  # noqa: E402


def qat_finetune(ckpt: dict[str, Any], data: TextDataModule, bits: int, group_size: int | None,
                 steps: int) -> LanguageModel:
    """The float checkpoint fine-tuned with the QAT callback, exported."""
    hp = ckpt["hyper_parameters"]
    module = build_model(ckpt, lr=hp["lr"] * 0.1, warmup_steps=0).train()  # (Lightning keeps a module's mode)
    qat = QAT(bits, group_size=group_size, start_step=0, freeze_observers_step=steps * 3 // 4)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        gradient_clip_val=1.0, callbacks=[qat])
    L.seed_everything(0, verbose=False)
    trainer.fit(module, DataLoader(data.train_set, batch_size=data.batch_size, shuffle=True))
    return qat.convert(module.eval())


def weight_setting(text: str) -> tuple[int, int | None]:
    """`8` -> (8, None): per channel; `4:64` -> (4, 64): per group of 64 inputs."""
    bits, _, group = text.partition(":")
    try:
        return int(bits), int(group) if group else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"--weights takes BITS or BITS:GROUP (e.g. 8 4:64), got {text!r}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt_path", type=Path, required=True)
    parser.add_argument("--method", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--weights", type=weight_setting, nargs="+", default=[(8, None)],
                        help="BITS (3, 4 or 8; per channel) or BITS:GROUP (per group of GROUP inputs)")
    parser.add_argument("--weight-method", choices=("minmax", "mse"), default="minmax")
    parser.add_argument("--percentile", type=float, default=99.99)
    parser.add_argument("--calib-batches", type=int, default=8)
    parser.add_argument("--val-batches", type=int, default=25)
    parser.add_argument("--qat-steps", type=int, default=100, help="0: no QAT row")
    parser.add_argument("--config", type=Path, nargs="+", default=[],
                        help="the run's config files: optional, checked against the checkpoint")
    opts = parser.parse_args()

    ckpt = load_checkpoint(opts.ckpt_path)
    data = data_module(ckpt, opts.config)
    calib = batches(data.train_set, data.batch_size, opts.calib_batches, flag="--calib-batches")
    val = batches(data.val_set, data.batch_size, opts.val_batches, shuffle=False, flag="--val-batches")
    float_model = build_model(ckpt)
    rows = {("float", "fp32"): val_loss(float_model, val)}
    for bits, group_size in opts.weights:
        weights = f"int{bits} " + (f"per group of {group_size}" if group_size else "per channel")
        for method in opts.method:
            ptq = PTQ(bits, group_size, method, opts.weight_method, opts.percentile)
            model = copy.deepcopy(float_model)
            ptq.calibrate(model, lambda b, m=model: m.model(b[:, :-1]), calib)
            rows[f"PTQ {method}", weights] = val_loss(ptq.convert(model), val)
            print(f"[ptq] {method} {weights}: {rows[f'PTQ {method}', weights]:.4f}", flush=True)
        if opts.qat_steps > 0:
            rows[f"QAT ({opts.qat_steps} fine-tuning steps)", weights] = val_loss(
                qat_finetune(ckpt, data, bits, group_size, opts.qat_steps), val)
    print(f"\n{opts.ckpt_path}: weights' range by {opts.weight_method}, activations uint8 per tensor; {len(calib)} "
          f"calibration and {len(val)} validation batches of {data.batch_size} x {data.seq_len}\n")
    float_loss = rows["float", "fp32"]
    print("| model | weights | val loss (vs float) | perplexity |\n|---|---|---|---|")
    for (name, weights), loss in rows.items():
        print(f"| {name} | {weights} | {loss:.4f} ({loss - float_loss:+.4f}) | {math.exp(loss):.2f} |")


if __name__ == "__main__":
    with reporting_errors(pop_debug_flag(None)[1]):
        main()
