"""The configurations every entry point shares, built on the one mechanism in :mod:`impala.options`.

:class:`RunConfig` holds the process-level settings every entry point shares (``launch_impala``,
``launch_ppo``, ``impala-actors`` takes a subset); :class:`ImpalaConfig` holds only IMPALA's
algorithm and model settings; ``impala.run.ppo_config.PPOConfig`` PPO's. The resume helpers here read a
run folder's saved settings back as the layer under the command line.

**ImpalaConfig's defaults are the settings measured to learn Pong on a 2-core CPU** (docs/PONG.md,
checked on Breakout and SpaceInvaders in docs/ATARI.md): V-trace(lambda=0.95) targets and advantages
computed once per batch, PPO's clipped surrogate against the behaviour policy (APPO), 4 passes of 8
minibatches over each batch of 32 x 32 steps, Adam 5e-4 on mean-reduced losses, gradient norm clipped at
0.5, orthogonal init. With the IMPALA paper's own
settings (single pass, RMSProp 6e-4 / eps 0.01 / clip 40 on summed losses,
``configs/atari.yaml``) the policy was still uniform after 4M frames here; they remain
one flag away for big boxes, with their published meaning (tests/test_impala_update.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping, Optional

from impala.options import ConfigError, capped, check_fields, need, option, option_values, read_yaml
from impala.run.cpus import available_cpus, split_cpus

# PopArt's statistics step size per learner update (Hessel et al. 2018): --popart-beta's default, and the
# value a checkpoint that predates the option was trained with
POPART_BETA = 3e-4

# --------------------------------------------------------------------------- resume: the run as it was

# What a resumed run takes from this command line, not from its config.yaml: where the run folder is, how
# this process talks and logs, and its own time limit. Everything else is the run's own setting.
PER_INVOCATION = frozenset(
    {
        "resume",
        "force",
        "logdir",
        "run_id",
        "runs_dir",
        "results_dir",
        "progress",
        "log_level",
        "device",
        "port",
        "bind",
        "curve",
        "insecure_bind",
        "track",
        "track_project",
        "max_seconds",
        "inference",
        "initialize_from",
    }
)
CONFIG_FILE = "config.yaml"
# Options added after runs were made whose default is not what those runs did: the value a run's config.yaml
# without the key stands for, so --resume continues it as it was (its network, its inputs).
ADDED_LATER: dict[str, Any] = {"obs_norm": False}


def resume_folder(args: argparse.Namespace) -> str:
    """The folder ``--resume`` continues: ``--logdir``, else ``--runs-dir/--run-id``."""
    if getattr(args, "logdir", None):
        return args.logdir
    if getattr(args, "run_id", None):
        return os.path.join(args.runs_dir, args.run_id)
    raise ConfigError("--resume continues a run folder: name it with --run-id NAME or --logdir DIR")


def saved_settings(folder: str, sections: Mapping[str | None, Iterable[type]]) -> tuple[dict[str, Any], list]:
    """A run's own settings from ``folder/config.yaml`` and the record of its earlier resumes. ``sections``:
    the file's section (None: the top level) -> the config classes whose fields it holds. Values are checked
    as a preset's are (a hand-edited bad value is one line naming the key); keys that are no option of this
    version are skipped, and so are :data:`PER_INVOCATION` ones. ({}, []) when the folder has no such file
    (a run of an older version, or one that never started)."""
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(path):
        return {}, []
    doc = read_yaml(path, "--resume")
    if not isinstance(doc, dict):
        raise ConfigError(f"--resume: {path} is not a mapping of setting: value (edited by hand?)")
    values: dict[str, Any] = {}
    for section, classes in sections.items():
        part = doc if section is None else doc.get(section, {})
        if not isinstance(part, dict):
            raise ConfigError(f"--resume: {path}: {section} is not a mapping of setting: value")
        found = option_values(part, classes, f"--resume: {path}", unknown="skip")
        for name, before in ADDED_LATER.items():  # a run from before the option: what it did then
            if name not in part and any(name in {f.name for f in dataclasses.fields(c)} for c in classes):
                found[name] = before
        for cls in classes:  # each class's own checks (ranges, combinations) on the saved values
            names = {f.name for f in dataclasses.fields(cls)}
            try:
                cls(**{k: v for k, v in found.items() if k in names and k not in PER_INVOCATION})
            except ConfigError as e:
                raise ConfigError(f"--resume: {path}: {e}") from None
        values.update(found)
    resumes = doc.get("resumes", [])
    return {k: v for k, v in values.items() if k not in PER_INVOCATION}, resumes if isinstance(
        resumes, list
    ) else []


def apply_saved(
    args: argparse.Namespace, saved: Mapping[str, Any], *, dest_prefix: Mapping[str, str] = {}
) -> None:
    """The run's saved settings as the layer under the command line: each one not given by a flag or the
    command line's preset takes its saved value and counts as chosen (``args.preset``), so a default that
    depends on others (a multi-task run's) does not replace it. ``dest_prefix``: setting -> its parser
    destination's prefix (``launch_ppo``'s PPO options are ``ppo__<name>``)."""
    chosen = args.given | getattr(args, "preset", set())
    for name, value in saved.items():
        dest = dest_prefix.get(name, "") + name
        if dest not in chosen:
            setattr(args, dest, value)
            args.preset = getattr(args, "preset", set()) | {dest}


def resume_changes(
    saved: Mapping[str, Any], now: Mapping[str, Any], fixed: Iterable[str]
) -> list[tuple[str, Any, Any]]:
    """(setting, saved value, value now) of each of the run's own settings this resume changes. A change of a
    ``fixed`` one (what a running run cannot change: its env, its network) is a :class:`ConfigError` naming
    it, before anything is written."""
    changes = [
        (name, saved[name], now[name])
        for name in saved
        if name in now and name not in PER_INVOCATION and _plain(saved[name]) != _plain(now[name])
    ]
    for name, old, new in changes:
        if name in fixed:
            raise ConfigError(
                f"--resume: the run's {name} is {old!r}; {new!r} cannot take its place in a running run "
                f"(resume without --{name.replace('_', '-')}, or start a new run)"
            )
    return changes


def _plain(value: Any) -> Any:
    """A value as config.yaml holds it (tuples as lists, floats as numbers)."""
    return json.loads(json.dumps(value, default=str))


def resume_record(resumes: list, changes: list[tuple[str, Any, Any]]) -> list:
    """The run's resumes with this one added: when, and each setting it changed ({name: [old, new]})."""
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "changed": {n: [o, v] for n, o, v in changes}}
    return [*resumes, _plain(entry)]


