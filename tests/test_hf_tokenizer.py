"""A `tokenizers` library tokenizer.json behind lit-lm's Tokenizer interface: the library's own ids on random unicode,
BOS/EOS read from the folder, the pretraining format, checkpoint and save round trips, a `lit-lm fit` run with it
then `lit-lm generate` and the export decoding with it, and the refusals (vocabulary, folder) in one line each."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from lit_lm.checkpoints import DATA_SETTINGS, model_state_dict, read_checkpoint, tokenizer_from
from lit_lm.config import ConfigError, ModelConfig
from lit_lm.data.datamodule import TextDataModule
from lit_lm.model import Transformer
from lit_lm.data.tokenizer import (EOT, BPETokenizer, HFTokenizer, document_ids, load_tokenizer, prompt_ids,
                              tokenizer_from_state)
from test_cli import CORPUS, run_cli, tiny_args
from test_tokenizer import RANGES

TRAIN_TEXT = [CORPUS, "naïve café — «quotes» 日本語のテキスト 한국어 🙂👍🏽 e\u0301 tabs\t\tand  spaces\n"
              * 20,
              "The quick brown fox jumps over the lazy dog; they're sure it'll rain. 12345 $9.99!\n" * 20]


def random_unicode(rng: random.Random, length: int) -> str:
    """Random code points from every range of test_tokenizer (astral planes, combining marks, whitespace, controls,
    private use...) and no special token: the library's ids and ours are then compared on the text alone."""
    return "".join(chr(rng.randint(*rng.choice(RANGES))) for _ in range(length))


def train_library_bpe(vocab_size: int = 420) -> Tokenizer:
    """A byte-level BPE trained by the `tokenizers` library itself (GPT-2's layout: no BOS, <|endoftext|>)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    return tok


@pytest.fixture(scope="module")
def library_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("library_tokenizer")
    train_library_bpe().save(str(folder / "tokenizer.json"))  # the library's own file, nothing beside it
    return folder


def llama_like(folder: Path, config: dict | None = None) -> Path:
    """The library BPE with Llama's layout: <s> and </s>, a post-processor that puts <s> before a sequence."""
    tok = train_library_bpe()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


# ---- the interface over the library ----

def test_ids_are_the_librarys_own_on_random_unicode(library_dir):
    library = Tokenizer.from_file(str(library_dir / "tokenizer.json"))
    ours = load_tokenizer(library_dir)
    assert isinstance(ours, HFTokenizer) and ours.vocab_size == library.get_vocab_size()
    rng = random.Random(27)
    texts = [random_unicode(rng, rng.randint(0, 80)) for _ in range(300)]
    expected = [library.encode(t).ids for t in texts]  # the library's default call, post-processing included
    assert [ours.encode(t) for t in texts] == expected
    assert ours.encode_batch(texts) == expected
    assert [ours.decode(ids) for ids in expected] == texts  # byte-level: every text comes back
    restored = tokenizer_from_state(json.loads(json.dumps(ours.state_dict())))  # as a checkpoint keeps it
    assert [restored.encode(t) for t in texts] == expected


def test_lit_lm_bpe_saved_for_transformers_encodes_to_its_own_ids():
    bpe = BPETokenizer.train(TRAIN_TEXT, vocab_size=450)
    rng = random.Random(5)
    texts = [random_unicode(rng, rng.randint(0, 60)) + rng.choice(["", EOT]) for _ in range(200)]
    converted = HFTokenizer(Tokenizer.from_str(json.dumps(bpe.hf_json())), None, EOT)
    assert [converted.encode(t) for t in texts] == [bpe.encode(t) for t in texts]


