#!/usr/bin/env python
"""Per-frame ablation on Pong: our defaults moved toward Sample Factory's published Atari settings one
difference at a time (docs/PONG_ABLATION.md).

    python scripts/pong_ablation.py run obs_norm --seeds 1 2      # run arms (one at a time), 2.5M frames each
    python scripts/pong_ablation.py run obs_norm --dry-run        # the commands, nothing run
    python scripts/pong_ablation.py report                        # table, and docs/pong_ablation.png
    python scripts/pong_ablation.py list                          # the arms and what each changes

Each run is a real ``launch_impala --env PongDeterministic-v4 --workers 2`` with every default but the
arm's flags (each arm names --obs-norm or --no-obs-norm, so its meaning does not move with the default).
The budget is a frame count at which the run is stopped with Ctrl-C (it writes its checkpoint and exits),
not ``--total-frames``: the learning rate keeps the default's schedule (decaying over 20M frames), so an
arm's first 2.5M frames are exactly what a default-length run with its flags does. A finished run's curve
is copied, small, to ``docs/data/ablation/pong_<arm>_s<seed>.csv`` (frames, time, mean return of the last
100 episodes, frames/s), and the report is drawn from those files alone, so it survives the loss of the
run folders. An arm and seed whose curve is there already is not run again.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "ablation"
PAGE = ROOT / "docs" / "PONG_ABLATION.md"
# the page's table lies between these lines; `report --write` replaces it, and tests/test_pong_ablation.py
# fails when it differs from what the committed curves give
BEGIN, END = "<!-- pong_ablation report: begin -->", "<!-- pong_ablation report: end -->"
ENV = "PongDeterministic-v4"
THRESHOLDS = (-10.0, 0.0, 15.0)
AT_FRAMES = (1.0e6, 1.5e6, 2.0e6, 2.5e6)
CI_AT = 2.0e6  # the frames at which the arms' seeds are compared with rliable

# name -> (launch_impala flags, the difference from Sample Factory's published Atari run it tests)
ARMS: dict[str, tuple[list[str], str]] = {
    "baseline": (["--no-obs-norm"], "none: the defaults before input normalization (frames x 1/255)"),
    "popart": (["--no-obs-norm", "--popart"], "return normalization: PopArt on the clipped rewards"),
    "obs_norm": (["--obs-norm"], "input normalization: each pixel standardized by running statistics"),
    # from here on, each arm adds one difference to obs_norm (kept: it is the step that pays)
    "obs_norm_popart": (["--obs-norm", "--popart"], "obs_norm + PopArt (Sample Factory normalizes both)"),
    "obs_norm_sync": (["--obs-norm", "--sync"], "obs_norm + synchronous collection (policy lag 0)"),
    "obs_norm_lr": (["--obs-norm", "--learning-rate", "2.5e-4"], "obs_norm + learning rate 2.5e-4"),
    "obs_norm_rollout128": (
        ["--obs-norm", "--unroll-length", "128", "--batch-size", "8", "--minibatches", "4"],
        "obs_norm + 128-step rollouts (8 x 128 per batch, 4 minibatches of 2 x 128)",
    ),
    "obs_norm_nature": (["--obs-norm", "--model", "nature"], "obs_norm + the Nature CNN"),
    "nature": (["--no-obs-norm", "--model", "nature"], "the Nature CNN instead of the shallow IMPALA CNN"),
    "sync": (["--no-obs-norm", "--sync"], "synchronous collection (policy lag 0)"),
    "lr": (["--no-obs-norm", "--learning-rate", "2.5e-4"], "learning rate 2.5e-4 instead of 5e-4"),
}


class AblationError(ValueError):
    """Bad input: one line, exit 2."""


def curve_file(arm: str, seed: int, data: Path = DATA) -> Path:
    return data / f"pong_{arm}_s{seed}.csv"


def read_metrics(path: Path) -> list[dict[str, float]]:
    """(frames, time, mean_return_100, fps) per row of a run's metrics.csv that has a return."""
    rows = []
    if not path.is_file():
        return rows
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            frames, ret = r.get("charts/env_frames"), r.get("charts/mean_return_100")
            if not frames or not ret:
                continue
            rows.append(
                {
                    "frames": float(frames),
                    "time": float(r.get("time") or "nan"),
                    "mean_return_100": float(ret),
                    "fps": float(r.get("charts/fps") or "nan"),
                }
            )
    return rows


def last_frames(path: Path) -> int:
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, csv.Error):
        return 0
    for r in reversed(rows):
        if r.get("charts/env_frames"):
            return int(float(r["charts/env_frames"]))
    return 0


def command(arm: str, seed: int, logdir: Path, python: str) -> list[str]:
    flags, _ = ARMS[arm]
    return [
        python, "-m", "learner.cli.launch_impala", "--env", ENV, "--workers", "2", "--seed", str(seed),
        "--logdir", str(logdir), "--force", "--no-progress", "--log-interval", "10", *flags,
    ]  # fmt: skip


