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
    raises it again in the caller (``_lose_tensorboard``, its one warning). Installed once per process: that
    thread's OSError becomes a debug line; every other thread's exception goes to the hook there was."""
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args: Any) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread":
            log.debug("TensorBoard's event writer stopped: %s", args.exc_value)  # the logger says it, once
            return
        previous(args)

    hook.quiets_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


MAX_HELD_ROWS = 100_000  # rows kept in memory while metrics.csv cannot be written (days of a run's rows)
RETRY_S = 30.0  # a writer that failed (TensorBoard's) is made again at most this often


class CsvRows:
    """``metrics.csv``: rows appended in order under one header, widened (the file rewritten once) when a key
    appears that earlier rows lack. A write that fails (a full disk) never reaches the caller: the file is cut
    back to its last whole row, the rows are held in memory (up to :data:`MAX_HELD_ROWS`, the oldest given up
    beyond that, and said) and written with the next row that can be, with one warning per outage."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fields: list[str] = []  # read from an existing file (a resumed run appends under its header)
        self.on_disk: list[str] | None = None  # the header the file has, once known
        self.held: list[dict[str, Any]] = []
        self.given_up = 0  # rows dropped from memory during a long outage
        self.failing: str | None = None  # why the last write failed, while it does

    def add(self, row: Mapping[str, Any]) -> None:
        """Append ``row`` (now, or once the disk takes it)."""
        self.held.append(dict(row))
        if len(self.held) > MAX_HELD_ROWS:
            del self.held[0]
            self.given_up += 1
        self.flush()

    def flush(self) -> None:
        """Write the held rows; on failure keep them for the next call."""
        if not self.held:
            return
        try:
            self._write()
        except OSError as e:
            reason = e.strerror or str(e)
            if self.failing is None:
                log.warning(
                    "metrics.csv cannot be written (%s): its rows are kept in memory and written when it can "
                    "be; training goes on",
                    reason,
                )
            self.failing = reason
            return
        if self.failing is not None:
            log.info("metrics.csv is written again (the rows held meanwhile included)")
            self.failing = None
        if self.given_up:
            log.warning(
                "metrics.csv: %d rows of the outage were given up (more than %d were held)",
                self.given_up,
                MAX_HELD_ROWS,
            )
            self.given_up = 0

    def _write(self) -> None:
        if self.on_disk is None:
            self.on_disk = self._header()
            self.fields = self.fields or list(self.on_disk)
        for key in ("step", "time"):
            if key not in self.fields:
                self.fields.insert(0 if key == "step" else 1, key)
        for row in self.held:
            self.fields += [k for k in row if k not in self.fields]
        if self.fields != self.on_disk:
            self._rewrite()
        else:
            self._append()
        self.held = []

    def _header(self) -> list[str]:
        if not (os.path.exists(self.path) and os.path.getsize(self.path) > 0):
            return []
        with open(self.path, newline="") as f:
            return next(csv.reader(f), [])

    def _append(self) -> None:
        size = os.path.getsize(self.path)
        try:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=self.fields, restval="").writerows(self.held)
        except OSError:
            os.truncate(self.path, size)  # no half row: the held rows are written whole next time
            raise

    def _rewrite(self) -> None:
        """The file under the wider header, the held rows after the old ones (a temporary file renamed over
        it, so a failure leaves the old file as it was)."""
        rows: list[dict[str, str]] = []
        if self.on_disk:
            with open(self.path, newline="") as f:
                rows = list(csv.DictReader(f))
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=self.fields, restval="")
                w.writeheader()
                w.writerows(rows)
                w.writerows(self.held)
            os.replace(tmp, self.path)
        except OSError:
            try:
                os.remove(tmp)
            except OSError:
                pass
            raise
        self.on_disk = list(self.fields)


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
        self.logdir = logdir
        self.writer: Any = None
        self._writer_lost_at: float | None = None  # when TensorBoard's writer failed (made again later)
        try:
            self.writer = SummaryWriter(logdir, purge_step=purge)
        except OSError as e:
            self._lose_tensorboard(e)
        self._config_text: str | None = None  # config.yaml's text until it is written
        self._config_failing = False
        if config_record:
            self._record_config(logdir, config_record)
        self.csv_path = os.path.join(logdir, "metrics.csv")
        self._rows = CsvRows(self.csv_path)
        if resumed_at_step is not None:
            try:
                self._drop_rows_after(resumed_at_step)
            except OSError as e:
                log.warning(
                    "metrics.csv: the rows after the checkpoint could not be dropped (%s)", e.strerror or e
                )
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
        self._config_text = text
        self._write_config()
        if self.writer is not None:
            try:
                self.writer.add_text("config", "```\n" + text + "```", 0)
            except OSError as e:
                self._lose_tensorboard(e)
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

    def _write_config(self) -> None:
        """config.yaml, atomically (a temporary file renamed over it); on a failing disk it is written with a
        later row, with one warning."""
        if self._config_text is None:
            return
        try:
            atomic_write_text(os.path.join(self.logdir, "config.yaml"), self._config_text)
        except OSError as e:
            if not self._config_failing:
                log.warning("config.yaml cannot be written (%s): written when it can be", e.strerror or e)
            self._config_failing = True
            return
        self._config_text, self._config_failing = None, False

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
        self._write_config()
        self._retry_tensorboard()
        if self.writer is not None:
            try:
                for key, value in row.items():
                    self.writer.add_scalar(key, value, step)
            except OSError as e:
                self._lose_tensorboard(e)
        if self.tracker is not None:
            self.tracker.log(step, row)
        self._rows.add({"step": step, "time": round(time.time() - self._start, 3), **row})
        if self._live is not None:
            self._live.update(self._table(row))
        else:
            unit, done, eta = self.progress_cells(row)
            parts = [f"{unit}={done}", f"eta={eta}"]
            parts += [f"{label}={_cell(fmt, row[k])}" for k, label, fmt in CONSOLE_KEYS if k in row]
            tasks = task_returns_text(row)
            print(f"[{self.title}] " + " ".join(parts) + (f" | {tasks}" if tasks else ""), flush=True)

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

    def _lose_tensorboard(self, error: OSError) -> None:
        """TensorBoard's writer thread failed (a full disk, say): it raises that error on every later call, so
        it is closed here, with one warning per outage, and made again (a new events file) at most every
        :data:`RETRY_S` seconds; training and metrics.csv go on, and metrics.csv holds the outage's rows."""
        if self._writer_lost_at is None:
            log.warning(
                "TensorBoard events in %s are not written while this lasts (%s: %s); training goes on, "
                "metrics.csv keeps the curve",
                self.logdir,
                type(error).__name__,
                error.strerror or error,
            )
        self._writer_lost_at = time.monotonic()
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception:  # noqa: BLE001 - its thread already failed; nothing more to save from it
                pass

    def _retry_tensorboard(self) -> None:
        if self._writer_lost_at is None or time.monotonic() - self._writer_lost_at < RETRY_S:
            return
        from torch.utils.tensorboard import SummaryWriter

        try:
            self.writer = SummaryWriter(self.logdir)
            self.writer.flush()
        except OSError as e:
            self.writer = None
            self._writer_lost_at = time.monotonic()
            log.debug("TensorBoard's writer still cannot start: %s", e)
            return
        self._writer_lost_at = None
        log.info(
            "TensorBoard events in %s are written again (a new events file; metrics.csv has the gap)",
            self.logdir,
        )

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
        self._write_config()
        self._rows.flush()
        if self._rows.held:
            log.warning(
                "metrics.csv: its last %d rows could not be written (%s)",
                len(self._rows.held),
                self._rows.failing,
            )


def atomic_write_text(path: str, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file beside it, renamed over it."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def _flatten(record: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(record, dict):
        return [item for key, value in record.items() for item in _flatten(value, f"{prefix}{key}.")]
    return [(prefix[:-1], record)]
