"""Typed configuration for the IMPALA run, validated once.

Every field has a docstring-like ``help`` in its metadata; ``add_arguments``
turns the dataclass into command-line flags so ``--help`` documents each one.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, get_type_hints


class ConfigError(ValueError):
    """A configuration value that cannot work; the message says how to fix it."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ImpalaConfig:
    env: str = _f("PongDeterministic-v4", "Environment id (classic Atari ids such as PongDeterministic-v4, ale-py ids, or gymnasium ids such as CartPole-v1).")
    env_kwargs: str = _f("", 'Env constructor overrides as a JSON object, e.g. \'{"frameskip": 4}\' for PongNoFrameskip-v4 with a 4-frame skip; checked in every worker like the registry settings.')
    workers: int = _f(2, "Number of local actor processes; 0 runs no local actors and waits for remote ones (impala-actors).")
    envs_per_worker: int = _f(4, "Environments stepped by each actor with one batched forward pass per step.")
    unroll_length: int = _f(80, "Steps per unroll (T).")
    batch_size: int = _f(32, "Unrolls per learner update (B).")
    total_frames: int = _f(50_000_000, "Stop after this many environment frames (agent steps x frame skip).")
    model: str = _f("auto", "Network: 'shallow' or 'deep' IMPALA CNN for images, 'mlp' for vectors, 'auto' to pick by observation rank.")
    use_lstm: bool = _f(False, "Add an LSTM-256 core (state resets at episode starts).")
    popart: bool = _f(True, "Normalize value targets with PopArt (Hessel et al. 2018).")
    learning_rate: float = _f(6e-4, "RMSProp learning rate; decays linearly to 0 over total_frames.")
    lr_decay: bool = _f(True, "Decay the learning rate linearly to 0 over the run.")
    rmsprop_eps: float = _f(0.01, "RMSProp epsilon.")
    rmsprop_alpha: float = _f(0.99, "RMSProp decay.")
    rmsprop_momentum: float = _f(0.0, "RMSProp momentum.")
    entropy_cost: float = _f(0.01, "Entropy bonus coefficient.")
    baseline_cost: float = _f(0.5, "Value loss coefficient.")
    discount: float = _f(0.99, "Discount factor gamma.")
    reward_clip: float = _f(1.0, "Clip rewards to [-c, c] in the learner; 0 disables.")
    grad_norm_clip: float = _f(40.0, "Global gradient-norm clip; 0 disables.")
    popart_beta: float = _f(3e-4, "PopArt statistics step size.")
    seed: int = _f(0, "Base seed; actor i uses seed + 1000 * i (+ restarts).")
    device: str = _f("auto", "Learner device: 'auto' (cuda if available), 'cpu', 'cuda', 'cuda:N'.")
    logdir: str = _f("runs/impala", "Directory for TensorBoard events, metrics.csv and checkpoints.")
    checkpoint_minutes: float = _f(10.0, "Minutes between checkpoints (one is always written at exit).")
    resume: bool = _f(False, "Continue from logdir/checkpoint.pt (weights, optimizer, PopArt, counters).")
    bind: str = _f("127.0.0.1", "Address the learner binds. Binding anything else exposes the learner; use with a firewall or CURVE keys.")
    curve: str = _f("", "Directory of ZeroMQ CURVE keys (created if missing): only actors with an authorized key may connect; traffic is encrypted. Use with a public --bind.")
    insecure_bind: bool = _f(False, "Allow a non-loopback --bind without --curve (only on a network you trust).")
    port: int = _f(0, "Trajectory port (params use port+1); 0 picks free ports.")
    start_method: str = _f("spawn", "Multiprocessing start method for actors: spawn, fork or forkserver.")
    max_policy_lag: int = _f(0, "Drop unrolls older than this many policy versions; 0 keeps all (V-trace corrects off-policy data).")
    queue_size: int = _f(0, "Unrolls buffered in the learner; 0 means 2 x batch_size.")
    progress: bool = _f(True, "Show the live console progress display.")
    log_interval: float = _f(5.0, "Seconds between console/CSV/TensorBoard rows.")
    torch_threads: int = _f(0, "CPU threads for the learner's torch ops; 0 = the cores left after the actors (at least 1). More would fight the actors for cores.")
    autocast_bf16: bool = _f(False, "Run the learner's forward pass under bf16 autocast (CUDA only).")
    max_seconds: float = _f(0.0, "Stop after this many seconds of training; 0 means no limit.")

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(self.workers >= 0, f"--workers must be >= 0, got {self.workers}")
        need(self.envs_per_worker >= 1, f"--envs-per-worker must be >= 1, got {self.envs_per_worker}")
        need(self.unroll_length >= 1, f"--unroll-length must be >= 1, got {self.unroll_length}")
        need(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        need(self.total_frames > 0, f"--total-frames must be > 0, got {self.total_frames}")
        need(self.model in ("auto", "shallow", "deep", "mlp"), f"--model must be auto, shallow, deep or mlp, got {self.model!r}")
        need(self.learning_rate > 0, f"--learning-rate must be > 0, got {self.learning_rate}")
        need(0 < self.discount <= 1, f"--discount must be in (0, 1], got {self.discount}")
        need(0 < self.popart_beta <= 1, f"--popart-beta must be in (0, 1], got {self.popart_beta}")
        need(self.reward_clip >= 0 and self.grad_norm_clip >= 0, "--reward-clip and --grad-norm-clip must be >= 0")
        need(1 <= self.port + 1 <= 65535 or self.port == 0, f"--port must be 0 or in 1..65534, got {self.port}")
        need(self.start_method in ("spawn", "fork", "forkserver"), f"--start-method must be spawn, fork or forkserver, got {self.start_method!r}")
        import multiprocessing

        need(
            self.start_method in multiprocessing.get_all_start_methods(),
            f"--start-method {self.start_method} is not available on this platform (have: {', '.join(multiprocessing.get_all_start_methods())})",
        )
        need(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"), f"--device must be auto, cpu or cuda[:N], got {self.device!r}")
        need(self.checkpoint_minutes > 0, "--checkpoint-minutes must be > 0")
        if self.env_kwargs:
            import json

            try:
                parsed = json.loads(self.env_kwargs)
            except ValueError as e:
                raise ConfigError(f"--env-kwargs is not valid JSON ({e}); example: '{{\"frameskip\": 4}}'") from None
            need(isinstance(parsed, dict), f"--env-kwargs must be a JSON object, got {self.env_kwargs!r}")

    @property
    def env_overrides(self) -> dict:
        """``env_kwargs`` parsed (validated in ``__post_init__``)."""
        import json

        return json.loads(self.env_kwargs) if self.env_kwargs else {}

    @property
    def effective_queue_size(self) -> int:
        return self.queue_size or 2 * self.batch_size

    @property
    def checkpoint_path(self) -> str:
        return os.path.join(self.logdir, "checkpoint.pt")


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """One ``--flag`` per dataclass field, with the field's help and default."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        typ = hints[f.name]
        help_text = f.metadata.get("help", "")
        if typ is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            parser.add_argument(flag, type=typ, default=f.default, help=f"{help_text} (default: {f.default})")


def from_arguments(cls: type, args: argparse.Namespace, **extra: Any) -> Any:
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    kwargs.update(extra)
    return cls(**kwargs)
