#!/usr/bin/env python
"""End-to-end throughput of launch_impala against the raw environment limit, in one run.

(a) the env limit: N processes step the same env (same DeepMind preprocessing)
    with random actions and no learning, for a fixed time;
(b) launch_impala with N workers, for a fixed time, frames/s measured between
    its first and last metrics rows (so process start-up is excluded);
(c) with --compare-dedup: (b) again with --no-frame-dedup (every unroll carries the
    full 4-frame stacks), and the bytes per agent step on the wire either way.

Prints frames/s of each and the ratio b/a. Both run on the same machine in the
same invocation, one after the other, so the ratio is robust to the machine's
speed; run it on an otherwise idle machine.

    python scripts/bench_throughput.py --workers 2 --seconds 60
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import tempfile
import time


def _env_worker(env_id: str, seconds: float, seed: int, out: mp.Queue) -> None:
    import numpy as np

    from impala.envs import EnvSpec, make_env

    env = make_env(EnvSpec(env_id), seed=seed)
    env.reset(seed=seed)
    n = env.action_space.n
    rng = np.random.default_rng(seed)
    ale = getattr(env.unwrapped, "ale", None)

    def run_for(duration: float) -> tuple[int, int]:
        steps = 0
        frames0 = ale.getFrameNumber() if ale else 0
        end = time.perf_counter() + duration
        while time.perf_counter() < end:
            for _ in range(100):
                _, _, term, trunc, _ = env.step(int(rng.integers(n)))
                steps += 1
                if term or trunc:
                    env.reset()
        return steps, (ale.getFrameNumber() - frames0) if ale else steps

    run_for(min(3.0, seconds / 5))  # warm-up
    t0 = time.perf_counter()
    steps, frames = run_for(seconds)
    out.put((steps, frames, time.perf_counter() - t0))


def env_limit(env_id: str, workers: int, seconds: float) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_env_worker, args=(env_id, seconds, i, q)) for i in range(workers)]
    for p in procs:
        p.start()
    results = [q.get() for _ in procs]
    for p in procs:
        p.join()
    steps = sum(r[0] / r[2] for r in results)
    frames = sum(r[1] / r[2] for r in results)
    return steps, frames


def system_throughput(
    env_id: str, workers: int, seconds: float, extra: list[str]
) -> tuple[float, float, str]:
    with tempfile.TemporaryDirectory() as logdir:
        cmd = [
            os.path.join(os.path.dirname(sys.executable), "launch_impala"),
            "--env",
            env_id,
            "--workers",
            str(workers),
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
            raise RuntimeError(f"launch_impala failed:\n{out.stderr[-3000:]}")
        with open(os.path.join(logdir, "metrics.csv")) as f:
            rows = list(csv.DictReader(f))
    if len(rows) < 3:
        raise RuntimeError("too few metrics rows; run longer (--seconds)")
    first, last = rows[1], rows[-1]  # skip the first row: it includes the queue filling up
    dt = float(last["time"]) - float(first["time"])
    frames = (float(last["charts/env_frames"]) - float(first["charts/env_frames"])) / dt
    lag = sum(float(r["charts/policy_lag"]) for r in rows[1:]) / (len(rows) - 1)
    return frames, lag, out.stdout.strip().splitlines()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("--env", default="PongDeterministic-v4")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--seconds", type=float, default=60.0, help="Measured seconds for each of (a) and (b).")
    ap.add_argument("--envs-per-worker", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=None, help="Default: launch_impala's.")
    ap.add_argument("--unroll-length", type=int, default=None, help="Default: launch_impala's.")
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--compare-dedup",
        action="store_true",
        help="Also run (b) with --no-frame-dedup and print bytes per agent step both ways.",
    )
    ap.add_argument("extra", nargs="*", help="More launch_impala flags (after --).")
    args = ap.parse_args()

    import torch

    from impala.transport.trajectory import impala_unroll_schema

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    print(f"machine: {os.cpu_count()} cores ({cpu}), GPU: {gpu}, torch {torch.__version__}")
    print(f"env {args.env}, N={args.workers} workers, {args.seconds:.0f}s each")

    steps_a, frames_a = env_limit(args.env, args.workers, args.seconds)
    print(f"(a) env limit:      {frames_a:10,.0f} frames/s  ({steps_a:,.0f} agent steps/s)")
    flags = ["--envs-per-worker", str(args.envs_per_worker), "--device", args.device]
    for flag, value in (("--batch-size", args.batch_size), ("--unroll-length", args.unroll_length)):
        if value is not None:
            flags += [flag, str(value)]
    flags += args.extra
    frames_b, lag, done = system_throughput(args.env, args.workers, args.seconds + 20, flags)
    print(
        f"(b) launch_impala:  {frames_b:10,.0f} frames/s  (K={args.envs_per_worker} envs/worker, "
        f"B={args.batch_size or 'default'}, T={args.unroll_length or 'default'}, mean policy lag {lag:.1f})"
    )
    print(f"    {done}")
    print(f"ratio b/a = {frames_b / frames_a:.3f}")
    if args.compare_dedup:
        frames_c, lag_c, done_c = system_throughput(
            args.env, args.workers, args.seconds + 20, flags + ["--no-frame-dedup"]
        )
        print(
            f"(c) --no-frame-dedup: {frames_c:8,.0f} frames/s  (mean policy lag {lag_c:.1f}); b/c = "
            f"{frames_b / frames_c:.3f}"
        )
        print(f"    {done_c}")
        T = args.unroll_length or 32
        for label, stack in (("frames once", 4), ("full stacks", 0)):
            schema = impala_unroll_schema(T, (4, 84, 84), "uint8", 6, frame_stack=stack)
            print(
                f"    wire bytes per agent step, {label}: {schema.nbytes / T:,.0f} (unroll T={T}: "
                f"{schema.nbytes:,} B)"
            )


if __name__ == "__main__":
    main()
