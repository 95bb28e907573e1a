"""`scripts/gpu_check.sh --dry-run`: the GPU run's every step on the CPU (Triton interpreter, tiny shapes), in the
environment the GPU machine has: `datasets` and `jsonargparse` cannot be imported (a sitecustomize on PYTHONPATH
puts a meta-path finder in front that refuses them), so an import of either anywhere on the path fails the run.

Asserts each section's JSON holds what the GPU results are judged on, and that a planted failure (one kernel's
output off by one) is recorded and turns the exit code non-zero.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lit_lm.planner.estimate import flops_per_token

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ["kernels", "kernel_speed", "fits", "sync_debug", "mfu", "speed"]
KERNELS = ["rmsnorm", "swiglu", "attention", "cross_entropy", "rope", "softmax", "gelu", "matmul"]
BLOCKER = '''import sys


class _Blocked:
    """The GPU machine has neither package: any import of them fails here too."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("datasets", "jsonargparse"):
            raise ImportError(f"{name} is blocked: the GPU machine does not have it")
        return None


sys.meta_path.insert(0, _Blocked())
'''


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text(BLOCKER)
    out = dict(os.environ, PYTHONPATH=str(site), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    out.pop("TRITON_INTERPRET", None)  # the script must set it itself for its dry-run
    return out


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def load(out: Path) -> dict[str, Any]:
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


@pytest.fixture(scope="module")
def dry_run(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess,
                                                                                       dict[str, Any]]:
    out = tmp_path_factory.mktemp("gpu")
    result = run(env, "--dry-run", "--out", str(out))
    return result, load(out)


def test_the_blocker_blocks(env: dict[str, str]) -> None:
    for name in ("datasets", "jsonargparse"):
        probe = subprocess.run([sys.executable, "-c", f"import {name}"], env=env, capture_output=True, text=True)
        assert probe.returncode != 0 and "blocked" in probe.stderr, probe.stderr


def test_every_section_passes_and_names_the_machine(dry_run: tuple) -> None:
    result, data = dry_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "torch" in result.stdout and "nvidia-smi" in result.stdout  # the environment is printed first
    assert set(data) == {*SECTIONS, "summary"}
    assert data["summary"]["failed"] == [] and list(data["summary"]["sections"]) == SECTIONS
    for name in SECTIONS:
        section = data[name]
        assert section["section"] == name and section["dry_run"] is True
        assert section["status"] == ("skipped" if name == "sync_debug" else "ok"), section.get("error")
        machine = section["machine"]
        for key in ("device_name", "torch", "triton", "cuda", "date", "time_utc", "cpu", "cpu_flags", "commit"):
            assert key in machine
        assert machine["device_name"] == "cpu" and machine["triton_interpret"] is True


def test_kernel_parity_rows(dry_run: tuple) -> None:
    rows = dry_run[1]["kernels"]["results"]
    assert {r["kernel"] for r in rows} == set(KERNELS)
    for row in rows:
        if "skipped" in row:  # bf16 through tl.dot: GPU only
            assert row["kernel"] in ("attention", "matmul") and row["dtype"] == "bfloat16"
            continue
        assert row["passed"], row
        bound = 1e-4 if row["dtype"] == "float32" else 3e-2 * 4  # atol + rtol * |ref| with |ref| of a few units
        assert 0 <= row["max_abs_err"] < bound and row["max_rel_err"] < bound
        assert {t["tensor"] for t in row["tensors"]} >= {"out0", "grad0"}
    for kernel in KERNELS:  # two shapes (a tiny one and an edge one) in fp32 each
        assert len([r for r in rows if r["kernel"] == kernel and r["dtype"] == "float32"]) == 2


def test_kernel_speed_rows(dry_run: tuple) -> None:
    speed = dry_run[1]["kernel_speed"]
    assert speed["copy_bandwidth"]["gbps"] > 0
    rows = speed["results"]
    for kernel in KERNELS:
        for mode in ("fwd", "fwd+bwd"):
            impls = {r["impl"]: r for r in rows if r["kernel"] == kernel and r["mode"] == mode}
            assert impls["triton"]["ms"] > 0 and impls["eager"]["ms"] > 0
            assert ("gbps" in impls["triton"]) != ("tflops" in impls["triton"])
            if "compile" in impls:
                assert "skipped" in impls["compile"]
    assert {r["impl"] for r in rows if r["kernel"] == "attention"} >= {"sdpa_flash"}
    summary = {(r["kernel"], r["mode"]): r for r in speed["summary"]}
    assert summary[("rmsnorm", "fwd")]["fraction_of_copy_bandwidth"] > 0
    assert summary[("attention", "fwd+bwd")]["speedup_vs_eager"] > 0


def test_fits_lose_the_same_under_every_strategy(dry_run: tuple) -> None:
    fits = dry_run[1]["fits"]
    runs = fits["runs"]
    assert len(runs) == 9 and {r["process_group_backend"] for r in runs} == {"gloo"}
    for kernels in (False, True):
        by_name = {r["strategy"]: r["losses"] for r in runs if bool(r["kernels"]) == kernels and not r["compile"]}
        assert set(by_name) == {"lm_ddp", "zero1", "zero2", "zero3"}
        for losses in by_name.values():
            assert len(losses) == fits["steps"] and losses == pytest.approx(by_name["lm_ddp"], rel=1e-5)
    compiled = runs[-1]  # the kernels (interpreted) under compile: the same losses as eager
    assert compiled["compile"] == "aot_eager" and compiled["kernels"] and compiled["strategy"] == "lm_ddp"
    assert compiled["losses"] == pytest.approx(by_name["lm_ddp"], rel=1e-5)
    assert len(fits["checks"]) == 11 and all(c["passed"] for c in fits["checks"])


def test_sync_debug_is_skipped_on_cpu_after_running_the_fit(dry_run: tuple) -> None:
    section = dry_run[1]["sync_debug"]
    assert section["mode_applied"] is False and "skipped on CPU" in section["note"]
    assert len(section["fit"]["losses"]) == section["steps"] and section["sync_count"] == 0


def test_sync_sites_counts_each_synchronising_call_site(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the sync debug mode emits on a GPU: a UserWarning naming the Python line that synced (stacklevel 1)."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from gpu_check_train import SyncSites

    def item() -> None:
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)

    shown = warnings.showwarning
    with SyncSites() as syncs:
        item()
        item()
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("unrelated", UserWarning, stacklevel=1)  # shown as usual, not counted
    assert syncs.count == 3 and len(syncs.sites) == 2
    twice = next(site for site in syncs.sites.values() if site["count"] == 2)
    assert twice["stack"][-1].endswith(" item") and "synchronizing" in twice["message"]
    assert warnings.showwarning is shown  # restored after the block


def test_mfu_is_model_flops_over_peak(dry_run: tuple) -> None:
    section = dry_run[1]["mfu"]
    cfg = section["model"]
    per_token = flops_per_token(section["params_without_embedding"], cfg["n_layers"], cfg["d_model"],
                                section["seq_len"])
    assert section["flops_per_token"] == per_token and section["peak_flops"] > 0
    assert section["mfu"] == pytest.approx(per_token * section["tokens_per_s"] / section["peak_flops"])
    assert 0 < section["mfu"] < 1 and section["dry_run"] is True
    assert len(section["step_seconds"]) == section["steps"]
    assert section["measured_steps"] == section["steps"] - section["warmup"] > 0  # the warm-up left out
    measured_tokens = section["batch"] * section["seq_len"] * section["measured_steps"]
    assert section["tokens_per_s"] == pytest.approx(measured_tokens / section["window_s"])


def test_speed_rows_eager_compile_and_fp8_under_lm_ddp_and_zero3(dry_run: tuple) -> None:
    section = dry_run[1]["speed"]
    rows = {(r["strategy"], r["variant"]): r for r in section["runs"]}
    variants = ["eager", "compile", "compile+fp8 tensorwise", "compile+fp8 rowwise"]
    assert set(rows) == {(s, v) for s in ("lm_ddp", "zero3") for v in variants}
    for (strategy, variant), row in rows.items():
        assert "error" not in row, row.get("error")
        assert row["compile"] == ("aot_eager" if variant != "eager" else False)  # the dry-run's backend
        assert row["fp8"] == (variant.rsplit(" ", 1)[-1] if "fp8" in variant else None)
        assert row["mfu"] == pytest.approx(section["flops_per_token"] * row["tokens_per_s"] / section["peak_flops"])
        assert len(row["losses"]) == section["steps"] and all(x == x for x in row["losses"])
        assert row["vs_eager"] == pytest.approx(row["tokens_per_s"] / rows[(strategy, "eager")]["tokens_per_s"])
        # the warm-up (the compile in it) is out of the timed window, its compile time reported apart
        assert row["measured_steps"] == section["steps"] - section["warmup"] > 0
        assert row["tokens_per_s"] == pytest.approx(
            section["batch"] * section["seq_len"] * row["measured_steps"] / row["window_s"])
        assert len(row["compile_graphs_per_step"]) == section["steps"] and row["compiles_in_window"] == 0
        if not row["compile"]:
            assert row["compile_graphs_per_step"][0] == 0 == row["compile_s"]
    for variant in variants[1:]:  # the process's first fit of each compiled variant compiles in its first step
        first = rows[("lm_ddp", variant)]  # (zero3's may reuse its graphs: ZeRO-3's hooks are outside the blocks)
        assert first["compile_graphs_per_step"][0] > 0 and first["compile_s"] > 0, first


def test_a_failing_kernel_fails_the_run(env: dict[str, str], tmp_path: Path) -> None:
    result = run(env, "--dry-run", "--out", str(tmp_path), "--sections", "kernels", "--kernels", "rmsnorm",
                 "--inject-failure", "rmsnorm")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    data = load(tmp_path)
    assert set(data) == {"kernels", "summary"} and data["summary"]["failed"] == ["kernels"]
    section = data["kernels"]
    assert section["status"] == "failed" and len(section["failed"]) == 4  # 2 shapes x (fp32, bf16)
    for row in section["results"]:
        out0 = next(t for t in row["tensors"] if t["tensor"] == "out0")
        assert not row["passed"] and not out0["pass"] and out0["max_abs_err"] == pytest.approx(1.0, abs=0.05)
        assert all(t["pass"] for t in row["tensors"] if t["tensor"] != "out0")  # the gradients are untouched


def test_a_section_over_its_budget_is_stopped_and_the_next_one_runs(env: dict[str, str], tmp_path: Path) -> None:
    result = run(env, "--dry-run", "--out", str(tmp_path), "--sections", "sync_debug", "kernels", "--kernels", "gelu",
                 "--inject-hang", "sync_debug", "--budget", "sync_debug=5")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    data = load(tmp_path)
    assert data["sync_debug"]["status"] == "timeout" and "budget of 5.0 s" in data["sync_debug"]["error"]
    assert data["kernels"]["status"] == "ok" and data["summary"]["failed"] == ["sync_debug"]


def test_the_total_budget_stops_the_run_and_skips_what_is_left(env: dict[str, str], tmp_path: Path) -> None:
    result = run(env, "--dry-run", "--out", str(tmp_path), "--sections", "sync_debug", "kernels", "--kernels", "gelu",
                 "--inject-hang", "sync_debug", "--total-budget", "6")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    data = load(tmp_path)  # the hang stopped when the total ran out, the next section not started
    assert (data["sync_debug"]["status"] == "timeout"
            and "killed after its budget of 6.0 s" in data["sync_debug"]["error"])
    assert data["kernels"]["status"] == "timeout" and "not run" in data["kernels"]["error"]
    assert data["summary"]["failed"] == ["sync_debug", "kernels"]


def test_the_budgets_fit_a_device_session() -> None:
    """15 minutes of device time per session, the machine's start (a few minutes) in them, 10 at most per command:
    the sections' budgets add up to the total, and the total leaves margin under 8 minutes."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert sum(gpu_check.BUDGETS.values()) <= gpu_check.TOTAL_BUDGET <= 450
    assert set(gpu_check.BUDGETS) == set(SECTIONS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="here the GPU run would start")
def test_without_a_gpu_the_real_run_refuses_and_writes_nothing(env: dict[str, str], tmp_path: Path) -> None:
    result = run(env, "--out", str(tmp_path / "gpu"))
    assert result.returncode == 2 and "no CUDA device" in result.stderr and not (tmp_path / "gpu").exists()


def test_a_dry_run_never_writes_docs_gpu(env: dict[str, str]) -> None:
    result = subprocess.run([sys.executable, "scripts/gpu_check.py", "--dry-run", "--out", "docs/gpu"], cwd=ROOT,
                            env=env, capture_output=True, text=True)
    assert result.returncode == 2 and "never writes docs/gpu" in result.stderr
