"""``launch_ppo``: PPO with ML-Agents or SB3 semantics, N actor processes, one learner.

Examples::

    launch_ppo --unity-build ~/builds/Crawler.x86_64 --workers 4           # Crawler, configs/Crawler.yaml
    launch_ppo --workers 2                                                # Crawler job on the Ant-v5 stand-in
    launch_ppo --env Pendulum-v1 --semantics sb3 --workers 1 --in-process --total-steps 200000

The topology (actors -> ZeroMQ -> learner -> parameter broadcast), metrics,
checkpoints, ``--resume``, Ctrl-C and actor supervision all live in
:func:`learner.runtime.run`; this module adds the PPO trainer and the CLI.

Trajectories (``--trajectory-handling``, row #15)
-----------------------------------------------
Actors send fixed ``T``-step unrolls per env (``T = --unroll-length``; see
``impala.run.ppo_config.choose_unroll_length``). What the learner makes of them:

- ``mlagents`` (the ``mlagents`` preset): the unroll is only the transport unit
  (default ``T = min(time_horizon, 16)``). The learner runs ML-Agents'
  ``AgentProcessor`` per env stream (``learner.ppo_learner.AgentTrajectories``): a
  trajectory ends at an episode end or ``time_horizon`` steps after its own start,
  and is processed when complete (normalizer, values and GAE with the critic of
  that moment, schedule steps counted), as ``PPOTrainer._process_trajectory``
  does. An unfinished trajectory waits across updates with its action-time
  log-probs, so no unroll is dropped for its age (``--max-policy-lag`` is
  refused). Actors still pause once they sent their share of an update, counted
  in steps of completed trajectories: ML-Agents does not step its envs during an
  update. What differs from ML-Agents: an actor finishes the unroll it is in when
  the buffer fills (at most ``T`` steps per env with the old weights that
  ML-Agents would have taken with the new ones), and the learner checks
  readiness after each env's unroll rather than after each env step.
- ``rollout`` (the ``sb3`` preset): every unroll is one :class:`TrajectoryPiece`,
  processed when it arrives; episode ends inside it split it into segments and
  its last step bootstraps from ``V(obs[T])`` unless the episode ended there.
  Cuts fall on the unroll grid (default ``T = min(time_horizon, 1000)``).

Update trigger and the buffer
-----------------------------
ML-Agents (``update_trigger=over_buffer_size``) updates once the buffer holds
*more* than ``buffer_size`` steps, whatever the piece sizes. SB3
(``buffer_full``) updates at ``buffer_size = n_steps * n_envs``: with T
dividing ``buffer_size`` a buffer fills exactly (``buffer_size / T`` unrolls).
Unless ``--unroll-length`` is given, T is SB3's ``n_steps``: the largest T (up
to the cap) whose round of unrolls over the local envs divides ``buffer_size``,
so no round straddles an update and nothing arrives stale. When a given T does
not divide ``buffer_size``, T is lowered to the largest divisor of
``buffer_size`` not above it (logged; ``rollout`` only), so no update ever holds
a partial rounding. Set ``--buffer-size = T * workers * envs_per_worker`` to get
SB3's exact "one n_steps rollout of every env per update". Both clear the
buffer after an update.

On-policy
---------
``rollout`` with ``--max-policy-lag 0`` (its default): an unroll that was
collected with weights older than the learner's current ones is dropped
(``transport/dropped_stale``), so every update trains on data of the policy it
updates, as SB3 does; the values are recomputed at ingest, which then equals
the action-time values.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from impala.run.checkpoint import prepare_run_folder
from impala.run.config import (
    ConfigError,
    FlagParser,
    RunConfig,
    add_flags,
    apply_preset,
    check_fields,
    fail,
    from_flags,
    load_preset,
    need,
    option,
)
from impala.envs import EnvSpec
from impala.envs.probe import EnvInfo, probe_env, probe_unity
from impala.envs.unity import UnityEnvError
from impala.run.ppo_config import (
    MAX_UNROLL,
    MLAGENTS_UNROLL,
    PPOConfig,
    PPOSource,
    actors_wait,
    config_from_args,
    config_to_argparse,
    ppo_run_config,
    ppo_preset_dests,
)
from learner.ppo_learner import PPOTrainer
from impala.run.metrics import LOG_FORMAT
from learner.runtime import START_ERRORS, RunFinished, RunPlan, RunResult, run

log = logging.getLogger("launch_ppo")

# Shipped inside the package (so `pip install .` has it too); the repo's configs/ links there.
CRAWLER_CONFIG = Path(__file__).resolve().parents[1] / "impala" / "configs" / "Crawler.yaml"
STAND_IN_ENV = "Ant-v5"
UNITY_BASE_PORT = 5005  # mlagents-envs' UnityEnvironment.BASE_ENVIRONMENT_PORT

RUN_DEFAULTS = {"env": None, "envs_per_worker": 8, "unroll_length": 0, "max_policy_lag": 0}
RUN_HELP = {
    "env": "A gymnasium id (Pendulum-v1, Ant-v5, ...) instead of a Unity build. Neither: the Crawler job on "
    f"the {STAND_IN_ENV} stand-in.",
    "workers": "Local actor processes (Unity: one instance each, worker_id = actor index); 0 runs no local "
    "actors and waits for remote ones (impala-actors).",
    "envs_per_worker": "Gym envs per actor, stepped with one batched forward pass (Unity: the build's agent "
    "count).",
    "unroll_length": f"Steps per env per unroll message; 0 = min(time_horizon, {MLAGENTS_UNROLL}) for "
    "--trajectory-handling mlagents (the learner "
    f"cuts the trajectories), min(time_horizon, {MAX_UNROLL}) for rollout (a divisor of buffer_size for "
    "SB3's buffer_full).",
    "total_steps": "Agent steps to train to (absolute, also with --resume); unset: the config's max_steps.",
    "torch_threads": "Learner CPU threads; 0 = all cores when actors wait during updates (--max-policy-lag "
    "0, or --trajectory-handling mlagents), else CPU count minus --workers.",
    "queue_size": "Unrolls buffered in the learner; 0 means max(16, 2 x envs).",
    "max_policy_lag": "Drop unrolls collected with weights more than this many updates old (0: strictly "
    "on-policy, SB3's rollouts); "
    "'none' keeps all. Applies to --trajectory-handling rollout; 'mlagents' keeps every unroll (an agent's "
    "unfinished "
    "trajectory continues in unrolls collected before an update, as in ML-Agents) and refuses this flag.",
}


@dataclass(frozen=True)
class PPOLaunchOptions:
    """launch_ppo's own settings: the Unity build and the on-policy actors' wait."""

    unity_build: Optional[str] = option(
        None, "Path of a Unity build (e.g. Crawler.x86_64); one instance per worker."
    )
    unity_timeout: int = option(60, "Seconds to wait for a Unity instance to connect.")
    unity_base_port: int = option(UNITY_BASE_PORT, "Unity gRPC port of worker 0; worker i uses base + i.")
    unity_behavior: Optional[str] = option(
        None, "Unity behavior name (needed only if the build has several)."
    )
    params_wait: float = option(
        60.0,
        "On-policy (lag 0): seconds an actor that sent its share of an update waits for the new weights "
        "before collecting more with the old ones.",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        need(self.unity_timeout > 0, f"--unity-timeout must be > 0, got {self.unity_timeout}")
        need(
            1 <= self.unity_base_port <= 65535,
            f"--unity-base-port must be in 1..65535, got {self.unity_base_port}",
        )
        need(self.params_wait >= 0, f"--params-wait must be >= 0, got {self.params_wait}")


def build_parser() -> argparse.ArgumentParser:
    """``launch_ppo``'s flags: RunConfig's, the Unity options and PPOConfig's."""
    parser = FlagParser(
        prog="launch_ppo",
        description=(
            "Train PPO (ML-Agents or SB3 semantics, docs/PPO.md) with N actor processes streaming unrolls "
            "over ZeroMQ to one learner. Default job: Unity Crawler with configs/Crawler.yaml "
            "(--unity-build); without "
            "a build it runs on gymnasium Ant-v5 as a stand-in. Metrics: console, LOGDIR/metrics.csv, "
            "TensorBoard; "
            "checkpoints: LOGDIR/checkpoint.pt (atomic). Ctrl-C stops cleanly with a final checkpoint."
        ),
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="Preset file (YAML, option: value) of run, Unity and PPO options (semantics, trainer_config, "
        "batch_size, ...), "
        "applied before the flags, e.g. configs/pendulum_sb3.yaml; flags given on the command line override "
        "it.",
    )
    add_flags(parser.add_argument_group("run"), RunConfig, defaults=RUN_DEFAULTS, helps=RUN_HELP)
    add_flags(parser.add_argument_group("Unity and actors"), PPOLaunchOptions)
    config_to_argparse(parser)
    return parser


