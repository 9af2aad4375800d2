"""``launch_ppo``: PPO with ML-Agents or SB3 semantics, N actor processes, one learner.

Examples::

    launch_ppo --unity-build ~/builds/Crawler.x86_64 --workers 4           # Crawler, configs/Crawler.yaml
    launch_ppo --workers 2                                                # Crawler job on the Ant-v5 stand-in
    launch_ppo --env Pendulum-v1 --semantics sb3 --workers 0 --total-steps 200000

The topology (actors -> ZeroMQ -> learner -> parameter broadcast), metrics,
checkpoints, ``--resume``, Ctrl-C and actor supervision all live in
:func:`learner.runtime.run`; this module adds the PPO trainer and the CLI.

Trajectory cutting vs ML-Agents
-------------------------------
ML-Agents cuts each agent's trajectory at ``time_horizon`` steps from the
trajectory's start (or at an episode end) and bootstraps the cut with
``V(next_obs)``. Here every actor sends fixed ``T``-step unrolls per env
(``T = --unroll-length``, by default ``min(time_horizon, 1000)``); an unroll is
one :class:`TrajectoryPiece` and the learner bootstraps its last step with
``V(obs[T])`` unless the episode ended there, exactly as ML-Agents does at
``time_horizon``. Episode ends inside an unroll split it into segments (GAE per
segment: ``value_next = 0`` on termination, ``V(final_obs)`` on
truncation/``interrupted``). The only difference is where the cuts fall: ours
are aligned to the unroll grid (every T steps of env time, not T steps after
each episode start), so with T = time_horizon an episode gets at most one more
cut than under ML-Agents. With ``time_horizon`` >= episode length (Crawler:
1000 vs max_step 1000 decisions) ML-Agents almost never cuts mid-episode and
we cut at T = 1000 env steps, i.e. once per episode at most.

Update trigger and the buffer
-----------------------------
ML-Agents (``update_trigger=over_buffer_size``) updates once the buffer holds
*more* than ``buffer_size`` steps, whatever the piece sizes. SB3
(``buffer_full``) updates at ``buffer_size = n_steps * n_envs``: with T
dividing ``buffer_size`` a buffer fills exactly (``buffer_size / T`` unrolls);
when it does not divide it, T is lowered to the largest divisor of
``buffer_size`` not above it (logged), so no update ever holds a partial
rounding. Set ``--buffer-size = T * workers * envs_per_worker`` to get SB3's
exact "one n_steps rollout of every env per update".

On-policy
---------
``--max-policy-lag 0`` (default): an unroll that was collected with weights
older than the learner's current ones is dropped (``transport/dropped_stale``),
so every update trains on data of the policy it updates, as both libraries do.
Because the learner re-computes values at ingest time (``gae_form='mlagents'``,
and for ``'sb3'`` since the schema carries no values), lag 0 also makes
``values`` equal the action-time values.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from impala.params import state_dict_arrays
from actors.ppo_agent import PPOAgent, flat_obs_dim
from impala import wire
from impala.envs import EnvSpec, UnknownEnvError, make_env
from impala.envs.fingerprint import EnvFingerprint, measure_fingerprint
from impala.envs.unity import UnityEnvError
from impala.checkpoint import CheckpointError, check_logdir
from impala.ppo_config import ConfigError, PPOConfig, config_from_args, config_to_argparse
from impala.trajectory import ppo_unroll_schema
from learner.ppo_learner import PPOLearner, TrajectoryPiece
from learner.runtime import FingerprintMismatchError, RunResult, RunSettings, run
from learner.server import PortInUseError
from learner.vtrace_learner import resolve_device

log = logging.getLogger("launch_ppo")

CRAWLER_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "Crawler.yaml"
STAND_IN_ENV = "Ant-v5"
MAX_UNROLL = 1000  # longer unrolls only delay the learner; ML-Agents' Crawler time_horizon is 1000
UNITY_BASE_PORT = 5005  # mlagents-envs' UnityEnvironment.BASE_ENVIRONMENT_PORT

# PPOLearner.update() key -> logged key (CleanRL's grouping).
METRIC_KEYS = {
    "policy_loss": "losses/policy_loss",
    "value_loss": "losses/value_loss",
    "entropy": "losses/entropy",
    "loss": "losses/total",
    "approx_kl": "losses/approx_kl",
    "clip_fraction": "losses/clip_fraction",
    "explained_variance": "losses/explained_variance",
    "grad_norm": "losses/grad_norm",
    "learning_rate": "charts/learning_rate",
    "epsilon": "charts/epsilon",
    "beta": "charts/beta",
    "log_sigma_mean": "charts/log_sigma_mean",
    "buffer_steps": "charts/buffer_steps",
    "n_minibatches": "charts/n_minibatches",
    "early_stop": "charts/early_stop",
    "total_steps": "charts/agent_steps_trained",
    "update_count": "charts/updates",
}


class LaunchError(RuntimeError):
    """Bad input the user can fix (a build, an env, a checkpoint); the message says how."""


# --------------------------------------------------------------------------- trainer


def piece_from_unroll(arrays: Mapping[str, np.ndarray], source: Any = 0) -> TrajectoryPiece:
    """One ``ppo_unroll_schema`` unroll -> a TrajectoryPiece.

    ``next_obs[t]`` is ``final_obs[t]`` where the episode ended at t (terminated or
    truncated) and ``obs[t + 1]`` otherwise; the last row bootstraps the cut.
    """
    obs = arrays["obs"]
    ended = arrays["terminated"] | arrays["truncated"]
    next_obs = np.where(ended[:, None], arrays["final_obs"], obs[1:])
    return TrajectoryPiece(
        obs=obs[:-1],
        actions=arrays["actions"],
        log_probs=arrays["log_probs"],
        rewards=arrays["rewards"],
        terminated=arrays["terminated"],
        truncated=arrays["truncated"],
        next_obs=next_obs,
        values=None,
        source=source,
    )


def _to_torch(x: Any) -> Any:
    """Numpy -> tensors (recursively): checkpoints load with ``weights_only=True``, which refuses numpy arrays."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.array(x))
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, dict):
        return {k: _to_torch(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_to_torch(v) for v in x]
    return x


class PPOTrainer:
    """The runtime's Trainer for PPO: unrolls -> TrajectoryPieces -> PPOLearner."""

    def __init__(
        self,
        config: PPOConfig,
        obs_dim: int,
        action_dim: int,
        action_low: np.ndarray,
        action_high: np.ndarray,
        unroll_length: int,
        device: str | torch.device = "cpu",
        *,
        unrolls_per_update: int = 0,
        params_wait_s: float = 0.0,
        max_abs_value: float = 1e6,
    ) -> None:
        self.config = config
        self.learner = PPOLearner(config, obs_dim, action_dim, action_low, action_high, device)
        self.schema = ppo_unroll_schema(unroll_length, obs_dim, action_dim)
        self.agent_settings = PPOAgent.settings(
            config, obs_dim, action_dim, action_low, action_high, unrolls_per_update=unrolls_per_update, params_wait_s=params_wait_s
        )
        self.frames_per_step = 1.0  # total_frames counts agent steps
        self.max_abs_value = max_abs_value

    def validate(self, arrays: Mapping[str, np.ndarray]) -> str | None:
        """Finite but huge floats (a peer's, or a diverging env's) are dropped on receipt."""
        return wire.check_bounded(arrays, self.max_abs_value)

    def ingest(self, msg: wire.Message, version: int) -> bool:
        """False when the unroll held NaN/inf: counted (``transport/rejected_nan``), never trained on."""
        # (actor, env index) keys SB3's per-env discounted return (reward normalization, #12).
        env = msg.info.get("env", 0)
        source = (msg.actor, env if isinstance(env, int) else 0)
        return self.learner.ingest(piece_from_unroll(msg.arrays, source))

    @property
    def rejected_nan(self) -> int:
        return self.learner.rejected_batches

    def ready(self) -> bool:
        return self.learner.ready()

    def update(self, frames_done: int) -> dict[str, float]:
        raw = self.learner.update()
        out = {METRIC_KEYS.get(k, f"charts/{k}"): float(v) for k, v in raw.items() if k != "rejected_batches"}
        out["transport/rejected_nan"] = float(self.rejected_nan)
        return out

    def params(self) -> dict[str, np.ndarray]:
        # Weights, log-sigma and the normalizer buffers: actors act with exactly these statistics.
        return state_dict_arrays(self.learner.policy)

    def state_dict(self) -> dict[str, Any]:
        return _to_torch(self.learner.state_dict())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = dict(state.get("policy", {}))
        mine = self.learner.policy.state_dict()
        for name, tensor in mine.items():
            if name not in saved or tuple(saved[name].shape) != tuple(tensor.shape):
                got = "missing" if name not in saved else tuple(saved[name].shape)
                raise LaunchError(
                    f"the checkpoint's network differs from this run's ({name}: checkpoint {got}, now {tuple(tensor.shape)}); "
                    "resume with the same env and network options, or use a new --logdir"
                )
        self.learner.load_state_dict(dict(state))


# --------------------------------------------------------------------------- env probing


@dataclasses.dataclass(frozen=True)
class EnvInfo:
    spec: EnvSpec
    obs_dim: int
    action_dim: int
    action_low: np.ndarray
    action_high: np.ndarray
    envs_per_worker: int  # Unity: agents per instance (the build decides)
    fingerprint: EnvFingerprint | None
    description: str


def probe_unity(build: str, *, worker_id: int, base_port: int, timeout: int, behavior: str | None, seed: int) -> EnvInfo:
    """Start the build once here (an unused worker_id), read its spec, close it.

    Fails fast, in this process, with UnityVecEnv's message (it names the path and the port).
    """
    from impala.envs.unity import UnityVecEnv

    with UnityVecEnv(build, worker_id=worker_id, base_port=base_port, seed=seed, timeout_wait=timeout, behavior_name=behavior) as env:
        obs_dim, action_dim, k, name = env.obs_dim, env.action_dim, env.num_envs, env.behavior_name
        specs = env.obs_specs
    kwargs = {"file_name": build, "base_port": base_port, "timeout_wait": timeout, "behavior_name": name}
    ones = np.ones(action_dim, np.float32)
    return EnvInfo(
        EnvSpec("unity:" + Path(build).name, kwargs=kwargs), obs_dim, action_dim, -ones, ones, k, None,
        f"Unity build {build!r}: behavior {name!r}, {k} agents per instance, obs {specs} -> {obs_dim}, "
        f"{action_dim} continuous actions in [-1, 1]",
    )


def probe_gym(env_id: str, *, envs_per_worker: int, seed: int) -> EnvInfo:
    """Build one env here: check it is PPO-shaped (Box obs and actions) and take its fingerprint."""
    import gymnasium as gym

    spec = EnvSpec(env_id)
    try:
        env = make_env(spec, seed=seed)
    except gym.error.DependencyNotInstalled as e:
        extra = " (pip install -e '.[mujoco]')" if "mujoco" in str(e).lower() else ""
        raise LaunchError(f"{env_id} cannot be built: {e}{extra}") from None
    try:
        fp = measure_fingerprint(env, seed=seed)
        obs_space, act_space = env.observation_space, env.action_space
    finally:
        env.close()
    if not isinstance(act_space, gym.spaces.Box):
        raise LaunchError(f"{env_id} has a {type(act_space).__name__} action space; launch_ppo needs continuous (Box) actions (try launch_impala)")
    if not isinstance(obs_space, gym.spaces.Box):
        raise LaunchError(f"{env_id} has a {type(obs_space).__name__} observation space; launch_ppo needs a Box (vector) observation")
    if len(obs_space.shape) >= 3:
        raise LaunchError(f"{env_id} has image observations {obs_space.shape}; launch_ppo supports vector observations only")
    low = np.broadcast_to(act_space.low, act_space.shape).reshape(-1).astype(np.float32)
    high = np.broadcast_to(act_space.high, act_space.shape).reshape(-1).astype(np.float32)
    obs_dim, action_dim = flat_obs_dim(obs_space.shape), int(np.prod(act_space.shape))
    return EnvInfo(
        spec, obs_dim, action_dim, low, high, envs_per_worker, fp,
        f"{env_id}: obs {obs_space.shape} {obs_space.dtype} -> {obs_dim} float32, {action_dim} actions in "
        f"[{low.min():g}, {high.max():g}], episode limit {fp.max_episode_steps}",
    )


def choose_unroll_length(config: PPOConfig, requested: int) -> tuple[int, str | None]:
    """T = requested, or min(time_horizon, MAX_UNROLL); for SB3's buffer_full, a divisor of buffer_size."""
    T = requested or min(config.time_horizon, MAX_UNROLL)
    if config.update_trigger != "buffer_full" or config.buffer_size % T == 0:
        return T, None
    divisor = max(d for d in range(1, T + 1) if config.buffer_size % d == 0)
    note = (
        f"unroll length {T} does not divide buffer_size {config.buffer_size} (update_trigger=buffer_full); "
        f"using {divisor} so that every update holds exactly buffer_size steps"
    )
    return divisor, note


def unrolls_per_update(config: PPOConfig, unroll_length: int, n_envs: int) -> int:
    """Rounds of unrolls (one per env of every actor) that fill one update's buffer."""
    needed = config.buffer_size + (1 if config.update_trigger == "over_buffer_size" else 0)
    return math.ceil(needed / (unroll_length * n_envs))


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="launch_ppo",
        description=(
            "Train PPO (ML-Agents or SB3 semantics, docs/PPO_SEMANTICS.md) with N actor processes streaming unrolls "
            "over ZeroMQ to one learner. Default job: Unity Crawler with configs/Crawler.yaml (--unity-build); without "
            "a build it runs on gymnasium Ant-v5 as a stand-in. Metrics: console, LOGDIR/metrics.csv, TensorBoard; "
            "checkpoints: LOGDIR/checkpoint.pt (atomic). Ctrl-C stops cleanly with a final checkpoint."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    r = parser.add_argument_group("run")
    r.add_argument("--unity-build", default=None, help="Path of a Unity build (e.g. Crawler.x86_64); one instance per worker.")
    r.add_argument("--env", default=None, help=f"A gymnasium id (Pendulum-v1, Ant-v5, ...) instead of a Unity build. Neither: the Crawler job on the {STAND_IN_ENV} stand-in.")
    r.add_argument("--mlagents-config", dest="ppo__trainer_config", default=None, metavar="FILE.yaml",
                   help=f"ML-Agents trainer YAML (same as --trainer-config). Default for the Crawler job: {CRAWLER_CONFIG.relative_to(CRAWLER_CONFIG.parents[1])}; none for --env.")
    r.add_argument("--workers", type=int, default=2, help="Actor processes (Unity: one instance each, worker_id = actor index). 0 = single-process mode: one actor as a thread of the learner process.")
    r.add_argument("--envs-per-worker", type=int, default=8, help="Gym envs per actor, stepped with one batched forward pass (Unity: the build's agent count).")
    r.add_argument("--unroll-length", type=int, default=0, help=f"Steps per env per unroll message; 0 = min(time_horizon, {MAX_UNROLL}) (a divisor of buffer_size for SB3's buffer_full).")
    r.add_argument("--total-steps", type=int, default=None, help="Agent steps to train to (absolute, also with --resume); default: the config's max_steps.")
    r.add_argument("--max-policy-lag", type=int, default=0, help="Drop unrolls collected with weights more than this many updates old; 0 = strictly on-policy.")
    r.add_argument("--max-abs-value", type=float, default=1e6, help="Unrolls holding a float (observation, action, log-prob, reward) above this in absolute value are dropped on receipt (transport/dropped_schema).")
    r.add_argument("--params-wait", type=float, default=60.0, help="On-policy (lag 0): seconds an actor that sent its share of an update waits for the new weights before collecting more with the old ones.")
    r.add_argument("--torch-threads", type=int, default=0, help="Learner CPU threads; 0 = all cores when on-policy (--max-policy-lag 0: actors wait during updates), else CPU count minus --workers.")
    r.add_argument("--device", default="auto", help="Learner device: auto, cpu, cuda, cuda:N.")
    r.add_argument("--logdir", default="runs/ppo", help="Metrics and checkpoint directory.")
    r.add_argument("--resume", action="store_true", help="Continue from LOGDIR/checkpoint.pt (its step count, weights, optimizer, normalizers).")
    r.add_argument("--port", type=int, default=0, help="Learner trajectory port (params on port+1); 0 picks free ports.")
    r.add_argument("--bind", default="127.0.0.1", help="Address the learner binds. Anything but loopback needs --curve (or --insecure-bind).")
    r.add_argument("--curve", default="", help="Directory of ZeroMQ CURVE keys (created if missing): only actors whose public key is in DIR/authorized/ may connect (impala-actors --curve); traffic is encrypted.")
    r.add_argument("--insecure-bind", action="store_true", help="Allow a non-loopback --bind without --curve (only on a network you trust).")
    r.add_argument("--start-method", default="spawn", choices=["spawn", "forkserver", "fork"], help="Multiprocessing start method for actors.")
    r.add_argument("--unity-timeout", type=int, default=60, help="Seconds to wait for a Unity instance to connect.")
    r.add_argument("--unity-base-port", type=int, default=UNITY_BASE_PORT, help="Unity gRPC port of worker 0; worker i uses base + i.")
    r.add_argument("--unity-behavior", default=None, help="Unity behavior name (needed only if the build has several).")
    r.add_argument("--max-seconds", type=float, default=0.0, help="Stop after this many seconds (0 = no limit).")
    r.add_argument("--checkpoint-minutes", type=float, default=10.0, help="Minutes between checkpoints (one is always written at exit).")
    r.add_argument("--log-interval", type=float, default=5.0, help="Seconds between console/CSV/TensorBoard rows.")
    r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="Live console table when stdout is a terminal.")
    r.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], help="Python logging level.")
    config_to_argparse(parser)
    return parser


