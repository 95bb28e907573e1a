"""Chat data and loss masks (lit_lm/data/chat.py, lit_lm/data/loss_mask.py; docs/finetune.md): the chat template
rendered as transformers' `apply_chat_template` renders it, token for token; the assistant's tokens found; a
template-less tokenizer refused in one line; masked tokens contribute exactly nothing; the loss normalised per target
of the whole global batch (accumulation x dp ranks), under lm_ddp, zero3 and tp2 equal to one process, the
per-micro-batch mutant caught; under cp2 x dp2 with packed documents too (a cp rank's share without any target adds
exactly nothing; the per-cp-rank mutant caught); chat rows through `lit-lm prepare`, a mixture, fit and resume;
packing: false."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from test_hf_tokenizer import train_library_bpe

from lit_lm.checkpoints import read_checkpoint, tokenizer_from
from lit_lm.config import ConfigError, ModelConfig
from lit_lm.data import loss_mask
from lit_lm.data.chat import ChatEncoder, ChatTemplate, chat_prompt_ids, encode_messages
from lit_lm.data.datamodule import TextDataModule
from lit_lm.data.loss_mask import ASSISTANT, LAST, START, encode_row
from lit_lm.data.packing import Packing
from lit_lm.data.prepare import PreparedSource, prepare
from lit_lm.data.tokenizer import load_tokenizer
from lit_lm.module import LanguageModel
from lit_lm.parity import TINY, Case, assert_parity, case_tokens, fit_case, run_parity
from lit_lm.strategies.composed import ComposedStrategy
from lit_lm.strategies.tp import TensorParallelStrategy
from lit_lm.strategies.zero import ZeroStrategy

# ChatML with a BOS, a default system turn, a role check and a loop control: what transformers' renderer must do
TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are terse.<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<s>", "<|im_start|>", "<|im_end|>"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."},
     {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": " Six, it's 6.  "}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "naïve café?"},
     {"role": "assistant", "content": "Oui — «café» 🙂"}],
    [{"role": "user", "content": "def main(argv):\n    return 0\n"}, {"role": "assistant", "content": "ok\n\nok"}],
]


def chat_folder(folder: Path, template: str | None = TEMPLATE) -> Path:
    """A `tokenizers` BPE with ChatML's specials; EOS is `<|im_end|>` (it ends every turn, as Qwen's instruct
    tokenizers do: so conversations cannot be told apart by EOS)."""
    tok = train_library_bpe()
    tok.add_special_tokens(SPECIALS)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>",
              "add_bos_token": False, "pad_token": "<|endoftext|>"}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return chat_folder(tmp_path_factory.mktemp("chat_tokenizer"))


# -- rendering and masks ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_the_rendering_is_transformers_apply_chat_template_token_for_token(tok_dir, generation_prompt):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    tokenizer = load_tokenizer(tok_dir)
    template = ChatTemplate(tokenizer.chat["template"], tokenizer.chat["tokens"])
    for messages in CONVERSATIONS:
        text = template.render(messages, add_generation_prompt=generation_prompt)
        want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert text == want
        ids = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert tokenizer.encode(text) == list(ids)
        if not generation_prompt:
            assert encode_messages(tokenizer, template, messages)[0] == list(ids)
    if generation_prompt:  # `lit-lm generate --chat`'s prompt
        message = [{"role": "user", "content": "repeat beta"}]
        ids = theirs.apply_chat_template(message, tokenize=True, add_generation_prompt=True)
        assert chat_prompt_ids(tokenizer, "repeat beta") == list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_the_assistant_tokens_are_its_messages_and_end_of_turn(tok_dir):
    tokenizer = load_tokenizer(tok_dir)
    encoder = ChatEncoder(tokenizer, "test")
    for messages in CONVERSATIONS:
        ids, flags = encoder.encode({"messages": messages})
        ids = np.asarray(ids)
        answers = [m["content"].strip() + "<|im_end|>\n" for m in messages if m["role"] == "assistant"]
        assert tokenizer.decode(ids[(flags & ASSISTANT) != 0]) == "".join(answers)
        assert tokenizer.decode(ids[(flags & LAST) != 0]) == answers[-1]
        assert flags[0] & START and not (flags[1:] & START).any()
    ids, flags = encoder.encode({"prompt": "Say hi.", "completion": " hi"})
    assert tokenizer.decode(np.asarray(ids)[flags == ASSISTANT | LAST]) == " hi<|im_end|>"


def test_a_tokenizer_without_a_template_is_refused_in_one_line(tmp_path):
    tokenizer = load_tokenizer(chat_folder(tmp_path / "plain", template=None))
    with pytest.raises(ConfigError, match="no chat_template") as e:
        ChatEncoder(tokenizer, "data.init_args.files").encode({"messages": CONVERSATIONS[0]})
    assert "\n" not in str(e.value)
    ChatEncoder(tokenizer, "x").encode({"prompt": "a", "completion": "b"})  # pairs need no template
    with pytest.raises(ConfigError, match="neither `messages` nor `prompt`"):
        ChatEncoder(tokenizer, "x").encode({"text": "a"})
    no_eos = SimpleNamespace(bos_id=None, eos_id=None, encode=lambda text: [1] * len(text))
    with pytest.raises(ConfigError, match=r"^prompt/completion rows of x end with the tokenizer's EOS token .* has "
                                          r"none: use one whose tokenizer_config\.json names an eos_token$"):
        ChatEncoder(no_eos, "x").encode({"prompt": "a", "completion": "b"})


def test_train_on_picks_the_targets_and_padding_is_never_one():
    ids = np.arange(10, 16)
    flags = np.array([START, 0, ASSISTANT, ASSISTANT, ASSISTANT | LAST, ASSISTANT | LAST], np.uint8)
    for train_on, trained in (("all", [1] * 6), ("assistant", [0, 0, 1, 1, 1, 1]), ("last", [0, 0, 0, 0, 1, 1])):
        row = encode_row(ids, flags, train_on, pad_to=8, pad_id=3)
        inputs, targets, starts = loss_mask.decode(row[None])
        assert inputs[0].tolist() == [10, 11, 12, 13, 14, 15, 3]
        assert targets[0].tolist() == [t if k else -100 for t, k in zip([11, 12, 13, 14, 15], trained[1:])] + [-100] * 2
        assert starts[0].tolist() == [True] + [False] * 6


# -- masked tokens contribute exactly nothing ---------------------------------------------------------------------
def _grads(module: LanguageModel, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    module.zero_grad()
    x, y, starts = module._split(rows, 1)
    loss, _ = module.step_loss(x, y, starts)
    loss.backward()
    return {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("masked_documents", [True, False])
def test_a_masked_conversation_changes_no_gradient(masked_documents):
    """A packed row: conversation A (no target) then B. A's tokens replaced: every gradient bit for bit the same
    under the conversation mask; without it (the mutant: attention across conversations) they move."""
    torch.manual_seed(0)
    module = LanguageModel(ModelConfig(**TINY))
    module.configure_model()
    module.loss_masks = True
    module.packing = Packing(eos_id=1, starts=True) if masked_documents else None
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randint(2, 64, (2, 7), generator=gen), torch.randint(2, 64, (2, 10), generator=gen)
    flags_a = np.zeros(7, np.uint8)
    flags_a[0] = START
    flags_b = np.full(10, ASSISTANT, np.uint8)
    flags_b[:3] = START, 0, 0  # B's prompt

    def rows(first: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.cat([encode_row(first[i].numpy(), flags_a, "assistant"),
                                       encode_row(b[i].numpy(), flags_b, "assistant")]) for i in range(2)])

    other = torch.randint(2, 64, (2, 7), generator=gen)
    grads = [_grads(module, rows(first)) for first in (a, other)]
    assert any(g.abs().sum() > 0 for g in grads[0].values())
    same = all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    assert same == masked_documents


# -- per-token normalisation across accumulation and ranks --------------------------------------------------------
MASKED = 3  # every target whose id is a multiple of 3 is not trained on: rows hold different numbers of targets


def per_micro_batch(monkeypatch) -> None:
    """The mutant: each micro-batch's own mean, as without loss masks (per micro-batch and per rank)."""
    monkeypatch.setattr(LanguageModel, "per_token", lambda self, loss, targets, batch_idx: loss)


