"""Judging a trained policy: what a checkpoint holds for playing, the options of an evaluation, its result.

The pure parts of ``impala-eval`` (``learner.evaluator`` plays the episodes in worker
processes through the actors' own agent code):

- :func:`read_policy_checkpoint`: a ``checkpoint.pt`` of either learner (or a run's logdir)
  as a :class:`PolicyCheckpoint`: the env and agent specs the actors ran and the policy's
  weights as named arrays (what a weights message carries). Checkpoints written before the
  runtime recorded ``kind``/``env``/``agent`` are IMPALA's; their flat config record says
  the same (``env``, ``env_kwargs``, ``model``, ``use_lstm``).
- :class:`EvalConfig`: the options, one flag each (``impala.options.add_flags``).
- :class:`EpisodeRecord`, :class:`EvalResult`: per-episode figures and the summary, with
  ``to_dict()`` for the JSON file; every result names its protocol and its settings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import numpy as np

from impala.envs import EnvSpec, UnknownEnvError, check_env_id
from impala.envs.protocols import ProtocolName
from impala.options import ConfigError, check_fields, need, option
from impala.run.checkpoint import CheckpointError, load_checkpoint
from impala.run.config import POPART_BETA
from impala.run.cpus import available_cpus
from impala.transport.messages import AgentSpec, ImpalaAgentSpec, agent_spec_from_dict

RESULT_SCHEMA = "impala-eval/1"
VIDEO_SUFFIXES = (".mp4", ".gif")


# ---------------------------------------------------------------------------
# The checkpoint as a policy
# ---------------------------------------------------------------------------


def checkpoint_path(path: str) -> str:
    """``path`` itself, or ``path/checkpoint.pt`` when ``path`` is a run's logdir."""
    return os.path.join(path, "checkpoint.pt") if os.path.isdir(path) else path


