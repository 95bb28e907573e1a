"""The Throughput callback: the FLOPs formula by hand, the peak table, the keys it logs in a real CPU fit, and that
it is the one measure of tokens/s (the lit-lm command adds it, once)."""

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning.pytorch.callbacks import ModelCheckpoint

from lit_lm.callbacks.progress import StepProgress
from lit_lm.callbacks.throughput import Throughput, flops_per_token, peak_flops_for
from lit_lm.cli import add_throughput
from lit_lm.config import ModelConfig
from lit_lm.model import Transformer
from lit_lm.module import LanguageModel

CONFIG = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=16)


def test_flops_per_token_by_hand() -> None:
    cfg = ModelConfig(**CONFIG)
    # Per block: q, k, v, o 4 * 32 * 32 + gate/up/down 3 * 32 * 64 + two norms 2 * 32; final norm 32; LM head 64 * 32.
    n = 2 * (4 * 32 * 32 + 3 * 32 * 64 + 2 * 32) + 32 + 64 * 32
    assert cfg.num_params(include_embedding=False) == n
    assert flops_per_token(n, n_layers=2, d_model=32, seq_len=16) == 6 * n + 12 * 2 * 32 * 16


def test_peak_flops_table() -> None:
    assert peak_flops_for("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_for("NVIDIA L40S") == 362e12 and peak_flops_for("NVIDIA L4") == 121e12
    assert peak_flops_for("cpu") is None


class ToyLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Transformer(ModelConfig(**CONFIG))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model.loss(batch[:, :-1], batch[:, 1:])[0]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("peak_flops", [1e12, None])
def test_logs_throughput_keys(peak_flops: float) -> None:
    data = DataLoader(torch.randint(0, 64, (8, 17)), batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=2,
                        callbacks=[Throughput(peak_flops=peak_flops)])
    trainer.fit(ToyLM(), data)
    metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
    expected = {"tokens_per_s", "throughput/flops_per_token", "throughput/peak_memory_gb"}
    assert expected <= metrics.keys()
    assert ("throughput/mfu" in metrics) == (peak_flops is not None)  # no peak known for a CPU
    assert metrics["tokens_per_s"] > 0 and metrics["throughput/peak_memory_gb"] > 0
    cfg = ModelConfig(**CONFIG)
    assert metrics["throughput/flops_per_token"] == flops_per_token(cfg.num_params(False), 2, 32, 16)
    if peak_flops:
        mfu = metrics["tokens_per_s"] * metrics["throughput/flops_per_token"] / peak_flops
        assert metrics["throughput/mfu"] == pytest.approx(mfu, rel=1e-4)


@pytest.mark.parametrize("given", [False, True])
def test_the_command_measures_tokens_once(given: bool) -> None:
    """The lit-lm command brings one Throughput callback, before the checkpoint callbacks (where Lightning puts a
    module's own, so a checkpoint sees this step's tokens/s); a config that has one (e.g. with a peak) keeps it,
    alone."""
    mine, progress, ckpt = Throughput(peak_flops=1e12), StepProgress(), ModelCheckpoint()
    callbacks = [progress, mine, ckpt] if given else [progress, ckpt]
    add_throughput(callbacks)
    found = [c for c in callbacks if isinstance(c, Throughput)]
    assert len(found) == 1 and (found[0] is mine) == given
    assert callbacks[0] is progress and callbacks.index(found[0]) == 1 and callbacks[2] is ckpt
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                        callbacks=found)
    trainer.fit(LanguageModel(ModelConfig(**CONFIG), warmup_steps=1),
                DataLoader(torch.randint(0, 64, (4, 17)), batch_size=2))
    assert ("throughput/mfu" in trainer.callback_metrics) == given and "tokens_per_s" in trainer.callback_metrics


def test_tokens_are_counted_per_data_parallel_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    """dp2 x tp2 on 4 ranks: 2 replicas read different tokens, the tp peers of each the same ones. A rank that
    processed 2 x 16 tokens in 1 s reports 2 replicas x 32 tokens/s, and MFU divides by all 4 devices."""
    clock = iter([10.0, 11.0])
    monkeypatch.setattr("lit_lm.callbacks.throughput.time.perf_counter", lambda: next(clock))
    monkeypatch.setattr("lit_lm.callbacks.throughput.logs_this_batch", lambda trainer: True)  # a logging step
    logged: dict = {}
    strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 0})
    trainer = SimpleNamespace(strategy=strategy, world_size=4)
    module = SimpleNamespace(device=torch.device("cpu"), model=SimpleNamespace(config=ModelConfig(**CONFIG)),
                             log_dict=lambda metrics, **_: logged.update(metrics))
    callback = Throughput(peak_flops=1e12)
    batch = torch.zeros(2, 17, dtype=torch.long)
    callback.on_train_batch_start(trainer, module, batch, 0)
    callback.on_train_batch_end(trainer, module, None, batch, 0)
    assert logged["tokens_per_s"] == 2 * 32.0
    assert logged["throughput/mfu"] == pytest.approx(64.0 * logged["throughput/flops_per_token"] / (4 * 1e12))
