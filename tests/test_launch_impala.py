"""launch_impala end to end: real actor processes, real ZeroMQ, real signals."""

import csv
import dataclasses
import math
import os
import re
import signal
import time

import pytest
import torch
import yaml

from procs import (
    actor_pids,
    alive,
    cmdline,
    descendants,
    free_port_pair,
    kill_group,
    push_socket,
    run,
    signal_and_wait,
    start,
    wait_for,
)

CARTPOLE = "--env CartPole-v1 --unroll-length 20 --batch-size 8 --no-progress --log-interval 2".split()


def _done_line(out: str) -> str:
    lines = [l for l in out.splitlines() if l.startswith("launch_impala: done")]
    assert lines, out[-3000:]
    return lines[-1]


def _frames(line: str) -> int:
    return int(re.search(r"done: (\d+) env frames", line).group(1))


def _csv_rows(logdir) -> list[dict]:
    with open(os.path.join(logdir, "metrics.csv")) as f:
        return list(csv.DictReader(f))


def test_cartpole_learns_to_195_within_3_minutes(tmp_path):
    t0 = time.monotonic()
    # The README's CartPole recipe: short unrolls, small batches, a higher learning rate than Atari's.
    out = run(
        [
            "launch_impala",
            "--workers",
            "2",
            *CARTPOLE,
            *(
                "--learning-rate 2e-3 --total-frames 400000 --max-seconds 170 --stop-at-return 195 --logdir"
            ).split(),
            str(tmp_path),
            "--log-interval",
            "5",
        ],
        timeout=240,
    )
    elapsed = time.monotonic() - t0
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = _done_line(out.stdout)
    mean = float(re.search(r"mean return \(last 100\) ([\d.]+)", line).group(1))
    print(line, f"elapsed {elapsed:.0f}s")
    assert mean >= 195 and "stopped at --stop-at-return 195" in line, line
    assert elapsed < 180 + 30  # 3 minutes of training plus process start-up
    last = _csv_rows(tmp_path)[-1]  # the curve ends where the run stopped
    assert float(last["charts/mean_return_100"]) >= 195, last


def test_pong_smoke_actor_kill_checkpoint_and_resume(tmp_path):
    port = free_port_pair()
    args = [
        *(
            "--env PongDeterministic-v4 --workers 2 --envs-per-worker 2 --unroll-length 20 --batch-size "
            "4 --minibatches 2 --no-progress --log-interval 1 --logdir"
        ).split(),
        str(tmp_path),
        "--port",
        str(port),
    ]
    proc = start(["launch_impala", *args, "--total-frames", "12000", "--max-seconds", "150"])
    try:
        # Once frames move, SIGKILL one actor mid-unroll: it must be restarted and no partial unroll may
        # arrive.
        assert wait_for(lambda: os.path.exists(tmp_path / "metrics.csv"), 120), "no metrics written"
        victims = actor_pids(proc.pid)
        assert len(victims) == 2
        os.kill(victims[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=200)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-3000:]
    line = _done_line(out)
    assert "actor restarts 1" in line or "actor restarts 2" in line, line
    assert "exited with code -9; restarting" in out
    assert "dropped {}" in line or "dropped 0" in line, line  # nothing partial or malformed arrived
    frames = _frames(line)
    assert frames >= 12000
    rows = _csv_rows(tmp_path)
    assert rows and all(math.isfinite(float(r["losses/total"])) for r in rows)
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert ckpt["env_frames"] == frames and ckpt["version"] > 0

    out2 = run(
        ["launch_impala", *args, "--total-frames", str(frames + 4000), "--resume", "--max-seconds", "120"],
        timeout=200,
    )
    assert out2.returncode == 0, out2.stdout[-3000:] + out2.stderr[-3000:]
    assert f"at {frames} env frames" in out2.stdout + out2.stderr
    line2 = _done_line(out2.stdout)
    assert _frames(line2) >= frames + 4000
    ckpt2 = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert ckpt2["version"] > ckpt["version"]


