"""Measure an environment's effective settings, and compare them with the configured ones.

The historical failure (the frameskip bug, docs/FRAMESKIP.md): an env pickled into a worker came back
with its *defaults*, so the worker trained on different dynamics and nothing
crashed. Reading a Python field would not catch that if the field and the
emulator disagree, so the frame skip is *measured*: the ALE's episode frame
counter is read before and after each agent step over many random steps. The
sticky-action probability and episode limit are read from the ALE itself and
from the wrapper chain of the env that actually runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from impala.envs.atari import register_classic_ids


class FingerprintMismatchError(RuntimeError):
    """An env differs from the learner's (or from its own configuration): training would be silently wrong."""


@dataclass(frozen=True)
class EnvFingerprint:
    """The settings an env exhibits. ``None`` means "not applicable" (non-Atari envs).

    frameskip_min / frameskip_max: the observed range of emulator frames per
        agent step (equal for a fixed skip).
    sticky: the ALE's ``repeat_action_probability``.
    num_actions: size of the action set the agent chooses from.
    minimal_actions / legal_actions: the game's minimal and full action-set sizes.
    max_episode_steps: the agent-step limit of the env's TimeLimit (None: none).
    obs_shape / obs_dtype: of a reset observation.
    """

    frameskip_min: int | None
    frameskip_max: int | None
    sticky: float | None
    num_actions: int | None
    minimal_actions: int | None
    legal_actions: int | None
    max_episode_steps: int | None
    obs_shape: tuple[int, ...]
    obs_dtype: str

    def frameskip_text(self) -> str:
        if self.frameskip_min is None:
            return "n/a"
        if self.frameskip_min == self.frameskip_max:
            return str(self.frameskip_min)
        return f"{self.frameskip_min}..{self.frameskip_max}"

    def action_set(self) -> str | None:
        if self.num_actions is None or self.minimal_actions is None:
            return None
        return (
            "full"
            if self.num_actions == self.legal_actions and self.legal_actions != self.minimal_actions
            else "minimal"
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["obs_shape"] = list(self.obs_shape)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EnvFingerprint":
        fields = {f for f in cls.__dataclass_fields__}
        if set(d) != fields:
            raise ValueError(f"fingerprint fields {sorted(d)} differ from {sorted(fields)}")
        d = dict(d)
        d["obs_shape"] = tuple(int(x) for x in d["obs_shape"])
        return cls(**d)


@dataclass(frozen=True)
class ConfiguredSettings:
    """What the parent configured for an Atari env (from the registry plus overrides)."""

    frameskip: int | tuple[int, int]
    sticky: float
    full_action_space: bool
    max_episode_steps: int | None


@dataclass(frozen=True)
class Mismatch:
    """One setting where a measured env differs from the configured one, and what it means."""

    field: str
    configured: str
    measured: str
    cause: str

    def __str__(self) -> str:
        return (
            f"{self.field}: configured {self.configured}, measured {self.measured}. Likely cause: "
            f"{self.cause}"
        )


def _find_time_limit(env: gym.Env) -> int | None:
    e: Any = env
    while e is not None:
        if isinstance(e, gym.wrappers.TimeLimit):
            return int(e._max_episode_steps)
        e = getattr(e, "env", None)
    return None


def _find_ale(env: gym.Env):
    return getattr(env.unwrapped, "ale", None)


def measure_fingerprint(env: gym.Env, *, steps: int = 300, seed: int = 0) -> EnvFingerprint:
    """Step ``env`` with random actions and report what it does.

    The env is reset first and left mid-episode; reset it before real use.
    Steps that end an episode are excluded from the frame-skip statistics
    (the emulator stops skipping at a game over).
    """
    obs, _ = env.reset(seed=seed)
    obs = np.asarray(obs)
    ale = _find_ale(env)
    n_actions = int(env.action_space.n) if isinstance(env.action_space, gym.spaces.Discrete) else None
    if ale is None:
        return EnvFingerprint(
            None, None, None, n_actions, None, None, _find_time_limit(env), tuple(obs.shape), str(obs.dtype)
        )
    rng = np.random.default_rng(seed)
    deltas: list[int] = []
    for _ in range(steps):
        before = ale.getEpisodeFrameNumber()
        _, _, terminated, truncated, _ = env.step(int(rng.integers(n_actions)))
        if terminated or truncated:
            env.reset()
            continue
        deltas.append(ale.getEpisodeFrameNumber() - before)
    if not deltas:
        raise RuntimeError("every measured step ended an episode; cannot measure the frame skip")
    return EnvFingerprint(
        frameskip_min=int(min(deltas)),
        frameskip_max=int(max(deltas)),
        sticky=round(float(ale.getFloat("repeat_action_probability")), 6),
        num_actions=n_actions,
        minimal_actions=len(ale.getMinimalActionSet()),
        legal_actions=len(ale.getLegalActionSet()),
        max_episode_steps=_find_time_limit(env),
        obs_shape=tuple(obs.shape),
        obs_dtype=str(obs.dtype),
    )


def configured_settings(env_id: str, overrides: dict[str, Any] | None = None) -> ConfiguredSettings | None:
    """The settings the registry plus ``overrides`` ask for; None for non-Atari ids."""
    register_classic_ids()
    spec = gym.registry[env_id]
    if spec.entry_point != "ale_py.env:AtariEnv":
        return None
    kw = {**spec.kwargs, **(overrides or {})}
    frameskip = kw.get("frameskip", 4)
    if isinstance(frameskip, list):
        frameskip = tuple(frameskip)
    return ConfiguredSettings(
        frameskip=frameskip,
        sticky=float(kw.get("repeat_action_probability", 0.25)),
        full_action_space=bool(kw.get("full_action_space", False)),
        max_episode_steps=kw.get("max_episode_steps", spec.max_episode_steps),
    )


def check_against_config(fp: EnvFingerprint, cfg: ConfiguredSettings | None) -> list[Mismatch]:
    """Compare a measured fingerprint with the configured settings."""
    if cfg is None:
        return []
    out: list[Mismatch] = []
    if fp.frameskip_min is None:
        return [Mismatch("frameskip", str(cfg.frameskip), "n/a", "the worker's env is not an ALE env")]
    pickle_cause = (
        "the env object was built in the parent and pickled into the worker, and its pickling "
        "dropped the setting (gym <= 0.10.5 EzPickle bug); build envs inside Actor.run() from an EnvSpec"
    )
    if isinstance(cfg.frameskip, int):
        if not fp.frameskip_min == fp.frameskip_max == cfg.frameskip:
            out.append(Mismatch("frameskip", str(cfg.frameskip), fp.frameskip_text(), pickle_cause))
    else:
        lo, hi = cfg.frameskip
        if fp.frameskip_min < lo or fp.frameskip_max > hi - 1 or fp.frameskip_min == fp.frameskip_max:
            out.append(Mismatch("frameskip", f"{lo}..{hi - 1} (random)", fp.frameskip_text(), pickle_cause))
    if fp.sticky is not None and abs(fp.sticky - cfg.sticky) > 1e-6:
        out.append(Mismatch("sticky", f"{cfg.sticky:g}", f"{fp.sticky:g}", pickle_cause))
    if fp.num_actions is not None and fp.legal_actions is not None:
        want = fp.legal_actions if cfg.full_action_space else fp.minimal_actions
        if fp.num_actions != want:
            out.append(
                Mismatch(
                    "action_set",
                    f"{'full' if cfg.full_action_space else 'minimal'} ({want})",
                    f"{fp.num_actions} actions",
                    "full_action_space was lost or overridden in the worker",
                )
            )
    if cfg.max_episode_steps != fp.max_episode_steps:
        out.append(
            Mismatch(
                "max_episode_steps",
                str(cfg.max_episode_steps),
                str(fp.max_episode_steps),
                "the worker's env lacks the registered TimeLimit (built without gymnasium.make's spec?)",
            )
        )
    return out


def compare_fingerprints(reference: EnvFingerprint, other: EnvFingerprint) -> list[Mismatch]:
    """Fields where ``other`` (an actor's) differs from ``reference`` (the learner's)."""
    out: list[Mismatch] = []
    cause = "the actor built its env with different settings than the learner (version skew or a pickled env)"
    if (reference.frameskip_min, reference.frameskip_max) != (other.frameskip_min, other.frameskip_max):
        # A stochastic skip shows a range that depends on luck only when very few steps are measured;
        # both sides measure enough steps for {2,3,4} to show up every time.
        out.append(Mismatch("frameskip", reference.frameskip_text(), other.frameskip_text(), cause))
    for name in ("sticky", "num_actions", "max_episode_steps", "obs_shape", "obs_dtype"):
        a, b = getattr(reference, name), getattr(other, name)
        if a != b:
            out.append(Mismatch(name, str(a), str(b), cause))
    return out
