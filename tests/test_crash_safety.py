"""Bad data and bad files never reach the weights, a checkpoint or a traceback."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

from impala.run.checkpoint import CheckpointError, load_checkpoint, non_finite_tensors, save_checkpoint
from impala.run.config import ImpalaConfig
from procs import run

T, B = 5, 4


def _learner():
    from impala.envs import EnvSpec
    from impala.envs.probe import EnvInfo
    from impala.run.config import RunConfig
    from learner.vtrace_learner import ImpalaTrainer

    config = ImpalaConfig(batch_size=B, minibatches=1, epochs=1)
    cartpole = EnvInfo(EnvSpec("CartPole-v1"), (4,), "float32", "Box", "Discrete", num_actions=2)
    return ImpalaTrainer(
        config, RunConfig(env="CartPole-v1", unroll_length=T, total_frames=1000, device="cpu"), cartpole
    )


def _unroll(rng, obs_scale=1.0):
    return {
        "obs": (rng.standard_normal((T + 1, 4)) * obs_scale).astype(np.float32),
        "first": np.zeros(T + 1, bool),
        "actions": rng.integers(0, 2, T).astype(np.int64),
        "behaviour_logits": rng.standard_normal((T, 2)).astype(np.float32),
        "rewards": rng.standard_normal(T).astype(np.float32),
        "dones": np.zeros(T, bool),
    }


def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.learner.model.state_dict().items()}


def test_a_finite_but_huge_unroll_is_skipped_and_training_goes_on():
    trainer = _learner()
    rng = np.random.default_rng(0)
    schema_names = {a.name for a in trainer.schema.arrays}
    assert schema_names == set(_unroll(rng))  # the test batch is the real schema
    before = _weights(trainer)
    # 1e25 observations are finite, so the wire accepts them; squared in the value loss they are inf.
    poisoned = [_unroll(rng)] * (B - 1) + [_unroll(rng, obs_scale=1e25)]
    batch = trainer.learner.stage(poisoned, trainer.schema)
    metrics = trainer.learner.train(batch, frames_done=0)
    assert metrics["learner/skipped_updates"] == 1.0 and trainer.learner.skipped_updates == 1
    after = _weights(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before), "a non-finite step changed the weights"
    assert non_finite_tensors(trainer.state_dict()) == []
    good = trainer.learner.stage([_unroll(rng) for _ in range(B)], trainer.schema)
    metrics = trainer.learner.train(good, frames_done=0)
    assert metrics["learner/skipped_updates"] == 1.0
    assert any(not torch.equal(after[k], v) for k, v in _weights(trainer).items()), (
        "a good batch must still train"
    )


def test_a_non_finite_state_is_never_written_over_a_good_checkpoint(tmp_path):
    path = str(tmp_path / "checkpoint.pt")
    save_checkpoint(path, {"trainer": {"w": torch.ones(3)}, "env_frames": 1, "version": 1})
    with pytest.raises(CheckpointError, match=r"not writing .*1 tensor\(s\) hold NaN or inf \(trainer\.w\)"):
        save_checkpoint(
            path, {"trainer": {"w": torch.tensor([1.0, float("nan"), 2.0])}, "env_frames": 2, "version": 2}
        )
    state = load_checkpoint(path)
    assert state["version"] == 1 and torch.equal(state["trainer"]["w"], torch.ones(3))
    assert [n for n in os.listdir(tmp_path)] == ["checkpoint.pt"]  # no temp file left behind
    # integer tensors and plain data are not "non-finite"
    assert non_finite_tensors({"a": torch.arange(3), "b": [torch.tensor([float("inf")])], "c": 1.5}) == [
        "b.0"
    ]


def _bad_files(tmp_path):
    good = tmp_path / "good.pt"
    save_checkpoint(str(good), {"trainer": {"w": torch.ones(1000)}, "env_frames": 1, "version": 1})
    data = good.read_bytes()
    cases = {
        "empty": b"",
        "truncated": data[: len(data) // 2],
        "random": np.random.default_rng(0).bytes(4096),
    }
    out = {}
    for name, blob in cases.items():
        path = tmp_path / f"{name}.pt"
        path.write_bytes(blob)
        out[name] = path
    missing = tmp_path / "missing-keys.pt"
    save_checkpoint(str(missing), {"something": torch.ones(2)})
    out["missing keys"] = missing
    directory = tmp_path / "a-directory.pt"
    directory.mkdir()
    out["directory"] = directory
    return out


_SAVE_FOREVER = """
import sys, torch
from impala.run.checkpoint import save_checkpoint
state = {"w": torch.randn(4_000_000), "step": 0}
print("ready", flush=True)
while True:
    state["step"] += 1
    save_checkpoint(sys.argv[1], state)
