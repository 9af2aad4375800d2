"""The one orphan watchdog: a child process (an actor, a learner-group follower) must never outlive the
process that started it, which may have been SIGKILLed and so could not stop it.

Two ways to act on the same test (the parent pid changed: the child was re-parented):
:func:`exit_if_orphaned` for loops that poll (an actor unwinds through its ``finally`` and closes its
envs), :func:`exit_when_orphaned` for processes that block where no poll runs (a follower inside a
collective: the kernel kills it with its parent).
"""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger(__name__)


def orphaned(parent_pid: int) -> bool:
    """The process that started this one is gone."""
    return os.getppid() != parent_pid


def exit_if_orphaned(parent_pid: int) -> None:
    """For polling loops: raise ``SystemExit(0)`` if the parent is gone, so ``finally`` blocks run."""
    if orphaned(parent_pid):
        log.warning("parent process %d is gone; exiting", parent_pid)
        raise SystemExit(0)


def exit_when_orphaned(parent_pid: int, every_s: float = 2.0) -> None:
    """For processes that block: exit as soon as the parent dies.

    On Linux the kernel kills this process with its parent (PR_SET_PDEATHSIG): a thread cannot be relied
    on while a collective blocks. Elsewhere a watch thread checks the parent every ``every_s``."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0:  # PR_SET_PDEATHSIG
            if orphaned(parent_pid):  # the parent died before the call
                os._exit(0)
            return
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while True:
            if orphaned(parent_pid):
                log.warning("parent process %d is gone; exiting", parent_pid)
                os._exit(0)
            time.sleep(every_s)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()
