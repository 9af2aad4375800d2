"""scripts/profile_update.py, run for real: the learner's own minibatch step under torch.profiler."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_update.py"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_profiles_the_learners_step_and_names_its_operations(precision):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--precision", precision, "--steps", "1", "--rows", "5"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    head = next(line for line in out.stdout.splitlines() if "ms per step unprofiled" in line)
    assert f"--precision {precision}" in head and "128 frames" in head
    assert float(head.split(": ")[-1].split(" ms per step")[0]) > 0
    # the step's own kernels: the convolutions' backward is always among the costliest five
    assert "aten::convolution_backward" in out.stdout


def test_bad_arguments_are_one_line_and_exit_2():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "0"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].endswith("--steps and --rows must be >= 1")
