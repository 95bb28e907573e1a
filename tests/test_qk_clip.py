"""QK-clip (`lit_lm.callbacks.qk_clip.QKClip`, Kimi K2's MuonClip): the per-head maximum logit the attention cores
measure against a brute-force recomputation from the model's weights and inputs; the rescaling of the heads over
the threshold by the formula (MHA with q/k biases: eta^alpha and eta^(1-alpha); GQA: the query takes eta, the shared
key is untouched), the others untouched; parity with one process under dp2, zero2, zero3, tp2, pp2 and cp2 (ring and
all-gather) at a threshold that clips about half the heads at every step (asserted); and the mutants that take the
maximum over the local rank only (under dp, under cp) or measure only the keys a cp rank holds, reported by the
harness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from dist_utils import REFERENCE_TILES
from lit_lm.callbacks import qk_clip
from lit_lm.callbacks.qk_clip import QKClip
from lit_lm.config import ConfigError
from lit_lm.kernels import logit_max as lm
from lit_lm.mla import LatentAttention
from lit_lm.model import Attention
from lit_lm.parity import TINY, Case, assert_parity, fit_case, run_parity, unreported_mutants
from lit_lm.strategies import cp
from lit_lm.strategies.composed import ComposedStrategy
from lit_lm.strategies.ddp import DataParallelStrategy
from lit_lm.strategies.pp import PipelineStrategy
from lit_lm.strategies.tp import TensorParallelStrategy
from lit_lm.strategies.zero import ZeroStrategy

MHA_BIAS = dict(TINY, n_kv_heads=4, qkv_bias=True)  # a kv head per query head, Qwen2's q/k/v biases
WINDOWED = dict(TINY, sliding_window=5)
# at initialisation the tiny models' per-head maxima are 0.03-0.07: this clips some of the heads at every step
TAU = 0.05


def brute_force_max(q: torch.Tensor, k: torch.Tensor, window: int | None = None,
                    documents: torch.Tensor | None = None) -> torch.Tensor:
    """(Hq,) max of q k^T / sqrt(D) over the batch and the causal (windowed, same-document) pairs, on the whole
    score matrix."""
    b, hq, t, d = q.shape
    k = k.repeat_interleave(hq // k.shape[1], dim=1)
    s = torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) / math.sqrt(d)
    distance = torch.arange(t)[:, None] - torch.arange(t)[None, :]
    allowed = (distance >= 0) & (distance < (window or t))
    if documents is not None:
        allowed = allowed & (documents[:, :, None] == documents[:, None, :])[:, None]
    return s.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3)).float()


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("tile_elements", [1 << 22, 2 * 4 * 13])  # one tile; one query row per tile
@pytest.mark.parametrize("packed", [False, True])
def test_logit_max_is_the_maximum_of_the_masked_scores(window: int | None, tile_elements: int, packed: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lm, "TILE_ELEMENTS", tile_elements)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 13, 8, generator=gen), torch.randn(2, 2, 13, 8, generator=gen)
    k[:, :, 9:] += 30.0  # late keys large: a mask that let a query see a later key would be seen
    # packed rows: documents of 3 and 10 tokens, and 7 and 6, whose first keys are large: a query of the second
    # document that saw them would be seen
    documents = torch.tensor([[0] * 3 + [1] * 10, [0] * 7 + [1] * 6]) if packed else None
    if packed:
        k[0, :, :3] += 30.0
        k[1, :, :7] += 30.0
    expected = brute_force_max(q, k, window, documents)
    torch.testing.assert_close(lm.logit_max(q, k, window, documents), expected, rtol=1e-6, atol=1e-6)


class BeforeStep(L.Callback):
    """Before the (only) step: the per-head maxima recomputed from the model's weights and the batch's inputs, on
    the whole score matrix, and the q/k weights and biases the step starts from."""

    def __init__(self) -> None:
        self.maxima: list[torch.Tensor] = []
        self.weights: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: torch.Tensor,
                             *args: Any) -> None:
        if trainer.global_step:
            return
        attns = [m for m in module.modules() if isinstance(m, Attention)]
        inputs: list[torch.Tensor] = []
        hooks = [a.register_forward_pre_hook(lambda _, args: inputs.append(args[0])) for a in attns]
        module.model(batch[:, :-1])
        for h in hooks:
            h.remove()
        for attn, x in zip(attns, inputs):
            b, t, _ = x.shape
            q = F.linear(x, attn.wq.weight, attn.wq.bias).view(b, t, -1, attn.head_dim)
            k = F.linear(x, attn.wk.weight, attn.wk.bias).view(b, t, -1, attn.head_dim)
            q, k = attn.rope(q, k)
            self.maxima.append(brute_force_max(q.transpose(1, 2), k.transpose(1, 2), attn.sliding_window))
        self.weights = {n: p.detach().clone() for n, p in module.named_parameters() if ".wq." in n or ".wk." in n}


@pytest.mark.parametrize("model", [TINY, MHA_BIAS, WINDOWED], ids=["gqa", "mha_bias", "window"])
def test_one_step_measures_and_clips_by_the_formula(model: dict) -> None:
    """SGD at lr 1e-12 (the update is far below the tolerance), so the weights after the step are the clip's."""
    alpha = 0.3
    result = fit_case(Case(model=model, steps=1, lr=1e-12, callbacks=(BeforeStep(), QKClip(TAU, alpha))))
    before, clip = result["callbacks"]
    s = torch.stack(before.maxima)  # (layers, Hq)
    assert ((s > TAU).any() and (s <= TAU).any()), f"the threshold should clip some heads, not all: {s}"
    torch.testing.assert_close(clip.qk_max, s.max(), rtol=1e-5, atol=0)
    assert int(clip.clipped) == int((s > TAU).sum())
    eta = torch.where(s > TAU, TAU / s, torch.ones_like(s))
    group = model["n_heads"] // model["n_kv_heads"]
    d = model["d_model"] // model["n_heads"]
    for layer, layer_eta in enumerate(eta):
        q_scale = layer_eta if group > 1 else layer_eta ** alpha
        k_scale = torch.ones(model["n_kv_heads"]) if group > 1 else layer_eta ** (1 - alpha)
        for proj, scale in (("wq", q_scale), ("wk", k_scale)):
            for kind in ("weight", "bias") if model.get("qkv_bias") else ("weight",):
                name = f"model.blocks.{layer}.attn.{proj}.{kind}"
                w0 = before.weights[name]
                expected = w0 * scale.repeat_interleave(d).view(-1, *[1] * (w0.ndim - 1))
                if kind == "bias":  # zero at initialisation: the step's update (~1e-12) is all there is
                    torch.testing.assert_close(result["params"][name], expected, rtol=0, atol=1e-9)
                else:
                    torch.testing.assert_close(result["params"][name], expected, rtol=1e-5, atol=1e-9, msg=name)


