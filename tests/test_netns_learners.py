"""A learner group across hosts, for real: two learner ranks on two hosts joined by torchrun's
rendezvous, an actor on a third (Linux network namespaces and veth pairs, as in test_netns.py).

Host L runs torchrun's node 0 (its rendezvous store, rank 0: the learner the actors connect to), host
H0 torchrun's node 1 (the follower rank), host H1 ``impala-actors``. Every rank runs
``learner.cli.launch_impala`` with a small probe loaded at start-up (:data:`RANK_PROBE`): it saves each rank's
weights after the first update, and rank 0 saves the batch that update trained on, so the test can
check the cross-host update against one learner's on the same whole batch (the one-host group equals
that to float32 reordering: tests/test_learner_group.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from impala.run.checkpoint import load_checkpoint
from procs import wait_for
from test_netns import CAPABLE, WHY_NOT, Net, _nets, netns_pids

pytestmark = [pytest.mark.skipif(not CAPABLE, reason=WHY_NOT), pytest.mark.serial]

PORT, RDZV_PORT = 5555, 29400  # the hosts' namespaces are this test's own: nothing else holds them
FOLLOWER_IP = "10.77.0.2"  # host H0: the follower rank, on the learner's own subnet

# Each rank's weights after its first update (and rank 0's first batch), saved where PROBE_OUT says: a
# sitecustomize.py on the learner hosts' PYTHONPATH, so it runs inside the ranks torchrun starts.
RANK_PROBE = r"""
import os

if os.environ.get("PROBE_OUT") and os.environ.get("RANK"):
    import json

    import learner.cli.sleeping_threads  # before torch, as launch_impala imports it
    import numpy as np
    import torch
    from learner import vtrace_learner

    out, rank, first = os.environ["PROBE_OUT"], os.environ["RANK"], [True]
    train, update = vtrace_learner.VTraceLearner.train, vtrace_learner.ImpalaTrainer.update

    def probed_train(self, batch, *, frames_done):
        metrics = train(self, batch, frames_done=frames_done)
        if first[0]:
            first[0] = False
            torch.save(self.model.state_dict(), f"{out}-rank{rank}.pt")
        return metrics

    def probed_update(self, frames_done):
        if first[0]:
            unrolls = self._pending[: self.config.batch_size]
            arrays = {f"{i}/{k}": v for i, u in enumerate(unrolls) for k, v in u.items()}
            np.savez(f"{out}-batch.npz", **arrays)
            with open(f"{out}-batch.json", "w") as f:
                json.dump({"frames_done": frames_done, "unrolls": len(unrolls)}, f)
        return update(self, frames_done)

    vtrace_learner.VTraceLearner.train = probed_train
    vtrace_learner.ImpalaTrainer.update = probed_update
"""

RUN = [
    *"--env CartPole-v1 --workers 0 --unroll-length 20 --batch-size 8".split(),
    "--minibatches",  # one: each rank's share is one minibatch, so the group's update equals one learner's
    "1",  # (with more, each rank shuffles its own share into minibatches: equal only in expectation)
    *"--torch-threads 1 --no-progress --log-interval 1 --port".split(),
    str(PORT),
    "--insecure-bind",  # the namespaces' links are this test's own
]


ENDPOINT = f"{Net.LEARNER_IP}:{RDZV_PORT}"


def learner_host(node_rank: int, bind: str, args: list[str]) -> list[str]:
    """What a learner host runs: launch_impala as torchrun's agent for its one rank."""
    return ["launch_impala", *RUN, "--learners", "2", "--node-rank", str(node_rank), "--rdzv-endpoint",
            ENDPOINT, "--bind", bind, *args]  # fmt: skip


