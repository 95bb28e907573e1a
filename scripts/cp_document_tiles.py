"""How much attention work the context-parallel tiles skip with packed documents (docs/cp.md, "Packed documents").

Counts, without running attention (integer plans only, `lit_lm.strategies.cp.block_plan`), the (query, key) pairs the
tiles of each cp rank compute for one row, with the row's documents and without them, beside the pairs the mask
allows (what a perfect skipper would compute):

    python scripts/cp_document_tiles.py --seq-lens 8192 32768 --cps 2 4 8 [--mean 512]

Rows are packed as in scripts/bench_document_mask.py (standard-library files, ~4 bytes a token, or exponential
lengths of --mean tokens). Ring and all-gather compute the same tiles (the ring per block, the all-gather on the
gathered keys), so one count serves both; Ulysses' tiles are the whole sequence's, also printed. The max over ranks
is the step's critical path (the zigzag split balances causal work, not documents).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_document_mask import stdlib_documents  # noqa: E402
from machine import machine  # noqa: E402
from lit_lm.strategies.cp import block_plan, row_documents, zigzag_runs  # noqa: E402


def pairs(q_runs: tuple, k_runs: tuple, chunk: int, first_key: tuple | None) -> int:
    return sum((r.stop - r.start) * (k.stop - k.start) for r, k, _ in block_plan(q_runs, k_runs, 1 << 62, chunk,
                                                                                    first_key))


def count(ids: torch.Tensor, cp: int) -> dict[str, float]:
    t = ids.shape[1]
    c, docs = t // (2 * cp), row_documents(ids, cp)
    row = ids[0]
    allowed = sum(int(n) * (int(n) + 1) // 2 for n in torch.unique_consecutive(row, return_counts=True)[1])
    per_rank = {"plain": [], "documents": []}
    for r in range(cp):
        q_runs = zigzag_runs(t, r, cp)
        for name, piece, first in (("plain", c, None), ("documents", docs.piece, docs.first_key)):
            per_rank[name].append(sum(pairs(q_runs, zigzag_runs(t, s, cp), piece, first) for s in range(cp)))
    whole = ((0, t),)
    return {"causal": t * (t + 1) / 2, "allowed": allowed,
            "plain_max": max(per_rank["plain"]), "doc_sum": sum(per_rank["documents"]),
            "doc_max": max(per_rank["documents"]), "doc_mean": sum(per_rank["documents"]) / cp,
            "ulysses": pairs(whole, whole, docs.piece, docs.first_key), "ulysses_plain": pairs(whole, whole, c, None)}


def balance(t: int, cp: int, rows: int, mean: int, heads: int, head_dim: int) -> dict[str, Any]:
    """Per-rank attention work of `rows` packed rows (seeds 0..rows-1) under the zigzag split and the document-aware
    one (`lit_lm.strategies.cp_balance.attention_work`): visible pairs, max/mean, chunks per rank, FLOPs per rank
    (forward + backward, `heads` query heads of `head_dim`)."""
    from lit_lm.strategies.cp_balance import attention_work

    ids = torch.cat([stdlib_documents(t, mean, seed) for seed in range(rows)])
    out: dict[str, Any] = {"seq_len": t, "cp": cp, "rows": rows, "n_documents": int(sum(int(r.max()) + 1 for r in ids))}
    for name in ("zigzag", "documents"):
        work = attention_work(ids, cp, name)
        out[name] = {"pairs": list(work.pairs), "imbalance": work.imbalance,
                     "chunks_per_rank": len(work.split.chunks[0]), "flops": list(work.flops(heads, head_dim))}
    return out


def balance_table(rows: list[dict[str, Any]], heads: int, head_dim: int) -> str:
    out = [f"Attention work per cp rank and layer, forward + backward ({heads} query heads of {head_dim}), the zigzag "
           "split against the document-aware one (cp_balance documents)", "",
           "| T | cp | rows (documents) | zigzag max / mean | balanced max / mean | chunks per rank | "
           "busiest rank GFLOP zigzag -> balanced | per-rank GFLOP, balanced |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        z, b = r["zigzag"], r["documents"]
        out.append(f"| {r['seq_len']} | {r['cp']} | {r['rows']} ({r['n_documents']}) | {z['imbalance']:.2f} | "
                   f"{b['imbalance']:.2f} | {b['chunks_per_rank']} | {max(z['flops']) / 1e9:.1f} -> "
                   f"{max(b['flops']) / 1e9:.1f} | {', '.join(f'{f / 1e9:.1f}' for f in b['flops'])} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--mean", type=int, default=0, help="exponential document lengths of this mean (0: stdlib)")
    parser.add_argument("--balance", type=int, default=0, metavar="ROWS", help="instead: per-rank attention work of "
                        "ROWS rows under the zigzag and the document-aware split")
    parser.add_argument("--heads", type=int, default=32, help="query heads, for --balance's FLOPs")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--json", help="--balance's rows as JSON here")
    args = parser.parse_args()
    if args.balance:
        rows = [balance(t, cp, args.balance, args.mean, args.heads, args.head_dim) for t in args.seq_lens
                for cp in args.cps]
        print(balance_table(rows, args.heads, args.head_dim))
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": machine(), "args": vars(args), "rows": rows}, indent=1))
        return
    print("| T | cp | documents | allowed / causal | computed / causal (sum over ranks) | max rank / plain max rank "
          "| max / mean rank | ulysses computed / causal |")
    print("|---|---|---|---|---|---|---|---|")
    for t in args.seq_lens:
        ids = stdlib_documents(t, args.mean)
        n_docs = int(ids.max()) + 1
        for cp in args.cps:
            r = count(ids, cp)
            print(f"| {t} | {cp} | {n_docs} | {r['allowed'] / r['causal']:.0%} | {r['doc_sum'] / r['causal']:.0%} | "
                  f"{r['doc_max'] / r['plain_max']:.0%} | {r['doc_max'] / r['doc_mean']:.2f} | "
                  f"{r['ulysses'] / r['causal']:.0%} |")


if __name__ == "__main__":
    main()
