"""LoRA (Hu et al., 2021): low-rank adapters on the blocks' linears, every other weight frozen.

    y = x W^T (+ b)  +  s · dropout(x) A^T B^T,      A: (r, in),  B: (out, r),  s = alpha / r

B starts at zero, so the adapted model computes exactly what the base model does until the first update; A starts
as PEFT's (Kaiming-uniform, U(-1/sqrt(in), 1/sqrt(in))), drawn from (init seed, name) like every parameter of the
model (`Transformer.init_parameter`), so a ZeRO-3 or pipeline rank that materialises its part from the meta device
gets the one-process values. Only the factors train: the base weights (and embeddings, norms, head, routers) have
`requires_grad=False`, so every strategy holds them without gradients or optimizer state (docs/finetune.md).

Targets (`LoRA.targets`), in every block:

    q, k, v, o        attn.wq, attn.wk, attn.wv, attn.wo
    gate, up, down    a dense block's mlp.w_gate / w_up / w_down; in an MoE block the shared experts' (a plain
                      SwiGLU) and, per routed expert, the stacked experts' (`LoRAExperts`)

MoE experts get one adapter *per expert* (stacked like the expert weights: A (E, r, in), B (E, out, r)): an expert
is a weight of its own, so its adapter is too (what PEFT puts on Mixtral's per-expert w1/w2/w3 modules), and the
factors then shard with their experts under expert parallelism (`lit_lm.strategies.experts` cuts every expert
parameter along dim 0) with no collective of their own; one adapter shared by all experts would be a replicated
parameter whose gradient is partial over the ep group. Routers are never adapted.

The adapted linears keep their parameter names (`blocks.0.attn.wq.weight`) and add `lora_A` / `lora_B` beside
them (`blocks.0.attn.wq.lora_A`; an expert stack's `blocks.1.mlp.experts.w_gate_lora_A`), so a checkpoint of the
base model loads into the adapted one, and the export can merge or name them (`merge_adapters`, `lit_lm.hf.peft`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_lm.config import ConfigError
from lit_lm.moe import MoE, GroupedExperts, grouped_linear

# target -> (the module under a block, the projection's name in an expert stack)
TARGETS = {"q": "attn.wq", "k": "attn.wk", "v": "attn.wv", "o": "attn.wo",
           "gate": "w_gate", "up": "w_up", "down": "w_down"}
MLP = ("gate", "up", "down")


@dataclass(frozen=True)
class LoRA:
    """`model.init_args.lora`: low-rank adapters (`lit_lm.lora`, docs/finetune.md).

    Args:
        rank: r, the adapters' inner dimension.
        alpha: the update is scaled by alpha / r.
        targets: which linears of every block: q, k, v, o, gate, up, down.
        dropout: dropout on the adapters' input (0: none).
    """

    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    dropout: float = 0.0

    def __post_init__(self) -> None:
        key = "model.init_args.lora"
        object.__setattr__(self, "targets", tuple(self.targets))
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            raise ConfigError(f"{key}.targets: {'unknown ' + ', '.join(map(str, unknown)) if unknown else 'empty'}; "
                              f"choose from {', '.join(TARGETS)}")
        if self.rank < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ConfigError(f"{key}: rank={self.rank}, alpha={self.alpha}, dropout={self.dropout}; need rank >= 1, "
                              "alpha > 0 and 0 <= dropout < 1")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def lora_from(value: "LoRA | dict | None") -> Optional[LoRA]:
    """The module's `lora` argument, also as a checkpoint's hyper-parameters store it (`lora_hparams`)."""
    if isinstance(value, dict):
        return LoRA(**{k: v for k, v in value.items() if k in LoRA.__dataclass_fields__})
    return value


def lora_hparams(lora: Optional[LoRA], base_model: Optional[str]) -> Optional[dict]:
    """`lora` as plain types for a checkpoint, with the Hugging Face folder it adapts (`init_from`, or None) as
    `base_model`: the PEFT export's `base_model_name_or_path`."""
    if lora is None:
        return None
    return {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets), "dropout": lora.dropout,
            "base_model": base_model}


def lora_factor(name: str) -> Optional[str]:
    """"A" or "B" for a LoRA factor's parameter name (`...wq.lora_A`, `...experts.w_up_lora_B`), else None."""
    leaf = name.rpartition(".")[2]
    return leaf[-1] if leaf.endswith(("lora_A", "lora_B")) else None


def init_factor(tensor: Tensor, factor: str, generator: torch.Generator) -> None:
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) (in: the last dim; an expert stack's too), B = 0."""
    with torch.no_grad():
        if factor == "B":
            tensor.zero_()
            return
        bound = 1 / math.sqrt(tensor.shape[-1])
        tensor.copy_(torch.empty(tensor.shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator))


class LoRALinear(nn.Module):
    """A linear with an adapter: F.linear(x, weight, bias) + s (dropout(x) A^T) B^T. It holds the base linear's own
    `weight` and `bias` Parameters (same names). Under tensor parallelism the strategy cuts `weight` and one factor
    in place (`lit_lm.strategies.tp_layers`): the forward is the same on a shard."""

    def __init__(self, weight: nn.Parameter, bias: Optional[nn.Parameter], rank: int, scaling: float,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        out_features, in_features = weight.shape
        like = dict(device=weight.device, dtype=weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, **like))
        self.lora_B = nn.Parameter(torch.empty(out_features, rank, **like))
        self.scaling = scaling
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias) + self.scaling * F.linear(
            F.linear(self.dropout(x), self.lora_A), self.lora_B)


