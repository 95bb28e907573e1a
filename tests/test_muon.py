"""lit_lm.optim.Muon on one process is torch's own optimizers, bit for bit: `torch.optim.Muon` on the matrices (each
expert of an MoE stack a matrix of its own), `torch.optim.AdamW` on the rest; and the orthogonalizer's pieces."""

from __future__ import annotations


import pytest
import torch
from torch import nn

from lit_lm.config import ModelConfig
from lit_lm.model import Transformer
from lit_lm.optim import Muon
from lit_lm.param_groups import param_groups
from lit_lm.parity import MOE, token_data
from lit_lm.strategies import orthogonalize
from lit_lm.strategies.newton_schulz import NewtonSchulz
from lit_lm.strategies.orthogonalize import Unit, assign_owners, chunk, long_cut, ns_flops

STEPS = 4
HP = dict(lr=0.02, weight_decay=0.1, momentum=0.9)
ADAMW = dict(adamw_lr=3e-3, adamw_betas=(0.9, 0.95), adamw_eps=1e-8)


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**MOE).resolved())


def _train(model: nn.Module, step: callable) -> list[float]:
    data = token_data(4 * STEPS, MOE["max_seq_len"])
    losses = []
    for batch in data.view(STEPS, 4, -1):
        model.zero_grad(set_to_none=True)
        loss = model.loss(batch[:, :-1], batch[:, 1:])[0]
        loss.backward()
        step()
        losses.append(loss.item())
    return losses


def _torch_reference(model: Transformer, adjust: str | None, nesterov: bool) -> callable:
    """torch.optim.Muon on 2-D matrices: each expert slice of a stack is copied into a 2-D Parameter whose gradient
    is the slice's, stepped, and copied back; torch.optim.AdamW on the other groups."""
    groups = param_groups(model, HP["weight_decay"], model.config.tie_embeddings, split_matrices=True)
    matrices, rest = groups[0]["params"], groups[1:]
    slices = {p: [nn.Parameter(p.detach()[e].clone()) for e in range(p.shape[0])] for p in matrices if p.ndim == 3}
    flat = [q for p in matrices for q in (slices[p] if p in slices else [p])]
    muon = torch.optim.Muon(flat, adjust_lr_fn=adjust, nesterov=nesterov, **HP)
    adamw = torch.optim.AdamW([dict(g, lr=ADAMW["adamw_lr"]) for g in rest], betas=ADAMW["adamw_betas"],
                              eps=ADAMW["adamw_eps"])

    def step() -> None:
        for p, qs in slices.items():
            for e, q in enumerate(qs):
                q.grad = p.grad[e].clone()
        muon.step()
        adamw.step()
        with torch.no_grad():
            for p, qs in slices.items():
                p.copy_(torch.stack([q.detach() for q in qs]))

    return step


@pytest.mark.parametrize("adjust,nesterov", [(None, True), ("match_rms_adamw", True), ("original", False)])
def test_one_process_muon_is_torch_muon_plus_adamw_bit_for_bit(adjust: str | None, nesterov: bool) -> None:
    ours, theirs = _model(), _model()
    theirs.load_state_dict(ours.state_dict())
    groups = param_groups(ours, HP["weight_decay"], ours.config.tie_embeddings, split_matrices=True)
    optimizer = Muon(groups, adjust_lr_fn=adjust, nesterov=nesterov, **HP, **ADAMW)
    assert [p.ndim for p in groups[0]["params"]].count(3) == 3  # the expert stacks are in the Muon group
    got = _train(ours, optimizer.step)
    expected = _train(theirs, _torch_reference(theirs, adjust, nesterov))
    assert got == expected
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(ours.blocks["1"].mlp.experts.w_up, _model().blocks["1"].mlp.experts.w_up)  # it trained
    assert set(optimizer.state[groups[0]["params"][0]]) == {"momentum_buffer"}


def test_an_expert_stack_is_orthogonalized_slice_by_slice_not_as_one_matrix() -> None:
    torch.manual_seed(0)
    stack = torch.randn(4, 16, 32)
    ns = orthogonalize_ns()
    got = orthogonalize.orthogonalize_whole(stack, ns)
    assert all(torch.equal(got[e], ns(stack[e])) for e in range(4))
    assert not torch.equal(got.reshape(64, 32), ns(stack.reshape(64, 32)))  # what the stack as one would be


