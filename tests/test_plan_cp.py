"""The planner with packed documents and the context-parallel methods (issue 57): masked attention FLOPs, the cp
split's imbalance, and `lit-lm plan`'s ranking of ring, all-gather and Ulysses per sequence length."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from rich.console import Console

from lit_lm.config import ConfigError, ModelConfig
from lit_lm.model import document_mask
from lit_lm.planner import cli
from lit_lm.planner.cp_rank import attention_buffers, rank_methods, reference_layout
from lit_lm.planner.documents import ROWS, allowed_share, document_ids, imbalance
from lit_lm.planner.estimate import Workload, estimate
from lit_lm.planner.plan import Cluster, plan, step_time
from lit_lm.strategies.cp import comm_theory, zigzag_positions
from lit_lm.strategies.layout import ParallelConfig

MODEL = ModelConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=8, n_kv_heads=8, d_ff=512, max_seq_len=4096)


def _rank_pairs(ids: torch.Tensor, cp: int) -> list[int]:
    """Per zigzag cp rank, the (query, key) pairs the model's own document mask lets through, over the rows."""
    mask = document_mask(ids)[:, 0]
    return [int(mask[:, zigzag_positions(ids.shape[1], r, cp)].sum()) for r in range(cp)]


@pytest.mark.parametrize("seq_len, mean", [(256, 16), (512, 100), (96, 1)])
def test_the_planners_pairs_are_the_models_mask(seq_len: int, mean: int) -> None:
    """The allowed share and the zigzag split's imbalance the planner counts equal what the model's own document
    mask (`lit_lm.model.document_mask`) lets through, rank by rank (one row, and a micro-batch of 3)."""
    rows = torch.cat([document_ids(seq_len, mean, seed) for seed in range(ROWS)])
    assert rows[0].max() > 0  # documents, not one causal row
    assert allowed_share(seq_len, mean) == pytest.approx(float(document_mask(rows).sum()) /
                                                         (ROWS * seq_len * (seq_len + 1) / 2))
    for cp, n in ((2, 1), (4, 1), (4, 3)):
        pairs = _rank_pairs(rows[:n], cp)
        assert imbalance(seq_len, cp, mean, n) == pytest.approx(max(pairs) * cp / sum(pairs))


