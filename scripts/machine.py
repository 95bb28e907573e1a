"""Where a figure was measured: every benchmark JSON carries `machine()`, every table `describe(machine())`.

A speed figure on one CPU says little about another: the same wave-2 benchmark gave `lm_ddp` 1.11x torch DDP on an
AVX512/VNNI EPYC and 0.94x on an AVX2-only one; fbgemm's int8 kernels take another path without VNNI. So each
result names the CPU model, the instruction-set flags that change kernels (AVX2, AVX512, VNNI, AMX), the cores this
process may use, the GPU if any, torch and the date.

    python scripts/machine.py          # this machine, as JSON and as the one line the docs print
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any

from lit_lm.strategies.host_malloc import thp_mode

# The flags (as /proc/cpuinfo spells them) that select different kernels in torch, oneDNN and fbgemm.
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
         "amx_int8", "asimd", "sve")


def _cpuinfo() -> tuple[str, list[str]]:
    """(model name, the FLAGS it has) from /proc/cpuinfo; the platform's processor string elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), []
    model, flags = platform.processor() or platform.machine(), set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and model in ("", platform.machine(), platform.processor()):
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model, [f for f in FLAGS if f in flags]


def machine() -> dict[str, Any]:
    """The JSON record of this machine (cheap: no subprocess, no GPU initialisation beyond torch's query)."""
    import torch

    model, flags = _cpuinfo()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu": model, "cpu_flags": flags, "arch": platform.machine(), "cores": cores,
            "gpu": gpu, "gpus": torch.cuda.device_count() if gpu else 0,
            "torch": torch.__version__, "cuda": torch.version.cuda if gpu else None,
            "python": platform.python_version(), "date": datetime.date.today().isoformat(),
            "load_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "thp": thp_mode()}


def describe(m: dict[str, Any]) -> str:
    """One line for a table's caption: 'AMD EPYC (avx2, avx512f, avx512_vnni), 2 cores, torch 2.13.0, 2026-12-01'."""
    if not m:
        return "machine not recorded"
    where = f"{m['gpus']}× {m['gpu']} on " if m.get("gpu") else ""
    flags = f" ({', '.join(m['cpu_flags'])})" if m.get("cpu_flags") else ""
    return f"{where}{m['cpu']}{flags}, {m['cores']} cores, torch {m['torch']}, {m['date']}"


if __name__ == "__main__":
    record = machine()
    print(json.dumps(record, indent=1))
    print(describe(record))
