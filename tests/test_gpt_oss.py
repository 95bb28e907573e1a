"""gpt-oss (transformers `gpt_oss`): its pieces against their formulas and transformers, MXFP4 experts, every
config key it reads, and a tiny gpt-oss under every layout against one process.

tests/test_hf_families.py holds the family's logits / greedy / export round trip (two tiny models: sliding then
full layers with biases and a clamping SwiGLU; full then sliding without attention biases).

- attention sinks: `sink_attention` is softmax over [scores, sink] with the sink dropped, head by head, and the
  log-sum-exp form context parallelism joins once to its merged rows (`cp.join_sink`) gives the same output;
- YaRN: frequencies and attention factor equal transformers' `_compute_yarn_parameters` (truncate on/off, mscale);
- MXFP4: `dequantize_mxfp4` equals an integer decoding of e2m1/e8m0 and transformers' `convert_moe_packed_tensors`;
  a folder whose experts are MXFP4 imports as the same folder with the dequantized experts, an expert slice reads
  only its blocks, and a blocks tensor without its scales is refused in one line;
- every config.json key gpt-oss reads changes the logits when changed, and lit-lm follows transformers there;
- zero1/2/3, tp2 (sinks and biases split with their heads, the output bias added once), ep2 (expert biases with
  their experts) and pp2 equal one process; mutants: each tp rank using the first ranks' sinks, the output bias
  added on every tp rank;
- cp2 ring, all-gather and Ulysses (the sink joined once to each head's merged rows; a sliding and a full layer)
  equal one process, on a dense gpt-oss (cp refuses MoE layers); mutant: the sink joined to every tile.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from lit_lm.attention_sinks import causal_mask, sink_attention  # noqa: E402
from lit_lm.config import ConfigError  # noqa: E402
from lit_lm.hf.gpt_oss import E2M1, dequantize_mxfp4, quantize_mxfp4  # noqa: E402
from lit_lm.hf.importer import HFWeights, load_model, model_config  # noqa: E402
from lit_lm.parity import TINY, Case, assert_parity, run_parity  # noqa: E402
from lit_lm.strategies import cp, tp_layers  # noqa: E402
from lit_lm.strategies.composed import ComposedStrategy  # noqa: E402
from lit_lm.strategies.ep import ExpertParallelStrategy  # noqa: E402
from lit_lm.strategies.pp import PipelineStrategy  # noqa: E402
from lit_lm.strategies.tp import TensorParallelStrategy  # noqa: E402
from lit_lm.strategies.zero import ZeroStrategy  # noqa: E402
from lit_lm.yarn import yarn_attention_factor, yarn_frequencies  # noqa: E402
from test_hf_families import FAMILIES, IDS, save_family  # noqa: E402


def test_sinks_join_each_heads_softmax_once():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 7, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    mask = causal_mask(7, 7, 3, q.device)
    got = sink_attention(q, k, v, sinks, mask).double()
    for h in range(4):  # softmax over the visible keys and the sink, the sink's column dropped
        scores = (q[:, h] @ k[:, h // 2].transpose(-1, -2) / 8 ** 0.5).masked_fill(~mask, float("-inf"))
        probs = torch.cat([scores, sinks[h].expand(2, 7, 1)], -1).softmax(-1)[..., :-1]
        torch.testing.assert_close(got[:, h], probs @ v[:, h // 2])
    # plain attention's (out, lse) with the sink joined once (cp's merged rows): the same output
    scores = (q.view(2, 2, 2, 7, 8) @ k.unsqueeze(2).transpose(-1, -2) / 8 ** 0.5).masked_fill(~mask, float("-inf"))
    out, lse = scores.softmax(-1) @ v.unsqueeze(2), scores.logsumexp(-1)  # (B, Hkv, G, T, D), (B, Hkv, G, T)
    joined, joined_lse = cp.join_sink(out, lse, sinks.view(2, 2))
    torch.testing.assert_close(joined.reshape(2, 4, 7, 8), got)
    # joined twice (as two tiles each adding it would): another output
    assert (cp.join_sink(joined, joined_lse, sinks.view(2, 2))[0].reshape(2, 4, 7, 8) - got).abs().max() > 1e-3


@pytest.mark.parametrize("params", [
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
    dict(factor=4.0, beta_fast=16.0, beta_slow=2.0, original_max_position_embeddings=64),  # truncate: default
    dict(factor=40.0, mscale=1.0, mscale_all_dim=0.8, original_max_position_embeddings=4096),  # DeepSeek-V3's
], ids=["gpt-oss", "truncated", "mscale"])
def test_yarn_equals_transformers(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta, head_dim = 150000.0, 64
    config = transformers.GptOssConfig(head_dim=head_dim, rope_parameters={"rope_type": "yarn", **params,
                                                                           "rope_theta": theta})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    plain = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    torch.testing.assert_close(yarn_frequencies(plain, head_dim, theta, params).float(), inv_freq, rtol=1e-6,
                               atol=0)
    assert yarn_attention_factor(params) == pytest.approx(factor, rel=1e-12)


def _e2m1(code: int) -> float:
    """The integer reference: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is subnormal."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
    return -magnitude if sign else magnitude


