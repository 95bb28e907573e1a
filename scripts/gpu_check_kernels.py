"""The kernel sections of `scripts/gpu_check.py`: parity (`kernels`) and speed (`kernel_speed`) of every Triton kernel.

One table of cases serves both: each kernel at a realistic and an edge shape on a GPU (tiny ones in the dry-run,
under the Triton interpreter), its inputs, the Triton function and the PyTorch reference it must match, and the
work it does (elements it must move at least, or FLOPs for attention and matmul).

Parity compares, per output and per input gradient, three evaluations on the same rounded inputs: the kernel in the
dtype under test, the reference in that dtype ("eager", PyTorch's own rounding) and the reference in fp32 (the
truth). A tensor passes when it is allclose to the truth at the dtype's tolerance, or when its largest error is no
more than twice eager's: at realistic shapes bf16 rounding alone can exceed a fixed tolerance, and matching
PyTorch's own accuracy is the bar a drop-in has to clear.
"""

from __future__ import annotations

import statistics
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor

from lit_lm.kernels.attention import attention_reference, flash_attention
from lit_lm.kernels.cross_entropy import IGNORE_INDEX, cross_entropy, cross_entropy_reference
from lit_lm.kernels.gelu import gelu, gelu_reference
from lit_lm.kernels.matmul import matmul, matmul_reference
from lit_lm.kernels.rmsnorm import rmsnorm, rmsnorm_reference
from lit_lm.kernels.rope import RotaryEmbedding, rope, rope_reference
from lit_lm.kernels.softmax import softmax, softmax_reference
from lit_lm.kernels.swiglu import swiglu, swiglu_reference

TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
EAGER_FACTOR = 2.0  # a kernel may be at most this many times less accurate than the reference in the same dtype
TL_DOT_KERNELS = ("attention", "matmul")  # the interpreter multiplies bf16 tl.dot tiles as raw bits (test_kernels.py)
# torch.compile is the bar for the memory-bound kernels; attention is held to SDPA's flash backend instead and a
# compiled `a @ b` is cuBLAS again, so those two are not compiled (each compile costs the budget ~10 s).
COMPILED = ("rmsnorm", "swiglu", "cross_entropy", "rope", "softmax", "gelu")

# kernel -> {"gpu": [realistic, edge], "dry": [tiny, tiny edge]}: the dimensions `build` takes for that kernel.
SHAPES: dict[str, dict[str, list[tuple[int, ...]]]] = {
    "rmsnorm": {"gpu": [(16384, 4096), (4099, 5003)], "dry": [(8, 64), (7, 100)]},  # (rows, hidden)
    "swiglu": {"gpu": [(8192, 11008), (1001, 1377)], "dry": [(8, 96), (5, 77)]},  # (tokens, d_ff)
    "rope": {"gpu": [(4, 2048, 32, 8, 128), (3, 1001, 6, 2, 96)], "dry": [(1, 16, 4, 2, 16), (2, 7, 3, 1, 12)]},
    # (B, Hq, Hkv, T, D); the edge's T is no multiple of any block, its D (80) no power of 2
    "attention": {"gpu": [(4, 32, 32, 2048, 128), (2, 12, 4, 1031, 80)], "dry": [(1, 2, 2, 32, 16),
                                                                                 (1, 4, 2, 21, 20)]},
    "cross_entropy": {"gpu": [(8192, 32000), (1001, 50257)], "dry": [(8, 64), (9, 100)]},  # (tokens, vocab)
    "softmax": {"gpu": [(8192, 4096), (1003, 3001)], "dry": [(8, 64), (5, 33)]},
    "gelu": {"gpu": [(8192, 16384), (777, 1333)], "dry": [(8, 64), (5, 77)]},
    "matmul": {"gpu": [(4096, 4096, 4096), (1000, 1031, 777)], "dry": [(32, 32, 32), (17, 33, 19)]},  # (M, K, N)
}


@dataclass
class Case:
    """One kernel at one shape. `inputs` hold fp32 values; the differentiable ones are cast to the dtype under
    test, the others (targets, RoPE tables) are passed as they are."""

    kernel: str
    shape: str
    inputs: list[Tensor]
    differentiable: list[bool]
    triton: Callable[..., Any]
    reference: Callable[..., Any]
    elems_fwd: int = 0  # elements (of the dtype) the forward must move at least: inputs read once, outputs written
    elems_bwd: int = 0
    flops_fwd: int = 0  # compute-bound kernels
    flops_bwd: int = 0
    notes: list[str] = field(default_factory=list)


