"""The planner: every layout of a cluster, those that fit memory ranked by estimated step time, the winner as yaml.

    ranked = plan(workload, Cluster(nodes=2, gpus_per_node=8, gpu_memory=80e9))
    ranked[0].config, ranked[0].step_time, ranked[0].reason
    strategy_yaml(ranked[0], cluster)   # for `lit-lm fit --config ... --config plan.yaml`

The layouts are `lit_lm.strategies.layout.ParallelConfig`s, the strategy's own configuration: every combination of sizes
and options that `lit_lm.strategies.layout.REFUSED` allows for the model (tp with MoE layers included, sequence
parallelism off there), so every ranked layout runs and the yaml is its `strategy_args()`.

The 3D rule it rediscovers from the estimates rather than hard-codes: tensor parallelism up to the GPUs of one
node (its collectives are on the critical path and want NVLink), pipeline stages or ZeRO-3 across nodes when the
model state does not fit, data parallelism over the rest, context parallelism when one sequence's activations do
not fit, gradient accumulation (more, smaller micro-batches) before any of them when only activations overflow.

Step time = compute at the assumed MFU / (1 - bubble) + exposed communication: tensor, context, expert and
pipeline traffic is on the critical path; the data-parallel reduction overlaps the backward (2/3 of the compute;
ZeRO-3's prefetched gathers the whole step) and only what exceeds it shows. Bandwidth: a group whose ranks share
a node (rank order pp, dp_replicate, dp_shard, cp, tp: tp innermost) uses `intra_bw`, others `inter_bw` (each
GPU's share of the node's network); the hybrid cp's Ulysses groups are its u consecutive cp ranks (inside a node
when tp x u <= GPUs per node), its ring groups those u apart.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from lit_lm.config import ConfigError
from lit_lm.planner.estimate import CHECKPOINTING, Estimate, Workload, estimate
from lit_lm.strategies.cp import hybrid_grid
from lit_lm.strategies.layout import ParallelConfig, ParallelDims, rank_grid
from lit_lm.strategies.pp_schedules import SCHEDULES

USABLE_MEMORY = 0.9  # of a GPU's memory: the CUDA context, allocator fragmentation and workspaces take the rest
MAX_PP = 16  # deeper pipelines are not planned (Llama 3 405B used 16): the schedule simulation grows as p^2 m^2
BACKWARD_SHARE = 2 / 3  # of a step's compute: the window in which the data-parallel reduction can hide


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_memory: float  # bytes
    intra_bw: float = 450e9  # bytes/s per GPU inside a node (NVLink 4 on H100: 450 GB/s each way)
    inter_bw: float = 50e9  # bytes/s per GPU across nodes (one 400 Gb/s NIC per GPU)
    peak_flops: float = 989e12  # dense bf16 per GPU (H100 SXM)
    mfu: float = 0.4  # the model FLOPs utilisation assumed for compute

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Ranked:
    estimate: Estimate
    step_time: float  # seconds per optimizer step
    parts: dict[str, float]  # compute, bubble, exposed communication per group
    reason: str = ""

    @property
    def config(self) -> ParallelConfig:
        return self.estimate.config


# -- time --------------------------------------------------------------------------------------------------------
# the groups that reduce gradients (`ParallelConfig.dense_group`, the experts' edp, HSDP's replicas): their traffic
# overlaps the backward
GRADIENT_GROUPS = ("dp", "dp_cp", "dp_shard", "dp_shard_cp", "edp", "dp_replicate")


@functools.lru_cache(maxsize=4096)
def _intra_node(dims: ParallelDims, gpus_per_node: int, ulysses: int = 1) -> dict[str, bool]:
    """Whether every group of each dimension lies inside one node, in the strategies' own rank order
    (`lit_lm.strategies.layout.rank_grid`); with them the hybrid cp's `ulysses` x r subgroups
    (`lit_lm.strategies.cp.hybrid_grid`: "cp_ulysses" the u consecutive cp ranks, "cp_ring" those u apart)."""
    grid = rank_grid(dims)
    grid.update(zip(("cp_ulysses", "cp_ring"), hybrid_grid(grid["cp"], ulysses)))
    return {name: all(g[0] // gpus_per_node == g[-1] // gpus_per_node for g in groups)
            for name, groups in grid.items()}


def step_time(est: Estimate, cluster: Cluster) -> tuple[float, dict[str, float]]:
    config = est.config
    intra = _intra_node(config.dims(), cluster.gpus_per_node, est.group_size("cp_ulysses"))
    compute = est.work_flops / (cluster.peak_flops * cluster.mfu)
    parts = {"compute": compute, "bubble": compute * est.bubble / (1 - est.bubble)}
    hidden = compute if config.zero_stage == 3 else BACKWARD_SHARE * compute
    for group in est.groups:
        bw = cluster.intra_bw if intra[group] else cluster.inter_bw
        seconds = est.wire_bytes(group) / bw
        if group in GRADIENT_GROUPS:
            # ZeRO-1/2 gather the updated shards after the step, and Muon's orthogonalizer moves its matrices in the
            # step (all-to-alls): those parts cannot hide behind the backward
            after_step = est.wire_bytes(group, "all_gather") / bw if config.zero_stage in (1, 2) else 0.0
            after_step += est.wire_bytes(group, "all_to_all") / bw
            seconds = after_step + max(0.0, seconds - after_step - hidden)
        parts[group] = seconds
    return sum(parts.values()), parts


# -- the layouts -------------------------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(work: Workload, cluster: Cluster) -> Iterator[ParallelConfig]:
    """Every configuration of `cluster` that `REFUSED` allows for the model and the estimator accepts
    (accumulation and microbatches left to `plan`). Pruned, as never faster: context parallelism below 16k
    positions, ZeRO over one rank, pipelines deeper than `MAX_PP`."""
    cfg, gpn = work.config, cluster.gpus_per_node
    moe = cfg.moe_experts > 0
    for tp in _divisors(gpn):
        for cp in (c for c in (1, 2, 4, 8) if tp * c <= gpn and (c == 1 or work.seq_len >= 16384)):
            for pp in _divisors(cluster.world // (tp * cp)):
                if pp > min(cfg.n_layers, MAX_PP):
                    continue
                dp = cluster.world // (tp * cp * pp)
                for zero in (0, 1, 2, 3) if dp * cp > 1 else (0,):
                    for replicate in _replicas(dp, tp * cp, gpn, zero):
                        for ep in (_divisors(cfg.moe_experts) if moe else [1]):
                            for sp in (True, False) if tp > 1 else (True,):
                                config = ParallelConfig(tp=tp, sequence_parallel=sp, pp=pp, cp=cp, ep=ep,
                                                        dp_replicate=replicate, dp_shard=dp // replicate,
                                                        zero_stage=zero)
                                if (dp // replicate * cp) % ep == 0 and config.refusal(moe) is None:
                                    yield from _schedules(config, cfg.n_layers)


def _replicas(dp: int, inner: int, gpn: int, zero: int) -> list[int]:
    """No replication, and under ZeRO also HSDP: shards within a node, replicas across nodes."""
    within = max(1, gpn // inner)
    return [1, dp // within] if zero and dp > within and dp % within == 0 else [1]


def _schedules(layout: ParallelConfig, n_layers: int) -> Iterator[ParallelConfig]:
    """Every schedule the registry marks `planned`; one with virtual stages as 2 chunks per rank, if the layers
    allow (`lit_lm/strategies/pp_schedules.py`)."""
    if layout.pp == 1:
        yield layout
        return
    for name, spec in SCHEDULES.items():
        v = 2 if spec.chunked else 1
        if spec.planned and layout.pp * v <= n_layers:
            yield dataclasses.replace(layout, schedule=name, virtual_stages=v)


def fitting(work: Workload, layout: ParallelConfig, budget: float) -> Optional[Estimate]:
    """The layout with the least accumulation that fits `budget` bytes per GPU, or None."""
    local = work.global_batch // layout.dp if work.global_batch % layout.dp == 0 else 0
    options = [a for a in _divisors(local) if layout.pp == 1 or local // a >= layout.pp]
    if not options:
        return None
    first = _estimate(work, layout, options[0])  # no accumulation: ZeRO-2/3 keep only gradient shards
    if first is not None and first.peak_bytes <= budget:
        return first
    if len(options) > 1:  # the most accumulation holds the least: when even it overflows, nothing fits (so ends
        last = _estimate(work, layout, options[-1])  # most layouts of a model too large for the cluster, --answer's)
        if last is not None and last.peak_bytes > budget:
            return None
    lo, hi, found = 1, len(options) - 1, None
    while lo <= hi:  # past that, memory falls as accumulation grows: the least that fits, by bisection
        mid = (lo + hi) // 2
        est = _estimate(work, layout, options[mid])
        if est is not None and est.peak_bytes <= budget:
            found, hi = est, mid - 1
        else:
            lo = mid + 1
    return found


def _estimate(work: Workload, layout: ParallelConfig, accumulate: int) -> Optional[Estimate]:
    """With `accumulate` micro-steps; a pipeline gets 4 microbatches per stage (or the most the batch allows)."""
    micro = work.global_batch // layout.dp // accumulate
    if layout.pp > 1:
        m = next((m for m in (4 * layout.pp, 2 * layout.pp, layout.pp) if micro % m == 0), None)
        if m is None:
            return None
        layout = dataclasses.replace(layout, microbatches=m)
    try:
        return estimate(dataclasses.replace(work, accumulate=accumulate), layout)
    except ConfigError:
        return None


def plan(work: Workload, cluster: Cluster, checkpointing: Sequence[str] = CHECKPOINTING) -> list[Ranked]:
    """Fitting layouts, fastest first, under each activation checkpointing mode tried."""
    budget = cluster.gpu_memory * USABLE_MEMORY
    ranked = []
    for mode in checkpointing:
        for layout in layouts(work, cluster):
            est = fitting(dataclasses.replace(work, checkpointing=mode), layout, budget)
            if est is not None:
                seconds, parts = step_time(est, cluster)
                ranked.append(Ranked(est, seconds, parts))
    ranked.sort(key=lambda r: (r.step_time, r.config.world - r.config.dp))  # ties: the simpler layout
    for r in ranked:
        r.reason = reason(r, cluster)
    return ranked


def nearest(work: Workload, layout: ParallelConfig, cluster: Cluster) -> Optional[Ranked]:
    """The layout nearest `layout` that fits the cluster, from `plan`'s own search (the same layouts, budget and
    accumulation): one that changes only activation checkpointing, tp (larger), pp (larger) or gradient
    accumulation, the data-parallel size taking what is left; the fewest of those changed, then the fastest. None
    when none of them fits."""
    def changes(c: ParallelConfig, mode: str) -> Optional[int]:
        same = (c.cp, c.ep, c.zero_stage, c.dp_replicate > 1) == \
            (layout.cp, layout.ep, layout.zero_stage, layout.dp_replicate > 1)
        if not same or c.tp < layout.tp or c.pp < layout.pp or (c.tp == layout.tp and c.sp != layout.sp):
            return None
        if c.pp == layout.pp and c.pp > 1 and (c.schedule, c.virtual_stages) != (layout.schedule,
                                                                                   layout.virtual_stages):
            return None
        return (mode != work.checkpointing) + (c.tp != layout.tp) + (c.pp != layout.pp)

    budget = cluster.gpu_memory * USABLE_MEMORY
    found = []
    for mode in CHECKPOINTING:
        for c in layouts(work, cluster):
            n = changes(c, mode)
            if n is None:
                continue
            est = fitting(dataclasses.replace(work, checkpointing=mode), c, budget)
            if est is not None:
                seconds, parts = step_time(est, cluster)
                n += est.workload.accumulate != work.accumulate  # and the microbatches `fitting` gives a pipeline
                n += c.pp == layout.pp > 1 and est.config.microbatches != layout.microbatches
                found.append((n, seconds, Ranked(est, seconds, parts)))
    if not found:
        return None
    best = min(found, key=lambda f: f[:2])[2]
    best.reason = reason(best, cluster)
    return best


# -- explaining ---------------------------------------------------------------------------------------------------
def reason(r: Ranked, cluster: Cluster) -> str:
    """Why each dimension is there, and what the step time is made of."""
    lay, est = r.config, r.estimate
    why = []
    if lay.tp > 1:
        sp = "" if lay.sp else ", sequence parallelism off" + (" (MoE layers are replicated over tp)"
                                                                  if est.workload.config.moe_experts else "")
        why.append(f"tp{lay.tp} inside a node splits weights and activations, its collectives on NVLink{sp}")
    if lay.pp > 1:
        why.append(f"pp{lay.pp} across {'nodes' if lay.world > cluster.gpus_per_node else 'GPUs'}: only "
                   f"activations cross stage borders, bubble {est.bubble:.0%}")
    if lay.cp > 1:
        why.append(f"cp{lay.cp}: one sequence's activations split {lay.cp} ways")
    if lay.ep > 1:
        why.append(f"ep{lay.ep}: each rank holds 1/{lay.ep} of the experts")
    if lay.zero_stage:
        shard = {1: "optimizer state", 2: "optimizer state + gradients", 3: "all model state"}[lay.zero_stage]
        why.append(f"ZeRO-{lay.zero_stage} shards {shard} over {lay.dims().size(lay.dense_group)} ranks")
    if lay.dp_replicate > 1:
        why.append(f"replicated over {lay.dp_replicate} groups: the gradient all-reduce crosses nodes once")
    if est.workload.checkpointing == "full":
        why.append("full activation checkpointing keeps each block's input and runs its forward again")
    elif est.workload.checkpointing == "selective":
        why.append("selective activation checkpointing keeps the matmul and attention outputs, recomputes the rest")
    if est.workload.accumulate > 1:
        why.append(f"{est.workload.accumulate} accumulation micro-steps keep the activations in memory")
    if est.workload.optimizer == "muon":
        why.append(muon_note(est))
    comm = sum(v for k, v in r.parts.items() if k not in ("compute", "bubble"))
    why.append(f"exposed comm {comm / r.step_time:.0%} of the step")
    return "; ".join(why)


def muon_note(est: Estimate) -> str:
    """Muon's part of the busiest pipeline rank: its state, its Newton-Schulz work and the orthogonalizer's bytes."""
    w = max(est.ranks, key=lambda r: r.optimizer_flops)
    moved = sum(nbytes for (_, op), nbytes in w.comm.items() if op == "all_to_all")
    gram = sum(nbytes for (g, op), nbytes in w.comm.items() if g == "tp" and op == "all_reduce")
    return (f"Muon: optimizer state {est.worst.optimizer / 2**20:.4g} MiB (one buffer per matrix), Newton-Schulz "
            f"{w.optimizer_flops / 1e12:.3g} TFLOP per step on a rank ({w.optimizer_flops / w.work_flops:.1%} of its "
            f"work), the orthogonalizer's all-to-alls {moved / 2**20:.3g} MiB per step"
            + (" and tp's Gram all-reduces (with tp's own)" if gram and est.config.tp > 1 else ""))


# -- the yaml ----------------------------------------------------------------------------------------------------
def strategy_yaml(r: Ranked, cluster: Cluster, precision: Optional[str] = None) -> dict:
    """The `trainer` and `data` settings that run layout `r` with `ComposedStrategy` (its arguments are the
    config's `strategy_args()`); a refused config raises the strategy's own error."""
    config, work = r.config, r.estimate.workload
    config.check(moe=work.config.moe_experts > 0)
    args = config.strategy_args()
    if work.checkpointing != "none":
        args["activation_checkpointing"] = work.checkpointing
    strategy = {"class_path": "lit_lm.strategies.composed.ComposedStrategy", "init_args": args}
    trainer = {"num_nodes": cluster.nodes, "devices": cluster.gpus_per_node,
               "accumulate_grad_batches": work.accumulate, "strategy": strategy}
    if precision is not None:
        trainer["precision"] = precision
    micro = work.global_batch // config.dp // work.accumulate
    return {"trainer": trainer, "data": {"init_args": {"batch_size": micro}}}
