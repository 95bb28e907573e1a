"""The MoE layer (`lit_lm.moe`): routing, balancing losses, capacity, load balancing on a skewed task, upcycling."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from lit_lm.config import ConfigError, ModelConfig
from lit_lm.model import Transformer
from lit_lm.moe import MoE, Router, update_router_bias

ROOT = Path(__file__).resolve().parent.parent


def _config(**moe: object) -> ModelConfig:
    return ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=16,
                       **{"moe_experts": 4, "moe_top_k": 2, "moe_d_ff": 8, **moe})


def _layer(**moe: object) -> MoE:
    torch.manual_seed(0)
    layer = MoE(_config(**moe))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def test_router_top_k_and_renormalised_gates() -> None:
    router = Router(d_model=3, n_experts=4, top_k=2)
    router.weight.data = torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 1], [-1, -1, -1]])
    x = torch.tensor([[3.0, 2.0, 0.0], [0.0, 0.5, 1.0]])
    r = router(x)
    assert r.experts.tolist() == [[0, 1], [2, 1]]
    probs = x.matmul(router.weight.T).softmax(-1)
    expected = probs.gather(-1, r.experts)
    torch.testing.assert_close(r.gates, expected / expected.sum(-1, keepdim=True))
    torch.testing.assert_close(r.gates.sum(-1), torch.ones(2))
    assert r.gates.dtype == torch.float32


def test_bias_changes_selection_not_gates() -> None:
    router = Router(d_model=3, n_experts=4, top_k=2, score="sigmoid")
    router.weight.data = torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 1], [-1, -1, -1]])
    x = torch.tensor([[3.0, 2.0, 0.0]])
    before = router(x)
    router.expert_bias[3] = 10.0  # expert 3 is now always picked
    after = router(x)
    assert before.experts.tolist() == [[0, 1]] and after.experts.tolist() == [[3, 0]]
    scores = x.matmul(router.weight.T).sigmoid()[0]  # the gate comes from the unbiased scores
    chosen = scores[[3, 0]]
    torch.testing.assert_close(after.gates[0], chosen / chosen.sum())


def test_switch_aux_loss_and_z_loss_formulas() -> None:
    layer = _layer(moe_top_k=1, moe_aux_loss=0.1, moe_z_loss=0.01)
    x = torch.randn(32, 16)
    layer(x)
    logits = x.matmul(layer.router.weight.T)
    probs = logits.softmax(-1)
    f = torch.bincount(probs.argmax(-1), minlength=4).float() / 32
    aux = 4 * (f * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).pow(2).mean()
    torch.testing.assert_close(layer.stats["aux"], aux)
    torch.testing.assert_close(layer.stats["z"], z)
    torch.testing.assert_close(layer.aux_loss, 0.1 * aux + 0.01 * z)
    torch.testing.assert_close(layer.stats["max_mean_load"], f.max() * 4)


def test_capacity_drops_exactly_the_over_capacity_tokens() -> None:
    layer = _layer(moe_top_k=1, moe_capacity_factor=0.5)  # capacity = ceil(0.5 * 10 * 1 / 4) = 2
    layer.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 100.0, 0.0]))  # every token picks expert 2
    x = torch.randn(10, 16)
    out = layer(x)
    assert layer.capacity(10) == 2
    experts = layer.experts
    expert2 = torch.nn.functional.silu(x[:2] @ experts.w_gate[2].T) * (x[:2] @ experts.w_up[2].T) @ experts.w_down[2].T
    torch.testing.assert_close(out[:2], expert2)  # the first two tokens in order, with gate 1 (k = 1)
    assert torch.count_nonzero(out[2:]) == 0
    torch.testing.assert_close(layer.stats["dropped"], torch.tensor(0.8))


def test_dropped_rows_cannot_poison_the_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouped matmul leaves the rows past the kept ones uninitialised: any bit pattern, NaN included (seen after
    bf16 work in the same process). They are masked before the gates multiply them, so no gradient is 0 x NaN."""
    real = torch._grouped_mm

    def garbage_past_the_groups(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        out = real(a, b, offs=offs)
        rows = torch.arange(out.shape[0])[:, None]
        return torch.where(rows >= offs[-1], torch.full_like(out, float("nan")), out)

    monkeypatch.setattr(torch, "_grouped_mm", garbage_past_the_groups)
    layer = _layer(moe_top_k=1, moe_capacity_factor=0.5)
    layer.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 100.0, 0.0]))  # 8 of 10 tokens dropped
    x = torch.randn(10, 16, requires_grad=True)
    layer(x).sum().backward()
    for name, p in [("x", x), *layer.named_parameters()]:
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def _skewed_run(**balancing: object) -> tuple[float, float]:
    """A regression through one MoE layer (k=1, so only balancing moves the router) on inputs that share a
    direction the router initially prefers: (max/mean load at the start, mean over the last 10 steps)."""
    layer = _layer(moe_top_k=1, **balancing)
    gen = torch.Generator().manual_seed(1)
    u = torch.randn(16, generator=gen)
    with torch.no_grad():
        layer.router.weight[0] += 0.2 * u  # expert 0 wins for most tokens
    x = torch.randn(256, 16, generator=gen) + u
    target = torch.randn(256, 16, generator=gen)
    optimizer = torch.optim.Adam(layer.parameters(), lr=3e-2)
    loads = []
    for _ in range(60):
        loss = (layer(x) - target).pow(2).mean() + layer.aux_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        update_router_bias(layer)
        loads.append(float(layer.stats["max_mean_load"]))
    return loads[0], sum(loads[-10:]) / 10


