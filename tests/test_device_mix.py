"""The compression callbacks put every tensor on the device of the data it meets, and read nothing back to the host
in a training step: on a GPU a CPU codebook, histogram or factory-made tensor meeting cuda data is an error (or a
silent copy and host sync), and an NCCL collective refuses a CPU tensor. This machine has no GPU, so each test makes
a mix fail on CPU instead:

- `meta` data: the weights on the `meta` device, where every op runs without values; a CPU tensor combined with them
  raises, and so does a `.cpu()` / `.item()` of them (k-means runs entirely on meta);
- `meta` by default: real CPU data under `torch.device("meta")`, so that a tensor made without `device=` (zeros,
  arange, linspace, tensor, full) lands on meta and the maths that combines it with the data raises, or the result
  is on meta (PTQ's range search reads `.item()`s, which meta data cannot give; QAT's fake quantization has no meta
  kernels; pruning's masks, bit packing and k-means are checked here too);
- no host reads: a torch function mode that refuses `.cpu()`, `.item()`, `.tolist()` and a tensor's truth value or
  Python number inside a training step of QAT (activations and TTQ) and of k-means.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lit_lm.callbacks.compress import PTQ, QAT, KMeansQuantization
from lit_lm.callbacks.compress.core import pack_bits, select, unpack_bits
from lit_lm.callbacks.compress.kmeans import kmeans_1d
from lit_lm.callbacks.compress.pruning import UnitGroup, magnitude_masks, nm_mask
from lit_lm.callbacks.compress.ptq import choose_range
from lit_lm.callbacks.compress.qat import IntLinear
from lit_lm.strategies.base import whole_weights


def _linears(device: str | torch.device = "cpu") -> nn.ModuleDict:
    """Two linears (named `a`, `b`; what the callbacks select) run one after the other."""
    torch.manual_seed(0)
    return nn.ModuleDict({"a": nn.Linear(16, 8, bias=False), "b": nn.Linear(8, 4, bias=False)}).to(device)


def _run(root: nn.ModuleDict, x: Tensor) -> Tensor:
    return root["b"](torch.relu(root["a"](x)))


class NoHostReads(TorchFunctionMode):
    """Raise on whatever reads a tensor back to the host (a sync on a GPU)."""

    READS = {"cpu", "item", "tolist", "numpy", "__bool__", "__float__", "__int__"}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in self.READS:
            raise AssertionError(f"host read in a training step: Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


def _trainer(step: int) -> SimpleNamespace:
    """What the k-means hooks read of a Trainer (no strategy: the weights are whole)."""
    return SimpleNamespace(strategy=None, max_steps=10, global_step=step, world_size=1)


def _kmeans_steps(root: nn.Module, km: KMeansQuantization, steps: int) -> None:
    km.on_train_start(_trainer(0), root)
    for step in range(1, steps + 1):
        with torch.no_grad():
            root["a"].weight.add_(0.01)  # the optimizer step the centroids follow
        km.on_train_batch_end(_trainer(step), root)


def test_kmeans_runs_on_the_weights_device() -> None:
    root = _linears("meta")
    root.log = lambda *args, **kwargs: None  # pl_module.log: the per-layer bits
    km = KMeansQuantization(bits=2, start_step=1, include=["a", "b"], exclude=())
    _kmeans_steps(root, km, 3)  # clusters at step 1, then moves the centroids twice
    assert km.codebooks.keys() == {"a.weight", "b.weight"}
    assert all(c.device.type == "meta" and c.shape == (4,) for c in km.codebooks.values())
    assert all(a.device.type == "meta" and a.shape == (8, 16) for a in list(km.assignments.values())[:1])

    cpu = _linears()  # a checkpoint's state (CPU) restored under meta weights: moved to them at the start
    cpu.log = lambda *args, **kwargs: None
    trained = KMeansQuantization(bits=2, start_step=1, include=["a", "b"], exclude=())
    _kmeans_steps(cpu, trained, 2)
    restored = KMeansQuantization(bits=2, start_step=1, include=["a", "b"], exclude=())
    restored.load_state_dict(trained.state_dict())
    assert all(c.device.type == "cpu" for c in restored.codebooks.values())
    root = _linears("meta")
    root.log = lambda *args, **kwargs: None
    restored.on_train_start(_trainer(2), root)
    restored.on_train_batch_end(_trainer(3), root)
    assert all(c.device.type == "meta" for c in [*restored.codebooks.values(), *restored.assignments.values()])
    assert kmeans_1d(torch.randn(5, 7, device="meta"), 4)[0].device.type == "meta"


def test_tensors_made_inside_follow_the_data() -> None:
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(0, 8, (37,), generator=gen)
    weights = torch.randn(64, generator=gen)
    counts = torch.rand(64, generator=gen).double() * 10 + 1
    x = torch.randn(4, 5, 16, generator=gen)
    qat_settings = ({"bits": 8}, {"bits": 2, "ternary": "ttq"}, {"bits": 4, "group_size": 8})
    roots = [_linears() for _ in range(1 + len(qat_settings))]  # made on CPU, before the meta default
    with torch.device("meta"):
        assert torch.equal(unpack_bits(pack_bits(values, 3), 3, 37), values)
        centroids, assignment = kmeans_1d(weights, 4)
        assert centroids.device.type == assignment.device.type == "cpu"
        w = weights.view(8, 8)
        keep = UnitGroup("m", (("w", 0, 2),)).keep_units({"w": w}, 0.5, "l2")
        masks = [keep, *magnitude_masks([w], 0.5), nm_mask(w, 2, 4)]
        assert [m.device.type for m in masks] == ["cpu"] * 3 and int(keep.sum()) == 2
        for method in ("minmax", "percentile", "mse", "kl"):
            lo, hi = choose_range(weights.double().sort().values, counts, method, percentile=99.0, grid=16)
            assert weights.min() <= lo < hi <= weights.max()

        ptq = PTQ(bits=8, method="kl", bins=256, grid=8, include=["a", "b"], exclude=())
        root = roots.pop()
        ptq.calibrate(root, lambda batch: _run(root, batch), [x[:2], x[2:]])
        ptq.convert(root)
        assert isinstance(root["a"], IntLinear) and _run(root, x).device.type == "cpu"

        for kwargs, root in zip(qat_settings, roots):
            qat = QAT(include=["a", "b"], exclude=(), scale_lr=0.01, **kwargs)
            qat.attach(root, select(whole_weights(root), ["a", "b"], (), "QAT"))
            _run(root, x).square().mean().backward()
            qat._update_ttq_scales()
            qat.convert(root)
            assert _run(root, x).device.type == "cpu"


@pytest.mark.parametrize("kwargs", [{"bits": 8}, {"bits": 2, "ternary": "ttq"},
                                    {"bits": 2, "ternary": "ttq", "activations": False}, {"bits": 1, "group_size": 8}])
def test_a_qat_step_reads_nothing_back_to_the_host(kwargs: dict) -> None:
    root = _linears()
    qat = QAT(include=["a", "b"], exclude=(), freeze_observers_step=2, **kwargs)
    qat.attach(root, select(whole_weights(root), ["a", "b"], (), "QAT"))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    for step in range(3):  # the first (observers and TTQ scales set), an EMA update, a frozen one
        qat._step = step
        with NoHostReads():
            _run(root, x).square().mean().backward()
            qat.on_before_optimizer_step(None, root, None)
    assert all(not o.isnan().any() for o in qat.observers.values()) or not qat.activations
    if qat.ttq:
        assert all(not s[:3].isnan().any() and int(s[3, 0]) == 3 for s in qat.ttq_scales.values())


def test_a_kmeans_step_reads_nothing_back_to_the_host() -> None:
    root = _linears()
    root.log = lambda *args, **kwargs: None
    km = KMeansQuantization(bits=2, start_step=1, include=["a", "b"], exclude=())
    _kmeans_steps(root, km, 1)  # clustering: once, at start_step (reads allowed)
    before = {k: v.clone() for k, v in km.codebooks.items()}
    with torch.no_grad():
        root["a"].weight.add_(0.01)
    with NoHostReads():
        km._update_centroids()
        km._snap(_trainer(2))
    assert not torch.equal(km.codebooks["a.weight"], before["a.weight"])  # the centroids followed the weights
