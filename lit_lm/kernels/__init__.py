"""Triton kernels with their PyTorch references and drop-in modules, swapped into a model by `apply`.

Each kernel file holds the Triton kernel(s), a `torch.autograd.Function` with forward and backward, the PyTorch
reference it must match, and (for the layers of `lit_lm.model`) a module with the same parameters and state-dict
keys as the layer it replaces, so checkpoints load with or without kernels. Triton itself is imported only when
a kernel first runs (see `lit_lm.kernels.runtime`), so this package imports anywhere.
"""

from __future__ import annotations

from torch import nn

from lit_lm.kernels.attention import CausalAttention
from lit_lm.kernels.cross_entropy import LMLoss
from lit_lm.kernels.rmsnorm import RMSNorm
from lit_lm.kernels.rope import RotaryEmbedding
from lit_lm.kernels.runtime import check_backend, register_ops
from lit_lm.kernels.swiglu import SwiGLU

# kernel name -> (class name in lit_lm.model, drop-in replacement). Named, not imported: lit_lm/kernels/ never imports
# lit_lm/ (the layering contract in pyproject.toml), lit_lm imports kernels.
MODEL_MODULE = "lit_lm.model"
KERNELS: dict[str, tuple[str, type[nn.Module]]] = {
    "rmsnorm": ("RMSNorm", RMSNorm),
    "swiglu": ("SwiGLU", SwiGLU),
    "rope": ("RotaryEmbedding", RotaryEmbedding),
    "attention": ("CausalAttention", CausalAttention),
    "cross_entropy": ("LMLoss", LMLoss),
}


def apply(model: nn.Module, names: list[str], backend: str = "auto") -> nn.Module:
    """Replace, in place, every `lit_lm.model` layer named by `names` with its kernel module; returns `model`.

    Parameters are moved over as the same `Parameter` objects, so state-dict keys, optimizer state and weight tying
    are unchanged. `backend`: "auto" runs Triton on CUDA tensors (or under TRITON_INTERPRET=1) and the PyTorch
    reference elsewhere, "triton"
    always runs Triton (on CPU only under TRITON_INTERPRET=1), "reference" always runs the reference.
    Only exact types are matched, so subclasses (e.g. tensor-parallel variants) are left alone.
    """
    unknown = sorted(set(names) - KERNELS.keys())
    if unknown:
        raise ValueError(f"unknown kernel name(s) {unknown}: valid names are {', '.join(KERNELS)}")
    check_backend(backend)
    register_ops()  # before a compile traces the blocks (lit_lm.kernels.runtime.Op)
    swaps = {f"{MODEL_MODULE}.{KERNELS[name][0]}": KERNELS[name][1] for name in names}
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            kind = f"{type(child).__module__}.{type(child).__qualname__}"
            if kind in swaps:
                setattr(parent, child_name, swaps[kind].from_reference(child, backend))
    return model


__all__ = ["KERNELS", "apply", "CausalAttention", "LMLoss", "RMSNorm", "RotaryEmbedding", "SwiGLU"]
