"""Episode statistics summed from the unrolls the learner accepted, never from what a peer claims.

Each (actor, env) stream keeps its running episode; an unroll adds its rewards and episode ends, and the
episodes that ended in it go into the last-100 window (and, in a multi-task run, their task's window). An
episode whose start was not seen (a stream that joined mid-episode, or lost an unroll) is not counted: its
return and length would be partial. The server owns one :class:`EpisodeStats`, feeds it from its receive
thread and reads it from the learner's; the lock inside is for that, nothing here waits.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
from typing import Any, Mapping

import numpy as np

log = logging.getLogger(__name__)

MAX_STREAMS = 65536  # (actor, env) streams whose running episode is tracked; more are not counted
WINDOW = 100  # episodes in the mean-return window


class _Stream:
    """The running episode of one env of one actor, summed from the unrolls the server accepted.

    ``counted`` is False while the episode's start was not seen (the stream joined mid-episode, or
    lost an unroll): its end is then not reported, since its return and length would be partial.
    """

    __slots__ = ("ret", "length", "counted")

    def __init__(self, counted: bool) -> None:
        self.ret = 0.0
        self.length = 0
        self.counted = counted

    def advance(self, rewards: np.ndarray, ends: np.ndarray) -> tuple[list[float], list[int]]:
        """Add one unroll's T transitions; return the episodes that ended in it (as the actor's
        ``EpisodeTracker`` counted them: the sum of the raw rewards and the number of steps)."""
        returns: list[float] = []
        lengths: list[int] = []
        start = 0
        for t in np.flatnonzero(ends):
            t = int(t)
            ret = self.ret + float(rewards[start : t + 1].sum(dtype=np.float64))
            length = self.length + t + 1 - start
            if self.counted:
                returns.append(ret)
                lengths.append(length)
            self.ret, self.length, self.counted = 0.0, 0, True
            start = t + 1
        self.ret += float(rewards[start:].sum(dtype=np.float64))
        self.length += len(rewards) - start
        return returns, lengths


def unroll_episode_arrays(arrays: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """An unroll's raw rewards [T] and episode ends [T] (IMPALA: ``dones``; PPO: terminated or truncated)."""
    ends = arrays["dones"] if "dones" in arrays else arrays["terminated"] | arrays["truncated"]
    return arrays["rewards"], ends