def torchrun_host(node_rank: int, bind: str, args: list[str]) -> list[str]:
    """The same rank started by torchrun itself (its static rendezvous), launch_impala as its module."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--node-rank", str(node_rank), "--rdzv-endpoint", ENDPOINT, "--max-restarts", "0",
            "-m", "learner.cli.launch_impala", *RUN, "--bind", bind, *args]  # fmt: skip


@pytest.fixture
def make_net():
    yield from _nets()


def follower_pid(net: Net) -> int | None:
    """The follower rank's process (torchrun's worker, not torchrun itself) on host H0."""
    for pid in netns_pids(net.hosts[0]):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"learner.cli.launch_impala" in cmd:  # the rank (its agent runs bin/launch_impala)
            return pid
    return None


def single_learner_update(probe_out: Path, logdir: Path, total_frames: int) -> dict[str, torch.Tensor]:
    """One learner (no group), from the same seed, on rank 0's whole first batch: its weights after."""
    from learner.cli.launch_impala import parse_args, probe_run_envs, resolve
    from learner.vtrace_learner import ImpalaTrainer

    torch.set_num_threads(1)
    config, impala = resolve(
        parse_args([*RUN, "--learners", "2", "--total-frames", str(total_frames), "--logdir", str(logdir)])
    )
    trainer = ImpalaTrainer(impala, config, probe_run_envs(config)[0])
    meta = json.loads(Path(f"{probe_out}-batch.json").read_text())
    arrays = np.load(f"{probe_out}-batch.npz")
    trainer._pending = [
        {k.split("/", 1)[1]: arrays[k] for k in arrays.files if k.startswith(f"{i}/")}
        for i in range(meta["unrolls"])
    ]
    trainer._sources = [0] * meta["unrolls"]
    trainer.update(meta["frames_done"])
    return trainer.learner.model.state_dict()


