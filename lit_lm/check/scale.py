"""The scaled-down copy of a user's model that `lit-lm check` trains: small enough for a few CPU steps, the same in
everything that decides how the layout splits it.

Kept as they are: layer kinds (dense and MoE blocks in their order: `moe_first_dense`, `moe_every`), tied
embeddings, qk-norm, q/k/v biases, RoPE scaling, the routing (top-k, scores, capacity, losses, balancing), shared
experts, the vocabulary padding rule, and every size's remainder modulo the parallel degree that splits it
(`_like`): a size the layout divides stays divisible, one it does not stays indivisible, and a padded vocabulary
keeps its padding rows. Shrunk: heads (the GQA ratio kept), head_dim (to 8), d_ff, experts, layers (enough for
every pipeline stage and the MoE pattern; all of them when `layers_per_stage` fixes the split), vocabulary and
sequence. A model already that small (`SMALL_PARAMS`, `SMALL_SEQ`) is trained as it is.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from typing import Optional

from lit_lm.config import ModelConfig, round_up
from lit_lm.strategies.layout import ParallelConfig

SMALL_PARAMS = 300_000  # at most this many parameters, and
SMALL_SEQ = 64  # at most this many positions: the user's model itself is trained
HEAD_DIM = 8


def _like(x: int, modulus: int, floor: int) -> int:
    """The smallest value >= `floor` with `x`'s remainder modulo `modulus` (`x` itself when it is below `floor`)."""
    if x <= floor:
        return x
    return floor + (x - floor) % modulus


def scaled_config(cfg: ModelConfig, par: Optional[ParallelConfig]) -> tuple[ModelConfig, list[str]]:
    """The model `lit-lm check` trains for `cfg` under `par` (None: plain data parallelism), and what changed, one
    `field user -> check` string each."""
    if cfg.num_params() <= SMALL_PARAMS and cfg.max_seq_len <= SMALL_SEQ:
        return cfg, []
    par = par or ParallelConfig()
    tp, cp, ep = par.tp, par.cp, par.ep
    stages = par.pp * par.virtual_stages if par.pp > 1 else 1
    kv = _like(cfg.n_kv_heads, tp, min(cfg.n_kv_heads, 2))
    heads = kv * (cfg.n_heads // cfg.n_kv_heads)
    head_dim = min(cfg.head_dim, HEAD_DIM)
    apart = cfg.n_heads * cfg.head_dim != cfg.d_model  # a head_dim set apart from d_model / n_heads stays apart
    sizes = dict(n_heads=heads, n_kv_heads=kv, head_dim=head_dim, d_model=heads * head_dim * (2 if apart else 1),
                 d_ff=_like(cfg.d_ff, tp, 16),
                 vocab_size=_like(cfg.vocab_size, math.lcm(cfg.vocab_multiple_of, tp), 64))
    seq_modulus = math.lcm(2 * cp if cp > 1 else 1, tp if par.sp else 1, 2)
    sizes["max_seq_len"] = _like(cfg.max_seq_len, seq_modulus, 16)
    if cfg.sliding_window is not None and cfg.sliding_window < cfg.max_seq_len:
        sizes["sliding_window"] = min(cfg.sliding_window, max(2, sizes["max_seq_len"] // 2))
    first, every = cfg.moe_first_dense, cfg.moe_every
    if cfg.moe_experts:
        first, every = min(first, 1), min(every, 2)
        floor, modulus = max(cfg.moe_top_k, min(cfg.moe_experts, 4)), ep
        if cfg.moe_groups > 1:  # node-limited routing kept, on 2 groups: the best 1 of them if it was limited
            groups, best = 2, 1 if cfg.moe_topk_groups < cfg.moe_groups else 2
            floor, modulus = max(floor, 2 * groups, cfg.moe_top_k * groups // best), math.lcm(ep, groups)
            sizes.update(moe_groups=groups, moe_topk_groups=best)
        sizes.update(moe_experts=_like(cfg.moe_experts, modulus, floor),
                     moe_d_ff=_like(cfg.moe_d_ff, tp, 16), moe_first_dense=first, moe_every=every,
                     moe_shared_experts=min(cfg.moe_shared_experts, 1))
    if par.layers_per_stage is None:
        need = max(2, stages, first + every + (1 if cfg.moe_experts and every > 1 else 0))
        sizes["n_layers"] = min(cfg.n_layers, round_up(need, stages))
    if cfg.layer_types is not None:  # gpt-oss's sliding and full layers: the first ones, in their order
        sizes["layer_types"] = cfg.layer_types[: sizes.get("n_layers", cfg.n_layers)]
    small = replace(cfg, **sizes)
    notes = [f"{k} {getattr(cfg, k)} -> {v}" for k, v in sizes.items() if getattr(cfg, k) != v]
    return small, notes


def model_args(cfg: ModelConfig) -> dict:
    """`ModelConfig` arguments for the harness's `Case.model`."""
    return asdict(cfg)
