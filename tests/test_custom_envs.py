"""Any gymnasium env: a user's package that registers its envs on import (tests/custom_envs), named by
gymnasium's ``module:id`` or by ``--env-package``, trains through launch_impala and travels to actors."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys

import pytest
import torch

from impala.envs import EnvPackageError, EnvSpec, make_env
from impala.transport.messages import RunInfo
from learner.cli import launch_impala, launch_ppo

TINY_RUN = (
    "--workers 1 --in-process --envs-per-worker 2 --unroll-length 8 --batch-size 4 --minibatches 1 "
    "--total-frames 400 --no-progress --device cpu --log-interval 0"
).split()
NO_SUCH = "env package 'no_such_env_package_here' does not import (ModuleNotFoundError"


def _error_lines(err: str) -> list[str]:
    """stderr without the log lines (they start with a date)."""
    return [line for line in err.splitlines() if line.strip() and not re.match(r"^\d{4}-\d\d-\d\d ", line)]


def _done(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("launch_impala: done")]
    assert lines, out[-3000:]
    return lines[-1]


@pytest.mark.parametrize(
    "env_args",
    [["--env", "custom_envs:Tiny-v0"], ["--env-package", "custom_envs", "--env", "Tiny-v0"]],
    ids=["module:id", "env-package"],
)
def test_a_users_registered_env_trains_through_launch_impala(env_args, tmp_path, capsys):
    rc = launch_impala.main([*env_args, *TINY_RUN, "--logdir", str(tmp_path / "run")])
    out = capsys.readouterr()
    assert rc == 0, out.out[-2000:] + out.err[-2000:]
    line = _done(out.out)
    frames = int(re.search(r"done: (\d+) env frames", line).group(1))
    updates = int(re.search(r"(\d+) updates", line).group(1))
    assert frames >= 400 and updates >= 1, line
    # The checkpoint records the package with the env, so impala-eval (and --resume) can build it again.
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert state["env"]["id"] == "Tiny-v0" and state["env"]["packages"] == ["custom_envs"], state["env"]


def test_the_package_travels_with_the_spec_to_a_fresh_process():
    # A fresh interpreter that never imported custom_envs (as a spawned actor, or a remote one reading the
    # run info) builds the env from the spec alone: the spec imports its package before gym.make.
    spec = EnvSpec("custom_envs:Tiny-v0")
    assert spec.id == "Tiny-v0" and spec.packages == ("custom_envs",)
    code = (
        "import pickle, sys; import gymnasium as gym; from impala.envs import make_env, EnvSpec;"
        "assert 'Tiny-v0' not in gym.registry;"
        "spec = pickle.loads(sys.stdin.buffer.read()); env = make_env(spec, seed=0);"
        "print(env.observation_space.shape, env.action_space);"
        "print(EnvSpec.from_dict({'id': 'TinyBox-v0', 'kwargs': {}, 'packages': ['custom_envs']}).id)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", code], input=pickle.dumps(spec), capture_output=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().split("\n")[:2] == ["(4,) Discrete(2)", "TinyBox-v0"]


@pytest.mark.parametrize(
    "packages,message",
    [
        (["os; import shutil"], "is not a Python module name"),
        (["__import__('os').system('true')"], "is not a Python module name"),
        ("custom_envs", "must be a list"),
        ([7], "is not a Python module name"),
        (["no_such_env_package_here"], NO_SUCH),
    ],
)
def test_a_peers_package_list_is_module_names_that_import(packages, message):
    # What a remote actor receives from the learner: names only, checked before anything is imported.
    env = {"id": "CartPole-v1", "kwargs": {}, "preprocess": True, "packages": packages}
    info = {
        "run_id": "r",
        "env": env,
        "agent": {"kind": "impala", "model": "mlp", "use_lstm": False, "popart_beta": 3e-4},
        "unroll_length": 8,
        "envs_per_worker": 1,
    }
    with pytest.raises(EnvPackageError) as e:
        RunInfo.from_dict(info)
    assert message in str(e.value)


def test_run_info_round_trips_the_packages():
    spec = EnvSpec("Tiny-v0", packages=("custom_envs",))
    assert EnvSpec.from_dict(spec.to_dict()) == spec
    assert "packages" not in EnvSpec("CartPole-v1").to_dict()  # specs without packages read as before
    env = make_env(spec, seed=1)
    assert env.reset(seed=1)[0].shape == (4,)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--env", "no_such_env_package_here:Tiny-v0"], NO_SUCH),
        (
            ["--env-package", "custom_envs.broken", "--env", "Tiny-v0"],
            "env package 'custom_envs.broken' does not import (ImportError: this module is broken on "
            "purpose)",
        ),
        (
            ["--env-package", "custom_envs;rm", "--env", "Tiny-v0"],
            "--env-package 'custom_envs;rm' is not a Python module name",
        ),
        (["--env", "custom_envs:NoSuch-v0"], "unknown env id 'NoSuch-v0'"),
        (["--env", "custom_envs:"], "nothing after the ':'"),
        (
            ["--env", "custom_envs:TinyBox-v0"],
            "TinyBox-v0 has a Box action space; launch_impala trains discrete (Discrete) actions only; "
            "launch_ppo trains continuous Box actions",
        ),
    ],
)
def test_bad_custom_envs_are_one_line_errors(argv, message, tmp_path, capsys):
    rc = launch_impala.main([*argv, *TINY_RUN, "--logdir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    lines = _error_lines(err)
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("launch_impala: error: "), err[-2000:]
    assert message in lines[0], lines[0]


def test_launch_ppo_trains_discrete_actions_and_refuses_other_spaces_in_one_line(tmp_path, capsys):
    """A user's Discrete env trains under launch_ppo (one categorical branch); a Tuple action space,
    which neither launcher trains, is one line and exit 2."""
    import torch

    run = "--workers 1 --in-process --total-steps 128 --buffer-size 32 --batch-size 16".split()
    run += ["--no-progress", "--device", "cpu"]
    rc = launch_ppo.main(["--env", "custom_envs:Tiny-v0", *run, "--logdir", str(tmp_path / "run")])
    assert rc == 0, capsys.readouterr().err[-2000:]
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert state["agent"]["branches"] == [2] and state["agent"]["action_space"] == "Discrete"
    capsys.readouterr()
    rc = launch_ppo.main(["--env", "custom_envs:TinyTuple-v0", *run, "--logdir", str(tmp_path / "tuple")])
    err = capsys.readouterr().err
    lines = _error_lines(err)
    assert rc == 2 and len(lines) == 1, err[-2000:]
    assert (
        "TinyTuple-v0 has a Tuple action space; launch_ppo trains Box, Discrete and MultiDiscrete actions"
        in lines[0]
    ), lines[0]


def _script(name: str, args: list[str]) -> list[str]:
    """A console script of this venv."""
    return [os.path.join(os.path.dirname(sys.executable), name), *args]


def _env(with_package: bool) -> dict:
    """The environment of a child process; ``with_package``: tests/ (custom_envs) on its PYTHONPATH."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [p for p in paths if os.path.abspath(p) != here]
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(([here] if with_package else []) + paths),
    }


