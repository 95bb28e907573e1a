"""Transformer: shapes, causality, GQA, RoPE, sliding window, init, loss, config errors."""

import math

import pytest
import torch

from lit_lm.config import ConfigError, ModelConfig
from lit_lm.generate import generate
from lit_lm.model import KVCache, LMLoss, RotaryEmbedding, Transformer


def tiny(**overrides) -> ModelConfig:
    cfg = dict(vocab_size=61, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
    cfg.update(overrides)
    return ModelConfig(**cfg)


def test_shapes_and_padded_vocab():
    torch.manual_seed(0)
    model = Transformer(tiny())
    idx = torch.randint(0, 61, (3, 17))
    logits = model(idx)
    assert logits.shape == (3, 17, 64)  # 61 padded to a multiple of 64
    assert model.config.num_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 4}, {"n_kv_heads": 1, "qk_norm": True}])
def test_causal_masking(overrides):
    """Changing the token at position t changes no logits before t, and does change logits at t."""
    torch.manual_seed(0)
    model = Transformer(tiny(**overrides)).eval()
    idx = torch.randint(0, 61, (2, 20))
    t = 11
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % 61
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)
    assert (a[:, t] - b[:, t]).abs().max() > 1e-4


def test_sliding_window_limits_receptive_field():
    """With one layer and window w, position t sees tokens t-w+1..t only."""
    torch.manual_seed(0)
    w = 3
    model = Transformer(tiny(n_layers=1, sliding_window=w)).eval()
    idx = torch.randint(0, 61, (1, 16))
    changed = idx.clone()
    changed[:, 5] = (changed[:, 5] + 7) % 61
    diff = (model(idx) - model(changed)).abs().amax(dim=-1)[0]
    assert torch.all(diff[5: 5 + w] > 1e-5)
    assert torch.all(diff[5 + w:] == 0) and torch.all(diff[:5] == 0)


def test_gqa_matches_mha_with_repeated_kv_heads():
    torch.manual_seed(0)
    gqa = Transformer(tiny(n_heads=4, n_kv_heads=2))
    mha = Transformer(tiny(n_heads=4, n_kv_heads=4))
    state = gqa.state_dict()
    group, hd, d = 2, gqa.config.head_dim, gqa.config.d_model
    for key in list(state):
        if key.endswith(("attn.wk.weight", "attn.wv.weight")):
            state[key] = state[key].view(2, hd, d).repeat_interleave(group, dim=0).reshape(4 * hd, d)
    mha.load_state_dict(state)
    idx = torch.randint(0, 61, (2, 13))
    torch.testing.assert_close(gqa(idx), mha(idx), rtol=1e-5, atol=1e-5)


def test_rope_depends_on_relative_position_only():
    rope = RotaryEmbedding(head_dim=16, theta=10000.0)
    torch.manual_seed(0)
    q = torch.randn(1, 1, 1, 16)
    k = torch.randn(1, 1, 1, 16)

    def score(tq: int, tk: int) -> float:
        cq, sq = rope.cos_sin(1, q.device, offset=tq)
        ck, sk = rope.cos_sin(1, k.device, offset=tk)
        return float((rope.rotate(q, cq, sq) * rope.rotate(k, ck, sk)).sum())

    assert math.isclose(score(7, 3), score(107, 103), rel_tol=1e-4)
    assert math.isclose(score(5, 5), float((q * k).sum()), rel_tol=1e-5)  # same position: no net rotation
    assert not math.isclose(score(7, 3), score(7, 5), rel_tol=1e-3)


def test_init_is_a_function_of_name_and_seed():
    torch.manual_seed(3)
    a = Transformer(tiny())
    torch.manual_seed(3)
    with torch.device("meta"):
        b = Transformer(tiny())
    assert b.tok_embeddings.weight.is_meta
    b = b.to_empty(device="cpu")
    for name, p in reversed(list(b.named_parameters())):  # any order gives the same values
        b.init_parameter(name, p)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
    torch.manual_seed(4)
    c = Transformer(tiny())
    assert not torch.equal(a.tok_embeddings.weight, c.tok_embeddings.weight)


def test_scaled_init_of_output_projections():
    torch.manual_seed(0)
    cfg = tiny(d_model=128, n_layers=8, n_heads=4)
    model = Transformer(cfg)
    wo = model.blocks["0"].attn.wo.weight
    wq = model.blocks["0"].attn.wq.weight
    assert abs(wq.std().item() - 0.02) < 2e-3
    assert abs(wo.std().item() - 0.02 / math.sqrt(16)) < 5e-4
    assert torch.all(model.norm.weight == 1)


def test_tied_embeddings_share_one_parameter():
    model = Transformer(tiny(tie_embeddings=True))
    assert model.lm_head.weight is model.tok_embeddings.weight
    assert model.config.num_params() == sum(p.numel() for p in model.parameters())