def test_mxfp4_decoding_equals_the_integer_reference_and_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    assert [_e2m1(c) for c in range(16)] == list(E2M1)
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 3, 2, 16), generator=g, dtype=torch.uint8)  # (E, rows, G, 16)
    scales = torch.randint(120, 134, (2, 3, 2), generator=g, dtype=torch.uint8)
    got = dequantize_mxfp4(blocks, scales)
    for e, r, b, i in [(0, 0, 0, 0), (1, 2, 1, 15), (0, 1, 1, 7), (1, 0, 0, 9)]:
        byte = int(blocks[e, r, b, i])
        for nibble, code in enumerate((byte & 15, byte >> 4)):
            want = _e2m1(code) * 2.0 ** (int(scales[e, r, b]) - 127)
            assert got[e, r, 32 * b + 2 * i + nibble].item() == want
    # transformers' decoding, (E, rows, cols) transposed to its (E, cols, rows)
    torch.testing.assert_close(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32),
                               got.transpose(1, 2), rtol=0, atol=0)
    again = quantize_mxfp4(got)
    assert torch.equal(dequantize_mxfp4(*again), got)


def _folder(tmp_path: Path, name: str = "gpt_oss") -> Path:
    folder = tmp_path / name.replace(" ", "_")
    save_family(folder, FAMILIES[name](), seed=5)
    return folder


def _round_mxfp4(values: torch.Tensor) -> torch.Tensor:
    """The nearest MXFP4 numbers: per block of 32, the scale 2^(floor(log2 max) - 2), each value e2m1's nearest."""
    blocks = values.reshape(*values.shape[:-1], -1, 32)
    scale = torch.exp2(torch.floor(torch.log2(blocks.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -100))) - 2)
    lut = torch.tensor(E2M1)
    return (lut[(blocks / scale).unsqueeze(-1).sub(lut).abs().argmin(-1)] * scale).reshape(values.shape)


def _mxfp4_folder(plain: Path, out: Path, drop: str = "") -> None:
    """`plain`'s folder with its expert weights rounded to MXFP4 (the plain one rewritten with the rounded values,
    so both hold the same numbers) and stored as the released checkpoints do: <name>_blocks and <name>_scales of
    the (E, out, in) layout; `drop`: a tensor left out."""
    tensors = load_file(plain / "model.safetensors")
    quantized = dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rounded = _round_mxfp4(tensors[name].transpose(1, 2))
        tensors[name] = quantized[name] = rounded.transpose(1, 2).contiguous()
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = quantize_mxfp4(rounded)
        del quantized[name]
    save_file(tensors, str(plain / "model.safetensors"), metadata={"format": "pt"})
    out.mkdir()
    (out / "config.json").write_text((plain / "config.json").read_text())
    save_file({k: v for k, v in quantized.items() if k != drop}, str(out / "model.safetensors"),
              metadata={"format": "pt"})


