"""Evaluation protocols: which env a trained agent is judged on, said in numbers.

A score without its protocol cannot be compared with anything (TorchBeast #25, #37, #39:
numbers nobody could reproduce). Each protocol here turns the env an agent was trained on
into the env it is evaluated on (an :class:`~impala.envs.EnvSpec`, built in every worker
like a training env) plus the settings that env must show, so that the same fingerprint
guard the training actors pass (``check_against_config``) proves each evaluation worker
runs the protocol:

``train``
    The env exactly as trained (the checkpoint's own id and kwargs).
``machado``
    The settings Machado et al. 2018 ("Revisiting the Arcade Learning Environment")
    recommend: sticky actions with probability 0.25, the full action set (18 actions), no
    life-loss resets, and no no-op starts (the sticky actions are the source of randomness);
    episodes capped at 108,000 emulator frames (30 minutes at 60 Hz; Dopamine's 27,000 agent
    steps). Atari only.
``dqn``
    Up to 30 no-op actions at the start of each episode (Mnih et al. 2015), no sticky
    actions, episodes capped at 108,000 emulator frames (the 30-minute cap of later
    papers; Mnih et al. played 5 minutes). Atari only.

Both Atari protocols keep the trained frame skip and preprocessing (they judge the agent
under the decision rate it learned). Episodes here never end at a lost life: the
preprocessing of this project has no life-loss resets, in training or in evaluation.

A network trained on a game's minimal action set chooses among those actions also under
the full action set: :func:`action_index_map` maps each network output to the full-set
index of the same ALE action, and :class:`NetworkActions` applies it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import gymnasium as gym
import numpy as np

from impala.envs import EnvSpec
from impala.envs.fingerprint import (
    ConfiguredSettings,
    EnvFingerprint,
    Mismatch,
    check_against_config,
    configured_settings,
    measure_fingerprint,
)
from impala.options import ConfigError

ProtocolName = Literal["train", "machado", "dqn"]
PROTOCOLS: tuple[str, ...] = ("train", "machado", "dqn")
FRAME_CAP = 108_000  # emulator frames: 30 minutes at 60 Hz
DQN_NOOP_MAX = 30
MACHADO_STICKY = 0.25
REFERENCES = {
    "train": "the env exactly as the checkpoint was trained",
    "machado": "Machado et al. 2018 (Revisiting the ALE): sticky actions 0.25, full action set, no no-op "
    "starts",
    "dqn": "no-op starts as in Mnih et al. 2015 (up to 30), no sticky actions",
}


class ProtocolError(ConfigError):
    """A protocol the env cannot do (an Atari protocol for a non-Atari env, a bad frame cap)."""


@dataclass(frozen=True)
class EvalProtocol:
    """One protocol applied to one trained env.

    env: what every evaluation worker builds.
    expected: the settings its measured fingerprint must show (Atari; None otherwise).
    noop_max: up to this many no-op actions at each reset (Atari; None: not applicable).
    max_frames: each episode is cut after this many env frames (Atari: the ALE's own
        ``max_num_frames_per_episode``, emulator frames; other envs: agent steps); None: no
        cap besides the env's own step limit.
    network_full_actions: whether the network chooses among the full action set (as trained);
        None for non-Atari envs.
    """

    name: str
    env: EnvSpec
    expected: ConfiguredSettings | None
    noop_max: int | None
    max_frames: int | None
    network_full_actions: bool | None

    @property
    def atari(self) -> bool:
        return self.env.atari

    def settings(self) -> dict[str, Any]:
        """Plain data: printed before the episodes and stored with the result."""
        out: dict[str, Any] = {
            "protocol": self.name,
            "reference": REFERENCES[self.name],
            "env_id": self.env.id,
            "env_kwargs": dict(self.env.kwargs),
        }
        cfg = self.expected
        if cfg is not None:
            fs = cfg.frameskip if isinstance(cfg.frameskip, int) else list(cfg.frameskip)
            out.update(
                frameskip=fs,
                sticky=cfg.sticky,
                action_set="full" if cfg.full_action_space else "minimal",
                network_action_set="full" if self.network_full_actions else "minimal",
                noop_max=self.noop_max,
                max_frames_per_episode=self.max_frames,
                max_episode_steps=cfg.max_episode_steps,
                life_loss_terminal=False,
            )
        else:
            limit = self.env.kwargs.get(
                "max_episode_steps", getattr(gym.registry.get(self.env.id), "max_episode_steps", None)
            )
            out.update(
                max_frames_per_episode=self.max_frames,
                max_episode_steps=limit,
                frames="agent steps (no frame skip)",
            )
        return out

    def summary(self) -> str:
        """The settings in one line, for the console."""
        s = self.settings()
        if self.expected is None:
            limit = f"step limit {s['max_episode_steps']}" if s["max_episode_steps"] else "no step limit"
            cap = f"episodes cut at {self.max_frames:,} steps" if self.max_frames else limit
            return f"{self.name}: {self.env.id} as trained, {cap}"
        fs = (
            s["frameskip"]
            if isinstance(s["frameskip"], int)
            else f"{s['frameskip'][0]}..{s['frameskip'][1] - 1}"
        )
        actions = f"{s['action_set']} action set"
        if s["action_set"] != s["network_action_set"]:
            actions += f" (the network's {s['network_action_set']} set mapped onto it)"
        noops = f"up to {self.noop_max} no-op starts" if self.noop_max else "no no-op starts"
        cap = f"cap {self.max_frames:,} frames/episode" if self.max_frames else "no frame cap"
        limit = f", step limit {s['max_episode_steps']:,}" if s["max_episode_steps"] else ""
        return (
            f"{self.name}: {self.env.id}, frameskip {fs}, sticky actions {s['sticky']:g}, {actions}, "
            f"{noops}, "
            f"{cap}{limit}, no life-loss resets"
        )


def eval_protocol(trained: EnvSpec, name: str, *, max_frames: int = 0) -> EvalProtocol:
    """``trained`` (the env as the checkpoint was trained) under protocol ``name``.

    ``max_frames`` > 0 replaces the protocol's per-episode frame cap (a short evaluation; the
    result then says so). Raises :class:`ProtocolError` for a protocol the env cannot do.
    """
    if name not in PROTOCOLS:
        raise ProtocolError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {name!r}")
    if isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames < 0:
        raise ProtocolError(
            f"--max-frames must be an integer >= 0 (0: the protocol's own cap), got {max_frames!r}"
        )
    if trained.is_unity:
        raise ProtocolError(f"{trained.id}: evaluating Unity builds is not supported (gymnasium envs only)")
    if not trained.atari:
        if name != "train":
            raise ProtocolError(
                f"--protocol {name} is defined for Atari envs only; {trained.id} is not one (use --protocol "
                "train)"
            )
        return EvalProtocol(name, trained, None, None, max_frames or None, None)
    if not trained.preprocess and name != "train":
        raise ProtocolError(
            f"--protocol {name} needs the DeepMind preprocessing (no-op starts); {trained.id} was trained "
            "without it"
        )
    train_cfg = configured_settings(trained.id, trained.kwargs)
    assert train_cfg is not None
    kwargs = dict(trained.kwargs)
    if name == "machado":
        kwargs.update(
            repeat_action_probability=MACHADO_STICKY,
            full_action_space=True,
            noop_max=0,
            max_num_frames_per_episode=max_frames or FRAME_CAP,
            max_episode_steps=None,
        )
    elif name == "dqn":
        kwargs.update(
            repeat_action_probability=0.0,
            noop_max=DQN_NOOP_MAX,
            max_num_frames_per_episode=max_frames or FRAME_CAP,
            max_episode_steps=None,
        )
    elif max_frames:
        kwargs["max_num_frames_per_episode"] = max_frames
    env = EnvSpec(trained.id, kwargs, trained.preprocess, trained.packages)
    noop_max = int(kwargs.get("noop_max", DQN_NOOP_MAX)) if trained.preprocess else None
    cap = kwargs.get("max_num_frames_per_episode") or None
    return EvalProtocol(
        name, env, configured_settings(env.id, env.kwargs), noop_max, cap, train_cfg.full_action_space
    )


# ---------------------------------------------------------------------------
# In the worker: the network's actions on the env's action set, and the guard
# ---------------------------------------------------------------------------


def action_index_map(network_actions: Sequence[Any], env_actions: Sequence[Any]) -> np.ndarray:
    """For each network output i, the index in ``env_actions`` of the same ALE action.

    ``network_actions``: the ALE actions the network was trained on, in its output order (the
    minimal or the full set); ``env_actions``: the evaluation env's action set. Raises
    ``ValueError`` for an action the env cannot take.
    """
    env_list = list(env_actions)
    missing = [a for a in network_actions if a not in env_list]
    if missing:
        raise ValueError(
            f"the env's action set lacks {', '.join(map(str, missing))} that the network was trained to "
            "choose"
        )
    return np.array([env_list.index(a) for a in network_actions], dtype=np.int64)


class NetworkActions(gym.ActionWrapper):
    """Present the network's action set (``Discrete(len(index))``) on an env with a larger one."""

    def __init__(self, env: gym.Env, index: np.ndarray) -> None:
        super().__init__(env)
        self.index = np.asarray(index, dtype=np.int64)
        self.action_space = gym.spaces.Discrete(len(self.index))

    def action(self, action: Any) -> int:
        return int(self.index[int(action)])


