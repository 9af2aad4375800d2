"""The one place that wires the topology: actors -> transport -> batcher -> learner -> params.

``run(trainer, config, plan)`` is shared by both learners. A *trainer* is the
learner-specific part: its trajectory schema, the agent spec actors run,
how it ingests a validated unroll, when it is ready to update, and the update
itself. Everything else (sockets, actor supervision, the fingerprint guard,
metrics, checkpoints, shutdown) lives here once.
"""

from __future__ import annotations

import hmac
import logging
import multiprocessing
import os
import queue
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
from actors.pool import ActorPool, ThreadActors
from impala.transport import wire
from impala.run.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from impala.run.config import ConfigError, RunConfig
from impala.envs import UnknownEnvError
from impala.envs.atari import human_normalized_score
from impala.transport.curve import prepare_server
from impala.envs.fingerprint import EnvFingerprint, FingerprintMismatchError, compare_fingerprints
from impala.envs.probe import EnvInfo
from impala.envs import EnvSpec
from impala.transport.messages import AgentSpec, RunInfo, agent_spec_from_dict
from impala.run.metrics import MetricsLogger
from impala.run.tracking import WandbTracker
from impala.transport.trajectory import TrajectorySchema
from learner.evaluator import evaluate_params
from learner.server import PortInUseError, TrajectoryServer

log = logging.getLogger(__name__)

# Bad input a user can fix, found while a run starts: each is reported as one line, exit 2.
START_ERRORS = (ConfigError, CheckpointError, UnknownEnvError, PortInUseError, FingerprintMismatchError, FileNotFoundError, TimeoutError)


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
    tasks: tuple[EnvInfo, ...] = ()  # a multi-task run's envs in task order (``env`` is the first); actor i runs task i % N


@dataclass
class RunResult:
    env_frames: int
    agent_steps: int
    updates: int
    mean_return: float | None
    dropped: dict[str, int]
    restarts: int
    interrupted: bool
    checkpoint: str
    reached_return: bool = False  # stopped early at --stop-at-return


def _evaluation_worker(jobs: Any, results: Any, envs: list[dict], agent: dict, episodes: int) -> None:
    """The --eval-every process, started once and fed weight snapshots: greedy episodes of each (of every
    task in a multi-task run), one summary per job on ``results``. Living across evaluations, it pays its
    start-up (torch, the env) only once."""
    os.nice(5)  # the actors and the learner come first
    specs, agent_spec = [EnvSpec.from_dict(env) for env in envs], agent_spec_from_dict(agent)
    while (job := jobs.get()) is not None:
        frames, params, seed, video = job
        try:
            row: dict[str, float] = {}
            for spec in specs:
                prefix = f"eval/{spec.id}/" if len(specs) > 1 else "eval/"
                task_video = video if spec is specs[0] else ""  # the first task's episode is recorded
                result = evaluate_params(spec, agent_spec, params, protocol="train", policy="greedy", episodes=episodes, workers=0,
                                         seed=seed, video=task_video, video_max_frames=600 if task_video else 0)
                row.update({f"{prefix}{k}_return": float(v) for k, v in result.stats.items()})
                row.update({f"{prefix}frames": float(result.total_frames), f"{prefix}wall_s": float(result.wall_time_s)})
            results.put((frames, row, video))
        except Exception as e:  # noqa: BLE001 - an evaluation that fails is reported, never stops training
            results.put((frames, {"error": f"{type(e).__name__}: {e}"}, ""))


