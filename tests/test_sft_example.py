"""docs/finetune.md's worked example starts from scripts/make_sft_example.py's folder and jsonl: the same files every
time, a folder lit-lm imports with transformers' logits, and a tokenizer that lit-lm's chat rendering and
transformers' `apply_chat_template` encode alike (transformers 5 rebuilds a `qwen2` folder's tokenizer with Qwen2's
own pre-tokenizer, so the file must carry it); and the worked example's chain, shortened: fit from the folder with
chat data and LoRA, export merged and as PEFT's adapter, both computing in transformers / peft what `lit-lm generate`
loads from the checkpoint."""

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


def make(folder: Path, conversations: int = 60) -> tuple[Path, Path]:
    out = subprocess.run([sys.executable, str(ROOT / "scripts/make_sft_example.py"), str(folder / "model"),
                          str(folder / "chats.jsonl"), "--conversations", str(conversations)], capture_output=True,
                         text=True)
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


def test_the_worked_example_from_the_folder_to_its_exports(tmp_path):
    """docs/finetune.md's commands with fewer conversations and steps: the merged export and PEFT's adapter on the
    `init_from` folder give the logits of the checkpoint as `lit-lm generate` loads it (adapters folded in), which the
    training moved off the base model's; the merged folder renders the chat prompt as lit-lm does."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from test_cli import run_cli, run_script

    from lit_lm.data.chat import chat_prompt_ids
    from lit_lm.generate import load

    model_dir, rows = make(tmp_path, conversations=200)
    fit = run_cli("fit", "--config", str(ROOT / "configs/default.yaml"), "--trainer.default_root_dir",
                  str(tmp_path / "run"), "--model.init_args.init_from", str(model_dir),
                  "--data.init_args.tokenizer_dir", str(model_dir), "--data.init_args.format", "chat",
                  "--data.init_args.files", f"[{rows}]", "--data.init_args.data_dir", str(tmp_path / "data"),
                  "--model.init_args.lora", "{rank: 4, alpha: 8, targets: [q, k, v, o, gate, up, down]}",
                  "--data.init_args.seq_len", "64", "--data.init_args.batch_size", "4",
                  "--data.init_args.val_fraction", "0.1", "--trainer.max_steps", "4",
                  "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1", cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    last = tmp_path / "run/checkpoints/last.ckpt"
    for args in (("--merge-lora", last, tmp_path / "merged"), (last, tmp_path / "adapter")):
        export = run_script("scripts/ckpt.py", "export-hf", *args, cwd=tmp_path)
        assert export.returncode == 0, export.stderr[-3000:]
    model, tokenizer = load(str(last))
    ids = chat_prompt_ids(tokenizer, "What is 3 + 4?")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert theirs.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], tokenize=True,
                                      add_generation_prompt=True, return_dict=True)["input_ids"] == ids
    x = torch.tensor([ids])
    with torch.no_grad():
        expected = model(x)
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
        assert (base(x).logits - expected).abs().max() > 1e-3  # the adapters trained
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(merged(x).logits, expected, rtol=0, atol=1e-4)
        config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(model_dir)
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        torch.testing.assert_close(adapted(x).logits, expected, rtol=0, atol=1e-4)
