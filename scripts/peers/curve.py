"""The curve file every peer writes: our columns, one row per report.

    frames,time,mean_return_100

- ``frames``: environment frames, i.e. agent steps x frameskip 4 (as ours counts ``charts/env_frames``);
- ``time``: wall seconds since the command was launched (monitor.py's PEER_T0; the runner's own start
  where it runs without monitor.py);
- ``mean_return_100``: mean undiscounted, unclipped return of the last 100 finished episodes (whole
  games), empty until the first episode ends.

Standard library only: it is imported by the runners inside each peer's own virtualenv.
"""

from __future__ import annotations

import csv
import os
import time
from collections import deque

COLUMNS = ("frames", "time", "mean_return_100")


def launch_time() -> float:
    t0 = os.environ.get("PEER_T0")
    return float(t0) if t0 else time.time()


class CurveWriter:
    """Appends rows (flushed each time, so a run cut at its window keeps every row written)."""

    def __init__(self, path: str, t0: float | None = None, min_interval: float = 0.0) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.t0 = launch_time() if t0 is None else t0
        self.min_interval = min_interval
        self._last = -float("inf")
        self._file = open(path, "w", newline="")
        self._csv = csv.writer(self._file)
        self._csv.writerow(COLUMNS)
        self._file.flush()
        self.returns: deque[float] = deque(maxlen=100)

    def episode(self, ret: float) -> None:
        self.returns.append(float(ret))

    def mean(self) -> float | None:
        return sum(self.returns) / len(self.returns) if self.returns else None

    def row(self, frames: int, mean: float | None = None, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last < self.min_interval:
            return
        self._last = now
        m = self.mean() if mean is None else mean
        self._csv.writerow([int(frames), f"{now - self.t0:.3f}", "" if m is None else f"{m:.4f}"])
        self._file.flush()

    def close(self) -> None:
        self._file.close()
