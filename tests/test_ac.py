"""Activation checkpointing (lit_lm.strategies.ac): the same losses, gradients and MoE state as without it, and the
activation memory each mode leaves for the backward, measured and checked against the planner's per-block figures
(`lit_lm.planner.estimate.block_kept`)."""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils.checkpoint import set_checkpoint_early_stop

from dist_utils import TINY, run_distributed, token_data
from lit_lm.config import ModelConfig
from lit_lm.planner.estimate import block_kept
from lit_lm.model import Transformer
from lit_lm.moe import moe_aux_loss, moe_layers, update_router_bias
from lit_lm.parity import MOE, Case, assert_parity, run_parity
from lit_lm.strategies.ac import ActivationMemory, Checkpointed, apply_activation_checkpointing, check_mode
from lit_lm.strategies.cp import parallelize_context
from lit_lm.strategies.layout import ParallelConfig
from lit_lm.strategies.plan import find_block_model
from lit_lm.strategies.zero import ZeroStrategy

BATCH, SEQ = 4, 16
DEFAULT = dict(TINY, d_model=192, n_layers=4, n_heads=6, n_kv_heads=2)  # configs/default.yaml's blocks


def build(cfg: dict, mode: str) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**cfg))
    apply_activation_checkpointing(model, mode)
    return model


