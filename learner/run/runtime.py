"""The one place that wires a run: actors -> transport -> learner -> weights back to the actors.

:func:`run` is shared by both learners. A *trainer* (``vtrace_learner.ImpalaTrainer``,
``ppo_learner.PPOTrainer``) is the learner-specific part: its trajectory schema, the agent spec actors
run, how it ingests a validated unroll, when it is ready to update, and the update itself. The rest
is built from named parts, each testable alone: the transport (``learner.serve.server``), the actors
(``actors.pool``, configured by ``actors.loop.actor_configs``), the fingerprint guard
(``learner.run.guard``), the budget (``learner.run.budget``), counters, resume and checkpoints
(``learner.run.checkpointer``), log rows (``learner.run.log_rows``) and periodic evaluation
(``learner.run.periodic_eval``).

The run's types, and which is which:

- ``RunConfig`` (``impala.run.config``): the process-level flags every entry point shares.
- :class:`RunPlan`: what a launcher resolved beyond those flags (the probed env, a title, the record
  stored in checkpoints).
- ``RunInfo`` (``impala.transport.messages``): what actors must know to join (env, agent, unroll
  length), sent with every weights message.
- ``ActorConfig`` (``actors.loop``): one actor's settings, made from a ``RunInfo``.
- ``Progress`` (``learner.run.checkpointer``): what the run has done (frames, steps, version).
- :class:`RunResult`: the summary :func:`run` returns.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Protocol

import numpy as np

from actors.actor import Actor
from actors.loop import actor_configs
from actors.pool import START_FAILURES, ActorPool, ThreadActors
from impala.envs import UnknownEnvError
from impala.envs.fingerprint import FingerprintMismatchError
from impala.envs.probe import EnvInfo
from impala.options import ConfigError
from impala.run.checkpoint import CheckpointError
from impala.run.config import RunConfig, resolve_device
from impala.run.cpus import CpuClaim, available_cpus, pin_process, split_cpus
from impala.run.metrics import MetricsLogger
from impala.run.tracking import WandbTracker
from impala.transport import wire
from impala.transport.curve import prepare_server
from impala.transport.messages import AgentSpec, RunInfo
from impala.transport.trajectory import TrajectorySchema
from learner.run.budget import Budget
from learner.run.checkpointer import Checkpointer, Progress, RunFinished, resume
from learner.run.guard import FingerprintGuard
from learner.run.log_rows import LogRows
from learner.run.periodic_eval import PeriodicEval
from learner.serve.server import PortInUseError, TrajectoryServer

log = logging.getLogger(__name__)


class ActorStartError(RuntimeError):
    """A local actor keeps dying at start-up: the run cannot start as set up."""


# Bad input a user can fix, found while a run starts: each is reported as one line, exit 2.
START_ERRORS = (
    ConfigError,
    CheckpointError,
    UnknownEnvError,
    PortInUseError,
    FingerprintMismatchError,
    FileNotFoundError,
    TimeoutError,
    ActorStartError,
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

    # True: ``stage_update`` takes the next batch now and returns its update, which the runtime runs on
    # a thread of its own while the batch after it arrives and is staged
    overlaps_updates: bool

    def stage_update(self, frames_done: int) -> Callable[[], dict[str, float]]: ...
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
    ] = ()  # a multi-task run's envs in task order (``env`` is the first); RunInfo.task_of deals them
    log_every_steps: int | None = None  # a log row per this many agent steps instead of --log-interval
    checkpoint_every_steps: int | None = None  # also a numbered checkpoint per this many agent steps
    keep_checkpoints: int = 5  # numbered checkpoints kept
    inference: bool = False  # no updates: the policy only acts (rows are logged between updates too)


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
    rejected_nan: int = 0  # launch_ppo: unrolls its learner rejected for NaN values
    # a multi-task run: each task's mean return over its last 100 episodes (a mean across tasks means nothing)
    task_returns: dict[str, float] = dataclasses.field(default_factory=dict)


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


@dataclass
class _Parts:
    """The parts :func:`run` wires, handed to the loop and to the shutdown together."""

    server: TrajectoryServer
    pool: Any  # ActorPool or ThreadActors
    guard: FingerprintGuard
    budget: Budget
    progress: Progress
    checkpointer: Checkpointer
    logger: MetricsLogger
    evaluator: PeriodicEval


class LaunchError(Exception):
    """A launch that did not run to its end: its one-line message and the exit status (2: bad input, the
    folder the start made taken away; 1: the run started and lost a learner rank)."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


