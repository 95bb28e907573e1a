"""`LanguageModel`: the LightningModule that trains a `Transformer` on (B, T+1) token windows."""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import asdict, replace
from typing import Any, Callable, Iterable, Optional, Union

import lightning as L
import torch
from torch import Tensor
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torchmetrics import MeanMetric

from lit_lm.checkpoints import with_tied_head
from lit_lm.config import ConfigError, ModelConfig
from lit_lm.data import loss_mask
from lit_lm.data.packing import Packing
from lit_lm.generate import generate
from lit_lm.log_steps import logs_this_batch
from lit_lm.lora import LoRA, add_adapters, lora_from, lora_hparams
from lit_lm.model import Transformer
from lit_lm.moe import moe_layers, moe_metrics, update_router_bias
from lit_lm.param_groups import param_groups
from lit_lm.schedules import Schedule
from lit_lm.planner.estimate import flops_per_token
from lit_lm.strategies.base import BaseStrategy
from lit_lm.strategies.checkpoint import OPTIMIZER_FQNS
from lit_lm.strategies.clip import clip_grad_norm_, local_grad_shards
from lit_lm.strategies.compile import compile_backend, speed_up
from lit_lm.strategies.fp8 import check_fp8
from lit_lm.strategies.plan import step_loss_fn

# Lightning's `lightning.pytorch.cli.OptimizerCallable`, spelled here: importing it imports jsonargparse, which a
# machine that only trains (the GPU check's) need not have; jsonargparse reads this type the same way.
OptimizerCallable = Callable[[Iterable], torch.optim.Optimizer]

SCHEDULE_HORIZON = "lit_lm_schedule_horizon"  # the checkpoint's key for the LR schedule's horizon (steps)
DECAY_START = "lit_lm_schedule_decay_start"  # and for WSD's decay start, when the run chose it (decay_start: resume)


def optimizer_target(optimizer: Callable[..., Any]) -> tuple[Optional[type], dict[str, Any]]:
    """The class an optimizer callable builds, and its keyword arguments. jsonargparse (`OptimizerCallable`) gives
    `partial(call_without_instantiate_context, default_class_instantiator, cls, **init_args)`; Python code may
    pass the class, a `functools.partial` of it, or any function (class unknown: None)."""
    if isinstance(optimizer, type):
        return optimizer, {}
    if isinstance(optimizer, functools.partial):
        target, kwargs = optimizer_target(optimizer.func)
        target = target or next((a for a in optimizer.args if isinstance(a, type)), None)
        return target, {**kwargs, **optimizer.keywords}
    return None, {}


def optimizer_from(spec: dict[str, Any]) -> Callable[..., Any]:
    """The callable saved as {class_path, init_args} in the hyper-parameters (plain types), rebuilt."""
    module, _, name = str(spec.get("class_path")).rpartition(".")
    try:
        target = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        raise ConfigError(f"model.init_args.optimizer: no class {spec.get('class_path')!r}; name an optimizer "
                          "class, e.g. torch.optim.SGD") from None
    return functools.partial(target, **spec.get("init_args", {}))


