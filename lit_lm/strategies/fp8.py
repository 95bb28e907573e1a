"""FP8 training of the blocks' linears (`model.init_args.fp8: tensorwise | rowwise`), on `torch._scaled_mm`, with
dynamic scaling as torchao's Float8Linear recipes do:

    tensorwise  one scale per tensor (amax of the whole tensor); e4m3 weights and activations, e5m2 gradients
    rowwise     one scale per row along each GEMM's contraction dim, rounded down to a power of 2; e4m3 throughout

Each of the three GEMMs of a linear runs in FP8 (out = x W^T, grad_x = g W, grad_W = g^T x), each operand cast with
its own scale just before it (`to_fp8`); the result is in the input's dtype. Master weights stay where they were
(fp32, or whatever the precision plugin keeps), so checkpoints hold no FP8 and an FP8 run resumes without it and back.

The swap keeps the module, its parameters and state-dict keys: the instance's `forward` is replaced (`Fp8Forward`), as
activation checkpointing and compile do, and it reads `weight` at call time (ZeRO-3 gathers it just before; under
tensorwise ZeRO-3 gathers it already in FP8 with the whole weight's scale, `Fp8Forward.weight8`, which the GEMMs take
as it is: the one-process cast, bit for bit, at half bf16's bytes).
Which linears: every `nn.Linear`-like module (a `weight` of 2 dims used as `F.linear`) inside the model's blocks
whose global shape is a multiple of 16 both ways (`_scaled_mm`'s alignment on GPUs), but MoE routers (routing
decisions stay in full precision) — never the embedding, the head or the norms, which are outside the blocks or not
linears. The MoE experts (the model's `expert_plan()` modules, whose `grouped(x, w, offs)` is their grouped GEMM) get
`Fp8Grouped`: each expert's GEMMs in FP8 on its own scales (per-expert tensorwise, or rowwise), emulated as one
`Fp8Matmul` per expert's token segment — the maths of a scaled grouped GEMM, one `_scaled_mm` per group.

Scales under tensor parallelism: a scale is the amax over some dims of a tensor; where one of those dims is split
over the tp ranks, each rank holds only part of it, and the one-process scale is the max over the tp group
(`comm.all_reduce(MAX)`). The strategy says which weights are split along which dim (the tp placements it
recorded in `params.ModelSplit`) and gives the tp group: a column-parallel weight (rows split) and its output
gradient (features split), a row-parallel weight (columns split) and its input (features split). The inputs of
column-parallel linears are whole on every rank (the region's entry gathers the sequence-parallel positions first),
so their scales need nothing. Tensorwise needs the reduction for every split tensor; rowwise only where the split
dim is the contraction dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lit_lm.strategies import comm
from lit_lm.strategies.errors import ConfigError
from lit_lm.strategies.plan import ExpertModel
from lit_lm.strategies.tp_layers import ColumnParallelLinear, RowParallelLinear

RECIPES = ("tensorwise", "rowwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ALIGN = 16  # `_scaled_mm` on GPUs: both dims multiples of 16
SKIP = ("router",)  # linears kept in full precision, by the last part of their name
EPS = 1e-12
LINEARS = (nn.Linear, ColumnParallelLinear, RowParallelLinear)  # F.linear(x, weight, bias), whole or a tp shard


def check_fp8(recipe: Optional[str]) -> Optional[str]:
    if recipe is not None and recipe not in RECIPES:
        raise ConfigError(f"model.init_args.fp8={recipe!r}: choose one of {', '.join(RECIPES)} (or null: no FP8)")
    return recipe


@dataclass(frozen=True)
class Scaling:
    """How one linear's operands are scaled: the recipe, and where its weight is split over tp (`split`: 0 for
    column-parallel, rows; 1 for row-parallel, columns; None: whole) with the group its scales are reduced over."""

    recipe: str
    split: Optional[int] = None
    group: Optional[dist.ProcessGroup] = None

    @property
    def rowwise(self) -> bool:
        return self.recipe == "rowwise"

    @property
    def grad_dtype(self) -> torch.dtype:
        return E4M3 if self.rowwise else E5M2


def reduced_over_tp(dim: Optional[int], split_dim: Optional[int]) -> bool:
    """Whether an amax over `dim` (None: the whole tensor) of a tensor whose dim `split_dim` is split over tp (None:
    whole on every rank) must be all-reduced over tp to be the one-process amax."""
    return split_dim is not None and (dim is None or dim == split_dim)


@dataclass(frozen=True)
class Cast:
    """One FP8 cast of `Fp8Matmul`: its operand (x (M, K), w (N, K), g (M, N), gt (N, M)), the dim it is scaled
    along under rowwise (its GEMM's contraction dim), and its dim split over tp (None: whole on every tp rank)."""

    operand: str
    dim: int
    split: Optional[int]


def casts(split: Optional[int]) -> tuple[Cast, ...]:
    """The six casts of one forward and backward of a linear whose weight is split along `split` over tp, in
    `Fp8Matmul`'s order: out = x W^T (x, w), grad_x = g W (g, w), grad_W = g^T x (gt, x). A row-parallel input
    holds 1/tp of the K features, a column-parallel output (and its gradient) 1/tp of the N features."""
    x_split = 1 if split == 1 else None
    g_split = 1 if split == 0 else None
    return (Cast("x", 1, x_split), Cast("w", 1, split), Cast("g", 1, g_split), Cast("w", 0, split),
            Cast("gt", 1, None if g_split is None else 0), Cast("x", 0, x_split))


def tp_amax_numels(recipe: str, split: Optional[int], m: int, n: int, k: int, weight_cast: bool = True) -> list[int]:
    """The numel of each fp32 amax one forward and backward of an FP8 linear (local weight (n, k), split along
    `split` over tp; m tokens) all-reduces over tp: `amax`'s rule (`reduced_over_tp`) on each of its `casts`
    (tensorwise: a scalar per reduced cast; rowwise: a row per non-contraction index). `weight_cast`: False when
    the weight comes already cast (ZeRO-3's FP8 gather, whose engine reduces its amax once per gather)."""
    shapes = {"x": (m, k), "w": (n, k), "g": (m, n), "gt": (n, m)}
    rowwise = recipe == "rowwise"
    out = []
    for c in casts(split):
        if (c.operand != "w" or weight_cast) and reduced_over_tp(c.dim if rowwise else None, c.split):
            out.append(shapes[c.operand][1 - c.dim] if rowwise else 1)
    return out


def amax(t: Tensor, dim: Optional[int], split_dim: Optional[int], scaling: Scaling) -> Tensor:
    """|t|'s max over `dim` (None: the whole tensor), kept 2-D; reduced over the tp group when `split_dim` (the dim
    of `t` that is split over tp, or None) is among the dims it is taken over."""
    a = t.detach().abs().amax() if dim is None else t.detach().abs().amax(dim=dim, keepdim=True)
    a = a.float()
    if scaling.group is not None and reduced_over_tp(dim, split_dim):
        a = a.clone()
        comm.all_reduce(a, scaling.group, op=dist.ReduceOp.MAX, label="fp8 amax")
    return a


def to_fp8(t: Tensor, dtype: torch.dtype, a: Tensor, rowwise: bool) -> tuple[Tensor, Tensor]:
    """`t` cast to `dtype` so that |t|'s amax `a` lands on the format's largest value; (fp8 tensor, its scale: the
    fp32 factor that turns it back). Rowwise scales are rounded down to powers of 2 (exact to apply)."""
    factor = torch.finfo(dtype).max / a.clamp(min=EPS)
    if rowwise:
        factor = torch.exp2(torch.floor(torch.log2(factor)))
    fp8 = (t.float() * factor).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    return fp8, factor.reciprocal()


def scaled_mm(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a (M, K) @ b (K, N) in FP8: a row-major, b column-major (what the GPU kernels take); scales (M, 1) and (1, N),
    or scalars."""
    return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=a_scale.reshape(a_scale.shape[:2] or ()),
                            scale_b=b_scale.reshape(b_scale.shape[:2] or ()), out_dtype=out_dtype)


def _cast(t: Tensor, dtype: torch.dtype, cast: Cast, scaling: Scaling) -> tuple[Tensor, Tensor]:
    """`t` as one GEMM operand: scaled along its contraction dim (rowwise) or as a whole (tensorwise)."""
    dim = cast.dim if scaling.rowwise else None
    return to_fp8(t, dtype, amax(t, dim, cast.split, scaling), scaling.rowwise)


class Fp8Matmul(torch.autograd.Function):
    """x (M, K) @ weight (N, K)^T with the three GEMMs in FP8 (see the module docstring). `w8`, `ws`: the weight
    already in FP8 with its tensorwise scale (ZeRO-3 gathers it so, `Fp8Forward.weight8`), used as it is in
    forward and backward (both GEMMs take the same tensorwise cast); None: cast here from `weight`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, scaling: Scaling, w8: Optional[Tensor] = None,
                ws: Optional[Tensor] = None) -> Tensor:
        ctx.save_for_backward(x, weight, w8, ws)
        ctx.scaling = scaling
        cast_x, cast_w = casts(scaling.split)[:2]
        x8, xs = _cast(x, E4M3, cast_x, scaling)
        if w8 is None:
            w8, ws = _cast(weight, E4M3, cast_w, scaling)  # (N, K): rows scaled over K
        return scaled_mm(x8, w8.t(), xs, ws.t() if ws.ndim else ws, x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        x, weight, w8, ws = ctx.saved_tensors
        scaling = ctx.scaling
        cast_g, cast_w, cast_gt, cast_x = casts(scaling.split)[2:]
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # g (M, N) @ W (N, K): contraction over N
            g8, gs = _cast(grad, scaling.grad_dtype, cast_g, scaling)
            if w8 is None:
                w8, ws = _cast(weight, E4M3, cast_w, scaling)
            grad_x = scaled_mm(g8, w8, gs, ws, grad.dtype)
        if ctx.needs_input_grad[1]:  # g^T (N, M) @ x (M, K): contraction over the tokens M
            gt = grad.t()
            g8, gs = _cast(gt, scaling.grad_dtype, cast_gt, scaling)
            x8, xs = _cast(x, E4M3, cast_x, scaling)
            grad_w = scaled_mm(g8, x8, gs, xs, weight.dtype)
        return grad_x, grad_w, None, None, None


def fp8_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], scaling: Scaling,
               weight8: Optional[tuple[Tensor, Tensor]] = None) -> Tensor:
    """`F.linear` with its matmul in FP8: x (..., K), weight (N, K); `weight8`: the weight already cast (FP8, scale)."""
    w8, ws = weight8 if weight8 is not None else (None, None)
    out = Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, scaling, w8, ws).view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


