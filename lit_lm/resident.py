"""A process's peak resident memory over a window, from Linux's /proc (the measure the memory tests and benchmarks use).

    peak = ResidentPeak()          # resets the high-water mark (clear_refs 5) and takes VmRSS as the baseline
    ... work ...
    peak.above()                   # VmHWM now minus that baseline, bytes (None where /proc cannot tell)

Resident memory is what the operating system lends the process: tensors, the allocator's cached and fragmented
pages, library workspaces, all of it; the planner's byte counts are held to it (issue 36).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

STATUS = Path("/proc/self/status")


def status_bytes(key: str) -> Optional[int]:
    """A line of /proc/self/status (`VmRSS`, `VmHWM`, ...) in bytes; None where there is none (not Linux)."""
    try:
        text = STATUS.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def reset_peak() -> bool:
    """Make VmHWM the current VmRSS (Linux >= 4.0: write 5 to clear_refs); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class ResidentPeak:
    """The resident high-water mark above the resident memory at construction."""

    def __init__(self) -> None:
        self.supported = reset_peak()
        self.baseline = status_bytes("VmRSS") if self.supported else None

    def above(self) -> Optional[int]:
        peak = status_bytes("VmHWM")
        return None if self.baseline is None or peak is None else peak - self.baseline
