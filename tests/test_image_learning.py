"""The image path learns with the shipped settings (docs/PONG.md).

PixelCatch-v0 (``impala/envs/catch.py``) is drawn like a preprocessed Atari frame
(uint8 [4, 84, 84], constant gray field), so it runs through the same CNN torso, wire
schema, actors and learner as Pong, with ``launch_impala``'s defaults: the only flags
below are the env, the budget (stopping once the threshold is reached) and where to log. Random play scores
about -0.5; the
threshold needs about 90% of balls caught. Before the small-box recipe (docs/PONG.md) the defaults (PyTorch
init,
the paper's RMSProp numbers on mean-reduced losses) left Pong's policy uniform; the
CartPole test could not see it because its hand-picked learning rate hid the scale.
"""

from __future__ import annotations

import csv
import os
import re
import time

from procs import run

THRESHOLD = 0.8


def test_pixel_catch_learns_with_the_default_settings(tmp_path):
    t0 = time.monotonic()
    out = run(
        [
            *(
                "launch_impala --env PixelCatch-v0 --workers 2 --total-frames 250000 --max-seconds 170 "
                "--stop-at-return"
            ).split(),
            str(THRESHOLD),
            *"--no-progress --log-interval 5 --logdir".split(),
            str(tmp_path),
        ],
        timeout=260,
    )
    elapsed = time.monotonic() - t0
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = [l for l in out.stdout.splitlines() if l.startswith("launch_impala: done")][-1]
    mean = float(re.search(r"mean return \(last 100\) (-?[\d.]+)", line).group(1))
    with open(os.path.join(tmp_path, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    curve = [(int(r["step"]), r["charts/mean_return_100"]) for r in rows if r.get("charts/mean_return_100")]
    print(line, f"elapsed {elapsed:.0f}s", curve[:: max(1, len(curve) // 10)])
    assert mean >= THRESHOLD, f"{line}; curve {curve}"
    # The health columns are there for every row, and the torso is not dead.
    last = rows[-1]
    assert float(last["health/alive_conv1"]) > 0.25 and float(last["health/logit_spread"]) > 0.1, last


def test_obs_norm_runs_resumes_and_evaluates_with_the_learners_pixel_statistics(tmp_path):
    """--obs-norm end to end: the learner updates the pixel statistics from every batch and the checkpoint
    holds them; a resume keeps them (and the setting); impala-eval plays with them."""
    import torch

    base = "launch_impala --env PixelCatch-v0 --workers 1 --no-progress --cpu-affinity off --logdir".split()
    first = run([*base, str(tmp_path), "--obs-norm", "--total-frames", "6000"], timeout=240)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["trainer"]["model"]
    count = float(state["torso.pixel_norm.count"])
    assert count > 1000, count  # thousands of observed frames, not the prior alone
    assert 0.0 < float(state["torso.pixel_norm.var"].min()) < 1.0  # the gray field: a small variance
    resumed = run([*base, str(tmp_path), "--resume", "--total-frames", "12000"], timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["trainer"]["model"]
    assert float(state["torso.pixel_norm.count"]) > count
    evaluated = run(["impala-eval", str(tmp_path), "--episodes", "3", "--workers", "0"], timeout=240)
    assert evaluated.returncode == 0, evaluated.stdout[-2000:] + evaluated.stderr[-2000:]


def test_a_run_from_before_obs_norm_resumes_as_it_was_made(tmp_path):
    """A run whose config.yaml predates --obs-norm (no obs_norm key) trained on frames scaled by 1/255; with
    obs_norm on by default, --resume must still rebuild that network (no pixel statistics) and continue it,
    recording obs_norm: false. Changing it on a resume is one line, exit 2."""
    import torch
    import yaml

    base = "launch_impala --env PixelCatch-v0 --workers 1 --no-progress --cpu-affinity off --logdir".split()
    first = run([*base, str(tmp_path), "--no-obs-norm", "--total-frames", "4000"], timeout=240)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    config = tmp_path / "config.yaml"
    lines = config.read_text().splitlines()
    assert "obs_norm: false" in lines
    config.write_text("\n".join(line for line in lines if not line.startswith("obs_norm:")) + "\n")
    resumed = run([*base, str(tmp_path), "--resume", "--total-frames", "8000"], timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert yaml.safe_load(config.read_text())["obs_norm"] is False
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["trainer"]["model"]
    assert not any("pixel_norm" in k for k in state)
    changed = run([*base, str(tmp_path), "--resume", "--total-frames", "9000", "--obs-norm"], timeout=120)
    assert changed.returncode == 2 and "Traceback" not in changed.stderr
    assert "--resume: the run's obs_norm is False" in changed.stderr.strip().splitlines()[-1]