def test_mxfp4_experts_import_as_their_dequantized_values(tmp_path):
    plain = _folder(tmp_path)
    _mxfp4_folder(plain, tmp_path / "mxfp4")
    assert any(k.endswith("gate_up_proj_blocks") for k in load_file(tmp_path / "mxfp4/model.safetensors"))
    ours, want = load_model(tmp_path / "mxfp4"), load_model(plain)
    for (name, got), (_, expected) in zip(ours.named_parameters(), want.named_parameters()):
        assert torch.equal(got, expected), name
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS), transformers.AutoModelForCausalLM.from_pretrained(
            plain, dtype=torch.float32).eval()(IDS).logits, rtol=1e-5, atol=1e-5)
    # a slice (experts 2:4, rows 4:12 of w_gate) reads just its blocks: the gate's rows of the fused ones (strided)
    weights = HFWeights(tmp_path / "mxfp4", model_config(tmp_path / "mxfp4"))
    part = torch.empty(2, 8, 32)
    weights.read("blocks.0.mlp.experts.w_gate", part, (slice(2, 4), slice(4, 12)))
    assert torch.equal(part, want.blocks["0"].mlp.experts.w_gate[2:4, 4:12])
    assert weights.bytes_read == 2 * 8 * 1 * 16 + 2 * 8 * 1  # 2 experts x 8 rows x 1 block of 16 bytes, its scales


def test_mxfp4_blocks_without_scales_are_refused(tmp_path):
    plain = _folder(tmp_path)
    _mxfp4_folder(plain, tmp_path / "mxfp4", drop="model.layers.1.mlp.experts.down_proj_scales")
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_blocks is MXFP4 but the files "
                                          r"hold no model\.layers\.1\.mlp\.experts\.down_proj_scales"):
        load_model(tmp_path / "mxfp4")


CHANGES = {  # config.json key -> a value other than the tiny model's
    "sliding_window": 2, "layer_types": ["full_attention", "full_attention"], "swiglu_limit": 0.5,
    "swiglu_alpha": 1.0, "num_experts_per_tok": 1, "rms_norm_eps": 0.5,
    "rope_parameters.factor": 2.0, "rope_parameters.beta_fast": 8.0, "rope_parameters.beta_slow": 0.5,
    "rope_parameters.original_max_position_embeddings": 64, "rope_parameters.truncate": True,
    "rope_parameters.rope_theta": 10.0,
}


def test_every_gpt_oss_key_changes_the_logits_as_in_transformers(tmp_path):
    folder = _folder(tmp_path)
    hf = json.loads((folder / "config.json").read_text())
    with torch.no_grad():
        base = load_model(folder)(IDS)
    for key, value in CHANGES.items():
        changed = json.loads(json.dumps(hf))
        top, _, sub = key.partition(".")
        (changed[top] if sub else changed).__setitem__(sub or top, value)
        (folder / "config.json").write_text(json.dumps(changed))
        with torch.no_grad():
            ours = load_model(folder)(IDS)
            theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(IDS).logits
        assert (ours - base).abs().max() > 1e-4, key
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5, msg=key)


YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False,
        "original_max_position_embeddings": 8}
# a tiny gpt-oss: a sliding then a full layer, sinks, YaRN, biases everywhere, both blocks MoE with the clamp
GPT_OSS = dict(TINY, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
               attn_sinks=True, qkv_bias=True, o_bias=True, rope_scaling=YARN, rope_theta=1000.0, moe_experts=4,
               moe_top_k=2, moe_d_ff=16, moe_biases=True, swiglu_limit=1.0)


