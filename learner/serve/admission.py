"""Who may feed the learner: the trajectory server's admission rules as one pure policy object.

:class:`Admission` holds the tables the rules need (accepted and refused ids, which client key owns an id,
when each id was last seen, over which connections it sends) and decides; it opens no socket, starts no
thread and reads no clock: every input is a decoded message's metadata, its connection, the time and the
queue's occupancy, and every answer is a :class:`Decision` (go on, or drop and count under a reason) or a
:class:`HelloOutcome`. The server (``learner.serve.server``) does the receiving, decoding, counting and
logging, and guards the tables the learner's thread also reads with its own lock. The rules
(docs/SECURITY.md):

- A hello is accepted when the run's check (``check_hello``: the environment fingerprint, a local actor's
  token) passes; a refused one is told back with its nonce and evicts the id, unless the id is a verified
  local actor's (a hello in its name must not lock it out). Refused ids live in a bounded LRU and take no
  actor slot; a full table frees the slots of actors silent for ``ACTOR_IDLE_S`` (never a local one).
- With CURVE an id belongs to the client key whose hello was first accepted for it (``wrong_key``).
- An unroll needs an accepted id (``unknown_actor``, or ``other_run`` when it names another run), an env
  index within its hello's ``num_envs`` and the task its (actor, env) plays (``schema``), the run's id
  (``other_run``), a local actor's token (``unverified_local``) and a published policy version
  (``future_version``).
- Fair share: an id sending over several connections at once that already holds its share of the queue
  has the unroll dropped before decoding (``over_share``); one on a single connection waits instead.
"""

from __future__ import annotations

import collections
import hmac
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

from impala.envs.fingerprint import EnvFingerprint

MAX_ACTORS = 4096  # accepted actor ids the learner keeps state for
MAX_REFUSED = 1024  # refused ids remembered (oldest forgotten first); they never take an actor slot
SILENT_S = 30.0  # an accepted actor silent this long is said to have left (once; "is back" when it returns)
ACTOR_IDLE_S = 600.0  # an accepted actor silent this long gives its slot up when the table is full
MAX_UNKNOWN_REPORTED = 64  # ids whose unrolls were dropped as unknown, told back in the weights message
MAX_ENVS_PER_ACTOR = 10_000  # an unroll's env index bound when the hello did not say (RunInfo's own bound)
# An actor with an accepted message this recent counts as active for the fair share. Short on purpose:
# an actor that just died (say, killed and restarting) must not shrink the others' share for long, and
# one that sends less often than this waits for room like any other (it is never over its share).
ACTIVE_S = 0.25
ACTIVE_RECOUNT_S = 0.05  # the number of active actors is recounted at most this often
# An id whose messages came over two connections within this many seconds sends over several at once
# (a restarted actor's old connection goes quiet when its process dies).
CONNECTIONS_S = 5.0
MAX_SOURCES = 64  # connections remembered per id
MAX_OWNERS = 4 * MAX_ACTORS  # actor id -> CURVE key that first claimed it (oldest forgotten first)
MAX_NONCE_CHARS = 64  # a hello's nonce, echoed when that hello is refused

# Every reason a message can be dropped for; all are always reported (CSV columns stay fixed).
DROP_REASONS = (
    "malformed",
    "oversized",
    "schema",
    "non_finite",
    "unknown_actor",
    "unexpected_kind",
    "stale",
    "future_version",
    "other_run",
    "unverified_local",
    "over_share",
    "wrong_key",
)


@dataclass(frozen=True)
class Decision:
    """What to do with one message: go on (``drop`` None) or drop it, counted under ``drop`` (one of
    :data:`DROP_REASONS`) with ``detail`` for the log. ``lose_episode``: the dropped unroll belonged to an
    accepted actor's stream, whose running episode now has a gap. ``quiet``: counted without the
    throttled drop line; ``warn``: a line to log instead (said once per id)."""

    drop: str | None = None
    detail: str = ""
    lose_episode: bool = False
    quiet: bool = False
    warn: str | None = None


GO = Decision()