class Fp8Gathered:
    """Where ZeRO-3 (tensorwise) puts a weight it gathers already in FP8 (`lit_lm/strategies/zero_engine.py`): `weight8`
    (the whole weight in e4m3, its storage freed and refilled as a gathered parameter's), `scale8` (its tensorwise
    scale: a scalar, or under `per_row` one per dim-0 row: per expert of a stacked (E, out, in) weight) and
    `filled`; the GEMMs then take them as they are, with no cast of the weight."""

    per_row = False

    def __init__(self, scaling: Scaling) -> None:
        self.scaling = scaling
        self.weight8: Optional[Tensor] = None
        self.scale8: Optional[Tensor] = None
        self.filled = False

    @property
    def gathers_fp8(self) -> bool:
        """Whether ZeRO-3 may gather this weight in FP8: one scale per tensor (rowwise scales need the whole weight's
        columns in backward, so a rowwise weight is gathered in its own dtype and cast here)."""
        return not self.scaling.rowwise


class Fp8Forward(Fp8Gathered):
    """A linear module's forward in FP8 (`module` is the linear: its weight and bias are read at every call); its
    weight gathered in FP8 by ZeRO-3 when `filled` (`Fp8Gathered`)."""

    def __init__(self, module: nn.Module, scaling: Scaling) -> None:
        super().__init__(scaling)
        self.module = module

    def __call__(self, x: Tensor) -> Tensor:
        weight8 = (self.weight8, self.scale8) if self.filled else None
        return fp8_linear(x, self.module.weight, getattr(self.module, "bias", None), self.scaling, weight8)