"""


def _has_o_tmpfile(directory) -> bool:
    from impala.run.checkpoint import _unnamed_file

    fd = _unnamed_file(str(directory))
    if fd is None:
        return False
    os.close(fd)
    return True


@pytest.mark.parametrize("unnamed", [True, False], ids=["o_tmpfile", "named_fallback"])
def test_a_writer_killed_mid_save_leaves_the_last_checkpoint_and_no_temp_file(tmp_path, unnamed):
    """SIGKILL a process that saves a 16 MB checkpoint back to back, 8 times (3 for the fallback) at random
    moments: the checkpoint always loads whole and is 0600, and with O_TMPFILE no temp file is ever left (a
    named temp file exists for almost the whole of each save, so the old mkstemp writer stranded one nearly
    every kill). The named fallback (no O_TMPFILE) must keep the checkpoint whole too."""
    import random
    import signal
    import subprocess
    import sys

    if unnamed and not _has_o_tmpfile(tmp_path):
        pytest.skip("this filesystem has no O_TMPFILE")
    rng = random.Random(0)
    path = tmp_path / "checkpoint.pt"
    code = (
        _SAVE_FOREVER
        if unnamed
        else _SAVE_FOREVER.replace(
            "from impala.run.checkpoint import save_checkpoint",
            "import impala.run.checkpoint as c; c._unnamed_file = lambda d: None; save_checkpoint = "
            "c.save_checkpoint",
        )
    )
    for _ in range(8 if unnamed else 3):
        proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            deadline = time.monotonic() + 60
            while not path.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert path.exists(), "the writer saved nothing within 60 s"
            time.sleep(rng.uniform(0.0, 0.3))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        state = load_checkpoint(str(path), keys=("w", "step"))
        assert state["w"].shape == (4_000_000,) and state["step"] >= 1
        assert path.stat().st_mode & 0o777 == 0o600
        temps = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
        if unnamed:
            assert temps == []
        for n in temps:
            os.unlink(tmp_path / n)


def test_without_proc_a_checkpoint_is_still_written_once_and_whole(tmp_path):
    """No /proc (a chroot, some sandboxes): an unnamed file cannot be linked in, so saves fall back to a named
    temp file, still atomic and 0600. Run for real in a mount namespace with an empty tmpfs over /proc."""
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare")
    code = (
        "import os, sys, torch\n"
        "import impala.run.checkpoint as c\n"
        "for step in range(3):\n"
        "    c.save_checkpoint(sys.argv[1], {'w': torch.full((5,), float(step)), 'step': step})\n"
        "print(c._link_works, sorted(os.listdir(os.path.dirname(sys.argv[1]))))\n"
    )
    path = tmp_path / "checkpoint.pt"
    out = subprocess.run(
        [
            *"unshare --mount --propagation private sh -c".split(),
            'mount -t tmpfs none /proc && exec "$0" -c "$1" "$2"',
            sys.executable,
            code,
            str(path),
        ],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if out.returncode != 0 and "mount" in out.stderr and "Traceback" not in out.stderr:
        pytest.skip(f"cannot mount over /proc here: {out.stderr.strip()[:200]}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False ['checkpoint.pt']"
    state = load_checkpoint(str(path), keys=("w", "step"))
    assert state["step"] == 2 and float(state["w"].sum()) == 10.0
    assert path.stat().st_mode & 0o777 == 0o600


def test_bad_checkpoint_files_are_one_clear_error(tmp_path):
    for name, path in _bad_files(tmp_path).items():
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(str(path), keys=("trainer", "env_frames", "version"))
        message = str(info.value)
        assert str(path) in message and "weights_only" not in message, (name, message)


def _launch_impala(argv: list[str], capsys, *, real_process: bool) -> tuple[int, str]:
    """(exit status, stderr) of launch_impala: the console script, or its main in this process."""
    if real_process:
        out = run(["launch_impala", *argv], timeout=120)
        return out.returncode, out.stderr
    from learner.cli.launch_impala import main

    threads = torch.get_num_threads()
    try:
        rc = main(argv)
    finally:
        torch.set_num_threads(threads)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("kind", ["truncated", "random", "missing keys"])
def test_resume_from_a_bad_checkpoint_is_one_line_and_exit_2(tmp_path, kind, capsys):
    """The first kind through the real console script, the others through its main in this process."""
    bad = _bad_files(tmp_path)[kind]
    logdir = tmp_path / "run"
    logdir.mkdir()
    os.replace(bad, logdir / "checkpoint.pt")
    rc, err = _launch_impala(
        ["--env", "CartPole-v1", "--workers", "1", "--resume", "--logdir", str(logdir)],
        capsys,
        real_process=kind == "truncated",
    )
    lines = err.strip().splitlines()
    assert rc == 2, err[-2000:]
    assert "Traceback" not in err and "weights_only" not in err
    assert (
        lines[-1].startswith("launch_impala: error: checkpoint ")
        and str(logdir / "checkpoint.pt") in lines[-1]
    ), lines


def test_resume_from_another_networks_checkpoint_is_one_line_and_exit_2(tmp_path, capsys):
    """A CartPole checkpoint (made in this process) resumed as Acrobot by the real console script."""
    logdir = tmp_path / "run"
    rc, err = _launch_impala(
        [
            *(
                "--env CartPole-v1 --workers 1 --in-process --unroll-length 8 --batch-size 4 "
                "--minibatches 2 --total-frames 2000 --logdir"
            ).split(),
            str(logdir),
            "--no-progress",
            "--device",
            "cpu",
        ],
        capsys,
        real_process=False,
    )
    assert rc == 0, err[-2000:]
    rc, err = _launch_impala(
        ["--env", "Acrobot-v1", "--workers", "1", "--resume", "--logdir", str(logdir)],
        capsys,
        real_process=True,
    )
    assert rc == 2 and "Traceback" not in err, err[-2000:]
    # the run's own config.yaml says what it plays: another env is refused before the checkpoint is read
    assert (
        "the run's env is 'CartPole-v1'; 'Acrobot-v1' cannot take its place" in err.strip().splitlines()[-1]
    )
    (logdir / "config.yaml").unlink()  # a run of a version without config.yaml: the checkpoint says it
    rc, err = _launch_impala(
        ["--env", "Acrobot-v1", "--workers", "1", "--resume", "--logdir", str(logdir)],
        capsys,
        real_process=True,
    )
    assert rc == 2 and "Traceback" not in err, err[-2000:]
    assert "does not fit this run: env 'CartPole-v1' there, 'Acrobot-v1' here" in err.strip().splitlines()[-1]


def test_sigkill_and_resume_ten_times(tmp_path):
    """Kill the learner at random points, resume at once on the same port (its orphans may still
    be running): the checkpoint always loads, frames and versions never go backwards, no temp file
    is left, no orphaned actor outlives 15 s, and no orphan's unroll is trained on (lag >= 0).

    Ten rounds is docs/RELIABILITY.md's number. Each kill lands up to 1 s after a new checkpoint
    was seen: checkpoints come every 0.6 s, so kills still fall anywhere in the write cycle."""
    import csv
    import random
    import signal

    from procs import actor_pids, alive, free_port_pair, kill_group, start, wait_for

    rng = random.Random(0)
    port = free_port_pair()
    ckpt = tmp_path / "checkpoint.pt"
    history: list[tuple[int, int]] = []
    orphans: list[int] = []
    for round_ in range(10):
        proc = start(
            [
                *(
                    "launch_impala --env CartPole-v1 --workers 1 --unroll-length 20 --batch-size 4 "
                    "--minibatches 2 --port"
                ).split(),
                str(port),
                *(
                    "--total-frames 10000000 --checkpoint-minutes 0.01 --no-progress --log-interval 0.5 "
                    "--logdir"
                ).split(),
                str(tmp_path),
            ]
            + (["--resume"] if round_ else [])
        )
        try:
            before = history[-1][0] if history else 0
            assert wait_for(
                lambda: ckpt.exists() and load_checkpoint(str(ckpt))["env_frames"] > before, 90
            ), f"round {round_}"
            time.sleep(rng.uniform(0.0, 1.0))
            orphans += actor_pids(proc.pid)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        finally:
            kill_group(proc)
        state = load_checkpoint(str(ckpt), keys=("trainer", "env_frames", "version"))
        assert non_finite_tensors(state) == []
        history.append((int(state["env_frames"]), int(state["version"])))
        assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == [], os.listdir(tmp_path)
    assert wait_for(lambda: not any(alive(p) for p in orphans), 15), [p for p in orphans if alive(p)]
    frames, versions = zip(*history)
    assert list(frames) == sorted(frames) and list(versions) == sorted(versions), history
    assert frames[-1] > frames[0]
    with open(tmp_path / "metrics.csv") as f:
        lags = [float(r["charts/policy_lag"]) for r in csv.DictReader(f) if r.get("charts/policy_lag")]
    assert lags and min(lags) >= 0, min(lags)


def test_huge_float_values_are_dropped_on_receipt():
    trainer = _learner()
    rng = np.random.default_rng(1)
    assert trainer.validate(_unroll(rng)) is None
    for name, scale in (("obs", 1e25), ("behaviour_logits", 1e7), ("rewards", 3e38)):
        bad = _unroll(rng)
        bad[name] = (bad[name] * 0 + scale).astype(np.float32)
        problem = trainer.validate(bad)
        assert problem is not None and name in problem and "--max-abs-value" in problem
    trainer.max_abs_value = 1e30  # the bound is the user's to set (--max-abs-value)
    bad = _unroll(rng)
    bad["obs"][:] = 1e25
    assert trainer.validate(bad) is None


def _cartpole_run(logdir, seconds: float):
    from procs import start

    return start(
        ["launch_impala", "--env", "CartPole-v1", "--workers", "1", "--in-process", "--unroll-length", "20",
         "--batch-size", "8", "--total-frames", "100000000", "--max-seconds", str(seconds), "--no-progress",
         "--checkpoint-minutes", "0.01", "--log-interval", "1", "--logdir", str(logdir)]
    )  # fmt: skip


def test_a_directory_put_at_the_checkpoint_path_mid_run_costs_nothing(tmp_path):
    """A checkpoint write that fails (here: a directory where the file goes) is one warning; training goes on,
    the next write retries, and the run ends with its checkpoint once the path is free again."""
    from procs import kill_group, wait_for

    logdir = tmp_path / "run"
    proc = _cartpole_run(logdir, 30)
    ckpt = logdir / "checkpoint.pt"
    try:
        assert wait_for(ckpt.exists, 60)
        os.remove(ckpt)
        os.mkdir(ckpt)
        time.sleep(4)  # several checkpoint intervals (0.6 s) fail meanwhile
        os.rmdir(ckpt)
        assert wait_for(ckpt.is_file, 30), "no checkpoint written once the path was free again"
        proc.send_signal(signal.SIGINT)  # a user's stop (the run's 30 s are only a bound)
        out, _ = proc.communicate(timeout=90)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "not written (IsADirectoryError: Is a directory); training goes on" in out, out[-3000:]
    assert "Traceback" not in out
    assert ckpt.is_file() and f"checkpoint {ckpt}" in out.splitlines()[-1]
    assert load_checkpoint(str(ckpt))["env_frames"] > 0


def test_a_full_disk_during_a_run_is_survived(tmpfs):
    """A run folder on a 512 KiB tmpfs: metrics and config fit, the checkpoint does not. The run trains to its
    end and says no checkpoint could be written (rc 0; before, ENOSPC ended it with chained tracebacks)."""
    logdir = tmpfs("run", "512k")
    with open(logdir / "filler", "wb") as f:  # leave less room than two checkpoints need
        f.write(b"\0" * (512 * 1024 - 96 * 1024))
    proc = _cartpole_run(logdir, 8)
    out, _ = proc.communicate(timeout=90)
    saved = (logdir / "checkpoint.pt").is_file() and load_checkpoint(str(logdir / "checkpoint.pt"))[
        "env_frames"
    ]
    assert proc.returncode == 0, out[-3000:]
    assert "No space left on device" in out and "training goes on" in out, out[-3000:]
    assert "Traceback" not in out
    # a first checkpoint may have fit before the folder filled up: then it is the last good one, whole
    last = out.splitlines()[-1]
    assert (
        "no checkpoint written (see the warnings above)" in last
        or f"checkpoint {logdir}/checkpoint.pt" in last
    ), last
    assert saved is False or saved > 0


def _fill(folder) -> None:
    """Take every byte left on ``folder``'s file system (a file named filler)."""
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0" * 512)
        except OSError:
            pass


