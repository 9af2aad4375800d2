"""``frameskip_check``: prove, inside real actor processes, that each env runs with its configured settings.

The frameskip bug (docs/FRAMESKIP.md): a worker whose env was built in the parent (in ``__init__``)
and pickled into the child trained on *different dynamics* (frameskip (2, 5)
instead of 4, sticky actions lost) and nothing crashed. This command is the
regression check for that bug. For every env id and every multiprocessing start
method it:

1. starts a real ``TrajectoryServer`` and an ``ActorPool`` of real ``Actor``
   processes, exactly as ``launch_impala`` does; each child builds its env in
   ``run()`` and sends the fingerprint it *measured* (the ALE frame counter's
   advance per agent step, sticky-action probability, action set, episode step
   limit, observation shape and dtype) in its hello message;
2. compares every child's fingerprint with what the parent configured
   (``configured_settings`` + ``check_against_config``, plus the observation
   the parent expects), then stops the pool and checks that no child lingers;
3. pickles the raw ALE env in the parent, unpickles it, measures it and
   compares (the historical failure mode itself; ``impala.envs.audit``);
4. constructs the actor class in the parent and walks its attributes for any
   environment object (envs must be built in ``run()``, never in ``__init__``;
   ``impala.envs.audit``).

One table row per (env id x start method); exit status 1 on any mismatch, 2 on
bad input. ``--plot`` additionally runs episodes under the configured settings
and under a deliberately mis-specified twin (frameskip 2-4, sticky 0.25) and
plots steps per episode and episode return side by side (``learner.cli.frameskip_plot``).
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import os
import pickle
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import gymnasium as gym

from actors.actor import Actor
from actors.loop import ActorConfig, actor_configs
from actors.pool import ActorPool
from impala.envs import EnvSpec, UnknownEnvError, check_env_id
from impala.envs.audit import (
    ENV_IN_INIT,
    check_actor_builds_no_env,
    check_pickle_roundtrip,
    envs_held_by,
    obs_mismatches,
)
from impala.envs.fingerprint import (
    ConfiguredSettings,
    EnvFingerprint,
    Mismatch,
    check_against_config,
    configured_settings,
)
from impala.envs.probe import expected_observation
from impala.evaluation import checkpoint_path
from impala.options import ConfigError, FlagParser, add_flags, check_fields, fail, from_flags, need, option
from impala.run.checkpoint import CheckpointError
from impala.transport.messages import ImpalaAgentSpec, RunInfo
from impala.transport.trajectory import impala_unroll_schema
from learner.cli.frameskip_plot import check_checkpoint, plot_episodes, run_episodes, summary_lines
from learner.serve.server import TrajectoryServer

DEFAULT_ENV_IDS = ("PongDeterministic-v4", "PongNoFrameskip-v4", "Pong-v4", "ALE/Pong-v5")
START_METHODS = ("fork", "spawn", "forkserver")


class UsageError(ValueError):
    """Bad command-line input: reported as one line on stderr, exit status 2."""


# ---------------------------------------------------------------------------
# Check 1: what the workers measure
# ---------------------------------------------------------------------------


@dataclass
class Row:
    """The result for one (env id x start method).

    measured / pids: per actor id, the fingerprint from its hello and the pid
    that measured it. mismatches: (actor id, Mismatch) for every field that
    differs from the configuration. errors: anything else that went wrong
    (missing hello, a process left running). pickle / actor_flags: the results
    of ``check_pickle_roundtrip`` and ``check_actor_builds_no_env`` when the
    caller attached them (None: not run).
    """

    env_id: str
    start_method: str
    workers: int
    configured: ConfiguredSettings | None
    expected_obs: tuple[tuple[int, ...], str]
    measured: dict[int, EnvFingerprint] = field(default_factory=dict)
    pids: dict[int, int] = field(default_factory=dict)
    mismatches: list[tuple[int, Mismatch]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    pickle: list[Mismatch] | None = None
    actor_flags: list[str] | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.mismatches or self.errors or self.pickle or self.actor_flags)

    def problems(self) -> list[str]:
        """One human-readable line per problem, naming field, both values and likely cause."""
        where = f"{self.env_id} [{self.start_method}]"
        out = [f"{where} worker {a}: {m}" for a, m in self.mismatches]
        out += [f"{where}: {e}" for e in self.errors]
        out += [f"{self.env_id} pickle round trip: {m}" for m in self.pickle or []]
        out += [f"{self.env_id} actor: {f}" for f in self.actor_flags or []]
        return out


def _lingering(pids: Iterable[int], wait: float = 5.0) -> list[int]:
    """Pids (of ours) still running after ``wait`` seconds; zombies count as gone."""

    have_proc = os.path.isdir("/proc/self")

    def running(pid: int) -> bool:
        if have_proc:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
            except OSError:
                return False
        try:  # no /proc (macOS): a zombie counts as running here, so the wait is conservative
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    pids = list(pids)
    deadline = time.monotonic() + wait
    while True:
        left = [p for p in pids if running(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _actor_configs(
    spec: EnvSpec,
    actor_ids: range,
    *,
    trajectory_endpoint: str,
    params_endpoint: str,
    seed: int,
    fingerprint_steps: int,
) -> list[ActorConfig]:
    """This command's actors (the worker check and the __init__ probe), made like every run's: one env each,
    the agent launch_impala's ImpalaTrainer sends (the child builds the same one)."""
    run = RunInfo(
        "frameskip-check",
        spec,
        ImpalaAgentSpec(model="auto", use_lstm=False),
        unroll_length=20,
        envs_per_worker=1,
    )
    # The actors wait for parameters that never come; we stop them, the timeout is the safety net.
    return actor_configs(
        run,
        actor_ids,
        trajectory_endpoint=trajectory_endpoint,
        params_endpoint=params_endpoint,
        seed=seed,
        fingerprint_steps=fingerprint_steps,
        params_timeout_s=60.0,
    )


