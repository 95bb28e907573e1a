"""Document masking's cost on one process (docs/data.md): lit_lm's attention core, forward + backward, at sequence
lengths 2k-8k, unmasked (SDPA is_causal) against the block-diagonal mask through SDPA (the path lit_lm takes), and
flex attention's forward (its CPU backward does not exist in torch 2.13: "FlexAttention does not support backward on
CPU"), compiled and eager, for the record. Documents: lengths drawn from the standard library's .py files tokenized
at ~4 bytes per token (the issue's "real" distribution), packed back to back.

    .venv/bin/python scripts/bench_document_mask.py [--lengths 2048 4096 8192] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sysconfig
import time
from pathlib import Path

import torch

from lit_lm.data.packing import document_ids
from lit_lm.model import CausalAttention, document_mask

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64


def stdlib_documents(seq_len: int, mean: int = 0, seed: int = 0) -> torch.Tensor:
    """(1, T) document ids of a row packed with stdlib files (~4 bytes a token), from a random start; `mean` > 0:
    exponentially distributed lengths of that mean instead."""
    rng = random.Random(seed)
    sizes = [p.stat().st_size // 4 + 2 for p in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
             if "site-packages" not in p.parts]
    if mean:
        sizes = [1 + int(rng.expovariate(1 / mean)) for _ in range(100 * seq_len // mean + 100)]
    rng.shuffle(sizes)
    eos = torch.zeros(seq_len, dtype=torch.long)
    at = -rng.randrange(sizes[0])  # the row starts inside its first document
    for size in sizes:
        at += size
        if at >= seq_len:
            break
        if at > 0:
            eos[at - 1] = 1
    return document_ids(eos[None], 1)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up (a compile, caches)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(seq_len: int, repeats: int, mean: int = 0) -> dict:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, seq_len, HEAD_DIM, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, KV_HEADS, seq_len, HEAD_DIM, generator=gen, requires_grad=True) for _ in range(2))
    documents = stdlib_documents(seq_len, mean)
    core = CausalAttention()

    def step(**kw):
        def run():
            q.grad = k.grad = v.grad = None
            core(q, k, v, **kw).sum().backward()
        return run

    def masked():
        q.grad = k.grad = v.grad = None
        fresh = documents.clone()  # a new step: the mask is built again, as every step does
        core(q, k, v, fresh).sum().backward()

    out = {"seq_len": seq_len, "documents": int(documents.max()) + 1,
           "allowed_fraction": float(document_mask(documents).sum() / (seq_len * (seq_len + 1) / 2)),
           "sdpa_causal_fwd_bwd_s": timed(step(), repeats), "sdpa_mask_fwd_bwd_s": timed(masked, repeats)}
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    docs = documents[0]

    def mask_mod(b, h, i, j):
        return (docs[i] == docs[j]) & (i >= j)

    with torch.no_grad():
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        out["sdpa_mask_fwd_s"] = timed(lambda: core(qd, kd, vd, documents.clone()), repeats)
        out["flex_block_mask_build_s"] = timed(lambda: create_block_mask(mask_mod, 1, None, seq_len, seq_len,
                                                                         device="cpu"), repeats)
        block = create_block_mask(mask_mod, 1, None, seq_len, seq_len, device="cpu")
        torch._dynamo.reset()  # one static compile per length
        compiled = torch.compile(flex_attention, dynamic=False)
        try:
            out["flex_compiled_fwd_s"] = timed(lambda: compiled(qd, kd, vd, block_mask=block, enable_gqa=True),
                                               repeats)
        except Exception as e:  # no C++ compiler, an inductor gap: say so
            out["flex_compiled_fwd_s"] = f"{type(e).__name__}: {str(e)[:120]}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mean", type=int, default=0, help="exponential document lengths of this mean (0: stdlib)")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [measure(t, args.repeats, args.mean) for t in args.lengths]
    result = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
                         f"torch {torch.__version__}", "date": time.strftime("%Y-%m-%d"),
              "documents": f"exponential, mean {args.mean} tokens" if args.mean else "stdlib .py files, ~4 B/token",
              "shape": f"B=1, Hq={HEADS}, Hkv={KV_HEADS}, D={HEAD_DIM}, fp32", "rows": rows}
    for r in rows:
        print(json.dumps(r))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
