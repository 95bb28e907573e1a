"""Hugging Face models in (`lit_lm.hf.importer`, `LanguageModel(init_from=...)`): tiny random Llama, Mistral and Qwen2
models made with `transformers` in a temporary folder (no network).

- logits equal transformers' (fp32, 1e-5) per family and feature: Llama 3 rope scaling, Mistral's sliding window
  shorter than the sequence, Qwen2's q/k/v biases, tied and untied embeddings, GQA; each feature also shown to
  matter (the model without it is off by far more);
- the same import under zero3 x 2, tp2 and pp2 gives the one-process first-step loss and gradients (parity harness);
- under zero3 x 4 each rank reads a quarter of the weights' bytes from the files, and the ranks together exactly
  the whole once (no rank reads the whole model);
- a config lit-lm cannot express is refused in one line naming the field.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch

transformers = pytest.importorskip("transformers")

from lit_lm.config import ConfigError, ModelConfig  # noqa: E402
from lit_lm.hf.importer import INDEX, HFWeights, load_model, model_config  # noqa: E402
from lit_lm.module import LanguageModel  # noqa: E402
from lit_lm.parity import TINY, Case, _fit_cases, assert_parity, run_parity  # noqa: E402
from lit_lm.resident import ResidentPeak, reset_peak  # noqa: E402
from lit_lm.spawn import run_distributed  # noqa: E402
from lit_lm.strategies.pp import PipelineStrategy  # noqa: E402
from lit_lm.strategies.tp import TensorParallelStrategy  # noqa: E402
from lit_lm.strategies.zero import ZeroStrategy  # noqa: E402

SHAPE = dict(vocab_size=TINY["vocab_size"], hidden_size=TINY["d_model"], intermediate_size=48,
             num_hidden_layers=TINY["n_layers"], num_attention_heads=TINY["n_heads"],
             num_key_value_heads=TINY["n_kv_heads"], initializer_range=0.1)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}
FAMILIES = {
    "llama3 rope scaling": lambda: transformers.LlamaConfig(**SHAPE, rope_scaling=LLAMA3_ROPE, rope_theta=5e5),
    "llama tied": lambda: transformers.LlamaConfig(**SHAPE, tie_word_embeddings=True),
    "mistral window 5": lambda: transformers.MistralConfig(**SHAPE, sliding_window=5),
    "qwen2 qkv bias": lambda: transformers.Qwen2Config(**SHAPE),
    "qwen2 tied": lambda: transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True),
}


def save_hf(folder: Path, config, seed: int = 0):
    """A random transformers model saved in `folder`; biases random too (transformers starts them at 0)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # not 0 / 1: a swapped or skipped one shows
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.2)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for i, (name, make) in enumerate(FAMILIES.items()):
        folder = tmp_path_factory.mktemp(name.replace(" ", "_"))
        save_hf(folder, make(), seed=i)
        out[name] = folder
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_equal_transformers(hf_dirs, family):
    folder = hf_dirs[family]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_model(folder)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = theirs(ids).logits, ours(ids)
    assert got.shape == expected.shape  # no padded vocabulary rows: the loss is transformers' too
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    cfg = ours.config
    # the feature under test is on, and without it the logits are far off (so the comparison above needed it)
    feature = {"llama3 rope scaling": ("rope_scaling", None), "mistral window 5": ("sliding_window", None),
               "qwen2 qkv bias": ("qkv_bias", False)}.get(family)
    if family.endswith("tied"):
        assert cfg.tie_embeddings and ours.lm_head.weight is ours.tok_embeddings.weight
    if feature is not None:
        name, off = feature
        assert getattr(cfg, name) not in (None, False)
        without = load_model(folder)
        if name == "qkv_bias":
            for block in without.blocks.values():
                for lin in (block.attn.wq, block.attn.wk, block.attn.wv):
                    lin.bias = None
        else:
            for block in without.blocks.values():
                if name == "rope_scaling":
                    block.attn.rope.inv_freq = type(block.attn.rope)(cfg.head_dim, cfg.rope_theta).inv_freq
                else:
                    block.attn.core.sliding_window = block.attn.sliding_window = off
        with torch.no_grad():
            assert (without(ids) - expected).abs().max() > 1e-3


