"""Context parallelism (lit_lm/strategies/cp.py) against single-process attention and training, on gloo; an odd ring
(cp=3) through the strategy in the parity harness, where a ring turned around is reported (cp=2 cannot tell)."""

from __future__ import annotations

import importlib
import itertools
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_utils import REFERENCE_TILES, TINY, run_distributed
from lit_lm.parity import Case, assert_parity, run_parity
from lit_lm.kernels.attention import attention_reference
from lit_lm.config import ConfigError, ModelConfig
from lit_lm.model import RotaryEmbedding, Transformer
from lit_lm.strategies import cp as context
from lit_lm.strategies.comm import COMM_LOG
from lit_lm.strategies.composed import ComposedStrategy
from lit_lm.strategies.cp import (METHODS, ContextParallelAttention, block_plan, comm_theory, context_attention,
                           parallelize_context, saved_bytes_theory, tile_mask, zigzag_batch, zigzag_gather,
                           zigzag_merge, zigzag_positions, zigzag_runs, zigzag_split)
from lit_lm.strategies.tp_layers import SavedActivations, TPGroup, parallelize_model
from lit_lm.strategies.zero_engine import ZeroEngine

# (query heads, kv heads, sliding window): MHA, GQA, GQA with windows inside a chunk, across chunks, of one token;
# window 6 at cp=4 leaves rows with no key in the first tile they meet (the merge must keep lse = −inf, not NaN)
CASES = [(2, 2, None), (4, 2, None), (4, 1, 4), (4, 2, 7), (2, 1, 1), (4, 2, 6)]


def test_zigzag_split_covers_the_sequence_with_equal_causal_work() -> None:
    seq_len, cp = 24, 4
    x = torch.arange(seq_len).view(1, seq_len)
    shares = [zigzag_split(x, r, cp) for r in range(cp)]
    for r, share in enumerate(shares):
        assert torch.equal(share[0], zigzag_positions(seq_len, r, cp))
    assert torch.equal(zigzag_merge(torch.stack(shares), dim=1), x)
    assert torch.equal(torch.cat(shares, 1).sort().values, x)
    causal_work = {int((zigzag_positions(seq_len, r, cp) + 1).sum()) for r in range(cp)}  # keys each query sees
    assert len(causal_work) == 1
    with pytest.raises(ValueError, match="divisible by 2·cp=8"):
        zigzag_split(torch.zeros(1, 20), 0, cp)


@pytest.mark.parametrize("window", [None, 5])
def test_ring_skips_the_blocks_no_query_sees(window: int | None) -> None:
    """Summed over the ring steps, every rank scores the same number of (query, key) pairs, about half of the
    T²/cp it would without skipping; a window skips more (and the first tokens, with fewer keys, unbalance it)."""
    seq_len, cp = 32, 4
    c = seq_len // (2 * cp)
    work = []
    for rank in range(cp):
        q_pos = zigzag_runs(seq_len, rank, cp)
        plans = (block_plan(q_pos, zigzag_runs(seq_len, src, cp), window or seq_len, c) for src in range(cp))
        work.append(sum((rows.stop - rows.start) * (keys.stop - keys.start)
                        for plan in plans for rows, keys, _ in plan))
    if window is None:  # own block: 3 of its 4 c×c tiles; every other step: 2 of 4 (no skipping: 4·cp tiles)
        assert work == [(2 * cp + 1) * c * c] * cp
    else:
        assert max(work) < (2 * cp + 1) * c * c


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_block_plan_tiles_exactly_the_pairs_attention_sees(cp: int) -> None:
    """From integers alone (the runs of positions): the tiles, each masked as `tile_mask` masks it, cover every
    (query, key) pair with 0 <= q − k < window once and no other, for every (rank, K/V block) of the ring and for
    the all-gather's whole sequence; both sides of a tile are consecutive positions, `offset` apart, and every key
    of a tile is seen by some row of it (no wasted columns)."""
    seq_len, c = 4 * cp, 2
    for window, rank in itertools.product((seq_len, 1, 3, 5), range(cp)):
        q_runs, q_pos = zigzag_runs(seq_len, rank, cp), zigzag_positions(seq_len, rank, cp)
        assert torch.equal(torch.cat([torch.arange(a, a + n) for a, n in q_runs]), q_pos)
        for k_runs in [zigzag_runs(seq_len, src, cp) for src in range(cp)] + [((0, seq_len),)]:
            k_pos = torch.cat([torch.arange(a, a + n) for a, n in k_runs])
            covered = torch.zeros(len(q_pos), len(k_pos), dtype=torch.int64)
            for rows, keys, offset in block_plan(q_runs, k_runs, window, c):
                qp, kp = q_pos[rows], k_pos[keys]
                assert torch.equal(qp, qp[0] + torch.arange(len(qp))) and torch.equal(kp, kp[0] + torch.arange(len(kp)))
                assert offset == qp[0] - kp[0]
                mask = tile_mask(len(qp), len(kp), offset, window, torch.device("cpu"))
                assert mask is None or bool(mask.any(0).all()), "a tile holds keys no row of it sees"
                covered[rows, keys] += torch.ones(len(qp), len(kp), dtype=torch.int64) if mask is None else mask
            distance = q_pos[:, None] - k_pos[None, :]
            assert torch.equal(covered, ((distance >= 0) & (distance < window)).long()), (window, rank, k_runs)


