"""Peers that follow the wire format but lie: about their episodes, their share of the learner, their
identity, or with values a float32 update cannot survive. Real sockets, loopback only, bounded in time."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import numpy as np
import pytest
import zmq

from impala.envs.vector import EpisodeTracker
from impala.transport import wire
from impala.transport.trajectory import impala_unroll_schema
from learner.serve.server import TrajectoryServer

T = 8
SCHEMA = impala_unroll_schema(T, (3,), "float32", 2)


def _wait(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not pred():
        time.sleep(0.02)
    return pred()


def _frames(kind, actor, arrays=None, info=None, version=0):
    return [bytes(f) for f in wire.encode(kind, actor=actor, version=version, arrays=arrays, info=info)]


@pytest.fixture
def link():
    """A started server that accepts every hello, and a PUSH socket connected to it."""
    srv = TrajectoryServer(SCHEMA, queue_size=4096)
    srv.start()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(srv.trajectory_endpoint)
    yield srv, push
    push.close()
    srv.close()


def _drain(srv, n):
    got = [srv.get(timeout=10) for _ in range(n)]
    assert all(m is not None for m in got), f"only {sum(m is not None for m in got)} of {n} unrolls arrived"
    return got


# ------------------------------------------------------------------ statistics come from data


def test_episode_statistics_go_through_a_checkpoint_and_a_bad_record_is_left_out(caplog):
    """What a checkpoint keeps of the last 100 episodes comes back whole in the resumed run's server; a
    record that is not plain finite numbers (an older version's, an edited file) leaves the window empty
    with one warning, never a crash or a NaN mean return."""
    record = {
        "returns": [float(r) for r in range(150)][-100:],
        "lengths": list(range(100)),
        "total": 150,
        "task_returns": [],
        "task_episodes": [],
    }
    first, second = TrajectoryServer(SCHEMA, queue_size=8), TrajectoryServer(SCHEMA, queue_size=8)
    try:
        assert first.full_window_mean_return() is None and first.episode_record()["total"] == 0
        first.restore_episodes(record)
        assert first.episode_record() == record
        assert first.full_window_mean_return() == pytest.approx(np.mean(range(50, 150)))
        stats = first.stats()
        assert (stats["charts/episodes"], stats["charts/mean_length_100"]) == (150, pytest.approx(49.5))
        for bad in (
            {**record, "returns": [float("nan")] * 100},
            {**record, "returns": "100 episodes"},
            {**record, "task_returns": [[1.0]]},  # another task list
            {"returns": [1.0]},
        ):
            second.restore_episodes(bad)
            assert second.full_window_mean_return() is None and second.episode_record()["total"] == 0
        assert caplog.text.count("episode statistics are left out") == 4
    finally:
        first.close()
        second.close()


def test_claimed_episode_returns_in_info_steer_nothing(link):
    """A new id's one valid unroll claiming 100 episodes of return 500 once filled the whole window
    (and could end a run through --stop-at-return); now only its rewards and episode ends count."""
    srv, push = link
    push.send_multipart(_frames("hello", 4242, info={"num_envs": 1}))
    assert _wait(lambda: 4242 in srv.accepted)
    u = SCHEMA.allocate()
    u["behaviour_logits"][:] = 0.5
    claims = wire.episode_info([500.0] * 100, [10] * 100)
    push.send_multipart(_frames("unroll", 4242, u, {"env": 0, **claims}))
    _drain(srv, 1)
    assert srv.full_window_mean_return() is None
    assert "charts/mean_return_100" not in srv.stats() and srv.stats()["charts/episodes"] == 0.0
    # The same peer's data with one real episode end counts exactly that episode, claims or not.
    u["first"][0], u["rewards"][:], u["dones"][T - 1] = True, 1.0, True
    push.send_multipart(_frames("unroll", 4242, u, {"env": 0, **claims}))
    _drain(srv, 1)
    assert srv.stats()["charts/episodes"] == 1.0 and srv.stats()["charts/mean_return_100"] == float(T)


def test_returns_summed_from_unrolls_match_the_actors_own_count(link):
    """Three env streams, random rewards and episode ends cut into unrolls: the server's episodes are
    exactly what the actor's EpisodeTracker counted step by step (the statistics' old source)."""
    srv, push = link
    rng = np.random.default_rng(0)
    K, unrolls = 3, 25
    push.send_multipart(_frames("hello", 7, info={"num_envs": K}))
    assert _wait(lambda: 7 in srv.accepted)
    tracker = EpisodeTracker(K)
    first = np.ones(K, bool)
    for _ in range(unrolls):
        rewards = rng.choice([-1.0, 0.0, 0.5, 21.0], size=(T, K)).astype(np.float32)
        dones = rng.random((T, K)) < 0.12
        for k in range(K):
            u = SCHEMA.allocate()
            u["rewards"], u["dones"] = rewards[:, k], dones[:, k]
            u["first"][0] = first[k]
            u["first"][1:] = dones[:, k]
            u["behaviour_logits"][:] = 0.5
            push.send_multipart(_frames("unroll", 7, u, {"env": k}))
        for t in range(T):
            tracker.record(rewards[t], dones[t])
        first = dones[-1]
    _drain(srv, unrolls * K)
    expected, lengths = tracker.pop()
    assert 50 <= len(expected) <= 100  # all of them fit the 100-episode window
    # the server counts stream by stream, the tracker step by step: the same episodes, in another order
    episodes = srv.episodes
    assert episodes.episodes_total == len(expected)
    assert sorted(zip(episodes.episode_returns, episodes.episode_lengths)) == sorted(zip(expected, lengths))


def test_partly_seen_episodes_are_not_counted(link):
    """An episode whose start the server did not see (a hello said mid-run) or that lost an unroll
    (dropped on receipt) is not counted: its sum would be a partial return."""
    srv, push = link
    push.send_multipart(_frames("hello", 8, info={"num_envs": 2, "resumed": True}))
    assert _wait(lambda: 8 in srv.accepted)

    def unroll(first, end, reward=1.0):
        u = SCHEMA.allocate()
        u["behaviour_logits"][:] = 0.5
        u["first"][0], u["rewards"][:], u["dones"][T - 1] = first, reward, end
        return u

    # env 0: mid-episode (resumed) -> its first end is not counted, the next whole episode is
    for u in (unroll(False, True), unroll(True, True)):
        push.send_multipart(_frames("unroll", 8, u, {"env": 0}))
    # env 1: an unroll lost to a NaN (dropped) inside the second episode
    push.send_multipart(_frames("unroll", 8, unroll(False, True), {"env": 1}))
    push.send_multipart(_frames("unroll", 8, unroll(False, False), {"env": 1}))
    push.send_multipart(_frames("unroll", 8, unroll(False, False, np.nan), {"env": 1}))
    push.send_multipart(_frames("unroll", 8, unroll(False, True), {"env": 1}))
    push.send_multipart(_frames("unroll", 8, unroll(False, True, 2.0), {"env": 1}))
    # an env index the actor does not have is dropped
    push.send_multipart(_frames("unroll", 8, unroll(True, True), {"env": 2}))
    _drain(srv, 6)
    assert _wait(lambda: srv.dropped["schema"] == 1 and srv.dropped["non_finite"] == 1)
    episodes = srv.episodes
    assert list(episodes.episode_returns) == [float(T), 2.0 * T] and list(episodes.episode_lengths) == [T, T]


def test_an_honest_actor_reports_the_same_returns_as_before():
    """A real actor loop (CartPole, 4 envs, in a thread): the episodes the server sums from the data
    are the ones the actor counted itself and still sends along (what the learner reported before)."""
    from actor_threads import cartpole_actor
    from impala.nets.impala_net import build_model
    from impala.transport.params import state_dict_arrays

    schema = impala_unroll_schema(16, (4,), "float32", 2)
    srv = TrajectoryServer(schema, queue_size=64)
    srv.start()
    actor = cartpole_actor(srv, num_envs=4, unroll_length=16, max_unrolls=30)
    claimed: list[tuple[float, int]] = []
    try:
        actor.start()
        assert _wait(lambda: 3 in srv.accepted, 60)
        srv.publish(0, state_dict_arrays(build_model("mlp", (4,), 2)))
        for msg in _drain(srv, 30 * 4):
            returns, lengths = wire.parse_episode_info(msg.info)
            claimed += zip(returns, lengths)
    finally:
        actor.join(timeout=30)
        srv.close()
    assert 10 <= len(claimed) <= 100, len(claimed)
    assert sorted(zip(srv.episodes.episode_returns, srv.episodes.episode_lengths)) == sorted(claimed)


# ------------------------------------------------------------------ fair share per actor id


def test_one_id_gets_at_most_its_share_of_the_queue():
    """Queue of 8, two active ids: each may hold ceil(8 / 2) + 2 = 6 queued unrolls; one id's excess
    is dropped as over_share (whatever the number of connections) while the other id still gets in.
    An id alone (the other one silent) may fill the queue, and then waits for room."""
    srv = TrajectoryServer(SCHEMA, queue_size=8)
    srv.start()
    socks = [zmq.Context.instance().socket(zmq.PUSH) for _ in range(4)]
    try:
        for s in socks:
            s.setsockopt(zmq.LINGER, 0)
            s.connect(srv.trajectory_endpoint)
        u = SCHEMA.allocate()
        for actor in (1, 2):
            socks[0].send_multipart(_frames("hello", actor))
        assert _wait(lambda: {1, 2} <= set(srv.accepted))
        srv.admission.last_seen[2] = time.monotonic() + 60  # actor 2 stays active while actor 1 floods
        for i in range(20):
            socks[i % 4].send_multipart(_frames("unroll", 1, u))
        assert _wait(lambda: srv.dropped["over_share"] == 14), dict(srv.dropped)
        socks[0].send_multipart(_frames("unroll", 2, u))
        socks[0].send_multipart(_frames("unroll", 2, u))
        got = [m.actor for m in _drain(srv, 8)]
        assert sorted(got) == [1] * 6 + [2] * 2 and srv.queue.qsize() == 0, got
        assert srv.stats()["transport/dropped_over_share"] == 14.0
        # an id alone is never over its share (ceil(8 / 1) + 2): it fills the queue and waits for room
        srv.admission.last_seen[2] = time.monotonic() - 60
        time.sleep(0.1)  # (the active count is refreshed every 50 ms)
        for i in range(12):
            socks[i % 4].send_multipart(_frames("unroll", 1, u))
        assert _wait(lambda: srv.queue.qsize() == 8)
        assert len(_drain(srv, 12)) == 12 and srv.dropped["over_share"] == 14
    finally:
        for s in socks:
            s.close()
        srv.close()


def test_an_id_on_one_connection_waits_for_its_share_and_loses_nothing():
    """The same queue and shares as above, but actor 1 sends its 20 unrolls over one connection, as
    every actor process does: over its share it waits (its connection is not read meanwhile) instead of
    being dropped, actor 2's unrolls still get in, and as the learner takes unrolls all 20 arrive."""
    srv = TrajectoryServer(SCHEMA, queue_size=8)
    srv.start()
    one, other = (zmq.Context.instance().socket(zmq.PUSH) for _ in range(2))
    try:
        for s in (one, other):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(srv.trajectory_endpoint)
        u = SCHEMA.allocate()
        one.send_multipart(_frames("hello", 1))
        other.send_multipart(_frames("hello", 2))
        assert _wait(lambda: {1, 2} <= set(srv.accepted))
        srv.admission.last_seen[2] = time.monotonic() + 60  # actor 2 stays active
        for _ in range(20):
            one.send_multipart(_frames("unroll", 1, u))
        assert _wait(lambda: srv.queue.queued(1) == 6)  # its share, ceil(8 / 2) + 2, then it waits
        time.sleep(0.3)
        assert srv.queue.queued(1) == 6 and srv.dropped["over_share"] == 0
        other.send_multipart(_frames("unroll", 2, u))
        other.send_multipart(_frames("unroll", 2, u))
        got = [m.actor for m in _drain(srv, 22)]
        assert sorted(got) == [1] * 20 + [2] * 2 and srv.dropped["over_share"] == 0, (got, dict(srv.dropped))
    finally:
        one.close()
        other.close()
        srv.close()


