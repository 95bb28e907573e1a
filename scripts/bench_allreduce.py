"""Collective bandwidth: all_reduce, reduce_scatter, all_gather, all_to_all from 1 KiB to 1 GiB (nccl-tests style).

    torchrun --nproc-per-node 8 scripts/bench_allreduce.py          # one process per GPU, NCCL
    python scripts/bench_allreduce.py --nproc 2 --max-bytes 1M        # spawns itself (gloo on CPU, NCCL on GPU)
    python scripts/bench_allreduce.py --nproc 2 --min-bytes 64M --max-bytes 64M --beside-compute   # overlap with work

`size` is the whole buffer (the gathered tensor for all_gather, the input for reduce_scatter). Algorithm
bandwidth = size / time. Bus bandwidth rescales it to what each link carries in a ring, so it is comparable
across world sizes and ops and with the hardware's link speed: x 2(n-1)/n for all_reduce (reduce-scatter then
all-gather), x (n-1)/n for reduce_scatter, all_gather and all_to_all (each rank sends all but its own 1/n).
Time per op is the mean over `--iters` after `--warmup`, synchronised, and the slowest rank's.

`--ops` also takes the other ways a backend offers to do a reduce-scatter or an all-gather (the same result, moved
differently), to find which one a backend does well: `reduce_scatter_list` and `all_gather_list` (torch's list
forms), `reduce_per_rank` (one `reduce` of each chunk to the rank that owns it, in place), `reduce_scatter_p2p`
(each chunk sent to its owner, batched, and summed there) and `broadcast_per_rank` (each rank broadcasts its chunk,
in place: what torch's `ZeroRedundancyOptimizer` does after its step). Their bus factor is their collective's.

    python scripts/bench_allreduce.py --nproc 2 --min-bytes 64M --max-bytes 64M --ops all_reduce reduce_scatter \\
        reduce_scatter_list reduce_per_rank reduce_scatter_p2p all_gather all_gather_list broadcast_per_rank
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from machine import machine  # scripts/: where the figures were measured

BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}
COLLECTIVES = tuple(BUS_FACTOR)  # what `--ops` runs by default; the other forms below on request
SAME_AS = {"reduce_scatter_list": "reduce_scatter", "reduce_per_rank": "reduce_scatter",
           "reduce_scatter_p2p": "reduce_scatter", "all_gather_list": "all_gather", "broadcast_per_rank": "all_gather"}
BUS_FACTOR.update({op: BUS_FACTOR[of] for op, of in SAME_AS.items()})
# torch >= 2.10 names; older releases have the *_tensor spellings.
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def parse_bytes(text: str) -> int:
    """'1G', '256M', '4K' or a plain number of bytes (powers of 1024)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


class Works:
    """The handles of several calls as one: `wait()` waits for each, then runs `then` (the local sum, if any)."""

    def __init__(self, works: list[Any], then: Callable[[], Any] = lambda: None) -> None:
        self.works, self.then = works, then

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.then()


def by_parts(launch: Callable[[], Works], async_op: bool) -> Callable[[], Any]:
    """A formulation made of several calls, launched together and, unless `async_op`, waited for here."""
    def run() -> Any:
        works = launch()
        return works if async_op else works.wait()
    return run


