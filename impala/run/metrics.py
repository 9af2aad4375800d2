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
import threading
import time
from typing import Any, Mapping

# The console log line of every entry point.
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"

log = logging.getLogger(__name__)


def log_this_one(count: int, first: int = 20, every: int = 1000) -> bool:
    """Throttle for log lines a peer can trigger: the first ``first`` occurrences, then every
    ``every``-th, so a flood of bad messages cannot flood the log too."""
    return count <= first or count % every == 0


def compact(x: float) -> str:
    """A count in at most 5 characters plus a sign (``950``, ``12.3k``, ``456k``, ``4.5M``, ``1.2G``): the
    display fits 80 columns."""
    if abs(x) < 999.5:
        return f"{x:.0f}"
    for size, unit in ((1e3, "k"), (1e6, "M"), (1e9, "G")):
        v = x / size
        if abs(v) < 99.95:
            return f"{v:.1f}{unit}"
        if abs(v) < 999.5:
            return f"{v:.0f}{unit}"
    return f"{x / 1e12:.0f}T"


def short(x: float) -> str:
    """A float in at most 7 characters or so: 3 significant digits, a compact count from 1000 on."""
    if abs(x) >= 999.5:
        return compact(x)
    if x == 0 or abs(x) >= 0.01 or x != x:
        return f"{x:.3g}"
    return f"{x:.1e}"


def one_decimal(x: float) -> str:
    """A return or lag: one decimal up to 1000, a compact count from there (at most 7 characters)."""
    return f"{x:.1f}" if abs(x) < 1000 else compact(x)


def duration(seconds: float) -> str:
    """``45s``, ``12m05s``, ``3h20m``, ``2d04h``: an ETA in at most 6 characters."""
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h" if s < 100 * 86400 else ">99d"


# (key, column label, format) of the console display after the progress and ETA columns; every cell is at
# most 7 characters, so that the table fits an 80-column terminal. Both launchers log these names.
CONSOLE_KEYS = (
    ("charts/fps", "fps", compact),
    ("charts/mean_return_100", "return", one_decimal),
    ("charts/episodes", "episodes", compact),
    ("charts/policy_lag", "lag", one_decimal),
    ("transport/queue_depth", "queue", compact),
    ("transport/dropped", "dropped", compact),
    ("losses/entropy", "entropy", short),
    ("losses/grad_norm", "grad", short),
)


def _cell(fmt: Any, value: float) -> str:
    return fmt(value) if callable(fmt) else fmt.format(value)


def run_budget(record: Mapping[str, Any] | None) -> tuple[str, str, float] | None:
    """(counter key, unit, total) of a run's step budget, read from its resolved settings (launch_impala's
    flat record, or launch_ppo's ``run`` section): ``total_frames`` counts env frames, ``total_steps`` agent
    steps. None when the record names no budget."""
    if not record:
        return None
    for section in (record, record.get("run")):
        if isinstance(section, Mapping):
            for name, key, unit in (
                ("total_frames", "charts/env_frames", "frames"),
                ("total_steps", "charts/agent_steps", "steps"),
            ):
                total = section.get(name)
                if isinstance(total, (int, float)) and not isinstance(total, bool) and total > 0:
                    return key, unit, float(total)
    return None


def task_returns_text(row: Mapping[str, float]) -> str:
    """A multi-task run's returns (last 100 episodes) per task, and the median human-normalized score."""
    parts = [
        f"{k[len('tasks/') : -len('/mean_return_100')]}={v:.2f}"
        for k, v in row.items()
        if k.startswith("tasks/") and k.endswith("/mean_return_100")
    ]
    if "tasks/median_human_normalized" in row:
        parts.append(f"median human-normalized={row['tasks/median_human_normalized']:.3f}")
    return " ".join(parts)


