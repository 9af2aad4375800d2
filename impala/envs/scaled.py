"""Reward-scaled copies of an env, for testing what PopArt promises.

``CartPoleX1000-v1`` is CartPole-v1 with every reward multiplied by 1000: the same dynamics
and the same optimal policy, returns 1000 times larger. Trained together with CartPole-v1 in
one multi-task run, it is the smallest case of Hessel et al. 2018's problem: without
per-task value normalization the large-reward task owns the gradient.
"""

from __future__ import annotations

import gymnasium as gym

SCALED = {"CartPoleX1000-v1": ("CartPole-v1", 1000.0)}


class ScaleReward(gym.RewardWrapper):
    """Multiplies every reward by ``scale`` (tasks with another reward scale, for PopArt tests)."""

    def __init__(self, env: gym.Env, scale: float) -> None:
        super().__init__(env)
        self.scale = scale

    def reward(self, reward: float) -> float:
        return float(reward) * self.scale


def make_scaled(base: str, scale: float, **kwargs) -> gym.Env:
    """``base`` with its rewards multiplied by ``scale``."""
    return ScaleReward(gym.make(base, **kwargs), scale)


def register() -> None:
    """Register the scaled ids (``CartPoleX1000-v1``) with gymnasium (once)."""
    for env_id, (base, scale) in SCALED.items():
        if env_id not in gym.registry:
            # the base env keeps its own TimeLimit (gym.make(base) inside); the same limit is registered
            # here too, so that tools reading the spec (the fingerprint, impala-eval) see it
            gym.register(
                id=env_id,
                entry_point=f"{__name__}:make_scaled",
                kwargs={"base": base, "scale": scale},
                max_episode_steps=gym.registry[base].max_episode_steps,
            )
