"""The families of `lit_lm.hf.families` in and out: Qwen3 (per-head QK-norm, its own head_dim, tied), a Mistral
with head_dim != hidden / heads (Mistral-Nemo's shape), and the MoE families Mixtral (renormalised top-2),
Qwen3-MoE (norm_topk_prob, a first dense layer) and OLMoE (QK-norm over the whole projection, raw top-k gates):
tiny random models made with `transformers` (no network).

- logits equal transformers' within 1e-5 (fp32) and greedy decoding token for token; the export loads in
  transformers with the same tensors and logits;
- every config.json key a family reads matters (imported without it, the config changes or is refused), the
  4.x top-level rope_theta / rope_scaling included; a tied checkpoint that also stores lm_head.weight;
- sharded folders: the index's paths are followed (shards in a sub-folder), a path leaving the folder, a missing
  and a truncated shard are refused in one line naming the file;
- under tp2, zero3 x 2 (dense and MoE) and ep2 (MoE) the imported model's first step equals one process (the
  parity harness), each rank reading its share of the bytes only.
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lit_lm.config import ConfigError  # noqa: E402
from lit_lm.hf.exporter import export_hf  # noqa: E402
from lit_lm.hf.families import FAMILIES as ENTRIES  # noqa: E402
from lit_lm.hf.importer import INDEX, HFWeights, as_checkpoint, config_from_hf, load_model, model_config  # noqa: E402
from lit_lm.model import Transformer  # noqa: E402
from lit_lm.parity import Case, assert_parity, run_parity  # noqa: E402
from lit_lm.strategies.composed import ComposedStrategy  # noqa: E402
from lit_lm.strategies.ep import ExpertParallelStrategy  # noqa: E402
from lit_lm.strategies.tp import TensorParallelStrategy  # noqa: E402
from lit_lm.strategies.zero import ZeroStrategy  # noqa: E402
from test_hf_import import SHAPE, BytesRead, save_hf  # noqa: E402

NO_IDS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)  # greedy decoding never stops early
BASE = dict(SHAPE, rms_norm_eps=1e-5, **NO_IDS)
MOE = dict(num_experts_per_tok=2)
# YaRN's ramp between dims 1.1 and 5.1 of head_dim 16's 8 (theta 1000, a context of 512)
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 512, "rope_theta": 1000.0}
FAMILIES = {
    "qwen3 tied": lambda: transformers.Qwen3Config(**BASE, head_dim=16, tie_word_embeddings=True),
    "mistral head_dim 16": lambda: transformers.MistralConfig(**BASE, head_dim=16, sliding_window=None),
    "mixtral window 6": lambda: transformers.MixtralConfig(**BASE, **MOE, num_local_experts=4, sliding_window=6,
                                                           rope_theta=1e4),  # not Mixtral's default (1e6)
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**BASE, **MOE, head_dim=16, num_experts=4,
                                                     moe_intermediate_size=24, norm_topk_prob=True,
                                                     mlp_only_layers=[0]),
    "olmoe": lambda: transformers.OlmoeConfig(**BASE, **MOE, num_experts=4),
    # MLA (non-interleaved rope here), 4 experts in 2 groups (the best 1), 2 shared experts, a dense first block: each
    # key off transformers' default (tests/test_deepseek_v3.py: interleaved, the selection bias, layouts)
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**BASE, "num_key_value_heads": SHAPE["num_attention_heads"]}, **MOE, n_routed_experts=4,
        moe_intermediate_size=16, n_shared_experts=2, n_group=2, topk_group=1, routed_scaling_factor=1.5,
        first_k_dense_replace=1, norm_topk_prob=False, q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=4,
        qk_rope_head_dim=4, v_head_dim=6, rope_interleave=False),
    # sinks, windowed and full layers, YaRN, biases, the clamped SwiGLU (limit 1: it clamps); experts of 32 (MXFP4's
    # blocks: tests/test_gpt_oss.py)
    "gpt_oss": lambda: transformers.GptOssConfig(**{**BASE, "intermediate_size": 32}, **MOE, head_dim=16,
                                                 num_local_experts=4, sliding_window=6, swiglu_limit=1.0,
                                                 swiglu_alpha=1.5, max_position_embeddings=32,
                                                 rope_parameters=GPT_OSS_YARN),
    "gpt_oss full first, no attention bias": lambda: transformers.GptOssConfig(
        **{**BASE, "intermediate_size": 24}, **MOE, head_dim=16, num_local_experts=4, sliding_window=3,
        layer_types=["full_attention", "sliding_attention"], attention_bias=False),
}


def save_family(folder: Path, config, seed: int) -> None:
    model = save_hf(folder, config, seed)
    with torch.no_grad():  # routers of std 1: clear top-k choices (no near-ties that rounding could flip)
        for key, p in model.named_parameters():
            if key.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight")):
                p.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed))
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for i, name in enumerate(FAMILIES):
        out[name] = tmp_path_factory.mktemp(name.replace(" ", "_"))
        save_family(out[name], FAMILIES[name](), seed=10 + i)
    return out


def _transformers(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


IDS = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))


def assert_in_and_out_equal_transformers(folder: Path, ids: torch.Tensor, out: Path) -> tuple[Transformer, str]:
    """lit-lm's import of `folder` computes transformers' logits (1e-5) and greedy decoding token for token; export-hf
    (float32: lossless; bf16 in test_hf_export_bf16) writes the folder's own names and tensors bit for bit, which
    transformers loads with the same logits exactly. Returns lit-lm's model and the exported architecture's name."""
    from safetensors.torch import load_file

    from lit_lm.generate import generate

    theirs, ours = _transformers(folder), load_model(folder)
    with torch.no_grad():
        expected = theirs(ids).logits
        torch.testing.assert_close(ours(ids), expected, rtol=1e-5, atol=1e-5)
    prompt = ids[:1, :5]
    want = theirs.generate(prompt, max_new_tokens=12, do_sample=False)[0, 5:].tolist()
    assert generate(ours, prompt, 12, temperature=0.0)[0, 5:].tolist() == want
    export_hf(as_checkpoint(folder), out, dtype="float32")
    before, after = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    again = _transformers(out)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, expected, rtol=0, atol=0)
    return ours, type(again).__name__


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_greedy_and_export_equal_transformers(hf_dirs, family, tmp_path):
    _, exported = assert_in_and_out_equal_transformers(hf_dirs[family], IDS, tmp_path / "out")
    # a Mistral without a window is Llama's architecture: exported as the first family that holds it
    theirs = type(_transformers(hf_dirs[family])).__name__
    assert exported == ("LlamaForCausalLM" if family.startswith("mistral") else theirs)


def test_each_family_feature_is_what_makes_the_logits_equal(hf_dirs):
    """Without the family's feature (the per-head / whole-projection QK-norm, raw top-k gates), the logits are far
    off (10x the tolerance and more): the comparisons above needed it."""
    cases = {"qwen3 tied": lambda m: [setattr(b.attn, "q_norm", torch.nn.Identity()) for b in m.blocks.values()],
             "qwen3_moe": lambda m: [setattr(b.mlp.router, "norm_topk", False) for b in m.blocks.values()
                                     if hasattr(b.mlp, "router")],
             "olmoe": lambda m: [setattr(b.mlp.router, "norm_topk", True) for b in m.blocks.values()],
             "mixtral window 6": lambda m: [setattr(b.attn.core, "sliding_window", None) for b in m.blocks.values()]}
    for family, mutate in cases.items():
        with torch.no_grad():
            expected = _transformers(hf_dirs[family])(IDS).logits
            model = load_model(hf_dirs[family])
            mutate(model)
            assert (model(IDS) - expected).abs().max() > 1e-4, family  # 10x the tolerance


def _without(hf: dict, keys: tuple[str, ...]) -> dict:
    return {k: v for k, v in hf.items() if k not in keys}


def test_every_config_key_a_family_reads_matters(hf_dirs):
    """Imported without a key it reads (each alternative name together), a family's config changes or is
    refused; every key of every entry is so exercised by some family here (a family whose value is the key's
    default when absent shows nothing for it)."""
    exercised = set()
    for family, folder in hf_dirs.items():
        hf = json.loads((folder / "config.json").read_text())
        entry = ENTRIES[hf["model_type"]]
        base = config_from_hf(hf)
        assert family.split()[0] == hf["model_type"]
        for keys in [*entry.all_fields.values(), ("rope_parameters",), ("mlp_only_layers",)]:
            if all(hf.get(k) is None for k in keys):
                continue
            try:
                changed = config_from_hf(_without(hf, keys)) != base
            except ConfigError:
                changed = True
            if changed:
                exercised.add(keys[0])
    wanted = {keys[0] for entry in ENTRIES.values() for keys in entry.all_fields.values()}
    assert wanted | {"rope_parameters", "mlp_only_layers"} == exercised
    for family, make in (("olmoe", transformers.OlmoeConfig), ("qwen3 tied", transformers.Qwen3Config)):
        hf = json.loads((hf_dirs[family] / "config.json").read_text())  # an absent key: transformers' default
        assert config_from_hf(_without(hf, ("rms_norm_eps",))).norm_eps == make().rms_norm_eps, family


# a config.json with the shape only, the heads a multiple of the default num_key_value_heads (Qwen2's, Qwen3's: 32)
STATED = dict(vocab_size=SHAPE["vocab_size"], hidden_size=256, intermediate_size=48, num_hidden_layers=1)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2)
STATED_MOE = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2), "qwen3_moe": EXPERTS, "olmoe": EXPERTS,
              "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                                  first_k_dense_replace=0),
              "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2)}


@pytest.mark.parametrize("model_type", list(ENTRIES))
def test_a_config_without_its_optional_keys_imports_with_transformers_defaults(model_type, tmp_path):
    """config.json with the shape only (and an MoE's expert counts): the import equals that of the config as
    transformers fills it with its defaults for the model type (num_key_value_heads, head_dim, rope_theta,
    sliding_window, rms_norm_eps, moe_intermediate_size, ...), and the logits equal transformers' reading the same
    file; a key stated as null is transformers' null (no window; kv heads and head_dim derived)."""
    heads = 64 if model_type in ("qwen2", "qwen3") else 16
    stated = {"model_type": model_type, **STATED, "num_attention_heads": heads, **STATED_MOE.get(model_type, {})}
    theirs = transformers.AutoConfig.for_model(**stated, initializer_range=0.1)  # the weights' std (not imported)
    assert config_from_hf(stated) == config_from_hf(json.loads(theirs.to_json_string(use_diff=False)))
    save_family(tmp_path, theirs, seed=3)
    (tmp_path / "config.json").write_text(json.dumps(stated))  # only the stated keys
    with torch.no_grad():
        # 1e-4: wider sums than the models above (hidden 256, Qwen3-MoE's experts of 768); a wrong default is far
        # off (Mixtral's rope_theta: 4 in the logits)
        torch.testing.assert_close(load_model(tmp_path)(IDS), _transformers(tmp_path)(IDS).logits, rtol=1e-4,
                                   atol=1e-4)
    nulls = config_from_hf({**stated, "num_key_value_heads": None, "head_dim": None, "sliding_window": None})
    head_dim = 64 if model_type == "deepseek_v3" else 256 // heads  # DeepSeek-V3's: its qk_rope_head_dim
    assert (nulls.n_kv_heads, nulls.head_dim, nulls.sliding_window) == (heads, head_dim, None)


def test_transformers_4_config_with_top_level_rope(tmp_path):
    """A transformers 4.x config.json (rope_theta and Llama 3's rope_scaling at the top level, no rope_parameters),
    as most Hub models have: the same logits as transformers; without the top-level rope_theta they differ."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    # q and k large enough (std 0.3) for attention to depend on the positions' angles; a copy of `rope`, which
    # transformers' config would write rope_theta into
    save_hf(tmp_path, transformers.LlamaConfig(**{**BASE, "initializer_range": 0.3}, rope_scaling=dict(rope),
                                               rope_theta=100.0))
    path = tmp_path / "config.json"
    hf = json.loads(path.read_text())
    assert hf.pop("rope_parameters")["rope_theta"] == 100.0
    legacy = {"rope_theta": 100.0, "rope_scaling": rope}
    path.write_text(json.dumps({**hf, **legacy}))
    cfg = model_config(tmp_path)
    assert cfg.rope_theta == 100.0 and cfg.rope_scaling["factor"] == 8.0
    with torch.no_grad():
        expected = _transformers(tmp_path)(IDS).logits
        torch.testing.assert_close(load_model(tmp_path)(IDS), expected, rtol=1e-5, atol=1e-5)
        for key in legacy:  # each of the two top-level keys is needed
            path.write_text(json.dumps({**hf, **_without(legacy, (key,))}))
            assert (load_model(tmp_path)(IDS) - expected).abs().max() > 1e-3, key


def test_tied_checkpoint_that_also_stores_the_head(hf_dirs, tmp_path):
    """Some Hub uploads of tied models store lm_head.weight too (a copy of the embedding): accepted, the head is
    the embedding, as in transformers."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_dirs["qwen3 tied"], tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ours = load_model(tmp_path)
    assert ours.lm_head.weight is ours.tok_embeddings.weight
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS), _transformers(tmp_path)(IDS).logits, rtol=1e-5, atol=1e-5)