def check_run_values(args: argparse.Namespace) -> None:
    """Process-level values that would crash later or silently do nothing; one message each."""
    for flag in ("max_seconds", "checkpoint_minutes", "log_interval", "params_wait", "max_abs_value"):
        value = getattr(args, flag)
        if not math.isfinite(value):
            raise LaunchError(f"--{flag.replace('_', '-')} must be a finite number, got {value}")
    if args.max_seconds < 0:
        raise LaunchError(f"--max-seconds must be >= 0 (0 means no limit), got {args.max_seconds}")
    if args.checkpoint_minutes <= 0:
        raise LaunchError(f"--checkpoint-minutes must be > 0, got {args.checkpoint_minutes}")
    if args.log_interval < 0 or args.params_wait < 0:
        raise LaunchError("--log-interval (0: every update) and --params-wait must be >= 0")
    if args.max_abs_value <= 0:
        raise LaunchError(f"--max-abs-value must be > 0, got {args.max_abs_value}")
    if args.torch_threads < 0:
        raise LaunchError(f"--torch-threads must be >= 0 (0 picks), got {args.torch_threads}")
    if not (args.port == 0 or 1 <= args.port <= 65534):
        raise LaunchError(f"--port must be 0 or in 1..65534 (params use port+1), got {args.port}")
    if args.total_steps is not None and args.total_steps <= 0:
        raise LaunchError(f"--total-steps must be > 0, got {args.total_steps}")
    if args.unity_timeout <= 0 or not 1 <= args.unity_base_port <= 65535:
        raise LaunchError("--unity-timeout must be > 0 and --unity-base-port in 1..65535")


