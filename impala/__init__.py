"""impala-rl: IMPALA (V-trace, PopArt) and PPO actor-learners. The Python API::

    import impala
    result = impala.train(env="CartPole-v1", workers=2, total_frames=400_000, logdir="runs/cartpole")
    agent = impala.load(result.run_folder)
    action = agent.act(observation)
    print(agent.evaluate(episodes=10).stats["mean"])

``train`` / ``train_ppo`` take the command line's settings by name (``learning_rate=2e-3``,
``config="atari"``); ``load`` reads a run folder or checkpoint of either launcher; errors are
:class:`ImpalaError` with the command line's one-line message (``learner.api``).

The library both learners and the actors stand on. Its rooms, bottom up (imports point down only):

- ``options``: the one configuration mechanism (typed dataclasses -> flags, presets, :class:`ConfigError`),
  importing nothing of the project, so every room may use it;
- ``algos``: the learning math as pure tensor functions (V-trace, PopArt, the IMPALA losses, PPO's
  formulas, observation normalizers);
- ``run``: run plumbing (the run's configurations, CPUs, checkpoints, metrics, tracking);
- ``envs``: building, probing and fingerprinting environments (Atari, gymnasium, Unity);
- ``nets``: the networks (IMPALA's CNNs/MLP, PPO's policy);
- ``transport``: what travels between processes (trajectory schema, wire format, messages, weights, CURVE);
- ``evaluation``: what a checkpoint holds for playing and the records of an evaluation.

The API's names are the one exception to "imports point down": a user types ``import impala``, while
training needs the launchers of the top layer. They are loaded on first use (``__getattr__``), so no module
of the library imports them and ``import impala`` stays as light as the library.
"""

from __future__ import annotations

import importlib
from typing import Any

API = ("train", "train_ppo", "load", "Agent", "TrainResult", "ImpalaError")
__all__ = list(API)


def __getattr__(name: str) -> Any:
    if name in API:
        return getattr(importlib.import_module("learner.api"), name)
    raise AttributeError(f"module 'impala' has no attribute {name!r}")
