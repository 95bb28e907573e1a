"""glibc's malloc on CPU ranks: freed memory handed back to the system at the step's phase boundaries, so that what a
rank has resident is what it holds, and the planner's bytes (`lit_lm.planner.estimate`) are its peak.

glibc serves a block of at least its mmap threshold (128 KiB at start) with its own mapping, returned to the system
when freed; smaller blocks come from the heap, where freed memory stays resident for reuse. The threshold is dynamic:
freeing a mapped block raises it to that block's size (up to 32 MiB on 64-bit), so after the first step a layer's
weights and gradients, activations and the optimizer step's pieces come from the heap, and what one phase frees
there stays resident through the next, in amounts that depend on the order of every allocation since the start:
7-14% above the estimate on 2 gloo ranks at 217M parameters, 17-26% at 52M, 830 MiB more in one zero3 run at 350M
than in the next (docs/benchmarks/2026-12-planner-peaks-cpu.md).

`LIT_LM_MALLOC` chooses (unset: `DEFAULT`):
    large  (the default) `mallopt(M_MMAP_THRESHOLD, 8 MiB)` (2 MiB under huge pages) at start, `malloc_trim(0)` at the
           end of the strategy's setup: every block from 8 MiB on (at hundreds of millions of parameters: an MLP's
           weights and gradients, gathered units, bucket and reduce buffers, the logits) is mapped and returned when
           freed, so the big blocks never sit in the heap; smaller ones (all of a ~4M-parameter model's tensors, the
           optimizer step's 256 KiB pieces, activations at a small batch) come from the heap as glibc does by default,
           so a small model's step is glibc's own. ZeRO-3 at 217M on 2 gloo ranks: peak 2.65-2.73 GiB against 2.89-3.14
           GiB with `setup` (the estimate 2.45 GiB: 0.92 of the peak instead of 0.78-0.85), at ~5% more time per step
           there (11.4 against 10.9 s, within the spread: ~1 GB of big blocks faulted in per step);
           docs/benchmarks/2026-12-planner-peaks-cpu.md. ZeRO-2 at 217M through the Trainer: 4.65 against 4.43 s a step
           under `glibc` (one run each; autograd's backward 2.44-2.64 against 2.27 s: the MLP's 16 MiB gradients mapped
           anew every step), 0.90-0.96x its plain loop on glibc's own malloc in two sets of 5 alternated rounds
           (docs/benchmarks/2026-12-size-cpu.md): the price of the planner's accuracy, per run, without huge pages; with
           them (below, the `lit-lm` command's default) the Trainer is level with its plain loop. Why not glibc's own
           ceiling, 32 MiB (trim threshold 64 MiB): measured, ZeRO-2's Trainer then ran 1.03x its plain loop, but every
           preset's peak rose by 100-735 MiB at 217M-350M and ZeRO-3's estimate fell to 0.78-0.81 of its peak (tp2's to
           0.83): the 16 MiB weights and gradients stayed in the heap. Under torch's huge pages (below) the threshold is
           2 MiB (`huge_pages_asked`): torch advises huge pages for every block from 2 MiB, aligned to 2 MiB; a block in
           the heap leaves that advice on its stretch when freed, and what lands there next (smaller blocks, the
           alignment's gaps) is made resident 2 MiB at a time. With 8 MiB there, tp2's estimate fell to 0.83 of its peak
           at 217M and 350M; with 2 MiB every preset is at 0.90-0.95 (2 gloo ranks, a 2-core AMD EPYC, 2026-12-02;
           docs/benchmarks/2026-12-planner-peaks-cpu.md), at no cost measured: ZeRO-2's Trainer at 217M ran 0.93 and
           1.03 (paired medians, spreads crossing 1) the speed of the 8 MiB threshold in two sets of 5 alternated rounds
           (docs/benchmarks/2026-12-size-cpu.md).
    setup  `malloc_trim(0)` once, at the end of the strategy's setup: what building and sharding the
           model freed (ZeRO-3: the whole parameters) goes back to the system; the steps run on glibc as it is.
    trim   `malloc_trim(0)` also after backward and its gradient reduction, and after the optimizer step (its
           all-gathers included): the free heap pages of every arena go back to the system there. Within a phase
           glibc reuses its heap as before, so what is faulted in again is each phase's heap high-water, once per
           step: no measured cost at 52M and 217M (steps of 1.4-6 s), but 15-20% at 4.3M (steps of ~0.27 s: the
           Trainer's zero2 0.35 against 0.29 s, lm_ddp 0.33 against 0.27 s, 3 alternated runs each, quiet 2-core
           Xeon, 2026-12-01), hence opt-in. Fragmentation within forward and backward stays.
    fixed  `mallopt(M_MMAP_THRESHOLD, 128 KiB)` at start: glibc's starting threshold kept, its adjustment off; every
           block from 128 KiB on is mapped and unmapped each time. Resident memory is then the live blocks at every
           moment (the estimate is 0.94-0.99 of the peak), but each large temporary is faulted in again each time:
           8-37% slower steps at 52M-217M. For a run that must be held to the byte.
    glibc  glibc as it is.
Left alone where the user set `MALLOC_MMAP_THRESHOLD_` (glibc read it at start). Nothing happens off glibc (musl,
macOS); with another allocator preloaded (jemalloc, tcmalloc) glibc's calls tune an allocator that serves nothing.

Huge pages (`ask_huge_pages`, what makes `large` cheap): a block mapped afresh is faulted in page by page on first
touch, 4 KiB at a time, and at hundreds of millions of parameters a step maps ~1 GB of big blocks anew (gradients,
gathered units, reduce buffers). torch's CPU allocator advises the kernel to back its blocks from 2 MiB with transparent
huge pages (`madvise(MADV_HUGEPAGE)`) when `THP_MEM_ALLOC_ENABLE=1`, which it reads once, at the process's first
allocation: the `lit-lm` command sets it on a machine without a GPU before anything allocates (`lit_lm/__main__.py`;
`import lightning` already does), and the ranks it launches inherit it. ZeRO-2 at 217M on 2 gloo ranks through the
Trainer, 2 runs each on a 2-core AMD EPYC (AVX2), 2026-12-02: 6.6-7.2 s a step against 8.8-9.0 s without, the same peak
(2.90 GB); docs/benchmarks/2026-12-size-cpu.md. Nothing happens where the user set `THP_MEM_ALLOC_ENABLE` (0 turns it
off) or the kernel's THP is `never` or absent; a script that builds its own Trainer sets it itself, before `import
lightning`.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

M_MMAP_THRESHOLD = -3  # <malloc.h>
HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"  # torch's CPU allocator (c10/core/impl/alloc_cpu.cpp), read at its first allocation
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")  # "always [madvise] never": the kernel's choice
THRESHOLDS = {"fixed": 128 * 1024, "large": 8 * 1024 * 1024}  # fixed: glibc's own starting threshold, kept
HUGE_PAGE = 2 * 1024 * 1024  # torch advises huge pages for its blocks from this size (and aligns them to it)
CHOICE = "LIT_LM_MALLOC"
MODES = ("large", "setup", "trim", "fixed", "glibc")
DEFAULT = "large"


def _glibc() -> Optional[Any]:
    """The C library if it is glibc (on Linux), else None."""
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: AttributeError elsewhere)
    except (OSError, AttributeError):
        return None
    return libc


def thp_mode() -> Optional[str]:
    """The kernel's transparent huge page mode (`always`, `madvise` or `never`); None where it has none."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1: text.index("]")] if "[" in text else None


