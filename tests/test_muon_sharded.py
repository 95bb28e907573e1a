"""The sharded orthogonalizer (lit_lm/strategies/orthogonalize.py) without Lightning: on 4 gloo ranks laid out as
dp2 x tp2, matrices cut every way a strategy cuts them (tp rows or columns then ZeRO rows, ZeRO rows alone and
uneven, expert stacks whose experts stay whole, a tp-split expert stack, a matrix replicated over dp) are
orthogonalized exactly as one process orthogonalizes each whole matrix: bit for bit, in owner and replicated mode,
with one all-to-all per level and direction (not one per matrix). In gram mode the matrices cut over tp along
their long dimension go by Gram mode (one all-reduce for the norms and one per NS step over tp, for all of them;
no all-to-all over tp for them), the others as in owner mode; float32 NS equals the whole matrix's to fp32
summation order, and bfloat16 NS stays within GRAM_BF16 of it (a rounding flip grows through the steps)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from lit_lm.spawn import run_distributed
from lit_lm.strategies import comm
from lit_lm.strategies.base import Split
from lit_lm.strategies.newton_schulz import NewtonSchulz
from lit_lm.strategies.orthogonalize import ShardedOrthogonalizer, chunk, orthogonalize_whole

NS = {dtype: NewtonSchulz((3.4445, -4.7750, 2.0315), 5, 1e-7, getattr(torch, dtype)) for dtype in ("bfloat16",
                                                                                                     "float32")}
GRAM_BF16 = 0.1  # measured: up to 4e-2 of the matrix's norm (bfloat16 NS of the Gram sum against the whole's)

# name: (global shape, cuts outer to inner as (dim, "tp" | "dp"), replicated over dp when not cut by it)
MATRICES = {
    "column, then ZeRO rows": ((32, 24), [(0, "tp"), (0, "dp")]),
    "column of a wide matrix (short cut), then ZeRO rows": ((16, 40), [(0, "tp"), (0, "dp")]),
    "row, then ZeRO rows": ((24, 40), [(1, "tp"), (0, "dp")]),
    "ZeRO rows, uneven": ((3, 8), [(0, "dp")]),
    "ZeRO rows, tall": ((40, 6), [(0, "dp")]),
    "expert stack, ZeRO rows (whole experts)": ((4, 16, 12), [(0, "dp")]),
    "expert stack, tp columns, ZeRO rows": ((2, 12, 16), [(2, "tp"), (0, "dp")]),
    "tp rows, replicated over dp": ((10, 6), [(0, "tp")]),
    "whole, replicated over dp": ((20, 20), []),
    "whole, another": ((12, 20), []),
}


GRAM = {"column, then ZeRO rows", "row, then ZeRO rows", "expert stack, tp columns, ZeRO rows",
        "tp rows, replicated over dp"}  # the tp cuts along the long dimension


def _orthogonalize(mode: str, dtype: str = "bfloat16") -> dict:
    rank = dist.get_rank()
    groups = {}
    for name, members in [("tp", [[0, 1], [2, 3]]), ("dp", [[0, 2], [1, 3]])]:
        for ranks in members:
            group = dist.new_group(ranks)
            if rank in ranks:
                groups[name] = group
                comm.name_group(group, name)
    gen = torch.Generator().manual_seed(0)
    shards, updates, expected = [], [], []
    for name, (shape, cuts) in MATRICES.items():
        whole = torch.randn(shape, generator=gen)
        local, splits = whole, []
        for dim, over in cuts:
            group = groups[over]
            start, end = chunk(local.shape[dim], dist.get_world_size(group), dist.get_rank(group))
            splits.append(Split(dim, start, end, group))
            local = local.narrow(dim, start, end - start)
        index = [slice(None)] * len(shape)
        for s in splits:  # nested: the starts add up per dim
            base = index[s.dim].start or 0
            index[s.dim] = slice(base + s.start, base + s.end)
        local = local.contiguous()
        shards.append(SimpleNamespace(name=name, local=local, global_shape=torch.Size(shape), splits=tuple(splits)))
        updates.append(local)
        expected.append(orthogonalize_whole(whole, NS[dtype])[tuple(index)])
    comm.COMM_LOG.reset()
    orthogonalizer = ShardedOrthogonalizer(shards, lambda shard: None if shard.splits else groups["dp"], mode,
                                           groups["tp"])
    got = orthogonalizer([s.local for s in shards], updates, NS[dtype])
    ops = [(r.op, r.group) for r in comm.COMM_LOG.records]
    return {"equal": {name: torch.equal(g, e) for name, g, e in zip(MATRICES, got, expected)},
            "error": {name: ((g.double() - e.double()).norm() / e.double().norm()).item()
                      for name, g, e in zip(MATRICES, got, expected) if e.numel()},
            "ops": ops, "shapes": [orthogonalizer.matrix_shape(s.local) for s in shards]}


def _both() -> dict:
    return {mode: _orthogonalize(mode) for mode in ("owner", "replicated")}


def _auto() -> dict:
    return {dtype: _orthogonalize("gram", dtype) for dtype in ("float32", "bfloat16")}


def test_sharded_orthogonalizer_equals_whole_matrices_bit_for_bit() -> None:
    for rank, result in enumerate(run_distributed(_both, 4)):
        for mode, got in result.items():
            wrong = [name for name, ok in got["equal"].items() if not ok]
            assert not wrong, f"rank {rank} {mode}: {wrong} differ from NS of the whole matrix"
            assert got["shapes"] == [tuple(shape[-2:]) for shape, _ in MATRICES.values()]
        # one all-to-all per pool, level and direction, whatever the number of matrices: owner mode gathers and
        # scatters the pools (dp, tp) and (dp,) over dp, the replica pool scatters over dp, the pools (dp, tp) and
        # (tp,) go over tp; replicated mode only gathers, and has no replica level
        owner, replicated = result["owner"]["ops"], result["replicated"]["ops"]
        assert sorted(owner) == [("all_to_all", "dp")] * 5 + [("all_to_all", "tp")] * 4, owner
        assert sorted(replicated) == [("all_to_all", "dp")] * 2 + [("all_to_all", "tp")] * 2, replicated


def test_gram_mode_orthogonalizes_long_tp_cuts_on_their_shards_with_one_all_reduce_per_step() -> None:
    moved_over_tp = []
    for rank, result in enumerate(run_distributed(_auto, 4)):
        fp32, bf16 = result["float32"], result["bfloat16"]
        not_gram = [name for name in MATRICES if name not in GRAM]
        for got in (fp32, bf16):  # the matrices not cut over tp along their long side: the owner route, exact
            assert all(got["equal"][name] for name in not_gram), (rank, got["equal"])
        assert all(fp32["error"][name] < 1e-5 for name in GRAM), (rank, fp32["error"])
        assert not all(fp32["equal"][name] for name in GRAM), (rank, "Gram mode ran the owner route")
        assert all(bf16["error"][name] < GRAM_BF16 for name in GRAM), (rank, bf16["error"])
        # per NS call: the norms' all-reduce and one per NS step (5) over tp, for every Gram matrix together; over
        # dp the owner route's all-to-alls as in owner mode; over tp only the short-cut matrix moves, on the tp
        # group of its dp owner (gathered and scattered)
        for got in (fp32, bf16):
            tp_moves = got["ops"].count(("all_to_all", "tp"))
            assert sorted(op for op in got["ops"] if op != ("all_to_all", "tp")) == (
                [("all_reduce", "tp")] * 6 + [("all_to_all", "dp")] * 5), got["ops"]
            moved_over_tp.append(tp_moves)
    assert sorted(moved_over_tp) == [0, 0, 0, 0, 2, 2, 2, 2], moved_over_tp  # one tp group, both dtypes
