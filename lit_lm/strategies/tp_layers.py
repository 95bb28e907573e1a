"""Megatron-style tensor parallelism (Shoeybi et al., 2019) with sequence parallelism (Korthikanti et al., 2022),
by hand on `lit_lm.strategies.comm`.

A tp *region* is a column-parallel linear (or several sharing one input: q, k, v; gate, up) followed by a
row-parallel one (wo; w_down). Inside, each rank holds 1/t of the weights and computes 1/t of the features, with
no communication. At the borders, a conjugate pair of collectives:

    no SP   entry f = identity fwd / all-reduce bwd      exit g = all-reduce fwd / identity bwd
    SP      entry   = all-gather(seq) fwd / reduce-scatter(seq) bwd
            exit    = reduce-scatter(seq) fwd / all-gather(seq) bwd

Sequence parallelism moves the same bytes (an all-reduce is a reduce-scatter plus an all-gather) but keeps the
activations *between* regions (residual stream, norms) split along the sequence: 1/t of that memory per rank.
Per block and step: 2 all-reduces forward + 2 backward without SP, 2 all-gathers + 2 reduce-scatters each way with.

The vocabulary is split too: the embedding looks up only the ids it owns and exits like a region; the LM head is
a column-parallel linear over the vocabulary whose logits stay split; `VocabParallelLoss` computes the
cross-entropy from per-rank max / sum-exp / target logit, so the full logits never exist on any rank.

Shards use `torch.chunk` rows (ceil-sized, the tail may be short), the layout of a `DTensor` with `Shard(dim)`, so
checkpoints keep global names and shapes. Linear splits must be even (and at head boundaries); the vocabulary may
be uneven.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lit_lm.strategies import comm
from lit_lm.strategies.errors import ConfigError
from lit_lm.strategies.plan import TensorParallel


# -- the collectives of a region's borders, as autograd functions -------------------------------------------------
def _all_gather_seq(x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """(B, T/t, ...) per rank -> (B, T, ...): rank r holds positions [r T/t, (r+1) T/t)."""
    x = x.transpose(0, 1).contiguous()  # all_gather concatenates along dim 0: put the sequence there
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    comm.all_gather(out, x, group)
    # one (B, T, ...) copy now: the region's linears save it for backward (each would copy a strided view again)
    return out.transpose(0, 1).contiguous()


def _reduce_scatter_seq(x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """(B, T, ...) partial sums per rank -> (B, T/t, ...) reduced: this rank's positions only."""
    size = dist.get_world_size(group)
    if x.shape[1] % size:
        raise ValueError(f"sequence parallelism splits the {x.shape[1]} positions of a sequence over "
                         f"tensor_parallel_size={size} ranks: use a sequence length divisible by it")
    x = x.transpose(0, 1).contiguous()
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    comm.reduce_scatter(out, x, group)
    return out.transpose(0, 1)