def test_zigzag_batch_stays_on_the_device_and_reuses_its_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    """No host sync per step: the loss weight is a tensor (cp · local valid / all valid, 0 when this share holds none),
    and the positions are one tensor across steps, so the model's RoPE tables for them are built once."""
    import lit_lm.strategies.cp as context

    monkeypatch.setattr(context, "dist", type("FakeDist", (), {"get_rank": staticmethod(lambda group=None: 1),
                                                               "get_world_size": staticmethod(lambda group=None: 2)}))
    inputs = torch.arange(16).view(2, 8)
    targets = inputs.clone()
    targets[0, :5] = -100  # 11 valid targets, 5 of them on rank 1 (positions 2, 3, 4, 5)
    x, y, positions, weight = zigzag_batch(inputs, targets)
    assert isinstance(weight, torch.Tensor) and weight.item() == pytest.approx(2 * 5 / 11)
    assert torch.equal(positions, zigzag_positions(8, 1, 2)) and torch.equal(x, inputs[:, positions])
    assert zigzag_batch(inputs, targets)[2] is positions
    assert zigzag_batch(inputs, torch.full_like(targets, -100))[3].item() == 0.0  # context_loss takes exactly 0
    rope = RotaryEmbedding(8)
    tables = rope.cos_sin_at(positions, positions.device)
    assert rope.cos_sin_at(positions, positions.device) is tables  # cached against the tensor, not rebuilt
    fresh = rope.cos_sin_at(positions.clone(), positions.device)
    assert fresh is not tables and all(torch.equal(a, b) for a, b in zip(fresh, tables))


def test_rope_positions_follow_the_tokens() -> None:
    """A share of the sequence rotated at its own positions equals that share of the whole rotation, bit for bit;
    no positions is the plain 0..T-1 path."""
    rope = RotaryEmbedding(8)
    q, k = torch.randn(2, 12, 4, 8), torch.randn(2, 12, 2, 8)
    full_q, full_k = rope(q, k)
    assert all(torch.equal(a, b) for a, b in zip(rope(q, k, torch.arange(12)), (full_q, full_k)))
    pos = zigzag_positions(12, 1, 2)
    share_q, share_k = rope(q[:, pos], k[:, pos], pos)
    assert torch.equal(share_q, full_q[:, pos]) and torch.equal(share_k, full_k[:, pos])


def test_moe_models_are_refused() -> None:
    model = Transformer(ModelConfig(**dict(TINY, moe_experts=2)))
    with pytest.raises(ConfigError, match="context parallelism does not support MoE"):
        parallelize_context(model)


def ulysses_degree(method: str, cp: int, hq: int, hk: int) -> tuple[int, Any]:
    """(u, the world's `HybridGroups` or None): the ranks a method's heads exchange spans (ulysses+ring: the most the
    heads allow over the world's cp ranks; the groups made on every rank, in the same order)."""
    if method != context.HYBRID:
        return (cp if method == "ulysses" else 1), None
    u = context.ulysses_size_for(cp, {(hq, hk)})
    return u, context.hybrid_groups([list(range(cp))], u)


