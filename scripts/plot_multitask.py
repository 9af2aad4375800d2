#!/usr/bin/env python
"""The multi-task Atari comparison (docs/MULTITASK.md): a figure and a Markdown table from the runs of
scripts/learn_multitask.sh.

Reads ROOT/<arm>-s<seed>/metrics.csv for the multi-task arms (popart, clipped, raw) and
ROOT/<arm>-<Game>-s<seed>/metrics.csv for the single-task ones (single, single-popart); a run with another
value-loss weight or another number of envs per actor has it in its name (popart-bc0.25-s1, labelled
"popart bc0.25 s1"; popart-k20-s1, "popart k20 s1"). Per game it takes
the mean return of the last 100 episodes at each million frames of that game's own frames (a multi-task
run's ``tasks/<env>/frames``, a single-task run's ``charts/env_frames``), its human-normalized score
((score - random) / (human - random), the standard table in impala.envs.atari), and the median and mean
over the games. Writes OUT (the figure: per game the return against its frames, each game's PopArt sigma,
the median and mean human-normalized score) and OUT with .md for .png (the table).

Curves kept elsewhere (run folders do not outlive the machine they ran on; the docs keep their CSVs) join
with ``--multi LABEL=PATH`` (a multi-task run's metrics.csv) and ``--single LABEL:GAME=PATH`` (one game's
single-task curve: a metrics.csv, or the short ``frames,mean_return_100`` form of the docs' data folder).

    python scripts/plot_multitask.py --root runs/multitask --games A,B,C --out docs/multitask.png
    python scripts/plot_multitask.py --root none --games A,B --multi "popart s1=docs/data/mt.csv" \
        --single "single:A=docs/data/a.csv" --single "single:B=docs/data/b.csv" --out docs/multitask.png
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from impala.envs.atari import human_normalized_score  # noqa: E402

MULTI = ("popart", "clipped", "raw")
SINGLE = ("single", "single-popart")
# per-task diagnostics a multi-task run logs (tasks/<game>/<name>) and the diagnostics table's headings
DIAGNOSTICS = {
    "entropy": "entropy",
    "adv_abs": "mean abs. advantage",
    "pg_weight_share": "share of summed abs. advantage",
    "step_share": "share of steps trained",
    "value_error": "value error",
    "grad_share": "share of summed gradient norm",
    "grad_cosine": "gradient cosine with the others'",
    "policy_lag": "policy lag",
}
STEP = 1_000_000  # the table's frames per game between columns
# a run is read at a step from its row nearest it, if within 10%: rows come every 30 s, a multi-task run's
# about 40k frames per game apart, a single-task run's 120-210k (4-7k frames/s)
TOLERANCE = 0.10


def read_rows(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def curve(rows: list[dict[str, str]], frames_key: str, value_key: str) -> list[tuple[float, float]]:
    """(frames, value) of each row that has both."""
    out = []
    for row in rows:
        if row.get(frames_key) and row.get(value_key):
            out.append((float(row[frames_key]), float(row[value_key])))
    return out


def at(points: list[tuple[float, float]], frames: float) -> float | None:
    """The value of the row nearest ``frames`` when it is within TOLERANCE of it; None where the run has no
    row there (it stopped before, or its rows are too far apart)."""
    if not points:
        return None
    nearest, value = min(points, key=lambda point: abs(point[0] - frames))
    return value if abs(nearest - frames) <= frames * TOLERANCE else None


def multi_run(
    rows: list[dict[str, str]], games: list[str]
) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """{game: {"return": curve, "sigma": curve}} of a multi-task run, each against that game's own frames."""
    return {
        g: {
            "return": curve(rows, f"tasks/{g}/frames", f"tasks/{g}/mean_return_100"),
            "sigma": curve(rows, f"tasks/{g}/frames", f"popart/sigma/{g}"),
            **{f"diag/{name}": curve(rows, f"tasks/{g}/frames", f"tasks/{g}/{name}") for name in DIAGNOSTICS},
        }
        for g in games
    }


