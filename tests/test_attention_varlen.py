"""The Triton FlashAttention kernel over packed documents (varlen) and the RoPE kernel with per-row positions, under
the Triton interpreter (tiles of 16), against the model's reference path: `lit_lm.model.CausalAttention` (SDPA with
the block-diagonal causal mask) and `lit_lm.model.RotaryEmbedding`.

Layouts cross tile edges on purpose: documents that straddle a tile boundary, one-token documents, a document longer
than a tile, a row that is one document (= the kernel without documents, bit for bit), with and without a sliding
window (shorter and longer than a tile). `test_the_kernels_compute_exactly_the_tiles_with_an_allowed_pair` proves the
skipping: NaN planted in one tile reaches exactly the tiles that read it.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (kernels import it lazily)

import pytest

from lit_lm.kernels.runtime import interpreting

if not interpreting():  # triton was imported before this line, in compiled mode (`import lightning` does that)
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported: set it in the environment or tests/conftest.py",
                allow_module_level=True)

import torch

from lit_lm.data.packing import document_positions
from lit_lm.kernels.attention import _backward, _forward, attention_reference, document_bounds, \
    flash_attention, flash_attention_lse, flash_attention_lse_backward
from lit_lm.kernels.rope import RotaryEmbedding as RoPEKernel
from lit_lm.model import CausalAttention, RotaryEmbedding, document_mask

TILE = 16  # the interpreter's BLOCK_M = BLOCK_N (`attention._launch_config`)
TOLERANCE = dict(atol=1e-5, rtol=1e-5)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: padded tail rows divide by 0, masked


def rows(*lengths: list[int]) -> torch.Tensor:
    """(B, T) document ids of rows made of documents of these lengths (each row's lengths summing to T)."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths])


LAYOUTS = {  # name -> (B, T) document ids
    "straddling": rows([5, 20, 1, 14], [16, 16, 8]),  # 5 | 20 crosses 16 | one token | a row cut at tile edges
    "one_token_documents": rows([1, 1, 1, 3, 1, 1, 19, 1, 1]),  # 29 tokens, a run of one-token documents
    "longer_than_two_tiles": rows([2, 35, 3]),  # 37 tokens, a document over three tiles
}


def qkv(b: int, t: int, hq: int = 4, hkv: int = 2, d: int = 16, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v as the model makes them: (B, T, H, D) storage viewed as (B, H, T, D)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, t, h, d, generator=gen).transpose(1, 2).requires_grad_() for h in (hq, hkv, hkv)]


def grads(out: torch.Tensor, inputs: list[torch.Tensor], cotangent: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out, inputs, cotangent)


@pytest.mark.parametrize("window", [None, 6, 20])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_varlen_kernel_matches_the_models_block_diagonal_attention(layout: str, window: int) -> None:
    """Forward and every input gradient of the kernel with `documents` equal the model's SDPA path with the same
    documents (GQA 4 query heads on 2 kv heads), and the kernels' own reference too."""
    documents = LAYOUTS[layout]
    q, k, v = qkv(documents.shape[0], documents.shape[1])
    out = flash_attention(q, k, v, window=window, documents=documents)
    ref = CausalAttention(window)(q, k, v, documents)
    torch.testing.assert_close(out, ref, **TOLERANCE)
    torch.testing.assert_close(attention_reference(q, k, v, True, window, documents), ref, **TOLERANCE)
    cotangent = torch.randn_like(ref)
    for grad, ref_grad in zip(grads(out, [q, k, v], cotangent), grads(ref, [q, k, v], cotangent)):
        torch.testing.assert_close(grad, ref_grad, **TOLERANCE)


@pytest.mark.parametrize("window", [None, 9])
def test_a_row_of_one_document_is_the_kernel_without_documents(window: int) -> None:
    """One document per row: the same tiles, the same masks, so the same bits as today's causal kernel."""
    q, k, v = qkv(2, 37, 2, 1)
    documents = torch.zeros(2, 37, dtype=torch.long)
    out = flash_attention(q, k, v, window=window, documents=documents)
    plain = flash_attention(q, k, v, window=window)
    assert torch.equal(out, plain)
    cotangent = torch.randn_like(out)
    for grad, plain_grad in zip(grads(out, [q, k, v], cotangent), grads(plain, [q, k, v], cotangent)):
        assert torch.equal(grad, plain_grad)


