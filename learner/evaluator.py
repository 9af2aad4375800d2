"""The evaluation engine: play a policy's episodes and judge them under a named protocol.

Used by ``impala-eval`` (:mod:`learner.cli.eval_cli`), by a training run's ``--eval-every`` and by
``frameskip_check --plot``; it reads both learners' checkpoints
(``impala.evaluation.read_policy_checkpoint``).
The episodes are played in worker processes through the actors' own agent code
(``actors.agents.make_agent`` + ``load_params`` + ``act``; ``act_greedy`` for
``--policy greedy``), one env per worker built from the protocol's ``EnvSpec``
(``impala.envs.protocols``). Before its first episode every worker measures the env it
built and compares it with the protocol (the fingerprint guard of the training actors plus
the frame cap and no-op starts); a difference stops the evaluation with the field named.

Episode i resets its env and seeds its agent with ``seed + i``, so the figures do not
depend on how many workers played them. The result is an ``EvalResult``;
a video recorder writes the first episode(s)
from the raw RGB screen. :func:`evaluate_params` is the same evaluation for a caller
holding weights rather than a file (a training run's periodic evaluation).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import gymnasium as gym
import numpy as np

from actors.agents import Agent, make_agent
from impala.envs import EnvSpec
from impala.envs.fingerprint import FingerprintMismatchError
from impala.envs.probe import build_env
from impala.envs.protocols import (
    EvalProtocol,
    NetworkActions,
    check_protocol_env,
    eval_protocol,
    network_action_map,
)
from impala.evaluation import EpisodeRecord, EvalConfig, EvalResult, PolicyCheckpoint
from impala.options import ConfigError
from impala.transport.messages import AgentSpec

PROG = "impala-eval"


class EvalError(ConfigError):
    """The checkpoint cannot play this env (or record it): one line, exit 2."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ---------------------------------------------------------------------------
# The agent: the actors' own adapter holding the checkpoint's weights
# ---------------------------------------------------------------------------


class _OneEnv:
    """What ``make_agent`` reads of a vector env, for one gymnasium env stepped directly."""

    num_envs = 1

    def __init__(self, env: gym.Env) -> None:
        self.action_space = env.action_space
        self.observation_space = env.observation_space


def checkpoint_agent(
    spec: AgentSpec, params: Mapping[str, np.ndarray], *, envs: Any, first_obs: np.ndarray, seed: int
) -> Agent:
    """The actor's agent adapter for ``envs`` (one env step per unroll), holding ``params``."""
    agent = make_agent(spec, envs=envs, first_obs=first_obs, unroll_length=1, seed=seed)
    agent.load_params(params)
    return agent


# ---------------------------------------------------------------------------
# Video: the raw screen with the step and score under it
# ---------------------------------------------------------------------------


