"""The CPUs this process may use: its affinity (a Slurm allocation's or a container's cpuset) capped by the
CFS quota of its cgroup (``docker --cpus``, Kubernetes CPU limits), so that defaults derived from it (actors,
learner threads, evaluation workers) never oversubscribe a container; and pinning a process to some of
them (``--cpu-affinity split``), and claiming them so that a second run on the machine does not pin onto the
same ones (``--cpu-affinity auto``)."""

from __future__ import annotations

import fcntl
import math
import os
import re
import tempfile

# One lock file per CPU: a run that pins holds an flock on each of its CPUs' files while it runs. Any user's
# run may create them (the folder is world-writable and sticky, as /tmp); an flock needs only read access.
# IMPALA_CPU_CLAIMS_DIR moves the folder (containers that share cores can mount one folder in common).
CLAIMS_DIR = os.path.join(tempfile.gettempdir(), "impala-rl-cpu-claims")


def available_cpus() -> int:
    """The CPUs this process may use: its affinity (a Slurm allocation's or a container's cpuset), capped by a
    CFS quota on its cgroup (``docker --cpus 4``, Kubernetes CPU limits), rounded up; not the machine's
    count."""
    try:
        cpus = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))


def split_cpus(learner_threads: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the learner's CPUs, the local actors' CPUs): the first ``learner_threads`` of this process's
    affinity set, and the rest. ValueError when that leaves the actors none."""
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    if learner_threads >= len(cpus):
        raise ValueError(
            f"--cpu-affinity split gives the learner {learner_threads} of this process's {len(cpus)} CPUs "
            f"({','.join(map(str, cpus))}) and leaves the actors none; lower --torch-threads"
        )
    return cpus[:learner_threads], cpus[learner_threads:]


def pin_process(cpus: tuple[int, ...]) -> None:
    """Pin every thread of this process to ``cpus`` (threads started later inherit it). Each thread has its
    own affinity on Linux: pinning only the calling one would leave a receive thread or torch's pool free."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def cgroup_cpu_quota(proc: str = "/proc/self") -> float | None:
    """CPUs' worth of time the CFS quota of this process's cgroup (or of an ancestor: the tightest) allows,
    from
    cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``; None when there is no quota."""
    try:
        with open(f"{proc}/cgroup") as f:
            memberships = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
        with open(f"{proc}/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    quotas = []
    for fields in mounts:
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if len(fields) < sep + 4:
            continue
        # mountinfo escapes space, tab, newline and backslash as octal (\\040 ...); /proc/self/cgroup does
        # not.
        mount_root, mount_point = _unescape_mountinfo(fields[3]), _unescape_mountinfo(fields[4])
        fstype, options = fields[sep + 1], fields[sep + 3].split(",")
        if fstype == "cgroup2":
            paths = [
                path for hierarchy, controllers, path in memberships if hierarchy == "0" and controllers == ""
            ]
        elif fstype == "cgroup" and "cpu" in options:
            paths = [path for _, controllers, path in memberships if "cpu" in controllers.split(",")]
        else:
            continue
        for path in paths:
            if not (path == mount_root or path.startswith(mount_root.rstrip("/") + "/")):
                continue  # this process's cgroup is not visible under that mount
            directory = os.path.join(mount_point, os.path.relpath(path, mount_root))
            while True:
                quota = _cfs_quota(directory, v2=fstype == "cgroup2")
                if quota is not None:
                    quotas.append(quota)
                if os.path.normpath(directory) == os.path.normpath(mount_point):
                    break
                directory = os.path.dirname(directory)
    return min(quotas) if quotas else None


def _unescape_mountinfo(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _cfs_quota(directory: str, v2: bool) -> float | None:
    try:
        if v2:
            with open(os.path.join(directory, "cpu.max")) as f:
                quota, period = (f.read().split() + ["100000"])[:2]
            return None if quota == "max" else int(quota) / int(period)
        with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError, ZeroDivisionError):
        return None


class CpuClaim:
    """The CPUs this process holds for a pinned run: an flock on one file per CPU in ``claims_dir``. The
    kernel drops the locks when the process ends, however it ends (a killed run leaves no stale claim);
    ``release`` drops them sooner and gives the process back the affinity it had before it was pinned (a
    run inside a longer-lived process)."""

    def __init__(self, claims_dir: str | None = None) -> None:
        self.claims_dir = claims_dir or os.environ.get("IMPALA_CPU_CLAIMS_DIR") or CLAIMS_DIR
        self.cpus: tuple[int, ...] = ()
        self._fds: list[int] = []
        self._affinity = frozenset(os.sched_getaffinity(0))

    def take(self, cpus: tuple[int, ...]) -> bool:
        """Claim every CPU of ``cpus``, or none: False when another process holds one of them, or the claims
        folder cannot be used (then nobody can tell, and the caller should not pin)."""
        fds = []
        try:
            os.makedirs(self.claims_dir, exist_ok=True)
            if os.stat(self.claims_dir).st_uid == os.getuid():
                os.chmod(self.claims_dir, 0o1777)
            for cpu in cpus:
                fd = os.open(os.path.join(self.claims_dir, f"cpu{cpu}.lock"), os.O_RDONLY | os.O_CREAT, 0o644)
                fds.append(fd)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by another run (EWOULDBLOCK), or no usable folder
            for fd in fds:
                os.close(fd)
            return False
        self._fds.extend(fds)
        self.cpus = tuple(cpus)
        return True

    def release(self) -> None:
        """Drop the claims and unpin this process (every thread) back to its affinity before the run."""
        for fd in self._fds:
            os.close(fd)
        self._fds, self.cpus = [], ()
        if frozenset(os.sched_getaffinity(0)) != self._affinity:
            pin_process(tuple(sorted(self._affinity)))
