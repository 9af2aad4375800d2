"""Actors on other hosts, for real: Linux network namespaces joined by veth pairs, over CURVE.

The learner runs in one network namespace and ``impala-actors`` in others, joined by veth
pairs with their own addresses (10.77.x.y); nothing goes over loopback. Each namespace has
its own network stack, so a link can be cut (``ip link set VETH down``) and a host killed
outright (every process in its namespace), as on separate machines.

Creating namespaces needs CAP_NET_ADMIN. CI (.ci/run, run as root) has it; where the test
process lacks it, these tests skip and say so. Namespaces, links and every process in them
are removed by the ``make_net`` fixtures' finalizers, whatever the outcome.

What the IMPALA scenario observes: the learner runs as ``learner.cli.launch_impala.main`` with
one addition, a hook (``INGEST_HOOK``) that writes one JSON line per unroll the trainer
ingests: actor id, the policy version it was collected with, the learner's version then, the
run id it carries, and a SHA-1 of its arrays. ZeroMQ unrolls carry no sequence number, so
"no unroll trained twice" is checked on content: every ingested unroll's SHA-1 is distinct.
That needs distinct actors to act differently: actor seeds are ``--seed + 1000 * actor id``
(before that fix, two hosts at the default seed sent identical unrolls; docs/SCALE_OUT.md,
section 2); the hosts here also get their own ``--seed``.
"""

from __future__ import annotations

import ast
import csv
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from procs import BIN, wait_for

ROOT = Path(__file__).resolve().parents[1]
PORT = 5555  # the learner has its namespace to itself: no other process can hold this port there


def _netns_capable() -> tuple[bool, str]:
    if shutil.which("ip") is None:
        return False, "no `ip` command (iproute2) to create network namespaces"
    name = f"impala-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return (
            False,
            f"cannot create a network namespace (needs CAP_NET_ADMIN, e.g. root): {made.stderr.strip()}",
        )
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return True, ""


CAPABLE, WHY_NOT = _netns_capable()
# serial: the hosts' actors must advance at a rate (versions, unrolls per actor) a neighbour would slow
pytestmark = [pytest.mark.skipif(not CAPABLE, reason=WHY_NOT), pytest.mark.serial]


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


def netns_pids(ns: str) -> list[int]:
    out = ip("netns", "pids", ns, check=False)
    return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []


