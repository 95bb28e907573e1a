"""Mixture-of-Experts: a top-k router and an MoE layer that replaces a block's SwiGLU (see `ModelConfig.moe_*`).

    x (N, d) -> Router (fp32) -> top-k experts and gates per token
             -> sort the (token, expert) pairs by expert (stable: token order inside an expert)
             -> [capacity: keep the first `capacity` pairs of each expert, drop the rest]
             -> GroupedExperts(x_sorted, counts): one SwiGLU per expert on its contiguous segment
             -> gate-weighted scatter-add back to the tokens  (+ shared experts on every token)

`GroupedExperts` is the expert-parallel seam: it takes tokens already grouped by expert plus the count per expert,
so `lit_lm.strategies.experts` can wrap it with an all-to-all dispatch/combine without the layer knowing. Expert
weights are stacked tensors (E, ...), so an expert-parallel shard is a slice along dim 0 under the same parameter name.

Load balancing: the Switch auxiliary loss, the router z-loss, and DeepSeek-V3's auxiliary-loss-free balancing (a
per-expert bias added to the scores for *selection only*, nudged after every optimizer step towards the mean load;
`update_router_bias`). Each layer keeps its last statistics in `stats` (detached, on the device) for logging
(`moe_metrics`: one vector for all layers, which `LanguageModel` averages over a logging interval).

Global-batch balancing (`moe_balance: global`, the default): under data parallelism each rank routes its share of
the batch, but the load fractions f_i of the Switch loss and the capacity are about the *global* batch. With a
`batch_group` (set by the strategy through `Transformer.set_batch_group`) the per-expert counts are all-gathered
over it (E integers per rank and layer): f_i comes from the global counts, and capacity keeps the first `capacity`
pairs of each expert in global token order (rank 0's tokens first, as the sampler lays the global batch out), so
drops match one process. The loss keeps this rank's mean router probabilities P_i: averaged over the ranks (as
the dp gradient average does) E * sum f_i P_i is the global-batch loss and its gradient. `micro_batch` uses this
rank's counts only (no collective).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lit_lm.config import ModelConfig
from lit_lm.strategies import comm
from lit_lm.strategies.ac import recomputing


@dataclass
class Routing:
    experts: Tensor  # (N, k) chosen expert ids
    gates: Tensor  # (N, k) fp32 weights of the chosen experts, summing to 1 per token with `moe_norm_topk`
    probs: Tensor  # (N, E) fp32 scores normalised over experts (P_i of the Switch loss)
    logits: Tensor  # (N, E) fp32 router logits (for the z-loss)


class Router(nn.Module):
    """Linear scores over E experts, computed in fp32 (routing decisions are brittle in bf16), top-k selection.

    `expert_bias` (a checkpointed buffer) shifts the scores used to *choose* experts, never the gate values, so
    the balancing nudges which experts are picked without changing what a chosen expert contributes.
    Node-limited routing (`groups` > 1, DeepSeek-V3): a token chooses among the experts of its `topk_groups` best
    groups only (`limit_groups`). The gates are multiplied by `scale` (DeepSeek-V3's routed_scaling_factor).
    `bias` (gpt-oss's router, a parameter) is part of the logits; softmax scores renormalised over the top k are
    the softmax of the top k logits (gpt-oss's form).
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int, score: str = "softmax", norm_topk: bool = True,
                 groups: int = 1, topk_groups: int = 1, scale: float = 1.0, bias: bool = False) -> None:
        super().__init__()
        self.groups, self.topk_groups, self.scale = groups, topk_groups, scale
        self.top_k = top_k
        self.score = score
        self.norm_topk = norm_topk  # the chosen scores renormalised to sum 1 (Mixtral), or as they are (OLMoE)
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))
        self.bias = nn.Parameter(torch.empty(n_experts)) if bias else None
        self.register_buffer("expert_bias", torch.zeros(n_experts))

    def forward(self, x: Tensor) -> Routing:
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        choice = scores.detach() + self.expert_bias
        if self.groups > 1:
            choice = self.limit_groups(choice)
        experts = choice.topk(self.top_k, dim=-1).indices
        chosen = scores.gather(-1, experts)
        gates = chosen / chosen.sum(-1, keepdim=True) if self.norm_topk else chosen
        if self.scale != 1.0:
            gates = gates * self.scale
        probs = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        return Routing(experts, gates, probs, logits)

    def limit_groups(self, choice: Tensor) -> Tensor:
        """`choice` (N, E) with -inf outside each token's `topk_groups` best groups of E / `groups` consecutive
        experts, a group scored by the sum of its two best choices (DeepSeek-V3's node-limited routing)."""
        grouped = choice.view(choice.shape[0], self.groups, -1)
        best = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_groups, dim=-1).indices  # (N, topk_groups)
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights: w_gate, w_up (E, d_ff, d) and w_down (E, d, d_ff); with `biases`
    (gpt-oss) gate_bias, up_bias (E, d_ff) and down_bias (E, d), each row getting its expert's; with `limit`,
    gpt-oss's clamped SwiGLU: g = min(gate, limit), u = clamp(up, -limit, limit), h = (u + 1) * g * sigmoid(alpha g).

    forward(x, counts): `x` holds the tokens grouped by expert, `counts[e]` rows for expert e (in order), then
    possibly rows of no expert (dropped by a capacity) whose output is garbage: the caller masks them. Each
    projection is one grouped matmul, `torch._grouped_mm` with the segment ends `offs` = cumsum(counts) on the
    device: the segments never come to the host (one kernel on CUDA for bf16 on sm90+; torch's fallback elsewhere).
    An empty segment is a 0-row group, so every expert's weights get a (zero) gradient and all ranks see the same
    parameters used.
    """

    def __init__(self, n_experts: int, d_model: int, d_ff: int, biases: bool = False, limit: Optional[float] = None,
                 alpha: float = 1.702) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.w_up = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        if biases:
            self.gate_bias = nn.Parameter(torch.empty(n_experts, d_ff))
            self.up_bias = nn.Parameter(torch.empty(n_experts, d_ff))
            self.down_bias = nn.Parameter(torch.empty(n_experts, d_model))
        self.biases, self.limit, self.alpha = biases, limit, alpha

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        offs = counts.cumsum(0).to(torch.int32)
        gate, up = self.grouped(x, self.w_gate, offs), self.grouped(x, self.w_up, offs)
        if self.biases:  # row r belongs to the expert whose segment holds it (rows past the last: any, masked)
            rows = torch.arange(x.shape[0], device=x.device, dtype=torch.int32)
            expert = torch.searchsorted(offs, rows, right=True).clamp(max=offs.numel() - 1)
            gate, up = gate + self.gate_bias[expert].to(gate.dtype), up + self.up_bias[expert].to(up.dtype)
        if self.limit is None:
            h = F.silu(gate) * up
        else:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            h = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        y = self.grouped(h, self.w_down, offs)
        return y + self.down_bias[expert].to(y.dtype) if self.biases else y

    @staticmethod
    def grouped(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        """The grouped GEMM of the three projections; FP8 sets an instance's own (`lit_lm/strategies/fp8.py`)."""
        return grouped_linear(x, w, offs)


GROUP_ROWS = 16  # every token group starts at a multiple of this many rows (`_aligned_rows`)
ALIGNED_ON = ("cuda",)  # devices whose `_grouped_mm` kernel wants aligned groups (CPU's fallback loops over groups)


def grouped_linear(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """Rows offs[e-1]:offs[e] of `x` (n, in) times w[e]^T, w (E, out, in): F.linear per expert segment; rows past
    offs[-1] (in no group) come back uninitialised.

    Under autocast both run in the autocast dtype, as F.linear would (torch does not autocast `_grouped_mm`):
    bf16 is its one-kernel path on CUDA sm90+; other dtypes and devices take torch's fallback, a loop over the
    groups that reads `offs` on the host. `torch._grouped_mm` wants rows of 16 bytes multiples: other widths are
    zero-padded (exact, and a copy of the weights per call, so pick multiples of 8 for bf16, 4 for fp32). Its
    CUTLASS kernel may also want each group to start on an aligned row (torchtitan pads token groups to multiples
    of 8/16): every group is moved to a multiple of `GROUP_ROWS` rows, zero rows between (`_aligned_rows`, on the
    device: static shapes, no host read) on the devices in `ALIGNED_ON`; elsewhere the rows go in as they are (no
    padded copy for the estimator to count)."""
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    w = w.to(x.dtype)
    align = 16 // x.element_size()
    pad_in, pad_out = -w.shape[2] % align, -w.shape[1] % align
    if pad_in or pad_out:
        x, w = F.pad(x, (0, pad_in)), F.pad(w, (0, pad_in, 0, pad_out))
    aligned = x.device.type in ALIGNED_ON
    if aligned:
        rows, offs, length = _aligned_rows(offs, x.shape[0])
        x = x.new_zeros(length, x.shape[1]).index_copy(0, rows, x)
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    if y.requires_grad:  # its backward rejects an expanded gradient (a sum()'s)
        y.register_hook(Tensor.contiguous)
    if aligned:
        y = y.index_select(0, rows)
    return y[:, : w.shape[1] - pad_out] if pad_out else y


def _aligned_rows(offs: Tensor, n: int) -> tuple[Tensor, Tensor, int]:
    """Where each of `n` rows grouped by the segment ends `offs` goes when every group starts at a multiple of
    `GROUP_ROWS` (an empty group stays empty; the rows past the last group follow the last padded one), the padded
    segment ends (int32) and the padded length: n + E x (GROUP_ROWS - 1), rounded up to GROUP_ROWS."""
    ends = offs.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    sizes = (counts + GROUP_ROWS - 1) // GROUP_ROWS * GROUP_ROWS
    padded_ends = sizes.cumsum(0)
    # a row of group e moves by (its padded start - its start); a row past the last group by (padded end - end)
    shift = torch.cat([(padded_ends - sizes) - (ends - counts), padded_ends[-1:] - ends[-1:]])
    row = torch.arange(n, device=offs.device)
    moved = row + shift[torch.searchsorted(ends, row, right=True)]
    length = -(-(n + offs.numel() * (GROUP_ROWS - 1)) // GROUP_ROWS) * GROUP_ROWS
    return moved, padded_ends.to(torch.int32), length


class MoE(nn.Module):
    """Routed experts (+ optional shared experts) in place of a block's MLP.

    After each forward: `aux_loss` (the weighted Switch and z-loss terms, to add to the LM loss) and `stats`
    (detached: per-expert load fractions, max/mean load, dropped fraction, aux and z values). In training,
    `step_counts` accumulates tokens per expert over the micro-steps of an optimizer step for the bias update.
    """

    def __init__(self, cfg: ModelConfig, shared: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_weight, self.z_weight, self.bias_update = cfg.moe_aux_loss, cfg.moe_z_loss, cfg.moe_bias_update
        self.router = Router(cfg.d_model, cfg.moe_experts, cfg.moe_top_k, cfg.moe_score, cfg.moe_norm_topk,
                             cfg.moe_groups, cfg.moe_topk_groups, cfg.moe_routed_scale, bias=cfg.moe_biases)
        self.experts = GroupedExperts(cfg.moe_experts, cfg.d_model, cfg.moe_d_ff, cfg.moe_biases, cfg.swiglu_limit,
                                      cfg.swiglu_alpha)
        self.shared = shared
        self.balance = cfg.moe_balance
        self.batch_group: Optional[dist.ProcessGroup] = None  # the ranks the global batch is split over
        self.register_buffer("step_counts", torch.zeros(cfg.moe_experts), persistent=False)
        self.aux_loss: Tensor = torch.zeros(())
        self.stats: dict[str, Tensor] = {}

    def capacity(self, n_tokens: int) -> Optional[int]:
        """Slots per expert: ceil(capacity_factor * tokens * k / E); None when dropless."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def _rank_counts(self, counts: Tensor) -> Tensor:
        """(ranks, E) token counts of every rank of the batch group, in rank order (just this rank's without one)."""
        if self.balance != "global" or self.batch_group is None or dist.get_world_size(self.batch_group) == 1:
            return counts[None]
        out = counts.new_empty(dist.get_world_size(self.batch_group) * counts.numel())
        comm.all_gather(out, counts, self.batch_group, label="MoE load counts")
        return out.view(-1, counts.numel())

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n = x.shape[0]
        r = self.router(x)
        flat_experts = r.experts.reshape(-1)
        order = flat_experts.argsort(stable=True)  # (token, slot) pairs grouped by expert, token order inside
        counts = flat_experts.new_zeros(self.n_experts).index_add_(
            0, flat_experts, torch.ones_like(flat_experts))  # bincount without its host read (CUDA)
        per_rank = self._rank_counts(counts)
        rank = dist.get_rank(self.batch_group) if per_rank.shape[0] > 1 else 0
        kept, kept_all, keep = counts, per_rank, None
        cap = self.capacity(n * per_rank.shape[0])  # equal shares: the global batch is ranks x n tokens
        if cap is not None:  # static shapes: the dropped pairs move behind the kept ones, and are masked out
            before = per_rank.cumsum(0) - per_rank  # pairs of each expert on the ranks before this one
            starts = counts.cumsum(0) - counts
            sorted_experts = flat_experts[order]
            position = torch.arange(order.numel(), device=x.device) - starts[sorted_experts]
            dropped = position + before[rank][sorted_experts] >= cap
            order = order[(sorted_experts + self.n_experts * dropped).argsort(stable=True)]
            keep = ~dropped.sort(stable=True).values[:, None]  # kept first, in the new order
            kept_all = torch.minimum(per_rank, (cap - before).clamp(min=0))
            kept = kept_all[rank]
        tokens = order // self.top_k
        xs = x[tokens] if keep is None else torch.where(keep, x[tokens], 0)
        y = self.experts(xs, kept)
        if keep is not None:  # the experts' rows past the kept ones are uninitialised memory (maybe NaN bits):
            y = torch.where(keep, y, 0)  # masked before the gates, or the gates' gradient is 0 x NaN = NaN
        y = y * r.gates.reshape(-1)[order, None].to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, tokens, y)
        if self.shared is not None:
            out = out + self.shared(x)
        self._account(r, counts, per_rank.sum(0), kept_all.sum(0))
        return out.reshape(shape)

    def _account(self, r: Routing, counts: Tensor, total: Tensor, kept: Tensor) -> None:
        """The balancing losses and the statistics of this forward: `counts` this rank's pairs per expert, `total`
        and `kept` the batch's (global or this rank's, see the module docstring).

        Under activation checkpointing the backward runs this forward again: the losses are computed (the
        recomputation must save what the forward saved) but not kept, and nothing is counted a second time."""
        load = total.float() / total.sum()  # f_i: the fraction of (token, slot) pairs sent to expert i
        aux = self.n_experts * (load * r.probs.mean(0)).sum()
        z = torch.logsumexp(r.logits, dim=-1).pow(2).mean()
        if recomputing():
            return
        self.aux_loss = self.aux_weight * aux + self.z_weight * z
        self.stats = {"load": load.detach(), "max_mean_load": (load.max() * self.n_experts).detach(),
                      "dropped": (1 - kept.sum() / total.sum()).detach().float(), "aux": aux.detach(),
                      "z": z.detach()}
        if self.training and torch.is_grad_enabled():
            self.step_counts += counts.detach().float()


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    return {name: m for name, m in model.named_modules() if isinstance(m, MoE)}


def moe_aux_loss(model: nn.Module) -> Tensor | float:
    """The sum of every MoE layer's balancing losses from the last forward (0.0 for a dense model)."""
    return sum((m.aux_loss for m in moe_layers(model).values() if m.aux_weight or m.z_weight), 0.0)


@torch.no_grad()
def update_router_bias(model: nn.Module, all_reduce_sum: Callable[[Tensor], Tensor] = lambda t: t) -> None:
    """Auxiliary-loss-free balancing, once per optimizer step: bias += gamma * sign(mean load - load).

    Counts are summed over the step's micro-steps (`step_counts`) and over data-parallel ranks (`all_reduce_sum`,
    one collective for all layers), so every replica applies the same update. sign() ignores the scale, so a sum
    over more ranks than dp (tensor-parallel peers see the same tokens) gives the same update.
    """
    layers = [m for m in moe_layers(model).values() if m.bias_update]
    if not layers:
        return
    counts = all_reduce_sum(torch.stack([m.step_counts for m in layers]))
    for m, c in zip(layers, counts):
        m.router.expert_bias += m.bias_update * torch.sign(c.mean() - c)
        m.step_counts.zero_()


def moe_metrics(model: nn.Module) -> tuple[list[str], Tensor]:
    """`moe/<layer>/<stat>` names and their values from the last forward, as one detached vector on the device:
    load per expert, max/mean load, dropped fraction, aux and z-loss. One vector, so that a caller can sum it
    over the steps of a logging interval and read it once (`LanguageModel`); empty for a dense model."""
    names: list[str] = []
    values: list[Tensor] = []
    for name, m in moe_layers(model).items():
        layer = name.split(".")[-2]  # blocks.<i>.mlp
        for key, value in m.stats.items():
            names += [f"moe/{layer}/load_e{e}" for e in range(value.numel())] if key == "load" else [
                f"moe/{layer}/{key}"]
            values.append(value.float().reshape(-1))
    return names, torch.cat(values) if values else torch.zeros(0)