def probe(config: RunConfig, options: PPOLaunchOptions, seed: int, *, stand_in: bool) -> EnvInfo:
    """The env the run trains: a Unity build, a gymnasium id, or the Crawler job's stand-in."""
    if options.unity_build:
        return probe_unity(
            options.unity_build,
            worker_id=max(config.workers, 1),
            base_port=options.unity_base_port,
            timeout=options.unity_timeout,
            behavior=options.unity_behavior,
            seed=seed,
        )
    if len(config.tasks) > 1:
        raise ConfigError(
            f"--env {config.env}: launch_ppo trains one env; several tasks in one agent is launch_impala's "
            "multi-task PopArt-IMPALA"
        )
    if stand_in:
        print(
            "launch_ppo: no --unity-build given: running the Crawler job (configs/Crawler.yaml) on "
            "gymnasium "
            f"{STAND_IN_ENV} (MuJoCo) as a STAND-IN for Unity Crawler; pass --unity-build PATH to train on "
            "Crawler.",
            flush=True,
        )
    spec = EnvSpec(config.env or STAND_IN_ENV, config.env_overrides, packages=config.env_packages)
    return probe_env(spec, seed=seed)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Defaults < ``--config`` preset (run, launch and PPO options by name) < flags given on the command
    line."""
    args = build_parser().parse_args(argv)
    if not args.config:
        return apply_preset(args, {})
    preset = load_preset(args.config, (PPOConfig, PPOSource, PPOLaunchOptions, RunConfig))
    return apply_preset(args, ppo_preset_dests(preset, {f.name for f in dataclasses.fields(RunConfig)}))


def main(argv: list[str] | None = None) -> int:
    """``launch_ppo``: parse, resolve, probe the env, wire the run; bad input is one line, exit 2."""
    try:
        args = parse_args(argv)
        config = from_flags(RunConfig, args)
        options = from_flags(PPOLaunchOptions, args)
    except ConfigError as e:
        return fail("launch_ppo", e)
    logging.basicConfig(level=config.log_level, format=LOG_FORMAT)
    try:
        if options.unity_build and config.env:
            raise ConfigError("pass either --unity-build or --env, not both")
        config = config.with_run_folder(
            f"ppo-{config.env or ('unity' if options.unity_build else STAND_IN_ENV)}"
        )
        prepare_run_folder(config.logdir, resume=config.resume, force=config.force)
        crawler_job = config.env is None and not options.unity_build
        trainer_config = args.ppo__trainer_config or (str(CRAWLER_CONFIG) if config.env is None else None)
        ppo_config = config_from_args(args, default_trainer_config=trainer_config, seed=config.seed)
        # --max-policy-lag's default depends on --trajectory-handling: whether it was given decides
        config, note = ppo_run_config(config, ppo_config, lag_given="max_policy_lag" in args.given)
        if note:
            log.warning(note)
        env = probe(config, options, ppo_config.seed, stand_in=crawler_job)
        if env.agents_per_instance:  # a Unity build decides how many agents each instance steps
            config = dataclasses.replace(config, envs_per_worker=env.agents_per_instance)
        torch.set_num_threads(config.cpu_threads(actors_wait_during_updates=actors_wait(config, ppo_config)))
        trainer = PPOTrainer(ppo_config, config, env, params_wait_s=options.params_wait)
        log_plan(env, config, ppo_config, trainer, args.ppo__semantics, trainer_config)
        plan = RunPlan(
            env,
            f"ppo/{args.ppo__semantics} {env.spec.id}",
            {
                "ppo": dataclasses.asdict(ppo_config),
                "run": dataclasses.asdict(config),
                "launch": dataclasses.asdict(options),
                "semantics": args.ppo__semantics,
                "trainer_config": trainer_config,
                "env": env.spec.id,
                "unroll_length": config.unroll_length,
            },
            hello_timeout=max(180.0, options.unity_timeout + 120.0),
        )
        result: RunResult = run(trainer, config, plan)
    except RunFinished as e:
        print(f"launch_ppo: {e}", flush=True)
        return 0
    except (*START_ERRORS, UnityEnvError) as e:
        return fail("launch_ppo", e)
    mean = "n/a" if result.mean_return is None else f"{result.mean_return:.2f}"
    print(
        f"launch_ppo: done: {result.agent_steps} agent steps, {result.updates} updates, mean return (last "
        f"100) {mean}, "
        f"rejected NaN unrolls {trainer.rejected_nan}, dropped {result.dropped or 0}, actor restarts "
        f"{result.restarts}, "
        + (
            f"checkpoint {result.checkpoint}"
            if result.checkpoint
            else "no checkpoint written"
            + (" (nothing trained)" if not result.updates else " (see the warnings above)")
        )
        + (" (interrupted)" if result.interrupted else "")
        + (f" (stopped at --stop-at-return {config.stop_at_return:g})" if result.reached_return else ""),
        flush=True,
    )
    return 0


def log_plan(
    env: EnvInfo,
    config: RunConfig,
    ppo_config: Any,
    trainer: PPOTrainer,
    semantics: str,
    trainer_config: str | None,
) -> None:
    """The start-up lines: the env, and what the PPO run will do."""
    T = config.unroll_length
    log.info("%s", env.description)
    log.info(
        "PPO %s semantics (%s): buffer %d, batch %d, %d epochs, %dx%d %s, unroll T=%d over %d envs (%d per "
        "round of unrolls), "
        "update trigger %s, trajectories %s, learner on %s, %s agent steps",
        semantics,
        trainer_config or "preset",
        ppo_config.buffer_size,
        ppo_config.batch_size,
        ppo_config.num_epoch,
        ppo_config.num_layers,
        ppo_config.hidden_units,
        ppo_config.activation,
        T,
        trainer.n_envs,
        T * trainer.n_envs,
        ppo_config.update_trigger,
        (
            f"cut at time_horizon {ppo_config.time_horizon} per agent, unfinished ones kept across updates "
            "(mlagents)"
            if ppo_config.trajectory_handling == "mlagents"
            else f"one per unroll, max policy lag {config.max_policy_lag} (rollout)"
        ),
        trainer.device,
        config.total_steps,
    )
    if ppo_config.update_trigger == "buffer_full" and ppo_config.buffer_size != T * trainer.n_envs:
        log.info(
            "buffer_full: an update holds %d unrolls of %d steps (SB3's n_steps*n_envs would be %d*%d = %d)",
            ppo_config.buffer_size // T,
            T,
            T,
            trainer.n_envs,
            T * trainer.n_envs,
        )


if __name__ == "__main__":
    sys.exit(main())
