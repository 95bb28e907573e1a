"""Activation checkpointing per block (`activation_checkpointing: none | full | selective`): keep less for the
backward, run part of the forward again instead (Chen et al., 2016; Korthikanti et al., 2022).

    none        autograd keeps every tensor the block's backward reads (the baseline)
    full        keeps the block's input only; the backward first runs the whole block forward again
    selective   keeps the block's input and the outputs of its matmuls and attention kernels (`SAVED_OPS`); the
                backward recomputes only the cheap ops between them (norms, activations, RoPE, routing,
                elementwise), so it never runs a matmul twice

A block is checkpointed *inside* its module: the instance's `forward` becomes a `Checkpointed` that runs the class's
forward under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`. The module tree, parameter names and
state-dict keys do not change, and hooks registered on the block itself (ZeRO-3's gather before the forward, free
after it, gather again before its backward) fire once per forward, outside the recomputation. Hooks on submodules
(the tensor-parallel regions' collectives, expert parallelism's all-to-alls) are inside: the recomputation issues
them again, in the same order on every rank (Megatron's full recompute does the same).

Non-reentrant checkpointing records the autograd graph as usual and only replaces the saved tensors by handles that
the recomputation fills, so a tensor that leaves the block by another way than its output (an MoE layer's
auxiliary loss, kept on the module) still gets its gradient. A layer whose forward has side effects must make them
once: `recomputing()` tells it that its forward runs again inside a backward.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective")

_aten = torch.ops.aten
# What `selective` keeps: every matmul and fused attention kernel, as the dispatcher sees them (below autograd,
# where nn.Linear / F.linear / matmul have already become mm, addmm or bmm plus views, and F.scaled_dot_product_
# attention one of the fused kernels; its math fallback becomes bmm + softmax, whose bmm outputs are kept).
SAVED_OPS = frozenset({
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._grouped_mm.default,  # the MoE experts' matmuls (lit_lm.moe.grouped_linear)
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
})


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown activation_checkpointing {mode!r}: choose one of {', '.join(MODES)}")
    return mode


def recomputing() -> bool:
    """True while a forward runs inside a backward pass, i.e. activation checkpointing recomputes it (autograd runs
    no module forward otherwise). Grad mode tells the recomputation (which enables it) from the backward's own ops."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep `SAVED_OPS` outputs, except inside a custom autograd function's forward (it runs with grad disabled and
    saves what its backward needs itself): there the cache would hold its internals, e.g. context parallelism's
    attention score tiles, O(T^2), more than no checkpointing keeps. Such a function is recomputed whole."""
    keep = op in SAVED_OPS and torch.is_grad_enabled()
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed:
    """A block's forward under activation checkpointing: `forward` is the block's own (bound) forward."""

    def __init__(self, forward: Callable[..., Any], mode: str) -> None:
        self.forward, self.mode = forward, mode
        # `full` passes no context_fn: under torch.compile dynamo reads an explicit one (even the no-op default, an
        # attribute here) as a lazy variable it cannot trace in torch 2.13, and checkpoints vanilla without it
        self._context_fn = partial(create_selective_checkpoint_contexts, _selective_policy) \
            if mode == "selective" else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation, generation: nothing is saved anyway
            return self.forward(*args, **kwargs)
        if self._context_fn is None:
            return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, context_fn=self._context_fn, **kwargs)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Checkpoint every block of `model` (a `lit_lm.strategies.plan.BlockModel`) in `mode`, in place. Applying it again
    (Lightning sets up again for validate after fit) re-wraps the original forward: never twice; "none" does
    nothing."""
    if check_mode(mode) == "none":
        return
    if not isinstance(getattr(model, "blocks", None), nn.ModuleDict):
        raise TypeError(f"activation_checkpointing wraps a model's `blocks` (lit_lm.strategies.plan.BlockModel): "
                        f"{type(model).__name__} has none; use activation_checkpointing: none")
    for block in model.blocks.values():
        current = block.__dict__.get("forward")
        original = current.forward if isinstance(current, Checkpointed) else block.forward
        block.forward = Checkpointed(original, mode)


class ActivationMemory(TorchDispatchMode):
    """Measures activation memory: the bytes of every storage created by an op of a forward, or of a recomputation
    inside the backward, while it is alive. Storages that existed before (parameters, inputs made outside) and the
    backward's own gradients are not counted.

        with ActivationMemory() as mem:
            out = blocks(x)
            kept = mem.live - out.untyped_storage().nbytes()   # what the forward leaves for the backward
            out.backward(grad)
        mem.peak                                               # the most alive at once (the output included)
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if torch._C._current_graph_task_id() == -1 or recomputing():
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, Tensor) and t.device.type != "meta":
                    self._track(t.untyped_storage(), inputs)
        return out

    def _track(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in inputs or key in self._tracked:  # a view or an in-place result: not new memory
            return
        self._tracked.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._tracked.discard(key)
        self.live -= size
