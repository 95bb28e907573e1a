"""QAT and k-means: fake quantization is quantize-dequantize maths with a clipped straight-through gradient,
observers survive a resume, the exported integer model matches the fake-quant logits, and bad bit widths fail.
Ternary (TWN, TTQ) and binary codes and scales equal a hand computation, TTQ's scales take the loss's gradient,
and their export is packed to 2 and 1 bits. The int8 kernel's sums equal an exact int32 reference, and equal the
AVX2 kernel's saturating pair sums too (emulated here, so this holds on every host): nothing can saturate."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn

from lit_lm.callbacks.compress import QAT, KMeansQuantization
from lit_lm.callbacks.compress.core import DEFAULT_EXCLUDE, select
from lit_lm.callbacks.compress.qat import ACT_QMAX, IntLinear, act_qparams, binary_codes, export_act, fake_quant_act, \
    fake_quant_weight, model_bytes, quantize_act, quantize_weight, ttq_codes, twn_codes, weight_scale
from dist_utils import TinyLM, fit_tiny, token_data
from lit_lm.config import ConfigError
from lit_lm.strategies.base import whole_weights


@pytest.mark.parametrize("bits, group_size", [(8, None), (4, 8), (3, 4)])
def test_fake_quant_weight_is_quantize_dequantize(bits: int, group_size: int | None) -> None:
    w = torch.randn(6, 16, generator=torch.Generator().manual_seed(bits))
    scale = weight_scale(w, bits, group_size)
    groups = w.view(6, -1, group_size or 16)
    amax = groups.abs().amax(-1, keepdim=True)
    qmax = 2 ** (bits - 1) - 1
    expected = (torch.round(groups / (amax / qmax)).clamp(-qmax - 1, qmax) * (amax / qmax)).view(6, 16)
    torch.testing.assert_close(fake_quant_weight(w, scale, bits), expected)


def avx2_pair_sums(codes: Tensor, w: Tensor) -> Tensor:
    """(n, out) int64: what fbgemm's AVX2 kernel (x86 without VNNI) accumulates for uint8 activation codes (n, k)
    and int8 weight codes (out, k). vpmaddubsw multiplies them bytewise and adds each pair of neighbouring products
    (inputs 2j, 2j + 1 of the packed row) in int16 *with saturation*; vpmaddwd then adds the pairs in int32."""
    codes, w = (F.pad(t.to(torch.int64), (0, t.shape[-1] % 2)) for t in (codes, w))
    pairs = (codes[:, None, :] * w[None]).view(codes.shape[0], w.shape[0], -1, 2).sum(-1)
    return pairs.clamp(-2 ** 15, 2 ** 15 - 1).sum(-1)


def int32_sums(codes: Tensor, w: Tensor) -> Tensor:
    """(n, out) int64: the exact sums (VNNI's vpdpbusd accumulates in int32 and saturates nothing)."""
    return codes.to(torch.int64) @ w.to(torch.int64).T


def assert_export_matches(fake: Tensor, exported: nn.Module, x: Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exported model's integer maths (its reference forward) gives the fake-quant output `fake`; fbgemm's kernel
    may round an activation one level away at a rounding boundary (which inputs sit on one depends on the weights,
    and whether it does on the kernel's vector or scalar path, so on the machine): rare, and at that level's size."""
    with torch.no_grad():
        kernel = exported(x)
        with monkeypatch.context() as m:
            m.setattr(IntLinear, "uses_kernel", property(lambda self: False))
            reference = exported(x)
    torch.testing.assert_close(reference, fake, rtol=1e-4, atol=1e-4)
    assert (kernel - fake).abs().mean() < 1e-2 * fake.abs().mean()


def assert_no_pair_saturates(model: nn.Module, x: Tensor) -> int:
    """Run `model(x)` and check, for every `IntLinear`'s input, that the AVX2 pair sums equal the int32 sums (equal
    exactly when no pair saturates, on any host); returns how many layers were checked."""
    checked = []

    def check(linear: IntLinear, args: tuple) -> None:
        codes = quantize_act(args[0].reshape(-1, linear.shape[1]), *linear.act)
        assert 0 <= int(codes.min()) and int(codes.max()) <= ACT_QMAX
        w = torch.cat([part for part, _ in linear._parts()]).reshape(-1, linear.shape[1])  # TTQ: both signs' rows
        assert torch.equal(avx2_pair_sums(codes, w), int32_sums(codes, w))
        checked.append(linear)

    hooks = [m.register_forward_pre_hook(check) for m in model.modules() if isinstance(m, IntLinear)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return len(checked)


def test_activation_range_leaves_every_int16_pair_unsaturated() -> None:
    """The bound itself: 7-bit activation codes times any int8 weight, |a1 w1 + a2 w2| <= 2 * 127 * 128 = 32512 <
    2^15; full-range uint8 codes (255) would reach 65280 and fail here on every machine, not only on AVX2 ones."""
    assert 2 * ACT_QMAX * 128 < 2 ** 15
    lo = torch.tensor([-1.0, -3.0, 0.5, -2.0, 0.0, -1e-3])
    hi = torch.tensor([1.0, 0.1, 4.0, -0.5, 0.0, 1e3])
    scale, zero = act_qparams(lo, hi)
    assert zero.dtype == torch.int32 and ((0 <= zero) & (zero <= ACT_QMAX)).all()
    for s, z, a, b in zip(scale.tolist(), zero.tolist(), lo.tolist(), hi.tolist()):
        x = torch.linspace(min(a, 0.0) * 3 - 1, max(b, 0.0) * 3 + 1, 101)  # far past both ends
        codes = quantize_act(x, s, z)
        assert int(codes.min()) == 0 and int(codes.max()) == ACT_QMAX  # both ends of the grid reached, no further
        w = torch.tensor([[-128, -128], [127, 127], [-128, 127]])
        assert torch.equal(avx2_pair_sums(codes[:, None].expand(-1, 2), w),
                           int32_sums(codes[:, None].expand(-1, 2), w))
    # the emulation does saturate where uint8's full range would: the check above can fail
    full = torch.tensor([[255, 255]])
    assert int(avx2_pair_sums(full, torch.tensor([[-128, -128]]))) == -2 ** 15 != int(int32_sums(full, torch.tensor(
        [[-128, -128]])))


@pytest.mark.parametrize("bits, group_size", [(8, None), (8, 16), (4, 8)])
def test_kernel_equals_the_exact_integer_reference_at_the_extremes(bits: int, group_size: int | None) -> None:
    """Weights at both ends of int`bits` and inputs at (and far past) both ends of the 7-bit grid, on exact grid
    points with power-of-two scales, so that every rounding and the float output are exact: the kernel's output is
    s_x * s_w * (the int32 sum of code products - z_x * the weight codes' sum), and no pair saturated. Inputs past
    the range would reach uint8 codes up to 255 without `IntLinear`'s clamp (a wrong output on every machine)."""
    gen = torch.Generator().manual_seed(bits)
    out, k = 24, 32
    q = 2 ** (bits - 1)
    w = torch.randint(-q, q, (out, k), generator=gen)
    w[0], w[1], w[2, ::2], w[2, 1::2] = -q, q - 1, -q, q - 1  # the largest products of either sign
    groups = k // (group_size or k)
    scale = 2.0 ** -torch.randint(3, 7, (out, groups), generator=gen).float()
    act = export_act(-20 / 16, 107 / 16)  # (hi - lo) / 127 = 1/16 exactly, zero point 20
    assert act == (1 / 16, 20)
    linear = IntLinear(w, scale, bits, act)
    assert linear.uses_kernel
    levels = torch.randint(-60, 300, (40, k), generator=gen)  # uint8 codes the input would have, many past 0..127
    levels[0], levels[1], levels[2] = 255, ACT_QMAX, 0
    x = (levels - act[1]).float() * act[0]  # exact grid points
    codes = quantize_act(x, *act)
    assert torch.equal(codes, levels.clamp(0, ACT_QMAX))
    y = torch.zeros(len(x), out, dtype=torch.float64)
    for g in range(groups):  # per group: the int32 sum of products, the zero point's share, the scales
        cols = slice(g * (k // groups), (g + 1) * (k // groups))
        acc = int32_sums(codes[:, cols], w[:, cols])
        assert torch.equal(avx2_pair_sums(codes[:, cols], w[:, cols]), acc)  # nothing saturates
        y += act[0] * scale[:, g].double() * (acc - act[1] * w[:, cols].sum(1)).double()
    torch.testing.assert_close(linear(x), y.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(linear.reference(x), y.float(), rtol=1e-6, atol=1e-6)


def test_ste_gradient_is_identity_inside_the_range_and_zero_outside() -> None:
    scale, zero_point = export_act(-1.0, 1.0)  # 7 bits: s = 2/127, z = 64, the grid [-64 s, 63 s] ~ [-1.008, 0.992]
    x = torch.tensor([-3.0, -0.5, 0.0, 0.3, 0.99, 2.0], requires_grad=True)
    fake_quant_act(x, scale, zero_point).sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    w = torch.randn(4, 8, requires_grad=True)
    fake_quant_weight(w, weight_scale(w, 4), 4).mul(torch.arange(8.0)).sum().backward()
    assert torch.equal(w.grad, torch.arange(8.0).expand(4, 8))  # absmax scales: every weight is in range


@pytest.mark.parametrize("bits, group_size", [(8, None), (4, 8)])
def test_observers_resume_and_export_matches_fake_quant(tmp_path: Path, bits: int, group_size: int | None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def qat() -> QAT:
        return QAT(bits, group_size=group_size, start_step=1, freeze_observers_step=3)

    first = qat()
    fit_tiny(max_steps=4, callbacks=(first, ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4)))
    resumed = qat()
    out = fit_tiny(max_steps=5, callbacks=(resumed,), ckpt_path=str(tmp_path / "epoch=0-step=4.ckpt"))
    assert first.observers.keys() == resumed.observers.keys() and len(first.observers) == 2 * 7
    for name, observer in first.observers.items():  # frozen since step 3: exactly the saved ranges
        assert torch.equal(resumed.observers[name], observer) and not observer.isnan().any()

    lm = TinyLM()  # the trained weights, fake-quantized with the trained observers
    lm.configure_model()
    lm.load_state_dict(out["params"])
    q = qat()
    q.load_state_dict(resumed.state_dict())
    q.attach(lm, select(whole_weights(lm), None, DEFAULT_EXCLUDE, "QAT"))
    q._step = 5
    lm.eval()
    x = token_data(2)[:, :-1]
    with torch.no_grad():
        fake = lm.model(x)
        dense_bytes = model_bytes(lm)
        q.convert(lm)
        assert_export_matches(fake, lm.model, x, monkeypatch)
    assert model_bytes(lm) < dense_bytes
    assert assert_no_pair_saturates(lm.model, x) == 2 * 7  # the trained ranges, on real inputs


def test_kmeans_shares_weights_and_resumes() -> None:
    km = KMeansQuantization(bits=2, start_step=1)
    out = fit_tiny(max_steps=3, callbacks=(km,))
    for name, codebook in km.codebooks.items():
        values = out["params"][name].unique()
        assert len(values) <= 4 and torch.allclose(values.sort().values, codebook[km.assignments[name].unique()]
                                                   .sort().values)
    again = KMeansQuantization(bits=2)
    again.load_state_dict(km.state_dict())
    assert all(torch.equal(again.assignments[k], v) for k, v in km.assignments.items())


@pytest.mark.parametrize("make", [lambda: QAT(bits=5), lambda: KMeansQuantization(bits=16),
                                  lambda: QAT(group_size=0)])
def test_bad_bits(make) -> None:
    with pytest.raises(ConfigError, match=r"(QAT|KMeansQuantization)\.(bits|group_size)"):
        make()


# -- ternary and binary weights -----------------------------------------------------------------------------------
W = torch.tensor([[0.1, -0.9, 0.5, 0.0], [2.0, -0.2, 0.3, -1.5]])


def test_twn_and_binary_codes_and_scales_by_hand() -> None:
    # TWN row 0: mean|w| = 0.375, threshold 0.2625 keeps -0.9 and 0.5, scale their mean |w| 0.7;
    # row 1: mean 1.0, threshold 0.7 keeps 2.0 and -1.5, scale 1.75
    codes, scale = twn_codes(W)
    assert codes.tolist() == [[0, -1, 1, 0], [1, 0, 0, -1]]
    torch.testing.assert_close(scale, torch.tensor([[0.7], [1.75]]))
    codes, scale = twn_codes(W, group_size=2)  # per group of 2: [0.1, -0.9] -> mean 0.5, threshold 0.35, ...
    assert codes.tolist() == [[0, -1, 1, 0], [1, 0, 0, -1]]
    torch.testing.assert_close(scale, torch.tensor([[0.9, 0.5], [2.0, 1.5]]))
    codes, scale = binary_codes(W)  # sign (0 -> +1), mean |w| per row
    assert codes.tolist() == [[1, -1, 1, 1], [1, -1, 1, -1]]
    torch.testing.assert_close(scale, torch.tensor([[0.375], [1.0]]))
    fake = QAT(bits=1).fake_weight("x", W)
    torch.testing.assert_close(fake, torch.tensor([[0.375, -0.375, 0.375, 0.375], [1.0, -1.0, 1.0, -1.0]]))


def test_ttq_scales_learn_the_loss_gradient() -> None:
    """TTQ (threshold 0.2 * max|w| = 0.4): W_p starts at mean(0.5, 2.0), W_n at mean(0.9, 1.5); one step moves
    each against dL/dW (got by autograd through W_p * P - W_n * N), and the weights' gradient is scaled by W."""
    linear = torch.nn.Linear(4, 2, bias=False)
    linear.weight.data.copy_(W)
    root = torch.nn.ModuleDict({"lin": linear})
    qat = QAT(bits=2, ternary="ttq", ttq_threshold=0.2, scale_lr=0.01, activations=False)
    qat.attach(root, select(whole_weights(root), None, (), "QAT"))
    x, c = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([[1.0, -2.0]])
    (linear(x) * c).sum().backward()
    w_p, w_n = torch.tensor(1.25, requires_grad=True), torch.tensor(1.2, requires_grad=True)
    pos, neg = torch.tensor([[0, 0, 1, 0], [1, 0, 0, 0.0]]), torch.tensor([[0, 1, 0, 0], [0, 0, 0, 1.0]])
    (torch.nn.functional.linear(x, w_p * pos - w_n * neg) * c).sum().backward()
    torch.testing.assert_close(qat.ttq_scales["lin"][0], torch.tensor([1.25, 1.2]))
    dq = (c.T * x.sum(0)).expand(2, 4)  # dL/dq for the weight q
    torch.testing.assert_close(linear.weight.grad, dq * (1.25 * pos + 1.2 * neg + (1 - pos - neg)))
    qat._update_ttq_scales()
    expected = torch.tensor([1.25, 1.2]) - 0.01 * torch.stack([w_p.grad, w_n.grad]).sign()  # Adam's first step
    torch.testing.assert_close(qat.ttq_scales["lin"][0], expected)
    restored = QAT(bits=2, ternary="ttq")
    restored.load_state_dict(qat.state_dict())
    assert torch.equal(restored.ttq_scales["lin"], qat.ttq_scales["lin"])


@pytest.mark.parametrize("kwargs", [{"bits": 2}, {"bits": 2, "ternary": "ttq"}, {"bits": 1},
                                    {"bits": 2, "group_size": 8}])
def test_ternary_and_binary_export_packs_and_matches_fake_quant(kwargs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    lm = TinyLM()
    lm.configure_model()
    qat = QAT(**kwargs)
    qat.attach(lm, select(whole_weights(lm), None, DEFAULT_EXCLUDE, "QAT"))
    x = token_data(2)[:, :-1]
    lm.train()
    lm.model(x)  # observers and TTQ scales from one training forward
    lm.eval()
    with torch.no_grad():
        fake = lm.model(x)
        qat.convert(lm)
        assert_export_matches(fake, lm.model, x, monkeypatch)
    linear = lm.model.blocks["0"].attn.wq
    assert linear.qweight.dtype == torch.uint8 and linear.qweight.numel() == math.ceil(32 * 32 * kwargs["bits"] / 8)
    assert set(linear.codes().unique().tolist()) <= ({-1, 1} if kwargs["bits"] == 1 else {-1, 0, 1})


@pytest.mark.parametrize("name", ["qat_int8", "qat_int4", "qat_ternary", "qat_binary"])
def test_qat_fragments_build(name: str) -> None:
    cfg = yaml.safe_load((Path(__file__).parent.parent / "configs" / "compress" / f"{name}.yaml").read_text())
    (callback,) = cfg["trainer"]["callbacks+"]
    assert callback["class_path"] == "lit_lm.callbacks.compress.QAT"
    assert QAT(**callback["init_args"]).bits == {"qat_int8": 8, "qat_int4": 4, "qat_ternary": 2, "qat_binary": 1}[name]


def _int_linear(bits: int, group_size: int | None, w: Tensor, act: tuple[float, int]) -> IntLinear:
    if bits >= 3:
        scale = weight_scale(w, bits, group_size)
        return IntLinear(quantize_weight(w, scale, bits), scale, bits, act)
    if bits == 1:
        return IntLinear(*binary_codes(w, group_size), 1, act)
    if group_size == 0:  # TTQ: a per-layer threshold, separate positive and negative scales
        return IntLinear(ttq_codes(w, 0.05)[0], torch.tensor([[0.7]]), 2, act, torch.tensor([[1.3]]))
    return IntLinear(*twn_codes(w, group_size), 2, act)


@pytest.mark.parametrize("bits, group_size", [(8, None), (8, 16), (4, 8), (3, None), (2, None), (2, 16), (2, 0),
                                              (1, None)])
def test_export_runs_fbgemm_within_one_activation_level_of_the_integer_reference(bits: int,
                                                                                 group_size: int | None) -> None:
    """Every width (sub-byte codes unpacked to int8, one call per group, TTQ's negative rows apart) on the kernel."""
    gen = torch.Generator().manual_seed(bits)
    w, x = torch.randn(48, 32, generator=gen), torch.randn(4, 16, 32, generator=gen)
    act = export_act(float(x.min()), float(x.max()))
    linear = _int_linear(bits, group_size, w, act)
    assert linear.uses_kernel
    deq = torch.stack([linear.reference(torch.eye(32) * act[0])[:, o] / act[0] for o in range(48)])  # w as exported
    fake = torch.nn.functional.linear(fake_quant_act(x, *act), deq)
    torch.testing.assert_close(linear.reference(x), fake, rtol=1e-5, atol=1e-5)  # exact integer maths
    kernel = linear(x)
    assert len(linear._packed) == (1 if group_size in (None, 0) else 32 // group_size)
    # the kernel's vector and scalar paths may round x one level away from fake quant's x * (1/s): at most one
    # activation level per input, s_x * sum |w| per output (s_x = range / 127: the bound follows the 7-bit level),
    # and rarely, so the mean stays far below it
    bound = act[0] * deq.abs().sum(1)
    assert ((kernel - fake).abs() <= bound + 1e-5).all()
    assert (kernel - fake).abs().mean() < 1e-3 * fake.abs().mean()
    restored = pickle.loads(pickle.dumps(linear))  # the packed weights are dropped and built again
    assert not restored._packed and torch.equal(restored(x), kernel)
