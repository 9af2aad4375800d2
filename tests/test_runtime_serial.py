"""The serial mode: the same actor loop, sockets and learner in one process (threads)."""

import math

import pytest

from impala.config import ImpalaConfig, RunConfig
from impala.envs import EnvSpec
from impala.envs.probe import probe_env
from learner.runtime import RunPlan, run
from learner.vtrace_learner import ImpalaTrainer


@pytest.mark.parametrize("use_lstm", [False, True])
def test_in_process_run_trains_with_and_without_lstm(tmp_path, use_lstm):
    cfg = ImpalaConfig(batch_size=4, use_lstm=use_lstm)
    run_config = RunConfig(env="CartPole-v1", workers=1, envs_per_worker=3, unroll_length=10, total_frames=2400,
                           logdir=str(tmp_path), progress=False, in_process=True, device="cpu")
    env = probe_env(EnvSpec(run_config.env))
    trainer = ImpalaTrainer(cfg, run_config, env)
    assert ("core_state" in trainer.schema.names) == use_lstm
    result = run(trainer, run_config, RunPlan(env, "test"))
    assert result.env_frames >= 2400
    assert result.updates >= 2400 // (10 * 4)
    assert result.dropped == {}
    assert (tmp_path / "checkpoint.pt").exists()
    assert all(math.isfinite(float(p.detach().abs().sum())) for p in trainer.learner.model.parameters())


def test_staging_buffers_match_a_fresh_stack_and_are_reused(tmp_path):
    import numpy as np

    from impala.models import build_model
    from impala.trajectory import impala_unroll_schema, stack_time_major
    from learner.vtrace_learner import VTraceLearner

    schema = impala_unroll_schema(5, (4,), "float32", 2, core_state_size=3)
    learner = VTraceLearner(build_model("mlp", (4,), 2), ImpalaConfig(), __import__("torch").device("cpu"), total_frames=1000)
    rng = np.random.default_rng(0)
    for _ in range(2):  # the second batch overwrites the first batch's buffers
        unrolls = []
        for _ in range(3):
            u = schema.allocate()
            for k, v in u.items():
                v[...] = rng.integers(0, 2, size=v.shape) if v.dtype == bool else rng.normal(size=v.shape)
            unrolls.append(u)
        staged = learner.stage(unrolls, schema)
        for name, want in stack_time_major(unrolls, schema).items():
            np.testing.assert_array_equal(staged[name].numpy(), want)
    assert staged["core_state"].shape == (2, 3, 3)


def test_same_seed_same_first_updates_in_process(tmp_path):
    """--seed seeds the network's initialization and the actors: two in-process runs with the same
    seed make bit-identical first updates; another seed does not."""
    import torch

    from impala.checkpoint import load_checkpoint
    from learner.launch_impala import main

    def weights(seed: int, name: str) -> dict:
        logdir = tmp_path / name
        # The first update: 4 unrolls x 8 steps, all acted with the initial weights; one actor thread with two
        # envs sends them in a fixed order. (Later updates depend on when an actor picks up new weights.)
        assert main(["--env", "CartPole-v1", "--workers", "1", "--in-process", "--envs-per-worker", "2", "--unroll-length", "8",
                     "--batch-size", "4", "--minibatches", "2", "--epochs", "2", "--total-frames", "32",
                     "--seed", str(seed), "--logdir", str(logdir), "--no-progress", "--device", "cpu"]) == 0
        return load_checkpoint(str(logdir / "checkpoint.pt"))["trainer"]["model"]

    a, b, c = weights(3, "a"), weights(3, "b"), weights(4, "c")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert not all(torch.equal(a[k], c[k]) for k in a)