def _shard(source: Path, folder: Path) -> dict:
    """`source` saved as shards of a few KB in folder/shards/, the index at the top (its paths into shards/)."""
    _transformers(source).save_pretrained(folder, max_shard_size="20KB")
    index = json.loads((folder / INDEX).read_text())
    (folder / "shards").mkdir()
    for name in set(index["weight_map"].values()):
        (folder / name).rename(folder / "shards" / name)
    index["weight_map"] = {k: f"shards/{v}" for k, v in index["weight_map"].items()}
    (folder / INDEX).write_text(json.dumps(index))
    return index


def test_sharded_folder_follows_its_index_and_refuses_bad_shards(hf_dirs, tmp_path):
    source = hf_dirs["qwen3_moe"]
    index = _shard(source, tmp_path / "sharded")
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and not list((tmp_path / "sharded").glob("*.safetensors"))  # only the index finds them
    ours = load_model(tmp_path / "sharded")
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS), _transformers(source)(IDS).logits, rtol=1e-5, atol=1e-5)

    def refused(edit, match: str) -> None:
        folder = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tmp_path / "sharded", folder)
        edit(folder)
        with pytest.raises(ConfigError, match=match) as err:
            HFWeights(folder, model_config(folder))
        assert "\n" not in str(err.value)

    def escape(folder: Path) -> None:
        moved = dict(index, weight_map={**index["weight_map"], "model.norm.weight": f"../{shards[0]}"})
        (folder / INDEX).write_text(json.dumps(moved))

    refused(escape, f"the shard '../{shards[0]}' is outside")
    refused(lambda folder: (folder / shards[1]).unlink(), f"{shards[1]}: missing, though .*index.json names it")
    truncate = lambda folder: (folder / shards[2]).write_bytes((folder / shards[2]).read_bytes()[:-100])  # noqa: E731
    refused(truncate, f"{shards[2]}: not a whole safetensors file .*truncated")


