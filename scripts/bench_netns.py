#!/usr/bin/env python
"""Pong frames/s with the actors on another "host" (a network namespace joined by a veth pair), with
and without frames sent once, side by side in one invocation. Needs root (ip netns).

The learner runs in one namespace bound to 10.77.0.1 with --workers 0; `impala-actors` runs in
another and reaches it over the veth link (no CURVE, to measure the bytes alone). Each setting
runs for the same wall time; frames/s is measured between the learner's metrics rows (start-up
excluded) and bytes per agent step come from the unroll schema.

    sudo .venv/bin/python scripts/bench_netns.py --seconds 90
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from impala.transport.trajectory import impala_unroll_schema  # noqa: E402
from test_netns import Net  # noqa: E402  - the namespace set-up the multi-host tests use


def one_run(dedup: bool, seconds: float, port: int, workers: int) -> float:
    net = Net(1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            logdir = Path(tmp) / "run"
            flags = [] if dedup else ["--no-frame-dedup"]
            learner = net.start(
                net.learner,
                [
                    "launch_impala",
                    "--env",
                    "PongDeterministic-v4",
                    "--workers",
                    "0",
                    "--torch-threads",
                    "1",
                    "--bind",
                    Net.LEARNER_IP,
                    "--insecure-bind",
                    "--port",
                    str(port),
                    "--total-frames",
                    str(10**12),
                    "--max-seconds",
                    str(seconds),
                    "--no-progress",
                    "--log-interval",
                    "2",
                    "--logdir",
                    str(logdir),
                    *flags,
                ],
                Path(tmp) / "learner.log",
            )
            time.sleep(8)  # the learner binds before the actors connect (they retry anyway)
            net.start(
                net.hosts[0],
                [
                    "impala-actors",
                    "--learner",
                    f"tcp://{Net.LEARNER_IP}:{port}",
                    "--workers",
                    str(workers),
                    "--insecure",
                    "--learner-timeout",
                    "20",
                ],
                Path(tmp) / "actors.log",
            )
            learner.wait(timeout=seconds + 180)
            with open(logdir / "metrics.csv") as f:
                rows = [r for r in csv.DictReader(f) if r.get("charts/env_frames")]
            first, last = rows[2], rows[-1]  # skip the rows that include start-up
            return (float(last["charts/env_frames"]) - float(first["charts/env_frames"])) / (
                float(last["time"]) - float(first["time"])
            )
    finally:
        net.close()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--port", type=int, default=47600)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    print(
        f"machine: {os.cpu_count()} cores; PongDeterministic-v4, {args.workers} remote actors x 4 envs, "
        f"{args.seconds:.0f}s per run"
    )
    for T in (32,):
        for label, stack in (("frames once", 4), ("full stacks", 0)):
            schema = impala_unroll_schema(T, (4, 84, 84), "uint8", 6, frame_stack=stack)
            print(f"wire bytes per agent step, {label}: {schema.nbytes / T:,.0f}")
    for r in range(args.repeats):
        for dedup in (True, False):
            fps = one_run(dedup, args.seconds, args.port + 10 * r + (0 if dedup else 5), args.workers)
            print(f"run {r}: {'frames once' if dedup else 'full stacks'}: {fps:,.0f} frames/s")


if __name__ == "__main__":
    main()
