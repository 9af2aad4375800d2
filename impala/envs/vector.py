"""A synchronous vector of K environments, stepped together by one actor.

Every vectorized env in the project (this one for gymnasium, ``UnityVecEnv``
for Unity) returns a ``StepResult`` with auto-reset: an env whose episode ended
is reset inside ``step`` and ``obs`` holds its new first observation, while
``final_obs`` keeps the last observation of the ended episode for
bootstrapping.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from impala.envs import EnvSpec, make_env


class StepResult(NamedTuple):
    """What one step of K envs returns, episode ends resolved."""

    obs: np.ndarray  # [K, *obs_shape] next obs; the first obs of the next episode where one ended
    reward: np.ndarray  # [K] float32, terminal rewards included
    terminated: np.ndarray  # [K] bool: ended for real, no bootstrap
    truncated: np.ndarray  # [K] bool: cut by a step limit, bootstrap from final_obs
    final_obs: np.ndarray  # [K, *obs_shape] last obs of the ended episode, else == obs


class EpisodeTracker:
    """Running return/length per env; collects finished episodes."""

    def __init__(self, num_envs: int) -> None:
        self.returns = np.zeros(num_envs, dtype=np.float64)
        self.lengths = np.zeros(num_envs, dtype=np.int64)
        self.finished_returns: list[float] = []
        self.finished_lengths: list[int] = []

    def record(self, reward: np.ndarray, done: np.ndarray) -> None:
        self.returns += reward
        self.lengths += 1
        for i in np.flatnonzero(done):
            self.finished_returns.append(float(self.returns[i]))
            self.finished_lengths.append(int(self.lengths[i]))
            self.returns[i] = 0.0
            self.lengths[i] = 0

    def pop(self) -> tuple[list[float], list[int]]:
        out = (self.finished_returns, self.finished_lengths)
        self.finished_returns, self.finished_lengths = [], []
        return out


class GymVecEnv:
    """K gymnasium envs built in the calling process: K of one ``EnvSpec``, or one per spec of a sequence
    of K (a multi-task actor's games; they must share observation and action spaces)."""

    def __init__(self, spec: EnvSpec | Sequence[EnvSpec], num_envs: int, *, seed: int = 0) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        specs = (spec,) * num_envs if isinstance(spec, EnvSpec) else tuple(spec)
        if len(specs) != num_envs:
            raise ValueError(f"{len(specs)} env specs for {num_envs} envs")
        self.spec = specs[0]
        self.num_envs = num_envs
        self.envs = [make_env(s, seed=seed + i) for i, s in enumerate(specs)]
        self.observation_space = self.envs[0].observation_space
        self.action_space = self.envs[0].action_space
        self._seed = seed

    def reset(self) -> np.ndarray:
        return np.stack([env.reset(seed=self._seed + i)[0] for i, env in enumerate(self.envs)])

    def step(self, actions: Sequence | np.ndarray) -> StepResult:
        obs, final_obs, rewards = [], [], np.empty(self.num_envs, dtype=np.float32)
        terminated = np.zeros(self.num_envs, dtype=bool)
        truncated = np.zeros(self.num_envs, dtype=bool)
        for i, (env, action) in enumerate(zip(self.envs, actions)):
            o, r, term, trunc, _ = env.step(action)
            rewards[i] = r
            terminated[i], truncated[i] = term, trunc
            final_obs.append(o)
            if term or trunc:
                o, _ = env.reset()
            obs.append(o)
        obs_arr = np.stack(obs)
        final_arr = np.stack(final_obs) if (terminated | truncated).any() else obs_arr
        return StepResult(obs_arr, rewards, terminated, truncated, final_arr)

    def close(self) -> None:
        for env in self.envs:
            env.close()
