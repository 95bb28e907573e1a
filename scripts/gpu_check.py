"""The GPU run in one command: kernel parity and speed, strategy fits, host syncs and MFU, every result as JSON.

    bash scripts/gpu_check.sh                      # on the GPU machine: writes docs/gpu/<section>.json
    bash scripts/gpu_check.sh --dry-run --out DIR  # the same steps on CPU (Triton interpreter, tiny shapes)

Sections (docs/gpu/README.md says what each JSON holds): kernels, kernel_speed, fits, sync_debug, mfu, speed (eager,
compile and compile + FP8 tokens/s and MFU of the ~1B model under lm_ddp and zero3, docs/compile.md). Each runs in
a process of its own under its own time budget and all within TOTAL_BUDGET, so a crash, a hang or a CUDA error in one is
recorded in its JSON (status "error" or "timeout", with the message) and the others still run; the exit code is 1 when
any section failed. A section writes its JSON as results come, so one cut short by its budget keeps what it measured.
Only torch, triton, lightning and numpy are needed: no `datasets`, no `jsonargparse` (models are built in Python).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Seconds per section on one H200 (estimates: no GPU has run this yet). A session's device allowance is 15 minutes
# with the machine's start (a few minutes) in it and 10 minutes at most per command, so the sections together get
# TOTAL_BUDGET, 7 minutes, and the script stops there whatever each section's own budget says: a section that
# would start with less than MIN_SECTION left is recorded "timeout" without running. Parity compiles ~50 Triton
# variants (~1.5 s each) into Triton's on-disk cache, which the later sections reuse; speed runs its most wanted
# rows first (`gpu_check_train.SPEED_VARIANTS`), so a budget cut loses rowwise FP8, not eager.
BUDGETS = {"kernels": 85, "kernel_speed": 35, "fits": 70, "sync_debug": 20, "mfu": 40, "speed": 170}
TOTAL_BUDGET = 420
MIN_SECTION = 5
DRY_RUN_BUDGET = 300  # per section on a CPU: a guard against hangs only, so a busy CPU cannot fail the tests
# the kernels the goals name first: a section cut short by its budget loses the teaching kernels, not these
KERNEL_NAMES = ["rmsnorm", "swiglu", "attention", "cross_entropy", "rope", "softmax", "gelu", "matmul"]
FAILED = ("failed", "error", "timeout")


def machine_record(device: Any) -> dict[str, Any]:
    """What ran the section: `scripts/machine.py`'s record (CPU model and flags, cores, GPU, torch, CUDA, date)
    plus what a GPU result also needs: the name of the device the section ran on, triton and cuDNN, the UTC time, the
    commit, and whether the Triton interpreter was on."""
    import torch

    from machine import machine

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    record = machine()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {**record, "device_name": name, "triton": triton_version,
            "cudnn": torch.backends.cudnn.version() if record["gpu"] else None,
            "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "commit": commit, "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1"}


class Report:
    """One section's JSON, rewritten whole (atomically) on every update."""

    def __init__(self, path: Path, **fields: Any) -> None:
        self.path, self.data = path, dict(fields)
        self.write()

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)


def budget(args: argparse.Namespace, section: str) -> float:
    given = dict(item.split("=", 1) for item in args.budget or [])
    return float(given[section]) if section in given else DRY_RUN_BUDGET if args.dry_run else BUDGETS[section]


def total_budget(args: argparse.Namespace) -> float:
    """All the sections' time together: TOTAL_BUDGET on a GPU (`--total-budget` to change it); a dry-run's is its
    sections' own budgets added up (a guard against hangs, as theirs)."""
    if args.total_budget is not None:
        return args.total_budget
    return sum(budget(args, s) for s in args.sections) if args.dry_run else TOTAL_BUDGET


