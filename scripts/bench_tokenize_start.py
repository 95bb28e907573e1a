"""Tokenizing at `fit` start: the resident peak of the data module's first `prepare_data` (corpus -> token file) on a
corpus of N MB, measured in one process (Linux VmHWM), with the machine it ran on.

    python scripts/bench_tokenize_start.py make --mb 1024 --dir /tmp/tok1g    # the corpus and the tokenizer.json
    python scripts/bench_tokenize_start.py run --dir /tmp/tok1g --out runs/tokenize_1g.json

The corpus (issue 36 item 4): five text files (each file one document), the standard library's .py sources in a
seeded order, repeated until each file holds MB/5 MB; the tokenizer: lit-lm's 4096-token byte-level BPE trained on
4 MB of the same sources, saved as a `tokenizers` tokenizer.json (the data module loads it with `tokenizers`).
`run` imports lit-lm and Lightning (what `fit` has loaded when it tokenizes), reads VmRSS, resets VmHWM, runs
`TextDataModule.prepare_data` and `setup("fit")` and reports the peak (absolute and above that baseline), the tokens
and the time. The work is long (1 GB: ~330M tokens); on a shared machine run it in slices, stopping the process
between them (SIGSTOP/SIGCONT: resident memory and VmHWM are kept), so `seconds` is wall time including the stops
and `cpu_seconds` is the work's own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe, machine  # noqa: E402


def make(root: Path, mb: float, files: int) -> None:
    from lit_lm.data.datamodule import stdlib_corpus
    from lit_lm.data.tokenizer import BPETokenizer

    sources = stdlib_corpus(1e9)  # every file, in the seeded order
    root.mkdir(parents=True, exist_ok=True)
    rng, i = random.Random(0), 0
    for k in range(files):
        written, target = 0, int(mb * 2**20 / files)
        with open(root / f"part{k}.txt", "w", encoding="utf-8") as f:
            while written < target:
                text = Path(sources[i % len(sources)]).read_text(encoding="utf-8", errors="replace")
                i += 1
                if i % len(sources) == 0:
                    rng.shuffle(sources)  # a new order for each pass over the library
                written += f.write(text[:target - written])
    BPETokenizer.train_from_files(stdlib_corpus(4), 4096, num_workers=1).save_hf(root / "tokenizer")


def run(root: Path) -> dict:
    import lightning  # noqa: F401  (what `fit` has imported when its data module tokenizes)

    from lit_lm.data.datamodule import TextDataModule
    from lit_lm.resident import ResidentPeak, status_bytes

    files = sorted(str(p) for p in root.glob("part*.txt"))
    dm = TextDataModule(files=files, data_dir=str(root / "data"), tokenizer_dir=str(root / "tokenizer"), seq_len=128,
                        batch_size=1)
    _ = dm.given_tokenizer
    peak, start = ResidentPeak(), time.perf_counter()
    dm.prepare_data()
    dm.setup("fit")
    meta = json.loads((dm.cache_dir / "tokens.json").read_text())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"corpus_bytes": sum(Path(f).stat().st_size for f in files), "files": len(files),
            "tokens": meta["n_tokens"], "baseline_rss": peak.baseline, "peak_rss": status_bytes("VmHWM"),
            "growth": peak.above(), "seconds": time.perf_counter() - start,
            "cpu_seconds": usage.ru_utime + usage.ru_stime, "load_1min_end": os.getloadavg()[0],
            "machine": machine()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["make", "run"])
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--mb", type=float, default=200.0, help="make: the corpus's size in MB")
    p.add_argument("--files", type=int, default=5, help="make: in this many text files")
    p.add_argument("--out", default="runs/bench_tokenize_start.json")
    args = p.parse_args()
    if args.what == "make":
        make(args.dir, args.mb, args.files)
        return
    result = run(args.dir)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{result['corpus_bytes'] / 2**20:,.0f} MiB, {result['tokens']:,} tokens: "
          f"peak {result['peak_rss'] / 2**30:.2f} GiB resident ({result['growth'] / 2**30:.2f} above "
          f"{result['baseline_rss'] / 2**30:.2f}), "
          f"{result['seconds']:.0f} s ({result['cpu_seconds']:.0f} s CPU) on {describe(result['machine'])}")


if __name__ == "__main__":
    main()
