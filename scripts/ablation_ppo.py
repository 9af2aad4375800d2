"""Ablation: ML-Agents vs SB3 PPO semantics, Crawler hyperparameters, on Ant-v5 (the Crawler stand-in).

Every run is a real ``launch_ppo`` training run (actor process + learner over
ZeroMQ), same step budget and same seeds for both presets; only ``--semantics``
differs. The Crawler hyperparameters come from configs/Crawler.yaml; buffer and
batch are shrunk by the same factor (default 8: 20480/2048 -> 2560/256, so the
buffer holds 10 minibatches, as in Crawler)
and the schedules decay over the shortened run (``max_steps`` = the budget), so
that a short run on a small machine goes through the same *shape* of training.
The script prints what it shrank.

    .venv/bin/python scripts/ablation_ppo.py                      # 2 seeds x 2 presets x 70k steps
    .venv/bin/python scripts/ablation_ppo.py --steps 100000 --seeds 0 1 2
    .venv/bin/python scripts/ablation_ppo.py --plot-only          # re-plot existing runs

Output: ``docs/ppo_ablation.png`` (mean +- min/max over seeds of the mean return
of the last 100 episodes vs agent steps) and a summary table on stdout.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CRAWLER_BUFFER, CRAWLER_BATCH = 20480, 2048
PRESETS = ("mlagents", "sb3")


def unroll_length(semantics: str, args: argparse.Namespace) -> int:
    """Default: one round of unrolls (every env once) fills one update, with no unroll left over to go stale.

    SB3 updates at exactly buffer_size steps, so T = buffer / envs; ML-Agents at MORE than buffer_size, so one
    step more per env (T + 1) lets a single round trigger it (2568 > 2560).
    """
    if args.unroll_length:
        return args.unroll_length
    T = (CRAWLER_BUFFER // args.shrink) // (args.workers * args.envs_per_worker)
    return T + 1 if semantics == "mlagents" else T


def run_one(semantics: str, seed: int, args: argparse.Namespace, logdir: Path) -> dict:
    buffer, batch = CRAWLER_BUFFER // args.shrink, CRAWLER_BATCH // args.shrink
    cmd = [
        str(Path(sys.executable).parent / "launch_ppo"),
        "--env", args.env, "--mlagents-config", str(ROOT / "configs" / "Crawler.yaml"),
        "--semantics", semantics, "--seed", str(seed),
        "--buffer-size", str(buffer), "--batch-size", str(batch),
        "--max-steps", str(args.steps), "--total-steps", str(args.steps),
        "--workers", str(args.workers), "--envs-per-worker", str(args.envs_per_worker),
        "--unroll-length", str(unroll_length(semantics, args)),
        "--device", "cpu", "--logdir", str(logdir), "--log-interval", "0", "--no-progress",
    ]
    if logdir.exists():
        for f in logdir.iterdir():
            f.unlink()
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - t0
    (logdir / "stdout.txt").write_text(out.stdout)
    (logdir / "stderr.txt").write_text(out.stderr)
    if out.returncode != 0:
        raise SystemExit(f"run {semantics} seed {seed} failed ({out.returncode}); see {logdir}/stderr.txt:\n{out.stderr[-2000:]}")
    info = {"semantics": semantics, "seed": seed, "wall_s": round(wall, 1), "cmd": " ".join(cmd[1:])}
    (logdir / "run.json").write_text(json.dumps(info, indent=1))
    print(f"  {semantics:8s} seed {seed}: {wall:6.0f}s  ({out.stdout.strip().splitlines()[-1]})", flush=True)
    return info


def read_curve(logdir: Path) -> tuple[np.ndarray, np.ndarray]:
    steps, returns = [], []
    with open(logdir / "metrics.csv") as f:
        for row in csv.DictReader(f):
            v = row.get("charts/mean_return_100", "")
            if v not in ("", None) and math.isfinite(float(v)):
                steps.append(int(row["step"]))
                returns.append(float(v))
    return np.asarray(steps), np.asarray(returns)


def plot(runs_dir: Path, seeds: list[int], steps: int, out_png: Path, title: str) -> dict[str, dict[str, float]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.linspace(0, steps, 101)
    summary: dict[str, dict[str, float]] = {}
    fig, ax = plt.subplots(figsize=(8, 5))
    for semantics, color in zip(PRESETS, ("tab:blue", "tab:orange")):
        curves = []
        for seed in seeds:
            s, r = read_curve(runs_dir / f"{semantics}-seed{seed}")
            if len(s) == 0:
                continue
            ax.plot(s, r, color=color, alpha=0.25, lw=0.8)
            # Interpolate onto a common grid; NaN before the first finished episode.
            c = np.interp(grid, s, r, left=np.nan, right=r[-1])
            curves.append(c)
        if not curves:
            continue
        C = np.vstack(curves)
        keep = ~np.all(np.isnan(C), axis=0)  # grid points before any seed finished an episode
        grid_k, C = grid[keep], C[:, keep]
        mean = np.nanmean(C, axis=0)
        lo, hi = np.nanmin(C, axis=0), np.nanmax(C, axis=0)
        ax.plot(grid_k, mean, color=color, lw=2, label=f"{semantics} (mean of {len(curves)} seeds)")
        ax.fill_between(grid_k, lo, hi, color=color, alpha=0.2, label=f"{semantics} min..max over seeds")
        final = C[:, -1]
        summary[semantics] = {
            "final_mean": float(np.mean(final)),
            "final_min": float(np.min(final)),
            "final_max": float(np.max(final)),
            "auc_mean": float(np.nanmean(C)),
        }
    ax.set_xlabel("agent steps")
    ax.set_ylabel("mean return of the last 100 episodes")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="Ant-v5")
    p.add_argument("--steps", type=int, default=70_000, help="Agent steps per run (same for every run).")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--shrink", type=int, default=8, help="Divide Crawler's buffer (20480) and batch (2048) by this.")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--envs-per-worker", type=int, default=8)
    p.add_argument("--unroll-length", type=int, default=0, help="Steps per env per unroll; 0 = one round of unrolls per update (320 for sb3, 321 for mlagents with the defaults).")
    p.add_argument("--runs-dir", default=str(ROOT / "runs" / "ablation_ppo"))
    p.add_argument("--out", default=str(ROOT / "docs" / "ppo_ablation.png"))
    p.add_argument("--plot-only", action="store_true")
    args = p.parse_args(argv)
    runs_dir = Path(args.runs_dir)
    buffer, batch = CRAWLER_BUFFER // args.shrink, CRAWLER_BATCH // args.shrink
    print(
        f"Ablation on {args.env}: Crawler hyperparameters (configs/Crawler.yaml) with buffer {CRAWLER_BUFFER}->{buffer} and "
        f"batch {CRAWLER_BATCH}->{batch} (shrunk x{args.shrink}), max_steps 1e7->{args.steps} (schedules decay over the run), "
        f"unroll {unroll_length('sb3', args)}/{unroll_length('mlagents', args)} (sb3/mlagents; time_horizon 1000), {args.workers} actor x {args.envs_per_worker} envs; "
        f"seeds {args.seeds}; presets {', '.join(PRESETS)}",
        flush=True,
    )
    if not args.plot_only:
        t0 = time.monotonic()
        for seed in args.seeds:  # interleave presets so that machine load drifts hit both alike
            for semantics in PRESETS:
                logdir = runs_dir / f"{semantics}-seed{seed}"
                logdir.mkdir(parents=True, exist_ok=True)
                run_one(semantics, seed, args, logdir)
        print(f"all runs: {time.monotonic() - t0:.0f}s", flush=True)
    title = (f"{args.env}: PPO ML-Agents vs SB3 semantics, Crawler hyperparameters\n"
             f"(buffer {buffer}, batch {batch}, 3x512), {args.steps:,} steps, seeds {args.seeds}")
    summary = plot(runs_dir, args.seeds, args.steps, Path(args.out), title)
    print(f"wrote {args.out}")
    print(f"{'preset':10s} {'final mean':>11s} {'final min':>10s} {'final max':>10s} {'mean over run':>14s}")
    for k, v in summary.items():
        print(f"{k:10s} {v['final_mean']:11.1f} {v['final_min']:10.1f} {v['final_max']:10.1f} {v['auc_mean']:14.1f}")
    (runs_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