def test_document_bounds_are_each_documents_start_and_end() -> None:
    """For a row with itself, q_lo is the first token of each token's document and k_hi the end (cu_seqlens, per
    token); for two chunks of a row, the first key at or after the query's document and the first query past the
    key's."""
    ids = rows([2, 3, 1])
    q_docs, k_docs = document_bounds(ids, ids)
    assert q_docs.tolist() == [[[0, 0, 1, 1, 1, 2]], [[0, 0, 2, 2, 2, 5]]]
    assert k_docs.tolist() == [[[0, 0, 1, 1, 1, 2]], [[2, 2, 5, 5, 5, 6]]]
    q_docs, k_docs = document_bounds(torch.tensor([[1, 1, 3]]), torch.tensor([[0, 1, 2, 2]]))
    assert q_docs[1].tolist() == [[1, 1, 4]] and k_docs[1].tolist() == [[0, 2, 2, 2]]


def tiles_with_an_allowed_pair(allowed: torch.Tensor) -> torch.Tensor:
    """(query tiles, key tiles) bool: whether the tile of pairs holds at least one allowed pair."""
    n = -(-allowed.shape[0] // TILE)
    padded = torch.zeros(n * TILE, n * TILE, dtype=torch.bool)
    padded[:allowed.shape[0], :allowed.shape[1]] = allowed
    return padded.view(n, TILE, n, TILE).any(dim=(1, 3))


def nan_tiles(x: torch.Tensor, t: int) -> torch.Tensor:
    """(B, tiles) bool: which tiles of rows of x (B, H, T, D) hold a NaN."""
    n = -(-t // TILE)
    padded = torch.zeros(x.shape[0], n * TILE, dtype=torch.bool)
    padded[:, :t] = x.isnan().any(dim=(1, 3))
    return padded.view(x.shape[0], n, TILE).any(-1)


@pytest.mark.parametrize("window", [None, 12])
def test_the_kernels_compute_exactly_the_tiles_with_an_allowed_pair(window: int) -> None:
    """Row b of the batch plants NaN in tile b of one input (every row holds the same documents); a kernel that
    reads a tile of pairs, masked or not, turns NaN (0 * NaN in its dots), so the tiles that come out NaN are the
    tiles it read. Forward (v planted per key tile), dQ (k planted) and dK (q planted per query tile) must read
    exactly the tiles holding an allowed pair: those wholly masked are skipped, and no other is."""
    lengths = [10, 30, 1, 19]  # 60 tokens: 4 tiles, the last partial; a 30-token document over three tiles
    t, n = sum(lengths), 4
    ids = rows(*[lengths] * n)
    expected = tiles_with_an_allowed_pair(document_mask(ids[:1], window)[0, 0])  # the model's mask
    assert 0 < int(expected.sum()) < n * (n + 1) // 2  # some tiles skipped beyond the causal ones
    q, k, v = (x.detach() for x in qkv(n, t, 2, 1))
    q_docs, k_docs = document_bounds(ids, ids)
    w = window or t
    planted = {name: x.clone() for name, x in (("q", q), ("k", k), ("v", v))}
    for b in range(n):
        for x in planted.values():
            x[b, :, b * TILE:(b + 1) * TILE] = float("nan")

    out, _ = _forward(q.contiguous(), k.contiguous(), planted["v"].contiguous(), True, w, 0, q_docs, k_docs)
    assert torch.equal(nan_tiles(out, t).T, expected)  # [query tile i, planted key tile b]

    o, lse = _forward(q.contiguous(), k.contiguous(), v.contiguous(), True, w, 0, q_docs, k_docs)
    do = torch.randn_like(o)
    delta = (o * do).sum(-1)
    dq, _, _ = _backward(q.contiguous(), planted["k"].contiguous(), v.contiguous(), do, lse, delta, True, w, 0,
                         q_docs, k_docs)
    assert torch.equal(nan_tiles(dq, t).T, expected)
    _, dk, _ = _backward(planted["q"].contiguous(), k.contiguous(), v.contiguous(), do, lse, delta, True, w, 0,
                         q_docs, k_docs)
    assert torch.equal(nan_tiles(dk, t), expected)  # [planted query tile b, key tile j]


def tile_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, window: int,
                   q_ids: torch.Tensor, k_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, natural-log lse) of a tile by dense masked softmax; a row that sees no key: out 0, lse -inf."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    distance = offset + torch.arange(q.shape[2])[:, None] - torch.arange(k.shape[2])[None, :]
    allowed = (distance >= 0) & (distance < window) & (q_ids[:, None, :, None] == k_ids[:, None, None, :])
    s = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~allowed, float("-inf"))
    lse = s.logsumexp(-1)
    return torch.nan_to_num(torch.softmax(s, -1)) @ v, lse