def test_balancing_on_a_skewed_task() -> None:
    start, unbalanced = _skewed_run()
    _, aux_loss = _skewed_run(moe_aux_loss=0.1)
    _, aux_free = _skewed_run(moe_bias_update=0.02, moe_score="sigmoid")  # DeepSeek-V3's pairing
    assert start > 3.0 and unbalanced > 3.0  # 4 = everything on one expert, 1 = uniform
    assert aux_loss < 1.5, aux_loss
    assert aux_free < 1.5, aux_free


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"`moe_top_k`=3 must be <= `moe_experts`=2"):
        _config(moe_experts=2, moe_top_k=3)
    with pytest.raises(ConfigError, match=r"`moe_score`"):
        _config(moe_score="relu")
    with pytest.raises(ConfigError, match=r"`moe_capacity_factor`"):
        _config(moe_capacity_factor=0.0)
    with pytest.raises(ConfigError, match=r"no block is MoE"):
        _config(moe_first_dense=2)


def test_layer_placement_and_init() -> None:
    model = Transformer(_config(moe_first_dense=1, moe_shared_experts=1))
    assert not isinstance(model.blocks["0"].mlp, MoE) and isinstance(model.blocks["1"].mlp, MoE)
    params = dict(model.named_parameters())
    std = model.config.init_std
    assert params["blocks.1.mlp.experts.w_gate"].std().item() == pytest.approx(std, rel=0.1)
    assert params["blocks.1.mlp.experts.w_down"].std().item() == pytest.approx(std / math.sqrt(4), rel=0.1)
    assert params["blocks.1.mlp.router.weight"].std().item() == pytest.approx(std / 10, rel=0.2)
    assert "blocks.1.mlp.router.expert_bias" in model.state_dict()  # checkpointed
    assert list(model.expert_plan()) == ["blocks.1.mlp.experts"]


def test_upcycled_model_computes_the_dense_function() -> None:
    spec = importlib.util.spec_from_file_location("upcycle", ROOT / "scripts" / "upcycle.py")
    upcycle = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(upcycle)
    dense_config = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, max_seq_len=16)
    dense = Transformer(dense_config)
    moe_config = ModelConfig(**{**dense_config.__dict__, "moe_experts": 4, "moe_top_k": 2,
                                "moe_d_ff": dense_config.d_ff})
    moe = Transformer(moe_config)
    moe.load_state_dict(upcycle.upcycle_state_dict(dense.state_dict(), moe_config))
    idx = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(moe(idx), dense(idx), rtol=1e-5, atol=1e-5)