def run_section(args: argparse.Namespace) -> int:
    """In the section's own process: run it, record its status (or the exception) in its JSON."""
    import torch

    device = torch.device("cpu" if args.dry_run else "cuda")  # a dry-run stays on the CPU even beside a GPU
    report = Report(Path(args.out) / f"{args.section}.json", section=args.section, status="running",
                    dry_run=args.dry_run, budget_s=budget(args, args.section), machine=machine_record(device))
    t0 = time.perf_counter()
    if args.inject_hang == args.section:
        time.sleep(3600)
    try:
        if args.section in ("kernels", "kernel_speed"):
            import gpu_check_kernels as ck

            if args.section == "kernels":
                status = ck.run_parity(report, args.kernels, args.dry_run, device, args.inject_failure)
            else:
                status = ck.run_speed(report, args.kernels, args.dry_run, device)
        else:
            import gpu_check_train as ct

            if args.section == "fits":
                status = ct.run_fits(report, args.dry_run, device)
            elif args.section == "sync_debug":
                status = ct.run_sync_debug(report, args.dry_run, device)
            elif args.section == "speed":
                status = ct.run_speed(report, args.dry_run, device, args.peak_tflops, args.mfu_precision)
            else:
                status = ct.run_mfu(report, args.dry_run, device, args.peak_tflops, args.mfu_precision)
        report.update(status=status, elapsed_s=time.perf_counter() - t0)
    except Exception as err:
        report.update(status="error", error=f"{type(err).__name__}: {err}"[:2000],
                      traceback=traceback.format_exc()[-6000:], elapsed_s=time.perf_counter() - t0)
    return 1 if report.data["status"] in FAILED else 0


def child_env(dry_run: bool) -> dict[str, str]:
    """The sections' environment (the fork server's, which they inherit)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "scripts"), *filter(None, [env.get("PYTHONPATH")])])
    if dry_run:
        env["TRITON_INTERPRET"] = "1"  # set before anything imports triton (lightning does)
        env.setdefault("OMP_NUM_THREADS", "1")
    else:
        env.pop("TRITON_INTERPRET", None)  # compiled kernels on the GPU
    return env


def section_process(argv: list[str]) -> None:
    """A section's process: in a session of its own, so that the parent stops it with all it started (inductor's
    compile workers) by its process group."""
    os.setsid()
    sys.exit(main(argv))


def sections_context(dry_run: bool) -> Any:
    """Where the sections' processes come from: a fork server that imported torch and lightning once (6 s per
    section on a CPU otherwise) and nothing of CUDA, so each section forked from it still initialises CUDA itself;
    started with the sections' environment (`child_env`: TRITON_INTERPRET set before anything imports triton)."""
    import multiprocessing

    env = child_env(dry_run)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:0] = [p for p in env["PYTHONPATH"].split(os.pathsep) if p not in sys.path]
    os.chdir(ROOT)  # where the sections ran before: the repository root
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "lightning"])
    return context


