"""Draw a run's curves from its CSV logs: train and validation loss, learning rate, tokens/s and gradient norm.

    python scripts/plot_run.py runs/default                    # the whole run: every metrics.csv under it
    python scripts/plot_run.py runs/default --out curves.png   # (default: runs/default/curves.png)

`metrics.csv` is what lit-lm's default logger (Lightning's CSVLogger) writes: one row per logging step, columns
for every metric logged (`train_loss`, `val_loss`, `lr`, `tokens_per_s`, `grad_norm`). Every start of a run in
the same directory (the first fit and each resume) writes its own `lightning_logs/version_N/metrics.csv`; the plot
joins them in the order they were written, and where a resume went back to an earlier checkpoint and trained the
same steps again, the later fragment's values replace the earlier ones from its first step on. A metric the run did
not log leaves its panel saying so.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plotting import figure, save  # noqa: E402

PANELS = (("loss", ("train_loss", "val_loss")), ("learning rate", ("lr",)), ("tokens / s", ("tokens_per_s",)),
          ("gradient norm (pre-clip)", ("grad_norm",)))


def find_fragments(run_dir: Path) -> list[Path]:
    """Every metrics.csv in or under `run_dir`, oldest first (one per start of the run: the fit, each resume)."""
    found = sorted(run_dir.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime) if run_dir.is_dir() else []
    if not found:
        raise SystemExit(f"no metrics.csv under {run_dir}: pass a run's default_root_dir (CSVLogger output)")
    return found


def read_series(metrics: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Metric name -> (steps, values), from the rows where the metric has a value."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    with metrics.open() as f:
        for row in csv.DictReader(f):
            for name, value in row.items():
                if name not in ("step", "epoch") and value not in ("", None):
                    steps, values = series.setdefault(name, ([], []))
                    steps.append(int(float(row["step"])))
                    values.append(float(value))
    return series


def read_run(fragments: list[Path]) -> dict[str, tuple[list[int], list[float]]]:
    """The series of every fragment joined, oldest first; a later fragment replaces what earlier ones logged from
    its first step on (a resume from an older checkpoint trains those steps again)."""
    run: dict[str, tuple[list[int], list[float]]] = {}
    for fragment in fragments:
        series = read_series(fragment)
        starts = [steps[0] for steps, _ in series.values() if steps]
        if not starts:
            continue
        start = min(starts)
        for name in set(run) | set(series):
            kept = [(s, v) for s, v in zip(*run.get(name, ([], []))) if s < start]
            kept += list(zip(*series.get(name, ([], []))))
            run[name] = ([s for s, _ in kept], [v for _, v in kept])
    return run


def plot_run(fragments: list[Path], out: Path, title: str) -> Path:
    series = read_run(fragments)
    fig, axes = figure(8.0, 5.0, nrows=2, ncols=2)
    for ax, (panel, names) in zip(axes.flat, PANELS):
        drawn = [n for n in names if n in series]
        for name in drawn:
            steps, values = series[name]
            ax.plot(steps, values, marker="o" if len(steps) < 20 else None, markersize=3, linewidth=1, label=name)
        if not drawn:
            ax.text(0.5, 0.5, f"{' / '.join(names)} not logged", ha="center", va="center", transform=ax.transAxes,
                    fontsize=8, color="grey")
        elif len(drawn) > 1:
            ax.legend(fontsize=7)
        ax.set_title(panel, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step", fontsize=8)
    fig.suptitle(title, fontsize=8)
    return save(fig, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    opts = parser.parse_args()
    fragments = find_fragments(opts.run_dir)
    title = f"{opts.run_dir} ({len(fragments)} log{'s' if len(fragments) > 1 else ''})"
    print(f"wrote {plot_run(fragments, opts.out or opts.run_dir / 'curves.png', title)}")


if __name__ == "__main__":
    main()
