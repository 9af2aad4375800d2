"""``launch_impala``: IMPALA (V-trace + PopArt) with N actor processes on this machine.

Example::

    launch_impala --workers 16 --env PongDeterministic-v4
    launch_impala --workers 2 --env CartPole-v1 --total-frames 300000

Only wiring: flags -> (RunConfig, ImpalaConfig) -> env probe -> ImpalaTrainer -> ``runtime.run``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing
import os
import sys

import torch

from impala.run.checkpoint import check_logdir, load_checkpoint
from impala.run.config import ConfigError, FlagParser, ImpalaConfig, RunConfig, add_flags, fail, from_flags, load_preset, resolve_device
from impala.envs import EnvSpec
from impala.envs.probe import EnvInfo, probe_env, probe_tasks
from learner.group import LearnerGroup, LearnerGroupError, exit_when_orphaned, init_group
from impala.run.metrics import LOG_FORMAT
from learner.runtime import START_ERRORS, RunPlan, RunResult, run
from learner.vtrace_learner import ImpalaTrainer

log = logging.getLogger("launch_impala")

DEFAULT_TOTAL_FRAMES = 20_000_000
RUN_HELP = {
    "total_frames": f"Stop after this many environment frames (agent steps x frame skip); unset and no --total-steps: {DEFAULT_TOTAL_FRAMES:,}.",
    "queue_size": "Unrolls buffered in the learner; 0 means --batch-size (one batch waits while the learner updates; every unroll buffered beyond that only adds policy lag).",
    "max_policy_lag": "Drop unrolls older than this many policy versions (0: on-policy only); unset keeps all (V-trace corrects off-policy data).",
}


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        prog="launch_impala",
        description=(
            "Train IMPALA (V-trace, optional PopArt) with N actor processes streaming over ZeroMQ to one learner "
            "(GPU when available). Metrics go to the console, LOGDIR/metrics.csv and TensorBoard; checkpoints to "
            "LOGDIR/checkpoint.pt (atomic). Ctrl-C stops cleanly with a final checkpoint."
        ),
    )
    parser.add_argument(
        "--config", metavar="FILE", default=None,
        help="Preset file (YAML, option: value) applied before the flags, e.g. configs/atari.yaml; "
        "flags given on the command line override it.",
    )
    add_flags(parser.add_argument_group("run"), RunConfig, helps=RUN_HELP)
    add_flags(parser.add_argument_group("IMPALA"), ImpalaConfig)
    return parser


# A multi-task run's defaults where they differ from one task's: the PopArt-IMPALA paper's agent
# (Hessel et al. 2018) normalizes each task's values with PopArt and trains on unclipped rewards,
# since clipping is what made tasks' reward scales look alike before PopArt.
MULTI_TASK_DEFAULTS = {"popart": True, "reward_clip": 0.0}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Defaults < ``--config`` preset < explicit flags. ``args.given`` names the ImpalaConfig options
    set by a preset or a flag (the multi-task defaults apply only to the others)."""
    parser = build_parser()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    # only whether they were given: the values are parsed (and a bad one reported) by the real parser
    pre.add_argument("--popart", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS)
    pre.add_argument("--reward-clip", dest="reward_clip", default=argparse.SUPPRESS)
    known, _ = pre.parse_known_args(argv)
    preset = load_preset(known.config, (RunConfig, ImpalaConfig)) if known.config else {}
    if preset:
        parser.set_defaults(**preset)
    args = parser.parse_args(argv)
    args.given = set(preset) | {name for name in MULTI_TASK_DEFAULTS if name in vars(known)}
    return args


