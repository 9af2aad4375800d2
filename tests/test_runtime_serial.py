"""The serial mode: the same actor loop, sockets and learner in one process (threads)."""

import math

import pytest

from impala.config import ImpalaConfig
from impala.envs import EnvSpec
from learner.launch_impala import ImpalaTrainer, frames_per_agent_step, probe_env
from learner.runtime import RunSettings, run


@pytest.mark.parametrize("use_lstm", [False, True])
def test_in_process_run_trains_with_and_without_lstm(tmp_path, use_lstm):
    cfg = ImpalaConfig(env="CartPole-v1", workers=1, envs_per_worker=3, unroll_length=10, batch_size=4,
                       use_lstm=use_lstm, total_frames=2400, logdir=str(tmp_path), progress=False)
    spec = EnvSpec(cfg.env)
    fp, obs_shape, obs_dtype, num_actions = probe_env(spec, 0)
    trainer = ImpalaTrainer(cfg, obs_shape, obs_dtype, num_actions, frames_per_agent_step(fp))
    assert ("core_state" in trainer.schema.names) == use_lstm
    result = run(trainer, RunSettings(env=spec, workers=1, envs_per_worker=3, unroll_length=10, total_frames=2400,
                                      logdir=str(tmp_path), progress=False, in_process=True, reference_fingerprint=fp))
    assert result.env_frames >= 2400
    assert result.updates >= 2400 // (10 * 4)
    assert result.dropped == {}
    assert (tmp_path / "checkpoint.pt").exists()
    assert all(math.isfinite(float(p.detach().abs().sum())) for p in trainer.learner.model.parameters())
