"""Which parameters an optimizer treats how: the one place that sorts a model's parameters into param groups.

    matrices    the hidden layers' weights: every parameter of the blocks with two or more dimensions except the
                MoE routers and biases. A 3-D one is a stack of matrices (an MoE layer's experts, [expert, out, in]): a
                matrix-wise optimizer (Muon) treats each [out, in] slice as its own matrix, never the stack as one.
    decay       the other parameters with two or more dimensions: the routers (and any such parameter outside
                the blocks that is not an embedding).
    no decay    norms, biases (a gpt-oss expert stack's (E, d) `gate_bias` too: E vectors, no matrix), and the
                token embedding with the LM head tied to it or not (as Moonlight and Kimi keep them out of Muon,
                and GPT-style recipes out of weight decay); LoRA's factors (`lit_lm.lora`):
                decay would pull the update B A towards zero at the run's (pre-training) rate, and a rank-r factor
                is no hidden matrix for Muon to orthogonalize.

`param_groups` returns torch param-group dicts. For an elementwise optimizer (AdamW, SGD, ...) two: decay (matrices
and the rest) and no decay, as lit-lm has always built them (a checkpoint's param groups must match the run that
resumes it). For a matrix-wise one (`split_matrices=True`: Muon) three: the matrices' group first, carrying
`"matrix": True` (the key a matrix-wise optimizer reads to know what to orthogonalize; torch's own optimizers keep
and ignore extra keys), then the other decayed parameters, then no decay. Frozen parameters are left out and empty
groups dropped, so the groups depend only on the model, its frozen set and the optimizer's kind.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lit_lm.lora import lora_factor


def is_matrix(name: str, param: nn.Parameter) -> bool:
    """A hidden layer's weight (a matrix, or a stack of them): in the blocks, >= 2-D, not a router nor a bias."""
    return name.startswith("blocks.") and param.ndim >= 2 and ".router." not in name and not is_bias(name)


def is_bias(name: str) -> bool:
    """A bias, whatever its shape: `wq.bias`, or an expert stack's (E, d) `gate_bias`, `up_bias`, `down_bias`."""
    return name.endswith((".bias", "_bias"))


def is_no_decay(name: str, param: nn.Parameter, tied: bool) -> bool:
    """Norms, biases, embeddings and LoRA factors: no weight decay. A tied head is the embedding (the last pipeline
    stage, which holds no tok_embeddings, knows it as lm_head.weight)."""
    return param.ndim < 2 or is_bias(name) or "tok_embeddings" in name or (tied and name.startswith("lm_head")) or \
        lora_factor(name) is not None


def param_groups(model: nn.Module, weight_decay: float, tied: bool, split_matrices: bool = False
                 ) -> list[dict[str, Any]]:
    """[decay, no decay (0.0)], or with `split_matrices` [matrices ("matrix": True), other decayed, no decay]; empty
    ones dropped. `model`'s parameter names are relative to the Transformer (`blocks.0.attn.wq.weight`)."""
    matrices, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if is_no_decay(name, p, tied):
            no_decay.append(p)
        elif is_matrix(name, p):
            matrices.append(p)
        else:
            decay.append(p)
    if split_matrices:
        groups = [{"params": matrices, "weight_decay": weight_decay, "matrix": True},
                  {"params": decay, "weight_decay": weight_decay}]
    else:  # in the model's order, as before the matrices had a group of their own
        groups = [{"params": [p for p in model.parameters() if any(p is q for q in matrices + decay)],
                   "weight_decay": weight_decay}]
    groups.append({"params": no_decay, "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


__all__ = ["is_bias", "is_matrix", "is_no_decay", "param_groups"]
