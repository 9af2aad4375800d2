"""The rows a run logs: learner losses, transport counters and the run's own charts (``charts/``), and for a
multi-task run each task's frames and human-normalized score."""

from __future__ import annotations

import time
from typing import Any, Mapping

import numpy as np

from impala.envs.atari import human_normalized_score


def task_rows(
    task_names: tuple[str, ...], task_frames: list[int], mean_returns: Mapping[str, float]
) -> dict[str, float]:
    """A multi-task run's per-task metrics: frames, and for Atari games the human-normalized score
    of the mean return of the last 100 episodes, with the median and mean over the tasks that have one."""
    row: dict[str, float] = {}
    scores = []
    for name, frames in zip(task_names, task_frames):
        row[f"tasks/{name}/frames"] = float(frames)
        if name in mean_returns:
            hns = human_normalized_score(name, mean_returns[name])
            if hns is not None:
                row[f"tasks/{name}/human_normalized"] = hns
                scores.append(hns)
    if scores:
        row["tasks/median_human_normalized"] = float(np.median(scores))
        row["tasks/mean_human_normalized"] = float(np.mean(scores))
    return row


class LogRows:
    """Collects what happens between two log rows (policy lag per unroll) and builds the row every
    ``--log-interval``."""

    def __init__(
        self,
        interval_s: float,
        task_names: tuple[str, ...],
        env_frames: int,
        since: float | None = None,
        *,
        every_steps: int | None = None,
        agent_steps: int = 0,
    ) -> None:
        """``since``: when the first interval started (``time.monotonic()``; default now). ``every_steps``: a
        row each time the agent steps pass a multiple of it (ML-Agents' ``summary_freq``) instead of every
        ``interval_s`` seconds."""
        self.interval_s, self.task_names, self.every_steps = interval_s, task_names, every_steps
        self.last_time, self.last_frames = time.monotonic() if since is None else since, env_frames
        self.next_steps = (agent_steps // every_steps + 1) * every_steps if every_steps else 0
        self.lags: list[float] = []
        self.task_lags: list[list[float]] = [[] for _ in task_names]

    def record_lag(self, lag: float, task: int = 0) -> None:
        """One accepted unroll's policy lag (and, in a multi-task run, its task's)."""
        self.lags.append(lag)
        if self.task_names:
            self.task_lags[task].append(lag)

    def due(self, agent_steps: int = 0) -> bool:
        if self.every_steps:
            if agent_steps < self.next_steps:
                return False
            self.next_steps = (agent_steps // self.every_steps + 1) * self.every_steps
            return True
        return time.monotonic() - self.last_time >= self.interval_s

    def row(
        self,
        progress: Any,
        metrics: Mapping[str, float],
        server_stats: Mapping[str, float],
        task_means: Mapping[str, float],
        actor_restarts: int,
    ) -> dict[str, float]:
        """The row for now; starts the next interval."""
        now = time.monotonic()
        row = {**metrics, **server_stats}
        row["charts/env_frames"] = progress.env_frames
        row["charts/agent_steps"] = progress.agent_steps
        row["charts/fps"] = (progress.env_frames - self.last_frames) / max(now - self.last_time, 1e-9)
        row["charts/policy_lag"] = float(np.mean(self.lags)) if self.lags else 0.0
        row["charts/policy_version"] = progress.version
        row["charts/actor_restarts"] = actor_restarts
        if self.task_names:
            row.update(task_rows(self.task_names, progress.task_frames, task_means))
            for name, lags in zip(self.task_names, self.task_lags):
                if lags:
                    row[f"tasks/{name}/policy_lag"] = float(np.mean(lags))
        self.last_time, self.last_frames, self.lags = now, progress.env_frames, []
        self.task_lags = [[] for _ in self.task_names]
        return row
