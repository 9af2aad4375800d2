"""The frameskip regression check (the frameskip bug, docs/FRAMESKIP.md), with real actor processes and real
envs.

Every test here starts real processes (the ``frameskip_check`` command, real
``Actor`` children under fork/spawn/forkserver, the real learner runtime); no
mocks. ``tests/legacy_env.py`` rebuilds the historical bug: an env whose pickling
drops frameskip and sticky actions, held by an actor that builds it in ``__init__``.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import subprocess
import sys

import pytest

from actors.actor import Actor
from impala.envs import EnvSpec, make_env
from impala.envs.audit import ENV_IN_INIT, check_actor_builds_no_env, check_pickle_roundtrip
from learner.cli.frameskip_check import DEFAULT_ENV_IDS, _actor_configs
from legacy_env import LegacyActor, LegacyAtariEnv, SwapEnvActor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
METHODS = [m for m in ("fork", "spawn", "forkserver") if m in multiprocessing.get_all_start_methods()]


def run_spawned_actor(env_id: str, actor_class: str) -> subprocess.CompletedProcess:
    """frameskip_check with one worker of ``actor_class`` (from tests/legacy_env.py), started by spawn."""
    return run_cli(
        env_id, "--start-method", "spawn", "--workers", "1", "--actor-class", f"legacy_env:{actor_class}"
    )


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    # PYTHONPATH: the CLI (and the children it spawns) must import tests/legacy_env.py for --actor-class.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run(
        [sys.executable, "-m", "learner.cli.frameskip_check", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def error_lines(stderr: str) -> list[str]:
    """stderr without the ALE's banner (printed by every emulator instance)."""
    return [
        l for l in stderr.splitlines() if l.strip() and not l.startswith(("A.L.E:", "[Powered by Stella]"))
    ]


def own_children() -> list[tuple[int, str]]:
    """Live direct children of this process, except multiprocessing's resource tracker / fork server."""
    out = []
    me = str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if (
            fields[1] == me
            and fields[0] not in ("Z", "X")
            and "resource_tracker" not in cmd
            and "forkserver" not in cmd
        ):
            out.append((int(pid), cmd))
    return out


