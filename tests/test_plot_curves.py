"""scripts/plot_curves.py, run for real on CSV files: every curve gets its own colour (docs/pong.png draws
11; matplotlib's default cycle has 10 and gave the 11th the first one's), and a source without data is one
line, not a traceback."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "plot_curves.py"


@pytest.fixture(scope="module")
def plot_curves():
    spec = importlib.util.spec_from_file_location("plot_curves", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _curve(path: Path, slope: float, with_time: bool) -> str:
    rows = ["frames,time,mean_return_100"] if with_time else ["frames,mean_return_100"]
    for i in range(5):
        rows.append(f"{i * 1000},{i * 10},{slope * i}" if with_time else f"{i * 1000},{slope * i}")
    path.write_text("\n".join(rows) + "\n")
    return str(path)


@pytest.mark.parametrize("n", [3, 11, 14])
def test_every_curve_has_its_own_colour(plot_curves, tmp_path, monkeypatch, n):
    import matplotlib.colors
    import matplotlib.pyplot as plt

    sources = [_curve(tmp_path / f"c{i}.csv", i + 1, with_time=i % 2 == 0) for i in range(n)]
    out = tmp_path / "curves.png"
    monkeypatch.setattr(sys, "argv", ["plot_curves.py", *sources, "--legend", "below", "--out", str(out)])
    plot_curves.main()
    fig = plt.gcf()
    frames_axis, minutes_axis = fig.axes
    colours = [matplotlib.colors.to_hex(line.get_color()) for line in frames_axis.get_lines()]
    assert len(colours) == n
    assert len(set(colours)) == n, colours
    # a curve keeps its colour in the wall-time panel (only the sources with a time column are drawn there)
    assert [matplotlib.colors.to_hex(line.get_color()) for line in minutes_axis.get_lines()] == colours[::2]
    assert out.stat().st_size > 10_000
    plt.close(fig)


def test_a_folder_without_metrics_is_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "--out", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"plot_curves: no metrics.csv in {str(tmp_path)!r}"