def orthogonalize_ns() -> callable:
    from functools import partial

    from torch.optim._muon import _zeropower_via_newtonschulz
    return partial(_zeropower_via_newtonschulz, ns_coefficients=(3.4445, -4.7750, 2.0315), ns_steps=5, eps=1e-7)


def test_a_bf16_cast_before_the_gather_leaves_newton_schulz_bit_identical() -> None:
    """The owner reassembles bfloat16 pieces: NS of that is NS of the fp32 matrix (its first op is the cast)."""
    torch.manual_seed(1)
    for shape in [(48, 16), (16, 48)]:
        u = torch.randn(shape)
        pieces = [p.bfloat16() for p in u.chunk(3, dim=0)]
        assert torch.equal(orthogonalize_ns()(torch.cat(pieces)), orthogonalize_ns()(u))


COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz_fp64(g: torch.Tensor) -> torch.Tensor:
    """The iteration as written (module docstring of lit_lm/strategies/newton_schulz.py), in float64."""
    a, b, c = COEFFICIENTS
    x = g.double().T if g.shape[0] > g.shape[1] else g.double()
    x = x / x.norm()
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (32, 32), (3, 1)])
def test_newton_schulz_is_torch_s_in_bfloat16_bit_for_bit_and_the_iteration_in_float32(shape: tuple) -> None:
    from torch.optim._muon import _zeropower_via_newtonschulz

    torch.manual_seed(2)
    g = torch.randn(shape)
    bf16, fp32 = NewtonSchulz(COEFFICIENTS, 5, 1e-7), NewtonSchulz(COEFFICIENTS, 5, 1e-7, torch.float32)
    assert torch.equal(bf16(g), _zeropower_via_newtonschulz(g, COEFFICIENTS, 5, 1e-7))
    exact = newton_schulz_fp64(g)
    assert fp32(g).dtype == torch.float32 and (fp32(g).double() - exact).norm() <= 1e-5 * exact.norm()
    assert (bf16(g).double() - exact).norm() > 1e-3 * exact.norm()  # what the bfloat16 rounding costs
    held = g.clone()
    fp32(g)
    assert torch.equal(g, held)  # its input is not written to (an fp32 update may be the momentum itself)


def test_muon_with_float32_newton_schulz_steps_with_the_float32_iteration() -> None:
    torch.manual_seed(3)
    w = nn.Parameter(torch.randn(24, 40))
    w.grad = torch.randn(24, 40)
    before, grad = w.detach().clone(), w.grad.clone()
    Muon([{"params": [w], "matrix": True}], lr=0.02, weight_decay=0.1, momentum=0.9, ns_dtype="float32").step()
    update = grad.lerp(grad * 0.1, 0.9)  # nesterov on a fresh buffer: B = 0.1 G, U = G.lerp(B, 0.9)
    expected = (1 - 0.02 * 0.1) * before.double() - 0.02 * newton_schulz_fp64(update)
    assert (w.detach().double() - expected).norm() <= 1e-7 * expected.norm()


def test_gram_mode_takes_the_long_cuts_and_a_whole_tp_column_of_owners() -> None:
    assert long_cut((16, 48), 1) and long_cut((48, 16), 0) and long_cut((32, 32), 1)  # NS's X: rows <= cols
    assert not long_cut((16, 48), 0) and not long_cut((48, 16), 1) and not long_cut((32, 32), 0)
    dp = orthogonalize.Level(None, "dp", 0, 8, 2, 0)  # type: ignore[arg-type]
    tp = orthogonalize.Level(None, "tp", 1, 8, 2, 0)  # type: ignore[arg-type]
    units = [Unit(0, None, (32, 128), (dp, tp), gram=True), Unit(1, None, (32, 128), (dp, tp), gram=True),
             Unit(2, None, (32, 64), (dp, tp))]
    assign_owners(units)
    # each Gram matrix: one dp coordinate, every tp rank (None); the two apart; the owner one where load is least
    assert [u.owners for u in units] == [(0, None), (1, None), (0, 0)]
    assert units[0].rank_flops == ns_flops((32, 128), 2) == 4 * 32 * 32 * 64 + 2 * 32 ** 3 < units[0].flops