# 1 -------------------------------------------------------------------------
def test_cli_passes_on_default_ids_under_every_start_method():
    r = run_cli("--workers", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    table = [l for l in r.stdout.splitlines() if l.split() and l.split()[0] in DEFAULT_ENV_IDS]
    assert len(table) == len(DEFAULT_ENV_IDS) * len(METHODS), r.stdout
    for env_id in DEFAULT_ENV_IDS:
        for method in METHODS:
            line = next(l for l in table if l.split()[:2] == [env_id, method])
            assert line.split()[2] == "1/1"  # the worker said hello
            assert line.endswith("OK") and "MISMATCH" not in line, line
    pong_v4 = next(l for l in table if l.startswith("Pong-v4 "))
    assert "2..4 / 2..4" in pong_v4  # the stochastic skip is measured as a range
    assert "Traceback" not in r.stderr


# 2 -------------------------------------------------------------------------
def test_legacy_env_built_in_init_and_pickled_into_a_spawned_worker_is_caught():
    # PongDeterministic-v0: frameskip 4, sticky 0.25. The legacy actor's env is pickled into the
    # spawned child and comes back with gym <= 0.10.5's defaults: frameskip (2, 5), sticky 0.
    r = run_spawned_actor("PongDeterministic-v0", "LegacyActor")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    frameskip = [l for l in r.stderr.splitlines() if "worker 0: frameskip: configured 4, measured 2..4" in l]
    assert frameskip and "pickl" in frameskip[0], (
        r.stderr
    )  # names the field, both values and the likely cause
    assert "sticky: configured 0.25, measured 0." in r.stderr
    assert ENV_IN_INIT in r.stderr
    assert "MISMATCH" in r.stdout


def test_actor_with_an_unpicklable_env_from_init_is_a_finding_under_spawn_not_a_traceback():
    r = run_spawned_actor("PongDeterministic-v4", "UnpicklableEnvActor")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert "could not be sent to a spawn worker" in r.stderr and "pickle" in r.stderr, r.stderr
    assert "UnpicklableEnvActor.ale is a ALEInterface" in r.stderr  # the attribute that holds the env


def test_pickle_roundtrip_of_the_legacy_env_reports_frameskip_and_sticky():
    problems = {m.field: m for m in check_pickle_roundtrip("PongDeterministic-v0", env_class=LegacyAtariEnv)}
    assert set(problems) >= {"frameskip", "sticky"}
    assert (problems["frameskip"].configured, problems["frameskip"].measured) == ("4", "2..4")
    assert (problems["sticky"].configured, problems["sticky"].measured) == ("0.25", "0")
    # ale-py's own AtariEnv keeps its settings through pickling.
    assert check_pickle_roundtrip("PongDeterministic-v0") == []


# 3 -------------------------------------------------------------------------
def test_actor_that_builds_its_env_in_init_is_flagged_and_the_real_actor_is_not():
    config = _actor_configs(
        EnvSpec("PongDeterministic-v4"),
        range(1),
        trajectory_endpoint="tcp://127.0.0.1:1",
        params_endpoint="tcp://127.0.0.1:2",
        seed=0,
        fingerprint_steps=50,
    )[0]
    legacy = LegacyActor(config)
    try:
        flags = check_actor_builds_no_env(legacy)
        assert len(flags) == 1 and flags[0].startswith("LegacyActor.env ") and ENV_IN_INIT in flags[0]
    finally:
        legacy.env.close()
    assert check_actor_builds_no_env(Actor(config)) == []
    # An env hidden inside the config (a list in a dict in a dataclass in a dataclass) is found too.
    env = make_env(EnvSpec("PongDeterministic-v4"))
    try:
        hidden = Actor(
            dataclasses.replace(config, env=dataclasses.replace(config.env, kwargs={"envs": [env]}))
        )
        flags = check_actor_builds_no_env(hidden)
        assert len(flags) == 1 and "config.env.kwargs['envs'][0]" in flags[0], flags
    finally:
        env.close()


# 4 -------------------------------------------------------------------------
def test_runtime_refuses_to_train_when_one_actor_fingerprint_differs(tmp_path):
    from impala.envs.fingerprint import FingerprintMismatchError
    from impala.envs.probe import probe_env
    from impala.run.config import ImpalaConfig, RunConfig
    from learner.run.runtime import RunPlan, run
    from learner.vtrace_learner import ImpalaTrainer

    config = RunConfig(
        env="PongDeterministic-v4",
        workers=2,
        envs_per_worker=1,
        unroll_length=20,
        total_frames=100_000,
        device="cpu",
        logdir=str(tmp_path),
        start_method="spawn",
        progress=False,
    )
    env = probe_env(EnvSpec(config.env), seed=config.seed)
    trainer = ImpalaTrainer(ImpalaConfig(batch_size=2, minibatches=1), config, env)
    with pytest.raises(FingerprintMismatchError) as info:
        run(trainer, config, RunPlan(env, "test", actor_class=SwapEnvActor, hello_timeout=120))
    msg = str(info.value)
    assert "actor 1" in msg and "frameskip: configured 4, measured 3" in msg, msg
    assert trainer.learner.updates == 0
    assert not os.path.exists(config.checkpoint_path)
    assert own_children() == []


# 5 -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, expect",
    [
        (
            ["PongDeterministc-v4"],
            ["unknown env id 'PongDeterministc-v4'", "Close matches", "PongDeterministic-v4"],
        ),
        (
            ["PongDeterministic-v4", "--start-method", "vfork"],
            ["start method 'vfork' is not available", "fork"],
        ),
        (["--plot", "x.png", "--episodes", "0"], ["--episodes must be >= 1, got 0"]),
        (["--episodes", "-3"], ["--episodes must be >= 1, got -3"]),
    ],
)
def test_bad_input_is_one_line_exit_2(args, expect, capsys):
    """The first case through the real command; the others through its main in this process (they fail
    before any process starts)."""
    if args == ["PongDeterministc-v4"]:
        r = run_cli(*args, timeout=60)
    else:
        from learner.cli.frameskip_check import main

        rc = main(list(args))
        cap = capsys.readouterr()
        r = subprocess.CompletedProcess(args, rc, cap.out, cap.err)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("frameskip_check: error: "), r.stderr
    for e in expect:
        assert e in lines[0]


# 6 -------------------------------------------------------------------------
def test_plot_writes_a_png(tmp_path):
    out = tmp_path / "frameskip.png"
    r = run_cli(
        "--plot",
        str(out),
        "--plot-only",
        "--episodes",
        "2",
        "--max-steps-per-episode",
        "60",
        "--jobs",
        "2",
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    import matplotlib.image

    image = matplotlib.image.imread(str(out))
    assert image.shape[0] > 300 and image.shape[1] > 600
    assert "configured (frameskip 4, sticky 0): 2 episodes" in r.stdout
    assert "mis-specified twin (frameskip 2-4, sticky 0.25): 2 episodes" in r.stdout
