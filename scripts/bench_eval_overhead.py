#!/usr/bin/env python
"""What --eval-every costs the learner: its update rate with and without periodic evaluation, side by side.

Runs launch_impala twice for the same wall time with the same flags, once with
--eval-every (greedy episodes of a weights snapshot in a separate, niced process), and
prints updates/s of each (from metrics.csv, start-up excluded), their ratio, and how
many evaluations finished.

    python scripts/bench_eval_overhead.py --env CartPole-v1 --seconds 90 --eval-every 20000
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile


def run(env: str, seconds: float, extra: list[str]) -> tuple[float, int, float]:
    with tempfile.TemporaryDirectory() as logdir:
        cmd = [
            os.path.join(os.path.dirname(sys.executable), "launch_impala"),
            "--env",
            env,
            "--logdir",
            logdir,
            "--no-progress",
            "--log-interval",
            "2",
            "--total-frames",
            str(10**12),
            "--max-seconds",
            str(seconds),
            *extra,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"launch_impala failed:\n{out.stderr[-3000:]}")
        with open(os.path.join(logdir, "metrics.csv")) as f:
            rows = list(csv.DictReader(f))
    train = [r for r in rows if r.get("charts/policy_version")]
    first, last = train[1], train[-1]  # the first row includes start-up
    rate = (float(last["charts/policy_version"]) - float(first["charts/policy_version"])) / (
        float(last["time"]) - float(first["time"])
    )
    evals = [r for r in rows if r.get("eval/mean_return")]
    return rate, len(evals), float(evals[-1]["eval/mean_return"]) if evals else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("--env", default="CartPole-v1")
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--eval-every", type=int, default=20000)
    ap.add_argument("--eval-episodes", type=int, default=5)
    ap.add_argument("extra", nargs="*", help="More launch_impala flags (after --).")
    args = ap.parse_args()
    flags = [
        "--workers",
        "2",
        "--unroll-length",
        "20",
        "--batch-size",
        "8",
        "--learning-rate",
        "2e-3",
        *args.extra,
    ]
    base, _, _ = run(args.env, args.seconds, flags)
    with_eval, n, last = run(
        args.env,
        args.seconds,
        [*flags, "--eval-every", str(args.eval_every), "--eval-episodes", str(args.eval_episodes)],
    )
    print(
        f"machine: {os.cpu_count()} cores; env {args.env}; {args.seconds:.0f}s each; flags {' '.join(flags)}"
    )
    print(f"without --eval-every: {base:8.2f} updates/s")
    print(
        f"with --eval-every {args.eval_every} ({args.eval_episodes} episodes): {with_eval:8.2f} updates/s, "
        f"{n} evaluations (last mean {last:.1f})"
    )
    print(f"ratio with/without = {with_eval / base:.3f}")


if __name__ == "__main__":
    main()