def sinks_of_rank_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tp rank keeps the first ranks' sinks (the sinks not split with their heads)."""
    shard = tp_layers.TPGroup.shard
    monkeypatch.setattr(tp_layers.TPGroup, "shard", lambda self, t, dim: t.narrow(0, 0, t.shape[0] // self.size)
                        if t.ndim == 1 and t.shape[0] == GPT_OSS["n_heads"] else shard(self, t, dim))


def output_bias_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each tp rank adds the output projection's bias to its partial sum (the exit's sum holds it tp times)."""
    monkeypatch.setattr(tp_layers.RowParallelLinear, "adds_bias", property(lambda self: True, lambda self, v: None),
                        raising=False)


def test_gpt_oss_layouts_equal_one_process():
    case = partial(Case, model=GPT_OSS, optimizer="adamw")
    tp2 = partial(TensorParallelStrategy, 2, sequence_parallel=False)
    cases = [case(partial(ZeroStrategy, stage=s), label=f"zero{s}") for s in (1, 2, 3)] + [
        case(tp2, label="tp2"), case(partial(ExpertParallelStrategy, expert_parallel_size=2), label="ep2"),
        case(partial(PipelineStrategy, microbatches=2), label="pp2")]
    mutants = [case(tp2, mutation=sinks_of_rank_0, label="tp2, sinks of rank 0"),
               case(tp2, mutation=output_bias_on_every_rank, label="tp2, output bias on every rank")]
    runs = run_parity(cases + mutants, 2)
    for run in runs[:len(cases)]:
        assert_parity(run)
    reports = (r"step 0 rank \d: gradient of model\.\S+ differs",  # another head's sink: every gradient moves
               r"step 0 rank \d: gradient of model\.blocks\.\d\.attn\.wo\.bias differs.*ratio of norms 2\.0000")
    for run, report in zip(runs[len(cases):], reports):
        with pytest.raises(AssertionError, match=report):
            assert_parity(run)


DENSE = {k: v for k, v in GPT_OSS.items() if not k.startswith(("moe_", "swiglu"))}  # cp refuses MoE layers


def sink_per_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tile joins the sink before the merge (a tiled core adding it per tile), not each merged row once: a row
    whose keys span n tiles counts exp(s) n times."""
    sinks, forward, tile = [], cp.ContextAttentionFunction.forward, cp.block_forward

    def forward_per_tile(ctx, q, k, v, s, method, call):
        sinks[:] = [s.detach().float().view(k.shape[1], -1)]
        return forward(ctx, q, k, v, None, method, call)

    monkeypatch.setattr(cp.ContextAttentionFunction, "forward", staticmethod(forward_per_tile))
    monkeypatch.setattr(cp, "block_forward", lambda *args, **kw: cp.join_sink(*tile(*args, **kw), sinks[0]))


def test_gpt_oss_under_cp_equals_one_process():
    """cp2 ring, all-gather and Ulysses: a sliding and a full layer with sinks (each rank's sinks the whole (Hq,);
    Ulysses' exchange gives each rank a head group, and its slice of them) as one process, 3 AdamW steps; the sink
    joined to each tile instead is caught at the first loss."""
    case = partial(Case, model=DENSE, optimizer="adamw")
    cases = [case(partial(ComposedStrategy, context_parallel_size=2, cp_method=m), label=f"cp2 {m}")
             for m in ("ring", "allgather", "ulysses")]
    mutant = case(partial(ComposedStrategy, context_parallel_size=2, cp_method="ring"), mutation=sink_per_tile,
                  label="cp2 ring, sink per tile")
    runs = run_parity([*cases, mutant], 2, env={"TRITON_INTERPRET": "0"})  # PyTorch tiles: the kernel has its own
    for run in runs[:-1]:
        assert_parity(run)
    with pytest.raises(AssertionError, match=r"batch 0 rank \d: loss .* != single-process"):
        assert_parity(runs[-1])