def test_learner_sigkill_then_resume_continues_from_checkpoint(tmp_path):
    proc = start(
        [
            "launch_impala",
            "--workers",
            "2",
            *CARTPOLE,
            *"--total-frames 10000000 --checkpoint-minutes 0.02 --logdir".split(),
            str(tmp_path),
        ]
    )
    try:
        ckpt_path = tmp_path / "checkpoint.pt"
        assert wait_for(
            lambda: ckpt_path.exists() and torch.load(ckpt_path, weights_only=True)["env_frames"] > 20000, 150
        )
        actors = actor_pids(proc.pid)
        assert actors
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        # Orphaned actors notice their learner is gone and exit by themselves.
        assert wait_for(lambda: not any(alive(p) for p in actors), 15), [p for p in actors if alive(p)]
    finally:
        kill_group(proc)
    saved = torch.load(ckpt_path, weights_only=True)
    frames = saved["env_frames"]
    out = run(
        [
            "launch_impala",
            "--workers",
            "1",
            *CARTPOLE,
            "--total-frames",
            str(frames + 5000),
            "--resume",
            "--logdir",
            str(tmp_path),
        ],
        timeout=150,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"at {frames} env frames, policy version {saved['version']}" in out.stderr + out.stdout
    assert _frames(_done_line(out.stdout)) >= frames + 5000
    # the last 100 episodes went through the checkpoint: the resumed curve's episode count goes on from
    # the killed run's and its first row's mean return is over a full window, not the first few episodes
    episodes = saved["episodes"]
    assert len(episodes["returns"]) == 100 and episodes["total"] >= 100, episodes["total"]
    steps = [int(r["step"]) for r in _csv_rows(tmp_path)]
    assert steps == sorted(steps), "the rows the killed run logged after its checkpoint are logged once"
    resumed = [r for r in _csv_rows(tmp_path) if int(float(r["charts/env_frames"])) > frames]
    assert resumed and float(resumed[0]["charts/episodes"]) >= episodes["total"], (resumed[:1], episodes)


def test_a_run_shorter_than_one_log_interval_still_ends_its_curve_at_its_last_frames(tmp_path):
    """The budget runs out long before the first --log-interval: the curve still gets its closing row, at
    the frames the run stopped at (a resumed run's few thousand frames must show on its curve)."""
    argv = list(CARTPOLE)
    argv[argv.index("--log-interval") + 1] = "3600"
    out = run(["launch_impala", "--workers", "1", *argv, "--total-frames", "3000", "--logdir", str(tmp_path)],
              timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = _csv_rows(tmp_path)
    assert len(rows) == 1, rows
    assert int(float(rows[0]["charts/env_frames"])) == _frames(_done_line(out.stdout)) >= 3000


def _cpus_allowed(pid: int, task: str | int | None = None) -> str:
    path = f"/proc/{pid}/status" if task is None else f"/proc/{pid}/task/{task}/status"
    with open(path) as f:
        return next(line.split(":")[1].strip() for line in f if line.startswith("Cpus_allowed_list"))


@pytest.mark.serial  # it pins processes to CPUs; a neighbouring test would share them
@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs: one for the learner, one for actors"
)
def test_cpu_affinity_split_and_actor_nice_place_the_learner_and_its_actors(tmp_path):
    """--cpu-affinity split: every thread of the learner (its receive thread too) on the first CPU, the
    actor processes on the others, a restarted actor as well; --actor-nice lowers the actors' priority,
    not the learner's; training goes on."""
    cpus = sorted(os.sched_getaffinity(0))
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    proc = start(["launch_impala", "--workers", "2", *CARTPOLE, "--cpu-affinity", "split",
                  "--actor-nice", "7", "--total-frames", "10000000", "--logdir", str(tmp_path)])  # fmt: skip
    try:
        assert wait_for(lambda: (tmp_path / "metrics.csv").exists() and len(_csv_rows(tmp_path)) >= 2, 120)
        learner, actors = str(cpus[0]), _compact_range(cpus[1:])
        threads = os.listdir(f"/proc/{proc.pid}/task")
        assert len(threads) > 1 and {_cpus_allowed(proc.pid, t) for t in threads} == {learner}
        pids = actor_pids(proc.pid)
        assert len(pids) == 2 and {_cpus_allowed(p) for p in pids} == {actors}
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == ours
        assert {os.getpriority(os.PRIO_PROCESS, p) for p in pids} == {min(ours + 7, 19)}
        os.kill(pids[0], signal.SIGKILL)  # the pool's restart pins itself too
        assert wait_for(lambda: len(set(actor_pids(proc.pid)) - set(pids)) == 1, 60)
        new = (set(actor_pids(proc.pid)) - set(pids)).pop()
        assert wait_for(lambda: _cpus_allowed(new) == actors, 30)
        assert wait_for(lambda: os.getpriority(os.PRIO_PROCESS, new) == min(ours + 7, 19), 30)
        rows = len(_csv_rows(tmp_path))
        assert wait_for(lambda: len(_csv_rows(tmp_path)) > rows + 1, 60)  # still training
    finally:
        kill_group(proc)


@pytest.mark.serial  # its actors run at nice 19: beside other tests they would get few cycles and crawl
def test_cpu_affinity_learner_first_nices_the_actors_and_pins_nothing(tmp_path):
    """--cpu-affinity learner-first: the actor processes (a restarted one too) 19 nice levels below the
    learner, which keeps its own priority; nothing pinned; training goes on."""
    everything = _compact_range(sorted(os.sched_getaffinity(0)))
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    proc = start(["launch_impala", "--workers", "2", *CARTPOLE, "--cpu-affinity", "learner-first",
                  "--total-frames", "10000000", "--logdir", str(tmp_path)])  # fmt: skip
    try:
        assert wait_for(lambda: (tmp_path / "metrics.csv").exists() and len(_csv_rows(tmp_path)) >= 2, 120)
        pids = actor_pids(proc.pid)
        assert len(pids) == 2 and os.getpriority(os.PRIO_PROCESS, proc.pid) == ours
        assert {os.getpriority(os.PRIO_PROCESS, p) for p in pids} == {min(ours + 19, 19)}
        threads = os.listdir(f"/proc/{proc.pid}/task")
        placed = {_cpus_allowed(proc.pid, t) for t in threads} | {_cpus_allowed(p) for p in pids}
        assert placed == {everything}
        os.kill(pids[0], signal.SIGKILL)  # the pool's restart lowers itself too
        assert wait_for(lambda: len(set(actor_pids(proc.pid)) - set(pids)) == 1, 60)
        new = (set(actor_pids(proc.pid)) - set(pids)).pop()
        assert wait_for(lambda: os.getpriority(os.PRIO_PROCESS, new) == min(ours + 19, 19), 30)
        rows = len(_csv_rows(tmp_path))
        assert wait_for(lambda: len(_csv_rows(tmp_path)) > rows + 1, 60)  # still training
    finally:
        kill_group(proc)
    out = proc.communicate(timeout=30)[0]
    assert "local actors: 2, 19 nice levels below the learner" in out, out[-2000:]
    # and, unless --publish-delay says otherwise, the actors' weights one update behind
    assert "weights: the actors act on weights 1 update behind the learner's" in out, out[-2000:]
    assert "publish_delay: 1" in (tmp_path / "config.yaml").read_text()


def _compact_range(cpus: list[int]) -> str:
    """How /proc writes a CPU list: runs of consecutive CPUs as a-b."""
    runs, out = [], []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    for a, b in runs:
        out.append(str(a) if a == b else f"{a}-{b}")
    return ",".join(out)


def test_ctrl_c_leaves_no_child_processes(tmp_path):
    proc = start(
        [
            "launch_impala",
            "--workers",
            "2",
            *CARTPOLE,
            "--total-frames",
            "10000000",
            "--logdir",
            str(tmp_path),
        ]
    )
    try:
        assert wait_for(lambda: os.path.exists(tmp_path / "metrics.csv"), 150)
        children = descendants(proc.pid)
        assert len(actor_pids(proc.pid)) == 2
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        out, _ = proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "(interrupted)" in _done_line(out)
    assert (tmp_path / "checkpoint.pt").exists()
    # Actors are joined before exit; multiprocessing's resource tracker exits once its pipe closes.
    assert wait_for(lambda: not any(alive(p) for p in children), 10), [
        cmdline(p) for p in children if alive(p)
    ]


def test_unknown_env_id_lists_close_matches(tmp_path):
    folder = tmp_path / "new-run"
    argv = ["launch_impala", "--env", "PongDeterministc-v4", "--workers", "1", "--logdir", str(folder)]
    out = run(argv, timeout=60)
    assert out.returncode == 2
    assert "unknown env id 'PongDeterministc-v4'" in out.stderr and "PongDeterministic-v4" in out.stderr
    assert "Traceback" not in out.stderr
    assert not folder.exists()  # the folder made for the run went with the failed start
    folder.mkdir()  # one that was there before stays, empty or not
    assert run(argv, timeout=60).returncode == 2 and folder.is_dir()


def test_port_in_use_names_port_and_flag(tmp_path):
    import zmq

    sock = zmq.Context.instance().socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        out = run(
            ["launch_impala", *CARTPOLE, "--workers", "1", "--port", str(port), "--logdir", str(tmp_path)],
            timeout=60,
        )
    finally:
        sock.close()
    assert out.returncode == 2
    assert f"port {port}" in out.stderr and "--port" in out.stderr
    assert "Traceback" not in out.stderr


def test_help_documents_every_option():
    out = run(["launch_impala", "--help"], timeout=60)
    assert out.returncode == 0
    for flag in (
        "--workers",
        "--env",
        "--total-frames",
        "--device",
        "--logdir",
        "--resume",
        "--bind",
        "--start-method",
        "--popart",
        "--batch-size",
    ):
        # A switch is shown once as --[no-]NAME, which documents both --NAME and --no-NAME.
        assert flag in out.stdout or f"--[no-]{flag[2:]}" in out.stdout, flag


def test_env_kwargs_override_is_applied_and_validated(tmp_path):
    from impala.envs import EnvSpec
    from impala.envs.probe import probe_env
    from impala.options import ConfigError
    from impala.run.config import RunConfig

    cfg = RunConfig(env="PongNoFrameskip-v4", env_kwargs='{"frameskip": 4}', logdir=str(tmp_path))
    fp = probe_env(EnvSpec(cfg.env, cfg.env_overrides)).fingerprint
    assert (fp.frameskip_min, fp.frameskip_max) == (4, 4)  # measured, not read back from the config
    with pytest.raises(ConfigError, match="--env-kwargs"):
        RunConfig(env_kwargs="[1, 2]")
    out = run(["launch_impala", "--env-kwargs", "{bad"], timeout=60)
    assert (
        out.returncode == 2
        and "--env-kwargs is not valid JSON" in out.stderr
        and "Traceback" not in out.stderr
    )


BAD_VALUES = [
    (["--learning-rate", "inf"], "--learning-rate must be a finite number"),
    (["--rmsprop-alpha", "5"], "--rmsprop-alpha must be in [0, 1)"),
    (["--entropy-cost", "nan"], "--entropy-cost must be a finite number"),
    (["--max-policy-lag", "-1"], "--max-policy-lag must be >= 0"),
    (["--queue-size", "-1"], "--queue-size must be >= 0"),
    (["--publish-delay", "-1"], "--publish-delay must be 0-16 updates, got -1"),
    (["--publish-delay", "17"], "--publish-delay must be 0-16 updates, got 17"),
    (["--publish-delay", "2", "--max-policy-lag", "1"], "--max-policy-lag 1 would drop them all"),
    (["--max-seconds", "-1"], "--max-seconds must be >= 0"),
    (["--log-interval", "nan"], "--log-interval must be a finite number"),
    (["--stop-at-return", "inf"], "--stop-at-return must be a finite number"),
    (["--torch-threads", "-1"], "--torch-threads must be >= 0"),
    (["--actor-nice", "20"], "--actor-nice must be 0-19, got 20"),
    (["--actor-nice", "-1"], "--actor-nice must be 0-19, got -1"),
    (["--actor-nice", "5", "--in-process"], "--actor-nice lowers the local actor processes' priority"),
    (["--cpu-affinity", "learner-first", "--in-process"], "--cpu-affinity learner-first runs the local"),
    (["--seed", "-1"], "--seed must be in 0.."),
    (["--rmsprop-eps", "-1"], "--rmsprop-eps must be > 0"),
    (["--rmsprop-momentum", "-1"], "--rmsprop-momentum must be >= 0"),
    (["--minibatches", "3"], "--minibatches must divide --batch-size 32 (one of 1, 2, 4, 8, 16, 32), got 3"),
    (["--device", "cuda:7"], "--device cuda:7"),
    (
        ["--in-process", "--cpu-affinity", "split"],
        "--cpu-affinity split pins one learner and its local actor",
    ),
    (["--learners", "2", "--cpu-affinity", "split"], "needs --workers >= 1, no --in-process and one learner"),
    (
        ["--torch-threads", "4096", "--cpu-affinity", "split"],
        "and leaves the actors none; lower --torch-threads",
    ),
    (["--env", "CartPole-v1", "--model", "deep"], "--model deep: model kind 'deep' needs image observations"),
    (["--env", "CartPole-v1", "--precision", "bf16"], "--precision bf16 runs an image torso's convolutions"),
    (
        ["--env", "CartPole-v1", "--sync", "--envs-per-worker", "3"],
        "--sync needs local actors whose envs divide a batch: --batch-size 32 is not a multiple of --workers",
    ),
    (
        ["--env", "CartPole-v1", "--sync", "--publish-delay", "1"],
        "--sync waits for each update's weights; with the actors' weights 1 update(s) behind",
    ),
    (["--env", "CartPole-v1", "--env-kwargs", '{"foo": 1}'], "CartPole-v1 does not accept them"),
    (
        ["--env", "CartPole-v1", "--logdir", "/proc/no-such-dir"],
        "--logdir /proc/no-such-dir: cannot create it",
    ),
]


@pytest.mark.parametrize("argv,message", BAD_VALUES, ids=[a[0] for a, _ in BAD_VALUES])
def test_bad_values_are_one_line_errors_before_anything_starts(argv, message, capsys, tmp_path, monkeypatch):
    from learner.cli.launch_impala import main

    if argv[:2] == ["--device", "cuda:7"] and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    monkeypatch.chdir(tmp_path)  # the default run folder, runs/<env>-<time>, goes here
    assert main([*argv, "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("launch_impala: error: ") and message in err[0], err
    # and the folders the failed start made (for the values found wrong after it), runs/ too, are gone again
    assert os.listdir(tmp_path) == []


def test_bad_log_level_and_preset_from_the_real_cli(tmp_path):
    out = run(["launch_impala", "--log-level", "BOGUS"], timeout=60)
    assert out.returncode == 2 and "invalid choice: 'BOGUS'" in out.stderr and "Traceback" not in out.stderr
    preset = tmp_path / "p.yaml"
    preset.write_text("learning_rate: 1e-3\nlearnin_rate: 2\n")
    out = run(["launch_impala", "--config", str(preset)], timeout=60)
    assert out.returncode == 2 and "unknown option 'learnin_rate'; did you mean learning_rate" in out.stderr
    assert "Traceback" not in out.stderr


def test_preset_values_are_defaults_that_flags_override(tmp_path):
    from learner.cli.launch_impala import parse_args

    preset = tmp_path / "p.yaml"
    preset.write_text(
        "learning-rate: 1e-3\nunroll_length: 80\noptimizer: rmsprop\n"
    )  # YAML 1.1 reads 1e-3 as a string
    args = parse_args(["--config", str(preset), "--unroll-length", "20"])
    assert (args.learning_rate, args.unroll_length, args.optimizer, args.batch_size) == (
        0.001,
        20,
        "rmsprop",
        32,
    )
    preset.write_text("unroll_length: eighty\n")
    from impala.options import ConfigError

    with pytest.raises(ConfigError, match="unroll_length"):
        parse_args(["--config", str(preset)])


def test_a_budget_flag_replaces_the_presets_budget_in_either_unit_and_says_so(tmp_path, monkeypatch):
    """The cartpole preset's budget is --total-frames; --total-steps on the command line replaces it (and the
    other way round in a preset of steps), said in one line; both given on the command line stay an error."""
    from learner.cli.launch_impala import parse_args, resolve

    run_config, _ = resolve(parse_args(["--config", "cartpole", "--total-steps", "2000"]))
    assert (run_config.total_frames, run_config.total_steps) == (None, 2000)
    steps = tmp_path / "steps.yaml"
    steps.write_text("# a preset of steps\ntotal_steps: 5000\n")
    run_config, _ = resolve(parse_args(["--config", str(steps), "--total-frames", "900"]))
    assert (run_config.total_frames, run_config.total_steps) == (900, None)
    monkeypatch.chdir(tmp_path)
    out = run(
        ["launch_impala", "--config", "cartpole", "--total-steps", "600", "--workers", "1", "--in-process",
         "--no-progress", "--logdir", str(tmp_path / "r")],
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--total-steps 600 replaces the preset's total_frames 400000" in out.stderr
    both = run(
        ["launch_impala", "--config", "cartpole", "--total-steps", "6", "--total-frames", "6"], timeout=60
    )
    assert both.returncode == 2 and "give --total-frames (env frames) or --total-steps" in both.stderr


def test_config_yaml_records_the_run_id_as_given(tmp_path):
    """`--run-id qs` names the folder runs/qs, and config.yaml says run_id: qs (it said null)."""
    out = run(
        ["launch_impala", *CARTPOLE, "--workers", "1", "--in-process", "--total-frames", "400",
         "--runs-dir", str(tmp_path), "--run-id", "qs"],
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert yaml.safe_load((tmp_path / "qs" / "config.yaml").read_text())["run_id"] == "qs"


def test_a_repository_preset_path_used_elsewhere_names_the_preset(tmp_path, monkeypatch):
    """The docs' `--config configs/cartpole.yaml` from a user's own folder: one line naming `--config
    cartpole`, which works anywhere."""
    monkeypatch.chdir(tmp_path)
    out = run(["launch_impala", "--config", "configs/cartpole.yaml"], timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "launch_impala: error: --config configs/cartpole.yaml: no such file; the preset of that name ships "
        "with the package: --config cartpole"
    )


def _cartpole_rows_after_every_update(tmp_path, *flags: str):
    """A 6,000-frame CartPole run with ``flags`` and a metrics row after every update (--log-interval 0: the
    last row counts every drop, however fast the run went): its output and rows."""
    out = run(
        ["launch_impala", *flags, *CARTPOLE, *"--total-frames 6000 --log-interval 0 --logdir".split(),
         str(tmp_path / "run")],
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    with open(tmp_path / "run" / "metrics.csv") as f:
        return out, list(csv.DictReader(f))


def test_max_policy_lag_has_launch_ppos_meaning(tmp_path):
    """Unset keeps every unroll (V-trace corrects); 0 means on-policy only, as in launch_ppo."""
    from learner.cli.launch_impala import parse_args

    assert parse_args([]).max_policy_lag is None
    assert parse_args(["--max-policy-lag", "0"]).max_policy_lag == 0
    preset = tmp_path / "p.yaml"
    preset.write_text("max_policy_lag: null\nstop_at_return: 20\n")
    args = parse_args(["--config", str(preset)])
    assert args.max_policy_lag is None and args.stop_at_return == 20.0
    # on-policy only, for real: every unroll used was produced by the current weights
    _, rows = _cartpole_rows_after_every_update(tmp_path, "--workers", "2", "--max-policy-lag", "0")
    assert rows and all(float(r["charts/policy_lag"]) == 0.0 for r in rows if r.get("charts/policy_lag"))
    assert float(rows[-1]["transport/dropped_stale"]) > 0  # unrolls from older weights were refused


def test_sync_collection_trains_every_batch_on_policy_and_drops_nothing(tmp_path):
    """--sync: each actor sends its share of a batch, then waits for the update's weights, so every unroll a
    batch holds was made with the weights of the update before it (policy lag 0) and none is dropped as
    stale, unlike --max-policy-lag 0, which throws the late ones away."""
    out, rows = _cartpole_rows_after_every_update(tmp_path, *"--workers 2 --envs-per-worker 2 --sync".split())
    lags = [float(r["charts/policy_lag"]) for r in rows if r.get("charts/policy_lag")]
    assert len(lags) > 10 and all(lag == 0.0 for lag in lags), lags
    assert float(rows[-1]["transport/dropped_stale"]) == 0 and float(rows[-1]["transport/dropped"]) == 0
    assert _frames(_done_line(out.stdout)) >= 6000


# Fields where these values are legitimate: an id/path/address checked where it is used, a threshold.
FREE_TEXT = {"env", "env_package", "logdir", "runs_dir", "run_id", "bind", "curve", "track_project"}
ANY_NUMBER = {"stop_at_return"}


@pytest.mark.parametrize("cls_name", ["RunConfig", "ImpalaConfig"])
def test_every_numeric_and_choice_field_rejects_bad_values(cls_name):
    """Walk every RunConfig and ImpalaConfig field (each is a launch_impala flag) with values that cannot
    work."""
    import dataclasses
    import math

    import impala.run.config
    from impala.options import ConfigError, field_kind

    cls = getattr(impala.run.config, cls_name)
    accepted = []
    for f in dataclasses.fields(cls):
        choices, kind, _ = field_kind(cls, f.name)
        bad = {
            float: [math.nan, math.inf, -math.inf] + ([] if f.name in ANY_NUMBER else [-1.0]),
            int: [-1],
            str: [] if f.name in FREE_TEXT else ["BOGUS"],
            bool: [],
        }[kind]
        for value in bad:
            try:
                cls(**{f.name: value})
                accepted.append((f.name, value))
            except ConfigError:
                pass
    assert accepted == []


def test_a_forged_hello_for_a_local_actor_neither_stops_nor_blinds_the_run(tmp_path):
    """Issue 10, item 2: anyone who reaches the port can send a hello as actor 0. Without the
    token the learner handed its own actors at spawn it is refused, and it does not evict them:
    actor 0 adds 4,000 frames after the forgeries (counted from two log rows after they were sent,
    so the test does not depend on how fast this machine is), and the run ends cleanly."""
    import signal

    from impala.transport import wire

    port = free_port_pair()
    learner = start(
        [
            "launch_impala",
            "--workers",
            "1",
            *CARTPOLE,
            "--port",
            str(port),
            *"--total-frames 100000000 --max-seconds 600 --logdir".split(),
            str(tmp_path),
        ]
    )
    sock = push_socket(port)

    def frames_logged() -> list[int]:
        rows = _csv_rows(tmp_path) if (tmp_path / "metrics.csv").exists() else []
        return [int(float(r["charts/env_frames"])) for r in rows if r.get("charts/env_frames")]

    try:
        assert wait_for(lambda: frames_logged(), 90), "the run never started"
        rows_at_forgery = len(frames_logged())
        for actor in (0, 0, 5):  # the local actor's id (twice), then a free remote id
            sock.send_multipart(
                [
                    bytes(f)
                    for f in wire.encode("hello", actor=actor, version=-1, info={"fingerprint": {"junk": 1}})
                ]
            )
        # The baseline is taken two log rows (>= 4 s) after the forgeries, when they have long been handled
        # and
        # anything actor 0 had queued before them is trained on: frames past it are frames actor 0 made after.
        assert wait_for(lambda: len(frames_logged()) >= rows_at_forgery + 2, 60)
        at_forgery = frames_logged()[-1]
        assert wait_for(lambda: frames_logged()[-1] >= at_forgery + 4000, 120), (
            at_forgery,
            frames_logged()[-3:],
        )
        out = signal_and_wait(learner, signal.SIGTERM)
    finally:
        sock.close()
        kill_group(learner)
    assert learner.returncode == 0, out[-3000:]
    assert "ignored a hello in the name of verified actor 0" in out and "no valid local token" in out, out[
        -3000:
    ]
    assert "refused actor 5" in out
    assert _frames(_done_line(out)) >= at_forgery + 4000  # actor 0 kept training after the forgeries


# Presets that are today's defaults but for a few settings (each file's comment says which and why).
BUT_FOR = {
    "pong_fast_cpu.yaml": {"minibatches": 4, "obs_norm": False},
    "pong_per_step_cpu.yaml": {
        "minibatches": 4,
        "targets": "per_step",
        "learning_rate": 2.5e-4,
        "obs_norm": False,
    },
}


def settled(argv: list[str]) -> tuple:
    """launch_impala's settings for ``argv`` as a Pong run starts with them: every derived default settled."""
    from impala.run.config import settle
    from learner.cli.launch_impala import chosen_options, parse_args, resolve

    args = parse_args(argv)
    return settle(*resolve(args), (4, 84, 84), chosen=chosen_options(args))


@pytest.mark.parametrize(
    "name",
    (
        "atari.yaml atari_deep.yaml pong_small_cpu.yaml pong_fast_cpu.yaml pong_per_step_cpu.yaml "
        "cartpole.yaml"
    ).split(),
)
def test_shipped_presets_load_and_validate(name):
    """Every preset in configs/ names only real options with valid values, and says where its numbers come
    from."""
    from learner.cli.launch_impala import parse_args, resolve

    path = os.path.join(os.path.dirname(__file__), "..", "configs", name)
    with open(path) as f:
        assert f.readline().startswith("# "), (
            "a preset starts with a comment saying where its numbers come from"
        )
    run_config, impala = resolve(parse_args(["--config", path]))
    with open(path) as f:
        written = yaml.safe_load(f)
    for key, value in written.items():  # every key of the file is what the run gets
        resolved = getattr(impala, key) if hasattr(impala, key) else getattr(run_config, key)
        if isinstance(resolved, float) and isinstance(value, str):
            value = float(
                value
            )  # YAML 1.1 reads 1e-05 (no dot) as a string; the loader takes it as the number
        assert resolved == value, (name, key, resolved, value)
    expected_model = {"atari.yaml": "shallow", "atari_deep.yaml": "deep"}.get(
        name, written.get("model", "auto")
    )
    assert impala.model == expected_model
    if name == "pong_small_cpu.yaml":
        # the file pins today's defaults; if a default moves, this file (and docs/PONG.md) must say so
        assert settled(["--config", path]) == settled(["--env", "PongDeterministic-v4"])
    elif name in BUT_FOR:  # the defaults but for what its comment names
        (run_config, impala), (default_run, default_impala) = (
            settled(["--config", path]),
            settled(["--env", "PongDeterministic-v4"]),
        )
        differs = BUT_FOR[name]
        assert {k: getattr(impala, k) for k in differs} == differs
        back = {k: getattr(default_impala, k) for k in differs}
        assert dataclasses.replace(impala, **back) == default_impala
        assert run_config == default_run
    elif name.startswith("atari"):
        assert (impala.loss_reduction, impala.optimizer, impala.learning_rate, run_config.unroll_length) == (
            "sum",
            "rmsprop",
            6e-4,
            20,
        )


def test_runs_get_their_own_folders_and_a_used_one_is_never_overwritten(tmp_path, capsys):
    """The same command twice: the second is refused (one line, exit 2) and the first run's files are
    untouched;
    --force starts over; --resume of the finished run exits 0 at once; config.yaml says what ran."""
    from learner.cli.launch_impala import main

    tiny = [
        *(
            "--env CartPole-v1 --workers 1 --in-process --unroll-length 8 --batch-size 2 --minibatches "
            "1 --total-frames 64 --no-progress --device cpu --runs-dir"
        ).split(),
        str(tmp_path),
        "--log-interval",
        "0",
    ]
    assert main([*tiny, "--run-id", "first"]) == 0
    folder = tmp_path / "first"
    written = yaml.safe_load((folder / "config.yaml").read_text())
    assert written["env"] == "CartPole-v1" and written["batch_size"] == 2 and written["logdir"] == str(folder)
    before = {
        name: (folder / name).stat().st_mtime_ns for name in ("checkpoint.pt", "metrics.csv", "config.yaml")
    }
    capsys.readouterr()
    assert main([*tiny, "--run-id", "first"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds a run" in err[0] and "--resume" in err[0] and "--force" in err[0], err
    assert {name: (folder / name).stat().st_mtime_ns for name in before} == before
    assert main([*tiny, "--run-id", "first", "--resume"]) == 0
    assert "nothing to resume" in capsys.readouterr().out
    assert main([*tiny, "--run-id", "first", "--force", "--seed", "3"]) == 0
    assert yaml.safe_load((folder / "config.yaml").read_text())["seed"] == 3
    assert main([*tiny]) == 0  # no --run-id: a new folder named by the env and the time
    assert any(p.name.startswith("CartPole-v1-20") for p in tmp_path.iterdir())


def test_resume_continues_the_run_as_it_was_and_records_what_a_flag_changed(tmp_path):
    """The quick start's recipe (unroll 20, batch 8, lr 2e-3), resumed with only the run id and a larger
    budget, goes on with that recipe (not the defaults: unroll 32, batch 32, lr 5e-4); a flag given on a
    resume changes that one setting, says so and records it; an env change or a hand-broken config.yaml is
    one line, exit 2, and leaves the folder as it was."""
    base = ["--runs-dir", str(tmp_path), "--run-id", "cp", "--no-progress", "--log-interval", "1"]
    recipe = ["--unroll-length", "20", "--batch-size", "8", "--learning-rate", "2e-3"]
    first = run(
        ["launch_impala", "--workers", "1", "--env", "CartPole-v1", *recipe, "--total-frames", "6000", *base],
        timeout=240,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    folder = tmp_path / "cp"

    def config():
        return yaml.safe_load((folder / "config.yaml").read_text())

    again = run(["launch_impala", *base, "--resume", "--total-frames", "9000"], timeout=240)
    assert again.returncode == 0, again.stderr[-2000:]
    saved = config()
    assert (saved["unroll_length"], saved["batch_size"], saved["learning_rate"]) == (20, 8, 0.002)
    assert saved["env"] == "CartPole-v1" and saved["total_frames"] == 9000
    assert "resume: total_frames 6000 -> 9000" in again.stderr
    assert [r["changed"] for r in saved["resumes"]] == [{"total_frames": [6000, 9000]}]
    rows = list(csv.DictReader(open(folder / "metrics.csv")))
    resumed = [r for r in rows if float(r["charts/env_frames"]) > 6000]
    # the first resumed row's learning rate: 2e-3 decaying over 9000 frames, not the default's 5e-4 curve
    lr, frames = float(resumed[0]["charts/learning_rate"]), float(resumed[0]["charts/env_frames"])
    assert lr == pytest.approx(2e-3 * (1 - frames / 9000), rel=0.05, abs=2e-5), (lr, frames)

    changed = run(["launch_impala", *base, "--resume", "--total-frames", "12000", "--learning-rate", "1e-3"],
                  timeout=240)  # fmt: skip
    assert changed.returncode == 0, changed.stderr[-2000:]
    assert "resume: learning_rate 0.002 -> 0.001" in changed.stderr
    assert config()["learning_rate"] == 0.001 and config()["unroll_length"] == 20
    assert config()["resumes"][-1]["changed"] == {
        "total_frames": [9000, 12000],
        "learning_rate": [0.002, 0.001],
    }

    before = (folder / "config.yaml").read_text()
    other = run(["launch_impala", *base, "--resume", "--env", "Acrobot-v1"], timeout=120)
    assert other.returncode == 2 and "Traceback" not in other.stderr
    assert other.stderr.strip().splitlines()[-1] == (
        "launch_impala: error: --resume: the run's env is 'CartPole-v1'; 'Acrobot-v1' cannot take its place "
        "in a running run (resume without --env, or start a new run)"
    )
    (folder / "config.yaml").write_text(before.replace("batch_size: 8", "batch_size: eight"))
    broken = run(["launch_impala", *base, "--resume", "--total-frames", "15000"], timeout=120)
    assert broken.returncode == 2 and "Traceback" not in broken.stderr
    assert "config.yaml: batch_size must be int, got 'eight'" in broken.stderr.strip().splitlines()[-1]
    assert (folder / "config.yaml").read_text() == before.replace("batch_size: 8", "batch_size: eight")