class Outcome(NamedTuple):
    """What a launch did: its resolved run settings, and the run's result (None when ``--resume`` found
    the run finished: ``note`` says so)."""

    config: RunConfig
    result: RunResult | None
    note: str = ""


def run(trainer: Trainer, config: RunConfig, plan: RunPlan) -> RunResult:
    """Train until the step budget (``total_frames`` / ``total_steps``), ``max_seconds``, ``stop_at_return``
    or a signal. Returns a summary."""
    budget = Budget(config)  # refuses a run without a step budget
    # the run folder: launchers resolve it, direct callers may leave it to us
    config = config.with_run_folder(plan.env.spec.id)
    tasks = plan.tasks or (plan.env,)
    progress = resume(trainer, config, tasks) if config.resume else Progress(task_frames=[0] * len(tasks))
    guard = FingerprintGuard(tasks, local_workers=config.workers, envs_per_worker=config.envs_per_worker)
    run_info = _run_info(trainer, config, plan)  # a new run id: remote actors say hello again
    tracker = _tracker(config, plan, run_info.run_id)  # before any socket: one that cannot start is bad input
    client_keys = prepare_server(config.curve) if config.curve else None  # makes the keys the server loads
    server = _server(trainer, config, guard, run_info)
    server.restore_episodes(progress.episodes)  # a resumed run's last 100 episodes go on
    actor_cpus = _place(config)
    pool = _local_actors(config, plan, run_info, server, guard, client_keys, actor_cpus)
    logger = MetricsLogger(config.logdir, progress=config.progress, title=plan.title, tracker=tracker,
                           time_offset_s=progress.elapsed_s, config_record=plan.config_record,
                           resumed_at_step=progress.env_frames if config.resume else None)  # fmt: skip
    record = plan.config_record  # stored in every checkpoint, written to config.yaml
    checkpointer = Checkpointer(config, trainer, run_info, record, progress, resuming=config.resume,
                                every_steps=plan.checkpoint_every_steps,
                                keep=plan.keep_checkpoints,
                                episode_record=server.episode_record)  # fmt: skip
    evaluator = PeriodicEval(config, run_info)
    parts = _Parts(server, pool, guard, budget, progress, checkpointer, logger, evaluator)
    interrupted = False
    try:
        server.start()
        _start_actors(pool, server, guard, config, plan.hello_timeout)
        with _Stop() as stop:
            _train(trainer, config, parts, stop.event, plan)
            interrupted = stop.event.is_set()
        if not interrupted:  # the last evaluation belongs to this run's record
            _log_eval(logger, progress, evaluator.finish(), checkpointer)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        # an inference run trains nothing: it never marks the run in its folder finished
        finished = budget.spent(progress.env_frames, progress.agent_steps) and not plan.inference
        checkpoint = _shut_down(trainer, parts, finished=finished)
    dropped = {k: int(v) for k, v in server.dropped.items()}
    stats = server.stats()
    tasks = {
        k.split("/")[1]: v
        for k, v in stats.items()
        if k.startswith("tasks/") and k.endswith("/mean_return_100")
    }
    return RunResult(progress.env_frames, progress.agent_steps, progress.version,
                     stats.get("charts/mean_return_100"), dropped, pool.restarts, interrupted, checkpoint,
                     budget.reached_return, task_returns=tasks)  # fmt: skip


def _run_info(trainer: Trainer, config: RunConfig, plan: RunPlan) -> RunInfo:
    """What actors run (env per task, agent, unroll length, envs each); remote ones read it from every
    weights message."""
    tasks = tuple(t.spec for t in plan.tasks) if len(plan.tasks) > 1 else ()
    return RunInfo(
        uuid.uuid4().hex, plan.env.spec, trainer.agent, config.unroll_length, config.envs_per_worker, tasks
    )