def test_loss_is_fp32_ce_plus_z_loss():
    torch.manual_seed(0)
    model = Transformer(tiny(z_loss=1e-2))
    idx = torch.randint(0, 61, (2, 9))
    targets = torch.randint(0, 61, (2, 9))
    targets[0, :3] = -100
    loss, ce = model.loss(idx, targets)
    logits = model(idx).reshape(-1, 64).double()
    valid = targets.reshape(-1) != -100
    t = targets.reshape(-1)[valid]
    lse = torch.logsumexp(logits[valid], -1)
    ref_ce = (lse - logits[valid].gather(1, t[:, None])[:, 0]).mean()
    torch.testing.assert_close(ce.double(), ref_ce, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss.double(), ref_ce + 1e-2 * lse.pow(2).mean(), rtol=1e-5, atol=1e-6)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_z_loss_has_no_data_dependent_shape():
    """The z-loss over the non-ignored targets is a mask, not `logits[valid]`: boolean indexing is a nonzero, a host
    sync in every step on an accelerator (chat data's -100 targets). The meta device refuses data-dependent ops."""
    logits, targets = torch.empty(2, 9, 64, device="meta"), torch.empty(2, 9, dtype=torch.long, device="meta")
    loss, _ = LMLoss(1e-2)(logits, targets)
    assert loss.shape == ()


def test_generate_greedy_is_deterministic():
    torch.manual_seed(0)
    model = Transformer(tiny()).eval()
    prompt = torch.randint(0, 61, (2, 4))
    a = generate(model, prompt, 6, temperature=0.0)
    b = generate(model, prompt, 6, temperature=0.0)
    assert a.shape == (2, 10) and torch.equal(a, b) and torch.equal(a[:, :4], prompt)
    assert int(a.max()) < 61  # padded vocabulary rows are never sampled
    sampled = generate(model, prompt, 6, temperature=1.0, top_k=3, top_p=0.5,
                       generator=torch.Generator().manual_seed(0))
    assert int(sampled.max()) < 61


def test_generate_never_picks_ids_past_the_tokenizer():
    """An imported model may have more embedding rows than its tokenizer has ids (Qwen2: 151,936 for 151,665):
    with the tokenizer's size given, those rows are never chosen, even when their logits are the largest."""
    torch.manual_seed(0)
    model = Transformer(tiny()).eval()
    bias = torch.zeros(model.lm_head.out_features)
    bias[50:61] = 1e3  # rows 50.. dominate whatever the input
    model.lm_head.bias = torch.nn.Parameter(bias)
    prompt = torch.randint(0, 50, (2, 4))
    assert int(generate(model, prompt, 4, temperature=0.0)[:, 4:].min()) >= 50  # they win without the cut
    out = generate(model, prompt, 6, temperature=0.0, vocab_size=50)
    assert int(out.max()) < 50
    sampled = generate(model, prompt, 6, temperature=1.0, generator=torch.Generator().manual_seed(0), vocab_size=50)
    assert int(sampled.max()) < 50


@pytest.mark.parametrize("window", [None, 3])
def test_kv_cache_decoding_equals_the_full_forward(window):
    """Logits of each position fed one at a time through the cache (after a prompt) equal the full forward's,
    with GQA and a sliding window shorter than the sequence."""
    torch.manual_seed(0)
    model = Transformer(tiny(n_kv_heads=2, sliding_window=window)).eval()
    idx = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        full = model(idx)
        cache = [KVCache() for _ in model.blocks]
        steps = [model(idx[:, :4], cache=cache)] + [model(idx[:, t: t + 1], cache=cache) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides, field", [
    ({"d_model": 50, "n_heads": 4}, "n_heads"),
    ({"n_heads": 4, "n_kv_heads": 3}, "n_kv_heads"),
    ({"n_layers": 0}, "n_layers"),
    ({"sliding_window": 0}, "sliding_window"),
])
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        tiny(**overrides)


def test_document_masks_are_shared_per_window_and_dropped_with_their_documents():
    """One mask per (documents tensor, window) for all the layers of a forward — alternating window kinds
    (gpt-oss's layer_types) do not make every layer build its own — and none is kept once the rows are gone."""
    import gc
    import weakref

    from lit_lm.model import document_mask

    documents = torch.tensor([[0, 0, 1, 1, 1, 2]])
    full, windowed = document_mask(documents), document_mask(documents, 2)
    assert document_mask(documents) is full and document_mask(documents, 2) is windowed and full is not windowed
    assert torch.equal(windowed[0, 0], full[0, 0] & (torch.arange(6)[:, None] - torch.arange(6)[None, :] < 2))
    assert document_mask(documents.clone()) is not full  # other rows: made anew
    kept = weakref.ref(document_mask(documents))
    del documents, full, windowed
    gc.collect()
    assert kept() is None


def test_rope_row_tables_copy_the_frequencies_to_a_device_once():
    """Per-row tables (cp's reset or balanced positions: new every step) use the frequencies' copy on the positions'
    device made at the first call: a host-to-device copy every step would wait on the accelerator."""
    from lit_lm.model import RotaryEmbedding

    rope = RotaryEmbedding(8)
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    first = rope.row_tables(positions)
    rope.inv_freq = None  # from now on only the per-device copy can serve
    again = rope.row_tables(positions.flip(-1))
    assert all(torch.equal(a.flip(-2), b) for a, b in zip(first, again))
    assert rope.tables(torch.arange(3), torch.device("cpu"))[0].shape == (3, 4)