def test_a_disk_that_fills_mid_run_and_is_freed_20_s_later_loses_nothing(tmpfs):
    """The run folder's disk fills mid-run and is freed 20 s later: the run goes on (rc 0, no traceback), says
    once per kind of file that it cannot write, writes again once it can (metrics.csv's held rows, TensorBoard
    in a new events file, the checkpoint), and ends with a whole final checkpoint of all its frames."""
    import csv

    from procs import kill_group, wait_for

    logdir = tmpfs("run", "8m")
    proc = _cartpole_run(logdir, 45)
    csv_path = logdir / "metrics.csv"
    try:
        assert wait_for(lambda: csv_path.exists() and len(csv_path.read_text().splitlines()) > 3, 60)
        _fill(logdir)
        filled_at = time.monotonic()
        time.sleep(20)
        os.remove(logdir / "filler")
        freed_rows_from = len(list(csv.DictReader(open(csv_path))))
        out, _ = proc.communicate(timeout=120)
        wall = time.monotonic() - filled_at
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    warnings = [line for line in out.splitlines() if " WARNING " in line]
    kinds = ["metrics.csv cannot be written", "TensorBoard events", "checkpoint"]
    for kind in kinds:  # each said once (TensorBoard's writer may not notice before the disk is free)
        assert sum(kind in w for w in warnings) <= 1, warnings
    assert sum("metrics.csv cannot be written" in w for w in warnings) == 1, out[-3000:]
    assert "metrics.csv is written again" in out, out[-3000:]
    rows = list(csv.DictReader(open(csv_path)))
    times = [float(r["time"]) for r in rows]
    assert times == sorted(times) and len(rows) > freed_rows_from + 10, (len(rows), freed_rows_from)
    assert max(times) - min(times) >= wall - 15  # the outage's rows are there: no gap in the curve
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) < 5, max(gaps)  # a row every second or so, the outage included
    final = load_checkpoint(str(logdir / "checkpoint.pt"))
    last = out.splitlines()[-1]
    assert f"checkpoint {logdir}/checkpoint.pt" in last and f"done: {final['env_frames']} env frames" in last