def _attention_worker(seq_len: int, runs: list[tuple[str, tuple]]) -> dict[str, Any]:
    """Every (method, case, tile backend): max |error| of the output and of dq, dk, dv against attention on the
    whole sequence, the accounting layer's wire bytes of one forward and one backward, and the saved bytes."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for method, (backend, (hq, hk, window)) in itertools.product(METHODS, runs):
        if method == "ulysses" and hq % cp:  # its heads split over the cp ranks (test_ulysses_refuses_...)
            continue
        if method == context.HYBRID and backend != "reference":  # (its tiles are the ring's)
            continue
        u, hybrid = ulysses_degree(method, cp, hq, hk)
        copies = context.ulysses_kv_copies(hq, hk, u)  # kv heads Ulysses sends a copy of per rank
        gen = torch.Generator().manual_seed(hq * 100 + hk * 10 + (window or 0))
        q, k, v, grad = (torch.randn(2, h, seq_len, 8, generator=gen) for h in (hq, hk, hk, hq))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = attention_reference(*leaves, causal=True, window=window)
        ref.backward(grad)
        local = [zigzag_split(t, rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
        holder = nn.Module()
        holder.core = ContextParallelAttention(None, method, window, backend, hybrid=hybrid)
        COMM_LOG.reset()
        with SavedActivations(holder) as saved:
            y = holder.core(*local)
        forward = COMM_LOG.summary()
        COMM_LOG.reset()
        y.backward(zigzag_split(grad, rank, cp, dim=2))
        backward = COMM_LOG.summary()
        errors = [(zigzag_gather(y.detach(), dim=2) - ref).abs().max()]
        errors += [(zigzag_gather(t.grad, dim=2) - leaf.grad).abs().max() for t, leaf in zip(local, leaves)]
        out[f"{method} {backend} {hq}/{hk} w={window}"] = {
            "errors": [float(e) for e in errors],
            "wire": [sum(s["wire_bytes"] for s in summary.values()) for summary in (forward, backward)],
            "theory": comm_theory(method, cp, 2 * k.numel() // cp, k.element_size(), q.numel() // cp, copies, u),
            "saved": (saved.bytes["core"], saved_bytes_theory(2, hq, hk * copies, 8, seq_len // cp, 4))}
    return out


# chunks of 3 (odd) and 2 tokens; the tiles by the PyTorch reference, and by the FlashAttention kernel (Triton's
# interpreter on CPU, which the suite turns on in conftest.py; slow, so two cases) at cp=2
REFERENCE = [("reference", case) for case in CASES]


@pytest.mark.parametrize("cp, seq_len, runs", [(2, 12, REFERENCE + [("triton", case) for case in CASES[1:3]]),
                                               (4, 16, REFERENCE)])
def test_attention_forward_and_backward_match_single_process(cp: int, seq_len: int, runs: list) -> None:
    for rank in run_distributed(_attention_worker, cp, seq_len, runs):
        for name, r in rank.items():
            assert max(r["errors"]) < 1e-5, (name, r["errors"])
            assert r["wire"] == [r["theory"]["forward"], r["theory"]["backward"]], name
            assert r["saved"][0] == r["saved"][1], name  # activation memory: this rank's share only


def test_comm_theory_ring_and_allgather() -> None:
    """Same K/V volume both ways; the ring's dK/dV make one more hop than the reduce-scatter moves."""
    ring, gather = comm_theory("ring", 4, 1000, 2), comm_theory("allgather", 4, 1000, 2)
    assert ring["forward"] == gather["forward"] == 3 * 2000
    assert ring["backward"] - gather["backward"] == 4000
    assert comm_theory("ring", 1, 1000, 2) == {"forward": 0.0, "backward": 0.0}