def make_op(op: str, numel: int, world: int, device: torch.device, dtype: torch.dtype,
            async_op: bool = False) -> Callable[[], Any]:
    full = torch.ones(numel, device=device, dtype=dtype)
    return op_on(op, full, torch.ones(numel // world, device=device, dtype=dtype), async_op)


def op_on(op: str, full: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> Callable[[], Any]:
    """The call of `op` over these buffers: a reduce-scatter reads `full` (the in-place forms overwrite it) and writes
    this rank's reduced chunk to `shard` (`reduce_per_rank`: to its chunk of `full`); an all-gather reads `shard`
    (the in-place forms: this rank's chunk of `full`) and writes `full`; all_reduce and all_to_all work on `full`."""
    world, rank, out = dist.get_world_size(), dist.get_rank(), torch.empty_like(full)
    chunks, received = full.chunk(world), [torch.empty_like(shard) for _ in range(world)]

    def p2p() -> Works:
        ops = [dist.P2POp(f, t, peer) for peer in range(world) if peer != rank
               for f, t in ((dist.isend, chunks[peer]), (dist.irecv, received[peer]))]
        mine = [received[peer] for peer in range(world) if peer != rank]
        return Works(dist.batch_isend_irecv(ops), lambda: torch.add(chunks[rank], sum(mine), out=shard))

    return {
        "all_reduce": lambda: dist.all_reduce(full, async_op=async_op),
        "reduce_scatter": lambda: reduce_scatter(shard, full, async_op=async_op),
        "all_gather": lambda: all_gather(full, shard, async_op=async_op),
        "all_to_all": lambda: dist.all_to_all_single(out, full, async_op=async_op),
        "reduce_scatter_list": lambda: dist.reduce_scatter(shard, list(chunks), async_op=async_op),
        "all_gather_list": lambda: dist.all_gather(list(chunks), shard, async_op=async_op),
        "reduce_per_rank": by_parts(lambda: Works([dist.reduce(c, dst=i, async_op=True)
                                                   for i, c in enumerate(chunks)]), async_op),
        "reduce_scatter_p2p": by_parts(p2p, async_op),
        "broadcast_per_rank": by_parts(lambda: Works([dist.broadcast(c, src=i, async_op=True)
                                                      for i, c in enumerate(chunks)]), async_op),
    }[op]


def beside_compute(op: str, numel: int, world: int, device: torch.device, dtype: torch.dtype, warmup: int,
                   iters: int) -> dict[str, float]:
    """Seconds per call of the collective alone, of an AdamW step (`foreach=False`) over a 1/world shard of it alone,
    and of the two together (the collective launched, the step run on this thread, then the wait), the slowest rank's
    each. Where the collective runs beside the rank's work (NCCL's kernels on their own stream; a spare core), the pair
    costs about the larger of the two; where it needs a core the rank's work already takes (gloo with one core per
    rank), nearer their sum, and overlapping it with backward or the step gains little."""
    shard = torch.zeros(numel // world, device=device, dtype=torch.float32, requires_grad=True)
    shard.grad = torch.ones_like(shard)
    step = torch.optim.AdamW([shard], foreach=False).step
    launch = make_op(op, numel, world, device, dtype, async_op=True)

    def both() -> None:
        work = launch()
        step()
        work.wait()

    return {"collective_s": time_op(make_op(op, numel, world, device, dtype), device, warmup, iters),
            "step_s": time_op(step, device, warmup, iters), "both_s": time_op(both, device, warmup, iters)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn: Callable[[], None], device: torch.device, warmup: int, iters: int) -> float:
    """Seconds per call: wall clock between synchronised start and end, the slowest rank's."""
    for _ in range(warmup):
        fn()
    sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    slowest = torch.tensor([(time.perf_counter() - start) / iters], device=device, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def sizes(max_bytes: int, min_bytes: int = 2**10) -> list[int]:
    """1 KiB (or min_bytes), 2 KiB, ... up to max_bytes (powers of two)."""
    return [2**p for p in range(10, 31) if min_bytes <= 2**p <= max_bytes]


def benchmark(args: argparse.Namespace) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    results = []
    for op in args.ops:
        for size in sizes(args.max_bytes, args.min_bytes):
            numel = size // elem // world * world  # divisible into world shards
            if numel == 0:
                continue
            if args.beside_compute:
                results.append(dict(op=op, bytes=numel * elem, world_size=world, backend=dist.get_backend(),
                                    **beside_compute(op, numel, world, device, dtype, args.warmup, args.iters)))
                if rank == 0:
                    row = results[-1]
                    print(f"{op:>15} {row['bytes']:>12} " + " ".join(
                        f"{row[k] * 1e3:>12.1f}" for k in ("collective_s", "step_s", "both_s")), flush=True)
                continue
            seconds = time_op(make_op(op, numel, world, device, dtype), device, args.warmup, args.iters)
            algbw = numel * elem / seconds / 1e9
            results.append(dict(op=op, bytes=numel * elem, world_size=world, backend=dist.get_backend(),
                                time_us=seconds * 1e6, algbw_gbps=algbw, busbw_gbps=algbw * BUS_FACTOR[op](world)))
            if rank == 0:
                print_row(results[-1])
    return results


def print_row(row: dict) -> None:
    print(f"{row['op']:>15} {row['bytes']:>12} {row['time_us']:>12.1f} {row['algbw_gbps']:>10.3f} "
          f"{row['busbw_gbps']:>10.3f}", flush=True)


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    """One rank: join the group (env:// from torchrun, or the spawner's address), run, write results on rank 0."""
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    else:  # the cores shared out, as Lightning's launchers do (oversubscribed OpenMP threads stall every op)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    try:
        if rank == 0:
            print(f"{dist.get_backend()} world_size={world} dtype={args.dtype}")
            print(f"{'op':>15} {'bytes':>12} " + (f"{'alone ms':>12} {'step ms':>12} {'both ms':>12}"
                  if args.beside_compute else f"{'time_us':>12} {'algbw GB/s':>10} {'busbw GB/s':>10}"))
        results = benchmark(args)
        if rank == 0 and args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": machine(), "results": results}, f, indent=1)
            print(f"wrote {args.json}")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=max(torch.cuda.device_count(), 2),
                        help="processes to spawn when not launched by torchrun")
    parser.add_argument("--max-bytes", type=parse_bytes, default=2**30, help="largest buffer, e.g. 64M (default 1G)")
    parser.add_argument("--ops", nargs="+", choices=list(BUS_FACTOR), default=list(COLLECTIVES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default="bench_allreduce.json", help="results file (empty: do not write)")
    parser.add_argument("--min-bytes", type=parse_bytes, default=2**10, help="smallest buffer (default 1K)")
    parser.add_argument("--beside-compute", action="store_true",
                        help="time each op alone, an AdamW step over a shard alone, and the two together")
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun: the environment already names this rank and the rendezvous
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        mp.spawn(worker, args=(args.nproc, args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
