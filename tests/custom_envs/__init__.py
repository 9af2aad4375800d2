"""A tiny env registered on import, as a user's own package would: ``--env custom_envs:Tiny-v0`` or
``--env-package custom_envs --env Tiny-v0`` (tests/test_custom_envs.py)."""

from __future__ import annotations

import multiprocessing

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class TinyEnv(gym.Env):
    """Reach the end of a 4-cell corridor: action 1 steps right (+1 at the end), action 0 stays.

    Small enough to train for a few hundred frames, and learnable (the return grows as the policy
    prefers action 1); episodes end after 4 right steps or 16 steps in all.
    """

    metadata = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0.0, 1.0, shape=(4,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self.pos = 0
        self.t = 0

    def _obs(self) -> np.ndarray:
        obs = np.zeros(4, dtype=np.float32)
        obs[self.pos] = 1.0
        return obs

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.pos, self.t = 0, 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        if int(action) == 1:
            self.pos += 1
        done = self.pos >= 3
        self.pos = min(self.pos, 3)
        return self._obs(), float(done), done, self.t >= 16 and not done, {}


class TinyContinuousEnv(TinyEnv):
    """The same corridor with a Box action (launch_ppo's kind, not launch_impala's)."""

    def __init__(self) -> None:
        super().__init__()
        self.action_space = spaces.Box(-1.0, 1.0, shape=(1,), dtype=np.float32)

    def step(self, action):
        return super().step(int(float(np.asarray(action).reshape(-1)[0]) > 0))


class TinyTupleEnv(TinyEnv):
    """The same corridor with a Tuple action space (neither launcher's kind)."""

    def __init__(self) -> None:
        super().__init__()
        self.action_space = spaces.Tuple((spaces.Discrete(2), spaces.Discrete(2)))

    def step(self, action):
        return super().step(int(action[0]))


class TinyImageEnv(gym.Env):
    """A uint8 camera (36x36x1, HWC: the smallest NatureCNN takes) showing a lit bar in the left or the
    right half; action 0 / 1 naming that half earns +1. Episodes last 8 steps: the best return is 8, a
    random policy's 4. For launch_ppo's image path (tests/test_ppo_visual.py)."""

    metadata = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0, 255, shape=(36, 36, 1), dtype=np.uint8)
        self.action_space = spaces.Discrete(2)
        self.side, self.t = 0, 0

    def _obs(self) -> np.ndarray:
        obs = np.full((36, 36, 1), 20, dtype=np.uint8)
        obs[8:28, 4 + 18 * self.side : 14 + 18 * self.side] = 255
        return obs

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.side, self.t = int(self.np_random.integers(2)), 0
        return self._obs(), {}

    def step(self, action):
        reward = float(int(action) == self.side)
        self.side, self.t = int(self.np_random.integers(2)), self.t + 1
        return self._obs(), reward, False, self.t >= 8, {}


class ActorOnlyBrokenEnv(TinyEnv):
    """The corridor in the process that starts a run, an error in any process it starts: an env that passes
    the learner's probe but kills every local actor at start-up (a missing file, a licence only the launching
    shell has)."""

    def __init__(self) -> None:
        if multiprocessing.parent_process() is not None:
            raise RuntimeError("this env only builds in the launching process")
        super().__init__()


gym.register("Tiny-v0", entry_point=TinyEnv)
gym.register("ActorOnlyBroken-v0", entry_point=ActorOnlyBrokenEnv)
gym.register("TinyImage-v0", entry_point=TinyImageEnv)
gym.register("TinyBox-v0", entry_point=TinyContinuousEnv)
gym.register("TinyTuple-v0", entry_point=TinyTupleEnv)
