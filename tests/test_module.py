"""LanguageModel: schedule, weight-decay groups, vocabulary check, checkpoint hyper-parameters."""

import math

import lightning as L
import pytest
import torch

from lit_lm.callbacks.throughput import Throughput
from lit_lm.config import ConfigError, ModelConfig
from lit_lm.module import LanguageModel
from lit_lm.schedules import warmup_cosine
from lit_lm.moe import moe_metrics

CFG = ModelConfig(vocab_size=61, d_model=32, n_layers=1, n_heads=4, max_seq_len=16)


def test_warmup_then_cosine_to_the_floor():
    lrs = [warmup_cosine(s, warmup_steps=10, total_steps=110, min_lr_ratio=0.1) for s in range(120)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[110] == pytest.approx(0.1) and lrs[119] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_no_weight_decay_on_norms_and_embeddings():
    module = LanguageModel(CFG)
    module.configure_model()
    opt = module.configure_optimizers()["optimizer"]
    decay, no_decay = opt.param_groups
    names = {id(p): n for n, p in module.model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 and "tok_embeddings" not in names[id(p)] for p in decay["params"])
    assert {names[id(p)] for p in no_decay["params"]} >= {"tok_embeddings.weight", "norm.weight"}
    assert len(decay["params"]) + len(no_decay["params"]) == len(names)


def test_a_tied_head_is_not_decayed_on_the_last_pipeline_stage():
    """There the tied weight is known only as lm_head.weight; decaying it would split it from the first stage's."""
    module = LanguageModel(ModelConfig(**{**CFG.__dict__, "tie_embeddings": True}))
    module.configure_model()
    module.model.pipeline_split([0], is_first=False, is_last=True)
    decay, no_decay = module.configure_optimizers()["optimizer"].param_groups
    assert any(p is module.model.lm_head.weight for p in no_decay["params"])
    assert all(p is not module.model.lm_head.weight for p in decay["params"])


def test_token_ids_over_the_vocabulary_are_reported():
    module = LanguageModel(CFG)
    module.configure_model()
    batch = torch.randint(0, 61, (2, 17))
    batch[1, 5] = 70
    with pytest.raises(ConfigError, match="token id 70 >= model.init_args.config.vocab_size=61"):
        module.training_step(batch, 0)


def test_checkpoint_hyperparameters_are_plain_and_reload(tmp_path):
    module = LanguageModel(CFG, lr=1e-3)
    module.configure_model()
    trainer = L.Trainer(max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)  # what LightningCLI does with --ckpt_path
    assert ckpt["hyper_parameters"]["config"]["d_model"] == 32
    restored = LanguageModel.load_from_checkpoint(path)
    assert restored.config == module.config and restored.hparams.lr == 1e-3


class _Metrics(L.pytorch.loggers.Logger):
    """Every `log_metrics` call, by step."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, dict[str, float]] = {}

    name, version = "memory", 0

    @property
    def experiment(self) -> None:
        return None

    def log_hyperparams(self, *args: object, **kwargs: object) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.setdefault(step, {}).update(metrics)


class _MoEStats(L.Callback):
    """Each batch's MoE statistics vector, as the layers left it."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: object) -> None:
        self.batches.append(moe_metrics(module.model)[1].clone())


def test_interval_metrics_are_means_over_the_logging_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """With log_every_n_steps=2: the MoE statistics logged at a logging step are the mean of the interval's two
    batches (read once), and tokens/s (the Throughput callback the lit-lm command adds) is the interval's tokens over
    its (synchronised) clock, 1 s a read here."""
    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr("lit_lm.callbacks.throughput.synchronized_clock", lambda device: next(clock))
    config = ModelConfig(**{**CFG.__dict__, "n_layers": 2, "moe_experts": 4, "moe_top_k": 2, "moe_d_ff": 16,
                            "moe_first_dense": 1})
    logger, stats = _Metrics(), _MoEStats()
    trainer = L.Trainer(accelerator="cpu", max_steps=4, log_every_n_steps=2, logger=logger,
                        callbacks=[stats, Throughput()], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(LanguageModel(config, warmup_steps=1), torch.utils.data.DataLoader(torch.randint(0, 61, (8, 17)),
                                                                                   batch_size=2))
    names = moe_metrics(trainer.lightning_module.model)[0]
    assert sorted(logger.rows) == [1, 3]  # the steps that log (0-based), after batches 1 and 3
    for step, batches in ((1, stats.batches[0:2]), (3, stats.batches[2:4])):
        assert not torch.equal(*batches)  # so the last batch's values would not pass for the mean
        mean = torch.stack(batches).mean(0)
        torch.testing.assert_close(torch.tensor([logger.rows[step][n] for n in names]), mean)
        assert logger.rows[step]["tokens_per_s"] == 2 * 2 * 16 / 1.0  # 2 batches of 2 x 16 tokens in 1 s


class _LRs(L.Callback):
    def __init__(self) -> None:
        self.lrs: dict[int, float] = {}

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        self.lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]


def _fit_lrs(tmp_path, max_steps: int, ckpt_path=None, **module_kwargs: object) -> dict[int, float]:
    """Steps of a tiny LanguageModel on random tokens, saving `last.ckpt`; the LR each step ran with."""
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.randint(0, CFG.vocab_size, (64, CFG.max_seq_len + 1)), batch_size=4)
    lrs = _LRs()
    trainer = L.Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[lrs, L.pytorch.callbacks.ModelCheckpoint(tmp_path, save_last=True)],
                        num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(LanguageModel(CFG, warmup_steps=2, **module_kwargs), data, ckpt_path=ckpt_path)
    return lrs.lrs