def check_workers(
    env_id: str,
    start_method: str,
    *,
    workers: int = 2,
    actor_class: type = Actor,
    env_kwargs: dict[str, Any] | None = None,
    timeout: float = 120.0,
    fingerprint_steps: int = 300,
    seed: int = 0,
) -> Row:
    """Start ``workers`` real actor processes with ``start_method`` and check the fingerprints they report.

    The path is launch_impala's: a ``TrajectoryServer`` receives the hellos, an
    ``ActorPool`` starts ``actor_class`` processes, each of which measures its
    env in the child and says hello. The pool is stopped once every hello is in
    (or a worker died, or ``timeout`` passed); any worker process still running
    afterwards is reported.
    """
    started = time.monotonic()
    if start_method not in multiprocessing.get_all_start_methods():
        raise UsageError(
            f"start method {start_method!r} is not available on this platform (available: "
            f"{', '.join(multiprocessing.get_all_start_methods())})"
        )
    spec = EnvSpec(env_id, kwargs=dict(env_kwargs or {}))
    cfg = configured_settings(env_id, spec.kwargs)
    expected = expected_observation(spec)
    row = Row(env_id, start_method, workers, cfg, expected)
    # The server needs some schema; only hellos are exchanged here, so its layout does not matter.
    schema = impala_unroll_schema(20, expected[0], expected[1], 1)
    server = TrajectoryServer(schema, on_hello=lambda actor, info: None)
    configs = _actor_configs(
        spec,
        range(workers),
        trajectory_endpoint=server.trajectory_endpoint,
        params_endpoint=server.params_endpoint,
        seed=seed,
        fingerprint_steps=fingerprint_steps,
    )
    pool = ActorPool(configs, start_method=start_method, actor_class=actor_class)
    spawned: list[int] = []
    try:
        server.start()
        started_all = True
        try:
            pool.start()
        except (TypeError, AttributeError, pickle.PicklingError) as e:
            # spawn/forkserver pickle the actor object; an env built in __init__ (an ALEInterface)
            # cannot cross. Report it as a finding; the __init__ audit names the attribute.
            row.errors.append(f"the actor could not be sent to a {start_method} worker: {e} ({ENV_IN_INIT})")
            started_all = False
        spawned = pool.pids()
        if started_all:
            _wait_for_hellos(server, pool, workers, timeout, row)
    finally:
        pool.stop()
        server.close()
    _check_stopped(pool, spawned, row)
    _check_fingerprints(server.accepted, cfg, expected, row)
    row.seconds = time.monotonic() - started
    return row


def _wait_for_hellos(
    server: TrajectoryServer, pool: ActorPool, workers: int, timeout: float, row: Row
) -> None:
    """Until every worker said hello; a worker that exited first, or ``timeout``, is an error in ``row``."""
    deadline = time.monotonic() + timeout
    while len(server.accepted) < workers:
        dead = [a for a in pool.actors if not a.is_alive() and a.config.actor_id not in server.accepted]
        if dead:
            time.sleep(0.5)  # a hello sent just before exiting may still be in flight
            dead = [a for a in dead if a.config.actor_id not in server.accepted]
            for a in dead:
                row.errors.append(
                    f"worker {a.config.actor_id} exited with code {a.exitcode} before saying hello"
                )
            if dead:
                return
        if time.monotonic() > deadline:
            row.errors.append(
                f"only {len(server.accepted)} of {workers} workers said hello within {timeout:.0f}s"
            )
            return
        time.sleep(0.05)


