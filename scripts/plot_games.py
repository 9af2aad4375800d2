"""One panel per game: the mean return of the last 100 episodes against env frames, for several runs of it.

Each panel is ``TITLE=LABEL:CSV,LABEL:CSV,...``; a CSV is a run's metrics.csv (or its folder) or a curve file
with columns frames,time,mean_return_100 (what docs/data/ holds).

    D=docs/data; python scripts/plot_games.py --out docs/obsnorm_games.png \\
        "Breakout=before:$D/single_breakout_4M_s1.csv,obs norm:$D/obsnorm_breakout_4M_s1.csv" \\
        "MsPacman=before:$D/single_mspacman_4M_s1.csv,obs norm:$D/obsnorm_mspacman_4M_s1.csv"
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path


def curve(source: str) -> tuple[list[float], list[float]]:
    """(frames, mean return of the last 100 episodes) of a run folder, its metrics.csv or a curve file."""
    path = Path(source)
    if path.is_dir():
        path = path / "metrics.csv"
    frames, returns = [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            x = row.get("frames") or row.get("charts/env_frames")
            y = row.get("mean_return_100") or row.get("charts/mean_return_100")
            if x and y:
                frames.append(float(x))
                returns.append(float(y))
    if not frames:
        raise ValueError(f"{source}: no rows with frames and a mean return")
    return frames, returns


def panel(spec: str) -> tuple[str, list[tuple[str, str]]]:
    title, sep, runs = spec.partition("=")
    pairs = [run.partition(":") for run in runs.split(",")] if sep else []
    if not title or not pairs or any(not label or not path for label, _, path in pairs):
        raise ValueError(f"panel {spec!r}: expected TITLE=LABEL:CSV[,LABEL:CSV...]")
    return title, [(label, path) for label, _, path in pairs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("panels", nargs="+", help="TITLE=LABEL:CSV[,LABEL:CSV...], one per game")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    try:
        panels = [
            (title, [(label, curve(path)) for label, path in runs]) for title, runs in map(panel, args.panels)
        ]
    except (OSError, ValueError) as e:
        print(f"plot_games.py: {e}", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(len(panels), 4)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.0 * rows), squeeze=False)
    for ax, (title, runs) in zip(axes.flat, panels):
        for label, (frames, returns) in runs:
            ax.plot([f / 1e6 for f in frames], returns, label=label)
        ax.set_title(title)
        ax.set_xlabel("env frames (M)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    axes[0][0].set_ylabel("mean return, last 100 episodes")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"plot_games.py: {len(panels)} panels in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