def single_run(rows: list[dict[str, str]]) -> dict[str, list[tuple[float, float]]]:
    """{"return": curve, "sigma": curve} of a single-task run: a metrics.csv or the short CSV form."""
    frames = "charts/env_frames" if rows and "charts/env_frames" in rows[0] else "frames"
    value = "charts/mean_return_100" if rows and "charts/mean_return_100" in rows[0] else "mean_return_100"
    return {"return": curve(rows, frames, value), "sigma": curve(rows, frames, "popart/sigma")}


def load(root: str, games: list[str]) -> dict[str, dict[str, dict[str, list[tuple[float, float]]]]]:
    """{run label: {game: {"return": curve, "sigma": curve}}} for every run of every arm under ``root``.

    A run folder is ``<arm>[-bc<weight>][-k<envs>]-s<seed>`` (multi-task) or
    ``<arm>[-bc<weight>][-k<envs>]-<Game>-s<seed>`` (single-task), as learn_multitask.sh names them; its label
    is ``<arm>[ bc<weight>][ k<envs>] s<seed>``."""
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    tag = r"((?:-bc[0-9.]+)?(?:-k\d+)?)"
    multi = re.compile(rf"^({'|'.join(MULTI)}){tag}-s(\d+)$")
    single = re.compile(rf"^({'|'.join(SINGLE)}){tag}-([A-Za-z]+)-s(\d+)$")
    by_game = {g.split("Deterministic")[0]: g for g in games}
    found = []  # (arm, tag, seed, game or None, path)
    for name in names:
        path = os.path.join(root, name, "metrics.csv")
        if not os.path.isfile(path):
            continue
        if m := multi.match(name):
            found.append((m.group(1), m.group(2), m.group(3), None, path))
        elif (m := single.match(name)) and m.group(3) in by_game:
            found.append((m.group(1), m.group(2), m.group(4), by_game[m.group(3)], path))
    # the arms in a fixed order (popart, clipped, raw, single, single-popart), each arm's default value-loss
    # weight before the others, then by seed
    order = {arm: i for i, arm in enumerate(MULTI + SINGLE)}
    found.sort(key=lambda f: (order[f[0]], f[1] or "", int(f[2])))
    runs: dict[str, dict[str, dict[str, list[tuple[float, float]]]]] = {}
    for arm, tag, seed, game, path in found:
        if game is None:
            runs[label_of(arm, tag, seed)] = multi_run(read_rows(path), games)
        else:
            runs.setdefault(label_of(arm, tag, seed), {})[game] = single_run(read_rows(path))
    return runs


def label_of(arm: str, tag: str | None, seed: str) -> str:
    return f"{arm}{tag.replace('-', ' ') if tag else ''} s{seed}"


def scores(
    run: dict[str, dict[str, list]], games: list[str], frames: float
) -> dict[str, tuple[float, float]]:
    """{game: (mean return, human-normalized score)} of a run at ``frames`` per game (games it has)."""
    out = {}
    for g in games:
        if g in run:
            value = at(run[g]["return"], frames)
            hns = None if value is None else human_normalized_score(g, value)
            if value is not None and hns is not None:
                out[g] = (value, hns)
    return out


def summary(found: dict[str, tuple[float, float]], games: list[str]) -> tuple[float, float] | None:
    """(median, mean) human-normalized score over every game, None unless all have one."""
    if len(found) != len(games):
        return None
    hns = [found[g][1] for g in games]
    return statistics.median(hns), statistics.fmean(hns)


