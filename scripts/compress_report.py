"""Train the default model once dense and once with each `configs/compress/*.yaml`, for the same steps, and print
one table: val loss, perplexity, sparsity, weight bits, exported bytes and the exported model's CPU forward time,
each relative to the dense run; optionally a loss-vs-size scatter (`--plot`) and the rows as JSON.

    python scripts/compress_report.py --steps 400          # the configs' own schedules (written for 400 steps)
    python scripts/compress_report.py --steps 40 --val-batches 5   # a short run: the schedules are scaled
    python scripts/compress_report.py --base configs/compress/report_fast.yaml --steps 20 --plot docs/img/x.png

Exported bytes: float weights of the unstructured/N:M layers as stored sparse (non-zeros + a 1-bit mask, or
+ 2-bit indices for N:M), structured pruning physically shrunk (`make_permanent`), QAT converted to packed integer
weights + scales (`QAT.convert`); everything else (embedding, norms) fp32. Single process, CPU or one GPU.
Forward time (`time_forward.py`): each exported model in its own worker process (1 thread by default: on a shared
machine a second thread mostly waits for a descheduled peer at every kernel's barrier), alternated in shuffled
rounds; median with min-max, and the load average. Every QAT width runs PyTorch's fbgemm int8 kernel (`IntLinear`);
structured pruning is a smaller dense model; unstructured/N:M sparsity stays dense (only its size shrinks).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_runner import MIN_ROUNDS  # noqa: E402
from lit_lm.callbacks.compress import QAT, Pruning  # noqa: E402
from lit_lm.callbacks.compress.qat import model_bytes  # noqa: E402
from lit_lm.cli import DEFAULT_CONFIG, LitLMCLI  # noqa: E402
from lit_lm.data.datamodule import TextDataModule  # noqa: E402
from lit_lm.module import LanguageModel  # noqa: E402
from time_forward import forward_latency  # noqa: E402

CONFIGS = ["prune_unstructured", "prune_2of4", "prune_structured", "qat_int8", "qat_int4", "qat_ternary", "qat_binary",
           "prune_then_qat"]
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_STEPS = 400  # what the fragments' schedules are written for


def scaled_fragment(name: str, steps: int, out_dir: Path) -> Path:
    """The fragment with every *_step and frequency scaled from DEFAULT_STEPS to `steps`."""
    cfg = yaml.safe_load((ROOT / "configs" / "compress" / f"{name}.yaml").read_text())
    for cb in cfg["trainer"]["callbacks+"]:
        args = cb["init_args"]
        for key in [k for k in args if k.endswith("_step") or k == "frequency"]:
            args[key] = max(round(args[key] * steps / DEFAULT_STEPS), 1 if key == "frequency" else 0)
    path = out_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def export(module: nn.Module, prunings: list[Pruning], qats: list[QAT]) -> nn.Module:
    """The deployable model: masks folded in (structured pruning shrinks the layers), QAT weights packed."""
    module = copy.deepcopy(module).cpu()
    for p in prunings:
        p.make_permanent(module)
    for q in qats:
        q.convert(module)
    return module


def exported_bytes(module: nn.Module, prunings: list[Pruning]) -> int:
    total = model_bytes(module)
    params = dict(module.named_parameters())
    for p in (p for p in prunings if p.method != "structured"):
        for name in p.masks:
            if name in params:  # still a float weight: stored sparse
                w = params[name]
                nnz = int((w != 0).sum())
                index_bits = 2 * nnz if p.method == "nm" else w.numel()
                total += nnz * w.element_size() + math.ceil(index_bits / 8) - w.numel() * w.element_size()
    return total


def run(name: str, fragment: list[str], steps: int, val_batches: int, root: Path) -> dict[str, Any]:
    args = ["fit", "--config", str(DEFAULT_CONFIG), *fragment, "--trainer.max_steps", str(steps),
            "--trainer.val_check_interval", str(steps), "--trainer.limit_val_batches", str(val_batches),
            "--trainer.default_root_dir", str(root / name),
            "--model.init_args.warmup_steps", str(max(steps // 10, 1))]
    cli = LitLMCLI(LanguageModel, TextDataModule, subclass_mode_model=True, subclass_mode_data=True,
                   save_config_kwargs={"overwrite": True}, args=[a for a in args if a])
    trainer, module = cli.trainer, cli.model
    prunings = [c for c in trainer.callbacks if isinstance(c, Pruning)]
    qats = [c for c in trainer.callbacks if isinstance(c, QAT)]
    val = float(trainer.callback_metrics["val_loss"])
    linear = sum(p.numel() for n, p in module.named_parameters() if p.ndim == 2 and "tok_embeddings" not in n)
    zeros = sum(int((~m).sum()) for p in prunings for m in p.masks.values())
    exported = export(module, prunings, qats)
    return {"val_loss": val, "ppl": math.exp(val), "sparsity": zeros / linear,
            "bits": min((q.bits for q in qats), default=32), "bytes": exported_bytes(exported, prunings),
            "exported": exported, "seq_len": cli.datamodule.seq_len}


def table(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The markdown table, every figure relative to the `dense` row in parentheses."""
    dense = rows["dense"]
    lines = ["| config | val loss | perplexity | sparsity | bits | exported bytes | exported forward ms [min-max] |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        ms = r["forward_ms"]
        lines.append(f"| {name} | {r['val_loss']:.4f} ({r['val_loss'] - dense['val_loss']:+.4f}) | {r['ppl']:.2f} "
                     f"({r['ppl'] / dense['ppl']:.3f}x) | {r['sparsity']:.3f} | {r['bits']} | {r['bytes']:,} "
                     f"({r['bytes'] / dense['bytes']:.3f}x) | {ms['median']:.1f} [{ms['min']:.1f}-{ms['max']:.1f}] "
                     f"({ms['median'] / dense['forward_ms']['median']:.2f}x) |")
    return lines


def plot_loss_vs_size(rows: dict[str, dict[str, Any]], path: Path) -> Path:
    """Every row as a point: exported size against validation loss (lower left is better)."""
    from plotting import figure, save

    fig, ax = figure(6.0, 3.8)
    for name, r in rows.items():
        ax.scatter(r["bytes"] / 2**20, r["val_loss"], s=25)
        ax.annotate(name, (r["bytes"] / 2**20, r["val_loss"]), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel("exported size (MiB)")
    ax.set_ylabel("validation loss")
    ax.set_title("compression: loss against size", fontsize=10)
    ax.grid(alpha=0.3)
    return save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--val-batches", type=int, default=25)
    parser.add_argument("--configs", nargs="*", default=CONFIGS)
    parser.add_argument("--base", nargs="*", default=[], help="config fragments applied to every run (e.g. "
                        "smaller batches: configs/compress/report_fast.yaml)")
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS, help="alternated rounds of forward timings, each "
                        "model in its own process (>= 5)")
    parser.add_argument("--reps", type=int, default=5, help="timed forwards per model and round (their median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each timing process")
    parser.add_argument("--batch", type=int, default=8, help="sequences per timed forward (of the data's seq_len)")
    parser.add_argument("--plot", type=Path, default=None, help="write the loss-vs-size scatter here (PNG)")
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args()
    base = [arg for path in opts.base for arg in ("--config", str(path))]
    with tempfile.TemporaryDirectory() as tmp:
        rows = {"dense": run("dense", base, opts.steps, opts.val_batches, Path(tmp))}
        for name in opts.configs:
            frag = scaled_fragment(name, opts.steps, Path(tmp))
            rows[name] = run(name, [*base, "--config", str(frag)], opts.steps, opts.val_batches, Path(tmp))
            print(f"[compress_report] {name}: val loss {rows[name]['val_loss']:.4f}", flush=True)
    exported = {name: r.pop("exported") for name, r in rows.items()}
    seq_len = rows["dense"]["seq_len"]
    for r in rows.values():
        r.pop("seq_len")
    latency, loads = forward_latency(exported, opts.batch, seq_len, opts.rounds, opts.threads, opts.reps)
    for name, ms in latency.items():
        rows[name]["forward_ms"] = ms
    print(f"\n{opts.steps} steps{' with ' + ' '.join(map(str, opts.base)) if opts.base else ''}; relative to dense "
          f"in parentheses (sparsity over the blocks' matrices); forward of ({opts.batch}, {seq_len}) tokens: each "
          f"model in its own process, {opts.threads} thread(s), median [min-max] over {opts.rounds} shuffled "
          f"alternated rounds of the median of {opts.reps}; 1-minute load average {min(loads):.1f}-{max(loads):.1f} "
          f"on {os.cpu_count()} CPUs\n")
    print("\n".join(table(rows)))
    if opts.json:
        opts.json.write_text(json.dumps(rows, indent=1))
    if opts.plot:
        print(f"wrote {plot_loss_vs_size(rows, opts.plot)}")


if __name__ == "__main__":
    torch.set_float32_matmul_precision("high")
    main()