ACCUMULATE = {"accumulate_grad_batches": 2}
CASES = {
    "lm_ddp": Case(partial(ComposedStrategy), loss_mask=MASKED, trainer=ACCUMULATE, label="lm_ddp, accumulate 2"),
    "zero3": Case(partial(ZeroStrategy, stage=3), loss_mask=MASKED, trainer=ACCUMULATE, optimizer="adamw",
                  label="zero3, accumulate 2"),
    "tp2": Case(partial(TensorParallelStrategy, tensor_parallel_size=2), loss_mask=MASKED, packing=(1, False),
                label="tp2 (vocab-parallel loss), packed"),
    "mutant": Case(partial(ComposedStrategy), loss_mask=MASKED, trainer=ACCUMULATE, mutation=per_micro_batch,
                   label="lm_ddp, per-micro-batch mutant"),
}


def test_the_loss_is_per_target_of_the_global_batch_under_lm_ddp_zero3_tp():
    runs = {run["case"].label: run for run in run_parity(list(CASES.values()), world_size=2)}
    for key in ("lm_ddp", "zero3", "tp2"):
        assert_parity(runs[CASES[key].label])
    with pytest.raises(AssertionError):
        assert_parity(runs[CASES["mutant"].label])


def per_cp_rank(monkeypatch) -> None:
    """The mutant: each cp rank's loss its own share's mean (weight 1), not its share of the sequence's targets."""
    from lit_lm.strategies import cp

    def unweighted(*args, **kwargs):
        share, targets, positions, weight = split_batch(*args, **kwargs)
        return share, targets, positions, torch.ones_like(weight)

    split_batch = cp.split_batch
    monkeypatch.setattr(cp, "split_batch", unweighted)