def test_owners_are_balanced_by_newton_schulz_flops() -> None:
    level = orthogonalize.Level(None, "dp", 0, 8, 2, 0)  # type: ignore[arg-type]
    units = [Unit(i, None, shape, (level,)) for i, shape in enumerate([(128, 32), (32, 32), (32, 128), (32, 32)])]
    assign_owners(units)
    load = [sum(u.flops for u in units if u.owners == (r,)) for r in range(2)]
    assert [u.owners for u in units] == [(0,), (0,), (1,), (1,)]  # two big ones apart, the small ones after
    assert load[0] == load[1]
    assert [chunk(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [chunk(2, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_biases_are_no_matrices_and_never_decayed_whatever_their_shape() -> None:
    """gpt-oss's experts' biases are (E, d) stacks of vectors: no decay, and Muon never orthogonalizes them."""
    model = Transformer(ModelConfig(**dict(MOE, moe_biases=True, qkv_bias=True)).resolved())
    names = {p: n for n, p in model.named_parameters()}
    biases = {n for n in names.values() if n.endswith(("bias", "_bias"))}
    assert {"blocks.1.mlp.experts.gate_bias", "blocks.0.attn.wq.bias"} <= biases
    for split in (True, False):
        groups = param_groups(model, 0.1, False, split_matrices=split)
        assert {names[p] for p in groups[-1]["params"]} >= biases and groups[-1]["weight_decay"] == 0.0
        assert not any(names[p] in biases for g in groups[:-1] for p in g["params"])


def test_muon_refuses_a_matrix_group_of_vectors_and_bad_settings() -> None:
    with pytest.raises(ValueError, match="matrices"):
        Muon([{"params": [nn.Parameter(torch.zeros(3))], "matrix": True}])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon([nn.Parameter(torch.zeros(3, 3))], adjust_lr_fn="other")
    with pytest.raises(ValueError, match="ns_mode"):
        Muon([nn.Parameter(torch.zeros(3, 3))], ns_mode="grams")
    with pytest.raises(ValueError, match="ns_dtype 'float16': choose one of bfloat16, float32"):
        Muon([nn.Parameter(torch.zeros(3, 3))], ns_dtype="float16")


def test_checkpointed_state_round_trips() -> None:
    model = _model()
    groups = param_groups(model, 0.1, model.config.tie_embeddings, split_matrices=True)
    optimizer = Muon(groups, **HP, **ADAMW)
    _train(model, optimizer.step)
    twin = _model()
    other = Muon(param_groups(twin, 0.1, twin.config.tie_embeddings, split_matrices=True), **HP, **ADAMW)
    other.load_state_dict(optimizer.state_dict())
    assert [g["lr"] for g in other.param_groups] == [0.02, 3e-3, 3e-3]
    assert [g["matrix"] for g in other.param_groups] == [True, False, False]


def test_auto_takes_gram_mode_only_where_it_moves_fewer_bytes() -> None:
    """`auto` weighs Gram's 40 (p-1) m^2 bytes against the owner route's 2 (p-1)/p m n e per step: a wide matrix cut
    along its long side goes by Gram, a transformer's near-square one to an owner; `gram` forces Gram wherever it
    applies; a cut along the short side never goes by Gram."""
    tp = object()  # stands for the tp group: the decision compares identities only

    def goes_by_gram(mode: str, shape: tuple[int, int], dim: int, itemsize: int = 2) -> bool:
        level = orthogonalize.Level(tp, "tp", dim, shape[dim], 2, 0)  # type: ignore[arg-type]
        return orthogonalize.ShardedOrthogonalizer([], lambda _: None, mode, tp, itemsize)._gram(  # type: ignore
            shape, (level,))

    moves_less = orthogonalize.gram_moves_less
    assert moves_less((4, 128), 2, 2) and not moves_less((64, 128), 2, 2)
    assert moves_less((8, 128), 2, 4) and not moves_less((8, 128), 2, 2)  # 320 < 512, 320 > 256
    assert goes_by_gram("auto", (4, 128), 1) and goes_by_gram("auto", (128, 4), 0)  # the long side, either way
    assert not goes_by_gram("auto", (64, 128), 1) and goes_by_gram("gram", (64, 128), 1)
    assert not goes_by_gram("gram", (64, 128), 0) and not goes_by_gram("owner", (4, 128), 1)
    assert goes_by_gram("auto", (8, 128), 1, itemsize=4) and not goes_by_gram("auto", (8, 128), 1, itemsize=2)
