"""Tokenizing at fit start, and `lit-lm prepare`, hold one batch of text and ids, not the corpus: a 4x larger
corpus (its documents 4x longer) barely moves the resident peak. Measured in fresh processes (Linux VmHWM), with the
batch and piece sizes scaled down so that a few MB show what 200 MB shows at the real sizes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lit_lm.data.tokenizer import BPETokenizer

CHILD = r"""
import json, sys
from pathlib import Path
import lit_lm.data.corpus, lit_lm.data.token_file
from lit_lm.data.datamodule import TextDataModule

lit_lm.data.corpus.PIECE_CHARS = 1 << 14
lit_lm.data.token_file.BATCH_CHARS = 1 << 16
def status(key):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024
files, data_dir, tok = json.loads(sys.argv[1])
dm = TextDataModule(files=files, data_dir=data_dir, tokenizer_dir=tok, seq_len=16, batch_size=2)
_ = dm.given_tokenizer
Path("/proc/self/clear_refs").write_text("5")
before = status("VmRSS")
dm.prepare_data()
meta = json.loads((dm.cache_dir / "tokens.json").read_text())
out = {"growth": status("VmHWM") - before, "peak": status("VmHWM"), "tokens": meta["n_tokens"]}

import lit_lm.data.prepare
lit_lm.data.prepare.WORKER_BATCH_CHARS = 1 << 16
Path("/proc/self/clear_refs").write_text("5")
before = status("VmRSS")
index = lit_lm.data.prepare.prepare(files, tok, data_dir + "/prepared", workers=1, chunk_mb=0.0625, progress=False)
out["prepare"] = {"growth": status("VmHWM") - before, "peak": status("VmHWM"), "tokens": index["tokens"]}
print(json.dumps(out))
"""


def _words(n_lines: int, seed: int) -> str:
    import random

    rng = random.Random(seed)
    vocab = [f"w{i}x" for i in range(500)]
    return "".join(" ".join(rng.choices(vocab, k=12)) + "\n" for _ in range(n_lines))


def _prepare_peak(tmp_path: Path, name: str, scale: int, tok: Path) -> dict:
    files = []
    for i in range(2):
        f = tmp_path / name / f"doc{i}.txt"
        f.parent.mkdir(exist_ok=True)
        f.write_text(_words(2000 * scale, i))  # one document of ~0.12 MB x scale
        files.append(str(f))
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps([files, str(tmp_path / f"data_{name}"), str(tok)])],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux VmHWM reset needed")
def test_tokenizing_memory_is_flat_in_the_corpus_size(tmp_path):
    tok = tmp_path / "tok"
    BPETokenizer.train([_words(400, 9)], 300).save_hf(tok)  # a `tokenizers` tokenizer.json
    small = _prepare_peak(tmp_path, "small", 1, tok)
    large = _prepare_peak(tmp_path, "large", 4, tok)
    assert large["tokens"] > 3.9 * small["tokens"]
    # The previous path held the corpus as Python strings and one Encoding per whole document: its peak grew with
    # the corpus (here 0.75 -> 0.94 GB, checked). Streamed, the growth is one batch's, the same at both sizes.
    assert large["peak"] <= 1.10 * small["peak"], (small, large)
    assert large["growth"] <= small["growth"] + (24 << 20), (small, large)
    # `lit-lm prepare` (one worker, inline): one chunk and one batch at a time, whatever the corpus's size
    small, large = small["prepare"], large["prepare"]
    assert large["tokens"] > 3.9 * small["tokens"]
    assert large["peak"] <= 1.10 * small["peak"], (small, large)
    assert large["growth"] <= small["growth"] + (24 << 20), (small, large)