def kill_netns(ns: str) -> None:
    """SIGKILL every process in ``ns`` (``ip netns pids NS | xargs kill -9``) and wait until they are gone."""
    for _ in range(50):
        pids = netns_pids(ns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


_NETS = itertools.count()


class Net:
    """A learner namespace and N actor-host namespaces, host i joined to the learner by a veth pair.

    Host 0's link is the learner's subnet: learner 10.77.0.1/24, host 10.77.0.2/24. Host i > 0
    has its own subnet (learner 10.77.i.1, host 10.77.i.2) and routes 10.77.0.0/24 over it, so
    every host reaches the learner's one bound address, 10.77.0.1, over its own link.
    """

    LEARNER_IP = "10.77.0.1"

    def __init__(self, hosts: int) -> None:
        tag = f"{os.getpid() % 100000}{next(_NETS)}"
        self.learner = f"impala-{tag}-L"
        self.hosts = [f"impala-{tag}-H{i}" for i in range(hosts)]
        self.host_links = [f"vh{tag}x{i}" for i in range(hosts)]  # <= 15 characters (IFNAMSIZ)
        self.learner_links = [f"vl{tag}x{i}" for i in range(hosts)]
        self.procs: list[subprocess.Popen] = []
        self.made: list[str] = []
        try:
            for ns in (self.learner, *self.hosts):
                ip("netns", "add", ns)
                self.made.append(ns)
                ip("-n", ns, "link", "set", "lo", "up")
            for i, (ns, link, learner_link) in enumerate(
                zip(self.hosts, self.host_links, self.learner_links)
            ):
                ip(
                    "link",
                    "add",
                    learner_link,
                    "netns",
                    self.learner,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    link,
                    "netns",
                    ns,
                )
                ip("-n", self.learner, "addr", "add", f"10.77.{i}.1/24", "dev", learner_link)
                ip("-n", ns, "addr", "add", f"10.77.{i}.2/24", "dev", link)
                ip("-n", self.learner, "link", "set", learner_link, "up")
                ip("-n", ns, "link", "set", link, "up")
                if i:
                    ip("-n", ns, "route", "add", "10.77.0.0/24", "via", f"10.77.{i}.1")
        except Exception:
            self.close()
            raise

    def start(self, ns: str, argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        """Run ``argv`` (a console script of this venv, or python) inside ``ns``; output to ``log``."""
        exe = argv[0] if os.path.isabs(argv[0]) else str(BIN / argv[0])
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        with open(log, "w") as out:
            p = subprocess.Popen(
                ["ip", "netns", "exec", ns, exe, *argv[1:]],
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
                env=full_env,
                cwd=ROOT,
            )
        self.procs.append(p)
        return p

    def link(self, host: int, up: bool) -> None:
        """Set the learner's end of host ``host``'s link down or up (the host's end loses its carrier).

        The learner's end, not the host's: an interface set down loses its routes, and Linux puts
        back only the connected ones when it comes up, so host i > 0 would lose its route to the
        learner for good (its actors then exit after --learner-timeout; docs/SCALE_OUT.md)."""
        ip("-n", self.learner, "link", "set", self.learner_links[host], "up" if up else "down")

    def close(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for ns in self.made:
            kill_netns(ns)
            ip("netns", "del", ns, check=False)  # its veth ends go with it
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.made = []


def _nets():
    nets: list[Net] = []

    def make(hosts: int) -> Net:
        nets.append(Net(hosts))
        return nets[-1]

    yield make
    for net in nets:
        net.close()


@pytest.fixture
def make_net():
    yield from _nets()


@pytest.fixture(scope="module")
def make_net_module():
    yield from _nets()


def connections(ns: str) -> set[tuple[str, str]] | None:
    """Established TCP connections in ``ns`` as (local, peer) address:port pairs; None without ``ss``."""
    if shutil.which("ss") is None:
        return None
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "ss", "-Htn", "state", "established"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return {tuple(line.split()[-2:]) for line in out.stdout.splitlines() if line.strip()}


def authorize_hosts(learner_keys: Path, host_keys: list[Path]) -> None:
    """The CURVE dance of README/Security: each host makes its own client keypair; its public key
    goes into the learner's authorized/ and the learner's server.key goes to the host. The hosts
    make their keypairs (all at once) while the learner starts up and makes its own."""
    makers = [
        subprocess.Popen(
            [str(BIN / "impala-actors"), "--curve", str(keys), "--make-keys"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for keys in host_keys
    ]
    for maker in makers:
        _, err = maker.communicate(timeout=60)
        assert maker.returncode == 0, err
    assert wait_for(
        lambda: (learner_keys / "server.key").exists() and (learner_keys / "authorized").is_dir(), 120
    ), "the learner made no keys"
    for i, keys in enumerate(host_keys):
        shutil.copy(keys / "client.key", learner_keys / "authorized" / f"host{i}.key")
        shutil.copy(learner_keys / "server.key", keys / "server.key")


def done_line(log: Path, prog: str) -> str:
    lines = [l for l in log.read_text().splitlines() if l.startswith(f"{prog}: done:")]
    assert lines, log.read_text()[-3000:]
    return lines[-1]


def dropped_of(line: str) -> dict[str, int]:
    """The ``dropped {...}`` part of a launcher's done line (``0`` when nothing was dropped)."""
    text = re.search(r"dropped (\{[^}]*\}|0)", line).group(1)
    return {} if text == "0" else {k: v for k, v in ast.literal_eval(text).items() if v}


def metrics_rows(logdir: Path) -> list[dict[str, float]]:
    with open(logdir / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f)]


# The learner with one observation point: a line per ingested unroll (see the module docstring).
INGEST_HOOK = r"""
import hashlib, json, os, sys, time
import numpy as np
from learner.cli import launch_impala, launch_ppo
from learner import ppo_learner, vtrace_learner

out = open(os.environ["INGEST_LOG"], "a", buffering=1)
for cls in (vtrace_learner.ImpalaTrainer, ppo_learner.PPOTrainer):
    def hooked(self, msg, version, _orig=cls.ingest):
        h = hashlib.sha1()
        for name in sorted(msg.arrays):
            h.update(name.encode())
            h.update(np.ascontiguousarray(msg.arrays[name]).tobytes())
        out.write(json.dumps({"t": time.time(), "actor": msg.actor, "version": msg.version, "learner_version":
        version,
                              "env": msg.info.get("env"), "run_id": msg.info.get("run_id"), "sha1":
                              h.hexdigest()}) + "\n")
        return _orig(self, msg, version)
    cls.ingest = hooked
sys.exit({"impala": launch_impala, "ppo": launch_ppo}[sys.argv[1]].main(sys.argv[2:]))
"""


def ingested(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


# --------------------------------------------------------------------------- IMPALA: one run, three cases

IMPALA_LEARNER = [
    *"--env CartPole-v1 --workers 0 --unroll-length 20 --batch-size 8".split(),
    "--minibatches",  # 2 unrolls a minibatch: the phases' timing was set with these updates
    "4",
    *"--torch-threads 1 --total-frames 100000000 --no-progress --log-interval 1".split(),
]


def learner_address(keys: Path, logdir: Path) -> list[str]:
    """A learner's flags for serving the other namespaces: its address, port and CURVE keys, and its run
    folder."""
    return ["--bind", Net.LEARNER_IP, "--port", str(PORT), "--curve", str(keys), "--logdir", str(logdir)]


IMPALA_SECONDS = (
    60  # the phases end ~28 s after the learner starts at load 3 on 2 cores, 42-50 s at load 5-7 (printed)
)
PARTITION_S = 15.0


@pytest.fixture(scope="module")
def impala_run(make_net_module, tmp_path_factory):
    """One learner (namespace L, bound to 10.77.0.1, --workers 0) and two actor hosts (one actor each),
    all over CURVE. Timeline: both hosts train; both host links go down for 15 s and come back;
    then host 1 is killed outright (SIGKILL to every process in its namespace); once host 0 has sent
    25 more unrolls the learner is stopped (SIGTERM; --max-seconds bounds it). Returns what each phase
    saw."""
    tmp = tmp_path_factory.mktemp("impala-netns")
    net = make_net_module(2)
    learner_keys, logdir, hook_log = tmp / "learner-keys", tmp / "run", tmp / "ingested.jsonl"
    t = {"start": time.time()}
    learner = net.start(
        net.learner,
        [
            sys.executable,
            "-c",
            INGEST_HOOK,
            "impala",
            *IMPALA_LEARNER,
            *learner_address(learner_keys, logdir),
            "--max-seconds",
            str(IMPALA_SECONDS),
        ],
        tmp / "learner.log",
        env={"INGEST_LOG": str(hook_log)},
    )
    host_keys = [tmp / f"host{i}-keys" for i in range(2)]
    authorize_hosts(learner_keys, host_keys)
    actors = [
        net.start(
            host,
            [
                "impala-actors",
                "--learner",
                f"tcp://{Net.LEARNER_IP}:{PORT}",
                "--curve",
                str(keys),
                "--workers",
                "1",
                "--first-id",
                str(1000 * (i + 1)),
                "--seed",
                str(1000 * 1000 * (i + 1)),
            ],
            tmp / f"host{i}.log",
        )
        for i, (host, keys) in enumerate(zip(net.hosts, host_keys))
    ]

    def seen(actor, after=0.0, min_count=1):
        return sum(1 for r in ingested(hook_log) if r["actor"] == actor and r["t"] > after) >= min_count

    # Phase 1: both hosts train (and have trained on weights they received: version >= 1).
    assert wait_for(
        lambda: all(
            any(r["actor"] == a and r["version"] >= 1 for r in ingested(hook_log)) for a in (1000, 2000)
        ),
        120,
    ), (tmp / "learner.log").read_text()[-3000:] + (tmp / "host0.log").read_text()[-2000:]
    time.sleep(1)
    conns_before = [connections(h) for h in net.hosts]
    # Phase 2: partition both hosts from the learner for 15 s.
    t["down"] = time.time()
    for i in range(2):
        net.link(i, up=False)
    time.sleep(PARTITION_S)
    learner_alive_during_partition = learner.poll() is None
    actors_alive_during_partition = [a.poll() is None for a in actors]
    t["up"] = time.time()
    for i in range(2):
        net.link(i, up=True)
    assert wait_for(lambda: seen(1000, t["up"], 8) and seen(2000, t["up"], 8), 90), (
        "no unrolls after the link came back"
    )
    t["resumed"] = {
        a: min(r["t"] for r in ingested(hook_log) if r["actor"] == a and r["t"] > t["up"])
        for a in (1000, 2000)
    }
    conns_after = [connections(h) for h in net.hosts]
    time.sleep(1)
    # Phase 3: host 1 dies outright.
    t["kill"] = time.time()
    kill_netns(net.hosts[1])
    assert wait_for(lambda: seen(1000, t["kill"] + 1.0, 25), 60), (
        "host 0's actors stopped after host 1 was killed"
    )
    t["phases_done"] = time.time()
    print(
        f"netns IMPALA: phases done {t['phases_done'] - t['start']:.1f} s after the learner started "
        f"(--max-seconds {IMPALA_SECONDS}); stopping it"
    )
    # Stopped as a user stops a run (it would train on to --max-seconds): a clean stop, exit 0.
    learner.send_signal(signal.SIGTERM)
    learner_rc = learner.wait(timeout=60)
    return {
        "tmp": tmp,
        "net": net,
        "t": t,
        "rows": ingested(hook_log),
        "learner_rc": learner_rc,
        "logdir": logdir,
        "learner_log": (tmp / "learner.log").read_text(),
        "host_logs": [(tmp / f"host{i}.log").read_text() for i in range(2)],
        "learner_alive_during_partition": learner_alive_during_partition,
        "actors_alive_during_partition": actors_alive_during_partition,
        "actors_alive_after": [a.poll() is None for a in actors],
        "conns_before": conns_before,
        "conns_after": conns_after,
    }


def test_impala_trains_with_actors_on_other_hosts_over_curve(impala_run):
    """Training advances with remote actors only (--workers 0), both hosts' actors joined through the
    CURVE handshake, trained on the weights they received, nothing was dropped, exit 0."""
    r = impala_run
    log = r["learner_log"]
    assert r["learner_rc"] == 0, log[-3000:]
    assert "actor 1000 joined" in log and "actor 2000 joined" in log, log[-3000:]
    line = done_line(r["tmp"] / "learner.log", "launch_impala")
    frames = int(re.search(r"done: (\d+) env frames", line).group(1))
    updates = int(re.search(r"(\d+) updates", line).group(1))
    # 50 updates of 8 unrolls of 20 steps; how far past that the run gets depends on the box's load
    assert frames > 8_000 and updates > 50, line
    assert dropped_of(line) == {}, line
    rows = r["rows"]
    assert len(rows) * 20 == frames, "every counted unroll went through the trainer's ingest"
    by_actor = Counter(x["actor"] for x in rows)
    assert set(by_actor) == {1000, 2000} and min(by_actor.values()) > 50, by_actor
    for a in (1000, 2000):  # the remote actors kept receiving new weights: their unrolls' versions rise
        versions = [x["version"] for x in rows if x["actor"] == a]
        assert max(versions) > 20, (a, max(versions))
    assert all(x["version"] <= x["learner_version"] for x in rows)
    metrics = metrics_rows(r["logdir"])
    assert metrics[-1]["charts/env_frames"] > metrics[0]["charts/env_frames"]
    assert all(row["transport/dropped"] == 0 for row in metrics), [
        row["transport/dropped"] for row in metrics
    ]
    for i in range(2):
        assert "running 1 actors for CartPole-v1" in r["host_logs"][i], r["host_logs"][i][-2000:]


def test_partition_of_15s_then_training_resumes_in_the_same_run(impala_run):
    """Both host links down for 15 s: nothing arrives meanwhile, the learner and the actors stay up
    (the actors' --learner-timeout is 60 s), the same TCP connections carry on once the links are back,
    and the learner continues the same run: its version counter keeps rising, every ingested unroll
    carries this run's id, none is ingested twice (distinct SHA-1), none is dropped."""
    r = impala_run
    t, rows = r["t"], r["rows"]
    assert r["learner_alive_during_partition"] and all(r["actors_alive_during_partition"])
    during = [x for x in rows if t["down"] + 2.0 < x["t"] < t["up"]]  # 2 s for what was already queued
    assert during == [], during[:5]
    before = [x for x in rows if x["t"] <= t["down"]]
    after = [x for x in rows if x["t"] >= t["up"]]
    assert after and min(x["learner_version"] for x in after) >= max(x["learner_version"] for x in before), (
        "the learner restarted"
    )
    assert max(x["learner_version"] for x in after) > max(x["learner_version"] for x in before) + 20, (
        "updates did not resume"
    )
    resumed = {a: s - t["up"] for a, s in t["resumed"].items()}
    print(
        f"training resumed {resumed} s after the links came back (down {t['up'] - t['down']:.1f} s); "
        f"host connections before/after: {r['conns_before']} / {r['conns_after']}"
    )
    assert max(resumed.values()) < 40, resumed
    assert len({x["run_id"] for x in rows}) == 1, "an unroll of another run was ingested"
    assert len({x["sha1"] for x in rows}) == len(rows), "an unroll was ingested twice"
    line = done_line(r["tmp"] / "learner.log", "launch_impala")
    assert "other_run" not in dropped_of(line) and "actor restarts 0" in line, line
    for before, after in zip(r["conns_before"], r["conns_after"]):
        if before is not None:  # no reconnection was needed: the TCP connections outlived the outage
            assert before and {c for c in before if c[1].startswith(Net.LEARNER_IP)} <= after, (before, after)
    for host_log in r["host_logs"]:  # the actors never gave up on the learner, nor were restarted
        assert "no weights from" not in host_log and "restarting" not in host_log, host_log[-2000:]


def test_killed_actor_host_leaves_the_learner_running(impala_run):
    """Host 1 killed outright (SIGKILL to every process in its namespace): host 0 goes on feeding the
    learner, which trains on until it is stopped and exits 0."""
    r = impala_run
    t, rows = r["t"], r["rows"]
    assert r["learner_rc"] == 0, r["learner_log"][-3000:]
    assert not [x for x in rows if x["actor"] == 2000 and x["t"] > t["kill"] + 1.0]
    later = [x for x in rows if x["actor"] == 1000 and x["t"] > t["kill"] + 1.0]
    assert len(later) > 20 and later[-1]["learner_version"] > later[0]["learner_version"], len(later)
    assert r["actors_alive_after"][0] and not r["actors_alive_after"][1]
    metrics = metrics_rows(r["logdir"])
    # its metrics go on past the kill: the last row counts more frames than were trained on before it
    frames_at_kill = 20 * sum(1 for x in rows if x["t"] <= t["kill"])
    assert metrics[-1]["charts/env_frames"] > frames_at_kill, (
        metrics[-1]["charts/env_frames"],
        frames_at_kill,
    )


# --------------------------------------------------------------------------- PPO


PPO_STEPS = (
    5 * 256
)  # five updates of --buffer-size 256, all from the remote host (--max-seconds is only a safety net)


def test_ppo_trains_with_actors_on_another_host_over_curve(make_net, tmp_path):
    """launch_ppo (SB3 semantics, on-policy) with --workers 0 and impala-actors in another namespace:
    the actors learn from the weights message that they run a PPO agent, several on-policy updates
    happen (each needs the previous update's weights at the actors, else its unrolls would be stale),
    nothing but stale unrolls is dropped, exit 0; the actors notice the learner is gone and stop."""
    net = make_net(1)
    learner_keys, actor_keys = tmp_path / "learner-keys", tmp_path / "actor-keys"
    learner = net.start(
        net.learner,
        [
            *(
                "launch_ppo --env Pendulum-v1 --semantics sb3 --workers 0 --envs-per-worker 2 "
                "--unroll-length 64 --buffer-size 256 --batch-size 64 --num-epoch 2"
            ).split(),
            *learner_address(learner_keys, tmp_path / "run"),
            "--total-steps",
            str(PPO_STEPS),
            *"--max-seconds 120 --no-progress --torch-threads 1".split(),
        ],
        tmp_path / "learner.log",
    )
    authorize_hosts(learner_keys, [actor_keys])
    actors = net.start(
        net.hosts[0],
        [
            "impala-actors",
            "--learner",
            f"tcp://{Net.LEARNER_IP}:{PORT}",
            "--curve",
            str(actor_keys),
            *"--workers 1 --learner-timeout 8".split(),
        ],
        tmp_path / "host.log",
    )
    assert learner.wait(timeout=150) == 0, (tmp_path / "learner.log").read_text()[-3000:]
    actors.wait(timeout=60)
    log, host_log = (tmp_path / "learner.log").read_text(), (tmp_path / "host.log").read_text()
    assert "actor 1000 joined (2 envs;" in log, log[-3000:]
    line = done_line(tmp_path / "learner.log", "launch_ppo")
    steps = int(re.search(r"done: (\d+) agent steps", line).group(1))
    updates = int(re.search(r"(\d+) updates", line).group(1))
    assert updates >= 3 and steps >= 256 * updates, line
    assert set(dropped_of(line)) <= {"stale"}, line
    assert "running 1 actors for Pendulum-v1" in host_log and "the learner is gone" in host_log, host_log[
        -2000:
    ]
    assert actors.returncode == 0
