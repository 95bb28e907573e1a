"""The hand-written DDP: the GradSync engine without Lightning, then `lm_ddp` against single-process training."""

from __future__ import annotations

import os
from functools import partial

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

import lit_lm.strategies.registry  # noqa: F401  (registers lm_ddp)
from lit_lm.callbacks.clip import GlobalNormClip
from dist_utils import TinyLM, run_distributed
from lit_lm.parity import CLIP_ABOVE, Case, assert_parity, run_parity
from lit_lm.strategies.comm import COMM_LOG
from lit_lm.strategies.ddp import DataParallelStrategy
from lit_lm.strategies.grad_sync import GradSync, _bucketize
from lit_lm.strategies.zero_engine import model_state_bytes


# -- engine ------------------------------------------------------------------------------------------------------
class Toy(nn.Module):
    """Tied embedding/head, a frozen layer, a layer nobody uses and one only rank 1 uses."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.body = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(8, 8)
        self.rank1_only = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, use_rank1_layer: bool) -> torch.Tensor:
        x = self.frozen(torch.tanh(self.body(self.emb(idx))))
        if use_rank1_layer:
            x = self.rank1_only(x)
        return self.head(x).logsumexp(-1).mean()


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _engine_worker(caps: list[float]) -> tuple[list[dict], dict]:
    return [_engine_case(cap) for cap in caps], _in_place_case()


def _engine_case(bucket_cap_mb: float) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(rank)  # different initial weights: GradSync must broadcast rank 0's
    model = Toy()
    sync = GradSync(model, bucket_cap_mb=bucket_cap_mb)
    batches = [torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(10 * rank + k)) for k in range(3)]
    out = {"weights": {n: p.detach().clone() for n, p in model.named_parameters()}, "buckets": len(sync.buckets)}

    # one synchronised step: local grads from a copy without hooks, then the synced ones
    reference = Toy()
    reference.load_state_dict(model.state_dict())
    reference(batches[0], rank == 1).backward()
    out["local"] = _grads(reference)
    COMM_LOG.reset()
    sync(batches[0], rank == 1).backward()
    out["launched_in_backward"] = sync._next  # buckets already in flight before finish_grad_sync()
    sync.finish_grad_sync()
    out["synced"] = _grads(model)
    out["reduced_numel"] = COMM_LOG.summary()["all_reduce"]["numel"]

    # accumulation: a no_sync micro-step, then a synchronised one; the sum of both is averaged
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    for k in (1, 2):
        reference(batches[k], rank == 1).backward()
    with sync.no_sync():
        sync(batches[1], rank == 1).backward()
    sync(batches[2], rank == 1).backward()
    sync.finish_grad_sync()
    out["local_accum"], out["synced_accum"] = _grads(reference), _grads(model)
    return out


def _in_place_case() -> dict:
    """Where the gradients live over four steps on the same batch (so the averaged gradients must come out equal):
    after zero_grad(set_to_none=True) twice, after set_to_none=False, and with a `.grad` replaced by a tensor of
    the user's before backward (accumulated there, then copied into its slice at launch)."""
    rank = dist.get_rank()
    model = Toy()
    sync = GradSync(model, bucket_cap_mb=1e-4)  # a few parameters per bucket
    trainable = [p for p in model.parameters() if p.requires_grad]
    buffers = {b.flat.untyped_storage().data_ptr() for b in sync.buckets}
    batch = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(rank))
    steps = []
    for mode in ("none", "none", "zeros", "replaced"):
        model.zero_grad(set_to_none=mode == "none")
        if mode == "replaced":
            model.body.weight.grad = torch.zeros_like(model.body.weight)
        sync(batch, rank == 1).backward()
        # before finish_grad_sync(): what autograd accumulated is already in the buckets (the unused layer is not yet)
        replaced = {"body.weight"} if mode == "replaced" else set()  # still the user's tensor
        in_buffers_before = {n: p.grad.untyped_storage().data_ptr() in buffers
                             for n, p in model.named_parameters() if p.grad is not None and n not in replaced}
        sync.finish_grad_sync()
        # gradient memory: the distinct storages behind the .grads and the communication buffers
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in [*(p.grad for p in trainable), *(b.flat for b in sync.buckets)]}
        steps.append({"in_buffers_before": in_buffers_before,
                      "in_buffers": [p.grad.untyped_storage().data_ptr() in buffers for p in trainable],
                      "grad_bytes": sum(storages.values()), "walked_grad_bytes": model_state_bytes(model)["grads"],
                      "grads": _grads(model)})
    return {"steps": steps, "phi_bytes": sum(p.numel() * p.element_size() for p in trainable),
            "buffer_bytes": sum({b.flat.untyped_storage().data_ptr(): b.flat.untyped_storage().nbytes()
                                 for b in sync.buckets}.values())}


def _mean(per_rank: list[dict], name: str, like: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.zeros_like(like) if r[name] is None else r[name] for r in per_rank]).mean(0)


def test_grad_sync_averages_gradients() -> None:
    caps = [1e-6, 1000.0]  # one bucket per parameter (7 trainable tensors); one bucket for all
    per_rank, in_place = zip(*run_distributed(_engine_worker, 2, caps))
    _check_in_place(in_place)
    for case, cap in enumerate(caps):
        results = [r[case] for r in per_rank]
        assert results[0]["buckets"] == (7 if cap < 1 else 1)
        _check_engine_case(results)
    # Reverse order: rank1_only's 2 tensors come first, then the unused layer, which holds every later bucket
    # back (buckets launch in order). Rank 1 used rank1_only: 2 buckets left during backward, asynchronously,
    # overlapping the rest of backward; rank 0: none.
    assert [r[0]["launched_in_backward"] for r in per_rank] == [0, 2]


