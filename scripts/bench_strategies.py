"""Benchmark the parallel strategies on one model: Lightning's `ddp`, our `lm_ddp`, `zero1`, `zero2`, `zero3`, torch
FSDP2 (`fully_shard` through Lightning's ModelParallelStrategy) as the reference, and tensor parallelism over all
the devices (`tp`, and `tp_sp` with sequence parallelism).

    python scripts/bench_strategies.py                     # CPU/gloo, 2 processes, 5 rounds
    python scripts/bench_strategies.py --devices 4 --d-model 512 --n-layers 8   # GPUs/nccl when available
    python scripts/bench_strategies.py --one zero2         # one contender once (what the rounds run)
    python scripts/bench_strategies.py --devices 4 --strategies tp2_pp2 zero3_tp2 hsdp_zero3 zero1_dp2_pp2
    python scripts/bench_strategies.py --devices 8 --strategies 3d --n-heads 8   # dp2 x tp2 x pp2, ZeRO-1 (the
                                                           # activation table splits the heads over all 8 ranks)
    python scripts/bench_strategies.py --table runs/bench_strategies.json   # a saved run as a Markdown table
                                                                              (docs/benchmarks/)

Fairness (`scripts/bench_runner.py`): every strategy runs in its own fresh processes (`--one NAME`), alternated
with the others over `--rounds` rounds (>= 5) in an order shuffled per round; tokens/s is the median over rounds of
each run's median steady step, shown with its min-max; the load average before each run is recorded.

Per strategy: tokens/s and the ratio of its median to Lightning ddp's, model-state bytes per rank (params + grads
+ optimizer state, walked just before the last update) against theory, and the bytes each rank sent per step as
the accounting layer (`lit_lm.strategies.comm`) recorded them, against theory (ddp and FSDP2 do not go through it: "-").
Then the activation memory of one block under tp=1, tp=N and tp=N with SP: the bytes autograd saves in its
forward (`lit_lm.strategies.tp_layers.SavedActivations`), norms and regions apart, against theory. Then the MoE rows
(`bench_moe.py`): an MoE model vs a dense one with the same active parameters, and the bytes of the expert-parallel
all-to-alls vs theory. Prints the tables and writes JSON (every round's raw numbers included).

The composed layouts (`COMPOSED`: tp x pp, ZeRO-3 x tp, HSDP, ZeRO-1 dp x pp, dp x tp x pp) each run on exactly
their world size. Their theory is the planner's estimator (`lit_lm.planner.estimate.estimate`, the one place that knows
what a layout allocates and sends): every rank's model-state bytes and sent bytes, in all and per group (tp, pp,
dp_shard, dp_replicate, ...), beside the estimate for its pipeline stage; the table gives the largest over the
ranks and the run names every rank and figure that differ.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning as L
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runner import MARK, run_rounds, summarize, write_json  # noqa: E402
from machine import describe  # noqa: E402
from lit_lm.config import ModelConfig  # noqa: E402
from lit_lm.planner.estimate import Workload, estimate, rope_table_bytes  # noqa: E402
from lit_lm.model import Transformer  # noqa: E402
from lit_lm.strategies.comm import COMM_LOG, wire_factor  # noqa: E402
from lit_lm.strategies.composed import ComposedStrategy  # noqa: E402
from lit_lm.strategies.ddp import DataParallelStrategy  # noqa: E402
from lit_lm.strategies.layout import ParallelConfig, rank_grid  # noqa: E402
from lit_lm.strategies.tp import TensorParallelStrategy  # noqa: E402
from lit_lm.strategies.tp_layers import SavedActivations, TPGroup, parallelize_model  # noqa: E402
from lit_lm.strategies.zero import ZeroStrategy  # noqa: E402
from lit_lm.strategies.zero_engine import model_state_bytes  # noqa: E402

STRATEGIES = ["ddp", "lm_ddp", "zero1", "zero2", "zero3", "fsdp2", "tp", "tp_sp"]
# N-D layouts of `ComposedStrategy`, each run on exactly its world size (`--devices`): the strategy is built from
# one ParallelConfig (the strategy's arguments: `strategy_args()`), so the run and its theory describe the same layout
COMPOSED = {
    "tp2_pp2": ParallelConfig(tp=2, pp=2, microbatches=2),
    "zero3_tp2": ParallelConfig(dp_shard=2, zero_stage=3, tp=2),
    "hsdp_zero3": ParallelConfig(dp_replicate=2, dp_shard=2, zero_stage=3),
    "zero1_dp2_pp2": ParallelConfig(dp_shard=2, zero_stage=1, pp=2, microbatches=2),
    "3d": ParallelConfig(dp_shard=2, zero_stage=1, tp=2, pp=2, microbatches=2),
}


def tp_local_params(config: ModelConfig, n: int, sp: bool) -> int:
    """Parameters on tp rank 0 of n (split weights 1/n, the vocabulary's first chunk, replicated norms whole)."""
    model = Transformer(config)
    parallelize_model(model, model.tensor_parallel_plan(), TPGroup(None, n, 0, sp))
    return sum(p.numel() for p in model.parameters())


def theory(name: str, config: ModelConfig, n: int, tokens: int) -> tuple[float, float]:
    """(model-state bytes per rank, wire bytes per rank per step) for fp32 Adam (see lit_lm/strategies/zero_engine.py
    and lit_lm/strategies/tp_layers.py)."""
    phi = config.num_params()
    if name.startswith("tp"):  # tp over all n ranks: every rank sees the whole batch; per step (4L + 2)
        # activation all-reduces of tokens x d (or as many all-gather + reduce-scatter pairs under SP), the loss's
        # 3 values per token, and under SP the norms' partial gradients
        sp = name == "tp_sp"
        elements = (4 * config.n_layers + 2) * tokens * config.d_model + 3 * tokens
        elements += (2 * config.n_layers + 1) * config.d_model if sp else 0
        return 16 * tp_local_params(config, n, sp), 2 * (n - 1) / n * elements * 4
    memory = {"ddp": 16, "lm_ddp": 16, "zero1": 8 + 8 / n, "zero2": 4 + 12 / n, "zero3": 16 / n, "fsdp2": 16 / n}
    gathers = 3 if name in ("zero3", "fsdp2") else 2  # all-reduce = reduce-scatter + all-gather
    return memory[name] * phi, gathers * (n - 1) / n * phi * 4


class BenchLM(L.LightningModule):
    """`zero_redundancy`: AdamW inside torch's `ZeroRedundancyOptimizer` (optimizer state sharded over the ranks;
    with Lightning's `ddp`, the reference for ZeRO-1/2)."""

    def __init__(self, config: ModelConfig, fsdp2: bool, adamw: Optional[dict[str, Any]] = None,
                 zero_redundancy: bool = False) -> None:
        super().__init__()
        self.config, self.fsdp2, self.adamw, self.zero_redundancy = config, fsdp2, adamw or {}, zero_redundancy
        self.model: Transformer | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = Transformer(self.config)
        if self.fsdp2:  # the same units as zero3: each block, then the rest
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks.values():
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens = batch[0]
        return self.model.loss(tokens[:, :-1], tokens[:, 1:])[0]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.zero_redundancy:
            return ZeroRedundancyOptimizer(self.parameters(), torch.optim.AdamW, lr=1e-4, **self.adamw)
        return torch.optim.AdamW(self.parameters(), lr=1e-4, **self.adamw)


class Probe(L.Callback):
    """Step wall time, bytes sent through the accounting layer, and model-state bytes before the last update."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times, self.wire, self.memory = device, [], [], {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def on_train_batch_start(self, *args: Any) -> None:
        self._sync()
        COMM_LOG.reset()
        self.t0 = time.perf_counter()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.memory = model_state_bytes(pl_module, getattr(optimizer, "_optimizer", optimizer))

    def on_train_batch_end(self, *args: Any) -> None:
        self._sync()
        self.times.append(time.perf_counter() - self.t0)
        self.wire.append(sum(op["wire_bytes"] for op in COMM_LOG.summary().values()))


class LayoutProbe(Probe):
    """Probe, plus what the estimator predicts per rank: every rank's model state and its last step's collectives
    ({"group/op": logical bytes}, Lightning's metric sync left out), with its pipeline stage, gathered to every rank
    at the end of training (the process group still lives)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.ranks: list[dict[str, Any]] = []

    def on_train_batch_end(self, *args: Any) -> None:
        super().on_train_batch_end(*args)
        self.comm: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        for r in COMM_LOG.records:
            if r.label != "strategy.reduce":
                self.comm[f"{r.group}/{r.op}"] = self.comm.get(f"{r.group}/{r.op}", 0) + r.nbytes
                self.sizes[r.group] = r.world

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        mine = {"pp_rank": trainer.strategy.layout.rank("pp"), "state": self.memory, "comm": self.comm,
                "sizes": self.sizes}
        self.ranks = [None] * trainer.world_size
        dist.all_gather_object(self.ranks, mine)


def data_rank(strategy: Any, n: int, rank: int) -> tuple[int, int]:
    """(this rank's index among the ranks that split the batch, their number): tp and pp peers read the same
    rows, so for our strategies it is the layout's dp group (`lit_lm/strategies/layout.py`); Lightning's ddp and FSDP2
    make every rank a replica."""
    if not isinstance(strategy, ComposedStrategy):
        return rank, n
    group = next(g for g in rank_grid(strategy.parallel_dims(n))["dp"] if rank in g)
    return group.index(rank), len(group)


def token_loader(args: argparse.Namespace, config: ModelConfig, dp_rank: int, dp: int) -> DataLoader:
    """`args.steps` batches of random tokens, (global batch / dp, seq_len + 1): replica `dp_rank`'s share of each
    global batch (seeded by it, so every contender reads the same rows)."""
    gen = torch.Generator().manual_seed(1000 + dp_rank)
    local = args.global_batch // dp
    tokens = torch.randint(0, config.vocab_size, (local * args.steps, args.seq_len + 1), generator=gen)
    return DataLoader(TensorDataset(tokens), batch_size=local)


def make_strategy(name: str, n: int) -> Any:
    if name in COMPOSED:
        return ComposedStrategy(**COMPOSED[name].strategy_args())
    return {"ddp": lambda: "ddp", "lm_ddp": DataParallelStrategy,
            "zero1": lambda: ZeroStrategy(stage=1), "zero2": lambda: ZeroStrategy(stage=2),
            "zero3": lambda: ZeroStrategy(stage=3),
            "fsdp2": lambda: ModelParallelStrategy(data_parallel_size=n, tensor_parallel_size=1),
            "tp": lambda: TensorParallelStrategy(n, sequence_parallel=False),
            "tp_sp": lambda: TensorParallelStrategy(n, sequence_parallel=True)}[name]()


def make_trainer(args: argparse.Namespace, accelerator: str, strategy: Any, callbacks: Sequence[L.Callback]
                 ) -> L.Trainer:
    """The benchmarks' Trainer: `args.steps` steps, nothing besides the step (no logger, bar, summary, checkpoint,
    sanity validation, sampler injection: each replica's loader is given)."""
    return L.Trainer(accelerator=accelerator, devices=args.devices, strategy=strategy, max_steps=args.steps,
                     callbacks=list(callbacks), logger=False, enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                     precision=args.precision)


def run_one(name: str, args: argparse.Namespace, config: ModelConfig, accelerator: str, strategy: Any = None,
            adamw: Optional[dict[str, Any]] = None, callbacks: Sequence[L.Callback] = (),
            zero_redundancy: bool = False) -> dict[str, Any]:
    """Fit `args.steps` steps under `strategy` (default: the contender `name`'s); median steady step and more."""
    rank, n = int(os.environ["LOCAL_RANK"]), args.devices
    strategy = strategy or make_strategy(name, n)
    loader = token_loader(args, config, *data_rank(strategy, n, rank))
    L.seed_everything(0, verbose=False)
    module = BenchLM(config, fsdp2=name == "fsdp2", adamw=adamw, zero_redundancy=zero_redundancy)
    device = torch.device("cuda", rank) if accelerator == "gpu" else torch.device("cpu")
    probe = LayoutProbe(device) if name in COMPOSED else Probe(device)
    trainer = make_trainer(args, accelerator, strategy, [probe, *callbacks])
    trainer.fit(module, loader)
    steady = probe.times[args.warmup:]
    out = {"step_s": statistics.median(steady), "steady_s": steady, "memory": probe.memory,
           "wire_bytes": statistics.median(probe.wire[args.warmup:]), "ranks": getattr(probe, "ranks", None)}
    del trainer, module
    gc.collect()
    return out


def block_activations(config: ModelConfig, args: argparse.Namespace, rank: int) -> dict[str, dict[str, int]]:
    """Bytes one block saves for backward on this rank (norms, regions) under tp=1, tp=N, and tp=N with SP, on
    the benchmark's global batch (what every tp rank sees), in fp32."""
    n, out = args.devices, {}
    for name, tp in (("tp=1", TPGroup(None, 1, 0)), (f"tp={n}", TPGroup(dist.group.WORLD, n, rank)),
                     (f"tp={n}+SP", TPGroup(dist.group.WORLD, n, rank, sequence_parallel=True))):
        model = Transformer(config)
        parallelize_model(model, model.tensor_parallel_plan(), tp)
        block = model.blocks[next(iter(model.blocks))]
        positions = args.seq_len // n if tp.sequence_parallel else args.seq_len
        x = torch.randn(args.global_batch, positions, config.d_model, requires_grad=True)
        with SavedActivations(block) as saved:
            block(x)
        out[name] = {"norms": saved.bytes.get("attn_norm", 0) + saved.bytes.get("mlp_norm", 0),
                     "regions": saved.bytes.get("attn", 0) + saved.bytes.get("mlp", 0)}
    return out


def print_activations(acts: dict[str, dict[str, int]], config: ModelConfig, args: argparse.Namespace) -> None:
    """Theory from the tp=1 measurement: the regions' inner activations split by heads / hidden features (1/N);
    their inputs, saved after the entry collective, stay whole (2 x B T d per block), as do the RoPE tables; the
    norms (and the residual stream they save) shrink by 1/N only under SP."""
    n, base = args.devices, acts["tp=1"]
    inputs = 2 * args.global_batch * args.seq_len * config.d_model * 4 + rope_table_bytes(config, args.seq_len)
    theory = {"tp=1": base, f"tp={n}": {"norms": base["norms"], "regions": (base["regions"] - inputs) / n + inputs},
              f"tp={n}+SP": {"norms": base["norms"] / n, "regions": (base["regions"] - inputs) / n + inputs}}
    print(f"\nsaved activations of one block per rank (fp32), B={args.global_batch} T={args.seq_len} "
          f"d={config.d_model}")
    print(f"{'layout':<8} {'norms MB':>9} {'theory':>8} {'regions MB':>11} {'theory':>8} {'total MB':>9} {'theory':>8}")
    for name, row in acts.items():
        t = theory[name]
        print(f"{name:<8} {row['norms'] / 1e6:>9.3f} {t['norms'] / 1e6:>8.3f} {row['regions'] / 1e6:>11.3f} "
              f"{t['regions'] / 1e6:>8.3f} {(row['norms'] + row['regions']) / 1e6:>9.3f} "
              f"{(t['norms'] + t['regions']) / 1e6:>8.3f}")


def _env(rank: int, args: argparse.Namespace, port: int, accelerator: str) -> ModelConfig:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(args.devices), NODE_RANK="0",
                      RANK=str(rank), LOCAL_RANK=str(rank))
    if accelerator == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    return model_config(args)


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab_size, d_model=args.d_model, n_layers=args.n_layers,
                       n_heads=args.n_heads, max_seq_len=args.seq_len)