def test_the_queue_hands_unrolls_out_round_robin_across_ids():
    from learner.serve.server import FairQueue

    q = FairQueue(8)
    for actor in (1, 1, 1, 2, 3, 1):
        q.put(wire.Message("unroll", actor, 0), timeout=0)
    assert q.queued(1) == 4 and q.qsize() == 6
    with pytest.raises(__import__("queue").Full):
        for _ in range(3):
            q.put(wire.Message("unroll", 4, 0), timeout=0.01)
    got = [q.get(timeout=0).actor for _ in range(8)]
    assert got == [1, 2, 3, 4, 1, 4, 1, 1], got  # each id with unrolls waiting in turn
    with pytest.raises(__import__("queue").Empty):
        q.get(timeout=0.01)


def test_a_full_queue_goes_over_its_size_only_for_an_id_held_under_its_equal_part():
    """The room over the queue's size is for an id under its equal part while another holds more than it.
    Two honest actors at 4 and 4 in a queue of 8, one of them seen as alone (the active count dips while
    an actor is blocked, so its equal part reads 8): it still waits for room. In a Pong run without this
    condition both actors went over the queue's size and then over their shares: 781 honest unrolls
    dropped in a minute."""
    from learner.serve.server import FairQueue

    q = FairQueue(8)
    for actor in (1, 2, 1, 2, 1, 2, 1, 2):
        q.put(wire.Message("unroll", actor, 0), timeout=0)
    with pytest.raises(__import__("queue").Full):
        q.put(wire.Message("unroll", 1, 0), timeout=0.01, guaranteed=8)
    with pytest.raises(__import__("queue").Full):  # at its equal part: waits too
        q.put(wire.Message("unroll", 1, 0), timeout=0.01, guaranteed=4)
    q.get(timeout=0)  # actor 1 at 3, actor 2 at 4: the queue has room
    q.put(wire.Message("unroll", 2, 0), timeout=0)  # actor 2 at 5, over its equal part of 4
    q.put(wire.Message("unroll", 1, 0), timeout=0, guaranteed=4)  # actor 1 at 3 < 4: over the size
    assert (q.qsize(), q.queued(1), q.queued(2)) == (9, 4, 5)
    with pytest.raises(__import__("queue").Full):  # actor 1 now at its equal part
        q.put(wire.Message("unroll", 1, 0), timeout=0.01, guaranteed=4)


