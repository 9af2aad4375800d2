"""PPOConfig: presets follow docs/PPO.md row by row; overrides; ML-Agents YAML; argparse."""

from __future__ import annotations

import dataclasses
import textwrap
import warnings
from pathlib import Path

import pytest

from impala.options import FlagParser
from impala.run.ppo_config import (
    ConfigError,
    PPOConfig,
    config_from_args,
    config_to_argparse,
    from_mlagents_yaml,
    read_mlagents_yaml,
)

CRAWLER = Path(__file__).resolve().parents[1] / "configs" / "Crawler.yaml"

# Row of docs/PPO.md -> (ML-Agents value, SB3 value), one entry per option.
EXPECTED = {
    "advantage_norm": ("buffer", "minibatch"),  # 1
    "ratio": ("per_dim", "summed"),  # 2
    "value_loss": (
        "mlagents",
        "mse",
    ),  # 3 (ML-Agents as 0.28 runs it; the intended clip is "mlagents_intended")
    "clip_range_vf": (None, None),  # 3 (SB3 default None)
    "entropy_reduce": ("mean", "sum"),  # 4
    "vf_coef": (0.5, 0.5),  # 5
    "lr_schedule": ("linear", "constant"),  # 6
    "epsilon_schedule": ("linear", "constant"),  # 6
    "beta_schedule": ("linear", "constant"),  # 6
    "lr_floor": (1e-10, 0.0),  # 6
    "epsilon_floor": (0.1, 0.0),  # 6
    "beta_floor": (1e-5, 0.0),  # 6
    "adam_eps": (1e-8, 1e-5),  # 7
    "max_grad_norm": (None, 0.5),  # 7
    "target_kl": (None, None),  # 7
    "update_trigger": ("over_buffer_size", "buffer_full"),  # 8
    "minibatch_remainder": ("drop", "keep"),  # 8
    "log_prob_form": ("mlagents", "exact"),  # 9
    "action_clip": ("mlagents", "bounds"),  # 10
    "activation": ("swish", "tanh"),  # 11
    "init": ("mlagents", "sb3"),  # 11
    "obs_norm": ("mlagents", "vecnormalize"),  # 12
    "reward_norm": (False, True),  # 12
    "gae_form": ("mlagents", "sb3"),  # 13
    "bootstrap_truncated": (True, True),  # 14
    "trajectory_handling": ("mlagents", "rollout"),  # 15
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_presets_follow_semantics_table(name):
    ml, sb = EXPECTED[name]
    assert getattr(PPOConfig.preset("mlagents"), name) == ml
    assert getattr(PPOConfig.preset("sb3"), name) == sb


def test_preset_hyperparameters_are_library_defaults():
    ml, sb = PPOConfig.preset("mlagents"), PPOConfig.preset("sb3")
    assert (ml.batch_size, ml.buffer_size, ml.num_epoch, ml.beta, ml.hidden_units, ml.num_layers) == (
        1024,
        10240,
        3,
        5e-3,
        128,
        2,
    )
    assert (sb.batch_size, sb.buffer_size, sb.num_epoch, sb.beta, sb.hidden_units, sb.num_layers) == (
        64,
        2048,
        10,
        0.0,
        64,
        2,
    )
    assert PPOConfig() == ml


def test_every_option_has_a_doc():
    for f in dataclasses.fields(PPOConfig):
        assert len(f.metadata["help"]) > 10, f.name
        assert f.name in PPOConfig.__doc__


def test_single_option_override():
    cfg = PPOConfig.preset("sb3", ratio="per_dim", advantage_norm="buffer")
    assert cfg.ratio == "per_dim" and cfg.advantage_norm == "buffer" and cfg.entropy_reduce == "sum"
    cfg = PPOConfig.preset("mlagents", max_grad_norm=0.5)
    assert cfg.max_grad_norm == 0.5 and cfg.ratio == "per_dim"
    # ML-Agents: beta/epsilon schedules follow learning_rate_schedule unless set.
    cfg = PPOConfig.preset("mlagents", lr_schedule="constant")
    assert cfg.epsilon_schedule == cfg.beta_schedule == "constant"
    cfg = PPOConfig.preset("mlagents", lr_schedule="constant", beta_schedule="linear")
    assert cfg.beta_schedule == "linear" and cfg.epsilon_schedule == "constant"


def test_frozen():
    cfg = PPOConfig.preset("mlagents")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.beta = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"ratio": "sum"}, "ratio"),
        ({"advantage_norm": "batch"}, "advantage_norm"),
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"reward_norm": "yes"}, "reward_norm"),
        ({"gamma": 1.5}, "gamma"),
        ({"value_loss": "sb3_clipped"}, "clip_range_vf"),
        ({"value_loss": "mlagents_clipped"}, "value_loss"),  # renamed: 'mlagents_intended'
        ({"value_loss": "mlagents_intended", "clip_range_vf": 0.2}, "clip_range_vf"),
        ({"clip_range_vf": 0.2}, "clip_range_vf"),
        ({"batch_size": 4096, "buffer_size": 2048}, "batch_size"),
        ({"lernin_rate": 1e-3}, "lernin_rate"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"trajectory_handling": "agent"}, "trajectory_handling"),
    ],
)
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        PPOConfig.preset("mlagents", **overrides)


