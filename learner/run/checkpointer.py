"""A run's counters, resuming them from a checkpoint, and writing checkpoints that no error can cost the run.

:class:`Progress` is what a run has done (env frames, agent steps, policy version, frames per task);
:func:`resume` restores it and the trainer from ``LOGDIR/checkpoint.pt``; :class:`Checkpointer` writes
the checkpoint every ``--checkpoint-minutes`` and at exit. Writing is atomic and refuses non-finite
weights (``impala.run.checkpoint``); a write that fails for any reason (disk full, a directory at the
path, permissions, I/O errors) is one warning line and training goes on: the last good checkpoint
stays, the next write retries, and a run that has not been able to write for ``LOUD_AFTER_S`` says so
at error level on every try.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from impala.envs import UNITY_ENGINE_KWARGS
from impala.envs.probe import EnvInfo
from impala.run.checkpoint import (
    FINISHED_MARKER,
    CheckpointError,
    load_checkpoint,
    run_files,
    save_checkpoint,
)
from impala.run.config import RunConfig
from impala.run.metrics import atomic_write_text
from impala.transport.messages import RunInfo
from learner.run.budget import Budget

log = logging.getLogger(__name__)

LOUD_AFTER_S = 30 * 60.0  # a run unable to checkpoint for this long says so at error level
RETRY_FAILED_S = 60.0  # a checkpoint that failed is tried again this often (a disk freed gets one soon)


@dataclass
class Progress:
    """What a run has done so far; saved in every checkpoint and restored by :func:`resume`."""

    env_frames: int = 0
    agent_steps: int = 0
    version: int = 0  # policy version: one per update
    task_frames: list[int] = field(default_factory=lambda: [0])  # env frames per task (multi-task runs)
    elapsed_s: float = 0.0  # wall time of the earlier runs this one resumes (metrics' time stays monotone)
    # a resumed checkpoint's episode statistics (the server's last 100 returns, episode counts), for the
    # resumed server to start from; the saves take them from the server itself (episode_record)
    episodes: dict[str, Any] = field(default_factory=dict)


class RunFinished(Exception):
    """``--resume`` of a run that already used up its budget: nothing to do (exit 0, not a restart loop)."""


def resume(trainer: Any, config: RunConfig, tasks: Sequence[EnvInfo]) -> Progress:
    """The trainer's state and the counters from ``config.checkpoint_path``; :class:`CheckpointError` when the
    checkpoint belongs to another task list, env or network, :class:`RunFinished` when its run had
    finished."""
    task_names = [t.spec.id for t in tasks] if len(tasks) > 1 else []
    finished = finished_record(config.logdir)
    if finished is not None and _budget_spent(config, finished):
        raise RunFinished(
            f"{config.logdir} finished at {finished.get('env_frames', 0):,} env frames / "
            f"{finished.get('agent_steps', 0):,} agent steps "
            "(its budget); nothing to resume. Raise --total-frames/--total-steps to train on, or start a new "
            "--logdir"
        )
    if not os.path.exists(config.checkpoint_path) and run_files(config.logdir):
        # the folder holds a run that never reached its first update (its config.yaml, some rows): there
        # is nothing to continue from, so the run starts from its beginning with its own settings
        log.info(
            "%s holds no checkpoint (its run trained nothing): starting it from the beginning", config.logdir
        )
        return Progress(task_frames=[0] * len(tasks))
    state = load_checkpoint(config.checkpoint_path, keys=("trainer", "env_frames", "version"))
    saved_tasks = [t.get("id") if isinstance(t, dict) else t for t in state.get("tasks") or []]
    if saved_tasks != task_names:
        raise CheckpointError(
            f"checkpoint {config.checkpoint_path} was trained on "
            f"{','.join(map(str, saved_tasks)) if saved_tasks else 'one task'}; "
            f"this run has --env {','.join(task_names) if task_names else tasks[0].spec.id}: resume with the "
            "same task list"
        )
    differences = _differences(state, tasks[0], trainer.agent.to_dict())
    if differences:
        raise CheckpointError(
            f"checkpoint {config.checkpoint_path} does not fit this run: {'; '.join(differences)}. Resume "
            "with "
            "the settings it was trained with, or start a new run (another --run-id)"
        )
    try:
        trainer.load_state_dict(state["trainer"])
        env_frames = int(state["env_frames"])
        progress = Progress(
            env_frames=env_frames,
            # checkpoints written before agent steps were counted apart: derived from the frames
            agent_steps=int(state.get("agent_steps", round(env_frames / trainer.frames_per_step))),
            version=int(state["version"]),
            task_frames=[int(f) for f in state.get("task_frames") or [0] * len(tasks)],
            elapsed_s=float(state.get("elapsed_s", 0.0)),
            episodes=dict(state.get("episodes") or {}),  # absent from checkpoints of older versions
        )
    except (KeyError, RuntimeError, ValueError, TypeError, IndexError) as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"checkpoint {config.checkpoint_path} does not fit this run (another env or network?): {first}"
        ) from None
    log.info(
        "resumed from %s at %d env frames, policy version %d",
        config.checkpoint_path,
        progress.env_frames,
        progress.version,
    )
    return progress


# What makes a checkpoint another run's: its env, and the agent settings that shape the network.
_AGENT_IDENTITY = (
    "kind",
    "model",
    "use_lstm",
    "frame_stack",
    "num_tasks",
    "obs_dim",
    "action_dim",
    "branches",
    "action_space",
    "action_mask",
)
_PPO_NETWORK = ("hidden_units", "num_layers", "activation")


def _differences(state: dict[str, Any], env: EnvInfo, agent: dict[str, Any]) -> list[str]:
    """What differs between the run a checkpoint recorded (env and agent specs) and this one, said per
    setting."""
    out = []
    saved_env = state.get("env")
    if isinstance(saved_env, dict):
        here = env.spec.to_dict()
        for key, label in (("id", "env"), ("kwargs", "env kwargs")):
            there, now = saved_env.get(key), here[key]
            if key == "kwargs" and env.spec.is_unity and isinstance(there, dict):
                # engine settings (time scale, window size, graphics) may change between a run and its resume
                there = {k: v for k, v in there.items() if k not in UNITY_ENGINE_KWARGS}
                now = {k: v for k, v in now.items() if k not in UNITY_ENGINE_KWARGS}
            if key in saved_env and there != now:
                out.append(f"{label} {there!r} there, {now!r} here")
    saved = state.get("agent")
    if isinstance(saved, dict):
        for key in _AGENT_IDENTITY:
            if key in saved and key in agent and saved[key] != agent[key]:
                out.append(f"{key} {saved[key]!r} there, {agent[key]!r} here")
        old_net, new_net = saved.get("config"), agent.get("config")
        if isinstance(old_net, dict) and isinstance(new_net, dict):
            out += [
                f"{k} {old_net[k]!r} there, {new_net[k]!r} here"
                for k in _PPO_NETWORK
                if k in old_net and k in new_net and old_net[k] != new_net[k]
            ]
    return out


def finished_record(logdir: str) -> dict[str, Any] | None:
    """The finished marker of the run in ``logdir``, or None."""
    try:
        with open(os.path.join(logdir, FINISHED_MARKER)) as f:
            record = json.load(f)
        return record if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def _budget_spent(config: RunConfig, record: dict[str, Any]) -> bool:
    """Whether the finished run's counters already meet this run's budget (the budget's own rule)."""
    frames, steps = record.get("env_frames"), record.get("agent_steps")
    if not isinstance(frames, int) or not isinstance(steps, int):
        return False
    return Budget(config).spent(frames, steps)


class Checkpointer:
    """Writes ``config.checkpoint_path`` periodically and at exit; never raises for a failed write."""

    def __init__(
        self,
        config: RunConfig,
        trainer: Any,
        run_info: RunInfo,
        config_record: dict[str, Any],
        progress: Progress,
        *,
        resuming: bool,
        every_steps: int | None = None,
        keep: int = 5,
        episode_record: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """``every_steps``: also keep a numbered copy, ``<name>-<agent steps>.pt`` (and ``.onnx`` when the
        trainer exports one), each time the agent steps pass a multiple of it; the ``keep`` newest stay
        (ML-Agents' ``checkpoint_interval`` and ``keep_checkpoints``). ``episode_record``: the episode
        statistics to keep in each checkpoint (the server's)."""
        self.episode_record = episode_record
        self.path, self.logdir = config.checkpoint_path, config.logdir
        self.every_s = config.checkpoint_minutes * 60
        self.every_steps, self.keep = every_steps, keep
        self.next_numbered = (progress.agent_steps // every_steps + 1) * every_steps if every_steps else 0
        self.trainer, self.run_info, self.config_record, self.progress = (
            trainer,
            run_info,
            config_record,
            progress,
        )
        self.start_version = progress.version  # nothing trained yet: never overwrite a checkpoint with it
        self._export_failures: set[str] = set()
        self.last_try = self.last_success = time.monotonic()
        self.failing_since: float | None = None
        self.said_loud = False  # the error for a long outage was said
        self.best_return = float("-inf")  # best.pt's evaluation, this run
        self.evaluated: tuple[int, dict[str, Any]] | None = None  # (frames, state) of the evaluation playing
        self.start = time.monotonic()
        if not resuming:  # a new run in this directory is not finished, whatever an earlier one was
            try:
                os.remove(os.path.join(self.logdir, FINISHED_MARKER))
            except OSError:
                pass

    def state(self) -> dict[str, Any]:
        p = self.progress
        return {
            "trainer": self.trainer.state_dict(),
            "env_frames": p.env_frames,
            "agent_steps": p.agent_steps,
            "version": p.version,
            # what the checkpoint is, for tools that play it (impala-eval): the actors' own env and agent
            # specs
            "kind": self.trainer.agent.kind,
            "env": self.run_info.env.to_dict(),
            "agent": self.run_info.agent.to_dict(),
            "tasks": [t.to_dict() for t in self.run_info.tasks],
            "task_frames": list(p.task_frames),
            "elapsed_s": p.elapsed_s + time.monotonic() - self.start,
            "episodes": self.episode_record() if self.episode_record is not None else p.episodes,
            "config": self.config_record,
        }

    def remember_evaluated(self, at_frames: int) -> None:
        """Keep a copy of the state whose weights an evaluation is about to play (one at a time), for
        ``best.pt``."""
        self.evaluated = (at_frames, copy.deepcopy(self.state()))

    def consider_best(self, mean_return: float | None, at_frames: int) -> None:
        """``best.pt``: the state an evaluation played, when its mean return beats every earlier one of
        this run."""
        if (
            mean_return is None
            or mean_return <= self.best_return
            or self.evaluated is None
            or self.evaluated[0] != at_frames
        ):
            return
        try:
            save_checkpoint(
                os.path.join(self.logdir, "best.pt"),
                {**self.evaluated[1], "eval_mean_return": float(mean_return)},
            )
        except (CheckpointError, OSError) as e:
            log.warning("best.pt not written (%s)", e)
            return
        self.best_return = mean_return
        log.info("best.pt: the weights at %d frames, eval mean return %.2f", at_frames, mean_return)

    def maybe_save(self) -> None:
        """Save if ``--checkpoint-minutes`` have passed since the last try, or (with ``every_steps``) the
        agent steps passed the next multiple: then a numbered copy too."""
        steps = self.progress.agent_steps
        if self.every_steps and steps >= self.next_numbered:
            self.next_numbered = (steps // self.every_steps + 1) * self.every_steps
            if self.save():
                self._numbered(steps)
        elif time.monotonic() - self.last_try >= (
            self.every_s if self.failing_since is None else min(self.every_s, RETRY_FAILED_S)
        ):
            self.save()

    def numbered_name(self) -> str:
        """The numbered checkpoints' name: the ONNX file's stem (the behaviour), else ``checkpoint``."""
        name_of = getattr(self.trainer, "onnx_name", None)
        return name_of() if name_of is not None else "checkpoint"

    def _numbered(self, steps: int) -> None:
        """Copy the checkpoint just written (and its ONNX file) to ``<name>-<steps>.*``; drop the oldest
        beyond ``keep``."""
        name = self.numbered_name()
        pattern = re.compile(re.escape(name) + r"-(\d+)\.(pt|onnx)")
        try:
            shutil.copyfile(self.path, os.path.join(self.logdir, f"{name}-{steps}.pt"))
            onnx = os.path.join(self.logdir, f"{name}.onnx")
            if os.path.isfile(onnx):
                shutil.copyfile(onnx, os.path.join(self.logdir, f"{name}-{steps}.onnx"))
            found = sorted({int(m.group(1)) for f in os.listdir(self.logdir) if (m := pattern.fullmatch(f))})
            for old in found[: max(len(found) - self.keep, 0)]:
                for ext in ("pt", "onnx"):
                    path = os.path.join(self.logdir, f"{name}-{old}.{ext}")
                    if os.path.exists(path):
                        os.remove(path)
        except OSError as e:
            log.warning("numbered checkpoint %s-%d not kept: %s", name, steps, e.strerror or e)

    def save(self) -> bool:
        """Write the checkpoint; False (with one log line) if it could not be written."""
        self.last_try = time.monotonic()
        try:
            save_checkpoint(self.path, self.state())
        except CheckpointError as e:  # diverged weights: keep the last good checkpoint
            log.error("%s; the previous checkpoint is kept", e)
            return False
        except (
            OSError
        ) as e:  # disk full, a directory at the path, permissions, I/O: train on, retry next time
            self._failed(f"{type(e).__name__}: {e.strerror or e}")
            return False
        if self.failing_since is not None:
            log.info("checkpoint %s is written again", self.path)
        self.last_success, self.failing_since, self.said_loud = time.monotonic(), None, False
        self._export()
        return True

    def _failed(self, reason: str) -> None:
        """One warning when checkpoints start failing, one error if it lasts LOUD_AFTER_S; the retries in
        between are quiet (``maybe_save`` retries every RETRY_FAILED_S)."""
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
            log.warning(
                "checkpoint %s not written (%s); training goes on, the previous checkpoint is kept, and the "
                "write is retried every %.0f s",
                self.path,
                reason,
                min(self.every_s, RETRY_FAILED_S),
            )
        elif now - self.failing_since >= LOUD_AFTER_S and not self.said_loud:
            self.said_loud = True
            log.error(
                "no checkpoint could be written for %.0f minutes (%s): a crash now loses everything since "
                "the last one; free space or fix %s",
                (now - self.failing_since) / 60,
                reason,
                self.path,
            )

    def _export(self) -> None:
        # A trainer that can export its policy for serving (PPO -> ONNX for Unity) does so beside each
        # checkpoint.
        export = getattr(self.trainer, "export_onnx", None)
        if export is None:
            return
        try:
            export(self.logdir)
        except Exception as e:  # noqa: BLE001 - an export that fails must not cost the run
            if str(e) not in self._export_failures:  # the same reason at every checkpoint: say it once
                self._export_failures.add(str(e))
                log.warning("ONNX export beside %s failed: %s", self.path, e)

    def final(self, *, finished: bool) -> str:
        """At exit: save if anything was trained; mark the run finished if its budget was used up and it
        trained (a run whose budget ended before its first update is not finished: it can be resumed, or
        started again in its folder). Returns the checkpoint's path if one exists, else ""."""
        if self.progress.version > self.start_version:
            self.save()
        if finished and self.progress.version > 0:
            marker = {
                "env_frames": self.progress.env_frames,
                "agent_steps": self.progress.agent_steps,
                "version": self.progress.version,
            }
            try:
                atomic_write_text(os.path.join(self.logdir, FINISHED_MARKER), json.dumps(marker))
            except OSError as e:
                log.warning("could not write the finished marker in %s: %s", self.logdir, e.strerror or e)
        return self.path if os.path.isfile(self.path) else ""
