"""The Python API (``impala.train``, ``impala.train_ppo``, ``impala.load``), used as a researcher would:
from a script in a folder outside the clone, with the venv's python; Ctrl-C stops a run with its
checkpoint and no process left behind; every error is an ImpalaError with the command line's one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import impala
from procs import descendants, wait_for

REPO = Path(__file__).resolve().parents[1]


def _script(tmp_path: Path, body: str) -> subprocess.Popen:
    """``body`` as a script run by the venv's python in an empty folder outside the clone."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    (work / "job.py").write_text(textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed package, not the tree
    return subprocess.Popen([sys.executable, "job.py"], cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip


def test_train_then_load_and_act_from_a_folder_outside_the_clone(tmp_path):
    proc = _script(
        tmp_path,
        f"""
        import json, numpy as np, impala

        if __name__ == "__main__":  # the actor processes import this script again (spawn)
            r = impala.train(env="CartPole-v1", workers=1, total_frames=20000,
                             logdir={str(tmp_path / "run")!r}, progress=False)
            agent = impala.load(r.run_folder)
            one = agent.act(np.zeros(4, np.float32))
            batch = agent.act(np.zeros((5, 4), np.float32), greedy=False)
            ev = agent.evaluate(episodes=2)
            print(json.dumps({{"folder": r.run_folder, "frames": r.env_frames, "checkpoint": r.checkpoint,
                              "updates": r.updates, "one": one, "batch": batch.tolist(),
                              "eval": ev.stats["mean"], "n": len(ev.returns), "where": impala.__file__}}))
        """,
    )
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert got["folder"] == str(tmp_path / "run") and got["frames"] >= 20000 and got["updates"] > 0
    assert got["checkpoint"] == str(tmp_path / "run" / "checkpoint.pt")
    assert got["one"] in (0, 1) and len(got["batch"]) == 5 and set(got["batch"]) <= {0, 1}
    assert got["n"] == 2 and got["eval"] > 0
    assert not got["where"].startswith(str(tmp_path))


def test_a_program_read_from_stdin_trains(tmp_path):
    """``python - < job.py`` (or a heredoc): spawn cannot re-read a script from stdin, so without care each
    actor died at start-up and the run waited out its 180 s hello timeout; it trains as from a file."""
    body = f"""
import impala
r = impala.train(env="CartPole-v1", workers=1, total_frames=4000, logdir={str(tmp_path / "run")!r},
                 progress=False)
print("FRAMES", r.env_frames, r.updates)
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-"], input=body, cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=240)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    frames, updates = out.stdout.split("FRAMES")[-1].split()
    assert int(frames) >= 4000 and int(updates) > 0, out.stdout


def test_ctrl_c_stops_a_run_with_its_checkpoint_and_no_process_left(tmp_path):
    proc = _script(
        tmp_path,
        f"""
        import impala

        def main():
            r = impala.train(env="CartPole-v1", workers=2, total_frames=50_000_000,
                             logdir={str(tmp_path / "run")!r}, progress=False)
            print("RESULT", r.interrupted, r.env_frames, r.checkpoint)

        if "__main__" == __name__:
            main()
        """,
    )
    try:
        assert wait_for(lambda: (tmp_path / "run" / "metrics.csv").exists(), 180), proc.stderr.read()[-2000:]
        children = descendants(proc.pid)
        assert len(children) >= 2  # the actors
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal reaches the whole group
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    line = [x for x in out.splitlines() if x.startswith("RESULT")][-1].split()
    assert line[1] == "True" and int(line[2]) > 0 and line[3] == str(tmp_path / "run" / "checkpoint.pt")

    def alive(pid: int) -> str | None:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return None

    assert wait_for(lambda: not any(alive(p) for p in children), 10), [alive(p) for p in children]


def test_a_script_that_trains_at_its_top_level_is_told_to_guard_it(tmp_path):
    """Unguarded, each actor process (spawn imports the script again) would start a run of its own: the call
    is refused at once, naming the line and the fix, before any process starts."""
    proc = _script(
        tmp_path,
        f"""
        import impala
        try:
            impala.train(env="CartPole-v1", workers=1, total_frames=2000, logdir={str(tmp_path / "run")!r})
        except impala.ImpalaError as e:
            print("REFUSED", e)
        """,
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert (
        "REFUSED job.py:4: the run starts at the script's top level" in out
        and '__name__ == "__main__"' in out
    )
    assert not (tmp_path / "run").exists()


def test_ppo_trains_loads_and_acts(tmp_path):
    r = impala.train_ppo(
        config="cartpole_ppo_sb3", total_steps=2048, in_process=True, workers=1, logdir=str(tmp_path / "p"),
        progress=False,
    )  # fmt: skip
    assert r.updates > 0 and r.checkpoint and r.agent_steps >= 2048
    agent = impala.load(r)  # what train returned, as a notebook user passes it
    assert agent.kind == "ppo" and agent.act(np.zeros(4, np.float32)) in (0, 1)
    assert agent.act(np.zeros((3, 4), np.float32)).shape == (3,)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda d: impala.train(env="CartPole-v9", logdir=d), "launch_impala: unknown env id 'CartPole-v9'"),
        (lambda d: impala.train(env="CartPole-v1", learning_rat=1e-3), "unknown setting 'learning_rat'; did"),
        (
            lambda d: impala.train(env="CartPole-v1", batch_size=-2, logdir=d),
            "--batch-size must be >= 1, got -2",
        ),
        (
            lambda d: impala.train(env="CartPole-v1", model="bogus", logdir=d),
            "argument --model: invalid choice",
        ),
        (lambda d: impala.train(env="CartPole-v1", config="nope", logdir=d), "no preset of that name"),
        (
            lambda d: impala.train(env="CartPole-v1", progress="yes", logdir=d),
            "progress must be True or False",
        ),
        (lambda d: impala.load(d), "load: no checkpoint at"),
        (lambda d: impala.load(impala.TrainResult(d, 0, 0, 0, None, None)), "load: no checkpoint at"),
        (lambda d: impala.load(3), "load: a run folder, a checkpoint file or a TrainResult, got int"),
    ],
)
def test_every_error_is_an_impala_error_with_the_command_lines_line(call, message, tmp_path):
    with pytest.raises(impala.ImpalaError) as e:
        call(str(tmp_path / "run"))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()  # a start that failed leaves no folder behind


def test_act_refuses_an_observation_of_another_shape(tmp_path):
    r = impala.train(env="CartPole-v1", workers=1, in_process=True, total_frames=2000, unroll_length=8,
                     batch_size=4, minibatches=2, logdir=str(tmp_path / "run"), progress=False)  # fmt: skip
    agent = impala.load(Path(r.run_folder))
    with pytest.raises(impala.ImpalaError, match=r"an observation of shape \(4,\)"):
        agent.act(np.zeros(3, np.float32))
    with pytest.raises(impala.ImpalaError, match="trained on CartPole-v1"):
        agent.evaluate(episodes=1, task="Acrobot-v1")


def test_the_readme_example_runs_as_written_but_for_its_budget(tmp_path):
    """The README's Python API block, run as a script from a folder outside the clone (its 400k frames cut
    to 20k: the rest as written)."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Python API") :]
    code = section[section.index("```python\n") + len("```python\n") :]
    code = code[: code.index("```")]
    assert "impala.train(" in code and "impala.load(" in code and ".act(" in code
    short = code.replace("total_frames=400_000", "total_frames=20_000")
    assert short != code
    proc = _script(tmp_path, short)
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    mean_return, evaluated = out.strip().splitlines()[-1].split()
    assert float(mean_return) > 0 and float(evaluated) > 0
    assert (tmp_path / "work" / "runs" / "cartpole" / "checkpoint.pt").is_file()
