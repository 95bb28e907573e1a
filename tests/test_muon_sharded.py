"""The sharded orthogonalizer (lit_lm/strategies/orthogonalize.py) without Lightning: on 4 gloo ranks laid out as
dp2 x tp2, matrices cut every way a strategy cuts them (tp rows or columns then ZeRO rows, ZeRO rows alone and
uneven, expert stacks whose experts stay whole, a tp-split expert stack, a matrix replicated over dp) are
orthogonalized exactly as one process orthogonalizes each whole matrix: bit for bit, in owner and replicated mode,
with one all-to-all per level and direction (not one per matrix)."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.optim._muon import _zeropower_via_newtonschulz

from lit_lm.spawn import run_distributed
from lit_lm.strategies import comm
from lit_lm.strategies.base import Split
from lit_lm.strategies.orthogonalize import ShardedOrthogonalizer, chunk, orthogonalize_whole

NS = partial(_zeropower_via_newtonschulz, ns_coefficients=(3.4445, -4.7750, 2.0315), ns_steps=5, eps=1e-7)

# name: (global shape, cuts outer to inner as (dim, "tp" | "dp"), replicated over dp when not cut by it)
MATRICES = {
    "column, then ZeRO rows": ((32, 24), [(0, "tp"), (0, "dp")]),
    "row, then ZeRO rows": ((24, 40), [(1, "tp"), (0, "dp")]),
    "ZeRO rows, uneven": ((3, 8), [(0, "dp")]),
    "ZeRO rows, tall": ((40, 6), [(0, "dp")]),
    "expert stack, ZeRO rows (whole experts)": ((4, 16, 12), [(0, "dp")]),
    "expert stack, tp columns, ZeRO rows": ((2, 12, 16), [(2, "tp"), (0, "dp")]),
    "tp rows, replicated over dp": ((10, 6), [(0, "tp")]),
    "whole, replicated over dp": ((20, 20), []),
    "whole, another": ((12, 20), []),
}


def _orthogonalize(mode: str) -> dict:
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
        expected.append(orthogonalize_whole(whole, NS)[tuple(index)])
    comm.COMM_LOG.reset()
    orthogonalizer = ShardedOrthogonalizer(shards, lambda shard: None if shard.splits else groups["dp"], mode)
    got = orthogonalizer([s.local for s in shards], updates, NS)
    ops = [(r.op, r.group) for r in comm.COMM_LOG.records]
    return {"equal": {name: torch.equal(g, e) for name, g, e in zip(MATRICES, got, expected)},
            "ops": ops, "shapes": [orthogonalizer.matrix_shape(s.local) for s in shards]}


def _both() -> dict:
    return {mode: _orthogonalize(mode) for mode in ("owner", "replicated")}


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
