"""The learner's transport: ZeroMQ sockets and the receive thread.

PULL receives trajectories from every actor (PUSH); a PUB socket broadcasts
versioned parameters. The receive thread validates each message against the
schema before it reaches the learner and drops (and counts, per reason and
actor) anything malformed, oversized, off-schema or non-finite. It never lets a
bad message raise out of the thread. Valid unrolls go into a bounded queue: when
the learner falls behind, the queue fills, the thread stops reading, and
ZeroMQ's high-water marks push back on the actors.

Who may feed the learner (hellos, client keys, the fair share, what an unroll must fit) is decided by
the pure policy in ``learner.serve.admission``; this module receives, decodes, counts and queues, and asks it.
Nothing a peer claims steers the learner's statistics: episode returns and lengths are summed by
``learner.serve.episode_stats`` from the rewards and episode ends of accepted unrolls.
"""

from __future__ import annotations

import collections
import errno
import logging
import queue
import threading
import time
from typing import Any, Callable, Mapping

import numpy as np
import zmq

from impala.run.metrics import log_this_one
from impala.transport import wire
from impala.transport.curve import make_server_socket, start_authenticator
from impala.transport.trajectory import TrajectorySchema
from learner.serve.admission import ACTOR_IDLE_S, DROP_REASONS, Admission, Decision
from learner.serve.episode_stats import EpisodeStats

log = logging.getLogger(__name__)


class PortInUseError(RuntimeError):
    """The port the learner must bind is taken (a user can fix it: another --port)."""

    pass


