"""A small Hugging Face model folder with a chat template, and a jsonl of conversations, for docs/finetune.md's worked
example (chat SFT with LoRA, then export): made offline, the same files every time.

    python scripts/make_sft_example.py models/tiny-chat chats.jsonl   # the folder, 1,000 conversations

- `models/tiny-chat/`: a Qwen2-shaped causal LM (d 64, 2 layers, 4 heads, 2 KV heads, untied; random weights from
  seed 0, saved by transformers) and its tokenizer: a byte-level BPE trained by the `tokenizers` library on the
  conversations, with ChatML's specials and a ChatML `chat_template` (Qwen's instruct layout: `<|im_end|>` ends every
  turn and is the EOS), saved by transformers' `PreTrainedTokenizerFast`.
- `chats.jsonl`: rows of `messages`: a user asks a sum of two numbers below 10, the assistant answers
  "a + b = c."; one row in four has a second turn ("And a + b?"). Learnable: the assistant tokens' loss falls.

The base model is random, not pre-trained: the example shows the chain (import, SFT, LoRA, export, generate), not a
useful model.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pre-tokenizer split (transformers' tokenization_qwen2.py): transformers 5 rebuilds a `qwen2` model's
# tokenizer with it whatever tokenizer.json says, so the file must say the same for both to encode alike
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
SHAPE = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
             initializer_range=0.1)


def turn(rng: random.Random, first: bool) -> list[dict[str, str]]:
    a, b = rng.randrange(10), rng.randrange(10)
    question = f"What is {a} + {b}?" if first else f"And {a} + {b}?"
    return [{"role": "user", "content": question}, {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]


def conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        messages = turn(rng, True)
        if i % 4 == 3:
            messages += turn(rng, False)
        out.append(messages)
    return out


def write_jsonl(path: Path, rows: list[list[dict[str, str]]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))


def write_tokenizer(folder: Path, rows: list[list[dict[str, str]]], vocab_size: int = 384) -> int:
    """A byte-level BPE trained on the rows' text with Qwen2's normalizer and pre-tokenizer (digits one by one),
    saved with its chat template; returns its vocabulary size."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([m["content"] for messages in rows for m in messages] + ["user", "assistant", "system"],
                            trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=TEMPLATE)
    fast.save_pretrained(folder)
    return len(fast)


def write_model(folder: Path, vocab_size: int, seed: int = 0) -> int:
    """A random Qwen2 of SHAPE saved by transformers; returns its parameter count."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(vocab_size=vocab_size, **SHAPE)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="the Hugging Face model folder to write")
    p.add_argument("jsonl", help="the conversations to write")
    p.add_argument("--conversations", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    folder, rows = Path(args.folder), conversations(args.conversations, args.seed)
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(Path(args.jsonl), rows)
    vocab = write_tokenizer(folder, rows)
    params = write_model(folder, vocab, args.seed)
    print(f"wrote {folder} (Qwen2, {params:,} parameters, vocabulary {vocab}, ChatML template) and "
          f"{args.jsonl} ({len(rows)} conversations)")


if __name__ == "__main__":
    main()