def _bench_variants_worker() -> dict[tuple[str, str], Any]:
    """Each method under each variant of `scripts/bench_cp.py --overlap`: the output and input gradients of one
    forward + backward, and how many transfers the accounting layer saw."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    bench = importlib.import_module("bench_cp")
    gen = torch.Generator().manual_seed(dist.get_rank())
    q, k, v, grad = (torch.randn(1, h, 4, 8, generator=gen) for h in (4, 2, 2, 4))
    out = {}
    for method, name in itertools.product(METHODS, bench.VARIANTS):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        COMM_LOG.reset()
        with bench.variant(name):
            y = context_attention(*leaves, method=method, hybrid=ulysses_degree(method, 2, 4, 2)[1])
            y.backward(grad)
        out[method, name] = ([y.detach(), *(t.grad for t in leaves)], len(COMM_LOG.records))
    return out


def test_bench_overlap_variants_reach_the_engine() -> None:
    """The overlap benchmark's swaps act on the engine: serialised is the same computation with the same transfers;
    with communication a no-op nothing is sent and the result is wrong (the other rank's keys never arrive)."""
    for rank in run_distributed(_bench_variants_worker, 2):
        for method in METHODS:
            (real, sent), (serial, serial_sent), (none, none_sent) = (rank[method, name]
                                                                      for name in ("overlap", "serial", "nocomm"))
            assert sent > 0 and serial_sent == sent and none_sent == 0, method
            assert all(torch.equal(a, b) for a, b in zip(real, serial)), method
            assert not torch.allclose(real[0], none[0]), method


def _groups(dp: int, cp: int, tp: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (cp, tp, dp × cp) groups in a dp × cp × tp layout, tp innermost (every rank builds all)."""
    layout = torch.arange(dp * cp * tp).view(dp, cp, tp)
    kinds = {"cp": layout.transpose(1, 2).reshape(-1, cp), "tp": layout.reshape(-1, tp),
             "dp_cp": layout.permute(2, 0, 1).reshape(tp, -1)}
    mine = {}
    for kind, rows in kinds.items():
        for members in rows.tolist():
            group = dist.new_group(members)
            if dist.get_rank() in members:
                mine[kind] = group
    return mine["cp"], mine["tp"], mine["dp_cp"]


def _training_worker(method: str, config: dict, dp: int, tp: int = 1, sequence_parallel: bool = False,
                     zero3: bool = False) -> dict[str, Any]:
    """One step's loss and every gradient (averaged over the dp × cp ranks as the gradient sync would; a
    tensor-parallel shard beside the same shard of the reference; under ZeRO-3 over dp × cp, the shards gathered)
    of a cp-sharded tiny Transformer, beside the single-process ones on the whole batch."""
    world, rank = dist.get_world_size(), dist.get_rank()
    cp = world // (dp * tp)
    cp_group, tp_group, dp_cp_group = _groups(dp, cp, tp)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, TINY["vocab_size"], (2 * dp, TINY["max_seq_len"] + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, 3:7] = -100  # ignored targets fall unevenly on the cp ranks: the loss weight must correct it

    torch.manual_seed(0)
    reference = Transformer(ModelConfig(**config))
    ref_loss = reference.loss(inputs, targets)[0]
    ref_loss.backward()

    torch.manual_seed(0)
    with torch.device("meta" if zero3 else "cpu"):  # ZeRO-3 materialises only this rank's shards
        model = Transformer(ModelConfig(**config))
    tp_shards = parallelize_model(model, model.tensor_parallel_plan(),
                                  TPGroup(tp_group, tp, rank % tp, sequence_parallel)) if tp > 1 else None
    assert parallelize_context(model, cp_group, method, backend="reference") == config["n_layers"]
    zero = ZeroEngine(model, 3, dp_cp_group) if zero3 else None
    rows = slice(rank // (cp * tp) * 2, rank // (cp * tp) * 2 + 2)  # this rank's data-parallel replica's rows
    x, y, positions, weight = zigzag_batch(inputs[rows], targets[rows], cp_group)
    loss = model.loss(x, y, positions)[0] * weight
    loss.backward()
    if tp_shards is not None:
        tp_shards.sum_partial_grads(model)
    ref_grads = dict(reference.named_parameters())
    if zero is not None:  # the engine averages the gradients over dp × cp into each rank's shard
        zero.finish_grad_sync()
        dist.all_reduce(loss.data, group=dp_cp_group)
        grads = {}
        for sp in zero.sharded_params():
            parts: list[Any] = [None] * dist.get_world_size(dp_cp_group)
            dist.all_gather_object(parts, sp.master.grad, group=dp_cp_group)
            grads[sp.fqn] = (torch.cat(parts), ref_grads[sp.fqn].grad)
        return {"loss": (float(loss) / (dp * cp), float(ref_loss)), "grads": grads}
    # dp replicas' mean losses average to the batch mean only with equal valid counts: weigh them here.
    replica_weight = dp * int((targets[rows] != -100).sum()) / int((targets != -100).sum())
    for t in (loss, *(p.grad for p in model.parameters())):
        t.data.mul_(replica_weight)
        dist.all_reduce(t.data, group=dp_cp_group)
        t.data.div_(dp * cp)
    grads = {}
    for name, p in model.named_parameters():
        ref = ref_grads[name].grad
        if tp_shards is not None and name in tp_shards.sharded:
            ref = tp_shards.tp.shard(ref, tp_shards.sharded[name][0])
        grads[name] = (p.grad, ref)
    return {"loss": (float(loss), float(ref_loss)), "grads": grads}


TRAIN_RUNS = {  # world size: {name: (method, model config, dp, tp, sequence parallel, zero3)}; one spawn per world
    2: {"ring_cp2_gqa": ("ring", dict(TINY), 1),
        "ring_cp2_zero3": ("ring", dict(TINY, sliding_window=6), 1, 1, False, True),
        "allgather_cp2_window_qknorm": ("allgather", dict(TINY, sliding_window=5, qk_norm=True), 1)},
    4: {"ring_cp4_window": ("ring", dict(TINY, sliding_window=6, n_kv_heads=1), 1),
        "allgather_cp4": ("allgather", dict(TINY), 1),
        "ring_dp2_cp2": ("ring", dict(TINY), 2),
        "ring_cp2_tp2": ("ring", dict(TINY, sliding_window=5), 1, 2),
        "allgather_cp2_tp2_sp": ("allgather", dict(TINY), 1, 2, True)},
}


def _training_runs(world: int) -> dict[str, dict[str, Any]]:
    return {name: _training_worker(*run) for name, run in TRAIN_RUNS[world].items()}


@pytest.mark.parametrize("world", TRAIN_RUNS)
def test_transformer_loss_and_gradients_match_single_process(world: int) -> None:
    for rank in run_distributed(_training_runs, world, world):
        for run, result in rank.items():
            loss, ref_loss = result["loss"]
            assert abs(loss - ref_loss) < 1e-5, run
            for name, (grad, ref) in result["grads"].items():
                torch.testing.assert_close(grad, ref, atol=1e-5, rtol=1e-5, msg=f"{run}: {name}")


# -- an odd ring through the strategy (lit_lm/parity.py): cp=3 against one process, and the ring turned around ------
CP3_MODEL = dict(TINY, max_seq_len=12)  # divisible by 2·cp = 6: chunks of 2 tokens


def ring_reversed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring turned around: each rank sends its K/V (and dK/dV) to the previous rank and receives the next one's,
    by reversing the member list `_ring_pass` computes its peers from. At cp=2 the previous and the next rank are
    the same one, so only an odd (or larger) ring can tell."""
    ranks = dist.get_process_group_ranks
    monkeypatch.setattr(context, "dist", SimpleNamespace(**{**vars(dist),
                                                            "get_process_group_ranks": lambda g: ranks(g)[::-1]}))


def test_cp3_ring_matches_one_process_and_the_reversed_ring_is_reported() -> None:
    """Three ranks (dp 1 x cp 3, ring attention) against one process, two steps; the same run with the ring
    reversed is reported by the first loss and, the losses set aside, at step 0 by the gradient of a named parameter
    (one launch for both)."""
    cp3 = partial(ComposedStrategy, context_parallel_size=3)
    clean, mutant = run_parity([Case(cp3, model=CP3_MODEL, steps=2, global_batch=2, label="cp3 ring"),
                                Case(cp3, model=CP3_MODEL, steps=1, global_batch=2, mutation=ring_reversed,
                                     label="cp3 ring, reversed")], 3, env=REFERENCE_TILES)
    assert_parity(clean)
    # K/V blocks attended at the wrong positions move the first loss, which the harness checks before the gradients
    with pytest.raises(AssertionError, match=r"cp3 ring, reversed: batch 0 rank \d: loss"):
        assert_parity(mutant)
    # the losses set aside, the report names the parameter whose gradient differs
    same_losses = [{**rank, "losses": mutant["single"]["losses"]} for rank in mutant["ranks"]]
    with pytest.raises(AssertionError, match=r"cp3 ring, reversed: step 0 rank \d: gradient of model\.\S+ differs"):
        assert_parity({**mutant, "ranks": same_losses})