def test_gpt_oss_under_the_hybrid_cp_equals_one_process():
    """cp4 ulysses+ring as 2 x 2: each rank's sinks its Ulysses head group's, joined once to the rows the ring merged,
    as one process over 3 steps; the sink joined to each tile instead is caught at the first loss. Plain SGD: step 0's
    gradients agree to ~3e-7 under every method, but AdamW's sign-like first updates grow that fp32 noise in the
    near-zero sink gradients to ~1.3e-5 by step 2 on this grid (the ring's 6.6e-6), past the harness's 1e-5. The
    tiles by the PyTorch reference (the interpreted Triton kernel gives the same, in 40 s on 2 cores, not 5)."""
    hybrid = partial(ComposedStrategy, context_parallel_size=4, cp_method=cp.HYBRID, ulysses_size=2)
    runs = run_parity([Case(hybrid, model=DENSE, label="cp4 ulysses+ring (2 x 2)"),
                       Case(hybrid, model=DENSE, steps=1, mutation=sink_per_tile,
                            label="cp4 ulysses+ring (2 x 2), sink per tile")], 4, env={"TRITON_INTERPRET": "0"})
    assert_parity(runs[0])
    with pytest.raises(AssertionError, match=r"batch 0 rank \d: loss .* != single-process"):
        assert_parity(runs[1])


def test_what_has_no_sinks_or_yarn_refuses_in_one_line():
    """The attention kernel (no sinks) and the rope kernel (no YaRN attention factor) refuse a gpt-oss model."""
    from lit_lm import kernels
    from lit_lm.config import ModelConfig
    from lit_lm.model import Transformer
    from lit_lm.module import LanguageModel

    with pytest.raises(ConfigError, match=r"attention kernel has no attention sinks .*config\.attn_sinks"):
        LanguageModel(ModelConfig(**GPT_OSS), kernels=["attention"]).configure_model()
    with pytest.raises(ValueError, match="YaRN's attention factor"):
        kernels.apply(Transformer(ModelConfig(**GPT_OSS)), ["rope"])


def test_imported_gpt_oss_under_layouts_reads_each_ranks_share(tmp_path):
    """A gpt-oss folder's first step under zero3, tp2 and ep2 equals one process, and ep2 from its MXFP4 copy too;
    each rank read its share of the bytes: under ZeRO-3 the two ranks together every byte once, under ep2 the
    dense parameters and half of the experts (strided reads: a gate's rows only, not the up's between), under tp2
    half of what tp splits and whatever it replicates (norms, the MoE blocks, `wo`'s bias)."""
    from test_hf_import import BytesRead

    plain = _folder(tmp_path)
    _mxfp4_folder(plain, tmp_path / "mxfp4")
    case = partial(Case, steps=1, callbacks=(BytesRead(),))
    runs = run_parity([case(partial(ZeroStrategy, stage=3), init_from=str(plain), label="zero3"),
                       case(partial(TensorParallelStrategy, 2, sequence_parallel=False), init_from=str(plain),
                            label="tp2"),
                       case(partial(ExpertParallelStrategy, expert_parallel_size=2), init_from=str(plain), label="ep2"),
                       case(partial(ExpertParallelStrategy, expert_parallel_size=2), init_from=str(tmp_path / "mxfp4"),
                            label="ep2 mxfp4")], 2)
    for run in runs:
        assert_parity(run)
    read = {run["case"].label: [r["callbacks"][0].read for r in run["ranks"]] for run in runs}

    def nbytes(keep=lambda name: True) -> int:
        return sum(p.numel() * p.element_size() for n, p in load_model(plain).named_parameters() if keep(n))

    whole, experts = nbytes(), nbytes(lambda n: ".experts." in n)
    assert sum(read["zero3"]) == whole and max(read["zero3"]) < 0.6 * whole, read
    assert read["ep2"] == [whole - experts // 2] * 2, read
    replicated = nbytes(lambda n: "norm" in n or ".mlp." in n or n.endswith("wo.bias"))
    assert read["tp2"] == [(whole - replicated) // 2 + replicated] * 2, read
