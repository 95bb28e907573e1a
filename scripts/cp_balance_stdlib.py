"""Per-rank attention work under context parallelism with packed documents, zigzag split against the document
balance (`lit_lm.strategies.cp_balance`), on a real length distribution (docs/cp.md, "Balancing documents").

The rows are the data module's own: `TextDataModule` with its default corpus (the standard library's .py files),
its BPE tokenizer trained on them, `[BOS] text [EOS]` per document packed into (T+1)-token training windows, and
`document_mask` on; the ids are `lit_lm.data.packing.document_ids` of the inputs, as the module computes them.
Integer counts only (visible query-key pairs per rank: FLOPs = 4·D·Hq per pair forward), no attention is run:

    python scripts/cp_balance_stdlib.py --seq-lens 8192 16384 32768 --cps 2 4 8 --batch 4 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lit_lm.data.datamodule import TextDataModule  # noqa: E402
from lit_lm.data.packing import document_ids  # noqa: E402
from lit_lm.strategies.cp_balance import attention_work  # noqa: E402


def batches(seq_len: int, batch: int, n: int, data_dir: str, corpus_mb: float) -> list:
    """`n` training batches' (B, T) document ids from the data module (its sampler's order)."""
    data = TextDataModule(data_dir=data_dir, seq_len=seq_len, batch_size=batch, corpus_mb=corpus_mb,
                          document_mask=True, val_fraction=0.25)  # (the val split: a batch even at 32k)
    data.prepare_data()
    data.setup("fit")
    eos = data.packing().eos_id
    out = []
    for i, rows in enumerate(data.train_dataloader()):
        if i == n:
            break
        out.append(document_ids(rows[:, :-1], eos))
    return out


def row(ids, cp: int) -> dict:
    before, after = attention_work(ids, cp, "zigzag"), attention_work(ids, cp, "documents")
    mean = sum(before.pairs) / cp
    return {"docs": int((ids[:, 1:] != ids[:, :-1]).sum()) + ids.shape[0],
            "zigzag": [p / mean for p in before.pairs], "documents": [p / mean for p in after.pairs],
            "zigzag_imbalance": before.imbalance, "documents_imbalance": after.imbalance,
            "chunks": len(after.split.chunks[0]) * cp}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--batches", type=int, default=8, help="batches per sequence length")
    parser.add_argument("--corpus-mb", type=float, default=4.0, help="the data module's default corpus size")
    parser.add_argument("--data-dir", default=None, help="the data module's cache (default: a temporary folder)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for t in args.seq_lens:
            for b, ids in enumerate(batches(t, args.batch, args.batches, args.data_dir or tmp, args.corpus_mb)):
                for cp in args.cps:
                    results.append({"seq_len": t, "batch": b, "cp": cp, **row(ids, cp)})
    print("| T | cp | batches | zigzag max/mean: median (worst) | documents max/mean: median (worst) | chunks |")
    print("|---|---|---|---|---|---|")
    for t in args.seq_lens:
        for cp in args.cps:
            rs = [r for r in results if r["seq_len"] == t and r["cp"] == cp]
            z = sorted(r["zigzag_imbalance"] for r in rs)
            d = sorted(r["documents_imbalance"] for r in rs)
            chunks = sorted({r["chunks"] for r in rs})
            print(f"| {t} | {cp} | {len(rs)} | {z[len(z) // 2]:.3f} ({z[-1]:.3f}) | {d[len(d) // 2]:.3f} ({d[-1]:.3f}) "
                  f"| {', '.join(map(str, chunks))} |")
    worst = max(results, key=lambda r: r["zigzag_imbalance"])
    print(f"\nper-rank work / mean of the worst zigzag batch (T {worst['seq_len']}, cp {worst['cp']}, "
          f"{worst['docs']} documents in {args.batch} rows):")
    print("zigzag:    " + " ".join(f"{w:.2f}" for w in worst["zigzag"]))
    print("documents: " + " ".join(f"{w:.2f}" for w in worst["documents"]))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