def test_kernels_keep_rope_scaling_and_window(hf_dirs):
    """The kernel drop-ins (rope, attention) take the reference's scaled frequencies and window."""
    from lit_lm import kernels
    for family in ("llama3 rope scaling", "mistral window 5"):
        ours = load_model(hf_dirs[family])
        ids = torch.randint(0, SHAPE["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            expected = ours(ids)
            kernels.apply(ours, ["rope", "attention"], backend="reference")
            assert type(ours.blocks["0"].attn.rope).__module__ == "lit_lm.kernels.rope"
            torch.testing.assert_close(ours(ids), expected, rtol=1e-5, atol=1e-5)


def test_config_fields(hf_dirs):
    cfg = model_config(hf_dirs["llama3 rope scaling"], ModelConfig(d_model=192, max_seq_len=48, z_loss=1e-4))
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.vocab_size) == (32, 4, 2, 48, 64)
    assert cfg.padded_vocab_size == 64 and cfg.rope_theta == 5e5 and cfg.rope_scaling["factor"] == 8.0
    assert (cfg.max_seq_len, cfg.z_loss) == (48, 1e-4)  # the run's, not the checkpoint's
    assert not cfg.qkv_bias and model_config(hf_dirs["qwen2 qkv bias"]).qkv_bias


def _layouts_case(folder: Path, strategy, label: str) -> Case:
    return Case(strategy, model=dict(TINY), steps=1, init_from=str(folder), label=label)


def test_import_under_layouts_matches_one_process(hf_dirs):
    """Qwen2 with tied embeddings (biases split by tp, the tied head on the last pipeline stage): first-step loss
    and every gradient under zero3 x 2, tp2 (sequence parallel) and pp2 as one process."""
    folder = hf_dirs["qwen2 tied"]
    cases = [_layouts_case(folder, partial(ZeroStrategy, stage=3), "hf zero3"),
             _layouts_case(folder, partial(TensorParallelStrategy, 2, sequence_parallel=True), "hf tp2"),
             _layouts_case(folder, partial(PipelineStrategy, pipeline_parallel_size=2, microbatches=2), "hf pp2")]
    for run in run_parity(cases, 2):
        assert_parity(run)
    # the runs started from the file's weights, not from the seeded init
    single = run["single"]["params"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert not torch.equal(single["model.blocks.0.attn.wq.bias"], torch.zeros(32))
    lr_step = single["model.norm.weight"] - theirs.model.norm.weight.detach()
    assert lr_step.abs().max() < 0.5  # one SGD step away from the imported norm weight


class BytesRead(L.Callback):
    """What this rank's import read from the files, once the strategy has materialised its part."""

    read = None

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.read = module.model.weights.bytes_read

    def __getstate__(self) -> dict:  # what travels back from a rank: the count (a strategy may attach its `log`)
        return {"read": self.read}


def test_zero3_rank_reads_its_rows_only(tmp_path):
    """A model 4x a rank's share: each of 4 ZeRO-3 ranks reads about a quarter of the bytes, none the whole; the
    four together read every byte exactly once."""
    save_hf(tmp_path, transformers.LlamaConfig(**{**SHAPE, "num_hidden_layers": 4}))
    case = Case(partial(ZeroStrategy, stage=3), steps=1, global_batch=4, init_from=str(tmp_path),
                callbacks=(BytesRead(),))
    ranks = run_distributed(_fit_cases, 4, [case], 4, [None], init_process_group=False)
    read = [r[0]["callbacks"][0].read for r in ranks]
    whole = sum(p.numel() * p.element_size() for p in load_model(tmp_path).parameters())
    assert sum(read) == whole
    assert max(read) < whole / 3, f"a rank read {max(read)} of {whole} bytes"


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))  # None: the key removed


@pytest.mark.parametrize("changes, field", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "`model_type` 'gpt2'"),
    ({"head_dim": 7}, "`head_dim` 7"),  # any even head_dim is imported (tests/test_hf_families.py)
    ({"intermediate_size": None}, "`intermediate_size` (missing)"),
    ({"hidden_act": "gelu"}, "`hidden_act` 'gelu'"),
    ({"attention_bias": True}, "`attention_bias` true"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}},
     "`rope_scaling` rope_type 'longrope'"),  # (YaRN is imported: tests/test_gpt_oss.py)
])
def test_refusals_name_the_field(tmp_path, changes, field):
    save_hf(tmp_path, FAMILIES["llama tied"]())
    _edit_config(tmp_path, **changes)
    with pytest.raises(ConfigError) as err:
        LanguageModel(init_from=str(tmp_path))
    message = str(err.value)
    assert field in message and "\n" not in message and "config.json" in message


