"""UnityVecEnv against a fake Unity player, through the real mlagents-envs client and real gRPC.

Nothing that can run is mocked: the only patch (in-process mode) replaces
``mlagents_envs.env_utils.launch_executable`` so that it starts the fake
player thread instead of a binary; the executable-mode tests patch nothing.
"""

from __future__ import annotations

import json
import pickle
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlagents_envs")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fake_unity as fu  # noqa: E402
from fake_unity import AgentScript, FakeUnityConfig  # noqa: E402
from impala.envs.unity import UnityEnvError, UnityVecEnv  # noqa: E402


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    # the same check mlagents-envs' RpcCommunicator does before serving a port
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("localhost", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def wait_port_free(port: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_is_free(port):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def unity(monkeypatch):
    """make(cfg, worker_id, **kw) -> (env, player): UnityVecEnv on an in-process fake player."""
    envs: list[UnityVecEnv] = []
    all_players: list[fu.FakeUnityPlayer] = []

    def make(cfg: FakeUnityConfig, worker_id: int, **kw):
        players = fu.install_in_process(monkeypatch, cfg, connect_timeout=10)
        base_port = free_port() - worker_id
        try:
            env = UnityVecEnv("FakeUnity", worker_id=worker_id, base_port=base_port, timeout_wait=10, **kw)
        finally:
            all_players.extend(players)
        envs.append(env)
        assert env.port == base_port + worker_id
        return env, players[0]

    yield make
    for env in envs:
        env.close()
    for p in all_players:
        assert p.join(5), "fake player thread did not end"
        assert p.error is None, p.error
        assert p.protocol_errors == []


def expected_obs(cfg, slots):
    """slots: list of (agent_index, episode, t) -> [K, obs_dim]."""
    return np.stack([fu.observation(cfg, i, e, t) for i, e, t in slots])


def test_several_agents_obs_actions_side_channel(unity):
    cfg = FakeUnityConfig(agents=[AgentScript() for _ in range(3)], obs_sizes=(5, 3), action_size=2)
    env, player = unity(cfg, worker_id=1, seed=7)
    assert (env.num_envs, env.obs_dim, env.action_dim) == (3, 8, 2)
    assert env.obs_specs == [(5,), (3,)]
    assert env.behavior_name == "FakeBehavior?team=0"

    obs = env.reset()
    assert obs.dtype == np.float32 and obs.shape == (3, 8)
    np.testing.assert_allclose(obs, expected_obs(cfg, [(i, 0, 0) for i in range(3)]))
    # the two specs are concatenated in spec order: spec 0 = first 5 floats (t, i, e, target)
    np.testing.assert_allclose(obs[:, 1], [0.0, 0.1, 0.2], rtol=1e-6)

    # engine configuration as mlagents-learn sets it, and the seed, reached the player
    assert player.engine_config["time_scale"] == pytest.approx(20.0)
    assert player.engine_config["target_frame_rate"] == -1
    assert player.engine_config["capture_frame_rate"] == 60
    assert player.init_input.seed == 7

    rng = np.random.default_rng(0)
    for t in range(3):
        acts = rng.uniform(-1, 1, size=(3, 2)).astype(np.float32)
        res = env.step(acts)
        # the actions arrived, per agent, unchanged
        sent = player.actions[-1]
        assert sorted(sent) == [0, 1, 2]
        for i in range(3):
            np.testing.assert_array_equal(sent[i], acts[i])
        want_r = [fu.step_reward(cfg, i, 0, t, acts[i]) for i in range(3)]
        np.testing.assert_allclose(res.reward, want_r, rtol=1e-6)
        np.testing.assert_allclose(res.obs, expected_obs(cfg, [(i, 0, t + 1) for i in range(3)]))
        assert not res.terminated.any() and not res.truncated.any()
        assert res.final_obs is res.obs or np.array_equal(res.final_obs, res.obs)

    with pytest.raises(ValueError, match=r"shape \(3, 2\)"):
        env.step(np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="NaN or inf for envs \\[1\\]"):
        env.step(np.array([[0, 0], [np.nan, 0], [0, 0]], np.float32))
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(env)


def test_terminated_and_interrupted_episodes(unity):
    cfg = FakeUnityConfig(
        agents=[
            AgentScript(3, "terminate", terminal_reward=5.0),
            AgentScript(4, "interrupt"),
            AgentScript(None),
        ]
    )
    env, player = unity(cfg, worker_id=2)
    env.reset()
    acts = np.array([[0.1, -0.2], [0.3, 0.0], [-0.5, 0.5]], np.float32)
    episode = [0, 0, 0]
    t = [0, 0, 0]
    n_terminated = n_truncated = 0
    for step in range(9):
        res = env.step(acts)
        for i in range(3):
            r = fu.step_reward(cfg, i, episode[i], t[i], acts[i])
            t[i] += 1
            length = cfg.agents[i].episode_length
            if length is not None and t[i] == length:
                is_term = cfg.agents[i].end == "terminate"
                assert res.terminated[i] == is_term and res.truncated[i] == (not is_term)
                # terminal reward kept; final_obs is the terminal obs; obs is the new first obs
                assert res.reward[i] == pytest.approx(r + (5.0 if is_term else 0.0), rel=1e-6)
                np.testing.assert_allclose(res.final_obs[i], fu.observation(cfg, i, episode[i], t[i]))
                episode[i], t[i] = episode[i] + 1, 0
                np.testing.assert_allclose(res.obs[i], fu.observation(cfg, i, episode[i], 0))
                n_terminated += is_term
                n_truncated += not is_term
            else:
                assert not res.terminated[i] and not res.truncated[i]
                assert res.reward[i] == pytest.approx(r, rel=1e-6)
                np.testing.assert_array_equal(res.final_obs[i], res.obs[i])
                np.testing.assert_allclose(res.obs[i], fu.observation(cfg, i, episode[i], t[i]))
    assert (n_terminated, n_truncated) == (3, 2)
    returns, lengths = env.episodes.pop()
    assert sorted(lengths) == [3, 3, 3, 4, 4]
    # Unity gives every episode a new agent id; the slots stayed with the physical agents
    assert max(player.actions[-1]) > 2

    # reset(): every slot starts a new episode (new ids, episode counter + 1 in the fake)
    obs = env.reset()
    np.testing.assert_allclose(obs, expected_obs(cfg, [(i, episode[i] + 1, 0) for i in range(3)]))
    res = env.step(acts)
    assert res.reward[2] == pytest.approx(fu.step_reward(cfg, 2, episode[2] + 1, 0, acts[2]), rel=1e-6)


def test_agents_absent_from_decision_steps(unity):
    """Agents missing from DecisionSteps: a late respawn, and a terminal row sent alone."""
    cfg = FakeUnityConfig(
        agents=[
            AgentScript(6, "terminate", terminal_reward=5.0, lone_terminal=True),  # ends mid-period
            AgentScript(3, "interrupt", respawn_delay=2),  # next episode asks 2 exchanges later
            AgentScript(None),
            AgentScript(3, "terminate", terminal_reward=1.0),  # same time as agent 1, respawns at once
        ]
    )
    env, player = unity(cfg, worker_id=3)
    env.reset()
    acts = np.array([[0.5, 0.5], [-0.5, 0.25], [0.2, -0.1], [0.0, 0.9]], np.float32)
    r = lambda i, e, t, a: fu.step_reward(cfg, i, e, t, a)  # noqa: E731
    ob = lambda i, e, t: fu.observation(cfg, i, e, t)  # noqa: E731

    for _ in range(2):
        res = env.step(acts)
    assert len(player.actions) == 2 and not (res.terminated | res.truncated).any()

    # step 3: agents 1 and 3 end. Agent 3's next episode asks at once (a new id, so it takes the
    # lowest free slot: 1); agent 1's asks 2 exchanges later (it gets slot 3). Meanwhile the env
    # steps Unity twice more: live slots repeat their action (rewards accumulate), the new
    # episode in slot 1 gets zeros and its rewards are dropped (they belong to the new episode).
    res = env.step(acts)
    assert len(player.actions) == 5
    assert res.truncated.tolist() == [False, True, False, False]
    assert res.terminated.tolist() == [False, False, False, True]
    assert res.reward[1] == pytest.approx(r(1, 0, 2, acts[1]), rel=1e-6)
    assert res.reward[3] == pytest.approx(r(3, 0, 2, acts[3]) + 1.0, rel=1e-6)
    for i in (0, 2):
        assert res.reward[i] == pytest.approx(sum(r(i, 0, t, acts[i]) for t in (2, 3, 4)), rel=1e-5)
        np.testing.assert_allclose(res.obs[i], ob(i, 0, 5))
    np.testing.assert_allclose(res.final_obs[1], ob(1, 0, 3))
    np.testing.assert_allclose(res.final_obs[3], ob(3, 0, 3))
    np.testing.assert_allclose(res.obs[1], ob(3, 1, 2))  # agent 3 after 2 zero actions
    np.testing.assert_allclose(res.obs[3], ob(1, 1, 0))
    for sent in player.actions[-2:]:  # the two extra exchanges: agents 0, 2 and 3's new episode
        assert len(sent) == 3
        assert sum(not a.any() for a in sent.values()) == 1
        assert sum(np.array_equal(a, acts[0]) for a in sent.values()) == 1
        assert sum(np.array_equal(a, acts[2]) for a in sent.values()) == 1

    # step 4: agent 0 ends mid-period: its terminal row comes alone (no decision at all in that
    # exchange), the env steps Unity with no actions, then every agent asks. Agent 3 (slot 1)
    # ends its short episode in that second exchange.
    res = env.step(acts)
    assert len(player.actions) == 6  # the empty exchange carried no actions
    assert res.terminated.tolist() == [True, True, False, False] and not res.truncated.any()
    assert res.reward[0] == pytest.approx(r(0, 0, 5, acts[0]) + 5.0, rel=1e-6)
    assert res.reward[1] == pytest.approx(r(3, 1, 2, acts[1]) + 1.0, rel=1e-6)
    assert res.reward[3] == pytest.approx(r(1, 1, 0, acts[3]), rel=1e-6)
    np.testing.assert_allclose(res.final_obs[0], ob(0, 0, 6))
    np.testing.assert_allclose(res.obs[0], ob(0, 1, 0))
    np.testing.assert_allclose(res.final_obs[1], ob(3, 1, 3))
    np.testing.assert_allclose(res.obs[1], ob(3, 2, 0))
    np.testing.assert_allclose(res.obs[2], ob(2, 0, 6))
    np.testing.assert_allclose(res.obs[3], ob(1, 1, 1))
    np.testing.assert_array_equal(res.final_obs[2:], res.obs[2:])


def test_crawler_like_two_specs(unity):
    cfg = fu.preset("crawler")
    env, player = unity(cfg, worker_id=4)
    assert (env.num_envs, env.obs_dim, env.action_dim) == (5, 158, 20)
    assert env.obs_specs == [(126,), (32,)]
    obs = env.reset()
    np.testing.assert_allclose(obs, expected_obs(cfg, [(i, 0, 0) for i in range(5)]))
    acts = np.random.default_rng(1).normal(size=(5, 20)).astype(np.float32)
    res = env.step(acts)
    np.testing.assert_allclose(
        res.reward, [fu.step_reward(cfg, i, 0, 0, acts[i]) for i in range(5)], rtol=1e-5
    )


def test_fast_client_steps_like_mlagents_environment(unity):
    """UnityVecEnv on FastUnityEnvironment (the default) == on mlagents' own UnityEnvironment.

    10 Crawler-shaped agents through episode ends (terminated and interrupted), same actions:
    every StepResult array is bitwise equal, and the player received the same actions.
    """
    from impala.envs.unity_client import FastUnityEnvironment

    base = fu.preset("crawler")
    cfg = FakeUnityConfig(
        agents=[base.agents[i % 5] for i in range(10)],
        obs_sizes=base.obs_sizes,
        action_size=base.action_size,
        behavior_name=base.behavior_name,
    )
    fast, p_fast = unity(cfg, worker_id=13)
    slow, p_slow = unity(cfg, worker_id=14, fast_client=False)
    assert isinstance(fast._env, FastUnityEnvironment)
    assert type(slow._env) is not FastUnityEnvironment
    rng = np.random.default_rng(5)
    np.testing.assert_array_equal(fast.reset(), slow.reset())
    n_term = n_trunc = 0
    for _ in range(125):
        acts = rng.uniform(-1, 1, size=(10, 20)).astype(np.float32)
        a, b = fast.step(acts), slow.step(acts)
        for field in ("obs", "reward", "terminated", "truncated", "final_obs"):
            x, y = getattr(a, field), getattr(b, field)
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), field
        n_term, n_trunc = n_term + int(a.terminated.sum()), n_trunc + int(a.truncated.sum())
    assert (n_trunc, n_term) == (2, 2)  # agents 0, 5 interrupted at 100 steps; 1, 6 end at 120
    assert len(p_fast.actions) == len(p_slow.actions)
    for x, y in zip(p_fast.actions, p_slow.actions):
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


class _SlowCloseReply:
    """The handler thread's end of the communicator, holding the close message's reply back a moment
    (what a busy host does now and then): it widens the window in which stopping the server could
    abort that reply before it reaches the player."""

    def __init__(self, end, delay: float) -> None:
        self._end, self._delay = end, delay

    def send(self, obj) -> None:
        self._end.send(obj)

    def recv(self):
        reply = self._end.recv()
        if reply.header.status == 400:
            time.sleep(self._delay)
        return reply


def test_close_message_reaches_the_player_when_its_reply_is_slow_to_go_out(unity):
    env, player = unity(FakeUnityConfig(), worker_id=6)
    servicer = env._env._communicator.unity_to_external
    # Exchange reads child_conn on each call: the handler waiting at close is one started after this
    servicer.child_conn = _SlowCloseReply(servicer.child_conn, delay=0.3)
    env.reset()
    env.step(np.zeros((3, 2), np.float32))
    t0 = time.monotonic()
    env.close()
    took = time.monotonic() - t0
    assert player.join(5)
    # mlagents' own close (no grace) aborts the held reply: the player then sees "cancelled"
    assert player.shutdown == "quit"
    assert took < 0.3 + 1.5  # the grace is bounded


def test_close_sends_quit_and_releases_port(unity):
    env, player = unity(FakeUnityConfig(), worker_id=5)
    env.reset()
    env.step(np.zeros((3, 2), np.float32))
    with pytest.raises(UnityEnvError, match=rf"port {env.port} .*already in use"):
        UnityVecEnv("FakeUnity", base_port=env.port, timeout_wait=2)
    env.close()
    assert player.join(5)
    assert player.shutdown == "quit"  # the status-400 message reached the player
    assert wait_port_free(env.port)
    env.close()  # idempotent
    with pytest.raises(UnityEnvError, match="closed"):
        env.step(np.zeros((3, 2), np.float32))


def test_several_behaviors(unity):
    cfg = FakeUnityConfig(extra_behaviors=("Other?team=0",))
    with pytest.raises(
        UnityEnvError,
        match=r"several behaviors \['FakeBehavior\?team=0', "
        r"'Other\?team=0'\].*behavior_name",
    ):
        unity(cfg, worker_id=6)
    env, _ = unity(cfg, worker_id=7, behavior_name="FakeBehavior")  # "?team=0" may be left out
    assert env.behavior_name == "FakeBehavior?team=0"
    env.reset()
    assert env.step(np.zeros((3, 2), np.float32)).obs.shape == (3, 8)
    with pytest.raises(UnityEnvError, match="'Nope' not found.*Other"):
        unity(cfg, worker_id=8, behavior_name="Nope")


def test_discrete_and_hybrid_actions_masks_and_bad_actions(unity):
    """Discrete branches reach the player per agent; ``action_masks`` gives each slot's allowed actions
    (the protocol's True means blocked); hybrid actions travel as (continuous, discrete); bad discrete
    actions are refused before anything is sent."""
    cfg = fu.preset("hybrid")
    env, player = unity(cfg, worker_id=9)
    K = cfg.n_agents
    assert (env.action_dim, env.action_branches) == (2, (3, 2))
    env.reset()
    for t in range(3):
        masks = env.action_masks()
        assert masks.shape == (K, 5) and masks.dtype == bool
        for i in range(K):
            no = fu.blocked(cfg, i, 0, t)
            assert not masks[i, no[0]] and not masks[i, 3 + no[1]] and masks[i].sum() == 3
        picks = np.stack([fu.discrete_target(cfg, i, 0, t) for i in range(K)]).astype(np.int64)
        cont = np.stack([fu.target(cfg, i, 0, t) for i in range(K)])
        res = env.step((cont, picks))
        assert player.discrete_actions[-K:] == picks.tolist()
        np.testing.assert_allclose(res.reward, 1.0, rtol=1e-6)  # both parts on target
    with pytest.raises(ValueError, match="give \\(continuous, discrete\\)"):
        env.step(picks)
    with pytest.raises(ValueError, match="outside the branches"):
        env.step((cont, np.full((K, 2), 2)))
    with pytest.raises(ValueError, match="must be integers"):
        env.step((cont, picks.astype(np.float32)))
    assert player.protocol_errors == []


def test_discrete_only_behaviour(unity):
    cfg = fu.preset("basic")
    env, player = unity(cfg, worker_id=10)
    assert (env.action_dim, env.action_branches, env.obs_dim) == (0, (3,), 8)
    obs = env.reset()
    np.testing.assert_array_equal(
        obs[:, 3:6], np.eye(3)[[fu.discrete_target(cfg, i, 0, 0)[0] for i in range(4)]]
    )
    allowed = env.action_masks().argmax(axis=1)[:, None]  # the first allowed action of each agent
    res = env.step(allowed)
    assert res.reward.shape == (4,) and player.discrete_actions[-4:] == allowed.tolist()


def test_visual_observation_flattened_hwc(unity):
    """A camera spec (rank 3, HWC) travels flattened after the vector spec, in C order: the policy reshapes
    it back from ``obs_specs`` (impala.envs.obs_layout)."""
    cfg = fu.preset("visual")
    env, player = unity(cfg, worker_id=12)
    assert env.obs_specs == [(2,), (20, 20, 3)] and env.obs_dim == 2 + 1200
    obs = env.reset()
    for i in range(cfg.n_agents):
        np.testing.assert_array_equal(obs[i, 2:].reshape(20, 20, 3), fu.image(cfg, i, 0, 0))
    assert player.protocol_errors == []


# -- executable mode: mlagents-envs launches the fake build as a subprocess, no patching ---------
def test_executable_fake_build(tmp_path):
    record = tmp_path / "player.json"
    build = fu.write_fake_build(tmp_path / "FakeCrawler.x86_64", preset="crawler", record=record)
    port = free_port()
    env = UnityVecEnv(str(build), base_port=port - 2, worker_id=2, timeout_wait=30)
    try:
        assert (env.num_envs, env.obs_dim, env.action_dim) == (5, 158, 20)
        cfg = fu.preset("crawler")
        obs = env.reset()
        np.testing.assert_allclose(obs, expected_obs(cfg, [(i, 0, 0) for i in range(5)]))
        acts = np.full((5, 20), 0.25, np.float32)
        for t in range(3):
            res = env.step(acts)
            want = [fu.step_reward(cfg, i, 0, t, acts[i]) for i in range(5)]
            np.testing.assert_allclose(res.reward, want, rtol=1e-5)
    finally:
        env.close()
    summary = json.loads(record.read_text())
    assert summary["shutdown"] == "quit"
    assert summary["engine_config"]["time_scale"] == pytest.approx(20.0)
    assert summary["n_steps"] == 3 and summary["error"] is None
    assert {"-nographics", "-batchmode", "--mlagents-port", str(port)} <= set(summary["args"])
    assert wait_port_free(port)


def test_missing_build_names_the_path(tmp_path):
    missing = tmp_path / "NoSuchDir" / "Crawler.x86_64"
    port = free_port()
    with pytest.raises(UnityEnvError, match="not found.*NoSuchDir/Crawler"):
        UnityVecEnv(str(missing), base_port=port, timeout_wait=5)
    assert wait_port_free(port)


def test_build_that_never_connects(tmp_path):
    build = fu.write_fake_build(tmp_path / "Hang.x86_64", preset=None, args=["--hang"])
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(UnityEnvError) as info:
        UnityVecEnv(str(build), base_port=port, timeout_wait=2)
    msg = str(info.value)
    assert str(build) in msg and f"port {port}" in msg and "timeout_wait=2" in msg
    assert time.monotonic() - t0 < 15
    assert wait_port_free(port)


def test_build_that_exits_early(tmp_path):
    build = tmp_path / "Broken.x86_64"
    build.write_text("#!/bin/sh\nexit 3\n")
    build.chmod(0o755)
    port = free_port()
    with pytest.raises(UnityEnvError, match=rf"Broken.*port {port}.*return code 3"):
        UnityVecEnv(str(build), base_port=port, timeout_wait=10)
    assert wait_port_free(port)  # the half-built UnityEnvironment was closed
