#!/usr/bin/env python3
"""Run one training command for a fixed window and measure the CPU it had and used.

    monitor.py --seconds 1800 --summary OUT/summary.json -- COMMAND ARGS...

Standard library only, so any interpreter runs it (the project's .venv or a peer's). It

- puts the launch time into the environment as PEER_T0 (epoch seconds): the peers' runners
  (cleanrl_run.py, sf_run.py) write each curve row's ``time`` as seconds since that moment, so
  every curve's clock starts at the command's launch, imports and env construction included;
- samples /proc/stat every second: ``cpu_busy`` is the fraction of all cores busy over the run,
  the whole machine (anything else running counts too: compare.sh runs each command alone);
- reads the command's own CPU time when it ends (RUSAGE_CHILDREN: every process of its tree that
  was reaped; or, where more, the CPU of its session's processes sampled each second):
  ``cpu_own`` is that CPU time over (wall seconds x cores);
- ends the command at the window: SIGINT to its process group (a Ctrl-C, which every peer and
  launch_impala handle by saving and exiting), SIGTERM 30 s later, SIGKILL 30 s after that.

The summary JSON holds the window, wall seconds, both CPU fractions and the exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time


def _proc_stat() -> tuple[int, int]:
    """(busy, total) jiffies over all cores; iowait counts as idle."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])  # guest time is already inside user
    return total - idle, total


_TICK = os.sysconf("SC_CLK_TCK")


def _session_cpu(sid: int, seen: dict[int, float]) -> None:
    """CPU seconds (user + system) of every live process in session ``sid``, into ``seen`` by pid."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) "
        if int(fields[3]) != sid:  # field 6 of stat: the session id
            continue
        seen[int(name)] = (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


class Sampler(threading.Thread):
    def __init__(self, period: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.period = period
        self.samples: list[tuple[float, float]] = []  # (t, busy fraction over the last period)
        self.session: int | None = None  # the command's session: its processes' CPU, sampled
        self.session_cpu: dict[int, float] = {}
        self._halt = threading.Event()
        self.first = _proc_stat()
        self.last = self.first

    def run(self) -> None:
        prev = self.first
        t0 = time.time()
        while not self._halt.wait(self.period):
            if self.session is not None:
                _session_cpu(self.session, self.session_cpu)
            cur = _proc_stat()
            d_total = cur[1] - prev[1]
            if d_total > 0:
                self.samples.append((round(time.time() - t0, 1), round((cur[0] - prev[0]) / d_total, 4)))
            prev = cur
        self.last = _proc_stat()

    def stop(self) -> float:
        self._halt.set()
        self.join()
        busy = self.last[0] - self.first[0]
        total = self.last[1] - self.first[1]
        return busy / total if total else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, required=True, help="window: the command is ended after this")
    ap.add_argument("--summary", required=True, help="JSON file to write")
    ap.add_argument("--grace", type=float, default=30.0, help="seconds between SIGINT, SIGTERM and SIGKILL")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command given")

    cores = os.cpu_count() or 1
    t0 = time.time()
    env = {**os.environ, "PEER_T0": repr(t0)}
    sampler = Sampler()
    sampler.start()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    sampler.session = proc.pid
    ended_by = "exit"
    deadline = t0 + args.seconds
    rc = None
    try:
        while rc is None:
            rc = proc.poll()
            if rc is None and time.time() >= deadline:
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        ended_by = "interrupted"
    if rc is None:
        if ended_by == "exit":
            ended_by = "window"
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                rc = proc.wait(timeout=args.grace)
                break
            except subprocess.TimeoutExpired:
                continue
        if rc is None:
            rc = proc.wait()
        # whatever of its tree outlived the leader (workers in their own groups are not ours to hunt)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wall = time.time() - t0
    cpu_busy = sampler.stop()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    # reaped processes of its tree (exact), or the sampled session where orphans escaped the count
    own = max(usage.ru_utime + usage.ru_stime, sum(sampler.session_cpu.values()))
    summary = {
        "command": cmd,
        "window_s": args.seconds,
        "wall_s": round(wall, 2),
        "ended_by": ended_by,
        "returncode": rc,
        "cores": cores,
        "cpu_busy": round(cpu_busy, 4),
        "cpu_own": round(own / (wall * cores), 4) if wall > 0 else None,
        "cpu_own_seconds": round(own, 1),
        "t0": t0,
        "cpu_busy_samples": sampler.samples,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.summary)), exist_ok=True)
    with open(args.summary, "w") as f:
        json.dump(summary, f)
    print(
        f"monitor: {ended_by} after {wall:.0f} s (rc {rc}); cpu busy {cpu_busy:.2f} of {cores} cores "
        f"(machine), own {summary['cpu_own']:.2f}",
        file=sys.stderr,
    )
    # a window's end is the expected way out
    return 0 if ended_by == "window" or rc == 0 else (rc if isinstance(rc, int) and rc > 0 else 1)


if __name__ == "__main__":
    sys.exit(main())
