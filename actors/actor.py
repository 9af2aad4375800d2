"""The actor process: builds its environments in ``run()``, streams unrolls to the learner.

``Actor.__init__`` runs in the parent and stores only a picklable
``ActorConfig`` (an ``EnvSpec``, endpoints, seeds). The environments are built
inside ``run()``, in the child, so no env object ever crosses a process
boundary (SEEDS.md part 1: that is how Pong lost its frame skip).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

from impala.envs import EnvSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActorConfig:
    """Everything a child needs, as plain picklable data.

    actor_id: this actor's index (also its Unity ``worker_id``).
    env: what to build inside ``run()``.
    num_envs: envs stepped together with one batched forward pass.
    unroll_length: steps per env per unroll (T).
    trajectory_endpoint / params_endpoint: the learner's ZeroMQ endpoints.
    agent: which agent adapter to use ("impala" or "ppo") and its settings.
    seed: base seed of this incarnation (restarts get a new one).
    fingerprint_steps: random steps used to measure the env fingerprint.
    """

    actor_id: int
    env: EnvSpec
    num_envs: int
    unroll_length: int
    trajectory_endpoint: str
    params_endpoint: str
    agent: dict[str, Any]
    seed: int = 0
    fingerprint_steps: int = 300
    send_hwm: int = 2
    params_timeout_s: float = 120.0
    curve: Any = None  # impala.curve.ClientKeys when the learner requires CURVE
    learner_timeout_s: float = 60.0  # no weights heartbeat for this long: the learner is gone, exit


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
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
        import torch

        torch.set_num_threads(1)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s actor-%(process)d %(message)s")
        from actors.loop import LEARNER_GONE_EXIT, run_actor

        if run_actor(self.config, parent_pid=os.getppid()) == "learner_gone":
            sys.exit(LEARNER_GONE_EXIT)  # the pool does not restart an actor whose learner is gone


def exit_if_orphaned(parent_pid: int) -> None:
    """Actors must not outlive their learner (it may have been SIGKILLed)."""
    if os.getppid() != parent_pid:
        log.warning("learner process %d is gone; actor exiting", parent_pid)
        raise SystemExit(0)  # unwinds through run_actor's finally, which closes the envs
