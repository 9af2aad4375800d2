"""Atari environments: the classic gym ids and DeepMind preprocessing.

ale-py >= 0.11 stopped registering the ``Deterministic`` ids (ale-py CHANGELOG
0.11.1, PR #561), and its ``Pong-v4`` means a *stochastic* frameskip drawn from
{2, 3, 4}. A run configured with ``PongDeterministic-v4`` must get the classic
meaning, so we register those ids ourselves:

* ``{Game}Deterministic-v4``: frameskip 4 (3 for SpaceInvaders, whose lasers
  blink with period 4), ``repeat_action_probability`` 0.0, minimal action set,
  gym's ``max_episode_steps`` 100000.
* ``{Game}Deterministic-v0``: the same with sticky actions 0.25.

ale-py's own ids (``Pong-v4``, ``PongNoFrameskip-v4``, ``ALE/Pong-v5``) keep the
meanings ale-py gives them today.

Preprocessing (Mnih et al. 2015, as used by IMPALA): the action is repeated
``frameskip`` times with rewards summed and the last two frames max-pooled,
84x84 grayscale, a stack of 4 frames, up to 30 no-op actions at reset. The frame
skip is done here rather than inside the ALE so that the max-pool can see the
second-to-last frame; a stochastic skip ``(lo, hi)`` is drawn per step from
``[lo, hi)`` with the env's own generator, exactly as ale-py draws it. Sticky
actions stay inside the ALE, which applies them per emulator frame. Rewards are
*not* clipped here: the learner clips them, so episode returns stay true.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any

import gymnasium as gym
import numpy as np

CLASSIC_MAX_EPISODE_STEPS = 100_000
_ALE_ENTRY_POINT = "ale_py.env:AtariEnv"
_registered = False


def _classic_frameskip(game: str) -> int:
    # Gym used 3 for SpaceInvaders: with 4 the lasers are invisible (they blink every 4 frames).
    return 3 if game == "space_invaders" else 4


def register_classic_ids() -> None:
    """Register ale-py's ids plus the classic ``Deterministic`` ids. Idempotent."""
    global _registered
    if _registered:
        return
    import ale_py

    gym.register_envs(ale_py)
    pattern = re.compile(r"^([A-Za-z]+)-v4$")
    for env_id, spec in list(gym.registry.items()):
        match = pattern.match(env_id)
        if not match or spec.entry_point != _ALE_ENTRY_POINT:
            continue
        name = match.group(1)
        if name.endswith("NoFrameskip"):
            continue
        game = spec.kwargs["game"]
        for version, sticky in (("v4", 0.0), ("v0", 0.25)):
            new_id = f"{name}Deterministic-{version}"
            if new_id in gym.registry:
                continue
            gym.register(
                id=new_id,
                entry_point=_ALE_ENTRY_POINT,
                kwargs={
                    "game": game,
                    "obs_type": "rgb",
                    "frameskip": _classic_frameskip(game),
                    "repeat_action_probability": sticky,
                    "full_action_space": False,
                },
                max_episode_steps=CLASSIC_MAX_EPISODE_STEPS,
            )
    _registered = True


def is_atari(env_id: str) -> bool:
    """Whether ``env_id`` is an ALE game (classic ids registered here count)."""
    register_classic_ids()
    spec = gym.registry.get(env_id)
    return spec is not None and spec.entry_point == _ALE_ENTRY_POINT


