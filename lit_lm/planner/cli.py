"""`lit-lm plan`: which layout to launch on a cluster, for the run the `--config` files describe.

    lit-lm plan --config configs/default.yaml --nodes 2 --gpus-per-node 8 --gpu-memory 80GB --out plan.yaml
    lit-lm fit --config configs/default.yaml --config plan.yaml

Reads the same yaml as `fit` (configs/default.yaml first, later files win): the model from
`model.init_args.config`, the sequence length, vocabulary and per-device batch from `data.init_args`, precision and
accumulation from `trainer`. The global batch defaults to what that per-device batch gives on every GPU of the
cluster (`--global-batch` to fix it); the plan keeps it and sets the per-device batch and accumulation to match.
Prints the fastest layouts that fit (`lit_lm.planner.plan`: only those the strategy runs) with the reason for each, and
writes the fastest as yaml. With context parallelism in the winner (or `--cp-methods`), a second table ranks ring,
all-gather, Ulysses and ulysses+ring at that layout's sizes per sequence length (`lit_lm.planner.cp_rank`). With
packed documents (`data.init_args.document_mask`) attention FLOPs are the mask's share of the causal ones and the
busiest cp rank's (`lit_lm.planner.documents`), for documents of `--document-length` tokens on average (default:
the prepared sources' own mean, tokens / documents of their index; unknown: counted unmasked, and said).
`--answer` adds the two questions asked before every run: the largest
model that fits the cluster, and how many days N tokens take.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any, Optional

import yaml
from rich.console import Console
from rich.table import Table

from lit_lm.config import ConfigError, ModelConfig
from lit_lm.lora import lora_from
from lit_lm.moved import load_yaml
from lit_lm.planner.cp_rank import rank_methods, reference_layout
from lit_lm.planner.documents import allowed_share
from lit_lm.planner.estimate import CHECKPOINTING, PRECISIONS, Workload, flops_per_token
from lit_lm.planner.optimizer import optimizer_fields
from lit_lm.planner.plan import USABLE_MEMORY, Cluster, Ranked, fitting, layouts, plan, strategy_yaml

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"  # as lit_lm.cli reads it
UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
# Llama-shaped models for "the largest model that fits": (name, d_model, n_layers, n_heads, n_kv_heads, d_ff)
LADDER = [("1B", 2048, 16, 32, 8, 8192), ("3B", 3072, 28, 24, 8, 8192), ("8B", 4096, 32, 32, 8, 14336),
          ("13B", 5120, 40, 40, 40, 13824), ("34B", 8192, 48, 64, 8, 22016), ("70B", 8192, 80, 64, 8, 28672),
          ("405B", 16384, 126, 128, 8, 53248)]


def quantity(text: str, what: str) -> float:
    """'80GB' -> 8e10, '80GiB' -> 85899345920, '450GB/s' -> 4.5e11, '989e12' -> 9.89e14."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMgGtTpP]i?)?[bB]?(/s)?\s*", text)
    if match is None:
        raise ConfigError(f"--{what} {text!r}: give a number with an optional unit, e.g. 80GB, 80GiB, 450GB/s")
    return float(match.group(1)) * UNITS[(match.group(2) or "").lower()]


def read_configs(paths: list[str]) -> dict[str, Any]:
    """The yaml files merged as `fit` merges them: dicts recursively, anything else replaced by the later file."""
    def merge(a: dict, b: dict) -> dict:
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out

    merged: dict[str, Any] = {}
    for path in ([str(DEFAULT_CONFIG)] if DEFAULT_CONFIG.is_file() else []) + paths:
        if not Path(path).is_file():
            raise ConfigError(f"--config {path}: no such file")
        merged = merge(merged, load_yaml(Path(path).read_text()) or {})
    return merged


