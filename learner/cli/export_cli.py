"""``impala-export CHECKPOINT``: a trained policy as an ONNX file.

A ``launch_ppo`` checkpoint becomes a model Unity's ML-Agents package runs (ML-Agents 0.28's format,
``impala.nets.onnx_export.ppo_onnx_model``); a ``launch_impala`` checkpoint becomes an
``obs -> policy_logits, baseline`` network for serving outside Python. Exit 0: written; 2: bad input.
"""

from __future__ import annotations

import argparse
import os
import sys

from impala.envs import UnknownEnvError
from impala.evaluation import PolicyCheckpoint, read_policy_checkpoint
from impala.nets.onnx_export import (
    ExportError,
    check_output_path,
    export_impala_onnx,
    export_ppo_onnx,
    onnx_file_name,
    require_onnx,
)
from impala.options import ConfigError, FlagParser, fail
from impala.run.checkpoint import CheckpointError
from impala.transport.messages import ImpalaAgentSpec, PPOAgentSpec

PROG = "impala-export"


def build_parser() -> argparse.ArgumentParser:
    """``impala-export``'s flags."""
    parser = FlagParser(
        prog=PROG,
        description=(
            "Write a launch_ppo checkpoint's policy as an ONNX model in ML-Agents 0.28's format "
            "(drop it into a Unity project's Behavior Parameters), or a launch_impala checkpoint's network "
            "as ONNX "
            "(obs -> policy_logits, baseline). Exit 0: written; 2: bad input."
        ),
    )
    parser.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="a checkpoint.pt, or a run's logdir holding one"
    )
    parser.add_argument(
        "-o",
        "--output",
        default="",
        metavar="OUT.onnx",
        help="the ONNX file; empty: <behaviour or env id>.onnx next to the checkpoint",
    )
    parser.add_argument(
        "--obs-sizes",
        default="",
        metavar="N,N,...",
        help="PPO: the sizes of the agent's observations (sensors) in the behaviour's order, e.g. "
        "126,32 for Crawler; one ONNX input each (obs_0, obs_1, ...). Empty: one input "
        "obs_0 for all of them",
    )
    return parser


def parse_obs_sizes(text: str) -> list[int] | None:
    """``"126,32"`` -> ``[126, 32]``; ``""`` -> ``None``."""
    if not text.strip():
        return None
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"--obs-sizes {text!r}: expected comma-separated whole numbers, e.g. 126,32"
        ) from None
    if min(sizes) < 1:
        raise ConfigError(f"--obs-sizes {text!r}: every size must be >= 1")
    return sizes


def _load(module, ckpt: PolicyCheckpoint) -> None:
    from impala.transport.params import load_state_arrays

    try:
        load_state_arrays(module, ckpt.params)
    except (RuntimeError, KeyError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"checkpoint {ckpt.path}: its weights do not fit the network its settings describe ({first})"
        ) from None


def export_checkpoint(ckpt: PolicyCheckpoint, out: str, obs_sizes: list[int] | None = None) -> str:
    """Build the checkpoint's policy, load its weights, write ``out``; returns a one-line summary."""
    agent = ckpt.agent
    if isinstance(agent, PPOAgentSpec):
        from impala.nets.ppo_policy import make_policy

        if obs_sizes and sum(obs_sizes) != agent.obs_dim:
            raise ConfigError(
                f"--obs-sizes {','.join(map(str, obs_sizes))} add up to {sum(obs_sizes)}, but the policy "
                f"takes {agent.obs_dim} observation values"
            )
        policy = make_policy(agent.config, agent.obs_dim, agent.action_dim, agent.branches, agent.obs_layout)
        _load(policy, ckpt)
        export_ppo_onnx(
            policy.eval(),
            out,
            action_clip=agent.config.action_clip,
            action_low=agent.action_low,
            action_high=agent.action_high,
            obs_sizes=obs_sizes,
        )
        sizes = obs_sizes or [agent.obs_dim]
        inputs = ", ".join(f"obs_{i}[{n}]" for i, n in enumerate(sizes))
        actions = [f"{agent.action_dim} continuous action(s)"] if agent.action_dim else []
        if agent.branches:
            inputs += f", action_masks[{sum(agent.branches)}]"
            actions.append(f"discrete branches {list(agent.branches)}")
        return f"PPO policy of {ckpt.env.id} ({inputs} -> {' and '.join(actions)}, ML-Agents model API 3)"
    if isinstance(agent, ImpalaAgentSpec):
        if obs_sizes:
            raise ConfigError("--obs-sizes applies to PPO checkpoints only; this one is IMPALA's")
        if agent.use_lstm:
            raise ExportError(
                f"checkpoint {ckpt.path}: IMPALA models with an LSTM core cannot be exported yet"
            )
        from impala.envs.probe import probe_env
        from impala.nets.impala_net import build_model

        # The checkpoint records the env, not its observation shape: build the env once to read it.
        info = probe_env(ckpt.env, check_config=False)
        if not info.num_actions:
            raise CheckpointError(
                f"checkpoint {ckpt.path}: env {ckpt.env.id} has no discrete actions for IMPALA"
            )
        model = build_model(
            agent.model, info.obs_shape, info.num_actions, num_tasks=agent.num_tasks, obs_norm=agent.obs_norm
        )
        _load(model, ckpt)
        export_impala_onnx(model.eval(), info.obs_shape, out, obs_dtype=info.obs_dtype)
        return (
            f"IMPALA {agent.model} network of {ckpt.env.id} (obs{list(info.obs_shape)} {info.obs_dtype} -> "
            f"{info.num_actions} policy logits, {agent.num_tasks} baseline(s))"
        )
    raise CheckpointError(f"checkpoint {ckpt.path}: no ONNX export for a {ckpt.kind} policy")


def main(argv: list[str] | None = None) -> int:
    """``impala-export``: write a checkpoint's policy as ONNX; bad input is one line, exit 2."""
    args = build_parser().parse_args(argv)
    try:
        obs_sizes = parse_obs_sizes(args.obs_sizes)
        if args.output:  # every flag is checked before the checkpoint is read
            check_output_path(args.output, "--output")
        require_onnx()  # before reading a checkpoint: say at once when the onnx package is missing
        ckpt = read_policy_checkpoint(args.checkpoint)
        out = args.output or os.path.join(
            os.path.dirname(os.path.abspath(ckpt.path)), onnx_file_name(ckpt.env)
        )
        what = export_checkpoint(ckpt, out, obs_sizes)
    except (ConfigError, CheckpointError, ExportError, UnknownEnvError) as e:
        return fail(PROG, e)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    print(f"{PROG}: wrote {out}: {what}", flush=True)
    if ckpt.env.is_unity and isinstance(ckpt.agent, PPOAgentSpec) and not obs_sizes:
        print(
            f"{PROG}: note: one input obs_0 for all {ckpt.agent.obs_dim} observation values; if the agent "
            "has several observations (sensors), export again with --obs-sizes",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
