"""The Python API: train a run and load a trained agent from Python (a script, a notebook, a sweep).

``impala.train`` / ``impala.train_ppo`` run the same launch as ``launch_impala`` / ``launch_ppo``, with the
settings as keyword arguments named as the command line's options (``learning_rate=2e-3`` for
``--learning-rate 2e-3``; ``config="atari"`` for ``--config atari``), checked by the same parser, so a bad
setting raises :class:`ImpalaError` with the line the command line prints. ``impala.load`` reads a run
folder or checkpoint of either launcher and returns an :class:`Agent` that acts on observations and plays
evaluation episodes.

    import impala
    result = impala.train(env="CartPole-v1", workers=1, total_frames=20_000, logdir="runs/cp")
    agent = impala.load(result.run_folder)
    action = agent.act(observation)                   # one observation, or a batch
    print(agent.evaluate(episodes=10).stats["mean"])
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import io
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping

import gymnasium as gym
import numpy as np

from actors.agents import make_agent
from impala.envs import make_env
from impala.evaluation import EvalResult, PolicyCheckpoint, read_policy_checkpoint
from impala.options import ConfigError
from impala.run.checkpoint import FINISHED_MARKER, CheckpointError
from learner.cli import launch_impala, launch_ppo
from learner.evaluator import evaluate_params
from learner.run.runtime import LaunchError, Outcome


class ImpalaError(Exception):
    """Anything the command line would refuse or report as an error, with the same one-line message."""


@dataclass(frozen=True)
class TrainResult:
    """What a run did. ``run_folder``: its folder, absolute (config.yaml, metrics.csv, checkpoint.pt);
    ``checkpoint``: the checkpoint's absolute path, or None when nothing was trained; ``mean_return``: the
    mean return of the last 100 training episodes (None before the first); ``interrupted``: stopped by Ctrl-C
    or SIGTERM (its checkpoint written); ``finished_before``: a ``resume=True`` of a run that had used up its
    budget, so nothing ran."""

    run_folder: str
    env_frames: int
    agent_steps: int
    updates: int
    mean_return: float | None
    checkpoint: str | None
    interrupted: bool = False
    finished_before: bool = False


def train(env: str, **settings: Any) -> TrainResult:
    """Train IMPALA (``launch_impala``) on ``env`` (a comma-separated list: one multi-task agent) with the
    command line's settings by name, e.g. ``impala.train(env="CartPole-v1", workers=2, unroll_length=20,
    batch_size=8, learning_rate=2e-3, total_frames=400_000, logdir="runs/cartpole")``; ``config`` names a
    preset (``"atari"``) or a preset file. Blocks until the run ends; Ctrl-C stops it after its update with
    a checkpoint (``interrupted=True``), and its actor processes end with it."""
    return _train(launch_impala, {"env": env, **settings})


def train_ppo(env: str | None = None, **settings: Any) -> TrainResult:
    """Train PPO (``launch_ppo``) with its settings by name (``semantics="sb3"``, ``unity_build=...``,
    ``total_steps=...``, ``config="cartpole_ppo_sb3"``); ``env`` None is the Crawler job's stand-in."""
    return _train(launch_ppo, {"env": env, **settings} if env is not None else settings)


def _train(launcher: Any, settings: Mapping[str, Any]) -> TrainResult:
    _check_main_guard()
    parser = launcher.build_parser()
    argv = settings_argv(parser, settings)
    prog = parser.prog
    try:
        with _argparse_errors(prog):
            launcher.parse_args(argv)  # a bad value is argparse's error line, said before anything starts
        with _spawnable_main():
            outcome: Outcome = launcher.launch(argv)
    except (LaunchError, ConfigError) as e:
        raise ImpalaError(f"{prog}: {e}") from None
    folder = os.path.abspath(outcome.config.logdir)
    if outcome.result is None:  # resumed a finished run: what its marker and checkpoint say
        with open(os.path.join(folder, FINISHED_MARKER)) as f:
            marker = json.load(f)
        checkpoint = os.path.abspath(outcome.config.checkpoint_path)
        saved = checkpoint if os.path.isfile(checkpoint) else None
        frames, steps = int(marker.get("env_frames", 0)), int(marker.get("agent_steps", 0))
        return TrainResult(
            folder, frames, steps, int(marker.get("version", 0)), None, saved, finished_before=True
        )
    r = outcome.result
    saved = os.path.abspath(r.checkpoint) if r.checkpoint else None
    return TrainResult(folder, r.env_frames, r.agent_steps, r.updates, r.mean_return, saved,
                       r.interrupted)  # fmt: skip