# T = 16 under cp2: rank 0 holds positions 0-3 and 12-15, rank 1 positions 4-11, so targets at 12-15 only leave rank 1
# none (its tokens still reach them as keys and values of their documents)
CP = partial(ComposedStrategy, context_parallel_size=2)
SFT = dict(loss_mask=MASKED, packing=(1, False), trainer=ACCUMULATE, steps=2)
CP_CASES = {
    "empty": Case(CP, loss_span=(12, 16), label="cp2 x dp2 ring, packed, accumulate 2, cp rank 1 without a target",
                  **SFT),
    "unequal": Case(partial(CP, cp_method="allgather"), label="cp2 x dp2 allgather, packed, accumulate 2", **SFT),
    "mutant": Case(partial(CP, cp_method="allgather"), mutation=per_cp_rank, label="cp2 x dp2, per-cp-rank mutant",
                   **SFT),
}


def test_the_loss_is_per_target_of_the_global_batch_under_cp_with_packed_documents():
    """Context parallelism x dp x accumulation against one process: each cp rank's share weighed by the targets it
    holds, a share without any target contributing exactly nothing (no 0/0 mean); per-rank means are caught."""
    tokens = case_tokens(CP_CASES["empty"])
    assert loss_mask.targets_of(tokens[:, :13]) == 0 < loss_mask.targets_of(tokens)  # positions 0-11: no target
    runs = {run["case"].label: run for run in run_parity(list(CP_CASES.values()), world_size=4)}
    for key in ("empty", "unequal"):
        assert_parity(runs[CP_CASES[key].label])
    with pytest.raises(AssertionError):
        assert_parity(runs[CP_CASES["mutant"].label])


