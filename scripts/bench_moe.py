"""MoE benchmark: training tokens/s of an MoE model vs a dense model with the same *active* parameters (one
process), and the bytes the expert-parallel all-to-alls move vs theory (ep ranks over gloo).

    python scripts/bench_moe.py [--steps 5] [--ep 2] [--json bench_moe.json]

Theory per MoE layer per step, summed over the ep ranks (dropless, fp32): 4 all-to-alls of k * tokens * d
elements each (dispatch and combine forward, their reverses backward), plus the counts exchange (E per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_lm.config import ModelConfig
from machine import machine  # scripts/: where the figures were measured
from lit_lm.model import Transformer
from lit_lm.strategies.comm import COMM_LOG

BASE = ModelConfig(vocab_size=2048, d_model=128, n_layers=4, n_heads=4, max_seq_len=128)
MOE = replace(BASE, moe_experts=8, moe_top_k=2, moe_d_ff=BASE.d_ff // 2)  # active MLP = 2 x d_ff/2 = d_ff
BATCH, SEQ = 8, 128


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, BASE.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def tokens_per_s(config: ModelConfig, steps: int) -> float:
    torch.manual_seed(0)
    model = Transformer(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elapsed = 0.0
    for step in range(steps + 1):  # the first step warms up
        tokens = _batch(step)
        started = time.perf_counter()
        model.loss(tokens[:, :-1], tokens[:, 1:])[0].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed += (time.perf_counter() - started) if step else 0.0
    return steps * BATCH * SEQ / elapsed


def _ep_worker(rank: int, world: int, port: int, steps: int, out: str) -> None:
    from lit_lm.strategies.experts import shard_experts
    from lit_lm.strategies.layout import ParallelDims, ParallelLayout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Transformer(MOE)
    shard_experts(model, ParallelLayout.get(ParallelDims.of(world, ep=world)).group("ep"))
    COMM_LOG.reset()
    for step in range(steps):
        tokens = _batch(step * world + rank)
        model.loss(tokens[:, :-1], tokens[:, 1:])[0].backward()
    a2a = [r for r in COMM_LOG.records if r.op == "all_to_all"]
    counts = [r for r in a2a if r.numel == MOE.moe_experts]
    result = {"token_bytes": sum(r.nbytes for r in a2a) - sum(r.nbytes for r in counts),
              "token_wire_bytes": sum(r.wire_bytes for r in a2a) - sum(r.wire_bytes for r in counts),
              "count_calls": len(counts), "token_calls": len(a2a) - len(counts)}
    torch.save(result, Path(out) / f"{rank}.pt")
    dist.destroy_process_group()


def ep_bytes(ep: int, steps: int) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_ep_worker, args=(ep, port, steps, out), nprocs=ep, join=True)
        ranks = [torch.load(Path(out) / f"{r}.pt") for r in range(ep)]
    layers = sum(MOE.is_moe_layer(i) for i in range(MOE.n_layers))
    theory = 4 * MOE.moe_top_k * BATCH * SEQ * MOE.d_model * 4 * layers * steps * ep  # summed over ranks
    measured = sum(r["token_bytes"] for r in ranks)
    return {"ep": ep, "steps": steps, "moe_layers": layers, "measured_bytes": measured, "theory_bytes": theory,
            "wire_bytes": sum(r["token_wire_bytes"] for r in ranks), "theory_wire_bytes": theory * (ep - 1) / ep,
            "token_all_to_alls_per_layer_step": ranks[0]["token_calls"] / (layers * steps),
            "count_all_to_alls_per_layer_step": ranks[0]["count_calls"] / (layers * steps)}


def active_params(config: ModelConfig) -> int:
    """Parameters one token passes through (an MoE layer counts k experts and the router)."""
    model = Transformer(config)
    total = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            total += p.numel() * config.moe_top_k // config.moe_experts
        else:
            total += p.numel()
    return total


def run(steps: int, ep: int) -> dict:
    """The measurements: dense and MoE tokens/s in this process, then the all-to-all bytes on `ep` gloo ranks."""
    torch.set_num_threads(1)
    dense, moe = tokens_per_s(BASE, steps), tokens_per_s(MOE, steps)
    return {"dense": {"tokens_per_s": dense, "active_params": active_params(BASE)},
            "moe": {"tokens_per_s": moe, "active_params": active_params(MOE),
                    "total_params": sum(p.numel() for p in Transformer(MOE).parameters())},
            "all_to_all": ep_bytes(ep, steps)}


def print_report(result: dict) -> None:
    dense, moe, a2a = result["dense"]["tokens_per_s"], result["moe"]["tokens_per_s"], result["all_to_all"]
    print(f"| model | active params | tokens/s | vs dense |\n|---|---|---|---|\n"
          f"| dense (d_ff {BASE.d_ff}) | {result['dense']['active_params']:,} | {dense:.0f} | 1.00x |\n"
          f"| MoE {MOE.moe_experts}x top-{MOE.moe_top_k} (d_ff {MOE.moe_d_ff}) | {result['moe']['active_params']:,} "
          f"| {moe:.0f} | {moe / dense:.2f}x |")
    print(f"\nep={a2a['ep']}: token all-to-all bytes {a2a['measured_bytes']:,} (theory {a2a['theory_bytes']:,}), "
          f"wire {a2a['wire_bytes']:,.0f} (theory {a2a['theory_wire_bytes']:,.0f}); per layer and step "
          f"{a2a['token_all_to_alls_per_layer_step']:.0f} token + {a2a['count_all_to_alls_per_layer_step']:.0f} "
          "count all-to-alls")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = run(args.steps, args.ep)
    print_report(result)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), **result}, indent=2))


if __name__ == "__main__":
    main()
