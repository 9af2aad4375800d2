"""``launch_ppo``: PPO with ML-Agents or SB3 semantics, N actor processes, one learner.

Examples::

    launch_ppo --unity-build ~/builds/Crawler.x86_64 --workers 4           # Crawler, configs/Crawler.yaml
    launch_ppo --workers 2                                                # Crawler job on the Ant-v5 stand-in
    launch_ppo --env Pendulum-v1 --semantics sb3 --workers 1 --in-process --total-steps 200000

The topology (actors -> ZeroMQ -> learner -> parameter broadcast), metrics,
checkpoints, ``--resume``, Ctrl-C and actor supervision all live in
:func:`learner.run.runtime.run`; this module adds the PPO trainer and the CLI.

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
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch

from impala.envs import EnvSpec, unity
from impala.envs.probe import EnvInfo, probe_env, probe_unity
from impala.envs.unity import UnityEnvError
from impala.options import (
    ConfigError,
    FlagParser,
    add_flags,
    apply_preset,
    check_fields,
    flag_name,
    from_flags,
    load_preset,
    need,
    option,
    say_preset_replaced,
)
from impala.run.checkpoint import drop_unused_run_folder, prepare_run_folder, release_run_folders
from impala.run.config import RUN_ID, RunConfig, apply_saved, resume_changes, resume_record, saved_settings
from impala.run.metrics import LOG_FORMAT
from impala.run.ppo_config import (
    MAX_UNROLL,
    MLAGENTS_UNROLL,
    PPOConfig,
    PPOSource,
    actors_wait,
    config_from_args,
    config_to_argparse,
    ppo_preset_dests,
    ppo_run_config,
    read_mlagents_yaml,
)
from learner.cli.console import console_main, ending
from learner.ppo_modes import MLAgentsPPOTrainer
from learner.run.runtime import START_ERRORS, LaunchError, Outcome, RunFinished, RunPlan, RunResult, run

log = logging.getLogger("launch_ppo")

# Shipped inside the package (so `pip install .` has it too); the repo's configs/ links there.
CRAWLER_CONFIG = Path(__file__).resolve().parents[2] / "impala" / "configs" / "Crawler.yaml"
STAND_IN_ENV = "Ant-v5"
UNITY_BASE_PORT = 5005  # mlagents-envs' UnityEnvironment.BASE_ENVIRONMENT_PORT

RUN_DEFAULTS = {"env": None, "envs_per_worker": 8, "unroll_length": 0, "max_policy_lag": 0}
# mlagents-learn's names for our flags
RUN_ALIASES = {"workers": ["--num-envs"], "device": ["--torch-device"], "runs_dir": ["--results-dir"]}
MLAGENTS_DEFAULTS = {"runs_dir": "results", "run_id": "ppo", "workers": 1}  # mlagents-learn's, in its form
ENGINE_OPTIONS = (
    "time_scale",
    "width",
    "height",
    "quality_level",
    "target_frame_rate",
    "capture_frame_rate",
    "graphics",
    "env_args",
)
RUN_BRIEFS = {  # where launch_ppo's options differ from launch_impala's
    "env": "A gymnasium id or a Unity build's path; unset: the Crawler job.",
    "workers": "Local actor processes (Unity: one instance each; mlagents-learn's --num-envs).",
    "envs_per_worker": "Gym envs per actor (Unity: the build's agents).",
    "unroll_length": "Agent steps per env per unroll; 0: from time_horizon.",
    "cpu_affinity": "Learner/actor CPU placement; auto: off (the actors wait during updates).",
    "total_steps": "Agent steps to train to, absolute; unset: max_steps.",
    "total_frames": "Budget in env frames instead, absolute.",
    "run_id": "Run folder name under --runs-dir; unset: ppo-<env>-<start time>.",
    "torch_threads": "Learner CPU threads; 0: every core while the actors wait, else those they leave.",
    "queue_size": "Unrolls buffered in the learner; 0: max(16, 2 x envs).",
    "max_policy_lag": "Drop unrolls collected this many updates ago or more (0: on-policy); none: keep all.",
}
LAUNCH_BRIEF = {
    "unity_build": "Path of a Unity build (Crawler.x86_64); one instance per actor.",
    "unity_timeout": "Seconds to wait for a Unity instance to connect.",
    "unity_base_port": "Unity gRPC port of actor 0; actor i uses base + i.",
    "unity_behavior": "The build's behaviour to train (needed if it has several).",
    "params_wait": "On-policy: seconds an actor waits for the next weights before acting on.",
    "time_scale": "Unity: Time.timeScale.",
    "width": "Unity: window width in pixels.",
    "height": "Unity: window height in pixels.",
    "quality_level": "Unity: QualitySettings level.",
    "target_frame_rate": "Unity: Application.targetFrameRate; -1: unlimited.",
    "capture_frame_rate": "Unity: Time.captureFramerate.",
    "graphics": "Unity: start the builds with graphics (else -nographics).",
    "initialize_from": "Start from run RUN's weights (not its counters).",
    "inference": "Act without training: no updates, no checkpoints.",
    "summary_freq": "A log row every this many agent steps instead of every --log-interval.",
    "checkpoint_interval": "Also keep <behaviour>-<steps>.pt/.onnx every this many agent steps.",
    "keep_checkpoints": "Numbered checkpoints kept, the newest.",
    "extrinsic_strength": "Factor on the env's reward in training (not in the logged returns).",
}
# launch_impala's options that mean nothing to PPO (its actors act on each update's weights at once)
IMPALA_ONLY = ("overlap_updates", "publish_delay")
RUN_HELP = {
    "env": "A gymnasium id (Pendulum-v1, Ant-v5, ...), or the path of a Unity build (an existing file or "
    "folder, or a path such as builds/Crawler.x86_64: as --unity-build; a path to nothing is an error), as "
    f"mlagents-learn --env. Neither: the Crawler job on the {STAND_IN_ENV} stand-in.",
    "workers": "Local actor processes (Unity: one instance each, worker_id = actor index; mlagents-learn's "
    "--num-envs); 0 runs no local actors and waits for remote ones (impala-actors).",
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
    "publish_delay": "launch_impala's (actors acting on older weights); PPO sends each update's weights at "
    "once: 0 or unset.",
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
    # -- mlagents-learn's engine settings (engine_settings in a trainer YAML), sent to every Unity instance
    time_scale: float = option(
        unity.TIME_SCALE, "Unity: Time.timeScale of every instance (mlagents-learn --time-scale)."
    )
    width: int = option(unity.WIDTH, "Unity: window width in pixels (mlagents-learn --width).")
    height: int = option(unity.HEIGHT, "Unity: window height in pixels (mlagents-learn --height).")
    quality_level: int = option(
        unity.QUALITY_LEVEL, "Unity: QualitySettings level (mlagents-learn --quality-level)."
    )
    target_frame_rate: int = option(
        unity.TARGET_FRAME_RATE,
        "Unity: Application.targetFrameRate, -1 unlimited (mlagents-learn --target-frame-rate).",
    )
    capture_frame_rate: int = option(
        unity.CAPTURE_FRAME_RATE, "Unity: Time.captureFramerate (mlagents-learn --capture-frame-rate)."
    )
    graphics: bool = option(
        False,
        "Unity: start the builds with graphics. --no-graphics (the default here, unlike mlagents-learn) "
        "passes -nographics: headless, enough for vector observations; engine_settings.no_graphics: false "
        "in a trainer YAML turns graphics on.",
    )
    env_args: tuple[str, ...] = ()  # no flag: env_settings.env_args, passed to each Unity instance
    # -- mlagents-learn's checkpoint settings and the behaviour's run settings
    initialize_from: Optional[str] = option(
        None,
        "Start from the weights of the run RUN (its checkpoint under --runs-dir/--results-dir, "
        "RUN/<behaviour>/checkpoint.pt or RUN/checkpoint.pt), not its counters: step 0, schedules start over "
        "(mlagents-learn --initialize-from).",
    )
    inference: bool = option(
        False,
        "Run the policy without training: no updates, no checkpoints; actions are sampled as in training "
        "(mlagents-learn --inference). Use with --resume or --initialize-from for trained weights; runs to "
        "--total-steps (else max_steps) or Ctrl-C.",
    )
    summary_freq: Optional[int] = option(
        None,
        "Log a row every this many agent steps instead of every --log-interval seconds (the trainer YAML's "
        "summary_freq).",
    )
    checkpoint_interval: Optional[int] = option(
        None,
        "Also keep a numbered checkpoint, <behaviour>-<steps>.pt and .onnx, every this many agent steps (the "
        "trainer YAML's checkpoint_interval).",
    )
    keep_checkpoints: int = option(
        5, "Numbered checkpoints kept, the newest (the trainer YAML's keep_checkpoints)."
    )
    extrinsic_strength: float = option(
        1.0,
        "Factor on the env's reward in training (the trainer YAML's reward_signals.extrinsic.strength); "
        "logged returns stay the env's.",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("width", "height", "keep_checkpoints"):
            need(getattr(self, name) >= 1, f"{flag_name(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("summary_freq", "checkpoint_interval"):
            value = getattr(self, name)
            need(value is None or value >= 1, f"{flag_name(name)} must be >= 1 (or none), got {value}")
        need(self.quality_level >= 0, f"--quality-level must be >= 0, got {self.quality_level}")
        need(self.time_scale > 0, f"--time-scale must be > 0, got {self.time_scale}")
        need(
            self.target_frame_rate >= -1,
            f"--target-frame-rate must be >= -1 (-1: unlimited), got {self.target_frame_rate}",
        )
        need(
            self.capture_frame_rate >= 0, f"--capture-frame-rate must be >= 0, got {self.capture_frame_rate}"
        )
        need(
            self.extrinsic_strength >= 0, f"--extrinsic-strength must be >= 0, got {self.extrinsic_strength}"
        )
        need(
            self.initialize_from is None or bool(RUN_ID.fullmatch(self.initialize_from)),
            f"--initialize-from must name a run (letters, digits and ._+=-), got {self.initialize_from!r}",
        )
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
        description="Train PPO with ML-Agents' or SB3's semantics (every difference an option, docs/PPO.md) "
        "with actor processes streaming to one learner over ZeroMQ. Default job: Unity Crawler "
        "(configs/Crawler.yaml; without --unity-build, gymnasium's Ant-v5 stands in).",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="A preset by name (pendulum_sb3, cartpole_ppo_sb3, ...) or a YAML file of options.",
    )
    parser.add_argument(
        "mlagents_yaml",
        nargs="?",
        metavar="TRAINER.yaml",
        default=None,
        help="mlagents-learn's form: an ML-Agents trainer YAML (as --trainer-config) and ML-Agents' run "
        "layout. RESULTS_DIR/RUN_ID/<behaviour>/ holds the run (checkpoint.pt, metrics, <behaviour>.onnx), "
        "RESULTS_DIR/RUN_ID/ its configuration.yaml and <behaviour>.onnx; --results-dir defaults to results, "
        "--run-id to ppo, --num-envs to 1 (docs/COMING_FROM_MLAGENTS.md).",
    )
    parser._actions[-1].brief = "mlagents-learn's form: an ML-Agents trainer YAML, with its run layout."
    add_flags(
        parser.add_argument_group("run"),
        RunConfig,
        skip=IMPALA_ONLY,
        defaults=RUN_DEFAULTS,
        helps=RUN_HELP,
        aliases=RUN_ALIASES,
        briefs=RUN_BRIEFS,
    )
    add_flags(
        parser.add_argument_group("Unity and actors (mlagents-learn's flags too)"),
        PPOLaunchOptions,
        skip=("env_args",),
        aliases={"unity_base_port": ["--base-port"]},
        briefs=LAUNCH_BRIEF,
    )
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


def check_engine_options(args: argparse.Namespace, options: PPOLaunchOptions) -> None:
    """Engine settings set (on the command line or in the file) for a run without a Unity build are
    refused: nothing would read them."""
    if options.unity_build:
        return
    defaults = PPOLaunchOptions()
    for name in ENGINE_OPTIONS:
        if getattr(options, name) != getattr(defaults, name):
            raise ConfigError(
                f"{'env_settings.env_args' if name == 'env_args' else flag_name(name)} "
                f"{getattr(options, name)}: "
                "engine settings apply to Unity builds only (--env PATH or --unity-build)"
            )


def with_engine_settings(env: EnvInfo, options: PPOLaunchOptions) -> EnvInfo:
    """A Unity build's spec with the engine settings every actor's instance gets (the probe's own short-lived
    instance runs with the defaults)."""
    if not env.spec.is_unity:
        return env
    engine = {
        "time_scale": options.time_scale,
        "width": options.width,
        "height": options.height,
        "quality_level": options.quality_level,
        "target_frame_rate": options.target_frame_rate,
        "capture_frame_rate": options.capture_frame_rate,
        "no_graphics": not options.graphics,
    }
    if options.env_args:
        engine["additional_args"] = list(options.env_args)
    spec = EnvSpec(env.spec.id, {**env.spec.kwargs, **engine}, env.spec.preprocess, env.spec.packages)
    return dataclasses.replace(env, spec=spec)


def mlagents_run_folder(config: RunConfig, behavior: str | None) -> RunConfig:
    """mlagents-learn's layout: the run's folder is RESULTS_DIR/RUN_ID/<behaviour>."""
    name = re.sub(r"[^A-Za-z0-9._+=-]+", "_", (behavior or "ppo").split("?", 1)[0])
    run_id = config.run_id or MLAGENTS_DEFAULTS["run_id"]
    return dataclasses.replace(config, logdir=os.path.join(config.runs_dir, run_id, name), run_id=None)


def inference_folder(
    config: RunConfig, options: PPOLaunchOptions
) -> tuple[RunConfig, str | None, tuple[str, ...]]:
    """``--inference --resume`` plays the run's own checkpoint without touching the run: its rows go to
    RUN_FOLDER/inference/ (replaced each time), the weights come from RUN_FOLDER/checkpoint.pt, and the run's
    counters, metrics and finished marker stay as training left them. Returns the config, that checkpoint
    (None for any other run) and the folders it created (``prepare_run_folder``)."""
    if not (options.inference and config.resume):
        return config, None, ()
    if not os.path.isfile(config.checkpoint_path):
        raise ConfigError(f"--inference --resume: no checkpoint at {config.checkpoint_path} to play")
    own = config.checkpoint_path
    config = dataclasses.replace(
        config, logdir=os.path.join(config.logdir, "inference"), resume=False, force=True
    )
    return config, own, prepare_run_folder(config.logdir, resume=False, force=True)


def initialize_path(config: RunConfig, options: PPOLaunchOptions, file: Any) -> str | None:
    """The checkpoint ``--initialize-from RUN`` names: RUNS_DIR/RUN/<behaviour>/checkpoint.pt
    (mlagents-learn's layout) or RUNS_DIR/RUN/checkpoint.pt."""
    run_id = options.initialize_from
    if run_id is None:
        return None
    if config.resume:
        raise ConfigError(f"--initialize-from {run_id} with --resume: give one")
    folder = os.path.join(config.runs_dir, run_id)
    names = [os.path.basename(config.logdir)] + ([file.behavior] if file and file.behavior else [])
    candidates = [os.path.join(folder, n, "checkpoint.pt") for n in names] + [
        os.path.join(folder, "checkpoint.pt")
    ]
    for path in candidates:
        if os.path.isfile(path):
            if os.path.abspath(path) == os.path.abspath(config.checkpoint_path):
                raise ConfigError(f"--initialize-from {run_id} is this run; use --resume to continue it")
            return path
    raise ConfigError(
        f"--initialize-from {run_id}: no checkpoint at {' or '.join(dict.fromkeys(candidates))}"
    )


def write_mlagents_configuration(
    config: RunConfig, options: PPOLaunchOptions, ppo_config: PPOConfig, file: Any, args: argparse.Namespace
) -> None:
    """RESULTS_DIR/RUN_ID/configuration.yaml: the resolved settings in ML-Agents' shape (mlagents-learn writes
    one there), beside the run folder's own config.yaml with every option (the semantics and PPO options
    ML-Agents has no key for are there). It reads back as a trainer YAML."""
    import yaml

    behavior = os.path.basename(config.logdir)
    settings = {
        "trainer_type": "ppo",
        "hyperparameters": {
            "batch_size": ppo_config.batch_size,
            "buffer_size": ppo_config.buffer_size,
            "learning_rate": ppo_config.learning_rate,
            "beta": ppo_config.beta,
            "epsilon": ppo_config.epsilon,
            "lambd": ppo_config.lambd,
            "num_epoch": ppo_config.num_epoch,
            "learning_rate_schedule": ppo_config.lr_schedule,
            "beta_schedule": ppo_config.beta_schedule,
            "epsilon_schedule": ppo_config.epsilon_schedule,
        },
        "network_settings": {
            "normalize": ppo_config.obs_norm != "none",
            "hidden_units": ppo_config.hidden_units,
            "num_layers": ppo_config.num_layers,
            # ML-Agents' EncoderType; SB3's NatureCNN has no key there (config.yaml keeps it)
            **(
                {"vis_encode_type": ppo_config.vis_encode_type}
                if ppo_config.vis_encode_type != "sb3_nature_cnn"
                else {}
            ),
        },
        "reward_signals": {"extrinsic": {"gamma": ppo_config.gamma, "strength": options.extrinsic_strength}},
        "keep_checkpoints": options.keep_checkpoints,
        "checkpoint_interval": options.checkpoint_interval,
        "max_steps": ppo_config.max_steps,
        "time_horizon": ppo_config.time_horizon,
        "summary_freq": options.summary_freq,
    }
    doc = {
        "default_settings": None,
        "behaviors": {behavior: settings},
        "env_settings": {
            "env_path": options.unity_build or config.env,
            "env_args": list(options.env_args) or None,
            "base_port": options.unity_base_port,
            "num_envs": config.workers,
            "seed": config.seed,
        },
        "engine_settings": {
            "width": options.width,
            "height": options.height,
            "quality_level": options.quality_level,
            "time_scale": options.time_scale,
            "target_frame_rate": options.target_frame_rate,
            "capture_frame_rate": options.capture_frame_rate,
            "no_graphics": not options.graphics,
        },
        "checkpoint_settings": {
            "run_id": os.path.basename(os.path.dirname(config.logdir)),
            "initialize_from": options.initialize_from,
            "resume": config.resume,
            "force": config.force,
            "inference": options.inference,
            "results_dir": config.runs_dir,
        },
        "torch_settings": {"device": config.device},
        "debug": config.log_level == "DEBUG",
    }
    path = os.path.join(os.path.dirname(config.logdir), "configuration.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)


def copy_model_up(config: RunConfig, trainer: MLAgentsPPOTrainer) -> None:
    """RESULTS_DIR/RUN_ID/<behaviour>.onnx: the last exported model, where mlagents-learn leaves it."""
    name = trainer.onnx_name() + ".onnx"
    source = os.path.join(config.logdir, name)
    if os.path.isfile(source):
        try:
            shutil.copyfile(source, os.path.join(os.path.dirname(config.logdir), name))
        except OSError as e:
            log.warning("could not copy %s up to the results folder: %s", source, e.strerror or e)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Defaults (mlagents-learn's own in its form: a positional trainer YAML) < ``--config`` preset (run,
    launch and PPO options by name) < the trainer YAML's run settings (``env_settings``, ``engine_settings``,
    ``checkpoint_settings``, ``torch_settings``, the behaviour's ``summary_freq`` ...) < flags given on the
    command line. ``args.trainer_file``: the trainer YAML, read (None without one); ``args.mlagents_form``:
    whether it came as mlagents-learn's positional argument."""
    args = build_parser().parse_args(argv)
    preset: dict[str, Any] = {}
    if args.config:
        preset = ppo_preset_dests(
            load_preset(args.config, (PPOConfig, PPOSource, PPOLaunchOptions, RunConfig)),
            {f.name for f in dataclasses.fields(RunConfig)},
        )
    args.mlagents_form = args.mlagents_yaml is not None
    if args.mlagents_form:
        if "ppo__trainer_config" in args.given:
            raise ConfigError(
                f"the trainer YAML twice: {args.mlagents_yaml} and --trainer-config "
                f"{args.ppo__trainer_config}; give one"
            )
        args.ppo__trainer_config = args.mlagents_yaml
        args.given.add("ppo__trainer_config")
    path = (
        args.ppo__trainer_config if "ppo__trainer_config" in args.given else preset.get("ppo__trainer_config")
    )
    args.trainer_file = None
    if path:
        behavior = args.ppo__behavior if "ppo__behavior" in args.given else preset.get("ppo__behavior")
        args.trainer_file = read_mlagents_yaml(path, behavior)
        preset.update(args.trainer_file.run)
    if args.mlagents_form:
        defaults = dict(MLAGENTS_DEFAULTS)
        if "logdir" in args.given or "logdir" in preset:  # a folder given: no run id
            defaults.pop("run_id")
        preset = {**defaults, **preset}
    apply_preset(args, preset)
    _resume_or_initialize(args)
    _env_or_build(args)
    return args


def _resume_or_initialize(args: argparse.Namespace) -> None:
    """mlagents-learn's rule for resume and initialize_from both set: the command line's wins over the
    file's; both from one place cannot both be honoured and are refused."""
    resume, init = args.resume, args.initialize_from
    if not (resume and init):
        return
    if "resume" in args.given and "initialize_from" not in args.given:
        args.initialize_from = None
    elif "initialize_from" in args.given and "resume" not in args.given:
        args.resume = False
    else:
        raise ConfigError(
            f"--resume continues this run and --initialize-from {init} starts it from another run's weights: "
            "give one"
        )


def _env_or_build(args: argparse.Namespace) -> None:
    """``--env``: a Unity build path becomes ``--unity-build`` (mlagents-learn's --env); a gymnasium id stays.
    A build given on the command line wins over the trainer YAML's env_path, and a command-line --env over
    the file's build."""
    if args.env is None:
        return
    build = unity.unity_build_path(args.env)
    env_given, build_given = "env" in args.given, "unity_build" in args.given
    if build is None:
        if env_given and not build_given:
            args.unity_build = None
        elif build_given and not env_given:
            args.env = None
        return
    if args.unity_build is not None and not (env_given and not build_given):
        if build_given and not env_given:  # the file's env_path yields to --unity-build
            args.env = None
            return
        raise ConfigError(f"pass either --unity-build or --env, not both (--env {args.env} is a Unity build)")
    args.unity_build, args.env = build, None


class Resolved(NamedTuple):
    """A launch_ppo command line resolved: its run settings (run folder included), launch options and PPO
    options, the trainer YAML's path (None: PPO's own presets), and whether it is the stand-in Crawler job."""

    config: RunConfig
    options: PPOLaunchOptions
    ppo: PPOConfig
    trainer_config: str | None
    crawler_job: bool


# What a resumed run cannot change: what it plays and the shape of its network.
FIXED_ON_RESUME = (
    "env",
    "env_kwargs",
    "env_package",
    "unity_build",
    "hidden_units",
    "num_layers",
    "activation",
)
# A run's config.yaml: its sections -> the settings each holds (PPO's first: the run's seed is the one kept)
SAVED_SECTIONS = {"ppo": (PPOConfig,), "run": (RunConfig,), "launch": (PPOLaunchOptions,), None: (PPOSource,)}
PPO_NAMES = frozenset(f.name for cls in (PPOConfig, PPOSource) for f in dataclasses.fields(cls)) - {"seed"}


def resolve(args: argparse.Namespace) -> Resolved:
    """The run the parsed flags describe, its folder resolved (mlagents-learn's RESULTS_DIR/RUN_ID/<behaviour>
    in its form)."""
    config = from_flags(RunConfig, args)
    options = from_flags(PPOLaunchOptions, args)
    if options.unity_build and config.env:
        raise ConfigError("pass either --unity-build or --env, not both")
    check_engine_options(args, options)
    file = args.trainer_file
    if args.mlagents_form and options.unity_build and options.unity_behavior is None and file.behavior:
        # mlagents-learn trains the build's behaviour of that name (Crawler matches Crawler?team=0)
        options = dataclasses.replace(options, unity_behavior=file.behavior)
    crawler_job = config.env is None and not options.unity_build
    trainer_config = args.ppo__trainer_config or (str(CRAWLER_CONFIG) if config.env is None else None)
    ppo_config = config_from_args(args, default_trainer_config=trainer_config, seed=config.seed)
    if args.mlagents_form and config.logdir is None:  # RESULTS_DIR/RUN_ID/<behaviour>, as mlagents-learn
        config = mlagents_run_folder(
            config, (file.behavior if file else None) or options.unity_behavior or config.env
        )
    config = config.with_run_folder(f"ppo-{config.env or ('unity' if options.unity_build else STAND_IN_ENV)}")
    return Resolved(config, options, ppo_config, trainer_config, crawler_job)


def resume_as_it_was(args: argparse.Namespace, resolved: Resolved) -> tuple[Resolved, list, list | None]:
    """``--resume``: the run's own settings from its config.yaml under the command line's (a trainer YAML
    given again is the PPO configuration, as mlagents-learn --resume reads it), resolved again; with the
    changes the command line makes and the run's resumes so far. A change of a setting a running run cannot
    change is one line, exit 2."""
    saved, resumes = saved_settings(resolved.config.logdir, SAVED_SECTIONS)
    if not saved:  # a run of an older version, or one that never started: the command line as given
        return resolved, [], None
    if "ppo__trainer_config" in args.given:
        saved = {k: v for k, v in saved.items() if k not in PPO_NAMES or k in ("semantics", "behavior")}
    apply_saved(args, saved, dest_prefix=dict.fromkeys(PPO_NAMES, "ppo__"))
    resolved = resolve(args)
    now = {
        **{k: v for k, v in dataclasses.asdict(resolved.ppo).items() if k != "seed"},
        **dataclasses.asdict(resolved.config),
        **dataclasses.asdict(resolved.options),
        "semantics": args.ppo__semantics,
        "trainer_config": resolved.trainer_config,
    }
    return resolved, resume_changes(saved, now, FIXED_ON_RESUME), resumes


def launch(argv: list[str] | None) -> Outcome:
    """Parse, resolve, probe the env, wire the run and train (``main`` and ``impala.train_ppo``). Raises
    :class:`learner.run.runtime.LaunchError`."""
    try:
        args = parse_args(argv)
        resolved, changes, resumes = resolve(args), [], None
        if resolved.config.resume:
            resolved, changes, resumes = resume_as_it_was(args, resolved)
    except ConfigError as e:
        raise LaunchError(str(e)) from None
    config, options, ppo_config = resolved.config, resolved.options, resolved.ppo
    trainer_config, crawler_job, file = resolved.trainer_config, resolved.crawler_job, args.trainer_file
    logging.basicConfig(level=config.log_level, format=LOG_FORMAT)
    say_preset_replaced(args, log)
    for name, old, new in changes:
        log.info("resume: %s %s -> %s", name, old, new)
    created: tuple[str, ...] = ()  # the folders this start made (a failed start takes them away again)
    try:
        created = prepare_run_folder(config.logdir, resume=config.resume, force=config.force)
        config, init_path, inference_created = inference_folder(config, options)
        created = inference_created + created  # innermost first: a failed start takes RUN/inference away
        init_path = init_path or initialize_path(config, options, file)
        # --max-policy-lag's default depends on --trajectory-handling: whether it was given decides
        config, note = ppo_run_config(config, ppo_config, lag_given="max_policy_lag" in args.given)
        if note:
            log.warning(note)
        env = with_engine_settings(probe(config, options, ppo_config.seed, stand_in=crawler_job), options)
        if env.agents_per_instance:  # a Unity build decides how many agents each instance steps
            config = dataclasses.replace(config, envs_per_worker=env.agents_per_instance)
        if config.cpu_affinity == "auto":  # its actors wait during updates: the learner uses every core then
            config = dataclasses.replace(config, cpu_affinity="off")
        torch.set_num_threads(config.cpu_threads(actors_wait_during_updates=actors_wait(config, ppo_config)))
        trainer = _trainer(config, options, ppo_config, env, init_path)
        log_plan(env, config, ppo_config, trainer, args.ppo__semantics, trainer_config)
        if options.inference:
            weights = init_path or (config.checkpoint_path if config.resume else None)
            source = f"weights of {weights}" if weights else "untrained weights"
            print(
                f"launch_ppo: INFERENCE: the policy acts ({source}), "
                "nothing is trained or checkpointed; actions are sampled as in training",
                flush=True,
            )
        if args.mlagents_form and not options.inference:
            write_mlagents_configuration(config, options, ppo_config, file, args)
        record = {"resumes": resume_record(resumes, changes)} if resumes is not None else {}
        plan = _run_plan(env, config, options, ppo_config, args, trainer_config, init_path, record)
        result: RunResult = run(trainer, config, plan)
        result.rejected_nan = trainer.rejected_nan
        if (
            args.mlagents_form and not options.inference
        ):  # mlagents-learn leaves the last model beside the run's folders too
            copy_model_up(config, trainer)
        return Outcome(config, result)
    except RunFinished as e:
        return Outcome(config, None, str(e))
    except (*START_ERRORS, UnityEnvError) as e:
        drop_unused_run_folder(created)
        raise LaunchError(str(e).strip() or type(e).__name__) from None
    finally:
        release_run_folders()


def _trainer(
    config: RunConfig, options: PPOLaunchOptions, ppo_config: PPOConfig, env: Any, init_path: str | None
) -> MLAgentsPPOTrainer:
    """The PPO trainer of this run, with ``--initialize-from``'s weights when given."""
    trainer = MLAgentsPPOTrainer(
        ppo_config,
        config,
        env,
        params_wait_s=options.params_wait,
        strength=options.extrinsic_strength,
        inference=options.inference,
    )
    if init_path:
        trainer.initialize_from(init_path)
        log.info("initialized from %s (its weights; this run's counters start at 0)", init_path)
    return trainer


def _run_plan(
    env: Any,
    config: RunConfig,
    options: PPOLaunchOptions,
    ppo_config: PPOConfig,
    args: argparse.Namespace,
    trainer_config: Any,
    init_path: str | None,
    resumes: dict[str, Any],
) -> RunPlan:
    """What ``runtime.run`` needs of a PPO run: its env, label, the settings its run folder records (with
    ``resumes``, the record of its resumes, when it was resumed) and PPO's step-counted cadences."""
    return RunPlan(
        env,
        f"ppo/{args.ppo__semantics} {env.spec.id}",
        {
            "ppo": dataclasses.asdict(ppo_config),
            "run": dataclasses.asdict(config),
            "launch": dataclasses.asdict(options),
            "initialize_from": init_path,
            "semantics": args.ppo__semantics,
            "trainer_config": trainer_config,
            "env": env.spec.id,
            "unroll_length": config.unroll_length,
            **resumes,
        },
        hello_timeout=max(180.0, options.unity_timeout + 120.0),
        log_every_steps=options.summary_freq,
        checkpoint_every_steps=None if options.inference else options.checkpoint_interval,
        keep_checkpoints=options.keep_checkpoints,
        inference=options.inference,
    )


def done_line(config: RunConfig, result: RunResult) -> str:
    """The run's last console line: what it trained, what it dropped, where its checkpoint is."""
    mean = "n/a" if result.mean_return is None else f"{result.mean_return:.2f}"
    return (
        f"launch_ppo: done: {result.agent_steps} agent steps, {result.updates} updates, mean return (last "
        f"100) {mean}, "
        f"rejected NaN unrolls {result.rejected_nan}, dropped {result.dropped or 0}, actor restarts "
        f"{result.restarts}, " + ending(config, result)
    )


def main(argv: list[str] | None = None) -> int:
    """``launch_ppo``: :func:`launch`; bad input is one line, exit 2."""
    return console_main("launch_ppo", lambda: launch(argv), done_line)


def log_plan(
    env: EnvInfo,
    config: RunConfig,
    ppo_config: Any,
    trainer: MLAgentsPPOTrainer,
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