class LoRAExperts(GroupedExperts):
    """`GroupedExperts` with a per-expert adapter on the chosen projections: `{proj}_lora_A` (E, r, in) and
    `{proj}_lora_B` (E, out, r) beside each stacked `{proj}` (E, out, in); expert e's rows get
    x w[e]^T + s (x A[e]^T) B[e]^T, each term one grouped GEMM over the same segments. It adopts the base module's
    parameters and settings (gpt-oss's biases and clamp included) and runs its forward: only `grouped`, the GEMM of
    one projection, adds the adapter of that projection."""

    def __init__(self, base: GroupedExperts, projections: tuple[str, ...], rank: int, scaling: float,
                 dropout: float = 0.0) -> None:
        nn.Module.__init__(self)
        for name, value in vars(base).items():  # settings (biases, limit, alpha, ...)
            if not name.startswith("_") and name != "training":
                setattr(self, name, value)
        for name, p in base.named_parameters(recurse=False):  # the base's Parameters, not new ones
            setattr(self, name, p)
        self.projections, self.scaling = projections, scaling
        for proj in projections:
            w = getattr(self, proj)
            like = dict(device=w.device, dtype=w.dtype)
            setattr(self, f"{proj}_lora_A", nn.Parameter(torch.empty(w.shape[0], rank, w.shape[2], **like)))
            setattr(self, f"{proj}_lora_B", nn.Parameter(torch.empty(w.shape[0], w.shape[1], rank, **like)))
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def grouped(self, x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        """x w^T per segment, plus the adapter's s (x A^T) B^T when `w` is an adapted projection."""
        y = grouped_linear(x, w, offs)
        proj = next((p for p in self.projections if getattr(self, p) is w), None)
        if proj is None:
            return y
        a, b = getattr(self, f"{proj}_lora_A"), getattr(self, f"{proj}_lora_B")
        return y + self.scaling * grouped_linear(grouped_linear(self.dropout(x), a, offs), b, offs)


def add_adapters(model: nn.Module, lora: LoRA) -> list[str]:
    """Put `lora`'s adapters on every block of a `Transformer` (built, or on the meta device), in place, and freeze
    everything else; returns the adapters' parameter names. A model that is not on the meta device gets the
    factors' initial values now (`model.init_parameter`); otherwise the strategy materialises them by name."""
    scaling = lora.scaling
    for block in model.blocks.values():
        for target in lora.targets:
            if target in MLP and isinstance(block.mlp, MoE):
                if block.mlp.shared is not None:
                    _adapt_linear(block.mlp.shared, TARGETS[target], lora)
                continue
            _adapt_linear(block, TARGETS[target] if target not in MLP else f"mlp.{TARGETS[target]}", lora)
        if isinstance(block.mlp, MoE):
            projections = tuple(TARGETS[t] for t in MLP if t in lora.targets)
            if projections:
                block.mlp.experts = LoRAExperts(block.mlp.experts, projections, lora.rank, scaling, lora.dropout)
    names = []
    for name, p in model.named_parameters():
        p.requires_grad_(lora_factor(name) is not None)
        if lora_factor(name) is not None:
            names.append(name)
            if not p.is_meta:
                model.init_parameter(name, p)
    return names


def _adapt_linear(parent: nn.Module, path: str, lora: LoRA) -> None:
    linear = parent.get_submodule(path) if _has(parent, path) else None
    if not isinstance(linear, nn.Linear):
        raise ConfigError(f"model.init_args.lora.targets: this model has no linear {path} to adapt (multi-head latent "
                          "attention has no q/k/v/o projections of that form); choose other targets")
    parent.set_submodule(path, LoRALinear(linear.weight, linear.bias, lora.rank, lora.scaling, lora.dropout))


def _has(parent: nn.Module, path: str) -> bool:
    try:
        parent.get_submodule(path)
    except AttributeError:
        return False
    return True


def merge_adapters(state: dict[str, Tensor], lora: LoRA) -> dict[str, Tensor]:
    """The state dict with each adapter folded into its base weight, W + s B A (per expert for a stack), in fp32,
    and the factors removed: the plain model that computes what the adapted one does (dropout aside)."""
    out = {k: v for k, v in state.items() if lora_factor(k) is None}
    for name, a in state.items():
        if lora_factor(name) != "A":
            continue
        b = state[name[:-1] + "B"]
        weight = name[: -len(".lora_A")] + ".weight" if name.endswith(".lora_A") else name[: -len("_lora_A")]
        delta = torch.matmul(b.float(), a.float())  # (out, r) @ (r, in), batched over experts
        out[weight] = (state[weight].float() + lora.scaling * delta).to(state[weight].dtype)
    return out


__all__ = ["LoRA", "LoRAExperts", "LoRALinear", "TARGETS", "add_adapters", "init_factor", "lora_factor", "lora_from",
           "lora_hparams", "merge_adapters"]