def _tracker(config: RunConfig, plan: RunPlan, run_id: str) -> WandbTracker | None:
    """The experiment tracker (``--track``), or None."""
    if not config.track:
        return None
    name = f"{plan.title} {run_id[:8]}"
    return WandbTracker(project=config.track_project, logdir=config.logdir, name=name,
                        config=plan.config_record, resume=config.resume)  # fmt: skip


def _server(
    trainer: Trainer, config: RunConfig, guard: FingerprintGuard, run_info: RunInfo
) -> TrajectoryServer:
    """The learner's sockets and receive thread, checking hellos with the guard and unrolls with the
    trainer. RunConfig already refused a public bind without --curve or --insecure-bind."""
    task_names = tuple(t.id for t in run_info.tasks)
    server = TrajectoryServer(
        trainer.schema, bind=config.bind, port=config.port,
        queue_size=config.queue_size or trainer.queue_size, on_hello=guard.on_hello,
        curve_dir=config.curve or None, validate=trainer.validate,
        protected_ids=guard.verified_local, local_token=guard.local_token, task_names=task_names,
        task_of=run_info.task_of if task_names else None, publish_delay=config.weights_delay(),
    )  # fmt: skip
    server.run_info = run_info.for_remote_actors().to_dict()
    return server


def claim_cpus(config: RunConfig, claim: CpuClaim, env: EnvInfo) -> RunConfig:
    """``config`` with ``--cpu-affinity auto`` resolved (launch_impala, before the learner's threads are set):
    'split' for image observations (a conv net: the learner is the bottleneck, and pinning was measured to
    pay there) on a CPU learner with local actor processes, no CPU quota below its CPU set, CPUs enough for
    its threads and the actors, when ``claim`` could take every CPU of the set (no other run on this
    machine holds one), with ``--torch-threads`` (unless given) the CPUs the actors leave; else 'off'. An
    explicit 'split' claims its CPUs too, and pins even where another run holds them (the user asked),
    with a warning."""
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    if config.cpu_affinity == "split":
        if not claim.take(cpus):
            log.warning("--cpu-affinity split: another run on this machine has pinned to these CPUs too")
        return config
    if config.cpu_affinity != "auto":
        return config
    off = dataclasses.replace(config, cpu_affinity="off")
    if not config.workers or config.in_process or config.learners != 1 or available_cpus() < len(cpus):
        return off
    if len(env.obs_shape) != 3:  # vector observations: a small MLP learner, the actors the bottleneck
        return off
    if resolve_device(config.device).type != "cpu":  # measured on CPU learners only
        return off
    # The learner keeps the CPUs its actors leave (on a 16-core box with 2 actors, 14 threads; on 2 cores
    # with 2 actors, 1: the measured placement), now as CPUs of its own.
    threads = config.torch_threads or max(1, len(cpus) - config.workers)
    try:
        split_cpus(threads)
    except ValueError:  # not CPUs enough to give the actors some
        return off
    if not claim.take(cpus):
        log.info("cpu affinity: another run on this machine has pinned to CPUs %s; the kernel places "
                 "this one", ",".join(map(str, cpus)))  # fmt: skip
        return off
    return dataclasses.replace(config, cpu_affinity="split", torch_threads=threads)


def _place(config: RunConfig) -> tuple[int, ...]:
    """``--cpu-affinity split``: pin this process (the learner, every thread) to its CPUs now and return the
    CPUs its local actors pin themselves to; () leaves placement to the kernel. The actors' niceness
    (``RunConfig.local_actor_nice``) and the weights' delay are only logged here: each actor lowers its own
    priority as it starts, the server delays the weights."""
    nice = config.local_actor_nice()
    if nice and config.workers:
        log.info("local actors: %d, %d nice levels below the learner", config.workers, nice)
    delay = config.weights_delay()
    if delay:
        log.info("weights: the actors act on weights %d update%s behind the learner's (--publish-delay)",
                 delay, "" if delay == 1 else "s")  # fmt: skip
    if config.cpu_affinity != "split":
        return ()
    learner_cpus, actor_cpus = split_cpus(config.cpu_threads())
    pin_process(learner_cpus)
    log.info(
        "cpu affinity: the learner on CPU %s, the %d local actors on CPU %s",
        ",".join(map(str, learner_cpus)),
        config.workers,
        ",".join(map(str, actor_cpus)),
    )
    return actor_cpus


