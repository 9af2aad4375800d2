"""Run cleanrl's ppo_atari_envpool.py unchanged, with two shims and a curve writer around it.

Runs inside cleanrl's virtualenv (scripts/peers/cleanrl.sh makes it and fetches the script):

    python scripts/peers/cleanrl_run.py --script PATH/ppo_atari_envpool.py --curve OUT/curve.csv \
        [--mode published|cpu] -- [the script's own flags]

The script file is executed as ``__main__`` (runpy), byte for byte as cleanrl 1.2.0 ships it. Around it:

1. **EnvPool's API shim.** The script was written for envpool 0.6 under gym 0.23 (cleanrl 1.2.0 pins
   both and Python < 3.11): ``reset()`` returned the observations and ``step()`` four values. envpool
   >= 0.7 under gym 0.26 (the releases with wheels for this Python) returns ``(obs, info)`` and
   ``(obs, reward, terminated, truncated, info)``. ``envpool.make`` is wrapped so the env it returns
   speaks the old API: done = terminated or truncated, exactly what envpool 0.6 reported. The info
   dict (``lives``, ``reward``, ``terminated``) is passed through untouched, so the script's own
   episode bookkeeping (raw returns of whole games across episodic-life resets) is unchanged.
2. **Threads (mode ``cpu`` only).** ``torch.set_num_threads(2)`` and EnvPool's ``num_threads=2`` with
   its worker threads pinned (``thread_affinity_offset=0``), as EnvPool's docs advise for throughput.
   On a 2-core box torch's default (the physical cores) and EnvPool's (min(num_envs, cores)) are 2
   already, so the two modes differ by the pinning alone there; on a bigger box the published mode
   uses every core and the ``cpu`` mode keeps to 2.
3. **The curve.** ``torch.utils.tensorboard.SummaryWriter`` is subclassed before the script imports
   it: each ``charts/episodic_return`` (one per finished game, the raw return) goes into a window of
   100, and each ``charts/SPS`` (once per PPO update, 1,024 agent steps) writes a row with frames =
   ``global_step`` x EnvPool's ``frame_skip`` (4). The events file is still written as cleanrl writes it.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from curve import CurveWriter, launch_time  # noqa: E402

T0 = launch_time()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--script", required=True, help="ppo_atari_envpool.py as fetched by cleanrl.sh")
    ap.add_argument("--curve", required=True)
    ap.add_argument("--mode", choices=("published", "cpu"), default="published")
    ap.add_argument("script_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    script_args = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    script = os.path.abspath(args.script)
    curve = CurveWriter(os.path.abspath(args.curve), t0=T0)

    import envpool
    import gym
    import numpy as np
    import torch
    import torch.utils.tensorboard

    if args.mode == "cpu":
        torch.set_num_threads(2)

    frame_skip = {"value": None}

    class OldGymAPI(gym.Wrapper):
        """envpool >= 0.7 under gym 0.26 -> the envpool 0.6 / gym 0.23 API the script was written for."""

        def reset(self, **kwargs):
            obs, _info = self.env.reset(**kwargs)
            return obs

        def step(self, action):
            obs, reward, terminated, truncated, info = self.env.step(action)
            return obs, reward, np.logical_or(terminated, truncated), info

    envpool_make = envpool.make

    def make(task_id, env_type="gym", **kwargs):
        if args.mode == "cpu":
            kwargs.setdefault("num_threads", 2)
            kwargs.setdefault("thread_affinity_offset", 0)
        env = envpool_make(task_id, env_type=env_type, **kwargs)
        frame_skip["value"] = int(env.config["frame_skip"])
        print(f"cleanrl_run: envpool {envpool.__version__} {task_id} config {env.config}", flush=True)
        return OldGymAPI(env)

    envpool.make = make

    class CurveSummaryWriter(torch.utils.tensorboard.SummaryWriter):
        def add_scalar(self, tag, scalar_value, global_step=None, *a, **kw):
            if tag == "charts/episodic_return":
                curve.episode(float(scalar_value))
            elif tag == "charts/SPS" and global_step is not None:
                curve.row(int(global_step) * (frame_skip["value"] or 4))
            return super().add_scalar(tag, scalar_value, global_step, *a, **kw)

    torch.utils.tensorboard.SummaryWriter = CurveSummaryWriter

    # cleanrl writes its TensorBoard folder to ./runs/<run name>: keep it beside the curve
    os.chdir(os.path.dirname(os.path.abspath(args.curve)))
    sys.argv = [script, *script_args]
    threads = torch.get_num_threads()
    print(f"cleanrl_run: mode {args.mode}, torch {torch.__version__} with {threads} threads", flush=True)
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        curve.close()


if __name__ == "__main__":
    main()
