"""QAT and k-means: fake quantization is quantize-dequantize maths with a clipped straight-through gradient,
observers survive a resume, the exported integer model matches the fake-quant logits, and bad bit widths fail."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from callbacks.compress import QAT, KMeansQuantization
from callbacks.compress.core import DEFAULT_EXCLUDE, select
from callbacks.compress.qat import act_qparams, fake_quant_act, fake_quant_weight, model_bytes, weight_scale
from dist_utils import TinyLM, fit_tiny, token_data
from lit_lm.config import ConfigError
from strategies.base import whole_weights


@pytest.mark.parametrize("bits, group_size", [(8, None), (4, 8), (2, 4)])
def test_fake_quant_weight_is_quantize_dequantize(bits: int, group_size: int | None) -> None:
    w = torch.randn(6, 16, generator=torch.Generator().manual_seed(bits))
    scale = weight_scale(w, bits, group_size)
    groups = w.view(6, -1, group_size or 16)
    amax = groups.abs().amax(-1, keepdim=True)
    qmax = 2 ** (bits - 1) - 1
    expected = (torch.round(groups / (amax / qmax)).clamp(-qmax - 1, qmax) * (amax / qmax)).view(6, 16)
    torch.testing.assert_close(fake_quant_weight(w, scale, bits), expected)


def test_ste_gradient_is_identity_inside_the_range_and_zero_outside() -> None:
    scale, zero_point = act_qparams(-1.0, 1.0)
    x = torch.tensor([-3.0, -0.5, 0.0, 0.3, 0.99, 2.0], requires_grad=True)
    fake_quant_act(x, scale, zero_point).sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    w = torch.randn(4, 8, requires_grad=True)
    fake_quant_weight(w, weight_scale(w, 4), 4).mul(torch.arange(8.0)).sum().backward()
    assert torch.equal(w.grad, torch.arange(8.0).expand(4, 8))  # absmax scales: every weight is in range


@pytest.mark.parametrize("bits, group_size", [(8, None), (4, 8)])
def test_observers_resume_and_export_matches_fake_quant(tmp_path: Path, bits: int, group_size: int | None) -> None:
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
        exported = lm.model(x)
    torch.testing.assert_close(exported, fake, rtol=1e-4, atol=1e-4)
    assert model_bytes(lm) < dense_bytes


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
