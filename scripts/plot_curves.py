#!/usr/bin/env python
"""Plot learning curves (mean return over the last 100 episodes vs env frames and vs wall time).

Each source is a run directory (its metrics.csv) or a CSV file with columns
frames,time,mean_return_100 (for example scripts/sb3_pong_reference.py's output).

    python scripts/plot_curves.py runs/a runs/b --labels "run a" "run b" --out docs/data/curve.png
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(source: str, key: str) -> tuple[list[float], list[float], list[float]]:
    """(frames, values, seconds) from a run directory's metrics.csv or a frames,time,<key> CSV."""
    path = source if os.path.isfile(source) else os.path.join(source, "metrics.csv")
    if not os.path.isfile(path):
        print(f"plot_curves: no metrics.csv in {source!r}", file=sys.stderr)
        raise SystemExit(2)
    xs, ys, ts = [], [], []
    with open(path) as f:
        for row in csv.DictReader(f):
            frames = row.get("charts/env_frames") or row.get("frames")
            value = row.get(key) or row.get(key.split("/")[-1])
            if frames and value:
                xs.append(float(frames))
                ys.append(float(value))
                # a published curve read off a plot of steps has no wall time (scripts/digitize_curve.py)
                ts.append(float(row["time"]) if row.get("time") else float("nan"))
    return xs, ys, ts


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("logdirs", nargs="+")
    ap.add_argument("--labels", nargs="*")
    ap.add_argument("--key", default="charts/mean_return_100")
    ap.add_argument("--title", default="")
    ap.add_argument("--hline", type=float, default=None, help="Draw a target line (e.g. 195 for CartPole).")
    ap.add_argument(
        "--legend",
        default="upper left",
        help="matplotlib legend location in each panel (default: upper left), "
        "or 'below': one legend under both",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    labels = args.labels or args.logdirs
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    # the default cycle has 10 colours: an 11th curve would share the first one's
    palette = plt.get_cmap("tab10" if len(args.logdirs) <= 10 else "tab20").colors
    for i, (logdir, label) in enumerate(zip(args.logdirs, labels)):
        xs, ys, ts = read(logdir, args.key)
        (line,) = ax1.plot(xs, ys, label=label, color=palette[i % len(palette)])
        if not all(t != t for t in ts):  # NaN: no wall times to draw
            ax2.plot([t / 60 for t in ts], ys, label=label, color=line.get_color())
    for ax, xl in ((ax1, "environment frames"), (ax2, "wall-clock minutes")):
        if args.hline is not None:
            ax.axhline(args.hline, color="gray", ls="--", lw=1, label=f"target {args.hline:g}")
        ax.set_xlabel(xl)
        ax.set_ylabel("mean return, last 100 episodes")
        ax.grid(alpha=0.3)
        if args.legend != "below":
            ax.legend(loc=args.legend, fontsize=8)  # learning curves rise: the top left usually stays empty
    if args.legend == "below":  # many curves: a legend inside would cover some of them
        handles, names = ax1.get_legend_handles_labels()
        fig.legend(handles, names, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(args.title)
    fig.tight_layout(rect=(0, 0.14, 1, 1) if args.legend == "below" else None)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
