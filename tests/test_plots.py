"""The scripts' pictures: sensitivity curves, a run's curves from its metrics.csv and the measured pipeline
timeline are written as PNGs that the imaging library (pillow, which matplotlib pulls in) opens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from PIL import Image

from test_compress_report import SCRIPTS, load_script


def assert_png(path: Path, min_width: int = 300) -> None:
    assert path.is_file() and path.stat().st_size > 1000
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width >= min_width and image.height >= 150
        image.verify()


def test_sensitivity_curves(tmp_path: Path) -> None:
    sensitivity = load_script("sensitivity")
    results = {f"model.blocks.{i}.mlp.w_up.weight": {0.25: 4.0 + 0.01 * i, 0.5: 4.1, 0.9: 4.5 + 0.1 * i}
               for i in range(3)}
    assert_png(sensitivity.plot_curves(results, 3.99, tmp_path / "s.png"))


def test_plot_run_reads_csvlogger_metrics(tmp_path: Path, monkeypatch) -> None:
    run = tmp_path / "run" / "lightning_logs" / "version_0"
    run.mkdir(parents=True)
    rows = ["epoch,grad_norm,lr,step,tokens_per_s,train_loss,val_loss,val_ppl"]
    rows += [f"0,{1.0 / (s + 1)},{1e-3 * s},{s},{1000 + s},{6 - 0.1 * s},," for s in range(10)]
    rows += ["0,,,9,,,5.2,181.3"]  # validation logs on a row of its own
    (run / "metrics.csv").write_text("\n".join(rows) + "\n")
    plot_run = load_script("plot_run")
    fragments = plot_run.find_fragments(tmp_path / "run")
    series = plot_run.read_series(fragments[0])
    assert series["val_loss"] == ([9], [5.2]) and series["train_loss"][0] == list(range(10))
    assert series["grad_norm"][1][0] == 1.0
    out = subprocess.run([sys.executable, str(SCRIPTS / "plot_run.py"), str(tmp_path / "run")], check=True,
                         capture_output=True, text=True).stdout
    assert out.strip() == f"wrote {tmp_path / 'run' / 'curves.png'}"
    assert_png(tmp_path / "run" / "curves.png")
    figures = []  # the picture's title is the run's, each panel its own (the panel loop once overwrote the title)
    monkeypatch.setattr(plot_run, "save", lambda fig, path: figures.append(fig) or path)
    plot_run.plot_run(fragments, tmp_path / "unused.png", "the run")
    assert figures[0]._suptitle.get_text() == "the run"
    assert [ax.get_title() for ax in figures[0].axes] == [panel for panel, _ in plot_run.PANELS]


def test_plot_run_joins_a_run_across_its_resumes(tmp_path: Path) -> None:
    """A fit to step 9, a resume from step 6's checkpoint (steps 6-9 trained again) to 14, then one to 19: the plot
    shows steps 0-19 once each, the resumed values where steps were trained twice."""
    import os

    plot_run = load_script("plot_run")
    for version, (first, last, loss) in enumerate([(0, 9, 6.0), (6, 14, 5.0), (15, 19, 4.0)]):
        log = tmp_path / "run" / "lightning_logs" / f"version_{version}"
        log.mkdir(parents=True)
        rows = ["lr,step,train_loss"] + [f"0.001,{s},{loss}" for s in range(first, last + 1)]
        (log / "metrics.csv").write_text("\n".join(rows) + "\n")
        os.utime(log / "metrics.csv", (1e9 + version, 1e9 + version))  # the order they were written
    series = plot_run.read_run(plot_run.find_fragments(tmp_path / "run"))
    steps, losses = series["train_loss"]
    assert steps == list(range(20))
    assert losses == [6.0] * 6 + [5.0] * 9 + [4.0] * 5
    assert series["lr"][0] == list(range(20))


def test_bench_pipeline_plots_measured_timelines(tmp_path: Path) -> None:
    args = ["--stages", "2", "--microbatches", "2", "--layers", "4", "--model", "sleep", "--sleep-ms", "2",
            "--steps", "2", "--plot", str(tmp_path / "pp.png"), "--json", str(tmp_path / "pp.json")]
    subprocess.run([sys.executable, str(SCRIPTS / "bench_pipeline.py"), *args], check=True, capture_output=True,
                   env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}, timeout=300)
    assert_png(tmp_path / "pp.png")
