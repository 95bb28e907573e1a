"""DeepSeek-V3's architecture (transformers `deepseek_v3`): multi-head latent attention (lit_lm/mla.py), node-limited
sigmoid routing with a selection bias and a routed scale, a shared expert, a first dense block, multi-token
prediction (lit_lm/mtp.py); tiny random models made with `transformers` (no network).

- logits equal transformers' within 1e-5 and greedy decoding token for token (the decoding cache holds the latent
  and the rope key only); the export is the same files, loaded by transformers as DeepseekV3ForCausalLM;
- every config.json key of the family matters: changed, the import is refused (a shape) or the logits move;
- MTP: its loss is the stated formula, and forward / generation never run it;
- under zero1-3, tp2 (heads split, the latent's down-projections replicated), ep2 and pp2 a step equals one
  process (the parity harness).
"""

from __future__ import annotations

import json
import math
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from lit_lm.config import ConfigError, ModelConfig  # noqa: E402
from lit_lm.hf.exporter import check_exportable  # noqa: E402
from lit_lm.hf.importer import config_from_hf, load_model  # noqa: E402
from lit_lm.model import KVCache, Transformer  # noqa: E402
from lit_lm.parity import TINY, Case, assert_parity, run_parity  # noqa: E402
from lit_lm.strategies.composed import ComposedStrategy  # noqa: E402
from lit_lm.strategies.ep import ExpertParallelStrategy  # noqa: E402
from lit_lm.strategies.pp import PipelineStrategy  # noqa: E402
from lit_lm.strategies.tp import TensorParallelStrategy  # noqa: E402
from lit_lm.strategies.zero import ZeroStrategy  # noqa: E402
from test_hf_families import assert_in_and_out_equal_transformers  # noqa: E402
from test_hf_import import BytesRead  # noqa: E402

# 8 experts in 4 groups of 2, the best 2 groups, top-2: the group limit decides (see the key test's n_group)
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
             num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
             kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, initializer_range=0.1,
             rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
VARIANTS = {"q_lora": dict(q_lora_rank=24), "direct q": dict(q_lora_rank=None, norm_topk_prob=False)}
IDS = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))


def save_deepseek(folder: Path, seed: int, **overrides) -> None:
    """A random DeepseekV3ForCausalLM: norms around 1, routers of std 1 (clear top-k choices) and a non-zero
    selection bias (e_score_correction_bias), so a skipped norm, scale or bias shows."""
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**{**SHAPE, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for i, (name, overrides) in enumerate(VARIANTS.items()):
        out[name] = tmp_path_factory.mktemp(name.replace(" ", "_"))
        save_deepseek(out[name], seed=20 + i, **overrides)
    return out


def _transformers(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_greedy_and_export_equal_transformers(folders, variant, tmp_path):
    ours, exported = assert_in_and_out_equal_transformers(folders[variant], IDS, tmp_path / "out")
    assert ours.config.mla_kv_rank == 16 and ours.config.moe_groups == 4 and ours.config.mtp_layers == 0
    assert exported == "DeepseekV3ForCausalLM"


# DeepSeek-V3's YaRN (factor 40, mscale = mscale_all_dim = 1 there): here 4 over a context of 16, and mscale apart
# from mscale_all_dim so that both the rotary dims' factor and the softmax's mscale^2 (lit_lm.mla) show
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0}


def test_yarn_softmax_mscale_equals_transformers(tmp_path):
    """With YaRN's mscale_all_dim the softmax scale is (Dn + Dr)^-1/2 * mscale^2 over all dims (transformers'
    yarn_apply_mscale): 40 positions (past the original 16) equal transformers', and without the mscale they do not."""
    save_deepseek(tmp_path, seed=5, q_lora_rank=24, max_position_embeddings=64, rope_parameters=YARN)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(2))
    ours = load_model(tmp_path)
    assert ours.config.rope_scaling["rope_type"] == "yarn"
    with torch.no_grad():
        expected = _transformers(tmp_path)(ids).logits
        torch.testing.assert_close(ours(ids), expected, rtol=1e-5, atol=1e-5)
        for block in ours.blocks.values():
            assert block.attn.q_scale == pytest.approx((0.1 * math.log(4.0) + 1) ** 2)
            block.attn.q_scale = 1.0
        assert (ours(ids) - expected).abs().max() > 1e-3


def test_decoding_caches_the_latent_and_equals_the_full_forward(folders):
    """Token by token with the cache = the whole sequence without it; the cache holds the normed latent
    (kv_lora_rank) and the rotated shared rope key (qk_rope_head_dim) per position, one 'head' each."""
    model = load_model(folders["q_lora"])
    cache = [KVCache() for _ in model.blocks]
    with torch.no_grad():
        steps = [model(IDS[:, :6], cache=cache)] + [model(IDS[:, t:t + 1], cache=cache) for t in range(6, 16)]
        torch.testing.assert_close(torch.cat(steps, dim=1), model(IDS), rtol=1e-5, atol=1e-5)
    assert [tuple(c.k.shape) for c in cache] == [(2, 1, 16, 16)] * 3
    assert [tuple(c.v.shape) for c in cache] == [(2, 1, 16, 4)] * 3


