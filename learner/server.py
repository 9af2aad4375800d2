"""The learner's transport: ZeroMQ sockets and the receive thread.

PULL receives trajectories from every actor (PUSH); a PUB socket broadcasts
versioned parameters. The receive thread validates each message against the
schema before it reaches the learner and drops (and counts, per reason and
actor) anything malformed, oversized, off-schema or non-finite. It never lets a
bad message raise out of the thread. Valid unrolls go into a bounded queue: when
the learner falls behind, the queue fills, the thread stops reading, and
ZeroMQ's high-water marks push back on the actors.

Nothing a peer claims steers the learner's statistics: episode returns and lengths are summed
here from the rewards and episode ends of accepted unrolls. No actor id gets more than its fair
share of the queue, and with CURVE an id belongs to the client key that first claimed it.
"""

from __future__ import annotations

import collections
import errno
import hmac
import logging
import math
import queue
import threading
import time
from typing import Any, Callable, Mapping

import numpy as np
import zmq

from impala.transport import wire
from impala.transport.curve import make_server_socket, start_authenticator
from impala.envs.fingerprint import EnvFingerprint
from impala.run.metrics import log_this_one
from impala.transport.trajectory import TrajectorySchema

log = logging.getLogger(__name__)


class PortInUseError(RuntimeError):
    """The port the learner must bind is taken (a user can fix it: another --port)."""

    pass


MAX_ACTORS = 4096  # accepted actor ids the learner keeps state for
MAX_REFUSED = 1024  # refused ids remembered (oldest forgotten first); they never take an actor slot
SILENT_S = 30.0  # an accepted actor silent this long is said to have left (once; "is back" when it returns)
ACTOR_IDLE_S = 600.0  # an accepted actor silent this long gives its slot up when the table is full
MAX_UNKNOWN_REPORTED = 64  # ids whose unrolls were dropped as unknown, told back in the weights message
MAX_STREAMS = 65536  # (actor, env) streams whose running episode the server tracks; more are not counted
MAX_ENVS_PER_ACTOR = 10_000  # an unroll's env index bound when the hello did not say (RunInfo's own bound)

# An actor with an accepted message this recent counts as active for the fair share. Short on purpose:
# an actor that just died (say, killed and restarting) must not shrink the others' share for long, and
# one that sends less often than this waits for room like any other (it is never over its share).
ACTIVE_S = 0.25
# An id whose messages came over two connections within this many seconds sends over several at once
# (a restarted actor's old connection goes quiet when its process dies).
CONNECTIONS_S = 5.0
MAX_SOURCES = 64  # connections remembered per id


def _source(frames: list) -> int | None:
    """The file descriptor of the connection a received message came over (ZeroMQ's SRCFD), or None for
    frames that did not come from a socket."""
    try:
        return int(frames[0].get(zmq.SRCFD))
    except (AttributeError, TypeError, ValueError, zmq.ZMQError):
        return None


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
MAX_OWNERS = 4 * MAX_ACTORS  # actor id -> CURVE key that first claimed it (oldest forgotten first)
MAX_NONCE_CHARS = 64  # a hello's nonce, echoed when that hello is refused


class _Stream:
    """The running episode of one env of one actor, summed from the unrolls the server accepted.

    ``counted`` is False while the episode's start was not seen (the stream joined mid-episode, or
    lost an unroll): its end is then not reported, since its return and length would be partial.
    """

    __slots__ = ("ret", "length", "counted")

    def __init__(self, counted: bool) -> None:
        self.ret = 0.0
        self.length = 0
        self.counted = counted

    def advance(self, rewards: np.ndarray, ends: np.ndarray) -> tuple[list[float], list[int]]:
        """Add one unroll's T transitions; return the episodes that ended in it (as the actor's
        ``EpisodeTracker`` counted them: the sum of the raw rewards and the number of steps)."""
        returns: list[float] = []
        lengths: list[int] = []
        start = 0
        for t in np.flatnonzero(ends):
            t = int(t)
            ret = self.ret + float(rewards[start : t + 1].sum(dtype=np.float64))
            length = self.length + t + 1 - start
            if self.counted:
                returns.append(ret)
                lengths.append(length)
            self.ret, self.length, self.counted = 0.0, 0, True
            start = t + 1
        self.ret += float(rewards[start:].sum(dtype=np.float64))
        self.length += len(rewards) - start
        return returns, lengths


def _nonce(info: Mapping[str, Any]) -> str | None:
    """A hello's nonce (a short string the actor drew), or None when it sent none or a bad one."""
    nonce = info.get("nonce")
    return nonce if isinstance(nonce, str) and len(nonce) <= MAX_NONCE_CHARS else None


