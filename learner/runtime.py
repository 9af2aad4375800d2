"""The one place that wires the topology: actors -> transport -> batcher -> learner -> params.

``run(trainer, ...)`` is shared by both learners. A *trainer* is the
learner-specific part: its trajectory schema, the agent settings actors need,
how it ingests a validated unroll, when it is ready to update, and the update
itself. Everything else (sockets, actor supervision, the fingerprint guard,
metrics, checkpoints, shutdown) lives here once.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

import numpy as np

from actors.actor import Actor
from actors.loop import ActorConfig
from actors.pool import ActorPool
from impala import wire
from impala.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from impala.config import ConfigError
from impala.envs import EnvSpec
from impala.envs.fingerprint import EnvFingerprint, FingerprintMismatchError, compare_fingerprints
from impala.metrics import MetricsLogger
from impala.trajectory import TrajectorySchema
from learner.server import TrajectoryServer

log = logging.getLogger(__name__)


class Trainer(Protocol):
    schema: TrajectorySchema
    agent_settings: dict[str, Any]
    frames_per_step: float

    def ingest(self, msg: wire.Message, version: int) -> None: ...
    def ready(self) -> bool: ...
    def update(self, frames_done: int) -> dict[str, float]: ...
    def params(self) -> dict[str, np.ndarray]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@dataclass
class RunSettings:
    """The process-level settings shared by both launchers."""

    env: EnvSpec
    workers: int
    envs_per_worker: int
    unroll_length: int
    total_frames: int
    logdir: str
    seed: int = 0
    bind: str = "127.0.0.1"
    port: int = 0
    start_method: str = "spawn"
    queue_size: int = 64
    checkpoint_minutes: float = 10.0
    resume: bool = False
    progress: bool = True
    log_interval: float = 5.0
    max_seconds: float = 0.0
    stop_at_return: float | None = None  # stop once the full 100-episode mean return reaches it
    max_policy_lag: int | None = None  # None keeps all (V-trace corrects); 0 = on-policy only (PPO)
    title: str = "impala"
    config_record: dict[str, Any] = field(default_factory=dict)
    reference_fingerprint: EnvFingerprint | None = None
    hello_timeout: float = 180.0
    spawn_actors: bool = True
    actor_class: type = Actor  # an Actor subclass to start instead (custom envs or instrumentation)
    curve_dir: str | None = None  # CURVE keys directory: authenticate and encrypt actor traffic
    insecure_bind: bool = False  # allow a non-loopback bind without CURVE
    in_process: bool = False  # serial mode: actors run as threads of this process (same code, same sockets)

    @property
    def checkpoint_path(self) -> str:
        return os.path.join(self.logdir, "checkpoint.pt")


@dataclass
class RunResult:
    env_frames: int
    updates: int
    mean_return: float | None
    dropped: dict[str, int]
    restarts: int
    interrupted: bool
    checkpoint: str
    reached_return: bool = False  # stopped early at settings.stop_at_return


class _Stop:
    """Ctrl-C / SIGTERM flag: the main loop finishes its update, checkpoints and exits."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_Stop":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.event.is_set():  # a second Ctrl-C: stop waiting
            raise KeyboardInterrupt
        log.warning("signal %d: stopping after the current update (press again to force)", signum)
        self.event.set()

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class ThreadActors:
    """Serial/debug mode: the same actor loop in threads of the learner process."""

    def __init__(self, configs: list[ActorConfig]) -> None:
        self.configs = configs
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.restarts = 0
        self.errors: list[BaseException] = []

    def _target(self, config: ActorConfig) -> None:
        from actors.loop import run_actor

        try:
            run_actor(config, stop_event=self.stop_event)
        except BaseException as e:  # surfaced by supervise(): a thread cannot be restarted like a process
            self.errors.append(e)

    def start(self) -> None:
        self.threads = [threading.Thread(target=self._target, args=(c,), name=f"actor-{c.actor_id}", daemon=True) for c in self.configs]
        for t in self.threads:
            t.start()

    def supervise(self) -> list[int]:
        if self.errors:
            raise RuntimeError(f"in-process actor failed: {self.errors[0]!r}") from self.errors[0]
        return []

    def stop(self, timeout: float = 10.0) -> None:
        self.stop_event.set()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))


