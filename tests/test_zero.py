"""ZeRO-1/2/3 against single-process training: losses and parameters, bytes on the wire and bytes in memory
against theory, sharded checkpoints resumed on another world size, and the bad configurations."""

from __future__ import annotations

import os
import zlib
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dist_utils import Recorder, TinyLM, rank_share, run_distributed, token_data
from strategies.comm import COMM_LOG
from strategies.zero import ZeroStrategy
from strategies.zero_engine import ZeroEngine, model_state_bytes

STEPS = 20
PLAIN: dict[str, Any] = {}
CLIP_ACCUM: dict[str, Any] = {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2}


class TwoGroupLM(TinyLM):
    """AdamW with a weight-decay group (matrices) and a no-decay group (norm gains), as LLM recipes do."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = list(self.parameters())
        return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                                 lr=self.hparams.lr)


class Probe(L.Callback):
    """Collectives issued per optimizer step (COMM_LOG) and model-state bytes just before each update, when the
    gradients are reduced and the optimizer state exists (from the second step on)."""

    def __init__(self) -> None:
        self.comm: list[dict] = []
        self.memory: list[dict] = []

    def on_train_batch_start(self, *args: Any) -> None:
        COMM_LOG.reset()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.memory.append(model_state_bytes(pl_module, getattr(optimizer, "_optimizer", optimizer)))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.comm.append(COMM_LOG.summary())


def fit(strategy: Any = "auto", devices: int = 1, global_batch: int = 8, max_steps: int = STEPS,
        steps_per_epoch: int = STEPS, ckpt_dir: str | None = None, resume: str | None = None,
        one_batch: bool = False, lr: float = 3e-3, **trainer_kwargs: Any) -> dict[str, Any]:
    """TwoGroupLM on fixed tokens, global batch constant over `devices`; returns losses, full params, probes.
    "zeroN" builds `ZeroStrategy(stage=N)`; `one_batch` repeats one global batch (see dist_utils.fit_tiny)."""
    if isinstance(strategy, str) and strategy.startswith("zero"):
        strategy = ZeroStrategy(stage=int(strategy[4:]))
    accumulate = trainer_kwargs.get("accumulate_grad_batches", 1)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    windows = 1 if one_batch else steps_per_epoch
    tokens = token_data(windows * accumulate * global_batch).repeat(steps_per_epoch // windows, 1)
    loader = DataLoader(TensorDataset(rank_share(tokens, global_batch, rank, devices)),
                        batch_size=global_batch // devices, shuffle=False)
    L.seed_everything(0, verbose=False)
    module, recorder, probe = TwoGroupLM(lr), Recorder(), Probe()
    callbacks: list[L.Callback] = [recorder, probe]
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps,
                        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0,
                        enable_checkpointing=ckpt_dir is not None, **trainer_kwargs)
    trainer.fit(module, loader, ckpt_path=resume)
    params = {k: v.detach().clone() for k, v in module.state_dict().items()}  # ZeRO-3: whole after teardown
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "params": params, "comm": probe.comm,
            "memory": probe.memory}


def _runs(configs: list[tuple[Any, dict]], devices: int, global_batch: int) -> list[dict]:
    return [fit(strategy, devices, global_batch, **cfg) for strategy, cfg in configs]


def _assert_parity(run: dict, single: dict, tag: str) -> None:
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0,
                               msg=lambda m: f"{tag}: {m}")
    for name, value in single["params"].items():
        rel = ((run["params"][name] - value).norm() / value.norm()).item()
        assert rel < 1e-5, (tag, name, rel)


def _phi() -> int:
    module = TinyLM()
    module.configure_model()
    return sum(p.numel() for p in module.parameters())


# -- parity, communication and memory with 2 ranks -----------------------------------------------------------
def test_zero_matches_single_process_with_theoretical_comm_and_memory() -> None:
    configs = [(f"zero{s}", cfg) for s in (1, 2, 3) for cfg in (PLAIN, CLIP_ACCUM)]
    configs.append(("zero3", {"precision": "bf16-mixed", "max_steps": 6}))
    runs = run_distributed(_runs, 2, configs, 2, 8, init_process_group=False)[0]
    single = {"plain": fit(**PLAIN), "clip": fit(**CLIP_ACCUM), "bf16": fit(precision="bf16-mixed", max_steps=6)}

    for (strategy, cfg), run in zip(configs, runs):
        if cfg.get("precision") == "bf16-mixed":  # bf16 rounding differs with the split: a loose check
            torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(single["bf16"]["losses"]),
                                       rtol=2e-2, atol=0)
            continue
        _assert_parity(run, single["clip" if cfg else "plain"], f"{strategy} {cfg}")
        if cfg:
            assert len(run["grad_norms"]) == STEPS and min(run["grad_norms"]) > 0.05  # clipped every step

    # Wire bytes per rank per step: reduce-scatter + all-gather = 2(N-1)/N Φ (stage 3: one more all-gather).
    phi, n = _phi(), 2
    for (strategy, cfg), run in zip(configs, runs):
        if cfg:
            continue
        stage = int(strategy[-1])
        expected = (2 if stage < 3 else 3) * (n - 1) / n * phi * 4
        assert len(run["comm"]) == STEPS
        for step in run["comm"]:
            assert set(step) == {"reduce_scatter", "all_gather"}, step
            assert sum(op["wire_bytes"] for op in step.values()) == pytest.approx(expected, rel=0.02), strategy

    # Model-state bytes (params + grads + Adam m, v), fp32: DP 16Φ, ZeRO-1 8Φ + 8Φ/N, ZeRO-2 4Φ + 12Φ/N,
    # ZeRO-3 16Φ/N. bf16-mixed autocasts fp32 weights: the same bytes as fp32.
    theory = {"auto": 16, "zero1": 8 + 8 / n, "zero2": 4 + 12 / n, "zero3": 16 / n}
    measured = [(s, r["memory"][-1]["total"]) for (s, _), r in zip(configs, runs)]
    measured.append(("auto", single["plain"]["memory"][-1]["total"]))
    for strategy, total in measured:
        assert total == pytest.approx(theory[strategy] * phi, rel=0.05), (strategy, total / phi)


# -- ZeRO-3 on 3 ranks: a parameter count (and row counts) not divisible by 3 --------------------------------
class ToyBlocks(nn.Module):
    """A BlockModel whose parameters have fewer rows than ranks (empty shards) and an output bias of one row."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 2)
        self.blocks = nn.ModuleDict({"0": nn.Linear(2, 2), "1": nn.Linear(2, 2)})
        self.out = nn.Linear(2, 1)

    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        with torch.no_grad():
            tensor.copy_(torch.randn(tensor.shape, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for block in self.blocks.values():
            x = torch.tanh(block(x))
        return self.out(x).square().mean()


def _toy_step(model: ToyBlocks, x: torch.Tensor, engine: ZeroEngine | None) -> dict[str, torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if engine is not None:
        engine.shard_optimizer(optimizer)
    for _ in range(2):
        model(x).backward()
        if engine is not None:
            engine.finish_grad_sync()
        optimizer.step()
        optimizer.zero_grad()
        if engine is not None:
            engine.after_step()
    if engine is None:
        return {n: p.detach() for n, p in model.named_parameters()}
    out = {}
    for sp in engine.sharded_params():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, sp.master.detach())
        out[sp.fqn] = torch.cat(parts)
    return out


def _toy_worker() -> dict[str, torch.Tensor]:
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    with torch.device("meta"):
        model = ToyBlocks()
    engine = ZeroEngine(model, stage=3)
    return _toy_step(model, x.chunk(dist.get_world_size())[dist.get_rank()], engine)


def _three_rank_worker() -> tuple[dict, dict]:
    lightning_run = fit("zero3", 3, 6, lr=1e-3, **CLIP_ACCUM)
    dist.barrier()
    return lightning_run, _toy_worker()


def test_zero3_on_3_ranks_with_uneven_and_empty_shards() -> None:
    run, toy = run_distributed(_three_rank_worker, 3, init_process_group=False)[0]
    _assert_parity(run, fit(global_batch=6, lr=1e-3, **CLIP_ACCUM), "zero3 x3")

    model = ToyBlocks()
    for name, p in model.named_parameters():
        model.init_parameter(name, p)
    single = _toy_step(model, torch.randn(6, 5, generator=torch.Generator().manual_seed(1)), None)
    for name, value in single.items():
        torch.testing.assert_close(toy[name], value, rtol=1e-5, atol=1e-6)


# -- checkpoints -------------------------------------------------------------------------------------------------
K = 4  # steps per epoch; checkpoint at the end of epoch 0, train to 2K


def _ckpt_worker(root: str, devices: int) -> dict[str, list[dict]]:
    """On 2 ranks: the uninterrupted run (checkpointing epoch 0), then a resume; on 1 rank: a resume."""
    runs: dict[str, list[dict]] = {}
    for stage in ("zero2", "zero3"):
        path = f"{root}/{stage}"
        common = dict(max_steps=2 * K, steps_per_epoch=K, one_batch=True)
        runs[stage] = [fit(stage, devices, ckpt_dir=path, **common)] if devices == 2 else []
        runs[stage].append(fit(stage, devices, resume=f"{path}/epoch=0-step={K}.ckpt", **common))
    return runs


def test_checkpoint_resumes_on_2_and_1_ranks(tmp_path: Any) -> None:
    on_two = run_distributed(_ckpt_worker, 2, str(tmp_path), 2, init_process_group=False)[0]
    on_one = run_distributed(_ckpt_worker, 1, str(tmp_path), 1, init_process_group=False)[0]
    for stage, (full, resumed_two) in on_two.items():
        for world, run in ((2, resumed_two), (1, on_one[stage][0])):
            torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(full["losses"][K:]),
                                       rtol=1e-5, atol=0, msg=lambda m: f"{stage} on {world}: {m}")  # noqa: B023 (called at once)
            for name, value in full["params"].items():
                assert ((run["params"][name] - value).norm() / value.norm()).item() < 1e-5, (stage, world, name)


# -- configuration ---------------------------------------------------------------------------------------------
def test_unknown_stage_is_explained() -> None:
    with pytest.raises(ValueError, match=r"unknown ZeRO stage 4: choose 1 .*, 2 .* or 3"):
        ZeroStrategy(stage=4)


def test_registered_names_select_the_stage() -> None:
    ZeroStrategy.register_strategies(StrategyRegistry)  # what strategies/__init__.py does at import
    for stage in (1, 2, 3):
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=f"zero{stage}", logger=False)
        assert isinstance(trainer.strategy, ZeroStrategy) and trainer.strategy.stage == stage