# --------------------------------------------------------------------------- RunConfig

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# --cpu-affinity learner-first's actors: the lowest priority, so the learner's threads preempt them at once
# (nice 19 weighs 15 against the learner's 1024); with 10 (weight 110) a second learner thread ran slower
LEARNER_FIRST_NICE = 19
MAX_PUBLISH_DELAY = 16  # updates; each held set of weights is a copy of the network
MAX_SEED = 2**31 - 1  # room for seed + 1000 * actor id below numpy's 2**32 limit
MIN_ABS_VALUE = 1e3
# A dotted Python module name: what --env-package and the module of --env module:id may be (impala.envs checks
# the names a remote actor receives with it before importing them).
MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
RUN_ID = re.compile(r"[A-Za-z0-9._+=-]{1,100}")
MAX_TASKS = 64  # tasks in one multi-task run (the ALE has 57 games)
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
StartMethod = Literal["spawn", "fork", "forkserver"]


@dataclass(frozen=True)
class RunConfig:
    """The process-level settings of a run, shared by every entry point.

    Counters say what they count: ``total_frames`` are environment frames (agent steps x frame
    skip; Atari's published budgets are in frames), ``total_steps`` are agent steps (PPO's and
    ML-Agents' ``max_steps``). Set at most one; the launcher picks its default.
    """

    env: Optional[str] = option(
        "PongDeterministic-v4",
        "Environment id (classic Atari ids such as PongDeterministic-v4, ale-py ids, or gymnasium ids such "
        "as CartPole-v1). launch_impala also takes a comma-separated list for one multi-task agent "
        "(PopArt-IMPALA), e.g. PongDeterministic-v4,BreakoutDeterministic-v4: the tasks are dealt over the "
        "actors' envs in turn, each task the same number of envs where --envs-per-worker allows.",
        brief="Env id: Atari (PongDeterministic-v4), gymnasium (CartPole-v1), mypkg.envs:Id-v0.",
    )
    env_package: str = option(
        "",
        "Python packages to import before the env is made, comma-separated (mypkg or mypkg.envs): "
        "packages that register their envs with gymnasium on import. Imported in the learner and in every "
        "actor (the run sends the names; remote actors need them installed). --env mypkg.envs:MyEnv-v0 "
        "(gymnasium's module:id) imports one such package for its id.",
        brief="Packages to import (learner and actors) that register their envs.",
    )
    env_kwargs: str = option(
        "",
        "Env constructor overrides as a JSON object, e.g. '{\"frameskip\": 4}' for PongNoFrameskip-v4 with a "
        "4-frame skip; checked in every worker like the registry settings.",
        brief="Env constructor overrides, JSON ('{\"frameskip\": 4}'); checked in every actor.",
    )
    workers: int = option(
        2,
        "Local actor processes; 0 runs no local actors and waits for remote ones (impala-actors).",
        brief="Local actor processes; 0: remote actors only (impala-actors).",
    )
    envs_per_worker: int = option(
        4,
        "Environments stepped by each actor with one batched forward pass per step.",
        brief="Envs each actor steps with one batched forward pass (without it a multi-task run gives "
        "every task the same number of envs, at least 8 where 32 per actor allow).",
    )
    learners: int = option(
        1,
        "Learner ranks in a data-parallel group (torch.distributed: gloo on CPU, NCCL with a CUDA --device, "
        "one GPU per rank): processes on this machine, or with --node-rank and --rdzv-endpoint one rank per "
        "host; each update's batch is split over them, --batch-size must divide. Rank 0 receives the "
        "unrolls, publishes weights and writes checkpoints.",
        brief="Data-parallel learner processes (each batch split over them).",
    )
    cpu_affinity: Literal["auto", "off", "split", "learner-first"] = option(
        "auto",
        "Where the learner and its local actor processes run. 'split': pin the learner to CPUs of its own "
        "(--torch-threads of them, 1 by default) and the local actors to the others: on a 2-core box with "
        "2 actors it ran Pong faster than the kernel's placement in 5 of 6 side-by-side pairs, 10-42%% "
        "(BENCHMARKS.md). 'auto' (launch_impala): split for image observations when the learner runs on "
        "the CPU with local actor processes and no other run on this machine has claimed these CPUs (a "
        "lock file per CPU in the temp folder, dropped when the run ends), the learner taking the CPUs "
        "the actors leave (at least 1) unless --torch-threads, else 'off'; launch_ppo: 'off' (its actors "
        "wait during updates, so its learner uses every core then). 'learner-first' (opt-in): no pinning; "
        "the actors run 19 nice levels below the learner (or --actor-nice, when above 0), the learner "
        "gets at least 2 torch threads, taking every core whenever its update can use it, and the "
        "actors' weights are one update behind (--publish-delay 1 unless given). On Pong on the 2-core box "
        "it ran at 0.75-0.91 of the cost model's ceiling (median 0.86) against 0.75-0.80 for split and "
        "reached 18 at 4.7M and 6.0M frames in 18 and 23 minutes against split's 4.7-5.3M in 23-24; "
        "not the default: at 10M frames it was level with split on Breakout (58.3 against 56.3) and "
        "behind on SpaceInvaders (449.9 against 507.1), one seed each (docs/ATARI.md). "
        "Containers that share cores but not a temp folder cannot see each other's claims: give them "
        "'off', CPU sets of their own, or a common folder in IMPALA_CPU_CLAIMS_DIR.",
        brief="Learner/actor CPU placement; auto: pinned for images on a CPU learner.",
    )
    actor_nice: int = option(
        0,
        "Niceness the local actor processes add to their own (0-19) so that the learner, the critical "
        "path when its queue is full, takes a core before they do; they get every cycle it leaves. With "
        "it alone the learner keeps one torch thread (unless --torch-threads): with 10, one thread ran "
        "Pong at 0.78-0.80 of the ceiling on a 2-core box. --cpu-affinity learner-first uses 19 when "
        "this is 0, with a second learner thread. Other programs at niceness 0 in the same session come "
        "before the actors too.",
        brief="Niceness added to the local actors (0-19): the learner first.",
    )
    overlap_updates: bool = option(
        False,
        "Train each IMPALA batch on a thread of its own while the next batch is staged (stacking, "
        "frame-stack rebuild, layout: ~7%% of a CPU learner's work); the updates and their order are the "
        "same, bit for bit (tests/test_overlap_updates.py). Off by default until measured end to end; a "
        "learner group and PPO stage in step either way.",
        brief="Train each batch on a thread while the next one is staged (same updates).",
    )
    in_process: bool = option(
        False,
        "Run the local actors as threads of the learner process (same actor code and sockets; for debugging "
        "and tiny machines).",
        brief="Run the local actors as threads of the learner (debugging).",
    )
    unroll_length: int = option(
        32, "Steps per env per unroll (T); 0: the learner picks.", brief="Agent steps per env per unroll (T)."
    )
    total_frames: Optional[int] = option(
        None,
        "Stop after this many environment frames (agent steps x frame skip).",
        brief="Budget in env frames (agent steps x frame skip), absolute.",
    )
    total_steps: Optional[int] = option(
        None,
        "Stop after this many agent steps (absolute, also with --resume).",
        brief="Budget in agent steps instead, absolute.",
    )
    stop_at_return: Optional[float] = option(
        None,
        "Stop early once the mean return of the last 100 episodes reaches this (counted only after 100 "
        "episodes have finished); unset: run to the step budget.",
        brief="Stop once the mean return of the last 100 episodes reaches this.",
    )
    max_seconds: float = option(
        0.0,
        "Stop after this many seconds of training; 0 means no limit.",
        brief="Stop after this many seconds of training; 0: no limit.",
    )
    eval_every: int = option(
        0,
        "Every this many env frames, play --eval-episodes greedy episodes of the current weights (the "
        "'train' protocol of impala-eval) in a separate process that never stalls the learner, and log eval/ "
        "rows; 0: off. One evaluation plays at a time: one falling due while another plays starts when that "
        "one ends, with the weights of then; at the end of the run the one playing gets 30 s to finish "
        "(its row then comes after the training's last).",
        brief="Evaluate (greedy, apart) every this many frames, one at a time; 0: off.",
    )
    eval_episodes: int = option(
        5, "Episodes per --eval-every evaluation.", brief="Episodes per --eval-every evaluation."
    )
    eval_video: bool = option(
        False,
        "Record the first 600 frames of each evaluation's first episode to LOGDIR/eval-FRAMES.mp4 (the raw "
        "screen; needs an env that renders RGB, e.g. Atari); with --track also to Weights & Biases.",
        brief="Record each evaluation's first 600 frames to LOGDIR/eval-FRAMES.mp4.",
    )
    seed: int = option(
        0,
        "Base seed: the network's initialization, and actor i's envs use seed + 1000 * i (+ restarts).",
        brief="Base seed: the network's init; actor i's envs use seed + 1000 i.",
    )
    device: str = option(
        "auto",
        "Learner device: 'auto' (cuda if available), 'cpu', 'cuda', 'cuda:N'.",
        brief="Learner device: auto, cpu, cuda, cuda:N.",
    )
    torch_threads: int = option(
        0,
        "CPU threads for the learner's torch ops; 0 = the cores left after the actors (launch_impala with "
        "image observations: at least 2 where there are 2, its idle threads sleeping instead of spinning; "
        "otherwise at least 1). More would fight the actors for cores.",
        brief="Learner CPU threads; 0: the cores the actors leave.",
    )
    logdir: Optional[str] = option(
        None,
        "Run folder (TensorBoard events, metrics.csv, config.yaml, checkpoints); default: RUNS_DIR/RUN_ID.",
        brief="Run folder; unset: RUNS_DIR/RUN_ID.",
    )
    runs_dir: str = option("runs", "Folder holding the run folders.", brief="Folder holding the run folders.")
    run_id: Optional[str] = option(
        None,
        "Name of this run's folder under --runs-dir; default: the env id and the start time "
        "(CartPole-v1-20261201-083000). A folder that holds a run is refused unless --resume or --force.",
        brief="Run folder name under --runs-dir; unset: <env>-<start time>.",
    )
    force: bool = option(
        False,
        "Start over in a run folder that holds a run: its checkpoints, metrics, events, config and finished "
        "marker are deleted first.",
        brief="Start over in a folder that holds a run (deletes the run's files).",
    )
    resume: bool = option(
        False,
        "Continue the run in the run folder from its checkpoint.pt (weights, optimizer, normalizers, "
        "counters, the last 100 episodes' returns); needs --run-id or --logdir.",
        brief="Continue the run in the folder with its own settings (its config.yaml).",
    )
    checkpoint_minutes: float = option(
        10.0,
        "Minutes between checkpoints (one is always written at exit).",
        brief="Minutes between checkpoints (and one at exit).",
    )
    log_interval: float = option(
        5.0,
        "Seconds between console/CSV/TensorBoard rows (0: a row after every update).",
        brief="Seconds between log rows (console, metrics.csv, TensorBoard).",
    )
    progress: bool = option(
        True,
        "Show the live console progress display (when stdout is a terminal).",
        brief="Live console display when stdout is a terminal.",
    )
    log_level: LogLevel = option("INFO", "Python logging level.", brief="Python logging level.")
    track: bool = option(
        False,
        "Also log every metric row, the resolved config and the git commit to Weights & Biases (pip install "
        "-e '.[track]'; WANDB_MODE=offline logs without a network).",
        brief="Also log to Weights & Biases (the track extra).",
    )
    track_project: str = option(
        "impala-rl", "Weights & Biases project for --track.", brief="Weights & Biases project for --track."
    )
    bind: str = option(
        "127.0.0.1",
        "Address the learner binds. Binding anything else exposes the learner; use with a firewall or CURVE "
        "keys.",
        brief="Address the learner binds (public needs --curve or --insecure-bind).",
    )
    port: int = option(
        0,
        "Trajectory port (weights use port+1); 0 picks free ports.",
        brief="Trajectory port (weights: port + 1); 0: free ports.",
    )
    curve: str = option(
        "",
        "Directory of ZeroMQ CURVE keys (created if missing): only actors with an authorized key may "
        "connect; traffic is encrypted. Use with a public --bind.",
        brief="Folder of CURVE keys: only authorized actors connect, encrypted.",
    )
    insecure_bind: bool = option(
        False,
        "Allow a non-loopback --bind without --curve (only on a network you trust).",
        brief="Allow a public --bind without --curve (a trusted network only).",
    )
    start_method: StartMethod = option(
        "spawn",
        "Multiprocessing start method for actors.",
        brief="Multiprocessing start method of the actor processes.",
    )
    queue_size: int = option(
        0,
        "Unrolls buffered in the learner; 0 lets the learner pick (IMPALA: one batch; more only adds policy "
        "lag).",
        brief="Unrolls buffered in the learner; 0: the learner picks.",
    )
    max_policy_lag: Optional[int] = option(
        None,
        "Drop unrolls collected with weights more than this many updates old (0: on-policy only); unset "
        "keeps all.",
        brief="Drop unrolls this many updates old or older; unset: keep all.",
    )
    publish_delay: Optional[int] = option(
        None,
        "Send each update's weights to the actors this many updates after it, so that they act on weights "
        "that much older than the learner's (the policy lag V-trace and the clipped objective correct for). "
        "Unset: 1 under --cpu-affinity learner-first, whose learner outruns its actors (their weights were "
        "0.6-0.8 updates old, and its Pong runs took 7.6-8.9M frames to 18 against 4.7M and 6.0M with 1, "
        "BENCHMARKS.md), else 0; never above --max-policy-lag. launch_ppo: 0 (its actors wait for each "
        "update's weights).",
        brief="Updates the actors' weights lag the learner's; unset: by --cpu-affinity.",
    )
    max_abs_value: float = option(
        1e6,
        "Unrolls holding a float (observation, logits, action, log-prob, reward) above this in absolute "
        "value are dropped on receipt (transport/dropped_schema): finite but huge values would overflow the "
        "update.",
        brief="Drop unrolls holding a float above this in absolute value.",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        self._check_budgets()
        self._check_processes()
        self._check_run_folder()
        self._check_transport()
        self._check_env()

    def _check_budgets(self) -> None:
        """Counts and budgets: workers, envs, learners, unroll, frames or steps, time, evaluation, seed."""
        need(self.workers >= 0, f"--workers must be >= 0, got {self.workers}")
        need(self.learners >= 1, f"--learners must be >= 1, got {self.learners}")
        need(self.envs_per_worker >= 1, f"--envs-per-worker must be >= 1, got {self.envs_per_worker}")
        need(
            not (self.in_process and self.workers == 0),
            "--in-process runs the local actors as threads: it needs --workers >= 1",
        )
        need(
            self.unroll_length >= 0,
            f"--unroll-length must be >= 1, or 0 to let the learner pick, got {self.unroll_length}",
        )
        need(
            self.total_frames is None or self.total_frames > 0,
            f"--total-frames must be > 0, got {self.total_frames}",
        )
        need(
            self.total_steps is None or self.total_steps > 0,
            f"--total-steps must be > 0, got {self.total_steps}",
        )
        need(
            self.total_frames is None or self.total_steps is None,
            "give --total-frames (env frames) or --total-steps (agent steps), not both",
        )
        need(self.max_seconds >= 0, f"--max-seconds must be >= 0 (0 means no limit), got {self.max_seconds}")
        need(self.eval_every >= 0, f"--eval-every must be >= 0 (0: off), got {self.eval_every}")
        need(self.eval_episodes >= 1, f"--eval-episodes must be >= 1, got {self.eval_episodes}")
        # actors seed their envs with seed + 1000 * id + restarts, and numpy/torch seeds stop at 2**32 - 1
        need(
            0 <= self.seed <= MAX_SEED, f"--seed must be in 0..{MAX_SEED:,}, got {capped(str(self.seed), 40)}"
        )

    def _check_processes(self) -> None:
        """Where and how the learner and its actors run: device, threads, CPU placement, priority."""
        need(
            self.device == "auto"
            or self.device == "cpu"
            or self.device == "cuda"
            or self.device.startswith("cuda:")
            and self.device[5:].isdigit(),
            f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}",
        )
        need(self.torch_threads >= 0, f"--torch-threads must be >= 0 (0 picks), got {self.torch_threads}")
        need(
            self.cpu_affinity != "split"
            or (self.workers >= 1 and not self.in_process and self.learners == 1),
            "--cpu-affinity split pins one learner and its local actor processes apart: it needs "
            "--workers >= 1, no --in-process and one learner",
        )
        need(
            self.cpu_affinity != "learner-first" or (self.workers >= 1 and not self.in_process),
            "--cpu-affinity learner-first runs the local actor processes below the learner's priority: it "
            "needs --workers >= 1 and no --in-process (actor threads would lower the learner too)",
        )
        need(0 <= self.actor_nice <= 19, f"--actor-nice must be 0-19, got {self.actor_nice}")
        need(
            self.actor_nice == 0 or not self.in_process,
            "--actor-nice lowers the local actor processes' priority: --in-process runs them as threads "
            "of the learner, which it would lower too",
        )
        if self.cpu_affinity == "split":
            try:
                split_cpus(self.cpu_threads())
            except ValueError as e:
                need(False, str(e))

    def _check_run_folder(self) -> None:
        """Where the run is written and how it is logged, resumed and tracked."""
        need(self.logdir is None or bool(self.logdir.strip()), "--logdir must not be empty")
        need(bool(self.runs_dir.strip()), "--runs-dir must not be empty")
        need(
            self.logdir is None
            or self.run_id is None
            # the folder --run-id named (with_run_folder keeps the name, so config.yaml records it as given)
            or os.path.normpath(self.logdir) == os.path.normpath(os.path.join(self.runs_dir, self.run_id)),
            "give --logdir (a folder) or --run-id (a name under --runs-dir), not both",
        )
        need(
            self.run_id is None or bool(RUN_ID.fullmatch(self.run_id)) and self.run_id not in (".", ".."),
            "--run-id must be a plain name of letters, digits and ._+=- (at most 100), got "
            f"{capped(repr(self.run_id), 60)}",
        )
        need(
            not (self.resume and self.force),
            "--resume continues the run in the folder and --force deletes it: give one",
        )
        need(
            not self.resume or self.logdir is not None or self.run_id is not None,
            "--resume needs the run to continue: --run-id NAME (under --runs-dir) or --logdir DIR",
        )
        need(
            bool(self.track_project.strip()) and "/" not in self.track_project,
            f"--track-project must be a plain project name, got {self.track_project!r}",
        )
        need(self.checkpoint_minutes > 0, f"--checkpoint-minutes must be > 0, got {self.checkpoint_minutes}")
        need(
            self.log_interval >= 0,
            f"--log-interval must be >= 0 (0: a row per update), got {self.log_interval}",
        )

    def _check_transport(self) -> None:
        """The sockets and what travels over them: bind, ports, queue, policy lag, value bound."""
        need(bool(self.bind.strip()), "--bind must not be empty")
        need(
            self.port == 0 or 1 <= self.port <= 65534,
            f"--port must be 0 or in 1..65534 (weights use port+1), got {self.port}",
        )
        need(
            self.start_method in multiprocessing.get_all_start_methods(),
            f"--start-method {self.start_method} is not available on this platform (have: "
            f"{', '.join(multiprocessing.get_all_start_methods())})",
        )
        need(self.queue_size >= 0, f"--queue-size must be >= 0 (0: the learner picks), got {self.queue_size}")
        need(
            self.max_policy_lag is None or self.max_policy_lag >= 0,
            "--max-policy-lag must be >= 0 (0: on-policy only; leave it unset to keep all), got "
            f"{self.max_policy_lag}",
        )
        need(
            self.publish_delay is None or 0 <= self.publish_delay <= MAX_PUBLISH_DELAY,
            f"--publish-delay must be 0-{MAX_PUBLISH_DELAY} updates, got {self.publish_delay}",
        )
        need(
            None in (self.max_policy_lag, self.publish_delay) or self.publish_delay <= self.max_policy_lag,
            f"--publish-delay {self.publish_delay} makes every unroll at least that many updates old, so "
            f"--max-policy-lag {self.max_policy_lag} would drop them all: raise it or lower the delay",
        )
        # below a few thousand, honest observations (Atari pixels are up to 255), logits and returns are
        # dropped
        need(
            self.max_abs_value >= MIN_ABS_VALUE,
            f"--max-abs-value must be >= {MIN_ABS_VALUE:g} (it drops unrolls holding larger "
            f"values; pixels alone reach 255), got {self.max_abs_value:g}",
        )
        # The bind/CURVE rule: an open port would let anyone send trajectories and read weights.
        need(
            bool(self.curve) or self.bind in LOOPBACK or self.insecure_bind,
            f"--bind {self.bind} without --curve would let anyone who can reach the port send trajectories "
            "and read "
            "weights; pass --curve DIR (see README, Security), or --insecure-bind on a network you trust",
        )

    def _check_env(self) -> None:
        """The env ids, packages and keyword arguments, checked before any env is made."""
        if self.env is not None:
            tasks = self.env.split(",")
            need(all(t.strip() for t in tasks), f"--env {self.env!r}: an empty env id in the list")
            need(
                len(set(t.strip() for t in tasks)) == len(tasks),
                f"--env {self.env!r}: a task is listed twice",
            )
            need(len(tasks) <= MAX_TASKS, f"--env: at most {MAX_TASKS} tasks, got {len(tasks)}")
        for name in self.env_packages:  # the import itself comes with the env (impala.envs.EnvSpec)
            need(
                bool(MODULE_NAME.fullmatch(name)),
                f"--env-package {capped(repr(name), 80)} is not a Python "
                "module name (like mypkg or mypkg.envs); give several as mypkg,otherpkg",
            )
        if self.env_kwargs:
            need(
                len(self.env_kwargs) <= 100_000,
                f"--env-kwargs is {len(self.env_kwargs):,} characters; an env's keyword "
                "arguments fit in far fewer",
            )
            try:
                parsed = json.loads(self.env_kwargs)
            except RecursionError:
                raise ConfigError("--env-kwargs is nested too deeply") from None
            except ValueError as e:
                raise ConfigError(
                    f"--env-kwargs is not valid JSON ({e}); example: '{{\"frameskip\": 4}}'"
                ) from None
            need(
                isinstance(parsed, dict),
                f"--env-kwargs must be a JSON object, got {capped(repr(self.env_kwargs), 80)}",
            )
            steps = parsed.get("max_episode_steps")
            need(
                steps is None or (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1),
                f"--env-kwargs: max_episode_steps must be an integer >= 1, got {capped(repr(steps), 40)}",
            )

    @property
    def tasks(self) -> tuple[str, ...]:
        """The env ids of ``--env`` (one for a single-task run), in task order."""
        return tuple(t.strip() for t in (self.env or "").split(",") if t.strip())

    @property
    def env_packages(self) -> tuple[str, ...]:
        """The module names of ``--env-package``, in order."""
        return tuple(p.strip() for p in self.env_package.split(",") if p.strip())

    @property
    def env_overrides(self) -> dict:
        """``env_kwargs`` parsed (validated in ``__post_init__``)."""
        return json.loads(self.env_kwargs) if self.env_kwargs else {}

    @property
    def checkpoint_path(self) -> str:
        if self.logdir is None:  # a name made now would differ from the folder the run uses
            raise ConfigError("the run folder is not resolved yet: call with_run_folder() first")
        return os.path.join(self.logdir, "checkpoint.pt")

    def with_run_folder(self, job: str) -> "RunConfig":
        """This config with ``logdir`` resolved: ``--logdir``, else ``--runs-dir/--run-id``, else
        ``--runs-dir/<job>-<start time>`` (``job``: the env id, say)."""
        if self.logdir:
            return self
        name = (
            self.run_id or f"{re.sub(r'[^A-Za-z0-9._+=-]+', '_', job)[:60]}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
        return dataclasses.replace(self, logdir=os.path.join(self.runs_dir, name))

    def local_actor_nice(self) -> int:
        """Nice levels the local actor processes add to their own: ``--actor-nice``, or
        :data:`LEARNER_FIRST_NICE` under ``--cpu-affinity learner-first`` when that is 0."""
        if self.cpu_affinity == "learner-first" and not self.actor_nice:
            return LEARNER_FIRST_NICE
        return self.actor_nice

    def weights_delay(self) -> int:
        """Updates between the learner's weights and the actors': ``--publish-delay``, or where it is unset
        1 under ``--cpu-affinity learner-first`` and 0 otherwise (its help says why), never above
        ``--max-policy-lag`` (more would make every unroll too old to train on)."""
        if self.publish_delay is not None:
            return self.publish_delay
        delay = 1 if self.cpu_affinity == "learner-first" else 0
        return delay if self.max_policy_lag is None else min(delay, self.max_policy_lag)

    def cpu_threads(self, *, actors_wait_during_updates: bool = False, at_least: int = 1) -> int:
        """The learner's torch threads: ``--torch-threads``, else the cores the local actors leave, and
        at least ``at_least`` where the machine has that many cores.

        Each actor is single-threaded; a learner with as many threads as cores would make the OS
        time-slice them against each other (several times slower on a small machine). Actors that
        wait for new weights during an update (on-policy PPO) leave every core to it then. IMPALA's
        learner asks for at least 2 with image observations (``learner_threads``): under
        ``--cpu-affinity learner-first`` its actors yield to it, so the second thread takes their core
        whenever the update can use it; at one priority (``off``) its actors spend most of their time
        blocked on its back pressure and a second thread that sleeps while idle (launch_impala loads torch
        with ``OMP_WAIT_POLICY=PASSIVE``) uses the part of their cores they leave. With actors niced by
        ``--actor-nice`` alone the learner keeps one thread, as measured with 10 (a second one took the
        actors' core at less than twice the speed, BENCHMARKS.md).
        """
        if self.torch_threads:
            return self.torch_threads
        if self.cpu_affinity == "split":  # the measured placement: one learner thread on a core of its own
            return 1
        cores = available_cpus()
        local = 0 if (self.in_process or actors_wait_during_updates) else self.workers
        if self.actor_nice and local and self.cpu_affinity != "learner-first":
            at_least = 1  # the learner outranks its actors: one thread, as measured with --actor-nice 10
        return max(min(at_least, cores), cores - local)


# --------------------------------------------------------------------------- ImpalaConfig


@dataclass(frozen=True)
class ImpalaConfig:
    """IMPALA's algorithm and model settings (the process-level ones are :class:`RunConfig`)."""

    batch_size: int = option(
        32, "Unrolls per learner update (B).", brief="Unrolls per learner update (B; T x B agent steps each)."
    )
    model: Literal["auto", "shallow", "nature", "deep", "mlp"] = option(
        "auto",
        "Network: 'shallow' or 'deep' IMPALA CNN or 'nature' (Mnih et al. 2015) for images, 'mlp' for "
        "vectors, 'auto' to pick by observation rank.",
        brief="Network: shallow/deep IMPALA CNN, nature CNN, mlp; auto by observation.",
    )
    use_lstm: bool = option(
        False, "Add an LSTM-256 core (state resets at episode starts).", brief="Add an LSTM-256 core."
    )
    popart: bool = option(
        False,
        "Normalize value targets with PopArt (Hessel et al. 2018). Off by default: the measured small-box "
        "Pong recipe (docs/PONG.md) ran without it, and with clipped rewards one task has one value scale; "
        "turn it on for unclipped or multi-task rewards.",
        brief="PopArt value normalization (per task); on for several --env.",
    )
    init: Literal["orthogonal", "torch"] = option(
        "orthogonal",
        "Weight init: 'orthogonal' (gain sqrt(2) torso, 0.01 policy head, zero biases; baselines/cleanrl) or "
        "'torch' (PyTorch defaults, as TorchBeast).",
        brief="Weight init: orthogonal (cleanrl) or torch (TorchBeast).",
    )
    loss_reduction: Literal["sum", "mean"] = option(
        "mean",
        "Reduce the losses over T x B by 'sum' (the IMPALA paper's and TorchBeast's units, in which lr 6e-4 "
        "/ eps 0.01 / clip 40 are published) or 'mean' (A2C/PPO units).",
        brief="Losses summed (the paper's units) or averaged over T x B.",
    )
    optimizer: Literal["rmsprop", "adam"] = option(
        "adam",
        "'rmsprop' (torch.optim.RMSprop: eps added to sqrt(v), no bias correction) or 'adam' "
        "(bias-corrected; uses --adam-eps).",
        brief="Optimizer: adam or rmsprop (TorchBeast's).",
    )
    adam_eps: float = option(1e-5, "Adam epsilon (with --optimizer adam).", brief="Adam epsilon.")
    epochs: int = option(
        4,
        "Passes over each batch (1 = IMPALA). More passes reuse each frame for more updates; V-trace "
        "re-corrects every pass. Use with --pg-clip.",
        brief="Passes over each batch (1: IMPALA; PPO's num_epoch).",
    )
    minibatches: int = option(
        8,
        "Split each batch into this many minibatches of whole unrolls per pass (PPO-style); must divide "
        "--batch-size.",
        brief="Minibatches of whole unrolls per pass; divides --batch-size.",
    )
    targets: Literal["per_step", "per_batch"] = option(
        "per_batch",
        "When V-trace's value targets and advantages are computed (with --epochs/--minibatches > 1): "
        "'per_step' recomputes them with the current network at every minibatch step (APPO, as Sample "
        "Factory); 'per_batch' computes them once per batch with the network as the batch arrives and "
        "holds them fixed over every pass (PPO's advantages and returns, computed once per rollout).",
        brief="V-trace targets once per batch, or at every minibatch step (APPO).",
    )
    pg_clip: float = option(
        0.1,
        "0: IMPALA's policy gradient. >0: PPO's clipped surrogate against the behaviour policy with this "
        "epsilon (APPO, as RLlib and Sample Factory).",
        brief="PPO clip epsilon against the behaviour policy; 0: IMPALA's gradient.",
    )
    advantage_norm: bool = option(
        True,
        "Standardize the policy-gradient advantages over each minibatch (as PPO does).",
        brief="Standardize advantages per minibatch.",
    )
    learning_rate: float = option(
        5e-4,
        "Learning rate; decays linearly to 0 over the run's frames (--no-lr-decay keeps it).",
        brief="Learning rate, decaying linearly to 0 over the run.",
    )
    lr_decay: bool = option(
        True,
        "Decay the learning rate linearly to 0 over the run.",
        brief="Decay the learning rate to 0 over the run.",
    )
    rmsprop_eps: float = option(0.01, "RMSProp epsilon.", brief="RMSProp epsilon.")
    rmsprop_alpha: float = option(0.99, "RMSProp decay.", brief="RMSProp decay.")
    rmsprop_momentum: float = option(0.0, "RMSProp momentum.", brief="RMSProp momentum.")
    entropy_cost: float = option(
        0.01,
        "Entropy bonus coefficient.",
        brief="Entropy bonus coefficient (PPO's ent_coef, ML-Agents' beta).",
    )
    baseline_cost: float = option(
        1.0,
        "Value loss coefficient, on 0.5 * squared error (so 1.0 here is PPO's vf_coef 0.5 on the MSE).",
        brief="Value loss coefficient on 0.5 x squared error.",
    )
    discount: float = option(0.99, "Discount factor gamma.", brief="Discount gamma.")
    vtrace_lambda: float = option(
        0.95,
        "V-trace trace decay lambda in [0, 1] (rlax's lambda_): 1 is the paper's V-trace; on-policy, lambda "
        "< 1 gives GAE(lambda) advantages.",
        brief="V-trace lambda; 1: the paper's V-trace.",
    )
    reward_clip: float = option(
        1.0,
        "Clip rewards to [-c, c] in the learner; 0 disables.",
        brief="Clip rewards to [-c, c]; 0: raw (several --env: 0).",
    )
    grad_norm_clip: float = option(
        0.5, "Global gradient-norm clip; 0 disables.", brief="Gradient norm clip; 0: none."
    )
    popart_beta: float = option(
        POPART_BETA, "PopArt statistics step size.", brief="PopArt statistics step size."
    )
    precision: Literal["fp32", "bf16"] = option(
        "fp32",
        "The learner's arithmetic in an image torso (its convolutions and fc layer): 'fp32', or 'bf16' "
        "(autocast; weights, optimizer, heads, losses and V-trace stay fp32, and so do the actors). bf16 "
        "pays on a CPU with native bf16 (AVX512-BF16 or AMX: 1.4-1.6x the frames/s on Pong, 2-core AMD "
        "EPYC) but its three Pong seeds needed 7.3-8.7M frames to 18 against fp32's 5.1-5.3M "
        "(BENCHMARKS.md), so it is not the default. Elsewhere it is slower (7.8x per minibatch step on an "
        "AVX2-only CPU): a CPU learner times both at start and warns with the figures when bf16 loses.",
        brief="Learner arithmetic in image torsos: fp32 or bf16 (autocast).",
    )
    sync: bool = option(
        False,
        "Synchronous collection, as Sample Factory's async_rl=False: each local actor collects its share of "
        "a batch with the newest weights, then waits for the update's weights, so every batch is on-policy "
        "(policy lag 0) while the actors and the learner take turns (fewer frames/s). --batch-size must be "
        "a multiple of the local envs (--workers x --envs-per-worker).",
        brief="Actors wait for each update's weights: on-policy batches, fewer frames/s.",
    )
    obs_norm: bool = option(
        True,
        "Image observations: standardize each input pixel by its running mean and variance (updated by the "
        "learner from every batch, sent to the actors with the weights) and clip to +-5, as Sample "
        "Factory's normalize_input; vector observations are unaffected. On Pong it took the mean return "
        "to -10 in a third of the frames plain 1/255 scaling needed (docs/PONG_ABLATION.md).",
        brief="Images: standardize each pixel by running statistics (clip +-5); off: x/255.",
    )
    frame_dedup: bool = option(
        True,
        "Atari: send each frame once (the newest frame per step) and rebuild the 4-frame stacks in the "
        "learner, about 4x fewer bytes per unroll; the actors check that their env stacks as the learner "
        "assumes.",
        brief="Atari: send each frame once; the learner rebuilds the stacks.",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        need(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        need(self.learning_rate > 0, f"--learning-rate must be > 0, got {self.learning_rate}")
        need(self.adam_eps > 0, f"--adam-eps must be > 0, got {self.adam_eps}")
        need(self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}")
        small = [d for d in range(1, math.isqrt(self.batch_size) + 1) if self.batch_size % d == 0]
        divisors = sorted({*small, *(self.batch_size // d for d in small)})
        divisors = ", ".join(map(str, divisors[:12])) + (", ..." if len(divisors) > 12 else "")
        need(
            self.minibatches >= 1 and self.batch_size % self.minibatches == 0,
            f"--minibatches must divide --batch-size {self.batch_size} (one of {divisors}), got "
            f"{self.minibatches}",
        )
        need(0 <= self.pg_clip < 1, f"--pg-clip must be in [0, 1), got {self.pg_clip}")
        need(0 < self.discount <= 1, f"--discount must be in (0, 1], got {self.discount}")
        need(0 <= self.vtrace_lambda <= 1, f"--vtrace-lambda must be in [0, 1], got {self.vtrace_lambda}")
        need(0 < self.popart_beta <= 1, f"--popart-beta must be in (0, 1], got {self.popart_beta}")
        need(self.rmsprop_eps > 0, f"--rmsprop-eps must be > 0, got {self.rmsprop_eps}")
        need(0 <= self.rmsprop_alpha < 1, f"--rmsprop-alpha must be in [0, 1), got {self.rmsprop_alpha}")
        need(self.rmsprop_momentum >= 0, f"--rmsprop-momentum must be >= 0, got {self.rmsprop_momentum}")
        need(self.entropy_cost >= 0, f"--entropy-cost must be >= 0, got {self.entropy_cost}")
        need(self.baseline_cost >= 0, f"--baseline-cost must be >= 0, got {self.baseline_cost}")
        need(self.reward_clip >= 0, f"--reward-clip must be >= 0 (0 disables), got {self.reward_clip}")
        need(
            self.grad_norm_clip >= 0, f"--grad-norm-clip must be >= 0 (0 disables), got {self.grad_norm_clip}"
        )


IMPALA_UNROLL = 32  # T where --unroll-length is 0 (the learner picks)
DEFAULT_TOTAL_FRAMES = (
    20_000_000  # launch_impala's budget where neither --total-frames nor --total-steps is given
)


# A multi-task run's defaults where they differ from one task's: the PopArt-IMPALA paper's agent
# (Hessel et al. 2018) normalizes each task's values with PopArt and trains on unclipped rewards,
# since clipping is what made tasks' reward scales look alike before PopArt.
MULTI_TASK_DEFAULTS = {"popart": True, "reward_clip": 0.0}


# Env streams per task a multi-task run aims for where --envs-per-worker is not given: as many as a
# single-task run on the default 2 actors x 4 envs has. With 2 streams per game (2 actors x 5 envs, five
# games) each game's share of a batch came from 2 episodes at a time, and Breakout and SpaceInvaders stayed
# under half of their single-task scores; with 8 they did not (docs/MULTITASK.md, section 2).
ENVS_PER_TASK = 8
MAX_ENVS_PER_ACTOR = 32  # past this an actor's unrolls wait long for its turn: the policy lag grows


def balanced_envs_per_worker(workers: int, num_tasks: int, default: int) -> int:
    """Envs per actor for a multi-task run where ``--envs-per-worker`` is not set: the smallest count from
    ``default`` up that deals every task the same number of envs (``workers * K`` a multiple of the tasks)
    and gives each at least ENVS_PER_TASK (2 actors and 5 games: 20 envs each, 8 per game; 16 actors: 5
    each, 16 per game). Where that is over MAX_ENVS_PER_ACTOR, the largest even count under it (1 actor and
    5 games: 30); where none is, the smallest even count, unless that needs more than twice the envs every
    task needs at least one of; then that many, and the tasks' shares differ by one env."""
    if workers < 1:
        return default
    step = num_tasks // math.gcd(workers, num_tasks)
    wanted = max(default, -(-ENVS_PER_TASK * num_tasks // workers))
    full = -(-wanted // step) * step
    if full <= MAX_ENVS_PER_ACTOR:
        return full
    capped = MAX_ENVS_PER_ACTOR // step * step
    if capped >= max(default, step):
        return capped
    balanced = max(step, -(-default // step) * step)
    enough = max(default, -(-num_tasks // workers))
    return balanced if balanced <= max(8, 2 * enough) else enough


def model_for(kind: str, obs_shape: tuple[int, ...]) -> str:
    """The network ``--model`` names for these observations: ``auto`` is an MLP for 1-D vectors and the
    shallow IMPALA CNN for [C, H, W] images; other kinds as given. ValueError where ``auto`` cannot choose."""
    if kind != "auto":
        return kind
    if len(obs_shape) == 1:
        return "mlp"
    if len(obs_shape) == 3:
        return "shallow"
    raise ValueError(
        f"model kind 'auto' cannot choose for obs_shape {tuple(obs_shape)}: expected 1-D vectors or "
        "[C, H, W] images; pass kind='mlp' with flattened observations instead"
    )


def settle(
    run: RunConfig, impala: ImpalaConfig, obs_shape: tuple[int, ...], *, chosen: Iterable[str] = ()
) -> tuple[RunConfig, ImpalaConfig]:
    """Every setting whose default depends on the run's other settings or its env, decided once, after the env
    probe measured the observations and the CPUs were claimed (``--cpu-affinity auto``, which takes a claim on
    the machine's CPUs, is ``learner.run.runtime.claim_cpus``): the budget (neither --total-frames nor
    --total-steps: DEFAULT_TOTAL_FRAMES), a multi-task run's PopArt, reward clip and envs per actor
    (MULTI_TASK_DEFAULTS and :func:`balanced_envs_per_worker`, for the options not in ``chosen``: the ones a
    flag, a preset or the resumed run set), the unroll length (0: IMPALA_UNROLL), the actors' weights delay
    (``--publish-delay`` unset: :meth:`RunConfig.weights_delay`) and the network (``--model auto``:
    :func:`model_for`). The values go to config.yaml and to the checkpoint's agent record as they are, so a
    run and its checkpoints say what they are and nothing downstream decides again (a rule changed later
    cannot rebuild an old run's network differently)."""
    chosen = set(chosen)
    if run.total_frames is None and run.total_steps is None:
        run = dataclasses.replace(run, total_frames=DEFAULT_TOTAL_FRAMES)
    if len(run.tasks) > 1:
        impala = dataclasses.replace(
            impala, **{k: v for k, v in MULTI_TASK_DEFAULTS.items() if k not in chosen}
        )
        if "envs_per_worker" not in chosen:
            k = balanced_envs_per_worker(run.workers, len(run.tasks), run.envs_per_worker)
            run = dataclasses.replace(run, envs_per_worker=k)
    try:
        model = model_for(impala.model, tuple(obs_shape))
    except ValueError as e:
        raise ConfigError(f"--model {impala.model}: {e}") from None
    run = dataclasses.replace(
        run, unroll_length=run.unroll_length or IMPALA_UNROLL, publish_delay=run.weights_delay()
    )
    return run, dataclasses.replace(impala, model=model)


def resolve_device(name: str) -> Any:
    """``--device`` as a ``torch.device``, refusing a CUDA device this machine does not have."""
    import torch  # here, not at the top: the config and its --help need no torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"--device {name} was requested but CUDA is not available; use --device cpu or auto"
        )
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device
