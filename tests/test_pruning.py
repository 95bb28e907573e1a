"""Pruning: the schedule, exact sparsities and N:M patterns, paired structured units and their physical removal,
masks kept on weights and optimizer state through training and a resume, and the bad configurations. Every
compression callback logs its layers' sparsity or bits each step and warns about a start_step the run never
reaches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_lm.callbacks.compress import QAT, KMeansQuantization, Pruning, SparsitySchedule
from lit_lm.callbacks.compress.pruning import magnitude_masks, nm_mask
from dist_utils import TinyLM, fit_tiny
from lit_lm.config import ConfigError


def test_schedule_values() -> None:
    cubic = SparsitySchedule(0.8, 0.2, start_step=10, end_step=20, frequency=5)
    assert cubic(9) == 0.0 and cubic(10) == pytest.approx(0.2) and cubic(20) == cubic(30) == pytest.approx(0.8)
    assert cubic(15) == pytest.approx(0.8 + (0.2 - 0.8) * 0.5 ** 3)
    assert SparsitySchedule(0.8, 0.2, 10, 20, kind="linear")(15) == pytest.approx(0.5)
    assert SparsitySchedule(0.8, 0.2, 10, 20, kind="constant")(11) == 0.8
    assert [s for s in range(30) if cubic.updates_at(s)] == [10, 15, 20]


def test_masks_are_exact() -> None:
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(16, 24, generator=gen), torch.randn(8, 24, generator=gen) * 5]
    per_layer = [magnitude_masks([w], 0.3)[0] for w in ws]
    assert [int((~m).sum()) for m in per_layer] == [round(0.3 * 384), round(0.3 * 192)]
    glob = magnitude_masks(ws, 0.3)
    assert sum(int((~m).sum()) for m in glob) == round(0.3 * 576)
    assert (~glob[0]).sum() > (~glob[1]).sum()  # one threshold: the small-magnitude layer loses more
    nm = nm_mask(ws[0], 2, 4)
    assert (nm.view(16, 6, 4).sum(-1) == 2).all()
    kept = ws[0].abs().view(16, 6, 4)
    assert (kept.masked_fill(~nm.view(16, 6, 4), float("inf")).amin(-1)
            >= kept.masked_fill(nm.view(16, 6, 4), 0).amax(-1)).all()  # the kept two are the largest


def test_training_keeps_masks_and_resumes(tmp_path: Path) -> None:
    def pruning() -> Pruning:
        return Pruning("unstructured", 0.5, start_step=1, end_step=3, frequency=1, scope="global")

    first = pruning()
    fit_tiny(max_steps=4, callbacks=(first, ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4)))
    assert first.sparsity()["all"] == pytest.approx(0.5, abs=1e-4)
    resumed = pruning()
    out = fit_tiny(max_steps=6, callbacks=(resumed,), ckpt_path=str(tmp_path / "epoch=0-step=4.ckpt"))
    assert resumed.masks.keys() == first.masks.keys()
    for name, mask in first.masks.items():  # restored, not recomputed (no update after end_step)
        assert torch.equal(resumed.masks[name], mask)
        assert (out["params"][name][~mask] == 0).all()  # Adam's moments were masked too: nothing regrew
    assert "model.tok_embeddings.weight" not in first.masks


def test_structured_pruning_shrinks_to_an_equivalent_model() -> None:
    pruning = Pruning("structured", 0.5, start_step=2)
    module = TinyLM()
    fit_tiny(max_steps=2, callbacks=(pruning,))
    module.configure_model()
    with torch.no_grad():  # masks on fresh weights: make_permanent must give the masked model's outputs
        for name, p in module.named_parameters():
            if name in pruning.masks:
                p.mul_(pruning.masks[name])
    x = torch.randint(0, 64, (2, 16))
    masked = module.model(x)
    pruning.make_permanent(module)
    mlp, attn = module.model.blocks["0"].mlp, module.model.blocks["0"].attn
    # TINY: d_ff 128 -> 64 hidden units; 2 kv groups of 2 query heads (head_dim 8) -> 1
    assert mlp.w_gate.weight.shape == mlp.w_up.weight.shape == (64, 32) and mlp.w_down.weight.shape == (32, 64)
    assert attn.wq.weight.shape == (16, 32) and attn.wk.weight.shape == (8, 32) and attn.wo.weight.shape == (32, 16)
    torch.testing.assert_close(module.model(x), masked, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs, field", [
    (dict(sparsity=1.0), "sparsity"), (dict(sparsity=-0.1), "sparsity"),
    (dict(method="nm", n=4, m=4), "n=4, m=4"), (dict(include=["*.nothing"]), "include"),
    (dict(method="nm", m=5), "Pruning.m=5"),
])
def test_bad_configs_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        fit_tiny(max_steps=1, callbacks=(Pruning(**kwargs),))


class Logged(L.Callback):
    """The compression metrics logged at each training batch."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()
                           if k.startswith(("sparsity/", "bits/"))})


def test_compression_logs_sparsity_and_bits_every_step_and_warns_about_unreached_starts() -> None:
    logged = Logged()
    prune = Pruning("unstructured", 0.5, start_step=2, include=["*.attn.*"])
    qat = QAT(4, group_size=8, start_step=2, include=["*.mlp.*"])
    km = KMeansQuantization(bits=3, start_step=2, include=["*.blocks.0.attn.wq"])
    with pytest.warns(UserWarning, match="QAT.start_step=9 is past trainer.max_steps=3") as caught:
        fit_tiny(max_steps=3, callbacks=(prune, qat, QAT(8, start_step=9, include=["*.blocks.1.attn.wq"]), km, logged))
    assert not [w for w in caught if "Pruning.start_step" in str(w.message) or "KMeans" in str(w.message)]
    assert len(logged.steps) == 3
    mlp, attn = "model.blocks.0.mlp.w_up", "model.blocks.1.attn.wo"
    assert [s[f"bits/{mlp}"] for s in logged.steps] == [32, 32, 4]  # fake-quant from step 2 (the third batch)
    # pruning and clustering happen after the optimizer step that reaches step 2 (the second batch)
    assert [s.get(f"sparsity/{attn}") for s in logged.steps] == [None, 0.5, 0.5]
    assert [s.get("bits/model.blocks.0.attn.wq") for s in logged.steps] == [32, 3, 3]
    with pytest.warns(UserWarning, match="Pruning.start_step=5 is past trainer.max_steps=3"):
        fit_tiny(max_steps=3, callbacks=(Pruning(start_step=5),))