class DeepMindAtari(gym.Wrapper):
    """Frame skip with max-pool, 84x84 grayscale, frame stack, no-op starts.

    Observation: uint8 ``[stack, 84, 84]``. ``frameskip`` is an int or a
    ``(lo, hi)`` pair meaning uniform in ``[lo, hi)``; the wrapped ALE env must
    itself have frameskip 1.
    """

    def __init__(
        self,
        env: gym.Env,
        *,
        frameskip: int | tuple[int, int],
        noop_max: int = 30,
        screen_size: int = 84,
        stack: int = 4,
    ) -> None:
        super().__init__(env)
        if getattr(env.unwrapped, "_frameskip", 1) != 1:
            raise ValueError("DeepMindAtari needs the underlying ALE env built with frameskip=1")
        if isinstance(frameskip, int):
            if frameskip < 1:
                raise ValueError(f"frameskip must be >= 1, got {frameskip}")
        else:
            lo, hi = frameskip
            if not 1 <= lo < hi:
                raise ValueError(f"frameskip range must satisfy 1 <= lo < hi, got {frameskip}")
        self.frameskip = frameskip
        self.noop_max = noop_max
        self.screen_size = screen_size
        self.stack = stack
        self.ale = env.unwrapped.ale
        self._action_set = env.unwrapped._action_set
        h, w = self.ale.getScreenDims()
        self._buffers = [np.empty((h, w), dtype=np.uint8), np.empty((h, w), dtype=np.uint8)]
        self._frames: deque[np.ndarray] = deque(maxlen=stack)
        self.observation_space = gym.spaces.Box(0, 255, (stack, screen_size, screen_size), np.uint8)

    def _skip(self) -> int:
        if isinstance(self.frameskip, int):
            return self.frameskip
        lo, hi = self.frameskip
        return int(self.env.unwrapped.np_random.integers(lo, hi))

    def _processed_frame(self, pooled: bool) -> np.ndarray:
        import cv2

        frame = self._buffers[0]
        if pooled:
            np.maximum(self._buffers[0], self._buffers[1], out=frame)
        return cv2.resize(frame, (self.screen_size, self.screen_size), interpolation=cv2.INTER_AREA)

    def _observation(self) -> np.ndarray:
        return np.stack(self._frames, axis=0)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        _, info = self.env.reset(seed=seed, options=options)
        if self.noop_max > 0:
            noops = int(self.env.unwrapped.np_random.integers(1, self.noop_max + 1))
            for _ in range(noops):
                _, _, terminated, truncated, info = self.env.step(0)
                if terminated or truncated:
                    _, info = self.env.reset()
        self.ale.getScreenGrayscale(self._buffers[0])
        frame = self._processed_frame(pooled=False)
        for _ in range(self.stack):
            self._frames.append(frame)
        return self._observation(), info

    def step(self, action: int):
        total_reward = 0.0
        terminated = truncated = False
        skip = self._skip()
        pooled = False
        # Drive the ALE directly: AtariEnv.step would build (and we would discard) an observation
        # and an info dict for every emulator frame, ~10-18% of an actor's time. Sticky actions
        # and the frame counter stay inside the ALE, so dynamics and fingerprint are unchanged.
        ale_action = self._action_set[action]
        for t in range(skip):
            total_reward += float(self.ale.act(ale_action))
            terminated = self.ale.game_over(with_truncation=False)
            truncated = self.ale.game_truncated()
            if t == skip - 2:
                self.ale.getScreenGrayscale(self._buffers[1])
            if terminated or truncated or t == skip - 1:
                self.ale.getScreenGrayscale(self._buffers[0])
                # Pool only when both of the last two frames of a full skip were seen.
                pooled = t == skip - 1 and skip >= 2
                break
        self._frames.append(self._processed_frame(pooled=pooled))
        return self._observation(), total_reward, terminated, truncated, {"lives": self.ale.lives()}


def make_atari(env_id: str, *, seed: int | None = None, preprocess: bool = True, **overrides: Any) -> gym.Env:
    """Build an Atari env with the registry's settings (plus ``overrides``).

    With ``preprocess`` the frame skip moves from the ALE into ``DeepMindAtari``
    (same dynamics, but the max-pool can see both frames); the registered
    ``max_episode_steps`` stays in agent steps. ``noop_max`` (default 30) sets the
    preprocessing's no-op starts; every other override goes to the ALE env (e.g.
    ``max_num_frames_per_episode``, the ALE's own cap in emulator frames).
    """
    register_classic_ids()
    spec = gym.registry[env_id]
    kwargs = {**spec.kwargs, **overrides}
    max_steps = kwargs.pop("max_episode_steps", spec.max_episode_steps)
    # noop_max belongs to the preprocessing (up to this many no-op actions at reset; 0: none), not to the ALE.
    noop_max = kwargs.pop("noop_max", 30)
    if not preprocess:
        if "noop_max" in overrides:
            raise TypeError(
                "noop_max is a setting of the DeepMind preprocessing; this env is built without it"
            )
        env = gym.make(
            env_id,
            max_episode_steps=max_steps,
            **{k: v for k, v in overrides.items() if k != "max_episode_steps"},
        )
        return env
    if isinstance(noop_max, bool) or not isinstance(noop_max, int) or noop_max < 0:
        raise ValueError(f"noop_max must be an integer >= 0, got {noop_max!r}")
    frameskip = kwargs.pop("frameskip", 1)
    if isinstance(frameskip, list):
        frameskip = tuple(frameskip)
    kwargs["frameskip"] = 1
    kwargs["obs_type"] = "grayscale"  # cheaper; DeepMindAtari reads the grayscale screen directly
    base = gym.make(env_id, max_episode_steps=None, disable_env_checker=True, **kwargs)
    # gym.make wraps in OrderEnforcing etc.; strip to the raw env so the wrapper owns stepping.
    env: gym.Env = DeepMindAtari(base.unwrapped, frameskip=frameskip, noop_max=noop_max)
    if max_steps is not None:
        env = gym.wrappers.TimeLimit(env, max_episode_steps=max_steps)
    if seed is not None:
        env.reset(seed=seed)
    return env


