"""PPO training throughput: ours (launch_ppo) vs stable-baselines3 PPO, same env, same work, same machine.

Both sides run full training cycles (collect n_steps x n_envs agent steps, then
n_epochs of minibatch updates) with identical sizes: env (Ant-v5), n_envs,
n_steps (our unroll length; buffer = n_steps * n_envs), batch size, epochs,
network (separate actor and critic MLPs of the same width/depth), Adam, and SB3
semantics on both sides (our ``--semantics sb3``; SB3 wrapped in
``VecNormalize(norm_obs, norm_reward)`` as our sb3 preset normalizes).

Steady-state throughput, start-up excluded:
  ours: ``launch_ppo`` as a real subprocess (1 actor process + learner), read from
        its metrics.csv: (steps at last update - steps at first update) / (time between).
  SB3:  ``PPO.learn`` in this process, timed from the 2nd rollout start to the end
        (the 1st cycle is the warm-up), steps = full cycles in between.
Runs alternate ours/SB3, several repeats; medians and the ratio ours/SB3 are reported.

    .venv/bin/python scripts/bench_ppo.py                     # both nets, 3 repeats
    .venv/bin/python scripts/bench_ppo.py --nets small --repeats 1 --cycles 3
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (hidden units, layers, batch size, epochs)
NETS = {
    "small": (64, 2, 64, 10),  # SB3's PPO defaults: [64, 64] tanh, batch 64, 10 epochs
    "crawler": (512, 3, 256, 3),  # Crawler's 3x512 net, 3 epochs (batch shrunk with the buffer)
}


def run_ours(net: str, args: argparse.Namespace, seed: int) -> float:
    hidden, layers, batch, epochs = NETS[net]
    buffer = args.n_steps * args.n_envs
    with tempfile.TemporaryDirectory(prefix="bench_ppo_") as logdir:
        cmd = [
            str(Path(sys.executable).parent / "launch_ppo"),
            "--env",
            args.env,
            "--semantics",
            "sb3",
            "--workers",
            "1",
            "--envs-per-worker",
            str(args.n_envs),
            "--unroll-length",
            str(args.n_steps),
            "--time-horizon",
            str(args.n_steps),
            "--buffer-size",
            str(buffer),
            "--batch-size",
            str(batch),
            "--num-epoch",
            str(epochs),
            "--hidden-units",
            str(hidden),
            "--num-layers",
            str(layers),
            "--total-steps",
            str((args.cycles + 1) * buffer),
            "--seed",
            str(seed),
            "--device",
            "cpu",
            "--logdir",
            logdir,
            "--log-interval",
            "0",
            "--no-progress",
            *args.ours_extra,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"launch_ppo failed:\n{out.stderr[-3000:]}")
        with open(os.path.join(logdir, "metrics.csv")) as f:
            rows = list(csv.DictReader(f))
    if len(rows) < 2:
        raise SystemExit(f"launch_ppo logged {len(rows)} updates; raise --cycles")
    return (int(rows[-1]["step"]) - int(rows[0]["step"])) / (float(rows[-1]["time"]) - float(rows[0]["time"]))


def run_sb3(net: str, args: argparse.Namespace, seed: int) -> float:
    import gymnasium as gym
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    hidden, layers, batch, epochs = NETS[net]
    buffer = args.n_steps * args.n_envs

    class Stamps(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.starts: list[float] = []

        def _on_rollout_start(self) -> None:
            self.starts.append(time.perf_counter())

        def _on_step(self) -> bool:
            return True

    venv = VecNormalize(
        DummyVecEnv([lambda i=i: gym.make(args.env) for i in range(args.n_envs)]),
        norm_obs=True,
        norm_reward=True,
    )
    venv.seed(seed)
    model = PPO(
        "MlpPolicy",
        venv,
        n_steps=args.n_steps,
        batch_size=batch,
        n_epochs=epochs,
        seed=seed,
        device="cpu",
        verbose=0,
        policy_kwargs=dict(
            net_arch=dict(pi=[hidden] * layers, vf=[hidden] * layers), activation_fn=torch.nn.Tanh
        ),
    )
    stamps = Stamps()
    model.learn(total_timesteps=(args.cycles + 1) * buffer, callback=stamps)
    end = time.perf_counter()
    venv.close()
    cycles = len(stamps.starts) - 1  # full cycles from the 2nd rollout start to the end
    return cycles * buffer / (end - stamps.starts[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--env", default="Ant-v5")
    p.add_argument("--nets", nargs="+", choices=sorted(NETS), default=["small", "crawler"])
    p.add_argument("--n-envs", type=int, default=8)
    p.add_argument(
        "--n-steps", type=int, default=256, help="Steps per env per cycle (buffer = n_steps * n_envs)."
    )
    p.add_argument(
        "--cycles", type=int, default=5, help="Timed collect+update cycles per run (after 1 warm-up cycle)."
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--ours-extra",
        nargs="*",
        default=[],
        help="Extra launch_ppo flags, e.g. --ours-extra=--torch-threads=2.",
    )
    args = p.parse_args(argv)
    import torch

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; env "
        f"{args.env}, "
        f"{args.n_envs} envs x {args.n_steps} steps = {args.n_envs * args.n_steps} per update; {args.cycles} "
        "timed cycles, "
        f"{args.repeats} repeats (alternating)",
        flush=True,
    )
    results: dict[str, dict[str, list[float]]] = {n: {"ours": [], "sb3": []} for n in args.nets}
    for r in range(args.repeats):
        for net in args.nets:
            order = ("ours", "sb3") if r % 2 == 0 else ("sb3", "ours")
            for who in order:
                sps = run_ours(net, args, seed=r) if who == "ours" else run_sb3(net, args, seed=r)
                results[net][who].append(sps)
                print(f"  repeat {r} {net:8s} {who:4s}: {sps:8.0f} steps/s", flush=True)
    print(
        "\n| net | hidden x layers | batch | epochs | ours steps/s (median) | SB3 steps/s (median) | "
        "ours/SB3 |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for net in args.nets:
        hidden, layers, batch, epochs = NETS[net]
        o, s = statistics.median(results[net]["ours"]), statistics.median(results[net]["sb3"])
        print(f"| {net} | {layers}x{hidden} | {batch} | {epochs} | {o:,.0f} | {s:,.0f} | {o / s:.2f}x |")
    for net in args.nets:
        print(
            f"{net}: ours {[round(x) for x in results[net]['ours']]}, sb3 "
            f"{[round(x) for x in results[net]['sb3']]}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