def test_remote_actors_import_the_runs_package_or_say_they_cannot(tmp_path):
    """impala-actors learn the package from the learner with the env: where it is installed they import
    it and train; where it is not, one line names it (exit 2) instead of a timeout."""
    from procs import free_port_pair, kill_group

    port = free_port_pair()
    learner = subprocess.Popen(
        _script("launch_impala", [])
        + [
            *(
                "--workers 0 --env-package custom_envs --env Tiny-v0 --unroll-length 8 --batch-size 4 "
                "--minibatches 1 --total-frames 800 --port"
            ).split(),
            str(port),
            *"--no-progress --torch-threads 1 --max-seconds 120 --logdir".split(),
            str(tmp_path / "run"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=_env(True),
    )
    try:
        endpoint = ["--learner", f"tcp://127.0.0.1:{port}", "--workers", "1", "--timeout", "60"]
        missing = subprocess.run(
            _script("impala-actors", endpoint), capture_output=True, text=True, timeout=120, env=_env(False)
        )
        lines = _error_lines(missing.stderr)
        assert missing.returncode == 2 and len(lines) == 1, missing.stderr[-2000:]
        assert lines[0].startswith("impala-actors: error: env package 'custom_envs' does not import"), lines
        actors = subprocess.run(
            _script("impala-actors", [*endpoint, "--learner-timeout", "8"]),
            capture_output=True,
            text=True,
            timeout=180,
            env=_env(True),
        )
        assert "running 1 actors for Tiny-v0" in actors.stderr, actors.stderr[-2000:]
        out, _ = learner.communicate(timeout=60)
    finally:
        kill_group(learner)
    assert learner.returncode == 0, out[-3000:]
    assert int(re.search(r"done: (\d+) env frames", out).group(1)) >= 800, out[-2000:]


def test_a_local_actor_that_cannot_start_ends_the_run_in_one_line_not_at_the_hello_timeout(tmp_path):
    """An env that builds in the learner (its probe passes) but not in an actor process: the actor dies at
    start-up, is restarted with backoff, and after its third quick death the run ends with one line naming
    it (exit 2) instead of waiting out the 180 s hello timeout; the actor's own error stays on stderr."""
    run = subprocess.run(
        _script("launch_impala", [])
        + "--env custom_envs:ActorOnlyBroken-v0 --workers 1 --total-frames 400 --no-progress".split()
        + ["--logdir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=150,  # under the hello timeout: a run that waits it out fails here
        env=_env(True),
    )
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "launch_impala: error: actor 0 exited (code 1) 3 times in a row at start-up, before its first hello"
    ), run.stderr[-3000:]
    assert "RuntimeError: this env only builds in the launching process" in run.stderr, run.stderr[-3000:]
    assert run.stderr.count("actor 0 restarted") == 2 and "said hello within" not in run.stderr


def test_impala_eval_plays_a_custom_env_checkpoint_in_worker_processes(tmp_path, capsys):
    """The checkpoint records the package with the env: impala-eval's spawned workers import it themselves."""
    import json

    from learner.cli import eval_cli

    assert (
        launch_impala.main(["--env", "custom_envs:Tiny-v0", *TINY_RUN, "--logdir", str(tmp_path / "run")])
        == 0
    )
    rc = eval_cli.main([str(tmp_path / "run"), "--episodes", "2", "--workers", "1"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    data = json.loads((tmp_path / "run" / "eval-train-sample-2.json").read_text())
    assert data["env"]["packages"] == ["custom_envs"] and len(data["returns"]) == 2
    assert all(w["pid"] != os.getpid() for w in data["workers"])  # played in a spawned worker process
