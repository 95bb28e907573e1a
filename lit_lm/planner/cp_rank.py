"""Which context-parallel method, per sequence length: ring, all-gather, Ulysses and the hybrid ulysses+ring
(`cp_method`; the hybrid at the layout's `ulysses_size`, by default the largest the heads allow,
`cp.ulysses_size_for`) ranked by the planner's own estimates for one layout's sizes.

    rows = rank_methods(work, cluster, layout, seq_lens=(16384, 32768, 65536, 131072))

For each sequence length T and each method, the layout's sizes (tp, cp, dp, ZeRO, activation checkpointing) with
that `cp_method`, at the least gradient accumulation that fits (`plan.fitting`, the planner's search), give:
- **bytes**: what one rank sends per step over the cp group (`Estimate.wire_bytes("cp")`: `cp.comm_theory`'s
  volumes per attention layer: ring and all-gather (cp - 1) K/V shares each way plus the fp32 dK/dV, Ulysses a
  constant (cp - 1)/cp of its q, k, v and output each way; the hybrid Ulysses' over its u ranks plus the ring's
  over cp/u, `Estimate.wire_bytes` of "cp_ulysses" and "cp_ring");
- **exposed comm**: those bytes over the cp group's bandwidth (NVLink inside a node, the NIC across; the hybrid's
  two groups each over their own). The planner's
  overlap model (`plan.step_time`) puts context-parallel traffic on the critical path: none of it is counted as
  hidden behind attention (the ring's overlap was measured on CPU only, 28% at cp 4: docs/cp.md);
- **memory**: the estimate's peak per rank (the same saved activations for every method: 1/cp of the sequence)
  plus the method's own buffers while one layer attends (`attention_buffers`, from the code of
  `lit_lm.strategies.cp`; not measured): the ring's next block and dK/dV accumulators, the all-gather's whole
  sequence of K/V and its fp32 gradient, Ulysses' exchange buffers, the hybrid Ulysses' (over u) plus the ring's
  on what the exchange left;
- **step time**: `plan.step_time` (compute at the assumed MFU, the busiest cp rank's attention with documents,
  plus the exposed communication).
The rank: the fastest step among the methods that fit the GPU, then those that do not, least memory first. A method
the model's heads refuse (Ulysses: query heads after tp not divisible by cp, `cp.ulysses_kv_copies`) is listed as
refused, with the one-line reason.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

from lit_lm.config import ConfigError
from lit_lm.planner.documents import imbalance
from lit_lm.planner.estimate import PRECISIONS, Estimate, Workload
from lit_lm.planner.plan import USABLE_MEMORY, Cluster, Ranked, _estimate, fitting, step_time
from lit_lm.strategies.cp import HYBRID, ulysses_kv_copies, ulysses_size_for
from lit_lm.strategies.layout import ParallelConfig

METHODS = ("ring", "allgather", "ulysses", HYBRID)  # those the estimate counts the bytes of
CP_GROUPS = ("cp", "cp_ulysses", "cp_ring")  # the groups cp traffic goes over (the hybrid's two)


@dataclass
class MethodRow:
    seq_len: int
    method: str
    ulysses: int = 0  # the hybrid's Ulysses ranks u (cp = u x r); 0 for the other methods
    rank: int = 0  # 1 = the best at this sequence length; 0: refused
    step_time: float = 0.0  # seconds
    cp_bytes: float = 0.0  # sent per rank per step over the cp group (the hybrid: both of its groups)
    exposed: float = 0.0  # seconds of cp communication on the critical path
    peak: float = 0.0  # bytes per rank: the estimate's peak plus `buffers`
    buffers: float = 0.0  # the method's attention buffers (`attention_buffers`)
    fits: bool = False
    accumulate: int = 1
    imbalance: float = 1.0  # the busiest cp rank's attention over the mean (documents)
    refused: str = ""


def attention_buffers(work: Workload, layout: ParallelConfig, micro_rows: int) -> int:
    """Bytes one rank holds beside its saved activations while one layer's attention runs (the larger of forward
    and backward), for `micro_rows` sequences; kv = one rank's share of stack(k, v), q of the queries (activation
    dtype), kv32 = kv in fp32, r the kv copies Ulysses sends:
    ring: kv + 3 kv32 (the next block in flight; this block's dK/dV, the accumulator arriving and the one sent);
    allgather: 2 cp kv + 2 cp kv32 (the gathered shares and their merge; the whole dK/dV and its shares in fp32);
    ulysses: 3 (q + r kv) (the exchange's send and receive buffers and the merged heads; the same backward);
    ulysses+ring: Ulysses' over its u ranks (r = its copies over u), then the ring's on the r kv the exchange left a
    rank (its heads' K/V of u shares): 3 (q + r kv) + r kv + 3 r kv32."""
    cfg, cp, tp = work.config, layout.cp, layout.tp
    abytes = PRECISIONS[work.precision][1]
    tokens = micro_rows * work.seq_len // cp
    kv = 2 * tokens * cfg.n_kv_heads // tp * cfg.head_dim
    if layout.cp_method == "ring":
        return kv * abytes + 3 * kv * 4
    if layout.cp_method == "allgather":
        return 2 * cp * kv * (abytes + 4)
    q = tokens * cfg.n_heads // tp * cfg.head_dim
    u = hybrid_ulysses(work, layout) if layout.cp_method == HYBRID else cp
    copies = ulysses_kv_copies(cfg.n_heads // tp, cfg.n_kv_heads // tp, u)
    exchange = 3 * (q + copies * kv) * abytes if u > 1 else 0  # (u = 1: the ring alone, u = cp: Ulysses alone)
    return exchange + (copies * kv * (abytes + 3 * 4) if u < cp else 0)


def hybrid_ulysses(work: Workload, layout: ParallelConfig) -> int:
    """The hybrid's u at `layout` for the model's heads after tp (`cp.ulysses_size_for`: its `ulysses_size`, or the
    largest divisor of cp the heads allow), as the estimate counts it."""
    cfg, tp = work.config, layout.tp
    return ulysses_size_for(layout.cp, {(cfg.n_heads // tp, max(1, cfg.n_kv_heads // tp))}, layout.ulysses_size)


def rank_methods(work: Workload, cluster: Cluster, layout: ParallelConfig, seq_lens: Sequence[int],
                 methods: Sequence[str] = METHODS) -> list[MethodRow]:
    """Per sequence length, every method at `layout`'s sizes, ranked (module docstring)."""
    budget = cluster.gpu_memory * USABLE_MEMORY
    rows = []
    for t in seq_lens:
        at_t = dataclasses.replace(work, seq_len=t, config=dataclasses.replace(work.config, max_seq_len=t))
        mine = []
        for method in methods:
            row = MethodRow(t, method)
            config = dataclasses.replace(layout, cp_method=method,
                                         ulysses_size=layout.ulysses_size if method == HYBRID else None)
            try:
                if method == "ulysses":
                    ulysses_kv_copies(work.config.n_heads // layout.tp, work.config.n_kv_heads // layout.tp, layout.cp)
                if method == HYBRID:
                    row.ulysses = hybrid_ulysses(work, config)
                est = _best(at_t, config, budget)
            except ConfigError as err:
                row.refused = str(err)
                rows.append(row)
                continue
            if est is None:
                row.refused = f"the sequence {t} does not split over this layout (2 x cp chunks, the batch)"
                rows.append(row)
                continue
            micro = est.workload.global_batch // layout.dp // est.workload.accumulate
            row.buffers = attention_buffers(est.workload, config, micro)
            row.peak = est.peak_bytes + row.buffers
            row.fits = row.peak <= budget
            row.step_time, parts = step_time(est, cluster)
            row.exposed = sum(parts.get(g, 0.0) for g in CP_GROUPS)
            row.cp_bytes = sum(est.wire_bytes(g) for g in CP_GROUPS)
            row.accumulate = est.workload.accumulate
            if work.document_length:
                row.imbalance = imbalance(t, layout.cp, work.document_length, micro, method, layout.cp_balance)
            mine.append(row)
            rows.append(row)
        order = sorted(mine, key=lambda r: (not r.fits, r.step_time if r.fits else r.peak))
        for i, row in enumerate(order, 1):
            row.rank = i
    return rows


def _best(work: Workload, layout: ParallelConfig, budget: float) -> Optional[Estimate]:
    """The least accumulation that fits (`plan.fitting`), else the most accumulation's estimate (what does not fit,
    by how much); None when the batch or the sequence does not split."""
    est = fitting(work, layout, budget)
    if est is not None:
        return est
    local = work.global_batch // layout.dp if work.global_batch % layout.dp == 0 else 0
    if not local or work.seq_len % (2 * layout.cp):
        return None
    return _estimate(work, layout, local)


def reference_layout(ranked: list[Ranked], cluster: Cluster) -> Optional[tuple[ParallelConfig, str]]:
    """The layout whose sizes the table keeps, with its activation checkpointing: the fastest ranked one with cp > 1;
    else the winner with cp taken from its data-parallel ranks (the largest of 8, 4, 2 that divides them and keeps
    tp x cp inside a node); None when neither exists."""
    with_cp = next((r for r in ranked if r.config.cp > 1), None)
    if with_cp is not None:
        return with_cp.config, with_cp.estimate.workload.checkpointing
    if not ranked:
        return None
    win = ranked[0].config
    for cp in (8, 4, 2):
        if win.pp == 1 and win.dp_shard % cp == 0 and win.tp * cp <= cluster.gpus_per_node:
            config = dataclasses.replace(win, cp=cp, dp_shard=win.dp_shard // cp, zero_stage=win.zero_stage or 3)
            return config, ranked[0].estimate.workload.checkpointing
    return None