def test_a_full_queue_still_takes_an_id_under_its_equal_part():
    """Queue of 8, two active ids: actor 1 holds its share (6 = 4 + the burst of 2) and actor 2's first two
    unrolls fill the queue. Actor 2's next two still go in (it is under its equal part, 4), over the queue's
    size; its fifth, at its equal part, waits for room, as does actor 1's next while the queue is over.
    Nothing is dropped; the learner gets actor 2's unrolls in order, round-robin with actor 1's."""
    srv = TrajectoryServer(SCHEMA, queue_size=8)
    srv.start()
    push = zmq.Context.instance().socket(zmq.PUSH)
    try:
        push.setsockopt(zmq.LINGER, 0)
        push.connect(srv.trajectory_endpoint)
        for actor in (1, 2):
            push.send_multipart(_frames("hello", actor))
        assert _wait(lambda: {1, 2} <= set(srv.accepted))
        # Two active ids throughout (an id counts as active for 0.25 s after its last accepted unroll; the
        # waits below are longer): the equal part of a queue of 8, as the server computes it for two.
        srv._equal_part = lambda: 4

        def unroll(actor, i):
            u = SCHEMA.allocate()
            u["rewards"][0] = i  # its place in the actor's sequence
            return _frames("unroll", actor, u)

        for i in range(6):
            push.send_multipart(unroll(1, i))
        assert _wait(lambda: srv.queue.queued(1) == 6)
        for i in range(5):
            push.send_multipart(unroll(2, 100 + i))
        assert _wait(lambda: srv.queue.queued(2) == 4), (srv.queue.queued(1), srv.queue.queued(2))
        time.sleep(0.3)  # the fifth is held (queue full, actor 2 at its equal part): nothing else moves
        assert (srv.queue.qsize(), srv.queue.queued(2), sum(srv.dropped.values())) == (10, 4, 0)
        got = [(m.actor, int(m.arrays["rewards"][0])) for m in _drain(srv, 11)]
        assert [i for a, i in got if a == 1] == list(range(6)), got
        assert [i for a, i in got if a == 2] == [100, 101, 102, 103, 104], got
        assert [a for a, _ in got[:8]] == [1, 2] * 4, got
    finally:
        push.close()
        srv.close()