@dataclass(frozen=True)
class HelloOutcome:
    """What a hello did. ``verdict``: 'accepted'; 'refused' (told back, the id evicted: ``reason`` says
    why); 'ignored' (refused in the name of a verified local actor, which keeps its slot); 'dropped' (the
    actor table is full: counted under ``drop`` with ``reason``). ``joined``: accepted and not accepted
    before; ``fresh``: its envs start at a reset (not a hello said again mid-run); ``back``: it had been
    said to have left; ``expired``: idle ids whose slots were freed to make room for it."""

    verdict: Literal["accepted", "refused", "ignored", "dropped"]
    reason: str = ""
    drop: str | None = None
    joined: bool = False
    fresh: bool = True
    back: bool = False
    expired: tuple[int, ...] = ()


def _nonce(info: Mapping[str, Any]) -> str | None:
    """A hello's nonce (a short string the actor drew), or None when it sent none or a bad one."""
    nonce = info.get("nonce")
    return nonce if isinstance(nonce, str) and len(nonce) <= MAX_NONCE_CHARS else None


def _kept_hello(info: Mapping[str, Any]) -> dict[str, Any]:
    """What the learner keeps of an accepted hello: small, typed fields only (a hello is peer-supplied)."""
    kept: dict[str, Any] = {k: info[k] for k in ("pid", "num_envs") if type(info.get(k)) is int}
    try:
        kept["fingerprint"] = EnvFingerprint.from_dict(info["fingerprint"]).to_dict()
    except (KeyError, TypeError, ValueError):
        pass
    return kept