def ask_huge_pages() -> bool:
    """Before this process's first CPU allocation: ask torch's allocator for transparent huge pages on blocks from 2
    MiB, here and in the processes this one starts (they inherit the environment). True if it set the variable.
    Not where torch sees a GPU: the ranks' big blocks are on the device there, and the host's few (checkpoint
    copies) would risk the kernel's compaction stalls on a huge page's fault for no measured gain."""
    import torch

    if HUGE_PAGES in os.environ or thp_mode() in (None, "never") or torch.cuda.is_available():
        return False
    os.environ[HUGE_PAGES] = "1"
    return True


def huge_pages_asked() -> bool:
    """Whether torch's allocator in this process advises huge pages for its blocks from 2 MiB (it reads the variable
    as "1" or not, once) and the kernel may grant them."""
    return os.environ.get(HUGE_PAGES) == "1" and thp_mode() in ("always", "madvise")


def huge_page_eligible(tensor: torch.Tensor) -> bool:
    """Whether the kernel may back `tensor`'s memory with huge pages (its mapping's `THPeligible` in
    /proc/self/smaps: the advice and the kernel's mode, not whether it found a free huge page)."""
    address, eligible, inside = tensor.data_ptr(), False, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and head == "THPeligible:":
            eligible = line.split()[1] == "1"
    return eligible


class HostMalloc:
    """This process's choice (`LIT_LM_MALLOC`), applied: `start()` once the rank runs, `trim()` at each boundary."""

    def __init__(self) -> None:
        mode = os.environ.get(CHOICE) or DEFAULT
        if mode not in MODES:
            raise ValueError(f"{CHOICE}={mode!r}: choose one of {', '.join(MODES)} (lit_lm/strategies/host_malloc.py)")
        self.libc = _glibc()
        self.mode = "glibc" if self.libc is None or "MALLOC_MMAP_THRESHOLD_" in os.environ else mode

    def threshold(self) -> Optional[int]:
        """glibc's mmap threshold this choice fixes (None: glibc's own). `large` under huge pages: 2 MiB, so that
        every block torch advises is a mapping of its own, never a stretch of the heap."""
        if self.mode == "large" and huge_pages_asked():
            return HUGE_PAGE
        return THRESHOLDS.get(self.mode)

    def start(self) -> bool:
        """With `fixed` or `large`, fix glibc's mmap threshold for this process; True if it did."""
        threshold = self.threshold()
        return threshold is not None and self.libc.mallopt(M_MMAP_THRESHOLD, threshold) == 1

    def trim(self, setup: bool = False) -> None:
        """Hand the free heap pages of every arena back to the system: with `trim` at every boundary, with `setup`
        and `large` only at the end of the setup (`setup=True`)."""
        if self.mode == "trim" or (setup and self.mode in ("setup", "large")):
            self.libc.malloc_trim(0)
