#!/usr/bin/env python
"""The peers' curves side by side: one figure (return against minutes and against frames) and a table.

    plot.py runs/peers/ours runs/peers/cleanrl-published ... --out runs/peers/compare.png
    plot.py --brief runs/peers/cleanrl-cpu          # one run's figures, as each peer's command prints them
    plot.py --from-metrics RUN/metrics.csv --summary OUT/summary.json --curve OUT/curve.csv
                                                    # our metrics.csv into the peers' curve columns

Each run folder holds curve.csv (frames,time,mean_return_100: scripts/peers/curve.py) and summary.json
(monitor.py). The table, one row per run:

- frames/s: the frames at the last row over its time (the whole window from launch, startup included),
  and the steady rate between the first and the last row;
- frames and minutes to a mean return of -10, 0 and 18 (the first row at or above), '-' if never;
- the mean return of the last 100 episodes at the last row, and the minutes and frames there;
- CPU: ``busy``, the fraction of all cores busy on the machine during the run (/proc/stat), and ``own``,
  the run's own processes' CPU time over (wall x cores); frames per own CPU-second, what a core buys
  (it holds up on a shared box, where frames/s does not).

matplotlib is imported only to draw (the project's .venv has it).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys

THRESHOLDS = (-10.0, 0.0, 18.0)


def read_curve(path: str) -> list[tuple[int, float, float | None]]:
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            m = r.get("mean_return_100", "")
            mean = float(m) if m not in ("", None) else None
            rows.append((int(float(r["frames"])), float(r["time"]), mean))
    return rows


def read_summary(run: str) -> dict:
    try:
        with open(os.path.join(run, "summary.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def figures(run: str) -> dict:
    rows = read_curve(os.path.join(run, "curve.csv"))
    s = read_summary(run)
    out: dict = {"run": run, "rows": len(rows), "cpu_busy": s.get("cpu_busy"), "cpu_own": s.get("cpu_own")}
    out["window_s"] = s.get("window_s")
    out["cpu_own_seconds"] = s.get("cpu_own_seconds")
    if not rows:
        return out
    frames, t, _ = rows[-1]
    out["frames"], out["time"] = frames, t
    out["fps_whole"] = frames / t if t > 0 else math.nan
    f0, t0, _ = rows[0]
    out["fps_steady"] = (frames - f0) / (t - t0) if t > t0 else math.nan
    means = [r for r in rows if r[2] is not None]
    out["final_return"] = means[-1][2] if means else None
    out["episodes_seen"] = bool(means)
    for th in THRESHOLDS:
        hit = next((r for r in means if r[2] >= th), None)
        out[f"to_{th:g}"] = (hit[0], hit[1]) if hit else None
    return out


def brief(run: str) -> str:
    f = figures(run)
    if not f["rows"]:
        return f"{run}: no curve rows"
    ret = "none yet" if f["final_return"] is None else f"{f['final_return']:.2f}"
    busy = "?" if f["cpu_busy"] is None else f"{f['cpu_busy']:.2f}"
    own = "?" if f["cpu_own"] is None else f"{f['cpu_own']:.2f}"
    # frames per CPU-second of its own processes: what a core buys, comparable on a busy box too
    per_cpu = f["frames"] / f["cpu_own_seconds"] if f.get("cpu_own_seconds") else math.nan
    return (
        f"{run}: {f['rows']} rows, {f['frames']:,} frames in {f['time']:.0f} s: "
        f"{f['fps_whole']:,.0f} frames/s "
        f"(steady {f['fps_steady']:,.0f}; {per_cpu:,.0f} per own CPU-second); mean return (last 100) {ret}; "
        f"CPU busy {busy} (machine), own {own}"
    )


def _num(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:,.0f}"


def _to(cell) -> tuple[str, str]:
    if cell is None:
        return "-", "-"
    frames, t = cell
    return f"{frames / 1e6:.2f}M", f"{t / 60:.1f}"


def table(runs: list[str], labels: list[str]) -> str:
    head = ["run", "frames/s (window)", "frames/s (steady)"]
    for th in THRESHOLDS:
        head += [f"frames to {th:g}", f"min to {th:g}"]
    head += ["return at end", "at (min, frames)", "CPU busy", "CPU own", "frames per own CPU-s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" + "--:|" * (len(head) - 1)]
    for run, label in zip(runs, labels):
        f = figures(run)
        if not f["rows"]:
            lines.append(f"| {label} | no rows |" + " |" * (len(head) - 2))
            continue
        cells = [label, _num(f["fps_whole"]), _num(f["fps_steady"])]
        for th in THRESHOLDS:
            cells += list(_to(f[f"to_{th:g}"]))
        cells.append("-" if f["final_return"] is None else f"{f['final_return']:.1f}")
        cells.append(f"{f['time'] / 60:.1f}, {f['frames'] / 1e6:.2f}M")
        cells.append("-" if f["cpu_busy"] is None else f"{f['cpu_busy']:.2f}")
        cells.append("-" if f["cpu_own"] is None else f"{f['cpu_own']:.2f}")
        cells.append(_num(f["frames"] / f["cpu_own_seconds"]) if f.get("cpu_own_seconds") else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def draw(runs: list[str], labels: list[str], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_f) = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for run, label in zip(runs, labels):
        rows = [r for r in read_curve(os.path.join(run, "curve.csv")) if r[2] is not None]
        if not rows:
            continue
        marker = "o" if len(rows) < 30 else None  # a short curve still shows
        returns = [r[2] for r in rows]
        (line,) = ax_t.plot([r[1] / 60 for r in rows], returns, label=label, marker=marker)
        ax_f.plot([r[0] / 1e6 for r in rows], returns, label=label, color=line.get_color(), marker=marker)
    for ax in (ax_t, ax_f):
        ax.axhline(18, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    ax_t.set_xlabel("minutes since launch")
    ax_f.set_xlabel("environment frames (millions; agent steps x 4)")
    ax_t.set_ylabel("mean return, last 100 episodes")
    ax_f.legend(loc="best", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)


def from_metrics(metrics: str, summary: str, curve_out: str) -> None:
    """Our metrics.csv (charts/env_frames, time, charts/mean_return_100) into curve.csv. Its ``time`` counts
    from the learner's logger start; the curve's counts from the launch (monitor.py's t0), so each row
    is shifted by (the file's last write - t0 - its last row's time): rows are appended as they are logged,
    so the file's modification time is the last row's wall-clock time."""
    with open(summary) as f:
        t0 = json.load(f)["t0"]
    with open(metrics, newline="") as f:
        rows = list(csv.DictReader(f))
    rows = [r for r in rows if r.get("charts/env_frames") not in (None, "")]
    offset = 0.0
    if rows:
        offset = os.path.getmtime(metrics) - t0 - float(rows[-1]["time"])
        if not 0 <= offset < 120:
            print(f"plot.py: odd launch offset {offset:.1f} s for {metrics}; using 0", file=sys.stderr)
            offset = 0.0
    with open(curve_out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("frames", "time", "mean_return_100"))
        for r in rows:
            m = r.get("charts/mean_return_100", "")
            w.writerow((int(float(r["charts/env_frames"])), f"{float(r['time']) + offset:.3f}", m))
    print(f"plot.py: {len(rows)} rows from {metrics} (launch offset {offset:.1f} s) -> {curve_out}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", help="run folders (curve.csv, summary.json)")
    ap.add_argument("--labels", nargs="*", help="one per run; default: the folder names")
    ap.add_argument("--out", default=None, help="figure (PNG); default: none")
    ap.add_argument("--title", default="Pong on this box, each run alone")
    ap.add_argument("--brief", metavar="RUN", help="print one run's figures and exit")
    ap.add_argument("--from-metrics", metavar="CSV")
    ap.add_argument("--summary", metavar="JSON")
    ap.add_argument("--curve", metavar="CSV")
    args = ap.parse_args()
    if args.brief:
        print(brief(args.brief))
        return 0
    if args.from_metrics:
        if not (args.summary and args.curve):
            ap.error("--from-metrics needs --summary and --curve")
        from_metrics(args.from_metrics, args.summary, args.curve)
        return 0
    runs = [r for r in args.runs if os.path.exists(os.path.join(r, "curve.csv"))]
    for r in set(args.runs) - set(runs):
        print(f"plot.py: {r} has no curve.csv; left out", file=sys.stderr)
    if not runs:
        ap.error("no run with a curve.csv")
    labels = args.labels or [os.path.basename(os.path.normpath(r)) for r in args.runs]
    labels = [lab for r, lab in zip(args.runs, labels) if r in runs]
    print(table(runs, labels))
    if args.out:
        draw(runs, labels, args.out, args.title)
        print(f"plot.py: figure {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