def run_all(args: argparse.Namespace, forwarded: list[str]) -> int:
    """Each section in a child process with its time budget; the section's JSON completed here if the child
    crashed or ran out of time; summary.json lists every section's status."""
    context = sections_context(args.dry_run)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    deadline = time.perf_counter() + total_budget(args)
    for section in args.sections:
        path, limit = out / f"{section}.json", budget(args, section)
        path.unlink(missing_ok=True)
        left = deadline - time.perf_counter()
        if left < min(limit, MIN_SECTION):
            Report(path, section=section, dry_run=args.dry_run, budget_s=limit, status="timeout", elapsed_s=0.0,
                   error=f"not run: {max(left, 0):.0f} s left of the total budget of {total_budget(args)} s")
            summary[section] = dict(status="timeout", elapsed_s=0.0, error=json.loads(path.read_text())["error"])
            print(f"== {section}: not run, the total budget is spent", flush=True)
            continue
        limit = min(limit, round(left, 1))
        print(f"== {section} (budget {limit} s)", flush=True)
        t0 = time.perf_counter()
        child = context.Process(target=section_process, args=(["--section", section, *forwarded],))
        child.start()
        try:
            child.join(timeout=limit)
            rc = None if child.is_alive() else child.exitcode
        finally:  # over budget, or this process interrupted: the section and anything it started (compile workers)
            if child.is_alive():
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except ProcessLookupError:  # not yet its own group
                    child.kill()
                child.join()
        data = json.loads(path.read_text()) if path.exists() else dict(section=section, dry_run=args.dry_run,
                                                                          budget_s=limit)
        if rc is None:
            data.update(status="timeout", error=f"killed after its budget of {limit} s "
                                                "(what it had measured is kept in this file)")
        elif rc != 0 and data.get("status") not in FAILED:
            data.update(status="error", error=f"the section's process exited with code {rc}: see its log")
        data["elapsed_s"] = time.perf_counter() - t0
        Report(path, **data)
        summary[section] = dict(status=data.get("status"), elapsed_s=round(data["elapsed_s"], 1),
                                error=data.get("error"))
        print(f"== {section}: {data.get('status')} in {data['elapsed_s']:.0f} s", flush=True)
    failed = [name for name, s in summary.items() if s["status"] in FAILED]
    machines = [json.loads((out / f"{name}.json").read_text()).get("machine") for name in summary]
    Report(out / "summary.json", dry_run=args.dry_run, sections=summary, failed=failed,
           machine=next((m for m in machines if m), None))  # the sections' record: no torch import here
    print(f"gpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'all sections passed'} ({out})", flush=True)
    return 1 if failed else 0


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    parser.add_argument("--out", help="folder for the JSON (default docs/gpu; in a dry-run runs/gpu_check_dry)")
    parser.add_argument("--sections", nargs="+", choices=list(BUDGETS), default=list(BUDGETS))
    parser.add_argument("--kernels", nargs="+", choices=KERNEL_NAMES, default=KERNEL_NAMES)
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak (default: from its name)")
    parser.add_argument("--mfu-precision", default="bf16-mixed", help="Lightning precision of the mfu section")
    parser.add_argument("--inject-failure", choices=KERNEL_NAMES, metavar="KERNEL",
                        help="perturb this kernel's output in the parity check (shows a failure is caught)")
    parser.add_argument("--inject-hang", choices=list(BUDGETS), metavar="SECTION",
                        help="make this section hang (shows its budget stops it and the next section runs)")
    parser.add_argument("--budget", action="append", metavar="SECTION=SECONDS",
                        help="another time budget for a section (repeatable; default: the table above)")
    parser.add_argument("--total-budget", type=float, metavar="SECONDS",
                        help=f"all sections together (default {TOTAL_BUDGET} s on a GPU); what is left stops a "
                             "section early and skips the ones after")
    parser.add_argument("--section", choices=list(BUDGETS), help=argparse.SUPPRESS)  # internal: one section
    args = parser.parse_args(argv)
    for item in args.budget or []:
        name, _, seconds = item.partition("=")
        if name not in BUDGETS or not seconds.replace(".", "", 1).isdigit():
            parser.error(f"--budget {item}: expected SECTION=SECONDS with SECTION one of {', '.join(BUDGETS)}")
    args.out = args.out or str(ROOT / ("runs/gpu_check_dry" if args.dry_run else "docs/gpu"))
    if args.dry_run and Path(args.out).resolve() == (ROOT / "docs/gpu").resolve():
        parser.error("a dry-run never writes docs/gpu (it holds the GPU's results): choose another --out")
    if args.dry_run and args.mfu_precision == "bf16-mixed":
        args.mfu_precision = "32-true"  # the CPU's bf16 autocast is slow and beside the point of a dry-run
    return args


def without_sections(argv: list[str]) -> list[str]:
    """argv minus `--sections a b ...`: the parent chooses the sections, a child runs one."""
    out, skipping = [], False
    for arg in argv:
        if arg == "--sections":
            skipping = True
            continue
        if skipping and not arg.startswith("--"):
            continue
        skipping = False
        out.append(arg)
    return out


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.section:
        return run_section(args)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():  # before anything is written to docs/gpu
            print("gpu_check: no CUDA device here; --dry-run runs the same steps on the CPU", file=sys.stderr)
            return 2
    return run_all(args, [*without_sections(argv), "--out", str(Path(args.out).resolve())])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
