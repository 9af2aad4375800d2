#!/usr/bin/env python
"""A resumable sweep over launch_impala's levers: which settings reach a score in fewer frames.

Each ``--lever`` names launch_impala options (as in ``--help``, dashes or underscores) and the values
to try; several options joined by ``:`` move together (``epochs:minibatches=2:4,4:4``). The sweep
runs every combination of the levers once per seed, one run at a time (each run takes the whole
machine), as a real ``launch_impala`` process with the same fixed flags (``--fixed``). Unknown
options and values launch_impala would refuse are one line and exit 2 before anything runs.

    python scripts/sweep.py --env PongDeterministic-v4 --frames 2e6 --seeds 1 2 \\
        --lever pg_clip=0.1,0.2,0.3 --lever epochs:minibatches=2:4,3:8,4:4 --thresholds -15,0,18
    python scripts/sweep.py ... --dry-run      # the commands, nothing run

Runs live in ``RUNS/<env>-<frames>/<combination>/seed<s>/`` (launch_impala's run folders). A run
whose folder holds the finished marker is done and never run again; one that was interrupted
continues from its checkpoint (``--resume``). Every finished run is also kept, small, in the
archive (``--archive``, JSON: its settings, frames, wall time, final mean return of the last 100
episodes, the frames at which it first reached each threshold, and its curve thinned to 120
points), and the table (frames to each threshold and final return, mean over seeds) is made from
the archive, so it survives the loss of the run folders.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import itertools
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from impala.options import ConfigError  # noqa: E402
from impala.run.checkpoint import FINISHED_MARKER  # noqa: E402
from learner.cli import launch_impala  # noqa: E402

LAUNCH_IMPALA = [sys.executable, "-m", "learner.cli.launch_impala"]
# Options a sweep sets itself (or that would break its bookkeeping): not levers.
RESERVED = {"env", "total_frames", "total_steps", "seed", "logdir", "runs_dir", "run_id", "force", "resume"}
CURVE_POINTS = 120


class SweepError(ValueError):
    """Bad input: one line, exit 2."""


def _options() -> dict[str, argparse.Action]:
    """launch_impala's options by dest."""
    return {a.dest: a for a in launch_impala.build_parser()._actions if a.option_strings and a.dest != "help"}


def parse_lever(
    text: str, options: dict[str, argparse.Action]
) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """``a:b=1:2,3:4`` -> (("a", "b"), [("1", "2"), ("3", "4")]), names checked against launch_impala."""
    if "=" not in text:
        raise SweepError(f"--lever {text!r}: expected NAME=V1,V2,... (or NAME1:NAME2=V1:W1,...)")
    names_text, values_text = text.split("=", 1)
    names = tuple(n.strip().lstrip("-").replace("-", "_") for n in names_text.split(":"))
    for name in names:
        if name in RESERVED:
            raise SweepError(f"--lever {name}: the sweep sets it itself (use --env/--frames/--seeds)")
        if name not in options:
            raise SweepError(f"--lever {name}: not a launch_impala option (see launch_impala --help)")
    if len(set(names)) != len(names):
        raise SweepError(f"--lever {text!r}: an option named twice")
    values = [tuple(v.strip() for v in item.split(":")) for item in values_text.split(",") if item.strip()]
    if not values:
        raise SweepError(f"--lever {names_text}: no values")
    for v in values:
        if len(v) != len(names):
            raise SweepError(f"--lever {text!r}: {':'.join(v)} has {len(v)} values for {len(names)} options")
    if len(set(values)) != len(values):
        raise SweepError(f"--lever {names_text}: a value given twice")
    return names, values


def flag_args(name: str, value: str, options: dict[str, argparse.Action]) -> list[str]:
    """The command-line form of one setting (booleans: --x / --no-x)."""
    action = options[name]
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        lowered = value.lower()
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise SweepError(f"--lever {name}: {value!r} is not true or false")
        return [flag] if lowered in ("true", "1", "yes") else [f"--no-{flag[2:]}"]
    return [flag, value]