def test_bos_and_eos_come_from_the_folder(tmp_path, library_dir):
    gpt2_like = load_tokenizer(library_dir)  # no config: EOS by its usual name, no BOS
    assert (gpt2_like.bos_id, gpt2_like.eos_token) == (None, EOT)
    llama = load_tokenizer(llama_like(tmp_path / "llama", {"eos_token": {"content": "</s>"}}))
    s, end = llama.special_tokens["<s>"], llama.special_tokens["</s>"]
    assert (llama.bos_id, llama.eos_id) == (s, end)  # BOS from the post-processor, EOS from the config
    off = load_tokenizer(llama_like(tmp_path / "off", {"add_bos_token": False, "eos_token": "</s>"}))
    assert off.bos_id is None  # the config's add_bos_token wins over the post-processor
    text = "def main(argv):\n"
    ids = llama.encode(text)
    assert s not in ids and document_ids(llama, ids) == [s, *ids, end] and prompt_ids(llama, text) == [s, *ids]
    assert prompt_ids(llama, "") == [s] and prompt_ids(gpt2_like, "") == [gpt2_like.eos_id]
    assert document_ids(gpt2_like, [7]) == [7, gpt2_like.eos_id]


def test_save_and_checkpoint_state_round_trip_with_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    llama = load_tokenizer(llama_like(tmp_path / "llama", {"eos_token": "</s>"}))
    llama.save(tmp_path / "saved")
    again = load_tokenizer(tmp_path / "saved")
    assert again.state_dict() == llama.state_dict()
    assert tokenizer_from_state(llama.state_dict()).state_dict() == llama.state_dict()
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "saved")
    text = "naïve 🙂 code = 1\n"
    assert auto.encode(text) == prompt_ids(llama, text)  # transformers' format is lit-lm's prompt
    assert (auto.bos_token_id, auto.eos_token_id) == (llama.bos_id, llama.eos_id)
    # a folder as transformers saves a model's tokenizer: its tokenizer_config.json names the tokens
    library = Tokenizer.from_file(str(tmp_path / "llama" / "tokenizer.json"))
    transformers.LlamaTokenizerFast(tokenizer_object=library, bos_token="<s>", eos_token="</s>").save_pretrained(
        tmp_path / "transformers")
    theirs = load_tokenizer(tmp_path / "transformers")
    assert (theirs.bos_id, theirs.eos_id) == (llama.bos_id, llama.eos_id) and theirs.encode(text) == llama.encode(text)


def test_data_module_stream_is_bos_text_eos_per_document(tmp_path):
    folder = llama_like(tmp_path / "llama", {"eos_token": "</s>"})
    library = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rng = random.Random(3)
    docs = [random_unicode(rng, rng.randint(1, 40)) for _ in range(60)]
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    dm = TextDataModule(files=[str(corpus)], data_dir=str(tmp_path / "data"), seq_len=8, batch_size=2,
                        tokenizer_dir=str(folder), val_fraction=0.1, vocab_size=4096)
    dm.setup("fit")
    stream = np.concatenate([dm.train_set.tokens, dm.val_set.tokens]).tolist()
    bos, eos = library.token_to_id("<s>"), library.token_to_id("</s>")
    assert stream[0] == bos and stream[-1] == eos
    pieces, start = [], 0
    for i, t in enumerate(stream):
        if t == eos:
            pieces.append(stream[start:i + 1])
            start = i + 1
    expected = [library.encode(d).ids + [eos] for d in docs]  # the library's post-processing puts the <s>
    assert sorted(pieces) == sorted(expected)
    assert dm.state_dict()["tokenizer"] == load_tokenizer(folder).state_dict()


# ---- refusals ----

def test_a_model_vocabulary_smaller_than_the_tokenizer_is_one_line(tmp_path, library_dir):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    vocab = load_tokenizer(library_dir).vocab_size

    def setup_with_model_vocab(model_vocab: int) -> TextDataModule:
        dm = TextDataModule(files=[str(corpus)], data_dir=str(tmp_path / "data"), seq_len=8, batch_size=2,
                            tokenizer_dir=str(library_dir))
        dm.trainer = SimpleNamespace(strategy=None, lightning_module=SimpleNamespace(
            config=ModelConfig(vocab_size=model_vocab, d_model=32, n_layers=1, n_heads=4)))
        dm.setup("fit")
        return dm

    assert setup_with_model_vocab(vocab + 100).tokenizer.vocab_size == vocab  # more rows: padding, fine
    with pytest.raises(ConfigError) as refused:
        setup_with_model_vocab(vocab - 1)
    message = str(refused.value)
    assert "\n" not in message and f"has {vocab} tokens" in message and f"vocabulary is {vocab - 1}" in message
    assert "model.init_args.config.vocab_size" in message


