"""Typed configuration for the IMPALA run, validated once.

Every field has a docstring-like ``help`` in its metadata; ``add_arguments``
turns the dataclass into command-line flags so ``--help`` documents each one.

**Defaults are the settings measured to learn Pong on a 2-core CPU** (docs/PONG.md,
issue 8): V-trace(lambda=0.95) targets and advantages with PPO's clipped surrogate
against the behaviour policy (APPO), 4 passes of 4 minibatches over each batch of
32 x 32 steps, Adam 2.5e-4 on mean-reduced losses, gradient norm clipped at 0.5,
orthogonal init. With the IMPALA paper's own settings (single pass, RMSProp 6e-4 /
eps 0.01 / clip 40 on summed losses, ``configs/impala_paper_atari.yaml``) the policy
was still uniform after 4M frames here; they remain one flag away for big boxes,
with their published meaning (tests/test_impala_update.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints


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
    unroll_length: int = _f(32, "Steps per unroll (T).")
    batch_size: int = _f(32, "Unrolls per learner update (B).")
    total_frames: int = _f(20_000_000, "Stop after this many environment frames (agent steps x frame skip).")
    model: str = _f("auto", "Network: 'shallow' or 'deep' IMPALA CNN or 'nature' (Mnih et al. 2015) for images, 'mlp' for vectors, 'auto' to pick by observation rank.")
    use_lstm: bool = _f(False, "Add an LSTM-256 core (state resets at episode starts).")
    popart: bool = _f(False, "Normalize value targets with PopArt (Hessel et al. 2018). Off by default: the measured small-box Pong recipe (docs/PONG.md) ran without it, and with clipped rewards one task has one value scale; turn it on for unclipped or multi-task rewards.")
    init: str = _f("orthogonal", "Weight init: 'orthogonal' (gain sqrt(2) torso, 0.01 policy head, zero biases; baselines/cleanrl) or 'torch' (PyTorch defaults, as TorchBeast).")
    loss_reduction: str = _f("mean", "Reduce the losses over T x B by 'sum' (the IMPALA paper's and TorchBeast's units, in which lr 6e-4 / eps 0.01 / clip 40 are published) or 'mean' (A2C/PPO units).")
    optimizer: str = _f("adam", "'rmsprop' (torch.optim.RMSprop: eps added to sqrt(v), no bias correction) or 'adam' (bias-corrected; uses --adam-eps).")
    adam_eps: float = _f(1e-5, "Adam epsilon (with --optimizer adam).")
    epochs: int = _f(4, "Passes over each batch (1 = IMPALA). More passes reuse each frame for more updates; V-trace re-corrects every pass. Use with --pg-clip.")
    minibatches: int = _f(4, "Split each batch into this many minibatches of whole unrolls per pass (PPO-style); must divide --batch-size.")
    pg_clip: float = _f(0.1, "0: IMPALA's policy gradient. >0: PPO's clipped surrogate against the behaviour policy with this epsilon (APPO, as RLlib and Sample Factory).")
    advantage_norm: bool = _f(True, "Standardize the policy-gradient advantages over each batch (as PPO does per minibatch).")
    learning_rate: float = _f(2.5e-4, "Learning rate; decays linearly to 0 over total_frames (--no-lr-decay keeps it).")
    lr_decay: bool = _f(True, "Decay the learning rate linearly to 0 over the run.")
    rmsprop_eps: float = _f(0.01, "RMSProp epsilon.")
    rmsprop_alpha: float = _f(0.99, "RMSProp decay.")
    rmsprop_momentum: float = _f(0.0, "RMSProp momentum.")
    entropy_cost: float = _f(0.01, "Entropy bonus coefficient.")
    baseline_cost: float = _f(1.0, "Value loss coefficient, on 0.5 * squared error (so 1.0 here is PPO's vf_coef 0.5 on the MSE).")
    discount: float = _f(0.99, "Discount factor gamma.")
    vtrace_lambda: float = _f(0.95, "V-trace trace decay lambda in [0, 1] (rlax's lambda_): 1 is the paper's V-trace; on-policy, lambda < 1 gives GAE(lambda) advantages.")
    max_abs_value: float = _f(1e6, "Unrolls whose float observations, behaviour logits or rewards exceed this in absolute value are dropped on receipt (counted as transport/dropped_schema): finite but huge values would overflow the update.")
    reward_clip: float = _f(1.0, "Clip rewards to [-c, c] in the learner; 0 disables.")
    grad_norm_clip: float = _f(0.5, "Global gradient-norm clip; 0 disables.")
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
    max_policy_lag: Optional[int] = _f(None, "Drop unrolls older than this many policy versions (0: on-policy only, as launch_ppo); unset keeps all (V-trace corrects off-policy data).")
    queue_size: int = _f(0, "Unrolls buffered in the learner; 0 means batch_size (one batch waits while the learner updates; every unroll buffered beyond that only adds policy lag).")
    progress: bool = _f(True, "Show the live console progress display.")
    log_interval: float = _f(5.0, "Seconds between console/CSV/TensorBoard rows (0: a row after every update).")
    torch_threads: int = _f(0, "CPU threads for the learner's torch ops; 0 = the cores left after the actors (at least 1). More would fight the actors for cores.")
    autocast_bf16: bool = _f(False, "Run the learner's forward pass under bf16 autocast (CUDA only).")
    max_seconds: float = _f(0.0, "Stop after this many seconds of training; 0 means no limit.")
    stop_at_return: Optional[float] = _f(None, "Stop early once the mean return of the last 100 episodes reaches this (counted only after 100 episodes have finished); unset: run to --total-frames.")

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        hints = get_type_hints(type(self))
        for f in dataclasses.fields(self):
            # inf or nan in any float flag trains a NaN network or never stops; no field means that.
            value = getattr(self, f.name)
            is_float = _value_type(hints[f.name]) is float
            need(not is_float or value is None or math.isfinite(value), f"--{f.name.replace('_', '-')} must be a finite number, got {value}")
        need(self.workers >= 0, f"--workers must be >= 0, got {self.workers}")
        need(self.envs_per_worker >= 1, f"--envs-per-worker must be >= 1, got {self.envs_per_worker}")
        need(self.unroll_length >= 1, f"--unroll-length must be >= 1, got {self.unroll_length}")
        need(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        need(self.total_frames > 0, f"--total-frames must be > 0, got {self.total_frames}")
        need(self.model in ("auto", "shallow", "nature", "deep", "mlp"), f"--model must be auto, shallow, nature, deep or mlp, got {self.model!r}")
        need(self.learning_rate > 0, f"--learning-rate must be > 0, got {self.learning_rate}")
        need(self.init in ("orthogonal", "torch"), f"--init must be orthogonal or torch, got {self.init!r}")
        need(self.loss_reduction in ("sum", "mean"), f"--loss-reduction must be sum or mean, got {self.loss_reduction!r}")
        need(self.optimizer in ("rmsprop", "adam"), f"--optimizer must be rmsprop or adam, got {self.optimizer!r}")
        need(self.adam_eps > 0, f"--adam-eps must be > 0, got {self.adam_eps}")
        need(self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}")
        need(self.minibatches >= 1 and self.batch_size % self.minibatches == 0,
             f"--minibatches must be >= 1 and divide --batch-size {self.batch_size}, got {self.minibatches}")
        need(0 <= self.pg_clip < 1, f"--pg-clip must be in [0, 1), got {self.pg_clip}")
        need(0 < self.discount <= 1, f"--discount must be in (0, 1], got {self.discount}")
        need(0 <= self.vtrace_lambda <= 1, f"--vtrace-lambda must be in [0, 1], got {self.vtrace_lambda}")
        need(0 < self.popart_beta <= 1, f"--popart-beta must be in (0, 1], got {self.popart_beta}")
        need(self.rmsprop_eps > 0, f"--rmsprop-eps must be > 0, got {self.rmsprop_eps}")
        need(0 <= self.rmsprop_alpha < 1, f"--rmsprop-alpha must be in [0, 1), got {self.rmsprop_alpha}")
        need(self.rmsprop_momentum >= 0, f"--rmsprop-momentum must be >= 0, got {self.rmsprop_momentum}")
        need(self.entropy_cost >= 0, f"--entropy-cost must be >= 0, got {self.entropy_cost}")
        need(self.baseline_cost >= 0, f"--baseline-cost must be >= 0, got {self.baseline_cost}")
        need(self.seed >= 0, f"--seed must be >= 0, got {self.seed}")
        need(self.max_policy_lag is None or self.max_policy_lag >= 0, f"--max-policy-lag must be >= 0 (0: on-policy only; leave it unset to keep all), got {self.max_policy_lag}")
        need(self.queue_size >= 0, f"--queue-size must be >= 0 (0 means --batch-size), got {self.queue_size}")
        need(self.max_seconds >= 0, f"--max-seconds must be >= 0 (0 means no limit), got {self.max_seconds}")
        need(self.log_interval >= 0, f"--log-interval must be >= 0 (0: a row per update), got {self.log_interval}")
        need(self.torch_threads >= 0, f"--torch-threads must be >= 0 (0 picks), got {self.torch_threads}")
        need(self.reward_clip >= 0 and self.grad_norm_clip >= 0, "--reward-clip and --grad-norm-clip must be >= 0")
        need(self.max_abs_value > 0, f"--max-abs-value must be > 0, got {self.max_abs_value}")
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
        return self.queue_size or self.batch_size

    @property
    def checkpoint_path(self) -> str:
        return os.path.join(self.logdir, "checkpoint.pt")


def _value_type(hint: Any) -> Any:
    """``float`` for ``float`` and ``Optional[float]`` (an unset optional flag is None)."""
    if get_origin(hint) is Union:
        args = [a for a in get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """One ``--flag`` per dataclass field, with the field's help and default (the parser's
    ``ArgumentDefaultsHelpFormatter`` prints the default once)."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        typ = _value_type(hints[f.name])
        help_text = f.metadata.get("help", "")
        if typ is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            parser.add_argument(flag, type=typ, default=f.default, help=help_text)