def _check_stopped(pool: ActorPool, spawned: list[int], row: Row) -> None:
    """Every worker process is gone and joined once the pool stopped; any left is an error in ``row``."""
    left = _lingering(spawned)
    if left:
        row.errors.append(f"worker processes still running after stop: pids {left}")
    ours = {a.pid for a in pool.actors}
    still_children = [p.pid for p in multiprocessing.active_children() if p.pid in ours]
    if still_children:
        row.errors.append(f"worker processes not joined after stop: pids {still_children}")


def _check_fingerprints(accepted: Mapping[int, Mapping[str, Any]], cfg: Any, expected: Any, row: Row) -> None:
    """Each worker's hello: a fingerprint measured in the child, matching the configured settings and the
    expected observation; what it measured goes into ``row``, what differs into its mismatches."""
    for actor_id, info in sorted(accepted.items()):
        pid = info.get("pid")
        raw = info.get("fingerprint")
        if pid == os.getpid():
            row.errors.append(f"worker {actor_id}: fingerprint was measured in the parent, not in the child")
        if not isinstance(raw, dict):
            row.errors.append(f"worker {actor_id}: hello carries no env fingerprint")
            continue
        try:
            fp = EnvFingerprint.from_dict(raw)
        except (TypeError, ValueError) as e:
            row.errors.append(f"worker {actor_id}: malformed fingerprint: {e}")
            continue
        row.measured[actor_id] = fp
        row.pids[actor_id] = int(pid) if isinstance(pid, int) else -1
        row.mismatches += [(actor_id, m) for m in check_against_config(fp, cfg)]
        row.mismatches += [(actor_id, m) for m in obs_mismatches(expected, fp)]


