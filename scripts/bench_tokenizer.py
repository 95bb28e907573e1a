"""Benchmark the BPE tokenizer on the Python standard library's source: training time, encode/decode speed,
compression. Usage: python scripts/bench_tokenizer.py --mb 4 --vocab-size 4096 --workers 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from lit_lm.data.datamodule import stdlib_corpus
from machine import machine  # scripts/: where the figures were measured
from lit_lm.data.tokenizer import EOT, BPETokenizer


def corpus_text(mb: float) -> str:
    """The default training corpus (the stdlib's .py files, as `lit_lm.data.datamodule` picks them) joined with
    <|endoftext|>."""
    return EOT.join(Path(p).read_text(encoding="utf-8", errors="replace") for p in stdlib_corpus(mb))


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=4.0, help="corpus size in MB of UTF-8")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=2, help="pre-tokenization processes for training")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this file")
    args = parser.parse_args()

    text = corpus_text(args.mb)
    n_bytes = len(text.encode("utf-8"))
    tokenizer, train_s = timed(BPETokenizer.train, [text], args.vocab_size, [EOT], args.workers)
    ids, encode_s = timed(tokenizer.encode, text)  # cold cache: every distinct pre-token is merged once
    decoded, decode_s = timed(tokenizer.decode, ids)
    assert decoded == text, "round trip failed"
    n_merges = len(tokenizer.merges)
    results = {
        "corpus_mb": n_bytes / 1e6,
        "vocab_size": tokenizer.vocab_size,
        "workers": args.workers,
        "train_s": train_s,
        "merges_per_s": n_merges / train_s,
        "encode_mb_per_s": n_bytes / 1e6 / encode_s,
        "decode_mb_per_s": n_bytes / 1e6 / decode_s,
        "tokens": len(ids),
        "tokens_per_byte": len(ids) / n_bytes,
        "bytes_per_token": n_bytes / len(ids),
    }
    print(f"corpus: {results['corpus_mb']:.2f} MB of stdlib .py, vocab {tokenizer.vocab_size} "
          f"({n_merges} merges), {args.workers} worker(s)")
    rows = [
        ("training time", f"{train_s:.2f} s"),
        ("merges / s", f"{results['merges_per_s']:.0f}"),
        ("encode (1 process)", f"{results['encode_mb_per_s']:.2f} MB/s"),
        ("decode", f"{results['decode_mb_per_s']:.1f} MB/s"),
        ("tokens / byte", f"{results['tokens_per_byte']:.3f}"),
        ("bytes / token", f"{results['bytes_per_token']:.2f}"),
    ]
    for name, value in rows:
        print(f"  {name:<20} {value:>14}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), **results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