@contextlib.contextmanager
def _spawnable_main():
    """A program read from stdin (``python - < job.py``, a heredoc) has ``__main__.__file__ == "<stdin>"``:
    multiprocessing's spawn would have each actor process run that path as a script, find no such file and
    die before it says hello, and the run would wait out its hello timeout. Without ``__file__`` spawn
    imports no main module in the children (as for a notebook or ``python -c``), which is all stdin allows."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or os.path.isfile(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _check_main_guard() -> None:
    """Refuse a call at a script's top level outside ``if __name__ == "__main__":``. The actor processes
    start with multiprocessing's spawn, which imports the script again in each of them: unguarded, every
    actor would start a run of its own instead of acting (Python's rule for spawn, as for PyTorch's
    DataLoader workers or SB3's SubprocVecEnv). A notebook, ``python -c`` and a guarded script pass."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path or not os.path.isfile(path):
        return
    frame = sys._getframe(2)
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:  # called from a function: the script's own guard decides, as it should
        return
    try:
        tree = ast.parse(open(path).read())
    except (OSError, SyntaxError, ValueError):
        return
    line = frame.f_lineno
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _tests_main(node.test) and node.lineno <= line <= node.end_lineno:
            return
    raise ImpalaError(
        f"{os.path.basename(path)}:{line}: the run starts at the script's top level; its actor processes "
        "import the script again (multiprocessing's spawn) and would each start a run: put the call under "
        'if __name__ == "__main__":'
    )


def _tests_main(test: ast.expr) -> bool:
    """Whether an ``if`` tests ``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    mains = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return bool(names and mains)


def settings_argv(parser: argparse.ArgumentParser, settings: Mapping[str, Any]) -> list[str]:
    """``settings`` (option name -> value) as the command line ``parser`` reads: ``x=True`` is ``--x`` (or
    ``--no-x`` for False), None an optional option's ``none``, lists and tuples comma-separated, anything
    else its ``str``. A name that is no option of the parser raises :class:`ImpalaError`, naming the
    closest."""
    by_name: dict[str, argparse.Action] = {}
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--") and not o.startswith("--no-")]
        if longs:
            by_name[action.dest.removeprefix("ppo__")] = action
            for flag in longs:
                by_name.setdefault(flag[2:].replace("-", "_"), action)
    argv: list[str] = []
    for name, value in settings.items():
        action = by_name.get(name)
        if action is None or isinstance(action, argparse._HelpAction):
            close = difflib.get_close_matches(name, list(by_name), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ImpalaError(f"{parser.prog}: unknown setting {name!r}{hint}")
        flag = max((o for o in action.option_strings if not o.startswith("--no-")), key=len)
        if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise ImpalaError(f"{parser.prog}: {name} must be True or False, got {value!r}")
            if isinstance(action, argparse.BooleanOptionalAction):
                argv.append(flag if value else f"--no-{flag[2:]}")
            elif value:
                argv.append(flag)
            continue
        if value is None:
            text = "none"
        elif isinstance(value, (list, tuple)):
            text = ",".join(str(v) for v in value)
        else:
            text = str(value)
        argv.append(f"{flag}={text}")
    return argv


@contextlib.contextmanager
def _argparse_errors(prog: str):
    """argparse's own errors (a bad value) print a line and exit 2: here they raise :class:`ImpalaError`
    with that line."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            yield
    except SystemExit as e:
        if e.code in (0, None):
            raise
        lines = [line for line in err.getvalue().splitlines() if line.startswith(f"{prog}: error: ")]
        raise ImpalaError(
            lines[-1].replace(": error:", ":", 1) if lines else f"{prog}: exit {e.code}"
        ) from None


class Agent:
    """A trained policy, loaded from a checkpoint (:func:`load`): the actors' own network and action
    mapping, so it acts as it did in training (Atari: on the preprocessed, stacked frames the run's env
    gives; PPO: the env actions, clipped as the run sent them)."""

    def __init__(self, checkpoint: PolicyCheckpoint) -> None:
        self.checkpoint = checkpoint
        self.kind = checkpoint.kind  # "impala" or "ppo"
        self.env_id = checkpoint.env.id
        self.tasks = tuple(t.id for t in checkpoint.tasks) or (checkpoint.env.id,)
        if checkpoint.env.is_unity:
            raise ImpalaError(
                f"checkpoint {checkpoint.path} plays a Unity build: act on it through the build's ONNX file "
                "or impala-eval"
            )
        probe = make_env(checkpoint.env, seed=0)
        try:
            self.observation_space = probe.observation_space
            self.action_space = probe.action_space
        finally:
            probe.close()
        self._adapters: dict[int, Any] = {}  # batch size -> the actor's adapter for that many envs
        self._started: set[int] = set()

    def act(self, observation: Any, *, greedy: bool = True, first: Any = None) -> Any:
        """The action for one observation (its env's shape), or one per row of a batch ``[N, *shape]``.
        ``greedy``: the most likely action (False: sampled, as in training). ``first``: whether each
        observation starts an episode (a recurrent core starts over); by default only the first call
        for a batch size does. Returns an int (discrete, one observation), an array otherwise."""
        obs = np.asarray(observation)
        shape = self.observation_space.shape
        single = obs.shape == tuple(shape)
        batch = obs[None] if single else obs
        if batch.ndim != len(shape) + 1 or batch.shape[1:] != tuple(shape):
            raise ImpalaError(
                f"act: an observation of shape {tuple(shape)} (or a batch of them, [N, ...]) was expected, "
                f"got {obs.shape}"
            )
        batch = batch.astype(self.observation_space.dtype, copy=False)
        n = batch.shape[0]
        adapter = self._adapter(n, batch)
        if first is None:
            starts = np.full(n, n not in self._started, dtype=bool)
        else:
            starts = np.broadcast_to(np.asarray(first, dtype=bool), (n,)).copy()
        self._started.add(n)
        actions, _ = (adapter.act_greedy if greedy else adapter.act)(batch, starts)
        if single:
            return int(actions[0]) if isinstance(self.action_space, gym.spaces.Discrete) else actions[0]
        return actions

    def reset(self) -> None:
        """Start every batch over: the next :meth:`act` begins new episodes."""
        self._started.clear()

    def _adapter(self, n: int, first_obs: np.ndarray) -> Any:
        if n not in self._adapters:
            envs = argparse.Namespace(
                num_envs=n, observation_space=self.observation_space, action_space=self.action_space
            )
            adapter = make_agent(
                self.checkpoint.agent, envs=envs, first_obs=first_obs, unroll_length=1, seed=0
            )
            adapter.load_params(self.checkpoint.params)
            self._adapters[n] = adapter
        return self._adapters[n]

    def evaluate(
        self,
        episodes: int = 10,
        *,
        protocol: str = "train",
        greedy: bool = True,
        task: str | None = None,
        seed: int = 0,
        workers: int = 0,
        video: str = "",
    ) -> EvalResult | dict[str, EvalResult]:
        """Play ``episodes`` episodes as ``impala-eval`` does (``protocol``: 'train' as trained, 'dqn'
        (no-op starts, 108k-frame cap), 'machado' (sticky actions, full action set)) and return the result
        (``.stats``: mean, std, median, min, max; ``.returns``). A multi-task agent plays every task (a
        dict by env id) unless ``task`` names one."""
        specs = list(self.checkpoint.tasks) or [self.checkpoint.env]
        if task is not None:
            specs = [s for s in specs if s.id == task]
            if not specs:
                raise ImpalaError(
                    f"evaluate: task {task!r}: the agent was trained on {', '.join(self.tasks)}"
                )
        results = {}
        for spec in specs:
            try:
                results[spec.id] = evaluate_params(
                    spec, self.checkpoint.agent, self.checkpoint.params, protocol=protocol,
                    policy="greedy" if greedy else "sample", episodes=episodes, workers=workers, seed=seed,
                    video=video if spec is specs[0] else "", checkpoint=self.checkpoint,
                )  # fmt: skip
            except ConfigError as e:
                raise ImpalaError(f"evaluate: {e}") from None
        return (
            results[specs[0].id]
            if len(specs) == 1 and (task is not None or len(self.tasks) == 1)
            else results
        )


def load(path: str | os.PathLike | TrainResult) -> Agent:
    """The agent of a run folder (its checkpoint.pt) or of a checkpoint file, from either launcher; or of what
    ``train`` returned (its checkpoint, or its folder when it trained nothing, which then says so)."""
    if isinstance(path, TrainResult):
        path = path.checkpoint or path.run_folder
    if not isinstance(path, (str, os.PathLike)):
        got = type(path).__name__
        raise ImpalaError(f"load: a run folder, a checkpoint file or a TrainResult, got {got}")
    try:
        return Agent(read_policy_checkpoint(os.fspath(path)))
    except (CheckpointError, ConfigError) as e:
        raise ImpalaError(f"load: {e}") from None
