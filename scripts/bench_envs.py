#!/usr/bin/env python
"""Atari env stepping per core: the actors' gym path against ale-py's and EnvPool's C++ vector envs.

Each path steps K envs with uniformly random actions (the same preprocessing: frame skip 4 with a
max-pool over the last two frames, 84x84 grayscale, 4 stacked frames, up to 30 no-op starts, raw
rewards, no fire reset, no episodic life) and is measured in its own process, one thread, by the CPU
time the process used (user + system, all its threads). Agent steps per CPU-second is what a core buys,
so the figures hold on a busy machine too; the wall-clock rate is printed beside it.

- ``gym``: what an actor runs today, ``GymVecEnv`` over ``DeepMindAtari`` (impala.envs), K envs
  stepped in turn in Python;
- ``ale-vector``: ``ale_py.vector_env.AtariVectorEnv`` (ships with ale-py), one C++ worker thread;
- ``envpool``: ``envpool.make(..., num_threads=1)``. EnvPool is not a dependency of this project; give
  an interpreter that has it with ``--envpool-python`` (it needs only envpool and numpy there).

    python scripts/bench_envs.py --game pong --envs 4 --seconds 10
    python scripts/bench_envs.py --envpool-python /path/to/venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# ALE game names (ale-py) and the ids our gym path and EnvPool call them by
GAMES = {
    "pong": ("PongDeterministic-v4", "Pong-v5"),
    "breakout": ("BreakoutDeterministic-v4", "Breakout-v5"),
    "space_invaders": ("SpaceInvadersDeterministic-v4", "SpaceInvaders-v5"),
}


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _time(step, actions, seconds: float, warmup: int = 200) -> dict:
    """Step for ``seconds`` of wall time after ``warmup`` steps; agent steps per CPU- and wall-second."""
    for i in range(warmup):
        step(actions[i % len(actions)])
    steps, cpu0, wall0 = 0, _cpu_seconds(), time.perf_counter()
    while time.perf_counter() - wall0 < seconds:
        for a in actions[:100]:
            step(a)
        steps += 100
    cpu, wall = _cpu_seconds() - cpu0, time.perf_counter() - wall0
    return {"cpu_s": cpu, "wall_s": wall, "batches": steps}


def _measure(path: str, game: str, num_envs: int, seconds: float) -> dict:
    """Run in a child process: one path, one thread."""
    import numpy as np

    rng = np.random.default_rng(0)
    if path == "gym":
        sys.path.insert(0, str(ROOT))
        import torch  # noqa: F401  (the actor process has it loaded; keep the import out of the timing)

        from impala.envs import EnvSpec
        from impala.envs.vector import GymVecEnv

        envs = GymVecEnv(EnvSpec(GAMES[game][0]), num_envs, seed=1)
        envs.reset()
        num_actions = envs.action_space.n
        step = envs.step
    elif path == "ale-vector":
        from ale_py.vector_env import AtariVectorEnv

        envs = AtariVectorEnv(
            game=game,
            num_envs=num_envs,
            num_threads=1,
            frameskip=4,
            maxpool=True,
            grayscale=True,
            img_height=84,
            img_width=84,
            stack_num=4,
            noop_max=30,
            repeat_action_probability=0.0,
            reward_clipping=False,
            episodic_life=False,
            use_fire_reset=False,
        )
        envs.reset(seed=1)
        num_actions = envs.single_action_space.n
        step = envs.step
    elif path == "envpool":
        import envpool

        envs = envpool.make(
            GAMES[game][1],
            env_type="gymnasium",
            num_envs=num_envs,
            num_threads=1,
            seed=1,
            frame_skip=4,
            stack_num=4,
            img_height=84,
            img_width=84,
            gray_scale=True,
            noop_max=30,
            repeat_action_probability=0.0,
            reward_clip=False,
            episodic_life=False,
            use_fire_reset=False,
        )
        envs.reset()
        num_actions = envs.action_space.n
        step = envs.step
    else:
        raise SystemExit(f"unknown path {path!r}")
    actions = [rng.integers(0, num_actions, size=num_envs) for _ in range(100)]
    out = _time(step, actions, seconds)
    out["agent_steps"] = out.pop("batches") * num_envs
    return out


def _child(python: str, path: str, args: argparse.Namespace) -> dict | str:
    cmd = [python, __file__, "--child", path, "--game", args.game, "--envs", str(args.envs)]
    cmd += ["--seconds", str(args.seconds)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return f"failed: {tail}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("--game", default="pong", choices=sorted(GAMES))
    ap.add_argument("--envs", type=int, default=4, help="envs per process, the actors' K (default 4)")
    ap.add_argument("--seconds", type=float, default=10.0, help="wall seconds measured per path")
    ap.add_argument("--repeats", type=int, default=2, help="alternating rounds over the paths")
    ap.add_argument("--envpool-python", default=None, help="an interpreter with envpool installed")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.envs < 1 or args.seconds <= 0 or args.repeats < 1:
        print("bench_envs: --envs, --seconds and --repeats must be positive", file=sys.stderr)
        return 2
    if args.child:
        print(json.dumps(_measure(args.child, args.game, args.envs, args.seconds)))
        return 0
    paths = [("gym", sys.executable), ("ale-vector", sys.executable)]
    if args.envpool_python:
        paths.append(("envpool", args.envpool_python))
    results: dict[str, list[dict]] = {p: [] for p, _ in paths}
    for _ in range(args.repeats):
        for path, python in paths:
            r = _child(python, path, args)
            if isinstance(r, str):
                print(f"{path}: {r}")
                continue
            results[path].append(r)
    print(f"{args.game}, K={args.envs} envs per process, one thread, {args.seconds:g} s x {args.repeats}")
    print(f"{'path':<12} {'steps/CPU-s':>12} {'frames/CPU-s':>13} {'steps/wall-s':>13} {'vs gym':>7}")
    base = None
    for path, _ in paths:
        rows = results[path]
        if not rows:
            continue
        steps = sum(r["agent_steps"] for r in rows)
        per_cpu = steps / sum(r["cpu_s"] for r in rows)
        per_wall = steps / sum(r["wall_s"] for r in rows)
        base = base or per_cpu
        ratio = per_cpu / base
        print(f"{path:<12} {per_cpu:>12,.0f} {4 * per_cpu:>13,.0f} {per_wall:>13,.0f} {ratio:>6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
