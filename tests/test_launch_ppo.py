"""launch_ppo end to end: real processes, real gRPC (fake Unity builds), real ZeroMQ; no mocks.

The fake builds are executables written by ``tests/fake_unity.py``: mlagents-envs
starts them as subprocesses exactly as it starts a Unity player. A small wrapper
build records each player's summary under its own port, so the test can see
which worker_id (port = base + worker_id) and seed every instance got.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("mlagents_envs")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from actors.ppo_agent import PPOAgent  # noqa: E402
from fake_unity import write_fake_build  # noqa: E402
from impala.envs import EnvSpec  # noqa: E402
from impala.envs.probe import EnvInfo  # noqa: E402
from impala.envs.vector import StepResult  # noqa: E402
from impala.options import ConfigError  # noqa: E402
from impala.run.config import RunConfig  # noqa: E402
from impala.run.ppo_config import PPOConfig, choose_unroll_length  # noqa: E402
from impala.transport import wire  # noqa: E402
from impala.transport.messages import PPOAgentSpec, RunInfo  # noqa: E402
from learner.ppo_learner import PPOLearner, PPOTrainer, TrajectoryPiece, piece_from_unroll, unrolls_per_update  # noqa: E402

LAUNCH_PPO = str(Path(sys.executable).parent / "launch_ppo")


def tiny(time_horizon: int = 32) -> list[str]:
    """Crawler.yaml shrunk to a few seconds per update on 2 loaded cores."""
    return [
        *"--buffer-size 256 --batch-size 64 --hidden-units 32 --num-layers 1 --time-horizon".split(),
        str(time_horizon),
        "--log-interval",
        "0",
        "--no-progress",
    ]


def free_base_port(n: int) -> int:
    """A base port with n consecutive free ports above it (Unity worker i uses base + i)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("localhost", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("localhost", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range")


def recording_build(path: Path, records: Path, *extra: str) -> Path:
    """A fake Crawler build that writes its summary to records/player-<port>.json."""
    records.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "from fake_unity import main\n"
        "port = sys.argv[sys.argv.index('--mlagents-port') + 1]\n"
        f"sys.exit(main(['--preset', 'crawler', *{list(extra)!r}, '--record', {str(records)!r} + "
        f"f'/player-{{port}}.json'] + sys.argv[1:]))\n"
    )
    path.chmod(0o755)
    return path


def launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([LAUNCH_PPO, *args], capture_output=True, text=True, timeout=timeout, env=env)


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def wait_records(records: Path, ports: list[int], timeout: float = 20.0) -> dict[int, dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {p: records / f"player-{p}.json" for p in ports}
        if all(f.exists() for f in found.values()):
            time.sleep(0.2)  # written in one call; give it a moment to finish
            return {p: json.loads(f.read_text()) for p, f in found.items()}
        time.sleep(0.2)
    raise AssertionError(f"fake players did not all record: have {sorted(os.listdir(records))}")


def check_metrics(rows: list[dict[str, str]]) -> None:
    assert rows, "metrics.csv has no rows"
    for key in (
        "losses/policy_loss",
        "losses/value_loss",
        "losses/entropy",
        "losses/approx_kl",
        "losses/clip_fraction",
        "health/explained_variance",
        "charts/fps",
        "transport/rejected_nan",
    ):
        assert key in rows[0], f"{key} not in metrics.csv columns"
    for row in rows:
        for key in (
            "losses/policy_loss",
            "losses/value_loss",
            "losses/total",
            "losses/approx_kl",
            "losses/clip_fraction",
        ):
            assert math.isfinite(float(row[key])), (key, row[key])


# ------------------------------------------------------------------------- end to end


def test_unity_two_workers_train_and_resume(tmp_path):
    base = free_base_port(3)
    records = tmp_path / "records"
    build = recording_build(tmp_path / "FakeCrawler.x86_64", records)
    logdir = tmp_path / "run"
    common = [
        "--unity-build",
        str(build),
        "--workers",
        "2",
        "--unity-base-port",
        str(base),
        "--logdir",
        str(logdir),
        *tiny(),
    ]

    first = launch(*common, "--total-steps", "900")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "launch_ppo: done" in first.stdout
    ckpt = torch.load(logdir / "checkpoint.pt", weights_only=True)
    steps_1 = int(ckpt["env_frames"])
    assert steps_1 >= 900 and ckpt["version"] >= 3
    rows = read_csv(logdir / "metrics.csv")
    check_metrics(rows)

    # Workers 0 and 1 on base+0 / base+1 with their own seeds; the launcher's probe on base+2.
    rec = wait_records(records, [base, base + 1, base + 2])
    for port, r in rec.items():
        assert r["port"] == port and r["engine_config"]["time_scale"] == 20.0, r
        assert r["error"] is None and not r["protocol_errors"], r
    assert (
        rec[base]["seed"] == 0 and rec[base + 1]["seed"] == 1000
    )  # ActorConfig.seed = seed + 1000 * worker_id
    assert rec[base]["n_steps"] > 0 and rec[base + 1]["n_steps"] > 0
    assert rec[base + 2]["shutdown"] == "quit"  # the probe closed its instance properly

    for f in records.iterdir():
        f.unlink()
    second = launch(*common, "--total-steps", str(steps_1 + 600), "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"at {steps_1} env frames" in second.stderr  # the runtime's "resumed from ..." line
    ckpt2 = torch.load(logdir / "checkpoint.pt", weights_only=True)
    assert int(ckpt2["env_frames"]) >= steps_1 + 600
    assert ckpt2["version"] > ckpt["version"]
    assert ckpt2["trainer"]["total_steps"] > ckpt["trainer"]["total_steps"]
    rows2 = read_csv(logdir / "metrics.csv")
    assert int(rows2[-1]["step"]) > steps_1 and len(rows2) > len(rows)


def test_single_process_mode(tmp_path):
    base = free_base_port(2)
    records = tmp_path / "records"
    build = recording_build(tmp_path / "FakeCrawler.x86_64", records)
    logdir = tmp_path / "run"
    out = launch(
        "--unity-build",
        str(build),
        "--workers",
        "1",
        "--in-process",
        "--unity-base-port",
        str(base),
        "--logdir",
        str(logdir),
        "--total-steps",
        "600",
        *tiny(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "started 1 actors (threads)" in out.stderr
    assert (logdir / "checkpoint.pt").exists()
    check_metrics(read_csv(logdir / "metrics.csv"))
    rec = wait_records(records, [base, base + 1])
    # The in-process actor closes its Unity instance itself (status 400) when the run ends.
    assert rec[base]["shutdown"] == "quit" and rec[base]["n_steps"] > 0
    assert rec[base]["engine_config"]["time_scale"] == 20.0


def test_ant_stand_in(tmp_path):
    pytest.importorskip("mujoco")
    logdir = tmp_path / "ant"
    out = launch(
        "--workers",
        "1",
        "--envs-per-worker",
        "2",
        "--total-steps",
        "700",
        "--logdir",
        str(logdir),
        *tiny(time_horizon=64),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    stand_in = [line for line in out.stdout.splitlines() if "STAND-IN" in line]
    assert len(stand_in) == 1 and "Ant-v5" in stand_in[0] and "--unity-build" in stand_in[0]
    rows = read_csv(logdir / "metrics.csv")
    check_metrics(rows)
    assert float(rows[-1]["charts/updates"]) >= 2
    # The mlagents preset's trajectory handling (#15): nothing dropped for its age, unfinished trajectories
    # kept.
    assert "charts/pending_steps" in rows[-1] and float(rows[-1].get("transport/dropped_stale") or 0) == 0


# ------------------------------------------------------------------------- bad input


def assert_clean_error(out: subprocess.CompletedProcess, *needles: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout, out.stderr[-2000:]
    err = [line for line in out.stderr.splitlines() if line.startswith("launch_ppo: error:")]
    assert err, out.stderr[-2000:]
    for n in needles:
        assert n in err[0], (n, err[0])


def launch_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """launch_ppo's main in this process, as a CompletedProcess (for errors raised before any process starts;
    test_build_that_never_answers and test_bad_log_level_is_an_argparse_error_not_a_traceback run the real
    command)."""
    from learner.cli.launch_ppo import main

    threads = torch.get_num_threads()
    try:
        rc = main(list(args))
    finally:
        torch.set_num_threads(threads)
    cap = capsys.readouterr()
    return subprocess.CompletedProcess(["launch_ppo", *args], rc, cap.out, cap.err)


def test_missing_build(tmp_path, capsys):
    missing = tmp_path / "nowhere" / "Crawler.x86_64"
    out = launch_here(
        capsys,
        "--unity-build",
        str(missing),
        "--logdir",
        str(tmp_path / "r"),
        "--unity-base-port",
        str(free_base_port(3)),
    )
    assert_clean_error(out, str(missing), "not found")


def test_build_that_never_answers(tmp_path):
    base = free_base_port(3)
    build = write_fake_build(tmp_path / "Hang.x86_64", preset="crawler", args=["--hang"])
    t0 = time.monotonic()
    out = launch(
        "--unity-build",
        str(build),
        "--workers",
        "2",
        "--unity-timeout",
        "2",
        "--unity-base-port",
        str(base),
        "--logdir",
        str(tmp_path / "r"),
    )
    assert_clean_error(out, str(build), f"port {base + 2}", "did not connect")
    assert time.monotonic() - t0 < 60


def test_unknown_yaml_key(tmp_path, capsys):
    bad = tmp_path / "Crawler.yaml"
    text = (
        (HERE.parent / "configs" / "Crawler.yaml")
        .read_text()
        .replace("      num_epoch: 3\n", "      num_epoch: 3\n      num_epochs: 5\n")
    )
    bad.write_text(text)
    out = launch_here(capsys, "--mlagents-config", str(bad), "--logdir", str(tmp_path / "r"))
    assert_clean_error(out, "behaviors.Crawler.hyperparameters.num_epochs", "unknown key")


# ------------------------------------------------------------------------- units


def _unroll_arrays(obs: np.ndarray, A: int, rng) -> dict[str, np.ndarray]:
    """A PPO unroll's arrays around ``obs`` ([T + 1, D]): random actions, log-probs and rewards (drawn in
    that order), no episode end."""
    T, D = obs.shape[0] - 1, obs.shape[1]
    return {
        "obs": obs,
        "actions": rng.normal(size=(T, A)).astype(np.float32),
        "log_probs": (rng.normal(size=(T, A)) - 1).astype(np.float32),
        "rewards": rng.normal(size=T).astype(np.float32),
        "terminated": np.zeros(T, bool),
        "truncated": np.zeros(T, bool),
        "final_obs": np.zeros((T, D), np.float32),
    }


def _unroll(T: int, D: int, A: int, rng) -> dict[str, np.ndarray]:
    arrays = _unroll_arrays(rng.normal(size=(T + 1, D)).astype(np.float32), A, rng)
    arrays["terminated"][1] = True
    arrays["truncated"][4] = True
    arrays["final_obs"][[1, 4]] = rng.normal(size=(2, D)).astype(np.float32)
    return arrays


def _trainer(cfg: PPOConfig, unroll_length: int = 8, **run: object) -> PPOTrainer:
    """A trainer for 3-value observations and 2 actions in [-1, 1] (the spaces a probe would report)."""
    ones = np.ones(2, np.float32)
    env = EnvInfo(EnvSpec("Pendulum-v1"), (3,), "float32", "Box", "Box", action_low=-ones, action_high=ones)
    return PPOTrainer(
        cfg, RunConfig(env="Pendulum-v1", unroll_length=unroll_length, device="cpu", **run), env
    )


def _message(trainer: PPOTrainer, arrays: dict[str, np.ndarray]) -> wire.Message:
    """Through the real codec, as the server receives it."""
    frames = wire.encode("unroll", actor=1, version=0, arrays=arrays, info={"env": 2})
    return wire.decode([bytes(memoryview(f)) for f in frames], schema=trainer.schema)


def test_piece_from_unroll_bootstraps_from_final_obs():
    arrays = _unroll(6, 3, 2, np.random.default_rng(0))
    p = piece_from_unroll(arrays)
    np.testing.assert_array_equal(p.obs, arrays["obs"][:6])
    for t in range(6):
        want = arrays["final_obs"][t] if t in (1, 4) else arrays["obs"][t + 1]
        np.testing.assert_array_equal(p.next_obs[t], want)


def test_nan_unroll_rejected_and_counted():
    # The same unroll three times is no continuing stream: 'rollout' processes each as it comes.
    cfg = PPOConfig.preset(
        "mlagents",
        buffer_size=16,
        batch_size=8,
        hidden_units=8,
        num_layers=1,
        time_horizon=8,
        trajectory_handling="rollout",
    )
    trainer = _trainer(cfg)
    rng = np.random.default_rng(1)
    good = _unroll(8, 3, 2, rng)
    bad = _unroll(8, 3, 2, rng)
    bad["rewards"][3] = np.nan
    assert trainer.ingest(_message(trainer, bad), 0) is False
    assert trainer.rejected_nan == 1 and trainer.learner.buffer.num_steps == 0
    steps = trainer.learner.policy.actor_norm.steps.clone()
    for _ in range(3):
        assert trainer.ingest(_message(trainer, good), 0) is True
    assert trainer.ready()
    m = trainer.update(24)
    assert m["transport/rejected_nan"] == 1.0
    assert all(
        math.isfinite(m[k]) for k in ("losses/policy_loss", "losses/approx_kl", "health/explained_variance")
    )
    assert (
        float(trainer.learner.policy.actor_norm.steps) == float(steps) + 24
    )  # the NaN piece never reached the normalizer


def _stream_unrolls(n: int, T: int, D: int, A: int, rng, ends: dict[int, str]) -> list[dict[str, np.ndarray]]:
    """n consecutive unrolls of one env, as an actor sends them: unroll k+1 starts with unroll k's obs[T].
    ``ends``: global step -> 'terminated' | 'truncated'."""
    total = n * T
    obs = rng.normal(size=(total + 1, D)).astype(np.float32)
    obs[:, 0] = np.arange(total + 1)
    out = []
    for k in range(n):
        a, b = k * T, (k + 1) * T
        u = _unroll_arrays(obs[a : b + 1].copy(), A, rng)
        for t, how in ends.items():
            if a <= t < b:
                u[how][t - a] = True
                u["final_obs"][t - a] = rng.normal(size=D)
        out.append(u)
    return out


def test_trainer_cuts_mlagents_trajectories_across_unrolls():
    """trajectory_handling='mlagents' through the real codec: unrolls of 8, time_horizon 5; an episode ends at
    step 6, so trajectories are 0-4 (horizon), 5-6 (end), 7-11 (horizon from its own start), 12-16, ..."""
    cfg = PPOConfig.preset(
        "mlagents", buffer_size=16, batch_size=8, hidden_units=8, num_layers=1, time_horizon=5
    )
    trainer = _trainer(cfg, unroll_length=8, max_policy_lag=None)
    rng = np.random.default_rng(5)
    unrolls = _stream_unrolls(3, 8, 3, 2, rng, {6: "terminated"})
    assert trainer.ingest(_message(trainer, unrolls[0]), 0)
    assert (
        trainer.learner.total_steps == 7 and trainer.learner.trajectories.pending_steps == 1
    )  # 0-4, 5-6; 7 waits
    assert trainer.ingest(_message(trainer, unrolls[1]), 0)
    starts = trainer.learner.buffer.stacked()["obs"][:, 0].numpy()
    assert trainer.learner.total_steps == 12 and list(starts[[0, 5, 7]]) == [0, 5, 7] and starts[-1] == 11
    assert trainer.learner.trajectories.pending_steps == 4  # 12-15
    assert not trainer.ready()
    assert trainer.ingest(_message(trainer, unrolls[2]), 0)  # 12-16, 17-21 -> 22 steps > 16
    assert trainer.ready() and trainer.learner.total_steps == 22
    m = trainer.update(24)
    assert m["charts/pending_steps"] == 2.0 and m["charts/broken_trajectories"] == 0.0
    # Actors wait for their share of an update even without an on-policy lag limit (ML-Agents is synchronous).
    assert trainer.agent.unrolls_per_update == unrolls_per_update(cfg, 8, trainer.n_envs) > 0
    rollout = _trainer(
        dataclasses.replace(cfg, trajectory_handling="rollout"), unroll_length=8, max_policy_lag=None
    )
    assert rollout.agent.unrolls_per_update == 0  # off-policy rollouts: actors never wait
    # the one local actor follows the buffer exactly; with two, neither can know the other's share
    assert not trainer.agent.sole_actor and not rollout.agent.sole_actor  # RunConfig's 2 workers
    sole = _trainer(cfg, unroll_length=8, max_policy_lag=None, workers=1).agent
    assert sole.sole_actor and PPOAgentSpec.from_dict(sole.to_dict()) == sole
    # what remote actors are told (the weights message's run settings): none of them is the only actor
    run = RunInfo("r1", EnvSpec("Pendulum-v1"), sole, 8, 3)
    assert RunInfo.from_dict(run.to_dict()).agent.sole_actor
    told = RunInfo.from_dict(run.for_remote_actors().to_dict())
    assert not told.agent.sole_actor and dataclasses.replace(told.agent, sole_actor=True) == sole


def test_huge_finite_unrolls_are_dropped_on_receipt():
    cfg = PPOConfig.preset(
        "mlagents", buffer_size=16, batch_size=8, hidden_units=8, num_layers=1, time_horizon=8
    )
    trainer = _trainer(cfg)
    rng = np.random.default_rng(2)
    assert trainer.validate(_unroll(8, 3, 2, rng)) is None
    for name in ("obs", "rewards", "log_probs", "final_obs"):
        bad = _unroll(8, 3, 2, rng)
        bad[name] = np.full_like(bad[name], 1e25)
        problem = trainer.validate(bad)
        assert problem is not None and problem.startswith(name) and "--max-abs-value" in problem
    loose = _trainer(cfg, max_abs_value=1e30)
    bad = _unroll(8, 3, 2, rng)
    bad["obs"][:] = 1e25
    assert loose.validate(bad) is None


def test_choose_unroll_length():
    ml = PPOConfig.preset("mlagents", time_horizon=1000, buffer_size=20480, batch_size=2048)
    assert choose_unroll_length(ml, 0) == (
        16,
        None,
    )  # the learner cuts the trajectories (#15): a short transport unit
    assert choose_unroll_length(ml, 40) == (40, None)
    assert choose_unroll_length(PPOConfig.preset("mlagents", time_horizon=8), 0) == (8, None)
    ml_rollout = PPOConfig.preset(
        "mlagents", time_horizon=1000, buffer_size=20480, batch_size=2048, trajectory_handling="rollout"
    )
    assert choose_unroll_length(ml_rollout, 0) == (1000, None)
    sb = PPOConfig.preset("sb3", time_horizon=2048, buffer_size=2048)
    T, note = choose_unroll_length(sb, 0)
    assert T == 512 and 2048 % T == 0 and "512" in note
    assert choose_unroll_length(PPOConfig.preset("sb3", time_horizon=256, buffer_size=2048), 0) == (256, None)
    # Knowing the local envs, buffer_full's round of unrolls fills the buffer exactly: SB3's n_steps.
    assert choose_unroll_length(sb, 0, n_envs=8) == (256, None)
    assert choose_unroll_length(sb, 0, n_envs=1) == (512, None)  # capped at MAX_UNROLL: 2048 = 4 rounds
    short = PPOConfig.preset("sb3", time_horizon=100, buffer_size=2048)
    assert choose_unroll_length(short, 0, n_envs=8) == (64, None)
    assert choose_unroll_length(sb, 0, n_envs=3)[0] == 512  # no round of 3 envs fills 2048: the divisor rule
    # a given T is kept as before (lowered to a divisor, with the note)
    assert choose_unroll_length(sb, 100, n_envs=8) == (64, choose_unroll_length(sb, 100)[1])


def test_readme_pendulum_example_drops_nothing(tmp_path, capsys, caplog):
    """The README's PPO example, shortened: no warning about the unroll length, and nothing collected is
    dropped (before, T = 512 over 8 envs filled the 2048-step buffer halfway through each round of
    unrolls and the other half arrived stale: 36 of 46 unrolls in 20k steps)."""
    import logging

    from learner.cli import launch_ppo

    caplog.set_level(logging.INFO)  # the launcher's plan line names T
    threads = torch.get_num_threads()
    try:
        rc = launch_ppo.main(
            [
                *(
                    "--env Pendulum-v1 --semantics sb3 --workers 1 --in-process --total-steps 8192 "
                    "--no-progress --device cpu --logdir"
                ).split(),
                str(tmp_path / "run"),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    done = [line for line in out.out.splitlines() if line.startswith("launch_ppo: done")][-1]
    assert "dropped 0" in done and "4 updates" in done, done
    logged = caplog.text + out.err
    assert "does not divide" not in logged and "unroll T=256 over 8 envs" in logged, logged[-3000:]


class _Envs:
    num_envs = 3
    action_dim = 2


@pytest.mark.parametrize("semantics", ["mlagents", "sb3"])
def test_agent_clips_env_actions_and_records_raw(semantics):
    cfg = PPOConfig.preset(semantics, hidden_units=8, num_layers=1, buffer_size=64, batch_size=8)
    low, high = np.array([-0.5, -2.0]), np.array([0.5, 2.0])
    settings = PPOAgentSpec(cfg, 4, 2, tuple(low), tuple(high))
    obs = np.random.default_rng(0).normal(size=(3, 4))  # float64, as MuJoCo returns
    agent = PPOAgent(settings, envs=_Envs(), first_obs=obs, unroll_length=5, seed=0)
    agent.policy.log_sigma.data.fill_(1.5)  # wide enough that clipping happens
    to_env, rec = agent.act(obs, np.ones(3, bool))
    raw = rec["actions"]
    assert rec["log_probs"].shape == (3, 2) and raw.dtype == np.float32
    want = np.clip(raw, -3, 3) / 3 if semantics == "mlagents" else np.clip(raw, low, high)
    np.testing.assert_allclose(to_env, want, rtol=1e-6)
    assert agent.observation(obs, None)["obs"].dtype == np.float32
    term, trunc = np.array([True, False, False]), np.array([False, False, True])
    nxt = np.ones((3, 4))
    out = agent.transition(StepResult(nxt, np.zeros(3, np.float32), term, trunc, nxt * 7))
    np.testing.assert_array_equal(out["final_obs"][1], 0.0)
    np.testing.assert_array_equal(out["final_obs"][[0, 2]], 7.0)


def test_agent_waits_after_its_share_of_completed_trajectories():
    """trajectory_handling='mlagents': the share of an update is counted in steps of trajectories this actor
    completed (episode end or time_horizon from the trajectory's start) since the weights arrived."""
    cfg = PPOConfig.preset(
        "mlagents", hidden_units=8, num_layers=1, buffer_size=16, batch_size=8, time_horizon=4
    )
    obs = np.zeros((3, 4))
    spec = PPOAgentSpec(cfg, 4, 2, (-1.0, -1.0), (1.0, 1.0), unrolls_per_update=1, params_wait_s=5.0)
    agent = PPOAgent(spec, envs=_Envs(), first_obs=obs, unroll_length=2, seed=0)
    assert agent.share_steps == 6  # one round of unrolls: 2 steps x 3 envs
    none = np.zeros(3, bool)
    step = lambda term: agent.transition(StepResult(obs, np.zeros(3, np.float32), term, none, obs))  # noqa: E731
    step(np.array([False, True, False]))  # env 1 ends after 1 step
    step(none)
    assert agent.completed_steps == 1 and agent.params_wait_s(1) == 0.0  # a round sent, but 1 step completed
    step(none)
    step(none)  # envs 0 and 2 reach time_horizon 4: 8 more
    assert agent.completed_steps == 9 and agent.params_wait_s(2) == 5.0
    agent.load_params(dict(agent.policy.state_dict()))  # new weights: a new share
    assert agent.completed_steps == 0 and agent.params_wait_s(0) == 0.0
    rollout = PPOAgent(
        PPOAgentSpec(
            dataclasses.replace(cfg, trajectory_handling="rollout"),
            4,
            2,
            (-1.0, -1.0),
            (1.0, 1.0),
            unrolls_per_update=1,
            params_wait_s=5.0,
        ),
        envs=_Envs(),
        first_obs=obs,
        unroll_length=2,
        seed=0,
    )
    assert rollout.params_wait_s(1) == 5.0  # counted in unrolls


def _sole_actor_against_the_learner(seed: int, trigger: str, nan_at: tuple[int, int] | None = None) -> list:
    """60 rounds of a sole actor's 3 envs (random episode ends) fed to a real PPOLearner one env's unroll at a
    time, as the learner's loop takes them; per round: (the learner updated, the actor asked to wait, the
    update came before the round's last unroll). New weights reach the actor right after the round."""
    K, T, D = 3, 3, 4
    cfg = PPOConfig.preset("mlagents", hidden_units=8, num_layers=1, buffer_size=16, batch_size=8,
                           time_horizon=4, num_epoch=1, update_trigger=trigger)  # fmt: skip
    spec = PPOAgentSpec(cfg, D, 2, (-1.0, -1.0), (1.0, 1.0), unrolls_per_update=3, params_wait_s=5.0,
                        sole_actor=True)  # fmt: skip
    rng = np.random.default_rng(seed)
    serial = iter(range(1, 10**6))  # every observation distinct, so the learner sees each stream continue
    fresh = lambda n: np.stack([np.full(D, float(next(serial)), np.float32) for _ in range(n)])  # noqa: E731
    obs = fresh(K)
    agent = PPOAgent(spec, envs=_Envs(), first_obs=obs, unroll_length=T, seed=0)
    learner = PPOLearner(cfg, D, 2, -np.ones(2), np.ones(2))
    rounds = []
    for r in range(60):
        ends = rng.random((T, K)) < 0.15
        seen, after = np.zeros((T, K, D), np.float32), np.zeros((T, K, D), np.float32)
        for t in range(T):
            seen[t], after[t] = obs, fresh(K)
            agent.transition(
                StepResult(after[t], np.zeros(K, np.float32), ends[t], np.zeros(K, bool), after[t])
            )
            obs = np.where(ends[t][:, None], fresh(K), after[t])
        updated_at = None
        for k in range(K):
            rewards = np.full(T, np.nan if (r, k) == nan_at else 0.0, np.float32)
            zeros = np.zeros((T, 2), np.float32)
            learner.ingest(TrajectoryPiece(seen[:, k], zeros, zeros, rewards, ends[:, k], np.zeros(T, bool),
                                           after[:, k], source=k))  # fmt: skip
            if learner.ready():
                learner.update()
                updated_at = k
        rounds.append((updated_at is not None, agent.params_wait_s(1) > 0, updated_at not in (None, K - 1)))
        if updated_at is not None:
            agent.load_params(dict(agent.policy.state_dict()))
    return rounds


@pytest.mark.parametrize("trigger", ["over_buffer_size", "buffer_full"])
def test_sole_actor_waits_exactly_where_the_learner_updates(trigger):
    """The learner's only actor (trajectory_handling='mlagents') replays the learner's buffer count over each
    round it sent: it asks to wait after exactly the rounds on which the real PPOLearner updates, also when
    the update came mid-round (the round's later unrolls start the next buffer). Then no unroll is collected
    with weights that depend on timing, and a seeded run repeats itself."""
    for seed in range(3):
        rounds = _sole_actor_against_the_learner(seed, trigger)
        assert sum(u for u, _, _ in rounds) >= 25 and sum(mid for _, _, mid in rounds) >= 10
        assert [u for u, _, _ in rounds] == [w for _, w, _ in rounds]


def test_sole_actor_after_a_rejected_unroll_costs_at_most_one_needless_wait():
    """A NaN unroll the learner rejects (its steps, and its stream's unfinished trajectory, are not in the
    buffer) puts the actor's count ahead: at most one wait for an update that does not come (bounded by
    --params-wait), then new weights arriving unexpectedly restart the count and the two agree again."""
    for seed in range(3):
        rounds = _sole_actor_against_the_learner(seed, "over_buffer_size", nan_at=(10, 1))
        assert sum(w and not u for u, w, _ in rounds) <= 1
        assert [u for u, _, _ in rounds[30:]] == [w for _, w, _ in rounds[30:]]


RUN_BAD_VALUES = [
    (["--max-seconds", "-1"], "--max-seconds must be >= 0"),
    (["--log-interval", "nan"], "--log-interval must be a finite number"),
    (["--params-wait", "nan"], "--params-wait must be a finite number"),
    (["--max-abs-value", "0"], "--max-abs-value must be >= 1000"),
    (["--max-abs-value", "1e-30"], "--max-abs-value must be >= 1000"),
    (["--checkpoint-minutes", "0"], "--checkpoint-minutes"),
    (["--torch-threads", "-1"], "--torch-threads must be >= 0"),
    (["--port", "70000"], "--port must be 0 or in 1..65534"),
    (["--total-steps", "-5"], "--total-steps must be > 0"),
    (["--learners", "2"], "--learners 2: the PPO learner runs as one process"),
    (["--max-policy-lag", "0"], "--max-policy-lag 0: --trajectory-handling mlagents keeps every unroll"),
    (["--logdir", "/proc/no-such-dir"], "--logdir /proc/no-such-dir: cannot create it"),
]


@pytest.mark.parametrize("argv,message", RUN_BAD_VALUES, ids=[a[0] for a, _ in RUN_BAD_VALUES])
def test_bad_run_values_are_one_line_errors(argv, message, capsys, tmp_path):
    from learner.cli.launch_ppo import main

    assert (
        main(["--env", "Pendulum-v1", "--workers", "1", "--in-process", "--logdir", str(tmp_path), *argv])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("launch_ppo: error: ") and message in err[0], err


@pytest.mark.parametrize("flag", [["--publish-delay", "1"], ["--overlap-updates"]])
def test_launch_impalas_own_options_are_not_offered(flag, capsys, tmp_path):
    from learner.cli.launch_ppo import main

    with pytest.raises(SystemExit) as e:
        main(["--env", "Pendulum-v1", "--logdir", str(tmp_path), *flag])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and f"unrecognized arguments: {flag[0]}" in err[0], err


def test_bad_log_level_is_an_argparse_error_not_a_traceback():
    out = subprocess.run(
        [sys.executable, "-m", "learner.cli.launch_ppo", "--log-level", "BOGUS"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=HERE.parent,
    )
    assert out.returncode == 2 and "invalid choice: 'BOGUS'" in out.stderr and "Traceback" not in out.stderr


def test_config_preset_sets_run_launch_and_ppo_options_and_flags_win(tmp_path):
    """launch_ppo --config: the shipped Pendulum preset resolves key by key; a flag given beside it wins; a
    PPO
    option set by the preset counts as chosen (not overwritten by --semantics' preset); an unknown key is
    one line."""
    import yaml as _yaml

    from impala.run.ppo_config import config_from_args
    from learner.cli.launch_ppo import parse_args

    path = os.path.join(os.path.dirname(__file__), "..", "configs", "pendulum_sb3.yaml")
    args = parse_args(["--config", path])
    written = _yaml.safe_load(open(path))
    assert (args.env, args.ppo__semantics, args.workers, args.in_process, args.total_steps) == (
        written["env"],
        written["semantics"],
        written["workers"],
        written["in_process"],
        written["total_steps"],
    )
    mine = tmp_path / "p.yaml"
    mine.write_text("semantics: sb3\nbatch_size: 128\nworkers: 3\n")
    args = parse_args(["--config", str(mine), "--workers", "1"])
    cfg = config_from_args(args)
    assert (args.workers, cfg.batch_size, cfg.advantage_norm) == (
        1,
        128,
        "minibatch",
    )  # sb3's, batch from the file
    mine.write_text("batch_sise: 128\n")
    with pytest.raises(ConfigError, match="unknown option 'batch_sise'; did you mean batch_size"):
        parse_args(["--config", str(mine)])


def test_a_budget_flag_replaces_the_presets_budget_in_the_other_unit():
    """cartpole_ppo_sb3's budget is --total-steps; --total-frames on the command line replaces it (launch_ppo
    says so in one line when it starts) instead of 'not both'."""
    from learner.cli.launch_ppo import parse_args, resolve

    args = parse_args(["--config", "cartpole_ppo_sb3", "--total-frames", "4000"])
    assert args.preset_replaced == [("total_steps", 100000, "--total-frames")]
    config = resolve(args).config
    assert (config.total_frames, config.total_steps) == (4000, None)


@pytest.mark.parametrize("preset, semantics", [("basic", "mlagents"), ("hybrid", "sb3")])
def test_discrete_and_hybrid_unity_agents_train_over_grpc(tmp_path, preset, semantics):
    """A discrete behaviour (one masked branch of 3, like ML-Agents' Basic) and a hybrid one (2 continuous
    actions, masked branches 3 + 2) train through a fake Unity build over real gRPC: no action the
    player's masks blocked is ever sent, the discrete agent learns its task (random choice among the
    allowed actions earns about half of the best return), and the run leaves <behaviour>.onnx with the
    mask input."""
    records = tmp_path / "records"
    build = recording_build(tmp_path / f"{preset}.x86_64", records, "--preset", preset)
    base = free_base_port(1)
    run = launch(
        "--unity-build", str(build), "--semantics", semantics, "--workers", "1",
        "--unity-base-port", str(base), "--buffer-size", "256", "--batch-size", "64",
        "--hidden-units", "32", "--num-layers", "1",
        "--time-horizon", "32", "--unroll-length", "32", "--learning-rate", "3e-3", "--beta", "0.005",
        "--total-steps", "12000", "--log-interval", "0", "--no-progress", "--logdir", str(tmp_path / "run"),
        timeout=300,  # a hang guard: 12,000 steps over gRPC can outlast 120 s on a busy box
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    player = wait_records(records, [base])[base]
    assert player["protocol_errors"] == [] and player["n_discrete_actions"] >= 12000, player
    mean = float(re.search(r"mean return \(last 100\) ([\d.]+)", run.stdout).group(1))
    if preset == "basic":
        # episodes of 20-35 decisions, reward 1 per right choice: the best is 27.5, random-allowed ~14
        assert mean > 22, run.stdout[-2000:]
    onnx = pytest.importorskip("onnx")
    name = {"basic": "BasicFake", "hybrid": "HybridFake"}[preset]
    model = onnx.load(str(tmp_path / "run" / f"{name}.onnx"))
    assert "action_masks" in [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    assert "discrete_actions" in outputs and ("continuous_actions" in outputs) == (preset == "hybrid")


def test_a_ppo_resume_keeps_the_runs_own_settings(tmp_path, capsys, caplog):
    """launch_ppo --resume with only the run id: SB3's semantics and the learning rate the run started with,
    not the preset's or the defaults'; a network change is one line, exit 2."""
    import yaml

    from learner.cli.launch_ppo import main

    base = ["--runs-dir", str(tmp_path), "--run-id", "p", "--no-progress", "--in-process", "--workers", "1"]
    assert (
        main(["--config", "cartpole_ppo_sb3", "--learning-rate", "1e-3", "--total-steps", "1024", *base]) == 0
    )
    with caplog.at_level("INFO", logger="launch_ppo"):
        assert main([*base, "--resume", "--total-steps", "2048"]) == 0
    err = caplog.text
    saved = yaml.safe_load((tmp_path / "p" / "config.yaml").read_text())
    assert (
        saved["semantics"] == "sb3"
        and saved["ppo"]["learning_rate"] == 0.001
        and saved["env"] == "CartPole-v1"
    )
    assert "resume: total_steps 1024 -> 2048" in err and saved["resumes"][-1]["changed"] == {
        "total_steps": [1024, 2048]
    }
    assert main([*base, "--resume", "--total-steps", "3072", "--hidden-units", "32"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "the run's hidden_units is 64; 32 cannot take its place" in last
