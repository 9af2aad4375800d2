"""Each Atari frame travels once: ``rebuild_frame_stacks`` restores the exact stacked observations
the actor saw, across episode starts, against a real preprocessed Atari env and a loop written from
the rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from impala.envs import EnvSpec
from impala.envs.vector import GymVecEnv
from impala.transport.trajectory import impala_unroll_schema, rebuild_frame_stacks


def reference(head, frames, first):
    """The rule as a loop: slide the stack by one frame; an episode start repeats its frame k times."""
    k = head.shape[0] + 1
    T1, B = frames.shape[:2]
    out = np.empty((T1, B, k, *frames.shape[2:]), frames.dtype)
    for b in range(B):
        stack = [*head[:, b], frames[0, b]]
        out[0, b] = np.stack(stack)
        for t in range(1, T1):
            stack = [frames[t, b]] * k if first[t, b] else stack[1:] + [frames[t, b]]
            out[t, b] = np.stack(stack)
    return out


def test_rebuild_matches_the_rule_on_random_data():
    rng = np.random.default_rng(0)
    k, T, B = 4, 12, 5
    head = rng.integers(0, 255, (k - 1, B, 3, 2), dtype=np.uint8)
    frames = rng.integers(0, 255, (T + 1, B, 3, 2), dtype=np.uint8)
    first = rng.random((T + 1, B)) < 0.2
    first[1:3, 0] = True  # two starts in a row
    np.testing.assert_array_equal(rebuild_frame_stacks(head, frames, first), reference(head, frames, first))
    on_torch = rebuild_frame_stacks(torch.from_numpy(head), torch.from_numpy(frames), torch.from_numpy(first))
    np.testing.assert_array_equal(on_torch.numpy(), reference(head, frames, first))


def test_rebuild_restores_a_real_atari_unroll_across_episode_ends():
    """Pong with a 1-step episode limit ends often; the rebuilt stacks equal what the env returned."""
    envs = GymVecEnv(EnvSpec("PongDeterministic-v4", {"max_num_frames_per_episode": 60}), 2, seed=3)
    T = 40
    obs = [envs.reset()]
    first = [np.ones(2, bool)]
    rng = np.random.default_rng(1)
    for _ in range(T):
        r = envs.step(rng.integers(0, 6, 2))
        obs.append(r.obs)
        first.append(r.terminated | r.truncated)
    obs, first = np.stack(obs), np.stack(first)  # [T+1, 2, 4, 84, 84]
    assert first[1:].any(), "the unroll should cross an episode end"
    rebuilt = rebuild_frame_stacks(obs[0, :, :-1].swapaxes(0, 1), obs[:, :, -1], first)
    np.testing.assert_array_equal(rebuilt, obs)


def test_schema_sends_each_frame_once():
    full = impala_unroll_schema(32, (4, 84, 84), "uint8", 6)
    lean = impala_unroll_schema(32, (4, 84, 84), "uint8", 6, frame_stack=4)
    assert "obs" not in lean.names and {"frames", "obs_head"} <= set(lean.names)
    assert lean.nbytes < full.nbytes / 3.5
    with pytest.raises(ValueError, match="frame_stack"):
        impala_unroll_schema(32, (3, 84, 84), "uint8", 6, frame_stack=4)


def test_the_actor_refuses_to_send_frames_alone_from_an_env_that_stacks_otherwise():
    """The actor's agent checks the stacking rule on every observation it records: real Pong frames
    stacked newest-first (another wrapper's convention) are refused with the flag that turns dedup off."""
    from actors.agents import make_agent
    from impala.transport.messages import ImpalaAgentSpec

    envs = GymVecEnv(EnvSpec("PongDeterministic-v4"), 1, seed=0)
    obs = envs.reset()
    agent = make_agent(
        ImpalaAgentSpec("shallow", frame_stack=4), envs=envs, first_obs=obs, unroll_length=4, seed=0
    )
    first = np.ones(1, bool)
    assert set(agent.unroll_start(obs)) == {"obs_head"} and agent.observation(obs, first)["frames"].shape == (
        1,
        84,
        84,
    )
    for _ in range(3):  # the real order passes
        obs = envs.step(np.array([2])).obs
        agent.observation(obs, np.zeros(1, bool))
    reversed_obs = envs.step(np.array([2])).obs[:, ::-1].copy()
    with pytest.raises(RuntimeError, match="--no-frame-dedup"):
        agent.observation(reversed_obs, np.zeros(1, bool))
