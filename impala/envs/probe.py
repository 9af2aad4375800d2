"""One env probe for every caller: build the env once in this process and say what it is.

The launchers (``launch_impala``, ``launch_ppo``), ``frameskip_check`` and the actor's
hello all learn an env's observation and action spaces and its measured fingerprint
here, so they cannot disagree on what "the env" is. What each learner *needs* of the
env (discrete actions for IMPALA, vector observations and Box actions for PPO) is
checked by :meth:`EnvInfo.require_discrete` / :meth:`EnvInfo.require_ppo_spaces`,
with the message naming the launcher that would work instead.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from impala.envs import EnvSpec, make_env
from impala.envs.fingerprint import (
    EnvFingerprint,
    FingerprintMismatchError,
    check_against_config,
    configured_settings,
    measure_fingerprint,
)
from impala.envs.obs_layout import ObsLayout, image_layout
from impala.options import ConfigError


def flat_obs_dim(obs_shape: tuple[int, ...]) -> int:
    """Vector observations are flattened to this many float32 values."""
    return int(np.prod(obs_shape)) if obs_shape else 1


@dataclass(frozen=True)
class EnvInfo:
    """What a probe measured. ``num_actions`` > 0 for discrete actions; ``action_low/high`` for Box
    actions."""

    spec: EnvSpec
    obs_shape: tuple[int, ...]
    obs_dtype: str
    obs_space: str  # the gymnasium spaces' class names (Box, Discrete, ...)
    action_space: str
    num_actions: int = 0
    action_low: np.ndarray | None = None
    action_high: np.ndarray | None = None
    fingerprint: EnvFingerprint | None = None  # None for Unity builds (the build is the reference)
    agents_per_instance: int | None = None  # Unity: the build decides how many agents one instance steps
    description: str = ""
    action_meanings: tuple[str, ...] = ()  # Atari: what each action index does (multi-task runs compare them)
    obs_sizes: tuple[int, ...] = ()  # Unity: each sensor's size in spec order (obs: their concatenation)
    action_branches: tuple[int, ...] = ()  # MultiDiscrete / Unity: each discrete branch's action count
    action_mask: bool = False  # Unity discrete branches: the env masks actions
    obs_shapes: tuple[tuple[int, ...], ...] = ()  # Unity: each sensor's shape in spec order (cameras HWC)

    @property
    def obs_layout(self) -> ObsLayout:
        """How a PPO policy cuts the flat observation into sensors: Unity's specs (cameras are HWC floats in
        [0, 1]); a rank-3 gymnasium Box is one image (uint8: scaled by 1/255); other envs one vector."""
        if self.obs_shapes:
            return ObsLayout(self.obs_shapes, channels_last=True, image_scale=1.0)
        if len(self.obs_shape) == 3:
            return image_layout(self.obs_shape, self.obs_dtype)
        return ObsLayout()

    @property
    def obs_dim(self) -> int:
        return flat_obs_dim(self.obs_shape)

    @property
    def action_dim(self) -> int:
        return 0 if self.action_low is None else int(self.action_low.size)

    @property
    def frames_per_step(self) -> float:
        """Env frames per agent step: the mean frame skip (1 for envs without one)."""
        fp = self.fingerprint
        if fp is None or fp.frameskip_min is None:
            return 1.0
        return (fp.frameskip_min + fp.frameskip_max) / 2.0

    def require_discrete(self, launcher: str) -> None:
        """IMPALA's policy is a categorical over ``Discrete`` actions; other spaces name the launcher
        that fits."""
        if self.num_actions < 1:
            box = self.action_space == "Box"
            fits = "launch_ppo trains continuous Box actions" if box else "neither launcher does"
            raise ConfigError(
                f"{self.spec.id} has a {self.action_space} action space; {launcher} trains "
                f"discrete (Discrete) actions only; {fits}"
            )

    @property
    def ppo_branches(self) -> tuple[int, ...]:
        """The discrete branches of a PPO policy: ``Discrete(n)`` is one branch of n actions."""
        return (self.num_actions,) if self.num_actions else self.action_branches

    def require_ppo_spaces(self, launcher: str) -> None:
        """PPO's policy is a Gaussian over a ``Box`` of actions and/or categoricals over ``Discrete`` /
        ``MultiDiscrete`` ones (Unity: both), fed vector observations, images (rank 3) or both (Unity)."""
        if self.action_low is None and not self.ppo_branches:
            raise ConfigError(
                f"{self.spec.id} has a {self.action_space} action space; {launcher} trains Box, Discrete and "
                "MultiDiscrete actions"
            )
        if self.obs_space != "Box":
            raise ConfigError(
                f"{self.spec.id} has a {self.obs_space} observation space; {launcher} needs a Box (vector) "
                "observation"
            )
        if self.spec.atari:
            raise ConfigError(
                f"{self.spec.id} is an Atari game; {launcher} does not train Atari (its unrolls would carry "
                "84x84x4 frames as float32 and count one frame per step); use launch_impala"
            )
        if len(self.obs_shape) not in (1, 3) and not self.obs_shapes:
            raise ConfigError(
                f"{self.spec.id} has observations of shape {self.obs_shape}; {launcher} takes vectors "
                "(rank 1) and images (rank 3: HWC or CHW)"
            )


def build_env(spec: EnvSpec, *, seed: int | None = None) -> gym.Env:
    """``make_env`` with the user's mistakes worded: kwargs the env does not take, a missing extra."""
    try:
        return make_env(spec, seed=seed)
    except gym.error.DependencyNotInstalled as e:
        extra = " (pip install -e '.[mujoco]')" if "mujoco" in str(e).lower() else ""
        raise ConfigError(f"{spec.id} cannot be built: {e}{extra}") from None
    except TypeError as e:
        if not spec.kwargs:
            raise
        # gymnasium's message for a constructor argument the env does not take
        raise ConfigError(
            f"--env-kwargs {json.dumps(spec.kwargs)}: {spec.id} does not accept them ({e})"
        ) from None


