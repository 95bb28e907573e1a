"""Text out of a trained model: `lit-lm generate` streams continuations of prompts from any checkpoint.

    lit-lm generate --ckpt_path runs/default/checkpoints/last.ckpt --prompt "def main(" --max_new_tokens 64
    lit-lm generate --ckpt_path runs/sft/checkpoints/last.ckpt --chat "What is 2 + 2?"   # the chat template's

One process reads a checkpoint of any strategy and world size (a single file or a sharded directory, gathered
whole), rebuilds the model from the hyper-parameters stored in it and decodes with the tokenizer stored in it.
Decoding keeps a KV cache, so each new token costs one position's forward.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor

from lit_lm.checkpoints import model_state_dict, read_checkpoint, tokenizer_from
from lit_lm.config import ConfigError, ModelConfig
from lit_lm.model import KVCache, Transformer
from lit_lm.data.chat import chat_prompt_ids
from lit_lm.lora import lora_from, merge_adapters
from lit_lm.data.tokenizer import Tokenizer, prompt_ids


def sample_next(logits: Tensor, temperature: float = 1.0, top_k: Optional[int] = None, top_p: float = 1.0,
                generator: Optional[torch.Generator] = None) -> Tensor:
    """(B, V) logits -> (B, 1) token ids: greedy when temperature == 0, else sampled from the top_k most likely
    tokens, then from the smallest prefix of them whose probability reaches top_p (nucleus)."""
    if temperature == 0.0:
        return logits.argmax(-1, keepdim=True)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p
    if top_k is not None:
        keep[:, top_k:] = False
    sorted_p = sorted_p * keep
    choice = torch.multinomial(sorted_p / sorted_p.sum(-1, keepdim=True), 1, generator=generator)
    return order.gather(-1, choice)


@torch.no_grad()
def stream(model: Transformer, idx: Tensor, max_new_tokens: int, temperature: float = 1.0,
           top_k: Optional[int] = None, top_p: float = 1.0, generator: Optional[torch.Generator] = None,
           vocab_size: Optional[int] = None) -> Iterator[Tensor]:
    """Yield (B, 1) new token ids one step at a time after the prompt idx (B, T); padded vocabulary rows are
    never chosen, nor (`vocab_size`: the tokenizer's) rows past the tokenizer's last id, which an imported model
    may have (Qwen2: 151,936 rows for 151,665 ids) and nothing could decode. The prompt is run once, then each
    step runs only the new position against the KV cache."""
    cache = [KVCache() for _ in model.blocks]
    step_input = idx
    rows = min(model.config.vocab_size, vocab_size or model.config.vocab_size)
    for _ in range(max_new_tokens):
        logits = model(step_input, cache=cache)[:, -1, :rows]
        step_input = sample_next(logits, temperature, top_k, top_p, generator)
        yield step_input


def generate(model: Transformer, idx: Tensor, max_new_tokens: int, **sampling: Any) -> Tensor:
    """idx (B, T) followed by max_new_tokens sampled ids: (B, T + max_new_tokens)."""
    return torch.cat([idx, *stream(model, idx, max_new_tokens, **sampling)], dim=1)


def load(ckpt_path: str, device: str = "cpu") -> tuple[Transformer, Tokenizer]:
    """The model and tokenizer of a checkpoint of any strategy, on one process."""
    checkpoint = read_checkpoint(ckpt_path)
    hparams = checkpoint.get("hyper_parameters", {})
    if "config" not in hparams:
        raise ConfigError(f"{ckpt_path} was not written by lit-lm's LanguageModel (no hyper_parameters.config) "
                          "(--ckpt_path); give a checkpoint of a lit-lm run")
    model = Transformer(ModelConfig(**hparams["config"]))
    state, lora = model_state_dict(checkpoint), lora_from(hparams.get("lora"))
    if lora is not None:  # a LoRA run: each adapter folded into its base weight, what the adapted model computes
        state = merge_adapters(state, lora)
    model.load_state_dict(state)
    return model.to(device).eval(), tokenizer_from(checkpoint)


def _prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts_file is None:
        return args.prompt or [""]
    path = Path(args.prompts_file)
    if not path.is_file():
        raise ConfigError(f"prompts file {path} does not exist (--prompts_file); give a text file with one prompt "
                          "per line")
    return [line.rstrip("\n").replace("\\n", "\n") for line in path.read_text().splitlines() if line.strip()]


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="lit-lm generate", description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt_path", required=True, help="a .ckpt file or sharded checkpoint directory")
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for more); default: empty")
    parser.add_argument("--prompts_file", help="a text file with one prompt per line (\\n for a newline)")
    parser.add_argument("--chat", action="append", help="a user message, rendered with the checkpoint's tokenizer's "
                        "chat template and answered (repeat for more; instead of --prompt)")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 0 or args.temperature < 0 or not 0 < args.top_p <= 1 or (args.top_k or 1) < 1:
        raise ConfigError("need --max_new_tokens >= 0, --temperature >= 0, 0 < --top_p <= 1 and --top_k >= 1 "
                          f"(got {args.max_new_tokens}, {args.temperature}, {args.top_p}, {args.top_k}); fix them")
    if args.chat and (args.prompt or args.prompts_file):
        raise ConfigError("give --chat messages or --prompt/--prompts_file, not both")
    prompts = args.chat or _prompts(args)
    model, tokenizer = load(args.ckpt_path, args.device)
    generator = torch.Generator(args.device).manual_seed(args.seed)
    for n, prompt in enumerate(prompts):
        # as a document begins in training ([BOS] + text), or a conversation (the chat template's)
        ids = chat_prompt_ids(tokenizer, prompt) if args.chat else prompt_ids(tokenizer, prompt)
        sys.stdout.write(("\n\n" if n else "") + prompt + ("\n" if args.chat else ""))
        text = tokenizer.stream(ids)  # a token may end inside a character
        for token in stream(model, torch.tensor([ids], device=args.device), args.max_new_tokens, args.temperature,
                            args.top_k, args.top_p, generator, vocab_size=tokenizer.vocab_size):
            if int(token) == tokenizer.eos_id:
                break
            sys.stdout.write(text.step(int(token)))
            sys.stdout.flush()
        sys.stdout.write(text.end() + "\n")
    sys.stdout.flush()


class GenerationWriter(BasePredictionWriter):
    """`lit-lm predict`: write each prompt and the model's continuation as one json line to `path` (one file per
    rank when there are several); the data module holds the tokenizer."""

    def __init__(self, path: Path) -> None:
        super().__init__(write_interval="batch")
        self.path = Path(path)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.world_size > 1:
            self.path = self.path.with_name(f"{self.path.stem}.rank{trainer.global_rank}{self.path.suffix}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")

    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: dict[str, Tensor], batch_indices: Any,
                           batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        decode = trainer.datamodule.tokenizer.decode
        with self.path.open("a") as f:
            for prompt, completion in zip(prediction["prompt"].tolist(), prediction["completion"].tolist()):
                f.write(json.dumps({"prompt": decode(prompt), "completion": decode(completion)}) + "\n")

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        print(f"[lit-lm] predictions: {self.path}")