def worker_one(rank: int, args: argparse.Namespace, port: int, accelerator: str) -> None:
    """One contender on `args.devices` processes; rank 0 prints its metrics for the runner."""
    config = _env(rank, args, port, accelerator)
    r = run_one(args.one, args, config, accelerator)
    if rank == 0:
        tokens = args.global_batch * args.seq_len
        measured = r["wire_bytes"] if args.one not in ("ddp", "fsdp2") else None  # outside the accounting layer
        ranks = {"ranks": r["ranks"]} if r["ranks"] else {}
        print(MARK + json.dumps({"tokens_per_s": tokens / r["step_s"], "state_bytes": r["memory"].get("total"),
                                 "wire_bytes_per_step": measured, **ranks}), flush=True)


def worker_activations(rank: int, args: argparse.Namespace, port: int, accelerator: str, out: str) -> None:
    config = _env(rank, args, port, accelerator)
    dist.init_process_group("nccl" if accelerator == "gpu" else "gloo")
    acts = block_activations(config, args, rank)
    dist.destroy_process_group()
    if rank == 0:
        print_activations(acts, config, args)
        Path(out).write_text(json.dumps(acts))


def _spawn(fn: Any, args: argparse.Namespace, *extra: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    # CPU: fork, so the ranks start with the interpreter and imports already loaded (a run's startup is then one
    # import, not 1 + devices); CUDA must not be forked after initialisation
    mp.start_processes(fn, args=(args, port, accelerator, *extra), nprocs=args.devices, join=True,
                       start_method="fork" if accelerator == "cpu" else "spawn")


FORWARDED = ["devices", "steps", "warmup", "global_batch", "seq_len", "vocab_size", "d_model", "n_layers", "n_heads",
             "precision"]


def print_table(table: dict[str, dict[str, Any]], args: argparse.Namespace, load: dict[str, float]) -> list[dict]:
    config, n = model_config(args), args.devices
    tokens = args.global_batch * args.seq_len
    base = table["ddp"]["tokens_per_s"]["median"] if "ddp" in table else None
    rows = []
    print(f"\n{n} x {'gpu' if torch.cuda.is_available() else 'cpu'}, Φ = {config.num_params():,} params, {tokens} "
          f"tokens/step, {args.precision}, {args.rounds} alternated rounds (shuffled), each the median of "
          f"{args.steps - args.warmup} steps; load average (1 min) {load['min']:.1f}-{load['max']:.1f} on "
          f"{os.cpu_count()} CPUs")
    print(f"{'strategy':<8} {'tokens/s median (min-max)':>26} {'vs ddp':>7} {'state MB':>9} {'theory':>8} "
          f"{'sent MB/step':>13} {'theory':>8}")
    for name in (s for s in args.strategies if s not in COMPOSED):
        t = table[name]
        speed = t["tokens_per_s"]
        mem_theory, wire_theory = theory(name, config, n, tokens)
        wire = t["wire_bytes_per_step"]
        sent = wire["median"] if isinstance(wire, dict) else None
        rows.append({"strategy": name, "tokens_per_s": speed, "vs_ddp": speed["median"] / base if base else None,
                     "state_bytes": t["state_bytes"]["median"], "state_bytes_theory": mem_theory,
                     "wire_bytes_per_step": sent, "wire_bytes_theory": wire_theory})
        ratio = "-" if base is None else f"{speed['median'] / base:.2f}x"
        spread = f"{speed['median']:.0f} ({speed['min']:.0f}-{speed['max']:.0f})"
        print(f"{name:<8} {spread:>26} {ratio:>7} {t['state_bytes']['median'] / 1e6:>9.2f} {mem_theory / 1e6:>8.2f} "
              f"{'-' if sent is None else f'{sent / 1e6:.3f}':>13} {wire_theory / 1e6:>8.3f}")
    return rows


def _wire(comm: dict[str, int], sizes: dict[str, int], group: str | None = None) -> float:
    """Bytes sent per step (ring algorithm) from {"group/op": logical bytes}, over one group or all."""
    return sum(nbytes * wire_factor(key.split("/")[1], sizes[key.split("/")[0]]) for key, nbytes in comm.items()
               if group in (None, key.split("/")[0]))


def composed_rows(table: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per composed layout: tokens/s, and per rank model-state bytes, sent bytes in all and per group, each beside
    the estimator's figure for that rank's pipeline stage (`lit_lm.planner.estimate`); the rows give the largest over
    the ranks, `differ` every rank and figure where measurement and estimate are not equal."""
    work = Workload(model_config(args), args.seq_len, args.global_batch, args.precision)
    rows = []
    for name in (s for s in args.strategies if s in COMPOSED):
        est = estimate(work, COMPOSED[name])
        ranks = table[name]["ranks"]  # the last round's (bytes do not vary between rounds)
        groups = sorted({k.split("/")[0] for r in ranks for k in r["comm"]} | set(est.groups))
        figures: dict[str, list[tuple[float, float]]] = {"state": [], "sent": [], **{g: [] for g in groups}}
        for r in ranks:
            theory = est.ranks[r["pp_rank"]]
            figures["state"].append((r["state"]["total"], theory.model_state))
            figures["sent"].append((_wire(r["comm"], r["sizes"]), theory.wire()))
            for g in groups:
                figures[g].append((_wire(r["comm"], r["sizes"], g), theory.wire(g)))
        differ = [f"rank {i} {key}: {m:.0f} vs {t:.0f}" for key, pairs in figures.items()
                  for i, (m, t) in enumerate(pairs) if round(m) != round(t)]
        rows.append({"strategy": name, "layout": COMPOSED[name].describe(), "tokens_per_s": table[name]["tokens_per_s"],
                     **{key: {"measured": max(m for m, _ in pairs), "theory": max(t for _, t in pairs)}
                        for key, pairs in figures.items()}, "groups": groups, "differ": differ})
    return rows


def composed_markdown(rows: list[dict[str, Any]]) -> str:
    """The composed rows as Markdown: MB, measured (estimator), the largest over the ranks."""
    def mb(fig: dict[str, float], digits: int = 3) -> str:
        return f"{fig['measured'] / 1e6:.{digits}f} ({fig['theory'] / 1e6:.{digits}f})"

    lines = ["| layout | tokens/s median (min–max) | model-state MB per rank (estimate) | sent MB/step per rank "
             "(estimate) | of which per group |", "|---|---|---|---|---|"]
    for row in rows:
        speed = row["tokens_per_s"]
        groups = ", ".join(f"{g} {mb(row[g])}" for g in row["groups"])
        lines.append(f"| `{row['strategy']}` ({row['layout']}) | {speed['median']:.0f} ({speed['min']:.0f}–"
                     f"{speed['max']:.0f}) | {mb(row['state'], 2)} | {mb(row['sent'])} | {groups} |")
    return "\n".join(lines)


LABELS = {"ddp": "Lightning `ddp` (reference)", "fsdp2": "torch FSDP2 `fully_shard` (reference)",
          "tp": "`tp` (tp=N)", "tp_sp": "`tp` (tp=N + SP)"}


def markdown(run: dict[str, Any]) -> str:
    """A saved run's table in Markdown (docs/benchmarks/), with the spread and the load average."""
    n = run["args"]["devices"]
    lines = ["| strategy | tokens/s median (min–max) | vs Lightning ddp | model-state MB per rank (theory) | "
             "sent MB/step, measured (theory) |", "|---|---|---|---|---|"]
    for row in run["rows"]:
        speed = row["tokens_per_s"]
        ratio = "–" if row["vs_ddp"] is None else f"{row['vs_ddp']:.2f}×"
        sent = "–" if row["wire_bytes_per_step"] is None else f"{row['wire_bytes_per_step'] / 1e6:.3f}"
        name = LABELS.get(row["strategy"], f"`{row['strategy']}`").replace("N", str(n))
        lines.append(f"| {name} | {speed['median']:.0f} ({speed['min']:.0f}–{speed['max']:.0f}) | {ratio} | "
                     f"{row['state_bytes'] / 1e6:.2f} ({row['state_bytes_theory'] / 1e6:.2f}) | {sent} "
                     f"({row['wire_bytes_theory'] / 1e6:.3f}) |")
    lines.append(f"\n{footer(run)}")
    return "\n".join(lines)


def footer(run: dict[str, Any]) -> str:
    """What a saved run's table needs beside it: the model size, the rounds, the machine and its load."""
    load = run["load_1min"]
    return (f"Φ = {run['phi']:,}, {len(run['rounds'])} rounds, load average (1 min) {load['min']:.1f}–"
            f"{load['max']:.1f} (median {load['median']:.1f}) on {describe(run.get('machine', {}))}.")


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The arguments every contender is forwarded (FORWARDED) plus the runner's rounds and seed."""
    p.add_argument("--devices", type=int, default=torch.cuda.device_count() if torch.cuda.is_available() else 2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0, help="of the per-round shuffles")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])


