"""Environment specs and construction.

What crosses a process boundary is an ``EnvSpec``: a frozen, picklable
description (id, kwargs, and the packages that register the id). The
environment object itself never does: a child process builds its own from the
spec (docs/FRAMESKIP.md describes the bug this prevents), importing the spec's
packages first, so an env registered by the user's own package (``--env
mypkg.envs:MyEnv-v0`` or ``--env-package mypkg``) exists in every actor too.
"""

from __future__ import annotations

import difflib
import importlib
import reprlib
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

from impala.envs import catch, scaled
from impala.envs.atari import is_atari, make_atari, register_classic_ids
from impala.run.config import MODULE_NAME

UNITY_PREFIX = "unity:"
# A Unity spec's kwargs that set how the engine runs (mlagents-learn's engine settings and player arguments),
# not which env it is: a run may resume with others.
UNITY_ENGINE_KWARGS = frozenset(
    {
        "time_scale",
        "width",
        "height",
        "quality_level",
        "target_frame_rate",
        "capture_frame_rate",
        "no_graphics",
        "additional_args",
    }
)


class UnknownEnvError(ValueError):
    """An env id that no registry knows."""


class EnvPackageError(UnknownEnvError):
    """A package named to register envs that is not a module name or does not import: the env it
    registers is as unknown here as a misspelt id (and every entry point reports it the same way)."""


MAX_PACKAGES = 16


def check_package_names(names: Any) -> tuple[str, ...]:
    """``names`` as a tuple of module names; ``EnvPackageError`` for anything that is not one.

    A dotted Python module name and nothing else: the names come from the command line or, on a remote
    actor, from the learner, and must never be a way to run code other than importing an installed module.
    """
    if not isinstance(names, (list, tuple)) or len(names) > MAX_PACKAGES:
        raise EnvPackageError(
            f"env packages must be a list of at most {MAX_PACKAGES} module names, got {names!r:.200}"
        )
    for name in names:
        if not isinstance(name, str) or len(name) > 200 or not MODULE_NAME.fullmatch(name):
            raise EnvPackageError(
                f"env package {name!r:.200} is not a Python module name (like mypkg or mypkg.envs)"
            )
    return tuple(names)


def import_env_packages(names: tuple[str, ...]) -> None:
    """Import each package so that it registers its envs with gymnasium (importing twice is a no-op).

    Raises ``EnvPackageError`` naming the first module that does not import and why.
    """
    for name in check_package_names(names):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any failure of the user's module is reported the same way
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            raise EnvPackageError(f"env package {name!r} does not import ({why})") from None


def split_env_id(env_id: str) -> tuple[str | None, str]:
    """gymnasium's ``module:id`` syntax (``mypkg.envs:MyEnv-v0``) as (module, id); (None, id) without one."""
    if env_id.startswith(UNITY_PREFIX) or ":" not in env_id:
        return None, env_id
    module, _, name = env_id.partition(":")
    return module, name


@dataclass(frozen=True)
class EnvSpec:
    """A picklable description of an environment.

    Attributes:
        id: a gymnasium id (``PongDeterministic-v4``, ``CartPole-v1``, ``Ant-v5``, ...).
        kwargs: keyword overrides passed to the env's constructor (e.g.
            ``{"frameskip": 4}``); must be picklable plain data.
        preprocess: apply DeepMind Atari preprocessing (Atari ids only).
        packages: modules imported before the env is made, which register ``id`` with gymnasium.
            An id written ``module:id`` (gymnasium's syntax) is stored as ``id`` with ``module``
            appended here, so every process imports the module the same way.
    """

    id: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    preprocess: bool = True
    packages: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        module, name = split_env_id(self.id)
        if not name:
            raise UnknownEnvError(f"env id {self.id!r}: nothing after the ':' (write module:EnvId-v0)")
        packages = check_package_names(tuple(self.packages))
        if module is not None and module not in packages:
            packages += (module,)
        # frozen: the normalized id and packages are set once, here
        object.__setattr__(self, "id", name)
        object.__setattr__(self, "packages", packages)
        if not self.is_unity:
            import_env_packages(self.packages)
            check_env_id(self.id)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the wire (JSON-like); kwargs must be JSON values."""
        d = {"id": self.id, "kwargs": dict(self.kwargs), "preprocess": self.preprocess}
        if self.packages:  # absent otherwise, so the specs of runs without packages read as before
            d["packages"] = list(self.packages)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "EnvSpec":
        """Validate a peer's env description; ``ValueError`` (``UnknownEnvError`` for an unknown id) says
        what is wrong."""
        if (
            not isinstance(d, dict)
            or not isinstance(d.get("id"), str)
            or not isinstance(d.get("kwargs", {}), dict)
        ):
            # reprlib: a bounded repr (a 5,000-deep list would exhaust the recursion limit in repr())
            shape = "{'id': str, 'kwargs': dict, 'preprocess': bool}"
            raise ValueError(f"env spec must be {shape}, got {reprlib.repr(d)}")
        preprocess = d.get("preprocess", True)
        if not isinstance(preprocess, bool):
            raise ValueError(f"env spec: preprocess must be true or false, got {preprocess!r}")
        # A peer's package list is checked to be module names before anything is imported (__post_init__).
        packages = check_package_names(d.get("packages", []))
        return cls(d["id"], dict(d.get("kwargs", {})), preprocess, packages)

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
    import_env_packages(spec.packages)  # ... so it has not imported the packages that register the id either
    if spec.atari:
        return make_atari(spec.id, seed=seed, preprocess=spec.preprocess, **spec.kwargs)
    env = gym.make(spec.id, **spec.kwargs)
    if seed is not None:
        env.reset(seed=seed)
        env.action_space.seed(seed)
    return env