def run_one(arm: str, seed: int, frames: int, runs: Path, python: str, data: Path = DATA) -> None:
    logdir = runs / arm / f"s{seed}"
    cmd = command(arm, seed, logdir, python)
    print(f"pong_ablation: {arm} seed {seed}: {' '.join(cmd[2:])} (stopped at {frames:,} frames)", flush=True)
    logdir.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(runs / arm / f"s{seed}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                if last_frames(logdir / "metrics.csv") >= frames:
                    proc.send_signal(signal.SIGINT)  # a checkpoint, then a clean exit
                    proc.wait(timeout=300)
                    break
                time.sleep(5)
        except BaseException:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=300)
            raise
    rows = read_metrics(logdir / "metrics.csv")
    past = next((i for i, r in enumerate(rows) if r["frames"] >= frames), None)
    rows = rows if past is None else rows[: past + 1]  # up to the first row at or past the budget
    if not rows or rows[-1]["frames"] < frames * 0.98:
        raise SystemExit(
            f"pong_ablation: {arm} seed {seed} ended at exit {proc.returncode} before {frames:,} frames"
        )
    write_curve(curve_file(arm, seed, data), rows)
    last = rows[-1]
    print(
        f"pong_ablation: {arm} seed {seed}: {last['mean_return_100']:.2f} at {last['frames']:,.0f} frames, "
        f"{(time.monotonic() - start) / 60:.1f} min",
        flush=True,
    )


