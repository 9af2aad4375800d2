"""PPOConfig: every ML-Agents-vs-SB3 difference as its own option (docs/PPO.md).

Usage::

    cfg = PPOConfig.preset("mlagents")                     # left column everywhere
    cfg = PPOConfig.preset("sb3", ratio="per_dim")         # right column, one row swapped
    cfg = from_mlagents_yaml("configs/Crawler.yaml")       # an ML-Agents trainer config
    parser = argparse.ArgumentParser(); config_to_argparse(parser)
    cfg = config_from_args(parser.parse_args())            # any option from the command line

The config is frozen and validated once, in ``__post_init__``; use
``dataclasses.replace`` (or ``preset(..., **overrides)``) to derive another.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import random
import warnings
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

from impala.algos import ppo
from impala.options import ConfigError, add_flags, check_fields, given_flags, read_yaml
from impala.options import option as _f
from impala.run.config import RunConfig

SEMANTICS = ("mlagents", "sb3")


@dataclass(frozen=True)
class PPOConfig:
    """PPO options. Defaults are the ``mlagents`` preset (ML-Agents' own defaults).

    Row numbers (#n) refer to docs/PPO.md. Field docs follow below.
    """

    # ------------------------------------------------------------- semantics
    advantage_norm: Literal["buffer", "minibatch", "none"] = _f(
        "buffer",
        "#1. 'buffer': once per update over the whole buffer, population std, +1e-10 (ML-Agents). "
        "'minibatch': per minibatch of more than 1 sample, unbiased std, +1e-8 (SB3). 'none': raw "
        "advantages.",
    )
    ratio: Literal["per_dim", "summed"] = _f(
        "per_dim",
        "#2. 'per_dim': probability ratio per action dimension, shape (B, A), advantage broadcast "
        "(ML-Agents). "
        "'summed': log-probs summed over dimensions, ratio shape (B,) (SB3).",
    )
    value_loss: Literal["mlagents", "mlagents_intended", "mse", "sb3_clipped"] = _f(
        "mlagents",
        "#3. 'mlagents': what ML-Agents 0.28 computes, mean(max((R-V)^2, (R-Vc)^2)) with "
        "Vc = R + clamp(V-R, +-eps) = mean((R-V)^2): its buffer key for the old value estimates is the "
        "returns key (trainers/buffer.py RewardSignalUtil.value_estimates_key == returns_key; "
        "Unity-Technologies/ml-agents#6281), so the clip is centred on the returns and never binds; "
        "numerically the same as 'mse'. 'mlagents_intended': the clip as ML-Agents writes it, "
        "Vc = V_old + clamp(V-V_old, +-eps) around the values from when the trajectory was processed, "
        "eps the decayed policy epsilon. 'mse': mse(R, V) (SB3 default). "
        "'sb3_clipped': mse(R, V_old + clamp(V-V_old, +-clip_range_vf)), no max. All times vf_coef.",
    )
    clip_range_vf: float | None = _f(
        None, "#3. Value clip for value_loss='sb3_clipped' (required there, must be None otherwise)."
    )
    entropy_reduce: Literal["mean", "sum"] = _f(
        "mean",
        "#4. Reduce per-dimension Gaussian entropy over action dims by 'mean' (ML-Agents) or 'sum' (SB3).",
    )
    log_prob_form: Literal["mlagents", "exact"] = _f(
        "mlagents",
        "#9. 'mlagents': -(x-mu)^2/(2 sigma^2+1e-7) - log(sigma+1e-7) - log(sqrt(2 pi)), entropy "
        "0.5 log(2 pi e sigma^2 + 1e-7). 'exact': torch.distributions.Normal (SB3).",
    )
    lr_schedule: Literal["linear", "constant"] = _f(
        "linear", "#6. Learning-rate schedule over max_steps agent steps: 'linear' decays to lr_floor."
    )
    epsilon_schedule: Literal["linear", "constant"] = _f(
        "linear", "#6. Clip-epsilon schedule (ML-Agents follows lr_schedule unless set; SB3 constant)."
    )
    beta_schedule: Literal["linear", "constant"] = _f(
        "linear", "#6. Entropy-coefficient schedule (ML-Agents follows lr_schedule unless set; SB3 constant)."
    )
    lr_floor: float = _f(
        ppo.MLAGENTS_LR_FLOOR, "#6. Value the linear lr schedule ends at (ML-Agents 1e-10, SB3 0)."
    )
    epsilon_floor: float = _f(
        ppo.MLAGENTS_EPSILON_FLOOR, "#6. Value the linear epsilon schedule ends at (ML-Agents 0.1, SB3 0)."
    )
    beta_floor: float = _f(
        ppo.MLAGENTS_BETA_FLOOR, "#6. Value the linear beta schedule ends at (ML-Agents 1e-5, SB3 0)."
    )
    max_grad_norm: float | None = _f(
        None, "#7. Global grad-norm clip; None = no clipping (ML-Agents), SB3 0.5."
    )
    adam_eps: float = _f(1e-8, "#7. Adam epsilon: torch default 1e-8 (ML-Agents), 1e-5 (SB3).")
    target_kl: float | None = _f(
        None,
        "#7. Stop the update's epochs when a minibatch's approx_kl > 1.5 * target_kl (SB3); None = never.",
    )
    update_trigger: Literal["over_buffer_size", "buffer_full"] = _f(
        "over_buffer_size",
        "#8. 'over_buffer_size': update once the buffer holds MORE than buffer_size steps (ML-Agents; whole "
        "trajectories so the size varies). 'buffer_full': at buffer_size steps = n_steps * n_envs (SB3).",
    )
    minibatch_remainder: Literal["drop", "keep"] = _f(
        "drop", "#8. Per epoch, 'drop' the last partial minibatch (ML-Agents) or 'keep' it (SB3)."
    )
    action_clip: Literal["mlagents", "bounds"] = _f(
        "mlagents",
        "#10. Env receives clamp(a, -3, 3) / 3 ('mlagents') or clip(a, low, high) ('bounds', SB3).",
    )
    init: Literal["mlagents", "sb3"] = _f(
        "mlagents",
        "#11. 'mlagents': kaiming_normal(linear) x gain (hidden 1.0, mean head 0.2), value head "
        "Xavier-uniform. "
        "'sb3': orthogonal, sqrt(2) / 0.01 / 1. Zero biases in both.",
    )
    activation: Literal["swish", "tanh", "relu"] = _f(
        "swish", "#11. Hidden activation: swish/SiLU (ML-Agents), tanh (SB3)."
    )
    vis_encode_type: Literal["simple", "nature_cnn", "resnet", "sb3_nature_cnn"] = _f(
        "simple",
        "#11. Encoder of each image sensor: ML-Agents' 'simple', 'nature_cnn' or 'resnet' (dense layer of "
        "hidden_units), or SB3's NatureCNN 'sb3_nature_cnn' (512 features; 256 beside other sensors). "
        "Vector-only envs ignore it.",
    )
    obs_norm: Literal["mlagents", "vecnormalize", "none"] = _f(
        "mlagents",
        "#12. 'mlagents': in-network normalizer per body, raw obs in the buffer, updated per trajectory "
        "before that trajectory's values (a piece spanning an episode end: part by part), step count in "
        "int64. "
        "'vecnormalize': SB3 RunningMeanStd, clip 10, normalized obs in the buffer. 'none'.",
    )
    reward_norm: bool = _f(
        False, "#12. VecNormalize reward scaling by the discounted-return std (SB3 True, ML-Agents False)."
    )
    gae_form: Literal["mlagents", "sb3"] = _f(
        "mlagents",
        "#13. 'mlagents': values recomputed by the current network when a trajectory is ingested, GAE per "
        "episode segment with a value_next bootstrap. 'sb3': values from action time (when sent), "
        "episode-start "
        "masks, truncation bootstrap folded into the reward.",
    )
    bootstrap_truncated: bool = _f(
        True,
        "#14. Bootstrap from V(final obs) when an episode is truncated/interrupted (both libraries: True).",
    )
    trajectory_handling: Literal["mlagents", "rollout"] = _f(
        "mlagents",
        "#15. 'mlagents': the learner keeps each env stream's (agent's) steps until its trajectory is "
        "complete, "
        "at an episode end or time_horizon steps after the trajectory's own start (ML-Agents' "
        "AgentProcessor); "
        "an unfinished trajectory waits across updates with the log-probs from action time, and is processed "
        "(normalizer, values and GAE with the critic of that moment, schedule step count) when complete; "
        "unrolls collected with older weights are kept. The unroll is then only the transport unit. "
        "'rollout': each unroll is processed when it arrives, cut on the unroll grid; with --max-policy-lag "
        "0 "
        "an unroll collected before the newest weights is dropped (SB3's fixed on-policy rollouts).",
    )

    # ------------------------------------------------------- hyperparameters
    batch_size: int = _f(1024, "Minibatch size in steps (ML-Agents batch_size, SB3 batch_size).")
    buffer_size: int = _f(10240, "Steps per update (ML-Agents buffer_size; SB3 n_steps * n_envs).")
    learning_rate: float = _f(3e-4, "Initial Adam learning rate.")
    beta: float = _f(5e-3, "Initial entropy coefficient (ML-Agents beta, SB3 ent_coef).")
    epsilon: float = _f(0.2, "Initial PPO clip range (ML-Agents epsilon, SB3 clip_range).")
    lambd: float = _f(0.95, "GAE lambda (ML-Agents lambd, SB3 gae_lambda).")
    num_epoch: int = _f(3, "Passes over the buffer per update (ML-Agents num_epoch, SB3 n_epochs).")
    hidden_units: int = _f(128, "Width of every hidden layer (ML-Agents hidden_units; SB3 net_arch width).")
    num_layers: int = _f(2, "Hidden layers per body (ML-Agents num_layers; SB3 net_arch depth).")
    gamma: float = _f(0.99, "Discount (ML-Agents reward_signals.extrinsic.gamma).")
    time_horizon: int = _f(
        64,
        "Longest trajectory: trajectory_handling='mlagents' cuts an agent's trajectory this many steps after "
        "its "
        "start (ML-Agents time_horizon); 'rollout' sends unrolls of this length by default (SB3 n_steps).",
    )
    max_steps: int = _f(500_000, "Total agent steps of the run; the schedules decay over it.")
    vf_coef: float = _f(0.5, "Value-loss coefficient (0.5 in both libraries).")
    seed: int = _f(0, "Seed for network init and minibatch shuffling.")

    def __post_init__(self) -> None:
        check_fields(self, label=lambda name: f"{name}:")
        if self.value_loss == "sb3_clipped" and self.clip_range_vf is None:
            raise ConfigError(
                "clip_range_vf: required when value_loss='sb3_clipped' (e.g. clip_range_vf=0.2)"
            )
        if self.value_loss != "sb3_clipped" and self.clip_range_vf is not None:
            raise ConfigError(
                f"clip_range_vf: only used by value_loss='sb3_clipped' (value_loss is {self.value_loss!r}); "
                "set value_loss='sb3_clipped' or clip_range_vf=None"
            )
        for name in (
            "batch_size",
            "buffer_size",
            "num_epoch",
            "hidden_units",
            "num_layers",
            "time_horizon",
            "max_steps",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("learning_rate", "epsilon", "adam_eps"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("beta", "vf_coef", "lr_floor", "epsilon_floor", "beta_floor"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("gamma", "lambd"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name}: must be in [0, 1], got {getattr(self, name)}")
        for name in ("max_grad_norm", "target_kl", "clip_range_vf"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ConfigError(f"{name}: must be > 0 or None, got {v}")
        if self.batch_size > self.buffer_size:
            raise ConfigError(
                f"batch_size: {self.batch_size} is larger than buffer_size {self.buffer_size}; "
                "lower batch_size or raise buffer_size"
            )
        if self.minibatch_remainder == "keep" and self.buffer_size % self.batch_size == 1:
            warnings.warn(
                f"buffer_size={self.buffer_size} leaves a last minibatch of 1 sample: its advantages are not "
                "normalized and it can make training unstable (SB3 warns the same); pick a batch_size "
                "dividing it",
                stacklevel=3,
            )

    # --------------------------------------------------------------- presets
    @classmethod
    def preset(cls, semantics: str, **overrides: Any) -> "PPOConfig":
        """'mlagents' = left column of docs/PPO.md everywhere, 'sb3' = right column.

        Hyperparameters default to each library's own defaults. Any field can be
        overridden. As in ML-Agents, when ``lr_schedule`` is overridden and
        ``epsilon_schedule`` / ``beta_schedule`` are not, the mlagents preset
        lets them follow it.
        """
        if semantics not in SEMANTICS:
            raise ConfigError(f"semantics: must be one of {SEMANTICS}, got {semantics!r}")
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown PPOConfig option (known: {', '.join(field_names())})")
        base = dict(_PRESETS[semantics])
        if semantics == "mlagents" and "lr_schedule" in overrides:
            base["epsilon_schedule"] = base["beta_schedule"] = overrides["lr_schedule"]
        base.update(overrides)
        return cls(**base)

    @property
    def update_steps(self) -> int:
        """#8: buffer steps that trigger an update: more than buffer_size (ML-Agents' 'over_buffer_size'),
        or buffer_size (SB3's 'buffer_full'). The learner's trigger, and what on-policy actors count to."""
        return self.buffer_size + (1 if self.update_trigger == "over_buffer_size" else 0)

    @property
    def field_docs(self) -> dict[str, str]:
        return {f.name: f.metadata["help"] for f in dataclasses.fields(self)}


_PRESETS: dict[str, dict[str, Any]] = {
    "mlagents": {f.name: f.default for f in dataclasses.fields(PPOConfig)},
    "sb3": dict(
        advantage_norm="minibatch",
        ratio="summed",
        value_loss="mse",
        clip_range_vf=None,
        entropy_reduce="sum",
        log_prob_form="exact",
        lr_schedule="constant",
        epsilon_schedule="constant",
        beta_schedule="constant",
        lr_floor=0.0,
        epsilon_floor=0.0,
        beta_floor=0.0,
        max_grad_norm=0.5,
        adam_eps=1e-5,
        target_kl=None,
        update_trigger="buffer_full",
        minibatch_remainder="keep",
        action_clip="bounds",
        init="sb3",
        activation="tanh",
        vis_encode_type="sb3_nature_cnn",
        obs_norm="vecnormalize",
        reward_norm=True,
        gae_form="sb3",
        bootstrap_truncated=True,
        trajectory_handling="rollout",
        # SB3 PPO defaults (n_steps 2048, one env).
        batch_size=64,
        buffer_size=2048,
        learning_rate=3e-4,
        beta=0.0,
        epsilon=0.2,
        lambd=0.95,
        num_epoch=10,
        hidden_units=64,
        num_layers=2,
        gamma=0.99,
        time_horizon=2048,
        max_steps=1_000_000,
        vf_coef=0.5,
        seed=0,
    ),
}


def field_names() -> list[str]:
    """PPOConfig's option names, in declaration order."""
    return [f.name for f in dataclasses.fields(PPOConfig)]


def _append_field_docs() -> None:
    lines = ["", "    Fields:"]
    for f in dataclasses.fields(PPOConfig):
        lines.append(f"      {f.name}: {f.metadata['help']}")
    PPOConfig.__doc__ = (PPOConfig.__doc__ or "") + "\n".join(lines) + "\n"


_append_field_docs()


# ------------------------------------------------------------ ML-Agents YAML
#
# Every key of an ML-Agents 0.28 trainer config (mlagents/trainers/settings.py, RunOptions) is read here and
# either honoured (a PPOConfig field, or a launch option the file sets as if given by --config) or refused
# with one line naming the key and why. Keys this trainer has no use for are accepted only at ML-Agents'
# own default (what a configuration.yaml written by mlagents-learn holds), since that value asks for
# nothing this trainer lacks.

# hyperparameters key -> PPOConfig field
_HYPER_KEYS = {
    "batch_size": "batch_size",
    "buffer_size": "buffer_size",
    "learning_rate": "learning_rate",
    "beta": "beta",
    "epsilon": "epsilon",
    "lambd": "lambd",
    "num_epoch": "num_epoch",
    "learning_rate_schedule": "lr_schedule",
    "beta_schedule": "beta_schedule",
    "epsilon_schedule": "epsilon_schedule",
}
_NETWORK_KEYS = {"normalize", "hidden_units", "num_layers", "vis_encode_type"}
# ML-Agents' EncoderType values this trainer builds (impala/nets/visual.py) and the ones it refuses.
_VIS_ENCODE_TYPES = ("simple", "nature_cnn", "resnet")
_REFUSED_VIS_ENCODE_TYPES = ("match3", "fully_connected")
_BEHAVIOR_KEYS = {
    "trainer_type",
    "hyperparameters",
    "network_settings",
    "reward_signals",
    "max_steps",
    "time_horizon",
}
# key -> (the one value accepted: ML-Agents' default, why any other is refused)
_HYPER_ONLY_DEFAULT = {"shared_critic": (False, "this trainer keeps separate actor and critic networks")}
_NETWORK_ONLY_DEFAULT = {
    "memory": (None, "recurrent policies (LSTM memory) are not supported; remove the memory section"),
    "goal_conditioning_type": ("hyper", "goal signals are not supported"),
    "deterministic": (
        False,
        "deterministic actions are not supported: actors sample from the policy, as mlagents-learn does "
        "by default",
    ),
}
_BEHAVIOR_ONLY_DEFAULT = {
    "even_checkpoints": (False, "checkpoints are written every checkpoint_interval steps"),
    "threaded": (False, "actors wait while the learner updates (ML-Agents' threaded: false)"),
    "init_path": (None, "start from another run's weights with --initialize-from RUN"),
    "self_play": (None, "self-play (ghost trainers) is not supported"),
    "behavioral_cloning": (None, "behavioral cloning from demonstrations is not supported"),
}
_REFUSED_TRAINERS = {
    "sac": "SAC is not implemented; launch_ppo trains PPO (trainer_type: ppo)",
    "poca": "MA-POCA (multi-agent cooperative) is not implemented; launch_ppo trains PPO (trainer_type: ppo)",
}
_REFUSED_SIGNALS = {
    "curiosity": "the curiosity reward signal is not supported; only extrinsic is",
    "gail": "the GAIL reward signal is not supported; only extrinsic is",
    "rnd": "the RND reward signal is not supported; only extrinsic is",
}
# behaviour key -> launch option (summary_freq, checkpoint_interval in agent steps)
_BEHAVIOR_RUN_KEYS = {
    "summary_freq": "summary_freq",
    "checkpoint_interval": "checkpoint_interval",
    "keep_checkpoints": "keep_checkpoints",
}
# section -> key -> (launch option, kind); null values leave the option as it is
_RUN_SECTIONS: dict[str, dict[str, tuple[str, Any]]] = {
    "env_settings": {
        "env_path": ("env", str),
        "env_args": ("env_args", list),
        "base_port": ("unity_base_port", int),
        "num_envs": ("workers", int),
        "seed": ("seed", int),
    },
    "engine_settings": {
        "width": ("width", int),
        "height": ("height", int),
        "quality_level": ("quality_level", int),
        "time_scale": ("time_scale", float),
        "target_frame_rate": ("target_frame_rate", int),
        "capture_frame_rate": ("capture_frame_rate", int),
        "no_graphics": ("graphics", "negated"),
    },
    "checkpoint_settings": {
        "run_id": ("run_id", str),
        "initialize_from": ("initialize_from", str),
        "resume": ("resume", bool),
        "load_model": ("resume", "or"),  # ML-Agents' deprecated name: resume = resume or load_model
        "force": ("force", bool),
        "inference": ("inference", bool),
        "results_dir": ("runs_dir", str),
        "train_model": (None, bool),  # deprecated in ML-Agents 0.28 and without effect there too
    },
    "torch_settings": {"device": ("device", str)},
}
_RUN_ONLY_DEFAULT = {
    "env_settings": {
        "num_areas": (1, "training areas per instance are the build's own; num_areas must be 1"),
        "max_lifetime_restarts": (10, "a dead actor (and its Unity instance) is restarted without a limit"),
        "restarts_rate_limit_n": (1, "a dead actor (and its Unity instance) is restarted without a limit"),
        "restarts_rate_limit_period_s": (
            60,
            "a dead actor (and its Unity instance) is restarted without a limit",
        ),
    }
}
_TOP_KEYS = {"behaviors", "default_settings", "environment_parameters", "debug", *_RUN_SECTIONS}
# ML-Agents defaults for keys the file may omit (mlagents/trainers/settings.py).
_MLAGENTS_DEFAULTS = {
    "batch_size": 1024,
    "buffer_size": 10240,
    "learning_rate": 3e-4,
    "beta": 5e-3,
    "epsilon": 0.2,
    "lambd": 0.95,
    "num_epoch": 3,
    "learning_rate_schedule": "linear",
    "normalize": False,
    "hidden_units": 128,
    "num_layers": 2,
    "gamma": 0.99,
    "max_steps": 500_000,
    "time_horizon": 64,
}
MLAGENTS_RANDOM_SEED = -1  # env_settings.seed: -1 asks for a random seed in 0..9999, as mlagents-learn does


@dataclass(frozen=True)
class MLAgentsTrainerFile:
    """An ML-Agents trainer YAML, read: the behaviour to train and the launch options the file sets.

    ``settings``: that behaviour's settings with ``default_settings`` merged under them (ML-Agents'
    ``deep_update_dict``: nested sections merge key by key, anything else is replaced). ``run``: launch
    options (``RunConfig`` / ``launch_ppo`` option names) from ``env_settings``, ``engine_settings``,
    ``checkpoint_settings``, ``torch_settings``, ``debug`` and the behaviour's ``summary_freq``,
    ``checkpoint_interval``, ``keep_checkpoints`` and ``reward_signals.extrinsic.strength``.
    """

    path: str
    behavior: Optional[str]  # None: the file has only default_settings, which any behaviour takes
    settings: dict
    run: dict

    @property
    def root(self) -> str:
        return f"behaviors.{self.behavior}" if self.behavior else "default_settings"


def _deep_update(d: dict, update: dict) -> None:
    """ML-Agents' ``deep_update_dict``: mappings merge key by key, any other value replaces."""
    for key, val in update.items():
        if key in d and isinstance(d[key], dict) and isinstance(val, dict):
            _deep_update(d[key], val)
        else:
            d[key] = copy.deepcopy(val)


def _mapping(value: Any, path: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
    return value


def _number(value: Any, path: str, kind: type) -> Any:
    if kind is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # ML-Agents files write max_steps as 1.0e7
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if isinstance(value, str):
        try:  # PyYAML (YAML 1.1) reads 3e-4 (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    return float(value)


def _only_default(value: Any, path: str, default: Any, why: str) -> None:
    if value != default or type(value) is not type(default):
        raise ConfigError(f"{path}: {value!r} is not supported ({why}); only {default!r} is")


def _typed(value: Any, path: str, kind: Any) -> Any:
    if kind in (int, float):
        return _number(value, path, kind)
    if kind in (bool, "negated", "or"):
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if kind is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{path}: expected a list of strings, got {value!r}")
        return tuple(value)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{path}: expected a non-empty string, got {value!r}")
    return value


def _run_sections(doc: dict) -> dict[str, Any]:
    """The launch options set by the file's env, engine, checkpoint and torch settings and ``debug``."""
    run: dict[str, Any] = {}
    for section, keys in _RUN_SECTIONS.items():
        only_default = _RUN_ONLY_DEFAULT.get(section, {})
        for key, value in _mapping(doc.get(section), section).items():
            path = f"{section}.{key}"
            if key in only_default:
                _only_default(value, path, *only_default[key])
                continue
            if key not in keys:
                raise ConfigError(f"{path}: unknown key (known: {', '.join([*keys, *only_default])})")
            if value is None:
                continue
            option_name, kind = keys[key]
            value = _typed(value, path, kind)
            if option_name is None:
                continue
            if kind == "negated":
                value = not value
            if kind == "or":
                run[option_name] = run.get(option_name, False) or value
                continue
            if key == "seed" and value == MLAGENTS_RANDOM_SEED:
                value = random.randrange(10_000)
            run[option_name] = value
    debug = doc.get("debug")
    if debug is not None:
        if _typed(debug, "debug", bool):
            run["log_level"] = "DEBUG"
    if doc.get("environment_parameters") is not None:
        raise ConfigError(
            "environment_parameters: not supported (curricula and environment parameter sampling); the "
            "build's own values apply"
        )
    return run


def read_mlagents_yaml(path: str, behavior: str | None = None) -> MLAgentsTrainerFile:
    """Read an ML-Agents trainer config: every key honoured or refused (:class:`ConfigError` naming the key
    path and why). ``behavior`` picks one of several behaviours; a file with several and no ``behavior`` is
    refused (one learner per run)."""
    doc = _mapping(read_yaml(path, "--trainer-config"), "<top level>")
    for key in doc:
        if key not in _TOP_KEYS:
            raise ConfigError(f"{key}: unknown key")
    run = _run_sections(doc)
    defaults = doc.get("default_settings")
    behaviors = _mapping(doc.get("behaviors"), "behaviors")
    if defaults is not None:
        _mapping(defaults, "default_settings")
    if not behaviors and defaults is None:
        raise ConfigError(
            "behaviors: missing or empty (and no default_settings); expected "
            "behaviors.<BehaviorName>.trainer_type etc."
        )
    if behavior is None and len(behaviors) > 1:
        raise ConfigError(
            f"behaviors: the file has {len(behaviors)} behaviours ({', '.join(map(str, behaviors))}); "
            "launch_ppo trains one per run: pass --behavior NAME (one run per behaviour)"
        )
    if behavior is None and behaviors:
        behavior = next(iter(behaviors))
    if behavior is not None and behavior not in behaviors and defaults is None:
        raise ConfigError(f"behaviors.{behavior}: not in the file (has: {', '.join(map(str, behaviors))})")
    settings: dict = copy.deepcopy(defaults) if defaults is not None else {}
    if behavior is not None and behavior in behaviors:
        _deep_update(settings, _mapping(behaviors[behavior], f"behaviors.{behavior}"))
    file = MLAgentsTrainerFile(
        path, behavior if behavior in behaviors else None, settings, run
    )  # a name only default_settings serves is the build's, not the file's
    run.update(_behavior_run_options(file))
    return file


def _behavior_run_options(file: MLAgentsTrainerFile) -> dict[str, Any]:
    """The behaviour's own run settings: log and checkpoint intervals, kept checkpoints, reward strength."""
    root, b = file.root, file.settings
    out: dict[str, Any] = {}
    for key, option_name in _BEHAVIOR_RUN_KEYS.items():
        if b.get(key) is not None:
            out[option_name] = _number(b[key], f"{root}.{key}", int)
    ext = _mapping(_mapping(b.get("reward_signals"), f"{root}.reward_signals").get("extrinsic"), "")
    if ext.get("strength") is not None:
        out["extrinsic_strength"] = _number(
            ext["strength"], f"{root}.reward_signals.extrinsic.strength", float
        )
    return out


def from_mlagents_yaml(
    path: str, behavior: str | None = None, semantics: str = "mlagents", **overrides: Any
) -> PPOConfig:
    """Read an ML-Agents trainer config (``behaviors.<name>...``) into a PPOConfig.

    Values in the file override the ``semantics`` preset; keys the file omits
    take ML-Agents' defaults (so ``normalize`` missing means no obs
    normalization, as in mlagents-learn). ``network_settings.normalize: true``
    selects the preset's normalizer ('mlagents' or, for sb3 semantics,
    'vecnormalize'). ``overrides`` win over everything. The file's run settings
    (:func:`read_mlagents_yaml`) are checked too; launch_ppo applies them.

    Raises ConfigError naming the key path for unknown, malformed or unsupported keys.
    """
    return ppo_config_from_file(read_mlagents_yaml(path, behavior), semantics, **overrides)


def _check_behavior_keys(root: str, b: Mapping[str, Any]) -> None:
    """A behaviour's own keys: each known (or at its only supported value), and a PPO trainer."""
    for key, value in b.items():
        if key in _BEHAVIOR_ONLY_DEFAULT:
            _only_default(value, f"{root}.{key}", *_BEHAVIOR_ONLY_DEFAULT[key])
        elif key not in _BEHAVIOR_KEYS and key not in _BEHAVIOR_RUN_KEYS:
            raise ConfigError(f"{root}.{key}: unknown key")
    trainer_type = b.get("trainer_type", "ppo")
    if trainer_type in _REFUSED_TRAINERS:
        raise ConfigError(f"{root}.trainer_type: {trainer_type}: {_REFUSED_TRAINERS[trainer_type]}")
    if trainer_type != "ppo":
        raise ConfigError(f"{root}.trainer_type: must be 'ppo', got {trainer_type!r}")


def _hyperparameter_values(root: str, b: Mapping[str, Any]) -> dict[str, Any]:
    """The values of a behaviour's ``hyperparameters``, each checked, by their ML-Agents key."""
    vals: dict[str, Any] = {}
    hp = _mapping(b.get("hyperparameters"), f"{root}.hyperparameters")
    for key, value in hp.items():
        p = f"{root}.hyperparameters.{key}"
        if key in _HYPER_ONLY_DEFAULT:
            _only_default(value, p, *_HYPER_ONLY_DEFAULT[key])
        elif key not in _HYPER_KEYS:
            raise ConfigError(f"{p}: unknown key")
        elif key.endswith("_schedule"):
            if value not in ("linear", "constant"):
                raise ConfigError(f"{p}: must be 'linear' or 'constant', got {value!r}")
            vals[key] = value
        else:
            vals[key] = _number(value, p, int if key in ("batch_size", "buffer_size", "num_epoch") else float)
    return vals


def _network_values(root: str, b: Mapping[str, Any]) -> dict[str, Any]:
    """The values of a behaviour's ``network_settings``, each checked, by their ML-Agents key."""
    vals: dict[str, Any] = {}
    net = _mapping(b.get("network_settings"), f"{root}.network_settings")
    for key, value in net.items():
        p = f"{root}.network_settings.{key}"
        if key in _NETWORK_ONLY_DEFAULT:
            _only_default(value, p, *_NETWORK_ONLY_DEFAULT[key])
        elif key not in _NETWORK_KEYS:
            raise ConfigError(f"{p}: unknown key")
        elif key == "normalize":
            if not isinstance(value, bool):
                raise ConfigError(f"{p}: expected true or false, got {value!r}")
            vals[key] = value
        elif key == "vis_encode_type":
            if value in _REFUSED_VIS_ENCODE_TYPES:
                raise ConfigError(
                    f"{p}: {value!r} is not built here; use one of {', '.join(_VIS_ENCODE_TYPES)}"
                )
            if value not in _VIS_ENCODE_TYPES:
                raise ConfigError(f"{p}: must be one of {', '.join(_VIS_ENCODE_TYPES)}, got {value!r}")
            vals[key] = value
        else:
            vals[key] = _number(value, p, int)
    return vals


def _reward_signal_values(root: str, b: Mapping[str, Any]) -> dict[str, Any]:
    """The extrinsic reward signal's gamma; any other signal, or none, is refused with its key path."""
    vals: dict[str, Any] = {}
    if "reward_signals" in b:
        rs = _mapping(b.get("reward_signals"), f"{root}.reward_signals")
        for key in rs:
            if key in _REFUSED_SIGNALS:
                raise ConfigError(f"{root}.reward_signals.{key}: {_REFUSED_SIGNALS[key]}")
            if key != "extrinsic":
                raise ConfigError(f"{root}.reward_signals.{key}: unknown reward signal; only 'extrinsic' is")
        if "extrinsic" not in rs:
            raise ConfigError(f"{root}.reward_signals: no extrinsic signal: nothing to train on")
    ext = _mapping(_mapping(b.get("reward_signals"), "").get("extrinsic"), f"{root}.reward_signals.extrinsic")
    for key, value in ext.items():
        p = f"{root}.reward_signals.extrinsic.{key}"
        if key == "gamma":
            vals["gamma"] = _number(value, p, float)
        elif key == "strength":
            if _number(value, p, float) < 0:
                raise ConfigError(f"{p}: must be >= 0, got {value!r}")
        elif key == "network_settings":
            if value is not None:
                _mapping(value, p)  # ML-Agents' extrinsic signal has no network: its settings change nothing
        else:
            raise ConfigError(f"{p}: unknown key")
    return vals


def ppo_config_from_file(
    file: MLAgentsTrainerFile, semantics: str = "mlagents", **overrides: Any
) -> PPOConfig:
    """The PPOConfig of a read trainer file's behaviour (see :func:`from_mlagents_yaml`)."""
    root, b = file.root, file.settings
    _check_behavior_keys(root, b)
    vals = {**_hyperparameter_values(root, b), **_network_values(root, b), **_reward_signal_values(root, b)}
    for key in ("max_steps", "time_horizon"):
        if key in b:
            vals[key] = _number(b[key], f"{root}.{key}", int)

    full = {**_MLAGENTS_DEFAULTS, **vals}
    lr_sched = full["learning_rate_schedule"]
    follow = overrides.get("lr_schedule", lr_sched)
    preset = dict(_PRESETS[semantics]) if semantics in SEMANTICS else None
    if preset is None:
        raise ConfigError(f"semantics: must be one of {SEMANTICS}, got {semantics!r}")
    mapped: dict[str, Any] = {
        "batch_size": full["batch_size"],
        "buffer_size": full["buffer_size"],
        "learning_rate": full["learning_rate"],
        "beta": full["beta"],
        "epsilon": full["epsilon"],
        "lambd": full["lambd"],
        "num_epoch": full["num_epoch"],
        "lr_schedule": lr_sched,
        # #6: beta/epsilon following learning_rate_schedule is ML-Agents' rule. Under sb3 semantics a
        # schedule the file does not name keeps SB3's meaning: clip_range and ent_coef constant.
        # An lr schedule given as an override (--lr-schedule) is followed as if the file said it.
        "epsilon_schedule": full.get(
            "epsilon_schedule", follow if semantics == "mlagents" else preset["epsilon_schedule"]
        ),
        "beta_schedule": full.get(
            "beta_schedule", follow if semantics == "mlagents" else preset["beta_schedule"]
        ),
        "hidden_units": full["hidden_units"],
        "num_layers": full["num_layers"],
        "gamma": full["gamma"],
        "max_steps": full["max_steps"],
        "time_horizon": full["time_horizon"],
        "obs_norm": (preset["obs_norm"] if full["normalize"] else "none"),
    }
    if "vis_encode_type" in full:  # a file that names none keeps the semantics' encoder
        mapped["vis_encode_type"] = full["vis_encode_type"]
    mapped.update(overrides)
    try:
        return PPOConfig.preset(semantics, **mapped)
    except ConfigError as e:
        # Name the YAML key the bad value came from (unless it came from an override).
        msg = str(e)
        name = msg.split(":", 1)[0]
        if name in _YAML_PATHS and name not in overrides:
            raise ConfigError(f"{root}.{_YAML_PATHS[name]}:{msg.split(':', 1)[1]}") from None
        raise ConfigError(f"{root}: {msg}") from None


_YAML_PATHS = {
    **{field: f"hyperparameters.{key}" for key, field in _HYPER_KEYS.items()},
    "hidden_units": "network_settings.hidden_units",
    "num_layers": "network_settings.num_layers",
    "vis_encode_type": "network_settings.vis_encode_type",
    "gamma": "reward_signals.extrinsic.gamma",
    "max_steps": "max_steps",
    "time_horizon": "time_horizon",
}


# ------------------------------------------------------------------ argparse

_DEST = "ppo__"

# --help's one line per option; the semantics rows (#n, docs/PPO.md) by their choices, ML-Agents' first.
PPO_BRIEF = {
    "advantage_norm": "#1 advantages normalized over the buffer, per minibatch, or not.",
    "ratio": "#2 ratio per action dimension, or of summed log-probs.",
    "value_loss": "#3 value loss.",
    "clip_range_vf": "#3 SB3's value clip range (sb3_clipped); none: no clip.",
    "entropy_reduce": "#4 entropy over action dimensions.",
    "log_prob_form": "#9 Gaussian log-prob formula.",
    "lr_schedule": "#6 learning-rate schedule.",
    "epsilon_schedule": "#6 clip-range schedule.",
    "beta_schedule": "#6 entropy-coefficient schedule.",
    "lr_floor": "#6 learning-rate floor (linear).",
    "epsilon_floor": "#6 clip-range floor (linear).",
    "beta_floor": "#6 entropy-coefficient floor.",
    "max_grad_norm": "#7 gradient norm clip; none: no clip.",
    "adam_eps": "#7 Adam epsilon.",
    "target_kl": "#7 stop an update past this KL; none: never.",
    "update_trigger": "#8 update once the buffer passed, or filled, buffer_size.",
    "minibatch_remainder": "#8 a last partial minibatch.",
    "action_clip": "#10 env actions: clamp(a, -3, 3) / 3, or clipped to bounds.",
    "init": "#11 weight init.",
    "activation": "#11 hidden activation.",
    "vis_encode_type": "#11 image encoder.",
    "obs_norm": "#12 observation normalization.",
    "reward_norm": "#12 normalize rewards (SB3's VecNormalize).",
    "gae_form": "#13 GAE formula.",
    "bootstrap_truncated": "#14 bootstrap at a time-limit end.",
    "trajectory_handling": "#15 trajectories cut per agent, or fixed rollouts.",
    "batch_size": "Minibatch size in agent steps.",
    "buffer_size": "Agent steps per update (SB3's n_steps x n_envs).",
    "learning_rate": "Initial Adam learning rate.",
    "beta": "Initial entropy coefficient (SB3's ent_coef).",
    "epsilon": "Initial clip range (SB3's clip_range).",
    "lambd": "GAE lambda (SB3's gae_lambda).",
    "num_epoch": "Passes over the buffer per update (SB3's n_epochs).",
    "hidden_units": "Width of each hidden layer.",
    "num_layers": "Hidden layers per body.",
    "gamma": "Discount gamma (ML-Agents' extrinsic gamma).",
    "time_horizon": "Steps after which an agent's trajectory is cut.",
    "max_steps": "Agent steps of the run; schedules decay over them.",
    "vf_coef": "Value-loss coefficient.",
}
# One vocabulary across the launchers: these options keep launch_impala's flag; their own name (and
# ML-Agents' key) stays an alias.
PPO_FLAG_NAMES = {
    "beta": "--entropy-cost",
    "gamma": "--discount",
    "max_grad_norm": "--grad-norm-clip",
    "num_epoch": "--epochs",
}


def config_to_argparse(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--semantics``, ``--trainer-config``, ``--behavior`` and one flag per option
    (``impala.options.add_flags``: ``--x/--no-x`` for booleans, ``none`` unsets an optional option).

    The layering is preset < trainer YAML < flags given on the command line (``args.given``), so an
    option's default depends on ``--semantics`` and the file: the help text names both presets' values,
    and a flag not given leaves no attribute. ``seed`` has no flag here: launchers take it from
    their run settings (``--seed``).
    """
    g = parser.add_argument_group("PPO options (docs/PPO.md)")
    g.add_argument(
        "--semantics",
        dest=f"{_DEST}semantics",
        choices=SEMANTICS,
        default="mlagents",
        help="Preset every PPO option to ML-Agents' semantics or SB3's (each option says both values).",
    )
    g.add_argument(
        "--trainer-config",
        "--mlagents-config",
        dest=f"{_DEST}trainer_config",
        default=None,
        metavar="FILE.yaml",
        help="ML-Agents trainer YAML (e.g. configs/Crawler.yaml); its values override the preset.",
    )
    g.add_argument(
        "--behavior",
        dest=f"{_DEST}behavior",
        default=None,
        metavar="NAME",
        help="Behavior name inside --trainer-config (needed if the file has several).",
    )
    ml, sb3 = PPOConfig.preset("mlagents"), PPOConfig.preset("sb3")
    names = [name for name in field_names() if name != "seed"]

    def defaults(name: str) -> str:
        a, b = (_shown(getattr(preset, name)) for preset in (ml, sb3))
        return f"[default: {a}]" if a == b else f"[{a} | sb3: {b}]"

    helps = {
        name: f"{PPOConfig.__dataclass_fields__[name].metadata['help']} {defaults(name)}; a --trainer-config "
        "file's value comes first."
        for name in names
    }
    briefs = {name: f"{PPO_BRIEF.get(name, '')} {defaults(name)}".strip() for name in names}
    add_flags(
        g,
        PPOConfig,
        dest_prefix=_DEST,
        only=names,
        defaults=dict.fromkeys(names, argparse.SUPPRESS),
        helps=helps,
        briefs=briefs,
        names=PPO_FLAG_NAMES,
    )
    return parser


@dataclass(frozen=True)
class PPOSource:
    """Where PPOConfig's values come from: ``launch_ppo``'s ``--semantics``, ``--trainer-config`` and
    ``--behavior``, as keys a ``--config`` preset may set too."""

    semantics: Literal["mlagents", "sb3"] = _f(
        "mlagents", "Preset every option to ML-Agents or SB3 semantics."
    )
    trainer_config: Optional[str] = _f(None, "ML-Agents trainer YAML; its values override the preset.")
    behavior: Optional[str] = _f(None, "Behavior name inside the trainer YAML.")


def ppo_preset_dests(preset: dict[str, Any], run_fields: set[str]) -> dict[str, Any]:
    """A ``launch_ppo --config`` preset's values keyed by their argparse destinations: PPO's options (and the
    three of :class:`PPOSource`) live under the ``ppo__`` prefix, run options under their own names."""
    ppo_names = set(field_names()) | {f.name for f in dataclasses.fields(PPOSource)}
    return {(f"{_DEST}{k}" if k in ppo_names and k not in run_fields else k): v for k, v in preset.items()}


def _shown(value: Any) -> str:
    # argparse expands %-formats in help texts; switches read on/off, as the other launcher's do
    if isinstance(value, bool):
        return "on" if value else "off"
    return ("none" if value is None else str(value)).replace("%", "%%")


def config_from_args(
    args: argparse.Namespace, *, default_trainer_config: str | None = None, **overrides: Any
) -> PPOConfig:
    """Build the PPOConfig from parsed args: preset (or trainer YAML: ``--trainer-config``, else
    ``default_trainer_config``), then the flags that were given, then ``overrides`` (a launcher's
    own settings such as ``seed``)."""
    ns = vars(args)
    given = {**given_flags(PPOConfig, args, dest_prefix=_DEST), **overrides}
    semantics = ns.get(f"{_DEST}semantics") or "mlagents"
    path = ns.get(f"{_DEST}trainer_config") or default_trainer_config
    if path:
        return from_mlagents_yaml(path, ns.get(f"{_DEST}behavior"), semantics, **given)
    return PPOConfig.preset(semantics, **given)


# ------------------------------------------------------------ the run settings PPO implies

MAX_UNROLL = 1000  # longer unrolls only delay the learner; ML-Agents' Crawler time_horizon is 1000
# trajectory_handling='mlagents' (#15) cuts trajectories on the learner, so an unroll is only the transport
# unit. Short ones keep ML-Agents' rhythm: an update comes right after the step that fills the buffer, while
# an actor finishes the unroll it is in with the old weights (at most this many steps per env that ML-Agents
# would have taken with the new ones; they train next time, with their own log-probs).
MLAGENTS_UNROLL = 16


def choose_unroll_length(config: PPOConfig, requested: int, *, n_envs: int = 0) -> tuple[int, str | None]:
    """T = requested, or min(time_horizon, MAX_UNROLL) ('rollout'; for SB3's buffer_full, a divisor of
    buffer_size), or min(time_horizon, MLAGENTS_UNROLL) for trajectory_handling='mlagents', where the
    learner cuts the trajectories and the buffer holds whole ones whatever T is.

    ``n_envs``: the envs of the local actors (0: not known, e.g. remote actors only). For buffer_full
    without a requested T, T is then the largest one (up to the cap above) whose round of unrolls
    (T x n_envs) divides buffer_size: SB3's n_steps = buffer_size / n_envs when that fits. A round
    larger than the buffer would fill it halfway through, and the rest of the round, collected with
    the weights that update replaced, would be dropped as stale under on-policy rollouts (about half of
    what the README's Pendulum example collected with T = 512 over 8 envs and a 2048-step buffer).
    """
    if config.trajectory_handling == "mlagents":
        return requested or min(config.time_horizon, MLAGENTS_UNROLL), None
    T = requested or min(config.time_horizon, MAX_UNROLL)
    if config.update_trigger == "buffer_full" and not requested and n_envs:
        fits = [d for d in range(1, T + 1) if config.buffer_size % (d * n_envs) == 0]
        if fits:
            return max(fits), None
    if config.update_trigger != "buffer_full" or config.buffer_size % T == 0:
        return T, None
    divisor = max(d for d in range(1, T + 1) if config.buffer_size % d == 0)
    note = (
        f"unroll length {T} does not divide buffer_size {config.buffer_size} (update_trigger=buffer_full); "
        f"using {divisor} so that every update holds exactly buffer_size steps"
    )
    return divisor, note


def actors_wait(run: RunConfig, config: PPOConfig) -> bool:
    """Whether actors pause once they sent their share of an update, until the new weights arrive: on-policy
    rollouts (``--max-policy-lag 0``, SB3's), and always under trajectory_handling='mlagents' (ML-Agents does
    not
    step its envs during an update). Then the learner has every core during an update."""
    return run.max_policy_lag == 0 or config.trajectory_handling == "mlagents"


def refuse_publish_delay(delay: int | None) -> None:
    """PPO sends each update's weights at once: a ``--publish-delay`` above 0 is a :class:`ConfigError`
    (launch_ppo checks it before RunConfig weighs it against ``--max-policy-lag``)."""
    if delay:
        raise ConfigError(
            f"--publish-delay {delay}: a PPO update trains on the weights its actors had, so each "
            "update's weights go out at once (0); --publish-delay is launch_impala's"
        )


def ppo_run_config(
    run: RunConfig, config: PPOConfig, *, lag_given: bool, agents_per_instance: int | None = None
) -> tuple[RunConfig, str | None]:
    """The run settings a PPO run implies, decided here once (the launcher only wires them): the policy-lag
    rule of each trajectory handling, the unroll length T (:func:`choose_unroll_length`), envs per actor (a
    Unity
    build's agent count), and the step budget (the config's ``max_steps`` unless one was given). Returns the
    resolved RunConfig and a note to log when T was changed. Weights go to the actors as soon as they exist
    (``--publish-delay`` 0)."""
    if run.learners > 1:
        raise ConfigError(
            f"--learners {run.learners}: the PPO learner runs as one process for now (its buffer-wide "
            "advantage "
            "normalization, minibatch order and normalizer updates would need cross-rank statistics first); "
            "launch_impala has --learners"
        )
    refuse_publish_delay(run.publish_delay)
    run = dataclasses.replace(run, publish_delay=0)
    if config.trajectory_handling == "mlagents":
        if lag_given and run.max_policy_lag is not None:
            raise ConfigError(
                f"--max-policy-lag {run.max_policy_lag}: --trajectory-handling mlagents keeps every unroll "
                "(unfinished "
                "trajectories continue across updates, as in ML-Agents); drop --max-policy-lag or pass "
                "--trajectory-handling rollout"
            )
        run = dataclasses.replace(run, max_policy_lag=None)
    n_envs = run.workers * (agents_per_instance or run.envs_per_worker)  # 0 with remote actors only
    T, note = choose_unroll_length(config, run.unroll_length, n_envs=n_envs)
    run = dataclasses.replace(
        run,
        unroll_length=T,
        total_steps=run.total_steps if run.total_steps or run.total_frames else config.max_steps,
    )
    return run, note