def file_sha256(path: str) -> str:
    """The file's SHA-256 (an evaluation names the exact checkpoint it judged)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class PolicyCheckpoint:
    """What playing a checkpoint needs. ``params``: ``{name: array}`` of the network's state dict
    (``impala.transport.params.state_dict_arrays``' format); ``legacy``: read from an older IMPALA
    checkpoint's flat config record."""

    path: str
    sha256: str
    kind: str
    env: EnvSpec
    agent: AgentSpec
    params: dict[str, np.ndarray]
    config: dict[str, Any]
    env_frames: int | None
    agent_steps: int | None
    legacy: bool = False
    tasks: tuple[EnvSpec, ...] = ()  # a multi-task checkpoint's envs in task order (``env`` is the first)

    def select_tasks(self, task: str) -> list[EnvSpec]:
        """The envs ``impala-eval --task`` asks for: every task when empty, else the one named."""
        tasks = list(self.tasks) or [self.env]
        if not task:
            return tasks
        chosen = [t for t in tasks if t.id == task]
        if not chosen:
            raise ConfigError(
                f"--task {task}: checkpoint {self.path} was trained on {', '.join(t.id for t in tasks)}"
            )
        return chosen

    def describe(self) -> dict[str, Any]:
        """Plain data for the result: which file, which learner, how far it was trained."""
        return {
            "path": os.path.abspath(self.path),
            "sha256": self.sha256,
            "kind": self.kind,
            "format": "legacy (config record only)" if self.legacy else "kind/env/agent",
            "env_frames": self.env_frames,
            "agent_steps": self.agent_steps,
        }


def _arrays(state_dict: Any, what: str) -> dict[str, np.ndarray]:
    import torch

    if (
        not isinstance(state_dict, Mapping)
        or not state_dict
        or not all(isinstance(v, torch.Tensor) for v in state_dict.values())
    ):
        raise CheckpointError(f"{what} is not a network state dict")
    return {str(k): v.detach().to("cpu").contiguous().numpy() for k, v in state_dict.items()}


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def read_policy_checkpoint(path: str) -> PolicyCheckpoint:
    """The policy in a ``launch_impala`` / ``launch_ppo`` checkpoint (or a run's logdir).

    Raises :class:`CheckpointError` (one line naming the file) for a missing, unreadable or
    foreign file and for a checkpoint of an env that is not installed here.
    """
    file = checkpoint_path(path)
    if not os.path.exists(file):
        raise CheckpointError(f"no checkpoint at {file}")
    state = load_checkpoint(file)
    trainer = state.get("trainer")
    if not isinstance(trainer, Mapping) or not isinstance(state.get("config"), Mapping):
        raise CheckpointError(
            f"checkpoint {file} holds no trainer state and config: not a launch_impala or launch_ppo "
            "checkpoint"
        )
    config = dict(state["config"])
    try:
        if "kind" in state:
            kind = state["kind"]
            if kind not in ("impala", "ppo"):
                raise CheckpointError(f"checkpoint {file}: unknown learner kind {kind!r}")
            env = EnvSpec.from_dict(state.get("env"))
            agent = agent_spec_from_dict(state.get("agent"))
            weights = trainer.get("model" if kind == "impala" else "policy")
            legacy = False
            raw_tasks = state.get("tasks") or []
            if not isinstance(raw_tasks, list):
                raise ValueError("tasks must be a list of env specs")
            tasks = tuple(EnvSpec.from_dict(t) for t in raw_tasks)
        else:
            # Written before the runtime recorded kind/env/agent: IMPALA's, with a flat config record.
            if (
                not isinstance(config.get("env"), str)
                or not isinstance(config.get("model"), str)
                or "model" not in trainer
            ):
                raise CheckpointError(
                    f"checkpoint {file} records neither kind/env/agent nor an IMPALA config (env, model): "
                    "not a launch_impala or launch_ppo checkpoint"
                )
            kwargs = json.loads(config["env_kwargs"]) if config.get("env_kwargs") else {}
            if not isinstance(kwargs, dict):
                raise CheckpointError(
                    f"checkpoint {file}: its env_kwargs {config['env_kwargs']!r} is not a JSON object"
                )
            kind = "impala"
            env = EnvSpec(config["env"], kwargs)
            agent = ImpalaAgentSpec(
                config["model"],
                bool(config.get("use_lstm", False)),
                float(config.get("popart_beta", POPART_BETA)),
            )
            weights = trainer["model"]
            legacy = True
            tasks = ()
    except UnknownEnvError as e:
        raise CheckpointError(
            f"checkpoint {file} was trained on an env that is not installed here: {e}"
        ) from None
    except (ValueError, TypeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"checkpoint {file}: its env/agent record is unusable ({e})") from None
    params = _arrays(weights, f"checkpoint {file}: trainer['{'model' if kind == 'impala' else 'policy'}']")
    return PolicyCheckpoint(
        file,
        file_sha256(file),
        kind,
        env,
        agent,
        params,
        config,
        _int_or_none(state.get("env_frames")),
        _int_or_none(state.get("agent_steps")),
        legacy,
        tasks,
    )


# ---------------------------------------------------------------------------
# The options
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalConfig:
    """``impala-eval``'s options (the checkpoint is the positional argument)."""

    episodes: int = option(30, "Episodes to play.")
    workers: int = option(
        available_cpus(),
        "Worker processes playing the episodes (each builds its env, measures its fingerprint and checks it "
        "against the protocol); 0 plays them in this process. Default: one per CPU.",
    )
    policy: Literal["sample", "greedy"] = option(
        "sample",
        "'sample': actions drawn from the policy, as the actors do; 'greedy': the most likely action (argmax "
        "of the logits; PPO: the mean action).",
    )
    protocol: ProtocolName = option(
        "train",
        "'train': the env exactly as trained. Atari only: 'machado' (sticky actions 0.25, full action set, "
        "no no-op starts, 108,000-frame cap; Machado et al. 2018) or 'dqn' (up to 30 no-op starts, no sticky "
        "actions, 108,000-frame cap).",
    )
    max_frames: int = option(
        0,
        "Cut each episode after this many env frames (Atari: emulator frames, the ALE's own cap; other envs: "
        "agent steps); 0: the protocol's cap (108,000 for machado and dqn, the env's step limit for train). "
        "A capped result says so in its settings.",
    )
    seed: int = option(
        0, "Episode i resets its env and seeds its agent with seed + i, whichever worker plays it."
    )
    out: str = option(
        "",
        "JSON result file; a relative name goes into the run folder (the checkpoint's). Default: "
        "eval-PROTOCOL-POLICY-EPISODES.json there (eval-train-sample-30.json), so runs of other settings "
        "keep their files.",
    )
    video: str = option(
        "",
        "Record the first episode(s) as OUT.mp4 (H.264, plays in browsers) or OUT.gif (Pillow); a "
        "relative name goes into the run folder (the checkpoint's): the raw RGB screen (Atari: the ALE's "
        "screen; other envs: render()), not the network's input, with the step and score drawn under it.",
    )
    video_episodes: int = option(1, "Episodes recorded into --video, one after the other.")
    video_max_frames: int = option(
        0,
        "Stop recording after this many frames (0: whole episodes); the episodes are still played to their "
        "end.",
    )
    video_scale: int = option(
        2, "Enlarge the recorded frames by this factor (nearest neighbour; 1 keeps a GIF small)."
    )
    task: str = option(
        "",
        "Multi-task checkpoints: play only this task (its env id). Empty: every task in turn, each with its "
        "own table and result file (eval-PROTOCOL-POLICY-ENV.json; --out and --video names get -ENV too).",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        need(self.episodes >= 1, f"--episodes must be >= 1, got {self.episodes}")
        need(self.workers >= 0, f"--workers must be >= 0 (0: play in this process), got {self.workers}")
        need(
            self.max_frames >= 0, f"--max-frames must be >= 0 (0: the protocol's cap), got {self.max_frames}"
        )
        need(
            0 <= self.seed < 2**31 - self.episodes,
            f"--seed must be in [0, 2**31 - episodes), got {self.seed}",
        )
        need(
            1 <= self.video_episodes <= self.episodes,
            f"--video-episodes must be in 1..--episodes ({self.episodes}), got {self.video_episodes}",
        )
        need(
            self.video_max_frames >= 0,
            f"--video-max-frames must be >= 0 (0: whole episodes), got {self.video_max_frames}",
        )
        need(1 <= self.video_scale <= 8, f"--video-scale must be in 1..8, got {self.video_scale}")
        if self.video:
            need(
                os.path.splitext(self.video)[1].lower() in VIDEO_SUFFIXES,
                f"--video {self.video}: the name must end in .mp4 or .gif",
            )
        if self.out:
            need(not os.path.isdir(self.out), f"--out {self.out} is a directory; give a file name")
        if (
            self.task
        ):  # which tasks the checkpoint has is known only once it is read; the id can be checked now
            check_env_id(self.task)

    def check_paths(self) -> None:
        """Fail before playing when --out or --video cannot be written."""
        for flag, path in (("--out", self.out), ("--video", self.video)):
            if path:
                check_writable(path, flag)

    def result_path(self, checkpoint_file: str) -> str:
        """``--out``, else eval-PROTOCOL-POLICY-EPISODES.json next to the checkpoint: the name says what was
        measured, so a 2-episode look never overwrites a 30-episode result."""
        name = f"eval-{self.protocol}-{self.policy}-{self.episodes}.json"
        return self.out or os.path.join(os.path.dirname(os.path.abspath(checkpoint_file)), name)

    def in_run_folder(self, run_folder: str) -> "EvalConfig":
        """Relative ``--out`` and ``--video`` names joined to ``run_folder``: what a run's evaluation writes
        stays with the run, wherever the command was typed."""

        def place(path: str) -> str:
            return os.path.join(run_folder, path) if path and not os.path.isabs(path) else path

        return dataclasses.replace(self, out=place(self.out), video=place(self.video))

    def for_task(self, env_id: str, checkpoint_file: str) -> "EvalConfig":
        """This evaluation for one task of a multi-task checkpoint: its own result file and video."""
        return dataclasses.replace(
            self,
            out=task_file(self.result_path(checkpoint_file), env_id),
            video=task_file(self.video, env_id) if self.video else "",
        )


def task_file(path: str, env_id: str) -> str:
    """``eval.json`` -> ``eval-PongDeterministic-v4.json`` (``/`` in ids such as ``ALE/Pong-v5`` becomes
    ``_``)."""
    root, ext = os.path.splitext(path)
    return f"{root}-{env_id.replace('/', '_')}{ext}"


def check_writable(path: str, flag: str) -> None:
    """ConfigError unless ``path`` can be written (its folder exists and is writable)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: cannot write into {folder}")


# ---------------------------------------------------------------------------
# The result
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class EpisodeRecord:
    """One played episode. ``frames``: env frames (Atari: the ALE's episode frame counter, no-op
    starts included; otherwise agent steps). ``capped``: ended by a step or frame cap, not by the game."""

    index: int
    seed: int
    ret: float
    steps: int
    frames: int
    capped: bool
    worker: int  # pid of the process that played it


def return_stats(returns: list[float] | np.ndarray) -> dict[str, float]:
    """mean, std (population, ddof 0), median, min, max."""
    r = np.asarray(returns, dtype=np.float64)
    if r.size == 0:
        return {k: math.nan for k in ("mean", "std", "median", "min", "max")}
    return {
        "mean": float(r.mean()),
        "std": float(r.std()),
        "median": float(np.median(r)),
        "min": float(r.min()),
        "max": float(r.max()),
    }


@dataclass(frozen=True)
class EvalResult:
    """What an evaluation measured, under which protocol, with which policy and seed.

    workers: one entry per process that played: its pid, the fingerprint it measured on its own
    env (checked against the protocol before its first episode), and the episodes it played.
    """

    protocol: str
    settings: dict[str, Any]
    policy: str
    seed: int
    episodes: tuple[EpisodeRecord, ...]
    workers: tuple[dict[str, Any], ...]
    wall_time_s: float
    env: dict[str, Any]
    agent: dict[str, Any]
    video: dict[str, Any] | None = None
    checkpoint: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def returns(self) -> list[float]:
        return [e.ret for e in self.episodes]

    @property
    def stats(self) -> dict[str, float]:
        return return_stats(self.returns)

    @property
    def total_frames(self) -> int:
        return int(sum(e.frames for e in self.episodes))

    @property
    def total_steps(self) -> int:
        return int(sum(e.steps for e in self.episodes))

    def to_dict(self) -> dict[str, Any]:
        """The JSON file's content (``RESULT_SCHEMA``)."""
        return {
            "schema": RESULT_SCHEMA,
            "protocol": self.protocol,
            "settings": self.settings,
            "policy": self.policy,
            "seed": self.seed,
            "episodes": len(self.episodes),
            **self.stats,
            "returns": self.returns,
            "episode_steps": [e.steps for e in self.episodes],
            "episode_frames": [e.frames for e in self.episodes],
            "episode_capped": [e.capped for e in self.episodes],
            "episode_seeds": [e.seed for e in self.episodes],
            "total_steps": self.total_steps,
            "total_frames": self.total_frames,
            "wall_time_s": round(self.wall_time_s, 3),
            "workers": list(self.workers),
            "env": self.env,
            "agent": self.agent,
            "checkpoint": self.checkpoint,
            "config": self.config,
            "video": self.video,
            **self.extra,
        }
