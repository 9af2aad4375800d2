"""``impala-eval CHECKPOINT``: play a trained checkpoint and judge it under a named protocol.

Only the command line: flags, the console table and the JSON file (``EvalResult.to_dict``) next
to the checkpoint. The episodes are played by :mod:`learner.evaluator`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from concurrent.futures.process import BrokenProcessPool  # imported by name: the package loads it lazily
from typing import Any, Mapping

import numpy as np

from impala.envs import UnknownEnvError
from impala.envs.fingerprint import FingerprintMismatchError
from impala.envs.protocols import eval_protocol
from impala.evaluation import EvalConfig, EvalResult, check_writable, checkpoint_path, read_policy_checkpoint
from impala.options import ConfigError, FlagParser, add_flags, fail, from_flags
from impala.run.checkpoint import CheckpointError
from learner.evaluator import PROG, evaluate_checkpoint


def build_parser() -> argparse.ArgumentParser:
    """``impala-eval``'s flags (one per EvalConfig field) and the checkpoint argument."""
    parser = FlagParser(
        prog=PROG,
        description=(
            "Play a launch_impala or launch_ppo checkpoint for N episodes across worker processes (through "
            "the actors' own "
            "agent code) under a named protocol, check every worker's env against the protocol, and report "
            "mean, std, median, "
            "min and max of the episode returns: a table here and a JSON file next to the checkpoint. Exit "
            "0: done; "
            "1: a worker's env differs from the protocol; 2: bad input."
        ),
    )
    parser.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="a checkpoint.pt, or a run's logdir holding one"
    )
    add_flags(parser, EvalConfig)
    return parser


def protocol_line(settings: Mapping[str, Any]) -> str:
    """The protocol and its frame budget in a few words (the console table, the results in docs/EVAL.md)."""
    s = settings
    if "sticky" not in s:
        cap = (
            f"episodes cut at {s['max_frames_per_episode']:,} steps"
            if s.get("max_frames_per_episode")
            else (f"step limit {s['max_episode_steps']:,}" if s.get("max_episode_steps") else "no step limit")
        )
        return f"{s['protocol']}: {s['env_id']} as trained, {cap}"
    parts = [
        f"sticky {s['sticky']:g}",
        f"{s['action_set']} actions",
        f"{s['noop_max']} no-ops max" if s["noop_max"] else "no no-ops",
    ]
    parts.append(
        f"cap {s['max_frames_per_episode']:,} frames"
        if s.get("max_frames_per_episode")
        else f"step limit {s['max_episode_steps']:,}"
        if s.get("max_episode_steps")
        else "no cap"
    )
    return f"{s['protocol']}: frameskip {s['frameskip']}, " + ", ".join(parts)


_FLAT_LIST = re.compile(
    r"\[\s+((?:-?[\d.eE+-]+|true|false|null)(?:,\s+(?:-?[\d.eE+-]+|true|false|null))*)\s+\]"
)


def result_json(data: Mapping[str, Any]) -> str:
    """``data`` as indented JSON with each list of numbers on one line."""
    return (
        _FLAT_LIST.sub(lambda m: "[" + " ".join(m.group(1).split()) + "]", json.dumps(data, indent=1)) + "\n"
    )


def _fmt(x: float) -> str:
    return f"{x:.2f}" if abs(x) < 1e4 else f"{x:,.0f}"


def print_result(result: EvalResult, *, json_path: str, file: Any = None) -> None:
    """The evaluation as a table on the console, naming the JSON file."""
    from rich.console import Console
    from rich.table import Table

    s = result.stats
    ck = result.checkpoint or {}
    trained = f", trained {ck['env_frames']:,} frames" if ck.get("env_frames") else ""
    table = Table(title=f"impala-eval: {result.env['id']}{trained}", show_header=False)
    table.add_column("", style="bold", no_wrap=True)
    table.add_column("", overflow="fold")
    steps = np.array([e.steps for e in result.episodes], dtype=float)
    frames = np.array([e.frames for e in result.episodes], dtype=float)
    capped = sum(e.capped for e in result.episodes)
    checked = ", ".join(str(w["pid"]) for w in result.workers)
    rows = [
        ("protocol", protocol_line(result.settings)),
        ("policy", result.policy),
        (
            "episodes",
            f"{len(result.episodes)} (seeds {result.seed}..{result.seed + len(result.episodes) - 1})"
            + (f", {capped} cut by a cap" if capped else ""),
        ),
        ("return", f"[bold]{_fmt(s['mean'])} ± {_fmt(s['std'])}[/bold] (mean ± std)"),
        ("median / min / max", f"{_fmt(s['median'])} / {_fmt(s['min'])} / {_fmt(s['max'])}"),
        ("episode length", f"{steps.mean():,.0f} agent steps, {frames.mean():,.0f} env frames (mean)"),
        ("total", f"{result.total_steps:,} agent steps, {result.total_frames:,} env frames"),
        ("env checked in", f"{len(result.workers)} worker(s): pid {checked}: OK"),
        ("wall time", f"{result.wall_time_s:,.1f} s"),
        ("result", json_path),
    ]
    if result.video:
        rows.append(
            (
                "video",
                f"{result.video['path']} ({result.video['frames']} frames, {result.video['fps']:g} fps)",
            )
        )
    for k, v in rows:
        table.add_row(k, v)
    Console(file=file or sys.stdout, soft_wrap=False).print(table)


def main(argv: list[str] | None = None) -> int:
    """``impala-eval``: evaluate a checkpoint, print the table, write the JSON; bad input is one line, exit
    2."""
    args = build_parser().parse_args(argv)
    try:
        options: EvalConfig = from_flags(EvalConfig, args)
        run_folder = os.path.dirname(os.path.abspath(checkpoint_path(args.checkpoint)))
        relative = any(p and not os.path.isabs(p) for p in (options.out, options.video))
        options = options.in_run_folder(run_folder)
        if os.path.isdir(run_folder) or not relative:  # else reading the checkpoint says the run is not there
            options.check_paths()
        ckpt = read_policy_checkpoint(args.checkpoint)
        tasks = ckpt.select_tasks(options.task)
        if len(tasks) > 1:
            print(
                f"{PROG}: {ckpt.path} is a multi-task checkpoint: playing its {len(tasks)} tasks in turn",
                flush=True,
            )
        for spec in tasks:
            one = dataclasses.replace(ckpt, env=spec)
            task_options = options.for_task(spec.id, ckpt.path) if ckpt.tasks else options
            out = task_options.result_path(ckpt.path)
            if not options.out:
                check_writable(out, "the result file (--out)")
            proto = eval_protocol(spec, options.protocol, max_frames=options.max_frames)
            print(f"{PROG}: {ckpt.path} ({ckpt.kind}, {spec.id}); protocol {proto.summary()}", flush=True)
            print(f"{PROG}: settings {json.dumps(proto.settings())}", flush=True)
            result = evaluate_checkpoint(one, task_options)
            write_result(result, out)
    except (ConfigError, CheckpointError, UnknownEnvError) as e:
        return fail(PROG, e)
    except FingerprintMismatchError as e:
        fail(PROG, e)
        return 1
    except BrokenProcessPool as e:
        fail(PROG, f"an evaluation worker process died ({e})")
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    return 0


def write_result(result: EvalResult, out: str) -> None:
    """The JSON result (atomically), the console table and where both went."""
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        f.write(result_json(result.to_dict()))
    os.replace(tmp, out)
    print_result(result, json_path=out)
    print(f"{PROG}: wrote {out}" + (f" and {result.video['path']}" if result.video else ""), flush=True)


if __name__ == "__main__":
    sys.exit(main())