def workload_from(config: dict[str, Any], args: argparse.Namespace, world: int) -> Workload:
    from lit_lm.data.datamodule import TextDataModule, model_vocab_size  # its defaults for what the yaml leaves out

    defaults = {k: p.default for k, p in inspect.signature(TextDataModule.__init__).parameters.items()}
    data = {**defaults, **((config.get("data") or {}).get("init_args") or {})}
    trainer = config.get("trainer") or {}
    model = dict(((config.get("model") or {}).get("init_args") or {}).get("config") or {})
    unknown = set(model) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise ConfigError(f"model.init_args.config: unknown field(s) {', '.join(sorted(unknown))}")
    vocab = model_vocab_size(data["vocab_size"], data["tokenizer_dir"], data.get("sources"))  # as `fit` links it
    cfg = ModelConfig(**{**model, "vocab_size": vocab, "max_seq_len": data["seq_len"]})
    precision = str(args.precision or trainer.get("precision") or "32-true")
    if precision not in PRECISIONS:
        raise ConfigError(f"trainer.precision {precision!r}: the planner knows {', '.join(PRECISIONS)} "
                          "(override with --precision)")
    batch = args.global_batch or data["batch_size"] * int(trainer.get("accumulate_grad_batches") or 1) * world
    init = (config.get("model") or {}).get("init_args") or {}
    return Workload(cfg, data["seq_len"], batch, precision, fp8=init.get("fp8"), lora=lora_from(init.get("lora")),
                    document_length=document_length(data, args.document_length),
                    **optimizer_fields(init.get("optimizer")))


def document_length(data: dict[str, Any], given: Optional[int]) -> Optional[int]:
    """The mean document length the estimate assumes: `--document-length`, else with `document_mask` the prepared
    sources' (token-weighted over the mixture: total tokens over total documents of each source's index, the
    sources mixed by weight); None: no mask, or its lengths unknown."""
    if given is not None:
        return given
    if not data.get("document_mask") or not data.get("sources"):
        return None
    from lit_lm.data.datamodule import _source_specs
    from lit_lm.data.prepare import PreparedSource

    specs = _source_specs(data["sources"])
    indexes = [PreparedSource(path).index for _, path, _ in specs]
    if any(not i.get("documents") for i in indexes):
        return None
    total = sum(w for _, _, w in specs)  # a token of the mix comes from source i with its weight's share
    per_token = sum(w / total * i["documents"] / i["tokens"] for (_, _, w), i in zip(specs, indexes))
    return max(1, round(1 / per_token))


def _speed_options(config: dict[str, Any], modes: tuple[str, ...], console: Console) -> tuple[str, ...]:
    """The model's compile and fp8 options (docs/compile.md): layouts with a checkpointing mode compile refuses
    (`lit_lm.strategies.compile.REFUSED`, none in torch 2.13) are not planned; FP8 keeps fp32 masters and makes its
    copies per GEMM, so the model state and activations are planned as without it, ZeRO-3's all-gathers of
    tensorwise weights at 1 byte per element (`Workload.fp8`), and its speed-up is not modelled (the compute time
    is bf16's, an upper bound)."""
    from lit_lm.strategies.compile import REFUSED, compile_backend

    args = (config.get("model") or {}).get("init_args") or {}
    if args.get("fp8"):
        gather = "; ZeRO-3 all-gathers the block linears' weights in FP8 (half bf16's bytes)" \
            if args["fp8"] == "tensorwise" else ""
        console.print(f"fp8 {args['fp8']}: memory as without it (fp32 masters, FP8 copies per GEMM){gather}; compute "
                      "timed at the bf16 peak (the FP8 speed-up is not modelled)")
    if not compile_backend(args.get("compile", False)):
        return modes
    refused = [m for m in modes if m in REFUSED]
    if refused and len(modes) == 1:
        raise ConfigError(REFUSED[refused[0]])
    if refused:
        console.print(f"compile: layouts without activation checkpointing {', '.join(refused)} (compile refuses it)")
    return tuple(m for m in modes if m not in REFUSED)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lit-lm plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", default=[], help="yaml files, as for fit (later files win)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory", default="80GB", help="per GPU, e.g. 80GB or 80GiB")
    p.add_argument("--intra-bw", default="450GB/s", help="per GPU inside a node (NVLink)")
    p.add_argument("--inter-bw", default="50GB/s", help="per GPU across nodes (its NIC)")
    p.add_argument("--peak-flops", default="989T", help="dense bf16 FLOP/s per GPU (H100 SXM: 989T)")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation assumed for compute")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step")
    p.add_argument("--precision", default=None, help=f"override trainer.precision ({', '.join(PRECISIONS)})")
    p.add_argument("--checkpointing", default="auto", choices=("auto", *CHECKPOINTING),
                   help="activation checkpointing to consider (auto: all three)")
    p.add_argument("--top", type=int, default=8, help="rows of the table")
    p.add_argument("--out", default=None, help="write the fastest layout here as yaml")
    p.add_argument("--answer", action="store_true", help="the largest model that fits; days to train --tokens")
    p.add_argument("--tokens", type=float, default=15e12, help="tokens to train, for --answer")
    p.add_argument("--document-length", type=int, default=None, help="mean tokens per document under "
                   "data.init_args.document_mask (default: the prepared sources' own mean)")
    p.add_argument("--cp-methods", action="store_true", help="rank ring, all-gather, Ulysses and ulysses+ring per "
                   "sequence length even when the fastest layout has no context parallelism")
    p.add_argument("--cp-seq-lens", type=int, nargs="+", default=None,
                   help="sequence lengths of that table (default: the run's and 16k-128k)")
    return p


