"""The fingerprint guard: no actor trains the learner on other dynamics than the env it probed.

Every actor measures its env (frame skip, sticky actions, action count, observation shape, episode
limit) and sends that fingerprint in its hello (a multi-task actor: one per game its envs play);
:meth:`FingerprintGuard.on_hello` compares it with the learner's own measurement of the actor's tasks.
Ids below ``--workers`` belong to this learner's own actors: only they know the run's local token, so a
peer that merely reaches the port cannot pose as one. A refused *local* actor means the run itself is
misconfigured and stops it before training (:meth:`check`); any other refused hello is only kept out, its
data dropped and counted.
"""

from __future__ import annotations

import hmac
import secrets
from typing import Any, Mapping, Sequence

from impala.envs.fingerprint import EnvFingerprint, FingerprintMismatchError, compare_fingerprints
from impala.envs.probe import EnvInfo
from impala.transport.messages import deal_task


class FingerprintGuard:
    """Judges hellos against the tasks' probed envs (a multi-task run deals its tasks over the actors'
    ``envs_per_worker`` envs, :func:`impala.transport.messages.deal_task`)."""

    def __init__(self, tasks: Sequence[EnvInfo], local_workers: int, envs_per_worker: int = 1) -> None:
        self.tasks = tuple(tasks)
        self.local_workers = local_workers
        self.envs_per_worker = envs_per_worker
        self.local_token = secrets.token_hex(16)  # handed to the local actors at spawn
        self.verified_local: set[int] = set()  # local ids whose hello carried the token
        self.local_refusals: dict[int, str] = {}  # verified local actors whose env differs

    def on_hello(self, actor: int, info: Mapping[str, Any]) -> str | None:
        """None to accept the actor, else the reason it is refused (the server's ``on_hello``)."""
        local = 0 <= actor < self.local_workers
        if local:
            token = info.get("local_token")
            if not (isinstance(token, str) and hmac.compare_digest(token, self.local_token)):
                return (
                    f"actor id {actor} is reserved for this learner's local actors and the hello has no "
                    "valid local token"
                )
        reason = self.problem(info, actor)
        if local:
            self.verified_local.add(actor)
            if reason is not None:
                self.local_refusals[actor] = reason
        return reason

    def actor_tasks(self, actor: int) -> list[int]:
        """The tasks actor ``actor``'s envs play, each once, in task order."""
        n, k = len(self.tasks), self.envs_per_worker
        return sorted({deal_task(actor, env, k, n) for env in range(k)})

    def problem(self, info: Mapping[str, Any], actor: int) -> str | None:
        """What differs between the hello's fingerprints and the actor's tasks, or None."""
        if len(self.tasks) == 1:
            return self._compare(0, info.get("fingerprint"))
        raw = info.get("task_fingerprints")
        if not isinstance(raw, list) or len(raw) > len(self.tasks):
            raw = []
        theirs = {
            row[0]: row[1] for row in raw if isinstance(row, list) and len(row) == 2 and type(row[0]) is int
        }
        for task in self.actor_tasks(actor):
            if self.tasks[task].fingerprint is None:
                continue
            if task not in theirs:
                return f"hello carries no env fingerprint for task {task} ({self.tasks[task].spec.id})"
            reason = self._compare(task, theirs[task])
            if reason is not None:
                return f"task {task} ({self.tasks[task].spec.id}): {reason}"
        return None

    def _compare(self, task: int, raw: Any) -> str | None:
        reference = self.tasks[task].fingerprint
        if reference is None:  # an env the learner could not fingerprint (nothing to compare)
            return None
        if not isinstance(raw, dict):
            return "hello carries no env fingerprint"
        try:
            theirs = EnvFingerprint.from_dict(raw)
        except (TypeError, ValueError) as e:
            return f"malformed fingerprint: {e}"
        problems = compare_fingerprints(reference, theirs)
        return "; ".join(str(p) for p in problems) or None

    def check(self) -> None:
        """Raise :class:`FingerprintMismatchError` if a verified local actor's env differs."""
        if self.local_refusals:
            actor, reason = next(iter(self.local_refusals.items()))
            raise FingerprintMismatchError(
                f"actor {actor}'s environment differs from the learner's: {reason}. Refusing to train on "
                "different dynamics."
            )