def network_action_map(env: gym.Env, protocol: EvalProtocol) -> np.ndarray | None:
    """The map :class:`NetworkActions` needs for ``env`` under ``protocol``; None when the sets are the
    same."""
    ale = getattr(env.unwrapped, "ale", None)
    if (
        ale is None
        or protocol.expected is None
        or protocol.network_full_actions == protocol.expected.full_action_space
    ):
        return None
    if protocol.network_full_actions:
        raise ValueError("a network trained on the full action set cannot act on the minimal one")
    legal = (
        list(ale.getLegalActionSet())
        if protocol.expected.full_action_space
        else list(ale.getMinimalActionSet())
    )
    return action_index_map(list(ale.getMinimalActionSet()), legal)


def _find_wrapper_attr(env: gym.Env, name: str) -> Any:
    e: Any = env
    while e is not None:
        if name in vars(e):
            return vars(e)[name]
        e = getattr(e, "env", None)
    return None


def protocol_mismatches(env: gym.Env, fp: EnvFingerprint, protocol: EvalProtocol) -> list[Mismatch]:
    """Where the env a worker built (and measured as ``fp``) differs from ``protocol``.

    The fingerprint guard of the training actors (frame skip, sticky actions, action set,
    step limit) plus what only evaluation sets: the ALE's per-episode frame cap and the
    number of no-op starts, both read from the running env.
    """
    out = check_against_config(fp, protocol.expected)
    ale = getattr(env.unwrapped, "ale", None)
    cause = "the worker built its env from other settings than the protocol's"
    if protocol.expected is not None and ale is not None:
        cap = int(ale.getInt("max_num_frames_per_episode")) or None
        if cap != protocol.max_frames:
            out.append(Mismatch("max_frames_per_episode", str(protocol.max_frames), str(cap), cause))
        noop = _find_wrapper_attr(env, "noop_max")
        if protocol.noop_max is not None and noop != protocol.noop_max:
            out.append(Mismatch("noop_max", str(protocol.noop_max), str(noop), cause))
    return out


def check_protocol_env(
    env: gym.Env, protocol: EvalProtocol, *, steps: int = 300, seed: int = 0
) -> tuple[EnvFingerprint, list[Mismatch]]:
    """Measure ``env`` (random steps; reset it before use) and compare it with ``protocol``."""
    fp = measure_fingerprint(env, steps=steps, seed=seed)
    return fp, protocol_mismatches(env, fp, protocol)


def protocol_key(protocol: EvalProtocol) -> str:
    """A stable text key of what a worker builds (for per-process caches)."""
    return json.dumps({"name": protocol.name, "env": protocol.env.to_dict()}, sort_keys=True)