def load_config(args: argparse.Namespace, crawler_job: bool) -> PPOConfig:
    if crawler_job and not args.ppo__trainer_config:
        args.ppo__trainer_config = str(CRAWLER_CONFIG)
    return config_from_args(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.unity_build and args.env:
            raise LaunchError("pass either --unity-build or --env, not both")
        if args.workers < 0:
            raise LaunchError(f"--workers must be >= 0, got {args.workers}")
        if args.envs_per_worker < 1:
            raise LaunchError(f"--envs-per-worker must be >= 1, got {args.envs_per_worker}")
        if args.unroll_length < 0 or args.max_policy_lag < 0:
            raise LaunchError("--unroll-length and --max-policy-lag must be >= 0")
        check_run_values(args)
        check_logdir(args.logdir)
        crawler_job = args.env is None
        config = load_config(args, crawler_job)
        T, note = choose_unroll_length(config, args.unroll_length)
        if note:
            log.warning(note)
        in_process = args.workers == 0
        workers = max(args.workers, 1)
        if args.unity_build:
            info = probe_unity(args.unity_build, worker_id=workers, base_port=args.unity_base_port,
                               timeout=args.unity_timeout, behavior=args.unity_behavior, seed=config.seed)
        else:
            if crawler_job:
                print(
                    f"launch_ppo: no --unity-build given: running the Crawler job (configs/Crawler.yaml) on gymnasium "
                    f"{STAND_IN_ENV} (MuJoCo) as a STAND-IN for Unity Crawler; pass --unity-build PATH to train on Crawler.",
                    flush=True,
                )
            info = probe_gym(args.env or STAND_IN_ENV, envs_per_worker=args.envs_per_worker, seed=config.seed)
        device = resolve_device(args.device)
        if device.type == "cpu":
            # On-policy (lag 0) actors wait for the new weights during an update, so the learner may use every
            # core then. With lag > 0 they keep stepping: leave them their cores, since oversubscribing a small
            # CPU box made tiny-minibatch updates ~8x slower than one thread on a loaded 2-core machine.
            cores = os.cpu_count() or 1
            torch.set_num_threads(args.torch_threads or (cores if args.max_policy_lag == 0 else max(1, cores - args.workers)))
        n_envs = workers * info.envs_per_worker
        per_actor = unrolls_per_update(config, T, n_envs)
        trainer = PPOTrainer(config, info.obs_dim, info.action_dim, info.action_low, info.action_high, T, device,
                             unrolls_per_update=per_actor if args.max_policy_lag == 0 else 0, params_wait_s=args.params_wait,
                             max_abs_value=args.max_abs_value)
        total_steps = args.total_steps if args.total_steps is not None else config.max_steps
        log.info("%s", info.description)
        log.info(
            "PPO %s semantics (%s): buffer %d, batch %d, %d epochs, %dx%d %s, unroll T=%d over %d envs (%d per round of unrolls), "
            "update trigger %s, learner on %s, %d agent steps",
            args.ppo__semantics, args.ppo__trainer_config or "preset", config.buffer_size, config.batch_size, config.num_epoch,
            config.num_layers, config.hidden_units, config.activation, T, n_envs, T * n_envs, config.update_trigger,
            device, total_steps,
        )
        if config.update_trigger == "buffer_full" and config.buffer_size != T * n_envs:
            log.info("buffer_full: an update holds %d unrolls of %d steps (SB3's n_steps*n_envs would be %d*%d = %d)",
                     config.buffer_size // T, T, T, n_envs, T * n_envs)
        settings = RunSettings(
            env=info.spec,
            workers=workers,
            envs_per_worker=info.envs_per_worker,
            unroll_length=T,
            total_frames=total_steps,
            logdir=args.logdir,
            seed=config.seed,
            bind=args.bind,
            port=args.port,
            start_method=args.start_method,
            queue_size=max(16, 2 * n_envs),
            checkpoint_minutes=args.checkpoint_minutes,
            resume=args.resume,
            progress=args.progress,
            log_interval=args.log_interval,
            max_seconds=args.max_seconds,
            max_policy_lag=args.max_policy_lag,
            title=f"ppo/{args.ppo__semantics} {info.spec.id}",
            config_record={"ppo": dataclasses.asdict(config), "launch": {k: v for k, v in vars(args).items() if not k.startswith("ppo__")},
                           "unroll_length": T, "env": info.spec.id},
            reference_fingerprint=info.fingerprint,
            hello_timeout=max(180.0, args.unity_timeout + 120.0),
            in_process=in_process,
            curve_dir=args.curve or None,
            insecure_bind=args.insecure_bind,
        )
        result: RunResult = run(trainer, settings)
    except (ConfigError, CheckpointError, LaunchError, UnityEnvError, UnknownEnvError, PortInUseError, FingerprintMismatchError, FileNotFoundError, TimeoutError) as e:
        print(f"launch_ppo: error: {e}", file=sys.stderr)
        return 2
    mean = "n/a" if result.mean_return is None else f"{result.mean_return:.2f}"
    print(
        f"launch_ppo: done: {result.env_frames} agent steps, {result.updates} updates, mean return (last 100) {mean}, "
        f"rejected NaN unrolls {trainer.rejected_nan}, dropped {result.dropped or 0}, actor restarts {result.restarts}, "
        f"checkpoint {result.checkpoint}" + (" (interrupted)" if result.interrupted else ""),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
