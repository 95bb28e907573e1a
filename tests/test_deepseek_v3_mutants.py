"""The mutants issue 58 names for DeepSeek-V3's architecture, each caught:

- the decoupled RoPE applied per head: every head's whole query and key rotated (its nope dims too, as ordinary
  attention rotates a head), not only the Dr rope dims beside the shared rope key: the logits leave transformers';
- routing without the group limit (`Router.limit_groups` a no-op: every group open): the logits leave
  transformers' (the tiny model's 8 experts in 4 groups, the best 2: the limit decides some tokens' experts);
- the shared expert split under ep (each ep rank running its half of the shared expert's hidden units, as the
  routed experts are split, with no sum over the ranks): ep2 is no longer one process (the parity harness).

Each first shows the unmutated code passes the same check (tests/test_deepseek_v3.py holds the full comparisons).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from lit_lm import mla, moe  # noqa: E402
from lit_lm.hf.importer import load_model  # noqa: E402
from lit_lm.model import RotaryEmbedding, SwiGLU  # noqa: E402
from lit_lm.parity import Case, assert_parity, run_parity  # noqa: E402
from lit_lm.strategies.ep import ExpertParallelStrategy  # noqa: E402
from test_deepseek_v3 import DEEPSEEK, IDS, _transformers, folders  # noqa: E402,F401


def rope_per_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each head's whole query and key rotated (the nope dims too), not only the decoupled rope dims."""
    attend = mla.LatentAttention.attend

    def coupled(self, q, k, v, documents=None):
        rope = RotaryEmbedding(self.nope, 10000.0, None)
        q_nope, k_nope = rope(q[..., :self.nope].transpose(1, 2), k[..., :self.nope].transpose(1, 2))
        q = torch.cat((q_nope.transpose(1, 2), q[..., self.nope:]), -1)
        k = torch.cat((k_nope.transpose(1, 2), k[..., self.nope:]), -1)
        return attend(self, q, k, v, documents)

    monkeypatch.setattr(mla.LatentAttention, "attend", coupled)


def no_group_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every token chooses among all experts: the node limit (n_group, topk_group) ignored."""
    monkeypatch.setattr(moe.Router, "limit_groups", lambda self, choice: choice)


@pytest.mark.parametrize("mutation", [rope_per_head, no_group_limit], ids=["rope per head", "no group limit"])
def test_mla_and_routing_mutants_leave_transformers_logits(folders, mutation, monkeypatch):  # noqa: F811
    folder = folders["q_lora"]
    with torch.no_grad():
        expected = _transformers(folder)(IDS).logits
        torch.testing.assert_close(load_model(folder)(IDS), expected, rtol=1e-5, atol=1e-5)
        mutation(monkeypatch)
        assert (load_model(folder)(IDS) - expected).abs().max() > 1e-3


def shared_expert_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ep rank keeps its 1/ep of the shared expert's hidden units (split as the routed experts are), unsummed."""
    moe_forward, swiglu_forward = moe.MoE.forward, SwiGLU.forward

    def marking(self, x):
        if self.shared is not None:
            self.shared.split_over_ranks = True
        return moe_forward(self, x)

    def split(self, x):
        if not getattr(self, "split_over_ranks", False) or not dist.is_initialized():
            return swiglu_forward(self, x)
        h = F.silu(self.w_gate(x)) * self.w_up(x)
        share = torch.arange(h.shape[-1], device=h.device) * dist.get_world_size() // h.shape[-1]
        return self.w_down(h * (share == dist.get_rank()))

    monkeypatch.setattr(moe.MoE, "forward", marking)
    monkeypatch.setattr(SwiGLU, "forward", split)


def test_shared_expert_split_under_ep_is_caught():
    runs = run_parity([Case(partial(ExpertParallelStrategy, expert_parallel_size=2), model=DEEPSEEK, steps=1,
                            mutation=shared_expert_split, label="ep2, shared expert split")], 2)
    with pytest.raises(AssertionError, match=r"batch 0 rank \d: loss .* != single-process"):
        assert_parity(runs[0])