def _quiet_tensorboard_writer_thread() -> None:
    """TensorBoard's event-writer thread ends by re-raising an OSError it met (a full disk), and Python's
    default hook prints that traceback in the run's console; MetricsLogger handles the error when the writer
    raises it again in the caller (``_lose_tensorboard``). Installed once per process: that thread's OSError
    becomes one warning line; every other thread's exception goes to the hook there was."""
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args: Any) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread":
            log.warning("TensorBoard's event writer stopped: %s", args.exc_value)
            return
        previous(args)

    hook.quiets_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class MetricsLogger:
    """One call logs a row to the console display, TensorBoard, ``metrics.csv`` and a tracker."""

    def __init__(
        self,
        logdir: str,
        *,
        progress: bool = True,
        title: str = "training",
        tracker: Any = None,
        time_offset_s: float = 0.0,
        config_record: Mapping[str, Any] | None = None,
        resumed_at_step: int | None = None,
    ) -> None:
        """``tracker``: an optional experiment tracker (``impala.run.tracking.WandbTracker``) that gets every
        row too.
        ``time_offset_s``: wall time of the runs this one resumes, so the ``time`` column stays monotone.
        ``config_record``: the run's resolved settings, written to ``LOGDIR/config.yaml``, TensorBoard (text)
        and
        the log, so a person can read what ran.
        ``resumed_at_step``: the step of the checkpoint a resumed run starts from. The rows the earlier run
        logged after it (between its last checkpoint and its end) describe training that is redone: they
        are dropped from ``metrics.csv`` and purged from TensorBoard's view, so every curve has one value
        per step and its steps only go forward."""
        os.makedirs(logdir, exist_ok=True)
        self.tracker = tracker
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resumed_at_step is None else resumed_at_step + 1
        _quiet_tensorboard_writer_thread()
        self.writer = SummaryWriter(logdir, purge_step=purge)
        if config_record:
            self._record_config(logdir, config_record)
        self.csv_path = os.path.join(logdir, "metrics.csv")
        self._csv_file = None
        self._csv: csv.DictWriter | None = None
        self._fields: list[str] = ["step", "time"]
        if resumed_at_step is not None:
            self._drop_rows_after(resumed_at_step)
        self.title = title
        self._live = None
        self._start = time.time() - time_offset_s
        self.budget = run_budget(config_record)
        # (time, count) of this session's first row: the ETA's rate is measured from there
        self._first: tuple[float, float] | None = None
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
        log.info(
            "config (also in %s):\n  %s", os.path.join(logdir, "config.yaml"), "\n  ".join(lines + [line])
        )

    def progress_cells(self, row: Mapping[str, float], now: float | None = None) -> tuple[str, str, str]:
        """(label, "done/total", ETA) of the step budget: frames (or agent steps) so far over the run's total,
        and the time left at this session's rate ("-" until two rows have been seen, or without a budget)."""
        now = time.time() if now is None else now
        if self.budget is None:
            count = row.get("charts/env_frames")
            return "frames", "-" if count is None else compact(count), "-"
        key, unit, total = self.budget
        if key not in row:
            return unit, f"-/{compact(total)}", "-"
        count = float(row[key])
        if self._first is None:
            self._first = (now, count)
        t0, c0 = self._first
        rate = (count - c0) / (now - t0) if now > t0 else 0.0
        eta = "done" if count >= total else duration((total - count) / rate) if rate > 0 else "-"
        return unit, f"{compact(count)}/{compact(total)}", eta

    def _table(self, row: Mapping[str, float], now: float | None = None):
        """The live display: the title and elapsed time, then one row of cells (80 columns wide at most)."""
        from rich import box
        from rich.table import Table

        now = time.time() if now is None else now
        # one space between columns and none at the edges: 10 columns of up to 10 characters in 80
        table = Table(
            title=f"{self.title}  ({duration(now - self._start)})",
            box=box.SIMPLE_HEAD,
            padding=0,
            show_edge=False,
        )
        unit, done, eta = self.progress_cells(row, now)
        table.add_column(unit, justify="right", no_wrap=True)
        table.add_column("ETA", justify="right", no_wrap=True)
        for _, label, _ in CONSOLE_KEYS:
            table.add_column(label, justify="right", no_wrap=True)
        table.add_row(done, eta, *[_cell(fmt, row[k]) if k in row else "-" for k, _, fmt in CONSOLE_KEYS])
        tasks = task_returns_text(row)
        if tasks:  # below the row, wrapped to the table's width, not as a column that would widen it
            table.caption, table.caption_justify = tasks, "left"
        return table

    def log(self, step: int, row: Mapping[str, float]) -> None:
        if self.writer is not None:
            try:
                for key, value in row.items():
                    self.writer.add_scalar(key, value, step)
            except OSError as e:
                self._lose_tensorboard(e)
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
            unit, done, eta = self.progress_cells(row)
            parts = [f"{unit}={done}", f"eta={eta}"]
            parts += [f"{label}={_cell(fmt, row[k])}" for k, label, fmt in CONSOLE_KEYS if k in row]
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

    def _drop_rows_after(self, step: int) -> None:
        """Rewrite ``metrics.csv`` without its rows past ``step`` (atomically; nothing to do if none)."""
        if not os.path.exists(self.csv_path):
            return
        with open(self.csv_path, newline="") as f:
            reader = csv.DictReader(f)
            fields, rows = reader.fieldnames, list(reader)

        def after(row: Mapping[str, str]) -> bool:
            try:
                return float(row.get("step") or "nan") > step
            except ValueError:  # a row this program did not write: kept as it is
                return False

        kept = [r for r in rows if not after(r)]
        if not fields or len(kept) == len(rows):
            return
        self._rewrite_csv(list(fields), kept)
        log.info(
            "metrics.csv: %d rows logged after the checkpoint (step %d) dropped; the resumed run logs "
            "those steps again",
            len(rows) - len(kept),
            step,
        )

    def _rewrite_csv(self, fields: list[str], rows: list[dict[str, str]]) -> None:
        """Replace ``metrics.csv`` with ``rows`` under ``fields`` (a temporary file renamed over it)."""
        tmp = self.csv_path + ".tmp"
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields, restval="")
            w.writeheader()
            w.writerows(rows)
        os.replace(tmp, self.csv_path)

    def _widen_csv(self, new_keys: list[str]) -> None:
        """A key not seen before: rewrite the file once with the wider header (rare, small)."""
        self._csv_file.close()
        with open(self.csv_path, newline="") as f:
            rows = list(csv.DictReader(f))
        self._fields = self._fields + new_keys
        self._rewrite_csv(self._fields, rows)
        self._csv_file = open(self.csv_path, "a", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=self._fields, restval="")

    def _lose_tensorboard(self, error: OSError) -> None:
        """TensorBoard's writer thread failed (a full disk, say): it raises that error on every later call,
        so its events stop here, with one warning; training, metrics.csv and the checkpoints go on."""
        log.warning(
            "TensorBoard events in %s are not written from here on (%s: %s); training goes on, metrics.csv "
            "keeps the curve",
            self.csv_path.rsplit(os.sep, 1)[0],
            type(error).__name__,
            error.strerror or error,
        )
        self.writer = None

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError as e:
                self._lose_tensorboard(e)
        if self.tracker is not None:
            self.tracker.close()
        if self._csv_file is not None:
            self._csv_file.close()


def _flatten(record: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(record, dict):
        return [item for key, value in record.items() for item in _flatten(value, f"{prefix}{key}.")]
    return [(prefix[:-1], record)]
