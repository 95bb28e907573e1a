"""What the scripts' pictures share: matplotlib on a file backend (no display), small low-dpi PNGs (the docs' are
committed), one figure per file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DPI = 72


def figure(width: float = 6.0, height: float = 3.6, **kwargs: Any) -> tuple[Any, Any]:
    return plt.subplots(figsize=(width, height), **kwargs)


def save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
