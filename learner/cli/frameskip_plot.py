"""``frameskip_check --plot``: episodes under the configured settings vs a mis-specified twin, and the plot.

The twin is the same game with the dynamics the historical worker silently ran
(frameskip 2-4, sticky actions 0.25). Each episode is played either by a uniformly
random policy or by a launch_impala checkpoint, through the actor's own agent
adapter (``actors.agents.make_agent`` + ``agent.act``), so the plot samples actions
exactly as a training actor does. The checkpoint is read and turned into an agent by
``impala.evaluation.read_policy_checkpoint`` and ``learner.evaluator.checkpoint_agent``, as
``impala-eval`` does.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import sys
from typing import Any

import numpy as np
import torch

from impala.envs import EnvSpec
from impala.envs.fingerprint import ConfiguredSettings, configured_settings
from impala.envs.vector import GymVecEnv
from impala.evaluation import PolicyCheckpoint, read_policy_checkpoint
from impala.run.checkpoint import CheckpointError
from impala.run.cpus import available_cpus
from learner.evaluator import checkpoint_agent

TWIN_OVERRIDES: dict[str, Any] = {"frameskip": (2, 5), "repeat_action_probability": 0.25}

EpisodeResult = tuple[int, float, int]  # (agent steps, return, emulator frames)


# ---------------------------------------------------------------------------
# A launch_impala checkpoint as an actor's agent
# ---------------------------------------------------------------------------


def check_checkpoint(checkpoint: str, env_id: str) -> str:
    """Load the checkpoint here once so that a bad one is a clean error; returns a policy description.

    Raises ``CheckpointError`` (one line) for a checkpoint that cannot play ``env_id``.
    """
    ckpt = read_policy_checkpoint(checkpoint)  # CheckpointError: missing, foreign, env not installed
    if ckpt.kind != "impala":
        raise CheckpointError(
            f"cannot use checkpoint {checkpoint!r} for {env_id}: --plot plays discrete-action "
            f"(launch_impala) checkpoints, this one is {ckpt.kind}'s"
        )
    envs = GymVecEnv(EnvSpec(env_id), 1, seed=0)
    try:
        checkpoint_agent(ckpt.agent, ckpt.params, envs=envs, first_obs=envs.reset(), seed=0)
    except Exception as e:  # noqa: BLE001 - any unusable checkpoint file is bad input, reported in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot use checkpoint {checkpoint!r} for {env_id}: {first}") from None
    finally:
        envs.close()
    if ckpt.env.id != env_id:
        print(
            f"frameskip_check: warning: the checkpoint was trained on {ckpt.env.id}, playing {env_id}",
            file=sys.stderr,
        )
    return f"policy from {os.path.basename(os.path.abspath(ckpt.path))}"


# ---------------------------------------------------------------------------
# Episodes
# ---------------------------------------------------------------------------

_CHECKPOINTS: dict[str, PolicyCheckpoint] = {}  # per worker process: read each file once


def _episode(task: tuple[str, dict[str, Any], int, int, str | None]) -> EpisodeResult:
    """Run one episode; returns (agent steps, return, emulator frames). Runs in a worker process."""
    env_id, kwargs, seed, max_steps, checkpoint = task
    envs = GymVecEnv(EnvSpec(env_id, kwargs=kwargs), 1, seed=seed)
    # The single env is stepped directly: GymVecEnv.step resets an ended episode at once, and the
    # ALE's episode frame counter with it, before it could be read.
    env = envs.envs[0]
    try:
        obs = envs.reset()  # [1, ...]
        ale = getattr(env.unwrapped, "ale", None)
        agent = None
        if checkpoint:
            torch.set_num_threads(1)
            if checkpoint not in _CHECKPOINTS:
                _CHECKPOINTS[checkpoint] = read_policy_checkpoint(checkpoint)
            ckpt = _CHECKPOINTS[checkpoint]
            agent = checkpoint_agent(ckpt.agent, ckpt.params, envs=envs, first_obs=obs, seed=seed)
        rng = np.random.default_rng(seed)
        n = int(envs.action_space.n)
        steps, total, first = 0, 0.0, np.ones(1, dtype=bool)
        while True:
            action = int(agent.act(obs, first)[0][0]) if agent is not None else int(rng.integers(n))
            o, reward, terminated, truncated, _ = env.step(action)
            obs, first = np.expand_dims(np.asarray(o), 0), np.zeros(1, dtype=bool)
            steps += 1
            total += float(reward)
            if terminated or truncated or (max_steps and steps >= max_steps):
                break
        frames = int(ale.getEpisodeFrameNumber()) if ale is not None else steps
    finally:
        envs.close()
    return steps, total, frames


def run_episodes(
    env_id: str,
    episodes: int,
    *,
    overrides: dict[str, Any] | None = None,
    seed: int = 0,
    max_steps: int = 0,
    checkpoint: str | None = None,
    jobs: int = 0,
) -> dict[str, list[EpisodeResult]]:
    """Episodes under the configured settings and under the mis-specified twin, in parallel worker processes.

    Episode i uses seed ``seed + i`` under both settings. Returns
    ``{"configured": [...], "twin": [...]}`` of (steps, return, emulator frames).
    """
    twin = {**(overrides or {}), **TWIN_OVERRIDES}
    tasks = [(env_id, dict(overrides or {}), seed + i, max_steps, checkpoint) for i in range(episodes)]
    tasks += [(env_id, twin, seed + i, max_steps, checkpoint) for i in range(episodes)]
    jobs = jobs or min(len(tasks), available_cpus())
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=jobs, mp_context=multiprocessing.get_context("spawn")
    ) as ex:
        results = list(ex.map(_episode, tasks))
    return {"configured": results[:episodes], "twin": results[episodes:]}


def setting_label(prefix: str, cfg: ConfiguredSettings | None) -> str:
    """A plot label naming the frame skip and sticky-action probability of ``cfg``."""
    if cfg is None:
        return prefix
    fs = cfg.frameskip if isinstance(cfg.frameskip, int) else f"{cfg.frameskip[0]}-{cfg.frameskip[1] - 1}"
    return f"{prefix} (frameskip {fs}, sticky {cfg.sticky:g})"


def summary_lines(
    results: dict[str, list[EpisodeResult]], *, env_id: str, overrides: dict[str, Any] | None = None
) -> list[str]:
    """One line per setting: episodes, steps per episode, return and emulator frames (mean and sd)."""
    cfg = configured_settings(env_id, overrides)
    twin = configured_settings(env_id, {**(overrides or {}), **TWIN_OVERRIDES})
    out = []
    for key, label in (
        ("configured", setting_label("configured", cfg)),
        ("twin", setting_label("mis-specified twin", twin)),
    ):
        steps = np.array([r[0] for r in results[key]], dtype=float)
        rets = np.array([r[1] for r in results[key]], dtype=float)
        frames = np.array([r[2] for r in results[key]], dtype=float)
        out.append(
            f"{label}: {len(steps)} episodes, steps/episode mean {steps.mean():.1f} (sd {steps.std():.1f}), "
            f"return mean {rets.mean():.2f} (sd {rets.std():.2f}), emulator frames/episode mean "
            f"{frames.mean():.0f}"
        )
    return out


# ---------------------------------------------------------------------------
# The plot
# ---------------------------------------------------------------------------


def plot_episodes(
    results: dict[str, list[EpisodeResult]],
    out: str,
    *,
    env_id: str,
    overrides: dict[str, Any] | None = None,
    policy: str = "random policy",
    max_steps: int = 0,
) -> None:
    """Steps per episode and episode return, configured vs twin, side by side (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = configured_settings(env_id, overrides)
    twin_cfg = configured_settings(env_id, {**(overrides or {}), **TWIN_OVERRIDES})
    labels = [setting_label("configured", cfg), setting_label("mis-specified twin", twin_cfg)]
    colors = ["tab:blue", "tab:orange"]
    n = len(results["configured"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.2))
    panels = [
        (0, "Episode length", "agent steps per episode (actions chosen)", "{:.0f}"),
        (1, "Episode return", "episode return (points scored − conceded)", "{:.1f}"),
    ]
    rng = np.random.default_rng(0)
    for idx, title, ylabel, fmt in panels:
        _draw_panel(axes[idx], results, idx, title, ylabel, fmt, colors, rng)
    cap = f", capped at {max_steps} steps" if max_steps else ""
    fig.suptitle(f"{env_id}: configured settings vs a mis-specified twin ({policy}, {n} episodes each{cap})")
    fig.legend(handles=_legend_handles(colors, labels), loc="lower center", ncol=4, frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _draw_panel(
    ax: Any,
    results: dict[str, list[EpisodeResult]],
    idx: int,
    title: str,
    ylabel: str,
    fmt: str,
    colors: list[str],
    rng: np.random.Generator,
) -> None:
    """One side of the figure: field ``idx`` of each episode, configured vs twin, as boxes and points."""
    from matplotlib.ticker import MaxNLocator

    keys = ["configured", "twin"]
    data = [np.array([r[idx] for r in results[k]], dtype=float) for k in keys]
    # Every episode is drawn as a point, so the box plot shows no separate outliers.
    box = ax.boxplot(
        data,
        positions=[1, 2],
        widths=0.5,
        patch_artist=True,
        showmeans=True,
        showfliers=False,
        medianprops={"color": "black"},
        meanprops={"marker": "D", "markerfacecolor": "white", "markeredgecolor": "black"},
    )
    for patch, color in zip(box["boxes"], colors):
        patch.set_facecolor(color)
        patch.set_alpha(0.35)
    for pos, (d, color) in enumerate(zip(data, colors), start=1):
        ax.scatter(
            pos + rng.uniform(-0.12, 0.12, size=len(d)),
            d,
            color=color,
            s=22,
            zorder=3,
            edgecolor="black",
            linewidth=0.4,
        )
        ax.annotate(
            f"mean {fmt.format(d.mean())}",
            (pos, d.max()),
            xytext=(0, 8),
            textcoords="offset points",
            ha="center",
            fontsize=9,
        )
    ax.set_xticks([1, 2], ["configured", "mis-specified twin"])
    if idx == 0:
        # The game lasts about as long in emulator frames; the agent just makes more decisions in it.
        frames = [np.mean([r[2] for r in results[k]]) for k in keys]
        title += f"\n(mean emulator frames per episode: {frames[0]:.0f} vs {frames[1]:.0f})"
    else:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi + 0.08 * (hi - lo))


def _legend_handles(colors: list[str], labels: list[str]) -> list:
    """The legend: a patch per setting, then what a point and a diamond mean."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=c, alpha=0.5, edgecolor="black", label=l) for c, l in zip(colors, labels)]
    handles += [
        Line2D([], [], marker="o", color="gray", markeredgecolor="black", linestyle="", label="one episode"),
        Line2D(
            [],
            [],
            marker="D",
            color="white",
            markeredgecolor="black",
            linestyle="",
            label="mean (box: quartiles, line: median)",
        ),
    ]
    return handles