def test_qk_norm_and_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="threshold must be positive"):
        QKClip(threshold=0.0)
    with pytest.raises(ConfigError, match=r"alpha must be in \[0, 1\]"):
        QKClip(alpha=1.5)
    with pytest.raises(ConfigError, match="QK-norm"):
        fit_case(Case(model=dict(TINY, qk_norm=True), steps=1, callbacks=(QKClip(TAU),)))


# -- multi-head latent attention (lit_lm.mla): Kimi K2's rule -----------------------------------------------------
MLA = dict(TINY, n_kv_heads=4, mla_kv_rank=8, mla_qk_nope_dim=4, mla_qk_rope_dim=4, mla_v_dim=6)
# DeepSeek-V3's YaRN shape (factor 4 over a context of 8 here): the softmax scale carries mscale^2 (lit_lm.mla)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 0.707,
        "mscale_all_dim": 1.0}
MLA_Q_YARN = dict(MLA, mla_q_rank=12, rope_scaling=YARN)
MLA_TAU = 0.0295  # the tiny MLA models' per-head maxima at initialisation: 0.019-0.037


def latent_logit_max(attn: LatentAttention, x: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    """(H,) max over the batch and the causal pairs of MLA's softmax logits, written out: mscale^2 (q_C . k_C +
    rope(q_R) . rope(k_R)) / sqrt(Dn + Dr), k_R one for all heads, mscale YaRN's 0.1 mscale_all_dim ln(factor) + 1."""
    b, t, _ = x.shape
    dn, dr = attn.nope, attn.rope_dim
    q_c, q_r = attn.query(x).view(b, t, -1, dn + dr).split([dn, dr], dim=-1)
    latent, k_r = attn.wkv_a(x).split([attn.kv_rank, dr], dim=-1)
    k_c = attn.wkv_b(attn.kv_norm(latent)).view(b, t, -1, dn + attn.v_dim)[..., :dn]
    q_r, k_r = attn.rope(attn._deinterleave(q_r), attn._deinterleave(k_r)[:, :, None])
    mscale = 0.1 * scaling["mscale_all_dim"] * math.log(scaling["factor"]) + 1 if scaling else 1.0
    s = (torch.einsum("bihd,bjhd->bhij", q_c.double(), k_c.double())
         + torch.einsum("bihd,bjd->bhij", q_r.double(), k_r[:, :, 0].double())) * mscale ** 2 / math.sqrt(dn + dr)
    allowed = torch.ones(t, t, dtype=torch.bool).tril()
    return s.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3)).float()