def train(cfg: dict, mode: str, bf16: bool = False, steps: int = 2) -> list[dict[str, Any]]:
    """Per step: the loss, every gradient, each MoE layer's token counts and (after the update) router bias."""
    model = build(cfg, mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = token_data(steps * BATCH, SEQ).view(steps, BATCH, SEQ + 1)
    record = []
    for batch in tokens:
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            loss, _ = model.loss(batch[:, :-1], batch[:, 1:])
        aux = {name: m.aux_loss for name, m in moe_layers(model).items()}
        loss.backward()
        assert all(m.aux_loss is aux[name] for name, m in moe_layers(model).items()), "recomputation replaced aux_loss"
        counts = {name: m.step_counts.clone() for name, m in moe_layers(model).items()}
        update_router_bias(model)
        record.append({"loss": loss.detach(), "counts": counts,
                       "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                       "bias": {n: m.router.expert_bias.clone() for n, m in moe_layers(model).items()}})
        optimizer.step()
        optimizer.zero_grad()
    return record


@pytest.mark.parametrize(("cfg", "early_stop", "bf16"),
                         [(TINY, True, False), (MOE, True, False), (MOE, False, False), (MOE, True, True)],
                         ids=["dense", "moe", "moe-whole-recompute", "moe-bf16-autocast"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_changes_no_result(cfg: dict, early_stop: bool, bf16: bool, mode: str) -> None:
    """Bitwise: the recomputation runs the same CPU kernels on the same inputs (under the forward's autocast
    state), so it reproduces every saved tensor exactly, and the backward then does the same arithmetic as without
    checkpointing.

    torch stops a recomputation early, once it has every tensor the backward needs, which here is before the MoE
    layer's accounting; without early stopping it runs the block to the end, accounting included."""
    expected = train(cfg, "none", bf16)
    with set_checkpoint_early_stop(early_stop):
        got = train(cfg, mode, bf16)
    for step, (e, g) in enumerate(zip(expected, got)):
        assert torch.equal(e["loss"], g["loss"]), f"step {step}: loss"
        for part in ("grads", "counts", "bias"):
            assert e[part].keys() == g[part].keys()
            for name in e[part]:
                assert torch.equal(e[part][name], g[part][name]), f"step {step}: {part} of {name}"
    if cfg is MOE:  # the balancing took effect, so step 1 routed with a moved bias
        assert all(b.abs().sum() > 0 for b in got[-1]["bias"].values())


# -- memory -----------------------------------------------------------------------------------------------------
def measure(model: Transformer, blocks: list[str]) -> tuple[int, int]:
    """(bytes the forward of `blocks` leaves for the backward, peak bytes through the backward) of activations;
    the input is made inside (as the embedding makes it), the output is not counted. The MoE balancing losses are
    part of the loss, as in training. A first forward fills the RoPE tables (module state, cached per length)."""
    x0, grad, one = torch.randn(BATCH, SEQ, model.config.d_model), torch.ones(BATCH, SEQ, model.config.d_model), \
        torch.ones(())
    with torch.no_grad():
        for i in blocks:
            model.blocks[i](x0)
    with ActivationMemory() as mem:
        x = x0.clone().requires_grad_()
        for i in blocks:
            x = model.blocks[i](x)
        out = x.untyped_storage().nbytes()
        kept = mem.live - out
        aux = sum(moe_aux_loss(model.blocks[i]) for i in blocks)  # 0.0 without MoE layers
        torch.autograd.backward(*([x, aux], [grad, one]) if isinstance(aux, Tensor) else ([x], [grad]))
    return kept, mem.peak - out


def kept_bytes(cfg: ModelConfig, layer: int, mode: str, layout: ParallelConfig = ParallelConfig()) -> int:
    """What the planner's estimate says one checkpointed block keeps (fp32, one rank): the figure held to
    measurement here."""
    return block_kept(cfg, layer, BATCH, SEQ, layout, 4, 4, mode)


def moe_state_bytes(model: Transformer) -> int:
    """What each MoE layer keeps of its last forward on the module (aux_loss and the detached stats)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for m in moe_layers(model).values() for t in (m.aux_loss, *m.stats.values())}
    return sum(storages.values())


@pytest.mark.parametrize("cfg", [TINY, MOE, DEFAULT], ids=["dense", "moe", "default"])
def test_activation_memory_per_mode(cfg: dict) -> None:
    config = ModelConfig(**cfg)
    layers = [str(i) for i in range(config.n_layers)]
    block_input = 4 * BATCH * SEQ * config.d_model
    none_model = build(cfg, "none")
    kept_none, _ = measure(none_model, layers)
    kept_block = [measure(none_model, [i])[0] for i in layers]  # each block alone, its input included
    assert kept_none == sum(kept_block)  # each block's saved tensors, its input once

    full = build(cfg, "full")
    kept_full, peak_full = measure(full, layers)
    state = moe_state_bytes(full)  # 0 for a dense model
    assert kept_full == sum(kept_bytes(config, int(i), "full") for i in layers) + state  # the inputs, nothing else
    assert kept_bytes(config, 0, "full") == block_input
    # the bound: through the backward, one input per layer plus one block's activations recomputed
    assert peak_full <= len(layers) * block_input + max(kept_block)

    kept_selective, _ = measure(build(cfg, "selective"), layers)
    assert kept_selective == sum(kept_bytes(config, int(i), "selective") for i in layers) + state
    assert kept_full < kept_selective < kept_none
    print(f"\nd_model={config.d_model}{', MoE' if config.moe_experts else ''}: none {kept_none}, full {kept_full} "
          f"(peak {peak_full}), selective {kept_selective}, block input {block_input}, blocks {kept_block}")


def _context_parallel_kept() -> int:
    model = build(TINY, "none")
    # one rank (the default group); PyTorch tiles: Triton's interpreter (the suite's TRITON_INTERPRET=1) keeps its
    # launch buffers alive, which would be counted
    parallelize_context(model, backend="reference")
    apply_activation_checkpointing(model, "selective")
    return measure(model, list(model.blocks))[0]


def test_selective_keeps_nothing_inside_a_custom_autograd_function() -> None:
    """Context-parallel attention is an autograd function computing score tiles with its own matmuls (O(T^2)):
    `selective` keeps none of its insides (it saves what it needs itself), so a block keeps the dense figure less
    the attention kernel's outputs, and the function is recomputed whole."""
    config = ModelConfig(**TINY)
    attention = 4 * BATCH * SEQ * (config.n_heads * config.head_dim + config.n_heads)
    kept = sum(kept_bytes(config, i, "selective", ParallelConfig(cp=2)) for i in range(config.n_layers))
    assert kept == sum(kept_bytes(config, i, "selective") for i in range(config.n_layers)) - config.n_layers * attention
    assert run_distributed(_context_parallel_kept, 1) == [kept]


# -- the wrapping ---------------------------------------------------------------------------------------------
def test_applying_again_wraps_once_and_keeps_names() -> None:
    model = build(TINY, "none")
    names = list(model.state_dict())
    assert all("forward" not in vars(b) for b in model.blocks.values())  # none: untouched
    apply_activation_checkpointing(model, "full")
    first = {i: b.forward.forward for i, b in model.blocks.items()}
    apply_activation_checkpointing(model, "selective")
    for i, block in model.blocks.items():
        assert isinstance(block.forward, Checkpointed) and block.forward.mode == "selective"
        assert block.forward.forward == first[i] and not isinstance(first[i], Checkpointed)
    assert list(model.state_dict()) == names
    twin = copy.deepcopy(model)  # e.g. an EMA copy: its blocks must run on its own weights
    assert all(b.forward.forward.__self__ is b for b in twin.blocks.values())


def test_unknown_mode_and_a_model_without_blocks_are_explained() -> None:
    with pytest.raises(ValueError, match=r"activation_checkpointing 'some'.*none, full, selective"):
        check_mode("some")
    with pytest.raises(TypeError, match=r"Linear has none; use activation_checkpointing: none"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), "full")


# -- ZeRO-3's gather hooks around a checkpointed block -----------------------------------------------------------
class CheckpointedZero3(ZeroStrategy):
    """ZeRO-3 with every block checkpointed (the composing strategy does this in its own order)."""

    def __init__(self, mode: str) -> None:
        super().__init__(stage=3)
        self.mode = mode

    def parallelize(self, fitting: bool) -> None:
        super().parallelize(fitting)
        apply_activation_checkpointing(find_block_model(self.lightning_module)[1], self.mode)


def test_zero3_gathers_around_the_recomputation() -> None:
    """The block's gather/free hooks fire outside the checkpoint, so the recomputation reads gathered weights and
    every gradient matches one process without checkpointing."""
    for run in run_parity([Case(partial(CheckpointedZero3, "full"), label="zero3 full"),
                           Case(partial(CheckpointedZero3, "selective"), label="zero3 selective")],
                          world_size=2):
        assert_parity(run)