def build(kernel: str, dims: tuple[int, ...], device: torch.device) -> Case:
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(repr((kernel, dims)).encode()))  # same every run

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    shape = "x".join(map(str, dims))
    if kernel == "rmsnorm":
        m, n = dims
        return Case(kernel, shape, [randn(m, n), 1 + 0.1 * randn(n)], [True, True],
                    lambda x, w: rmsnorm(x, w, 1e-5), lambda x, w: rmsnorm_reference(x, w, 1e-5),
                    elems_fwd=2 * m * n, elems_bwd=3 * m * n)
    if kernel == "swiglu":
        m, n = dims
        return Case(kernel, shape, [randn(m, n), randn(m, n)], [True, True], swiglu, swiglu_reference,
                    elems_fwd=3 * m * n, elems_bwd=5 * m * n)
    if kernel == "rope":
        b, t, hq, hkv, d = dims
        cos, sin = RotaryEmbedding(d).cos_sin(t, device)
        moved = 2 * b * t * (hq + hkv) * d
        return Case(kernel, f"b{b} t{t} h{hq}/{hkv} d{d}", [randn(b, t, hq, d), randn(b, t, hkv, d), cos, sin],
                    [True, True, False, False], rope,
                    lambda q, k, c, s: (rope_reference(q, c, s), rope_reference(k, c, s)),
                    elems_fwd=moved, elems_bwd=moved)
    if kernel == "attention":
        b, hq, hkv, t, d = dims
        flops = 4 * b * hq * t * t * d // 2  # causal: half of q k^T and p v
        return Case(kernel, f"b{b} h{hq}/{hkv} t{t} d{d}", [randn(b, hq, t, d), randn(b, hkv, t, d),
                                                            randn(b, hkv, t, d)], [True, True, True],
                    flash_attention, attention_reference, flops_fwd=flops, flops_bwd=5 * flops // 2)
    if kernel == "cross_entropy":
        m, v = dims
        targets = torch.randint(0, v, (m,), generator=gen, device=device)
        targets[::7] = IGNORE_INDEX  # ignored rows, as padding gives
        return Case(kernel, shape, [randn(m, v), targets], [True, False],
                    lambda x, t: cross_entropy(x, t, 1e-4), lambda x, t: cross_entropy_reference(x, t, 1e-4),
                    elems_fwd=m * v, elems_bwd=2 * m * v)
    if kernel in ("softmax", "gelu"):
        m, n = dims
        fns = {"softmax": (softmax, softmax_reference), "gelu": (gelu, gelu_reference)}[kernel]
        return Case(kernel, shape, [randn(m, n)], [True], *fns, elems_fwd=2 * m * n, elems_bwd=3 * m * n)
    if kernel == "matmul":
        m, k, n = dims
        return Case(kernel, f"{m}x{k}@{k}x{n}", [randn(m, k), randn(k, n)], [True, True], matmul, matmul_reference,
                    flops_fwd=2 * m * n * k, flops_bwd=4 * m * n * k)
    raise ValueError(f"unknown kernel {kernel!r}")


def as_tuple(x: Any) -> tuple[Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def perturbed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with its first output off by one: the failure `--inject-failure KERNEL` plants to show it is caught."""
    def wrong(*args: Any) -> Any:
        outs = as_tuple(fn(*args))
        outs = (outs[0] + 1.0, *outs[1:])
        return outs if len(outs) > 1 else outs[0]
    return wrong


def _evaluate(fn: Callable[..., Any], inputs: list[Tensor], diff: list[bool]) -> tuple[list[Tensor], list[Tensor]]:
    """(outputs, gradients of the differentiable inputs) of fn, as fp32. The output cotangents are drawn from a
    fixed seed by shape, so every evaluation of a case back-propagates the same ones."""
    args = [x.detach().clone().requires_grad_() if d else x for x, d in zip(inputs, diff)]
    outs = as_tuple(fn(*args))
    live = [o for o in outs if o.requires_grad]
    gen = torch.Generator(device=live[0].device).manual_seed(1)
    cotangents = [torch.randn(o.shape, generator=gen, device=o.device) for o in live]
    grads = torch.autograd.grad(live, [a for a, d in zip(args, diff) if d],
                                [c.to(o.dtype) for c, o in zip(cotangents, live)])
    return [o.detach().float() for o in outs], [g.float() for g in grads]


def parity(case: Case, dtype: torch.dtype, inject: bool = False) -> dict[str, Any]:
    """Forward and backward of the kernel vs the reference (in `dtype` and in fp32) on the same rounded inputs."""
    low = [x.to(dtype) if d else x for x, d in zip(case.inputs, case.differentiable)]
    high = [x.float() if d else x for x, d in zip(low, case.differentiable)]
    truth_out, truth_grad = _evaluate(case.reference, high, case.differentiable)
    kern_out, kern_grad = _evaluate(perturbed(case.triton) if inject else case.triton, low, case.differentiable)
    eager_out, eager_grad = _evaluate(case.reference, low, case.differentiable)
    tol = TOLERANCE[dtype]
    tensors = []
    names = [f"out{i}" for i in range(len(truth_out))] + [f"grad{i}" for i in range(len(truth_grad))]
    for name, k, e, t in zip(names, kern_out + kern_grad, eager_out + eager_grad, truth_out + truth_grad):
        err, eager_err = (k - t).abs(), (e - t).abs()
        scale = t.abs().max().clamp_min(1e-30)
        worst = (err / (tol["atol"] + tol["rtol"] * t.abs())).max()
        row = dict(tensor=name, max_abs_err=err.max().item(), max_rel_err=(err.max() / scale).item(),
                   eager_max_abs_err=eager_err.max().item(), worst_over_tolerance=worst.item())
        row["allclose"] = row["worst_over_tolerance"] <= 1.0
        row["within_eager"] = row["max_abs_err"] <= EAGER_FACTOR * row["eager_max_abs_err"]
        row["pass"] = bool(row["allclose"] or row["within_eager"]) and bool(torch.isfinite(k).all())
        tensors.append(row)
    return dict(kernel=case.kernel, shape=case.shape, dtype=str(dtype).removeprefix("torch."), tolerance=tol,
                max_abs_err=max(r["max_abs_err"] for r in tensors), max_rel_err=max(r["max_rel_err"] for r in tensors),
                passed=all(r["pass"] for r in tensors), tensors=tensors)


def cases(kernels: list[str], dry_run: bool, device: torch.device) -> Iterator[Case]:
    """One case at a time: on a GPU the realistic shapes' inputs take gigabytes together."""
    for kernel in kernels:
        for dims in SHAPES[kernel]["dry" if dry_run else "gpu"]:
            yield build(kernel, dims, device)


def run_parity(report: Any, kernels: list[str], dry_run: bool, device: torch.device, inject: Optional[str]) -> str:
    """The `kernels` section: every case in fp32 and bf16; returns the status ("ok" or "failed")."""
    rows: list[dict[str, Any]] = []
    for case in cases(kernels, dry_run, device):
        for dtype in (torch.float32, torch.bfloat16):
            if dry_run and dtype == torch.bfloat16 and case.kernel in TL_DOT_KERNELS:
                rows.append(dict(kernel=case.kernel, shape=case.shape, dtype="bfloat16", skipped=(
                    "the Triton interpreter multiplies bf16 tl.dot tiles as raw bits: checked on a GPU only")))
                continue
            try:
                rows.append(parity(case, dtype, inject=case.kernel == inject))
            except Exception as err:  # one kernel's crash is that kernel's failure, not the section's
                rows.append(dict(kernel=case.kernel, shape=case.shape, dtype=str(dtype).removeprefix("torch."),
                                 passed=False, error=f"{type(err).__name__}: {err}"[:500]))
            print(_parity_line(rows[-1]), flush=True)
            report.update(results=rows)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    failed = [f"{r['kernel']} {r['shape']} {r['dtype']}" for r in rows if r.get("passed") is False]
    report.update(results=rows, failed=failed, eager_factor=EAGER_FACTOR)
    return "failed" if failed else "ok"


def _parity_line(row: dict[str, Any]) -> str:
    head = f"  {row['kernel']:>13} {row['shape']:>24} {row['dtype']:>8}"
    if "skipped" in row or "error" in row:
        return f"{head}  {row.get('skipped') or row.get('error')}"
    return f"{head}  max abs {row['max_abs_err']:.2e}  rel {row['max_rel_err']:.2e}  " \
           f"{'pass' if row['passed'] else 'FAIL'}"


# -- speed -----------------------------------------------------------------------------------------------------
def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> float:
    """Median milliseconds of fn: CUDA events around each call on a GPU, the host clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def copy_bandwidth(device: torch.device, dry_run: bool, warmup: int, iters: int) -> dict[str, Any]:
    """GB/s of dst.copy_(src) over a large tensor (read once + written once): the roofline for memory-bound
    kernels, measured rather than taken from a datasheet."""
    n = 2**22 if dry_run else 2**30  # elements of bf16: 8 MiB / 2 GiB
    src = torch.randn(n, device=device).to(torch.bfloat16) if dry_run else \
        torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup, iters)
    moved = 2 * src.numel() * src.element_size()
    return dict(bytes=moved, ms=ms, gbps=moved / ms / 1e6)


def _fwd_bwd(fn: Callable[..., Any], args: list[Tensor], diff: list[bool]) -> Callable[[], Any]:
    """A closure running fn and the gradients of its differentiable outputs w.r.t. the differentiable inputs."""
    outs = [o for o in as_tuple(fn(*args)) if o.requires_grad]
    cot = [torch.randn_like(o) for o in outs]
    wrt = [a for a, d in zip(args, diff) if d]

    def run() -> Any:
        return torch.autograd.grad([o for o in as_tuple(fn(*args)) if o.requires_grad], wrt, cot)

    return run


def sdpa_flash(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """SDPA restricted to its FlashAttention backend: the bar the Triton attention is held to."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=q.shape[1] != k.shape[1])


def speed(case: Case, dtype: torch.dtype, device: torch.device, dry_run: bool, warmup: int,
          iters: int) -> list[dict[str, Any]]:
    args = [x.to(dtype).requires_grad_() if d else x for x, d in zip(case.inputs, case.differentiable)]
    impls: dict[str, Optional[Callable[..., Any]]] = {"triton": case.triton, "eager": case.reference}
    if case.kernel in COMPILED:
        impls["compile"] = None if dry_run else torch.compile(case.reference)
    if case.kernel == "attention":
        impls["sdpa_flash"] = sdpa_flash
    size = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        flops = case.flops_fwd + (case.flops_bwd if mode == "fwd+bwd" else 0)
        moved = (case.elems_fwd + (case.elems_bwd if mode == "fwd+bwd" else 0)) * size
        for impl, fn in impls.items():
            row: dict[str, Any] = dict(kernel=case.kernel, shape=case.shape, dtype=str(dtype).removeprefix("torch."),
                                       mode=mode, impl=impl)
            if fn is None:
                rows.append({**row, "skipped": "torch.compile is skipped in the dry-run (keeps it fast)"})
                continue
            try:
                call = (lambda fn=fn: fn(*args)) if mode == "fwd" else _fwd_bwd(fn, args, case.differentiable)
                ms = time_ms(call, device, warmup, iters)
            except Exception as err:  # e.g. a backend that refuses a shape: recorded, the others still run
                rows.append({**row, "error": f"{type(err).__name__}: {err}"[:300]})
                continue
            row["ms"] = ms
            if flops:
                row["tflops"] = flops / ms / 1e9
            else:
                row["bytes"], row["gbps"] = moved, moved / ms / 1e6
            rows.append(row)
    return rows


def summarise(rows: list[dict[str, Any]], copy_gbps: float) -> list[dict[str, Any]]:
    """Per kernel and mode, what the goals are judged on: the Triton kernel's GB/s as a fraction of the measured
    copy bandwidth, its speed-up over eager and torch.compile, and attention's over SDPA's flash backend."""
    out = []
    for kernel, shape, mode in dict.fromkeys((r["kernel"], r["shape"], r["mode"]) for r in rows):
        ms = {r["impl"]: r["ms"] for r in rows if (r["kernel"], r["shape"], r["mode"]) == (kernel, shape, mode)
              and "ms" in r}
        if "triton" not in ms:
            continue
        row: dict[str, Any] = dict(kernel=kernel, shape=shape, mode=mode, triton_ms=ms["triton"])
        for other in ("eager", "compile", "sdpa_flash"):
            if other in ms:
                row[f"speedup_vs_{other}"] = ms[other] / ms["triton"]  # > 1: Triton is faster
        gbps = next((r.get("gbps") for r in rows if (r["kernel"], r["shape"], r["mode"], r["impl"]) ==
                     (kernel, shape, mode, "triton")), None)
        if gbps is not None and copy_gbps:
            row["fraction_of_copy_bandwidth"] = gbps / copy_gbps
        out.append(row)
    return out


def run_speed(report: Any, kernels: list[str], dry_run: bool, device: torch.device) -> str:
    """The `kernel_speed` section: copy bandwidth, then each kernel's first (realistic) shape in bf16 on a GPU
    (fp32 in the dry-run, where the interpreter cannot multiply bf16 tiles); results are written as they come, so
    a section cut short by its time budget keeps what it measured."""
    warmup, iters = (1, 2) if dry_run else (3, 10)  # CUDA events: 10 launches average out the noise
    dtype = torch.float32 if dry_run else torch.bfloat16
    copy = copy_bandwidth(device, dry_run, warmup, iters)
    print(f"  copy: {copy['gbps']:.1f} GB/s", flush=True)
    report.update(copy_bandwidth=copy, warmup=warmup, iters=iters, timer="cuda events" if device.type == "cuda"
                  else "time.perf_counter", results=[])
    rows: list[dict[str, Any]] = []
    for kernel in kernels:
        case = build(kernel, SHAPES[kernel]["dry" if dry_run else "gpu"][0], device)
        rows += speed(case, dtype, device, dry_run, warmup, iters)
        report.update(results=rows, summary=summarise(rows, copy["gbps"]))
        for row in summarise(rows, copy["gbps"]):
            if row["kernel"] == kernel:
                print("  " + "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in row.items()), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    errors = [f"{r['kernel']} {r['mode']} {r['impl']}: {r['error']}" for r in rows if "error" in r]
    report.update(errors=errors)
    return "ok"
