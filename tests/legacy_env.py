"""Reconstructions of the historical bug (the frameskip bug, docs/FRAMESKIP.md), importable by spawned
children.

* ``LegacyAtariEnv``: ale-py's ``AtariEnv`` with gym <= 0.10.5's pickling. Its
  constructor defaults are the old gym ones (frameskip ``(2, 5)``,
  ``repeat_action_probability`` 0.0) and it records only ``game, mode,
  difficulty, obs_type`` for pickling, so an unpickled copy silently comes back
  with those defaults.
* ``LegacyActor``: an actor written the old way: it builds its env in
  ``__init__`` (in the parent), so the env object is pickled into the child
  (spawn / forkserver). Its ``run()`` measures *that* env and reports the
  fingerprint in its hello over the normal actor link.
* ``SwapEnvActor``: a correct actor, except that actor 1 builds a differently
  configured env (frameskip 3); ``launch_impala``'s runtime must refuse it.

pytest puts ``tests/`` on ``sys.path``, and spawn/forkserver children inherit
``sys.path``, so the children can import this module.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections import deque
from typing import Any

import ale_py
import gymnasium as gym
import numpy as np
from ale_py.env import AtariEnv

from actors.actor import Actor
from actors.loop import ActorConfig
from impala.envs import EnvSpec


class LegacyAtariEnv(AtariEnv):
    """``AtariEnv`` pickled the way gym <= 0.10.5 pickled it (frameskip and sticky dropped)."""

    def __init__(
        self,
        game: str = "pong",
        mode: int | None = None,
        difficulty: int | None = None,
        obs_type: str = "rgb",
        frameskip: int | tuple[int, int] = (2, 5),  # gym <= 0.10.5's default (ale-py's is 4)
        repeat_action_probability: float = 0.0,  # gym <= 0.10.5's default (ale-py's is 0.25)
        **kwargs: Any,
    ) -> None:
        super().__init__(
            game=game,
            mode=mode,
            difficulty=difficulty,
            obs_type=obs_type,
            frameskip=frameskip,
            repeat_action_probability=repeat_action_probability,
            **kwargs,
        )
        # Exactly the old bug: EzPickle records only these four arguments, so unpickling
        # calls LegacyAtariEnv(game, mode, difficulty, obs_type) and gets the defaults above.
        gym.utils.EzPickle.__init__(self, game=game, mode=mode, difficulty=difficulty, obs_type=obs_type)


class LegacyWarpFrameStack(gym.ObservationWrapper):
    """baselines-style WarpFrame + FrameStack (84x84 grayscale, 4 frames), picklable by its ``__dict__``."""

    def __init__(self, env: gym.Env, size: int = 84, stack: int = 4) -> None:
        super().__init__(env)
        self.size, self.stack = size, stack
        self.frames: deque = deque(maxlen=stack)
        self.observation_space = gym.spaces.Box(0, 255, (stack, size, size), np.uint8)

    def _warp(self, obs: np.ndarray) -> np.ndarray:
        import cv2

        if obs.ndim == 3:
            obs = cv2.cvtColor(obs, cv2.COLOR_RGB2GRAY)
        return cv2.resize(obs, (self.size, self.size), interpolation=cv2.INTER_AREA)

    def reset(self, **kwargs: Any):
        obs, info = self.env.reset(**kwargs)
        frame = self._warp(obs)
        for _ in range(self.stack):
            self.frames.append(frame)
        return np.stack(self.frames), info

    def observation(self, obs: np.ndarray) -> np.ndarray:
        self.frames.append(self._warp(obs))
        return np.stack(self.frames)


def legacy_env_from_spec(spec: EnvSpec) -> gym.Env:
    """What the old worker code did in ``__init__``: the ALE env with its frameskip, wrapped for the agent."""
    reg = gym.registry[spec.id]
    kwargs = {**reg.kwargs, **spec.kwargs}
    max_steps = kwargs.pop("max_episode_steps", reg.max_episode_steps)
    if isinstance(kwargs.get("frameskip"), list):
        kwargs["frameskip"] = tuple(kwargs["frameskip"])
    env: gym.Env = LegacyWarpFrameStack(LegacyAtariEnv(**kwargs))
    if max_steps is not None:
        env = gym.wrappers.TimeLimit(env, max_episode_steps=max_steps)
    return env


class LegacyActor(Actor):
    """The old, wrong pattern: the env is built in ``__init__``, i.e. in the parent process."""

    def __init__(self, config: ActorConfig, *, start_method: str = "spawn") -> None:
        super().__init__(config, start_method=start_method)
        self.env = legacy_env_from_spec(config.env)  # <- the bug: crosses the process boundary by pickling

    def run(self) -> None:  # runs in the child, on the unpickled (spawn/forkserver) or copied (fork) env
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        from actors.loop import ActorLink
        from impala.envs.fingerprint import measure_fingerprint
        from impala.transport import wire

        cfg = self.config
        link = ActorLink(cfg, parent_pid=os.getppid())
        try:
            fp = measure_fingerprint(self.env, steps=cfg.fingerprint_steps, seed=cfg.seed)
            link.send(
                wire.encode(
                    "hello",
                    actor=cfg.actor_id,
                    version=-1,
                    info={"fingerprint": fp.to_dict(), "pid": os.getpid(), "num_envs": 1},
                )
            )
            deadline = time.monotonic() + cfg.params_timeout_s
            while time.monotonic() < deadline:  # wait for weights like a real actor, until stopped
                link._alive()
                time.sleep(0.1)
        finally:
            self.env.close()
            link.close()


class UnpicklableEnvActor(Actor):
    """The seed's pattern: the emulator itself (an ALEInterface, which cannot be pickled) built in
    ``__init__``."""

    def __init__(self, config: ActorConfig, *, start_method: str = "spawn") -> None:
        super().__init__(config, start_method=start_method)
        self.ale = ale_py.ALEInterface()


class SwapEnvActor(Actor):
    """A correct actor, except that actor 1 silently runs PongDeterministic-v4 with frameskip 3."""

    def run(self) -> None:
        if self.config.actor_id == 1:
            self.config = dataclasses.replace(
                self.config, env=EnvSpec("PongDeterministic-v4", kwargs={"frameskip": 3})
            )
        super().run()