def probe_actor_class(actor_class: type, spec: EnvSpec, *, start_method: str = "spawn") -> list[str]:
    """Construct ``actor_class`` in this process (never started) and run ``check_actor_builds_no_env``."""
    config = _actor_configs(
        spec,
        range(1),
        trajectory_endpoint="tcp://127.0.0.1:1",
        params_endpoint="tcp://127.0.0.1:2",
        seed=0,
        fingerprint_steps=300,
    )[0]
    actor = actor_class(config, start_method=start_method)
    try:
        return check_actor_builds_no_env(actor)
    finally:
        for _, obj in envs_held_by(actor):
            close = getattr(obj, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:  # noqa: BLE001 - best effort cleanup of what the actor built
                    pass


# ---------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------


def _cfg_frameskip(cfg: ConfiguredSettings) -> str:
    fs = cfg.frameskip
    return str(fs) if isinstance(fs, int) else f"{fs[0]}..{fs[1] - 1}"


def _distinct(values: Iterable[str]) -> str:
    out: list[str] = []
    for v in values:
        if v not in out:
            out.append(v)
    return ", ".join(out) if out else "-"


def _obs_text(shape: Sequence[int], dtype: str) -> str:
    return "x".join(str(d) for d in shape) + f" {dtype}"


HEADERS = (
    "env id",
    "start",
    "workers",
    "frameskip",
    "sticky",
    "action set",
    "max steps",
    "obs",
    "pickle",
    "__init__",
    "result",
)


def row_cells(row: Row, sep: str = " / ") -> list[str]:
    """Table cells: each compared field as ``configured<sep>measured``."""
    fps = [row.measured[k] for k in sorted(row.measured)]
    cfg = row.configured
    if cfg is not None:
        frameskip = f"{_cfg_frameskip(cfg)}{sep}{_distinct(f.frameskip_text() for f in fps)}"
        sticky = (
            f"{cfg.sticky:g}{sep}{_distinct('n/a' if f.sticky is None else f'{f.sticky:g}' for f in fps)}"
        )
        action_sets = _distinct(f"{f.action_set()} ({f.num_actions})" for f in fps)
        actions = f"{'full' if cfg.full_action_space else 'minimal'}{sep}{action_sets}"
        step_limits = _distinct(str(f.max_episode_steps or "none") for f in fps)
        max_steps = f"{cfg.max_episode_steps or 'none'}{sep}{step_limits}"
    else:
        frameskip = sticky = actions = "n/a"
        max_steps = f"-{sep}{_distinct(str(f.max_episode_steps or 'none') for f in fps)}"
    obs = f"{_obs_text(*row.expected_obs)}{sep}{_distinct(_obs_text(f.obs_shape, f.obs_dtype) for f in fps)}"
    pickle_cell = (
        "-"
        if row.pickle is None
        else ("OK" if not row.pickle else "MISMATCH: " + ", ".join(m.field for m in row.pickle))
    )
    init_cell = "-" if row.actor_flags is None else ("OK" if not row.actor_flags else "ENV IN __init__")
    result = "OK" if row.ok else "MISMATCH"
    return [
        row.env_id,
        row.start_method,
        f"{len(row.measured)}/{row.workers}",
        frameskip,
        sticky,
        actions,
        max_steps,
        obs,
        pickle_cell,
        init_cell,
        result,
    ]


def print_table(rows: list[Row], *, file=None, rich: bool | None = None) -> None:
    """A rich table on a terminal, plain aligned text otherwise."""
    file = file or sys.stdout
    if rich is None:
        rich = file.isatty()
    cells = [row_cells(r, sep="\n" if rich else " / ") for r in rows]
    if rich:
        from rich.console import Console
        from rich.table import Table

        table = Table(
            title="frameskip check",
            caption="each cell: configured (top) / measured in the workers (bottom)",
            show_lines=True,
        )
        for h in HEADERS:
            table.add_column(h, no_wrap=True)
        for r, c in zip(rows, cells):
            style = "green" if r.ok else "bold red"
            table.add_row(*c[:-1], f"[{style}]{c[-1]}[/{style}]")
        Console(file=file).print(table)
        return
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(HEADERS)]
    print("frameskip check (configured / measured in each worker)", file=file)
    print("  ".join(h.ljust(w) for h, w in zip(HEADERS, widths)).rstrip(), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for c in cells:
        print("  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip(), file=file)
    file.flush()


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckOptions:
    """frameskip_check's options (the env ids and start methods are repeatable flags of their own)."""

    workers: int = option(2, "Actor processes per (env id x start method).")
    fingerprint_steps: int = option(300, "Random agent steps each worker measures.")
    timeout: float = option(120.0, "Seconds to wait for the workers' hellos.")
    actor_class: Optional[str] = option(
        None,
        "An Actor subclass MODULE:CLASS to check instead of actors.actor:Actor (must be importable in the "
        "children).",
    )
    seed: int = option(0, "Base seed.")
    plot: Optional[str] = option(
        None,
        "OUT.png: also run episodes under the configured settings of the first env id and under a "
        "mis-specified twin (frameskip (2,5), sticky 0.25) and plot steps per episode and return.",
    )
    plot_only: bool = option(False, "With --plot: skip the worker checks.")
    episodes: int = option(10, "Episodes per setting for --plot.")
    max_steps_per_episode: int = option(0, "Cap each --plot episode at this many agent steps (0: no cap).")
    checkpoint: Optional[str] = option(
        None,
        "With --plot: sample actions from a launch_impala checkpoint.pt (or its logdir) instead of a random "
        "policy.",
    )
    jobs: int = option(0, "Worker processes for --plot episodes (0: one per CPU).")

    def __post_init__(self) -> None:
        check_fields(self)
        need(self.workers >= 1, f"--workers must be >= 1, got {self.workers}")
        need(self.fingerprint_steps >= 10, f"--fingerprint-steps must be >= 10, got {self.fingerprint_steps}")
        need(self.timeout > 0, f"--timeout must be a number of seconds > 0, got {self.timeout}")
        need(self.seed >= 0, f"--seed must be >= 0, got {self.seed}")
        need(self.episodes >= 1, f"--episodes must be >= 1, got {self.episodes}")
        need(
            self.max_steps_per_episode >= 0,
            f"--max-steps-per-episode must be >= 0, got {self.max_steps_per_episode}",
        )
        need(self.jobs >= 0, f"--jobs must be >= 0, got {self.jobs}")
        need(not self.plot_only or bool(self.plot), "--plot-only needs --plot OUT.png")
        need(not self.checkpoint or bool(self.plot), "--checkpoint is only used with --plot OUT.png")


def build_parser() -> argparse.ArgumentParser:
    """``frameskip_check``'s flags."""
    parser = FlagParser(
        prog="frameskip_check",
        description=(
            "Regression check for the frameskip bug (an env built in the parent and pickled into a worker "
            "ran with other settings; docs/FRAMESKIP.md): start real actor processes (TrajectoryServer + "
            "ActorPool, as launch_impala "
            "does) for each env id and start method, and compare the env fingerprint each child measures "
            "(frameskip from the "
            "ALE frame counter, sticky actions, action set, episode step limit, obs shape/dtype) with the "
            "configured settings. "
            "Also checks a pickle round trip of each raw env and that the actor class builds no env in "
            "__init__. "
            "Exit 0: all OK; 1: a mismatch; 2: bad input."
        ),
    )
    parser.add_argument(
        "env_ids",
        nargs="*",
        default=[],
        metavar="ENV_ID",
        help=f"env ids to check; none here and no --env: {' '.join(DEFAULT_ENV_IDS)}",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="ENV_ID",
        help="an env id to check (repeatable; adds to the positional ids)",
    )
    parser.add_argument(
        "--start-method",
        action="append",
        default=[],
        metavar="METHOD",
        help="multiprocessing start method (repeatable; none given: every one available here)",
    )
    add_flags(parser, CheckOptions)
    return parser


def _load_actor_class(text: str) -> type:
    module, sep, name = text.partition(":")
    if not sep or not module or not name:
        raise UsageError(f"--actor-class must be MODULE:CLASS, got {text!r}")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"cannot load --actor-class {text!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise UsageError(f"--actor-class {text!r} is not an Actor subclass")
    return cls


def _validate(args: argparse.Namespace) -> tuple[CheckOptions, list[str], list[str], type]:
    options = from_flags(CheckOptions, args)
    env_ids = list(dict.fromkeys([*args.env_ids, *args.env])) or list(DEFAULT_ENV_IDS)
    for env_id in env_ids:
        check_env_id(env_id)  # UnknownEnvError lists close matches
    available = multiprocessing.get_all_start_methods()
    methods = list(dict.fromkeys(args.start_method)) or [m for m in START_METHODS if m in available]
    for m in methods:
        if m not in available:
            raise UsageError(
                f"start method {m!r} is not available on this platform (available: {', '.join(available)})"
            )
    if options.plot:
        folder = os.path.dirname(os.path.abspath(options.plot))
        if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            raise UsageError(f"--plot {options.plot}: cannot write into {folder}")
    if options.checkpoint:
        path = checkpoint_path(options.checkpoint)
        if not os.path.exists(path):
            raise UsageError(f"no checkpoint at {path}")
    actor_class = _load_actor_class(options.actor_class) if options.actor_class else Actor
    return options, env_ids, methods, actor_class


def main(argv: list[str] | None = None) -> int:
    """``frameskip_check``: check every worker's env against its configuration, print the table."""
    try:
        options, env_ids, methods, actor_class = _validate(build_parser().parse_args(argv))
        policy = check_checkpoint(options.checkpoint, env_ids[0]) if options.checkpoint else "random policy"
    except (ConfigError, UsageError, UnknownEnvError, CheckpointError) as e:
        return fail("frameskip_check", e)
    args = options

    rows: list[Row] = []
    if not args.plot_only:
        for env_id in env_ids:
            pickle_result = (
                check_pickle_roundtrip(env_id, seed=args.seed)
                if gym.registry[env_id].entry_point == "ale_py.env:AtariEnv"
                else []
            )
            flags = probe_actor_class(actor_class, EnvSpec(env_id), start_method=methods[0])
            for method in methods:
                row = check_workers(
                    env_id,
                    method,
                    workers=args.workers,
                    actor_class=actor_class,
                    timeout=args.timeout,
                    fingerprint_steps=args.fingerprint_steps,
                    seed=args.seed,
                )
                row.pickle, row.actor_flags = pickle_result, flags
                rows.append(row)
        print_table(rows)

    if args.plot:
        results = run_episodes(
            env_ids[0],
            args.episodes,
            seed=args.seed,
            max_steps=args.max_steps_per_episode,
            checkpoint=args.checkpoint,
            jobs=args.jobs,
        )
        plot_episodes(
            results, args.plot, env_id=env_ids[0], policy=policy, max_steps=args.max_steps_per_episode
        )
        for line in summary_lines(results, env_id=env_ids[0]):
            print(line)
        print(f"wrote {args.plot}")

    problems = list(
        dict.fromkeys(p for r in rows for p in r.problems())
    )  # pickle/actor findings are per env id
    for p in problems:
        print(f"frameskip_check: MISMATCH {p}", file=sys.stderr)
    if problems:
        failed = sum(not r.ok for r in rows)
        print(
            f"frameskip_check: {failed} of {len(rows)} (env id x start method) checks failed", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