def expected_observation(spec: EnvSpec) -> tuple[tuple[int, ...], str]:
    """The observation shape and dtype of ``spec``'s observation space (no steps taken)."""
    env = build_env(spec)
    try:
        space = env.observation_space
        return tuple(int(d) for d in space.shape), str(np.dtype(space.dtype))
    finally:
        env.close()


def measure_env_fingerprint(spec: EnvSpec, *, seed: int = 0, steps: int = 300) -> EnvFingerprint:
    """The fingerprint of a fresh env built from ``spec`` (what an actor reports in its hello)."""
    env = build_env(spec, seed=seed)
    try:
        return measure_fingerprint(env, steps=steps, seed=seed)
    finally:
        env.close()


def probe_env(spec: EnvSpec, *, seed: int = 0, check_config: bool = True) -> EnvInfo:
    """Build one gymnasium env here, measure its fingerprint and spaces, close it.

    With ``check_config`` the measured dynamics must match what the id and kwargs promise
    (frame skip, sticky actions): a mismatch is a :class:`FingerprintMismatchError`.
    """
    env = build_env(spec, seed=seed)
    try:
        fp = measure_fingerprint(env, seed=seed)
        obs_space, act_space = env.observation_space, env.action_space
        meanings = getattr(env.unwrapped, "get_action_meanings", None)
        action_meanings = tuple(meanings()) if spec.atari and meanings is not None else ()
    finally:
        env.close()
    if check_config:
        problems = check_against_config(fp, configured_settings(spec.id, spec.kwargs))
        if problems:
            raise FingerprintMismatchError(
                "the learner's own env differs from its configuration: " + "; ".join(map(str, problems))
            )
    kind = type(act_space).__name__
    num_actions = int(act_space.n) if isinstance(act_space, gym.spaces.Discrete) else 0
    branches: tuple[int, ...] = ()
    if isinstance(act_space, gym.spaces.MultiDiscrete):
        if act_space.nvec.ndim != 1 or np.any(act_space.start != 0):
            raise ConfigError(
                f"{spec.id} has a MultiDiscrete action space of shape {act_space.nvec.shape} starting at "
                f"{act_space.start.tolist()}; only flat ones starting at 0 are supported"
            )
        branches = tuple(int(n) for n in act_space.nvec)
    low = high = None
    if isinstance(act_space, gym.spaces.Box):
        low = np.broadcast_to(act_space.low, act_space.shape).reshape(-1).astype(np.float32)
        high = np.broadcast_to(act_space.high, act_space.shape).reshape(-1).astype(np.float32)
    if num_actions:
        actions = f"{num_actions} discrete actions"
    elif branches:
        actions = f"discrete branches {list(branches)}"
    elif low is not None:
        actions = f"{low.size} actions in [{low.min():g}, {high.max():g}]"
    else:
        actions = f"a {kind} action space"
    description = (
        f"{spec.id}: obs {fp.obs_shape} {fp.obs_dtype}, {actions}, frameskip {fp.frameskip_text()}, sticky "
        f"{fp.sticky}, "
        f"episode limit {fp.max_episode_steps}"
    )
    return EnvInfo(
        spec,
        tuple(fp.obs_shape),
        fp.obs_dtype,
        type(obs_space).__name__,
        kind,
        num_actions,
        low,
        high,
        fp,
        None,
        description,
        action_meanings,
        action_branches=branches,
    )


