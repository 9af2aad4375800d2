"""Episode statistics from accepted unrolls, on the object alone (no server): what counts as an episode.
End to end, with real actors and hostile peers: tests/test_hostile_peers.py."""

from __future__ import annotations

import numpy as np

from learner.serve.episode_stats import EpisodeStats


def _unroll(rewards, ends, first=None):
    arrays = {"rewards": np.asarray(rewards, np.float32), "dones": np.asarray(ends, bool)}
    if first is not None:
        arrays["first"] = np.asarray([first] + [False] * (len(rewards) - 1))
    return arrays


def test_a_fresh_actors_episodes_count_whole_and_a_resumed_ones_first_does_not():
    stats = EpisodeStats()
    stats.restart(1, fresh=True)
    stats.restart(2, fresh=False)  # said hello again mid-run: its first episode per env is partly seen
    for actor in (1, 2):
        stats.add(actor, 0, 0, _unroll([1, 1, 1], [False, False, True]))
        stats.add(actor, 0, 0, _unroll([2, 2], [False, True]))
    assert list(stats.episode_returns) == [3.0, 4.0, 4.0] and list(stats.episode_lengths) == [3, 2, 2]
    assert stats.episodes_total == 3 and stats.stats()["charts/mean_return_100"] == 11 / 3


def test_a_stream_that_lost_an_unroll_counts_from_its_next_episode_start():
    stats = EpisodeStats()
    stats.restart(1, fresh=True)
    stats.add(1, 0, 0, _unroll([1, 1], [False, False]))
    stats.lose(1, 0)  # an unroll of this stream was dropped: the running episode has a gap
    stats.lose(1, "0")  # a bad env index names no stream
    stats.add(1, 0, 0, _unroll([1, 1], [False, True]))
    assert stats.episodes_total == 0
    stats.add(1, 0, 0, _unroll([5, 5], [False, True]))
    assert list(stats.episode_returns) == [10.0]
    stats.lose(1, 0)
    stats.add(1, 0, 0, _unroll([7, 7], [False, True], first=True))  # IMPALA says where an episode starts
    assert list(stats.episode_returns) == [10.0, 14.0]


def test_per_task_windows_and_a_forgotten_actors_streams():
    stats = EpisodeStats(("pong", "breakout"))
    stats.restart(1, fresh=True)
    stats.add(1, 0, 1, _unroll([3], [True]))
    assert stats.task_mean_returns() == {"breakout": 3.0}
    assert stats.stats()["tasks/pong/episodes"] == 0.0 and stats.stats()["tasks/breakout/episodes"] == 1.0
    assert stats.stream_count == 1
    stats.forget(1)
    assert stats.stream_count == 0 and stats.streams == {}
    assert stats.record()["task_returns"] == [[], [3.0]]