def main(argv: Optional[list[str]] = None) -> None:
    args = parser().parse_args(argv)
    try:
        run(args)
    except ConfigError as err:
        raise SystemExit(f"lit-lm plan: {err}") from None


def run(args: argparse.Namespace) -> None:
    cluster = Cluster(args.nodes, args.gpus_per_node, quantity(args.gpu_memory, "gpu-memory"),
                      quantity(args.intra_bw, "intra-bw"), quantity(args.inter_bw, "inter-bw"),
                      quantity(args.peak_flops, "peak-flops"), args.mfu)
    config = read_configs(args.config)
    work = workload_from(config, args, cluster.world)
    modes = CHECKPOINTING if args.checkpointing == "auto" else (args.checkpointing,)
    console = Console(width=160)
    modes = _speed_options(config, modes, console)
    console.print(f"[bold]{_count(work.config.num_params())} parameters[/] "
                  f"({_count(work.config.num_params(False, active=True))} active, non-embedding), sequence "
                  f"{work.seq_len}, global batch {work.global_batch}, {work.precision} on {cluster.nodes} x "
                  f"{cluster.gpus_per_node} GPUs of {cluster.gpu_memory / 1e9:.0f} GB (usable "
                  f"{USABLE_MEMORY:.0%}), peak {cluster.peak_flops / 1e12:.0f} TFLOP/s at MFU {cluster.mfu:.0%}")
    ranked = plan(work, cluster, modes)
    if not ranked:
        raise ConfigError("no layout fits: add GPUs (--nodes), allow activation checkpointing (--checkpointing "
                          "auto) or shorten data.init_args.seq_len")
    print_table(console, ranked[: args.top], cluster)
    _documents_note(console, config, work)
    winner = ranked[0]
    if winner.config.cp > 1 or args.cp_methods:
        print_cp_table(console, work, cluster, ranked, args.cp_seq_lens)
    if args.out:
        text = yaml.safe_dump(strategy_yaml(winner, cluster, args.precision), sort_keys=False)
        header = (f"# lit-lm plan: {winner.estimate.describe()} on {cluster.nodes} x {cluster.gpus_per_node} GPUs, "
                  f"est. {winner.step_time:.3g} s/step, peak {winner.estimate.peak_bytes / 2**30:.1f} GiB/GPU\n"
                  f"#   lit-lm fit {' '.join(f'--config {c}' for c in args.config)} --config {args.out}\n")
        Path(args.out).write_text(header + text)
        console.print(f"wrote {args.out}")
    if args.answer:
        answer(console, work, cluster, ranked, args.tokens)


def print_table(console: Console, rows: list[Ranked], cluster: Cluster) -> None:
    table = Table(title="layouts that fit, fastest first (estimated)")
    for col in ("#", "layout", "ckpt", "step s", "MFU", "peak GiB", "state/act GiB", "exposed comm", "bubble"):
        table.add_column(col, justify="left" if col in ("layout", "ckpt") else "right")
    for i, r in enumerate(rows, 1):
        est, w = r.estimate, r.estimate.worst
        comm = sum(v for k, v in r.parts.items() if k not in ("compute", "bubble"))
        mfu = est.flops / (r.step_time * cluster.peak_flops)
        table.add_row(str(i), est.describe(), est.workload.checkpointing, f"{r.step_time:.3g}", f"{mfu:.0%}",
                      f"{est.peak_bytes / 2**30:.1f}", f"{w.model_state / 2**30:.1f}/{w.activations / 2**30:.1f}",
                      f"{comm / r.step_time:.0%}", f"{est.bubble:.0%}")
    console.print(table)
    for i, r in enumerate(rows, 1):
        console.print(f"  {i}. {r.reason}")


def _documents_note(console: Console, config: dict[str, Any], work: Workload) -> None:
    if work.document_length:
        share = allowed_share(work.seq_len, work.document_length)
        console.print(f"documents: attention FLOPs masked for documents of {work.document_length} tokens on average "
                      f"(exponential lengths, lit_lm/planner/documents.py): {share:.1%} of the causal pairs")
    elif ((config.get("data") or {}).get("init_args") or {}).get("document_mask"):
        console.print("documents: data.init_args.document_mask is on but the documents' lengths are unknown (no "
                      "prepared sources): attention FLOPs counted unmasked; give --document-length N")