class EpisodeStats:
    """The last 100 episodes' returns and lengths, the episode count, and per task the same, from
    accepted unrolls. ``task_names``: a multi-task run's tasks (empty: one task, no per-task windows)."""

    def __init__(self, task_names: tuple[str, ...] = ()) -> None:
        self.task_names = tuple(task_names)
        self._lock = threading.Lock()  # the receive thread adds, the learner's thread reads
        self.streams: dict[int, dict[int, _Stream]] = {}
        self.stream_count = 0
        self.fresh: dict[int, bool] = {}  # actor -> its hello said it starts its envs afresh
        self.episode_returns: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.episode_lengths: collections.deque[int] = collections.deque(maxlen=WINDOW)
        self.episodes_total = 0
        self.task_returns: list[collections.deque[float]] = [
            collections.deque(maxlen=WINDOW) for _ in self.task_names
        ]
        self.task_episodes = [0] * len(self.task_names)

    # ---- fed by the receive thread --------------------------------------
    def restart(self, actor: int, fresh: bool) -> None:
        """A hello starts ``actor``'s accounting again: a new actor process starts its envs at a reset
        (``fresh``); one saying hello again mid-run is mid-episode, so its first episode per env is only
        partly seen and is not counted."""
        self.forget(actor)
        self.fresh[actor] = fresh

    def forget(self, actor: int) -> None:
        """Drop ``actor``'s streams (refused, evicted or expired)."""
        self.stream_count -= len(self.streams.pop(actor, {}))
        self.fresh.pop(actor, None)

    def lose(self, actor: int, env: Any) -> None:
        """An unroll of this stream was dropped: its running episode has a gap, so its end is not counted."""
        stream = self.streams.get(actor, {}).get(env) if type(env) is int else None
        if stream is not None:
            stream.counted = False

    def add(self, actor: int, env: int, task: int, arrays: Mapping[str, np.ndarray]) -> None:
        """Count the episodes that ended in this accepted unroll, from its own rewards and episode ends."""
        returns, lengths = self._episodes(actor, env, arrays)
        with self._lock:
            self.episode_returns.extend(returns)
            self.episode_lengths.extend(lengths)
            self.episodes_total += len(returns)
            if self.task_names:
                self.task_returns[task].extend(returns)
                self.task_episodes[task] += len(returns)

    def _episodes(
        self, actor: int, env: int, arrays: Mapping[str, np.ndarray]
    ) -> tuple[list[float], list[int]]:
        streams = self.streams.setdefault(actor, {})
        stream = streams.get(env)
        if stream is None:
            if self.stream_count >= MAX_STREAMS:
                return [], []  # table full (thousands of actors): these episodes go uncounted
            stream = streams[env] = _Stream(counted=self.fresh.get(actor, False))
            self.stream_count += 1
        if "first" in arrays and arrays["first"][0]:
            # IMPALA unrolls say when obs[0] starts an episode: from here the episode is seen whole.
            stream.ret, stream.length, stream.counted = 0.0, 0, True
        rewards, ends = unroll_episode_arrays(arrays)
        return stream.advance(rewards, ends)

    # ---- read by the learner's thread -----------------------------------
    def record(self) -> dict[str, Any]:
        """The statistics as plain lists, for the checkpoint: a resumed run's curve and
        ``--stop-at-return`` go on from the same last 100 episodes instead of starting an empty window."""
        with self._lock:
            return {
                "returns": [float(r) for r in self.episode_returns],
                "lengths": [int(n) for n in self.episode_lengths],
                "total": int(self.episodes_total),
                "task_returns": [[float(r) for r in q] for q in self.task_returns],
                "task_episodes": [int(n) for n in self.task_episodes],
            }

    def restore(self, record: Mapping[str, Any]) -> None:
        """Take back :meth:`record`'s statistics; a record that does not fit this run (another task list,
        values that are not finite numbers: a checkpoint of an older version or edited by hand) is left out,
        with one log line, and the window starts empty as it did before records existed."""
        if not record:
            return

        def numbers(values: Any, kind: type) -> list[Any]:
            if not isinstance(values, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values
            ):
                raise ValueError("not a list of finite numbers")
            return [kind(v) for v in values]

        try:
            returns, lengths = numbers(record["returns"], float), numbers(record["lengths"], int)
            total, task_episodes = int(record["total"]), numbers(record["task_episodes"], int)
            task_returns = [numbers(q, float) for q in record["task_returns"]]
            if len(task_returns) != len(self.task_names) or len(task_episodes) != len(self.task_names):
                raise ValueError(f"{len(task_returns)} tasks there, {len(self.task_names)} here")
        except (KeyError, TypeError, ValueError) as e:
            log.warning("the checkpoint's episode statistics are left out (%s); the window starts empty", e)
            return
        with self._lock:
            self.episode_returns.extend(returns)
            self.episode_lengths.extend(lengths)
            self.episodes_total = total
            for window, values in zip(self.task_returns, task_returns):
                window.extend(values)
            self.task_episodes = task_episodes

    def full_window_mean_return(self) -> float | None:
        """Mean return of the last 100 episodes; None until 100 episodes have finished."""
        with self._lock:
            if len(self.episode_returns) < (self.episode_returns.maxlen or 0):
                return None
            return float(np.mean(self.episode_returns))

    def stats(self) -> dict[str, float]:
        """The episode rows of a log line: counts, and the windows' means once they hold episodes."""
        with self._lock:
            returns, lengths = list(self.episode_returns), list(self.episode_lengths)
            out = {"charts/episodes": float(self.episodes_total)}
            per_task = [
                (name, list(r), n)
                for name, r, n in zip(self.task_names, self.task_returns, self.task_episodes)
            ]
        if returns:
            out["charts/mean_return_100"] = float(np.mean(returns))
            out["charts/mean_length_100"] = float(np.mean(lengths))
        for name, task_returns, episodes in per_task:
            out[f"tasks/{name}/episodes"] = float(episodes)
            if task_returns:
                out[f"tasks/{name}/mean_return_100"] = float(np.mean(task_returns))
        return out

    def task_mean_returns(self) -> dict[str, float]:
        """Each task's mean return over its last 100 episodes (tasks with none yet are left out)."""
        with self._lock:
            return {name: float(np.mean(r)) for name, r in zip(self.task_names, self.task_returns) if r}