def _all_reduce(x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    x = x.clone(memory_format=torch.contiguous_format)  # never reduce a tensor autograd may still hold
    comm.all_reduce(x, group)
    return x


class CopyToTP(torch.autograd.Function):
    """f: every rank needs the whole input (forward: identity); each rank's branch gives part of its gradient
    (backward: all-reduce)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    """g: the ranks' partial sums add up to the output (forward: all-reduce); the output's gradient is the same on
    every rank and is each partial sum's gradient (backward: identity)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class GatherSequence(torch.autograd.Function):
    """SP's f: the region needs every position (forward: all-gather); each rank's gradient for all positions is
    partial, and a rank keeps only its own positions (backward: reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _reduce_scatter_seq(grad, ctx.group), None


class ScatterSequence(torch.autograd.Function):
    """SP's g: partial sums reduced and split by position (forward: reduce-scatter); the gradient of every
    position is needed by every rank's partial sum (backward: all-gather)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _all_gather_seq(grad, ctx.group), None


@dataclass(frozen=True)
class TPGroup:
    """This rank's tensor-parallel group, and which pair of border collectives its regions use."""

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    sequence_parallel: bool = False

    def enter(self, x: Tensor) -> Tensor:
        """Into a region: the whole activation on every rank."""
        if self.size == 1:
            return x
        return (GatherSequence if self.sequence_parallel else CopyToTP).apply(x, self.group)

    def exit(self, x: Tensor) -> Tensor:
        """Out of a region: the ranks' partial sums reduced (and split by position under SP)."""
        if self.size == 1:
            return x
        return (ScatterSequence if self.sequence_parallel else ReduceFromTP).apply(x, self.group)

    def rows(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of n rows, `torch.chunk` layout (ceil-sized chunks, the tail short or empty)."""
        chunk = -(-n // self.size)
        start = min(self.rank * chunk, n)
        return start, min(start + chunk, n)

    def shard(self, tensor: Tensor, dim: int) -> Tensor:
        start, end = self.rows(tensor.shape[dim])
        return tensor.narrow(dim, start, end - start)


# -- layers holding one shard ----------------------------------------------------------------------------------
class _ShardedLinear(nn.Module):
    """An nn.Linear keeping only this rank's 1/t of the weight along `dim` (and of a column split's bias, e.g.
    Qwen2's q/k/v biases); no communication."""

    dim: int

    def __init__(self, weight: nn.Parameter, bias: Optional[nn.Parameter] = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(_ShardedLinear):
    """y_r = x W_r^T with W_r this rank's output features (rows of W): needs the whole x, gives 1/t of y."""

    dim = 0


class RowParallelLinear(_ShardedLinear):
    """y = sum_r x_r W_r^T with W_r this rank's input features (columns of W): takes 1/t of x, gives a partial
    sum of y (the region's exit adds them). A bias (gpt-oss's attention output) is whole on every rank and added
    to tp rank 0's partial sum only, so the exit's sum holds it once; its gradient is partial (rank 0's)."""

    dim = 1

    def __init__(self, weight: nn.Parameter, bias: Optional[nn.Parameter] = None, adds_bias: bool = True) -> None:
        super().__init__(weight, bias)
        self.adds_bias = adds_bias

    def forward(self, x: Tensor) -> Tensor:
        if self.bias is None or self.adds_bias:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias * 0)  # a (zero) gradient on every rank: one all-reduce shape


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding: ids outside the range give 0, so the exit's sum over ranks is the
    lookup (all-reduce, or reduce-scatter into sequence shards under SP)."""

    def __init__(self, weight: nn.Parameter, vocab_start: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = weight
        self.vocab_start = vocab_start
        self.tp = tp

    def forward(self, idx: Tensor) -> Tensor:
        local = idx - self.vocab_start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.masked_fill(~mine, 0), self.weight).masked_fill(~mine.unsqueeze(-1), 0.0)
        return self.tp.exit(x)


class VocabParallelHead(nn.Module):
    """The LM head over this rank's vocabulary rows: enters like a region (the whole sequence on every rank) and
    returns logits (B, T, V/t) that stay split for `VocabParallelLoss`."""

    def __init__(self, weight: nn.Parameter, tp: TPGroup) -> None:
        super().__init__()
        self.weight = weight
        self.tp = tp

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(self.tp.enter(x), self.weight)


class VocabParallelLoss(nn.Module):
    """Mean cross-entropy (+ z_loss * mean(lse^2)) over targets != -100, from vocab-split logits, in fp32.

        lse    = log sum_v exp(z_v) = m + log sum_r sum_{v in r} exp(z_v - m),  m = max over all ranks
        ce     = lse - z_target,  z_target taken on the rank owning the target (0 elsewhere), summed

    Three all-reduces of one value per token (MAX of the local maxima, SUM of sum-exp, SUM of target logits);
    the sums go through g, so autograd gives each rank exactly its logits' gradient softmax - onehot (m is a
    constant: any shift leaves lse unchanged). Returns (loss, detached ce), as the model's own loss.
    """

    def __init__(self, z_loss: float, vocab_start: int, tp: TPGroup) -> None:
        super().__init__()
        self.z_loss = z_loss
        self.vocab_start = vocab_start
        self.tp = tp

    def forward(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        logits = logits.reshape(-1, logits.shape[-1]).float()  # (N, V/t)
        targets = targets.reshape(-1)
        m = logits.detach().max(-1).values
        comm.all_reduce(m, self.tp.group, op=dist.ReduceOp.MAX)
        sum_exp = ReduceFromTP.apply((logits - m.unsqueeze(1)).exp().sum(-1), self.tp.group)
        lse = sum_exp.log() + m
        local = targets - self.vocab_start
        mine = (local >= 0) & (local < logits.shape[1])
        picked = logits.gather(1, local.clamp(0, logits.shape[1] - 1).unsqueeze(1)).squeeze(1)
        target_logit = ReduceFromTP.apply(picked.masked_fill(~mine, 0.0), self.tp.group)
        valid = targets != -100
        ce = (lse - target_logit).masked_fill(~valid, 0.0).sum() / valid.sum()
        if self.z_loss == 0.0:
            return ce, ce.detach()
        # masked, not indexed: `lse[valid]` is a nonzero, a host sync on an accelerator
        return ce + self.z_loss * lse.masked_fill(~valid, 0.0).pow(2).sum() / valid.sum(), ce.detach()


# -- applying a model's plan ----------------------------------------------------------------------------------
@dataclass
class TPShards:
    """What `parallelize_model` did, by parameter NAME (relative to the model it parallelised, every name of a tied
    weight), so it stays true when the Parameter objects are replaced (a model materialised from the meta device):
    the sharded parameters (dim, global shape) and the replicated ones whose gradients are partial on each tp rank."""

    tp: TPGroup
    sharded: dict[str, tuple[int, torch.Size]] = field(default_factory=dict)
    partial: list[str] = field(default_factory=list)

    def sum_partial_grads(self, model: nn.Module) -> None:
        """`sum_partial_grads` of `model`'s partial parameters' `.grad` (a model without other gradient engines)."""
        params = dict(model.named_parameters())
        sum_partial_grads([params[n].grad for n in self.partial if n in params], self.tp.group)


def sum_partial_grads(grads: list[Optional[Tensor]], group: Optional[dist.ProcessGroup]) -> None:
    """One all-reduce over tp of every partial gradient (norms under SP, QK-norms), in place: after backward. The
    caller says where each gradient lives (under ZeRO: its dp rows, on the master shard)."""
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = _all_reduce(torch.cat([g.reshape(-1) for g in grads]), group)
    for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(reduced.view_as(g))


def parallelize_model(model: nn.Module, plan: dict[str, TensorParallel], tp: TPGroup) -> TPShards:
    """Replace the submodules `plan` names with their tp versions, sliced from the whole ones, in place; the
    parameter names (and so checkpoint keys) stay the same. Tied weights stay tied (one local shard)."""
    shards = TPShards(tp)
    local: dict[nn.Parameter, nn.Parameter] = {}
    vocab_start: dict[str, int] = {}  # where each vocab split starts on this rank (the loss needs the head's)

    def shard(name: str, weight: nn.Parameter, dim: int, spec: Optional[TensorParallel], leaf: str = "weight"
              ) -> nn.Parameter:
        if weight not in local:
            n = weight.shape[dim]
            if spec is not None and (n % spec.unit or n // spec.unit % tp.size):
                raise ValueError(f"{name}: {n // spec.unit} {spec.unit_name} cannot be split evenly over "
                                 f"tensor_parallel_size={tp.size}: choose a tensor_parallel_size that divides it")
            local[weight] = nn.Parameter(tp.shard(weight.detach(), dim).clone(), weight.requires_grad)
        shards.sharded[f"{name}.{leaf}" if name else leaf] = (dim, weight.shape)
        return local[weight]

    def partial(name: str, module: nn.Module) -> None:
        shards.partial.extend(f"{name}.{n}" if name else n for n, _ in module.named_parameters())

    def shard_adapted(name: str, module: nn.Module, dim: int, spec: TensorParallel) -> None:
        """A linear with a low-rank adapter, y = x W^T + s (x A^T) B^T (`lora_A` (r, in), `lora_B` (out, r): see
        lit_lm.lora), cut in place, its forward unchanged. Column (W's output rows): B's rows too, A whole, and
        A's gradient partial (each rank's outputs only). Row (W's input columns): A's columns too, B whole, its
        input x_r A_r^T a partial sum like x_r W_r^T, so the region's exit reduces the adapter's share with the
        base's, and B's gradient partial."""
        if module.bias is not None and dim == 1:
            raise ConfigError(f"{name}: an adapter (LoRA) on a row-parallel linear with a bias is not supported "
                              "under tensor parallelism; leave it out of model.init_args.lora.targets")
        module.weight = shard(name, module.weight, dim, spec)
        if module.bias is not None:
            module.bias = shard(name, module.bias, 0, spec, "bias")
        split, whole = ("lora_B", "lora_A") if dim == 0 else ("lora_A", "lora_B")
        setattr(module, split, shard(name, getattr(module, split), dim, spec, split))
        shards.partial.append(f"{name}.{whole}" if name else whole)

    for name, spec in plan.items():
        module = model.get_submodule(name)
        bias = getattr(module, "bias", None)
        if bias is not None and (spec.style in ("vocab_embedding", "vocab_head") or
                                 spec.style == "row" and hasattr(module, "lora_A")):
            raise ValueError(f"{name}: vocab-parallel embeddings and adapted row-parallel linears without bias only")
        if spec.style in ("column", "row"):
            cls = ColumnParallelLinear if spec.style == "column" else RowParallelLinear
            if hasattr(module, "lora_A"):  # adapted (LoRA): kept, its weight and one factor cut
                shard_adapted(name, module, cls.dim, spec)
                continue
            if spec.style == "row" and bias is not None:  # whole, added once (RowParallelLinear)
                model.set_submodule(name, cls(shard(name, module.weight, cls.dim, spec), bias, tp.rank == 0))
                shards.partial.append(f"{name}.bias")
                continue
            model.set_submodule(name, cls(shard(name, module.weight, cls.dim, spec),
                                          None if bias is None else shard(name, bias, 0, spec, "bias")))
        elif spec.style == "region":  # hooks, not a wrapper module: the parameter names stay the same
            module.register_forward_pre_hook(lambda _, args: (tp.enter(args[0]), *args[1:]))
            module.register_forward_hook(lambda _, args, out: tp.exit(out))
        elif spec.style == "sequence":
            if tp.sequence_parallel:  # on 1/t of the positions: partial gradients
                partial(name, module)
        elif spec.style == "per_head":
            partial(name, module)
        elif spec.style == "heads":
            for leaf, p in list(module.named_parameters(recurse=False)):
                setattr(module, leaf, shard(name, p, 0, spec, leaf))
        elif spec.style == "batch":
            if tp.sequence_parallel:
                raise ConfigError(f"{name}: computes statistics over the whole batch (MoE routing), which sequence "
                                  "parallelism would split over the tp ranks; set sequence_parallel: false")
        elif spec.style in ("vocab_embedding", "vocab_head"):
            vocab_start[name] = tp.rows(module.weight.shape[0])[0]
            weight = shard(name, module.weight, 0, None)
            new = VocabParallelEmbedding(weight, vocab_start[name], tp) if spec.style == "vocab_embedding" \
                else VocabParallelHead(weight, tp)
            model.set_submodule(name, new)
        elif spec.style != "vocab_loss":
            raise ValueError(f"{name}: unknown tensor-parallel style {spec.style!r}")
    for name, spec in plan.items():  # the loss last: it needs the head's rows
        if spec.style == "vocab_loss":
            heads = [n for n, s in plan.items() if s.style == "vocab_head"]
            if len(heads) != 1:
                raise ValueError(f"{name}: a vocab-parallel loss needs exactly one vocab_head in the plan, got {heads}")
            model.set_submodule(name, VocabParallelLoss(model.get_submodule(name).z_loss, vocab_start[heads[0]], tp))
    return shards


# -- measuring what SP saves -----------------------------------------------------------------------------------
class SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Activation memory: the bytes autograd saves for backward while active, each storage once, by the direct
    child of `module` that was running (for a block: its norms vs its regions). Parameters and buffers are model
    state, not counted.

        with SavedActivations(block) as saved:
            out = block(x)
        saved.bytes  # {"attn_norm": ..., "attn": ..., "mlp_norm": ..., "mlp": ...}
    """

    def __init__(self, module: nn.Module) -> None:
        self.bytes: dict[str, int] = {}
        self._part = ""
        self._module = module
        self._hooks: list[Any] = []
        seen = {t.untyped_storage().data_ptr() for t in itertools.chain(module.parameters(), module.buffers())}

        def pack(t: Tensor) -> Tensor:
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:  # alive until backward: no address reuse
                seen.add(storage.data_ptr())
                self.bytes[self._part] = self.bytes.get(self._part, 0) + storage.nbytes()
            return t

        super().__init__(pack, lambda t: t)

    def _enter_part(self, name: str) -> None:
        self._part = name

    def __enter__(self) -> "SavedActivations":
        # registered after the region hooks: a region's entry collective runs before its part starts
        self._hooks = [child.register_forward_pre_hook(lambda *_, n=name: self._enter_part(n))
                       for name, child in self._module.named_children()]
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        for h in self._hooks:
            h.remove()