def write_curve(path: Path, rows: list[dict[str, float]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["frames", "time", "mean_return_100", "fps"])
        for r in rows:
            w.writerow(
                [int(r["frames"]), f"{r['time']:.1f}", f"{r['mean_return_100']:.2f}", f"{r['fps']:.0f}"]
            )


def arm_curves(arm: str, data: Path = DATA) -> list[tuple[int, Path]]:
    """(seed, curve file) of each committed run of ``arm``, by seed. Matched by the whole name: a glob on
    ``pong_obs_norm_s*`` also took ``pong_obs_norm_sync_s1.csv`` (another arm's run) as a seed of obs_norm."""
    pattern = re.compile(rf"pong_{re.escape(arm)}_s(\d+)\.csv")
    found = [(int(m.group(1)), p) for p in data.glob("pong_*.csv") if (m := pattern.fullmatch(p.name))]
    return sorted(found)


def read_curve(path: Path) -> list[tuple[float, float]]:
    with open(path, newline="") as f:
        return [
            (float(r["frames"]), float(r["mean_return_100"]))
            for r in csv.DictReader(f)
            if r["mean_return_100"]
        ]


def first_reach(curve: list[tuple[float, float]], threshold: float) -> float | None:
    return next((f for f, r in curve if r >= threshold), None)


def value_at(curve: list[tuple[float, float]], frames: float) -> float | None:
    """The return of the first row at or past ``frames``; a curve that ends within 3% short of ``frames``
    gives its last row, one that ends earlier None."""
    after = [r for f, r in curve if f >= frames]
    if after:
        return after[0]
    return curve[-1][1] if curve and curve[-1][0] >= frames * 0.97 else None


def _fmt_frames(f: float | None) -> str:
    return "-" if f is None else f"{f / 1e6:.2f}M"


def _fmt_ret(r: float | None) -> str:
    return "-" if r is None else f"{r:.1f}"


def report(references: dict[str, Path], out: Path | None, data: Path = DATA) -> str:
    """Markdown table of every arm with curves in docs/data/ablation (and the references); the figure to
    ``out``."""
    arms: dict[str, list[tuple[int, list[tuple[float, float]]]]] = {}
    for arm in ARMS:
        for seed, path in arm_curves(arm, data):
            arms.setdefault(arm, []).append((seed, read_curve(path)))
    for label, path in references.items():
        if path.is_file():
            arms[label] = [(0, read_curve(path))]
    head = (
        "| arm | what it changes | seeds | "
        + " | ".join(f"return at {f / 1e6:g}M" for f in AT_FRAMES)
        + f" | at {CI_AT / 1e6:g}M: IQM [95% CI] | "
        + " | ".join(f"frames to {t:g}" for t in THRESHOLDS)
        + " |"
    )
    lines = [head, "|" + "---|" * 3 + "--:|" * (len(AT_FRAMES) + 1 + len(THRESHOLDS))]
    intervals = interval_estimates(
        {arm: [value_at(c, CI_AT) for _, c in runs] for arm, runs in arms.items() if arm in ARMS}
    )
    for arm, runs in arms.items():
        what = ARMS[arm][1] if arm in ARMS else "reference run on the same box"
        cells = []
        for f in AT_FRAMES:
            vals = [value_at(c, f) for _, c in runs]
            cells.append(" / ".join(_fmt_ret(v) for v in vals))
        iqm = intervals.get(arm)
        cells.append("-" if iqm is None else f"{iqm[0]:.1f} [{iqm[1]:.1f}, {iqm[2]:.1f}]")
        for t in THRESHOLDS:
            cells.append(" / ".join(_fmt_frames(first_reach(c, t)) for _, c in runs))
        seeds = ", ".join(str(s) for s, _ in runs) if arm in ARMS else "1"
        lines.append(f"| {arm} | {what} | {seeds} | " + " | ".join(cells) + " |")
    if out is not None:
        plot(arms, out)
    return "\n".join(lines)


def interval_estimates(scores: dict[str, list[float | None]]) -> dict[str, tuple[float, float, float]]:
    """Per arm with 2 or more seeds: the interquartile mean of its seeds' returns and rliable's stratified
    bootstrap 95% interval (``rliable.library.get_interval_estimates``, 2,000 resamples, seeded): an arm is
    ahead of another only where their intervals do not overlap. With 2-3 seeds an interval spans about the
    seeds' range; it says how far apart the seeds landed, not more."""
    import numpy as np
    from rliable import library as rly
    from rliable import metrics

    matrices = {
        arm: np.array([[v] for v in values], dtype=float)
        for arm, values in scores.items()
        if len(values) >= 2 and all(v is not None for v in values)
    }
    if not matrices:
        return {}
    with warnings.catch_warnings():  # arch's notice that its random_state keyword is going away
        warnings.simplefilter("ignore", FutureWarning)
        points, cis = rly.get_interval_estimates(
            matrices,
            lambda x: np.array([metrics.aggregate_iqm(x)]),
            reps=2000,
            random_state=np.random.RandomState(0),
        )
    return {arm: (float(points[arm][0]), float(cis[arm][0][0]), float(cis[arm][1][0])) for arm in matrices}


def plot(arms: dict[str, list[tuple[int, list[tuple[float, float]]]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (arm, runs) in enumerate(arms.items()):
        color = colors[i % len(colors)]
        for j, (_, curve) in enumerate(runs):
            xs = [f / 1e6 for f, _ in curve if f <= 3.0e6]
            ys = [r for f, r in curve if f <= 3.0e6]
            reference = arm not in ARMS  # a peer's published run: dashed
            label = (f"{arm} (published settings)" if reference else arm) if j == 0 else None
            ax.plot(xs, ys, color=color, lw=1.4, alpha=0.9, ls="--" if reference else "-", label=label)
    ax.axhline(15, color="gray", ls=":", lw=1)
    ax.set_xlabel("env frames (millions)")
    ax.set_ylabel("mean return, last 100 episodes")
    ax.set_title(f"{ENV}: our defaults moved toward Sample Factory's, one difference at a time")
    ax.set_xlim(0, 3.0)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"pong_ablation: wrote {out}")


def write_page(page: Path, table: str) -> None:
    """Replace the table between the page's BEGIN and END lines."""
    text = page.read_text()
    if BEGIN not in text or END not in text:
        raise AblationError(f"{page}: no '{BEGIN}' ... '{END}' block to write the table into")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    page.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")
    print(f"pong_ablation: wrote the table into {page}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA, help="folder of the arms' curves (docs/data/ablation)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run arms, one at a time")
    r.add_argument("arms", nargs="+", help="arm names (see 'list')")
    r.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    r.add_argument("--frames", type=float, default=2.5e6, help="env frames per run (default 2.5e6)")
    r.add_argument("--runs", type=Path, default=ROOT / "runs" / "ablation", help="parent of the run folders")
    r.add_argument("--python", default=sys.executable)
    r.add_argument("--dry-run", action="store_true")
    p = sub.add_parser("report", help="the table (stdout) and the figure")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "pong_ablation.png", help="the figure")
    p.add_argument("--no-plot", action="store_true", help="the table only")
    p.add_argument(
        "--write", type=Path, help=f"also write the table into this page's report block ({PAGE.name})"
    )
    sub.add_parser("list", help="the arms")
    try:
        args = ap.parse_args(argv)
        if args.cmd == "list":
            for name, (flags, what) in ARMS.items():
                print(f"{name:16s} {' '.join(flags) or '(none)':40s} {what}")
            return 0
        if args.cmd == "report":
            refs = {
                "sample_factory": ROOT / "docs" / "data" / "peers_pong_30min_sample_factory_published.csv",
                "cleanrl": ROOT / "docs" / "data" / "peers_pong_30min_cleanrl_published.csv",
            }
            table = report(refs, None if args.no_plot else args.out, args.data)
            print(table)
            if args.write:
                write_page(args.write, table)
            return 0
        unknown = [a for a in args.arms if a not in ARMS]
        if unknown:
            raise AblationError(f"unknown arm {unknown[0]!r}; one of {', '.join(ARMS)}")
        if not (math.isfinite(args.frames) and args.frames >= 1e4):
            raise AblationError(f"--frames {args.frames:g}: at least 10,000")
        if any(s < 0 for s in args.seeds):
            raise AblationError("--seeds: non-negative integers")
        for arm in args.arms:
            for seed in args.seeds:
                if args.dry_run:
                    print(" ".join(command(arm, seed, args.runs / arm / f"s{seed}", args.python)))
                elif curve_file(arm, seed, args.data).is_file():
                    print(f"pong_ablation: {arm} seed {seed}: already in {curve_file(arm, seed, args.data)}")
                else:
                    run_one(arm, seed, int(args.frames), args.runs, args.python, args.data)
        return 0
    except AblationError as e:
        print(f"pong_ablation: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