def _accepted(out: str, actor: int) -> tuple[int, float]:
    """``actor``'s accepted unrolls and the seconds from its first to its last, from the learner's
    closing per-actor report."""
    import re

    m = re.search(rf"actor {actor}: (\d+) unrolls in ([\d.]+)s", out)
    assert m, out[-3000:]
    return int(m.group(1)), float(m.group(2))


def _flood(port: int, stop, rate: float, sent, cpu_s) -> None:
    """One accepted id (1000, real fingerprint) over 16 PUSH connections, ``rate`` valid unrolls/s; a process
    of its own (spawned), on the learner's CPU but at the lowest priority that still sends at ``rate``.

    A remote flooder has a machine of its own; here it must share one of two cores, so it takes the
    learner's (away from the honest actor) and gives way to it. A session of its own with its autogroup
    at nice 10 (about a tenth of a busy CPU): the kernel divides a CPU between autogroups first, so a
    thread's own nice would not hold against the learner, which runs in a session of its own too, and an
    unniced flooder took up to half of the learner's CPU. Its ZeroMQ I/O thread is pinned with it."""
    os.setsid()
    os.sched_setaffinity(0, {LEARNER_CPU})
    from actors.remote import fetch_run_info
    from impala.envs import EnvSpec
    from impala.envs.probe import measure_env_fingerprint

    run_id = fetch_run_info(f"tcp://127.0.0.1:{port + 1}", 60).run_id
    fingerprint = measure_env_fingerprint(EnvSpec("CartPole-v1"), seed=7).to_dict()
    ctx = zmq.Context()
    socks = []
    for _ in range(16):
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 1000)
        s.connect(f"tcp://127.0.0.1:{port}")
        socks.append(s)
    try:
        socks[0].send_multipart(_frames("hello", 1000, info={"fingerprint": fingerprint, "num_envs": 1}))
        schema = impala_unroll_schema(20, (4,), "float32", 2)
        u = schema.allocate()
        u["behaviour_logits"][:] = 0.5
        frames = _frames("unroll", 1000, u, {"run_id": run_id, "env": 0})
        try:  # set up at the usual priority; the flood itself gives way
            with open("/proc/self/autogroup", "w") as f:
                f.write("10")
        except OSError:  # no autogroup in this kernel, or not allowed: the thread's own nice at least
            os.setpriority(os.PRIO_PROCESS, 0, 10)
        t0, i = time.monotonic(), 0
        while not stop.is_set():
            if i > rate * (time.monotonic() - t0):
                time.sleep(0.002)
                continue
            try:
                socks[i % 16].send_multipart(frames, zmq.NOBLOCK)
                sent.value += 1
            except zmq.Again:
                pass
            i += 1
    finally:
        for s in socks:
            s.close()
        ctx.term()
        cpu_s.value = sum(os.times()[:2])  # user + system seconds of all its threads


