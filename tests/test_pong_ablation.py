"""scripts/pong_ablation.py: its table in docs/PONG_ABLATION.md is what the committed curves give, a run is a
real launch_impala process stopped at its frame budget, and bad input is one line, exit 2."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "pong_ablation.py"
sys.path.insert(0, str(REPO / "scripts"))

import pong_ablation  # noqa: E402


def _script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout
    )


def _page_table(page: Path) -> str:
    text = page.read_text()
    return text.split(pong_ablation.BEGIN, 1)[1].split(pong_ablation.END, 1)[0].strip()


def test_the_pages_table_is_what_the_committed_curves_give():
    """The figures on the page come from docs/data/ablation by the script, never by hand: redrawn with
    `python scripts/pong_ablation.py report --write docs/PONG_ABLATION.md`."""
    out = _script("report", "--no-plot")
    assert out.returncode == 0, out.stderr
    assert _page_table(pong_ablation.PAGE) == out.stdout.strip()


def test_a_planted_wrong_figure_is_caught(tmp_path):
    """The comparison above can fail: a table one figure off the curves does not match."""
    page = tmp_path / "page.md"
    table = _script("report", "--no-plot").stdout.strip()
    row = next(line for line in table.splitlines() if line.startswith("| obs_norm |"))
    cells = row.split(" | ")
    cells[4] = "-20.0"  # the return at 1M frames
    page.write_text(
        f"x\n{pong_ablation.BEGIN}\n{table.replace(row, ' | '.join(cells))}\n{pong_ablation.END}\n"
    )
    assert _page_table(page) != table
    pong_ablation.write_page(page, table)  # and `report --write` puts the real one back
    assert _page_table(page) == table and page.read_text().startswith("x\n")


def test_an_arm_takes_its_own_runs_only(tmp_path):
    """obs_norm's seeds are pong_obs_norm_s<N>.csv, not obs_norm_sync's pong_obs_norm_sync_s1.csv."""
    for name in (
        "pong_obs_norm_s1.csv",
        "pong_obs_norm_s12.csv",
        "pong_obs_norm_sync_s1.csv",
        "pong_obs_norm_s2.txt",
    ):
        (tmp_path / name).write_text("frames,time,mean_return_100,fps\n")
    assert [seed for seed, _ in pong_ablation.arm_curves("obs_norm", tmp_path)] == [1, 12]
    assert [p.name for _, p in pong_ablation.arm_curves("obs_norm_sync", tmp_path)] == [
        "pong_obs_norm_sync_s1.csv"
    ]


def test_frames_to_a_threshold_and_the_return_at_a_budget_read_the_curve_as_written():
    curve = [(0.5e6, -20.0), (1.0e6, -12.0), (1.6e6, 0.5), (2.49e6, 16.0)]
    assert pong_ablation.first_reach(curve, -10) == 1.6e6 and pong_ablation.first_reach(curve, 18) is None
    assert pong_ablation.value_at(curve, 1.0e6) == -12.0  # the first row at or past the budget
    assert pong_ablation.value_at(curve, 1.5e6) == 0.5
    assert pong_ablation.value_at(curve, 2.5e6) == 16.0  # a curve ending within 3% short of it
    assert pong_ablation.value_at(curve, 3.0e6) is None


def test_a_run_is_launch_impala_stopped_at_its_frames_with_its_curve_kept(tmp_path):
    """For real: the arm's flags reach launch_impala, which is stopped (Ctrl-C, so it checkpoints) once its
    metrics pass the budget; the curve file holds the rows up to it."""
    data, runs = tmp_path / "data", tmp_path / "runs"
    out = _script(
        "--data",
        str(data),
        "run",
        "obs_norm",
        "--seeds",
        "3",
        "--frames",
        "40000",
        "--runs",
        str(runs),
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    config = (runs / "obs_norm" / "s3" / "config.yaml").read_text()
    assert "obs_norm: true" in config and "seed: 3" in config
    assert (runs / "obs_norm" / "s3" / "checkpoint.pt").is_file()
    with open(data / "pong_obs_norm_s3.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and float(rows[-1]["frames"]) >= 40000 and all(float(r["frames"]) < 40000 for r in rows[:-1])
    again = _script("--data", str(data), "run", "obs_norm", "--seeds", "3", "--runs", str(runs))
    assert again.returncode == 0 and "already in" in again.stdout  # a kept curve is not run again


@pytest.mark.parametrize(
    "args, message",
    [
        (("run", "no_such_arm"), "unknown arm 'no_such_arm'"),
        (("run", "obs_norm", "--frames", "10"), "--frames 10: at least 10,000"),
        (("run", "obs_norm", "--seeds", "-1"), "--seeds: non-negative integers"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    out = _script(*args, "--dry-run")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pong_ablation: {message}"), out.stderr
