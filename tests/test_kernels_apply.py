"""`kernels.apply` on a real (tiny) `lit_lm` Transformer: same logits, loss and gradients as the plain model, the
same parameters and state-dict keys, checkpoints interchangeable both ways. Triton runs in the interpreter."""

import copy
import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (kernels import it lazily)

import pytest

from lit_lm.kernels.runtime import interpreting

if not interpreting():  # triton was imported before this line, in compiled mode (`import lightning` does that)
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported: set it in the environment or tests/conftest.py",
                allow_module_level=True)

import torch

from lit_lm import kernels
from lit_lm.kernels import runtime
from lit_lm.config import ModelConfig
from lit_lm.model import Transformer

ALL = list(kernels.KERNELS)
TOLERANCE = dict(atol=1e-5, rtol=1e-4)


def tiny_model(**overrides: object) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=24)
    return Transformer(ModelConfig(**{**cfg, **overrides}))


def batch(model: Transformer, seq_len: int = 18) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, model.config.vocab_size, (2, seq_len + 1), generator=gen)
    targets = idx[:, 1:].clone()
    targets[0, :3] = -100
    return idx[:, :-1], targets


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy in the interpreter: masked padding rows
@pytest.mark.parametrize("overrides", [{}, dict(sliding_window=7, z_loss=1e-3, qk_norm=True, tie_embeddings=True)])
def test_swapped_model_matches_reference(overrides: dict) -> None:
    ref = tiny_model(**overrides)
    fast = kernels.apply(copy.deepcopy(ref), ALL, backend="triton")
    idx, targets = batch(ref)
    outputs = []
    for model in (ref, fast):
        logits = model(idx)
        loss, ce = model.loss_fn(logits, targets)
        loss.backward()
        outputs.append((logits, loss, ce, {n: p.grad for n, p in model.named_parameters()}))
    (logits, loss, ce, grads), (logits_k, loss_k, ce_k, grads_k) = outputs
    torch.testing.assert_close(logits_k, logits, **TOLERANCE)
    torch.testing.assert_close(loss_k, loss, **TOLERANCE)
    torch.testing.assert_close(ce_k, ce, **TOLERANCE)
    assert grads_k.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_k[name], grads[name], **TOLERANCE, msg=name)


def test_apply_swaps_every_layer_and_keeps_parameters() -> None:
    model = tiny_model()
    params_before = dict(model.named_parameters())
    keys_before = list(model.state_dict())
    kernels.apply(model, ALL)
    kernel_types = {cls for _, cls in kernels.KERNELS.values()}
    swapped = [m for m in model.modules() if type(m) in kernel_types]
    assert len(swapped) == 2 * 5 + 2  # per block: 2 norms, rope, attention, mlp; plus final norm and loss
    assert list(model.state_dict()) == keys_before
    assert all(p is params_before[n] for n, p in model.named_parameters())  # same Parameter objects


def test_apply_only_named_kernels() -> None:
    model = kernels.apply(tiny_model(), ["rmsnorm"])
    assert isinstance(model.norm, kernels.RMSNorm)
    assert not isinstance(model.blocks["0"].mlp, kernels.SwiGLU)


def test_state_dict_round_trip() -> None:
    ref, fast = tiny_model(), kernels.apply(tiny_model(), ALL, backend="triton")
    with torch.no_grad():
        for p in fast.parameters():
            p.add_(0.01 * torch.randn_like(p))  # make the two models differ first
    idx, _ = batch(ref, seq_len=9)
    ref.load_state_dict(fast.state_dict())  # strict: same keys
    torch.testing.assert_close(fast(idx), ref(idx), **TOLERANCE)
    other = kernels.apply(tiny_model(init_std=0.05), ALL)
    other.load_state_dict(ref.state_dict())
    torch.testing.assert_close(other(idx), ref(idx), **TOLERANCE)


def test_reference_and_auto_backends_on_cpu_are_the_plain_model(monkeypatch: pytest.MonkeyPatch) -> None:
    ref = tiny_model()
    idx, _ = batch(ref, seq_len=9)
    monkeypatch.delenv("TRITON_INTERPRET")  # "auto" picks the reference for CPU tensors outside the interpreter
    for backend in ("reference", "auto"):
        model = kernels.apply(copy.deepcopy(ref), ALL, backend=backend)
        assert torch.equal(model(idx), ref(idx))