def _local_actors(config: RunConfig, plan: RunPlan, run_info: RunInfo, server: TrajectoryServer,
                  guard: FingerprintGuard, client_keys: Any, cpus: tuple[int, ...] = ()) -> Any:  # fmt: skip
    """This learner's own actors (not started yet): processes, or threads with --in-process; with --curve they
    connect with the learner's local keypair (``client_keys``); ``cpus``: the CPUs they pin themselves to."""
    configs = actor_configs(
        run_info, range(config.workers), trajectory_endpoint=server.trajectory_endpoint,
        params_endpoint=server.params_endpoint, seed=config.seed, curve=client_keys,
        local_token=guard.local_token, cpus=cpus, nice=config.local_actor_nice(),
    )  # fmt: skip
    if config.in_process:
        return ThreadActors(configs)
    return ActorPool(configs, start_method=config.start_method, actor_class=plan.actor_class)


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
        failing = [(i, code) for i, code in pool.failing_at_start() if i not in guard.verified_local]
        if failing:  # it would die again until the hello timeout: say so now
            i, code = failing[0]
            raise ActorStartError(
                f"actor {i} exited (code {code}) {START_FAILURES} times in a row at start-up, before its "
                "first hello; its error is above (the env builds in the learner's process but not in an "
                "actor's?)"
            )

    # Actors send no unroll before they have weights, so no hello can queue behind unrolls here; only hellos
    # that proved to be from our actors count (a forged one must not end the wait).
    server.wait_for_hellos(config.workers, hello_timeout, check=during_wait, ids=guard.verified_local)
    guard.check()