# Random-agent and human reference scores per game, for human-normalized scores
# ``(score - random) / (human - random)``. The standard table: Mnih et al. 2015 (Nature DQN) and
# van Hasselt et al. 2016 / Wang et al. 2016 for the games added later, as collected in Badia et
# al. 2020 (Agent57), Table H.1 - the numbers the PopArt-IMPALA paper's median/mean use.
# (random, human); keys are the ALE's game names without underscores.
ATARI_REFERENCE_SCORES: dict[str, tuple[float, float]] = {
    "alien": (227.8, 7127.7),
    "amidar": (5.8, 1719.5),
    "assault": (222.4, 742.0),
    "asterix": (210.0, 8503.3),
    "asteroids": (719.1, 47388.7),
    "atlantis": (12850.0, 29028.1),
    "bankheist": (14.2, 753.1),
    "battlezone": (2360.0, 37187.5),
    "beamrider": (363.9, 16926.5),
    "berzerk": (123.7, 2630.4),
    "bowling": (23.1, 160.7),
    "boxing": (0.1, 12.1),
    "breakout": (1.7, 30.5),
    "centipede": (2090.9, 12017.0),
    "choppercommand": (811.0, 7387.8),
    "crazyclimber": (10780.5, 35829.4),
    "defender": (2874.5, 18688.9),
    "demonattack": (152.1, 1971.0),
    "doubledunk": (-18.6, -16.4),
    "enduro": (0.0, 860.5),
    "fishingderby": (-91.7, -38.7),
    "freeway": (0.0, 29.6),
    "frostbite": (65.2, 4334.7),
    "gopher": (257.6, 2412.5),
    "gravitar": (173.0, 3351.4),
    "hero": (1027.0, 30826.4),
    "icehockey": (-11.2, 0.9),
    "jamesbond": (29.0, 302.8),
    "kangaroo": (52.0, 3035.0),
    "krull": (1598.0, 2665.5),
    "kungfumaster": (258.5, 22736.3),
    "montezumarevenge": (0.0, 4753.3),
    "mspacman": (307.3, 6951.6),
    "namethisgame": (2292.3, 8049.0),
    "phoenix": (761.4, 7242.6),
    "pitfall": (-229.4, 6463.7),
    "pong": (-20.7, 14.6),
    "privateeye": (24.9, 69571.3),
    "qbert": (163.9, 13455.0),
    "riverraid": (1338.5, 17118.0),
    "roadrunner": (11.5, 7845.0),
    "robotank": (2.2, 11.9),
    "seaquest": (68.4, 42054.7),
    "skiing": (-17098.1, -4336.9),
    "solaris": (1236.3, 12326.7),
    "spaceinvaders": (148.0, 1668.7),
    "stargunner": (664.0, 10250.0),
    "surround": (-10.0, 6.5),
    "tennis": (-23.8, -8.3),
    "timepilot": (3568.0, 5229.2),
    "tutankham": (11.4, 167.6),
    "upndown": (533.4, 11693.2),
    "venture": (0.0, 1187.5),
    "videopinball": (0.0, 17667.9),
    "wizardofwor": (563.5, 4756.5),
    "yarsrevenge": (3092.9, 54576.9),
    "zaxxon": (32.5, 9173.3),
}


def atari_game(env_id: str) -> str | None:
    """The ALE game an Atari id plays (``PongDeterministic-v4`` -> ``pong``), None for other ids."""
    register_classic_ids()
    spec = gym.registry.get(env_id)
    if spec is None or spec.entry_point != _ALE_ENTRY_POINT:
        return None
    return str(spec.kwargs.get("game", "")).replace("_", "").lower() or None


def human_normalized_score(env_id: str, score: float) -> float | None:
    """``(score - random) / (human - random)`` for an Atari id with reference scores, else None."""
    game = atari_game(env_id)
    if game is None or game not in ATARI_REFERENCE_SCORES:
        return None
    random, human = ATARI_REFERENCE_SCORES[game]
    return (score - random) / (human - random)