def test_two_learner_hosts_through_torchrun_train_equal_one_learner_survive_a_lost_rank_and_resume(
    make_net, tmp_path
):
    """Two learner ranks on two hosts (torchrun's rendezvous) and an actor on a third: the first
    update on each rank equals one learner's on the whole batch; a stop signal to both hosts ends the
    run cleanly with a checkpoint; --resume restarts the group, and killing the follower then ends the
    run with one error line on each host and a checkpoint; --resume on both hosts (started by
    torchrun itself this time) restarts the group again, which trains on from the checkpoint with
    both ranks in step (rank 0's state reached the follower)."""
    started = time.time()
    net = make_net(2)
    host_l, host_f, host_a = net.learner, net.hosts[0], net.hosts[1]
    probe, logdir = tmp_path / "probe", tmp_path / "run"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(RANK_PROBE)
    total = 100_000_000
    logs = {
        name: tmp_path / f"{name}.log" for name in ("actors", *(f"rank{r}{x}" for r in (0, 1) for x in "bc"))
    }
    logs.update({f"rank{r}": tmp_path / f"rank{r}.log" for r in (0, 1)})

    def text(name: str) -> str:
        return logs[name].read_text() if logs[name].exists() else ""

    def phase(suffix: str = "") -> str:
        """Both ranks' logs of a phase and the actors', for an assertion that fails."""
        return "\n".join(
            f"--- {n}:\n{text(n)[-2500:]}" for n in (f"rank0{suffix}", f"rank1{suffix}", "actors")
        )

    def exits(*procs: subprocess.Popen, timeout: float) -> list[int | None]:
        """The ranks' exit codes once all have exited (None for one still running at ``timeout``)."""
        wait_for(lambda: all(p.poll() is not None for p in procs), timeout)
        return [p.poll() for p in procs]

    def start_ranks(command, args: list[str], out: str, suffix: str = "") -> list[subprocess.Popen]:
        env = {"PROBE_OUT": str(tmp_path / out), "PYTHONPATH": str(probe)}
        return [
            net.start(host, command(r, bind, args), logs[f"rank{r}{suffix}"], env=env)
            for r, (host, bind) in enumerate(((host_l, Net.LEARNER_IP), (host_f, FOLLOWER_IP)))
        ]

    common = ["--logdir", str(logdir), "--total-frames", str(total), "--max-seconds", "120"]
    rank0, rank1 = start_ranks(learner_host, common, "first")
    actors = net.start(
        host_a,
        [
            "impala-actors",
            "--learner",
            f"tcp://{Net.LEARNER_IP}:{PORT}",
            "--insecure",
            "--workers",
            "1",
            "--learner-timeout",
            "60",  # it outlives the learner's restart below and joins the resumed run
        ],
        logs["actors"],
    )

    # Phase 1: the group forms across hosts and trains: both ranks made their first update.
    def rows() -> int:
        path = logdir / "metrics.csv"
        return path.read_text().count("\n") - 1 if path.exists() else 0

    assert wait_for(lambda: rows() >= 3 and (tmp_path / "first-rank1.pt").exists(), 90), phase()
    assert re.search(r"learner group: 2 ranks across hosts \(torchrun, rendezvous 10\.77\.0\.1:29400\), gloo "
                     r"backend on vl\w+; this is rank 0", text("rank0")), text("rank0")[-3000:]  # fmt: skip
    assert "learner-1 INFO learner group: rank 1 of 2 (rendezvous 10.77.0.1:29400) joined on vh" in text(
        "rank1"
    ), text("rank1")[-3000:]
    formed = time.time() - started

    # The update across hosts equals one learner's on the whole batch (and the ranks agree).
    want = single_learner_update(tmp_path / "first", tmp_path / "replay", total)
    ranks = [torch.load(tmp_path / f"first-rank{r}.pt") for r in (0, 1)]
    for r, got in enumerate(ranks):
        assert set(got) == set(want)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=2e-5, atol=1e-5, msg=f"rank {r}: {key}")

    # Phase 2: both hosts are told to stop (SIGTERM to each host's launch_impala, as scancel or a pod's
    # deletion does): rank 0 finishes its update, checkpoints and releases the follower, which waited
    # for it; neither host reports an error, and the agents exit 128 + SIGTERM.
    rank0.send_signal(signal.SIGTERM)
    rank1.send_signal(signal.SIGTERM)
    assert exits(rank0, rank1, timeout=60) == [128 + signal.SIGTERM] * 2, phase()
    assert re.search(r"launch_impala: done: .* checkpoint \S+ \(interrupted\)", text("rank0")), text("rank0")[
        -3000:
    ]
    assert re.search(r"launch_impala: learner rank 1 of 2 .* done: \d+ updates", text("rank1")), text(
        "rank1"
    )[-3000:]
    for name in ("rank0", "rank1"):
        assert "launch_impala: error" not in text(name) and "Traceback" not in text(name), text(name)[-3000:]
    stopped = int(load_checkpoint(str(logdir / "checkpoint.pt"), keys=("env_frames",))["env_frames"])

    # Phase 3: --resume on both hosts; once the group trains again, the follower host's rank dies
    # outright: each host ends with one line, rank 0 with a checkpoint.
    rank0, rank1 = start_ranks(
        learner_host, ["--logdir", str(logdir), "--resume", "--max-seconds", "120"], "again", "b"
    )
    assert wait_for(lambda: (tmp_path / "again-rank1.pt").exists() and follower_pid(net), 90), phase("b")
    assert f"resumed from {logdir}/checkpoint.pt at {stopped} env frames" in text("rank0b")
    os.kill(follower_pid(net), signal.SIGKILL)
    assert exits(rank0, rank1, timeout=60) == [1, 1], phase("b")
    for name, says in (
        ("rank0b", "a learner rank stopped"),
        ("rank1b", "learner rank 1 of 2 was killed (SIGKILL)"),
    ):
        out = text(name)
        errors = [line for line in out.splitlines() if line.startswith("launch_impala: error:")]
        assert len(errors) == 1 and says in errors[0], out[-3000:]
        assert "Traceback" not in out and "launch_impala: done" not in out, out[-3000:]
    assert "--resume continues" in text("rank0b") and (logdir / "checkpoint.pt").exists()
    frames = int(load_checkpoint(str(logdir / "checkpoint.pt"), keys=("env_frames",))["env_frames"])
    assert frames > stopped

    # Phase 4: --resume on both hosts, this time under torchrun itself, restarts the group from that
    # checkpoint; it trains 2,000 more frames and ends at its budget.
    resume = ["--logdir", str(logdir), "--resume", "--total-frames", str(frames + 2000)]
    rank0, rank1 = start_ranks(torchrun_host, [*resume, "--max-seconds", "90"], "resumed", "c")
    assert exits(rank0, rank1, timeout=120) == [0, 0], phase("c")
    assert f"resumed from {logdir}/checkpoint.pt at {frames} env frames" in text("rank0c")
    done = [line for line in text("rank0c").splitlines() if line.startswith("launch_impala: done:")]
    assert done and int(re.search(r"done: (\d+) env frames", done[0]).group(1)) >= frames + 2000, done
    follower_done = re.search(r"launch_impala: learner rank 1 of 2 .* done: (\d+) updates", text("rank1c"))
    assert follower_done and int(follower_done.group(1)) >= 1, text("rank1c")[-2000:]
    # The follower took rank 0's resumed state (weights and optimizer): after their first update the two
    # ranks hold the same weights, and not those of the first run's first update.
    resumed = [torch.load(tmp_path / f"resumed-rank{r}.pt") for r in (0, 1)]
    for key in resumed[0]:
        torch.testing.assert_close(resumed[1][key], resumed[0][key], rtol=0, atol=0, msg=key)
    assert any(not torch.equal(resumed[0][k], ranks[0][k]) for k in resumed[0])
    took = time.time() - started
    print(f"netns learners: the group formed and trained in {formed:.1f} s, the whole test took {took:.1f} s")
    actors.send_signal(signal.SIGTERM)
    try:
        actors.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
