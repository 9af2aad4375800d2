"""``launch_impala``: IMPALA (V-trace + PopArt) with N actor processes on this machine.

Example::

    launch_impala --workers 16 --env PongDeterministic-v4
    launch_impala --workers 2 --env CartPole-v1 --total-frames 300000
    # one learner rank on each of two hosts (docs/SCALE_OUT.md, section 9): on host 0, then host 1
    launch_impala --env PongDeterministic-v4 --workers 0 --learners 2 --node-rank 0 \
        --rdzv-endpoint host0:29400 --bind host0 --curve keys/learner
    launch_impala --env PongDeterministic-v4 --workers 0 --learners 2 --node-rank 1 \
        --rdzv-endpoint host0:29400 --bind host1 --insecure-bind

Only wiring: flags -> (RunConfig, ImpalaConfig) -> env probe -> ImpalaTrainer -> ``runtime.run``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import signal
import sys

import learner.cli.sleeping_threads  # noqa: F401  (before torch: its idle threads sleep)

# isort: split
import torch

from impala.envs import EnvSpec
from impala.envs.atari import human_normalized_score
from impala.envs.probe import EnvInfo, probe_env, probe_tasks
from impala.options import (
    ConfigError,
    FlagParser,
    add_flags,
    apply_preset,
    from_flags,
    load_preset,
    say_preset_replaced,
)
from impala.run.checkpoint import drop_unused_run_folder, prepare_run_folder, release_run_folders
from impala.run.config import (
    DEFAULT_TOTAL_FRAMES,
    IMPALA_UNROLL,
    ImpalaConfig,
    RunConfig,
    apply_saved,
    resolve_device,
    resume_changes,
    resume_folder,
    resume_record,
    saved_settings,
    settle,
)
from impala.run.cpus import CpuClaim
from impala.run.metrics import LOG_FORMAT
from impala.transport.messages import task_shares
from learner import group as learner_group
from learner.cli import hosts
from learner.cli.console import console_main, ending
from learner.cli.group_start import follower_settings, start_group
from learner.group import LearnerGroupError, Membership, join_group, lost_peer, membership, peer_error
from learner.run.runtime import (
    START_ERRORS,
    LaunchError,
    Outcome,
    RunFinished,
    RunPlan,
    RunResult,
    claim_cpus,
    run,
)
from learner.update.precision import learner_threads
from learner.vtrace_learner import ImpalaTrainer

log = logging.getLogger("launch_impala")

RUN_BRIEFS = {  # where launch_impala's defaults differ from the options' own
    "total_frames": f"Budget in env frames (agent steps x frame skip); unset: {DEFAULT_TOTAL_FRAMES:,}.",
    "queue_size": "Unrolls buffered in the learner; 0: --batch-size.",
    "max_policy_lag": "Drop unrolls this many updates old or older; unset: keep all (V-trace).",
}
RUN_HELP = {
    "unroll_length": f"Steps per env per unroll (T); 0 is taken as {IMPALA_UNROLL}.",
    "total_frames": "Stop after this many environment frames (agent steps x frame skip); unset and no "
    f"--total-steps: {DEFAULT_TOTAL_FRAMES:,}.",
    "queue_size": "Unrolls buffered in the learner; 0 means --batch-size (one batch waits while the learner "
    "updates; every unroll buffered beyond that only adds policy lag).",
    "max_policy_lag": "Drop unrolls older than this many policy versions (0: on-policy only); unset keeps "
    "all (V-trace corrects off-policy data).",
}


def build_parser() -> argparse.ArgumentParser:
    """``launch_impala``'s flags: RunConfig's and ImpalaConfig's, plus ``--config``."""
    parser = FlagParser(
        prog="launch_impala",
        description="Train IMPALA (V-trace, PopArt) with actor processes streaming to one learner over "
        "ZeroMQ. Each run has a folder (config.yaml, metrics.csv, TensorBoard, checkpoint.pt); Ctrl-C stops "
        "with a checkpoint. Why each default, with figures: docs/IMPALA.md.",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="A preset by name (atari, atari_deep, cartpole, ...) or a YAML file of options.",
    )
    add_flags(parser.add_argument_group("run"), RunConfig, helps=RUN_HELP, briefs=RUN_BRIEFS)
    add_flags(parser.add_argument_group("IMPALA"), ImpalaConfig)
    hosts.add_flags(parser)
    return parser