def table(runs: dict, games: list[str]) -> str:
    """The Markdown table: median and mean HNS per run at each million frames per game, then per game its
    mean return and HNS at each million frames."""
    last = max((f for run in runs.values() for g in run.values() for f, _ in g["return"]), default=0.0)
    steps = [STEP * k for k in range(1, int(last * (1 + TOLERANCE) // STEP) + 1)]
    short = [g.split("Deterministic")[0] for g in games]
    lines = [
        "Median (mean) human-normalized score over the "
        f"{len(games)} games, by frames per game (– where a run has not reached them):",
        "",
        "| run | " + " | ".join(f"{s // STEP}M" for s in steps) + " |",
        "|---|" + "--:|" * len(steps),
    ]
    for label, run in runs.items():
        cells = []
        for s in steps:
            both = summary(scores(run, games, s), games)
            cells.append("–" if both is None else f"{both[0]:.3f} ({both[1]:.3f})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for s in steps:
        lines += [
            "",
            f"Mean return of the last 100 episodes (human-normalized) at {s // STEP}M frames per game:",
            "",
            "| run | " + " | ".join(short) + " | median | mean |",
            "|---|" + "--:|" * (len(games) + 2),
        ]
        for label, run in runs.items():
            found = scores(run, games, s)
            if not found:
                continue
            cells = [f"{found[g][0]:.1f} ({found[g][1]:.3f})" if g in found else "–" for g in games]
            both = summary(found, games)
            cells += ["–", "–"] if both is None else [f"{both[0]:.3f}", f"{both[1]:.3f}"]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def diagnostics(runs: dict, games: list[str]) -> str:
    """Per multi-task run and game, the mean of each per-task diagnostic over the second half of that game's
    frames (rows past half its last frames): where a game behind the others differs in how it is trained."""
    lines = []
    for label, run in runs.items():
        if not any(run[g].get(f"diag/{name}") for g in games if g in run for name in DIAGNOSTICS):
            continue  # a single-task run, or a multi-task CSV without the per-task columns
        lines += [
            "",
            f"{label}, per game over the second half of its frames:",
            "",
            "| game | " + " | ".join(DIAGNOSTICS.values()) + " |",
            "|---|" + "--:|" * len(DIAGNOSTICS),
        ]
        for g in games:
            last = max((f for f, _ in run[g]["return"]), default=0.0)
            cells = []
            for name in DIAGNOSTICS:
                half = [v for f, v in run[g].get(f"diag/{name}", []) if f > last / 2]
                cells.append(f"{statistics.fmean(half):.2f}" if half else "–")
            lines.append(f"| {g.split('Deterministic')[0]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" if lines else ""


def figure(runs: dict, games: list[str], out: str) -> None:
    """Per game its return against its own frames and its PopArt sigma; the median and mean HNS."""
    n = len(games)
    fig, axes = plt.subplots(2, n + 1, figsize=(4.2 * (n + 1), 7.4), squeeze=False)
    colors = {label: f"C{i % 10}" for i, label in enumerate(runs)}
    for col, g in enumerate(games):
        for label, run in runs.items():
            if g not in run:
                continue
            style = "--" if label.startswith("single") else "-"
            xs, ys = zip(*run[g]["return"]) if run[g]["return"] else ((), ())
            axes[0][col].plot([x / 1e6 for x in xs], ys, style, color=colors[label], label=label, lw=1.2)
            sig = run[g]["sigma"]
            if sig and max(v for _, v in sig) != min(v for _, v in sig):  # without PopArt: no statistics
                axes[1][col].plot([f / 1e6 for f, _ in sig], [v for _, v in sig], style, color=colors[label])
        axes[0][col].set_title(g.split("Deterministic")[0])
        axes[0][col].set_ylabel("mean return, last 100 episodes")
        axes[1][col].set_ylabel("PopArt sigma of this game")
        axes[1][col].set_yscale("log")
    last = max((f for run in runs.values() for g in run.values() for f, _ in g["return"]), default=0.0)
    grid = [STEP / 4 * k for k in range(1, int(last // (STEP / 4)) + 1)]
    for label, run in runs.items():
        points = [(s, summary(scores(run, games, s), games)) for s in grid]
        points = [(s, b) for s, b in points if b is not None]
        style = "--" if label.startswith("single") else "-"
        if points:
            frames = [s / 1e6 for s, _ in points]
            axes[0][n].plot(frames, [b[0] for _, b in points], style, color=colors[label], label=label)
            axes[1][n].plot(
                [s / 1e6 for s, _ in points], [b[1] for _, b in points], style, color=colors[label]
            )
    axes[0][n].set_title("median over the games")
    axes[0][n].set_ylabel("human-normalized score")
    axes[1][n].set_title("mean over the games")
    axes[1][n].set_ylabel("human-normalized score")
    for ax in axes.flat:
        ax.set_xlabel("frames of this game (M)")
        ax.grid(alpha=0.3)
    legend: dict[str, object] = {}  # every run drawn, also one with no median yet (a game missing)
    for ax in axes[0]:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(name, handle)
    if legend:
        fig.legend(
            list(legend.values()), list(legend), loc="lower center", ncol=min(len(legend), 4), frameon=False
        )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out, dpi=100)


def add_csvs(runs: dict, games: list[str], multi: list[str], single: list[str]) -> None:
    """Adds the --multi and --single curves to ``runs``; ValueError (one line) on a malformed spec or
    a file that cannot be read."""

    def rows_of(spec: str, path: str) -> list[dict[str, str]]:
        try:
            rows = read_rows(path)
        except OSError as e:
            raise ValueError(f"cannot read {path!r} ({spec!r}): {e.strerror or e}") from None
        if not rows:
            raise ValueError(f"{path!r} ({spec!r}) holds no rows")
        return rows

    for spec in multi:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise ValueError(f"--multi takes LABEL=PATH, got {spec!r}")
        runs[label] = multi_run(rows_of(spec, path), games)
    for spec in single:
        head, sep, path = spec.partition("=")
        label, colon, game = head.partition(":")
        if not sep or not colon or not label or not path:
            raise ValueError(f"--single takes LABEL:GAME=PATH, got {spec!r}")
        if game not in games:
            raise ValueError(f"--single {spec!r}: {game!r} is not one of --games")
        runs.setdefault(label, {})[game] = single_run(rows_of(spec, path))


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("--root", default="runs/multitask", help="The folder learn_multitask.sh trains in.")
    ap.add_argument("--games", required=True, help="The games, comma-separated, in the table's order.")
    ap.add_argument("--out", required=True, help="The figure (.png); the table goes beside it (.md).")
    ap.add_argument(
        "--multi",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="A multi-task run's metrics.csv to add under LABEL (repeatable).",
    )
    ap.add_argument("--single", action="append", default=[], metavar="LABEL:GAME=PATH",
                    help="One game's single-task curve to add to the run LABEL (repeatable).")  # fmt: skip
    ap.add_argument("--upto", type=float, default=0.0, metavar="FRAMES",
                    help="Draw and tabulate each game up to this many of its frames (a longer single-task "
                    "run read at the multi-task runs' length); 0: all.")  # fmt: skip
    args = ap.parse_args()
    games = [g.strip() for g in args.games.split(",") if g.strip()]
    runs = load(args.root, games)
    try:
        add_csvs(runs, games, args.multi, args.single)
    except ValueError as e:
        print(f"plot_multitask: {e}", file=sys.stderr)
        return 2
    if not runs:
        print(f"plot_multitask: no runs under {args.root!r}", file=sys.stderr)
        return 2
    if args.upto < 0:
        print(f"plot_multitask: --upto must be >= 0, got {args.upto:g}", file=sys.stderr)
        return 2
    if args.upto:
        for run in runs.values():
            for curves in run.values():
                for key, points in curves.items():
                    curves[key] = [(f, v) for f, v in points if f <= args.upto * (1 + TOLERANCE)]
    unknown = [g for g in games if human_normalized_score(g, 0.0) is None]
    if unknown:
        print(f"plot_multitask: no human reference score for {', '.join(unknown)}", file=sys.stderr)
        return 2
    figure(runs, games, args.out)
    md = os.path.splitext(args.out)[0] + ".md"
    with open(md, "w") as f:
        f.write(table(runs, games) + diagnostics(runs, games))
    print(f"plot_multitask: wrote {args.out} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