def test_weights_that_do_not_match_the_config_are_refused(tmp_path):
    save_hf(tmp_path, FAMILIES["llama tied"]())
    _edit_config(tmp_path, tie_word_embeddings=False)  # the file has no lm_head.weight
    with pytest.raises(ConfigError, match="has no tensor lm_head.weight"):
        HFWeights(tmp_path, model_config(tmp_path))


def hf_folder_with_tokenizer(folder: Path, corpus: str, make=transformers.LlamaConfig, **extra) -> tuple[Path, object]:
    """A random Llama (or `make`'s family, with `extra` config arguments) whose vocabulary is a byte-level BPE trained
    with the `tokenizers` library on `corpus`, saved as a Hugging Face folder with its tokenizer.json (EOS
    `<|endoftext|>`, no BOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([corpus], trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "add_bos_token": False}))
    config = make(**{**SHAPE, "vocab_size": tokenizer.get_vocab_size()}, eos_token_id=None, bos_token_id=None,
                  pad_token_id=0, **extra)
    return folder, save_hf(folder, config)


def test_generate_from_hf_folder_matches_transformers_greedy(tmp_path):
    """`lit-lm generate --ckpt_path <HF folder>` continues a prompt with transformers' greedy tokens, one for one."""
    from lit_lm.generate import generate, load
    from lit_lm.data.tokenizer import prompt_ids
    from test_cli import CORPUS, run_cli

    folder, theirs = hf_folder_with_tokenizer(tmp_path / "hf", CORPUS)
    model, tokenizer = load(str(folder))
    prompt = "def main("
    ids = torch.tensor([prompt_ids(tokenizer, prompt)])
    expected = theirs.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    got = generate(model, ids, 24, temperature=0.0)[0, ids.shape[1]:].tolist()
    assert got == expected
    out = run_cli("generate", "--ckpt_path", str(folder), "--prompt", prompt, "--temperature", "0",
                  "--max_new_tokens", "24", "--device", "cpu", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    until_eos = expected[:expected.index(tokenizer.eos_id)] if tokenizer.eos_id in expected else expected
    assert out.stdout == prompt + tokenizer.decode(until_eos) + "\n"


def test_fit_from_hf_folder_then_validate_and_inspect_it(tmp_path):
    """The recipe's commands on a tiny model: fit from an HF folder with its tokenizer (the yaml's model shape
    replaced, said in one line), `validate --ckpt_path <HF folder>`, `scripts/ckpt.py inspect <HF folder>`."""
    from test_cli import CORPUS, run_cli, run_script, tiny_args

    folder, _ = hf_folder_with_tokenizer(tmp_path / "hf", CORPUS)
    hf_args = ["--model.init_args.init_from", str(folder), "--data.init_args.tokenizer_dir", str(folder)]
    fit = run_cli("fit", *tiny_args(tmp_path), *hf_args, "--trainer.max_steps", "3", cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert "the model is the Hugging Face config's: d_model 32 -> 32" not in fit.stderr  # only what changed
    assert "n_layers 1 -> 2" in fit.stdout + fit.stderr
    validate = run_cli("validate", *tiny_args(tmp_path), "--data.init_args.tokenizer_dir", str(folder),
                       "--ckpt_path", str(folder), cwd=tmp_path)
    assert validate.returncode == 0, validate.stderr[-3000:]
    assert "is a Hugging Face model: its weights start the run" in validate.stdout + validate.stderr
    inspect = run_script("scripts/ckpt.py", "inspect", folder, cwd=tmp_path)
    assert inspect.returncode == 0, inspect.stderr[-3000:]
    assert "a Hugging Face model folder" in inspect.stdout and "model.layers.1.mlp.down_proj.weight" in inspect.stdout


def test_init_from_without_its_tokenizer_is_warned_about(hf_dirs):
    from types import SimpleNamespace

    module = LanguageModel(ModelConfig(**TINY), init_from=str(hf_dirs["llama tied"]))
    for tokenizer_dir, warned in ((None, True), (str(hf_dirs["llama tied"]), False)):
        module._trainer = SimpleNamespace(datamodule=SimpleNamespace(tokenizer_dir=tokenizer_dir))
        with pytest.warns(UserWarning, match="without data.init_args.tokenizer_dir") if warned else \
                warnings.catch_warnings():
            if not warned:
                warnings.simplefilter("error")
            module.on_fit_start()


class MeasuredZero(ZeroStrategy):
    """ZeRO whose `parallelize` (the import: build on meta, then materialise this rank's rows from the files) is
    measured alone: the resident peak is reset (Linux `clear_refs` 5) before and read after it, so what the
    training state allocates next (the flat optimizer step's buffers) is not counted."""

    def parallelize(self, fitting: bool) -> None:
        peak = ResidentPeak()
        super().parallelize(fitting)
        self.import_peak = peak.above()


class ImportPeak(L.Callback):
    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.peak = trainer.strategy.import_peak


def test_zero3_import_peak_memory_stays_below_the_model(tmp_path):
    """A model of ~94 MB (fp32) imported under ZeRO-3 x 4: each rank's resident peak during the import grows by well
    under the whole model's bytes (its quarter of the rows as fp32 masters, one parameter at a time materialised,
    the slices it read: ~0.3-0.45x measured), where a rank reading or building the whole model grows by more than
    the whole."""
    if not reset_peak():  # not Linux, or a sandbox that forbids resetting the peak: nothing to measure with
        pytest.skip("cannot reset the peak resident size (/proc/self/clear_refs)")
    shape = {**SHAPE, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 6,
             "num_attention_heads": 8, "num_key_value_heads": 4}
    save_hf(tmp_path, transformers.LlamaConfig(**shape))
    whole = sum(p.numel() * p.element_size() for p in load_model(tmp_path).parameters())
    case = Case(partial(MeasuredZero, stage=3), steps=1, global_batch=4, init_from=str(tmp_path),
                callbacks=(ImportPeak(),))
    ranks = run_distributed(_fit_cases, 4, [case], 4, [None], init_process_group=False)
    peaks = [r[0]["callbacks"][0].peak for r in ranks]
    assert whole > 80e6 and max(peaks) < 0.6 * whole, f"peak growth per rank {peaks} for a model of {whole} bytes"


def hub_snapshot(cache: Path, repo_id: str, source: Path) -> Path:
    """`source`'s files in a `huggingface_hub` cache as `hf_hub_download` leaves them: `models--org--name/` with
    `blobs/<etag>` (a safetensors file's sha256, another file's git blob hash), `refs/main` (the commit) and
    `snapshots/<commit>/<file>`, a relative symlink `../../blobs/<etag>` made by huggingface_hub's own helper;
    huggingface_hub itself then finds the snapshot offline."""
    hub = pytest.importorskip("huggingface_hub")
    from huggingface_hub.file_download import _create_symlink, repo_folder_name
    from huggingface_hub.utils.sha import git_hash

    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    commit = git_hash(repo_id.encode())  # any 40-hex commit id
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(commit)
    (storage / "blobs").mkdir()
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        etag = hashlib.sha256(data).hexdigest() if file.suffix == ".safetensors" else git_hash(data)
        (storage / "blobs" / etag).write_bytes(data)
        _create_symlink(str(storage / "blobs" / etag), str(snapshot / file.name), new_blob=True)
        assert os.readlink(snapshot / file.name) == f"../../blobs/{etag}"
    assert Path(hub.snapshot_download(repo_id, cache_dir=cache, local_files_only=True)) == snapshot
    return snapshot


def test_sharded_model_imports_from_the_hub_cache(tmp_path):
    """A sharded model in the Hugging Face cache (its shards symlinks into ../../blobs) imports, as from the folder it
    was saved to; an index naming a shard with `..` or by an absolute path is still refused in one line (the names
    are checked as written, not where the symlinks lead)."""
    whole, saved = tmp_path / "whole", tmp_path / "saved"
    save_hf(whole, FAMILIES["llama tied"]()).save_pretrained(saved, max_shard_size="20KB")
    index = json.loads((saved / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (saved / "model.safetensors").exists()
    snapshot = hub_snapshot(tmp_path / "hub", "org/tiny-llama", saved)
    ours, theirs = load_model(snapshot).state_dict(), load_model(whole).state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    for name in (f"../{snapshot.name}/{shards[0]}", f"sub/../../{snapshot.name}/{shards[0]}",
                 str(snapshot / shards[0])):
        (snapshot / INDEX).unlink()  # a local edit of the cached index: a file of its own
        (snapshot / INDEX).write_text(json.dumps(dict(index, weight_map={**index["weight_map"],
                                                                         "model.norm.weight": name})))
        with pytest.raises(ConfigError, match=f"the shard '{re.escape(name)}' is outside") as err:
            HFWeights(snapshot, model_config(snapshot))
        assert "\n" not in str(err.value)