def _caption(frame: np.ndarray, text: str) -> np.ndarray:
    """``frame`` with a black strip below holding ``text`` (white), sized to the frame."""
    import cv2

    h, w = frame.shape[:2]
    bar_h = max(14, h // 15)
    font = cv2.FONT_HERSHEY_PLAIN if bar_h < 24 else cv2.FONT_HERSHEY_SIMPLEX
    (tw, th), _ = cv2.getTextSize(text, font, 1.0, 1)
    scale = min((bar_h - 4) / th, (w - 6) / tw)
    bar = np.zeros((bar_h, w, 3), np.uint8)
    baseline = int(round((bar_h + th * scale) / 2))
    cv2.putText(bar, text, (3, baseline), font, scale, (255, 255, 255), 1, cv2.LINE_AA)
    out = np.concatenate([frame, bar], axis=0)
    # Even sides: what most MP4 decoders expect.
    return np.ascontiguousarray(out[: out.shape[0] // 2 * 2, : out.shape[1] // 2 * 2])


@dataclass
class VideoRecorder:
    """Frames into ``path``: MP4 (H.264, written as it goes) or GIF (Pillow, written at ``close``).

    The MP4 is H.264 in yuv420p with the index at the front (``+faststart``): what browsers play
    inline. OpenCV's wheels only write MPEG-4 Part 2 (``mp4v``), which they do not, so the frames
    go to the ffmpeg that imageio-ffmpeg ships (built with libx264), padded to an even size
    (yuv420p halves the chroma planes).
    """

    path: str
    fps: float
    scale: int = 2
    max_frames: int = 0
    frames: int = 0
    episodes: int = 0
    _writer: Any = None
    _images: list = field(default_factory=list)
    _tmp: str = ""
    _size: tuple[int, int] = (0, 0)

    @property
    def gif(self) -> bool:
        return self.path.lower().endswith(".gif")

    @property
    def full(self) -> bool:
        return bool(self.max_frames) and self.frames >= self.max_frames

    def add(self, rgb: np.ndarray, *, episode: int, step: int, score: float) -> None:
        if self.full:
            return
        rgb = np.asarray(rgb, dtype=np.uint8)
        if self.scale > 1:
            rgb = rgb.repeat(self.scale, axis=0).repeat(self.scale, axis=1)
        frame = _caption(rgb, f"ep {episode + 1}  step {step}  score {score:g}")
        if self.gif:
            from PIL import Image

            self._images.append(
                Image.fromarray(frame).convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
            )
        else:
            import cv2

            if self._writer is None:
                self._open_mp4(frame.shape[1] + frame.shape[1] % 2, frame.shape[0] + frame.shape[0] % 2)
            if (frame.shape[1], frame.shape[0]) != self._size:  # an odd size, or a render() that changed size
                if frame.shape[1] > self._size[0] or frame.shape[0] > self._size[1]:
                    frame = cv2.resize(frame, self._size, interpolation=cv2.INTER_NEAREST)
                bottom, right = self._size[1] - frame.shape[0], self._size[0] - frame.shape[1]
                frame = cv2.copyMakeBorder(frame, 0, bottom, 0, right, cv2.BORDER_CONSTANT, value=0)
            self._writer.send(np.ascontiguousarray(frame))
        self.frames += 1

    def _open_mp4(self, width: int, height: int) -> None:
        """Start ffmpeg writing H.264 to a temporary file next to ``path`` (renamed at ``close``)."""
        import imageio_ffmpeg

        folder, name = os.path.split(os.path.abspath(self.path))
        self._tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp.mp4")
        self._size = (width, height)
        self._writer = imageio_ffmpeg.write_frames(
            self._tmp,
            self._size,
            fps=float(self.fps),
            codec="libx264",
            pix_fmt_in="rgb24",
            pix_fmt_out="yuv420p",
            macro_block_size=1,  # the size is already even; imageio-ffmpeg would otherwise rescale to 16s
            ffmpeg_log_level="error",
            output_params=["-movflags", "+faststart"],
        )
        self._writer.send(None)  # the generator starts ffmpeg here

    def close(self) -> dict[str, Any]:
        if self.gif and self._images:
            first, rest = self._images[0], self._images[1:]
            # GIF delays are in 10 ms units
            first.save(
                self.path, save_all=True, append_images=rest, duration=int(round(100 / self.fps)) * 10, loop=0
            )
            self._images = []
        elif self._writer is not None:
            self._writer.close()  # ffmpeg finishes the file and exits
            os.replace(self._tmp, self.path)
            self._writer = None
        return {
            "path": os.path.abspath(self.path),
            "frames": self.frames,
            "fps": round(float(self.fps), 3),
            "episodes": self.episodes,
            "scale": self.scale,
            "max_frames": self.max_frames or None,
        }

    def discard(self) -> None:
        """Stop writing and delete the unfinished file."""
        if self._writer is not None:
            try:
                self._writer.close()
            except (OSError, RuntimeError):  # ffmpeg already gone: nothing left to finish
                pass
            self._writer = None
        if self._tmp and os.path.exists(self._tmp):
            os.unlink(self._tmp)
        self._images = []


def _screen(env: gym.Env) -> np.ndarray:
    ale = getattr(env.unwrapped, "ale", None)
    return ale.getScreenRGB() if ale is not None else np.asarray(env.render())


def _video_fps(env: gym.Env, protocol: EvalProtocol) -> float:
    cfg = protocol.expected
    if cfg is not None:  # one frame per agent step; the ALE runs at 60 Hz
        skip = (
            cfg.frameskip if isinstance(cfg.frameskip, int) else (cfg.frameskip[0] + cfg.frameskip[1] - 1) / 2
        )
        return 60.0 / skip
    return float(env.metadata.get("render_fps") or 30)


# ---------------------------------------------------------------------------
# The workers
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalJob:
    """What every worker needs, sent once per worker process."""

    protocol: EvalProtocol
    agent: AgentSpec
    params: dict[str, np.ndarray]
    policy: str = "greedy"
    seed: int = 0
    fingerprint_steps: int = 300
    video: str = ""
    video_episodes: int = 1
    video_max_frames: int = 0
    video_scale: int = 2

    def env_spec(self, render: bool) -> EnvSpec:
        spec = self.protocol.env
        if render and not spec.atari:  # gymnasium envs draw only when built to (Atari: the ALE's screen)
            # off-screen drawing needs no display: without this, pygame's SDL looks for one and prints
            # "XDG_RUNTIME_DIR is invalid" on a headless box (the frames come out the same)
            os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
            # and no sound card: pygame.init() opens SDL's audio too, which printed 18 "ALSA lib ..." lines on
            # a box with ALSA's library but no device
            os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
            return dataclasses.replace(spec, kwargs={**spec.kwargs, "render_mode": "rgb_array"})
        return spec


@dataclass
class TaskResult:
    """What one worker played: its episodes, the env checks it made and the video it recorded."""

    pid: int
    episodes: list[EpisodeRecord]
    checks: list[
        dict[str, Any]
    ]  # one per env this worker built: its fingerprint, checked against the protocol
    video: dict[str, Any] | None = None


class Player:
    """Plays episodes in one process: builds and checks its env once, an agent per episode."""

    def __init__(self, job: EvalJob) -> None:
        self.job = job
        self._envs: dict[bool, gym.Env] = {}
        self.checks: list[dict[str, Any]] = []

    def env(self, render: bool) -> gym.Env:
        job = self.job
        render = render and not job.protocol.env.atari  # Atari: the ALE's screen, no renderer needed
        if render in self._envs:
            return self._envs[render]
        env = build_env(job.env_spec(render), seed=job.seed)
        try:
            fp, problems = check_protocol_env(env, job.protocol, steps=job.fingerprint_steps, seed=job.seed)
            if problems:
                raise FingerprintMismatchError(
                    f"evaluation worker (pid {os.getpid()}) does not run protocol {job.protocol.name}: "
                    + "; ".join(map(str, problems))
                )
            index = network_action_map(env, job.protocol)
        except BaseException:
            env.close()
            raise
        self.checks.append({"env": "render" if render else "play", "fingerprint": fp.to_dict()})
        play = NetworkActions(env, index) if index is not None else env
        self._envs[render] = play
        return play

    def episode(self, index: int, *, recorder: VideoRecorder | None = None) -> EpisodeRecord:
        job = self.job
        env = self.env(recorder is not None)
        seed = job.seed + index
        obs, _ = env.reset(seed=seed)
        agent = checkpoint_agent(
            job.agent, job.params, envs=_OneEnv(env), first_obs=np.expand_dims(np.asarray(obs), 0), seed=seed
        )
        act = agent.act_greedy if job.policy == "greedy" else agent.act
        discrete = isinstance(env.action_space, gym.spaces.Discrete)
        step_cap = job.protocol.max_frames if job.protocol.expected is None else None
        ale = getattr(env.unwrapped, "ale", None)
        steps, total, first = 0, 0.0, np.ones(1, dtype=bool)
        if recorder is not None:
            recorder.add(_screen(env), episode=index, step=0, score=0.0)
        while True:
            actions, _ = act(np.expand_dims(np.asarray(obs), 0), first)
            action = int(actions[0]) if discrete else np.asarray(actions[0])
            obs, reward, terminated, truncated, _ = env.step(action)
            first = np.zeros(1, dtype=bool)
            steps += 1
            total += float(reward)
            if recorder is not None:
                recorder.add(_screen(env), episode=index, step=steps, score=total)
            capped = bool(step_cap) and steps >= step_cap
            if terminated or truncated or capped:
                break
        frames = int(ale.getEpisodeFrameNumber()) if ale is not None else steps
        return EpisodeRecord(
            index, seed, total, steps, frames, bool(truncated or capped) and not terminated, os.getpid()
        )

    def run(self, indices: tuple[int, ...], record: bool) -> TaskResult:
        recorder = None
        if record and self.job.video:
            recorder = VideoRecorder(
                self.job.video,
                _video_fps(self.env(True), self.job.protocol),
                self.job.video_scale,
                self.job.video_max_frames,
            )
        try:
            records = []
            for i in indices:
                records.append(self.episode(i, recorder=recorder))
                if recorder is not None:
                    recorder.episodes += 1
            video = recorder.close() if recorder is not None else None
        except BaseException:
            if recorder is not None:
                recorder.discard()
            raise
        return TaskResult(os.getpid(), records, list(self.checks), video)

    def close(self) -> None:
        for env in self._envs.values():
            env.close()
        self._envs = {}


_PLAYER: Player | None = None  # per worker process


def _init_worker(job: EvalJob) -> None:
    global _PLAYER
    import torch

    torch.set_num_threads(1)  # one core per worker; the pool has as many workers as cores
    _PLAYER = Player(job)


def _run_task(task: tuple[tuple[int, ...], bool]) -> TaskResult:
    assert _PLAYER is not None
    return _PLAYER.run(*task)


def _tasks(job: EvalJob, episodes: int) -> list[tuple[tuple[int, ...], bool]]:
    """The recorded episodes as one task (one worker writes the file), then one task per episode."""
    recorded = min(job.video_episodes, episodes) if job.video else 0
    tasks = [(tuple(range(recorded)), True)] if recorded else []
    return tasks + [((i,), False) for i in range(recorded, episodes)]


def run_episodes(job: EvalJob, *, episodes: int, workers: int) -> list[TaskResult]:
    """Play ``episodes`` episodes: in this process (``workers`` 0) or in up to ``workers`` spawned processes.

    A worker whose env differs from the protocol raises ``FingerprintMismatchError`` here; the
    other workers are stopped at once.
    """
    tasks = _tasks(job, episodes)
    if workers == 0:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one env, batch 1: more threads only contend (10x slower on 2 busy cores)
        player = Player(job)
        try:
            return [player.run(*t) for t in tasks]
        finally:
            player.close()
            torch.set_num_threads(threads)
    ex = concurrent.futures.ProcessPoolExecutor(
        max_workers=min(workers, len(tasks)),
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(job,),
    )
    try:
        futures = [ex.submit(_run_task, t) for t in tasks]
        results = [f.result() for f in concurrent.futures.as_completed(futures)]
    except BaseException:
        # Stop the other workers now rather than after their current (possibly long) episode.
        procs = list((getattr(ex, "_processes", None) or {}).values())
        ex.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.join(timeout=10)
        raise
    ex.shutdown(wait=True)
    return results


def _probe(job: EvalJob) -> None:
    """Build the protocol's env and the agent here once, so that a checkpoint that cannot play it is one
    clean error."""
    env = None
    try:
        env = build_env(job.env_spec(bool(job.video)), seed=job.seed)
        index = network_action_map(env, job.protocol)
        play = NetworkActions(env, index) if index is not None else env
        obs, _ = play.reset(seed=job.seed)
        agent = checkpoint_agent(
            job.agent,
            job.params,
            envs=_OneEnv(play),
            first_obs=np.expand_dims(np.asarray(obs), 0),
            seed=job.seed,
        )
        agent.act(np.expand_dims(np.asarray(obs), 0), np.ones(1, dtype=bool))
        if job.video:
            try:
                frame = _screen(play)
            except Exception as e:  # noqa: BLE001 - a renderer that is not installed, no display, ...
                raise EvalError(
                    f"--video: {job.protocol.env.id} cannot draw its screen here: {_first_line(e)}"
                ) from None
            if frame is None or np.ndim(frame) != 3:
                raise EvalError(f"--video: {job.protocol.env.id}'s render() gives no RGB frame")
    except (EvalError, ConfigError):
        raise
    except Exception as e:  # noqa: BLE001 - any checkpoint that cannot act in this env is bad input
        raise EvalError(
            f"the checkpoint cannot play {job.protocol.env.id} under protocol {job.protocol.name}: "
            f"{_first_line(e)}"
        ) from None
    finally:
        if env is not None:
            env.close()


# ---------------------------------------------------------------------------
# The evaluation
# ---------------------------------------------------------------------------


def evaluate_params(
    env: EnvSpec,
    agent: AgentSpec,
    params: Mapping[str, np.ndarray],
    *,
    protocol: str = "train",
    policy: str = "greedy",
    episodes: int = 10,
    workers: int = 1,
    seed: int = 0,
    max_frames: int = 0,
    video: str = "",
    video_episodes: int = 1,
    video_max_frames: int = 0,
    video_scale: int = 2,
    fingerprint_steps: int = 300,
    checkpoint: PolicyCheckpoint | None = None,
) -> EvalResult:
    """Play ``episodes`` episodes of the policy ``params`` (``{name: array}``, a weights message's
    content) on ``env`` (as trained) under ``protocol``; see :class:`impala.evaluation.EvalConfig`.

    ``workers`` 0 plays in the calling process. Raises ``ConfigError`` (``ProtocolError``,
    ``EvalError``) for options or a protocol this env cannot do, ``FingerprintMismatchError``
    when a worker's env differs from the protocol.
    """
    options = EvalConfig(
        episodes=episodes,
        workers=workers,
        policy=policy,
        protocol=protocol,
        max_frames=max_frames,
        seed=seed,
        video=video,
        video_episodes=video_episodes,
        video_max_frames=video_max_frames,
        video_scale=video_scale,
    )
    proto = eval_protocol(env, options.protocol, max_frames=options.max_frames)
    job = EvalJob(
        proto,
        agent,
        {k: np.asarray(v) for k, v in params.items()},
        options.policy,
        options.seed,
        fingerprint_steps,
        options.video,
        options.video_episodes,
        options.video_max_frames,
        options.video_scale,
    )
    start = time.monotonic()
    _probe(job)
    results = run_episodes(job, episodes=options.episodes, workers=options.workers)
    wall = time.monotonic() - start
    records = tuple(sorted((e for r in results for e in r.episodes), key=lambda e: e.index))
    by_pid: dict[int, dict[str, Any]] = {}
    for r in results:
        entry = by_pid.setdefault(r.pid, {"pid": r.pid, "checked": [], "episodes": []})
        for check in r.checks:
            if check["env"] not in [c["env"] for c in entry["checked"]]:
                entry["checked"].append(check)
        entry["episodes"] += [e.index for e in r.episodes]
    for entry in by_pid.values():
        entry["episodes"].sort()
    video_info = next((r.video for r in results if r.video), None)
    return EvalResult(
        protocol=proto.name,
        settings=proto.settings(),
        policy=options.policy,
        seed=options.seed,
        episodes=records,
        workers=tuple(by_pid[p] for p in sorted(by_pid)),
        wall_time_s=wall,
        env=env.to_dict(),
        agent=agent.to_dict(),
        video=video_info,
        checkpoint=checkpoint.describe() if checkpoint else None,
        config=checkpoint.config if checkpoint else None,
    )


def evaluate_checkpoint(
    ckpt: PolicyCheckpoint, options: EvalConfig, *, fingerprint_steps: int = 300
) -> EvalResult:
    """:func:`evaluate_params` for a checkpoint (``read_policy_checkpoint``), with ``impala-eval``'s
    options."""
    return evaluate_params(
        ckpt.env,
        ckpt.agent,
        ckpt.params,
        protocol=options.protocol,
        policy=options.policy,
        episodes=options.episodes,
        workers=options.workers,
        seed=options.seed,
        max_frames=options.max_frames,
        video=options.video,
        video_episodes=options.video_episodes,
        video_max_frames=options.video_max_frames,
        video_scale=options.video_scale,
        fingerprint_steps=fingerprint_steps,
        checkpoint=ckpt,
    )
