"""Draw a run's curves from its CSV log: train and validation loss, learning rate, tokens/s and gradient norm.

    python scripts/plot_run.py runs/default                    # the newest metrics.csv under the directory
    python scripts/plot_run.py runs/default --out curves.png   # (default: next to the metrics.csv)

`metrics.csv` is what lit-lm's default logger (Lightning's CSVLogger) writes: one row per logging step, columns
for every metric logged (`train_loss`, `val_loss`, `lr`, `tokens_per_s`, `grad_norm` when a lit-lm strategy clips).
A metric the run did not log leaves its panel saying so.
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


def find_metrics(run_dir: Path) -> Path:
    """The newest metrics.csv in or under `run_dir`."""
    found = sorted(run_dir.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime) if run_dir.is_dir() else []
    if not found:
        raise SystemExit(f"no metrics.csv under {run_dir}: pass a run's default_root_dir (CSVLogger output)")
    return found[-1]


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


def plot_run(metrics: Path, out: Path) -> Path:
    series = read_series(metrics)
    fig, axes = figure(8.0, 5.0, nrows=2, ncols=2)
    for ax, (title, names) in zip(axes.flat, PANELS):
        drawn = [n for n in names if n in series]
        for name in drawn:
            steps, values = series[name]
            ax.plot(steps, values, marker="o" if len(steps) < 20 else None, markersize=3, linewidth=1, label=name)
        if not drawn:
            ax.text(0.5, 0.5, f"{' / '.join(names)} not logged", ha="center", va="center", transform=ax.transAxes,
                    fontsize=8, color="grey")
        elif len(drawn) > 1:
            ax.legend(fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step", fontsize=8)
    fig.suptitle(str(metrics.parent), fontsize=8)
    return save(fig, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    opts = parser.parse_args()
    metrics = find_metrics(opts.run_dir)
    print(f"wrote {plot_run(metrics, opts.out or metrics.parent / 'curves.png')}")


if __name__ == "__main__":
    main()
