"""Per-layer pruning sensitivity: prune each linear alone (unstructured magnitude) at a sweep of sparsities and
record the validation loss; print a table, write JSON and a plot of the curves (matplotlib), and optionally pick
per-layer sparsities that reach a target overall sparsity with the smallest per-layer loss increase (within a budget).

    python scripts/sensitivity.py --ckpt runs/default/.../last.ckpt --out runs/sensitivity [--config RUN.yaml ...] \
        [--sparsities 0.25 0.5 0.75 0.9] [--val-batches 10] [--target 0.5 --budget 0.05]

The allocation: every layer takes the largest swept sparsity whose loss increase is <= t, for the smallest t
(searched over the measured increases, t <= budget) that reaches the target overall (parameter-weighted).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lit_lm.callbacks.compress.core import DEFAULT_EXCLUDE, select  # noqa: E402
from lit_lm.callbacks.compress.pruning import magnitude_masks  # noqa: E402
from lit_lm.errors import pop_debug_flag, reporting_errors  # noqa: E402
from offline import batches, build_model, data_module, load_checkpoint, val_loss  # noqa: E402
from lit_lm.strategies.base import whole_weights  # noqa: E402


def plot_curves(results: dict[str, dict[float, float]], dense: float, path: Path) -> Path:
    """Validation loss increase against sparsity, one curve per layer."""
    from plotting import figure, save

    fig, ax = figure(6.0, 3.8)
    for name, curve in results.items():
        ax.plot(list(curve), [loss - dense for loss in curve.values()], marker="o", markersize=3, linewidth=1,
                label=name.removeprefix("model.").removesuffix(".weight"))
    ax.set_xlabel("sparsity of the layer alone (unstructured magnitude)")
    ax.set_ylabel("val loss increase")
    ax.set_title(f"per-layer pruning sensitivity (dense val loss {dense:.3f})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=5, ncol=2, loc="upper left")
    return save(fig, path)


def allocate(results: dict[str, dict[float, float]], sizes: dict[str, int], dense: float, target: float,
             budget: float) -> dict[str, float] | None:
    total = sum(sizes.values())
    for t in sorted({loss - dense for r in results.values() for loss in r.values()} | {0.0}):
        if t > budget:
            break
        pick = {n: max([s for s, loss in r.items() if loss - dense <= t], default=0.0) for n, r in results.items()}
        if sum(pick[n] * sizes[n] for n in pick) / total >= target:
            return pick
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, required=True,
                        help="a Lightning checkpoint of lit_lm's LanguageModel (one file or a sharded directory)")
    parser.add_argument("--config", type=Path, nargs="+", default=[],
                        help="the run's config files: optional (the checkpoint holds the run's data settings and "
                        "tokenizer), checked against the checkpoint")
    parser.add_argument("--out", default="runs/sensitivity")
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.25, 0.5, 0.75, 0.9])
    parser.add_argument("--val-batches", type=int, default=10)
    parser.add_argument("--target", type=float)
    parser.add_argument("--budget", type=float, default=0.05)
    opts = parser.parse_args()
    ckpt = load_checkpoint(opts.ckpt)
    module = build_model(ckpt)
    data = data_module(ckpt, opts.config)
    windows = batches(data.val_set, data.batch_size, opts.val_batches, shuffle=False, flag="--val-batches")
    dense = val_loss(module, windows)
    weights = select(whole_weights(module), None, DEFAULT_EXCLUDE, "sensitivity")
    results: dict[str, dict[float, float]] = {}
    for ws in weights:
        original = ws.local.detach().clone()
        results[ws.name] = {}
        for s in opts.sparsities:
            with torch.no_grad():
                ws.local.mul_(magnitude_masks([original], s)[0])
            results[ws.name][s] = val_loss(module, windows)
            with torch.no_grad():
                ws.local.copy_(original)
        print(f"{ws.name:40s} " + " ".join(f"{s:.2f}:{loss - dense:+.4f}" for s, loss in results[ws.name].items()))
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"dense_val_loss": dense, "val_loss": results}
    if opts.target is not None:
        report["allocation"] = allocate(results, {ws.name: ws.local.numel() for ws in weights}, dense, opts.target,
                                        opts.budget)
        print("allocation:", report["allocation"] or f"target {opts.target} not reachable within {opts.budget}")
    (out / "sensitivity.json").write_text(json.dumps(report, indent=1))
    plot_curves(results, dense, out / "sensitivity.png")
    print(f"dense val loss {dense:.4f}; wrote {out / 'sensitivity.json'} and {out / 'sensitivity.png'}")


if __name__ == "__main__":
    with reporting_errors(pop_debug_flag(None)[1]):
        main()
