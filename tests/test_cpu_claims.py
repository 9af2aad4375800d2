"""--cpu-affinity auto (launch_impala's default): a run pins its learner and actors apart only where no other
run on the machine has; the claims are flocks that the kernel drops however a run ends."""

import dataclasses
import os
import subprocess
import sys

import pytest

from impala.envs import EnvSpec
from impala.envs.probe import EnvInfo
from impala.run.config import RunConfig
from impala.run.cpus import CpuClaim
from learner.run.runtime import claim_cpus
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
def test_auto_splits_only_a_cpu_learner_of_images_with_local_actors_whose_cpus_are_free(tmp_path):
    base = RunConfig(env="PixelCatch-v0", workers=2, device="cpu")
    claim = CpuClaim(str(tmp_path))
    try:
        resolved = claim_cpus(base, claim, IMAGE)
        assert resolved.cpu_affinity == "split" and claim.cpus == CPUS
        # the learner's threads: the CPUs its 2 actors leave, at least one (a 16-core box: 14)
        assert resolved.torch_threads == max(1, len(CPUS) - 2) == resolved.cpu_threads()
        # another run's process (a second claim in the same folder) finds them held
        other = CpuClaim(str(tmp_path))
        assert claim_cpus(base, other, IMAGE).cpu_affinity == "off" and other.cpus == ()
    finally:
        claim.release()
    for change, env in (
        ({}, VECTOR),  # an MLP learner: the actors are the bottleneck, not pinned apart
        ({"workers": 0}, IMAGE),  # remote actors only
        ({"in_process": True}, IMAGE),  # actors are threads of the learner
        ({"learners": 2}, IMAGE),
        ({"torch_threads": len(CPUS)}, IMAGE),  # no CPU left for the actors
        ({"cpu_affinity": "off"}, IMAGE),
    ):
        free = CpuClaim(str(tmp_path))
        assert claim_cpus(dataclasses.replace(base, **change), free, env).cpu_affinity == "off", change
        assert free.cpus == (), change
    explicit = CpuClaim(str(tmp_path))  # an explicit split claims as well, whatever the observations
    split = dataclasses.replace(base, cpu_affinity="split")
    assert claim_cpus(split, explicit, VECTOR).cpu_affinity == "split"
    assert explicit.cpus == CPUS
    explicit.release()


def _cpus_allowed(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split(":")[1].strip() for line in f if line.startswith("Cpus_allowed_list"))


def _pixel_catch(tmp_path, name: str) -> subprocess.Popen:
    return start(
        ["launch_impala", "--workers", "2", "--env", "PixelCatch-v0", "--batch-size", "8",
         "--total-frames", "10000000", "--no-progress", "--logdir", str(tmp_path / name)],
        extra_env={"IMPALA_CPU_CLAIMS_DIR": str(tmp_path / "claims")},
    )  # fmt: skip


@two_cpus
def test_two_runs_on_one_machine_pin_only_the_first(tmp_path):
    """Two launch_impala runs of an image env with the defaults, one claims folder: the first pins (learner
    on the first CPU, actors on the rest), the second leaves placement to the kernel and says why. Once the
    first is killed (SIGKILL: no cleanup), a third pins again."""
    everything = f"{CPUS[0]}-{CPUS[-1]}" if CPUS == tuple(range(CPUS[0], CPUS[-1] + 1)) else None
    first = _pixel_catch(tmp_path, "first")
    second = third = None
    try:
        assert wait_for(lambda: len(actor_pids(first.pid)) == 2, 120)
        assert _cpus_allowed(first.pid) == str(CPUS[0])
        second = _pixel_catch(tmp_path, "second")
        assert wait_for(lambda: len(actor_pids(second.pid)) == 2, 120)
        assert _cpus_allowed(second.pid) != str(CPUS[0])
        if everything:
            assert {_cpus_allowed(p) for p in [second.pid, *actor_pids(second.pid)]} == {everything}
        kill_group(first)
        first.wait(30)
        third = _pixel_catch(tmp_path, "third")
        assert wait_for(lambda: len(actor_pids(third.pid)) == 2, 120)
        assert _cpus_allowed(third.pid) == str(CPUS[0])
    finally:
        for proc in (first, second, third):
            if proc is not None:
                kill_group(proc)
    outs = [proc.communicate(timeout=30)[0] for proc in (first, second, third)]
    assert "cpu affinity: the learner on CPU" in outs[0], outs[0][-2000:]
    assert "another run on this machine has pinned to CPUs" in outs[1], outs[1][-2000:]
    assert "cpu affinity: the learner on CPU" in outs[2], outs[2][-2000:]
