"""The one place that wires a run: actors -> transport -> learner -> weights back to the actors.

:func:`run` is shared by both learners. A *trainer* (``vtrace_learner.ImpalaTrainer``,
``ppo_learner.PPOTrainer``) is the learner-specific part: its trajectory schema, the agent spec actors
run, how it ingests a validated unroll, when it is ready to update, and the update itself. The rest
is built from named parts, each testable alone: the transport (``learner.server``), the actors
(``actors.pool``, configured by ``actors.loop.actor_configs``), the fingerprint guard
(``learner.guard``), the budget (``learner.budget``), counters, resume and checkpoints
(``learner.checkpointer``), log rows (``learner.log_rows``) and periodic evaluation
(``learner.periodic_eval``).

The run's types, and which is which:

- ``RunConfig`` (``impala.run.config``): the process-level flags every entry point shares.
- :class:`RunPlan`: what a launcher resolved beyond those flags (the probed env, a title, the record
  stored in checkpoints).
- ``RunInfo`` (``impala.transport.messages``): what actors must know to join (env, agent, unroll
  length), sent with every weights message.
- ``ActorConfig`` (``actors.loop``): one actor's settings, made from a ``RunInfo``.
- ``Progress`` (``learner.checkpointer``): what the run has done (frames, steps, version).
- :class:`RunResult`: the summary :func:`run` returns.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

import numpy as np

from actors.actor import Actor
from actors.loop import actor_configs
from actors.pool import ActorPool, ThreadActors
from impala.envs import UnknownEnvError
from impala.envs.fingerprint import FingerprintMismatchError
from impala.envs.probe import EnvInfo
from impala.run.checkpoint import CheckpointError
from impala.run.config import ConfigError, RunConfig
from impala.run.metrics import MetricsLogger
from impala.run.tracking import WandbTracker
from impala.transport import wire
from impala.transport.curve import prepare_server
from impala.transport.messages import AgentSpec, RunInfo
from impala.transport.trajectory import TrajectorySchema
from learner.budget import Budget
from learner.checkpointer import Checkpointer, Progress, RunFinished, resume
from learner.guard import FingerprintGuard
from learner.log_rows import LogRows
from learner.periodic_eval import PeriodicEval
from learner.server import PortInUseError, TrajectoryServer

log = logging.getLogger(__name__)

# Bad input a user can fix, found while a run starts: each is reported as one line, exit 2.
START_ERRORS = (
    ConfigError,
    CheckpointError,
    UnknownEnvError,
    PortInUseError,
    FingerprintMismatchError,
    FileNotFoundError,
    TimeoutError,
)

__all__ = ["START_ERRORS", "RunFinished", "RunPlan", "RunResult", "Trainer", "run"]


class Trainer(Protocol):
    """The learner-specific part of a run (``vtrace_learner.ImpalaTrainer``, ``ppo_learner.PPOTrainer``)."""

    schema: TrajectorySchema  # what every unroll must hold
    agent: AgentSpec  # what the actors run
    frames_per_step: float  # env frames per agent step
    queue_size: int  # unrolls the server buffers
    device: Any

    def validate(self, arrays: Mapping[str, np.ndarray]) -> str | None: ...
    def ingest(self, msg: wire.Message, version: int) -> Any: ...
    def ready(self) -> bool: ...
    def update(self, frames_done: int) -> dict[str, float]: ...  # ``losses/`` and ``charts/`` keys
    def params(self) -> dict[str, np.ndarray]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...
    def close(self) -> None: ...  # the run is over (a learner group's followers are released)


@dataclass(frozen=True)
class RunPlan:
    """What a launcher resolved for this run beyond its :class:`RunConfig` flags."""

    env: EnvInfo  # the probed env: its spec goes to the actors, its fingerprint is the reference
    title: str
    config_record: dict[str, Any] = field(default_factory=dict)  # stored in every checkpoint
    hello_timeout: float = 180.0
    actor_class: type = Actor  # an Actor subclass to start instead (custom envs or instrumentation)
    tasks: tuple[
        EnvInfo, ...
    ] = ()  # a multi-task run's envs in task order (``env`` is the first); actor i runs task i % N


@dataclass
class RunResult:
    """The summary of a finished :func:`run`."""

    env_frames: int
    agent_steps: int
    updates: int
    mean_return: float | None
    dropped: dict[str, int]
    restarts: int
    interrupted: bool
    checkpoint: str  # its path if one exists, else ""
    reached_return: bool = False  # stopped early at --stop-at-return


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


def run(trainer: Trainer, config: RunConfig, plan: RunPlan) -> RunResult:
    """Train until the step budget (``total_frames`` / ``total_steps``), ``max_seconds``, ``stop_at_return``
    or a signal. Returns a summary."""
    budget = Budget(config)  # refuses a run without a step budget
    config = config.with_run_folder(
        plan.env.spec.id
    )  # launchers resolve it; callers of run() may leave it to us
    tasks = plan.tasks or (plan.env,)
    task_names = tuple(t.spec.id for t in tasks) if len(tasks) > 1 else ()
    progress = resume(trainer, config, tasks) if config.resume else Progress(task_frames=[0] * len(tasks))
    guard = FingerprintGuard(tasks, local_workers=config.workers)
    run_id = uuid.uuid4().hex  # a new learner process: remote actors say hello again
    tracker = None
    if config.track:  # before any socket is bound: a tracker that cannot start is a start-up error
        tracker = WandbTracker(
            project=config.track_project,
            logdir=config.logdir,
            name=f"{plan.title} {run_id[:8]}",
            config=plan.config_record,
            resume=config.resume,
        )
    # RunConfig already refused a public bind without --curve or --insecure-bind.
    client_keys = prepare_server(config.curve) if config.curve else None
    server = TrajectoryServer(
        trainer.schema,
        bind=config.bind,
        port=config.port,
        queue_size=config.queue_size or trainer.queue_size,
        on_hello=guard.on_hello,
        curve_dir=config.curve or None,
        validate=trainer.validate,
        protected_ids=guard.verified_local,
        local_token=guard.local_token,
        task_names=task_names,
    )
    # What actors run; remote actors (impala-actors) read it from every weights message.
    run_info = RunInfo(
        run_id,
        plan.env.spec,
        trainer.agent,
        config.unroll_length,
        config.envs_per_worker,
        tuple(t.spec for t in tasks) if task_names else (),
    )
    server.run_info = run_info.to_dict()
    local = actor_configs(
        run_info,
        range(config.workers),
        trajectory_endpoint=server.trajectory_endpoint,
        params_endpoint=server.params_endpoint,
        seed=config.seed,
        curve=client_keys,
        local_token=guard.local_token,
    )
    pool = (
        ThreadActors(local)
        if config.in_process
        else ActorPool(local, start_method=config.start_method, actor_class=plan.actor_class)
    )
    logger = MetricsLogger(
        config.logdir,
        progress=config.progress,
        title=plan.title,
        tracker=tracker,
        time_offset_s=progress.elapsed_s,
        config_record=plan.config_record,
    )
    evaluator = PeriodicEval(config, run_info)
    checkpointer = Checkpointer(
        config, trainer, run_info, plan.config_record, progress, resuming=config.resume
    )
    interrupted = False
    try:
        server.start()
        _start_actors(pool, server, guard, config, plan.hello_timeout)
        with _Stop() as stop:
            _train(
                trainer,
                config,
                server,
                pool,
                guard,
                budget,
                progress,
                checkpointer,
                logger,
                evaluator,
                stop.event,
            )
            interrupted = stop.event.is_set()
        if not interrupted:
            _log_eval(
                logger, progress, evaluator.finish(), checkpointer
            )  # the last evaluation belongs to this run's record
    except KeyboardInterrupt:
        interrupted = True
    finally:
        checkpoint = _shut_down(
            trainer,
            evaluator,
            pool,
            server,
            checkpointer,
            logger,
            finished=budget.spent(progress.env_frames, progress.agent_steps),
        )
    return RunResult(
        env_frames=progress.env_frames,
        agent_steps=progress.agent_steps,
        updates=progress.version,
        mean_return=server.stats().get("charts/mean_return_100"),
        dropped={k: int(v) for k, v in server.dropped.items()},
        restarts=pool.restarts,
        interrupted=interrupted,
        checkpoint=checkpoint,
        reached_return=budget.reached_return,
    )


def _start_actors(
    pool: Any, server: TrajectoryServer, guard: FingerprintGuard, config: RunConfig, hello_timeout: float
) -> None:
    """Say where actors connect; start the local actors and wait until each passed the fingerprint guard."""
    keys = (
        f"; actors need the learner's public key {os.path.join(config.curve, 'server.key')}"
        if config.curve
        else ""
    )
    log.info(
        "learner listening: trajectories %s, weights %s%s",
        server.trajectory_endpoint,
        server.params_endpoint,
        keys,
    )
    if not config.workers:
        log.info(
            "no local actors: waiting for remote ones (impala-actors --learner %s)",
            server.trajectory_endpoint,
        )
        return
    pool.start()
    log.info(
        "started %d actors (%s) -> %s",
        config.workers,
        "threads" if config.in_process else config.start_method,
        server.trajectory_endpoint,
    )

    def during_wait() -> None:
        guard.check()
        pool.supervise()

    # Actors send no unroll before they have weights, so no hello can queue behind unrolls here; only hellos
    # that proved to be from our actors count (a forged one must not end the wait).
    server.wait_for_hellos(config.workers, hello_timeout, check=during_wait, ids=guard.verified_local)
    guard.check()


def _train(
    trainer: Trainer,
    config: RunConfig,
    server: TrajectoryServer,
    pool: Any,
    guard: FingerprintGuard,
    budget: Budget,
    progress: Progress,
    checkpointer: Checkpointer,
    logger: MetricsLogger,
    evaluator: PeriodicEval,
    stop: threading.Event,
) -> None:
    """The learner's loop: take a validated unroll, update when the trainer is ready, publish, log,
    checkpoint."""
    # the first interval counts from the run's start (actor start-up included), so a short run still logs a
    # row
    rows = LogRows(config.log_interval, server.task_names, progress.env_frames, since=budget.start)
    frames_per_unroll = int(round(config.unroll_length * trainer.frames_per_step))
    metrics: dict[str, float] = {}
    server.publish(progress.version, trainer.params())
    while not (
        budget.spent(progress.env_frames, progress.agent_steps) or stop.is_set() or budget.out_of_time()
    ):
        guard.check()
        if not server.healthy():
            raise RuntimeError("the learner's receive thread died; see the log above")
        if config.workers:
            pool.supervise()
        msg = server.get(timeout=0.1)
        if msg is None:
            continue
        lag = progress.version - msg.version
        if config.max_policy_lag is not None and lag > config.max_policy_lag:
            server.count_stale()
            continue
        rows.lags.append(lag)
        trainer.ingest(msg, progress.version)
        progress.agent_steps += config.unroll_length
        progress.env_frames += frames_per_unroll
        if server.task_names:
            progress.task_frames[int(msg.arrays["task"][0])] += frames_per_unroll
        if not trainer.ready():
            continue
        metrics = trainer.update(progress.env_frames)
        progress.version += 1
        params = trainer.params()
        server.publish(progress.version, params)
        if evaluator.maybe_start(progress.env_frames, params):
            checkpointer.remember_evaluated(progress.env_frames)  # best.pt must hold the weights evaluated
        _log_eval(logger, progress, evaluator.poll(), checkpointer)
        if rows.due():
            logger.log(
                progress.env_frames,
                rows.row(progress, metrics, server.stats(), server.task_mean_returns(), pool.restarts),
            )
        checkpointer.maybe_save()
        if budget.return_reached(server.full_window_mean_return()):
            break


def _log_eval(
    logger: MetricsLogger,
    progress: Progress,
    evaluated: tuple[int, dict[str, float], str] | None,
    checkpointer: Checkpointer,
) -> None:
    """Log a finished evaluation (at today's step: trackers want steps in order; the snapshot's frames ride
    along) and keep the best weights so far as ``best.pt``."""
    if evaluated is None:
        return
    at, row, video = evaluated
    logger.log(progress.env_frames, {**row, "eval/at_frames": float(at)})
    if video and logger.tracker is not None and os.path.exists(video):
        logger.tracker.log_video(progress.env_frames, "eval/video", video)
    checkpointer.consider_best(row.get("eval/mean_return"), at)


def _shut_down(
    trainer: Trainer,
    evaluator: PeriodicEval,
    pool: Any,
    server: TrajectoryServer,
    checkpointer: Checkpointer,
    logger: MetricsLogger,
    *,
    finished: bool,
) -> str:
    """Release everything, in an order that leaves no child process behind; returns the checkpoint path (""
    if none)."""
    try:
        trainer.close()
    except Exception as e:  # noqa: BLE001 - a follower that is gone must not cost the final checkpoint
        log.error("releasing the learner group failed: %s", e)
    evaluator.stop()
    pool.stop()
    server.close()
    try:
        return checkpointer.final(finished=finished)
    finally:
        logger.close()