def print_cp_table(console: Console, work: Workload, cluster: Cluster, ranked: list[Ranked],
                   seq_lens: Optional[list[int]]) -> None:
    """Ring, all-gather, Ulysses and ulysses+ring (u x r) per sequence length at the sizes of the fastest layout with
    cp (`cp_rank`)."""
    reference = reference_layout(ranked, cluster)
    if reference is None:
        console.print("context parallelism: no layout with cp > 1 to compare the methods at (pipeline, or too few "
                      "data-parallel ranks)")
        return
    layout, checkpointing = reference
    lengths = sorted(set(seq_lens or [work.seq_len, 16384, 32768, 65536, 131072]))
    rows = rank_methods(dataclasses.replace(work, checkpointing=checkpointing), cluster, layout, lengths)
    shown = dataclasses.replace(layout, cp_method="ring").describe()
    table = Table(title=f"context parallelism per sequence length at {shown}, {checkpointing} activation "
                  "checkpointing (estimated)")
    for col in ("T", "method", "rank", "step s", "exposed cp comm", "cp MiB/step/rank", "peak GiB", "attn buffers GiB",
                "busiest/mean attn"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        if r.refused:
            table.add_row(str(r.seq_len), r.method, "-", "refused: " + r.refused[:70], "", "", "", "", "")
            continue
        method = f"{r.method} ({r.ulysses}x{layout.cp // r.ulysses})" if r.ulysses else r.method
        table.add_row(str(r.seq_len), method, str(r.rank), f"{r.step_time:.3g}",
                      f"{r.exposed * 1e3:.3g} ms ({r.exposed / r.step_time:.0%})", f"{r.cp_bytes / 2**20:,.0f}",
                      f"{r.peak / 2**30:.1f}" + ("" if r.fits else " (does not fit)"), f"{r.buffers / 2**30:.2f}",
                      f"{r.imbalance:.2f}")
    console.print(table)
    console.print("  rank: the fastest step (compute at the MFU, the busiest cp rank's attention, plus the cp bytes "
                  "over the cp group's bandwidth: the planner counts cp traffic as exposed) among the methods that fit "
                  "the GPU, then the rest by memory; peak = the estimate's peak + the method's attention buffers "
                  "(lit_lm/planner/cp_rank.py)")


def _count(n: float) -> str:
    """A parameter count as people write it: 406B, 1.57M."""
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def answer(console: Console, work: Workload, cluster: Cluster, ranked: list[Ranked], tokens: float) -> None:
    """The largest Llama-shaped model with a fitting layout; days to train."""
    def fits(shape: tuple) -> bool:
        _, d, n_layers, heads, kv, ff = shape
        cfg = dataclasses.replace(work.config, d_model=d, n_layers=n_layers, n_heads=heads, n_kv_heads=kv, d_ff=ff,
                                  head_dim=d // heads, moe_experts=0)
        w = dataclasses.replace(work, config=cfg, checkpointing="full")
        budget = cluster.gpu_memory * USABLE_MEMORY
        return any(fitting(w, lay, budget) is not None for lay in layouts(w, cluster))

    lo, hi = 0, len(LADDER) - 1  # bisection: a larger model never fits where a smaller one does not
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(LADDER[mid]):
            best, lo = LADDER[mid][0], mid + 1
        else:
            hi = mid - 1
    console.print(f"largest Llama-shaped model that fits {cluster.world} GPUs with full activation checkpointing: "
                  f"{best or 'none'} (sequence {work.seq_len}, global batch {work.global_batch}, AdamW, "
                  f"{work.precision})")
    cfg = work.config
    ideal = flops_per_token(cfg.num_params(False, active=True), cfg.n_layers, cfg.d_model, work.seq_len) * tokens / \
        (cluster.world * cluster.peak_flops * cluster.mfu) / 86400
    size = _count(cfg.num_params(False, active=True))
    console.print(f"{tokens:.3g} tokens on the configured model ({size} active, not the largest above): "
                  f"{ideal:.3g} days at MFU {cluster.mfu:.0%} (6N + attention)")
    r = ranked[0]
    days = tokens / work.tokens * r.step_time / 86400
    console.print(f"  with {r.estimate.describe()} ({r.estimate.workload.checkpointing} checkpointing): "
                  f"{days:.3g} days (bubble, exposed communication and recomputation included)")
