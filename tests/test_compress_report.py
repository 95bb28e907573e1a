"""scripts/compress_report.py: the exported int8 model is timed against the dense one (its layers on the fbgemm
kernel), each in its own worker process over alternated rounds, the table carries the forward-time column (median
and min-max) relative to dense, and the loss-vs-size scatter is a PNG."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import matplotlib.pyplot as plt

from lit_lm.callbacks.compress import QAT
from lit_lm.callbacks.compress.core import DEFAULT_EXCLUDE, select
from lit_lm.callbacks.compress.qat import IntLinear
from dist_utils import TINY, token_data
from lit_lm.config import ModelConfig
from lit_lm.module import LanguageModel
from lit_lm.strategies.base import whole_weights

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str):  # noqa: ANN201 (a module)
    sys.path.insert(0, str(SCRIPTS))  # the scripts import their shared `plotting`
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_report_times_the_int8_export_and_plots_loss_against_size(tmp_path: Path) -> None:
    report = load_script("compress_report")
    dense = LanguageModel(ModelConfig(**TINY))
    dense.configure_model()
    qat = QAT(8)
    exported = copy.deepcopy(dense)
    qat.attach(exported, select(whole_weights(exported), None, DEFAULT_EXCLUDE, "QAT"))
    exported.train()
    exported.model(token_data(4)[:, :-1])  # observers
    exported = report.export(exported, [], [qat])
    linears = [m for m in exported.modules() if isinstance(m, IntLinear)]
    assert len(linears) == 14 and all(m.uses_kernel for m in linears)
    ms, loads = report.forward_latency({"dense": dense.eval(), "qat_int8": exported.eval()}, batch=2, seq_len=16,
                                       rounds=5, reps=2)
    assert list(ms) == ["dense", "qat_int8"] and len(loads) == 10
    assert all(s["n"] == 5 and 0 < s["min"] <= s["median"] <= s["max"] for s in ms.values())
    rows = {name: {"val_loss": 4.0 + i, "ppl": 50.0, "sparsity": 0.0, "bits": 32 - 24 * i, "bytes": 1000 - 500 * i,
                   "forward_ms": ms[name]} for i, name in enumerate(ms)}
    header, _, dense_row, int8_row = report.table(rows)
    assert header.rstrip(" |").endswith("exported forward ms [min-max]")
    dense_ms, int8_ms = ms["dense"], ms["qat_int8"]
    assert dense_row.endswith(f"{dense_ms['median']:.1f} [{dense_ms['min']:.1f}-{dense_ms['max']:.1f}] (1.00x) |")
    assert int8_row.endswith(f"{int8_ms['median']:.1f} [{int8_ms['min']:.1f}-{int8_ms['max']:.1f}] "
                             f"({int8_ms['median'] / dense_ms['median']:.2f}x) |")
    png = report.plot_loss_vs_size(rows, tmp_path / "scatter.png")
    image = plt.imread(png)
    assert png.stat().st_size > 1000 and image.ndim == 3 and image.shape[0] > 100