def resolve(args: argparse.Namespace) -> tuple[RunConfig, ImpalaConfig]:
    config = from_flags(RunConfig, args)
    if config.env is None:
        raise ConfigError("--env is required (for example PongDeterministic-v4 or CartPole-v1)")
    if config.unroll_length < 1:
        raise ConfigError(f"--unroll-length must be >= 1, got {config.unroll_length}")
    if config.total_frames is None and config.total_steps is None:
        config = dataclasses.replace(config, total_frames=DEFAULT_TOTAL_FRAMES)
    impala = from_flags(ImpalaConfig, args)
    if len(config.tasks) > 1 and config.stop_at_return is not None:
        raise ConfigError("--stop-at-return compares one mean return; tasks' returns have different scales, so a multi-task "
                          "run stops at --total-frames or --max-seconds")
    if len(config.tasks) > 1:
        impala = dataclasses.replace(impala, **{k: v for k, v in MULTI_TASK_DEFAULTS.items() if k not in getattr(args, "given", ())})
    if impala.batch_size % config.learners or (impala.batch_size // config.learners) % impala.minibatches:
        raise ConfigError(
            f"--learners {config.learners} splits each batch: --batch-size {impala.batch_size} must divide by it, "
            f"and each share by --minibatches {impala.minibatches}"
        )
    return config, impala


def probe_run_envs(config: RunConfig) -> tuple[EnvInfo, tuple[EnvInfo, ...], str]:
    """The run's env (task 0), its tasks (empty for one task) and a note on what a multi-task run changed."""
    if len(config.tasks) == 1:
        return probe_env(EnvSpec(config.env, config.env_overrides), seed=config.seed), (), ""
    tasks, note = probe_tasks([EnvSpec(t, config.env_overrides) for t in config.tasks], seed=config.seed)
    return tasks[0], tuple(tasks), note


def start_group(config: RunConfig, argv: list[str]) -> LearnerGroup | None:
    """--learners G > 1: start G-1 follower processes here and join the group as rank 0."""
    if config.learners == 1:
        return None
    store = os.path.join(os.path.abspath(config.logdir), ".learner_group")
    if os.path.exists(store):
        os.remove(store)  # a rendezvous file left by an earlier run would hang this one
    ctx = multiprocessing.get_context("spawn")
    for rank in range(1, config.learners):
        ctx.Process(target=follower_main, args=(rank, config.learners, store, argv, os.getpid()), name=f"learner-{rank}", daemon=True).start()
    backend = "nccl" if resolve_device(config.device).type == "cuda" else "gloo"
    return init_group(0, config.learners, store, backend)


def follower_main(rank: int, world_size: int, store: str, argv: list[str], parent_pid: int) -> None:
    """Learner rank > 0: the same trainer as rank 0 (same flags), fed its share of each batch by rank 0."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s learner-{rank} %(levelname)s %(message)s")
    exit_when_orphaned(parent_pid)
    config, impala = resolve(parse_args(argv))
    torch.set_num_threads(max(1, config.cpu_threads() // config.learners))
    env, tasks, _ = probe_run_envs(config)
    backend = "nccl" if resolve_device(config.device).type == "cuda" else "gloo"
    trainer = ImpalaTrainer(impala, config, env, group=init_group(rank, world_size, store, backend), tasks=tasks)
    if config.resume:  # rank 0 resumes from the same file
        trainer.load_state_dict(load_checkpoint(config.checkpoint_path, keys=("trainer",))["trainer"])
    trainer.follow()


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        config, impala = resolve(args)
    except ConfigError as e:
        return fail("launch_impala", e)
    logging.basicConfig(level=config.log_level, format=LOG_FORMAT)
    try:
        torch.set_num_threads(max(1, config.cpu_threads() // config.learners))
        check_logdir(config.logdir)
        env, tasks, note = probe_run_envs(config)
        group = start_group(config, sys.argv[1:] if argv is None else list(argv))
        trainer = ImpalaTrainer(impala, config, env, group=group, tasks=tasks)
        plan = RunPlan(env, f"impala {config.env}", {**dataclasses.asdict(config), **dataclasses.asdict(impala), "preset": args.config or ""},
                       tasks=tasks)
        if tasks:
            log.info("multi-task: %d tasks, actor i runs task i %% %d (%s); %s; rewards %s (the PopArt-IMPALA paper trains "
                     "on unclipped rewards; --popart/--no-popart and --reward-clip override)",
                     len(tasks), len(tasks), ", ".join(f"{i}: {t.spec.id}" for i, t in enumerate(tasks)),
                     "PopArt per task" if impala.algos.popart else "no PopArt", f"clipped to +-{impala.reward_clip:g}" if impala.reward_clip else "unclipped")
            if note:
                log.info("multi-task: %s", note)
            if config.workers and config.workers < len(tasks):
                log.warning("--workers %d < %d tasks: tasks %s get no local actor", config.workers, len(tasks),
                            ", ".join(t.spec.id for t in tasks[config.workers:]))
        for info in tasks or (env,):
            log.info("%s; learner on %s", info.description, trainer.device)
        result: RunResult = run(trainer, config, plan)
    except START_ERRORS as e:
        return fail("launch_impala", e)
    except LearnerGroupError as e:  # not bad input: the run started and lost a rank
        fail("launch_impala", e)
        return 1
    mean = "n/a" if result.mean_return is None else f"{result.mean_return:.2f}"
    print(
        f"launch_impala: done: {result.env_frames} env frames ({result.agent_steps} agent steps), {result.updates} updates, "
        f"mean return (last 100) {mean}, dropped {result.dropped or 0}, actor restarts {result.restarts}, checkpoint {result.checkpoint}"
        + (" (interrupted)" if result.interrupted else "")
        + (f" (stopped at --stop-at-return {config.stop_at_return:g})" if result.reached_return else ""),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