def test_masked_attention_flops_and_the_busiest_cp_rank() -> None:
    """With documents the attention term of the FLOPs (12 L d T per token) falls to the mask's share; under ring the
    busiest cp rank does `imbalance` times the mean rank's attention (counted apart from model FLOPs, in the step's
    work); Ulysses attends the whole sequence on every rank: no excess."""
    work = Workload(MODEL, 4096, 8, "bf16-mixed")
    masked = dataclasses.replace(work, document_length=256)
    layout = ParallelConfig(dp_shard=2, cp=4)
    plain, docs = estimate(work, layout).ranks[0], estimate(masked, layout).ranks[0]
    attention = 12 * MODEL.n_layers * MODEL.d_model * 4096 * (8 // 2) * 4096 / 4  # per token x tokens per rank
    share = allowed_share(4096, 256)
    assert 0.02 < share < 0.2
    assert plain.flops - docs.flops == pytest.approx(attention * (1 - share))
    ring_excess = attention * share * (imbalance(4096, 4, 256, 4) - 1)
    assert docs.cp_excess_flops == pytest.approx(ring_excess) and ring_excess > 0
    assert docs.work_flops == pytest.approx(docs.flops + docs.cp_excess_flops)
    ulysses = estimate(masked, dataclasses.replace(layout, cp_method="ulysses")).ranks[0]
    assert ulysses.cp_excess_flops == 0 and ulysses.flops == pytest.approx(docs.flops)
    with pytest.raises(ConfigError, match="document length"):
        Workload(MODEL, 4096, 8, document_length=0)


def test_the_document_aware_split_evens_the_ranks() -> None:
    """`cp_balance: documents` (the strategy's balancer) brings the busiest rank near the mean where zigzag leaves it
    well above; Ulysses and cp 1 have none to even out."""
    assert imbalance(32768, 8, 512) > 1.2 and imbalance(32768, 8, 512, balance="documents") < 1.1
    assert imbalance(8192, 4, 512, method="ulysses") == 1.0 and imbalance(8192, 1, 512) == 1.0
    work = Workload(MODEL, 8192, 8, "bf16-mixed", document_length=512)
    zigzag, balanced = (estimate(work, ParallelConfig(dp_shard=2, cp=4, cp_balance=b)).ranks[0].cp_excess_flops
                        for b in ("zigzag", "documents"))
    assert 0 <= balanced < zigzag


def _rows(work: Workload, cluster: Cluster, layout: ParallelConfig, seq_lens: tuple[int, ...]) -> dict:
    return {(r.seq_len, r.method): r for r in rank_methods(work, cluster, layout, seq_lens)}


def test_slow_links_rank_by_bytes_ulysses_first_at_cp8_with_mha() -> None:
    """Where communication dominates (a slow cp link), the order follows the bytes: with MHA at cp 8 Ulysses sends
    (cp-1)/cp of 2q + kv = 1.75 kv, against the ring's 2 x 7 kv + 8 kv32 (docs/cp.md), so it ranks first and the
    ring last; each row's bytes are the estimate's for that method."""
    work = Workload(MODEL, 4096, 8, "bf16-mixed")
    cluster = Cluster(1, 8, 80e9, intra_bw=1e6, inter_bw=1e6)
    layout = ParallelConfig(cp=8)
    rows = _rows(work, cluster, layout, (4096,))
    assert [rows[4096, m].rank for m in ("ulysses", "ulysses+ring", "allgather", "ring")] == [1, 2, 3, 4]
    assert rows[4096, "ulysses+ring"].ulysses == 8  # the heads allow u = cp: Ulysses alone, the same bytes
    assert rows[4096, "ulysses+ring"].cp_bytes == rows[4096, "ulysses"].cp_bytes
    for m in ("ring", "allgather", "ulysses"):
        est = estimate(work, dataclasses.replace(layout, cp_method=m))
        assert rows[4096, m].cp_bytes == est.wire_bytes("cp") and rows[4096, m].fits


def test_documents_rank_ulysses_first_when_links_are_fast() -> None:
    """With documents and links fast enough to hide the bytes, the ring's busiest rank (the zigzag split's
    imbalance) sets the step: its step is longer than Ulysses' (balanced by construction) by that rank's excess
    attention at the assumed MFU, and Ulysses ranks first."""
    work = Workload(MODEL, 8192, 4, "bf16-mixed", document_length=512)
    cluster = Cluster(1, 4, 80e9, intra_bw=1e18, inter_bw=1e18)
    rows = _rows(work, cluster, ParallelConfig(cp=4), (8192,))
    ring, ulysses = rows[8192, "ring"], rows[8192, "ulysses"]
    assert ring.imbalance > 1.05 and ulysses.imbalance == 1.0
    excess = estimate(work, ParallelConfig(cp=4)).ranks[0].cp_excess_flops
    assert ring.step_time - ulysses.step_time == pytest.approx(excess / (cluster.peak_flops * cluster.mfu), rel=1e-3)
    assert ulysses.rank == 1


def test_memory_decides_and_heads_refuse() -> None:
    """A method whose attention buffers do not fit ranks after those that do (the all-gather holds the whole
    sequence's K/V and its fp32 gradient); Ulysses is refused in one line where the heads do not divide by cp."""
    work = Workload(MODEL, 8192, 4, "bf16-mixed")
    layout = ParallelConfig(cp=4)
    budgets = {m: attention_buffers(work, dataclasses.replace(layout, cp_method=m), 4)  # the batch of 4 rows
               for m in ("ring", "allgather")}
    assert budgets["allgather"] > budgets["ring"]
    est = estimate(work, layout)
    gpu = (est.peak_bytes + (budgets["ring"] + budgets["allgather"]) / 2) / 0.9  # the ring fits, the all-gather not
    rows = _rows(work, Cluster(1, 4, gpu, intra_bw=1e6, inter_bw=1e6), layout, (8192,))
    assert rows[8192, "ring"].fits and not rows[8192, "allgather"].fits
    assert rows[8192, "allgather"].rank == max(r.rank for r in rows.values())  # last
    odd = Workload(dataclasses.replace(MODEL, n_heads=6, n_kv_heads=6, d_model=192), 8192, 4)
    refused = _rows(odd, Cluster(1, 4, 80e9), layout, (8192,))[8192, "ulysses"]
    assert refused.rank == 0 and "cp_method ulysses" in refused.refused


def test_plan_prints_the_cp_table_with_documents(tmp_path) -> None:
    """`lit-lm plan --cp-methods --document-length`: the masked share and the methods' table per sequence length,
    at the sizes of a cp layout (the winner has none at 4k: cp is taken from its data-parallel ranks)."""
    work = Workload(MODEL, 4096, 8, "bf16-mixed", document_length=256)
    cluster = Cluster(1, 4, 80e9)
    ranked = plan(work, cluster, ("none",))
    layout, checkpointing = reference_layout(ranked, cluster)
    assert layout.cp > 1 and checkpointing == "none"
    out = io.StringIO()
    cli.print_cp_table(Console(file=out, width=200), work, cluster, ranked, [4096, 8192])
    text = out.getvalue()
    assert "context parallelism per sequence length" in text
    assert all(m in text for m in ("ring", "allgather", "ulysses")) and "8192" in text


def test_document_length_from_the_option_or_unknown() -> None:
    assert cli.document_length({"document_mask": True}, 300) == 300
    assert cli.document_length({"document_mask": True}, None) is None  # no prepared sources: unknown, said
    assert cli.document_length({"document_mask": False, "sources": None}, None) is None


def test_hybrid_subgroups_have_their_own_bandwidth_and_comm_theorys_bytes() -> None:
    """ulysses+ring at cp 4 = 2 x 2 on nodes of 2 GPUs: the Ulysses pairs (consecutive cp ranks) inside a node, the
    ring pairs across (`cp.hybrid_grid`); each group's bytes are `cp.comm_theory`'s (ulysses=2) per layer, and its
    time those bytes over its own link (on 4-GPU nodes both inside)."""
    work = Workload(MODEL, 4096, 1, "bf16-mixed")
    layout = ParallelConfig(cp=4, cp_method="ulysses+ring", ulysses_size=2)
    est = estimate(work, layout)
    tokens = 4096 // 4
    kv, q = 2 * tokens * MODEL.n_kv_heads * MODEL.head_dim, tokens * MODEL.n_heads * MODEL.head_dim
    inner = sum(comm_theory("ulysses", 2, kv, 2, q).values())
    theory = sum(comm_theory("ulysses+ring", 4, kv, 2, q, ulysses=2).values())
    assert est.wire_bytes("cp_ulysses") == MODEL.n_layers * inner
    assert est.wire_bytes("cp_ulysses") + est.wire_bytes("cp_ring") == MODEL.n_layers * theory
    cluster = Cluster(2, 2, 80e9, intra_bw=400e9, inter_bw=40e9)
    _, parts = step_time(est, cluster)
    assert parts["cp_ulysses"] == pytest.approx(est.wire_bytes("cp_ulysses") / cluster.intra_bw)
    assert parts["cp_ring"] == pytest.approx(est.wire_bytes("cp_ring") / cluster.inter_bw)
    _, one_node = step_time(est, Cluster(1, 4, 80e9, intra_bw=400e9, inter_bw=40e9))
    assert one_node["cp_ring"] == pytest.approx(est.wire_bytes("cp_ring") / cluster.intra_bw)
    # u = 4 > 2 GPUs per node: the Ulysses groups cross nodes too (cp 8 = 4 x 2 on 4 nodes of 2)
    wide = estimate(Workload(MODEL, 4096, 1), dataclasses.replace(layout, cp=8, ulysses_size=4))
    _, four_nodes = step_time(wide, Cluster(4, 2, 80e9, intra_bw=400e9, inter_bw=40e9))
    assert four_nodes["cp_ulysses"] == pytest.approx(wide.wire_bytes("cp_ulysses") / cluster.inter_bw)


def test_the_hybrid_is_a_row_at_its_default_ulysses_size() -> None:
    """With 6 heads at cp 4 Ulysses is refused and the hybrid's default u is 2 (`cp.ulysses_size_for`); its row's
    bytes and exposed time are both groups', its buffers Ulysses' exchange over u (3 (q + kv)) plus the ring's on
    the K/V the exchange left (kv + 3 kv32)."""
    odd = dataclasses.replace(MODEL, n_heads=6, n_kv_heads=6, d_model=192)
    work = Workload(odd, 8192, 4, "bf16-mixed")
    layout = ParallelConfig(cp=4)
    cluster = Cluster(2, 2, 80e9, intra_bw=400e9, inter_bw=40e9)
    rows = _rows(work, cluster, layout, (8192,))
    assert rows[8192, "ulysses"].rank == 0
    hybrid = rows[8192, "ulysses+ring"]
    assert hybrid.ulysses == 2 and hybrid.rank > 0
    est = estimate(work, dataclasses.replace(layout, cp_method="ulysses+ring"))
    assert est.group_size("cp_ulysses") == est.group_size("cp_ring") == 2
    assert hybrid.cp_bytes == est.wire_bytes("cp_ulysses") + est.wire_bytes("cp_ring") > 0
    _, parts = step_time(est, cluster)
    assert hybrid.exposed == pytest.approx(parts["cp_ulysses"] + parts["cp_ring"])
    tokens = 4 * 8192 // 4  # the batch of 4 rows (one micro-batch), 1/cp of each
    q, kv = tokens * 6 * odd.head_dim, 2 * tokens * 6 * odd.head_dim
    assert hybrid.buffers == 3 * (q + kv) * 2 + kv * 2 + 3 * kv * 4
    # u = cp is Ulysses' buffers alone (3 (q + kv)), u = 1 the ring's alone (kv + 3 kv32)
    q, kv = tokens * MODEL.n_heads * MODEL.head_dim, 2 * tokens * MODEL.n_kv_heads * MODEL.head_dim
    for u, alone, expected in ((4, "ulysses", 3 * (q + kv) * 2), (1, "ring", kv * 2 + 3 * kv * 4)):
        mha = dataclasses.replace(layout, cp_method="ulysses+ring", ulysses_size=u)
        assert attention_buffers(Workload(MODEL, 8192, 4), mha, 4) == expected == \
            attention_buffers(Workload(MODEL, 8192, 4), dataclasses.replace(layout, cp_method=alone), 4)


def test_lit_lm_plan_prints_the_hybrid_row(tmp_path, capsys) -> None:
    """`lit-lm plan --cp-methods` from the command line, one sequence on 4 GPUs: the fastest layout is cp 4, and the
    table has the hybrid's row at 2 x 2 (6 query heads: Ulysses alone is refused)."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  init_args:\n    config: {vocab_size: 512, d_model: 192, n_layers: 2, n_heads: 6, "
                   "n_kv_heads: 2, d_ff: 512, max_seq_len: 16384}\ndata:\n  init_args: {seq_len: 16384}\n")
    cli.main(["--config", str(cfg), "--nodes", "1", "--gpus-per-node", "4", "--global-batch", "1", "--cp-methods",
              "--cp-seq-lens", "16384", "--checkpointing", "none"])
    out = capsys.readouterr().out
    assert "at dp1 cp4," in out and "ulysses+ring (2x2)" in out