def _source(frames: list) -> int | None:
    """The file descriptor of the connection a received message came over (ZeroMQ's SRCFD), or None for
    frames that did not come from a socket."""
    try:
        return int(frames[0].get(zmq.SRCFD))
    except (AttributeError, TypeError, ValueError, zmq.ZMQError):
        return None


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
    """Owns the learner's sockets and receive thread; :class:`Admission` decides who may feed the learner
    and :class:`EpisodeStats` counts the episodes of what it accepted.

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
        (``task``); episode returns are also kept per task. ``protected_ids`` and ``local_token``: the
        verified local actors and their token (:class:`Admission`)."""
        self.auth = None
        self.task_names = tuple(task_names)
        if self.task_names and task_of is None:
            task_of = lambda actor, env: actor % len(self.task_names)  # noqa: E731
        self.admission = Admission(
            on_hello, protected_ids=protected_ids, local_token=local_token,
            task_of=task_of if self.task_names else None,
        )  # fmt: skip
        self.episodes = EpisodeStats(self.task_names)
        self.validate = validate or (lambda arrays: None)
        self.schema = schema
        self.max_bytes = schema.nbytes + 1024
        # Guards what the learner's thread reads while the receive thread writes: the drop counts and the
        # admission's reports (unknown and refused ids) that go into the weights message.
        self._stats_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive_loop, name="trajectory-receiver", daemon=True)
        # The newest weights message, re-sent every second for late joiners (restarted or remote
        # actors: PUB drops messages for absent subscribers) and as the learner's heartbeat, even
        # while the main thread is busy in a long update. The lock gives the PUB socket one user at a time.
        self._pub_lock = threading.Lock()
        self._last_params: bytes | None = None
        self.publish_delay = publish_delay
        # --publish-delay: the newest weights not sent yet, oldest first, as copies (the learner's arrays
        # are views of weights the next optimizer step changes in place)
        self._held: collections.deque[tuple[int, dict[str, np.ndarray]]] = collections.deque()
        self._heartbeat = threading.Thread(target=self._republish_loop, name="weights-heartbeat", daemon=True)
        self._open_sockets(schema, bind, port, rcv_hwm, curve_dir)
        self.queue = FairQueue(queue_size)
        self.dropped: collections.Counter[str] = collections.Counter()
        self.received = 0

    def _open_sockets(
        self, schema: TrajectorySchema, bind: str, port: int, rcv_hwm: int, curve_dir: str | None
    ) -> None:
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

    # ---- what the admission knows, as the run reads it --------------------
    @property
    def accepted(self) -> dict[int, dict[str, Any]]:
        """Accepted actor id -> what the learner kept of its hello."""
        return self.admission.accepted

    @property
    def refused(self) -> Mapping[int, str]:
        """Refused actor id -> why (the newest MAX_REFUSED)."""
        return self.admission.refused

    @property
    def refused_hellos(self) -> int:
        """Hellos refused so far (ignored ones in a verified local actor's name included)."""
        return self.admission.refused_hellos

    @property
    def run_info(self) -> dict[str, Any]:
        """The run as remote actors see it (``RunInfo.for_remote_actors``), sent with the weights."""
        return self.admission.run_info

    @run_info.setter
    def run_info(self, info: dict[str, Any]) -> None:
        self.admission.run_info = info

    @property
    def published_version(self) -> int:
        """The newest weights' version sent; unrolls claiming a later one are dropped."""
        return self.admission.published_version

    # ---- receive thread -------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._heartbeat.start()

    def _republish_loop(self) -> None:
        while not self._stop.wait(1.0):
            for actor, silent_s in self.admission.newly_silent(time.monotonic()):
                log.info("actor %d left? nothing from it for %.0f s", actor, silent_s)
            with self._stats_lock:
                changed, self.admission.reports_changed = self.admission.reports_changed, False
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

    def _drop(self, reason: str, actor: Any, detail: str) -> None:
        with self._stats_lock:
            self.dropped[reason] += 1
            n = self.dropped[reason]
        # Log the first few of each reason, then every 1000th: a flood must not flood the log too.
        if log_this_one(n):
            log.warning("dropped message from actor %s (%s, #%d of this kind): %s", actor, reason, n, detail)

    def _dropped(self, decision: Decision, actor: int, info: Mapping[str, Any]) -> bool:
        """Act on an admission decision: count (and log) a drop, mark the stream's gap; True if dropped."""
        if decision.drop is None:
            return False
        if decision.quiet:
            with self._stats_lock:
                self.dropped[decision.drop] += 1
        else:
            self._drop(decision.drop, actor, decision.detail)
        if decision.warn is not None:
            log.warning("%s", decision.warn)
        if decision.lose_episode:
            self.episodes.lose(actor, info.get("env", 0))
        return True

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
        actor, kind, info = header["actor"], header["kind"], header["info"]
        size = sum(len(f.buffer) if hasattr(f, "buffer") else len(f) for f in frames[1:])
        if size > self.max_bytes:
            self._drop("oversized", actor, f"{size} payload bytes > {self.max_bytes}")
            return
        with self._stats_lock:  # a wrong-key hello is told back in the weights message
            decision = self.admission.check_key(actor, kind, info, user)
        if self._dropped(decision, actor, info):
            return
        if kind == "hello":
            self._hello(actor, info, user)
        elif kind == "unroll":
            self._unroll(frames, actor, info)
        else:
            self._drop("unexpected_kind", actor, kind)

    def _hello(self, actor: int, info: Mapping[str, Any], user: str | None) -> None:
        """Accept or refuse an actor id (``Admission.hello``) and restart or forget its episode streams."""
        with self._stats_lock:  # a refusal is told back in the weights message
            outcome = self.admission.hello(actor, info, user, time.monotonic())
        for expired in outcome.expired:
            self.episodes.forget(expired)
        if outcome.expired:
            log.info("forgot %d actor(s) silent for more than %.0fs", len(outcome.expired), ACTOR_IDLE_S)
        count = self.admission.refused_hellos
        if outcome.verdict == "dropped":
            self._drop(outcome.drop or "unknown_actor", actor, outcome.reason)
        elif outcome.verdict == "accepted":
            if outcome.joined and log_this_one(self.admission.joined, first=100):
                num_envs = self.admission.accepted[actor].get("num_envs", "?")
                log.info("actor %d joined (%s envs; #%d)", actor, num_envs, self.admission.joined)
            if outcome.back:
                log.info("actor %d is back", actor)
            self.episodes.restart(actor, outcome.fresh)
        elif outcome.verdict == "ignored":
            if log_this_one(count):
                log.error(
                    "ignored a hello in the name of verified actor %d (#%d refused hello): %s",
                    actor,
                    count,
                    outcome.reason[:300],
                )
        else:
            self.episodes.forget(actor)
            if log_this_one(count):  # each line cut to 300 characters
                log.error("refused actor %d (#%d refused hello): %s", actor, count, outcome.reason[:300])

    def _unroll(self, frames: list, actor: int, info: Mapping[str, Any]) -> None:
        """An unroll: admitted (known sender, within its share), decoded, checked, counted, then queued."""
        with self._stats_lock:  # an unknown id is told back in the weights message
            decision = self.admission.known_sender(actor, info)
        if self._dropped(decision, actor, info):
            return
        decision = self.admission.within_share(
            actor,
            info,
            _source(frames),
            lambda: self.queue.queued(actor),
            self.fair_share(),
            time.monotonic(),
        )
        if self._dropped(decision, actor, info):
            return
        msg = self._decoded(frames, actor, info)
        if msg is None:
            return
        task = int(msg.arrays["task"][0]) if self.task_names else 0
        if self._dropped(self.admission.after_decoding(actor, msg.info, task, msg.version), actor, msg.info):
            return
        now = time.monotonic()
        if self.admission.seen(actor, now):
            log.info("actor %d is back", actor)
        self.episodes.add(actor, msg.info.get("env", 0), task, msg.arrays)
        self.admission.count_accepted(actor, now)
        while not self._stop.is_set():
            try:
                self.queue.put(msg, timeout=0.1, guaranteed=self._equal_part(), cap=self.fair_share())
                return
            except queue.Full:
                continue

    def _decoded(self, frames: list, actor: int, info: Mapping[str, Any]) -> wire.Message | None:
        """The unroll decoded against the schema, finite and passing the learner's own value checks; None
        (dropped, counted, and its stream's episode marked as lost) otherwise."""
        try:
            msg = wire.decode(frames, schema=self.schema, max_bytes=self.max_bytes)
        except wire.WireError as e:
            reason, detail = "schema", str(e)
        else:
            info = msg.info
            bad = wire.check_finite(msg.arrays)
            problem = self.validate(msg.arrays) if bad is None else None
            if bad is None and problem is None:
                return msg
            reason, detail = (
                ("non_finite", f"{bad} holds NaN/inf") if bad is not None else ("schema", problem)
            )
        self._drop(reason, actor, detail)
        if self.admission.owns_stream(actor, info):
            self.episodes.lose(actor, info.get("env", 0))
        return None

    # ---- learner side ---------------------------------------------------
    def get(self, timeout: float | None = None) -> wire.Message | None:
        """The next queued unroll (round-robin across actors), or None after ``timeout`` seconds."""
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def _equal_part(self) -> int:
        """The queued unrolls every id is sure of (``Admission.equal_part``; ``FairQueue.put`` queues them
        even when the queue is full)."""
        return self.admission.equal_part(time.monotonic(), self.queue.maxsize, self.queue.waiting_ids)

    def fair_share(self) -> int:
        """Unrolls one actor id may have queued (``Admission.fair_share``). The burst above the equal part
        never keeps another id under its equal part (``FairQueue.put``)."""
        return self.admission.fair_share(self._equal_part())

    def actor_report(self, top: int = 8) -> str:
        """The actors with the most accepted unrolls: count, seconds from first to last, rate."""
        return self.admission.actor_report(top)

    def _pack(self, version: int, arrays: Mapping[str, np.ndarray]) -> bytes:
        """A weights message: the arrays, the run, and the ids recently dropped as unknown or refused."""
        with self._stats_lock:
            unknown, refused = self.admission.reports()
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
            self.admission.published_version = version
            self._last_params = packed
            self.pub.send(packed, copy=False)

    def episode_record(self) -> dict[str, Any]:
        """The episode statistics as plain lists, for the checkpoint (``EpisodeStats.record``)."""
        return self.episodes.record()

    def restore_episodes(self, record: Mapping[str, Any]) -> None:
        """Take back :meth:`episode_record`'s statistics (``EpisodeStats.restore``)."""
        self.episodes.restore(record)

    def full_window_mean_return(self) -> float | None:
        """Mean return of the last 100 episodes; None until 100 episodes have finished."""
        return self.episodes.full_window_mean_return()

    def stats(self) -> dict[str, float]:
        """The transport's counts and the episode statistics, for a log row."""
        episodes = self.episodes.stats()
        with self._stats_lock:
            out = {
                "transport/received": float(self.received),
                "transport/dropped": float(sum(self.dropped.values())),
                "transport/queue_depth": float(self.queue.qsize()),
                "charts/episodes": episodes.pop("charts/episodes"),
            }
            for reason in DROP_REASONS:
                out[f"transport/dropped_{reason}"] = float(self.dropped.get(reason, 0))
        out.update(episodes)
        return out

    def task_mean_returns(self) -> dict[str, float]:
        """Each task's mean return over its last 100 episodes (tasks with none yet are left out)."""
        return self.episodes.task_mean_returns()

    def close(self) -> None:
        self._stop.set()
        for t in (self._thread, self._heartbeat):
            if t.is_alive():
                t.join(timeout=5)
        report = getattr(self, "admission", None)
        if report is not None and report.unrolls_by_actor:
            log.info(
                "accepted unrolls by actor (top %d of %d): %s",
                min(8, len(report.unrolls_by_actor)),
                len(report.unrolls_by_actor),
                report.actor_report(),
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