CPUS = sorted(os.sched_getaffinity(0))
LEARNER_CPU, ACTOR_CPU = CPUS[0], CPUS[-1]  # the flood test needs two (it is skipped otherwise)
RUN_S = 15  # each of the flood test's three runs (alone, flooded, alone): rates over 10+ s of steady state


def _own_cpu() -> None:
    """The honest actor: a CPU of its own, ahead of the machine's other work (root may raise a priority), so
    that what the test measures is the learner's fairness, not the box's load."""
    os.sched_setaffinity(0, {ACTOR_CPU})
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    except PermissionError:
        pass


def _honest_run(tmp_path, name: str, flood_rate: float) -> tuple[float, float, str, dict]:
    """A real learner on one CPU and one honest impala-actors process (id 2000) on another for RUN_S seconds,
    with a flooder process (low priority, on the learner's CPU) when ``flood_rate``. Returns the honest
    actor's accepted unrolls per second of wall time, and per second it was not kept waiting for a CPU."""
    from procs import descendants, free_port_pair, kill_group, start

    port = free_port_pair()
    learner = start(
        [
            *"launch_impala --env CartPole-v1 --workers 0 --unroll-length 20 --batch-size 32".split(),
            "--minibatches",  # the update this test was sized with: the learner keeps up with 2 honest actors
            "4",
            "--envs-per-worker",
            "1",
            "--port",
            str(port),
            "--total-frames",
            "100000000",
            "--max-seconds",
            str(RUN_S),
            *"--no-progress --log-interval 5 --logdir".split(),
            str(tmp_path / name),
        ],
        preexec_fn=lambda: os.sched_setaffinity(0, {LEARNER_CPU}),
    )
    honest = start(
        [
            "impala-actors",
            "--learner",
            f"tcp://127.0.0.1:{port}",
            *"--workers 1 --first-id 2000 --learner-timeout 5 --max-seconds 60".split(),
        ],
        preexec_fn=_own_cpu,
    )
    spawn = multiprocessing.get_context("spawn")
    stop, sent, flood_cpu = spawn.Event(), spawn.Value("q", 0), spawn.Value("d", 0.0)
    flooder = spawn.Process(target=_flood, args=(port, stop, flood_rate, sent, flood_cpu), daemon=True)
    cpu_wait = 0.0
    try:
        if flood_rate:
            flooder.start()
        out, _ = learner.communicate(timeout=120)
        # The actor process (the pool's child) is still alive: how long its main thread, ready to run,
        # waited for a CPU (the kernel's own count; other sessions share this machine's two cores).
        for pid in descendants(honest.pid):
            with open(f"/proc/{pid}/schedstat") as f:
                cpu_wait = max(cpu_wait, int(f.read().split()[1]) / 1e9)
    finally:
        stop.set()
        kill_group(learner)
        kill_group(honest)
        if flood_rate:
            flooder.join(timeout=10)
            if flooder.is_alive():
                flooder.kill()
    assert learner.returncode == 0, out[-3000:]
    n, span = _accepted(out, 2000)
    print(f"{name}: honest actor {n} unrolls in {span:.1f}s, {cpu_wait:.1f}s of it waiting for a CPU")
    if flood_rate:
        print(f"{name}: the flooder sent {sent.value} unrolls on {flood_cpu.value:.1f} CPU-seconds")
    return n / span, n / (span - cpu_wait), out, {"sent": sent.value}


@pytest.mark.serial  # a throughput ratio between runs pinned to the CPUs a neighbouring test would share
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs: learner, actor apart")
def test_a_flooding_id_does_not_starve_an_honest_actor(tmp_path):
    """One honest remote actor beside a real learner, RUN_S s alone (twice) and RUN_S s beside one accepted
    id sending 1,600 valid unrolls/s (the rate a probe reached) over 16 connections. Learner and actor
    run on CPUs of their own. The honest actor keeps >= 60% of its accepted frames/s alone (the slower
    of the two alone runs, counted over the time it was not waiting for a CPU); the flood's excess is
    dropped as over_share."""
    import re

    # Alone before and after the flood. The shared host's speed drifts by up to a third within a minute
    # (one CI run: 182 and 140 unrolls/s alone), so the flooded run is held against the slower of the two:
    # what this test must catch is starvation (a probe before the fair share: 5% of the rate alone).
    before, before_ready, _, _ = _honest_run(tmp_path, "before", 0)
    flooded, flooded_ready, out, counts = _honest_run(tmp_path, "flood", 1600)
    after, after_ready, _, _ = _honest_run(tmp_path, "after", 0)
    alone, alone_ready = min(before, after), min(before_ready, after_ready)
    done = [line for line in out.splitlines() if line.startswith("launch_impala: done")][-1]
    over = int(re.search(r"'over_share': (\d+)", done).group(1))
    flood_n, flood_span = _accepted(out, 1000)
    print(
        f"honest actor: {alone * 20:.0f} frames/s alone, {flooded * 20:.0f} beside the flood "
        f"({alone_ready * 20:.0f} and {flooded_ready * 20:.0f} per second not waiting for a CPU); "
        f"flood sent {counts['sent']}, {flood_n / flood_span:.0f}/s accepted, {over} dropped as over_share"
    )
    assert counts["sent"] > 10000 and over > 0, (counts, done)
    # On two shared cores the flood's own work (the learner training on the flood's share, the loopback
    # traffic) takes CPU from the honest actor; what the learner's fairness decides is whether the actor
    # is held back while it could run, so the rate counts the time it was not waiting for a CPU.
    # The bound is starvation's, not the learner's cost of reading a flood: the learner's one CPU also reads
    # and drops ~1,000 flood unrolls/s, and CI has measured the honest actor at 0.77 of its rate alone (and
    # above 0.8 on other runs); without the fair share it was 0.05.
    assert flooded_ready >= 0.6 * alone_ready, (alone_ready, flooded_ready)