# a changed value per config.json key: those that change a shape are refused on import, the others move the logits
CHANGED = {"n_routed_experts": 4, "moe_intermediate_size": 8, "n_shared_experts": 2, "first_k_dense_replace": 0,
           "kv_lora_rank": 8, "q_lora_rank": 12, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 8,
           "num_experts_per_tok": 3, "norm_topk_prob": False, "n_group": 1, "topk_group": 4,
           "routed_scaling_factor": 1.0, "rope_interleave": False, "rms_norm_eps": 1e-2,
           "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}


def test_every_config_key_matters(folders, tmp_path):
    """Each key the family reads, changed in config.json beside the same tensors: refused (shapes) or other logits
    (far beyond the tolerance); n_group 1 is routing without the group limit."""
    from lit_lm.hf.families import FAMILIES

    folder = folders["q_lora"]
    expected = _transformers(folder)(IDS).logits.detach()
    keys = {keys[0] for keys in FAMILIES["deepseek_v3"].fields.values()}
    assert keys - {"num_nextn_predict_layers"} <= set(CHANGED), keys - set(CHANGED)
    hf = json.loads((folder / "config.json").read_text())
    for key, value in CHANGED.items():
        shutil.rmtree(tmp_path / "v", ignore_errors=True)
        shutil.copytree(folder, tmp_path / "v")
        (tmp_path / "v/config.json").write_text(json.dumps({**hf, key: value}))
        try:
            with torch.no_grad():
                got = load_model(tmp_path / "v")(IDS)
        except ConfigError:
            continue
        assert (got - expected).abs().max() > 1e-3, key


def test_mtp_loss_is_the_stated_formula_and_stays_out_of_forward():
    """loss = main CE + mtp_weight / D * sum_k CE_k, CE_k of lm_head(norm_k(block_k(eh_proj([enorm(emb(idx[k:]));
    hnorm(h^{k-1}[:T-k])])))) against targets[k:]; the logits are those of the same model without MTP."""
    cfg = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, mla_kv_rank=8, mla_q_rank=None, mla_qk_nope_dim=4,
               mla_qk_rope_dim=4, mla_v_dim=8, max_seq_len=16, vocab_multiple_of=1)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**cfg, mtp_layers=2, mtp_weight=0.5))
    plain = Transformer(ModelConfig(**cfg))
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    x, y = idx[:, :-1], idx[:, 1:]
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    h = plain.tok_embeddings(x)
    for block in plain.blocks.values():
        h = block(h)
    want = F.cross_entropy(plain(x).flatten(0, 1), y.flatten())
    mtp = []
    for k, m in enumerate(model.mtp.values(), start=1):
        n = x.shape[1] - k
        h = m.block(m.eh_proj(torch.cat((m.enorm(model.tok_embeddings(x[:, k:])), m.hnorm(h[:, :n])), -1)))
        mtp.append(F.cross_entropy(model.lm_head(m.norm(h)).flatten(0, 1), y[:, k:].flatten()))
    loss, ce = model.loss(x, y)
    torch.testing.assert_close(ce, want)
    torch.testing.assert_close(loss, want + 0.5 / 2 * sum(mtp))
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.mtp.parameters())


