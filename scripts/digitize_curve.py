#!/usr/bin/env python
"""Read a published learning curve off its plot image, for comparison at equal frames.

Published curves (cleanrl's benchmark plots, for one) come as images. Given two y gridlines and two x
ticks in image pixels with their values, this reads the curve of one colour (the median of its pixels
in each column) at the requested points and writes ``frames,time,mean_return_100`` rows (time left
empty: a plot of steps says nothing of wall time) that scripts/plot_curves.py draws.

    python scripts/digitize_curve.py cleanrl_breakout.png --y 816:400,2295:0 \\
        --x 1183.5:2e6,1881.5:4e6 --frames-per-step 4 --out docs/data/cleanrl_breakout_ref.csv

cleanrl's Atari plots count agent steps of a 4-frame skip, hence ``--frames-per-step 4``.
"""

from __future__ import annotations

import argparse
import csv
import sys

import numpy as np


def _pair(text: str) -> tuple[float, float]:
    pixel, value = text.split(":")
    return float(pixel), float(value)


def _calibration(text: str) -> tuple[tuple[float, float], tuple[float, float]]:
    a, b = text.split(",")
    return _pair(a), _pair(b)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("image")
    ap.add_argument("--y", required=True, help="two y gridlines as PIXEL:VALUE,PIXEL:VALUE")
    ap.add_argument("--x", required=True, help="two x ticks as PIXEL:STEPS,PIXEL:STEPS")
    ap.add_argument("--frames-per-step", type=float, default=1.0, help="frames per x-axis unit")
    ap.add_argument("--color", default="200,70,70", help="the curve's R,G,B (default: cleanrl's red)")
    ap.add_argument("--tolerance", type=int, default=60, help="max per-channel distance from --color")
    ap.add_argument("--every", type=float, default=0.25e6, help="frames between points (default 0.25M)")
    ap.add_argument("--until", type=float, default=10e6, help="last frame count read (default 10M)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    try:
        (y1, v1), (y2, v2) = _calibration(args.y)
        (x1, s1), (x2, s2) = _calibration(args.x)
        color = np.array([int(c) for c in args.color.split(",")])
        if len(color) != 3 or x1 == x2 or y1 == y2 or s1 == s2 or v1 == v2:
            raise ValueError
    except ValueError:
        print("digitize_curve: --y/--x need two distinct PIXEL:VALUE pairs, --color R,G,B", file=sys.stderr)
        return 2
    from PIL import Image

    try:
        rgb = np.asarray(Image.open(args.image).convert("RGB")).astype(int)
    except OSError as e:
        print(f"digitize_curve: cannot read {args.image}: {e}", file=sys.stderr)
        return 2
    mask = (np.abs(rgb - color) <= args.tolerance).all(-1)
    lo, hi = sorted((y1, y2))
    span = (hi - lo) * 0.25  # the curve stays near the plotted range; legends and titles lie far outside
    rows = []
    frames = args.every
    while frames <= args.until + 1e-6:
        x = int(round(x1 + (frames / args.frames_per_step - s1) * (x2 - x1) / (s2 - s1)))
        if not 0 <= x < rgb.shape[1]:
            break
        ys = np.where(mask[:, max(0, x - 2) : x + 3].any(1))[0]
        ys = ys[(ys >= lo - span) & (ys <= hi + span)]
        if len(ys):
            value = v1 + (float(np.median(ys)) - y1) * (v2 - v1) / (y2 - y1)
            rows.append((int(frames), "", round(value, 2)))
        frames += args.every
    if not rows:
        print("digitize_curve: no pixel of that colour at the requested points", file=sys.stderr)
        return 2
    with open(args.out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["frames", "time", "mean_return_100"])
        writer.writerows(rows)
    print(f"digitize_curve: {len(rows)} points to {args.out}, last {rows[-1][0]:,} frames: {rows[-1][2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
