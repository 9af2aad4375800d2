"""Peers that follow the wire format but lie: about their episodes, their share of the learner, their
identity, or with values a float32 update cannot survive. Real sockets, loopback only, bounded in time."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from impala.envs.vector import EpisodeTracker
from impala.transport import wire
from impala.transport.trajectory import impala_unroll_schema
from learner.server import TrajectoryServer

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


def test_claimed_episode_returns_in_info_steer_nothing(link):
    """A new id's one valid unroll claiming 100 episodes of return 500 once filled the whole window
    (and could end a run through --stop-at-return); now only its rewards and episode ends count."""
    srv, push = link
    push.send_multipart(_frames("hello", 4242, info={"num_envs": 1}))
    assert _wait(lambda: 4242 in srv.accepted)
    u = SCHEMA.allocate()
    u["behaviour_logits"][:] = 0.5
    push.send_multipart(_frames("unroll", 4242, u, {"env": 0, **wire.episode_info([500.0] * 100, [10] * 100)}))
    _drain(srv, 1)
    assert srv.full_window_mean_return() is None
    assert "charts/mean_return_100" not in srv.stats() and srv.stats()["charts/episodes"] == 0.0
    # The same peer's data with one real episode end counts exactly that episode, claims or not.
    u["first"][0], u["rewards"][:], u["dones"][T - 1] = True, 1.0, True
    push.send_multipart(_frames("unroll", 4242, u, {"env": 0, **wire.episode_info([500.0] * 100, [10] * 100)}))
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
    assert srv.episodes_total == len(expected)
    assert sorted(zip(srv.episode_returns, srv.episode_lengths)) == sorted(zip(expected, lengths))


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
    assert list(srv.episode_returns) == [float(T), 2.0 * T] and list(srv.episode_lengths) == [T, T]


def test_an_honest_actor_reports_the_same_returns_as_before():
    """A real actor loop (CartPole, 4 envs, in a thread): the episodes the server sums from the data
    are the ones the actor counted itself and still sends along (what the learner reported before)."""
    from actors.loop import ActorConfig, run_actor
    from impala.envs import EnvSpec
    from impala.nets.impala_net import build_model
    from impala.transport.messages import ImpalaAgentSpec
    from impala.transport.params import state_dict_arrays

    schema = impala_unroll_schema(16, (4,), "float32", 2)
    srv = TrajectoryServer(schema, queue_size=64)
    srv.start()
    config = ActorConfig(actor_id=3, env=EnvSpec("CartPole-v1"), num_envs=4, unroll_length=16,
                         trajectory_endpoint=srv.trajectory_endpoint, params_endpoint=srv.params_endpoint,
                         agent=ImpalaAgentSpec("mlp"), learner_timeout_s=30)
    actor = threading.Thread(target=run_actor, args=(config,), kwargs={"max_unrolls": 30}, daemon=True)
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
    assert sorted(zip(srv.episode_returns, srv.episode_lengths)) == sorted(claimed)
