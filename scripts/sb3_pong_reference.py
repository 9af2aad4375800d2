#!/usr/bin/env python
"""Reference curve for docs/PONG.md: Stable-Baselines3 PPO on our PongDeterministic-v4.

The same env construction and preprocessing as launch_impala (``impala.envs.make_env``),
SB3's Atari PPO settings (rl-zoo: 8 envs x 128 steps, 4 epochs of 256-sample minibatches,
Adam 2.5e-4 decaying linearly, clip 0.1, entropy 0.01, vf 0.5, grad clip 0.5, GAE 0.95,
Nature CNN), one process. Writes ``frames,time,mean_return_100,episodes`` rows every
20k agent steps; frames = agent steps x 4 (the env's frame skip), as launch_impala counts.

    .venv/bin/python scripts/sb3_pong_reference.py --out docs/data/sb3_pong_ref.csv --steps 2500000
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

FRAME_SKIP = 4  # PongDeterministic-v4


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("--out", required=True, help="CSV to write.")
    ap.add_argument(
        "--steps", type=int, default=2_500_000, help="Agent steps (the lr decays to 0 over them)."
    )
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    import numpy as np
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.vec_env import DummyVecEnv, VecMonitor

    from impala.envs import EnvSpec, make_env

    torch.set_num_threads(2)
    spec = EnvSpec("PongDeterministic-v4")
    venv = VecMonitor(DummyVecEnv([lambda i=i: make_env(spec, seed=100 + i) for i in range(8)]))

    class LogReturns(BaseCallback):
        def __init__(self, writer, f):
            super().__init__()
            self.writer, self.file = writer, f
            self.returns: collections.deque = collections.deque(maxlen=100)
            self.episodes, self.last, self.t0 = 0, 0, time.time()

        def _on_step(self) -> bool:
            for info in self.locals["infos"]:
                if "episode" in info:
                    self.returns.append(info["episode"]["r"])
                    self.episodes += 1
            if self.num_timesteps - self.last >= 20_000 and self.returns:
                self.last = self.num_timesteps
                self.writer.writerow(
                    [
                        self.num_timesteps * FRAME_SKIP,
                        round(time.time() - self.t0),
                        float(np.mean(self.returns)),
                        self.episodes,
                    ]
                )
                self.file.flush()
            return True

    with open(args.out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["frames", "time", "mean_return_100", "episodes"])
        model = PPO(
            "CnnPolicy",
            venv,
            n_steps=128,
            batch_size=256,
            n_epochs=4,
            learning_rate=lambda p: p * 2.5e-4,
            clip_range=0.1,
            ent_coef=0.01,
            vf_coef=0.5,
            max_grad_norm=0.5,
            gamma=0.99,
            gae_lambda=0.95,
            seed=args.seed,
            device="cpu",
            verbose=0,
        )
        model.learn(total_timesteps=args.steps, callback=LogReturns(writer, f))


if __name__ == "__main__":
    main()
