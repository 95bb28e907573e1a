"""Per-layer pruning sensitivity: prune each linear alone (unstructured magnitude) at a sweep of sparsities and
record the validation loss; print a table, write JSON and a PNG plot, and optionally pick per-layer sparsities
that reach a target overall sparsity with the smallest per-layer loss increase (within a budget).

    python scripts/sensitivity.py --ckpt runs/default/.../last.ckpt --out runs/sensitivity \
        [--sparsities 0.25 0.5 0.75 0.9] [--val-batches 10] [--target 0.5 --budget 0.05]

The allocation: every layer takes the largest swept sparsity whose loss increase is <= t, for the smallest t
(searched over the measured increases, t <= budget) that reaches the target overall (parameter-weighted).
"""

from __future__ import annotations

import argparse
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from callbacks.compress.core import DEFAULT_EXCLUDE, select
from callbacks.compress.pruning import magnitude_masks
from lit_lm.data import TextDataModule
from lit_lm.module import LanguageModel
from strategies.base import whole_weights


@torch.no_grad()
def val_loss(module: LanguageModel, batches: list[torch.Tensor]) -> float:
    return float(np.mean([float(module.model.loss(b[:, :-1], b[:, 1:])[1]) for b in batches]))


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def write_png(path: Path, curves: dict[str, list[float]], xs: list[float], size: int = 400) -> None:
    """Loss against sparsity, one grey level per layer, no axis text: a dependency-free picture of the table
    (matplotlib is not a dependency)."""
    img = np.full((size, size), 255, np.uint8)
    ys = np.array(list(curves.values()))
    lo, span = ys.min(), max(ys.max() - ys.min(), 1e-9)
    for i, curve in enumerate(ys):
        pts = [(10 + (x - xs[0]) / (xs[-1] - xs[0] or 1) * (size - 20), size - 10 - (y - lo) / span * (size - 20))
               for x, y in zip(xs, curve)]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            for t in np.linspace(0, 1, size):
                img[int(y0 + t * (y1 - y0)), int(x0 + t * (x1 - x0))] = int(200 * i / max(len(ys) - 1, 1))
    raw = b"".join(b"\0" + row.tobytes() for row in img)
    header = struct.pack(">IIBBBBB", size, size, 8, 0, 0, 0, 0)  # 8-bit greyscale
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", zlib.compress(raw))
                     + _png_chunk(b"IEND", b""))


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
    parser.add_argument("--ckpt", required=True, help="a single-file Lightning checkpoint of lit_lm's LanguageModel")
    parser.add_argument("--out", default="runs/sensitivity")
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.25, 0.5, 0.75, 0.9])
    parser.add_argument("--val-batches", type=int, default=10)
    parser.add_argument("--target", type=float)
    parser.add_argument("--budget", type=float, default=0.05)
    opts = parser.parse_args()
    ckpt = torch.load(opts.ckpt, map_location="cpu", weights_only=False)
    module = LanguageModel(**ckpt["hyper_parameters"])
    module.configure_model()
    module.load_state_dict(ckpt["state_dict"])
    data = TextDataModule(**ckpt.get("datamodule_hyper_parameters", {}))
    data.setup("validate")
    batches = [b for b, _ in zip(iter(torch.utils.data.DataLoader(data.val_set, batch_size=data.batch_size)),
                                 range(opts.val_batches))]
    dense = val_loss(module, batches)
    weights = select(whole_weights(module), None, DEFAULT_EXCLUDE, "sensitivity")
    results: dict[str, dict[float, float]] = {}
    for ws in weights:
        original = ws.local.detach().clone()
        results[ws.name] = {}
        for s in opts.sparsities:
            with torch.no_grad():
                ws.local.mul_(magnitude_masks([original], s)[0])
            results[ws.name][s] = val_loss(module, batches)
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
    write_png(out / "sensitivity.png", {n: list(r.values()) for n, r in results.items()}, opts.sparsities)
    print(f"dense val loss {dense:.4f}; wrote {out / 'sensitivity.json'} and {out / 'sensitivity.png'}")


if __name__ == "__main__":
    main()
