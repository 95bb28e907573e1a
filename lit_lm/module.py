"""`LanguageModel`: the LightningModule that trains a `Transformer` on (B, T+1) token windows."""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from typing import Any, Optional, Union

import lightning as L
import torch
from torch import Tensor
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torchmetrics import MeanMetric

from lit_lm.checkpoints import with_tied_head
from lit_lm.config import ConfigError, ModelConfig
from lit_lm.generate import generate
from lit_lm.log_steps import logs_this_batch
from lit_lm.model import Transformer
from lit_lm.moe import moe_layers, moe_metrics, update_router_bias
from lit_lm.param_groups import param_groups
from lit_lm.planner.estimate import flops_per_token
from lit_lm.strategies.base import BaseStrategy
from lit_lm.strategies.checkpoint import OPTIMIZER_FQNS
from lit_lm.strategies.clip import clip_grad_norm_, local_grad_shards
from lit_lm.strategies.compile import compile_backend, speed_up
from lit_lm.strategies.fp8 import check_fp8
from lit_lm.strategies.plan import step_loss_fn

SCHEDULE_HORIZON = "lit_lm_schedule_horizon"  # the checkpoint's key for the LR schedule's horizon (steps)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1 over `warmup_steps`, then cosine decay to `min_lr_ratio` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class LanguageModel(L.LightningModule):
    """Next-token prediction with AdamW (decoupled weight decay, none on norms and embeddings) and warmup+cosine.

    The Transformer is built in `configure_model`, not `__init__`, so a sharding strategy can build it under its
    own context (meta device, shard-local allocation) once the process groups exist.

    Args:
        config: the model's shape (`model.init_args.config.*`; `vocab_size` is linked to the data's).
        lr, betas, eps, weight_decay: AdamW.
        warmup_steps, min_lr_ratio: the schedule; it ends at `schedule_steps`.
        schedule_steps: the cosine's horizon. None: the trainer's `max_steps` (or the epochs' steps) when the run
            first starts; a resume keeps the horizon its checkpoint was trained with, so `--ckpt_path last
            --trainer.max_steps 800` after a 400-step run goes on at the floor LR instead of jumping back up the
            cosine. Set it to change the horizon on purpose (the change is logged with the LR before and after).
        kernels: modules to swap for `lit_lm/kernels/` implementations (e.g. [rmsnorm, swiglu]); "auto" picks Triton
            on CUDA and the PyTorch references elsewhere.
        init_from: a Hugging Face model folder (Llama, Qwen3, Mixtral, ...: `lit_lm.hf.families`) whose config.json
            decides the model's shape (the yaml's differing fields are replaced, said in one line) and whose
            weights start the run: weights only, a fresh optimizer at step 0 (unlike `--ckpt_path`). See docs/hf.md.
        compile: each transformer block under `torch.compile` (true: inductor; or a backend's name, e.g.
            aot_eager), applied after the strategy's engines (`lit_lm/strategies/compile.py`, docs/compile.md).
        fp8: tensorwise or rowwise: the blocks' linears compute in FP8 with dynamic scales, fp32 master weights
            (`lit_lm/strategies/fp8.py`, docs/compile.md).
    """

    def __init__(self, config: ModelConfig = ModelConfig.signature_default(), lr: float = 3e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1,
                 warmup_steps: int = 100, min_lr_ratio: float = 0.1,
                 kernels: Optional[list[str]] = None, schedule_steps: Optional[int] = None,
                 init_from: Optional[str] = None, compile: Union[bool, str] = False, fp8: Optional[str] = None) -> None:
        super().__init__()
        if isinstance(config, dict):  # from a checkpoint's hyper-parameters (stored as plain types)
            config = ModelConfig(**config)
        config = config.resolved()  # the signature default leaves d_ff & co. to be derived
        self.init_from = init_from
        if init_from is not None:
            config = self._hf_config(init_from, config)
        self._derived = config.derived_fields()  # what a checkpoint may settle (adopt_checkpoint_config)
        if schedule_steps is not None and schedule_steps < 1:
            raise ConfigError(f"model.init_args.schedule_steps={schedule_steps}: the LR schedule's horizon must be "
                              ">= 1 step, or null for the trainer's max_steps")
        if lr <= 0 or warmup_steps < 0 or not 0 <= min_lr_ratio <= 1:
            raise ConfigError(f"model.init_args: need lr > 0, warmup_steps >= 0 and 0 <= min_lr_ratio <= 1; got "
                              f"lr={lr}, warmup_steps={warmup_steps}, min_lr_ratio={min_lr_ratio}")
        self.config = config
        self.kernels = list(kernels or [])
        self.compile_blocks, self.fp8 = compile_backend(compile), check_fp8(fp8)  # the strategy reads them
        # Plain types only, so `torch.load(weights_only=True)` (LightningCLI's ckpt parsing) can read them.
        self.save_hyperparameters({"config": asdict(config), "lr": lr, "betas": tuple(betas), "eps": eps,
                                   "weight_decay": weight_decay, "warmup_steps": warmup_steps,
                                   "min_lr_ratio": min_lr_ratio, "kernels": self.kernels,
                                   "schedule_steps": schedule_steps, "compile": self.compile_blocks,
                                   "fp8": self.fp8})  # not init_from: `config` is its shape
        self.model: Optional[Transformer] = None
        self._horizon: Optional[int] = None  # the LR schedule's, once known (the run's state: kept by checkpoints)
        self._saved_horizon: Optional[int] = None  # the checkpoint's, when resuming
        self.val_loss = MeanMetric()
        self._moe_sum: Optional[Tensor] = None  # MoE statistics summed over the interval's batches, on the device
        self._moe_batches = 0

    def adopt_checkpoint_config(self, saved: dict[str, Any]) -> None:
        """Before the model is built: the config fields this run left to derivation (d_ff, n_kv_heads, moe_d_ff)
        take the checkpoint's values. A run started before they were left open in the signature default saved a
        d_ff derived from the *default* d_model, which its yaml never stated: it still validates and resumes."""
        values = {n: saved[n] for n in self._derived
                  if saved.get(n) is not None and saved[n] != getattr(self.config, n)}
        if not values or self.model is not None:
            return
        self.config = replace(self.config, **values)
        self.hparams["config"] = asdict(self.config)
        rank_zero_info("[lit-lm] from the checkpoint: " + ", ".join(f"{k} {v}" for k, v in values.items()) +
                       " (fields the config leaves to derivation)")

    @staticmethod
    def _hf_config(folder: str, config: ModelConfig) -> ModelConfig:
        """The Hugging Face model's shape replaces the yaml's (said in one line when they differ)."""
        from lit_lm.hf.importer import model_config, overridden

        hf = model_config(folder, config)
        changes = overridden(config, hf)
        if changes:
            rank_zero_info(f"[lit-lm] init_from {folder}: the model is the Hugging Face config's: "
                           + ", ".join(changes))
        return hf

    def start_from(self, folder: str) -> None:
        """Before the model is built: take the weights (and shape) of the Hugging Face model in `folder`
        (`init_from`; what `--ckpt_path <HF folder>` means)."""
        if self.model is not None:
            raise ConfigError(f"{folder}: the model is built already; pass it as model.init_args.init_from")
        self.init_from = folder
        self.config = self._hf_config(folder, self.config)
        self.hparams["config"] = asdict(self.config)

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.init_from is not None:
            self.model = self._from_hf()
        else:
            self.model = Transformer(self.config)
        if self.kernels:
            from lit_lm import kernels
            kernels.apply(self.model, self.kernels)
        if not isinstance(getattr(self._trainer, "strategy", None), BaseStrategy):  # lit-lm's apply them after TP
            speed_up(self.model, self.fp8, self.compile_blocks)

    def _from_hf(self) -> Transformer:
        """The model built on the meta device with its values read from `init_from` by global name and slice: a
        lit-lm strategy materialises only this rank's part (`lit_lm.strategies.placement`, ZeRO-3's rows), so each rank
        reads only what it holds; under Lightning's own strategies (every rank holds the whole model) it is
        materialised here, whole."""
        from lit_lm.hf.importer import HFWeights
        from lit_lm.strategies.placement import materialize

        with torch.device("meta"):
            model = Transformer(self.config)
        model.weights = HFWeights(self.init_from, self.config)
        strategy = self._trainer.strategy if self._trainer is not None else None
        if not isinstance(strategy, BaseStrategy):
            materialize(model, torch.device("cpu"), model.init_parameter, model.init_buffer)
        return model

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Name the optimizer's parameters (torch keys its state by position), so that a single file resumes under
        a strategy whose ranks hold other parameters (pipeline stages). lit-lm's strategies key by name already."""
        names = {p: n for n, p in self.named_parameters()}
        optimizers = self._trainer.optimizers if self._trainer is not None else []
        groups = [[[names.get(p) for p in g["params"]] for g in o.param_groups] for o in optimizers]
        if all(n is not None for o in groups for g in o for n in g):
            checkpoint[OPTIMIZER_FQNS] = groups
        if self._horizon is not None:
            checkpoint[SCHEDULE_HORIZON] = self._horizon

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Before the strict load: a sharded checkpoint names a tied head once, by the embedding's name. (lit-lm's
        strategies load the tensors themselves, before this hook, and pass no state_dict.)"""
        if "state_dict" in checkpoint:
            with_tied_head(checkpoint["state_dict"], self.config.tie_embeddings, prefix="model.")
        self._saved_horizon = checkpoint.get(SCHEDULE_HORIZON)
        self._horizon = None  # resolved again at the next scheduler step, against the checkpoint's

    def schedule_horizon(self) -> int:
        """The step at which the cosine reaches its floor: `schedule_steps` if set, else the horizon the run
        started with (a checkpoint's), else the trainer's total steps. Resolved once, at the first scheduler step
        (after a resume's checkpoint is loaded), and said when a resume keeps or changes it."""
        if self._horizon is None:
            total = int(self.trainer.estimated_stepping_batches) if self._trainer is not None else 1
            wanted, saved = self.hparams.get("schedule_steps"), self._saved_horizon
            self._horizon = wanted or saved or total
            if saved is not None and self._horizon != saved:
                step = self.trainer.global_step
                before, after = (warmup_cosine(step, self.hparams.warmup_steps, h, self.hparams.min_lr_ratio)
                                 for h in (saved, self._horizon))
                rank_zero_info(f"[lit-lm] LR schedule: horizon {saved} -> {self._horizon} steps (schedule_steps) at "
                               f"step {step}: the LR multiplier moves from {before:.3g} to {after:.3g}")
            elif saved is not None and saved != total:
                rank_zero_info(f"[lit-lm] LR schedule: keeps the checkpoint's horizon of {saved} steps (the run now "
                               f"ends at {total}; past step {saved} the LR stays at its floor). Set "
                               "model.init_args.schedule_steps to change it")
        return self._horizon

    def on_fit_start(self) -> None:
        self._moe_sum, self._moe_batches = None, 0
        cfg, seq_len = self.config, self.config.max_seq_len
        flops = flops_per_token(cfg.num_params(include_embedding=False), cfg.n_layers, cfg.d_model, seq_len)
        rank_zero_info(f"[lit-lm] model: {cfg.num_params() / 1e6:.2f}M parameters, {cfg.n_layers} layers x d_model "
                       f"{cfg.d_model}; {flops / 1e6:.1f} MFLOPs per trained token (6N + 12·L·d·T, T={seq_len})")
        data = getattr(self.trainer, "datamodule", None)
        if self.init_from is not None and data is not None and getattr(data, "tokenizer_dir", "") is None:
            rank_zero_warn(f"[lit-lm] init_from {self.init_from} without data.init_args.tokenizer_dir: the text is "
                           "tokenized by a BPE trained on your corpus, whose ids mean nothing to the imported "
                           f"embedding; pass --data.init_args.tokenizer_dir {self.init_from} (docs/hf.md)")

    # -- steps ---------------------------------------------------------------------------------------------
    def _split(self, batch: Tensor, batch_idx: int) -> tuple[Tensor, Tensor]:
        if batch_idx == 0:  # one check per loop: a sync on GPU, so not every step
            top = int(batch.max())
            if top >= self.config.vocab_size:
                raise ConfigError(f"token id {top} >= model.init_args.config.vocab_size={self.config.vocab_size}: "
                                  "the data's tokenizer is larger than the model's vocabulary; make them equal")
        return batch[:, :-1], batch[:, 1:]

    def step_loss(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """The step's (loss, ce), through the strategy's loss seam (`lit_lm.strategies.plan.LossSeam`): a pipeline
        runs its schedule, a context split feeds the model its share of the tokens; other strategies call
        `model.loss`."""
        return step_loss_fn(getattr(self._trainer, "strategy", None), self.model)(inputs, targets)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        """The loss, logged every micro-batch as the ranks' mean (`sync_dist`: one scalar all-reduce queued on the
        device, no host read; `prog_bar` would make Lightning read it every step, `StepProgress` shows it at logging
        steps), so `callback_metrics["train_loss"]` is this batch's global loss for any callback that monitors it
        (ModelCheckpoint, EarlyStopping, the parity harness); the MoE statistics are summed on the device and logged
        as their mean over each logging interval, read once."""
        x, y = self._split(batch, batch_idx)
        loss, _ = self.step_loss(x, y)
        self.log("train_loss", loss.detach(), sync_dist=True)
        self._log_moe_metrics()
        return loss

    def _log_moe_metrics(self) -> None:
        names, values = moe_metrics(self.model)  # this rank's routing (unsynced)
        if not names:
            return
        self._moe_sum = values if self._moe_sum is None else self._moe_sum + values
        self._moe_batches += 1
        if logs_this_batch(self.trainer):
            self.log_dict(dict(zip(names, (self._moe_sum / self._moe_batches).tolist())))  # the interval's read
            self._moe_sum, self._moe_batches = None, 0

    def _eval_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        x, y = self._split(batch, batch_idx)
        _, ce = self.step_loss(x, y)
        self.val_loss.update(ce, weight=y.numel())
        return ce

    def validation_step(self, batch: Tensor, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        ce = self._eval_step(batch, batch_idx)
        source = getattr(getattr(self._trainer, "datamodule", None), "val_source", lambda _: None)(dataloader_idx)
        if source is not None:  # a mixture's loader per source (lit_lm.data): its loss beside the overall
            self.log(f"val_loss/{source}", ce, on_step=False, on_epoch=True, sync_dist=True, batch_size=batch.shape[0],
                     add_dataloader_idx=False)
        return ce

    def test_step(self, batch: Tensor, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        return self._eval_step(batch, batch_idx)

    def _log_eval(self, prefix: str) -> None:
        loss = self.val_loss.compute()
        self.log(f"{prefix}_loss", loss, prog_bar=True)
        self.log(f"{prefix}_ppl", torch.exp(loss))
        self.val_loss.reset()

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    def predict_step(self, batch: Tensor, batch_idx: int) -> dict[str, Tensor]:
        """Greedy continuation of the first quarter of each validation window (what `lit-lm predict` writes to
        `<default_root_dir>/predictions.jsonl`): a look at what the model learnt. Never an id past the data's
        tokenizer's last one (an imported model may have more rows than ids: `generate.stream`'s `vocab_size`)."""
        prompt = batch[:, : max(batch.shape[1] // 4, 1)]
        tokenizer = getattr(getattr(self._trainer, "datamodule", None), "tokenizer", None)
        out = generate(self.model, prompt, max_new_tokens=batch.shape[1] // 4, temperature=0.0,
                       vocab_size=None if tokenizer is None else tokenizer.vocab_size)
        return {"prompt": prompt, "completion": out[:, prompt.shape[1]:]}

    # -- lr -------------------------------------------------------------------------------------------------
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """The lr, at logging steps only: Lightning copies a logged Python number to the device, a blocking copy on
        CUDA."""
        if logs_this_batch(self.trainer):
            self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])

    # -- optimisation --------------------------------------------------------------------------------------
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """The step, then the MoE routers' auxiliary-loss-free bias update (counts summed over the ranks that split
        the batch: the layers' `batch_group`, which the strategy set; a pipeline stage's layers live on its ranks)."""
        super().optimizer_step(*args, **kwargs)
        group = next((m.batch_group for m in moe_layers(self.model).values()), None)
        update_router_bias(self.model, lambda t: self.trainer.strategy.reduce(t, group, reduce_op="sum"))

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: Optional[float] = None,
                                    gradient_clip_algorithm: Optional[str] = None) -> None:
        """`grad_norm` (the pre-clip global norm) is logged on every strategy, clipped or not: lit-lm's strategies
        log it when they clip by norm (their global norm over shards); otherwise it is measured here with a no-op
        clip, at logging steps only (a norm nobody clips with is not worth a pass over the gradients and, sharded,
        a collective every step). Lightning's single-device and DDP strategies (whole gradients on every rank) clip
        through the same function; other Lightning strategies (FSDP) keep their own clipping and log no norm."""
        by_norm = bool(gradient_clip_val) and gradient_clip_algorithm in (None, "norm")
        measure = not by_norm and logs_this_batch(self.trainer)
        strategy = self.trainer.strategy
        if isinstance(strategy, BaseStrategy):
            if measure:
                strategy.clip_grad_norm_(float("inf"))  # logs the norm; clips nothing
        elif isinstance(strategy, (L.pytorch.strategies.SingleDeviceStrategy, L.pytorch.strategies.DDPStrategy)):
            if by_norm or measure:
                norm = clip_grad_norm_(local_grad_shards(self), gradient_clip_val if by_norm else float("inf"))
                self.log("grad_norm", norm)
            if by_norm:
                return
        if gradient_clip_val:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        groups = param_groups(self.model, hp.weight_decay, self.model.config.tie_embeddings)
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps)
        self._horizon = None
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, hp.warmup_steps, self.schedule_horizon(), hp.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


__all__ = ["LanguageModel", "warmup_cosine"]
