"""What a layout costs per rank before launching it: model-state and activation bytes, FLOPs, communication and
the pipeline bubble. Plain arithmetic on the model's shapes: no Lightning API and no process group (importing
`strategies` for its pure helpers still registers the strategies with Lightning, as for every engine).

    est = estimate(Workload(cfg, seq_len=4096, global_batch=512, precision="bf16-mixed"),
                   ParallelConfig(dp_shard=8, zero_stage=3, tp=8))
    est.peak_bytes, est.flops, est.wire_bytes, est.bubble

The configuration is the strategy's own (`lit_lm.strategies.layout.ParallelConfig`: `pp x dp_replicate x dp_shard x cp x
tp`, with `ep` carved from `dp_shard x cp`; the workload adds activation checkpointing none | full | selective and
gradient accumulation); `refused` is the `lit_lm.strategies.layout.REFUSED` entry the strategy would raise for it (None:
it runs; `lit_lm.planner.plan` plans only those).

Where the figures come from, so that they match what the strategies allocate and send:
- shapes: the model built on the meta device (the same `Transformer`), its `tensor_parallel_plan()` and
  `expert_plan()`; shards use `torch.chunk` rows (the largest shard, rank 0 of each group, is reported);
- model state: the ZeRO engine's layout (`lit_lm.strategies.zero_engine`): fp32 master rows, Adam m and v at shard size
  (plus one 4-byte `step` per tensor, as torch keeps it), stage >= 2 gradients in one flat fp32 buffer of the
  owned rows (the flat optimizer step's); without ZeRO, gradients and optimizer state of the whole local model;
- activations: the tensors this model's autograd saves, counted from the code (`model.py`): per block
  attention 3btd + 2b t kv (activation dtype) + the fp32 softmax statistics b h t, MLP btd + 4btf, each RMSNorm
  2btd + bt in fp32; tensor parallelism splits the regions' insides, sequence parallelism also the norms;
  a pipeline rank holds as many microbatches as its schedule keeps in flight (`Schedule.peak_in_flight`);
  under bf16 autocast also each projection's own cast of its input and the cast weights; measured in fp32 and
  bf16 autocast (dense within 1%, MoE within 10%); activation checkpointing (`lit_lm.strategies.ac`) keeps per block
  its input (full) or also its matmul and attention outputs (selective), plus one block recomputed in backward:
  the per-block figures are `tests/test_ac.py`'s expected bytes (fp32, dense and MoE, exact);
- communication: the collectives the strategies issue, in the accounting layer's terms (`lit_lm.strategies.comm`: the
  full logical tensor per call; on the wire times `wire_factor`): all-reduce 2(N-1)/N Φ, ZeRO-3 3(N-1)/N Φ,
  tensor parallelism 2 collectives per region (attention, a dense MLP) per step each way, pipelines their
  activations (a send and its recv each), cp's K/V and fp32 dK/dV per attention layer (the ring's sends and their
  recvs, or all-gathers and a reduce-scatter, or Ulysses' all-to-alls: `lit_lm.strategies.cp.comm_theory`'s
  volumes), experts 4 all-to-alls of
  token rows and one of the counts per MoE layer and forward (the rows under balanced routing: an expectation,
  met by the mean over an ep group's ranks), MoE global balancing an all-gather of the per-expert counts over dp
  per layer and forward; gradient finishes after the dp reduce (tp partial sums, a tied embedding over the first
  and last stage) on this rank's ZeRO rows only; the forwards activation checkpointing recomputes are not counted;
  the bubble from `lit_lm.strategies.pp_schedules.bubble_theory`;
- packed documents (`Workload.document_length`, their assumed mean length): the attention term of the FLOPs is the
  share of causal pairs the document mask leaves, and under cp the busiest rank's excess over the mean rank's
  attention (`RankEstimate.cp_excess_flops`: the split's imbalance; none under Ulysses) is in its work
  (`lit_lm.planner.documents`);
- MoE layers under tensor parallelism: the model's plan replicates them over tp (`batch` style, sequence
  parallelism off): every tp rank holds every expert (or its ep share) and computes the layer whole, so its FLOPs
  are not divided by tp (`RankEstimate.replicated_flops`: the part the tp peers repeat).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from lit_lm.config import ConfigError, ModelConfig
from lit_lm.lora import LoRA, add_adapters, lora_factor
from lit_lm.planner.documents import allowed_share, imbalance
from lit_lm.planner.optimizer import NS_BYTES, NS_STEPS, OPTIMIZERS, Cut, muon_matrix, ns_work, state_bytes
from lit_lm.strategies.ac import MODES as CHECKPOINTING
from lit_lm.strategies.comm import wire_factor, zero_forms
from lit_lm.strategies.cp import ulysses_size_for
from lit_lm.strategies.fp8 import check_fp8, fp8_experts, fp8_linears, tp_amax_numels
from lit_lm.strategies.flat_step import piece_numel
from lit_lm.strategies.grad_sync import GradSync, _bucketize
from lit_lm.strategies.layout import ParallelConfig, Refusal
from lit_lm.strategies.pp_schedules import bubble_theory, build_schedule, schedule_spec
from lit_lm.strategies.pp_split import split_layers

PRECISIONS = {"32-true": (4, 4), "bf16-mixed": (4, 2), "bf16-true": (2, 2)}  # (parameter, activation) bytes
# The moments of a step whose holdings differ (`RankEstimate.moment_peaks`), and the phases a resident-memory
# measurement separates them into (scripts/bench_peaks.py)
MOMENTS = ("build", "engines", "backward", "backward_head", "backward_end", "step", "after_step")
PHASES = {"setup": ("build", "engines"), "fwd_bwd": ("backward", "backward_head", "backward_end"),
          "step": ("step", "after_step")}
THROUGH_BACKWARD = ("backward", "backward_head")  # a transient that lives through the whole backward is in both
DEVICES = ("cuda", "cpu")  # where the ranks run: what torch's default optimizer implementation is there
GLOO_STAGING = "gloo's all-gather staging (a whole unit)"
# ZeRO-1's owned rows of an fp32 gradient are views of the whole one (`ZeroEngine._complete_reduce`): the last step's
# gradients live until Lightning's zero_grad, after the step's loss, which under a pipeline is every backward
PREVIOUS_GRADS = "the previous step's gradients (ZeRO-1 under a pipeline)"
GRAD_SYNC = {k: v.default for k, v in inspect.signature(GradSync.__init__).parameters.items()
             if k in ("bucket_cap_mb", "first_bucket_mb")}  # its buckets (the strategy's default cap is the same)


def flops_per_token(num_params: int, n_layers: int, d_model: int, seq_len: int) -> int:
    """Training FLOPs per token, forward + backward: 6N + 12 L d T (PaLM, appendix B).

    6N: each parameter that takes part in a matmul costs 2 FLOPs (multiply-add) per token forward and 4 backward
    (gradients of input and weight); N excludes the input embedding (a lookup), includes the LM head, and for MoE
    counts the experts a token is routed to (`ModelConfig.num_params(active=True)`).
    12 L d T: per layer, q k^T and (softmax) v are 2 * 2 * T * d FLOPs per token forward, x3 with backward. The
    causal mask halves the work actually needed but, as in PaLM and most MFU reports, it is not discounted.
    Activation recomputation is not counted (model FLOPs, not hardware FLOPs).
    """
    return 6 * num_params + 12 * n_layers * d_model * seq_len


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, layer: int) -> int:
    """Training FLOPs per token of block `layer`'s attention scores and weighted values (PaLM's 12 d T, generalised):
    q k^T over `span` keys is 2 span H D_qk FLOPs forward, the weighted values 2 span H D_v, x3 with backward. Span:
    the sequence, or the layer's window when shorter (gpt-oss's sliding layers: the keys a query can see; the causal
    half is not discounted, as PaLM's). Grouped-query attention: D_qk = D_v = head_dim, 12 H head_dim T = 12 d T;
    latent attention (`lit_lm.mla`): D_qk = nope + rope dims, D_v = v dims. A sink is one more logit per row: not
    counted. Layers past the blocks (multi-token prediction's) take the config's window."""
    window = cfg.window(layer) if layer < cfg.n_layers else cfg.sliding_window
    span = min(seq_len, window or seq_len)
    if cfg.mla_kv_rank:
        qk, v = cfg.mla_qk_nope_dim + cfg.mla_qk_rope_dim, cfg.mla_v_dim
    else:
        qk = v = cfg.head_dim
    return 6 * span * cfg.n_heads * (qk + v)


def model_flops_per_token(cfg: ModelConfig, seq_len: int, layers: Optional[list[int]] = None) -> float:
    """Training FLOPs per token of `layers` (default: the whole model) from the model's own shapes: 6 per
    parameter a token multiplies by in those blocks (`block_active_params`), each block's attention
    (`attention_flops_per_token`), and where the last block is among them the final norm and head, and the
    multi-token prediction modules (`lit_lm.mtp`): module k runs its block, eh_proj (2d -> d), its norms and the
    shared head again on T - k of the T positions. A dense GQA model without windows: `flops_per_token`."""
    layers = list(range(cfg.n_layers)) if layers is None else layers
    d, head = cfg.d_model, cfg.padded_vocab_size * cfg.d_model
    flops = float(sum(6 * block_active_params(cfg, i) + attention_flops_per_token(cfg, seq_len, i) for i in layers))
    if cfg.n_layers - 1 in layers:
        flops += 6 * (head + d)
        for k in range(1, cfg.mtp_layers + 1):
            layer = cfg.n_layers + k - 1
            module = block_active_params(cfg, layer) + 2 * d * d + 3 * d + head
            flops += (seq_len - k) / seq_len * (6 * module + attention_flops_per_token(cfg, seq_len - k, layer))
    return flops


def block_active_params(cfg: ModelConfig, layer: int) -> int:
    """The parameters of block `layer` one token multiplies by (norms included; an MoE block's router, shared
    experts and top_k routed experts): `ModelConfig.num_params(active=True)`'s count of a one-block model of that
    kind, less its final norm and head."""
    return _one_block(_config_key(cfg), cfg.is_moe_layer(layer))


@functools.lru_cache(maxsize=64)
def _one_block(key: str, moe: bool) -> int:
    cfg = _config_of(key)
    one = dataclasses.replace(cfg, n_layers=1, layer_types=None, mtp_layers=0, moe_first_dense=0, moe_every=1,
                              **({} if moe else {"moe_experts": 0, "moe_groups": 1, "moe_topk_groups": 1}))
    head = 0 if cfg.tie_embeddings else cfg.padded_vocab_size * cfg.d_model
    return one.num_params(include_embedding=False, active=True) - head - cfg.d_model


@dataclass(frozen=True)
class Workload:
    """What is trained and how each rank runs it besides the parallel configuration: the model, tokens per
    sequence and per optimizer step, precision, recomputation and gradient accumulation."""

    config: ModelConfig
    seq_len: int
    global_batch: int  # sequences per optimizer step, over all replicas
    precision: str = "bf16-mixed"
    checkpointing: str = "none"  # none | full | selective, as `lit_lm.strategies.ac` runs them
    accumulate: int = 1  # Lightning's accumulate_grad_batches: micro-steps per optimizer step
    device: str = "cuda"  # what the ranks run on (`DEVICES`): torch's default optimizer step differs there
    fp8: Optional[str] = None  # the model's FP8 recipe (`strategies.fp8`): ZeRO-3 gathers tensorwise weights in FP8
    optimizer: str = "adamw"  # `OPTIMIZERS`: AdamW (any elementwise one with two moments) or Muon (lit_lm.optim)
    ns_mode: str = "auto"  # Muon's: how the strategy spreads Newton-Schulz (`lit_lm.planner.optimizer.ns_work`)
    ns_dtype: str = "bfloat16"  # Muon's: what Newton-Schulz computes in, and the pieces travel in
    ns_steps: int = NS_STEPS  # Muon's Newton-Schulz steps per optimizer step
    # packed documents (data.init_args.document_mask): their mean length in tokens, the planner's assumption
    # (`lit_lm.planner.documents`: exponential lengths); None: attention crosses documents (no mask)
    document_length: Optional[int] = None
    lora: Optional[LoRA] = None  # model.init_args.lora: only the adapters train (`trains` of `ParamSpec`)

    def __post_init__(self) -> None:
        check_fp8(self.fp8)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision {self.precision!r}: the estimate knows {', '.join(PRECISIONS)}")
        if self.checkpointing not in CHECKPOINTING:
            raise ConfigError(f"activation checkpointing {self.checkpointing!r}: choose {', '.join(CHECKPOINTING)}")
        if not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ConfigError(f"accumulate {self.accumulate!r}: must be an integer >= 1")
        if self.device not in DEVICES:
            raise ConfigError(f"device {self.device!r}: the estimate knows {', '.join(DEVICES)}")
        length = self.document_length
        if length is not None and not (isinstance(length, int) and length > 0):
            raise ConfigError(f"document length {self.document_length!r}: a mean number of tokens >= 1")
        if self.optimizer not in OPTIMIZERS or self.ns_dtype not in NS_BYTES:
            raise ConfigError(f"optimizer {self.optimizer!r}, ns_dtype {self.ns_dtype!r}: the estimate knows "
                              f"{', '.join(OPTIMIZERS)} and {', '.join(NS_BYTES)}")

    @property
    def tokens(self) -> int:
        return self.seq_len * self.global_batch


@dataclass
class RankEstimate:
    """One pipeline rank (rank 0 of its other groups: the largest shards). Bytes and FLOPs per optimizer step."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    buffers: int = 0  # communication buffers: ZeRO-3 gathered units, pipeline outputs held (DDP buckets are the grads)
    slots: int = 0  # ZeRO-1/2's two comm slots (`zero_engine.CommSlots`), held from the first backward on
    activations: int = 0
    flops: float = 0.0  # model FLOPs (what MFU counts)
    replicated_flops: float = 0.0  # what the tp peers compute again (MoE layers are replicated over tp)
    recompute_flops: float = 0.0  # the forwards activation checkpointing runs again
    cp_excess_flops: float = 0.0  # with documents, the attention the busiest cp rank does above the mean rank's
    optimizer_flops: float = 0.0  # Muon's Newton-Schulz on this rank (`lit_lm.planner.optimizer.ns_work`)
    comm: dict[tuple[str, str], int] = field(default_factory=dict)  # (group, op) -> logical bytes, as recorded
    _sizes: dict[str, int] = field(default_factory=dict, repr=False)  # ranks per group

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optimizer

    # what lives only at one moment of the step, on top of what `moment_peaks` says holds then: {moment: {name:
    # bytes}} (`MOMENTS`; filled by `_transients`)
    transients: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        """The most this rank holds at once: the largest of its moments (`moment_peaks`)."""
        return max(self.moment_peaks().values())

    def moment_peaks(self) -> dict[str, int]:
        """Bytes held at each moment of `MOMENTS`: what persists there plus that moment's named transients."""
        held = {"build": self.params, "engines": self.params + self.grads,
                "backward": self.model_state + self.slots + self.buffers + self.activations,
                "backward_head": self.model_state + self.slots + self.buffers + self.activations,
                "backward_end": self.model_state + self.slots, "step": self.model_state + self.slots,
                "after_step": self.model_state + self.slots}
        return {m: held[m] + sum(self.transients.get(m, {}).values()) for m in MOMENTS}

    def phase_peaks(self) -> dict[str, int]:
        """The moments grouped as a measurement sees a step's phases: `setup` (the model built and split, the
        engines and optimizer made), `fwd_bwd` (forward, backward, the gradient reduction), `step` (the optimizer
        step and what follows it to the batch's end)."""
        at = self.moment_peaks()
        return {phase: max(at[m] for m in moments) for phase, moments in PHASES.items()}

    def categories(self) -> dict[str, int]:
        """Every named figure of this rank in bytes; a transient as `moment/name`."""
        out = {"params": self.params, "grads": self.grads, "optimizer": self.optimizer, "buffers": self.buffers,
               "slots": self.slots, "activations": self.activations}
        for moment, terms in self.transients.items():
            out.update({f"{moment}/{k}": v for k, v in terms.items()})
        return out

    def add_transient(self, moment: str, name: str, nbytes: int) -> None:
        if nbytes:
            terms = self.transients.setdefault(moment, {})
            terms[name] = terms.get(name, 0) + int(nbytes)

    @property
    def work_flops(self) -> float:
        """What this rank computes: its model FLOPs, what its tp peers compute too, the recomputation and the
        optimizer's Newton-Schulz."""
        return self.flops + self.replicated_flops + self.recompute_flops + self.optimizer_flops + self.cp_excess_flops

    def wire(self, group: Optional[str] = None, op: Optional[str] = None) -> float:
        """Bytes this rank sends per step (ring algorithm), over one group (and op) or all."""
        return sum(nbytes * wire_factor(o, self._sizes[g]) for (g, o), nbytes in self.comm.items()
                   if group in (None, g) and op in (None, o))

    def add_comm(self, group: str, op: str, nbytes: float, size: int) -> None:
        if size > 1 and nbytes:
            self.comm[(group, op)] = self.comm.get((group, op), 0) + int(nbytes)
            self._sizes[group] = size


@dataclass
class Estimate:
    workload: Workload
    config: ParallelConfig
    ranks: list[RankEstimate]  # per pipeline rank
    bubble: float
    refused: Optional[Refusal] = None  # the `REFUSED` entry the strategy raises for this config; None: it runs

    def describe(self) -> str:
        """The configuration and the accumulation, as the planner prints them."""
        accumulate = self.workload.accumulate
        return self.config.describe() + (f" accum{accumulate}" if accumulate > 1 else "")

    @property
    def worst(self) -> RankEstimate:
        return max(self.ranks, key=lambda r: r.peak)

    @property
    def peak_bytes(self) -> int:
        return self.worst.peak

    @property
    def flops(self) -> float:
        return max(r.flops for r in self.ranks)

    @property
    def work_flops(self) -> float:
        """The busiest pipeline rank's computation (`RankEstimate.work_flops`): what its step time is made of."""
        return max(r.work_flops for r in self.ranks)

    def wire_bytes(self, group: Optional[str] = None, op: Optional[str] = None) -> float:
        return max(r.wire(group, op) for r in self.ranks)

    def group_size(self, group: str) -> int:
        """The ranks of `group` as counted (1 where it sends nothing: the hybrid cp's "cp_ulysses" at u = 1)."""
        return max(r._sizes.get(group, 1) for r in self.ranks)

    @property
    def groups(self) -> list[str]:
        return sorted({g for r in self.ranks for g, _ in r.comm})


# -- the model's parameters, from a meta-device build --------------------------------------------------------------
@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    unit: str  # "root", "blocks.<i>" or "tail" (after the blocks: ZeRO-1/2's own unit, ZeRO-3's root): what ZeRO
    # gathers and reduces together
    layer: Optional[int]
    tp_style: Optional[str]  # the plan's style for the parameter's module (column, row, vocab_*, sequence, ...)
    expert: bool
    fp8: bool = False  # a weight FP8 swaps: a block linear's or an expert stack's (`lit_lm.strategies.fp8.fp8_linears`,
    # `fp8_experts`)
    trains: bool = True  # False: frozen (LoRA's base weights): held, but no gradient and no optimizer state


def _config_key(cfg: ModelConfig) -> str:
    """The config as a cache key: JSON, so that its dict and list fields (YaRN's rope_scaling, gpt-oss's
    layer_types) hash (`_config_of` reads it back)."""
    return json.dumps(dataclasses.asdict(cfg), sort_keys=True)


def _config_of(key: str) -> ModelConfig:
    return ModelConfig(**json.loads(key))


@functools.lru_cache(maxsize=16)
def _inventory(key: tuple, lora: Optional[LoRA] = None) -> tuple[ParamSpec, ...]:
    """The parameters in registration order; with `lora`, the adapters beside their linears (`lit_lm.lora`) and
    everything else frozen."""
    from lit_lm.model import Transformer

    cfg = _config_of(key)
    with torch.device("meta"):
        model = Transformer(cfg)
    # MoE layers: `batch`, their parameters unsplit; multi-token prediction has no tp plan (`check_layout`)
    plan = {} if cfg.mtp_layers else model.tensor_parallel_plan()
    experts = set(model.expert_plan())
    swapped = {f"{n}.weight" for n in fp8_linears(model)}
    swapped |= {f"{n}.{p}" for n, m in fp8_experts(model).items() for p, _ in m.named_parameters(recurse=False)}
    if lora is not None:
        add_adapters(model, lora)
    out, seen_blocks = [], False
    for name, p in model.named_parameters():
        module = name.rpartition(".")[0]
        layer = int(name.split(".")[1]) if name.startswith("blocks.") else None
        seen_blocks |= layer is not None
        unit = f"blocks.{layer}" if layer is not None else "tail" if seen_blocks else "root"
        out.append(ParamSpec(name, tuple(p.shape), unit, layer, _tp_style(plan[module].style, lora_factor(name))
                             if module in plan else None, module in experts, name in swapped, p.requires_grad))
    return tuple(out)


def _tp_style(style: str, factor: Optional[str]) -> Optional[str]:
    """A parameter's tp style; an adapter's factor is cut along its base linear's cut dimension or kept whole
    (`lit_lm.strategies.tp_layers.shard_adapted`): column -> B's rows (A whole), row -> A's columns (B whole)."""
    if (factor == "A" and style == "column") or (factor == "B" and style == "row"):
        return None
    return style


def _chunk(n: int, parts: int) -> int:
    """Rows of the largest `torch.chunk` piece (rank 0's)."""
    return -(-n // parts)


def _local_shape(p: ParamSpec, layout: ParallelConfig) -> tuple[int, ...]:
    """The shape rank 0 of the tp (and ep) group holds."""
    shape = list(p.shape)
    if layout.tp > 1 and p.tp_style in ("column", "vocab_embedding", "vocab_head", "heads"):  # heads: the sinks
        shape[0] = _chunk(shape[0], layout.tp)
    elif layout.tp > 1 and p.tp_style == "row" and len(shape) > 1:  # a row-parallel bias is whole (gpt-oss's wo)
        shape[1] = _chunk(shape[1], layout.tp)
    if p.expert and layout.ep > 1:
        shape[0] = _chunk(shape[0], layout.ep)
    return tuple(shape)


# -- model state -----------------------------------------------------------------------------------------------
def _model_state(rank: RankEstimate, units: dict[str, list[tuple[int, ...]]], stage: int, group: int,
                 pbytes: int, group_name: str, accumulate: int, reduce_in_backward: bool,
                 fp8: Optional[dict[str, list[int]]] = None,
                 forms: tuple[str, str] = ("reduce_scatter", "all_gather"),
                 matrix: Optional[dict[str, list[bool]]] = None,
                 trains: Optional[dict[str, list[bool]]] = None) -> None:
    """Params, grads, optimizer state and the data-parallel collectives of `units` ({unit: local shapes}) under
    ZeRO `stage` over `group` ranks (stage 0: `GradSync`'s bucketed all-reduce). Under accumulation stages 2-3
    reduce-scatter after every micro-step's backward into the shard (docs/zero.md), stage 1 and GradSync once at the
    window's end; ZeRO-3 gathers for every forward and backward. Without `reduce_in_backward` (a pipeline runs many
    backwards per step) stage 2 keeps the full gradient until the window's end and reduces it once, as stage 1.
    `fp8` ({unit: per shape its amaxes, 0 when not in FP8}): ZeRO-3's FP8 weights (tensorwise), gathered as e4m3
    bytes (1 per element) after one all-reduce of the unit's fp32 amaxes, one per linear, one per expert of a
    stack (`lit_lm.strategies.zero_engine.Fp8Layout`). `forms`: the ops ZeRO's reduce-scatter and all-gather run
    as (`lit_lm.strategies.comm.zero_forms`: the same logical bytes, an all-reduce's twice on the wire). `matrix`
    ({unit: per shape whether Muon steps it}): its one momentum buffer there (`lit_lm.planner.optimizer`).
    `trains` ({unit: per shape whether it trains}; default all): a frozen parameter (LoRA's base) is held as in
    full fine-tuning, its rows and master rows, gathered by ZeRO-3, but has no gradient and no optimizer state;
    GradSync leaves it out of its buckets, ZeRO reduces it with its unit (zeros)."""
    shapes = [s for unit in units.values() for s in unit]
    numel = sum(math.prod(s) for s in shapes)
    matrix, trains = matrix or {}, trains or {}
    if stage == 0:
        flags = [f for name, unit in units.items() for f in matrix.get(name, [False] * len(unit))]
        taught = [t for name, unit in units.items() for t in trains.get(name, [True] * len(unit))]
        trained = [math.prod(s) for s, t in zip(shapes, taught) if t]
        rank.params += numel * pbytes
        rank.grads += sum(trained) * pbytes  # GradSync's buckets: the .grads are views into them
        rank.optimizer += state_bytes(trained, [f for f, t in zip(flags, taught) if t], pbytes)  # parameter dtype
        rank.add_comm(group_name, "all_reduce", sum(trained) * pbytes, group)
        return
    master_copy = pbytes != 4  # fp32 parameters are their own master rows (a view)
    fp8 = fp8 if stage == 3 else None
    gathered_bytes = {}  # per unit, whole: what ZeRO-3 holds of it gathered
    for name, shapes in units.items():
        in_fp8 = (fp8 or {}).get(name, [False] * len(shapes))
        gathered_bytes[name] = sum(math.prod(s) * (1 if f else pbytes) for s, f in zip(shapes, in_fp8))
        rows = [(_chunk(s[0], group), min(_chunk(s[0], group), s[0]), math.prod(s[1:])) for s in shapes]
        # padded, one rank's share of the packed buffer: every row of the unit, a frozen one's as zeros (the engine
        # packs and reduces whole units; `ZeroEngine._launch_reduce`)
        segment = sum(chunk * row for chunk, _, row in rows)
        local = sum(mine * row for _, mine, row in rows)
        full = sum(math.prod(s) for s in shapes)
        rank.params += full * pbytes * (stage < 3) + local * 4 * (stage == 3 or master_copy)
        taught = trains.get(name, [True] * len(shapes))  # from here on, what trains only
        trained = [r for r, t in zip(rows, taught) if t]
        muon = [m for m, t in zip(matrix.get(name, [False] * len(shapes)), taught) if t]
        local = sum(mine * row for _, mine, row in trained)
        full = sum(math.prod(s) for s, t in zip(shapes, taught) if t)
        # stage 1: the full gradient (and an fp32 copy of the owned rows below fp32); stages 2-3: the reduced rows
        # in the flat fp32 gradient buffer of the optimizer step (lit_lm/strategies/flat_step.py), under a pipeline
        # stage 2 also the full gradient until it is reduced
        if stage == 1:
            rank.grads += full * pbytes + local * 4 * master_copy
            if not reduce_in_backward and not master_copy:  # a pipeline: the step's loss runs every backward
                for moment in THROUGH_BACKWARD:
                    rank.add_transient(moment, PREVIOUS_GRADS, full * pbytes)
        else:
            rank.grads += local * 4 + full * pbytes * (not reduce_in_backward)
        rank.optimizer += state_bytes([mine * row for _, mine, row in trained], muon, 4)
        gathers = 2 * accumulate if stage == 3 else 1
        reduces = accumulate if stage >= 2 and reduce_in_backward else 1
        rank.add_comm(group_name, forms[0], reduces * group * segment * pbytes, group)
        wire = sum(chunk * row * (1 if f else pbytes) for (chunk, _, row), f in zip(rows, in_fp8))
        rank.add_comm(group_name, forms[1], gathers * group * wire, group)
        if any(in_fp8):
            rank.add_comm(group_name, "all_reduce", gathers * 4 * sum(in_fp8), group)
    if stage == 3:  # the unit being used and the one prefetched, whole
        rank.buffers += sum(sorted(gathered_bytes.values(), reverse=True)[:2])


# -- what a step holds only for a moment --------------------------------------------------------------------------
def _engine_steps(shapes: list[tuple[int, ...]], units: dict[str, list[tuple[int, ...]]], stage: int, group: int,
                  pbytes: int, device: str) -> list[int]:
    """Numels of the tensors torch's optimizer step is handed for the parameters one data-parallel engine holds
    (`shapes` in registration order, `units` as ZeRO packs them), one param group: where the members are views of
    a flat master and a flat gradient the step hands torch pieces of it (`lit_lm/strategies/flat_step.py`: runs of
    consecutive members of at most `piece_numel`, a larger member alone; the whole flat on an accelerator),
    elsewhere the members one by one. Flat: `GradSync`'s buckets (laid out in backward order, `_bucketize`), ZeRO
    stages 2-3 where the master is its own buffer (stage 3, or parameters below fp32); stages 1-2 over fp32
    parameters step the parameter's own rows, and a rank without data-parallel peers has no engine."""
    if group == 1:
        return [math.prod(s) for s in shapes]
    limit = piece_numel(torch.device(device))
    if stage == 0:
        metas = [torch.empty(s, device="meta", dtype=torch.float32 if pbytes == 4 else torch.bfloat16)
                 for s in shapes]
        flats = [[m.numel() for m in b] for b in _bucketize(reversed(metas), GRAD_SYNC["bucket_cap_mb"] * 2**20,
                                                            GRAD_SYNC["first_bucket_mb"] * 2**20)]
    elif stage >= 2 and (stage == 3 or pbytes != 4):
        flats = [[min(_chunk(s[0], group), s[0]) * math.prod(s[1:]) for u in units.values() for s in u]]
    else:  # the param group's order: registration order
        return [min(_chunk(s[0], group), s[0]) * math.prod(s[1:]) for s in shapes]
    pieces = []
    for members in flats:
        size = 0
        for n in members:  # as `FlatShard` cuts them
            if size and limit is not None and size + n > limit:
                pieces.append(size)
                size = 0
            size += n
        pieces.append(size)
    return pieces


def _transients(rank: RankEstimate, work: Workload, layout: ParallelConfig, engines: list[tuple], whole: int,
                meta_build: bool, logits: int, head: int, mlp_grads: int) -> None:
    """What the rank holds only at one moment of the step (`MOMENTS`), by name, from the engines' code:
    `engines` is [(shapes in registration order, {unit: shapes}, data-parallel group size)] per engine, `whole`
    the unsplit model's numel, `logits` the numel of one (batch, positions, vocabulary shard) tensor of the last
    stage (0 elsewhere), `mlp_grads` the bytes of the stage's last MLP's backward (`_mlp_backward`).

    - build: a model built on a real device is whole before the strategy splits it (tp, ep), so its split copies
      are made next to it; ZeRO-3 and pipelines build on the meta device and fill one tensor at a time, whole
      before ZeRO-3 keeps its rows;
    - engines: `GradSync` re-lays each bucket's parameters into a new flat buffer (one bucket at a time); ZeRO-3
      copies its master rows into one flat master (the rows and the flat both alive until the copy ends);
    - backward: the loss's backward makes the gradient of the fp32 log-probabilities and of the logits at once,
      both (batch, positions, vocabulary shard) in fp32, while every saved activation still lives; before a
      pipeline's last stage, whose backward starts from a received gradient, the stage's last MLP's backward
      (its three gradients of the hidden width, `_mlp_backward`) is the largest it makes then;
    - backward_head: the head's backward, after the loss's (its log-probabilities freed, one logits gradient in
      their place: the activations' bytes again): under ZeRO stages 2-3 the head's whole gradients, from its
      backward to the root unit's reduce (the root unit, embedding and head, reduces last), and under ZeRO-3 on
      the CPU gloo's staging of the gather for the backward (below); what lives through the whole backward (a
      pipeline's sent gradients, ZeRO-1's previous ones) is in both moments (`THROUGH_BACKWARD`);
    - backward_end: ZeRO's reduce-scatter buffers, a unit's whole-size send (the receive is this rank's part of
      it: in place), at most two units in flight (`_launch_next_reduce` waits for unit i - 2), next to the unit's
      whole gradients being packed (stages 2-3) and, under ZeRO-3, the receive buffer of the unit gathered for the
      next backward; ZeRO-1/2 send through two slots kept from step to step (`slots`, not a transient: unit i of
      the reduce order and of the gather order takes slot i % 2, which grows to the largest unit that takes it);
    - step: torch's default AdamW on the CPU (the for-loop) allocates `sqrt(v)` and the denominator at the size
      of the tensor it steps (`_engine_steps`), while the previous tensor's denominator is still bound; on an
      accelerator foreach's `sqrt(v)` is the size of all it steps
      (one param group: `LanguageModel`'s second group, norms and embeddings, only splits it further);
    - after_step: ZeRO-1/2 all-gather the updated rows unit by unit, at most two in flight, into the two slots;
    - on the CPU, gloo's all-gather first gathers into a flat output of its own and copies it out: one more whole
      unit while ZeRO-1/2's after-step gathers run, and while ZeRO-3 gathers in forward and backward (NCCL gathers
      in place). A library's workspace, but one this program's choice of collective makes: counted."""
    pbytes = PRECISIONS[work.precision][0]
    stage = layout.zero_stage
    local = sum(math.prod(s) for shapes, _, _ in engines for s in shapes)
    if not meta_build and whole > local:
        rank.add_transient("build", "the model built whole, before the split", whole * pbytes)
    elif meta_build:
        largest = max((math.prod(s) for shapes, _, _ in engines for s in shapes), default=0)
        rank.add_transient("build", "one parameter whole, before its rows are kept", largest * pbytes)
    if 2 * logits * 4 >= mlp_grads:
        rank.add_transient("backward", "loss gradients (log-probabilities, logits; fp32)", 2 * logits * 4)
    else:
        rank.add_transient("backward", "the last block's MLP gradients (its hidden width)", mlp_grads)
    stepped = []
    for shapes, units, group in engines:
        stepped += _engine_steps(shapes, units, stage, group, pbytes, work.device)
        if group == 1:
            continue
        seg = {name: sum(_chunk(s[0], group) * math.prod(s[1:]) for s in u) for name, u in units.items()}
        segments = list(seg.values())
        if stage == 0:
            buckets = _engine_steps(shapes, units, 0, group, pbytes, "cuda")  # one piece per bucket
            rank.add_transient("engines", "a bucket re-laid flat", max(buckets) * pbytes)
            continue
        if stage == 3:
            rows = sum(min(_chunk(s[0], group), s[0]) * math.prod(s[1:]) for s in shapes)
            rank.add_transient("engines", "master rows before the flat master", rows * 4)
        whole = {u: sum(math.prod(s) for s in shapes) for u, shapes in units.items()}
        if stage >= 2 and head:  # the head's whole gradients wait for the embedding's: the root unit reduces last
            rank.add_transient("backward_head", "the head's whole gradients", head * pbytes)
        # the reduce order (the blocks from the last, then the rest); launching unit i waits for unit i - 2 first:
        # unit i - 1's send, unit i's send, and under stages 2-3 unit i's whole gradients (and the head's, until
        # the root unit's turn) at once; each receive is its rank's part of the send (in place)
        order = [u for u in units if u != "root"][::-1] + [u for u in units if u == "root"]  # the tail first
        at = [group * seg[order[i - 1]] * (i > 0) + group * seg[u]
              + (stage >= 2) * (whole[u] + head * (u != "root")) for i, u in enumerate(order)]
        if stage < 3:  # the sends are the two slots (`CommSlots`); what is left is the unit's gradients being packed
            # the refresh walks the engine's units in their order, the root first: on a pipeline stage without the
            # embedding the root is empty but still takes position 0
            gather = ["root", *(u for u in units if u != "root")]
            rank.slots += sum(group * max([seg.get(u, 0) for u in (*order[k::2], *gather[k::2])], default=0)
                              for k in (0, 1)) * pbytes
            at = [(stage >= 2) * (whole[u] + head * (u != "root")) for u in order]
        rank.add_transient("backward_end", "reduce-scatters in flight (two units)" if stage == 3 else
                           "a unit's whole gradients, being packed", max(at) * pbytes)
        if stage == 3:  # meanwhile the unit whose backward comes next is being gathered: its receive buffer
            prefetch = [group * seg[order[i + 1]] if i + 1 < len(order) else 0 for i in range(len(order))]
            rank.add_transient("backward_end", "the next unit's all-gather receive buffer",
                               max(a + b for a, b in zip(at, prefetch)) * pbytes - max(at) * pbytes)
        gather = zero_forms(layout.zero_collectives, work.device, stage)[1]  # a broadcast per rank: in place
        if work.device == "cpu" and gather == "all_gather":  # gloo gathers into a flat copy of the output: ZeRO-1/2
            rank.add_transient("after_step" if stage < 3 else "backward_head", GLOO_STAGING,  # after the step, ZeRO-3
                               group * max(segments) * pbytes)  # in forward and backward
    sbytes = 4 if stage else pbytes  # ZeRO steps fp32 master rows
    if stepped:
        # the for-loop: tensor i's two while tensor i - 1's denominator is still bound (freed when replaced)
        cpu = max(2 * n + prev for n, prev in zip(stepped, [0, *stepped]))
        temporaries = cpu if work.device == "cpu" else sum(stepped)
        rank.add_transient("step", "optimizer temporaries", temporaries * sbytes)


# -- activations -----------------------------------------------------------------------------------------------
def rope_table_bytes(cfg: ModelConfig, t: int) -> int:
    """The RoPE cos and sin tables one block saves, fp32: whole on every tp rank (positions are not split)."""
    return t * cfg.head_dim * 4


def _block_activations(cfg: ModelConfig, layer: int, b: int, t: int, layout: ParallelConfig, abytes: int,
                       autocast: bool) -> int:
    """Bytes one block saves for backward on one rank for b sequences of t positions (t already split by cp).
    Under autocast each projection casts (and saves) its own copy of the region's input: q, k, v three, gate
    and up two."""
    tp, sp = layout.tp, layout.tp if layout.sp else 1
    d, kv, h = cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg.n_heads
    q = h * cfg.head_dim  # d unless head_dim is set apart from d_model / n_heads (Qwen3)
    bt = b * t
    norm = (2 * bt * d * 4 + bt * 4) // sp  # RMSNorm: its input and normalised value, 1/rms: fp32
    rope = rope_table_bytes(cfg, t)
    if cfg.mla_kv_rank:
        attn = _latent_attention_activations(cfg, bt, t, layout, abytes, autocast)
    else:
        attn = (3 if autocast else 1) * bt * d * abytes + ((2 * bt * q + 2 * bt * kv) * abytes + b * h * t * 4) // tp
        attn += rope + (_sink_activations(cfg, b, t, layout) if cfg.attn_sinks else 0)
    if cfg.is_moe_layer(layer):
        k, f, e = cfg.moe_top_k, cfg.moe_d_ff, cfg.moe_experts
        # gathered rows, the expert SwiGLU, the experts' outputs (the gates' product keeps them) and their gated
        # product (the combining `index_add_` keeps its source: its backward expands the gradient to its shape):
        # on the fp32 residual stream's rows, measured as large under bf16 autocast as in fp32; gpt-oss's clamped
        # SwiGLU (`swiglu_limit`) keeps three more of the hidden width per pair (the clamps' and the sigmoid's
        # inputs), its router bias one more score
        routed = bt * k * (3 * d + (7 if cfg.swiglu_limit else 4) * f) * 4
        shared = 4 * bt * cfg.moe_shared_experts * f * 4
        mlp = bt * d * 4 + (3 + cfg.moe_biases) * bt * e * 4 + routed + shared  # fp32 router input and scores
    else:
        mlp = (2 if autocast else 1) * bt * d * abytes + 4 * bt * cfg.d_ff * abytes // tp
    return 2 * norm + attn + mlp


def _latent_attention_activations(cfg: ModelConfig, bt: int, t: int, layout: ParallelConfig, abytes: int,
                                  autocast: bool) -> int:
    """Bytes latent attention (`lit_lm.mla`) saves per block for bt tokens of a t-long sequence: the input (each
    down-projection's own cast under autocast: wq_a or wq, and wkv_a); per query rank r_q its RMSNorm (fp32 input
    and normalised value, 1/rms) and output; the latent's norm the same over r_kv, its fp32 input the whole wkv_a
    output (r_kv + Dr) unless autocast copied the latent alone; per head (split by tp) q and k of D_qk = Dn + Dr
    each, wkv_b's output (Dn + Dv: v is a view of it), the attention output (Dv; wo's input a view of it) and the
    fp32 log-sum-exp; the RoPE tables of the Dr rope dims (the rotation saves no input: only the tables need it)."""
    h = cfg.n_heads // layout.tp
    r_kv, dr, dn, dv = cfg.mla_kv_rank, cfg.mla_qk_rope_dim, cfg.mla_qk_nope_dim, cfg.mla_v_dim

    def norm(r: int) -> int:  # an RMSNorm over r: fp32 input and normalised value, 1/rms; its output
        return bt * (2 * r * 4 + 4 + r * abytes)

    saved = (2 if autocast else 1) * bt * cfg.d_model * abytes + norm(r_kv) + (0 if autocast else bt * dr * 4)
    if cfg.mla_q_rank:
        saved += norm(cfg.mla_q_rank)
    return saved + bt * h * ((2 * (dn + dr) + dn + 2 * dv) * abytes + 4) + t * dr * 4


def _sink_activations(cfg: ModelConfig, b: int, t: int, layout: ParallelConfig) -> int:
    """What attention with sinks (`lit_lm.attention_sinks.sink_attention`, the softmax written out) saves beyond a
    fused kernel's output and log-sum-exp: the fp32 probabilities of every (query, key) pair per head, the grouped
    queries and keys matmul copies in fp32 (2 (Hq - Hkv) head_dim per token), and the (t, t) boolean mask per call.
    Quadratic in t: at 4,096 positions and 64 heads, 4 GiB per sequence and layer (split by tp)."""
    h, kv = cfg.n_heads // layout.tp, max(1, cfg.n_kv_heads // layout.tp)
    return b * h * t * t * 4 + 2 * b * t * (h - kv) * cfg.head_dim * 4 + t * t


def _mlp_backward(cfg: ModelConfig, layer: int, b: int, t: int, layout: ParallelConfig, abytes: int) -> int:
    """Bytes the backward of block `layer`'s MLP makes at once at its start: the gradient of the down projection's
    input and the SwiGLU's of its gate and up outputs, three of its hidden width (split by tp; an MoE layer's on
    its routed rows and shared experts, fp32, replicated over tp)."""
    if cfg.is_moe_layer(layer):
        return 3 * b * t * (cfg.moe_top_k + cfg.moe_shared_experts) * cfg.moe_d_ff * 4
    return 3 * b * t * cfg.d_ff // layout.tp * abytes


def block_kept(cfg: ModelConfig, layer: int, b: int, t: int, layout: ParallelConfig, pbytes: int, abytes: int,
               checkpointing: str) -> int:
    """Bytes one checkpointed block keeps from its forward to its backward (`lit_lm.strategies.ac`'s modes; `none` is
    `_block_activations`). full: its input, the residual stream in the weights' dtype (split by sequence
    parallelism). selective: also the outputs of its matmuls and attention kernel (`lit_lm.strategies.ac.SAVED_OPS`),
    in the activation dtype: q, k, v, the attention output and its fp32 log-sum-exp per head (not under cp: the
    ring/all-gather attention is an autograd function that saves its own), gate and up split by tp, while the
    row-parallel wo and w_down outputs are whole (partial sums, before their reduction); an MoE layer (fp32 rows) keeps
    its router logits and each routed pair's gate, up and down outputs and the shared experts'."""
    sp = layout.tp if layout.sp else 1
    bt, d = b * t, cfg.d_model
    kept = bt * d * pbytes // sp
    if checkpointing == "full":
        return kept
    tp, h, hd, kv = layout.tp, cfg.n_heads, cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    attention = (h * hd * bt * abytes + bt * h * 4) // tp if layout.cp == 1 else 0  # cp's is recomputed whole
    kept += ((h * hd + 2 * kv) * bt * abytes) // tp + attention + bt * d * abytes  # q k v, out and lse, wo
    if cfg.is_moe_layer(layer):
        k, f, s = cfg.moe_top_k, cfg.moe_d_ff, cfg.moe_shared_experts
        return kept + bt * (cfg.moe_experts + k * (2 * f + d) + (2 * s * f + d if s else 0)) * 4
    return kept + 2 * bt * cfg.d_ff * abytes // tp + bt * d * abytes  # gate, up; w_down


def _stage_activations(cfg: ModelConfig, layers: list[int], first: bool, last: bool, b: int, t: int,
                       layout: ParallelConfig, pbytes: int, abytes: int, checkpointing: str) -> tuple[int, int]:
    """(bytes one microbatch keeps through a stage between its forward and backward, the extra bytes of the
    block recomputed during backward under checkpointing: what it keeps without, less what it keeps with)."""
    autocast = pbytes != abytes  # bf16-mixed
    sp = layout.tp if layout.sp else 1
    blocks = [_block_activations(cfg, i, b, t, layout, abytes, autocast) for i in layers]
    if checkpointing == "none":
        kept, recompute = sum(blocks), 0
    else:
        ckpt = [block_kept(cfg, i, b, t, layout, pbytes, abytes, checkpointing) for i in layers]
        kept, recompute = sum(ckpt), max(a - c for a, c in zip(blocks, ckpt))
    if first:
        kept += b * t * 8  # the token ids the embedding saves
    if last:
        v = _chunk(cfg.padded_vocab_size, layout.tp)
        kept += (2 * b * t * cfg.d_model * 4 + b * t * 4) // sp + b * t * cfg.d_model * abytes  # final norm, head
        # fp32: the log-softmax (and the z-loss's logsumexp input); under tp the vocab-parallel loss keeps the logits
        # (its target gather's input) and their exp (`lit_lm.strategies.tp_layers.VocabParallelLoss`)
        kept += b * t * v * 4 * (2 if cfg.z_loss or layout.tp > 1 else 1)
        kept += sum(_mtp_activations(cfg, k, b, t, layout, abytes, autocast) for k in range(1, cfg.mtp_layers + 1))
    return kept, recompute


def _mtp_activations(cfg: ModelConfig, k: int, b: int, t: int, layout: ParallelConfig, abytes: int,
                     autocast: bool) -> int:
    """Multi-token prediction module k (`lit_lm.mtp`) on its t - k positions, never checkpointed (activation
    checkpointing wraps `blocks`): the shifted token ids, enorm (its fp32 input, the embedding, and normalised
    value; 1/rms) and hnorm (the normalised value and 1/rms: its input is the main stream, kept anyway), eh_proj's
    input (the two concatenated, 2d), its block, its final norm, the head's input and the fp32 log-softmax."""
    n, d = b * (t - k), cfg.d_model
    block = _block_activations(cfg, cfg.n_layers + k - 1, b, t - k, layout, abytes, autocast)
    loss = cfg.padded_vocab_size * 4 * (2 if cfg.z_loss else 1)
    return block + n * (8 + (2 * d + 1 + d + 1 + 2 * d + 1) * 4 + 3 * d * abytes + loss)


# -- the estimate ----------------------------------------------------------------------------------------------
def _pipeline(layout: ParallelConfig) -> tuple[int, int, int]:
    """(stages, microbatches, virtual stages) as the strategy runs them: (1, 1, 1) without a pipeline."""
    return (layout.pp, layout.microbatches, layout.virtual_stages) if layout.pp > 1 else (1, 1, 1)


def check_layout(work: Workload, layout: ParallelConfig) -> None:
    """Raise ConfigError naming what does not divide (what the model's shapes and the batch allow; what the
    strategy refuses whatever the shapes is `ParallelConfig.refusal`)."""
    cfg, dims = work.config, layout.dims()
    p, m, v = _pipeline(layout)
    if p > 1:
        schedule_spec(layout.schedule)  # an unknown schedule: the one error that names them all
    if work.global_batch % dims.dp:
        raise ConfigError(f"global batch {work.global_batch} is not divisible by dp {dims.dp}")
    local = work.global_batch // dims.dp
    if local % work.accumulate or local // work.accumulate % m:
        raise ConfigError(f"accumulate {work.accumulate} x microbatches {m} must divide the per-replica batch {local}")
    if p * v > cfg.n_layers:
        raise ConfigError(f"pp x virtual_stages = {p * v} exceeds n_layers {cfg.n_layers}")
    if cfg.mtp_layers and (layout.tp > 1 or p > 1):  # as `Transformer.tensor_parallel_plan`, `pipeline_split` refuse
        raise ConfigError("multi-token prediction (mtp_layers) runs under ZeRO, ep and cp, not tp or pp")
    dense = any(not cfg.is_moe_layer(i) for i in range(cfg.n_layers))  # MoE layers are not split over tp
    if cfg.n_kv_heads % layout.tp or (dense and cfg.d_ff % layout.tp):
        raise ConfigError(f"tp {layout.tp} must divide n_kv_heads {cfg.n_kv_heads} and d_ff {cfg.d_ff}")
    if layout.sp and work.seq_len // layout.cp % layout.tp:
        raise ConfigError(f"sequence parallelism: tp {layout.tp} must divide the sequence {work.seq_len}")
    if work.seq_len % (2 * layout.cp) and layout.cp > 1:
        raise ConfigError(f"cp {layout.cp}: the sequence {work.seq_len} must split into 2 x cp chunks")
    if layout.ep > 1 and (not cfg.moe_experts or cfg.moe_experts % layout.ep
                          or (dims.dp_shard * layout.cp) % layout.ep):
        raise ConfigError(f"ep {layout.ep} must divide moe_experts {cfg.moe_experts} and dp_shard x cp")


def estimate(work: Workload, layout: ParallelConfig) -> Estimate:
    """Per-rank bytes, FLOPs and communication of one optimizer step of `work` under `layout`."""
    check_layout(work, layout)
    cfg, dims = work.config, layout.dims()
    pbytes, abytes = PRECISIONS[work.precision]
    inventory = _inventory(_config_key(cfg), work.lora)
    p, m, v = _pipeline(layout)
    stages = _split(cfg.n_layers, p, v)
    in_flight = peak_in_flight(layout.schedule, p, m, v) if p > 1 else [1]
    local_batch = work.global_batch // dims.dp
    micro = local_batch // work.accumulate  # sequences of one forward/backward (one Lightning batch)
    mb, t = micro // m, work.seq_len // layout.cp
    tokens_per_rank = local_batch * work.seq_len / layout.cp  # each tp peer works on all of them
    ranks = []
    for r in range(p):
        rank = RankEstimate()
        chunks = [stages[c * p + r] for c in range(v)]
        layers = {i for c in chunks for i in c}
        first, last = r == 0, r == p - 1
        keep = [q for q in inventory if (q.layer in layers) or (q.layer is None and _root_on(q.name, first, last))]
        if last and p > 1 and cfg.tie_embeddings:  # the head's own copy of the tied embedding
            keep += [dataclasses.replace(q, name="lm_head.weight", tp_style="vocab_head") for q in inventory
                     if q.name == "tok_embeddings.weight"]
        if layout.zero_stage not in (1, 2):  # the tail is a unit of its own under ZeRO-1/2 only
            keep = [dataclasses.replace(q, unit="root") if q.unit == "tail" else q for q in keep]
        dense: dict[str, list[tuple[int, ...]]] = {}
        experts: dict[str, list[tuple[int, ...]]] = {}
        matrix: dict[str, list[bool]] = {}  # Muon's: {unit: per shape whether it is a matrix}; experts' own under ep
        expert_matrix: dict[str, list[bool]] = {}
        trains: dict[str, list[bool]] = {}  # {unit: per shape whether it trains} (LoRA: the adapters only)
        expert_trains: dict[str, list[bool]] = {}
        for q in keep:
            # experts get an engine of their own under expert parallelism only (the ranks holding the same ones)
            own = q.expert and layout.ep > 1
            (experts if own else dense).setdefault(q.unit, []).append(_local_shape(q, layout))
            muon = work.optimizer == "muon" and muon_matrix(q.name, q.shape)
            (expert_matrix if own else matrix).setdefault(q.unit, []).append(muon)
            (expert_trains if own else trains).setdefault(q.unit, []).append(q.trains)
        # dense gradients over the strategy's group (every rank that saw other tokens; under ZeRO within a replica,
        # HSDP all-reducing the shard over the replicas), experts over the ranks holding the same experts
        dp_group = dims.size(layout.dense_group)
        in_fp8: dict[str, list[int]] = {}  # ZeRO-3 gathers these in FP8: their amaxes (an expert stack's: E)
        for q in keep:
            if not (q.expert and layout.ep > 1):
                amaxes = (q.shape[0] if q.expert else 1) if q.fp8 and work.fp8 == "tensorwise" else 0
                in_fp8.setdefault(q.unit, []).append(amaxes)
        if experts:  # each engine holds a list of parameters without blocks (`ModelSplit.dp_parts`): its one unit is
            # its root
            dense, in_fp8, experts, matrix, expert_matrix, trains, expert_trains = (
                {"root": [x for u in d.values() for x in u]}
                for d in (dense, in_fp8, experts, matrix, expert_matrix, trains, expert_trains))
        forms = zero_forms(layout.zero_collectives, work.device, layout.zero_stage)  # the ops that run
        _model_state(rank, dense, layout.zero_stage, dp_group, pbytes, layout.dense_group, work.accumulate, p == 1,
                     in_fp8, forms, matrix, trains)
        if experts:
            _model_state(rank, experts, layout.zero_stage, dims.size("edp"), pbytes, "edp", work.accumulate, p == 1,
                         forms=forms, matrix=expert_matrix, trains=expert_trains)
        if work.optimizer == "muon":
            _newton_schulz(rank, work, layout, keep, pbytes)
        engines = [([_local_shape(q, layout) for q in keep if not (q.expert and layout.ep > 1)], dense, dp_group)]
        if experts:
            engines.append(([_local_shape(q, layout) for q in keep if q.expert], experts, dims.size("edp")))
        logits = mb * t * _chunk(cfg.padded_vocab_size, layout.tp) if last else 0
        head = sum(math.prod(_local_shape(q, layout)) for q in keep if last and q.unit == "root"
                   and q.name != "tok_embeddings.weight")  # the final norm and the head (ZeRO-1/2: in the tail)
        _transients(rank, work, layout, engines, sum(math.prod(q.shape) for q in keep),
                    layout.zero_stage == 3 or p > 1, logits, head,
                    _mlp_backward(cfg, chunks[-1][-1], mb, t, layout, abytes) if chunks[-1] else 0)
        if layout.dp_replicate > 1:
            shard = sum(_chunk(s[0], dp_group) * math.prod(s[1:]) for u in dense.values() for s in u)
            rank.add_comm("dp_replicate", "all_reduce", shard * pbytes, layout.dp_replicate)

        kept, recompute = zip(*(_stage_activations(cfg, c, first and i == 0, last and i == v - 1, mb, t, layout,
                                                   pbytes, abytes, work.checkpointing) for i, c in enumerate(chunks)))
        rank.activations = in_flight[r] * max(kept) + max(recompute)
        if pbytes != abytes:  # autocast's low-precision copies of the matmul weights, saved for backward
            rank.activations += abytes * sum(math.prod(_local_shape(q, layout)) for q in keep if _cast(q, cfg, p))
        if p > 1:  # what the runner sends it keeps until the step's end (`PipelineRunner.run` waits for the sends
            # there): every microbatch's stage output, and each input gradient sent back; and the gradient receive
            # it posts before a backward
            one = mb * t * cfg.d_model * pbytes // (layout.tp if layout.sp else 1)
            mine = [c * p + r for c in range(v)]  # its stages (`Schedule.stage`)
            outputs = sum(s < p * v - 1 for s in mine)
            rank.buffers += (m * outputs + (outputs > 0)) * one
            for moment in THROUGH_BACKWARD:
                rank.add_transient(moment, "input gradients sent, held to the step's end",
                                   (m - 1) * sum(s > 0 for s in mine) * one)

        share = sum(len(c) for c in chunks) / cfg.n_layers
        rank.flops = model_flops_per_token(cfg, work.seq_len) * share * tokens_per_rank  # MLA, windows, MTP
        rank.flops /= layout.tp
        if work.document_length:  # the mask leaves a share of the attention pairs; the cp split shares it unevenly
            attention = 12 * cfg.n_layers * cfg.d_model * work.seq_len * share * tokens_per_rank / layout.tp
            masked = attention * allowed_share(work.seq_len, work.document_length)
            rank.flops -= attention - masked
            rank.cp_excess_flops = masked * (imbalance(work.seq_len, layout.cp, work.document_length, mb,
                                                       layout.cp_method, layout.cp_balance) - 1)
        if layout.tp > 1:  # MoE layers are replicated over tp: each peer computes them whole, 6 FLOPs per parameter
            moe = 6 * sum(_moe_active_params(inventory, cfg, i) for i in layers if cfg.is_moe_layer(i))
            rank.replicated_flops = moe * tokens_per_rank * (1 - 1 / layout.tp)
        if work.checkpointing == "full":  # every block's forward again (2N of 6N); selective recomputes no matmul
            rank.recompute_flops = (rank.flops + rank.replicated_flops) / 3
        adapters = None if work.lora is None else [  # factors whole beside a tp-cut base (MoE layers: replicated)
            _local_shape(q, layout) for q in keep if q.trains and q.tp_style is None and q.layer is not None
            and not cfg.is_moe_layer(q.layer)]
        _activation_comm(rank, r, cfg, layout, chunks, first, last, mb, t, local_batch, work.accumulate, abytes,
                         pbytes, dp_group, adapters)
        _fp8_tp_comm(rank, work, layout, keep, mb * t, work.accumulate * m)
        ranks.append(rank)
    bubble = bubble_theory(layout.schedule, p, m, v) if p > 1 else 0.0
    return Estimate(work, layout, ranks, bubble, layout.refusal(moe=cfg.moe_experts > 0))


def _newton_schulz(rank: RankEstimate, work: Workload, layout: ParallelConfig, keep: list[ParamSpec],
                   pbytes: int) -> None:
    """Muon's step on this rank (`lit_lm.planner.optimizer`): Newton-Schulz FLOPs and the orthogonalizer's
    collectives, from each matrix's cuts as the strategy makes them (inner first: ZeRO's rows of the tp slice, which
    keep an expert stack's experts whole; the tp slice, column-parallel along dim 0, row-parallel along dim 1; a
    matrix no cut splits is held whole by its data-parallel group, a replica level); and the step's updates (one
    per matrix, all alive until the orthogonalizer returns) and their orthogonalized parts (the NS dtype)."""
    dims, matrices, updates = layout.dims(), [], 0
    for q in keep:
        if not muon_matrix(q.name, q.shape):
            continue
        local, stack, cuts = _local_shape(q, layout), len(q.shape) == 3, []
        own = q.expert and layout.ep > 1
        group = "edp" if own else layout.dense_group
        size = dims.size(group)
        if layout.zero_stage and size > 1 and not stack:
            cuts.append(Cut(group, size, 0, local[0]))
        split = {"column": 0, "row": 1}.get(q.tp_style) if layout.tp > 1 else None
        if split is not None:
            cuts.append(Cut("tp", layout.tp, split, q.shape[split]))
        if not cuts and not layout.zero_stage and size > 1:
            cuts.append(Cut(group, size))
        matrices += [(tuple(q.shape[-2:]), tuple(cuts))] * (local[0] if stack else 1)
        rows = min(_chunk(local[0], size), local[0]) if layout.zero_stage and size > 1 else local[0]
        updates += rows * math.prod(local[1:])
    work_ns = ns_work(matrices, work.ns_mode, NS_BYTES[work.ns_dtype], work.ns_steps)
    rank.optimizer_flops = work_ns.flops
    for (group, op), nbytes in work_ns.comm.items():
        rank.add_comm(group, op, nbytes, work_ns.sizes[group])
    rank.add_transient("step", "Muon's updates and their orthogonalized parts",
                       updates * ((4 if layout.zero_stage else pbytes) + NS_BYTES[work.ns_dtype]))


def _fp8_tp_comm(rank: RankEstimate, work: Workload, layout: ParallelConfig, keep: list[ParamSpec], tokens: int,
                 forwards: int) -> None:
    """FP8 under tp: the scales' amax all-reduces (MAX, fp32) over tp, `forwards` forwards and backwards of
    `tokens` positions each: per tp-split FP8 linear `lit_lm.strategies.fp8.tp_amax_numels` (the rule `Fp8Matmul` casts
    by); under ZeRO-3 tensorwise the weights' amaxes are the engine's instead, once per gather of a unit, those of
    its tp-split FP8 weights in one tensor (`ZeroEngine._fp8_amax`). Recomputed forwards are not counted (as
    elsewhere). Expert stacks are not split over tp (MoE layers are replicated): nothing to reduce."""
    if not work.fp8 or layout.tp == 1:
        return
    gathered = layout.zero_stage == 3 and work.fp8 == "tensorwise"
    numel = 0
    for q in keep:
        split = {"column": 0, "row": 1}.get(q.tp_style)
        if q.fp8 and split is not None:
            numel += forwards * sum(tp_amax_numels(work.fp8, split, tokens, *_local_shape(q, layout), not gathered))
            numel += 2 * work.accumulate * gathered  # its amax, gathered for each forward and each backward
    rank.add_comm("tp", "all_reduce", numel * 4, layout.tp)


def _moe_active_params(inventory: tuple[ParamSpec, ...], cfg: ModelConfig, layer: int) -> float:
    """The parameters of MoE layer `layer` one token multiplies by: router, shared experts, top_k of the routed."""
    prefix = f"blocks.{layer}.mlp."
    return sum(math.prod(q.shape) * (cfg.moe_top_k / cfg.moe_experts if q.expert else 1)
               for q in inventory if q.name.startswith(prefix))


def _cast(q: ParamSpec, cfg: ModelConfig, pp: int) -> bool:
    """Whether autocast runs the parameter through a matmul in low precision (not norms, the embedding lookup,
    the fp32 router; a tied embedding is the head's weight, unless a pipeline gives the head its own copy)."""
    if q.name.startswith("tok_embeddings"):
        return cfg.tie_embeddings and pp == 1
    return len(q.shape) >= 2 and not q.name.endswith("router.weight")


def _root_on(name: str, first: bool, last: bool) -> bool:
    if name.startswith("tok_embeddings"):
        return first
    return last  # the final norm and the head


@functools.lru_cache(maxsize=256)
def peak_in_flight(name: str, p: int, m: int, v: int) -> list[int]:
    """`Schedule.peak_in_flight` per pipeline rank. Past m = 2pv microbatches the 1F1B family is in its steady
    state (each new forward follows a finished backward), so the peak is simulated there: the simulation costs
    O(m^2 p) and the planner asks for hundreds of microbatches. GPipe holds every microbatch: simulated at m."""
    cap = m if name == "gpipe" else min(m, 2 * p * v)
    return build_schedule(name, p, cap, v).peak_in_flight()


@functools.lru_cache(maxsize=256)
def _split(n_layers: int, p: int, v: int) -> list[list[int]]:
    return split_layers(n_layers, p, v)


def _activation_comm(rank: RankEstimate, pp_rank: int, cfg: ModelConfig, layout: ParallelConfig,
                     chunks: list[list[int]], first: bool, last: bool, mb: int, t: int, local_batch: int,
                     accumulate: int, abytes: int, pbytes: int, dp_group: int,
                     adapters: Optional[list[tuple[int, ...]]] = None) -> None:
    """The collectives that move activations: tp region borders, pipeline sends, cp ring, ep all-to-alls; and the
    gradient finishes after the data-parallel reduce (tp partial sums, the tied embedding over pp), which under
    ZeRO reduce only this rank's rows of its `dp_group` shard (the engine's optimized tensor). `adapters` (LoRA: the
    local shapes of the factors kept whole beside a tp-cut base linear, `_tp_style`): theirs are the only partial
    gradients (the norms are frozen), and on the first stage nothing before the first block trains, so the first
    region's entry and the embedding's exit have no gradient to carry back."""

    def rows(n: int) -> int:  # of a tensor's n rows, those the gradient finish reduces on this rank
        return _chunk(n, dp_group) if layout.zero_stage else n

    layers = [i for c in chunks for i in c]
    act = local_batch * t * cfg.d_model * abytes  # one (B, T, d) activation of the whole local batch
    tokens = local_batch * t
    if layout.tp > 1:
        # per region (attention, a dense MLP; an MoE layer is replicated, no region): an entry and an exit
        # collective forward and their conjugates backward; the embedding exits like a region, the head enters like one
        calls = sum(2 + 2 * (not cfg.is_moe_layer(i)) for i in layers) + first + last
        calls -= adapters is not None and first  # LoRA: the first entry's backward (SP: and the embedding's exit's)
        if layout.sp:
            rank.add_comm("tp", "all_gather", calls * act, layout.tp)
            rank.add_comm("tp", "reduce_scatter", calls * act, layout.tp)
            partial = (2 * len(layers) + last) * cfg.d_model  # norm weights on sequence shards
        else:
            rank.add_comm("tp", "all_reduce", calls * act, layout.tp)
            partial = 0
        partial += 2 * len(layers) * cfg.head_dim if cfg.qk_norm else 0
        if adapters is not None:  # LoRA: the frozen norms (and latent down-projections) reduce nothing
            partial = 0
            rank.add_comm("tp", "all_reduce", sum(rows(s[0]) * math.prod(s[1:]) for s in adapters) * pbytes, layout.tp)
        if partial:  # one all-reduce of the partial gradients (under ZeRO: this rank's dp rows of each)
            rank.add_comm("tp", "all_reduce", partial * rows(cfg.d_model) // cfg.d_model * pbytes, layout.tp)
        if cfg.mla_kv_rank:  # latent attention's replicated down-projections and norms (`lit_lm.mla`): partial sums
            r_q, latent = cfg.mla_q_rank or 0, cfg.mla_kv_rank + cfg.mla_qk_rope_dim
            per_layer = rows(latent) * cfg.d_model + rows(cfg.mla_kv_rank) + rows(r_q) * (cfg.d_model + 1)
            rank.add_comm("tp", "all_reduce", len(layers) * per_layer * pbytes, layout.tp)
        if last:  # loss-parallel cross-entropy: max, sum-exp and target logit per token, fp32
            rank.add_comm("tp", "all_reduce", 3 * tokens * 4, layout.tp)
    if layout.pp > 1:
        p = layout.pp
        one = mb * t * cfg.d_model * pbytes  # the residual stream keeps the weights' dtype between stages
        stages, n = p * layout.virtual_stages, layout.microbatches
        for c in range(layout.virtual_stages):
            stage = c * p + pp_rank  # as `Schedule.stage`: chunk c of rank r
            sends = (stage < stages - 1) + (stage > 0)  # activations forward, their gradients back
            rank.add_comm("pp", "send", accumulate * sends * n * one // layout.tp, p)
            rank.add_comm("pp", "recv", accumulate * sends * n * one // layout.tp, p)
        rank.add_comm("pp", "all_reduce", accumulate * 2 * 4, p)  # the batch loss and ce (+ stages' aux)
        if cfg.tie_embeddings and (first or last):  # the vocabulary rows of this tp rank (of its ZeRO shard)
            emb = rows(_chunk(cfg.padded_vocab_size, layout.tp)) * cfg.d_model
            rank.add_comm("pp_embedding", "all_reduce", emb * pbytes, 2)
    if layout.cp > 1:
        # stack(k, v) of this rank's share per attention call, its gradient in fp32 (`lit_lm.strategies.cp`)
        kv = len(layers) * 2 * local_batch * t * cfg.n_kv_heads * cfg.head_dim // layout.tp
        if layout.cp_method == "ring":  # each pass is one send and one recv of the block (`comm.p2p_batch`)
            # forward: K/V passed cp - 1 times; backward: again cp - 1 times, and the dK/dV accumulator cp times
            # (its last hop brings each rank's own block home)
            ring = kv * (2 * (layout.cp - 1) * abytes + layout.cp * 4)
            rank.add_comm("cp", "send", ring, layout.cp)
            rank.add_comm("cp", "recv", ring, layout.cp)
        elif layout.cp_method == "ulysses":  # all-to-alls of q, k, v (kv heads copied up to cp) and the output,
            # forward, and of their gradients backward, in the activations' dtype
            q = len(layers) * local_batch * t * cfg.n_heads * cfg.head_dim // layout.tp
            copies = max(1, layout.cp // max(1, cfg.n_kv_heads // layout.tp))
            rank.add_comm("cp", "all_to_all", 2 * (2 * q + copies * kv) * abytes, layout.cp)
        elif layout.cp_method == "ulysses+ring":  # Ulysses' all-to-alls over its u ranks, then the ring over the
            # cp/u on what they left a rank: its heads' K/V of u shares, copies x kv (`lit_lm.strategies.cp`)
            q = len(layers) * local_batch * t * cfg.n_heads * cfg.head_dim // layout.tp
            heads = (cfg.n_heads // layout.tp, max(1, cfg.n_kv_heads // layout.tp))
            u = ulysses_size_for(layout.cp, {heads}, layout.ulysses_size)
            copies, r = max(1, u // heads[1]), layout.cp // u
            rank.add_comm("cp_ulysses", "all_to_all", 2 * (2 * q + copies * kv) * abytes, u)
            ring = copies * kv * (2 * (r - 1) * abytes + r * 4)
            rank.add_comm("cp_ring", "send", ring, r)
            rank.add_comm("cp_ring", "recv", ring, r)
        else:  # allgather: K/V gathered forward and again backward; the fp32 dK/dV shares reduce-scattered
            rank.add_comm("cp", "all_gather", 2 * layout.cp * kv * abytes, layout.cp)
            rank.add_comm("cp", "reduce_scatter", layout.cp * kv * 4, layout.cp)
    # multi-token prediction module k's block (after the last block; on t - k of the t positions)
    mtp = [k for k in range(1, cfg.mtp_layers + 1) if last and cfg.is_moe_layer(cfg.n_layers + k - 1)]
    moe = [i for i in layers if cfg.is_moe_layer(i)] + [cfg.n_layers + k - 1 for k in mtp]
    forwards = accumulate * (layout.microbatches if layout.pp > 1 else 1)  # (recomputed forwards not counted)
    if layout.ep > 1:
        # per layer and forward the per-expert counts (int64); the token rows, dispatch and combine forward and
        # backward: a rank sends its own tokens' rows (dropless) and the rows it received, as many under balanced
        # routing: the expectation, exact for the ep group's mean (what every rank sends, the group receives).
        # One row per (token, expert) pair: node-limited routing (moe_groups, moe_topk_groups) bounds the groups a
        # token's rows go to, not their number (no row is sent once per node and fanned out there, as DeepEP's
        # dispatch does), so it changes no byte here
        routed = tokens * (len(moe) - len(mtp)) + sum(local_batch * (t - k) for k in mtp)  # over the layers
        dispatched = routed * cfg.moe_top_k * cfg.d_model * abytes
        rank.add_comm("ep", "all_to_all", 4 * dispatched + len(moe) * forwards * cfg.moe_experts * 8, layout.ep)
    dp = layout.dims().dp
    if moe and cfg.moe_balance == "global" and dp > 1:  # each forward's per-expert counts (int64) over the batch
        rank.add_comm("dp", "all_gather", forwards * len(moe) * dp * cfg.moe_experts * 8, dp)
