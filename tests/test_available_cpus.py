"""available_cpus: affinity capped by a CFS quota (docker --cpus, Kubernetes limits), read the way the
kernel exposes it."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from impala.run.cpus import available_cpus, cgroup_cpu_quota

ROOT = Path(__file__).resolve().parents[1]
CPU_V1 = Path("/sys/fs/cgroup/cpu")


def _can_make_v1_cpu_cgroups() -> bool:
    return os.geteuid() == 0 and (CPU_V1 / "cpu.cfs_quota_us").exists() and os.access(CPU_V1, os.W_OK)


@pytest.mark.skipif(
    not _can_make_v1_cpu_cgroups(), reason="needs root and a writable cgroup-v1 cpu hierarchy"
)
@pytest.mark.parametrize("quota_us, expected_quota", [(50_000, 0.5), (150_000, 1.5)])
def test_a_quota_on_a_parent_cgroup_caps_a_process_in_its_child(quota_us, expected_quota):
    """A real cgroup: the quota sits on the parent, the process runs in a child without one (the tightest
    ancestor counts); 0.5 CPU -> 1, 1.5 CPUs -> 2 (rounded up), never more than the affinity allows."""
    here = cgroup_cpu_quota()
    if here is not None and here < expected_quota:
        pytest.skip(f"this test's own cgroup already has a tighter quota ({here} CPUs)")
    parent = CPU_V1 / f"impala-test-{uuid.uuid4().hex[:8]}"
    child = parent / "job"
    child.mkdir(parents=True)
    try:
        (parent / "cpu.cfs_period_us").write_text("100000")
        (parent / "cpu.cfs_quota_us").write_text(str(quota_us))
        code = (
            "from impala.run.cpus import available_cpus, cgroup_cpu_quota; print(available_cpus(), "
            "cgroup_cpu_quota())"
        )
        out = subprocess.run(
            ["sh", "-c", f'echo $$ > {child}/cgroup.procs && exec "$0" -c "$1"', sys.executable, code],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        cpus, quota = out.stdout.split()
        assert float(quota) == expected_quota
        assert int(cpus) == min(len(os.sched_getaffinity(0)), -(-quota_us // 100_000))
    finally:
        for d in (child, parent):
            for _ in range(50):  # the short-lived process may still be leaving the cgroup
                try:
                    d.rmdir()
                    break
                except OSError:
                    import time

                    time.sleep(0.1)


def _fake_proc(tmp_path: Path, cgroup: str, mountinfo: str) -> str:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    return str(proc)


def test_cgroup_v2_cpu_max_is_read_and_max_means_no_quota(tmp_path):
    """cgroup v2 (the layout of current Docker / Kubernetes nodes), written as files: 'max' is no quota, a
    number over the period is a quota, the tightest of the process's cgroup and its ancestors wins."""
    mount = tmp_path / "cg2"
    (mount / "kubepods" / "pod1").mkdir(parents=True)
    (mount / "cpu.max").write_text("max 100000\n")
    (mount / "kubepods" / "cpu.max").write_text("400000 100000\n")
    (mount / "kubepods" / "pod1" / "cpu.max").write_text("max 100000\n")
    proc = _fake_proc(
        tmp_path,
        "0::/kubepods/pod1\n",
        f"30 23 0:26 / {mount} rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n",
    )
    assert cgroup_cpu_quota(proc) == 4.0
    (mount / "kubepods" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(proc) is None
    (mount / "kubepods" / "pod1" / "cpu.max").write_text("250000 100000\n")
    assert cgroup_cpu_quota(proc) == 2.5


def test_unreadable_or_unrelated_cgroup_files_mean_no_quota(tmp_path):
    assert cgroup_cpu_quota(str(tmp_path / "missing")) is None
    proc = _fake_proc(tmp_path, "4:memory:/x\n", f"30 23 0:26 / {tmp_path} rw - cgroup cgroup rw,memory\n")
    assert cgroup_cpu_quota(proc) is None
    assert 1 <= available_cpus() <= (os.cpu_count() or 1)


def test_cgroup_v1_with_combined_controllers_optional_fields_and_an_escaped_space(tmp_path):
    """v1 as systemd mounts it (cpu,cpuacct in one hierarchy), mountinfo with several optional fields before
    '-', and a mount point holding a space (written \\040 in mountinfo, as the kernel escapes it)."""
    mount = tmp_path / "cg v1"
    (mount / "docker" / "abc").mkdir(parents=True)
    (mount / "docker" / "abc" / "cpu.cfs_quota_us").write_text("-1\n")
    (mount / "docker" / "abc" / "cpu.cfs_period_us").write_text("100000\n")
    (mount / "docker" / "cpu.cfs_quota_us").write_text("150000\n")
    (mount / "docker" / "cpu.cfs_period_us").write_text("100000\n")
    escaped = str(mount).replace(" ", "\\040")
    proc = _fake_proc(
        tmp_path,
        "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n",
        f"25 1 0:22 / /sys rw shared:7 - sysfs sysfs rw\n"
        f"33 25 0:29 / {escaped} rw,nosuid shared:12 master:3 - cgroup cgroup rw,cpu,cpuacct\n",
    )
    assert cgroup_cpu_quota(proc) == 1.5
    # a container's view (no cgroup namespace): only its own cgroup is mounted, at the mount point; the
    # parent's looser quota is not visible there, its own is
    (mount / "docker" / "abc" / "cpu.cfs_quota_us").write_text("50000\n")
    inside = tmp_path / "inside"
    inside.mkdir()
    proc2 = _fake_proc(
        inside,
        "4:cpu,cpuacct:/docker/abc\n",
        f"33 25 0:29 /docker/abc {escaped}/docker/abc rw - cgroup cgroup rw,cpu,cpuacct\n",
    )
    assert cgroup_cpu_quota(proc2) == 0.5


def test_the_impala_learner_takes_the_cores_its_actors_leave_and_at_least_two_for_images():
    """With 2 local actors on one core the learner gets 1 thread; on two cores, with actors at its own
    priority (--actor-nice 0, the default), 2 for image observations (a second thread that sleeps when idle:
    launch_impala loads torch with OMP_WAIT_POLICY=PASSIVE unless the user set it, as libgomp itself
    reports, and leaves the variable unset for the processes it starts) and 1 for vector ones (an MLP
    gains nothing from it); with actors niced by --actor-nice 10 alone 1, under --cpu-affinity learner-first
    2 (its actors yield the second core); a user's --torch-threads and OMP_WAIT_POLICY win."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    code = (
        "import os, learner.cli.launch_impala\n"
        "from learner.update.precision import learner_threads\n"
        "from impala.envs import EnvSpec\n"
        "from impala.envs.probe import EnvInfo\n"
        "from impala.run.config import RunConfig\n"
        "pong = EnvInfo(EnvSpec('PongDeterministic-v4'), (4, 84, 84), 'uint8', 'Box', 'Discrete', "
        "num_actions=6)\n"
        "cartpole = EnvInfo(EnvSpec('CartPole-v1'), (4,), 'float32', 'Box', 'Discrete', num_actions=2)\n"
        "two = RunConfig(workers=2)\n"
        "first = RunConfig(workers=2, cpu_affinity='learner-first', actor_nice=10)\n"
        "print(learner_threads(first, pong), "
        "learner_threads(RunConfig(workers=2, actor_nice=10), pong), learner_threads(two, pong), "
        "learner_threads(two, cartpole), learner_threads(RunConfig(workers=2, torch_threads=3), pong), "
        "os.environ.get('OMP_WAIT_POLICY'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["OMP_DISPLAY_ENV"] = "TRUE"  # libgomp prints the settings it loaded with
    for cores, policy, want, loaded in (
        ("0", None, "1 1 1 1 3 None", "PASSIVE"),
        ("0,1", "ACTIVE", "2 1 2 1 3 ACTIVE", "ACTIVE"),
    ):
        out = subprocess.run(
            ["taskset", "-c", cores, sys.executable, "-c", code],
            cwd=ROOT,
            env={**env, "OMP_WAIT_POLICY": policy} if policy else env,
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[-6:] == want.split(), (cores, out.stdout)
        assert f"OMP_WAIT_POLICY = '{loaded}'" in out.stderr, out.stderr
