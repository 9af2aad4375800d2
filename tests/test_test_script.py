"""scripts/test.sh, the README's test command, run for real on small selections: its two parts (parallel, then
the serial tests alone) and its exit status."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "test.sh"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TEST_WORKERS": "0"}  # one process: the selections are a handful of fast tests
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300)


def test_a_selection_that_only_one_part_collects_passes():
    r = _run("tests/test_imports.py")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "passed" in r.stdout and "the serial tests, alone" in r.stdout


def test_a_selection_that_neither_part_collects_fails():
    # one file's tests deselected: collecting the whole suite twice took 25 s
    r = _run("tests/test_imports.py", "-k", "no_test_is_named_like_this_zq")
    assert r.returncode == 1, r.stdout[-2000:]
    assert "collected no tests" in r.stderr


def test_a_failure_in_the_parallel_part_fails_the_run_though_the_serial_part_collects_nothing(tmp_path):
    failing = tmp_path / "test_fails.py"
    failing.write_text("def test_fails():\n    assert 1 == 2\n")
    r = _run(str(failing))
    assert r.returncode == 1, r.stdout[-2000:]
    assert "1 failed" in r.stdout
