"""Each Triton kernel against its PyTorch reference, forward and backward, under the Triton interpreter.

Shapes are tiny and deliberately awkward (non-powers of two, tails that do not fill a tile, batch 1, GQA ratios
1/2/4). The low-precision kernels are compared with the reference evaluated in fp32 on the same rounded inputs.
bf16 is not run through `tl.dot` here: the interpreter (Triton 3.x) multiplies bf16 tiles as raw uint16 bits,
so attention and matmul are checked in fp32 and fp16 on CPU and in bf16 only on a GPU.
"""

import os
from typing import Callable, Sequence

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (kernels import it lazily)

import pytest

from lit_lm.kernels.runtime import interpreting

if not interpreting():  # triton was imported before this line, in compiled mode (`import lightning` does that)
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported: set it in the environment or tests/conftest.py",
                allow_module_level=True)

import torch

from lit_lm.kernels import matmul as matmul_module
from lit_lm.kernels import rmsnorm as rmsnorm_module
from lit_lm.kernels.attention import _attn_bwd_delta, _grid, _launch_config, _program, _strides, attention_reference, \
    flash_attention
from lit_lm.kernels.cross_entropy import cross_entropy, cross_entropy_reference
from lit_lm.kernels.gelu import gelu, gelu_reference
from lit_lm.kernels.matmul import matmul, matmul_reference
from lit_lm.kernels.rmsnorm import rmsnorm, rmsnorm_reference
from lit_lm.kernels.rope import RotaryEmbedding, rope, rope_reference
from lit_lm.kernels.runtime import cdiv, dot_precision
from lit_lm.kernels.softmax import softmax, softmax_reference
from lit_lm.kernels.swiglu import swiglu, swiglu_reference
from lit_lm.strategies.cp import block_backward, block_backward_reference, block_forward, block_forward_reference

TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def assert_matches(kernel: Callable, reference: Callable, inputs: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
    """kernel(*inputs in dtype) == reference(*same values in fp32): every output and every input gradient."""
    torch.manual_seed(1)
    low = [x.to(dtype).requires_grad_() for x in inputs]
    high = [x.detach().float().requires_grad_() for x in low]
    outs, ref_outs = kernel(*low), reference(*high)
    outs = outs if isinstance(outs, tuple) else (outs,)
    ref_outs = ref_outs if isinstance(ref_outs, tuple) else (ref_outs,)
    for out, ref in zip(outs, ref_outs):
        assert out.dtype == dtype or out.dtype == torch.float32
        torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])
    cotangents = [torch.randn_like(ref) for ref in ref_outs if ref.requires_grad]
    grads = torch.autograd.grad([o for o in outs if o.requires_grad], low, [c.to(dtype) for c in cotangents])
    ref_grads = torch.autograd.grad([o for o in ref_outs if o.requires_grad], high, cotangents)
    for grad, ref, x in zip(grads, ref_grads, low):
        assert grad.dtype == x.dtype and grad.shape == x.shape
        torch.testing.assert_close(grad.float(), ref, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 37), (2, 5, 100), (3, 4, 2, 8)])
def test_rmsnorm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = torch.randn(shape)
    w = 1 + 0.1 * torch.randn(shape[-1])
    assert_matches(lambda x, w: rmsnorm(x, w, 1e-5), lambda x, w: rmsnorm_reference(x, w, 1e-5), [x, w], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [12288, 16000, 16384, 20000])
def test_rmsnorm_wide_rows(d: int, dtype: torch.dtype) -> None:
    """Real hidden sizes: the forward holds up to 16384 columns in one block and walks wider rows in chunks
    (20000: two, the last masked); the backward walks 4096-column chunks (12288: three full ones, 16000: a masked
    tail) with its dw partials in memory. 5 rows over 4 programs: a program sums two rows, one none."""
    x = torch.randn(5, d)
    w = 1 + 0.1 * torch.randn(d)
    assert_matches(lambda x, w: rmsnorm(x, w, 1e-5), lambda x, w: rmsnorm_reference(x, w, 1e-5), [x, w], dtype)