# ------------------------------------------------------------------ identities


def test_with_curve_an_id_belongs_to_the_key_that_claimed_it(tmp_path):
    """Two authorized client keys: the second one's hello and unrolls for an id the first one owns are
    dropped (wrong_key) and the owner stays accepted; the weights message tells the refused hello's
    sender (by its nonce) why."""
    import os
    import shutil

    from impala.transport.curve import ClientKeys, make_client_keys, make_client_socket, prepare_server

    keys_dir = str(tmp_path / "keys")
    prepare_server(keys_dir)
    clients = []
    for name in ("alice", "mallory"):
        d = str(tmp_path / name)
        public = make_client_keys(d)
        shutil.copy(os.path.join(keys_dir, "server.key"), d)
        shutil.copy(public, os.path.join(keys_dir, "authorized", f"{name}.key"))
        clients.append(ClientKeys(os.path.join(d, "server.key"), os.path.join(d, "client.key_secret")))
    srv = TrajectoryServer(SCHEMA, queue_size=8, curve_dir=keys_dir)
    srv.start()
    ctx = zmq.Context.instance()
    socks = []
    for keys in clients:
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        make_client_socket(s, keys)
        s.connect(srv.trajectory_endpoint)
        socks.append(s)
    alice, mallory = socks
    u = SCHEMA.allocate()
    try:
        alice.send_multipart(_frames("hello", 5, info={"nonce": "a1"}))
        assert _wait(lambda: 5 in srv.accepted)
        mallory.send_multipart(_frames("hello", 5, info={"nonce": "m1"}))
        mallory.send_multipart(_frames("unroll", 5, u))
        assert _wait(lambda: srv.dropped["wrong_key"] == 2), dict(srv.dropped)
        assert 5 in srv.accepted and srv.refused_hellos == 1
        alice.send_multipart(_frames("unroll", 5, u))
        assert srv.get(timeout=10).actor == 5 and srv.queue.qsize() == 0
        # mallory's own ids are hers
        mallory.send_multipart(_frames("hello", 6, info={"nonce": "m2"}))
        assert _wait(lambda: 6 in srv.accepted)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        make_client_socket(sub, clients[1])
        sub.connect(srv.params_endpoint)
        socks.append(sub)
        msg = None
        deadline = time.monotonic() + 10
        while msg is None and time.monotonic() < deadline:
            srv.publish(0, {})
            if sub.poll(200):
                msg = wire.decode_packed(sub.recv(), expect_kind="params")
        assert msg is not None
        assert msg.info["refused_actors"] == [[5, "m1", "actor id 5 belongs to another client key"]]
    finally:
        for s in socks:
            s.close()
        srv.close()


