"""FlashAttention-2: softmax(q k^T / sqrt(D) + mask) v without ever materialising the (T x T) score matrix.

Forward (one program per block of BLOCK_M query rows of one head): stream over key/value blocks keeping a running
row max m, row sum l and output accumulator, rescaled by exp(m_old - m_new) whenever the max grows (online
softmax). Only the output and the per-row logsumexp L = m + log(l) are saved. Scores are kept in base 2
(s * scale * log2(e), so exp is the GPU's native exp2) and so is L.

Backward recomputes P = exp(q k^T * scale - L) block by block instead of storing it. With D_i = rowsum(dO ∘ O)
(a cheap pre-pass): dV = P^T dO, dP = dO V^T, dS = P ∘ (dP - D), dQ = dS K * scale, dK = dS^T Q * scale.
dK/dV are computed by one program per key block (looping over query blocks, and over the query heads sharing that
kv head under GQA) and dQ by one program per query block, so every gradient element has one writer: no atomics.

Causal attention skips the key blocks entirely above the diagonal, and a sliding window of W also skips the
blocks entirely older than W; the masks are applied inside the blocks.

Packed documents (varlen): with per-token document ids (`lit_lm.data.packing.document_ids`, non-decreasing along
each row), query i sees key j only if ids_q[i] == ids_k[j] as well. The kernels read, besides the ids, each query's
first key in its document and each key's end of document (`document_bounds`: the per-token form of the varlen
kernels' cu_seqlens, by searchsorted on the device, no host read), and narrow the loops with them:

    forward, dQ (query block [m0, m1)):  keys from max(window's start, first key of row m0's document)
    dK/dV (key block [n0, n1)):          queries up to min(window's end, end of key n1-1's document)

Since ids are non-decreasing, those are the first key any row of the block sees and the last query row any key of
the block is seen by: the blocks wholly outside a query block's documents are skipped, not masked. In a row's
attention to itself a block of pairs is then computed iff one of its pairs is allowed (tests/test_kernels.py proves
it by poisoning every other block).

GQA reads kv head `q_head // group` without repeating k, v in memory. Any sequence length (masked tails) and any
head_dim (padded to a power of 2).

The kernels also attend a *tile* of a longer sequence (`flash_attention_lse`): M queries on N keys, query row i
sitting `q_offset` + i positions after key 0, returning the log-sum-exp; its backward takes the lse and delta of
the merged output. Context parallelism (`lit_lm/strategies/cp.py`) merges such tiles around its ring.

Safe at real sizes: each launch is a 1-D grid of (row block, batch x head) pairs, row block fastest (`_grid`,
decoded as `_program`), since CUDA caps grid axes 1 and 2 at 65,535 and B x H passes that (1024 x 128); the program
id is widened to int64 before any product, and so is every block of row indices added to a loop index, so each
index x stride product is 64-bit (a (B, H, T, D) tensor past 2^31 elements stays addressable); fp32 operands go
through `tl.dot` at "ieee" precision (`runtime.dot_precision`), 16-bit ones on tensor cores.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_lm.kernels.logit_max import LogitMaxRecord, logit_max
from lit_lm.kernels.runtime import cdiv, check_backend, check_grid, dot_precision, jit, launch, next_power_of_2, op, \
    use_triton

tl: Any = None  # triton.language, bound by `lit_lm.kernels.runtime.jit` at the first launch

LOG2E = 1.4426950408889634


def attention_reference(q: Tensor, k: Tensor, v: Tensor, causal: bool = True,
                        window: Optional[int] = None, documents: Optional[Tensor] = None) -> Tensor:
    """SDPA with the same masking: q (B, Hq, T, D), k/v (B, Hkv, T, D); `window` counts the query itself;
    `documents` (B, T): each token's document id (causal only), pairs of two documents masked too."""
    gqa = q.shape[1] != k.shape[1]
    if documents is None and (window is None or window >= q.shape[2]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    t = torch.arange(q.shape[2], device=q.device)
    distance = t[:, None] - t[None, :]
    mask = (distance >= 0) & (distance < (window or q.shape[2]))
    if documents is not None:
        mask = (mask & (documents[:, :, None] == documents[:, None, :]))[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def document_bounds(q_ids: Tensor, k_ids: Tensor) -> tuple[Tensor, Tensor]:
    """What the kernels read with packed documents, from the document ids of the queries (B, M) and keys (B, N),
    each non-decreasing along its row (a packed row's, or a context-parallel tile's two chunks of one row's):

        q_docs (2, B, M) int64:  q_ids, and q_lo[i] = first key j with k_ids[j] >= q_ids[i]
        k_docs (2, B, N) int64:  k_ids, and k_hi[j] = first query i with q_ids[i] > k_ids[j]

    (for a row with itself: its document's first token and its end, cu_seqlens per token), by `searchsorted` on
    the ids' device."""
    q_ids, k_ids = q_ids.long().contiguous(), k_ids.long().contiguous()
    q_lo = torch.searchsorted(k_ids, q_ids)
    k_hi = torch.searchsorted(q_ids, k_ids, right=True)
    return torch.stack((q_ids, q_lo)), torch.stack((k_ids, k_hi))


@jit
def _attn_fwd(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, qdoc_ptr, qlo_ptr, kdoc_ptr,
              sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
              n_heads, group, seq_q, seq_k, q_offset, head_dim, window, qk_scale,
              CAUSAL: tl.constexpr, DOCUMENTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # = bh * row_blocks + row_block, as `_program`
    row_blocks = tl.cdiv(seq_q, BLOCK_M)
    start_m, bh = pid % row_blocks * BLOCK_M, pid // row_blocks
    b, h = bh // n_heads, bh % n_heads
    hk = h // group
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_mask = (rows[:, None] < seq_q) & (dims[None, :] < head_dim)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_t + dims[None, :], mask=row_mask, other=0.0)
    k_base = k_ptr + b * sk_b + hk * sk_h
    v_base = v_ptr + b * sv_b + hk * sv_h

    m = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)  # finite: a row fully masked in one block gives p = 0
    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if CAUSAL:  # only key blocks that hold a (row + offset >= col > row + offset - window) pair
        lo = tl.maximum(start_m + q_offset - window + 1, 0)
        hi = tl.minimum(start_m + BLOCK_M + q_offset, seq_k)
    else:
        lo = 0
        hi = seq_k
    if DOCUMENTS:  # and none before the first key of the first row's document
        row_docs = tl.load(qdoc_ptr + b * seq_q + rows, mask=rows < seq_q, other=-1)
        lo = tl.maximum(lo, tl.load(qlo_ptr + b * seq_q + start_m))
    lo = lo // BLOCK_N * BLOCK_N
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N).to(tl.int64)  # start_n is int32 when not causal
        col_mask = (cols[:, None] < seq_k) & (dims[None, :] < head_dim)
        k = tl.load(k_base + cols[:, None] * sk_t + dims[None, :], mask=col_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * sv_t + dims[None, :], mask=col_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        keep = cols[None, :] < seq_k
        if CAUSAL:
            distance = rows[:, None] + q_offset - cols[None, :]
            keep = keep & (distance >= 0) & (distance < window)
        if DOCUMENTS:
            col_docs = tl.load(kdoc_ptr + b * seq_k + cols, mask=cols < seq_k, other=-2)
            keep = keep & (row_docs[:, None] == col_docs[None, :])
        s = tl.where(keep, s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    acc = acc / tl.where(l > 0, l, 1.0)[:, None]  # a row that sees no key (offset tiles): out 0, lse -inf
    tl.store(o_ptr + b * so_b + h * so_h + rows[:, None] * so_t + dims[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=row_mask)
    tl.store(lse_ptr + bh * seq_q + rows, m + tl.log2(l), mask=rows < seq_q)


@jit
def _attn_bwd_delta(o_ptr, do_ptr, delta_ptr, so_b, so_h, so_t, sdo_b, sdo_h, sdo_t, n_heads, seq_len, head_dim,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row_blocks = tl.cdiv(seq_len, BLOCK_M)
    bh = pid // row_blocks
    b, h = bh // n_heads, bh % n_heads
    rows = pid % row_blocks * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < seq_len) & (dims[None, :] < head_dim)
    o = tl.load(o_ptr + b * so_b + h * so_h + rows[:, None] * so_t + dims[None, :], mask=mask, other=0.0)
    do = tl.load(do_ptr + b * sdo_b + h * sdo_h + rows[:, None] * sdo_t + dims[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(delta_ptr + bh * seq_len + rows, delta, mask=rows < seq_len)


@jit
def _attn_bwd_dkdv(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, qdoc_ptr, kdoc_ptr, khi_ptr,
                   sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                   n_heads, group, seq_q, seq_k, q_offset, head_dim, window, qk_scale, scale,
                   CAUSAL: tl.constexpr, DOCUMENTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # q and dO share strides (dO is made contiguous like q); so do k/dk and v/dv.
    pid = tl.program_id(0).to(tl.int64)  # = bhk * key_blocks + key_block
    key_blocks = tl.cdiv(seq_k, BLOCK_N)
    start_n, bhk = pid % key_blocks * BLOCK_N, pid // key_blocks
    n_kv_heads = n_heads // group
    b, hk = bhk // n_kv_heads, bhk % n_kv_heads
    cols = start_n + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    col_mask = (cols[:, None] < seq_k) & (dims[None, :] < head_dim)
    k_offs = b * sk_b + hk * sk_h + cols[:, None] * sk_t + dims[None, :]
    v_offs = b * sv_b + hk * sv_h + cols[:, None] * sv_t + dims[None, :]
    k = tl.load(k_ptr + k_offs, mask=col_mask, other=0.0)
    v = tl.load(v_ptr + v_offs, mask=col_mask, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    if CAUSAL:  # only query blocks that hold a (row + offset >= col > row + offset - window) pair
        lo = tl.maximum(start_n - q_offset, 0) // BLOCK_M * BLOCK_M
        hi = tl.minimum(start_n + BLOCK_N - q_offset + window - 1, seq_q)
    else:
        lo = 0
        hi = seq_q
    if DOCUMENTS:  # and none past the last query row of the last key's document
        col_docs = tl.load(kdoc_ptr + b * seq_k + cols, mask=cols < seq_k, other=-2)
        hi = tl.minimum(hi, tl.load(khi_ptr + b * seq_k + tl.minimum(start_n + BLOCK_N, seq_k) - 1))
    for g in range(group):  # the query heads that share this kv head
        bh = b * n_heads + hk * group + g
        q_base = q_ptr + b * sq_b + (hk * group + g) * sq_h
        do_base = do_ptr + b * sq_b + (hk * group + g) * sq_h
        for start_m in range(lo, hi, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M).to(tl.int64)  # start_m is int32 when not causal
            row_mask = (rows[:, None] < seq_q) & (dims[None, :] < head_dim)
            q = tl.load(q_base + rows[:, None] * sq_t + dims[None, :], mask=row_mask, other=0.0)
            do = tl.load(do_base + rows[:, None] * sq_t + dims[None, :], mask=row_mask, other=0.0)
            lse = tl.load(lse_ptr + bh * seq_q + rows, mask=rows < seq_q, other=float("inf"))
            delta = tl.load(delta_ptr + bh * seq_q + rows, mask=rows < seq_q, other=0.0)
            # P^T: (BLOCK_N, BLOCK_M)
            p_t = tl.exp2(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale - lse[None, :])
            keep = rows[None, :] < seq_q
            if CAUSAL:
                distance = rows[None, :] + q_offset - cols[:, None]
                keep = keep & (distance >= 0) & (distance < window)
            if DOCUMENTS:
                row_docs = tl.load(qdoc_ptr + b * seq_q + rows, mask=rows < seq_q, other=-1)
                keep = keep & (row_docs[None, :] == col_docs[:, None])
            p_t = tl.where(keep, p_t, 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
            ds_t = p_t * (tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION) - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    tl.store(dk_ptr + k_offs, (dk * scale).to(dk_ptr.dtype.element_ty), mask=col_mask)
    tl.store(dv_ptr + v_offs, dv.to(dv_ptr.dtype.element_ty), mask=col_mask)


@jit
def _attn_bwd_dq(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, qdoc_ptr, qlo_ptr, kdoc_ptr,
                 sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                 n_heads, group, seq_q, seq_k, q_offset, head_dim, window, qk_scale, scale,
                 CAUSAL: tl.constexpr, DOCUMENTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # q, dO and dQ share strides.
    pid = tl.program_id(0).to(tl.int64)
    row_blocks = tl.cdiv(seq_q, BLOCK_M)
    start_m, bh = pid % row_blocks * BLOCK_M, pid // row_blocks
    b, h = bh // n_heads, bh % n_heads
    hk = h // group
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_mask = (rows[:, None] < seq_q) & (dims[None, :] < head_dim)
    q_offs = b * sq_b + h * sq_h + rows[:, None] * sq_t + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_mask, other=0.0)
    do = tl.load(do_ptr + q_offs, mask=row_mask, other=0.0)
    lse = tl.load(lse_ptr + bh * seq_q + rows, mask=rows < seq_q, other=float("inf"))
    delta = tl.load(delta_ptr + bh * seq_q + rows, mask=rows < seq_q, other=0.0)
    k_base = k_ptr + b * sk_b + hk * sk_h
    v_base = v_ptr + b * sv_b + hk * sv_h
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if CAUSAL:  # the forward's key blocks
        lo = tl.maximum(start_m + q_offset - window + 1, 0)
        hi = tl.minimum(start_m + BLOCK_M + q_offset, seq_k)
    else:
        lo = 0
        hi = seq_k
    if DOCUMENTS:
        row_docs = tl.load(qdoc_ptr + b * seq_q + rows, mask=rows < seq_q, other=-1)
        lo = tl.maximum(lo, tl.load(qlo_ptr + b * seq_q + start_m))
    lo = lo // BLOCK_N * BLOCK_N
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N).to(tl.int64)  # start_n is int32 when not causal
        col_mask = (cols[:, None] < seq_k) & (dims[None, :] < head_dim)
        k = tl.load(k_base + cols[:, None] * sk_t + dims[None, :], mask=col_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * sv_t + dims[None, :], mask=col_mask, other=0.0)
        p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - lse[:, None])
        keep = cols[None, :] < seq_k
        if CAUSAL:
            distance = rows[:, None] + q_offset - cols[None, :]
            keep = keep & (distance >= 0) & (distance < window)
        if DOCUMENTS:
            col_docs = tl.load(kdoc_ptr + b * seq_k + cols, mask=cols < seq_k, other=-2)
            keep = keep & (row_docs[:, None] == col_docs[None, :])
        p = tl.where(keep, p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    tl.store(dq_ptr + q_offs, (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_mask)


def _launch_config(head_dim: int, dtype: torch.dtype, gpu: bool) -> dict[str, Any]:
    """Tile sizes: 16 in the interpreter (so small tests still cross tile edges), FA2-like on a GPU.
    head_dim is padded to a power of 2 and at least 16 (the smallest tl.dot); `tl.dot` precision per dtype."""
    block_d = max(next_power_of_2(head_dim), 16)
    precision = dot_precision(dtype)
    if not gpu:
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_D=block_d, DOT_PRECISION=precision)
    big = block_d > 64
    return dict(BLOCK_M=64 if big else 128, BLOCK_N=64, BLOCK_D=block_d, DOT_PRECISION=precision,
                num_warps=8 if big else 4, num_stages=2 if big else 3)


def _grid(n_rows: int, block: int, n_bh: int) -> tuple[int]:
    """One program per (block of `block` rows, batch x head) pair, flattened onto axis 0 (up to 2^31 - 1 programs;
    axis 1 would stop at 65,535 batch x heads). Row blocks vary fastest, so the programs in flight share a head's
    keys and values in L2, as a (row blocks, B x H) grid would."""
    return check_grid((cdiv(n_rows, block) * n_bh,))


def _program(pid: Any, n_rows: int, block: int) -> tuple[Any, Any]:
    """(row block, batch x head) of program id(s) `pid` (an int or a tensor of them) in `_grid`: what each kernel
    computes from tl.program_id(0)."""
    row_blocks = cdiv(n_rows, block)
    return pid % row_blocks, pid // row_blocks


def _strides(*tensors: Tensor) -> list[int]:
    """(batch, head, time) strides of each (B, H, T, D) tensor; the head dimension must be contiguous."""
    return [s for t in tensors for s in t.stride()[:3]]


def _last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _documents(q: Tensor, q_docs: Optional[Tensor], k_docs: Optional[Tensor]) -> tuple[Tensor, ...]:
    """The kernels' (q ids, q_lo, k ids, k_hi) pointers from `document_bounds`' pair; without documents, q four
    times (never read: DOCUMENTS is off)."""
    if q_docs is None or k_docs is None:
        return q, q, q, q
    return q_docs[0], q_docs[1], k_docs[0], k_docs[1]


@op("attention_fwd")
def _forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, window: int, q_offset: int,
             q_docs: Optional[Tensor] = None, k_docs: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(o, lse in base 2) for q (B, Hq, M, D), k/v (B, Hkv, N, D), last dims contiguous; `q_docs`/`k_docs`: packed
    documents (`document_bounds`)."""
    b, n_heads, seq_q, head_dim = q.shape
    cfg = _launch_config(head_dim, q.dtype, q.is_cuda)
    o = torch.empty_like(q)  # empty_like keeps q's strides: a (B, T, H, D) layout stays one
    lse = torch.empty(b, n_heads, seq_q, dtype=torch.float32, device=q.device)
    q_ids, q_lo, k_ids, _ = _documents(q, q_docs, k_docs)
    launch(_attn_fwd, _grid(seq_q, cfg["BLOCK_M"], b * n_heads), q, k, v, o, lse, q_ids, q_lo, k_ids,
           *_strides(q, k, v, o), n_heads, n_heads // k.shape[1], seq_q, k.shape[2], q_offset, head_dim, window,
           head_dim ** -0.5 * LOG2E, CAUSAL=causal, DOCUMENTS=q_docs is not None, **cfg)
    return o, lse


@op("attention_bwd")
def _backward(q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, delta: Tensor, causal: bool, window: int,
              q_offset: int, q_docs: Optional[Tensor] = None, k_docs: Optional[Tensor] = None
              ) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) from the base-2 lse and delta = rowsum(dO * O); `do` has q's strides."""
    b, n_heads, seq_q, head_dim = q.shape
    cfg = _launch_config(head_dim, q.dtype, q.is_cuda)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    scale = head_dim ** -0.5
    args = (*_strides(q, k, v), n_heads, n_heads // k.shape[1], seq_q, k.shape[2], q_offset, head_dim, window,
            scale * LOG2E, scale)
    q_ids, q_lo, k_ids, k_hi = _documents(q, q_docs, k_docs)
    documents = q_docs is not None
    launch(_attn_bwd_dkdv, _grid(k.shape[2], cfg["BLOCK_N"], b * k.shape[1]),
           q, k, v, do, lse, delta, dk, dv, q_ids, k_ids, k_hi, *args, CAUSAL=causal, DOCUMENTS=documents, **cfg)
    launch(_attn_bwd_dq, _grid(seq_q, cfg["BLOCK_M"], b * n_heads),
           q, k, v, do, lse, delta, dq, q_ids, q_lo, k_ids, *args, CAUSAL=causal, DOCUMENTS=documents, **cfg)
    return dq, dk, dv


@op("attention_bwd_delta")
def _delta(o: Tensor, do: Tensor) -> Tensor:
    """rowsum(dO * O) (B, H, T) fp32, `do` with o's strides."""
    b, n_heads, seq_len, head_dim = o.shape
    cfg = _launch_config(head_dim, o.dtype, o.is_cuda)
    delta = torch.empty(b, n_heads, seq_len, dtype=torch.float32, device=o.device)
    launch(_attn_bwd_delta, _grid(seq_len, cfg["BLOCK_M"], b * n_heads), o, do, delta, *_strides(o, do), n_heads,
           seq_len, head_dim, BLOCK_M=cfg["BLOCK_M"], BLOCK_D=cfg["BLOCK_D"])
    return delta


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, causal: bool, window: int, documents: Optional[Tensor]
                ) -> Tensor:
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        q_docs, k_docs = (None, None) if documents is None else document_bounds(documents, documents)
        o, lse = _forward(q, k, v, causal, window, 0, q_docs, k_docs)
        ctx.save_for_backward(q, k, v, o, lse, q_docs, k_docs)
        ctx.causal, ctx.window = causal, window
        return o

    @staticmethod
    def backward(ctx, do: Tensor) -> tuple[Optional[Tensor], ...]:
        q, k, v, o, lse, q_docs, k_docs = ctx.saved_tensors
        do = torch.empty_like(q).copy_(do)  # same strides as q, so the kernels share q's
        grads = _backward(q, k, v, do, lse, _delta(o, do), ctx.causal, ctx.window, 0, q_docs, k_docs)
        return (*grads, None, None, None)


def _tile_documents(documents: Optional[tuple[Tensor, Tensor]]) -> tuple[Optional[Tensor], Optional[Tensor]]:
    return (None, None) if documents is None else document_bounds(*documents)


def flash_attention_lse(q: Tensor, k: Tensor, v: Tensor, q_offset: int = 0, window: Optional[int] = None,
                        documents: Optional[tuple[Tensor, Tensor]] = None) -> tuple[Tensor, Tensor]:
    """Causal attention of a tile, no autograd: q (B, Hq, M, D) on k/v (B, Hkv, N, D), query row i sitting
    `q_offset` + i positions after key 0 (keys j with 0 <= q_offset + i - j < window attend) -> (o, lse), lse
    (B, Hq, M) fp32 in natural log. A row that sees no key gets o 0, lse -inf. Context parallelism merges tiles by
    their lse and runs the backward with `flash_attention_lse_backward`. `documents`: the queries' (B, M) and the
    keys' (B, N) document ids in one numbering (each non-decreasing), only pairs of one document attend."""
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    o, lse = _forward(q, k, v, True, window or q_offset + q.shape[2], q_offset, *_tile_documents(documents))
    return o, lse / LOG2E


def flash_attention_lse_backward(q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, delta: Tensor,
                                 q_offset: int = 0, window: Optional[int] = None,
                                 documents: Optional[tuple[Tensor, Tensor]] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of a tile given the final (merged) natural-log lse and delta = rowsum(dO * O) (B, Hq, M)."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    return _backward(q, k, v, do.contiguous(), (lse * LOG2E).contiguous(), delta.contiguous(), True,
                     window or q_offset + q.shape[2], q_offset, *_tile_documents(documents))


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, window: Optional[int] = None,
                    documents: Optional[Tensor] = None) -> Tensor:
    """Triton attention for q (B, Hq, T, D), k/v (B, Hkv, T, D), Hkv dividing Hq; `window` needs `causal`;
    `documents` (B, T): packed rows' document ids (`lit_lm.data.packing.document_ids`), causal only: varlen."""
    if (window is not None or documents is not None) and not causal:
        raise ValueError("a sliding window or documents are only defined for causal attention")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"kv heads ({k.shape[1]}) must divide query heads ({q.shape[1]})")
    if documents is not None and documents.shape != (q.shape[0], q.shape[2]):
        raise ValueError(f"documents {tuple(documents.shape)} must be (batch, time) = {(q.shape[0], q.shape[2])}")
    return FlashAttentionFunction.apply(q, k, v, causal, window or q.shape[2], documents)


class CausalAttention(LogitMaxRecord, nn.Module):
    """Drop-in for `lit_lm.model.CausalAttention`: no parameters, same `sliding_window`, `core(q, k, v,
    documents=None)` (packed rows: the varlen kernel), and the same QK-clip measurement (`LogitMaxRecord`)."""

    def __init__(self, sliding_window: Optional[int] = None, backend: str = "auto") -> None:
        super().__init__()
        self.sliding_window = sliding_window
        self.backend = check_backend(backend)

    @classmethod
    def from_reference(cls, ref: nn.Module, backend: str) -> "CausalAttention":
        return cls(ref.sliding_window, backend)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, documents: Optional[Tensor] = None) -> Tensor:
        if self.measuring:
            self.record_logit_max(logit_max(q, k, self.sliding_window, documents))
        if use_triton(self.backend, q):
            return flash_attention(q, k, v, causal=True, window=self.sliding_window, documents=documents)
        return attention_reference(q, k, v, causal=True, window=self.sliding_window, documents=documents)
