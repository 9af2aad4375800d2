"""Environment specs and construction.

What crosses a process boundary is an ``EnvSpec``: a frozen, picklable
description (id plus kwargs). The environment object itself never does: a
child process builds its own from the spec (see SEEDS.md part 1 for the bug
this prevents).
"""

from __future__ import annotations

import difflib
import reprlib
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

from impala.envs import catch, scaled
from impala.envs.atari import is_atari, make_atari, register_classic_ids


UNITY_PREFIX = "unity:"


class UnknownEnvError(ValueError):
    """An env id that no registry knows."""


@dataclass(frozen=True)
class EnvSpec:
    """A picklable description of an environment.

    Attributes:
        id: a gymnasium id (``PongDeterministic-v4``, ``CartPole-v1``, ``Ant-v5``, ...).
        kwargs: keyword overrides passed to the env's constructor (e.g.
            ``{"frameskip": 4}``); must be picklable plain data.
        preprocess: apply DeepMind Atari preprocessing (Atari ids only).
    """

    id: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    preprocess: bool = True

    def __post_init__(self) -> None:
        if not self.is_unity:
            check_env_id(self.id)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the wire (JSON-like); kwargs must be JSON values."""
        return {"id": self.id, "kwargs": dict(self.kwargs), "preprocess": self.preprocess}

    @classmethod
    def from_dict(cls, d: Any) -> "EnvSpec":
        """Validate a peer's env description; ``ValueError`` (``UnknownEnvError`` for an unknown id) says what is wrong."""
        if not isinstance(d, dict) or not isinstance(d.get("id"), str) or not isinstance(d.get("kwargs", {}), dict):
            # reprlib: a bounded repr (a 5,000-deep list would exhaust the recursion limit in repr())
            shape = "{'id': str, 'kwargs': dict, 'preprocess': bool}"
            raise ValueError(f"env spec must be {shape}, got {reprlib.repr(d)}")
        preprocess = d.get("preprocess", True)
        if not isinstance(preprocess, bool):
            raise ValueError(f"env spec: preprocess must be true or false, got {preprocess!r}")
        return cls(d["id"], dict(d.get("kwargs", {})), preprocess)

    @property
    def is_unity(self) -> bool:
        """``unity:<name>`` specs describe a Unity build (kwargs hold ``file_name`` etc.)."""
        return self.id.startswith(UNITY_PREFIX)

    @property
    def atari(self) -> bool:
        return not self.is_unity and is_atari(self.id)


def _ensure_registries() -> None:
    register_classic_ids()
    catch.register()
    scaled.register()


def check_env_id(env_id: str) -> None:
    """Raise ``UnknownEnvError`` listing close matches when ``env_id`` is unknown."""
    _ensure_registries()
    if env_id in gym.registry:
        return
    matches = difflib.get_close_matches(env_id, list(gym.registry.keys()), n=5, cutoff=0.6)
    hint = f" Close matches: {', '.join(matches)}." if matches else ""
    raise UnknownEnvError(f"unknown env id {env_id!r}.{hint}")


def make_env(spec: EnvSpec, *, seed: int | None = None) -> gym.Env:
    """Build the environment described by ``spec`` in the calling process."""
    _ensure_registries()  # a spawned child unpickles the spec without running __post_init__
    if spec.atari:
        return make_atari(spec.id, seed=seed, preprocess=spec.preprocess, **spec.kwargs)
    env = gym.make(spec.id, **spec.kwargs)
    if seed is not None:
        env.reset(seed=seed)
        env.action_space.seed(seed)
    return env