def run(trainer: Trainer, settings: RunSettings) -> RunResult:
    """Train until ``total_frames``, ``max_seconds`` or a signal. Returns a summary."""
    env_frames = 0
    version = 0
    if settings.resume:
        state = load_checkpoint(settings.checkpoint_path, keys=("trainer", "env_frames", "version"))
        try:
            trainer.load_state_dict(state["trainer"])
            env_frames = int(state["env_frames"])
            version = int(state["version"])
        except (KeyError, RuntimeError, ValueError, TypeError, IndexError) as e:
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"checkpoint {settings.checkpoint_path} does not fit this run (another env or network?): {first}") from None
        log.info("resumed from %s at %d env frames, policy version %d", settings.checkpoint_path, env_frames, version)
    start_version = version

    reference = settings.reference_fingerprint
    # Ids below --workers belong to this learner's own actors. A peer that merely reaches the port
    # could send a hello as actor 0; only the actors spawned here know this run's token.
    local_token = secrets.token_hex(16)
    verified_local: set[int] = set()  # local ids whose hello carried the token
    local_refusals: dict[int, str] = {}  # verified local actors whose env differs: stop the run

    def on_hello(actor: int, info: Mapping[str, Any]) -> str | None:
        local = settings.spawn_actors and 0 <= actor < settings.workers
        if local:
            token = info.get("local_token")
            if not (isinstance(token, str) and hmac.compare_digest(token, local_token)):
                return f"actor id {actor} is reserved for this learner's local actors and the hello has no valid local token"
        reason = fingerprint_problem(info)
        if local:
            verified_local.add(actor)
            if reason is not None:
                local_refusals[actor] = reason
        return reason

    def fingerprint_problem(info: Mapping[str, Any]) -> str | None:
        # The runtime guard of SEEDS.md part 1: a worker must never train on other dynamics.
        if reference is None:
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

    client_keys = None
    if settings.curve_dir:
        from impala.curve import prepare_server

        client_keys = prepare_server(settings.curve_dir)
    elif settings.bind not in ("127.0.0.1", "localhost", "::1") and not settings.insecure_bind:
        raise ConfigError(
            f"--bind {settings.bind} without --curve would let anyone who can reach the port send trajectories and read "
            "weights; pass --curve DIR (see README, Security), or --insecure-bind on a network you trust"
        )
    server = TrajectoryServer(
        trainer.schema, bind=settings.bind, port=settings.port, queue_size=settings.queue_size, on_hello=on_hello, curve_dir=settings.curve_dir,
        validate=getattr(trainer, "validate", None), protected_ids=verified_local, local_token=local_token,
    )
    # Remote actors (impala-actors) learn what to run from this, sent with every weights message.
    server.run_info = {
        "run_id": uuid.uuid4().hex,  # a new learner process: remote actors say hello again
        "env": {"id": settings.env.id, "kwargs": settings.env.kwargs, "preprocess": settings.env.preprocess},
        "agent": trainer.agent_settings,
        "unroll_length": settings.unroll_length,
        "envs_per_worker": settings.envs_per_worker,
    }
    configs = [
        ActorConfig(
            actor_id=i,
            env=settings.env,
            num_envs=settings.envs_per_worker,
            unroll_length=settings.unroll_length,
            trajectory_endpoint=server.trajectory_endpoint,
            params_endpoint=server.params_endpoint,
            agent=trainer.agent_settings,
            seed=settings.seed + 1000 * i,
            curve=client_keys,
            local_token=local_token,
        )
        for i in range(settings.workers)
    ]
    pool = ThreadActors(configs) if settings.in_process else ActorPool(configs, start_method=settings.start_method, actor_class=settings.actor_class)
    logger = MetricsLogger(settings.logdir, progress=settings.progress, title=settings.title)
    interrupted = reached_return = False
    start = time.monotonic()
    last_ckpt = time.monotonic()
    last_log = time.monotonic()
    frames_at_last_log = env_frames
    lags: list[float] = []
    metrics: dict[str, float] = {}

    def checkpoint() -> None:
        try:
            save_checkpoint(
                settings.checkpoint_path,
                {"trainer": trainer.state_dict(), "env_frames": env_frames, "version": version, "config": settings.config_record},
            )
        except CheckpointError as e:  # diverged weights: keep the last good checkpoint
            log.error("%s; the previous checkpoint is kept", e)

    def check_refusals() -> None:
        # A refused *local* actor (one that proved it is ours) means this run is misconfigured: stop
        # before training. Any other refused hello is only kept out; its data is dropped and counted.
        if local_refusals:
            actor, reason = next(iter(local_refusals.items()))
            raise FingerprintMismatchError(
                f"actor {actor}'s environment differs from the learner's: {reason}. Refusing to train on different dynamics."
            )

    try:
        server.start()
        if settings.spawn_actors:
            pool.start()
            log.info("started %d actors (%s) -> %s", settings.workers, "threads" if settings.in_process else settings.start_method, server.trajectory_endpoint)

            # Every local actor must pass the fingerprint guard before any weights go out. Actors
            # send no unroll before they have weights, so no hello can queue behind unrolls here.
            def during_wait() -> None:
                check_refusals()
                pool.supervise()

            # count only hellos that proved to be from our actors: a forged one must not end the wait
            server.wait_for_hellos(settings.workers, settings.hello_timeout, check=during_wait, ids=verified_local)
            check_refusals()
        server.publish(version, trainer.params())
        with _Stop() as stop:
            while env_frames < settings.total_frames and not stop.event.is_set():
                if settings.max_seconds and time.monotonic() - start > settings.max_seconds:
                    break
                check_refusals()
                if not server.healthy():
                    raise RuntimeError("the learner's receive thread died; see the log above")
                if settings.spawn_actors:
                    pool.supervise()
                msg = server.get(timeout=0.1)
                if msg is None:
                    continue
                lag = version - msg.version
                if settings.max_policy_lag is not None and lag > settings.max_policy_lag:
                    server.count_stale()
                    continue
                lags.append(lag)
                trainer.ingest(msg, version)
                env_frames += int(round(settings.unroll_length * trainer.frames_per_step))
                if not trainer.ready():
                    continue
                metrics = trainer.update(env_frames)
                version += 1
                server.publish(version, trainer.params())
                now = time.monotonic()
                if now - last_log >= settings.log_interval:
                    row = dict(metrics)
                    row.update(server.stats())
                    row["charts/env_frames"] = env_frames
                    row["charts/fps"] = (env_frames - frames_at_last_log) / (now - last_log)
                    row["charts/policy_lag"] = float(np.mean(lags)) if lags else 0.0
                    row["charts/policy_version"] = version
                    row["charts/actor_restarts"] = pool.restarts
                    logger.log(env_frames, row)
                    frames_at_last_log, last_log, lags = env_frames, now, []
                if now - last_ckpt >= settings.checkpoint_minutes * 60:
                    checkpoint()
                    last_ckpt = now
                if settings.stop_at_return is not None:
                    mean = server.full_window_mean_return()
                    if mean is not None and mean >= settings.stop_at_return:
                        log.info("mean return of the last 100 episodes %.2f reached --stop-at-return %g", mean, settings.stop_at_return)
                        reached_return = True
                        break
            interrupted = stop.event.is_set()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        pool.stop()
        server.close()
        try:
            if version > start_version:  # never overwrite a good checkpoint with an untrained model
                checkpoint()
        finally:
            logger.close()
    stats = server.stats()
    return RunResult(
        env_frames=env_frames,
        updates=version,
        mean_return=stats.get("charts/mean_return_100"),
        dropped={k: int(v) for k, v in server.dropped.items()},
        restarts=pool.restarts,
        interrupted=interrupted,
        checkpoint=settings.checkpoint_path,
        reached_return=reached_return,
    )