def test_a_refusal_is_told_without_an_update_and_outlives_a_flood_of_others():
    """The weights heartbeat carries a new refusal within a second, with no update to publish (an
    evicted sole actor makes none), and a victim that keeps sending stays reported however many other
    ids are refused meanwhile (the report holds the newest 64)."""
    srv = TrajectoryServer(
        SCHEMA, queue_size=8, on_hello=lambda actor, info: "junk" if info.get("junk") else None
    )
    srv.start()
    ctx = zmq.Context.instance()
    push, sub = ctx.socket(zmq.PUSH), ctx.socket(zmq.SUB)
    for sock in (push, sub):
        sock.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.CONFLATE, 1)
    push.connect(srv.trajectory_endpoint)
    sub.connect(srv.params_endpoint)

    def reported(timeout=5.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sub.poll(200):
                rows = wire.decode_packed(sub.recv(), expect_kind="params").info["refused_actors"]
                if any(r[0] == 1000 for r in rows):
                    return rows
        return None

    try:
        push.send_multipart(_frames("hello", 1000, info={"nonce": "real"}))
        assert _wait(lambda: 1000 in srv.accepted)
        srv.publish(0, {})  # the last publish() of this test
        push.send_multipart(_frames("hello", 1000, info={"nonce": "forged", "junk": 1}))
        assert _wait(lambda: 1000 not in srv.accepted)
        assert [1000, "forged", "junk"] in reported()
        for actor in range(2000, 2100):
            push.send_multipart(_frames("hello", actor, info={"junk": 1}))
        assert _wait(lambda: srv.refused_hellos == 101)
        assert 1000 not in srv.admission.refused_recent  # pushed out by the newer refusals ...
        push.send_multipart(_frames("unroll", 1000, SCHEMA.allocate()))  # ... until the victim sends again
        assert [1000, "forged", "junk"] in reported()
    finally:
        push.close()
        sub.close()
        srv.close()


def _cartpole_learner(tmp_path, seconds: int, extra=()):
    """A real launch_impala without actors of its own (--workers 0) for ``seconds``: (port, process)."""
    from procs import free_port_pair, start

    port = free_port_pair()
    learner = start(
        [
            *"launch_impala --env CartPole-v1 --workers 0 --unroll-length 20 --batch-size 8 --port".split(),
            str(port),
            "--total-frames",
            "100000000",
            "--max-seconds",
            str(seconds),
            *"--torch-threads 1 --no-progress --log-interval 2 --logdir".split(),
            str(tmp_path / "run"),
            *extra,
        ]
    )
    return port, learner


def _frames_so_far(tmp_path) -> float:
    """The run's env frames in its latest metrics row (0 before the first)."""
    import csv

    metrics = tmp_path / "run" / "metrics.csv"
    if not metrics.exists():
        return 0.0
    with open(metrics) as f:
        rows = [r for r in csv.DictReader(f) if r.get("charts/env_frames")]
    return float(rows[-1]["charts/env_frames"]) if rows else 0.0


def test_a_forged_hello_does_not_lock_a_remote_actor_out(tmp_path):
    """Without CURVE, a forged hello {actor: 1000, fingerprint: junk} while impala-actors --first-id 1000
    trains is refused and evicts id 1000; the weights message reports the refusal with another nonce
    than the actor's, so the actor says hello again and keeps training."""
    from procs import kill_group, signal_and_wait, start, wait_for

    # 60 s only bound the run: it is stopped once the actor has trained 20k frames past the forgery. With 30,
    # one fresh-clone run on a slow host spent most of them starting impala-actors (18,240 frames by then).
    port, learner = _cartpole_learner(tmp_path, 60)
    actors = start(
        [
            "impala-actors",
            "--learner",
            f"tcp://127.0.0.1:{port}",
            *"--workers 1 --first-id 1000 --learner-timeout 5".split(),
        ]
    )
    frames = lambda: _frames_so_far(tmp_path)  # noqa: E731
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    try:
        assert wait_for(lambda: frames() > 0, 60), "the remote actor never trained"
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send_multipart(_frames("hello", 1000, info={"fingerprint": {"junk": 1}}))
        at_forgery = frames()
        # training goes on past the forgery (the only actor: locked out, the frames would stop here);
        # then the run is stopped as a user stops one (its 60 s are only a bound)
        wait_for(lambda: frames() > at_forgery + 20000, 50)
        out = signal_and_wait(learner, signal.SIGINT, timeout=90)
        actors_out, _ = actors.communicate(timeout=30)
    finally:
        push.close()
        kill_group(learner)
        kill_group(actors)
    assert learner.returncode == 0, out[-3000:]
    # a learner without local actors says where remote ones connect, before anything else happens
    assert f"learner listening: trajectories tcp://127.0.0.1:{port}" in out, out[:3000]
    assert f"waiting for remote ones (impala-actors --learner tcp://127.0.0.1:{port})" in out, out[:3000]
    assert "refused actor 1000" in out, out[-3000:]
    assert "a hello in this actor's name from elsewhere was refused" in actors_out, actors_out[-3000:]
    assert "actor 1000 joined" in out.split("refused actor 1000", 1)[1], out[-3000:]
    # it trained on after the forgery (the only actor: locked out, the frames would have stopped there)
    import re

    final = int(re.search(r"done: (\d+) env frames", out).group(1))
    assert final > at_forgery + 20000, (at_forgery, final)
    print(
        f"forged hello: actor 1000 said hello again;"
        f" frames {at_forgery:.0f} at the forgery, {final} at the end"
    )


def test_an_actor_refused_for_good_exits_with_one_line(tmp_path):
    """With CURVE, a second machine (its own key) running --first-id 1000 while the first one trains
    as 1000: the learner refuses its hello, and its impala-actors exits with the reason, exit code 2."""
    import os
    import shutil

    from impala.transport.curve import make_client_keys
    from procs import kill_group, run, start, wait_for

    keys_dir = str(tmp_path / "learner-keys")
    port, learner = _cartpole_learner(tmp_path, 60, ["--curve", keys_dir])
    first = None
    try:
        assert wait_for(
            lambda: (
                os.path.exists(os.path.join(keys_dir, "server.key"))
                and os.path.isdir(os.path.join(keys_dir, "authorized"))
            ),
            60,
        )
        dirs = []
        for name in ("first", "second"):
            d = str(tmp_path / name)
            shutil.copy(make_client_keys(d), os.path.join(keys_dir, "authorized", f"{name}.key"))
            shutil.copy(os.path.join(keys_dir, "server.key"), d)
            dirs.append(d)
        cmd = [
            "impala-actors",
            "--learner",
            f"tcp://127.0.0.1:{port}",
            *"--workers 1 --first-id 1000 --learner-timeout 5".split(),
        ]
        first = start([*cmd, "--curve", dirs[0]])
        assert wait_for(lambda: _frames_so_far(tmp_path) > 0, 60)  # the first one's unrolls: it owns 1000
        second = run([*cmd, "--curve", dirs[1], "--max-seconds", "50"], timeout=90)
        assert first.poll() is None  # the owner trains on
    finally:
        kill_group(learner)
        if first is not None:
            kill_group(first)
    assert second.returncode == 2, second.stderr[-3000:]
    assert "the learner refused this actor: actor id 1000 belongs to another client key" in second.stderr
    assert "impala-actors: the learner refused actor(s) [1000]" in second.stderr
    assert "Traceback" not in second.stderr


# ------------------------------------------------------------------ values at the bound


def test_behaviour_logits_at_the_bound_are_dropped_before_they_stall_an_update():
    """Logits at exactly +-1e6 (the default --max-abs-value) passed receipt, and an unroll whose taken
    action they call impossible made the whole (APPO-clipped) update non-finite. validate() now drops
    it; the same logits with the likely action taken stay trainable."""
    import torch

    from impala.envs import EnvSpec
    from impala.envs.probe import EnvInfo
    from impala.run.config import ImpalaConfig, RunConfig
    from learner.vtrace_learner import ImpalaTrainer

    B = 4
    run = RunConfig(env="CartPole-v1", unroll_length=T, total_frames=1000, device="cpu")
    trainer = ImpalaTrainer(
        ImpalaConfig(batch_size=B, minibatches=1, epochs=1),
        run,
        EnvInfo(EnvSpec("CartPole-v1"), (4,), "float32", "Box", "Discrete", num_actions=2),
    )
    assert run.max_abs_value == 1e6
    rng = np.random.default_rng(0)

    def unroll(actions):
        schema = trainer.schema
        u = schema.allocate()
        u["obs"][:] = rng.standard_normal(u["obs"].shape)
        u["rewards"][:] = rng.standard_normal(T)
        u["behaviour_logits"][:] = [1e6, -1e6]
        u["actions"][:] = actions
        return u

    unlikely, likely = unroll(1), unroll(0)
    assert "log-probability" in trainer.validate(unlikely) and trainer.validate(likely) is None
    honest = [unroll(rng.integers(0, 2, T)) for _ in range(B)]
    for u in honest:
        u["behaviour_logits"][:] = rng.standard_normal((T, 2))
        assert trainer.validate(u) is None

    def skipped(unrolls):
        before = trainer.learner.skipped_updates
        metrics = trainer.learner.train(trainer.learner.stage(unrolls, trainer.schema), frames_done=0)
        return trainer.learner.skipped_updates - before, metrics

    # what used to reach a minibatch: the update is not finite and is skipped
    assert skipped(honest[:-1] + [unlikely])[0] == 1
    # what passes validate() now trains
    n, metrics = skipped(honest[:-1] + [likely])
    assert n == 0 and np.isfinite(metrics["losses/total"])
    assert all(torch.isfinite(p).all() for p in trainer.learner.model.parameters())


def test_ppo_log_probs_at_the_bound_are_dropped():
    """PPO: a log-probability of -1e6 passes --max-abs-value but overflows exp(new - old); honest
    samples from the policy pass."""
    import torch

    from impala.envs import EnvSpec
    from impala.envs.probe import EnvInfo
    from impala.run.config import RunConfig
    from impala.run.ppo_config import PPOConfig
    from learner.ppo_learner import PPOTrainer

    ones = np.ones(2, np.float32)
    env = EnvInfo(EnvSpec("Pendulum-v1"), (3,), "float32", "Box", "Box", action_low=-ones, action_high=ones)
    trainer = PPOTrainer(PPOConfig(), RunConfig(env="Pendulum-v1", unroll_length=T, device="cpu"), env)
    policy = trainer.learner.policy
    u = trainer.schema.allocate()
    mu = torch.zeros(T, 2)
    actions = mu + torch.exp(policy.log_sigma) * torch.randn(T, 2, generator=torch.Generator().manual_seed(0))
    u["actions"][:] = actions.detach().numpy()
    u["log_probs"][:] = policy.log_prob_per_dim(actions, mu).detach().numpy()
    assert trainer.validate(u) is None
    u["log_probs"][3] = -1e6
    assert "overflow" in trainer.validate(u)