def forwarded(args: argparse.Namespace) -> list[str]:
    """The command-line flags that give a contender's process the same run."""
    return [item for key in FORWARDED for item in (f"--{key.replace('_', '-')}", str(getattr(args, key)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", nargs="+", default=STRATEGIES, choices=[*STRATEGIES, *COMPOSED],
                   help="contenders; a composed layout (%s) runs only on its world size" % ", ".join(COMPOSED))
    p.add_argument("--one", choices=[*STRATEGIES, *COMPOSED],
                   help="run this contender once and print its metrics (the runner's unit of work)")
    add_run_args(p)
    p.add_argument("--out", default="runs/bench_strategies.json")
    p.add_argument("--moe-steps", type=int, default=5, help="steps of the MoE rows (0 skips them)")
    p.add_argument("--table", help="print a saved run (its --out JSON) as a Markdown table, and exit")
    args = p.parse_args()
    if args.table:
        run = json.loads(Path(args.table).read_text())
        print("\n\n".join([*([markdown(run)] if run["rows"] else []),
                            *([composed_markdown(run["composed_rows"])] if run.get("composed_rows") else [])]))
        return
    if args.global_batch % args.devices:
        p.error(f"--global-batch {args.global_batch} must be divisible by --devices {args.devices}")
    for name in {args.one, *args.strategies} & set(COMPOSED):
        if COMPOSED[name].world != args.devices:
            p.error(f"{name} ({COMPOSED[name].describe()}) runs on {COMPOSED[name].world} ranks: use --devices "
                    f"{COMPOSED[name].world}, not {args.devices}")
    if args.one:
        _spawn(worker_one, args)
        return
    contenders = {name: [sys.executable, __file__, "--one", name, *forwarded(args)] for name in args.strategies}
    rounds = run_rounds(contenders, args.rounds, args.seed)
    table = summarize(rounds)
    loads = [m["load_1min"] for r in rounds for _, m in r]
    rows = print_table(table, args, {"min": min(loads), "max": max(loads)})
    composed = composed_rows(table, args)
    if composed:
        print("\ncomposed layouts (MB, measured (estimate), the largest over the ranks):")
        print(composed_markdown(composed))
        for row in composed:
            print(f"{row['strategy']}: " + ("every rank equals the estimate" if not row["differ"] else
                                           "differs from the estimate: " + "; ".join(row["differ"])))
    write_json(args.out, rounds, table, args=vars(args), phi=model_config(args).num_params(), rows=rows,
               composed_rows=composed)
    print(f"wrote {args.out}")
    acts_file = Path(args.out).with_suffix(".activations.json")
    _spawn(worker_activations, args, str(acts_file))
    out = Path(args.out)
    out.write_text(json.dumps({**json.loads(out.read_text()), "block_activation_bytes": json.loads(
        acts_file.read_text())}, indent=1))
    acts_file.unlink()
    if args.moe_steps:
        import bench_moe  # the MoE rows: same script directory

        print("\nMoE vs dense with the same active parameters, and the expert-parallel all-to-alls:")
        result = bench_moe.run(args.moe_steps, args.devices)
        bench_moe.print_report(result)
        out = Path(args.out)
        out.write_text(json.dumps({**json.loads(out.read_text()), "moe": result}, indent=1))


if __name__ == "__main__":
    main()
