"""Helpers for tests that run the real commands as subprocesses."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def signal_and_wait(proc: subprocess.Popen, sig: int, timeout: float = 60) -> str:
    """Signal a process :func:`start` started and wait for it to end; what it printed."""
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=timeout)
    return out


def push_socket(port: int, sndhwm: int | None = None):
    """A ZeroMQ PUSH socket connected to the learner at ``port`` on this machine, as an actor (or an
    attacker) holds one: it drops what it could not send when closed, and queues ``sndhwm`` messages."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if sndhwm is not None:
        sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def free_port_pair() -> int:
    """A port p such that p and p+1 were both free a moment ago."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p >= 65535:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no free port pair")


def start(cmd: list[str], extra_env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    """Start a console script in its own session (so a test can signal its whole group)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra_env or {}))
    return subprocess.Popen(
        [str(BIN / cmd[0]), *cmd[1:]],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
        **kw,
    )


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [str(BIN / cmd[0]), *cmd[1:]], capture_output=True, text=True, timeout=timeout, env=env
    )


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            out.append(c)
            stack.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def actor_pids(pid: int) -> list[int]:
    return [
        p for p in descendants(pid) if "spawn_main" in cmdline(p) and "resource_tracker" not in cmdline(p)
    ]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(predicate, timeout: float, poll: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return predicate()


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
