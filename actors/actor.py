"""The actor process: builds its environments in ``run()``, streams unrolls to the learner.

``Actor.__init__`` runs in the parent and stores only a picklable
``ActorConfig`` (``actors.loop``: an ``EnvSpec``, endpoints, seeds). The environments are built
inside ``run()``, in the child, so no env object ever crosses a process
boundary (an env pickled into a worker is how Pong once lost its frame skip; docs/FRAMESKIP.md).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys

import torch

from actors.loop import LEARNER_GONE_EXIT, REFUSED_EXIT, ActorConfig, run_actor
from impala.run.cpus import pin_process


def _unwind_once(signum: int, frame: object) -> None:
    """SIGTERM in an actor: unwind through ``run_actor``'s cleanup, once; a second SIGTERM during that cleanup
    (or during the interpreter's exit) is ignored rather than raised inside it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(0)


class Actor(multiprocessing.Process):
    """One actor process. Holds only its config until ``run()``."""

    def __init__(self, config: ActorConfig, *, start_method: str = "spawn") -> None:
        super().__init__(name=f"actor-{config.actor_id}", daemon=True)
        self.config = config
        # The start method is chosen per actor, not through the global default:
        # Process.start() calls self._Popen, so take the chosen context's launcher.
        self._Popen = multiprocessing.get_context(start_method).Process._Popen

    def run(self) -> None:  # runs in the child
        # Ctrl-C goes to the whole process group; the learner owns shutdown and terminates us.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # The pool stops actors with SIGTERM: unwind (not die) so run_actor's finally closes the
        # envs; a Unity player would otherwise outlive its actor.
        signal.signal(signal.SIGTERM, _unwind_once)
        if self.config.cpus:  # spawned from a learner pinned to its own CPUs: move to the actors'
            pin_process(self.config.cpus)
        if self.config.nice:  # below the learner: it takes a core first when both are runnable
            os.nice(self.config.nice)
        torch.set_num_threads(1)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s actor-%(process)d %(message)s")
        why = run_actor(self.config, parent_pid=os.getppid())
        # Exiting from here on: a SIGTERM now (the pool stopping its actors) must not raise SystemExit inside
        # multiprocessing's atexit callbacks ("Exception ignored in atexit callback ... SystemExit: 0").
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if why == "learner_gone":
            sys.exit(LEARNER_GONE_EXIT)  # the pool does not restart an actor whose learner is gone
        if why == "refused":
            sys.exit(REFUSED_EXIT)  # nor one the learner refused (it logged why)
