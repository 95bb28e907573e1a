"""Kernel benchmark: eager PyTorch vs torch.compile vs Triton, forward and forward+backward, over a sweep of shapes.

    python scripts/bench_kernels.py                          # all kernels, bf16, table + bench_kernels.json
    python scripts/bench_kernels.py --kernels attention rmsnorm --peak-tflops 989 --peak-gbps 4800

Times are medians from `triton.testing.do_bench`. Memory-bound kernels report achieved GB/s from the bytes they
must move at least (inputs read once, outputs written once); attention and matmul report TFLOP/s (attention:
4 B H T^2 D forward, halved when causal; backward 2.5x forward, as FlashAttention-2 counts). "% peak" divides by
the device's peak from a small table (dense bf16 FLOP/s, HBM bandwidth), overridable by flag. Needs a CUDA GPU;
elsewhere it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from lit_lm.callbacks.throughput import peak_flops_for
from machine import machine  # scripts/: where the figures were measured
from lit_lm.kernels.attention import attention_reference, flash_attention
from lit_lm.kernels.cross_entropy import cross_entropy, cross_entropy_reference
from lit_lm.kernels.gelu import gelu, gelu_reference
from lit_lm.kernels.matmul import matmul, matmul_reference
from lit_lm.kernels.rmsnorm import rmsnorm, rmsnorm_reference
from lit_lm.kernels.rope import RotaryEmbedding, rope, rope_reference
from lit_lm.kernels.softmax import softmax, softmax_reference
from lit_lm.kernels.swiglu import swiglu, swiglu_reference

# HBM bandwidth in bytes/s (NVIDIA datasheets), matched by substring like lit_lm.callbacks.throughput.PEAK_FLOPS.
PEAK_BANDWIDTH: list[tuple[str, float]] = [
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100", 2.0e12),
    ("L40S", 0.864e12),
    ("L4", 0.3e12),
    ("A10", 0.6e12),
]

KERNELS = ["rmsnorm", "swiglu", "rope", "cross_entropy", "attention", "matmul", "gelu", "softmax"]


@dataclass
class Case:
    """One kernel at one shape: its inputs, the reference and Triton callables, and the work it must do."""

    kernel: str
    shape: str
    inputs: Callable[[], list[torch.Tensor]]
    reference: Callable[..., object]
    triton: Callable[..., object]
    bytes_fwd: int = 0  # minimum bytes moved (memory-bound kernels)
    bytes_bwd: int = 0
    flops_fwd: int = 0  # FLOPs (compute-bound kernels)
    flops_bwd: int = 0


def cases(dtype: torch.dtype) -> list[Case]:
    dev, size = "cuda", torch.tensor([], dtype=dtype).element_size()

    def randn(*shape: int, grad: bool = True) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dtype, requires_grad=grad)

    out: list[Case] = []
    for m, n in [(4096, 4096), (8192, 5120), (16384, 8192)]:
        out.append(Case("rmsnorm", f"{m}x{n}",
                        lambda m=m, n=n: [randn(m, n), torch.ones(n, device=dev, requires_grad=True)],
                        lambda x, w: rmsnorm_reference(x, w, 1e-5), lambda x, w: rmsnorm(x, w, 1e-5),
                        bytes_fwd=2 * m * n * size, bytes_bwd=3 * m * n * size))
    for m, n in [(4096, 11008), (16384, 14336)]:
        out.append(Case("swiglu", f"{m}x{n}", lambda m=m, n=n: [randn(m, n), randn(m, n)], swiglu_reference, swiglu,
                        bytes_fwd=3 * m * n * size, bytes_bwd=5 * m * n * size))
    for b, t, hq, hkv, d in [(4, 4096, 32, 8, 128), (8, 2048, 16, 16, 64)]:
        cos, sin = RotaryEmbedding(d).cos_sin(t, torch.device(dev))
        moved = 2 * b * t * (hq + hkv) * d * size
        out.append(Case("rope", f"b{b} t{t} h{hq}/{hkv} d{d}",
                        lambda b=b, t=t, hq=hq, hkv=hkv, d=d: [randn(b, t, hq, d), randn(b, t, hkv, d)],
                        lambda q, k, c=cos, s=sin: (rope_reference(q, c, s), rope_reference(k, c, s)),
                        lambda q, k, c=cos, s=sin: rope(q, k, c, s), bytes_fwd=moved, bytes_bwd=moved))
    for m, v in [(4096, 32000), (8192, 128256)]:
        targets = torch.randint(0, v, (m,), device=dev)
        out.append(Case("cross_entropy", f"{m}x{v}", lambda m=m, v=v: [randn(m, v)],
                        lambda x, t=targets: cross_entropy_reference(x, t, 1e-4),
                        lambda x, t=targets: cross_entropy(x, t, 1e-4), bytes_fwd=m * v * size,
                        bytes_bwd=2 * m * v * size))
    for b, hq, hkv, t, d in [(4, 32, 8, 2048, 128), (2, 16, 16, 4096, 64), (1, 32, 8, 8192, 128)]:
        flops = 4 * b * hq * t * t * d // 2  # causal
        out.append(Case("attention", f"b{b} h{hq}/{hkv} t{t} d{d}",
                        lambda b=b, hq=hq, hkv=hkv, t=t, d=d: [randn(b, hq, t, d), randn(b, hkv, t, d),
                                                               randn(b, hkv, t, d)],
                        attention_reference, flash_attention, flops_fwd=flops, flops_bwd=5 * flops // 2))
    for m, n, k in [(4096, 4096, 4096), (8192, 8192, 8192)]:
        out.append(Case("matmul", f"{m}x{k}@{k}x{n}", lambda m=m, n=n, k=k: [randn(m, k), randn(k, n)],
                        matmul_reference, matmul, flops_fwd=2 * m * n * k, flops_bwd=4 * m * n * k))
    for m, n in [(4096, 16384)]:
        out.append(Case("gelu", f"{m}x{n}", lambda m=m, n=n: [randn(m, n)], gelu_reference, gelu,
                        bytes_fwd=2 * m * n * size, bytes_bwd=3 * m * n * size))
    for m, n in [(4096, 4096), (8192, 8192)]:
        out.append(Case("softmax", f"{m}x{n}", lambda m=m, n=n: [randn(m, n)], softmax_reference, softmax,
                        bytes_fwd=2 * m * n * size, bytes_bwd=3 * m * n * size))
    return out


def as_tuple(x: object) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def forward_backward(fn: Callable[..., object], inputs: list[torch.Tensor]) -> Callable[[], None]:
    """A closure running fn and the gradients of its differentiable outputs w.r.t. all inputs that need them."""
    outs = [o for o in as_tuple(fn(*inputs)) if o.requires_grad]
    cotangents = [torch.randn_like(o) for o in outs]
    wrt = [x for x in inputs if x.requires_grad]

    def run() -> None:
        torch.autograd.grad([o for o in as_tuple(fn(*inputs)) if o.requires_grad], wrt, cotangents)

    return run


def bench(case: Case, peak_flops: float, peak_bandwidth: float) -> list[dict]:
    from triton.testing import do_bench

    inputs = case.inputs()
    impls = {"eager": case.reference, "compile": torch.compile(case.reference), "triton": case.triton}
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        flops = case.flops_fwd + (case.flops_bwd if mode == "fwd+bwd" else 0)
        moved = case.bytes_fwd + (case.bytes_bwd if mode == "fwd+bwd" else 0)
        for impl, fn in impls.items():
            row = dict(kernel=case.kernel, shape=case.shape, mode=mode, impl=impl)
            try:
                call = (lambda fn=fn: fn(*inputs)) if mode == "fwd" else forward_backward(fn, inputs)
                ms = do_bench(call, return_mode="median")
            except Exception as err:  # e.g. torch.compile failing on one shape: report and go on
                rows.append({**row, "error": f"{type(err).__name__}: {err}"[:200]})
                continue
            if flops:
                rate, unit, peak = flops / ms / 1e9, "TFLOP/s", peak_flops / 1e12
            else:
                rate, unit, peak = moved / ms / 1e6, "GB/s", peak_bandwidth / 1e9
            rows.append({**row, "ms": ms, "rate": rate, "unit": unit, "peak_fraction": rate / peak if peak else None})
        torch.cuda.empty_cache()
    return rows


def print_row(row: dict) -> None:
    head = f"{row['kernel']:>13} {row['shape']:>26} {row['mode']:>7} {row['impl']:>7}"
    if "error" in row:
        print(f"{head}  error: {row['error']}")
        return
    frac = f"{100 * row['peak_fraction']:6.1f}%" if row["peak_fraction"] is not None else "     -"
    print(f"{head} {row['ms']:9.3f} ms {row['rate']:9.1f} {row['unit']:<7} {frac}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=KERNELS)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--peak-tflops", type=float, help="override the device's dense peak TFLOP/s")
    parser.add_argument("--peak-gbps", type=float, help="override the device's memory bandwidth in GB/s")
    parser.add_argument("--json", default="bench_kernels.json", help="results file (empty: do not write)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA device here; the kernels are benchmarked on a GPU only "
              "(on CPU, run the tests with TRITON_INTERPRET=1 instead).")
        return 0

    name = torch.cuda.get_device_name()
    peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else (peak_flops_for(name) or 0.0)
    peak_bandwidth = args.peak_gbps * 1e9 if args.peak_gbps else \
        next((bw for key, bw in PEAK_BANDWIDTH if key in name), 0.0)
    print(f"{name}: peak {peak_flops / 1e12:.0f} TFLOP/s, {peak_bandwidth / 1e9:.0f} GB/s ({args.dtype})")
    rows = []
    for case in cases(getattr(torch, args.dtype)):
        if case.kernel in args.kernels:
            for row in bench(case, peak_flops, peak_bandwidth):
                print_row(row)
                rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine(), device=name, dtype=args.dtype, peak_flops=peak_flops,
                           peak_bandwidth=peak_bandwidth, results=rows), f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
