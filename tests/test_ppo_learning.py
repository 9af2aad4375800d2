"""End-to-end: the PPO learner learns Pendulum-v1 in a plain single-process loop.

Settings: SB3 preset semantics with rl-zoo's Pendulum-v1 PPO hyperparameters
(n_envs 4, gae_lambda 0.95, gamma 0.9, n_epochs 10, ent_coef 0, lr 1e-3,
clip 0.2, batch 64), except n_steps 256 instead of 1024: more frequent updates
learn Pendulum in ~30k steps without rl-zoo's gSDE. With VecNormalize-style obs
and reward normalization (the sb3 preset). 100k steps take ~40 s on 2 busy cores;
seeds 0/1/2 gave deterministic eval returns -160/-231/-291 (train, last 40
episodes: -236/-341/-318).
"""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np
import torch

from impala.run.ppo_config import PPOConfig
from learner.ppo_learner import PPOLearner, TrajectoryPiece

N_ENVS = 4
N_STEPS = 256


def run_pendulum(
    total_steps: int,
    seed: int = 0,
    n_steps: int = N_STEPS,
    log_every: int = 0,
    eval_episodes: int = 20,
    **overrides,
) -> tuple[list[float], float, float]:
    """Train; return (training episode returns in completion order, mean deterministic eval return,
    seconds)."""
    torch.manual_seed(seed)
    torch.set_num_threads(1)  # a 64x64 MLP: threads only add overhead, and CI shares its cores
    cfg = PPOConfig.preset(
        "sb3",
        buffer_size=N_ENVS * n_steps,
        time_horizon=n_steps,
        batch_size=64,
        lambd=0.95,
        gamma=0.9,
        num_epoch=10,
        beta=0.0,
        learning_rate=1e-3,
        epsilon=0.2,
        max_steps=total_steps,
        seed=seed,
        **overrides,
    )
    envs = [gym.make("Pendulum-v1") for _ in range(N_ENVS)]
    obs = np.stack([e.reset(seed=seed + i)[0] for i, e in enumerate(envs)]).astype(np.float32)
    space = envs[0].action_space
    learner = PPOLearner(cfg, obs.shape[1], space.shape[0], space.low, space.high)
    gen = torch.Generator().manual_seed(seed)
    ep_ret = np.zeros(N_ENVS)
    returns: list[float] = []
    t0 = time.perf_counter()
    steps = 0
    while steps < total_steps:
        cols = {
            k: []
            for k in (
                "obs",
                "actions",
                "log_probs",
                "rewards",
                "terminated",
                "truncated",
                "next_obs",
                "values",
            )
        }
        for _ in range(cfg.time_horizon):
            out = learner.policy.act(torch.as_tensor(obs), generator=gen)
            a_env = learner.env_action(out.action.numpy())
            row = {k: [] for k in ("reward", "term", "trunc", "final", "next")}
            for i, e in enumerate(envs):
                o, r, term, trunc, _ = e.step(a_env[i])
                ep_ret[i] += r
                final = o
                if term or trunc:
                    returns.append(ep_ret[i])
                    ep_ret[i] = 0.0
                    o, _ = e.reset()
                row["reward"].append(r), row["term"].append(term), row["trunc"].append(trunc)
                row["final"].append(final), row["next"].append(o)
            cols["obs"].append(obs)
            cols["actions"].append(out.action.numpy())
            cols["log_probs"].append(out.log_prob.numpy())
            cols["values"].append(out.value.numpy())
            cols["rewards"].append(np.array(row["reward"], np.float32))
            cols["terminated"].append(np.array(row["term"]))
            cols["truncated"].append(np.array(row["trunc"]))
            cols["next_obs"].append(np.array(row["final"], np.float32))
            obs = np.array(row["next"], np.float32)
        steps += cfg.time_horizon * N_ENVS
        arr = {k: np.stack(v, axis=1) for k, v in cols.items()}  # [K, T, ...]
        for i in range(N_ENVS):
            learner.ingest(TrajectoryPiece(**{k: arr[k][i] for k in arr}, source=i))
        assert learner.ready()
        m = learner.update()
        assert all(np.isfinite(m[k]) for k in ("policy_loss", "value_loss", "approx_kl"))
        if log_every and learner.update_count % log_every == 0:
            print(
                f"{steps:7d} steps {time.perf_counter() - t0:6.1f}s return(last 20) "
                f"{np.mean(returns[-20:]):8.1f}",
                flush=True,
            )
    seconds = time.perf_counter() - t0
    eval_env = gym.make("Pendulum-v1")
    eval_returns = []
    for ep in range(eval_episodes):
        o, _ = eval_env.reset(seed=10_000 + seed * 100 + ep)
        done, total = False, 0.0
        while not done:
            with torch.no_grad():
                a = learner.policy.act(
                    torch.as_tensor(o[None], dtype=torch.float32), deterministic=True
                ).action
            o, r, term, trunc, _ = eval_env.step(learner.env_action(a.numpy())[0])
            total += r
            done = term or trunc
        eval_returns.append(total)
    return returns, float(np.mean(eval_returns)), seconds


def test_pendulum_learns():
    returns, eval_return, seconds = run_pendulum(total_steps=100_000)
    train_last = float(np.mean(returns[-40:]))
    print(
        f"Pendulum-v1 after 100k steps in {seconds:.1f}s: deterministic eval (20 episodes) "
        f"{eval_return:.1f}, "
        f"training episodes (last 40) {train_last:.1f}, first 40 {np.mean(returns[:40]):.1f}"
    )
    assert eval_return > -400, (
        f"deterministic eval return {eval_return:.1f} <= -400 (training: {train_last:.1f})"
    )
