"""The fingerprint guard: no actor trains the learner on other dynamics than the env it probed.

Every actor measures its env (frame skip, sticky actions, action count, observation shape, episode
limit) and sends that fingerprint in its hello; :meth:`FingerprintGuard.on_hello` compares it with the
learner's own measurement of the actor's task. Ids below ``--workers`` belong to this learner's own
actors: only they know the run's local token, so a peer that merely reaches the port cannot pose as
one. A refused *local* actor means the run itself is misconfigured and stops it before training
(:meth:`check`); any other refused hello is only kept out, its data dropped and counted.
"""

from __future__ import annotations

import hmac
import secrets
from typing import Any, Mapping, Sequence

from impala.envs.fingerprint import EnvFingerprint, FingerprintMismatchError, compare_fingerprints
from impala.envs.probe import EnvInfo


class FingerprintGuard:
    """Judges hellos against the tasks' probed envs (a multi-task run deals task ``id % N`` to actor
    ``id``)."""

    def __init__(self, tasks: Sequence[EnvInfo], local_workers: int) -> None:
        self.tasks = tuple(tasks)
        self.local_workers = local_workers
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

    def problem(self, info: Mapping[str, Any], actor: int) -> str | None:
        """What differs between the hello's fingerprint and the actor's task, or None."""
        reference = self.tasks[actor % len(self.tasks)].fingerprint
        if reference is None:  # an env the learner could not fingerprint (nothing to compare)
            return None
        raw = info.get("fingerprint")
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
