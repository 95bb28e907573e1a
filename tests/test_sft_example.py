"""docs/finetune.md's worked example starts from scripts/make_sft_example.py's folder and jsonl: the same files every
time, a folder lit-lm imports with transformers' logits, and a tokenizer that lit-lm's chat rendering and
transformers' `apply_chat_template` encode alike (transformers 5 rebuilds a `qwen2` folder's tokenizer with Qwen2's
own pre-tokenizer, so the file must carry it). The chain itself (fit with LoRA, export, generate) is tested piecewise:
tests/test_chat.py (SFT through the command, generate --chat), tests/test_lora.py (export, PEFT, generate's load)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_lm.data.chat import ChatEncoder
from lit_lm.data.tokenizer import load_tokenizer
from lit_lm.module import LanguageModel

ROOT = Path(__file__).resolve().parents[1]


def make(folder: Path) -> tuple[Path, Path]:
    out = subprocess.run([sys.executable, str(ROOT / "scripts/make_sft_example.py"), str(folder / "model"),
                          str(folder / "chats.jsonl"), "--conversations", "60"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return folder / "model", folder / "chats.jsonl"


def test_the_example_folder_is_repeatable_and_lit_lm_reads_it_as_transformers_does(tmp_path):
    transformers = pytest.importorskip("transformers")
    model_dir, rows = make(tmp_path / "a")
    again, rows_again = make(tmp_path / "b")
    assert rows.read_bytes() == rows_again.read_bytes()
    for name in ("model.safetensors", "tokenizer.json"):
        assert (model_dir / name).read_bytes() == (again / name).read_bytes(), name
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    encoder = ChatEncoder(load_tokenizer(model_dir), "test")
    conversations = [json.loads(line) for line in rows.read_text().splitlines()]
    assert len(conversations) == 60 and any(len(c["messages"]) == 4 for c in conversations)
    for row in conversations:
        user, answer = row["messages"][0]["content"], row["messages"][1]["content"]
        a, b = (int(x) for x in user.removeprefix("What is ").removesuffix("?").split(" + "))
        assert answer == f"{a} + {b} = {a + b}."
        want = theirs.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"]
        assert list(encoder.encode(row)[0]) == list(want), row
    imported = LanguageModel(init_from=str(model_dir))
    imported.configure_model()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([want])
    with torch.no_grad():
        torch.testing.assert_close(imported.model(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)
