"""scripts/profile_update.py, run for real: the learner's own minibatch step under torch.profiler."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_update.py"


@pytest.mark.parametrize(
    "precision, onednn",
    [("fp32", True), ("bf16", True), ("bf16", False)],
    ids=["fp32", "bf16", "bf16-no-onednn"],
)
def test_profiles_the_learners_step_and_names_its_operations(precision, onednn):
    # without oneDNN, the kernels a CPU without AVX-512 runs bf16 convolutions on (aten::_slow_conv2d_*)
    extra = [] if onednn else ["--no-onednn"]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--precision", precision, "--steps", "1", "--rows", "5", *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    head = next(line for line in out.stdout.splitlines() if "ms per step unprofiled" in line)
    assert f"--precision {precision}" in head and "128 frames" in head
    assert float(head.split(": ")[-1].split(" ms per step")[0]) > 0
    # the step's own operations: a convolution's backward is always among the costliest five, under whichever
    # kernel this CPU runs it (aten::convolution_backward through oneDNN; aten::_slow_conv2d_backward where
    # torch has no oneDNN bf16 kernels, as on AVX2-only CPUs)
    table = out.stdout.split("ms per step unprofiled", 1)[1]
    assert re.search(r"aten::\S*conv\S*_backward", table), table


def test_bad_arguments_are_one_line_and_exit_2():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "0"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].endswith("--steps and --rows must be >= 1")
