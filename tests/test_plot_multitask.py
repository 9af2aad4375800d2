"""scripts/plot_multitask.py, run for real on small run folders laid out as scripts/learn_multitask.sh lays
them out: the table's returns and human-normalized scores are read at each game's own frames, a run that
has not reached a step shows none, and bad input is one line, exit 2."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "plot_multitask.py"
GAMES = ["PongDeterministic-v4", "BreakoutDeterministic-v4"]
# (random, human) of the standard table: Pong (-20.7, 14.6), Breakout (1.7, 30.5)


def _write(folder: Path, rows: list[dict]) -> None:
    folder.mkdir(parents=True)
    keys = sorted({k for r in rows for k in r})
    with open(folder / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          cwd=str(ROOT))  # fmt: skip


def test_the_table_reads_each_game_at_its_own_frames(tmp_path):
    # a multi-task run: Pong's frames run ahead of Breakout's in the rows' order, and it reaches 2M per game
    multi = []
    for k in range(1, 9):
        f = k * 250_000
        row = {f"tasks/{g}/frames": f for g in GAMES}
        row["tasks/PongDeterministic-v4/mean_return_100"] = -20.7 + k * 35.3 / 8
        row["tasks/BreakoutDeterministic-v4/mean_return_100"] = 1.7 + k * 28.8 / 16
        row["popart/sigma/PongDeterministic-v4"], row["popart/sigma/BreakoutDeterministic-v4"] = 0.5, 2.0 + k
        row["tasks/PongDeterministic-v4/entropy"] = k
        row["tasks/BreakoutDeterministic-v4/policy_lag"] = 10 * k
        row["tasks/PongDeterministic-v4/grad_cosine"] = -0.1 * k
        multi.append(row)
    _write(tmp_path / "popart-s1", multi)
    # single-task runs: Pong to 1M frames only, Breakout to 2M
    _write(tmp_path / "single-Pong-s1", [{"charts/env_frames": 1_000_000, "charts/mean_return_100": 14.6}])
    # Breakout's rows 130k apart, none at 1M: read from the nearest (950k, not 1.08M), as within 10% of it
    breakout = [{"charts/env_frames": f, "charts/mean_return_100": r} for f, r in
                ((950_000, 30.5), (1_080_000, 1.7), (2_000_000, 30.5))]  # fmt: skip
    _write(tmp_path / "single-Breakout-s1", breakout)
    out = _run("--root", str(tmp_path), "--games", ",".join(GAMES), "--out", str(tmp_path / "mt.png"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "mt.png").stat().st_size > 10_000
    md = (tmp_path / "mt.md").read_text()
    # popart at 1M per game: Pong -20.7 + 35.3 / 2 = -3.05 (HNS 0.5), Breakout 1.7 + 28.8 / 4 = 8.9 (0.25)
    assert "| popart s1 | -3.1 (0.500) | 8.9 (0.250) | 0.375 | 0.375 |" in md, md
    # at 2M: Pong 14.6 (1.0), Breakout 16.1 (0.5)
    assert "| popart s1 | 14.6 (1.000) | 16.1 (0.500) | 0.750 | 0.750 |" in md, md
    # the single-task reference: both games at 1M; at 2M only Breakout got there, so no median
    assert "| single s1 | 14.6 (1.000) | 30.5 (1.000) | 1.000 | 1.000 |" in md, md
    assert "| single s1 | – | 30.5 (1.000) | – | – |" in md, md
    assert "| single s1 | 1.000 (1.000) | – |" in md and "| popart s1 | 0.375 (0.375) | 0.750 (0.750) |" in md
    # the per-task diagnostics over the second half of each game's 2M frames: rows k = 5..8 (1.25M-2M);
    # a column the run did not log is "–", and the single-task runs (no per-task columns) get no table
    assert "popart s1, per game over the second half of its frames:" in md and "single s1, per game" not in md
    assert "| Pong | 6.50 | – | – | – | – | – | -0.65 | – |" in md, md
    assert "| Breakout | – | – | – | – | – | – | – | 65.00 |" in md, md


def test_no_runs_or_an_unscored_game_is_one_line_and_exit_2(tmp_path):
    out = _run("--root", str(tmp_path), "--games", ",".join(GAMES), "--out", str(tmp_path / "x.png"))
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "no runs under" in out.stderr
    _write(tmp_path / "popart-s1", [{"tasks/CartPole-v1/frames": 1, "tasks/CartPole-v1/mean_return_100": 1}])
    out = _run("--root", str(tmp_path), "--games", "CartPole-v1", "--out", str(tmp_path / "x.png"))
    assert out.returncode == 2 and "no human reference score for CartPole-v1" in out.stderr


def test_curves_kept_as_csv_files_join_by_label(tmp_path):
    """--multi and --single read committed CSVs (the docs' short frames,mean_return_100 form too) beside the
    runs found under --root; a malformed spec or a missing file is one line, exit 2."""
    multi = [
        {
            "tasks/PongDeterministic-v4/frames": 1_000_000,
            "tasks/PongDeterministic-v4/mean_return_100": -3.05,
            "tasks/BreakoutDeterministic-v4/frames": 1_000_000,
            "tasks/BreakoutDeterministic-v4/mean_return_100": 16.1,
        }
    ]
    _write(tmp_path / "kept", multi)
    short = tmp_path / "pong_short.csv"
    short.write_text("frames,time,mean_return_100,fps\n500000,10,-20.7,5000\n1000000,20,14.6,5000\n")
    _write(tmp_path / "breakout_single", [{"charts/env_frames": 1_000_000, "charts/mean_return_100": 1.7}])
    args = ["--root", str(tmp_path / "none"), "--games", ",".join(GAMES), "--out", str(tmp_path / "mt.png")]
    breakout = tmp_path / "breakout_single" / "metrics.csv"
    out = _run(*args, "--multi", f"popart s9={tmp_path / 'kept' / 'metrics.csv'}",
               "--single", f"alone:PongDeterministic-v4={short}",
               "--single", f"alone:BreakoutDeterministic-v4={breakout}")  # fmt: skip
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "mt.md").read_text()
    # Pong -3.05 (-3.0499... in binary, printed -3.0) -> 0.5, Breakout 16.1 -> 0.5;
    # alone: Pong 14.6 -> 1.0, Breakout 1.7 -> 0.0
    assert "| popart s9 | -3.0 (0.500) | 16.1 (0.500) | 0.500 | 0.500 |" in md, md
    assert "| alone | 14.6 (1.000) | 1.7 (0.000) | 0.500 | 0.500 |" in md, md
    # --upto: the single-task curve read only to 0.5M frames, so no 1M column is left
    out = _run(*args, "--single", f"alone:PongDeterministic-v4={short}", "--upto", "500000")
    assert out.returncode == 0, out.stderr
    assert "at 1M frames" not in (tmp_path / "mt.md").read_text()
    for bad, says in [
        (["--multi", f"x={short}", "--upto", "-1"], "--upto must be >= 0"),
        (["--multi", "no-equals-sign"], "--multi takes LABEL=PATH"),
        (["--single", f"alone=PongDeterministic-v4={short}"], "--single takes LABEL:GAME=PATH"),
        (["--single", f"alone:CartPole-v1={short}"], "is not one of --games"),
        (["--multi", f"x={tmp_path / 'missing.csv'}"], "cannot read"),
    ]:
        out = _run(*args, *bad)
        assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and says in out.stderr, (bad, out)


def test_runs_with_another_value_loss_weight_are_found_labelled_and_ordered(tmp_path):
    """learn_multitask.sh's BASELINE_COST names its runs popart-bc0.25-s1 and single-popart-bc0.25-<Game>-s1,
    its ENVS_PER_WORKER popart-k20-s1: each is a run of its own, labelled with its settings, after the arm's
    default runs; a folder of another game or none of the arms' names is left out."""
    row = {f"tasks/{g}/frames": 1_000_000 for g in GAMES}
    runs = (("popart-bc0.25-s1", -3.05), ("popart-s2", 14.6), ("popart-s1", -20.7), ("raw-s1", 0),
            ("popart-k20-s1", 14.6), ("popart-bc0.25-k20-s3", 0), ("popart-k-s1", 0))  # fmt: skip
    for label, pong in runs:
        _write(tmp_path / label, [{**row, "tasks/PongDeterministic-v4/mean_return_100": pong,
                                   "tasks/BreakoutDeterministic-v4/mean_return_100": 1.7}])  # fmt: skip
    single = {"charts/env_frames": 1_000_000, "charts/mean_return_100": 14.6}
    for name in ("single-popart-bc0.25-Pong-s1", "single-popart-Pong-s1", "single-popart-Seaquest-s1",
                 "popartish-s1", "single-Pong-s10"):  # fmt: skip
        _write(tmp_path / name, [single])
    out = _run("--root", str(tmp_path), "--games", ",".join(GAMES), "--out", str(tmp_path / "mt.png"))
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "mt.md").read_text()
    labels = [line.split(" | ")[0][2:] for line in md.split("\n\n")[1].splitlines()[2:]]
    assert labels == ["popart s1", "popart s2", "popart bc0.25 s1", "popart bc0.25 k20 s3", "popart k20 s1",
                      "raw s1", "single s10",
                      "single-popart s1", "single-popart bc0.25 s1"], md  # fmt: skip
    # each weight's run keeps its own curve: Pong at -3.05 (HNS 0.5) for bc0.25, -20.7 (0.0) for the default
    assert "| popart bc0.25 s1 | -3.0 (0.500) | 1.7 (0.000) |" in md, md
    assert "| popart s1 | -20.7 (0.000) | 1.7 (0.000) |" in md, md
    assert "| popart k20 s1 | 14.6 (1.000) | 1.7 (0.000) |" in md, md
