"""When a run ends: its step budget (env frames or agent steps), ``--max-seconds`` and
``--stop-at-return``."""

from __future__ import annotations

import logging
import time

from impala.options import ConfigError
from impala.run.config import RunConfig

log = logging.getLogger(__name__)


class Budget:
    """A run's limits, read from :class:`RunConfig`; the clock starts at construction."""

    def __init__(self, config: RunConfig) -> None:
        if config.total_frames is None and config.total_steps is None:
            raise ConfigError("the run needs a budget: --total-frames or --total-steps")
        self.total_frames, self.total_steps = config.total_frames, config.total_steps
        self.max_seconds, self.stop_at_return = config.max_seconds, config.stop_at_return
        self.start = time.monotonic()
        self.reached_return = False

    def spent(self, env_frames: int, agent_steps: int) -> bool:
        """The step budget is used up (``--total-frames`` / ``--total-steps``, absolute also after a
        resume)."""
        return (self.total_frames is not None and env_frames >= self.total_frames) or (
            self.total_steps is not None and agent_steps >= self.total_steps
        )

    def out_of_time(self) -> bool:
        return bool(self.max_seconds) and time.monotonic() - self.start > self.max_seconds

    def return_reached(self, mean_return_100: float | None) -> bool:
        """``--stop-at-return``: the mean of the last 100 episodes (None until there are 100) reached it."""
        if self.stop_at_return is None or mean_return_100 is None or mean_return_100 < self.stop_at_return:
            return False
        log.info(
            "mean return of the last 100 episodes %.2f reached --stop-at-return %g",
            mean_return_100,
            self.stop_at_return,
        )
        self.reached_return = True
        return True
