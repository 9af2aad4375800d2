"""Run metrics: a live console display, TensorBoard scalars and a CSV, from one call.

Keys are grouped by prefix (``losses/``, ``charts/``, ``transport/``,
``popart/``) as CleanRL does. The CSV is wide; when a key appears that
earlier rows lack, the file is rewritten once with the wider header.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import sys
import time
from typing import Any, Mapping

# The console log line of every entry point.
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"

log = logging.getLogger(__name__)


def log_this_one(count: int, first: int = 20, every: int = 1000) -> bool:
    """Throttle for log lines a peer can trigger: the first ``first`` occurrences, then every
    ``every``-th, so a flood of bad messages cannot flood the log too."""
    return count <= first or count % every == 0


CONSOLE_KEYS = (
    ("charts/env_frames", "frames", "{:,.0f}"),
    ("charts/fps", "frames/s", "{:,.0f}"),
    ("charts/mean_return_100", "return(100)", "{:.2f}"),
    ("charts/episodes", "episodes", "{:.0f}"),
    ("charts/policy_lag", "lag", "{:.1f}"),
    ("transport/queue_depth", "queue", "{:.0f}"),
    ("transport/dropped", "dropped", "{:.0f}"),
    ("losses/entropy", "entropy", "{:.3f}"),
    ("losses/grad_norm", "grad", "{:.3g}"),
)


def task_returns_text(row: Mapping[str, float]) -> str:
    """A multi-task run's returns (last 100 episodes) per task, and the median human-normalized score."""
    parts = [f"{k[len('tasks/'):-len('/mean_return_100')]}={v:.2f}" for k, v in row.items()
             if k.startswith("tasks/") and k.endswith("/mean_return_100")]
    if "tasks/median_human_normalized" in row:
        parts.append(f"median human-normalized={row['tasks/median_human_normalized']:.3f}")
    return " ".join(parts)


class MetricsLogger:
    """One call logs a row to the console display, TensorBoard, ``metrics.csv`` and a tracker."""
    def __init__(self, logdir: str, *, progress: bool = True, title: str = "training", tracker: Any = None,
                 time_offset_s: float = 0.0, config_record: Mapping[str, Any] | None = None) -> None:
        """``tracker``: an optional experiment tracker (``impala.run.tracking.WandbTracker``) that gets every row too.
        ``time_offset_s``: wall time of the runs this one resumes, so the ``time`` column stays monotone.
        ``config_record``: the run's resolved settings, written to ``LOGDIR/config.yaml``, TensorBoard (text) and
        the log, so a person can read what ran."""
        os.makedirs(logdir, exist_ok=True)
        self.tracker = tracker
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(logdir)
        if config_record:
            self._record_config(logdir, config_record)
        self.csv_path = os.path.join(logdir, "metrics.csv")
        self._csv_file = None
        self._csv: csv.DictWriter | None = None
        self._fields: list[str] = ["step", "time"]
        self.title = title
        self._live = None
        self._start = time.time() - time_offset_s
        if progress and sys.stdout.isatty():
            from rich.live import Live

            self._live = Live(self._table({}), refresh_per_second=2, transient=False)
            self._live.start()

    def _record_config(self, logdir: str, record: Mapping[str, Any]) -> None:
        import yaml

        plain = json.loads(json.dumps(record, default=str))  # tuples -> lists, anything else -> its text
        text = yaml.safe_dump(plain, sort_keys=False, default_flow_style=False)
        with open(os.path.join(logdir, "config.yaml"), "w") as f:
            f.write(text)
        self.writer.add_text("config", "```\n" + text + "```", 0)
        flat = [f"{key}={value}" for key, value in _flatten(plain)]
        lines, line = [], ""
        for item in flat:  # a compact block: key=value pairs, about 110 characters a line
            if line and len(line) + len(item) > 108:
                lines.append(line)
                line = ""
            line = f"{line}  {item}" if line else item
        log.info("config (also in %s):\n  %s", os.path.join(logdir, "config.yaml"), "\n  ".join(lines + [line]))

    def _table(self, row: Mapping[str, float]):
        from rich.table import Table

        table = Table(title=f"{self.title}  ({time.time() - self._start:,.0f}s)")
        for _, label, _ in CONSOLE_KEYS:
            table.add_column(label, justify="right")
        cells = [fmt.format(row[k]) if k in row else "-" for k, _, fmt in CONSOLE_KEYS]
        tasks = task_returns_text(row)
        if tasks:
            table.add_column("per task", justify="left")
            cells.append(tasks)
        table.add_row(*cells)
        return table

    def log(self, step: int, row: Mapping[str, float]) -> None:
        for key, value in row.items():
            self.writer.add_scalar(key, value, step)
        if self.tracker is not None:
            self.tracker.log(step, row)
        full = {"step": step, "time": round(time.time() - self._start, 3), **row}
        if self._csv is None:
            self._open_csv()
        if any(k not in self._fields for k in full):
            self._widen_csv([k for k in full if k not in self._fields])
        self._csv.writerow(full)
        self._csv_file.flush()
        if self._live is not None:
            self._live.update(self._table(row))
        else:
            parts = [f"{label}={fmt.format(row[k])}" for k, label, fmt in CONSOLE_KEYS if k in row]
            tasks = task_returns_text(row)
            print(f"[{self.title}] " + " ".join(parts) + (f" | {tasks}" if tasks else ""), flush=True)

    def _open_csv(self) -> None:
        exists = os.path.exists(self.csv_path) and os.path.getsize(self.csv_path) > 0
        if exists:  # a resumed run appends under the existing header
            with open(self.csv_path, newline="") as f:
                self._fields = next(csv.reader(f))
        self._csv_file = open(self.csv_path, "a", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=self._fields, restval="")
        if not exists:
            self._csv.writeheader()

    def _widen_csv(self, new_keys: list[str]) -> None:
        """A key not seen before: rewrite the file once with the wider header (rare, small)."""
        self._csv_file.close()
        with open(self.csv_path, newline="") as f:
            rows = list(csv.DictReader(f))
        self._fields = self._fields + new_keys
        tmp = self.csv_path + ".tmp"
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self._fields, restval="")
            w.writeheader()
            w.writerows(rows)
        os.replace(tmp, self.csv_path)
        self._csv_file = open(self.csv_path, "a", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=self._fields, restval="")

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
        self.writer.close()
        if self.tracker is not None:
            self.tracker.close()
        if self._csv_file is not None:
            self._csv_file.close()


def _flatten(record: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(record, dict):
        return [item for key, value in record.items() for item in _flatten(value, f"{prefix}{key}.")]
    return [(prefix[:-1], record)]
