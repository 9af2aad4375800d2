"""Run metrics: a live console display, TensorBoard scalars and a CSV, from one call.

Keys are grouped by prefix (``losses/``, ``charts/``, ``transport/``,
``popart/``) as CleanRL does. The CSV is wide: its columns are fixed by the
first row written; a later key that was not there is kept in TensorBoard only.
"""

from __future__ import annotations

import csv
import os
import sys
import time
from typing import Mapping

CONSOLE_KEYS = (
    ("charts/env_frames", "frames", "{:,.0f}"),
    ("charts/fps", "frames/s", "{:,.0f}"),
    ("charts/mean_return_100", "return(100)", "{:.2f}"),
    ("charts/episodes", "episodes", "{:.0f}"),
    ("charts/policy_lag", "lag", "{:.1f}"),
    ("transport/queue_depth", "queue", "{:.0f}"),
    ("transport/dropped", "dropped", "{:.0f}"),
    ("losses/total", "loss", "{:.4f}"),
)


class MetricsLogger:
    def __init__(self, logdir: str, *, progress: bool = True, title: str = "training") -> None:
        os.makedirs(logdir, exist_ok=True)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(logdir)
        self.csv_path = os.path.join(logdir, "metrics.csv")
        self._csv_file = None
        self._csv: csv.DictWriter | None = None
        self._fields: list[str] = []
        self.title = title
        self._live = None
        self._start = time.time()
        if progress and sys.stdout.isatty():
            from rich.live import Live

            self._live = Live(self._table({}), refresh_per_second=2, transient=False)
            self._live.start()

    def _table(self, row: Mapping[str, float]):
        from rich.table import Table

        table = Table(title=f"{self.title}  ({time.time() - self._start:,.0f}s)")
        for _, label, _ in CONSOLE_KEYS:
            table.add_column(label, justify="right")
        table.add_row(*[fmt.format(row[k]) if k in row else "-" for k, _, fmt in CONSOLE_KEYS])
        return table

    def log(self, step: int, row: Mapping[str, float]) -> None:
        for key, value in row.items():
            self.writer.add_scalar(key, value, step)
        full = {"step": step, "time": round(time.time() - self._start, 3), **row}
        if self._csv is None:
            exists = os.path.exists(self.csv_path) and os.path.getsize(self.csv_path) > 0
            self._csv_file = open(self.csv_path, "a", newline="")
            if exists:
                with open(self.csv_path) as f:
                    self._fields = next(csv.reader(f))
            else:
                self._fields = list(full)
            self._csv = csv.DictWriter(self._csv_file, fieldnames=self._fields, extrasaction="ignore")
            if not exists:
                self._csv.writeheader()
        self._csv.writerow(full)
        self._csv_file.flush()
        if self._live is not None:
            self._live.update(self._table(row))
        else:
            parts = [f"{label}={fmt.format(row[k])}" for k, label, fmt in CONSOLE_KEYS if k in row]
            print(f"[{self.title}] " + " ".join(parts), flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
        self.writer.close()
        if self._csv_file is not None:
            self._csv_file.close()