def probe_tasks(specs: list[EnvSpec], *, seed: int = 0) -> tuple[list[EnvInfo], str]:
    """Probe every task of a multi-task run; one network must fit them all.

    Returns the tasks' :class:`EnvInfo` (Atari games whose minimal action sets differ are probed
    again with the ALE's full 18-action set, so one action index means one joystick move in every
    game) and a note saying so ("" when nothing changed). Observation shapes, dtypes, frame skips and
    action counts that still differ are a :class:`ConfigError` naming the task.
    """
    atari = [spec.atari for spec in specs]
    if any(atari) and not all(atari):
        games = ", ".join(s.id for s in specs if s.atari)
        others = ", ".join(s.id for s in specs if not s.atari)
        raise ConfigError(
            f"--env mixes Atari games ({games}) with other envs ({others}); one multi-task network needs "
            "one kind of observation: list Atari games only, or other envs only"
        )
    infos = [probe_env(spec, seed=seed) for spec in specs]
    note = ""
    if len(infos) > 1 and all(atari) and len({info.action_meanings for info in infos}) > 1:
        minimal = ", ".join(f"{info.spec.id}: {info.num_actions}" for info in infos)
        full = [
            dataclasses.replace(i.spec, kwargs={**i.spec.kwargs, "full_action_space": True}) for i in infos
        ]
        infos = [probe_env(spec, seed=seed) for spec in full]
        note = (
            f"the games' minimal action sets differ ({minimal}): every task uses the ALE's full set of "
            f"{infos[0].num_actions} actions"
        )
    first = infos[0]
    for info in infos[1:]:
        what = None
        if (info.obs_shape, info.obs_dtype) != (first.obs_shape, first.obs_dtype):
            what = (
                f"observations {info.obs_shape} {info.obs_dtype}, but {first.spec.id} has "
                f"{first.obs_shape} {first.obs_dtype}"
            )
        elif (
            info.action_space != first.action_space
            or info.num_actions != first.num_actions
            or info.action_dim != first.action_dim
        ):
            what = (
                f"{info.num_actions or info.action_dim} {info.action_space} actions, but {first.spec.id} "
                f"has {first.num_actions or first.action_dim}"
            )
        elif info.frames_per_step != first.frames_per_step:
            what = (
                f"{info.frames_per_step:g} frames per step, but {first.spec.id} has {first.frames_per_step:g}"
            )
        if what:
            raise ConfigError(
                f"--env: task {info.spec.id} has {what}; one multi-task network needs the same observations, "
                "actions and frame skip in every task"
            )
    return infos, note


def probe_unity(
    build: str, *, worker_id: int, base_port: int, timeout: int, behavior: str | None, seed: int
) -> EnvInfo:
    """Start the build once here (an unused worker_id), read its spec, close it.

    Fails fast, in this process, with UnityVecEnv's message (it names the path and the port).
    """
    from impala.envs.unity import UnityVecEnv  # here: mlagents-envs is only needed for Unity builds

    with UnityVecEnv(
        build,
        worker_id=worker_id,
        base_port=base_port,
        seed=seed,
        timeout_wait=timeout,
        behavior_name=behavior,
    ) as env:
        obs_dim, action_dim, k, name = env.obs_dim, env.action_dim, env.num_envs, env.behavior_name
        branches = env.action_branches
        specs = env.obs_specs
    kwargs: dict[str, Any] = {
        "file_name": build,
        "base_port": base_port,
        "timeout_wait": timeout,
        "behavior_name": name,
    }
    ones = np.ones(action_dim, np.float32) if action_dim else None
    actions = [f"{action_dim} continuous actions in [-1, 1]"] if action_dim else []
    if branches:
        actions.append(f"discrete branches {list(branches)} (masked)")
    return EnvInfo(
        EnvSpec("unity:" + Path(build).name, kwargs=kwargs),
        (obs_dim,),
        "float32",
        "Box",
        "Box",
        0,
        None if ones is None else -ones,
        ones,
        None,
        k,
        f"Unity build {build!r}: behavior {name!r}, {k} agents per instance, obs {specs} -> {obs_dim}, "
        + " and ".join(actions),
        obs_sizes=tuple(int(np.prod(shape)) for shape in specs),
        obs_shapes=tuple(tuple(int(n) for n in shape) for shape in specs),
        action_branches=branches,
        action_mask=bool(branches),  # Unity may mask any branch at any decision: unrolls carry the masks
    )