class LanguageModel(L.LightningModule):
    """Next-token prediction with AdamW (decoupled weight decay, none on norms and embeddings) and warmup+cosine,
    or the optimizer and schedule the config names (docs/optim.md).

    The Transformer is built in `configure_model`, not `__init__`, so a sharding strategy can build it under its
    own context (meta device, shard-local allocation) once the process groups exist.

    Args:
        config: the model's shape (`model.init_args.config.*`; `vocab_size` is linked to the data's).
        lr, betas, eps, weight_decay: the default optimizer's, AdamW's (weight_decay on the decayed groups only).
        warmup_steps, min_lr_ratio: every schedule's warmup and floor; it ends at `schedule_steps`.
        schedule_steps: the schedule's horizon. None: the trainer's `max_steps` (or the epochs' steps) when the run
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
        optimizer: an optimizer class with its init_args (`--model.init_args.optimizer torch.optim.SGD
            --model.init_args.optimizer.momentum 0.9`); its own arguments rule (lr, weight_decay, ...: the four
            above are AdamW's only), on the same groups (no decay on norms, biases, embeddings). A class with
            `matrix_wise = True` (lit_lm.optim.Muon) gets the hidden matrices as a group of their own. None: AdamW.
        schedule: the LR's shape (`lit_lm.schedules.Schedule`: cosine, wsd, linear, constant; WSD's decay).
        lora: low-rank adapters on the blocks' linears, everything else frozen (`lit_lm.lora.LoRA`: rank, alpha,
            targets, dropout; docs/finetune.md). None: every weight trains.
    """

    def __init__(self, config: ModelConfig = ModelConfig.signature_default(), lr: float = 3e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1,
                 warmup_steps: int = 100, min_lr_ratio: float = 0.1,
                 kernels: Optional[list[str]] = None, schedule_steps: Optional[int] = None,
                 init_from: Optional[str] = None, compile: Union[bool, str] = False, fp8: Optional[str] = None,
                 optimizer: Optional[OptimizerCallable] = None, schedule: Schedule = Schedule(),
                 lora: Optional[LoRA] = None) -> None:
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
        self.optimizer_fn = optimizer_from(optimizer) if isinstance(optimizer, dict) else optimizer  # dict: saved
        if optimizer is not None:
            _warn_unused_adamw_args(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.schedule = Schedule(**schedule) if isinstance(schedule, dict) else schedule
        self.lora = lora_from(lora)
        if self.lora is not None and fp8 is not None:
            raise ConfigError("model.init_args.fp8 with model.init_args.lora: FP8 replaces the GEMMs of the linears "
                              "and experts the adapters add to; set one of them")
        self.kernels = list(kernels or [])
        self.compile_blocks, self.fp8 = compile_backend(compile), check_fp8(fp8)  # the strategy reads them
        # Plain types only, so `torch.load(weights_only=True)` (LightningCLI's ckpt parsing) can read them.
        self.save_hyperparameters({"config": asdict(config), "lr": lr, "betas": tuple(betas), "eps": eps,
                                   "weight_decay": weight_decay, "warmup_steps": warmup_steps,
                                   "min_lr_ratio": min_lr_ratio, "kernels": self.kernels,
                                   "schedule_steps": schedule_steps, "compile": self.compile_blocks,
                                   "fp8": self.fp8, "optimizer": self._optimizer_hparams(),
                                   "schedule": asdict(self.schedule),
                                   "lora": lora_hparams(self.lora, init_from)})  # not init_from: `config` is its shape
        self.model: Optional[Transformer] = None
        self._horizon: Optional[int] = None  # the LR schedule's, once known (the run's state: kept by checkpoints)
        self._saved_horizon: Optional[int] = None  # the checkpoint's, when resuming
        self._decay_start: Optional[int] = None  # WSD's, once resolved (None: unresolved, or no decay start yet)
        self._decay_resolved = False
        self._saved_decay_start: Optional[int] = None  # the checkpoint's (a run that chose it), when resuming
        self._resumed_step: Optional[int] = None  # the step a fit resumes from
        self.val_loss = MeanMetric()
        self._moe_sum: Optional[Tensor] = None  # MoE statistics summed over the interval's batches, on the device
        self._moe_batches = 0
        self.packing: Optional[Packing] = None  # the rows' documents (data.init_args.document_mask), from setup
        self.loss_masks = False  # the rows carry loss masks (chat data: lit_lm.data.loss_mask), from setup
        self._token_scale = 1.0  # replicas x accumulation / the step's global targets (`per_token`)
        self._step_targets = 0  # the step's global targets (`per_token`)
        self._log_scale = 1.0  # the weighted micro-batch loss -> its own global mean, for the log (`per_token`)

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
        if self.lora is not None:
            add_adapters(self.model, self.lora)
        if self.kernels:
            from lit_lm import kernels
            if self.config.mla_kv_rank and {"rope", "attention"} & set(self.kernels):
                raise ConfigError("the rope and attention kernels do not run multi-head latent attention (its value "
                                  "head dim and interleaved shared rope key): drop them from model.init_args.kernels")
            if self.config.attn_sinks and "attention" in self.kernels:
                raise ConfigError("the attention kernel has no attention sinks (model.init_args.config.attn_sinks): "
                                  "drop it from model.init_args.kernels")
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
        if self._decay_start is not None and self._saved_start_kept():
            checkpoint[DECAY_START] = self._decay_start

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Before the strict load: a sharded checkpoint names a tied head once, by the embedding's name. (lit-lm's
        strategies load the tensors themselves, before this hook, and pass no state_dict.)"""
        if "state_dict" in checkpoint:
            with_tied_head(checkpoint["state_dict"], self.config.tie_embeddings, prefix="model.")
        self._saved_horizon = checkpoint.get(SCHEDULE_HORIZON)
        self._saved_decay_start, self._resumed_step = checkpoint.get(DECAY_START), checkpoint.get("global_step")
        self._horizon, self._decay_resolved = None, False  # resolved again at the next scheduler step

    def schedule_horizon(self) -> int:
        """The step at which the schedule reaches its floor: `schedule_steps` if set, else the horizon the run
        started with (a checkpoint's), else the trainer's total steps. Resolved once, at the first scheduler step
        (after a resume's checkpoint is loaded), and said when a resume keeps or changes it."""
        if self._horizon is None:
            total = int(self.trainer.estimated_stepping_batches) if self._trainer is not None else 1
            wanted, saved = self.hparams.get("schedule_steps"), self._saved_horizon
            self._horizon = wanted or saved or total
            if saved is not None and self._horizon != saved:
                step = self.trainer.global_step
                before, after = (self.schedule.multiplier(step, self.hparams.warmup_steps, h,
                                                          self.hparams.min_lr_ratio, self._decay_start)
                                 for h in (saved, self._horizon))
                rank_zero_info(f"[lit-lm] LR schedule: horizon {saved} -> {self._horizon} steps (schedule_steps) at "
                               f"step {step}: the LR multiplier moves from {before:.3g} to {after:.3g}")
            elif saved is not None and saved != total:
                rank_zero_info(f"[lit-lm] LR schedule: keeps the checkpoint's horizon of {saved} steps (the run now "
                               f"ends at {total}; past step {saved} the LR stays at its floor). Set "
                               "model.init_args.schedule_steps to change it")
        return self._horizon

    def _saved_start_kept(self) -> bool:
        """WSD's decay start is run state (saved, resumed) when the run chose it: `decay_start: resume`, or a
        checkpoint's; a stated step is config and the default (horizon - L) follows the horizon."""
        return self.schedule.name == "wsd" and not isinstance(self.schedule.decay_start, int)

    def decay_start(self) -> Optional[int]:
        """WSD's decay start D: `decay_start` if a step, else the checkpoint's (a branch resumed mid-decay goes on
        with its decay), else with `decay_start: resume` the step this fit resumed from (said, with the LR
        multiplier before and after), else None: the horizon minus the decay's length."""
        if self._decay_resolved:
            return self._decay_start
        wanted, saved, resumed = self.schedule.decay_start, self._saved_decay_start, self._resumed_step
        start = None
        if isinstance(wanted, int):
            start = wanted
        elif saved is not None and self._saved_start_kept():
            start = saved
            rank_zero_info(f"[lit-lm] LR schedule: continues the checkpoint's WSD decay from step {saved}")
        elif wanted == "resume" and resumed is not None:
            start, hp, horizon = resumed, self.hparams, self.schedule_horizon()
            before, after = (self.schedule.multiplier(resumed + 1, hp.warmup_steps, horizon, hp.min_lr_ratio, d)
                             for d in (None, start))
            length = self.schedule.decay_length(horizon)
            rank_zero_info(f"[lit-lm] LR schedule: WSD decays from step {start} (decay_start: resume) over {length} "
                           f"steps, to step {start + length}: the LR multiplier at step {start + 1} moves from "
                           f"{before:.3g} to {after:.3g}")
        self._decay_start, self._decay_resolved = start, True
        return start

    def lr_multiplier(self, step: int) -> float:
        """The schedule's m(step) (lit_lm/schedules.py) for the run's horizon and decay start."""
        hp = self.hparams
        return self.schedule.multiplier(step, hp.warmup_steps, self.schedule_horizon(), hp.min_lr_ratio,
                                        self.decay_start() if self.schedule.name == "wsd" else None)

    def on_train_start(self) -> None:
        """After a resume's checkpoint is loaded (under every strategy), before the first step."""
        if self.schedule.decay_start == "resume" and self._resumed_step is None:
            raise ConfigError("model.init_args.schedule.decay_start: resume starts the decay at the step fit "
                              "resumes from; pass --ckpt_path <a stable-phase checkpoint>, or a step")

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
    def _split(self, batch: Tensor, batch_idx: int) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """(inputs, targets, conversation starts or None) of a (B, T+1) batch; rows with loss masks are decoded
        (`lit_lm.data.loss_mask`: targets -100 where not trained on)."""
        inputs, targets, starts = loss_mask.decode(batch) if self.loss_masks else (batch[:, :-1], batch[:, 1:], None)
        if batch_idx == 0:  # one check per loop: a sync on GPU, so not every step
            top = int(inputs.max())
            if top >= self.config.vocab_size:
                raise ConfigError(f"token id {top} >= model.init_args.config.vocab_size={self.config.vocab_size}: "
                                  "the data's tokenizer is larger than the model's vocabulary; make them equal")
        return inputs, targets, starts

    def setup(self, stage: str) -> None:
        """The data module's `packing()` (after its setup: the tokenizer's EOS), when it has one, and whether its rows
        carry loss masks (refused under a pipeline, whose schedule starts each microbatch's backward itself)."""
        data = getattr(self._trainer, "datamodule", None)
        if hasattr(data, "packing"):
            self.packing = data.packing()
        self.loss_masks = bool(getattr(data, "flagged", False))
        layout = getattr(getattr(self._trainer, "strategy", None), "layout", None)
        if self.loss_masks and stage == "fit" and getattr(layout, "pp_size", 1) > 1:
            raise ConfigError("chat data's loss masks (data.init_args.format chat / train_on / packing) under "
                              "pipeline parallelism are not built yet (its schedule weighs microbatches equally); use "
                              "dp, ZeRO, tp, cp or ep")

    def host_documents(self, batch: Tensor) -> Optional[Tensor]:
        """(B, T) document ids of a (B, T+1) batch still on the host, as `step_loss` will compute them on the device;
        None without packing. A strategy plans from them before the transfer (`lit_lm.strategies.cp_balance`)."""
        if self.packing is None:
            return None
        inputs, _, starts = loss_mask.decode(batch) if self.loss_masks else (batch[:, :-1], None, None)
        return self.packing.rows(inputs, starts if self.packing.starts else None)[0]

    def step_loss(self, inputs: Tensor, targets: Tensor, starts: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """The step's (loss, ce), through the strategy's loss seam (`lit_lm.strategies.plan.LossSeam`): a pipeline
        runs its schedule, a context split feeds the model its share of the tokens; other strategies call
        `model.loss`. With `packing`, the whole rows' `documents` and `positions` (B, T) go with them (a strategy
        that splits the batch splits them alike); chat rows' documents come from their `starts`."""
        loss_fn = step_loss_fn(getattr(self._trainer, "strategy", None), self.model)
        if self.packing is None:
            return loss_fn(inputs, targets)
        documents, positions = self.packing.rows(inputs, starts if self.packing.starts else None)
        return loss_fn(inputs, targets, positions=positions, documents=documents)

    def per_token(self, loss: Tensor, targets: Tensor, batch_idx: int) -> Tensor:
        """The micro-batch's loss weighted so that the step's gradient is that of the mean over every target of the
        GLOBAL batch (all dp replicas, all accumulated micro-batches), whatever each micro-batch's share of them:

            step gradient = 1/(R·A) Σ_{replica, micro-batch} ∇(loss_mb · n_mb · R·A / N) = ∇(Σ token losses) / N

        (`loss_mb`: the mean over the micro-batch's n_mb targets; the data-parallel sync averages over R replicas,
        Lightning divides by A = accumulate_grad_batches; N: the step's targets, `step_targets`, known on the host
        before the step from the rows' masks, so no collective and no device read). A micro-batch without a
        target contributes 0. Without masks every weight is exactly 1.

        For the log, `_log_scale` = N / (A·N_mb) (N_mb: the micro-batch's targets over the replicas; 1 without
        accumulation) turns the ranks' mean of the weighted loss back into the micro-batch's own mean over its
        targets, Σ loss_mb·n_mb / N_mb, what `train_loss` says without masks."""
        accumulate = self.trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0:  # the step's first micro-batch
            count = self.step_targets(batch_idx, min(accumulate, self.trainer.num_training_batches - batch_idx))
            self._token_scale = self._replicas() * accumulate / count if count else 0.0
            self._step_targets = count
        here = self._step_targets if accumulate == 1 else self.step_targets(batch_idx, 1)
        self._log_scale = self._step_targets / (accumulate * here) if here else 0.0
        n = (targets != loss_mask.IGNORE).sum()
        return torch.where(n > 0, loss * n * self._token_scale, torch.zeros_like(loss))

    def _replicas(self) -> int:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None)
        return kwargs["num_replicas"] if kwargs else 1

    def step_targets(self, batch_idx: int, micro_batches: int) -> int:
        """The targets of the optimizer step beginning at this micro-batch: `micro_batches` global batches from the
        data's current position (`TextDataModule.step_targets`)."""
        data = self.trainer.datamodule
        return data.step_targets(data.samples_consumed(), micro_batches * data.batch_size * self._replicas())

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        """The loss, logged every micro-batch as the ranks' mean (`sync_dist`: one scalar all-reduce queued on the
        device, no host read; `prog_bar` would make Lightning read it every step, `StepProgress` shows it at logging
        steps), so `callback_metrics["train_loss"]` is this batch's global loss for any callback that monitors it
        (ModelCheckpoint, EarlyStopping, the parity harness); the MoE statistics are summed on the device and logged
        as their mean over each logging interval, read once."""
        x, y, starts = self._split(batch, batch_idx)
        loss, _ = self.step_loss(x, y, starts)
        if self.loss_masks:
            loss = self.per_token(loss, y, batch_idx)
        self.log("train_loss", loss.detach() * self._log_scale if self.loss_masks else loss.detach(), sync_dist=True)
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
        x, y, starts = self._split(batch, batch_idx)
        _, ce = self.step_loss(x, y, starts)
        n = (y != loss_mask.IGNORE).sum()
        ce = torch.where(n > 0, ce, torch.zeros_like(ce))  # a batch without targets has no mean (0/0)
        self.val_loss.update(ce, weight=n)
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
        batch = loss_mask.decode(batch)[0] if self.loss_masks else batch
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

    def _optimizer_hparams(self) -> Optional[dict[str, Any]]:
        """The optimizer as plain types for the checkpoint: {class_path, init_args}, or None for the default."""
        if self.optimizer_fn is None:
            return None
        target, kwargs = optimizer_target(self.optimizer_fn)
        named = target if target is not None else self.optimizer_fn
        return {"class_path": f"{named.__module__}.{named.__qualname__}", "init_args": kwargs}

    def configure_optimizers(self) -> dict[str, Any]:
        """The optimizer on `param_groups` (a matrix-wise one, whose class says `matrix_wise = True`, gets the hidden
        matrices as a group of their own) and a LambdaLR of the schedule's multiplier, stepped every optimizer step."""
        hp, tied = self.hparams, self.model.config.tie_embeddings
        if self.optimizer_fn is None:  # today's AdamW, today's groups
            optimizer = torch.optim.AdamW(param_groups(self.model, hp.weight_decay, tied), lr=hp.lr,
                                          betas=tuple(hp.betas), eps=hp.eps)
        else:
            matrix_wise = getattr(optimizer_target(self.optimizer_fn)[0], "matrix_wise", False) is True
            groups = [{k: v for k, v in g.items() if v is not None}  # decayed: the optimizer's own weight_decay
                      for g in param_groups(self.model, None, tied, matrix_wise)]
            try:
                optimizer = self.optimizer_fn(groups)
            except (TypeError, ValueError) as e:
                name = hp.optimizer["class_path"] if hp.optimizer else self.optimizer_fn
                raise ConfigError(f"{name} cannot train lit-lm's parameter groups (model.init_args.optimizer): "
                                  f"{e}; use an elementwise torch.optim optimizer (AdamW, SGD, ...) or "
                                  "lit_lm.optim.Muon") from e
        self._horizon, self._decay_resolved = None, False
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self.lr_multiplier(step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _warn_unused_adamw_args(**given: Any) -> None:
    """`lr`, `betas`, `eps`, `weight_decay` set away from their defaults beside a configured optimizer: they are the
    default AdamW's, and the optimizer's own init_args rule; said once, naming where to put them."""
    defaults = inspect.signature(LanguageModel.__init__).parameters
    unused = [f"{name}={value}" for name, value in given.items() if value != defaults[name].default]
    if unused:
        rank_zero_warn(f"[lit-lm] model.init_args {', '.join(unused)}: unused beside model.init_args.optimizer (they "
                       "are the default AdamW's); set them in the optimizer's init_args")


__all__ = ["LanguageModel", "optimizer_from", "optimizer_target"]
