#!/usr/bin/env python
"""Plot learning curves (mean return over the last 100 episodes vs env frames) from runs' metrics.csv.

    python scripts/plot_curves.py runs/a runs/b --labels "run a" "run b" --out docs/curve.png
"""

from __future__ import annotations

import argparse
import csv
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(logdir: str, key: str) -> tuple[list[float], list[float], list[float]]:
    xs, ys, ts = [], [], []
    with open(os.path.join(logdir, "metrics.csv")) as f:
        for row in csv.DictReader(f):
            if row.get(key):
                xs.append(float(row["charts/env_frames"]))
                ys.append(float(row[key]))
                ts.append(float(row["time"]))
    return xs, ys, ts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logdirs", nargs="+")
    ap.add_argument("--labels", nargs="*")
    ap.add_argument("--key", default="charts/mean_return_100")
    ap.add_argument("--title", default="")
    ap.add_argument("--hline", type=float, default=None, help="Draw a target line (e.g. 195 for CartPole).")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    labels = args.labels or args.logdirs
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for logdir, label in zip(args.logdirs, labels):
        xs, ys, ts = read(logdir, args.key)
        ax1.plot(xs, ys, label=label)
        ax2.plot(ts, ys, label=label)
    for ax, xl in ((ax1, "environment frames"), (ax2, "wall-clock seconds")):
        if args.hline is not None:
            ax.axhline(args.hline, color="gray", ls="--", lw=1, label=f"target {args.hline:g}")
        ax.set_xlabel(xl)
        ax.set_ylabel("mean return, last 100 episodes")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
