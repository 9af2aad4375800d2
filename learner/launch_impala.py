"""``launch_impala``: IMPALA (V-trace + PopArt) with N actor processes on this machine.

Example::

    launch_impala --workers 16 --env PongDeterministic-v4
    launch_impala --workers 2 --env CartPole-v1 --total-frames 300000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Any, Mapping

import numpy as np
import torch

from impala.params import state_dict_arrays
from impala import wire
from impala.checkpoint import CheckpointError, check_logdir
from impala.config import ConfigError, ImpalaConfig, add_arguments, from_arguments, load_preset
from impala.envs import EnvSpec, UnknownEnvError, make_env
from impala.envs.fingerprint import EnvFingerprint, check_against_config, configured_settings, measure_fingerprint
from impala.models import build_model
from impala.trajectory import impala_unroll_schema
from learner.runtime import FingerprintMismatchError, RunResult, RunSettings, run
from learner.server import PortInUseError
from learner.vtrace_learner import VTraceLearner, resolve_device

log = logging.getLogger("launch_impala")


class ImpalaTrainer:
    """Collects B unrolls, stacks them time-major and runs one V-trace update."""

    def __init__(self, config: ImpalaConfig, obs_shape: tuple[int, ...], obs_dtype: str, num_actions: int, frames_per_step: float) -> None:
        self.config = config
        try:
            model = build_model(config.model, obs_shape, num_actions, use_lstm=config.use_lstm, init=config.init, beta=config.popart_beta)
        except ValueError as e:  # the model kind does not fit this env's observations
            raise ConfigError(f"--model {config.model}: {e}") from None
        self.learner = VTraceLearner(model, config, resolve_device(config.device))
        core = model.core.hidden_size if config.use_lstm else 0
        self.schema = impala_unroll_schema(config.unroll_length, obs_shape, obs_dtype, num_actions, core)
        self.agent_settings = {"kind": "impala", "model": config.model, "use_lstm": config.use_lstm, "popart_beta": config.popart_beta}
        self.frames_per_step = frames_per_step
        self._pending: list[Mapping[str, np.ndarray]] = []
        self._sources: list[int] = []  # actor id of each pending unroll, to name them if a batch is bad

    def ingest(self, msg: wire.Message, version: int) -> None:
        self._pending.append(msg.arrays)
        self._sources.append(msg.actor)

    def ready(self) -> bool:
        return len(self._pending) >= self.config.batch_size

    def update(self, frames_done: int) -> dict[str, float]:
        B = self.config.batch_size
        batch = self.learner.stage(self._pending[:B], self.schema)
        sources = sorted(set(self._sources[:B]))
        del self._pending[:B], self._sources[:B]
        skipped_before = self.learner.skipped_updates
        metrics = self.learner.train(batch, frames_done=frames_done)
        if self.learner.skipped_updates > skipped_before:
            log.warning("skipped %d update step(s) with a non-finite loss or gradient; the batch came from actors %s",
                        self.learner.skipped_updates - skipped_before, sources)
        return metrics

    def params(self) -> dict[str, np.ndarray]:
        return state_dict_arrays(self.learner.model)

    def validate(self, arrays: Mapping[str, np.ndarray]) -> str | None:
        """Values the schema cannot express: actions must index the policy's logits, and float
        arrays stay within --max-abs-value (uint8 frames are bounded by their dtype)."""
        actions = arrays["actions"]
        n = arrays["behaviour_logits"].shape[-1]
        if actions.size and (actions.min() < 0 or actions.max() >= n):
            return f"actions outside [0, {n})"
        return wire.check_bounded(arrays, self.config.max_abs_value, ("obs", "behaviour_logits", "rewards"))

    def state_dict(self) -> dict[str, Any]:
        return self.learner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.learner.load_state_dict(state)


def probe_env(spec: EnvSpec, seed: int) -> tuple[EnvFingerprint, tuple[int, ...], str, int]:
    """Build one env here, in the learner, and measure what it does."""
    try:
        env = make_env(spec, seed=seed)
    except TypeError as e:
        if not spec.kwargs:
            raise
        # gymnasium's message for a constructor argument the env does not take
        raise ConfigError(f"--env-kwargs {json.dumps(spec.kwargs)}: {spec.id} does not accept them ({e})") from None
    try:
        fp = measure_fingerprint(env, seed=seed)
        num_actions = int(getattr(env.action_space, "n", 0))
        if num_actions < 1:
            raise ConfigError(f"{spec.id} has a {type(env.action_space).__name__} action space; IMPALA here needs discrete actions (try launch_ppo)")
    finally:
        env.close()
    problems = check_against_config(fp, configured_settings(spec.id, spec.kwargs))
    if problems:
        raise FingerprintMismatchError("the learner's own env differs from its configuration: " + "; ".join(map(str, problems)))
    return fp, fp.obs_shape, fp.obs_dtype, num_actions


def frames_per_agent_step(fp: EnvFingerprint) -> float:
    if fp.frameskip_min is None:
        return 1.0
    return (fp.frameskip_min + fp.frameskip_max) / 2.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launch_impala",
        description=(
            "Train IMPALA (V-trace, optional PopArt) with N actor processes streaming over ZeroMQ to one learner "
            "(GPU when available). Metrics go to the console, LOGDIR/metrics.csv and TensorBoard; checkpoints to "
            "LOGDIR/checkpoint.pt (atomic). Ctrl-C stops cleanly with a final checkpoint."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--config", metavar="FILE", default=None,
        help="Preset file (YAML, option: value) applied before the flags, e.g. configs/impala_paper_atari.yaml; "
        "flags given on the command line override it.",
    )
    add_arguments(parser, ImpalaConfig)
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], help="Python logging level.")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Defaults < ``--config`` preset < explicit flags."""
    parser = build_parser()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config:
        parser.set_defaults(**load_preset(known.config, ImpalaConfig))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ConfigError as e:
        print(f"launch_impala: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = from_arguments(ImpalaConfig, args)
        # Each actor is single-threaded; a learner with as many threads as cores would make the
        # OS time-slice them against each other (several times slower on a small machine).
        torch.set_num_threads(config.torch_threads or max(1, (os.cpu_count() or 1) - config.workers))
        torch.manual_seed(config.seed)  # the network's initialization is part of the run's seed
        check_logdir(config.logdir)
        spec = EnvSpec(config.env, config.env_overrides)
        fp, obs_shape, obs_dtype, num_actions = probe_env(spec, config.seed)
        trainer = ImpalaTrainer(config, obs_shape, obs_dtype, num_actions, frames_per_agent_step(fp))
        settings = RunSettings(
            env=spec,
            workers=config.workers,
            envs_per_worker=config.envs_per_worker,
            unroll_length=config.unroll_length,
            total_frames=config.total_frames,
            logdir=config.logdir,
            seed=config.seed,
            bind=config.bind,
            port=config.port,
            start_method=config.start_method,
            queue_size=config.effective_queue_size,
            checkpoint_minutes=config.checkpoint_minutes,
            resume=config.resume,
            progress=config.progress,
            log_interval=config.log_interval,
            max_seconds=config.max_seconds,
            stop_at_return=config.stop_at_return,
            max_policy_lag=config.max_policy_lag,
            title=f"impala {config.env}",
            config_record={**dataclasses.asdict(config), "preset": args.config or ""},
            reference_fingerprint=fp,
            spawn_actors=config.workers > 0,
            curve_dir=config.curve or None,
            insecure_bind=config.insecure_bind,
        )
        log.info("env %s: obs %s %s, %d actions, frameskip %s, sticky %s; learner on %s", spec.id, obs_shape, obs_dtype, num_actions, fp.frameskip_text(), fp.sticky, trainer.learner.device)
        result: RunResult = run(trainer, settings)
    except (ConfigError, CheckpointError, UnknownEnvError, PortInUseError, FingerprintMismatchError, FileNotFoundError, TimeoutError) as e:
        print(f"launch_impala: error: {e}", file=sys.stderr)
        return 2
    mean = "n/a" if result.mean_return is None else f"{result.mean_return:.2f}"
    print(
        f"launch_impala: done: {result.env_frames} env frames, {result.updates} updates, mean return (last 100) {mean}, "
        f"dropped {result.dropped or 0}, actor restarts {result.restarts}, checkpoint {result.checkpoint}"
        + (" (interrupted)" if result.interrupted else "")
        + (f" (stopped at --stop-at-return {config.stop_at_return:g})" if result.reached_return else ""),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
