"""--cpu-affinity: what 'auto' (launch_impala's default) resolves to, and the CPU claims of 'split' (a split
run that finds another one's claims says so); the claims are flocks the kernel drops however a run ends."""

import dataclasses
import os
import subprocess
import sys

import pytest

from impala.envs import EnvSpec
from impala.envs.probe import EnvInfo
from impala.run.config import RunConfig
from impala.run.cpus import CpuClaim
from learner.runtime import resolve_cpu_affinity
from procs import actor_pids, kill_group, start, wait_for

CPUS = tuple(sorted(os.sched_getaffinity(0)))
two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPUs: one for the learner, one for actors")


def test_a_claim_is_all_or_nothing_and_released(tmp_path):
    first, second = CpuClaim(str(tmp_path)), CpuClaim(str(tmp_path))
    assert first.take((0, 1)) and first.cpus == (0, 1)
    assert not second.take((1, 2)) and second.cpus == ()  # CPU 1 is held: CPU 2 is not kept either
    assert CpuClaim(str(tmp_path)).take((2,))  # (so it was released)
    first.release()
    assert second.take((0, 1))
    second.release()


def test_a_killed_holder_leaves_no_claim_behind(tmp_path):
    """The lock files stay on disk; the locks go with the process that held them."""
    code = (
        "import sys, time\n"
        "from impala.run.cpus import CpuClaim\n"
        f"assert CpuClaim({str(tmp_path)!r}).take((0,))\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert not CpuClaim(str(tmp_path)).take((0,))
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / "cpu0.lock").exists() and CpuClaim(str(tmp_path)).take((0,))


@two_cpus
def test_release_gives_the_process_its_affinity_back(tmp_path):
    from impala.run.cpus import pin_process

    claim = CpuClaim(str(tmp_path))
    assert claim.take(CPUS)
    try:
        pin_process(CPUS[:1])
        assert os.sched_getaffinity(0) == {CPUS[0]}
    finally:
        claim.release()
    assert os.sched_getaffinity(0) == set(CPUS)


IMAGE = EnvInfo(EnvSpec("PixelCatch-v0"), (84, 84, 4), "uint8", "Box", "Discrete", num_actions=3)
VECTOR = EnvInfo(EnvSpec("CartPole-v1"), (4,), "float32", "Box", "Discrete", num_actions=2)


@two_cpus
def test_auto_puts_the_learner_first_only_for_a_cpu_learner_of_images_with_local_actors(tmp_path):
    base = RunConfig(env="PixelCatch-v0", workers=2, device="cpu")
    claim = CpuClaim(str(tmp_path))
    resolved = resolve_cpu_affinity(base, claim, IMAGE)
    assert resolved.cpu_affinity == "learner-first" and claim.cpus == ()  # nothing pinned, nothing claimed
    assert resolved.local_actor_nice() == 19 and resolved.weights_delay() == 1
    for change, env in (
        ({}, VECTOR),  # an MLP learner: the actors are the bottleneck
        ({"workers": 0}, IMAGE),  # remote actors only
        ({"in_process": True}, IMAGE),  # actors are threads of the learner
        ({"learners": 2}, IMAGE),
        ({"cpu_affinity": "off"}, IMAGE),
    ):
        off = resolve_cpu_affinity(dataclasses.replace(base, **change), claim, env)
        assert off.cpu_affinity == "off" and off.weights_delay() == 0 and off.local_actor_nice() == 0, change
    explicit = CpuClaim(str(tmp_path))  # an explicit split claims, whatever the observations
    split = dataclasses.replace(base, cpu_affinity="split")
    assert resolve_cpu_affinity(split, explicit, VECTOR).cpu_affinity == "split"
    assert explicit.cpus == CPUS
    other = CpuClaim(str(tmp_path))  # a second split run pins too (the user asked), holding no claim
    assert resolve_cpu_affinity(split, other, IMAGE).cpu_affinity == "split" and other.cpus == ()
    explicit.release()


def _cpus_allowed(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split(":")[1].strip() for line in f if line.startswith("Cpus_allowed_list"))


def _pixel_catch(tmp_path, name: str, *flags: str) -> subprocess.Popen:
    return start(
        ["launch_impala", "--workers", "2", "--env", "PixelCatch-v0", "--batch-size", "8",
         "--total-frames", "10000000", "--no-progress", "--logdir", str(tmp_path / name), *flags],
        extra_env={"IMPALA_CPU_CLAIMS_DIR": str(tmp_path / "claims")},
    )  # fmt: skip


@two_cpus
def test_a_second_split_run_is_warned_until_the_first_is_gone(tmp_path):
    """Two launch_impala runs with --cpu-affinity split, one claims folder: both pin (learner on the first
    CPU, actors on the rest), the second with a warning that the first holds those CPUs. Once the first
    is killed (SIGKILL: no cleanup), a third pins without one."""
    first = _pixel_catch(tmp_path, "first", "--cpu-affinity", "split")
    second = third = None
    try:
        assert wait_for(lambda: len(actor_pids(first.pid)) == 2, 120)
        assert _cpus_allowed(first.pid) == str(CPUS[0])
        second = _pixel_catch(tmp_path, "second", "--cpu-affinity", "split")
        assert wait_for(lambda: len(actor_pids(second.pid)) == 2, 120)
        assert _cpus_allowed(second.pid) == str(CPUS[0])
        kill_group(first)
        first.wait(30)
        kill_group(second)
        second.wait(30)
        third = _pixel_catch(tmp_path, "third", "--cpu-affinity", "split")
        assert wait_for(lambda: len(actor_pids(third.pid)) == 2, 120)
        assert _cpus_allowed(third.pid) == str(CPUS[0])
    finally:
        for proc in (first, second, third):
            if proc is not None:
                kill_group(proc)
    outs = [proc.communicate(timeout=30)[0] for proc in (first, second, third)]
    warning = "another run on this machine has pinned to these CPUs too"
    assert "cpu affinity: the learner on CPU" in outs[0] and warning not in outs[0], outs[0][-2000:]
    assert warning in outs[1], outs[1][-2000:]
    assert "cpu affinity: the learner on CPU" in outs[2] and warning not in outs[2], outs[2][-2000:]


@two_cpus
def test_auto_runs_an_image_env_learner_first(tmp_path):
    """launch_impala's defaults on an image env: nothing pinned, the actors 19 nice levels down, the
    learner's weights published one update late (the log and config.yaml say so)."""
    run = _pixel_catch(tmp_path, "auto")
    lowest = min(os.getpriority(os.PRIO_PROCESS, 0) + 19, 19)
    try:
        assert wait_for(lambda: len(actor_pids(run.pid)) == 2, 120)
        pids = actor_pids(run.pid)
        # each actor lowers its own priority as it starts
        assert wait_for(lambda: {os.getpriority(os.PRIO_PROCESS, p) for p in pids} == {lowest}, 60)
        everything = _cpus_allowed(os.getpid())
        assert {_cpus_allowed(p) for p in [run.pid, *pids]} == {everything}
        assert wait_for(lambda: (tmp_path / "auto" / "config.yaml").exists(), 60)
    finally:
        kill_group(run)
    out = run.communicate(timeout=30)[0]
    assert "local actors: 2, 19 nice levels below the learner" in out, out[-2000:]
    assert "1 update behind the learner's" in out, out[-2000:]
    record = (tmp_path / "auto" / "config.yaml").read_text()
    assert "cpu_affinity: learner-first" in record and "publish_delay: 1" in record, record
