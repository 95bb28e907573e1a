"""PTQ: every range method calibrates and quantizes a tiny model; mse's range is the brute-force best, percentile
clips exactly the tails it should, kl clips outliers but keeps a uniform range, bad settings fail by name, and
scripts/ptq.py reads its --weights settings (BITS or BITS:GROUP)."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from lit_lm.callbacks.compress.ptq import METHODS, PTQ, candidate_ranges, choose_range, mse_weight_scale
from lit_lm.callbacks.compress.qat import ACT_QMAX, IntLinear, export_act, fake_quant_weight, weight_scale
from dist_utils import TinyLM, token_data
from lit_lm.config import ConfigError
from test_qat import assert_no_pair_saturates


def _tiny() -> TinyLM:
    torch.manual_seed(0)
    lm = TinyLM()
    lm.configure_model()
    return lm.eval()


def _loss(lm: TinyLM, batches: list[torch.Tensor]) -> float:
    with torch.no_grad():
        return sum(float(lm.model.loss(b[:, :-1], b[:, 1:])[1]) for b in batches) / len(batches)


@pytest.mark.parametrize("method", METHODS)
def test_each_method_calibrates_and_quantizes_a_tiny_model(method: str) -> None:
    lm = _tiny()
    calib, val = list(token_data(16, seed=1).split(4)), list(token_data(8, seed=2).split(4))
    seen: dict[str, list[float]] = {}  # the true extremes of each linear's input
    for name, module in lm.named_modules():
        if name.endswith(("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")):
            module.register_forward_pre_hook(lambda m, a, n=name: seen.setdefault(n, []).extend(
                [float(a[0].min()), float(a[0].max())]))
    float_loss = _loss(lm, val)
    seen.clear()
    ptq = PTQ(bits=8, method=method, percentile=99.0, bins=1024)  # (the default 4096 costs kl 4x the time here)
    ranges = ptq.calibrate(lm, lambda b: lm.model(b[:, :-1]), calib)
    assert ranges.keys() == seen.keys() and len(ranges) == 2 * 7
    for name, (lo, hi) in ranges.items():
        true_lo, true_hi = min(seen[name]), max(seen[name])
        if method == "minmax":
            assert (lo, hi) == (true_lo, true_hi)
        else:  # inside the observed range, and a real range
            assert true_lo - 1e-6 <= lo < hi <= true_hi + 1e-6
    ptq.convert(lm)
    assert sum(isinstance(m, IntLinear) for m in lm.modules()) == 14
    assert assert_no_pair_saturates(lm.model, val[0][:, :-1]) == 14  # 7-bit codes: fbgemm's AVX2 pairs fit int16
    quant_loss = _loss(lm, val)
    assert math.isfinite(quant_loss) and abs(quant_loss - float_loss) < 0.05 * float_loss


def test_mse_range_is_the_brute_force_best() -> None:
    """A bulk of 500 values seen 1000 times each (a histogram's counts) and one outlier seen once."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(500, generator=gen), torch.tensor([30.0])]).double()
    counts = torch.cat([torch.full((500,), 1000.0), torch.ones(1)]).double()
    best, best_err = None, math.inf
    for lo, hi in candidate_ranges(float(x.min()), float(x.max()), 12).tolist():  # every candidate, one at a time
        scale, zero = export_act(lo, hi)
        err = float(((torch.fake_quantize_per_tensor_affine(x, scale, zero, 0, ACT_QMAX) - x).pow(2) * counts).sum())
        if err < best_err:
            best, best_err = (lo, hi), err
    assert choose_range(x, counts, "mse", grid=12) == pytest.approx(best, abs=1e-12)
    assert best[1] < 20.0  # the outlier is clipped: it is not worth its share of the grid
    assert choose_range(x[:500], counts[:500], "mse", grid=12)[1] == float(x[:500].max())  # nothing to clip


def test_percentile_clips_exactly_the_tails() -> None:
    x = torch.randperm(1000, generator=torch.Generator().manual_seed(0)).double()  # 0 .. 999
    lo, hi = choose_range(x, torch.ones_like(x), "percentile", percentile=99.0)
    assert (lo, hi) == (10.0, 989.0)
    assert int((x < lo).sum()) == int((x > hi).sum()) == 10  # 1% clipped on each side
    values, counts = torch.arange(4.0), torch.tensor([1.0, 97.0, 1.0, 1.0])  # weighted: 1% in each tail point
    assert choose_range(values, counts, "percentile", percentile=99.0) == (1.0, 2.0)


def test_kl_clips_outliers_but_keeps_a_uniform_range() -> None:
    gen = torch.Generator().manual_seed(0)
    heavy = torch.cat([torch.randn(20000, generator=gen), torch.tensor([60.0, -40.0])])
    centres = torch.linspace(-40, 60, 2048, dtype=torch.float64)
    counts = torch.histc(heavy.double(), 2048, -40, 60)
    lo, hi = choose_range(centres, counts, "kl")
    assert -40 < lo < -3 and 3 < hi < 60  # outliers clipped, the bulk kept
    uniform = torch.linspace(-1, 1, 2048, dtype=torch.float64)
    lo, hi = choose_range(uniform, torch.ones_like(uniform), "kl")
    assert lo < -0.9 and hi > 0.9  # nothing to clip


def test_mse_weight_scale_never_loses_to_absmax() -> None:
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    for bits, group_size in ((8, None), (4, 8), (3, None)):
        absmax, mse = weight_scale(w, bits, group_size), mse_weight_scale(w, bits, group_size)
        rows = w.reshape(*absmax.shape, -1)
        err = [(fake_quant_weight(rows, s, bits) - rows).pow(2).sum(-1) for s in (absmax, mse)]
        assert (err[1] <= err[0]).all() and (mse <= absmax).all()
        if bits == 3:  # at low bits clipping a Gaussian's tail pays
            assert (err[1] < err[0]).any()


@pytest.mark.parametrize("kwargs, field", [({"bits": 2}, "bits"), ({"method": "max"}, "method"),
                                           ({"percentile": 10.0}, "percentile")])
def test_bad_settings(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=f"PTQ.{field}"):
        PTQ(**kwargs)


def test_ptq_script_reads_weight_settings() -> None:
    from test_compress_report import load_script

    setting = load_script("ptq").weight_setting
    assert setting("8") == (8, None) and setting("4:32") == (4, 32)
    with pytest.raises(argparse.ArgumentTypeError, match="--weights takes BITS or BITS:GROUP"):
        setting("int4")