def _check_in_place(per_rank: tuple[dict, ...]) -> None:
    """Gradients live in the buckets: one copy of Φ per rank (grads and communication buffers together, storages
    counted once), every .grad a view of a bucket buffer from backward on, the same buffers every step."""
    for r in per_rank:
        assert r["buffer_bytes"] == r["phi_bytes"]
        for step in r["steps"]:
            assert all(step["in_buffers"]) and all(step["in_buffers_before"].values())
            assert step["grad_bytes"] == step["walked_grad_bytes"] == r["phi_bytes"]
            assert step["grads"]["frozen.weight"] is None
        first = r["steps"][0]["grads"]
        for step in r["steps"][1:]:  # every mode restarts from zeros
            for name, g in step["grads"].items():
                torch.testing.assert_close(g, first[name], rtol=0, atol=0)


def _check_engine_case(results: list[dict]) -> None:
    for name, w in results[0]["weights"].items():
        torch.testing.assert_close(results[1]["weights"][name], w, rtol=0, atol=0)  # rank 0's broadcast
    for local, synced in (("local", "synced"), ("local_accum", "synced_accum")):
        for name, like in results[0]["weights"].items():
            grads = [r[synced][name] for r in results]
            if name.startswith("frozen"):
                assert grads == [None, None]
                continue
            expected = _mean([r[local] for r in results], name, like)
            for g in grads:
                torch.testing.assert_close(g, expected, rtol=1e-6, atol=1e-7)
            if name.startswith("unused"):
                assert torch.count_nonzero(grads[0]) == 0
    # named_parameters() lists the tied head weight once (as emb.weight): it is reduced once
    trainable = sum(w.numel() for n, w in results[0]["weights"].items() if not n.startswith("frozen"))
    assert results[0]["reduced_numel"] == trainable


# -- lm_ddp against one process ------------------------------------------------------------------------------------
class CommPerStep(L.Callback):
    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_start(self, *args) -> None:
        COMM_LOG.reset()

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        """The gradient all-reduces of the step (the metric sync of the logged loss is a labelled one more)."""
        grads = [r for r in COMM_LOG.records if r.label == "GradSync bucket"]
        self.steps.append({"numel": sum(r.numel for r in grads), "wire_bytes": sum(r.wire_bytes for r in grads)})


DDP = partial(DataParallelStrategy, bucket_cap_mb=0.01)
# SGD with the collectives counted; AdamW with Trainer clipping (small enough to clip every step) and accumulation;
# AdamW with the clipping callback; SGD with a limit above every norm, by the Trainer and by the callback (clipping
# must then leave the gradients alone: a coefficient not capped at 1 would scale them up, test_parity_mutations.py)
CASES = [Case(DDP, callbacks=(CommPerStep(),), label="sgd"),
         Case(DDP, optimizer="adamw", trainer={"gradient_clip_val": 0.05, "accumulate_grad_batches": 2},
              label="adamw clip accumulate"),
         Case(DDP, optimizer="adamw", callbacks=(GlobalNormClip(0.05),), label="adamw GlobalNormClip"),
         Case(DDP, trainer={"gradient_clip_val": CLIP_ABOVE}, label="sgd, clip limit above the norm"),
         Case(DDP, callbacks=(GlobalNormClip(CLIP_ABOVE),), label="sgd GlobalNormClip, limit above the norm")]


def test_lm_ddp_matches_single_process() -> None:
    runs = run_parity(CASES, 2)
    for run in runs:
        assert_parity(run)
    for run in runs[2:3]:
        assert min(s["grad_norm"] for s in run["single"]["steps"]) > 0.05  # every step was clipped
    for run in runs[3:]:
        assert max(s["grad_norm"] for s in run["single"]["steps"]) < CLIP_ABOVE / 2  # no step was

    # accounting: the gradient all-reduces move the whole gradient (Φ elements) once per optimizer step
    module = TinyLM()
    module.configure_model()
    phi = sum(p.numel() for p in module.parameters())
    comm = runs[0]["ranks"][0]["callbacks"][0].steps
    assert len(comm) == CASES[0].steps
    for step in comm:
        assert step["numel"] == phi
        assert step["wire_bytes"] == pytest.approx(2 * (2 - 1) / 2 * phi * 4, rel=0.02)


# -- bad configurations --------------------------------------------------------------------------------------------
def test_fp16_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"trainer\.precision: bf16-mixed"):
        L.Trainer(accelerator="cpu", devices=2, strategy="lm_ddp", plugins=[MixedPrecision("16-mixed", "cpu")])


def test_world_size_mismatch_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")  # processes started by an external launcher
    with pytest.raises(ValueError, match=r"WORLD_SIZE=3.*trainer\.devices"):
        L.Trainer(accelerator="cpu", devices=2, strategy="lm_ddp")
    assert os.environ["WORLD_SIZE"] == "3"


def test_first_bucket_is_small_so_communication_starts_early() -> None:
    """Reverse order, first bucket closed at `first_cap_bytes` (torch DDP's 1 MB), the others at `cap_bytes`: a
    model smaller than one full bucket still launches its last layers' all-reduce before backward is over."""
    params = [nn.Parameter(torch.zeros(n)) for n in (3, 3, 3, 3, 3, 3)]  # 12 bytes each
    sizes = [[p.numel() for p in b] for b in _bucketize(params, cap_bytes=40, first_cap_bytes=12)]
    assert sizes == [[3], [3, 3, 3, 3], [3]]
    assert len(_bucketize(params, cap_bytes=1000)) == 1
    assert len(_bucketize(params, cap_bytes=1000, first_cap_bytes=24)) == 2
    assert len(_bucketize(params, cap_bytes=12, first_cap_bytes=1000)) == 6  # never larger than cap_bytes
