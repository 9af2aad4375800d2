"""Run N actors: ``ActorPool`` (processes: start, restart the dead with a new seed, stop all) and
``ThreadActors`` (the same actor loop in threads of this process), with one interface."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import threading
import time
from typing import Callable

from actors.actor import Actor
from actors.loop import LEARNER_GONE_EXIT, REFUSED_EXIT, ActorConfig, run_actor

log = logging.getLogger(__name__)


# An actor that dies this many times in a row, each within QUICK_DEATH_S of its start and before its first
# hello, cannot start (its env does not build in a fresh process): the learner ends the start then.
START_FAILURES = 3
QUICK_DEATH_S = 30.0


class ActorPool:
    """Starts actors with an explicit start method and keeps them running.

    An actor that dies (crash, OOM, SIGKILL) is restarted with a fresh seed and
    the restart is logged and counted; the learner never goes down with it.
    """

    def __init__(
        self,
        configs: list[ActorConfig],
        *,
        start_method: str = "spawn",
        actor_class: Callable[..., Actor] = Actor,
    ) -> None:
        if start_method not in multiprocessing.get_all_start_methods():
            raise ValueError(
                f"start method {start_method!r} is not available here (have: "
                f"{multiprocessing.get_all_start_methods()})"
            )
        self.ctx = multiprocessing.get_context(start_method)
        self.start_method = start_method
        self.configs = list(configs)
        self.actor_class = actor_class
        self.actors: list[Actor] = []
        self.restarts = 0
        self._incarnation = [0] * len(configs)
        self.finished: set[int] = set()  # actors that exited because their learner is gone (or refused them)
        self.refused: set[int] = set()  # ids of actors the learner refused
        # Restart backoff per slot: an actor that dies at start-up (say, a Unity port in use) must
        # not be re-spawned ten times a second, each spawn importing torch on the learner's cores.
        self._next_start: list[float | None] = [None] * len(configs)
        self._backoff = [0.0] * len(configs)
        self._started_at = [0.0] * len(configs)
        self._quick_deaths = [0] * len(configs)  # deaths in a row, each within QUICK_DEATH_S of its start
        self._exitcodes: list[int | None] = [None] * len(configs)

    def _spawn(self, config: ActorConfig) -> Actor:
        actor = self.actor_class(config, start_method=self.start_method)
        actor.start()
        return actor

    def start(self) -> None:
        self.actors = [self._spawn(c) for c in self.configs]
        self._started_at = [time.monotonic()] * len(self.configs)

    def supervise(self) -> list[int]:
        """Restart dead actors (after a backoff when they keep dying fast); returns the ids restarted."""
        restarted = []
        now = time.monotonic()
        for i, actor in enumerate(self.actors):
            if actor.is_alive() or i in self.finished:
                continue
            if self._next_start[i] is None:  # a death not seen before
                actor.join(timeout=0)
                if actor.exitcode == LEARNER_GONE_EXIT:
                    log.warning(
                        "actor %d: its learner stopped sending weights; not restarting it",
                        self.configs[i].actor_id,
                    )
                    self.finished.add(i)
                    continue
                if actor.exitcode == REFUSED_EXIT:
                    log.warning(
                        "actor %d: refused by the learner; not restarting it", self.configs[i].actor_id
                    )
                    self.finished.add(i)
                    self.refused.add(self.configs[i].actor_id)
                    continue
                # Back off only when an actor keeps dying quickly; one that ran a while restarts at once.
                quick = now - self._started_at[i] < QUICK_DEATH_S
                self._quick_deaths[i] = self._quick_deaths[i] + 1 if quick else 0
                self._exitcodes[i] = actor.exitcode
                self._backoff[i] = min(30.0, max(1.0, 2 * self._backoff[i])) if quick else 0.0
                self._next_start[i] = now + self._backoff[i]
                log.warning(
                    "actor %d exited with code %s; restarting in %.0fs",
                    self.configs[i].actor_id,
                    actor.exitcode,
                    self._backoff[i],
                )
            if now < self._next_start[i]:
                continue
            self._incarnation[i] += 1
            config = dataclasses.replace(
                self.configs[i], seed=self.configs[i].seed + 7919 * self._incarnation[i]
            )
            self.actors[i] = self._spawn(config)
            self._next_start[i] = None
            self._started_at[i] = now
            self.restarts += 1
            restarted.append(config.actor_id)
            log.info("actor %d restarted with seed %d", config.actor_id, config.seed)
        return restarted

    def failing_at_start(self, times: int = START_FAILURES) -> list[tuple[int, int | None]]:
        """(actor id, last exit code) of each actor that died ``times`` times in a row, each time within
        QUICK_DEATH_S of its start: one that cannot start (its env does not build in a fresh process), for
        which waiting and restarting changes nothing."""
        return [
            (config.actor_id, self._exitcodes[i])
            for i, config in enumerate(self.configs)
            if self._quick_deaths[i] >= times and i not in self.finished
        ]

    def all_finished(self) -> bool:
        return len(self.finished) == len(self.actors)

    def pids(self) -> list[int]:
        return [a.pid for a in self.actors if a.pid is not None]

    def stop(self, timeout: float = 5.0) -> None:
        for actor in self.actors:
            if actor.is_alive():
                actor.terminate()
        deadline = time.monotonic() + timeout
        for actor in self.actors:
            actor.join(timeout=max(0.0, deadline - time.monotonic()))
            if actor.is_alive():
                actor.kill()
                actor.join(timeout=1.0)


class ThreadActors:
    """Serial/debug mode (``--in-process``): the same actor loop in threads of this process.

    A thread cannot be restarted like a process: an actor that fails fails the run (``supervise``).
    """

    def __init__(self, configs: list[ActorConfig]) -> None:
        self.configs = list(configs)
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.restarts = 0
        self.errors: list[BaseException] = []
        self.finished: set[int] = set()
        self.refused: set[int] = set()  # ids of actors the learner refused

    def _target(self, i: int, config: ActorConfig) -> None:
        try:
            why = run_actor(config, stop_event=self.stop_event)
            if why in ("learner_gone", "no_weights", "refused"):
                self.finished.add(i)
            if why == "refused":
                self.refused.add(config.actor_id)
        except BaseException as e:  # surfaced by supervise()
            self.errors.append(e)

    def start(self) -> None:
        self.threads = [
            threading.Thread(target=self._target, args=(i, c), name=f"actor-{c.actor_id}", daemon=True)
            for i, c in enumerate(self.configs)
        ]
        for t in self.threads:
            t.start()

    def supervise(self) -> list[int]:
        if self.errors:
            raise RuntimeError(f"in-process actor failed: {self.errors[0]!r}") from self.errors[0]
        return []

    def failing_at_start(self, times: int = START_FAILURES) -> list[tuple[int, int | None]]:
        return []  # a failing thread is raised by supervise

    def all_finished(self) -> bool:
        return len(self.finished) == len(self.threads)

    def pids(self) -> list[int]:
        return []

    def stop(self, timeout: float = 10.0) -> None:
        self.stop_event.set()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