def test_unknown_semantics():
    with pytest.raises(ConfigError, match="semantics"):
        PPOConfig.preset("rllib")


# ------------------------------------------------------------------- YAML


def test_crawler_yaml(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the project's own file (a default launch_ppo reads it): no warnings
        cfg = from_mlagents_yaml(str(CRAWLER))
    # ML-Agents' own Crawler.yaml has the run keys the shipped one leaves out: read as launch options, the
    # PPO settings the same, and no warning (a key is honoured or refused, never ignored)
    ml = CRAWLER.read_text().replace(
        "    time_horizon: 1000\n",
        "    time_horizon: 1000\n    summary_freq: 30000\n    keep_checkpoints: 5\n",
    )
    ml = ml.replace("        gamma: 0.995\n", "        gamma: 0.995\n        strength: 1.0\n")
    (tmp_path / "ml.yaml").write_text(ml)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert from_mlagents_yaml(str(tmp_path / "ml.yaml")) == cfg
        run = read_mlagents_yaml(str(tmp_path / "ml.yaml")).run
    assert run == {"summary_freq": 30000, "keep_checkpoints": 5, "extrinsic_strength": 1.0}
    assert (cfg.batch_size, cfg.buffer_size, cfg.learning_rate, cfg.lr_schedule) == (
        2048,
        20480,
        3e-4,
        "linear",
    )
    assert (cfg.beta, cfg.epsilon, cfg.lambd, cfg.num_epoch) == (0.005, 0.2, 0.95, 3)
    assert (cfg.obs_norm, cfg.hidden_units, cfg.num_layers) == ("mlagents", 512, 3)
    assert (cfg.gamma, cfg.time_horizon, cfg.max_steps) == (0.995, 1000, 10_000_000)
    assert cfg.epsilon_schedule == cfg.beta_schedule == "linear"
    assert cfg.ratio == "per_dim" and cfg.max_grad_norm is None


def test_crawler_yaml_with_sb3_semantics_and_overrides():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = from_mlagents_yaml(str(CRAWLER), "Crawler", semantics="sb3", beta=2.5e-4)
    assert cfg.ratio == "summed" and cfg.obs_norm == "vecnormalize"
    assert cfg.batch_size == 2048 and cfg.beta == 2.5e-4 and cfg.lr_schedule == "linear"
    # Beta/epsilon following the lr schedule is ML-Agents' rule (#6); SB3's clip_range and ent_coef stay
    # constant unless the file names their schedules.
    assert cfg.epsilon_schedule == cfg.beta_schedule == "constant"


def test_an_lr_schedule_override_is_followed_as_if_the_yaml_said_it():
    """ML-Agents: beta/epsilon follow learning_rate_schedule unless set; --lr-schedule on top of a trainer
    config is that key edited, so they follow it; an explicit --epsilon-schedule still wins."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = from_mlagents_yaml(str(CRAWLER), semantics="mlagents", lr_schedule="constant")
        assert (cfg.lr_schedule, cfg.epsilon_schedule, cfg.beta_schedule) == (
            "constant",
            "constant",
            "constant",
        )
        cfg = from_mlagents_yaml(
            str(CRAWLER), semantics="mlagents", lr_schedule="constant", epsilon_schedule="linear"
        )
        assert (cfg.lr_schedule, cfg.epsilon_schedule, cfg.beta_schedule) == (
            "constant",
            "linear",
            "constant",
        )


def test_sb3_semantics_keep_a_schedule_the_yaml_names(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        CRAWLER.read_text().replace(
            "learning_rate_schedule: linear", "learning_rate_schedule: linear\n      epsilon_schedule: linear"
        )
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = from_mlagents_yaml(str(path), "Crawler", semantics="sb3")
    assert (cfg.lr_schedule, cfg.epsilon_schedule, cfg.beta_schedule) == ("linear", "linear", "constant")


def _write(tmp_path, body: str) -> str:
    p = tmp_path / "t.yaml"
    p.write_text(textwrap.dedent(body))
    return str(p)


BASE = """\
behaviors:
  Walker:
    trainer_type: ppo
    hyperparameters:
      {hp}
    network_settings:
      {net}
    reward_signals:
      extrinsic:
        gamma: 0.99
"""


@pytest.mark.parametrize(
    "hp, net, message",
    [
        (
            "lernin_rate: 0.001",
            "normalize: true",
            "behaviors.Walker.hyperparameters.lernin_rate: unknown key",
        ),
        (
            "learning_rate: fast",
            "normalize: true",
            "behaviors.Walker.hyperparameters.learning_rate: expected a number",
        ),
        (
            "batch_size: 12.5",
            "normalize: true",
            "behaviors.Walker.hyperparameters.batch_size: expected an integer",
        ),
        (
            "learning_rate_schedule: cosine",
            "normalize: true",
            "behaviors.Walker.hyperparameters.learning_rate_schedule",
        ),
        ("beta: 0.01", "normalise: true", "behaviors.Walker.network_settings.normalise: unknown key"),
        ("beta: 0.01", "normalize: 3", "behaviors.Walker.network_settings.normalize: expected true or false"),
        (
            "beta: 0.01",
            "memory: {sequence_length: 64, memory_size: 128}",
            "behaviors.Walker.network_settings.memory",
        ),
        (
            "batch_size: 20000",
            "normalize: true",
            "behaviors.Walker.hyperparameters.batch_size: 20000 is larger than buffer_size",
        ),
        ("lambd: 1.5", "normalize: true", "behaviors.Walker.hyperparameters.lambd: must be in [0, 1]"),
        ("beta: 0.01", "hidden_units: 0", "behaviors.Walker.network_settings.hidden_units: must be >= 1"),
    ],
)
def test_yaml_errors_name_the_key(tmp_path, hp, net, message):
    path = _write(tmp_path, BASE.format(hp=hp, net=net))
    with pytest.raises(ConfigError) as e:
        from_mlagents_yaml(path)
    assert message in str(e.value)


def test_yaml_structure_errors(tmp_path):
    p = _write(tmp_path, "behaviors:\n  W:\n    trainer_type: sac\n")
    with pytest.raises(ConfigError, match=r"behaviors\.W\.trainer_type: sac: SAC is not implemented"):
        from_mlagents_yaml(p)
    p = _write(tmp_path, "behaviors:\n  W:\n    trainer_type: ppo\n    hyperparameters: 3\n")
    with pytest.raises(ConfigError, match=r"behaviors\.W\.hyperparameters: expected a mapping"):
        from_mlagents_yaml(p)
    p = _write(
        tmp_path,
        "behaviors:\n  W:\n    trainer_type: ppo\n    reward_signals:\n      curiosity: {gamma: 0.99}\n",
    )
    with pytest.raises(ConfigError, match=r"behaviors\.W\.reward_signals\.curiosity"):
        from_mlagents_yaml(p)
    p = _write(tmp_path, "behaviours:\n  W: {}\n")
    with pytest.raises(ConfigError, match=r"^behaviours: unknown key"):
        from_mlagents_yaml(p)
    p = _write(tmp_path, "behaviors:\n  A: {}\n  B: {}\n")
    with pytest.raises(ConfigError, match=r"2 behaviours \(A, B\).*pass --behavior NAME"):
        from_mlagents_yaml(p)
    with pytest.raises(ConfigError, match=r"behaviors\.C: not in the file"):
        from_mlagents_yaml(p, behavior="C")


def test_yaml_defaults_and_unsupported_keys(tmp_path):
    p = _write(
        tmp_path,
        "behaviors:\n  W:\n    trainer_type: ppo\n    threaded: true\n    checkpoint_interval: 500\n",
    )
    with pytest.raises(ConfigError, match=r"^behaviors\.W\.threaded: True is not supported \(actors wait"):
        from_mlagents_yaml(p)
    p = _write(
        tmp_path,
        "behaviors:\n  W:\n    trainer_type: ppo\n    threaded: false\n    checkpoint_interval: 500\n",
    )
    cfg = from_mlagents_yaml(p)
    assert cfg.obs_norm == "none"  # ML-Agents: normalize defaults to false
    assert (cfg.batch_size, cfg.buffer_size, cfg.hidden_units, cfg.time_horizon) == (1024, 10240, 128, 64)


# ---------------------------------------------------------------- argparse


def test_argparse_every_option_with_help():
    parser = config_to_argparse(FlagParser(prog="t"))
    text = parser.format_full_help()
    for f in dataclasses.fields(PPOConfig):
        if f.name != "seed":  # the launchers' --seed (RunConfig) sets it
            assert f"--{f.name.replace('_', '-')}" in text
    assert "per action dimension" in text


def test_argparse_overrides():
    parser = config_to_argparse(FlagParser(prog="t"))
    cfg = config_from_args(parser.parse_args([]))
    assert cfg == PPOConfig.preset("mlagents")
    args = parser.parse_args(
        (
            "--semantics sb3 --ratio per_dim --max-grad-norm none --no-reward-norm --batch-size 128 "
            "--target-kl 0.02"
        ).split()
    )
    cfg = config_from_args(args)
    assert (cfg.ratio, cfg.max_grad_norm, cfg.reward_norm, cfg.batch_size, cfg.target_kl) == (
        "per_dim",
        None,
        False,
        128,
        0.02,
    )
    assert cfg.entropy_reduce == "sum"
    with pytest.raises(SystemExit):
        parser.parse_args(["--ratio", "sum"])
    # #15 is a switch like the others, both ways.
    assert (
        config_from_args(parser.parse_args(["--trajectory-handling", "rollout"])).trajectory_handling
        == "rollout"
    )
    assert (
        config_from_args(
            parser.parse_args(["--semantics", "sb3", "--trajectory-handling", "mlagents"])
        ).trajectory_handling
        == "mlagents"
    )


def test_argparse_trainer_config_and_launcher_overrides():
    parser = config_to_argparse(FlagParser(prog="t"))
    parser.add_argument("--seed", type=int, default=7)  # the launcher's own flag (RunConfig) does not clash
    args = parser.parse_args(["--trainer-config", str(CRAWLER), "--beta", "2.5e-4", "--seed", "3"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = config_from_args(args, seed=args.seed)
        default_file = config_from_args(parser.parse_args([]), default_trainer_config=str(CRAWLER))
    assert (cfg.beta, cfg.batch_size, cfg.seed) == (2.5e-4, 2048, 3)
    assert (
        default_file.batch_size == 2048
    )  # a launcher's default file, used when --trainer-config is not given
