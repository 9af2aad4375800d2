#!/usr/bin/env python
"""Pong frames/s with frames sent once vs full stacks, and with 2 learner ranks, alternating.

Each setting runs launch_impala for the same wall time (frames/s between its metrics rows,
start-up excluded, as scripts/bench_throughput.py's (b)), and the settings alternate so that
a slow spell of the machine does not land on one setting only.

    python scripts/bench_wire_and_group.py --seconds 50 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_throughput import system_throughput  # noqa: E402

SETTINGS = [
    ("1 learner, frames once (default)", []),
    ("1 learner, full stacks (--no-frame-dedup)", ["--no-frame-dedup"]),
    ("2 learner ranks (--learners 2), frames once", ["--learners", "2"]),
]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("--env", default="PongDeterministic-v4")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=50.0)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    print(
        f"machine: {os.cpu_count()} cores; {args.env}, {args.workers} workers x 4 envs, {args.seconds:.0f}s "
        "per run"
    )
    for r in range(args.repeats):
        for label, extra in SETTINGS:
            fps, lag, _ = system_throughput(
                args.env, args.workers, args.seconds, ["--envs-per-worker", "4", "--device", "cpu", *extra]
            )
            print(f"repeat {r}: {label}: {fps:,.0f} frames/s (mean policy lag {lag:.1f})", flush=True)


if __name__ == "__main__":
    main()