# What a resumed run cannot change: what it plays and the shape of its network (and PopArt's value head).
FIXED_ON_RESUME = ("env", "env_kwargs", "env_package", "model", "use_lstm", "popart", "obs_norm")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Defaults < a resumed run's own settings (its config.yaml) < ``--config`` preset < flags given on the
    command line (``args.given``; ``args.preset`` names the options the preset or the resumed run set: the
    multi-task defaults apply only to the others). ``args.saved`` / ``args.resumes``: the resumed run's
    settings and earlier resumes (empty for a new run)."""
    args = build_parser().parse_args(argv)
    apply_preset(args, load_preset(args.config, (RunConfig, ImpalaConfig)) if args.config else {})
    args.saved, args.resumes = {}, []
    if args.resume:
        args.saved, args.resumes = saved_settings(resume_folder(args), {None: (RunConfig, ImpalaConfig)})
        apply_saved(args, args.saved)
    return args


def resolve(args: argparse.Namespace) -> tuple[RunConfig, ImpalaConfig]:
    """The run's RunConfig and ImpalaConfig from parsed flags: defaults, multi-task rules, run folder."""
    config = from_flags(RunConfig, args)
    if config.env is None:
        raise ConfigError("--env is required (for example PongDeterministic-v4 or CartPole-v1)")
    config = config.with_run_folder(config.env)
    impala = from_flags(ImpalaConfig, args)
    if len(config.tasks) > 1 and config.stop_at_return is not None:
        raise ConfigError(
            "--stop-at-return compares one mean return; tasks' returns have different scales, so a "
            "multi-task "
            "run stops at --total-frames or --max-seconds"
        )
    args.resume_changes = resume_changes(
        args.saved, {**dataclasses.asdict(config), **dataclasses.asdict(impala)}, FIXED_ON_RESUME
    )
    if impala.batch_size % config.learners or (impala.batch_size // config.learners) % impala.minibatches:
        raise ConfigError(
            f"--learners {config.learners} splits each batch: --batch-size {impala.batch_size} must divide "
            "by it, "
            f"and each share by --minibatches {impala.minibatches}"
        )
    return config, impala


def chosen_options(args: argparse.Namespace) -> set[str]:
    """The options a flag, a preset or the resumed run set (the derived defaults leave them as they are)."""
    return set(args.given) | set(getattr(args, "preset", set()))


def probe_run_envs(config: RunConfig) -> tuple[EnvInfo, tuple[EnvInfo, ...], str]:
    """The run's env (task 0), its tasks (empty for one task) and a note on what a multi-task run changed."""
    specs = [EnvSpec(t, config.env_overrides, packages=config.env_packages) for t in config.tasks]
    if len(specs) == 1:
        return probe_env(specs[0], seed=config.seed), (), ""
    tasks, note = probe_tasks(specs, seed=config.seed)
    return tasks[0], tuple(tasks), note


def log_multi_task(config: RunConfig, impala: ImpalaConfig, tasks: tuple[EnvInfo, ...], note: str) -> None:
    """A multi-task run's start: its tasks and how the local actors' envs are dealt to them, its value
    scaling and rewards, and warnings for what is legal but unusual."""
    shares = task_shares(config.workers, config.envs_per_worker, len(tasks))
    log.info(
        "multi-task: %d tasks (%s); %s; rewards %s (the PopArt-IMPALA paper trains on unclipped rewards; "
        "--popart/--no-popart and --reward-clip override)",
        len(tasks),
        ", ".join(f"{i}: {t.spec.id}" for i, t in enumerate(tasks)),
        "PopArt per task" if impala.popart else "no PopArt",
        f"clipped to +-{impala.reward_clip:g}" if impala.reward_clip else "unclipped",
    )
    if config.workers:
        log.info(
            "multi-task: %d actors x %d envs, envs per task: %s",
            config.workers,
            config.envs_per_worker,
            ", ".join(f"{t.spec.id} {n}" for t, n in zip(tasks, shares)),
        )
    if note:
        log.info("multi-task: %s", note)
    if config.workers and len(set(shares)) > 1:
        log.warning(
            "multi-task: %d actors x %d envs do not divide evenly over %d tasks (envs per task: %s): the "
            "tasks get unequal frames; --envs-per-worker a multiple of %d evens them",
            config.workers,
            config.envs_per_worker,
            len(tasks),
            ", ".join(map(str, shares)),
            len(tasks) // math.gcd(config.workers, len(tasks)),
        )
    if impala.popart and impala.reward_clip:
        log.warning(
            "multi-task: PopArt with rewards clipped to +-%g: the tasks' reward scales are already alike, "
            "which is what PopArt is for; the PopArt-IMPALA paper trains on unclipped rewards",
            impala.reward_clip,
        )
    unscored = [t.spec.id for t in tasks if t.spec.atari and human_normalized_score(t.spec.id, 0.0) is None]
    if unscored:
        log.warning(
            "multi-task: no human reference score for %s: left out of the median and mean human-normalized "
            "score",
            ", ".join(unscored),
        )


def group_membership(args: argparse.Namespace) -> Membership | None:
    """This process's rank when torchrun started it as one of a learner group across hosts (None: it runs
    alone, or starts its own followers with --learners G); ``args.learners`` becomes the group's size.
    A --learners that says otherwise is a :class:`ConfigError`."""
    member = membership()
    if member is None:
        return None
    if "learners" in args.given and args.learners != member.world_size:
        raise ConfigError(
            f"--learners {args.learners}, but torchrun started {member.world_size} ranks (--nnodes x "
            "--nproc-per-node): give --learners the group's size, or leave it out"
        )
    args.learners = member.world_size
    return member


def follow_rank_0(args: argparse.Namespace, member: Membership) -> str:
    """A follower rank across hosts: join the group, take rank 0's resolved settings (this host needs no
    run folder, not even on --resume: rank 0 sends its state too), probe the same env, and step on each
    batch's share until rank 0 stops the run. Returns the rank's last line."""
    logging.basicConfig(
        level=args.log_level, format=f"%(asctime)s learner-{member.rank} %(levelname)s %(message)s"
    )
    backend = "nccl" if resolve_device(args.device).type == "cuda" else "gloo"
    group = join_group(member, backend, args.bind)
    own = {k: getattr(args, k) for k in ("bind", "curve", "insecure_bind", "device", "log_level")}
    impala, config = follower_settings(group, **own)
    log.info(
        "learner group: %s joined on %s",
        member.describe(),
        os.environ.get("GLOO_SOCKET_IFNAME") or "the interface of this host's name",
    )
    env, tasks, _ = probe_run_envs(config)
    torch.set_num_threads(learner_threads(config, env, ranks_here=member.local_world_size))
    trainer = ImpalaTrainer(impala, config, env, group=group, tasks=tasks)
    # A stop signal (scancel, a pod's deletion, Ctrl-C) reaches every host at once: rank 0 finishes its
    # update and checkpoints, which needs this rank in the update, then releases it. Dying at once here
    # would cost that update and end the run as a lost rank.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _await_rank_0)
    try:
        updates = trainer.follow()
    finally:
        group.leave()
    return f"learner {member.describe()} done: {updates} updates (rank 0 ended the run)"


def _await_rank_0(signum: int, frame: object) -> None:
    log.warning(
        "signal %d: this rank stops when rank 0 stops the group (after its update and checkpoint)", signum
    )


def _follow(args: argparse.Namespace, member: Membership) -> str:
    """:func:`follow_rank_0`, its failures as :class:`LaunchError`: bad input exit 2, a lost rank 0 exit 1."""
    try:
        return follow_rank_0(args, member)
    except START_ERRORS as e:
        raise LaunchError(f"learner {member.describe()}: {str(e).strip() or type(e).__name__}") from None
    except RuntimeError as e:  # the group never formed, or rank 0 is gone (gloo: connection closed)
        if not lost_peer(e):
            raise
        raise LaunchError(
            f"learner {member.describe()}: rank 0 is gone or never came ({peer_error(e)}); "
            "rank 0 writes the run's checkpoint: start every host's rank again (rank 0 with --resume) to "
            "continue",
            status=1,
        ) from None


def launch(argv: list[str] | None) -> Outcome:
    """Parse, resolve, probe the env, wire the run and train (``main`` and ``impala.train``). Raises
    :class:`LaunchError`."""
    try:
        args = parse_args(argv)
        member = group_membership(args)
        if member is None and hosts.requested_rank(args) is not None:  # main() would have been the agent
            raise ConfigError(
                "--node-rank runs this host's rank as a process of its own (torchrun's agent): start it with "
                "the launch_impala command, not from Python"
            )
        if member is not None and member.rank > 0:
            return Outcome(None, None, _follow(args, member))
        config, impala = resolve(args)
    except ConfigError as e:
        raise LaunchError(str(e)) from None
    logging.basicConfig(level=config.log_level, format=LOG_FORMAT)
    claim = CpuClaim()  # the CPUs a pinned run holds until it ends (a second run then leaves them be)
    trainer = None
    created: tuple[str, ...] = ()  # the folders this start made (a failed start takes them away again)
    try:
        created = prepare_run_folder(config.logdir, resume=config.resume, force=config.force)
        env, tasks, note = probe_run_envs(config)
        config = claim_cpus(config, claim, env)
        # every derived default, decided once: config.yaml and the checkpoints record the values
        config, impala = settle(config, impala, env.obs_shape, chosen=chosen_options(args))
        ranks_here = member.local_world_size if member is not None else None
        torch.set_num_threads(learner_threads(config, env, ranks_here))
        trainer = ImpalaTrainer(
            impala, config, env, group=start_group(impala, config, env, tasks, member), tasks=tasks
        )
        record = {**dataclasses.asdict(config), **dataclasses.asdict(impala), "preset": args.config or ""}
        say_preset_replaced(args, log)
        if config.resume:
            for name, old, new in args.resume_changes:
                log.info("resume: %s %s -> %s", name, old, new)
            if args.saved:
                record["resumes"] = resume_record(args.resumes, args.resume_changes)
        plan = RunPlan(env, f"impala {config.env}", record, tasks=tasks)
        if tasks:
            log_multi_task(config, impala, tasks, note)
        elif impala.popart and impala.reward_clip:
            log.warning(
                "PopArt with rewards clipped to +-%g: its value scale is that of the clipped rewards; "
                "--reward-clip 0 trains on the raw scores, as the PopArt papers do",
                impala.reward_clip,
            )
        for info in tasks or (env,):
            log.info("%s; learner on %s", info.description, trainer.device)
        return Outcome(config, run(trainer, config, plan))
    except RunFinished as e:  # --resume of a finished run: nothing to do, and no restart loop
        _release_followers(trainer)
        return Outcome(config, None, str(e))
    except START_ERRORS as e:
        _release_followers(trainer)
        drop_unused_run_folder(created)
        raise LaunchError(str(e).strip() or type(e).__name__) from None
    except LearnerGroupError as e:  # not bad input: the run started and lost a rank
        saved = os.path.isfile(config.checkpoint_path)
        raise LaunchError(
            f"{e}; "
            + (
                f"the run ends with its checkpoint {config.checkpoint_path}: --resume continues"
                + (" (start every host's rank again, this one with --resume)" if member is not None else "")
                if saved
                else "no checkpoint was written (nothing trained yet): start the run again"
            ),
            status=1,
        ) from None
    finally:
        if member is not None and trainer is not None and trainer.group is not None:
            trainer.group.leave()  # across hosts: this process ends here (one host's group leaves with it)
        claim.release()
        release_run_folders()


def _release_followers(trainer: ImpalaTrainer | None) -> None:
    """A run that ends before it trains (finished already, bad input found late) stops its followers, which
    would otherwise wait in a collective until their host's rank 0 connection closes."""
    if trainer is None or trainer.group is None:
        return
    try:
        trainer.close()
    except RuntimeError as e:  # a follower that is gone already
        log.warning("releasing the learner group: %s", peer_error(e))


def done_line(config: RunConfig, result: RunResult) -> str:
    """The run's last console line: what it trained, what it dropped, where its checkpoint is."""
    if len(config.tasks) > 1:  # each task's own: their scales differ, so a mean across them means nothing
        per_task = ", ".join(
            f"{task} {result.task_returns[task]:.2f}" if task in result.task_returns else f"{task} n/a"
            for task in config.tasks
        )
        returns = f"mean return (last 100) per task: {per_task}"
    else:
        returns = (
            f"mean return (last 100) {'n/a' if result.mean_return is None else f'{result.mean_return:.2f}'}"
        )
    return (
        f"launch_impala: done: {result.env_frames} env frames ({result.agent_steps} agent steps), "
        f"{result.updates} updates, {returns}, dropped {result.dropped or 0}, "
        f"actor restarts {result.restarts}, " + ending(config, result)
    )


def host_rank(argv: list[str]) -> Membership | None:
    """With ``--node-rank`` and ``--rdzv-endpoint``: this host's rank of a learner group across hosts, its
    flags checked (None: the run is this process's, or torchrun started it as a rank)."""
    try:
        args = parse_args(argv)
        member = hosts.agent_membership(args)
        # the run's own settings are checked here too, before the rendezvous waits for the other hosts;
        # a follower host resuming may lack the run folder (rank 0 sends it the run's settings)
        if member is not None and not (args.resume and member.rank > 0):
            resolve(args)
        return member
    except ConfigError as e:
        raise LaunchError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    """``launch_impala``: :func:`launch`, or this host's rank of a learner group across hosts
    (:func:`learner.cli.hosts.run_rank`); bad input is one line, exit 2."""
    argv = sys.argv[1:] if argv is None else argv

    def start() -> Outcome | int:
        member = host_rank(argv)
        return launch(argv) if member is None else hosts.run_rank(member, argv)

    status = console_main("launch_impala", start, done_line)
    if learner_group.joined_across_hosts:
        # A rank whose peers have left can abort in libtorch's teardown of the process group at the
        # interpreter's exit ("terminate called without an active exception", SIGABRT) after a run that
        # ended well; everything is written and its last line printed, so the rank skips that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
