"""What both launchers end with: :func:`console_main` (a launch's outcome as one console line and an exit
status) and :func:`ending` (the end of their done lines)."""

from __future__ import annotations

from typing import Callable

from impala.options import fail
from impala.run.config import RunConfig
from learner.run.runtime import LaunchError, Outcome, RunResult

DoneLine = Callable[[RunConfig, RunResult], str]


def console_main(prog: str, start: Callable[[], Outcome | int], done_line: DoneLine) -> int:
    """A launcher's ``main``: run ``start``; a :class:`LaunchError` is one line on stderr and its status, a
    run that was finished already its note, a run that trained its done line. ``start`` may return an exit
    status instead of an outcome (a learner rank of a group across hosts, which reports for itself)."""
    try:
        outcome = start()
    except LaunchError as e:
        fail(prog, e)
        return e.status
    if isinstance(outcome, int):
        return outcome
    if outcome.result is None:
        print(f"{prog}: {outcome.note}", flush=True)
    else:
        print(done_line(outcome.config, outcome.result), flush=True)
    return 0


def ending(config: RunConfig, result: RunResult) -> str:
    """The end of both launchers' done lines: where the checkpoint is, or why there is none, and what stopped
    the run early."""
    if result.checkpoint:
        saved = f"checkpoint {result.checkpoint}"
    else:
        why = "nothing trained" if not result.updates else "see the warnings above"
        saved = f"no checkpoint written ({why})"
    return (
        saved
        + (" (interrupted)" if result.interrupted else "")
        + (f" (stopped at --stop-at-return {config.stop_at_return:g})" if result.reached_return else "")
    )
