"""Multi-head latent attention (DeepSeek-V2/V3's MLA), an attention variant selected by `ModelConfig.mla_kv_rank`.

Per token x (d_model), with H heads, nope/rope/v head dims Dn, Dr, Dv and ranks r_q, r_kv:

    q      = wq_b(q_norm(wq_a(x)))                 (H, Dn + Dr)   [r_q = None: q = wq(x), a direct projection]
    c, kr  = split(wkv_a(x), [r_kv, Dr])           the latent c and ONE rope key kr shared by all heads
    k_nope, v = split(wkv_b(kv_norm(c)), [Dn, Dv]) per head
    q = [q_nope, rope(q_rope)]    k = [k_nope, rope(kr) broadcast to every head]
    y = wo(softmax(q k^T * scale + causal) v),     scale = (Dn + Dr)^-1/2 * mscale^2

RoPE is "decoupled": it rotates only the Dr rope dims, and the rotated key is computed once from x and shared by
the heads (the nope part carries no position, so the latent can be cached without it). DeepSeek stores the rope
dims interleaved (pairs (x0, x1), (x2, x3), ... share a frequency: `mla_rope_interleave`); they are
de-interleaved (evens then odds) before lit-lm's half-split rotation, which is the same rotation of the same pairs,
laid out as transformers' `apply_rotary_pos_emb_interleave` returns it. `mscale` is YaRN's 0.1 * mscale_all_dim *
ln(factor) + 1 when `rope_scaling` is YaRN with mscale_all_dim (DeepSeek-V3), else 1: SDPA scales by
(Dn + Dr)^-1/2, so q is multiplied by mscale^2.

Decoding caches the latent: `KVCache.k` holds kv_norm(c) (B, 1, L, r_kv) and `KVCache.v` the rotated rope key
(B, 1, L, Dr), (r_kv + Dr) numbers per token and layer instead of H (Dn + Dr + Dv); each step expands them
through wkv_b.

Context parallelism (ring, all-gather) replaces the core as for grouped-query attention (`attend`: v padded to
the key width, which cp's k/v exchange shares); the rope follows the zigzag positions given to forward.

Tensor parallelism splits the heads (wq / wq_b, wkv_b by heads, wo by its input); the down-projections wq_a,
wkv_a and their norms are replicated: they produce the per-token latent that every head reads, and the norms
normalise the whole latent, so a split would need a gather; each rank's backward through them sees its heads
only, so their gradients are partial and summed over tp (`per_head`)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_lm.config import ModelConfig
from lit_lm.yarn import yarn_mscale


LATENT_EPS = 1e-6  # the latents' norms' epsilon: DeepSeek's RMSNorm default, whatever rms_norm_eps says


def softmax_mscale(rope_scaling: Optional[dict]) -> float:
    """YaRN's attention temperature for the softmax of all dims: `lit_lm.yarn.yarn_mscale(factor, mscale_all_dim)`
    (0.1 * mscale_all_dim * ln(factor) + 1) when `rope_scaling` is YaRN with mscale_all_dim, else 1 (transformers'
    `yarn_apply_mscale`)."""
    if not rope_scaling or rope_scaling.get("rope_type", rope_scaling.get("type")) != "yarn":
        return 1.0
    all_dim = rope_scaling.get("mscale_all_dim")
    return yarn_mscale(rope_scaling.get("factor", 1.0), all_dim) if all_dim else 1.0


class LatentAttention(nn.Module):
    """MLA with DeepSeek's parameter names (its reference code's: wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo);
    the constructor and forward take what `lit_lm.model.Attention`'s take, so a block holds either."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        from lit_lm.model import CausalAttention, RMSNorm, RotaryEmbedding  # model.py builds this class

        d, h = cfg.d_model, cfg.n_heads
        self.nope, self.rope_dim, self.v_dim = cfg.mla_qk_nope_dim, cfg.mla_qk_rope_dim, cfg.mla_v_dim
        self.kv_rank = cfg.mla_kv_rank
        qk = self.nope + self.rope_dim
        if cfg.mla_q_rank is None:
            self.wq = nn.Linear(d, h * qk, bias=False)
        else:
            self.wq_a = nn.Linear(d, cfg.mla_q_rank, bias=False)
            self.q_norm = RMSNorm(cfg.mla_q_rank, LATENT_EPS)
            self.wq_b = nn.Linear(cfg.mla_q_rank, h * qk, bias=False)
        self.wkv_a = nn.Linear(d, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, LATENT_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, h * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(h * self.v_dim, d, bias=False)
        self.rope = RotaryEmbedding(self.rope_dim, cfg.rope_theta, cfg.rope_scaling)
        self.interleaved = cfg.mla_rope_interleave
        self.q_scale = softmax_mscale(cfg.rope_scaling) ** 2  # on top of SDPA's (Dn + Dr)^-1/2
        self.sliding_window = cfg.window(layer)  # block `layer`'s, as `Attention` and the cp plan read it
        self.core = CausalAttention(self.sliding_window)

    def query(self, x: Tensor) -> Tensor:
        return self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))

    def _deinterleave(self, x: Tensor) -> Tensor:
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if self.interleaved else x

    def expand(self, latent: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values (B, H, L, Dn + Dr), (B, H, L, Dv) of the normed latent (B, 1, L, r_kv) and the rotated
        shared rope key (B, 1, L, Dr): per-head nope keys and values from wkv_b, the one rope key beside each."""
        b, _, n, _ = latent.shape
        kv = self.wkv_b(latent[:, 0]).view(b, n, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        return k, v

    def forward(self, x: Tensor, positions: Optional[Tensor] = None, cache=None,
                documents: Optional[Tensor] = None) -> Tensor:
        from lit_lm.model import cached_attention

        b, t, _ = x.shape
        q = self.query(x).view(b, t, -1, self.nope + self.rope_dim)  # heads from the weights (a tp shard's own)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        latent = self.kv_norm(latent)[:, None]  # (B, 1, T, r_kv)
        q_rope, k_rope = self._deinterleave(q_rope), self._deinterleave(k_rope)[:, :, None]  # k: (B, T, 1, Dr)
        if cache is not None:  # decoding: positions continue after the cached ones
            positions = torch.arange(cache.length, cache.length + t)
        q_rope, k_rope = self.rope(q_rope, k_rope, positions)
        q = torch.cat((q_nope, q_rope), dim=-1).transpose(1, 2)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k_rope = k_rope.transpose(1, 2)  # (B, 1, T, Dr)
        if cache is None:
            y = self.attend(q, *self.expand(latent, k_rope), documents)
        else:
            k, v = self.expand(*cache.append(latent, k_rope))
            y = cached_attention(q, k, v, self.sliding_window)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, documents: Optional[Tensor] = None) -> Tensor:
        """The core on q, k (B, H, T, Dn + Dr) and v (B, H, T, Dv). A core that context parallelism put in place
        (ring or all-gather, `lit_lm.strategies.cp`) moves k and v as one tensor of one width: v is zero-padded to
        q's width and the padding's outputs (zeros) dropped, exact at (Dn + Dr - Dv) / Dv more value bytes."""
        from lit_lm.model import CausalAttention

        pad = 0 if isinstance(self.core, CausalAttention) else q.shape[-1] - v.shape[-1]
        if pad:
            v = F.pad(v, (0, pad))
        y = self.core(q, k, v) if documents is None else self.core(q, k, v, documents)
        return y[..., : self.v_dim] if pad else y

    def tensor_parallel_plan(self, prefix: str) -> dict:
        """Heads split (wq / wq_b and wkv_b by output, wo by input, whole heads per rank); the latent's
        down-projections and norms replicated with partial gradients (see the module docstring)."""
        from lit_lm.strategies.plan import TensorParallel as TP

        qk = self.nope + self.rope_dim
        plan = {prefix: TP("region"), f"{prefix}.wkv_b": TP("column", self.nope + self.v_dim, "heads"),
                f"{prefix}.wo": TP("row", self.v_dim, "heads"), f"{prefix}.wkv_a": TP("per_head"),
                f"{prefix}.kv_norm": TP("per_head")}
        if hasattr(self, "wq"):
            plan[f"{prefix}.wq"] = TP("column", qk, "heads")
        else:
            plan.update({f"{prefix}.wq_a": TP("per_head"), f"{prefix}.q_norm": TP("per_head"),
                         f"{prefix}.wq_b": TP("column", qk, "heads")})
        return plan