class LatentBeforeAfter(L.Callback):
    """The MLA layers' per-head maxima written out (`latent_logit_max`) on the first batch's attention inputs, before
    the (only) step and, on the same inputs, after it (its clip); the attention weights the step starts from."""

    def __init__(self) -> None:
        self.before: list[torch.Tensor] = []
        self.after: list[torch.Tensor] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.inputs: list[torch.Tensor] = []

    @torch.no_grad()
    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: torch.Tensor,
                             *args: Any) -> None:
        if trainer.global_step:
            return
        attns = [m for m in module.modules() if isinstance(m, LatentAttention)]
        hooks = [a.register_forward_pre_hook(lambda _, args: self.inputs.append(args[0])) for a in attns]
        module.model(batch[:, :-1])
        for h in hooks:
            h.remove()
        self.before = [latent_logit_max(a, x, module.model.config.rope_scaling) for a, x in zip(attns, self.inputs)]
        self.weights = {n: p.detach().clone() for n, p in module.named_parameters() if ".attn." in n}

    @torch.no_grad()
    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        attns = [m for m in module.modules() if isinstance(m, LatentAttention)]
        self.after = [latent_logit_max(a, x, module.model.config.rope_scaling) for a, x in zip(attns, self.inputs)]


def check_latent_clip(model: dict, result: dict) -> None:
    """Per head h with S_h > tau and gamma_h = tau / S_h: wq_b's (wq's) q nope rows times sqrt(gamma_h), its q rope
    rows times gamma_h, wkv_b's k nope rows times sqrt(gamma_h); wkv_b's value rows, wkv_a (the latent and the shared
    rope key k_R), wq_a, the norms and wo as they were; the heads under tau untouched. Then, on the same inputs, the
    clipped heads' maxima are tau and the others' as before."""
    probe, clip = result["callbacks"]
    s = torch.stack(probe.before)  # (layers, H)
    assert (s > MLA_TAU).any() and (s <= MLA_TAU).any(), f"the threshold should clip some heads, not all: {s}"
    torch.testing.assert_close(clip.qk_max, s.max(), rtol=1e-5, atol=0)
    assert int(clip.clipped) == int((s > MLA_TAU).sum())
    gamma = torch.where(s > MLA_TAU, MLA_TAU / s, torch.ones_like(s))
    dn, dr, dv, h = model["mla_qk_nope_dim"], model["mla_qk_rope_dim"], model["mla_v_dim"], model["n_heads"]
    q_name = "wq" if model.get("mla_q_rank") is None else "wq_b"
    for name, w0 in probe.weights.items():
        layer, proj = int(name.split(".")[2]), name.split(".")[4]
        g = gamma[layer][:, None, None]
        if proj == q_name:  # (H, Dn + Dr, in): q_C then q_R per head
            expected = w0.view(h, dn + dr, -1) * torch.cat((g.sqrt().expand(-1, dn, 1), g.expand(-1, dr, 1)), 1)
        elif proj == "wkv_b":  # (H, Dn + Dv, r_kv): k_C then the values per head
            expected = w0.view(h, dn + dv, -1) * torch.cat((g.sqrt().expand(-1, dn, 1), torch.ones(h, dv, 1)), 1)
        else:
            expected = w0
        torch.testing.assert_close(result["params"][name], expected.view_as(w0), rtol=1e-5, atol=1e-9, msg=name)
    after, clipped = torch.stack(probe.after), s > MLA_TAU
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], MLA_TAU), rtol=1e-5, atol=0)
    torch.testing.assert_close(after[~clipped], s[~clipped], rtol=1e-5, atol=0)


