"""``--eval-every``: greedy evaluations of the current weights in one separate process, so the learner never
waits.

The process is started once and fed weight snapshots; it plays ``--eval-episodes`` greedy episodes of
each (of every task in a multi-task run) with the evaluation engine (:mod:`learner.evaluator`) and
reports one ``eval/`` row per snapshot.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
from typing import Any, Mapping

import numpy as np

from impala.envs import EnvSpec
from impala.run.config import RunConfig
from impala.transport.messages import RunInfo, agent_spec_from_dict
from learner.evaluator import evaluate_params

log = logging.getLogger(__name__)


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

                def play(video_path: str) -> Any:
                    return evaluate_params(
                        spec,
                        agent_spec,
                        params,
                        protocol="train",
                        policy="greedy",
                        episodes=episodes,
                        workers=0,
                        seed=seed,
                        video=video_path,
                        video_max_frames=600 if video_path else 0,
                    )

                try:
                    result = play(task_video)
                except OSError as e:  # the video could not be written (a full disk): the scores still count
                    if not task_video:
                        raise
                    row["video_error"] = f"{e.strerror or e}"
                    video = ""
                    result = play("")
                row.update({f"{prefix}{k}_return": float(v) for k, v in result.stats.items()})
                row.update(
                    {
                        f"{prefix}frames": float(result.total_frames),
                        f"{prefix}wall_s": float(result.wall_time_s),
                    }
                )
            results.put((frames, row, video))
        except Exception as e:  # noqa: BLE001 - an evaluation that fails is reported, never stops training
            results.put((frames, {"error": f"{type(e).__name__}: {e}"}, ""))


class PeriodicEval:
    """--eval-every: one evaluation process for the run, at most one snapshot in it at a time; a snapshot is
    handed over after an update and the result polled each update."""

    def __init__(self, config: RunConfig, run_info: RunInfo) -> None:
        self.every, self.episodes, self.seed = config.eval_every, config.eval_episodes, config.seed + 7777
        self.video_dir = config.logdir if config.eval_video else ""
        self.video_failing = False  # said once per outage
        self.run_info = run_info
        self.ctx = multiprocessing.get_context("spawn")
        self.jobs: Any = None
        self.results: Any = None
        self.proc: Any = None
        self.busy = False
        self.next_at = config.eval_every
        self.started = 0

    def maybe_start(self, frames: int, params: Mapping[str, np.ndarray]) -> bool:
        """Hand a snapshot of ``params`` to the evaluation process if one is due and none is playing; True
        if so."""
        if not self.every or frames < self.next_at or self.busy:
            return False
        if self.proc is None or not self.proc.is_alive():
            self.jobs, self.results = self.ctx.Queue(), self.ctx.Queue()
            # A snapshot the evaluation process never read (it died) must not hold this process at exit:
            # multiprocessing joins the queue's feeder thread then, which blocks for good writing megabytes
            # of weights into a pipe no one reads. stop() hands the process its None before it goes.
            self.jobs.cancel_join_thread()
            self.proc = self.ctx.Process(
                target=_evaluation_worker,
                name="eval",
                daemon=True,
                args=(
                    self.jobs,
                    self.results,
                    [t.to_dict() for t in self.run_info.task_envs],
                    self.run_info.agent.to_dict(),
                    self.episodes,
                ),
            )
            self.proc.start()
        self.next_at = (frames // self.every + 1) * self.every
        snapshot = {k: np.array(v, copy=True) for k, v in params.items()}
        video = os.path.join(self.video_dir, f"eval-{frames}.mp4") if self.video_dir else ""
        self.jobs.put((frames, snapshot, self.seed + self.started, video))
        self.busy = True
        self.started += 1
        return True

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
        video_error = row.pop("video_error", None)
        if video_error is not None and not self.video_failing:
            log.warning(
                "evaluation videos cannot be written (%s): the scores are kept, videos resume later",
                video_error,
            )
        elif video_error is None and video and self.video_failing:
            log.info("evaluation videos are written again")
        self.video_failing = video_error is not None
        means = {k: v for k, v in row.items() if k.endswith("mean_return")}
        log.info(
            "eval at %d frames over %d episodes: %s",
            frames,
            self.episodes,
            ", ".join(f"{k} {v:.2f}" for k, v in means.items()),
        )
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