def unroll_episode_arrays(arrays: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """An unroll's raw rewards [T] and episode ends [T] (IMPALA: ``dones``; PPO: terminated or truncated)."""
    ends = arrays["dones"] if "dones" in arrays else arrays["terminated"] | arrays["truncated"]
    return arrays["rewards"], ends


class FairQueue:
    """A bounded queue of unrolls that hands them out round-robin across actor ids.

    Each actor's unrolls stay in order; the learner takes one from each actor with unrolls waiting
    in turn, so an id holding many queued unrolls cannot push the others' back in line. ``put`` blocks
    while ``maxsize`` unrolls wait (ZeroMQ's high-water marks then push back on the actors).
    """

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._by_actor: collections.OrderedDict[int, collections.deque] = collections.OrderedDict()
        self._size = 0
        self._cond = threading.Condition()

    def qsize(self) -> int:
        return self._size

    def queued(self, actor: int) -> int:
        """Unrolls of ``actor`` waiting."""
        with self._cond:
            waiting = self._by_actor.get(actor)
            return len(waiting) if waiting else 0

    def put(self, msg: wire.Message, timeout: float, guaranteed: int = 0, cap: int | None = None) -> None:
        """Append ``msg``; raise queue.Full if no room came within ``timeout`` seconds.

        ``cap``: while ``msg``'s id holds this many unrolls or more, wait too (its fair share: an id
        sending over one connection is held to it by back pressure, not by losing data).

        ``guaranteed``: the unrolls every id is sure of (its equal part of the queue). While another id
        holds more than that, an id holding fewer is queued even when ``maxsize`` unrolls wait, up to
        twice ``maxsize``. Shares above the equal part let an honest actor's burst in while there is
        room; without this, whichever id refilled that room fastest (a flood over many connections) kept
        it, and the others were held under their equal part. Twice ``maxsize`` always suffices: the room
        others hold above their equal parts is at most ``maxsize``."""

        def room() -> bool:
            if cap is not None and len(self._by_actor.get(msg.actor, ())) >= cap:
                return False
            if self._size < self.maxsize:
                return True
            if self._size >= 2 * self.maxsize or len(self._by_actor.get(msg.actor, ())) >= guaranteed:
                return False
            return any(len(q) > guaranteed for a, q in self._by_actor.items() if a != msg.actor)

        with self._cond:
            if not self._cond.wait_for(room, timeout):
                raise queue.Full
            self._by_actor.setdefault(msg.actor, collections.deque()).append(msg)
            self._size += 1
            self._cond.notify_all()

    def waiting_ids(self) -> set[int]:
        """The ids with unrolls waiting."""
        with self._cond:
            return set(self._by_actor)

    def get(self, timeout: float | None = None) -> wire.Message:
        """The next actor's oldest unroll; raise queue.Empty after ``timeout`` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._size > 0, timeout):
                raise queue.Empty
            actor, waiting = next(iter(self._by_actor.items()))
            msg = waiting.popleft()
            del self._by_actor[actor]
            if waiting:  # to the back of the line
                self._by_actor[actor] = waiting
            self._size -= 1
            self._cond.notify_all()
            return msg


class TrajectoryServer:
    """Owns the learner's sockets and receive thread.

    Args:
        schema: the unroll layout every "unroll" message must match.
        bind: address to bind (127.0.0.1 unless the user asks otherwise).
        port: trajectory port; parameters use ``port + 1``. 0 picks free ports.
        queue_size: valid unrolls held before pushing back.
        on_hello: called with (actor_id, info) for each hello; returns None to
            accept the actor or an error string to refuse it (its unrolls are
            then dropped and ``refused`` records why).
        validate: the learner's own check of a decoded unroll's values (e.g. action
            ranges); returns a reason to drop it, or None.
        curve_dir: a CURVE keys directory (impala.transport.curve); when given, only actors
            holding an authorized key can connect, and traffic is encrypted.
        publish_delay: :meth:`publish` sends the weights of this many versions before the ones it is
            given (``--publish-delay``); the first weights go out at once.
    """

    def __init__(
        self,
        schema: TrajectorySchema,
        *,
        bind: str = "127.0.0.1",
        port: int = 0,
        queue_size: int = 64,
        on_hello: Callable[[int, Mapping[str, Any]], str | None] | None = None,
        rcv_hwm: int = 2,
        curve_dir: str | None = None,
        validate: Callable[[Mapping[str, np.ndarray]], str | None] | None = None,
        protected_ids: set[int] | None = None,
        local_token: str = "",
        task_names: tuple[str, ...] = (),
        task_of: Callable[[int, int], int] | None = None,
        publish_delay: int = 0,
    ) -> None:
        """``task_names``: a multi-task run's tasks; env ``k`` of actor ``i`` plays task ``task_of(i, k)``
        (``RunInfo.task_of``; by default ``i % len(task_names)``) and each of its unrolls must say so
        (``task``); episode returns are also kept per task."""
        self.auth = None
        self.task_names = tuple(task_names)
        self.task_of = task_of or (lambda actor, env: actor % len(self.task_names))
        # Accepted actors that a refused hello must not evict (the learner's own, verified actors):
        # otherwise anyone reaching the port could lock one out by sending a bad hello in its name.
        self.protected_ids = protected_ids if protected_ids is not None else set()
        self.local_token = local_token  # verified local actors stamp every unroll with it
        self.validate = validate or (lambda arrays: None)
        self.schema = schema
        self.max_bytes = schema.nbytes + 1024
        self.on_hello = on_hello or (lambda actor, info: None)
        self._stats_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive_loop, name="trajectory-receiver", daemon=True)
        # The newest weights message, re-sent every second for late joiners (restarted or remote
        # actors: PUB drops messages for absent subscribers) and as the learner's heartbeat, even
        # while the main thread is busy in a long update. The lock gives the PUB socket one user at a time.
        self._pub_lock = threading.Lock()
        self._last_params: bytes | None = None
        self._reports_changed = False  # unknown or refused ids not yet in the packed weights message
        self.publish_delay = publish_delay
        # --publish-delay: the newest weights not sent yet, oldest first, as copies (the learner's arrays
        # are views of weights the next optimizer step changes in place)
        self._held: collections.deque[tuple[int, dict[str, np.ndarray]]] = collections.deque()
        self._heartbeat = threading.Thread(target=self._republish_loop, name="weights-heartbeat", daemon=True)
        self.ctx = zmq.Context.instance()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, rcv_hwm)
        self.pull.setsockopt(zmq.LINGER, 0)
        # Small kernel buffers: with tiny unrolls (CartPole) the OS would otherwise queue
        # thousands of them, and every one would be many policy versions old when read.
        self.pull.setsockopt(zmq.RCVBUF, max(8192, 2 * schema.nbytes))
        # A hard cap inside ZeroMQ on each frame, so one huge frame is never buffered (the sender is
        # disconnected). Between the schema's size and this cap, messages arrive and are counted.
        # ZeroMQ does not bound the number of frames in a message, so an unauthenticated peer can
        # still make it buffer a lot: a public bind needs CURVE (runtime refuses it otherwise).
        self.pull.setsockopt(zmq.MAXMSGSIZE, 4 * self.max_bytes + wire.MAX_HEADER_BYTES)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 2)
        self.pub.setsockopt(zmq.LINGER, 0)
        try:
            if curve_dir:
                self.auth = start_authenticator(self.ctx, curve_dir)
                make_server_socket(self.pull, curve_dir)
                make_server_socket(self.pub, curve_dir)
            self.trajectory_port, self.params_port = self._bind(bind, port)
        except BaseException:
            # a server that cannot start must not leave its authenticator (one per process) or sockets behind
            if self.auth is not None:
                self.auth.stop()
                self.auth = None
            self.pull.close(linger=0)
            self.pub.close(linger=0)
            raise
        host = "127.0.0.1" if bind in ("0.0.0.0", "*") else bind
        self.trajectory_endpoint = f"tcp://{host}:{self.trajectory_port}"
        self.params_endpoint = f"tcp://{host}:{self.params_port}"
        self.queue = FairQueue(queue_size)
        self.accepted: dict[int, dict[str, Any]] = {}
        self.refused: collections.OrderedDict[int, str] = collections.OrderedDict()
        self.refused_nonces: dict[int, str | None] = {}  # the nonce of each refused id's refused hello
        self.last_seen: dict[int, float] = {}  # accepted actor -> monotonic time of its last valid message
        self.silent: set[int] = set()  # accepted actors said to have left (SILENT_S); "back" when they return
        # Ids whose unrolls were dropped because the learner does not know them (never said hello,
        # or their slot expired): the weights message lists them, so such an actor says hello again.
        self.unknown_recent: collections.OrderedDict[int, None] = collections.OrderedDict()
        # Recently refused hellos, told back in the weights message with the nonce of the refused
        # hello and why: the actor whose own hello it was exits with the reason; an actor evicted by
        # someone else's hello in its name (its nonce differs) says hello again.
        self.refused_recent: collections.OrderedDict[int, tuple[str | None, str]] = collections.OrderedDict()
        # With CURVE: each actor id belongs to the client key (ZAP User-Id) whose hello first claimed it.
        self.owners: collections.OrderedDict[int, str] = collections.OrderedDict()
        self.dropped: collections.Counter[str] = collections.Counter()
        self._sources: dict[int, dict[int, float]] = {}  # actor -> its connections' fds, last seen
        self._told_over_share: set[int] = set()  # ids whose over-share drops were logged
        self.received = 0
        # Episode statistics are summed here from the rewards and episode ends of accepted unrolls, per
        # (actor, env) stream: what a peer claims in an unroll's info never reaches them.
        self.streams: dict[int, dict[int, _Stream]] = {}
        self.stream_count = 0
        self.fresh: dict[int, bool] = {}  # actor -> its hello said it starts its envs afresh
        self.episode_returns: collections.deque[float] = collections.deque(maxlen=100)
        self.episode_lengths: collections.deque[int] = collections.deque(maxlen=100)
        # Fair share: the number of active actors, recounted at most every 50 ms.
        self._active = 1
        self._active_at = 0.0
        # Per-actor accounting (accepted unrolls, first and last time, unrolls over its share), logged
        # when the server closes.
        self.unrolls_by_actor: dict[int, list[float]] = {}
        self.episodes_total = 0
        self.task_returns: list[collections.deque[float]] = [
            collections.deque(maxlen=100) for _ in self.task_names
        ]
        self.task_episodes = [0] * len(self.task_names)
        self.run_info: dict[str, Any] = {}
        self.refused_hellos = 0
        self.joined = 0
        self.published_version = (
            0  # the initial weights are version 0; unrolls claiming a later one are dropped
        )

    def _bind(self, bind: str, port: int) -> tuple[int, int]:
        addr = f"tcp://{bind}"
        try:
            if port == 0:
                tport = self.pull.bind_to_random_port(addr)
                pport = self.pub.bind_to_random_port(addr)
                return tport, pport
            self.pull.bind(f"{addr}:{port}")
            self.pub.bind(f"{addr}:{port + 1}")
            return port, port + 1
        except zmq.ZMQError as e:
            self.close()
            if e.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    f"port {port} or {port + 1} on {bind} is already in use; pass --port with another port, "
                    "or --port 0 to pick free ones"
                ) from None
            raise PortInUseError(f"cannot bind {addr}:{port}: {e}; check --bind and --port") from None

    # ---- receive thread -------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._heartbeat.start()

    def _seen(self, actor: int) -> None:
        self.last_seen[actor] = time.monotonic()
        if actor in self.silent:
            self.silent.discard(actor)
            log.info("actor %d is back", actor)

    def _note_silent(self) -> None:
        """Say once when an accepted actor has sent nothing for ``SILENT_S`` (it left, or cannot reach us)."""
        now = time.monotonic()
        for actor, seen in list(self.last_seen.items()):  # a copy: the receive thread updates the table
            if now - seen > SILENT_S and actor in self.accepted and actor not in self.silent:
                self.silent.add(actor)
                log.info("actor %d left? nothing from it for %.0f s", actor, now - seen)

    def _republish_loop(self) -> None:
        while not self._stop.wait(1.0):
            self._note_silent()
            with self._stats_lock:
                changed, self._reports_changed = self._reports_changed, False
            last = self._last_params
            if changed and last is not None:
                # New unknown or refused ids since the weights were packed: tell them now, not at the
                # next update (a learner whose only actor was just evicted makes no more updates).
                # The weights come from the packed message itself (its bytes never change), not from
                # the learner's arrays, which the next optimizer step changes in place.
                try:
                    old = wire.decode_packed(last, expect_kind="params")
                    packed = self._pack(old.version, old.arrays)
                except (wire.WireError, ValueError) as e:  # the heartbeat itself must go on
                    log.error("could not re-pack the weights message: %s", e)
                else:
                    with self._pub_lock:
                        if self._last_params is last:  # publish() may have sent newer weights meanwhile
                            self._last_params = packed
            with self._pub_lock:
                if self._last_params is not None and not self.pub.closed:
                    self.pub.send(self._last_params, copy=False)

    def _connections_of(self, actor: int, source: int | None) -> int:
        """How many connections ``actor``'s messages came over in the last CONNECTIONS_S seconds, this
        one (``source``, its file descriptor) included. An actor process has one; a restarted one a
        new one, while its old one goes quiet."""
        if source is None:  # a message handed in without a socket (tests): one connection
            return 1
        now = time.monotonic()
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

    def _drop_over_share(self, actor: int, connections: int, share: int) -> None:
        """Drop an unroll of an id over its share on several connections; say so once per id."""
        with self._stats_lock:
            self.dropped["over_share"] += 1
        self._account(actor)[3] += 1
        if actor not in self._told_over_share and len(self._told_over_share) < MAX_ACTORS:
            self._told_over_share.add(actor)
            log.warning(
                "actor %s sends over %d connections at once and holds its fair share of the learner's queue "
                "(%d unrolls): its unrolls over that share are dropped (transport/dropped_over_share)",
                actor,
                connections,
                share,
            )

    def _drop(self, reason: str, actor: Any, detail: str) -> None:
        with self._stats_lock:
            self.dropped[reason] += 1
            n = self.dropped[reason]
        # Log the first few of each reason, then every 1000th: a flood must not flood the log too.
        if log_this_one(n):
            log.warning("dropped message from actor %s (%s, #%d of this kind): %s", actor, reason, n, detail)

    def count_stale(self) -> None:
        with self._stats_lock:
            self.dropped["stale"] += 1

    def healthy(self) -> bool:
        """False once the receive thread has died (a bug: the learner must stop, not hang)."""
        return self._thread.is_alive() or self._stop.is_set()

    def _receive_loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.pull.poll(100, zmq.POLLIN):
                    continue
                # Read what is waiting without a poll per message: each call gives the GIL up, and under
                # a flood the honest actors' messages wait behind every flooding connection's.
                for _ in range(256):
                    try:
                        frames = self.pull.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self.received += 1
                    try:
                        # the sender's CURVE key, as the authenticator vouched for it (None without CURVE)
                        user = frames[0].get("User-Id") if self.auth is not None else None
                        self._handle(frames, user)
                    except Exception as e:  # noqa: BLE001 - no message may kill the receiver
                        self._drop("malformed", "?", f"{type(e).__name__}: {str(e)[:200]}")
                    if self._stop.is_set():
                        return
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise

    def _handle(self, frames: list, user: str | None = None) -> None:
        """Check one message and act on it: a hello accepts or refuses its actor id, a valid unroll of
        an accepted id goes into the queue; anything else is dropped and counted. ``user``: the
        sender's CURVE key (None without CURVE)."""
        try:
            header = wire.decode_header(frames[0])
        except wire.WireError as e:
            self._drop("malformed", "?", str(e))
            return
        actor = header["actor"]
        size = sum(len(f.buffer) if hasattr(f, "buffer") else len(f) for f in frames[1:])
        if size > self.max_bytes:
            self._drop("oversized", actor, f"{size} payload bytes > {self.max_bytes}")
            return
        kind = header["kind"]
        owner = self.owners.get(actor)
        if user is not None and owner is not None and user != owner:
            # Another client key speaking for an id that belongs to someone else: never accepted, and
            # the owner is not evicted (a hello in its name cannot lock it out).
            self._drop("wrong_key", actor, f"{kind} from a key other than the one that owns actor {actor}")
            if kind == "hello":
                self.refused_hellos += 1
                self._tell_refused(actor, header["info"], f"actor id {actor} belongs to another client key")
            return
        if kind == "hello":
            if actor not in self.accepted and len(self.accepted) >= MAX_ACTORS and not self._expire_idle():
                self._drop("unknown_actor", actor, f"more than {MAX_ACTORS} active actor ids")
                return
            reason = self.on_hello(actor, header["info"])
            if reason is None:
                info = header["info"]
                # Keep only small, typed fields: a hello is peer-supplied data.
                kept: dict[str, Any] = {k: info[k] for k in ("pid", "num_envs") if type(info.get(k)) is int}
                try:
                    kept["fingerprint"] = EnvFingerprint.from_dict(info["fingerprint"]).to_dict()
                except (KeyError, TypeError, ValueError):
                    pass
                if actor not in self.accepted:
                    self.joined += 1
                    if log_this_one(self.joined, first=100):
                        log.info(
                            "actor %d joined (%s envs; #%d)", actor, kept.get("num_envs", "?"), self.joined
                        )
                self.accepted[actor] = kept
                self._seen(actor)
                if user is not None and owner is None:
                    self.owners[actor] = user
                    while len(self.owners) > MAX_OWNERS:
                        self.owners.popitem(last=False)
                with self._stats_lock:
                    self.refused_recent.pop(actor, None)
                # A hello starts the actor's episode accounting again: a new actor process starts
                # its envs at a reset; one saying hello again mid-run ("resumed") is mid-episode,
                # so its first episode per env is only partly seen and is not counted.
                self._forget_streams(actor)
                self.fresh[actor] = info.get("resumed") is not True
                self.refused.pop(actor, None)
                self.refused_nonces.pop(actor, None)
                with self._stats_lock:
                    self.unknown_recent.pop(actor, None)
            elif actor in self.accepted and actor in self.protected_ids:
                self.refused_hellos += 1
                if log_this_one(self.refused_hellos):
                    log.error(
                        "ignored a hello in the name of verified actor %d (#%d refused hello): %s",
                        actor,
                        self.refused_hellos,
                        reason[:300],
                    )
            else:
                self.refused[actor] = reason[:1000]
                self.refused.move_to_end(actor)
                self.refused_nonces[actor] = _nonce(header["info"])
                while len(self.refused) > MAX_REFUSED:
                    self.refused_nonces.pop(self.refused.popitem(last=False)[0], None)
                self.accepted.pop(actor, None)
                self.last_seen.pop(actor, None)
                self._forget_streams(actor)
                self._tell_refused(actor, header["info"], reason)
                self.refused_hellos += 1
                if log_this_one(self.refused_hellos):  # each line cut to 300 characters
                    log.error(
                        "refused actor %d (#%d refused hello): %s", actor, self.refused_hellos, reason[:300]
                    )
            return
        if kind != "unroll":
            self._drop("unexpected_kind", actor, kind)
            return
        if actor not in self.accepted:
            claimed, run_id = header["info"].get("run_id"), self.run_info.get("run_id")
            if run_id is not None and isinstance(claimed, str) and claimed and claimed != run_id:
                # an actor of another learner process (an orphan of a killed run, before a --resume on this
                # port): not ours to tell, and counted as what it is
                self._drop("other_run", actor, "unroll from another learner run")
                return
            self._drop("unknown_actor", actor, self.refused.get(actor, "no hello received"))
            if actor in self.refused:
                # Still sending: keep its refusal among the reported ones, however many other ids
                # were refused since (a flood of refused hellos must not push a victim's out).
                if actor not in self.refused_recent:
                    self._tell_refused(actor, {"nonce": self.refused_nonces.get(actor)}, self.refused[actor])
            else:
                with self._stats_lock:  # publish() reads it from the learner's thread
                    if actor not in self.unknown_recent:
                        self._reports_changed = True
                    self.unknown_recent[actor] = None
                    self.unknown_recent.move_to_end(actor)
                    while len(self.unknown_recent) > MAX_UNKNOWN_REPORTED:
                        self.unknown_recent.popitem(last=False)
            return
        # Before decoding (cheap): an id holding its share of the queue or more while it sends over
        # several connections at once has this unroll dropped. Waiting for room would hand the receive
        # thread to whichever connections ZeroMQ reads most often (it reads connections in turn): one id
        # over 16 connections took 16 of every 17 reads. An id on one connection (every honest actor)
        # waits for its share instead: while it waits, its connection is not read, and the others' are
        # in turn once its unroll is in, so back pressure holds it to its share and no data is lost.
        share = self.fair_share()
        connections = self._connections_of(actor, _source(frames))
        if connections > 1 and self.queue.queued(actor) >= share:
            self._drop_over_share(actor, connections, share)
            self._lose_episode(actor, header["info"])
            return
        try:
            msg = wire.decode(frames, schema=self.schema, max_bytes=self.max_bytes)
        except wire.WireError as e:
            self._drop("schema", actor, str(e))
            self._lose_episode(actor, header["info"])
            return
        bad = wire.check_finite(msg.arrays)
        if bad is not None:
            self._drop("non_finite", actor, f"{bad} holds NaN/inf")
            self._lose_episode(actor, msg.info)
            return
        problem = self.validate(msg.arrays)
        env = msg.info.get("env", 0)
        num_envs = self.accepted[actor].get("num_envs", MAX_ENVS_PER_ACTOR)
        if problem is None and (type(env) is not int or not 0 <= env < num_envs):
            problem = f"env index {env!r} outside [0, {num_envs})"
        task = 0
        if problem is None and self.task_names:
            task, expected = int(msg.arrays["task"][0]), self.task_of(actor, env)
            if task != expected:  # tasks are dealt by (actor, env): another label is a mislabel
                problem = f"unroll labelled task {task}, but env {env} of actor {actor} plays task {expected}"
        if problem is not None:
            self._drop("schema", actor, problem)
            self._lose_episode(actor, msg.info)
            return
        run_id = self.run_info.get("run_id")
        if run_id is not None and msg.info.get("run_id") != run_id:
            # collected for another learner process (say, by an orphan of a killed run on this port)
            self._drop("other_run", actor, "unroll from another learner run")
            return
        if actor in self.protected_ids:
            if not self._has_token(msg.info):
                self._drop("unverified_local", actor, "unroll in the name of a local actor without its token")
                return
        if msg.version > self.published_version:
            # No actor can hold weights the learner has not published yet.
            self._drop(
                "future_version", actor, f"policy version {msg.version} > published {self.published_version}"
            )
            return
        self._seen(actor)
        returns, lengths = self._episodes(actor, env, msg.arrays)
        with self._stats_lock:
            self.episode_returns.extend(returns)
            self.episode_lengths.extend(lengths)
            self.episodes_total += len(returns)
            if self.task_names:
                self.task_returns[task].extend(returns)
                self.task_episodes[task] += len(returns)
        seen = self._account(actor)
        seen[0] += 1
        seen[2] = time.monotonic()
        while not self._stop.is_set():
            try:
                self.queue.put(msg, timeout=0.1, guaranteed=self._equal_part(), cap=self.fair_share())
                return
            except queue.Full:
                continue

    def _episodes(
        self, actor: int, env: int, arrays: Mapping[str, np.ndarray]
    ) -> tuple[list[float], list[int]]:
        """The episodes that ended in this accepted unroll, from its own rewards and episode ends."""
        streams = self.streams.setdefault(actor, {})
        stream = streams.get(env)
        if stream is None:
            if self.stream_count >= MAX_STREAMS:
                return [], []  # table full (thousands of actors): these episodes go uncounted
            stream = streams[env] = _Stream(counted=self.fresh.get(actor, False))
            self.stream_count += 1
        if "first" in arrays and arrays["first"][0]:
            # IMPALA unrolls say when obs[0] starts an episode: from here the episode is seen whole.
            stream.ret, stream.length, stream.counted = 0.0, 0, True
        rewards, ends = unroll_episode_arrays(arrays)
        return stream.advance(rewards, ends)

    def _tell_refused(self, actor: int, info: Mapping[str, Any], reason: str) -> None:
        """Remember a refused hello for the weights message (bounded: the newest MAX_UNKNOWN_REPORTED)."""
        with self._stats_lock:  # publish() reads it from the learner's thread
            self.refused_recent[actor] = (_nonce(info), reason[:200])
            self.refused_recent.move_to_end(actor)
            self._reports_changed = True
            while len(self.refused_recent) > MAX_UNKNOWN_REPORTED:
                self.refused_recent.popitem(last=False)

    def _account(self, actor: int) -> list:
        """``actor``'s entry in the per-actor accounting: [accepted, first time, last time, over share]."""
        seen = self.unrolls_by_actor.get(actor)
        if seen is None:
            now = time.monotonic()
            seen = [0, now, now, 0]
            if len(self.unrolls_by_actor) < 2 * MAX_ACTORS:  # bounded; beyond that, counted nowhere
                self.unrolls_by_actor[actor] = seen
        return seen

    def _lose_episode(self, actor: int, info: Mapping[str, Any]) -> None:
        """An unroll of an accepted actor was dropped: the running episode of its stream has a gap,
        so its end is not counted. A local actor's stream only loses an unroll stamped with its token
        (anyone else's unroll in its name is not part of the stream)."""
        env = info.get("env", 0)
        if actor in self.protected_ids and not self._has_token(info):
            return
        stream = self.streams.get(actor, {}).get(env) if type(env) is int else None
        if stream is not None:
            stream.counted = False

    def _has_token(self, info: Mapping[str, Any]) -> bool:
        token = info.get("local_token")
        return isinstance(token, str) and hmac.compare_digest(token, self.local_token)

    def _forget_streams(self, actor: int) -> None:
        self.stream_count -= len(self.streams.pop(actor, {}))
        self.fresh.pop(actor, None)

    # ---- learner side ---------------------------------------------------
    def get(self, timeout: float | None = None) -> wire.Message | None:
        """The next queued unroll (round-robin across actors), or None after ``timeout`` seconds."""
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def _equal_part(self) -> int:
        """ceil(queue size / active actors) (active: an accepted message within ACTIVE_S, or unrolls
        waiting in the queue, so that an actor held to its share does not look idle and let the others'
        shares grow): the queued unrolls every id is sure of (``FairQueue.put`` queues them even when
        the queue is full)."""
        now = time.monotonic()
        if now - self._active_at > 0.05:
            recent = {a for a, t in list(self.last_seen.items()) if now - t < ACTIVE_S}
            self._active = max(1, len(recent | self.queue.waiting_ids()))
            self._active_at = now
        return -(-self.queue.maxsize // self._active)

    def fair_share(self) -> int:
        """Unrolls one actor id may have queued: its equal part + 2 K. K, the run's envs per actor, is
        the burst an honest actor sends at once (one unroll per env, back to back), and one round may
        arrive while the last one still waits; K comes from the run's own settings, never a peer. The
        burst above the equal part never keeps another id under its equal part (``FairQueue.put``)."""
        burst = self.run_info.get("envs_per_worker")
        burst = burst if type(burst) is int and burst >= 1 else 1
        return self._equal_part() + 2 * burst

    def actor_report(self, top: int = 8) -> str:
        """The actors with the most accepted unrolls: count, seconds from first to last, rate."""
        rows = sorted(self.unrolls_by_actor.items(), key=lambda kv: -kv[1][0])[:top]
        return ", ".join(
            f"actor {a}: {int(n)} unrolls in {last - first:.1f}s ({n / max(last - first, 1e-9):.1f}/s, "
            f"{over} over its share)"
            for a, (n, first, last, over) in rows
        )

    def _expire_idle(self) -> bool:
        """Free the slots of accepted actors silent for ACTOR_IDLE_S (never a verified local one)."""
        now = time.monotonic()
        idle = [
            a
            for a in self.accepted
            if a not in self.protected_ids and now - self.last_seen.get(a, now) > ACTOR_IDLE_S
        ]
        for actor in idle:
            self.accepted.pop(actor, None)
            self.last_seen.pop(actor, None)
            self._forget_streams(actor)
        if idle:
            log.info("forgot %d actor(s) silent for more than %.0fs", len(idle), ACTOR_IDLE_S)
        return bool(idle)

    def _pack(self, version: int, arrays: Mapping[str, np.ndarray]) -> bytes:
        """A weights message: the arrays, the run, and the ids recently dropped as unknown or refused."""
        with self._stats_lock:
            unknown = list(self.unknown_recent)
            refused = [[a, nonce, reason] for a, (nonce, reason) in self.refused_recent.items()]
            self._reports_changed = False
        info = {"run": self.run_info, "unknown_actors": unknown, "refused_actors": refused}
        return wire.encode_packed("params", actor=0, version=version, arrays=arrays, info=info)

    def publish(self, version: int, arrays: Mapping[str, np.ndarray]) -> None:
        """Send the weights of ``version`` to every actor (and re-send them every second); with
        ``publish_delay`` d, keep them and send those given d calls before instead, if any (the first
        weights go out at once: actors wait for some before they start)."""
        if self.publish_delay and self._last_params is not None:
            self._held.append((version, {name: np.array(a, copy=True) for name, a in arrays.items()}))
            if len(self._held) <= self.publish_delay:
                return
            version, arrays = self._held.popleft()
        packed = self._pack(version, arrays)
        with self._pub_lock:
            self.published_version = version
            self._last_params = packed
            self.pub.send(packed, copy=False)

    def episode_record(self) -> dict[str, Any]:
        """The episode statistics as plain lists, for the checkpoint: a resumed run's curve and
        ``--stop-at-return`` go on from the same last 100 episodes instead of starting an empty window."""
        with self._stats_lock:
            return {
                "returns": [float(r) for r in self.episode_returns],
                "lengths": [int(n) for n in self.episode_lengths],
                "total": int(self.episodes_total),
                "task_returns": [[float(r) for r in q] for q in self.task_returns],
                "task_episodes": [int(n) for n in self.task_episodes],
            }

    def restore_episodes(self, record: Mapping[str, Any]) -> None:
        """Take back :meth:`episode_record`'s statistics; a record that does not fit this run (another task
        list, values that are not finite numbers: a checkpoint of an older version or edited by hand) is
        left out, with one log line, and the window starts empty as it did before records existed."""
        if not record:
            return

        def numbers(values: Any, kind: type) -> list[Any]:
            if not isinstance(values, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values
            ):
                raise ValueError("not a list of finite numbers")
            return [kind(v) for v in values]

        try:
            returns, lengths = numbers(record["returns"], float), numbers(record["lengths"], int)
            total, task_episodes = int(record["total"]), numbers(record["task_episodes"], int)
            task_returns = [numbers(q, float) for q in record["task_returns"]]
            if len(task_returns) != len(self.task_names) or len(task_episodes) != len(self.task_names):
                raise ValueError(f"{len(task_returns)} tasks there, {len(self.task_names)} here")
        except (KeyError, TypeError, ValueError) as e:
            log.warning("the checkpoint's episode statistics are left out (%s); the window starts empty", e)
            return
        with self._stats_lock:
            self.episode_returns.extend(returns)
            self.episode_lengths.extend(lengths)
            self.episodes_total = total
            for queue, values in zip(self.task_returns, task_returns):
                queue.extend(values)
            self.task_episodes = task_episodes

    def full_window_mean_return(self) -> float | None:
        """Mean return of the last 100 episodes; None until 100 episodes have finished."""
        with self._stats_lock:
            if len(self.episode_returns) < (self.episode_returns.maxlen or 0):
                return None
            return float(np.mean(self.episode_returns))

    def stats(self) -> dict[str, float]:
        with self._stats_lock:
            returns = list(self.episode_returns)
            out = {
                "transport/received": float(self.received),
                "transport/dropped": float(sum(self.dropped.values())),
                "transport/queue_depth": float(self.queue.qsize()),
                "charts/episodes": float(self.episodes_total),
            }
            for reason in DROP_REASONS:
                out[f"transport/dropped_{reason}"] = float(self.dropped.get(reason, 0))
            per_task = [
                (name, list(r), n)
                for name, r, n in zip(self.task_names, self.task_returns, self.task_episodes)
            ]
        if returns:
            out["charts/mean_return_100"] = float(np.mean(returns))
            out["charts/mean_length_100"] = float(np.mean(self.episode_lengths))
        for name, task_returns, episodes in per_task:
            out[f"tasks/{name}/episodes"] = float(episodes)
            if task_returns:
                out[f"tasks/{name}/mean_return_100"] = float(np.mean(task_returns))
        return out

    def task_mean_returns(self) -> dict[str, float]:
        """Each task's mean return over its last 100 episodes (tasks with none yet are left out)."""
        with self._stats_lock:
            return {name: float(np.mean(r)) for name, r in zip(self.task_names, self.task_returns) if r}

    def close(self) -> None:
        self._stop.set()
        for t in (self._thread, self._heartbeat):
            if t.is_alive():
                t.join(timeout=5)
        if getattr(self, "unrolls_by_actor", None):  # (absent when binding failed in __init__)
            log.info(
                "accepted unrolls by actor (top %d of %d): %s",
                min(8, len(self.unrolls_by_actor)),
                len(self.unrolls_by_actor),
                self.actor_report(),
            )
        with self._pub_lock:
            for s in (self.pull, self.pub):
                if not s.closed:
                    s.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
            self.auth = None

    def wait_for_hellos(
        self, n: int, timeout: float, check: Callable[[], None] = lambda: None, ids: set[int] | None = None
    ) -> None:
        """Wait until ``n`` actors said hello (accepted or refused), or ``n`` of ``ids`` did."""
        deadline = time.monotonic() + timeout
        while (len(ids) if ids is not None else len(self.accepted) + len(self.refused)) < n:
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(self.accepted)} of {n} actors said hello within {timeout:.0f}s"
                )
            time.sleep(0.05)
