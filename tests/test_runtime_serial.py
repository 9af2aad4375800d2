"""The serial mode: the same actor loop, sockets and learner in one process (threads)."""

import math

import pytest

from impala.envs import EnvSpec
from impala.envs.probe import probe_env
from impala.run.config import ImpalaConfig, RunConfig
from learner.run.runtime import RunPlan, run
from learner.vtrace_learner import ImpalaTrainer


@pytest.mark.parametrize("use_lstm", [False, True])
def test_in_process_run_trains_with_and_without_lstm(tmp_path, use_lstm):
    cfg = ImpalaConfig(batch_size=4, minibatches=2, use_lstm=use_lstm)
    run_config = RunConfig(
        env="CartPole-v1",
        workers=1,
        envs_per_worker=3,
        unroll_length=10,
        total_frames=2400,
        logdir=str(tmp_path),
        progress=False,
        in_process=True,
        device="cpu",
    )
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

    from impala.nets.impala_net import build_model
    from impala.transport.trajectory import impala_unroll_schema, stack_time_major
    from learner.vtrace_learner import VTraceLearner

    schema = impala_unroll_schema(5, (4,), "float32", 2, core_state_size=3)
    learner = VTraceLearner(
        build_model("mlp", (4,), 2), ImpalaConfig(), __import__("torch").device("cpu"), total_frames=1000
    )
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

    from impala.run.checkpoint import load_checkpoint
    from learner.cli.launch_impala import main

    def weights(seed: int, name: str) -> dict:
        logdir = tmp_path / name
        # The first update: 4 unrolls x 8 steps, all acted with the initial weights; one actor thread with two
        # envs sends them in a fixed order. (Later updates depend on when an actor picks up new weights.)
        assert (
            main(
                [
                    *(
                        "--env CartPole-v1 --workers 1 --in-process --envs-per-worker 2 --unroll-length "
                        "8 --batch-size 4 --minibatches 2 --epochs 2 --total-frames 32 --seed"
                    ).split(),
                    str(seed),
                    "--logdir",
                    str(logdir),
                    "--no-progress",
                    "--device",
                    "cpu",
                ]
            )
            == 0
        )
        return load_checkpoint(str(logdir / "checkpoint.pt"))["trainer"]["model"]

    a, b, c = weights(3, "a"), weights(3, "b"), weights(4, "c")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_eval_every_logs_eval_rows_while_training_goes_on(tmp_path):
    """--eval-every: greedy episodes of a weights snapshot in a separate process; their summary lands in
    metrics.csv as eval/ rows at the frame count of the snapshot, and training kept going meanwhile."""
    import csv

    from learner.cli.launch_impala import main

    every, total = 5000, 20000
    assert (
        main(
            [
                *(
                    "--env CartPole-v1 --workers 1 --unroll-length 20 --batch-size 8 --learning-rate "
                    "2e-3 --total-frames"
                ).split(),
                str(total),
                "--eval-every",
                str(every),
                *"--eval-episodes 2 --log-interval 1 --no-progress --logdir".split(),
                str(tmp_path),
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    evals = [(i, r) for i, r in enumerate(rows) if r.get("eval/mean_return")]
    assert len(evals) >= 2, [r for r in rows if any(k.startswith("eval/") and r[k] for k in r)]
    steps = [int(float(r["eval/at_frames"])) for _, r in evals]
    # a snapshot at the first update past each multiple of --eval-every (later if the previous evaluation
    # still ran)
    assert steps[0] >= every and all(b // every > a // every for a, b in zip(steps, steps[1:])), steps
    for i, row in evals:
        # a CartPole return is its length: at least 1 (a greedy policy that always pushes one way falls in ~8)
        assert (
            1
            <= float(row["eval/min_return"])
            <= float(row["eval/mean_return"])
            <= float(row["eval/max_return"])
            <= 500
        )
        # training went on while the episodes played: the row lands at a later step than its snapshot
        # (except an evaluation the run waited for at its end)
        assert int(row["step"]) > float(row["eval/at_frames"]) or int(row["step"]) == total


def test_a_dead_evaluation_process_does_not_hold_the_launcher_at_exit(tmp_path):
    """The --eval-every process dies before reading its snapshot (megabytes, more than a pipe holds):
    the launcher still exits. (It used to hang for good at exit, in multiprocessing's join of the
    jobs queue's feeder thread; a whole pytest session once sat there for 17 minutes.)"""
    import subprocess
    import sys

    script = tmp_path / "dead_eval.py"
    script.write_text(
        "import numpy as np\n"
        "from types import SimpleNamespace\n"
        "from impala.run.config import RunConfig\n"
        "from impala.envs import EnvSpec\n"
        "from learner.run.periodic_eval import PeriodicEval\n"
        "if __name__ == '__main__':\n"
        "    # an agent spec the evaluation process cannot read: it dies before taking the job\n"
        "    ev = PeriodicEval(RunConfig(env='CartPole-v1', eval_every=1, device='cpu'),\n"
        "                      SimpleNamespace(task_envs=[EnvSpec('CartPole-v1')], "
        "agent=SimpleNamespace(to_dict=dict)))\n"
        "    ev.maybe_start(1, {'w': np.zeros(1_000_000, np.float32)})\n"
        "    ev.proc.join(60)\n"
        "    assert ev.proc.exitcode not in (None, 0), ev.proc.exitcode\n"
        "    assert ev.finish(wait_s=1) is None\n"
        "    print('exiting', flush=True)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "exiting" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_staging_into_a_slot_lays_the_frames_out_over_its_previous_batch():
    """An image learner on CPU lays each batch's frames out as float32 over the previous batch of the same
    staging slot (no fresh 120 MB per Pong batch); the values are a fresh layout's, and the other slot's
    batch, which may still be training, is left alone."""
    import numpy as np
    import torch

    from impala.nets.impala_net import build_model
    from impala.transport.trajectory import impala_unroll_schema, stack_time_major
    from learner.vtrace_learner import VTraceLearner

    schema = impala_unroll_schema(3, (4, 84, 84), "uint8", 6)
    learner = VTraceLearner(
        build_model("shallow", (4, 84, 84), 6), ImpalaConfig(), torch.device("cpu"), total_frames=1000
    )
    learner.model.torso.to_channels_last()
    rng = np.random.default_rng(1)

    def unrolls():
        out = []
        for _ in range(2):
            u = schema.allocate()
            for k, v in u.items():
                v[...] = rng.integers(0, 2 if v.dtype == bool else 255, size=v.shape)
            out.append(u)
        return out

    first, second, third = unrolls(), unrolls(), unrolls()
    slot0 = learner.stage(first, schema, slot=0)["obs"]
    slot1 = learner.stage(second, schema, slot=1)["obs"]
    kept = slot1.clone()
    again = learner.stage(third, schema, slot=0)["obs"]
    assert again is slot0 and again.dtype == torch.float32
    want = learner.model.torso.lay_out(torch.from_numpy(stack_time_major(third, schema)["obs"]))
    assert torch.equal(again, want) and again.stride() == want.stride()
    assert torch.equal(slot1, kept)