# the writer thread's own end is one warning line, not a traceback (pytest reports an unhandled one this way)
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_tensorboard_failing_on_a_full_disk_costs_only_its_events(tmpfs, caplog):
    """TensorBoard's writer thread hits ENOSPC and raises it on every later call: the logger says so once and
    goes on with metrics.csv (before, the run ended with that traceback when the disk filled mid-run). The
    thread itself ends without printing its traceback (a full-disk run's console once showed it)."""
    from impala.run.metrics import MetricsLogger

    logdir = tmpfs("run", "256k")
    logger = MetricsLogger(str(logdir), progress=False)
    logger.log(1, {"charts/mean_return_100": 1.0})
    filler = logdir / "filler"
    with open(filler, "wb", buffering=0) as f:  # every byte left
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    deadline = time.monotonic() + 10
    with caplog.at_level("WARNING", logger="impala.run.metrics"):
        while logger.writer is not None and time.monotonic() < deadline:
            logger.log(2, {"charts/mean_return_100": 2.0})  # must not raise
            time.sleep(0.05)
    assert logger.writer is None, "TensorBoard's writer never reported the full disk"
    assert sum("TensorBoard events" in r.getMessage() for r in caplog.records) == 1
    os.remove(filler)
    logger.log(3, {"charts/mean_return_100": 3.0})
    logger.close()
    steps = [line.split(",")[0] for line in (logdir / "metrics.csv").read_text().splitlines()[1:]]
    assert steps[0] == "1" and steps[-1] == "3"
