"""Context parallelism measured beside theory, on CPU processes (gloo): activation memory per rank and the bytes
each rank sends, for ring and all-gather attention, over sequence lengths and cp sizes; and (`--overlap`) how much
of the attention's communication hides behind its compute.

    python scripts/bench_cp.py --seq-lens 512 1024 2048 4096 --cps 1 2 4 --cap-mib 256 --json runs/bench_cp.json

For each cp size, `cp` processes run one Transformer block of a small model (`--d-model`, `--heads`,
`--kv-heads`) on their zigzag share of a (`--batch`, T) sequence, its attention core swapped for
`lit_lm.strategies.cp.ContextParallelAttention`:
- memory: the bytes autograd saves for backward (each storage once, `lit_lm.strategies.tp_layers.SavedActivations`), the
  whole block and its attention core. Theory: everything in a block is token-wise but attention, and the core saves
  only its local q, k, v, output and log-sum-exp, so a rank saves 1/cp of what cp=1 saves;
- bytes: the accounting layer's wire bytes (`lit_lm.strategies.comm`) of one forward and backward of the block, i.e. per
  layer and step, beside `lit_lm.strategies.cp.comm_theory`. A model of L layers sends L times that per step.
- with `--cap-mib`: the longest sequence (doubling from the first of `--seq-lens`) whose training step of a 2-layer
  model stays under the cap per rank, measured as the rise of each process's peak RSS (own processes per cp).

    python scripts/bench_cp.py --overlap --cps 2 4 --rounds 5 --out runs/bench_cp_overlap.json

`--overlap`: how much of the attention's communication hides behind its compute. One contender per (method, cp),
each in its own fresh processes, alternated over >= 5 rounds in an order shuffled per round
(`scripts/bench_runner.py`; median with min-max, load average recorded). A contender times forward + backward of
the attention op alone (`--overlap-seq-len` tokens, `--overlap-heads` / `--overlap-kv-heads` of `--overlap-head-dim`)
in three variants, interleaved step by step in a seeded shuffled order so that all three see the same load:
- `overlap`: the engine as it is (the ring issues the next block's send/receive, attends, then waits);
- `serial`: every ring pass waits right after it is issued (nothing to overlap). The all-gather's collectives
  block already, so for it `serial` is the same code as `overlap`: their difference is the noise floor;
- `nocomm`: the ring passes and the collectives are no-ops that zero-fill their outputs (same shapes; the result
  is wrong, only the time matters).
A step's time is the slowest rank's; per variant the median over the `--steps` cycles. Hidden fraction of the
communication: (serial - overlap) / (serial - nocomm), each difference the median over the cycles of the difference
within a cycle: 1 fully hidden, 0 fully exposed. The swaps are made here, on `lit_lm.strategies.cp`'s `_ring_pass` and
`comm` (`variant`): the engine has no benchmark switch.

    python scripts/bench_cp.py --step --step-seq-lens 8192 16384 32768 --cp 4 --steps 2 --warmup 1 --rounds 5 \
        --lock /tmp/heavy.lock --out docs/benchmarks/2026-12-cp-documents-cpu.json

`--step`: a training step (forward + backward, `lit_lm.strategies.cp.context_loss`) of a small model (`--step-*`)
at cp ranks, per method, with the rows packed with documents (the standard library's .py files,
`bench_document_mask.stdlib_documents`, one row) and without: step time (the slowest rank's, median over
`--steps` after `--warmup`) and the wire bytes a rank sends per step (the accounting layer, the loss's all-reduce
left out). Each (method, T, documents) is a contender in its own processes, alternated over shuffled rounds; with
`--lock` each round holds that flock (other work runs between rounds, never beside a contender). Beside the times,
the pairs the tiles compute (`cp_document_tiles.count`: counted from the plans, not timed) give the fraction of
attention work documents skip, to read the measured gain against.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_document_mask import stdlib_documents  # noqa: E402
from bench_runner import MARK, paired, run_rounds, summarize, write_json  # noqa: E402
from machine import machine  # noqa: E402
from lit_lm.config import ModelConfig  # noqa: E402
from lit_lm.model import Transformer  # noqa: E402
from lit_lm.strategies import comm  # noqa: E402
from lit_lm.strategies import cp as context  # noqa: E402
from lit_lm.strategies.comm import COMM_LOG  # noqa: E402
from lit_lm.strategies.cp import (HYBRID, METHODS, check_seq_len, comm_theory, context_attention,  # noqa: E402
                                  context_loss, model_ulysses_size, parallelize_context, saved_bytes_theory,
                                  zigzag_batch, zigzag_positions)
from lit_lm.strategies.cp_balance import DocumentBalancer  # noqa: E402
from lit_lm.strategies.tp_layers import SavedActivations  # noqa: E402


def _measure(args: argparse.Namespace, method: str, seq_len: int) -> dict[str, Any]:
    """This rank's saved bytes (block, attention core) and wire bytes (forward, backward) of one block."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    config = ModelConfig(vocab_size=256, d_model=args.d_model, n_layers=1, n_heads=args.heads,
                         n_kv_heads=args.kv_heads, max_seq_len=seq_len)
    torch.manual_seed(0)
    model = Transformer(config)
    parallelize_context(model, None, method)
    block = model.blocks["0"]
    positions = zigzag_positions(seq_len, rank, cp)
    x = torch.randn(args.batch, seq_len // cp, args.d_model, requires_grad=True)
    with SavedActivations(block.attn) as attn_saved:
        block(x, positions)
    with SavedActivations(block) as block_saved:
        COMM_LOG.reset()
        y = block(x, positions)
        forward = COMM_LOG.summary()
    COMM_LOG.reset()
    y.sum().backward()
    backward = COMM_LOG.summary()
    kv_numel = 2 * args.batch * args.kv_heads * (seq_len // cp) * config.head_dim
    # Ulysses' ranks: all cp of them, the hybrid's u (the default `parallelize_context` took), none for the others
    u = {"ulysses": cp, HYBRID: model_ulysses_size(model, cp)}.get(method, 1)
    return {"method": method, "seq_len": seq_len, "cp": cp,
            "block_saved": sum(block_saved.bytes.values()), "core_saved": attn_saved.bytes["core"],
            "wire_forward": sum(s["wire_bytes"] for s in forward.values()),
            "wire_backward": sum(s["wire_bytes"] for s in backward.values()),
            "core_saved_theory": saved_bytes_theory(args.batch, args.heads, args.kv_heads, config.head_dim,
                                                    seq_len // cp, 4),
            "theory": comm_theory(method, cp, kv_numel, 4, args.batch * args.heads * (seq_len // cp) * config.head_dim,
                                  max(1, u // args.kv_heads), ulysses=u)}


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _longest(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Training steps of a 2-layer model (ring attention) at doubling T until the step's peak memory (the rise of
    this process's peak RSS over its level before the first step, the max over the cp ranks) passes the cap."""
    config = ModelConfig(vocab_size=256, d_model=args.d_model, n_layers=2, n_heads=args.heads,
                         n_kv_heads=args.kv_heads, max_seq_len=args.max_seq)
    torch.manual_seed(0)
    model = Transformer(config)
    parallelize_context(model, None, "ring")
    base = _peak_rss_mib()
    rows, seq_len = [], args.seq_lens[0]
    while seq_len <= args.max_seq:
        tokens = torch.randint(0, 256, (args.batch, seq_len + 1))
        x, y, positions, weight = zigzag_batch(tokens[:, :-1], tokens[:, 1:])
        (model.loss(x, y, positions)[0] * weight).backward()
        model.zero_grad(set_to_none=True)
        used = torch.tensor(_peak_rss_mib() - base)
        dist.all_reduce(used, op=dist.ReduceOp.MAX)
        rows.append({"cp": dist.get_world_size(), "seq_len": seq_len, "peak_mib": float(used)})
        if used > args.cap_mib:
            break
        seq_len *= 2
    return rows


def _worker(rank: int, args: argparse.Namespace, cp: int, port: int, out: str, longest: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    try:
        rows = _longest(args) if longest else [_measure(args, method, t) for t in args.seq_lens for method in METHODS]
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


# -- overlap: the attention step with its communication, serialised, and without --------------------------------
VARIANTS = ("overlap", "serial", "nocomm")
_RING_PASS = context._ring_pass


def _serial_pass(t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, list]:
    """A ring pass that waits right after it is issued: the attention of the block in hand cannot hide it."""
    received, works = _RING_PASS(t, group)
    for work in works:
        work.wait()
    return received, []


def _no_pass(t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, list]:
    return torch.zeros_like(t), []


def _no_collective(output: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    output.zero_()


NO_COLLECTIVES = SimpleNamespace(**{**vars(comm), "all_gather": _no_collective, "reduce_scatter": _no_collective,
                                    "all_to_all": _no_collective})


@contextmanager
def variant(name: str) -> Iterator[None]:
    """`lit_lm.strategies.cp` with its communication as it is, serialised, or replaced by no-ops (module docstring)."""
    saved = context._ring_pass, context.comm
    if name == "serial":
        context._ring_pass = _serial_pass
    elif name == "nocomm":
        context._ring_pass, context.comm = _no_pass, NO_COLLECTIVES
    try:
        yield
    finally:
        context._ring_pass, context.comm = saved


def _time_variants(args: argparse.Namespace, method: str) -> dict[str, float]:
    """Median step time (forward + backward of the attention op, slowest rank) of each variant, and the hidden
    fraction. The variants alternate step by step, in an order shuffled per cycle (the same on every rank)."""
    cp = dist.get_world_size()
    torch.manual_seed(dist.get_rank())
    local, d = args.overlap_seq_len // cp, args.overlap_head_dim
    q = torch.randn(1, args.overlap_heads, local, d, requires_grad=True)
    k, v = (torch.randn(1, args.overlap_kv_heads, local, d, requires_grad=True) for _ in range(2))
    grad = torch.randn_like(q)
    order, times = random.Random(0), {name: [] for name in VARIANTS}
    for cycle in range(args.warmup + args.steps):
        names = list(VARIANTS)
        order.shuffle(names)
        for name in names:
            with variant(name):
                dist.barrier()
                start = time.perf_counter()
                context_attention(q, k, v, None, method).backward(grad)
                elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            q.grad = k.grad = v.grad = None
            if cycle >= args.warmup:
                times[name].append(float(elapsed))
    step = {name: statistics.median(t) for name, t in times.items()}
    # differences paired within a cycle (its variants ran back to back, so a drift of the load cancels)
    comm_s = statistics.median(s - n for s, n in zip(times["serial"], times["nocomm"]))
    saved_s = statistics.median(s - o for s, o in zip(times["serial"], times["overlap"]))
    return {"overlap_s": step["overlap"], "serial_s": step["serial"], "nocomm_s": step["nocomm"], "comm_s": comm_s,
            "saved_s": saved_s, "hidden": saved_s / comm_s if comm_s else 0.0}


def _overlap_worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.cp)
    try:
        metrics = _time_variants(args, args.one)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(MARK + json.dumps(metrics), flush=True)


def overlap_contenders(args: argparse.Namespace) -> dict[str, list[str]]:
    """{"METHOD cpN": command} for every method and every cp > 1 of `--cps`."""
    shape = ["--overlap-seq-len", str(args.overlap_seq_len), "--overlap-heads", str(args.overlap_heads),
             "--overlap-kv-heads", str(args.overlap_kv_heads), "--overlap-head-dim", str(args.overlap_head_dim),
             "--steps", str(args.steps), "--warmup", str(args.warmup)]
    return {f"{method} cp{cp}": [sys.executable, __file__, "--one", method, "--cp", str(cp), *shape]
            for method in METHODS for cp in args.cps if cp > 1}


def _spread(t: dict[str, float], scale: float = 1e3, fmt: str = ".1f") -> str:
    return f"{t['median'] * scale:{fmt}} ({t['min'] * scale:{fmt}}–{t['max'] * scale:{fmt}})"


def overlap_table(run: dict[str, Any]) -> str:
    """The overlap run (its `--out` JSON) as Markdown: step times in ms and the hidden fraction, median (min–max)."""
    a, load = run["args"], run["load_1min"]
    out = [f"Attention op alone, forward + backward: T = {a['overlap_seq_len']}, {a['overlap_heads']} query / "
           f"{a['overlap_kv_heads']} kv heads of {a['overlap_head_dim']}, batch 1, fp32, gloo; ms per step, median "
           f"(min–max) over {a['rounds']} rounds", "",
           "| method | cp | with communication | serialised | communication a no-op | serial − no-op "
           "| serial − with | hidden |", "|---|---|---|---|---|---|---|---|"]
    for name, t in sorted(run["summary"].items()):
        method, cp = name.split(" cp")
        out.append(f"| {method} | {cp} | {_spread(t['overlap_s'])} | {_spread(t['serial_s'])} | "
                   f"{_spread(t['nocomm_s'])} | {_spread(t['comm_s'])} | {_spread(t['saved_s'])} | "
                   f"{_spread(t['hidden'], 100, '.0f')} % |")
    out.append(f"\nLoad average (1 min) before the runs: {load['min']:.1f}–{load['max']:.1f} (median "
               f"{load['median']:.1f}) on {run['cpus']} CPUs.")
    return "\n".join(out)


# -- step: a training step per method, with packed documents and without --------------------------------------
def _step_model(args: argparse.Namespace, seq_len: int) -> Transformer:
    config = ModelConfig(vocab_size=256, d_model=args.step_d_model, n_layers=args.step_layers,
                         n_heads=args.step_heads, n_kv_heads=args.step_kv_heads, max_seq_len=seq_len)
    torch.manual_seed(0)
    return Transformer(config)


def _step_worker(rank: int, args: argparse.Namespace, port: int) -> None:
    """One contender: `--warmup` + `--steps` training steps of `--one-step` at `--cp` ranks; rank 0 prints the
    slowest rank's median step time and the wire bytes a rank sends per step (the loss's all-reduce left out)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.cp)
    try:
        seq_len = args.step_seq_len
        model = _step_model(args, seq_len)
        if args.one_step == "ulysses+ring":  # u Ulysses ranks inside, the ring across (u = cp would be Ulysses)
            hybrid = context.hybrid_groups([list(range(args.cp))], args.ulysses_size)
            parallelize_context(model, None, args.one_step, hybrid=hybrid)
        else:
            parallelize_context(model, None, args.one_step)
        tokens = torch.randint(0, 256, (1, seq_len + 1), generator=torch.Generator().manual_seed(1))
        documents = stdlib_documents(seq_len) if args.documents else None
        balancer = DocumentBalancer(args.cp) if args.balance else None
        loss_fn = context_loss(model, None, balancer)
        times, wire = [], 0.0
        for step in range(args.warmup + args.steps):
            dist.barrier()
            COMM_LOG.reset()
            start = time.perf_counter()
            if balancer is not None:  # the strategy plans it from the batch on the host, inside its step
                balancer.plan(documents)
            loss = loss_fn(tokens[:, :-1], tokens[:, 1:], documents=documents)[0] if documents is not None else \
                loss_fn(tokens[:, :-1], tokens[:, 1:])[0]
            loss.backward()
            elapsed = torch.tensor(time.perf_counter() - start)
            wire = sum(r.wire_bytes for r in COMM_LOG.records if r.label != "cp loss")
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            model.zero_grad(set_to_none=True)
            if step >= args.warmup:
                times.append(float(elapsed))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(MARK + json.dumps({"step_s": statistics.median(times), "wire_mib": wire / 2**20}), flush=True)


BALANCED = ("ring", "allgather")  # the methods whose work the split decides (Ulysses attends the whole sequence)


def step_contenders(args: argparse.Namespace) -> dict[str, list[str]]:
    """{"METHOD T docs|plain|balanced": command}: every method with documents at every T of `--step-seq-lens`,
    unmasked at those of `--plain-seq-lens`, and with `--balanced` ring and all-gather on the document-aware split."""
    shape = ["--cp", str(args.cp), "--steps", str(args.steps), "--warmup", str(args.warmup),
             "--step-d-model", str(args.step_d_model), "--step-layers", str(args.step_layers),
             "--step-heads", str(args.step_heads), "--step-kv-heads", str(args.step_kv_heads),
             "--ulysses-size", str(args.ulysses_size)]
    kinds = {"plain": [], "docs": ["--documents"], "balanced": ["--documents", "--balance"]}
    out = {}
    for method in args.methods:
        for t in sorted({*args.step_seq_lens, *args.plain_seq_lens}):
            for kind, flags in kinds.items():
                wanted = t in args.plain_seq_lens if kind == "plain" else t in args.step_seq_lens and (
                    kind == "docs" or (args.balanced and method in BALANCED))
                if wanted:
                    out[f"{method} {t} {kind}"] = [sys.executable, __file__, "--one-step", method, "--step-seq-len",
                                                   str(t), *shape, *flags]
    return out


def step_tiles(seq_lens: list[int], cp: int) -> dict[str, dict[str, float]]:
    """Per T, from the tile plans (`cp_document_tiles.count`): the busiest rank's pairs with documents against
    without (ring and all-gather), Ulysses' likewise, and what the mask allows."""
    from cp_document_tiles import count

    out = {}
    for t in seq_lens:
        ids = stdlib_documents(t)
        r = count(ids, cp)
        out[str(t)] = {"documents": int(ids.max()) + 1, "allowed": r["allowed"] / r["causal"],
                       "ring_allgather": r["doc_max"] / r["plain_max"], "ulysses": r["ulysses"] / r["ulysses_plain"],
                       "max_over_mean": r["doc_max"] / r["doc_mean"]}
    return out


def step_table(run: dict[str, Any]) -> str:
    """The step run (its `--out` JSON) as Markdown: per (T, method) step time and bytes unmasked, masked and on the
    balanced split, median (min-max) over the rounds; the masked/unmasked ratio paired within rounds, beside the
    tiles' ratio."""
    a, table, tiles = run["args"], run["summary"], run["tiles"]
    out = [f"Training step (forward + backward) of a {a['step_layers']}-layer model, d_model {a['step_d_model']}, "
           f"{a['step_heads']} query / {a['step_kv_heads']} kv heads, batch 1, fp32, PyTorch tiles, cp {a['cp']} gloo "
           f"ranks (ulysses+ring: {a['ulysses_size']} Ulysses x {a['cp'] // a['ulysses_size']} ring); s per step, "
           f"median (min-max) over {a['rounds']} rounds; MiB a rank sends per step", "",
           "| T | method | unmasked s | masked s | masked / unmasked (paired) | tiles masked / unmasked | "
           "masked, balanced split s | MiB sent |", "|---|---|---|---|---|---|---|---|"]
    for t in sorted({*a["step_seq_lens"], *a["plain_seq_lens"]}):
        for method in a["methods"]:
            plain, docs = table.get(f"{method} {t} plain"), table.get(f"{method} {t} docs")
            balanced = table.get(f"{method} {t} balanced")
            ratio = run["paired"].get(f"{method} {t}")
            share = tiles[str(t)]["ulysses" if method == "ulysses" else "ring_allgather"] if str(t) in tiles else None
            sent = (docs or plain)["wire_mib"]["median"]
            cells = [_spread(x["step_s"], 1, ".2f") if x else "-" for x in (plain, docs)]
            out.append(f"| {t} | {method} | {cells[0]} | {cells[1]} | "
                       f"{_spread(ratio, 100, '.0f') + ' %' if ratio else '-'} | "
                       f"{f'{share:.0%}' if share is not None and method in BALANCED + ('ulysses',) else '-'} | "
                       f"{_spread(balanced['step_s'], 1, '.2f') if balanced else '-'} | {sent:.2f} |")
    out.append("\nDocuments (stdlib .py files, one row), from the tile plans: " + "; ".join(
        f"T {t}: {v['documents']} documents, the mask allows {v['allowed']:.0%} of causal pairs, the busiest rank "
        f"{v['max_over_mean']:.2f}x the mean" for t, v in tiles.items()))
    load = run["load_1min"]
    out.append(f"\nLoad average (1 min) at each run's start: {load['min']:.1f}-{load['max']:.1f} (median "
               f"{load['median']:.1f}) on {run['cpus']} CPUs.")
    return "\n".join(out)


def step_rounds(args: argparse.Namespace) -> None:
    rounds = run_rounds(step_contenders(args), args.rounds, args.seed, round_lock=args.lock)
    pairs = {f"{method} {t}": paired(rounds, f"{method} {t} docs", f"{method} {t} plain", "step_s")
             for method in args.methods for t in set(args.step_seq_lens) & set(args.plain_seq_lens)}
    write_json(args.out, rounds, summarize(rounds), args=vars(args), paired=pairs,
               tiles=step_tiles(args.step_seq_lens, args.cp))
    print(step_table(json.loads(Path(args.out).read_text())))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f}"


def tables(rows: list[dict[str, Any]]) -> str:
    """Markdown tables, one row per (T, cp): saved bytes (both methods) and wire bytes, measured (theory)."""
    by = {(r["seq_len"], r["cp"], r["method"]): r for r in rows}
    keys = sorted({(r["seq_len"], r["cp"]) for r in rows})
    out = ["Saved activations per rank, one block, MiB: measured for ring / allgather (theory: cp=1 / cp, as all but",
           "attention is token-wise); the attention core's (theory: local q, k, v, out + fp32 lse)", "",
           "| T | cp | block ring / allgather | theory | attention core | theory |", "|---|---|---|---|---|---|"]
    for t, cp in keys:
        ring, gather = by[t, cp, "ring"], by[t, cp, "allgather"]
        base = by.get((t, 1, "ring"))
        theory = _mib(base["block_saved"] / cp) if base else "-"
        out.append(f"| {t} | {cp} | {_mib(ring['block_saved'])} / {_mib(gather['block_saved'])} | {theory} | "
                   f"{_mib(ring['core_saved'])} | {_mib(ring['core_saved_theory'])} |")
    out += ["", "Wire bytes per rank for one layer's forward + backward, MiB: measured (theory); a model of L "
            "layers sends L times this per step", "",
            "| T | cp | ring forward | ring backward | allgather forward | allgather backward |",
            "|---|---|---|---|---|---|"]
    for t, cp in keys:
        cells = [f"{_mib(r[f'wire_{d}'])} ({_mib(r['theory'][d])})" for r in (by[t, cp, "ring"],
                                                                            by[t, cp, "allgather"])
                 for d in ("forward", "backward")]
        out.append(f"| {t} | {cp} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def longest_table(rows: list[dict[str, Any]], cap_mib: float) -> str:
    out = [f"\nPeak memory of a training step per rank (2 layers, ring; MiB above the process's level before it) and "
           f"the longest sequence under {cap_mib:g} MiB", "", "| cp | T: peak MiB | longest T under the cap |",
           "|---|---|---|"]
    for cp in sorted({r["cp"] for r in rows}):
        mine = [r for r in rows if r["cp"] == cp]
        fit = [r["seq_len"] for r in mine if r["peak_mib"] <= cap_mib]
        steps = ", ".join(f"{r['seq_len']}: {r['peak_mib']:.0f}" for r in mine)
        out.append(f"| {cp} | {steps} | {max(fit) if fit else '-'} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--cap-mib", type=float, default=0.0,
                        help="also find the longest sequence (doubling from the first --seq-lens) whose training step "
                             "stays under this many MiB per rank; 0: skip")
    parser.add_argument("--max-seq", type=int, default=32768)
    parser.add_argument("--json", type=str, default=None)
    overlap = parser.add_argument_group("overlap (see the module docstring)")
    overlap.add_argument("--overlap", action="store_true", help="measure the hidden communication instead, for each "
                         "method and each cp > 1 of --cps, over --rounds alternated rounds")
    overlap.add_argument("--overlap-seq-len", type=int, default=512)
    overlap.add_argument("--overlap-heads", type=int, default=4)
    overlap.add_argument("--overlap-kv-heads", type=int, default=4)
    overlap.add_argument("--overlap-head-dim", type=int, default=128)
    overlap.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    overlap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    overlap.add_argument("--rounds", type=int, default=5)
    overlap.add_argument("--seed", type=int, default=0)
    overlap.add_argument("--out", default="runs/bench_cp_overlap.json")
    overlap.add_argument("--one", choices=METHODS, help="one contender (what the rounds run): time it at --cp ranks")
    overlap.add_argument("--cp", type=int, default=2)
    overlap.add_argument("--table", help="print a saved overlap run (its --out JSON) as Markdown, and exit")
    step = parser.add_argument_group("step (see the module docstring)")
    step.add_argument("--step", action="store_true", help="time a training step per method, masked and unmasked")
    step.add_argument("--step-seq-lens", type=int, nargs="+", default=[8192, 16384, 32768], help="with documents")
    step.add_argument("--plain-seq-lens", type=int, nargs="*", default=[8192], help="unmasked too")
    step.add_argument("--balanced", action="store_true", help="also ring and all-gather on the document-aware split")
    step.add_argument("--ulysses-size", type=int, default=2, help="ulysses+ring's Ulysses ranks")
    step.add_argument("--balance", action="store_true", help="the contender's split balanced by documents")
    step.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    step.add_argument("--step-d-model", type=int, default=32)
    step.add_argument("--step-layers", type=int, default=1)
    step.add_argument("--step-heads", type=int, default=4)
    step.add_argument("--step-kv-heads", type=int, default=2)
    step.add_argument("--one-step", choices=METHODS, help="one contender: time it at --cp ranks, --step-seq-len")
    step.add_argument("--step-seq-len", type=int, default=8192)
    step.add_argument("--documents", action="store_true", help="the contender's rows packed with stdlib files")
    step.add_argument("--lock", help="hold this file's flock for each round (released between rounds)")
    step.add_argument("--step-table", help="print a saved step run (its --out JSON) as Markdown, and exit")
    args = parser.parse_args()
    for saved, table in ((args.table, overlap_table), (args.step_table, step_table)):
        if saved:
            print(table(json.loads(Path(saved).read_text())))
            return
    for one, worker, seq_len in ((args.one_step, _step_worker, args.step_seq_len),
                                 (args.one, _overlap_worker, args.overlap_seq_len)):
        if one:  # one contender: its cp ranks, here
            check_seq_len(seq_len, args.cp)
            mp.spawn(worker, args=(args, _free_port()), nprocs=args.cp, join=True)
            return
    if args.step:
        step_rounds(args)
        return
    if args.overlap:
        rounds = run_rounds(overlap_contenders(args), args.rounds, args.seed)
        write_json(args.out, rounds, summarize(rounds), args=vars(args))
        print(overlap_table(json.loads(Path(args.out).read_text())))
        return
    rows: list[dict[str, Any]] = []
    longest: list[dict[str, Any]] = []
    for cp, search in itertools.product(args.cps, (False, True) if args.cap_mib else (False,)):
        with tempfile.TemporaryDirectory() as tmp:  # own processes: the longest-sequence search reads peak RSS
            out = str(Path(tmp) / "rows.json")
            mp.spawn(_worker, args=(args, cp, _free_port(), out, search), nprocs=cp, join=True)
            (longest if search else rows).extend(json.loads(Path(out).read_text()))

    print(tables(rows))
    if longest:
        print(longest_table(longest, args.cap_mib))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": machine(), "args": vars(args), "rows": rows,
                                               "longest": longest}, indent=1))


if __name__ == "__main__":
    main()