def from_arguments(cls: type, args: argparse.Namespace, **extra: Any) -> Any:
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    kwargs.update(extra)
    return cls(**kwargs)


def load_preset(path: str, cls: type) -> dict[str, Any]:
    """Read a preset file: a YAML mapping from option names to values.

    Keys are the long flags without dashes (``learning_rate`` or ``learning-rate``). An
    unknown key or a value of the wrong type is a :class:`ConfigError` naming the file and
    the key. The values become the parser's defaults, so explicit flags still override them.
    """
    import difflib

    import yaml

    try:
        with open(path) as fh:
            doc = yaml.safe_load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option: value, got {type(doc).__name__}")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = {}
    for key, value in doc.items():
        name = str(key).replace("-", "_")
        if name not in names:
            close = difflib.get_close_matches(name, names, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"--config {path}: unknown option {key!r}{hint}")
        typ = _value_type(hints[name])
        if typ is float and isinstance(value, str):
            # PyYAML (YAML 1.1) reads 1e-3 (no dot) as a string; take it as the number it reads as.
            try:
                value = float(value)
            except ValueError:
                pass
        ok = (
            _value_type(hints[name]) is not hints[name] if value is None  # null for an optional field: unset
            else isinstance(value, bool) if typ is bool
            else isinstance(value, int) and not isinstance(value, bool) if typ is int
            else isinstance(value, (int, float)) and not isinstance(value, bool) if typ is float
            else isinstance(value, str)
        )
        if not ok:
            raise ConfigError(f"--config {path}: {key} must be {typ.__name__}, got {value!r}")
        values[name] = float(value) if typ is float and value is not None else value
    return values