def test_resuming_with_more_steps_keeps_the_lr_continuous(tmp_path):
    """The issue's case: a 6-step run resumed with max_steps 10. The schedule's horizon is the run's state, so the
    resumed steps go on from the 6-step cosine (at its floor), not from a 10-step one re-stretched at step 6
    (which would lift the LR); an explicit schedule_steps changes it, and the LR then follows the new cosine."""
    first = _fit_lrs(tmp_path / "a", 6)
    resumed = _fit_lrs(tmp_path / "a", 10, ckpt_path=str(tmp_path / "a" / "last.ckpt"))
    floor = 3e-3 * 0.1
    assert sorted(resumed) == [6, 7, 8, 9]
    assert all(lr == pytest.approx(floor) for lr in resumed.values()), resumed
    assert first[5] >= floor  # continuous: never above where the first run left it
    stretched = _fit_lrs(tmp_path / "b", 6)  # the same run, then stretched on purpose
    restarted = _fit_lrs(tmp_path / "b", 10, ckpt_path=str(tmp_path / "b" / "last.ckpt"), schedule_steps=10)
    assert stretched == first
    assert restarted[6] == pytest.approx(floor)  # the checkpoint's LR; the new horizon sets the next one
    for step in (7, 8, 9):
        assert restarted[step] == pytest.approx(3e-3 * warmup_cosine(step, 2, 10, 0.1))
    assert restarted[7] > floor * 1.5


def test_derived_config_fields_follow_the_yaml_not_the_default_instance(tmp_path):
    """jsonargparse takes the signature default's fields as the defaults: with d_ff derived from the default
    d_model (704 for 256) there, `fit` built another model from configs/default.yaml (d_model 192: 2.80M
    parameters) than `plan` and ModelConfig(d_model=192) (d_ff 512: 2.36M). The derived fields stay None there."""
    import yaml
    from test_cli import REPO, run_cli

    printed = run_cli("fit", "--config", str(REPO / "configs/default.yaml"), "--print_config", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr[-3000:]
    out = printed.stdout
    fields = yaml.safe_load(out)["model"]["init_args"]["config"]
    assert fields["d_ff"] is None and fields["moe_d_ff"] is None
    built = LanguageModel(ModelConfig(**fields)).config
    assert built.d_ff == 512 and built.num_params() == 2_361_024
    assert LanguageModel().config == ModelConfig()  # the bare default is resolved as before


def test_a_checkpoint_settles_the_fields_the_config_leaves_to_derivation():
    """Runs started before the fix above saved d_ff 704 for configs/default.yaml's model: validate and resume
    them with the same yaml (d_ff derived: 512) by taking the checkpoint's value, which the yaml never stated;
    a d_ff the config states otherwise is kept (and check_architecture then refuses the checkpoint)."""
    derived = LanguageModel(ModelConfig(**dict(vars(CFG), d_ff=None, moe_d_ff=None)))
    assert {"d_ff", "moe_d_ff"} <= set(derived.config.derived_fields())
    saved = dict(vars(derived.config), d_ff=derived.config.d_ff + 64, moe_d_ff=derived.config.d_ff + 64)
    derived.adopt_checkpoint_config(saved)
    assert derived.config.d_ff == saved["d_ff"] and derived.hparams["config"]["d_ff"] == saved["d_ff"]
    stated = LanguageModel(ModelConfig(**dict(vars(CFG), d_ff=CFG.d_ff + 128)))
    stated.adopt_checkpoint_config(saved)
    assert stated.config.d_ff == CFG.d_ff + 128


def test_an_unclipped_run_logs_the_gradient_norm_at_its_logging_steps():
    """No clipping configured: the pre-clip norm is still logged, measured at logging steps only, and equals the
    norm of the gradients the optimizer steps with."""
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.randint(0, CFG.vocab_size, (16, CFG.max_seq_len + 1)), batch_size=4)
    metrics, norms = _Metrics(), {}

    class Norms(L.Callback):
        def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: object) -> None:
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            norms[trainer.global_step] = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))

    trainer = L.Trainer(max_steps=4, logger=metrics, log_every_n_steps=2, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[Norms()],
                        limit_val_batches=0)
    trainer.fit(LanguageModel(CFG, warmup_steps=2), data)
    logged = {step: row["grad_norm"] for step, row in metrics.rows.items() if "grad_norm" in row}
    assert sorted(logged) == [1, 3]
    for step, value in logged.items():
        assert value == pytest.approx(norms[step], rel=1e-5)