@pytest.mark.parametrize("content", [None, '{"version": "1.0"}', "not json"])
def test_a_folder_without_a_tokenizer_is_one_line(tmp_path, content):
    if content is not None:
        (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(ConfigError, match=r"data.init_args.tokenizer_dir") as refused:
        load_tokenizer(tmp_path)
    assert "\n" not in str(refused.value)


# ---- end to end ----

def test_fit_with_a_library_tokenizer_then_generate_and_export_decode_with_it(tmp_path, library_dir):
    """`lit-lm fit --data.init_args.tokenizer_dir` (the yaml's vocab_size 300 is not the tokenizer's): the model's
    vocabulary is the tokenizer's, the checkpoint carries it, and generate and the export decode with it."""
    library = Tokenizer.from_file(str(library_dir / "tokenizer.json"))
    assert library.get_vocab_size() != 300
    fit = run_cli("fit", *tiny_args(tmp_path), "--trainer.max_steps", "3", "--trainer.val_check_interval", "3",
                  "--data.init_args.tokenizer_dir", str(library_dir), cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    last = tmp_path / "run/checkpoints/last.ckpt"
    checkpoint = read_checkpoint(last)
    assert checkpoint["hyper_parameters"]["config"]["vocab_size"] == library.get_vocab_size()
    assert checkpoint[DATA_SETTINGS]["tokenizer_dir"] == str(library_dir)
    tokenizer = tokenizer_from(checkpoint)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.state_dict()["tokenizer_json"] == library.to_str()

    prompt, n = "def main(argv):\n", 12
    out = run_cli("generate", "--ckpt_path", str(last), "--prompt", prompt, "--max_new_tokens", str(n),
                  "--temperature", "0", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    model = Transformer(ModelConfig(**checkpoint["hyper_parameters"]["config"])).eval()
    model.load_state_dict(model_state_dict(checkpoint))
    ids = library.encode(prompt).ids
    with torch.no_grad():
        for _ in range(n):
            token = int(model(torch.tensor([ids]))[0, -1, : model.config.vocab_size].argmax())
            if token == library.token_to_id(EOT):
                break
            ids.append(token)
    assert out.stdout == library.decode(ids, skip_special_tokens=False) + "\n"

    transformers = pytest.importorskip("transformers")
    from lit_lm.hf.exporter import export_hf

    export_hf(checkpoint, tmp_path / "hf")
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "naïve 🙂 x = main(argv)\n"
    assert auto.encode(text) == library.encode(text).ids and auto.decode(ids) == library.decode(ids)

    bad = run_cli("fit", *tiny_args(tmp_path), "--data.init_args.tokenizer_dir", str(tmp_path / "nowhere"),
                  cwd=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("lit-lm: error: no tokenizer in ")


def test_a_hugging_face_model_smaller_than_the_tokenizer_is_refused_in_one_line(tmp_path, library_dir):
    """`init_from` takes the model's vocabulary from its config.json: smaller than the tokenizer's, `fit` stops."""
    transformers = pytest.importorskip("transformers")
    vocab = load_tokenizer(library_dir).vocab_size
    config = transformers.LlamaConfig(vocab_size=vocab - 20, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    fit = run_cli("fit", *tiny_args(tmp_path), "--data.init_args.tokenizer_dir", str(library_dir),
                  "--model.init_args.init_from", str(tmp_path / "hf"), cwd=tmp_path)
    assert fit.returncode == 2 and "Traceback" not in fit.stderr, fit.stderr[-3000:]
    errors = [line for line in fit.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"lit-lm: error: the tokenizer has {vocab} tokens but the model's vocabulary is {vocab - 20} "
                      "(model.init_args.config.vocab_size, or init_from's config.json): it must be at least the "
                      "tokenizer's; use the model's own tokenizer (data.init_args.tokenizer_dir) or a model as large"]
