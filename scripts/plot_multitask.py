#!/usr/bin/env python
"""Draw a multi-task run's curves: per task, mean return (last 100 episodes) against that task's
own frames, and each task's PopArt sigma; one line per run directory.

    python scripts/plot_multitask.py runs/a runs/b --labels PopArt "no PopArt" --out docs/multitask.png
"""

from __future__ import annotations

import argparse
import csv
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TASK_KEY = re.compile(r"^tasks/(.+)/frames$")


def read(logdir: str) -> list[dict[str, str]]:
    path = os.path.join(logdir, "metrics.csv")
    if not os.path.isfile(path):
        raise SystemExit(f"plot_multitask: no metrics.csv in {logdir!r}")
    with open(path) as f:
        return list(csv.DictReader(f))


def series(rows: list[dict[str, str]], x_key: str, y_key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in rows:
        if row.get(x_key) and row.get(y_key):
            xs.append(float(row[x_key]))
            ys.append(float(row[y_key]))
    return xs, ys


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("logdirs", nargs="+")
    ap.add_argument("--labels", nargs="*")
    ap.add_argument("--title", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = [read(d) for d in args.logdirs]
    labels = args.labels or args.logdirs
    tasks = [m.group(1) for m in map(TASK_KEY.match, runs[0][0].keys()) if m]
    if not tasks:
        raise SystemExit(
            f"plot_multitask: {args.logdirs[0]} is not a multi-task run (no tasks/<env>/frames column)"
        )
    fig, axes = plt.subplots(2, len(tasks), figsize=(5.5 * len(tasks), 7.5), squeeze=False)
    for col, task in enumerate(tasks):
        for rows, label in zip(runs, labels):
            xs, ys = series(rows, f"tasks/{task}/frames", f"tasks/{task}/mean_return_100")
            axes[0][col].plot([x / 1e6 for x in xs], ys, label=label)
            xs, ys = series(rows, f"tasks/{task}/frames", f"popart/sigma/{task}")
            if ys and max(ys) != min(
                ys
            ):  # without PopArt the statistics stay at their initial 1: nothing to draw
                axes[1][col].plot([x / 1e6 for x in xs], ys, label=label)
        axes[0][col].set_title(task)
        axes[0][col].set_ylabel("mean return, last 100 episodes")
        axes[1][col].set_ylabel("PopArt sigma (this task)")
        axes[1][col].set_yscale("log")
        for ax in axes[:, col]:
            ax.set_xlabel("this task's env frames (M)")
            ax.grid(alpha=0.3)
            ax.legend()
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"plot_multitask: wrote {args.out}")


if __name__ == "__main__":
    main()
