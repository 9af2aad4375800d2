"""scripts/sweep.py: bad levers are one line and exit 2 before anything runs; a real sweep of two tiny
CartPole runs archives both; run again, it reruns nothing; an interrupted run (no finished marker) is
resumed, not started over."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXED = "--workers 1 --in-process --unroll-length 20 --batch-size 8 --learning-rate 2e-3 --device cpu "
FIXED += "--log-interval 0"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("sweep", ROOT / "scripts" / "sweep.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lever", "foo=1,2"], "--lever foo: not a launch_impala option"),
        (["--lever", "seed=1,2"], "--lever seed: the sweep sets it itself"),
        (["--lever", "learning_rate=-1"], "--learning-rate must be > 0"),
        (["--lever", "model=huge"], "invalid choice: 'huge'"),
        (["--lever", "epochs:minibatches=1:2,3"], "3 has 1 values for 2 options"),
        (["--lever", "epochs=2,2"], "a value given twice"),
        (["--lever", "popart=maybe"], "'maybe' is not true or false"),
        (["--lever", "epochs"], "expected NAME=V1,V2"),
        (["--lever", "epochs=1", "--lever", "epochs=2"], "an option appears in two --lever arguments"),
        (["--thresholds", "x"], "--thresholds 'x': numbers"),
        (["--env", "Nope-v0", "--lever", "epochs=1"], "--env Nope-v0: unknown env id"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(sweep, tmp_path, capsys, argv, message):
    rc = sweep.main(["--env", "CartPole-v1", "--frames", "1000", "--runs", str(tmp_path), *argv])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("sweep: error: "), err
    assert message in err[0], err[0]
    assert not any(tmp_path.iterdir())  # nothing ran


def test_a_sweep_archives_its_runs_and_resumes_without_rerunning(sweep, tmp_path, capsys):
    argv = ["--env", "CartPole-v1", "--frames", "6000", "--seeds", "1", "--lever", "epochs=1,2"]
    argv += ["--fixed", FIXED, "--thresholds", "10,1000", "--runs", str(tmp_path)]
    assert sweep.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("sweep: finished ") == 2, out
    records = json.loads((tmp_path / "archive.json").read_text())
    assert sorted(r["settings"]["epochs"] for r in records) == ["1", "2"]
    for r in records:
        assert r["frames"] >= 6000 and r["curve"] and r["reached"]["1000"] is None
        assert r["reached"]["10"]["frames"] <= r["frames"]  # CartPole's episodes last 10+ steps at once
    assert "| epochs=1 | 1 |" in out and "not reached" in out

    # run again: nothing reruns, the table comes from the archive
    assert sweep.main(argv) == 0
    again = capsys.readouterr().out
    assert again.count("sweep: finished: ") == 2 and "sweep: finished /" not in again, again

    # an interrupted run (its finished marker gone, its checkpoint kept) is resumed, not started over
    run = tmp_path / "CartPole-v1-6000" / "epochs2" / "seed1"
    (run / "finished.json").unlink()
    assert sweep.main(argv) == 0
    resumed = capsys.readouterr().out
    assert "sweep: resume: " in resumed and resumed.count("sweep: finished /") == 1, resumed
    assert len(json.loads((tmp_path / "archive.json").read_text())) == 2


def test_negative_thresholds_are_values_not_options(sweep, tmp_path, capsys):
    """Pong's thresholds start below zero: ``--thresholds -15,0,18`` is the values, as the docs write it."""
    argv = ["--env", "CartPole-v1", "--frames", "1000", "--lever", "epochs=1,2", "--runs", str(tmp_path)]
    assert sweep.main([*argv, "--thresholds", "-15,0,18", "--dry-run"]) == 0
    assert "launch_impala" in capsys.readouterr().out