def test_auto_backend_runs_triton_under_the_interpreter() -> None:
    ref = tiny_model()
    idx, _ = batch(ref, seq_len=9)
    model = kernels.apply(copy.deepcopy(ref), ["rmsnorm"], backend="auto")
    calls = []
    model.norm.register_forward_hook(lambda *_: calls.append(runtime.use_triton("auto", idx)))
    torch.testing.assert_close(model(idx), ref(idx), **TOLERANCE)
    assert calls == [True]


def test_bad_names_and_backends() -> None:
    with pytest.raises(ValueError, match="valid names are rmsnorm, swiglu, rope, attention, cross_entropy"):
        kernels.apply(tiny_model(), ["rmsnorm", "layernorm"])
    with pytest.raises(ValueError, match="auto, triton, reference"):
        kernels.apply(tiny_model(), ["rmsnorm"], backend="cuda")


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    model = kernels.apply(tiny_model(), ["rmsnorm"], backend="triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        model.norm(torch.randn(2, 32))


def test_import_does_not_import_triton() -> None:
    code = "import sys, kernels; assert 'triton' not in sys.modules, 'import kernels imported triton'"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy in the interpreter: masked padding rows
def test_packed_documents_train_through_the_trainer_as_the_reference(tmp_path, monkeypatch: pytest.MonkeyPatch
                                                                     ) -> None:
    """`kernels: [attention, rope]` with `document_mask` and `position_reset`: two Trainer steps on one process give
    the reference path's losses and parameters, the varlen attention kernel having run with the rows' documents
    (several per row) and the rope kernel with their per-row positions."""
    import lightning as L

    from lit_lm.data.datamodule import TextDataModule
    from lit_lm.kernels import attention, rope
    from lit_lm.module import LanguageModel
    from lit_lm.parity import TINY

    files = []
    for i in range(30):
        files.append(str(tmp_path / f"doc{i}.txt"))
        (tmp_path / f"doc{i}.txt").write_text(" ".join(["alpha beta", "gamma (x)", "y: delta"][i % 3] for _ in
                                                       range(1 + i % 4)) + "\n")
    seen = []
    flash_attention, rope_fn = attention.flash_attention, rope.rope
    monkeypatch.setattr(attention, "flash_attention", lambda *a, documents=None, **k: seen.append(
        ("attention", int(documents.max()))) or flash_attention(*a, documents=documents, **k))
    monkeypatch.setattr(rope, "rope", lambda q, k, cos, sin, positions=None: seen.append(
        ("rope", cos.shape[0] == q.shape[0] * q.shape[1] and positions is not None)) or rope_fn(q, k, cos, sin,
                                                                                              positions))

    class Losses(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"]))

    runs = {}
    for names in ([], ["attention", "rope"]):
        torch.manual_seed(0)
        data = TextDataModule(files=files, data_dir=str(tmp_path / "data"), vocab_size=270, seq_len=32,
                              batch_size=2, val_fraction=0.2, document_mask=True, position_reset=True)
        module = LanguageModel(ModelConfig(**dict(TINY, vocab_size=270, max_seq_len=32)), kernels=names)
        losses = Losses()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                            callbacks=[losses])
        trainer.fit(module, datamodule=data)
        runs[bool(names)] = losses.losses, {n: p.detach().clone() for n, p in module.model.named_parameters()}
    (ref_losses, ref_params), (losses_k, params_k) = runs[False], runs[True]
    assert len(ref_losses) == 2
    torch.testing.assert_close(losses_k, ref_losses, **TOLERANCE)
    assert params_k.keys() == ref_params.keys()
    for name in ref_params:
        torch.testing.assert_close(params_k[name], ref_params[name], **TOLERANCE, msg=name)
    # both kernels ran, the attention on rows of several documents, the rope on a table row per token (the rows'
    # restarting positions: `RotaryEmbedding.row_tables`), whose equality with the reference above is the proof
    assert {kind for kind, _ in seen} == {"attention", "rope"}
    assert all(documents >= 2 for kind, documents in seen if kind == "attention")
    assert all(per_token for kind, per_token in seen if kind == "rope")
