"""scripts/plot_games.py, run as a real process: one panel per game from committed curves; bad input is one
line and exit 2."""

from __future__ import annotations

import sys
from pathlib import Path

from procs import run

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "docs" / "data"
SCRIPT = [sys.executable, str(REPO / "scripts" / "plot_games.py")]


def test_draws_a_panel_per_game_from_curve_files_and_run_folders(tmp_path):
    run_folder = tmp_path / "run"
    run_folder.mkdir()
    (run_folder / "metrics.csv").write_text(
        "step,charts/env_frames,charts/mean_return_100\n1,1000,\n2,2000,1.5\n3,4000,2.5\n"
    )
    out = tmp_path / "games.png"
    panels = [
        f"Breakout=before:{DATA / 'single_breakout_4M_s1.csv'},after:{DATA / 'obsnorm_breakout_4M_s1.csv'}",
        f"Mine=run:{run_folder}",
    ]
    result = run([*SCRIPT, *panels, "--out", str(out)], timeout=120)
    assert result.returncode == 0, result.stderr
    assert "2 panels" in result.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_panels_and_files_are_one_line_and_exit_2(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("frames,time,mean_return_100\n")
    for panel, says in (
        ("Breakout", "expected TITLE=LABEL:CSV"),
        ("Breakout=before", "expected TITLE=LABEL:CSV"),
        (f"Breakout=before:{tmp_path / 'missing.csv'}", "missing.csv"),
        (f"Breakout=before:{empty}", "no rows with frames and a mean return"),
    ):
        result = run([*SCRIPT, panel, "--out", str(tmp_path / "x.png")], timeout=120)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and says in lines[0], (panel, result.stderr)
        assert not (tmp_path / "x.png").exists()