def _fit_latent(model: dict) -> dict:
    """One step of SGD at lr 1e-12 (far below the tolerances): the weights after it are the clip's."""
    return fit_case(Case(model=model, steps=1, lr=1e-12, callbacks=(LatentBeforeAfter(), QKClip(MLA_TAU))))


@pytest.mark.parametrize("model", [MLA, MLA_Q_YARN], ids=["direct_q", "q_rank_yarn"])
def test_latent_attention_clips_by_kimi_k2s_rule(model: dict) -> None:
    check_latent_clip(model, _fit_latent(model))


@dataclass(frozen=True)
class _SharedKeyRows(qk_clip.HeadRows):
    """Mutant: wkv_a's rows, its shared rope key k_R's by sqrt of the layer's smallest gamma."""

    def factors(self, eta: torch.Tensor) -> torch.Tensor:
        (latent, _), (rope, _) = self.segments
        return torch.cat((torch.ones(latent), eta.min().sqrt().expand(rope)))


def k_rope_scaled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the shared rotary key scaled too (wkv_a's last Dr rows)."""
    rows = qk_clip.latent_rows
    monkeypatch.setattr(qk_clip, "latent_rows", lambda attn, alpha: rows(attn, alpha) + [
        _SharedKeyRows((attn.wkv_a.weight,), ((attn.kv_rank, 0.0), (attn.rope_dim, 0.5)))])


def q_rope_by_sqrt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the rotary query q_R by gamma^alpha (sqrt) as q_C, not by gamma."""

    def rows(attn: LatentAttention, alpha: float) -> list:
        wq = attn.wq if hasattr(attn, "wq") else attn.wq_b
        return [qk_clip.HeadRows((wq.weight,), ((attn.nope, alpha), (attn.rope_dim, alpha))),
                qk_clip.HeadRows((attn.wkv_b.weight,), ((attn.nope, 1 - alpha), (attn.v_dim, 0.0)))]

    monkeypatch.setattr(qk_clip, "latent_rows", rows)


def neighbours_gamma(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: each head clipped by the previous head's gamma."""
    clip = QKClip._clip
    monkeypatch.setattr(QKClip, "_clip", lambda self, layer, eta, by_param: clip(self, layer, eta.roll(1), by_param))


@pytest.mark.parametrize("mutant", [k_rope_scaled, q_rope_by_sqrt, neighbours_gamma])
def test_latent_rule_mutants_fail(mutant: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    mutant(monkeypatch)
    with pytest.raises(AssertionError):
        check_latent_clip(MLA_Q_YARN, _fit_latent(MLA_Q_YARN))


# -- parity with one process ------------------------------------------------------------------------------------
def _case(strategy: Any, label: str, model: dict = TINY, tau: float = TAU, **kwargs: Any) -> Case:
    return Case(strategy, model=model, steps=3, callbacks=(QKClip(tau),), label=label, **kwargs)


CP2 = partial(ComposedStrategy, context_parallel_size=2)
CASES = [
    _case(DataParallelStrategy, "lm_ddp dp2"),
    _case(partial(ZeroStrategy, stage=2), "zero2 (MHA, q/k biases)", model=MHA_BIAS, optimizer="adamw"),
    _case(partial(ZeroStrategy, stage=3), "zero3", optimizer="adamw"),
    _case(TensorParallelStrategy, "tp2 (MHA, q/k biases)", model=MHA_BIAS),
    _case(TensorParallelStrategy, "tp2 (GQA)"),
    _case(CP2, "cp2 ring"),
    _case(partial(PipelineStrategy, microbatches=2), "pp2 1f1b, accumulation 2",
          trainer={"accumulate_grad_batches": 2}),
    _case(partial(CP2, cp_method="allgather"), "cp2 allgather, window 5", model=WINDOWED),
    _case(partial(CP2, cp_method="ulysses"), "cp2 ulysses (each rank measures its heads)"),
    _case(TensorParallelStrategy, "tp2 (MLA, q rank, YaRN)", model=MLA_Q_YARN, tau=MLA_TAU),
    _case(partial(ZeroStrategy, stage=3), "zero3 (MLA)", model=MLA, tau=MLA_TAU, optimizer="adamw"),
    _case(CP2, "cp2 ring (MLA, the max over cp)", model=MLA, tau=MLA_TAU),
]


def _clipped(run: dict) -> list[float]:
    return [float(rank["callbacks"][0].clipped) for rank in run["ranks"]] + [float(run["single"]["callbacks"][0]
                                                                                .clipped)]


def test_parity_with_one_process() -> None:
    for run in run_parity(CASES, world_size=2, env=REFERENCE_TILES):
        assert_parity(run)
        clipped = _clipped(run)
        assert min(clipped) > 0 and len(set(clipped)) == 1, f"{run['case'].label}: heads clipped {clipped}"


# -- mutants: the harness reports them ------------------------------------------------------------------------
def local_max_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The maximum over this rank's tokens only: no all-reduce over dp x cp."""
    monkeypatch.setattr(qk_clip, "max_groups", lambda trainer: [])


def own_keys_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cp ring measures only the first of its steps: this rank's queries on the keys it holds."""
    forward = cp.ring_forward

    def ring_forward(q: torch.Tensor, kv: torch.Tensor, call: cp.Call) -> Any:
        heads, result = call.logit_max, None
        if heads is None:
            return forward(q, kv, call)
        own = torch.full_like(heads, float("-inf"))
        result = forward(q, kv, cp.Call(call.group, call.seq_len, call.window, call.backend))
        cp.attend(q, kv, cp.zigzag_runs(call.seq_len, call.rank, call.cp), cp.zigzag_runs(call.seq_len, call.rank,
                  call.cp), cp.Call(call.group, call.seq_len, call.window, call.backend, own),
                  torch.zeros(q.shape), torch.full(q.shape[:-1], float("-inf")))
        heads.copy_(own)
        return result

    monkeypatch.setitem(cp._FORWARD, "ring", ring_forward)


# the clip follows step 0's update: a wrong maximum shows from the next step on (or, clipped at the last step only,
# in the final q/k weights), never at step 0
AFTER_STEP_0 = r"(step [12]|batch [1-9]) rank \d: |rank \d: final model\.blocks\.\d\.attn\.w[qk]\."
MUTANTS = [
    (_case(DataParallelStrategy, "lm_ddp dp2, max over the local rank", mutation=local_max_only),
     AFTER_STEP_0),
    (_case(partial(ZeroStrategy, stage=2), "zero2, max over the local rank", mutation=local_max_only),
     AFTER_STEP_0),
    (_case(CP2, "cp2 ring, max over the local rank", mutation=local_max_only),
     AFTER_STEP_0),
    (_case(CP2, "cp2 ring, own keys only", mutation=own_keys_only),
     AFTER_STEP_0),
]


def test_harness_reports_the_local_maximum_mutants() -> None:
    runs = run_parity([case for case, _ in MUTANTS], world_size=2, env=REFERENCE_TILES)
    missed, _ = unreported_mutants([(run["case"].label, report, run) for run, (_, report) in zip(runs, MUTANTS)],
                                   assert_parity)
    assert not missed, "\n".join(missed)