def test_refusals_in_one_line():
    cfg = dict(TINY, mla_kv_rank=8, mla_qk_nope_dim=4, mla_qk_rope_dim=4, mla_v_dim=8)
    with pytest.raises(ConfigError, match="`mla_v_dim` 9 must be <= mla_qk_nope_dim"):
        Transformer(ModelConfig(**{**cfg, "mla_v_dim": 9})).context_parallel_plan()
    with pytest.raises(ConfigError, match="tensor parallelism does not split the multi-token prediction"):
        Transformer(ModelConfig(**cfg, mtp_layers=1)).tensor_parallel_plan()
    with pytest.raises(ConfigError, match="pipeline parallelism does not run the multi-token prediction"):
        Transformer(ModelConfig(**cfg, mtp_layers=1)).pipeline_split([0], True, False)
    with pytest.raises(ConfigError, match="`mla_qk_rope_dim` 3 must be even"):
        ModelConfig(**{**cfg, "mla_qk_rope_dim": 3})
    with pytest.raises(ConfigError, match="`moe_groups`=3 must split `moe_experts`=4"):
        ModelConfig(**TINY, moe_experts=4, moe_groups=3)
    with pytest.raises(ConfigError, match="`quantization_config`.*DeepSeek-V3's FP8 blocks"):
        config_from_hf({**json.loads(transformers.DeepseekV3Config(**SHAPE).to_json_string()),
                        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    # grouped-query attention with DeepSeek's routing is no family's: not exported as a deepseek_v3 without MLA
    with pytest.raises(ConfigError, match="is in no Hugging Face family"):
        check_exportable(ModelConfig(**{k: v for k, v in DEEPSEEK.items() if not k.startswith("mla_")}))


# lit-lm's own DeepSeek-V3-shaped model: MLA with a low-rank query, block 0 dense, block 1 MoE with 8 experts in 4
# groups (the best 2), a shared expert, sigmoid scores, routed scale, aux-free balancing
DEEPSEEK = dict(TINY, n_kv_heads=4, mla_kv_rank=8, mla_q_rank=12, mla_qk_nope_dim=4, mla_qk_rope_dim=4, mla_v_dim=6,
                moe_experts=8, moe_top_k=2, moe_groups=4, moe_topk_groups=2, moe_d_ff=16, moe_shared_experts=1,
                moe_first_dense=1, moe_score="sigmoid", moe_routed_scale=2.5, moe_bias_update=1e-3)


DENSE_MLA = {k: v for k, v in DEEPSEEK.items() if not k.startswith("moe_")}  # MLA alone (sequence parallelism)
MTP = dict(DEEPSEEK, mtp_layers=1, mtp_weight=0.5)  # its module's block MoE (block index 2): experts under ep too


def test_latent_attention_takes_each_layers_window():
    """`layer_types` alternating sliding and full attention: an MLA block's core (and its decoding) uses its own
    layer's window, the one the context-parallel plan gives that layer (`ModelConfig.window`)."""
    cfg = ModelConfig(**dict(DENSE_MLA, n_layers=2, sliding_window=4,
                             layer_types=["sliding_attention", "full_attention"]))
    model = Transformer(cfg)
    assert [(b.attn.sliding_window, b.attn.core.sliding_window) for b in model.blocks.values()] == \
        [(4, 4), (None, None)]


def test_layouts_equal_one_process():
    """zero1-3; cp2 ring, all-gather and ulysses (v padded to the key width, rope at the zigzag positions); tp2
    (heads split; wq_a, q_norm, wkv_a, kv_norm replicated, their gradients summed over tp; with sequence
    parallelism on a dense MLA model, MoE refusing it); ep2 (4 routed experts per rank, the shared expert dense on
    both); pp2: three steps as one process; a multi-token prediction module under zero3 and ep2 too."""
    cases = [Case(partial(ZeroStrategy, stage=s), model=DEEPSEEK, label=f"zero{s}") for s in (1, 2, 3)]
    cases += [Case(partial(TensorParallelStrategy, 2, sequence_parallel=False), model=DEEPSEEK, label="tp2"),
              Case(partial(TensorParallelStrategy, 2, sequence_parallel=True), model=DENSE_MLA, label="tp2 sp dense"),
              Case(partial(ExpertParallelStrategy, expert_parallel_size=2), model=DEEPSEEK, label="ep2"),
              Case(partial(PipelineStrategy, pipeline_parallel_size=2, microbatches=2, schedule="1f1b"),
                   model=DEEPSEEK, label="pp2")]
    cases += [Case(partial(ComposedStrategy, context_parallel_size=2, cp_method=m), model=DENSE_MLA, label=f"cp2 {m}")
              for m in ("ring", "allgather", "ulysses")]
    cases += [Case(partial(ZeroStrategy, stage=3), model=MTP, label="zero3 mtp"),
              Case(partial(ExpertParallelStrategy, expert_parallel_size=2), model=MTP, label="ep2 mtp")]
    for run in run_parity(cases, 2):
        assert_parity(run)


def test_imported_under_tp2_and_ep2_each_rank_reads_its_share(folders):
    """From a transformers folder: the first step as one process under tp2 and ep2, and each rank read its share of
    the files only: under tp2 half of what tp splits (q_b, kv_b, o, the dense MLP, embedding and head) and all of what
    it replicates (the latent's down-projections and norms, the norms, an MoE block whole: router, selection bias,
    routed and shared experts); under ep2 half of the routed experts and everything else."""
    folder = folders["q_lora"]
    case = partial(Case, steps=1, callbacks=(BytesRead(),), init_from=str(folder))
    runs = run_parity([case(partial(TensorParallelStrategy, 2, sequence_parallel=False), label="tp2"),
                       case(partial(ExpertParallelStrategy, expert_parallel_size=2), label="ep2")], 2)
    for run in runs:
        assert_parity(run)
    read = {run["case"].label: [r["callbacks"][0].read for r in run["ranks"]] for run in runs}
    model = load_model(folder)
    tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n.endswith("expert_bias"))]

    def nbytes(keep=lambda name: True) -> int:
        return sum(t.numel() * t.element_size() for n, t in tensors if keep(n))

    replicated = nbytes(lambda n: "norm" in n or ".router." in n or ".experts." in n or ".shared." in n or
                        ".wq_a." in n or ".wkv_a." in n)
    assert read["tp2"] == [(nbytes() - replicated) // 2 + replicated] * 2, read
    experts = nbytes(lambda n: ".experts." in n)
    assert experts > 0 and read["ep2"] == [nbytes() - experts // 2] * 2, read