class PeriodicEval:
    """--eval-every: one evaluation process for the run, at most one snapshot in it at a time; a snapshot is
    handed over after an update and the result polled each update."""

    def __init__(self, config: RunConfig, run_info: RunInfo) -> None:
        self.every, self.episodes, self.seed = config.eval_every, config.eval_episodes, config.seed + 7777
        self.video_dir = config.logdir if config.eval_video else ""
        self.run_info = run_info
        self.ctx = multiprocessing.get_context("spawn")
        self.jobs: Any = None
        self.results: Any = None
        self.proc: Any = None
        self.busy = False
        self.next_at = config.eval_every
        self.started = 0

    def maybe_start(self, frames: int, params: Mapping[str, np.ndarray]) -> None:
        if not self.every or frames < self.next_at or self.busy:
            return
        if self.proc is None or not self.proc.is_alive():
            self.jobs, self.results = self.ctx.Queue(), self.ctx.Queue()
            # A snapshot the evaluation process never read (it died) must not hold this process at exit:
            # multiprocessing joins the queue's feeder thread then, which blocks for good writing megabytes
            # of weights into a pipe no one reads. stop() hands the process its None before it goes.
            self.jobs.cancel_join_thread()
            self.proc = self.ctx.Process(
                target=_evaluation_worker, name="eval", daemon=True,
                args=(self.jobs, self.results, [t.to_dict() for t in self.run_info.task_envs], self.run_info.agent.to_dict(), self.episodes),
            )
            self.proc.start()
        self.next_at = (frames // self.every + 1) * self.every
        snapshot = {k: np.array(v, copy=True) for k, v in params.items()}
        video = os.path.join(self.video_dir, f"eval-{frames}.mp4") if self.video_dir else ""
        self.jobs.put((frames, snapshot, self.seed + self.started, video))
        self.busy = True
        self.started += 1

    def poll(self, timeout: float = 0.0) -> tuple[int, dict[str, float], str] | None:
        """(frames of the snapshot, eval/ row, video path or "") of a finished evaluation, else None."""
        if not self.busy:
            return None
        try:
            frames, row, video = self.results.get(timeout=timeout) if timeout else self.results.get_nowait()
        except queue.Empty:
            if not self.proc.is_alive():  # it died (say, out of memory): the next snapshot starts a new one
                log.error("the evaluation process exited with code %s", self.proc.exitcode)
                self.busy = False
            return None
        self.busy = False
        if "error" in row:
            log.error("evaluation at %d frames failed: %s", frames, row["error"])
            return None
        means = {k: v for k, v in row.items() if k.endswith("mean_return")}
        log.info("eval at %d frames over %d episodes: %s", frames, self.episodes, ", ".join(f"{k} {v:.2f}" for k, v in means.items()))
        return frames, row, video

    def finish(self, wait_s: float = 30.0) -> tuple[int, dict[str, float], str] | None:
        """At the end of the run: the evaluation still playing gets ``wait_s`` to report."""
        done = self.poll(timeout=wait_s) if self.busy else None
        self.stop()
        return done

    def stop(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.jobs.put(None)
            self.proc.join(timeout=2)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(timeout=5)


def task_rows(task_names: tuple[str, ...], task_frames: list[int], mean_returns: Mapping[str, float]) -> dict[str, float]:
    """A multi-task run's per-task metrics: frames, and for Atari games the human-normalized score
    of the mean return of the last 100 episodes, with the median and mean over the tasks that have one."""
    row: dict[str, float] = {}
    scores = []
    for name, frames in zip(task_names, task_frames):
        row[f"tasks/{name}/frames"] = float(frames)
        if name in mean_returns:
            hns = human_normalized_score(name, mean_returns[name])
            if hns is not None:
                row[f"tasks/{name}/human_normalized"] = hns
                scores.append(hns)
    if scores:
        row["tasks/median_human_normalized"] = float(np.median(scores))
        row["tasks/mean_human_normalized"] = float(np.mean(scores))
    return row


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
    if config.total_frames is None and config.total_steps is None:
        raise ConfigError("the run needs a budget: --total-frames or --total-steps")
    env_frames = agent_steps = 0
    version = 0
    task_infos = plan.tasks or (plan.env,)
    task_names = tuple(t.spec.id for t in task_infos) if len(task_infos) > 1 else ()
    task_frames = [0] * len(task_infos)
    if config.resume:
        state = load_checkpoint(config.checkpoint_path, keys=("trainer", "env_frames", "version"))
        saved_tasks = [t.get("id") if isinstance(t, dict) else t for t in state.get("tasks") or []]
        if saved_tasks != list(task_names):
            raise CheckpointError(
                f"checkpoint {config.checkpoint_path} was trained on {','.join(saved_tasks) if saved_tasks else 'one task'}; "
                f"this run has --env {','.join(task_names) if task_names else task_infos[0].spec.id}: resume with the same task list"
            )
        task_frames = [int(f) for f in state.get("task_frames") or task_frames]
        try:
            trainer.load_state_dict(state["trainer"])
            env_frames = int(state["env_frames"])
            # checkpoints before agent steps were counted apart: derive them from the frames
            agent_steps = int(state.get("agent_steps", round(env_frames / trainer.frames_per_step)))
            version = int(state["version"])
        except (KeyError, RuntimeError, ValueError, TypeError, IndexError) as e:
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"checkpoint {config.checkpoint_path} does not fit this run (another env or network?): {first}") from None
        log.info("resumed from %s at %d env frames, policy version %d", config.checkpoint_path, env_frames, version)
    start_version = version

    def budget_spent(frames: int, steps: int) -> bool:
        return (config.total_frames is not None and frames >= config.total_frames) or (
            config.total_steps is not None and steps >= config.total_steps
        )

    # Ids below --workers belong to this learner's own actors. A peer that merely reaches the port
    # could send a hello as actor 0; only the actors spawned here know this run's token.
    local_token = secrets.token_hex(16)
    verified_local: set[int] = set()  # local ids whose hello carried the token
    local_refusals: dict[int, str] = {}  # verified local actors whose env differs: stop the run

    def on_hello(actor: int, info: Mapping[str, Any]) -> str | None:
        local = 0 <= actor < config.workers
        if local:
            token = info.get("local_token")
            if not (isinstance(token, str) and hmac.compare_digest(token, local_token)):
                return f"actor id {actor} is reserved for this learner's local actors and the hello has no valid local token"
        reason = fingerprint_problem(info, actor)
        if local:
            verified_local.add(actor)
            if reason is not None:
                local_refusals[actor] = reason
        return reason

    def fingerprint_problem(info: Mapping[str, Any], actor: int) -> str | None:
        # The runtime guard of SEEDS.md part 1: a worker must never train on other dynamics. In a
        # multi-task run each actor is checked against its own task's env (tasks are dealt by id).
        reference = task_infos[actor % len(task_infos)].fingerprint
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

    run_id = uuid.uuid4().hex  # a new learner process: remote actors say hello again
    tracker = None
    if config.track:  # before any socket is bound: a tracker that cannot start is a start-up error
        tracker = WandbTracker(project=config.track_project, logdir=config.logdir, name=f"{plan.title} {run_id[:8]}",
                               config=plan.config_record, resume=config.resume)
    # RunConfig already refused a public bind without --curve or --insecure-bind.
    client_keys = prepare_server(config.curve) if config.curve else None
    server = TrajectoryServer(
        trainer.schema, bind=config.bind, port=config.port, queue_size=config.queue_size or trainer.queue_size, on_hello=on_hello,
        curve_dir=config.curve or None, validate=trainer.validate, protected_ids=verified_local, local_token=local_token,
        task_names=task_names,
    )
    # Remote actors (impala-actors) learn what to run from this, sent with every weights message.
    run_info = RunInfo(run_id, plan.env.spec, trainer.agent, config.unroll_length, config.envs_per_worker,
                       tuple(t.spec for t in task_infos) if task_names else ())
    server.run_info = run_info.to_dict()
    configs = [
        ActorConfig(
            actor_id=i,
            env=run_info.task_envs[run_info.task_of(i)],
            task=run_info.task_of(i),
            num_envs=run_info.envs_per_worker,
            unroll_length=run_info.unroll_length,
            trajectory_endpoint=server.trajectory_endpoint,
            params_endpoint=server.params_endpoint,
            agent=run_info.agent,
            seed=config.seed + 1000 * i,
            curve=client_keys,
            local_token=local_token,
        )
        for i in range(config.workers)
    ]
    pool = ThreadActors(configs) if config.in_process else ActorPool(configs, start_method=config.start_method, actor_class=plan.actor_class)
    logger = MetricsLogger(config.logdir, progress=config.progress, title=plan.title, tracker=tracker)
    evaluator = PeriodicEval(config, run_info)
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
                config.checkpoint_path,
                {"trainer": trainer.state_dict(), "env_frames": env_frames, "agent_steps": agent_steps, "version": version,
                 # what the checkpoint is, for tools that play it (impala-eval): the actors' own env and agent specs
                 "kind": trainer.agent.kind, "env": run_info.env.to_dict(), "agent": run_info.agent.to_dict(),
                 "tasks": [t.to_dict() for t in run_info.tasks], "task_frames": list(task_frames),
                 "config": plan.config_record},
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
        if config.workers:
            pool.start()
            log.info("started %d actors (%s) -> %s", config.workers, "threads" if config.in_process else config.start_method, server.trajectory_endpoint)

            # Every local actor must pass the fingerprint guard before any weights go out. Actors
            # send no unroll before they have weights, so no hello can queue behind unrolls here.
            def during_wait() -> None:
                check_refusals()
                pool.supervise()

            # count only hellos that proved to be from our actors: a forged one must not end the wait
            server.wait_for_hellos(config.workers, plan.hello_timeout, check=during_wait, ids=verified_local)
            check_refusals()
        server.publish(version, trainer.params())
        with _Stop() as stop:
            while not budget_spent(env_frames, agent_steps) and not stop.event.is_set():
                if config.max_seconds and time.monotonic() - start > config.max_seconds:
                    break
                check_refusals()
                if not server.healthy():
                    raise RuntimeError("the learner's receive thread died; see the log above")
                if config.workers:
                    pool.supervise()
                msg = server.get(timeout=0.1)
                if msg is None:
                    continue
                lag = version - msg.version
                if config.max_policy_lag is not None and lag > config.max_policy_lag:
                    server.count_stale()
                    continue
                lags.append(lag)
                trainer.ingest(msg, version)
                agent_steps += config.unroll_length
                frames = int(round(config.unroll_length * trainer.frames_per_step))
                env_frames += frames
                if task_names:
                    task_frames[int(msg.arrays["task"][0])] += frames
                if not trainer.ready():
                    continue
                metrics = trainer.update(env_frames)
                version += 1
                params = trainer.params()
                server.publish(version, params)
                evaluator.maybe_start(env_frames, params)
                evaluated = evaluator.poll()
                if evaluated is not None:
                    # logged at today's step (trackers want steps in order); the snapshot's frames ride along
                    at, row, video = evaluated
                    logger.log(env_frames, {**row, "eval/at_frames": float(at)})
                    if video and tracker is not None and os.path.exists(video):
                        tracker.log_video(env_frames, "eval/video", video)
                now = time.monotonic()
                if now - last_log >= config.log_interval:
                    row = dict(metrics)
                    row.update(server.stats())
                    row["charts/env_frames"] = env_frames
                    row["charts/agent_steps"] = agent_steps
                    row["charts/fps"] = (env_frames - frames_at_last_log) / (now - last_log)
                    row["charts/policy_lag"] = float(np.mean(lags)) if lags else 0.0
                    row["charts/policy_version"] = version
                    row["charts/actor_restarts"] = pool.restarts
                    if task_names:
                        row.update(task_rows(task_names, task_frames, server.task_mean_returns()))
                    logger.log(env_frames, row)
                    frames_at_last_log, last_log, lags = env_frames, now, []
                if now - last_ckpt >= config.checkpoint_minutes * 60:
                    checkpoint()
                    last_ckpt = now
                if config.stop_at_return is not None:
                    mean = server.full_window_mean_return()
                    if mean is not None and mean >= config.stop_at_return:
                        log.info("mean return of the last 100 episodes %.2f reached --stop-at-return %g", mean, config.stop_at_return)
                        reached_return = True
                        break
            interrupted = stop.event.is_set()
        if not interrupted:
            evaluated = evaluator.finish()  # the last evaluation belongs to this run's record
            if evaluated is not None:
                at, row, _ = evaluated
                logger.log(env_frames, {**row, "eval/at_frames": float(at)})
    except KeyboardInterrupt:
        interrupted = True
    finally:
        try:
            trainer.close()
        except Exception as e:  # noqa: BLE001 - a follower that is gone must not cost the final checkpoint
            log.error("releasing the learner group failed: %s", e)
        evaluator.stop()
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
        agent_steps=agent_steps,
        updates=version,
        mean_return=stats.get("charts/mean_return_100"),
        dropped={k: int(v) for k, v in server.dropped.items()},
        restarts=pool.restarts,
        interrupted=interrupted,
        checkpoint=config.checkpoint_path,
        reached_return=reached_return,
    )