@pytest.mark.parametrize("m,n,offset,window,blind", [
    (20, 24, 24, 100, True),  # a later chunk on an earlier one: the queries of later documents see no key
    (21, 37, 16, 30, False),  # the diagonal inside the keys, odd sizes, a window
])
def test_a_context_parallel_tile_with_documents(m: int, n: int, offset: int, window: int, blind: bool) -> None:
    """`flash_attention_lse(..., documents=(q ids, k ids))`: a tile of a longer packed row, its queries' and keys'
    ids in the row's numbering (some queries see no key: their document starts after the keys), forward with the
    lse and backward from a given lse/delta, against the dense masked softmax and its autograd."""
    ids = rows([3, 30, 1, 12, 1, 40])[0]
    k_ids, q_ids = ids[None, :n], ids[None, offset:offset + m]
    q, k, v = qkv(1, m, 4, 2)[0], *qkv(1, n, 2, 2, seed=1)[1:]
    out, lse = flash_attention_lse(q.detach(), k.detach(), v.detach(), offset, window, (q_ids, k_ids))
    ref, ref_lse = tile_reference(q, k, v, offset, window, q_ids, k_ids)
    torch.testing.assert_close(out, ref.detach(), **TOLERANCE)
    torch.testing.assert_close(lse, ref_lse.detach(), **TOLERANCE)
    assert bool(ref_lse.isinf().any()) == blind and not ref_lse.isinf().all()
    do = torch.randn_like(out)
    final_lse = torch.where(lse.isinf(), 0.0, lse)  # a merged lse is finite
    got = flash_attention_lse_backward(q.detach(), k.detach(), v.detach(), do, final_lse, (do * out).sum(-1),
                                       offset, window, (q_ids, k_ids))
    for grad, ref_grad in zip(got, grads(ref, [q, k, v], do)):
        torch.testing.assert_close(grad, ref_grad, **TOLERANCE)


@pytest.mark.parametrize("reset", [True, False])
def test_rope_kernel_with_per_row_positions(reset: bool) -> None:
    """The RoPE kernel with (B, T) positions (position_reset's per-document restart) equals the model's RoPE with
    the same positions, forward and backward; without reset, (T,) positions keep working."""
    documents = rows([3, 1, 7], [11])
    positions = document_positions(documents) if reset else torch.arange(11)
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 11, 4, 8, generator=gen, requires_grad=True), \
        torch.randn(2, 11, 2, 8, generator=gen, requires_grad=True)
    ref = RotaryEmbedding(8)
    out, ref_out = RoPEKernel.from_reference(ref, "triton")(q, k, positions), ref(q, k, positions)
    cotangent = [torch.randn_like(x) for x in ref_out]
    for got, want in zip(out, ref_out):
        torch.testing.assert_close(got, want, **TOLERANCE)
    for grad, ref_grad in zip(grads(out, [q, k], cotangent), grads(ref_out, [q, k], cotangent)):
        torch.testing.assert_close(grad, ref_grad, **TOLERANCE)
    if reset:  # the second document restarts: its first token is rotated as position 0 (not at all)
        torch.testing.assert_close(out[0][0, 3], q[0, 3].detach())


def test_the_kernel_core_measures_qk_clips_maximum_within_documents() -> None:
    """QK-clip's per-head maximum logit (`LogitMaxRecord`) from the kernel's drop-in with documents is the model
    core's: over the pairs of one document only (a pair across documents would raise it here)."""
    from lit_lm.kernels.attention import CausalAttention as KernelAttention

    documents = LAYOUTS["straddling"]
    q, k, v = (x.detach() for x in qkv(*documents.shape))
    k[:, :, 5:25] = -q[:, ::2, 5:25]  # keys of document 1 opposite to their own queries: the maxima lie elsewhere
    cores = CausalAttention(6), KernelAttention.from_reference(CausalAttention(6), "triton")
    for core in cores:
        core.measure_logits = True
        core(q, k, v, documents)
    with_documents = cores[0].take_logit_max()
    torch.testing.assert_close(cores[1].take_logit_max(), with_documents)
    cores[0](q, k, v)
    assert (cores[0].take_logit_max() > with_documents).any()


def test_documents_are_refused_where_undefined() -> None:
    q = torch.randn(2, 2, 8, 16)
    with pytest.raises(ValueError, match="only defined for causal attention"):
        flash_attention(q, q, q, causal=False, documents=torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"documents \(2, 7\) must be \(batch, time\) = \(2, 8\)"):
        flash_attention(q, q, q, documents=torch.zeros(2, 7, dtype=torch.long))