@pytest.mark.parametrize("d", [37, 4096, 12288, 16000, 16384, 20000])
def test_rmsnorm_launch_config_fits_a_gpu_block(d: int) -> None:
    """Warps a GPU block can hold (at most 32, 1024 threads), a power-of-2 block covering the row in whole chunks,
    16 columns per thread at wide rows (the register budget in lit_lm/kernels/rmsnorm.py); rows up to 16384 are one
    block forward, rows past 4096 are chunked backward."""
    for max_block in (rmsnorm_module.FORWARD_MAX_BLOCK, rmsnorm_module.BACKWARD_MAX_BLOCK):
        cfg = rmsnorm_module._launch_config(d, max_block)
        block, warps = cfg["BLOCK"], cfg["num_warps"]
        assert block & (block - 1) == 0 and block <= max_block and 4 <= warps <= 32
        assert cfg["ONE_BLOCK"] == (d <= block) and (cfg["ONE_BLOCK"] or block == max_block)
        assert block <= 32 * warps * rmsnorm_module.ELEMENTS_PER_THREAD
    assert rmsnorm_module._launch_config(d, rmsnorm_module.FORWARD_MAX_BLOCK)["ONE_BLOCK"] == (d <= 16384)
    assert rmsnorm_module._launch_config(d, rmsnorm_module.BACKWARD_MAX_BLOCK)["ONE_BLOCK"] == (d <= 4096)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 37, 50), (3, 700)])  # 2100 elements: three 1024-blocks, masked tail