def test_accumulation_equals_one_batch_of_the_whole_step():
    """One process: 2 accumulated micro-batches of 4 rows = 1 batch of the same 8 rows (the one-process reference
    itself is per target of the step, not per micro-batch), with unequal targets per micro-batch."""
    accumulated = Case(loss_mask=MASKED, trainer=ACCUMULATE, global_batch=4, steps=2)
    whole = Case(loss_mask=MASKED, global_batch=8, steps=2)
    assert torch.equal(case_tokens(accumulated), case_tokens(whole))
    counts = [loss_mask.targets_of(case_tokens(accumulated)[i:i + 4]) for i in (0, 4)]
    assert counts[0] != counts[1]
    a, w = fit_case(accumulated), fit_case(whole)
    for sa, sw in zip(a["steps"], w["steps"]):
        for (name, _, _, ga), (_, _, _, gw) in zip(sa["grads"], sw["grads"]):
            torch.testing.assert_close(ga, gw, rtol=1e-5, atol=1e-7, msg=name)


# -- chat rows through prepare, a mixture, fit and resume; one conversation per row ------------------------------
WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "theta", "kappa", "lambda", "sigma"]


def write_conversations(path: Path, n: int, seed: int = 0) -> Path:
    """`n` rows: a user asks to repeat a word, the assistant repeats it twice (learnable: the answer's loss falls);
    every third row a prompt/completion pair."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            word = WORDS[rng.integers(len(WORDS))]
            if i % 3 == 2:
                row = {"prompt": f"repeat {word}:", "completion": f" {word} {word}"}
            else:
                row = {"messages": [{"role": "user", "content": f"repeat {word}"},
                                    {"role": "assistant", "content": f"{word} {word}"}]}
            f.write(json.dumps(row) + "\n")
    return path


def fit_steps(data: TextDataModule, vocab: int, steps: int, ckpt: str | None = None, save: str | None = None
              ) -> dict[str, torch.Tensor]:
    L.seed_everything(0, verbose=False)
    module = LanguageModel(ModelConfig(**dict(TINY, vocab_size=vocab, max_seq_len=32)), warmup_steps=1,
                           schedule_steps=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        accumulate_grad_batches=2)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt)
    if save:
        trainer.save_checkpoint(save)
    assert module.loss_masks and module.packing is not None and module.packing.starts
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_chat_rows_through_prepare_a_mixture_fit_and_resume(tmp_path, tok_dir):
    rows = write_conversations(tmp_path / "chat.jsonl", 120)
    prepare([str(rows)], str(tok_dir), str(tmp_path / "chat"), chunk_mb=0.002, val_fraction=0.1, progress=False,
            format="chat")
    (tmp_path / "plain.txt").write_text("plain text about alpha and beta.\n" * 200)
    prepare([str(tmp_path / "plain.txt")], str(tok_dir), str(tmp_path / "plain"), progress=False)
    source = PreparedSource(tmp_path / "chat")
    assert source.flagged and not PreparedSource(tmp_path / "plain").flagged
    assert len(source.index["shards"]) > 1
    tokenizer = load_tokenizer(tok_dir)
    encoder = ChatEncoder(tokenizer, "test")
    encoded = [encoder.encode(json.loads(line)) for line in rows.read_text().splitlines()]
    train = sum(len(p) for p in source.parts("train"))
    all_ids = np.concatenate([np.fromfile(tmp_path / "chat/shards" / s["file"], source.dtype)
                              for s in source.index["shards"]])
    all_flags = np.concatenate([np.fromfile(tmp_path / "chat/shards" / s["file"].replace(".bin", ".flags"), np.uint8)
                                for s in source.index["shards"]])
    assert all_ids.tolist() == [i for e in encoded for i in e[0]] and train < len(all_ids)
    assert np.array_equal(all_flags, np.concatenate([e[1] for e in encoded]))

    def data() -> TextDataModule:
        return TextDataModule(sources=[{"path": str(tmp_path / "chat"), "weight": 3},
                                       {"path": str(tmp_path / "plain"), "weight": 1}],
                              seq_len=32, batch_size=2, data_dir=str(tmp_path / "data"))

    whole = fit_steps(data(), tokenizer.vocab_size, 4)
    fit_steps(data(), tokenizer.vocab_size, 2, save=str(tmp_path / "half.ckpt"))
    resumed = fit_steps(data(), tokenizer.vocab_size, 4, ckpt=str(tmp_path / "half.ckpt"))
    for name in whole:
        assert torch.equal(whole[name], resumed[name]), name


def test_one_conversation_per_row_from_files(tmp_path, tok_dir):
    """`packed: false` (tokenize-at-start path): each row is one conversation from its first token, padded, the
    padding never a target; `train_on: last` keeps the last answer only."""
    rows = write_conversations(tmp_path / "chat.jsonl", 40)
    data = TextDataModule(files=[str(rows)], format="chat", tokenizer_dir=str(tok_dir), packed=False,
                          train_on="last", seq_len=128, batch_size=2, val_fraction=0.2, data_dir=str(tmp_path / "d"))
    data.setup("fit")
    tokenizer = data.tokenizer
    assert data.flagged and data.packing() is None
    for i in range(len(data.train_set)):
        row = data.train_set[i]
        inputs, targets, starts = loss_mask.decode(row[None])
        assert starts[0, 0] and not starts[0, 1:].any()
        kept = targets[targets != -100].tolist()
        text = tokenizer.decode(inputs[0].tolist())
        assert text.startswith("<s><|im_start|>system") or text.startswith("repeat")
        answer = tokenizer.decode(kept)
        assert "<|im_end|>" in answer and "repeat" not in answer and "system" not in answer
        assert inputs[0, -1] == tokenizer.eos_id and targets[0, -1] == -100  # padded with EOS, not a target
    assert data.step_targets(0, 4) == sum(loss_mask.targets_of(data.train_set[i]) for i in
                                          __import__("lit_lm.data.sampler", fromlist=["x"]).ResumableSampler(
                                              len(data.train_set), 1, seed=data.seed).indices(0, 4))
    with pytest.raises(ConfigError, match="tokenizer_dir"):
        TextDataModule(files=[str(rows)], format="chat")
    with pytest.raises(ConfigError, match="train_on"):
        TextDataModule(files=[str(rows)], format="chat", tokenizer_dir=str(tok_dir), train_on="user")


# -- through the command: a tiny SFT run whose assistant-token loss falls ------------------------------------------
def test_a_tiny_sft_run_through_the_command_lowers_the_assistant_loss(tmp_path, tok_dir):
    from test_cli import read_metrics, run_cli, tiny_args

    rows = write_conversations(tmp_path / "chat.jsonl", 400)
    fit = run_cli("fit", *tiny_args(tmp_path), "--data.init_args.files", f"[{rows}]",
                  "--data.init_args.format", "chat", "--data.init_args.tokenizer_dir", str(tok_dir),
                  "--data.init_args.seq_len", "32", "--model.init_args.lr", "1e-2", "--trainer.max_steps", "40",
                  "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "4", cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    val = [float(r["val_loss"]) for r in read_metrics(tmp_path / "run", 0) if r.get("val_loss")]
    assert len(val) == 20 and val[-1] < 0.6 * val[0], val
    # `generate --chat`: the checkpoint's tokenizer keeps the template; the message is rendered as a user turn
    last = tmp_path / "run/checkpoints/last.ckpt"
    assert tokenizer_from(read_checkpoint(last)).chat == load_tokenizer(tok_dir).chat
    out = run_cli("generate", "--ckpt_path", str(last), "--chat", "repeat gamma", "--max_new_tokens", "12",
                  "--temperature", "0", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("repeat gamma\n"), out.stderr[-2000:]


def test_loss_masks_under_a_pipeline_are_refused_in_one_line():
    from types import SimpleNamespace

    module = LanguageModel(ModelConfig(**TINY))
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(flagged=True, packing=lambda: None),
                                      strategy=SimpleNamespace(layout=SimpleNamespace(pp_size=2)))
    with pytest.raises(ConfigError, match="pipeline parallelism") as e:
        module.setup("fit")
    assert "\n" not in str(e.value)
    module._trainer.strategy.layout.pp_size = 1
    module.setup("fit")
    assert module.loss_masks