class Admission:
    """The admission tables and rules of one learner (module docstring).

    Args:
        check_hello: the run's check of a hello, (actor id, info) -> None to accept or the reason to refuse.
        protected_ids: the verified local actors' ids (a live set: the run adds to it as they say hello).
        local_token: the per-run token a local actor stamps every unroll with.
        task_of: a multi-task run's (actor, env) -> task; None for a single-task run.
    """

    def __init__(
        self,
        check_hello: Callable[[int, Mapping[str, Any]], str | None] | None = None,
        *,
        protected_ids: set[int] | None = None,
        local_token: str = "",
        task_of: Callable[[int, int], int] | None = None,
    ) -> None:
        self.check_hello = check_hello or (lambda actor, info: None)
        # Accepted actors that a refused hello must not evict (the learner's own, verified actors):
        # otherwise anyone reaching the port could lock one out by sending a bad hello in its name.
        self.protected_ids = protected_ids if protected_ids is not None else set()
        self.local_token = local_token
        self.task_of = task_of
        self.run_info: dict[str, Any] = {}  # the run as remote actors see it (run_id, envs_per_worker)
        self.published_version = 0  # the initial weights are version 0; unrolls claiming a later one drop
        self.accepted: dict[int, dict[str, Any]] = {}
        self.refused: collections.OrderedDict[int, str] = collections.OrderedDict()
        self.refused_nonces: dict[int, str | None] = {}  # the nonce of each refused id's refused hello
        self.last_seen: dict[int, float] = {}  # accepted actor -> time of its last valid message
        self.silent: set[int] = set()  # accepted actors said to have left (SILENT_S); "back" when they return
        # Ids whose unrolls were dropped because the learner does not know them (never said hello,
        # or their slot expired): the weights message lists them, so such an actor says hello again.
        self.unknown_recent: collections.OrderedDict[int, None] = collections.OrderedDict()
        # Recently refused hellos, told back in the weights message with the nonce of the refused
        # hello and why: the actor whose own hello it was exits with the reason; an actor evicted by
        # someone else's hello in its name (its nonce differs) says hello again.
        self.refused_recent: collections.OrderedDict[int, tuple[str | None, str]] = collections.OrderedDict()
        self.reports_changed = False  # unknown or refused ids not yet in a packed weights message
        # With CURVE: each actor id belongs to the client key (ZAP User-Id) whose hello first claimed it.
        self.owners: collections.OrderedDict[int, str] = collections.OrderedDict()
        self.refused_hellos = 0
        self.joined = 0
        self._sources: dict[int, dict[int, float]] = {}  # actor -> its connections' fds, last seen
        self._told_over_share: set[int] = set()  # ids whose over-share drops were said
        # Per-actor accounting (accepted unrolls, first and last time, unrolls over its share), logged
        # when the server closes.
        self.unrolls_by_actor: dict[int, list[float]] = {}
        self._active = 1  # active actors at the last recount
        self._active_at = float("-inf")

    # ---- hellos ---------------------------------------------------------
    def check_key(self, actor: int, kind: str, info: Mapping[str, Any], user: str | None) -> Decision:
        """Any message: another client key speaking for an id that belongs to someone else is never
        accepted, and the owner is not evicted (a hello in its name cannot lock it out); a hello so
        refused is told back. ``user``: the sender's CURVE key (None without CURVE)."""
        owner = self.owners.get(actor)
        if user is None or owner is None or user == owner:
            return GO
        if kind == "hello":
            self.refused_hellos += 1
            self._tell_refused(actor, info, f"actor id {actor} belongs to another client key")
        return Decision("wrong_key", f"{kind} from a key other than the one that owns actor {actor}")

    def hello(self, actor: int, info: Mapping[str, Any], user: str | None, now: float) -> HelloOutcome:
        """Accept or refuse ``actor`` by the run's check, after :meth:`check_key` let it through."""
        expired: tuple[int, ...] = ()
        if actor not in self.accepted and len(self.accepted) >= MAX_ACTORS:
            expired = self._expire_idle(now)
            if not expired:
                return HelloOutcome(
                    "dropped", f"more than {MAX_ACTORS} active actor ids", drop="unknown_actor"
                )
        reason = self.check_hello(actor, info)
        if reason is None:
            return self._accept(actor, info, user, now, expired)
        self.refused_hellos += 1
        if actor in self.accepted and actor in self.protected_ids:
            return HelloOutcome("ignored", reason, expired=expired)
        self.refused[actor] = reason[:1000]
        self.refused.move_to_end(actor)
        self.refused_nonces[actor] = _nonce(info)
        while len(self.refused) > MAX_REFUSED:
            self.refused_nonces.pop(self.refused.popitem(last=False)[0], None)
        self.accepted.pop(actor, None)
        self.last_seen.pop(actor, None)
        self._tell_refused(actor, info, reason)
        return HelloOutcome("refused", reason, expired=expired)

    def _accept(
        self, actor: int, info: Mapping[str, Any], user: str | None, now: float, expired: tuple[int, ...]
    ) -> HelloOutcome:
        joined = actor not in self.accepted
        if joined:
            self.joined += 1
        self.accepted[actor] = _kept_hello(info)
        back = self.seen(actor, now)
        if user is not None and actor not in self.owners:
            self.owners[actor] = user
            while len(self.owners) > MAX_OWNERS:
                self.owners.popitem(last=False)
        self.refused_recent.pop(actor, None)
        self.refused.pop(actor, None)
        self.refused_nonces.pop(actor, None)
        self.unknown_recent.pop(actor, None)
        fresh = info.get("resumed") is not True
        return HelloOutcome("accepted", joined=joined, fresh=fresh, back=back, expired=expired)

    def _expire_idle(self, now: float) -> tuple[int, ...]:
        """Free the slots of accepted actors silent for ACTOR_IDLE_S (never a verified local one)."""
        idle = tuple(
            a
            for a in self.accepted
            if a not in self.protected_ids and now - self.last_seen.get(a, now) > ACTOR_IDLE_S
        )
        for actor in idle:
            self.accepted.pop(actor, None)
            self.last_seen.pop(actor, None)
        return idle

    def _tell_refused(self, actor: int, info: Mapping[str, Any], reason: str) -> None:
        """Remember a refused hello for the weights message (bounded: the newest MAX_UNKNOWN_REPORTED)."""
        self.refused_recent[actor] = (_nonce(info), reason[:200])
        self.refused_recent.move_to_end(actor)
        self.reports_changed = True
        while len(self.refused_recent) > MAX_UNKNOWN_REPORTED:
            self.refused_recent.popitem(last=False)

    def reports(self) -> tuple[list[int], list[list[Any]]]:
        """The ids recently dropped as unknown, and [id, nonce, reason] of each recent refusal: what the
        weights message tells the actors. Taking them clears :attr:`reports_changed`."""
        self.reports_changed = False
        refused = [[a, nonce, reason] for a, (nonce, reason) in self.refused_recent.items()]
        return list(self.unknown_recent), refused

    # ---- unrolls --------------------------------------------------------
    def known_sender(self, actor: int, info: Mapping[str, Any]) -> Decision:
        """An unroll needs an accepted id. One of another learner run (an orphan of a killed run, before a
        --resume on this port) is not ours to tell; any other unknown id is told, in the weights message, to
        say hello (a refused one keeps its refusal among the reported ones instead, however many other ids
        were refused since: a flood of refused hellos must not push a victim's out)."""
        if actor in self.accepted:
            return GO
        claimed, run_id = info.get("run_id"), self.run_info.get("run_id")
        if run_id is not None and isinstance(claimed, str) and claimed and claimed != run_id:
            return Decision("other_run", "unroll from another learner run")
        if actor in self.refused:
            if actor not in self.refused_recent:
                self._tell_refused(actor, {"nonce": self.refused_nonces.get(actor)}, self.refused[actor])
        else:
            if actor not in self.unknown_recent:
                self.reports_changed = True
            self.unknown_recent[actor] = None
            self.unknown_recent.move_to_end(actor)
            while len(self.unknown_recent) > MAX_UNKNOWN_REPORTED:
                self.unknown_recent.popitem(last=False)
        return Decision("unknown_actor", self.refused.get(actor, "no hello received"))

    def within_share(
        self, actor: int, info: Mapping[str, Any], source: int | None, queued: Callable[[], int], share: int,
        now: float,
    ) -> Decision:  # fmt: skip
        """Before decoding (cheap): an id holding its ``share`` of the queue or more (``queued()``: its
        unrolls waiting) while it sends over several connections at once has this unroll dropped. Waiting
        for room would hand the receive thread to whichever connections ZeroMQ reads most often (it reads
        connections in turn): one id over 16 connections took 16 of every 17 reads. An id on one connection
        (every honest actor) waits for its share instead: while it waits, its connection is not read, and
        the others' are in turn once its unroll is in, so back pressure holds it to its share and no data is
        lost. ``source``: the connection's file descriptor (None: handed in without a socket)."""
        connections = self._connections_of(actor, source, now)
        if connections <= 1 or queued() < share:
            return GO
        self.account(actor, now)[3] += 1
        warn = None
        if actor not in self._told_over_share and len(self._told_over_share) < MAX_ACTORS:
            self._told_over_share.add(actor)
            warn = (
                f"actor {actor} sends over {connections} connections at once and holds its fair share of the "
                f"learner's queue ({share} unrolls): its unrolls over that share are dropped "
                "(transport/dropped_over_share)"
            )
        return Decision("over_share", lose_episode=self.owns_stream(actor, info), quiet=True, warn=warn)

    def _connections_of(self, actor: int, source: int | None, now: float) -> int:
        """How many connections ``actor``'s messages came over in the last CONNECTIONS_S seconds, this
        one included. An actor process has one; a restarted one a new one, while its old one goes quiet."""
        if source is None:  # a message handed in without a socket (tests): one connection
            return 1
        seen = self._sources.setdefault(actor, {})
        seen[source] = now
        if len(seen) > 1:
            for fd in [fd for fd, t in seen.items() if now - t > CONNECTIONS_S]:
                del seen[fd]
            while len(seen) > MAX_SOURCES:
                del seen[next(iter(seen))]
        while len(self._sources) > 2 * MAX_ACTORS:
            del self._sources[next(iter(self._sources))]
        return len(seen)

    def after_decoding(self, actor: int, info: Mapping[str, Any], task: int, version: int) -> Decision:
        """A decoded, finite unroll of an accepted id that passed the learner's own value checks: its env
        index and task label (``task``, 0 in a single-task run) must fit what the hello and the run say, and
        it must be this run's, carry a local actor's token and claim a published policy version."""
        env = info.get("env", 0)
        num_envs = self.accepted[actor].get("num_envs", MAX_ENVS_PER_ACTOR)
        problem = None
        if type(env) is not int or not 0 <= env < num_envs:
            problem = f"env index {env!r} outside [0, {num_envs})"
        elif self.task_of is not None and task != (expected := self.task_of(actor, env)):
            # tasks are dealt by (actor, env): another label is a mislabel
            problem = f"unroll labelled task {task}, but env {env} of actor {actor} plays task {expected}"
        if problem is not None:
            return Decision("schema", problem, lose_episode=self.owns_stream(actor, info))
        run_id = self.run_info.get("run_id")
        if run_id is not None and info.get("run_id") != run_id:
            # collected for another learner process (say, by an orphan of a killed run on this port)
            return Decision("other_run", "unroll from another learner run")
        if actor in self.protected_ids and not self.has_token(info):
            return Decision("unverified_local", "unroll in the name of a local actor without its token")
        if version > self.published_version:  # no actor can hold weights the learner has not published yet
            return Decision(
                "future_version", f"policy version {version} > published {self.published_version}"
            )
        return GO

    def owns_stream(self, actor: int, info: Mapping[str, Any]) -> bool:
        """Whether a dropped unroll of ``actor`` was part of its stream: a local actor's only when stamped
        with its token (anyone else's unroll in its name is not)."""
        return actor not in self.protected_ids or self.has_token(info)

    def has_token(self, info: Mapping[str, Any]) -> bool:
        """Whether an unroll carries the run's local token (compared in constant time)."""
        token = info.get("local_token")
        return isinstance(token, str) and hmac.compare_digest(token, self.local_token)

    # ---- presence and fair share ----------------------------------------
    def seen(self, actor: int, now: float) -> bool:
        """``actor`` sent an accepted message at ``now``; True when it had been said to have left."""
        self.last_seen[actor] = now
        if actor in self.silent:
            self.silent.discard(actor)
            return True
        return False

    def newly_silent(self, now: float) -> list[tuple[int, float]]:
        """(actor, seconds silent) of each accepted actor silent for ``SILENT_S`` not said before: it left,
        or cannot reach us. Each is said once, until it is :meth:`seen` again."""
        out = []
        for actor, seen in list(self.last_seen.items()):  # a copy: the receive thread updates the table
            if now - seen > SILENT_S and actor in self.accepted and actor not in self.silent:
                self.silent.add(actor)
                out.append((actor, now - seen))
        return out

    def account(self, actor: int, now: float) -> list:
        """``actor``'s entry in the per-actor accounting: [accepted, first time, last time, over share]."""
        entry = self.unrolls_by_actor.get(actor)
        if entry is None:
            entry = [0, now, now, 0]
            if len(self.unrolls_by_actor) < 2 * MAX_ACTORS:  # bounded; beyond that, counted nowhere
                self.unrolls_by_actor[actor] = entry
        return entry

    def count_accepted(self, actor: int, now: float) -> None:
        """One more accepted unroll of ``actor``, at ``now``."""
        entry = self.account(actor, now)
        entry[0] += 1
        entry[2] = now

    def equal_part(self, now: float, queue_size: int, waiting_ids: Callable[[], set[int]]) -> int:
        """ceil(queue size / active actors) (active: an accepted message within ACTIVE_S, or unrolls
        waiting in the queue, ``waiting_ids()``, so that an actor held to its share does not look idle and
        let the others' shares grow): the queued unrolls every id is sure of. Recounted at most every
        ACTIVE_RECOUNT_S."""
        if now - self._active_at > ACTIVE_RECOUNT_S:
            recent = {a for a, t in list(self.last_seen.items()) if now - t < ACTIVE_S}
            self._active = max(1, len(recent | waiting_ids()))
            self._active_at = now
        return -(-queue_size // self._active)

    def fair_share(self, equal_part: int) -> int:
        """Unrolls one actor id may have queued: its equal part + 2 K. K, the run's envs per actor, is
        the burst an honest actor sends at once (one unroll per env, back to back), and one round may
        arrive while the last one still waits; K comes from the run's own settings, never a peer."""
        burst = self.run_info.get("envs_per_worker")
        burst = burst if type(burst) is int and burst >= 1 else 1
        return equal_part + 2 * burst

    def actor_report(self, top: int = 8) -> str:
        """The actors with the most accepted unrolls: count, seconds from first to last, rate."""
        rows = sorted(self.unrolls_by_actor.items(), key=lambda kv: -kv[1][0])[:top]
        return ", ".join(
            f"actor {a}: {int(n)} unrolls in {last - first:.1f}s ({n / max(last - first, 1e-9):.1f}/s, "
            f"{over} over its share)"
            for a, (n, first, last, over) in rows
        )