def test_swiglu(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    assert_matches(swiglu, swiglu_reference, [torch.randn(shape), torch.randn(shape)], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,t,hq,hkv,d", [(1, 37, 4, 2, 8), (1, 100, 3, 3, 6), (2, 5, 4, 1, 32)])
def test_rope(b: int, t: int, hq: int, hkv: int, d: int, dtype: torch.dtype) -> None:
    cos, sin = RotaryEmbedding(d).cos_sin(t, torch.device("cpu"))
    assert_matches(lambda q, k: rope(q, k, cos, sin),
                   lambda q, k: (rope_reference(q, cos, sin), rope_reference(k, cos, sin)),
                   [torch.randn(b, t, hq, d), torch.randn(b, t, hkv, d)], dtype)


def test_rope_backward_is_inverse_rotation() -> None:
    """Rotating by the angle and then back is the identity: the backward kernel is the forward with -sin."""
    q, k = torch.randn(2, 37, 4, 8, requires_grad=True), torch.randn(2, 37, 2, 8, requires_grad=True)
    cos, sin = RotaryEmbedding(8).cos_sin(37, torch.device("cpu"))
    rq, rk = rope(q, k, cos, sin)
    dq, dk = torch.autograd.grad((rq, rk), (q, k), (rq.detach(), rk.detach()))
    torch.testing.assert_close(dq, q.detach(), **TOLERANCE[torch.float32])
    torch.testing.assert_close(dk, k.detach(), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
@pytest.mark.parametrize("vocab,block_v", [(100, 32), (61, None)])  # 4 chunks with a tail; one masked chunk
def test_cross_entropy(vocab: int, block_v: int, z_loss: float, dtype: torch.dtype) -> None:
    targets = torch.randint(0, vocab, (2, 9))
    targets[0, :4] = -100
    assert_matches(lambda x: cross_entropy(x, targets, z_loss, block_v),
                   lambda x: cross_entropy_reference(x, targets, z_loss), [3 * torch.randn(2, 9, vocab)], dtype)


def test_cross_entropy_gradient_keeps_logits_dtype() -> None:
    logits = torch.randn(5, 70, dtype=torch.bfloat16, requires_grad=True)
    loss, ce = cross_entropy(logits, torch.randint(0, 70, (5,)), 1e-4, block_v=16)
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16 and not ce.requires_grad


ATTENTION_CASES = [  # batch, q heads, kv heads, seq len, head dim, causal, window
    (1, 2, 2, 37, 16, True, None),
    (2, 4, 2, 100, 32, True, None),
    (1, 4, 1, 37, 8, False, None),
    (1, 4, 2, 100, 16, True, 20),
    (1, 2, 1, 33, 64, True, 5),
    (1, 1, 1, 20, 128, True, None),
]
SMALL_ATTENTION_CASES = [case for case in ATTENTION_CASES if case[3] * case[4] <= 2000]  # fp16 dots are slow here


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: padded tail rows divide by 0, masked afterwards
@pytest.mark.parametrize("b,hq,hkv,t,d,causal,window,dtype",
                         [(*case, torch.float32) for case in ATTENTION_CASES]
                         + [(*case, torch.float16) for case in SMALL_ATTENTION_CASES])
def test_flash_attention(b: int, hq: int, hkv: int, t: int, d: int, causal: bool, window: int,
                         dtype: torch.dtype) -> None:
    # q/k/v as the model produces them: (B, T, H, D) storage viewed as (B, H, T, D).
    q, k, v = (torch.randn(b, t, h, d).transpose(1, 2) for h in (hq, hkv, hkv))
    assert_matches(lambda q, k, v: flash_attention(q, k, v, causal, window),
                   lambda q, k, v: attention_reference(q, k, v, causal, window), [q, k, v], dtype)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: padded tail rows divide by 0, masked afterwards
@pytest.mark.parametrize("m,n,offset,window", [
    (16, 20, 0, None),  # the diagonal at 0, more keys than queries
    (12, 24, 30, None),  # every pair visible (a later chunk on an earlier one)
    (20, 16, 5, 8),  # a window: the last rows see no key at all (out 0, lse -inf)
    (7, 33, 10, 13),  # odd sizes crossing tile edges
])
def test_flash_attention_tile_matches_the_cp_reference(m: int, n: int, offset: int, window: int) -> None:
    """A context-parallel tile (queries `offset` positions after the first key) with its log-sum-exp, and its
    backward from a given lse/delta, as lit_lm/strategies/cp.py runs them, against its PyTorch reference."""
    gen = torch.Generator().manual_seed(m * n + offset)
    q, do = torch.randn(2, 1, 2, 2, m, 16, generator=gen)  # (B, Hkv, G, M, D): 2 query heads per kv head
    k, v = torch.randn(2, 1, 2, n, 16, generator=gen)
    w = window or offset + m
    out, lse = block_forward(q, k, v, offset, w, backend="triton")
    ref_out, ref_lse = block_forward_reference(q, k, v, offset, w)
    torch.testing.assert_close(out, ref_out, **TOLERANCE[torch.float32])
    torch.testing.assert_close(lse, ref_lse, **TOLERANCE[torch.float32])  # -inf where a row sees nothing
    final_lse = torch.where(ref_lse.isinf(), 0.0, ref_lse)  # a merged lse is finite
    delta = (do * ref_out).sum(-1)
    grads = block_backward(q, k, v, do, final_lse, delta, offset, w, backend="triton")
    for grad, ref in zip(grads, block_backward_reference(q, k, v, do, final_lse, delta, offset, w)):
        torch.testing.assert_close(grad, ref, **TOLERANCE[torch.float32])


CUDA_GRID_LIMITS = (2**31 - 1, 65_535, 65_535)  # programs per grid axis 0, 1, 2


@pytest.mark.parametrize("b,h,t,block", [
    (1024, 128, 4096, 128),  # B x H = 131,072: past axis 1's 65,535
    (1023, 131, 1000, 64),  # odd everything, a tail row block
    (1, 65_537, 17, 16),
    (7, 3, 1, 16),  # a single row
])
def test_attention_grid_respects_cuda_limits_and_covers_each_block_once(b: int, h: int, t: int, block: int) -> None:
    """The launch grid fits CUDA's per-axis limits at any B x H, and its program ids decode (as the kernels do) to
    every (row block, batch x head) pair exactly once."""
    grid = _grid(t, block, b * h)
    assert 1 <= len(grid) <= 3 and all(0 < n <= limit for n, limit in zip(grid, CUDA_GRID_LIMITS))
    row_blocks = cdiv(t, block)
    row_block, bh = _program(torch.arange(grid[0]), t, block)
    assert 0 <= row_block.min() and row_block.max() < row_blocks and 0 <= bh.min() and bh.max() < b * h
    hits = torch.bincount(bh * row_blocks + row_block, minlength=row_blocks * b * h)
    assert hits.numel() == row_blocks * b * h and bool((hits == 1).all())


def test_launch_grids_refuse_what_cuda_would() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        _grid(2**20, 16, 2**20)  # 2^36 programs
    cfg = matmul_module._launch_config(torch.bfloat16, gpu=True)
    assert matmul_module._grid(2**20, 2**17, cfg) == (2**13 * 2**10,)  # tokens x vocab logits: one axis
    with pytest.raises(ValueError, match="CUDA"):
        matmul_module._grid(2**26, 2**20, cfg)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: padded tail rows divide by 0, masked afterwards
def test_attention_programs_map_back_to_their_row_block_and_head() -> None:
    """One kernel, launched on `_grid` and nothing else, writes every (batch, head, row) exactly where it belongs:
    3 batches x 5 heads x 3 row blocks of 16 (37 rows: a tail). A wrong decoding leaves NaNs or misplaced rows."""
    o, do = torch.randn(2, 3, 5, 37, 16)
    delta = torch.full((3, 5, 37), float("nan"))
    cfg = _launch_config(16, torch.float32, gpu=False)
    _attn_bwd_delta[_grid(37, cfg["BLOCK_M"], 3 * 5)](o, do, delta, *_strides(o, do), 5, 37, 16,
                                                       BLOCK_M=cfg["BLOCK_M"], BLOCK_D=cfg["BLOCK_D"])
    torch.testing.assert_close(delta, (o * do).sum(-1), **TOLERANCE[torch.float32])


def test_dot_precision_is_ieee_for_fp32_only() -> None:
    """fp32 operands must not be rounded to TF32 (10 mantissa bits) on a GPU; 16-bit ones keep Triton's default.
    That the kernels pass it to every `tl.dot` is checked on the built IR (tests/test_kernels_build.py)."""
    assert dot_precision(torch.float32) == "ieee"
    assert dot_precision(torch.bfloat16) == dot_precision(torch.float16) == "tf32"
    assert _launch_config(64, torch.float32, gpu=True)["DOT_PRECISION"] == "ieee"
    assert _launch_config(64, torch.bfloat16, gpu=True)["DOT_PRECISION"] == "tf32"


def test_flash_attention_rejects_bad_shapes() -> None:
    q, k = torch.randn(1, 3, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="divide"):
        flash_attention(q, k, k)
    with pytest.raises(ValueError, match="causal"):
        flash_attention(q, q, q, causal=False, window=4)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: exp overflows to inf in sigmoid, giving 0
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu(dtype: torch.dtype) -> None:
    assert_matches(gelu, gelu_reference, [3 * torch.randn(3, 700)], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 37), (2, 3, 100)])
def test_softmax(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    assert_matches(softmax, softmax_reference, [3 * torch.randn(shape)], dtype)


@pytest.mark.parametrize("m,k,n,dtype", [
    (37, 20, 50, torch.float32),
    (200, 20, 40, torch.float32),  # 13 x 3 tiles: more tile rows than GROUP_M, a partial last group
    (70, 33, 100, torch.float16),
])
def test_matmul(m: int, k: int, n: int, dtype: torch.dtype) -> None:
    assert_matches(matmul, matmul_reference, [torch.randn(m, k), torch.randn(k, n)], dtype)


def test_rope_kernel_tables_are_built_where_the_positions_are() -> None:
    """The rope kernel's tables for a cp rank's positions (new every step under the balanced split) and per-row
    positions never read the positions to the host: the meta device refuses any copy out of it."""
    rope = RotaryEmbedding(8, backend="reference")
    positions = torch.arange(6, device="meta")
    cos, _ = rope.cos_sin_at(positions, torch.device("meta"))
    assert cos.shape == (6, 4) and cos.device.type == "meta"
    assert rope.row_tables(positions.view(2, 3))[0].shape == (2, 3, 4)
    on_cpu = rope.cos_sin_at(torch.tensor([4, 0, 2]), torch.device("cpu"))
    assert all(torch.equal(a, b[[4, 0, 2]]) for a, b in zip(on_cpu, rope.cos_sin(5, torch.device("cpu"))))