class Fp8Stack(Fp8Gathered):
    """A stacked expert weight (E, out, in) that ZeRO-3 gathers in FP8: each expert cast with its own tensorwise
    scale (`scale8` (E,)), as `Fp8Grouped` casts it unsharded. ZeRO shards along dim 0, so every expert is whole on
    one rank: its amax is the owner's, and one all-reduce (MAX) of the (E,) amaxes, zeros where a rank holds no
    rows, gives every rank every expert's scale."""

    per_row = True

    def __init__(self, scaling: Scaling, param: nn.Parameter) -> None:
        super().__init__(scaling)
        self.param = param


class _Experts(torch.autograd.Function):
    """The E experts of a stacked weight w (E, out, in) as E stand-ins of shape (out, in) that hold no data (ZeRO-3
    freed w's storage and gathered its FP8 copy instead): each expert's `Fp8Matmul` reads only their shape and
    dtype, and their gradients (zeros for an expert with no tokens) stack into w's."""

    @staticmethod
    def forward(ctx: Any, w: Tensor) -> tuple[Tensor, ...]:
        return tuple(w.new_zeros(()).expand(*w.shape[1:]) for _ in range(w.shape[0]))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Tensor:
        return torch.stack(grads)


class Fp8Grouped:
    """An expert module's grouped GEMM (rows offs[e-1]:offs[e] of x (n, in) times w[e]^T, w (E, out, in); rows past
    offs[-1] are in no group and come back as zeros) in FP8: each expert's segment through `Fp8Matmul` with that
    expert's scales (tensorwise: its own weight's amax and its segment's; rowwise: per row as the dense linears), so
    experts sharded over ep ranks need no reduction. On CPU (no scaled grouped GEMM kernel) this loop of per-expert
    `_scaled_mm`s is the exact reference; it reads the segment ends on the host. An empty segment is a 0-row
    full-precision matmul (no amax of nothing), giving its expert a zero gradient. Under ZeRO-3 tensorwise the
    engine gathers w in FP8 into its `Fp8Stack` (`stacks`, made by `fp8_forwards`): each expert's GEMMs take its
    e4m3 rows and scale as they are."""

    def __init__(self, scaling: Scaling) -> None:
        self.scaling = scaling
        self.stacks: dict[str, Fp8Stack] = {}  # by the parameter's name in its module

    def __call__(self, x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        stack = next((s for s in self.stacks.values() if s.filled and s.param is w), None)
        experts = _Experts.apply(w) if stack is not None else w
        pieces, start = [], 0
        for e, end in enumerate(offs.tolist()):
            seg = x[start:end]
            if stack is not None:
                cast = (stack.weight8[e], stack.scale8[e])
                pieces.append(fp8_linear(seg, experts[e], None, self.scaling, cast) if end > start
                              else x.new_zeros(0, w.shape[1]))
            else:
                pieces.append(fp8_linear(seg, w[e], None, self.scaling) if end > start else seg @ w[e].t().to(x.dtype))
            start = end
        if start < x.shape[0]:
            pieces.append(x.new_zeros(x.shape[0] - start, w.shape[1]))
        return torch.cat(pieces)


def fp8_experts(model: nn.Module) -> dict[str, nn.Module]:
    """The expert modules of `model` (an `ExpertModel`) FP8 swaps, by name: those with a `grouped` GEMM whose
    parameters' per-expert dims are multiples of `ALIGN`."""
    names = model.expert_plan() if isinstance(model, ExpertModel) else {}
    out = {}
    for name in names:
        module = model.get_submodule(name)
        if hasattr(module, "grouped") and all(n % ALIGN == 0 for p in module.parameters() for n in p.shape[1:]):
            out[name] = module
    return out


def weight_to_fp8(t: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """A weight (or a dim-0 shard of it) in e4m3 with the tensorwise scale of amax `a` (the whole weight's; or
    broadcast along dim 0, one per expert): the cast `Fp8Matmul` makes of the whole weight, element for element."""
    return to_fp8(t, E4M3, a, rowwise=False)


def weight_scale(a: Tensor) -> Tensor:
    """The scale `weight_to_fp8` gives for amax `a` (elementwise): what every rank needs of a weight it did not cast."""
    return to_fp8(a.new_zeros(()), E4M3, a, rowwise=False)[1]


def fp8_forwards(model: nn.Module) -> dict[nn.Parameter, Fp8Gathered]:
    """The FP8 weights of `model` that ZeRO-3 gathers in FP8 (`Fp8Gathered.gathers_fp8`), by parameter: the
    linears' (their `Fp8Forward`) and the experts' stacked weights (an `Fp8Stack` each, made here for the
    parameters the module holds now)."""
    out: dict[nn.Parameter, Fp8Gathered] = {}
    for module in model.modules():
        fwd = module.__dict__.get("forward")
        if isinstance(fwd, Fp8Forward) and fwd.gathers_fp8:
            out[module.weight] = fwd
        grouped = module.__dict__.get("grouped")
        if isinstance(grouped, Fp8Grouped) and not grouped.scaling.rowwise:
            for name, p in module.named_parameters(recurse=False):
                grouped.stacks[name] = out[p] = Fp8Stack(grouped.scaling, p)
    return out


def fp8_linears(model: nn.Module, global_shapes: Optional[dict[str, tuple[int, ...]]] = None) -> dict[str, nn.Module]:
    """The linears of `model`'s blocks that FP8 swaps, by name: `LINEARS` whose global shape (`global_shapes[name +
    ".weight"]`, else the local one) is of multiples of `ALIGN`, not `SKIP`ped."""
    shapes = global_shapes or {}
    out = {}
    for name, module in model.named_modules():
        if not name.startswith("blocks.") or name.rsplit(".", 1)[-1] in SKIP:
            continue
        if not isinstance(module, LINEARS):
            continue
        shape = tuple(shapes.get(f"{name}.weight", module.weight.shape))
        if all(n % ALIGN == 0 for n in shape):
            out[name] = module
    return out


def apply_fp8(model: nn.Module, recipe: Optional[str], splits: Optional[dict[str, tuple[int, tuple[int, ...]]]] = None,
              group: Optional[dist.ProcessGroup] = None) -> list[str]:
    """Swap `model`'s block linears (and its experts' grouped GEMMs) for FP8 ones, in place; the names swapped.
    `splits`: the tp-split weights by name (relative to `model`) -> (split dim, global shape); `group`: the tp group
    their scales are reduced over."""
    if check_fp8(recipe) is None:
        return []
    splits = splits or {}
    shapes = {name: shape for name, (_, shape) in splits.items()}
    swapped = []
    for name, module in fp8_linears(model, shapes).items():
        if isinstance(module.__dict__.get("forward"), Fp8Forward):
            continue
        split = splits.get(f"{name}.weight", (None, None))[0]
        module.forward = Fp8Forward(module, Scaling(recipe, split, group if split is not None else None))
        swapped.append(name)
    for name, module in fp8_experts(model).items():
        if not isinstance(module.__dict__.get("grouped"), Fp8Grouped):
            module.grouped = Fp8Grouped(Scaling(recipe))
            swapped.append(name)
    return swapped