def test_imported_families_under_layouts_match_one_process(hf_dirs):
    """First step's loss and every gradient as one process: Qwen3 (tied, head_dim 16) under tp2 with sequence
    parallelism, zero3 x 2 and cp2 (ring); Qwen3-MoE (a dense then an MoE block) under ep2, zero3 x 2 and tp2. Each rank
    read its share: under ZeRO-3 half of every parameter's rows (the two ranks together: every byte once), under ep2
    the dense parameters and half of the experts, under tp2 half of what tp splits and what it replicates."""
    dense, moe = hf_dirs["qwen3 tied"], hf_dirs["qwen3_moe"]
    case = partial(Case, steps=1, callbacks=(BytesRead(),))
    cases = [case(partial(TensorParallelStrategy, 2, sequence_parallel=True), init_from=str(dense), label="qwen3 tp2"),
             case(partial(ZeroStrategy, stage=3), init_from=str(dense), label="qwen3 zero3"),
             case(partial(ComposedStrategy, context_parallel_size=2, cp_method="ring"), init_from=str(dense),
                  label="qwen3 cp2"),
             case(partial(ExpertParallelStrategy, expert_parallel_size=2), init_from=str(moe), label="qwen3_moe ep2"),
             case(partial(ZeroStrategy, stage=3), init_from=str(moe), label="qwen3_moe zero3"),
             case(partial(TensorParallelStrategy, 2, sequence_parallel=False), init_from=str(moe),
                  label="qwen3_moe tp2")]
    runs = run_parity(cases, 2)
    for run in runs:
        assert_parity(run)
    read = {run["case"].label: [r["callbacks"][0].read for r in run["ranks"]] for run in runs}

    def nbytes(folder: Path, keep=lambda name: True) -> int:
        return sum(p.numel() * p.element_size() for n, p in load_model(folder).named_parameters() if keep(n))

    for folder, name in ((dense, "qwen3"), (moe, "qwen3_moe")):
        whole = nbytes(folder)
        assert sum(read[f"{name} zero3"]) == whole and max(read[f"{name} zero3"]) < 0.6 * whole, read
        # replicated over tp: the norms (QK-norms too) and an MoE block's router and experts
        replicated = nbytes(folder, lambda n: "norm" in n or ".experts." in n or ".router." in n)
        assert read[f"{name} tp2"] == [(whole - replicated) // 2 + replicated] * 2, (read, whole, replicated)
    experts = nbytes(moe, lambda n: ".experts." in n)
    assert experts > 0 and read["qwen3_moe ep2"] == [nbytes(moe) - experts // 2] * 2, read


def test_generate_command_on_an_moe_folder_matches_transformers_greedy(tmp_path, capsys):
    """`lit-lm generate --ckpt_path <Qwen3-MoE folder>` (its `main`, in this process: the command's own subprocess
    is tests/test_hf_import.py's) decodes transformers' greedy tokens, one for one."""
    from lit_lm.generate import load, main
    from lit_lm.data.tokenizer import prompt_ids
    from test_cli import CORPUS
    from test_hf_import import hf_folder_with_tokenizer

    folder, theirs = hf_folder_with_tokenizer(tmp_path / "hf", CORPUS, transformers.Qwen3MoeConfig, head_dim=16,
                                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
    _, tokenizer = load(str(folder))
    prompt = "def main("
    ids = torch.tensor([prompt_ids(tokenizer, prompt)])
    expected = theirs.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
    capsys.readouterr()
    main(["--ckpt_path", str(folder), "--prompt", prompt, "--temperature", "0", "--max_new_tokens", "16",
          "--device", "cpu"])
    until_eos = expected[:expected.index(tokenizer.eos_id)] if tokenizer.eos_id in expected else expected
    assert capsys.readouterr().out == prompt + tokenizer.decode(until_eos) + "\n"


def test_head_dim_apart_from_d_model_through_the_config_users():
    """head_dim set apart from d_model / n_heads: the parameter count is the model's (q/o projections n_heads x
    head_dim wide, OLMoE's whole-projection QK-norm), `lit-lm check`'s scaled copy keeps it apart, a derived one
    follows d_model / n_heads, and an odd one is refused in one line."""
    from lit_lm.check.scale import scaled_config
    from lit_lm.config import ModelConfig
    from lit_lm.model import Transformer
    from lit_lm.strategies.layout import ParallelConfig

    for extra in ({}, dict(qk_norm=True), dict(qk_norm=True, qk_norm_scope="all", qkv_bias=True)):
        cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, **extra)
        assert cfg.num_params() == sum(p.numel() for p in Transformer(cfg).parameters())
    nemo = ModelConfig(vocab_size=131072, d_model=5120, n_layers=40, n_heads=32, n_kv_heads=8, head_dim=128,
                       d_ff=14336, max_seq_len=1024)
    small, notes = scaled_config(nemo, ParallelConfig(tp=2))
    assert small.n_heads * small.head_dim != small.d_model and "head_dim 128 -> 8" in notes
    Transformer(small)
    assert ModelConfig(d_model=96, n_heads=4).head_dim == 24
    with pytest.raises(ConfigError, match="`head_dim` 7 .* must be even"):
        ModelConfig(d_model=32, n_heads=4, head_dim=7)
