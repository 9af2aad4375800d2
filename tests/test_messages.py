"""The typed contracts that travel between processes: round trips through the real wire codec,
and a peer's malformed run info refused with a reason (never a crash or a half-built actor)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from impala.envs import EnvSpec, UnknownEnvError
from impala.run.ppo_config import PPOConfig
from impala.transport import wire
from impala.transport.messages import ImpalaAgentSpec, PPOAgentSpec, RunInfo, agent_spec_from_dict


def _through_the_wire(info: dict) -> dict:
    """As a remote actor reads it: one packed weights frame (impala-actors' fetch_run_info)."""
    frame = wire.encode_packed(
        "params", actor=0, version=0, arrays={"w": np.zeros(2, np.float32)}, info={"run": info}
    )
    return wire.decode_packed(frame, expect_kind="params").info["run"]


RUNS = [
    RunInfo(
        "a" * 32,
        EnvSpec("PongDeterministic-v4", {"frameskip": 4}),
        ImpalaAgentSpec("shallow", True, 1e-3, obs_norm=True),
        20,
        4,
    ),
    RunInfo(
        "b" * 32,
        EnvSpec("Pendulum-v1"),
        PPOAgentSpec(PPOConfig.preset("sb3"), 3, 1, (-2.0,), (2.0,), 4, 60.0),
        64,
        8,
    ),
]


@pytest.mark.parametrize("info", RUNS, ids=["impala", "ppo"])
def test_run_info_round_trips_through_the_codec(info):
    assert RunInfo.from_dict(_through_the_wire(info.to_dict())) == info


def test_an_impala_agent_record_without_obs_norm_is_one_from_before_it():
    """Checkpoints and learners older than --obs-norm send no obs_norm: their networks had no pixel
    statistics, so the agent is built without them."""
    d = RUNS[0].agent.to_dict()
    del d["obs_norm"]
    assert ImpalaAgentSpec.from_dict(d).obs_norm is False


def _broken(info: RunInfo, path: tuple, value) -> dict:
    d = copy.deepcopy(info.to_dict())
    node = d
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


BROKEN = [
    (0, ("unroll_length",), 0, "unroll_length"),
    (0, ("unroll_length",), True, "unroll_length"),
    (0, ("envs_per_worker",), KeyError, "envs_per_worker"),
    (0, ("env", "id"), 7, "env spec"),
    (0, ("env", "preprocess"), "yes", "preprocess"),
    (0, ("agent", "kind"), "dqn", "unknown agent kind"),
    (0, ("agent", "model"), "resnet9000", "unknown model"),
    (0, ("agent", "popart_beta"), 5.0, "popart_beta"),
    (0, ("agent", "obs_norm"), 1, "obs_norm must be a bool"),
    (1, ("agent", "config", "learning_rate"), -1.0, "learning_rate"),
    (1, ("agent", "config", "bogus_option"), 1, "unknown PPO options"),
    (1, ("agent", "action_low"), [float("nan")], "finite"),
    (1, ("agent", "action_high"), [1.0, 2.0], "action bounds"),
    (1, ("agent", "obs_dim"), 0, "obs_dim"),
]


@pytest.mark.parametrize(
    "which,path,value,reason", BROKEN, ids=[".".join(b[1]) + f"={b[2]!r}" for b in BROKEN]
)
def test_malformed_run_info_is_refused_with_a_reason(which, path, value, reason):
    with pytest.raises(ValueError, match=reason):
        RunInfo.from_dict(_broken(RUNS[which], path, value))


def test_unknown_env_id_from_a_peer_is_refused():
    d = RUNS[0].to_dict()
    d["env"]["id"] = "NoSuchGame-v9"
    with pytest.raises(UnknownEnvError):
        RunInfo.from_dict(d)
    assert isinstance(agent_spec_from_dict(RUNS[1].agent.to_dict()), PPOAgentSpec)
