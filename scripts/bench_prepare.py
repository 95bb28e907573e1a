"""Benchmark `lit-lm prepare` in tokens/s per core against two references on the same jsonl corpus and tokenizer:
the `tokenizers` library's own batch encoding in one process, one thread (the ceiling: encoding only, nothing read
or written), and a Megatron-style single-process loop (`preprocess_data.py` with one worker: json.loads a line,
encode it, append EOS, write its ids to a .bin and its length to an index).

    python scripts/bench_prepare.py --mb 4 --rounds 5 --out docs/benchmarks/2026-12-prepare-cpu.json

The corpus is the standard library's source (`lit_lm.data.datamodule.stdlib_corpus`), one file per jsonl row; the
tokenizer is lit-lm's BPE of 4096 tokens trained on it, saved as a `tokenizers` tokenizer.json (or --tokenizer_dir).
Each contender runs in its own fresh process, alternated over shuffled rounds (scripts/bench_runner.py); the figure is
the time of the work itself (the interpreter's start and imports excluded; prepare's pool start included)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runner import MARK, run_rounds, summarize, write_json  # noqa: E402
from machine import describe, machine  # noqa: E402

CONTENDERS = ("prepare_w1", "prepare_w2", "batch_encode", "megatron_loop")


def one(name: str, corpus: Path, tokenizer_dir: str) -> dict:
    """Run one contender here; its tokens, seconds and tokens/s per core."""
    os.environ["RAYON_NUM_THREADS"] = "1"  # before the library's first parallel call: one thread per process
    import numpy as np

    from lit_lm.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        if name.startswith("prepare_w"):
            from lit_lm.data.prepare import prepare

            cores = int(name[len("prepare_w"):])
            tokens = prepare([str(corpus)], tokenizer_dir, str(Path(out) / "p"), workers=cores, chunk_mb=1.0,
                             progress=False)["tokens"]
        elif name == "batch_encode":
            cores, tokens = 1, 0
            texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
            start = time.perf_counter()  # encoding only: the ceiling
            for i in range(0, len(texts), 64):
                tokens += sum(len(ids) + 1 for ids in tok.encode_batch(texts[i:i + 64]))
        elif name == "megatron_loop":
            cores, tokens, sizes = 1, 0, []
            dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
            with open(corpus) as f, open(Path(out) / "c.bin", "wb") as bin_file:
                for line in f:
                    ids = tok.encode(json.loads(line)["text"]) + [tok.eos_id]
                    np.array(ids, dtype=dtype).tofile(bin_file)
                    sizes.append(len(ids))
                    tokens += len(ids)
            np.save(Path(out) / "c.idx.npy", np.array(sizes, dtype=np.int64))
        else:
            raise SystemExit(f"unknown contender {name!r}: one of {CONTENDERS}")
        seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "cores": cores, "tokens_per_s": tokens / seconds,
            "tokens_per_s_per_core": tokens / seconds / cores}


def make_inputs(root: Path, mb: float, tokenizer_dir: str | None) -> tuple[Path, str]:
    from lit_lm.data.datamodule import stdlib_corpus
    from lit_lm.data.tokenizer import BPETokenizer

    files = stdlib_corpus(mb)
    corpus = root / "corpus.jsonl"
    with open(corpus, "w") as f:
        for p in files:
            f.write(json.dumps({"text": Path(p).read_text(encoding="utf-8", errors="replace")}) + "\n")
    if tokenizer_dir is None:
        tokenizer_dir = str(root / "tokenizer")
        BPETokenizer.train_from_files(files, 4096, num_workers=1).save_hf(tokenizer_dir)
    return corpus, tokenizer_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=4.0, help="corpus size (MB of the stdlib's source)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokenizer_dir", default=None, help="default: a 4096-token BPE trained on the corpus")
    p.add_argument("--out", default="runs/bench_prepare.json")
    p.add_argument("--one", choices=CONTENDERS, help="(internal) run one contender and print its result")
    p.add_argument("--corpus", type=Path, help="(internal) the jsonl corpus")
    args = p.parse_args()
    if args.one:
        print(MARK + json.dumps(one(args.one, args.corpus, args.tokenizer_dir)), flush=True)
        return
    with tempfile.TemporaryDirectory() as root:
        corpus, tokenizer_dir = make_inputs(Path(root), args.mb, args.tokenizer_dir)
        corpus_bytes = corpus.stat().st_size
        command = [sys.executable, __file__, "--corpus", str(corpus), "--tokenizer_dir", tokenizer_dir, "--one"]
        rounds = run_rounds({name: command + [name] for name in CONTENDERS}, args.rounds)
    table = summarize(rounds)
    write_json(args.out, rounds, table, args={k: str(v) for k, v in vars(args).items()},
               corpus_bytes=corpus_bytes)
    print(describe(machine()))
    ceiling = table["batch_encode"]["tokens_per_s_per_core"]["median"]
    print(f"{'contender':<15} {'tokens/s per core (median, min-max)':>40} {'x ceiling':>10}")
    for name in CONTENDERS:
        m = table[name]["tokens_per_s_per_core"]
        print(f"{name:<15} {m['median']:>20,.0f} ({m['min']:,.0f}-{m['max']:,.0f}) {m['median'] / ceiling:>10.2f}")


if __name__ == "__main__":
    main()