class _Learning:
    """The learner's loop, in named steps over its state: take a validated unroll, update when the trainer is
    ready, publish, log, checkpoint. Rows come after updates; with ``plan.log_every_steps`` or
    ``plan.inference`` also between them."""

    def __init__(
        self, trainer: Trainer, config: RunConfig, parts: _Parts, stop: threading.Event, plan: RunPlan
    ):
        self.trainer, self.config, self.parts, self.stop, self.plan = trainer, config, parts, stop, plan
        server, budget, progress = parts.server, parts.budget, parts.progress
        # the first interval counts from the run's start (actor start-up included), so a short run still logs
        # a row
        self.rows = LogRows(config.log_interval, server.task_names, progress.env_frames, since=budget.start,
                            every_steps=plan.log_every_steps, agent_steps=progress.agent_steps)  # fmt: skip
        self.between_updates = bool(plan.log_every_steps or plan.inference)
        self.frames_per_unroll = int(round(config.unroll_length * trainer.frames_per_step))
        self.metrics: dict[str, float] = {}
        self.in_flight: Future | None = None

    def log_row(self) -> None:
        """One row of the run's log: the last update's metrics, the transport's counters, the returns."""
        parts, progress = self.parts, self.parts.progress
        row = self.rows.row(
            progress,
            self.metrics,
            parts.server.stats(),
            parts.server.task_mean_returns(),
            parts.pool.restarts,
        )
        parts.logger.log(progress.env_frames, row)

    def running(self) -> bool:
        """Whether the run goes on: budget left, no stop asked for, time left."""
        budget, progress = self.parts.budget, self.parts.progress
        return not (
            budget.spent(progress.env_frames, progress.agent_steps)
            or self.stop.is_set()
            or budget.out_of_time()
        )

    def next_message(self) -> Any:
        """The next validated unroll (None after 0.1 s without one), once the run's parts are checked."""
        parts = self.parts
        parts.guard.check()
        if not parts.server.healthy():
            raise RuntimeError("the learner's receive thread died; see the log above")
        if self.config.workers:
            parts.pool.supervise()
        return parts.server.get(timeout=0.1)

    def take(self, msg: Any) -> bool:
        """Hand an unroll to the trainer and count it; True when the trainer is ready to update."""
        config, server, progress = self.config, self.parts.server, self.parts.progress
        # the weights that will train on it: those after the update in flight, if there is one
        lag = progress.version + (self.in_flight is not None) - msg.version
        if config.max_policy_lag is not None and lag > config.max_policy_lag:
            server.count_stale()
            return False
        task = int(msg.arrays["task"][0]) if server.task_names else 0
        self.rows.record_lag(lag, task)
        self.trainer.ingest(msg, progress.version)
        progress.agent_steps += config.unroll_length
        progress.env_frames += self.frames_per_unroll
        if server.task_names:
            progress.task_frames[task] += self.frames_per_unroll
        if not self.trainer.ready():
            if self.between_updates and self.rows.due(progress.agent_steps):
                self.log_row()
            return False
        return True

    def update(self, updates: ThreadPoolExecutor | None) -> bool:
        """Update now, or (with an update thread) stage the next update and finish the one in flight; True
        when the run reached its return."""
        trainer, progress = self.trainer, self.parts.progress
        if updates is None:
            return self.after_update(trainer.update(progress.env_frames))
        update = trainer.stage_update(progress.env_frames)  # while the previous update trains
        if self.in_flight is not None:
            done, self.in_flight = self.in_flight, None
            if self.after_update(done.result()):
                return True
        self.in_flight = updates.submit(update)
        return False

    def after_update(self, update_metrics: dict[str, float]) -> bool:
        """Publish the new weights, evaluate, log, checkpoint; True when the run reached its return."""
        parts, progress = self.parts, self.parts.progress
        checkpointer, evaluator, server = parts.checkpointer, parts.evaluator, parts.server
        self.metrics = update_metrics
        progress.version += 1
        params = self.trainer.params()
        server.publish(progress.version, params)
        if evaluator.maybe_start(progress.env_frames, params):
            checkpointer.remember_evaluated(progress.env_frames)  # best.pt must hold the weights evaluated
        _log_eval(parts.logger, progress, evaluator.poll(), checkpointer)
        if self.rows.due(progress.agent_steps):
            self.log_row()
        checkpointer.maybe_save()
        if parts.budget.return_reached(server.full_window_mean_return()):
            self.log_row()  # the curve ends where the run stopped, at the return it was asked for
            return True
        return False

    def finish(self) -> None:
        """The last batch of the budget, and the curve's last row."""
        progress = self.parts.progress
        if self.in_flight is not None:  # the last batch of the budget
            self.after_update(self.in_flight.result())
        # a timed curve ends at the run's last update, even when the budget ran out inside one interval
        # (rows counted in agent steps keep ML-Agents' summary_freq: only at its multiples)
        if self.metrics and not self.plan.log_every_steps and progress.env_frames > self.rows.last_frames:
            self.log_row()


def _train(trainer: Trainer, config: RunConfig, parts: _Parts, stop: threading.Event, plan: RunPlan) -> None:
    """The learner's loop (:class:`_Learning`): receive, update, publish, until the budget is spent."""
    learning = _Learning(trainer, config, parts, stop, plan)
    # The update thread: update n trains there while this thread receives and stages batch n+1. Update
    # n is finished (weights published, checkpoint due) before n+1 starts, as without it.
    overlap = config.overlap_updates and trainer.overlaps_updates
    updates = ThreadPoolExecutor(1, thread_name_prefix="update") if overlap else None
    parts.server.publish(parts.progress.version, trainer.params())
    try:
        while learning.running():
            msg = learning.next_message()
            if msg is None or not learning.take(msg):
                continue
            if learning.update(updates):
                break
    except BaseException:
        # the weights change until the update in flight returns: nothing may read or save them before
        in_flight = learning.in_flight
        if in_flight is not None and in_flight.exception() is None:
            parts.progress.version += 1
        raise
    else:
        learning.finish()
    finally:
        if updates is not None:
            updates.shutdown()


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


def _shut_down(trainer: Trainer, parts: _Parts, *, finished: bool) -> str:
    """Release everything, in an order that leaves no child process behind; returns the checkpoint path (""
    if none)."""
    try:
        trainer.close()
    except Exception as e:  # noqa: BLE001 - a follower that is gone must not cost the final checkpoint
        log.error("releasing the learner group failed: %s", e)
    parts.evaluator.stop()
    parts.pool.stop()
    parts.server.close()
    try:
        return parts.checkpointer.final(finished=finished)
    finally:
        parts.logger.close()