def check_settings(argv: list[str]) -> None:
    """What launch_impala would refuse (types, choices, ranges), without running anything."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            launch_impala.resolve(launch_impala.parse_args(argv))
    except SystemExit:  # argparse: its last line is the reason
        lines = [line for line in said.getvalue().splitlines() if line.strip()]
        why = lines[-1].split("error: ", 1)[-1] if lines else "refused"
        raise SweepError(f"launch_impala refuses {' '.join(argv)}: {why}") from None
    except ConfigError as e:
        raise SweepError(f"launch_impala refuses {' '.join(argv)}: {e}") from None


def check_env(env: str) -> None:
    """The env builds here (a wrong id fails now, not in the first run)."""
    try:
        launch_impala.probe_run_envs(launch_impala.resolve(launch_impala.parse_args(["--env", env]))[0])
    except ConfigError as e:
        raise SweepError(f"--env {env}: {e}") from None
    except Exception as e:  # noqa: BLE001 - gymnasium's errors for ids it does not know, in one line
        raise SweepError(f"--env {env}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def slug(settings: dict[str, str]) -> str:
    """A folder name for one combination: ``epochs2-minibatches4``; ``base`` with no levers."""
    if not settings:
        return "base"
    return "-".join(f"{k}{re.sub(r'[^0-9A-Za-z.+-]', '_', v)}" for k, v in settings.items())


def read_curve(logdir: Path) -> list[tuple[int, float, float]]:
    """(env frames, wall seconds, mean return of the last 100 episodes) per metrics row that has one."""
    path = logdir / "metrics.csv"
    if not path.exists():
        return []
    out = []
    with open(path) as f:
        for row in csv.DictReader(f):
            value = row.get("charts/mean_return_100")
            if value not in (None, "") and row.get("step") and row.get("time"):
                out.append((int(float(row["step"])), float(row["time"]), float(value)))
    return out


def record_of(env: str, frames: int, settings: dict[str, str], seed: int, logdir: Path, thresholds) -> dict:
    """A finished run, small: what the archive keeps."""
    curve = read_curve(logdir)
    marker = json.loads((logdir / FINISHED_MARKER).read_text())
    reached = {}
    for threshold in thresholds:
        hit = next(((f, t) for f, t, r in curve if r >= threshold), None)
        reached[f"{threshold:g}"] = None if hit is None else {"frames": hit[0], "seconds": round(hit[1], 1)}
    step = max(1, math.ceil(len(curve) / CURVE_POINTS))
    return {
        "env": env,
        "frames_budget": frames,
        "settings": settings,
        "seed": seed,
        "frames": int(marker.get("env_frames", curve[-1][0] if curve else 0)),
        "wall_s": round(curve[-1][1], 1) if curve else None,
        "final_return": curve[-1][2] if curve else None,
        "reached": reached,
        "curve": [[f, round(t, 1), round(r, 3)] for f, t, r in curve[::step]],
    }


def load_archive(path: Path) -> list[dict]:
    if not path.exists():
        return []
    try:
        records = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SweepError(f"--archive {path}: not JSON ({e})") from None
    if not isinstance(records, list):
        raise SweepError(f"--archive {path}: expected a list of run records")
    return records


def save_archive(path: Path, records: list[dict]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(records, indent=1) + "\n")
    os.replace(tmp, path)


def same_run(a: dict, b: dict) -> bool:
    keys = ("env", "frames_budget", "settings", "seed")
    return all(a.get(k) == b.get(k) for k in keys)


def first_frames(record: dict, threshold: float) -> int | None:
    """The frames at which a run first reached ``threshold``: as recorded, or (a threshold the run was not
    archived with) read off its thinned curve, so to within one of its 120 points."""
    key = f"{threshold:g}"
    if key in record["reached"]:
        hit = record["reached"][key]
        return None if hit is None else hit["frames"]
    return next((f for f, _, r in record["curve"] if r >= threshold), None)


def table(
    records: list[dict], combos: list[dict[str, str]], seeds: list[int], env: str, frames: int, thresholds
):
    """Markdown: per combination, frames to each threshold (mean over the seeds that reached it) and the
    final return (mean over seeds)."""
    head = "| settings | seeds | " + " | ".join(f"frames to {t:g}" for t in thresholds) + " | final return |"
    lines = [head, "|" + "---|" * (3 + len(thresholds))]
    for settings in combos:
        rows = [
            r
            for r in records
            if r["env"] == env
            and r["frames_budget"] == frames
            and r["settings"] == settings
            and r["seed"] in seeds
        ]
        cells = []
        for t in thresholds:
            hits = [f for f in (first_frames(r, t) for r in rows) if f is not None]
            cells.append(
                f"{sum(hits) / len(hits) / 1e6:.2f}M ({len(hits)}/{len(rows)})" if hits else "not reached"
            )
        finals = [r["final_return"] for r in rows if r["final_return"] is not None]
        final = f"{sum(finals) / len(finals):.1f}" if finals else "n/a"
        name = ", ".join(f"{k}={v}" for k, v in settings.items()) or "(fixed flags only)"
        lines.append(f"| {name} | {len(rows)} | " + " | ".join(cells) + f" | {final} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--env", default="PongDeterministic-v4", help="env id (default: %(default)s)")
    p.add_argument("--frames", type=float, required=True, help="env frames per run (e.g. 2e6)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1], help="seeds per combination (default: 1)")
    p.add_argument(
        "--lever",
        action="append",
        default=[],
        help="NAME=V1,V2,... or NAME1:NAME2=V1:W1,V2:W2 (launch_impala options); repeat for a grid",
    )
    p.add_argument(
        "--fixed", default="", help="launch_impala flags every run gets, one string ('--workers 2')"
    )
    p.add_argument(
        "--thresholds",
        default="0",
        help="mean returns whose first frame is reported, comma-separated (default: 0)",
    )
    p.add_argument(
        "--runs", type=Path, default=ROOT / "runs" / "sweep", help="run folders (default: runs/sweep)"
    )
    p.add_argument("--archive", type=Path, help="JSON archive of finished runs (default: RUNS/archive.json)")
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    return p


def _join_option_values(argv: list[str]) -> list[str]:
    """``--thresholds -15,0,18`` as ``--thresholds=-15,0,18``: argparse would read a value that starts
    with a minus sign (and is not a plain number) as an unknown option."""
    out, it = [], iter(argv)
    for a in it:
        if a == "--thresholds":
            nxt = next(it, None)
            out.append(a if nxt is None else f"{a}={nxt}")
        else:
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(_join_option_values(sys.argv[1:] if argv is None else argv))
    try:
        return sweep(args)
    except SweepError as e:
        print(f"sweep: error: {e}", file=sys.stderr)
        return 2


def sweep(args: argparse.Namespace) -> int:
    options = _options()
    if not (args.frames >= 1 and args.frames == int(args.frames)):
        raise SweepError(f"--frames {args.frames:g}: a whole number of frames >= 1")
    frames = int(args.frames)
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        raise SweepError(f"--seeds {args.seeds}: distinct seeds >= 0")
    try:
        thresholds = [float(t) for t in args.thresholds.split(",") if t.strip()]
    except ValueError:
        raise SweepError(f"--thresholds {args.thresholds!r}: numbers, comma-separated") from None
    if not thresholds or not all(math.isfinite(t) for t in thresholds):
        raise SweepError(f"--thresholds {args.thresholds!r}: at least one finite number")
    fixed = args.fixed.split()
    levers = [parse_lever(text, options) for text in args.lever]
    named = [n for names, _ in levers for n in names]
    if len(set(named)) != len(named):
        raise SweepError("an option appears in two --lever arguments")
    combos = [
        {n: v for (names, _), values in zip(levers, choice) for n, v in zip(names, values)}
        for choice in itertools.product(*(values for _, values in levers))
    ]
    base = ["--env", args.env, "--total-frames", str(frames), "--no-progress", *fixed]
    commands = []
    for settings in combos:
        flags = [a for name, value in settings.items() for a in flag_args(name, value, options)]
        check_settings([*base, *flags])
        for seed in args.seeds:
            logdir = args.runs / f"{args.env.replace('/', '_')}-{frames}" / slug(settings) / f"seed{seed}"
            commands.append(
                (settings, seed, logdir, [*base, *flags, "--seed", str(seed), "--logdir", str(logdir)])
            )

    if not args.dry_run:
        check_env(args.env)
    archive_path = args.archive or args.runs / "archive.json"
    records = load_archive(archive_path)
    for settings, seed, logdir, cmd in commands:
        done = (logdir / FINISHED_MARKER).exists()
        again = not done and (logdir / "checkpoint.pt").exists()
        what = "finished" if done else ("resume" if again else "run")
        print(f"sweep: {what}: {' '.join(['launch_impala', *cmd])}", flush=True)
        if args.dry_run or done:
            continue
        t0 = time.monotonic()
        proc = subprocess.run([*LAUNCH_IMPALA, *cmd, *(["--resume"] if again else [])], cwd=ROOT)
        if proc.returncode != 0 or not (logdir / FINISHED_MARKER).exists():
            print(
                f"sweep: run {logdir} stopped (exit {proc.returncode}) before its budget; rerun to resume it"
            )
            return proc.returncode or 1
        print(f"sweep: finished {logdir} in {time.monotonic() - t0:.0f}s", flush=True)
        record = record_of(args.env, frames, settings, seed, logdir, thresholds)
        records = [r for r in records if not same_run(r, record)] + [record]
        save_archive(archive_path, records)
    if args.dry_run:
        return 0
    for settings, seed, logdir, _ in commands:  # finished before this invocation, not yet archived
        if (logdir / FINISHED_MARKER).exists() and not any(
            same_run(r, {"env": args.env, "frames_budget": frames, "settings": settings, "seed": seed})
            for r in records
        ):
            records.append(record_of(args.env, frames, settings, seed, logdir, thresholds))
            save_archive(archive_path, records)
    print(table(records, combos, args.seeds, args.env, frames, thresholds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
